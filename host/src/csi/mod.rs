//! Every backend is also a CSI driver, `<backend>.csi.volagent.io`: the
//! Identity and Node services on a socket of its own under kubelet's root,
//! and kubelet's plugin-registration service beside it, so kubelet finds
//! the driver without a registrar sidecar. The calls go through the same
//! pipeline as the Flexvolume driver's (see [`crate::ops::csi`]).

mod authority;
pub mod client;
pub mod drivers;
mod identity;
mod node;
pub mod registration;
pub mod request;
pub mod threads;

/// Code generated from `proto/` by the build script.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod proto {
    pub mod csi {
        tonic::include_proto!("csi.v1");
    }
    pub mod registration {
        tonic::include_proto!("pluginregistration");
    }
}

/// The CSI driver name of `backend`.
pub fn driver_name(backend: &str) -> String {
    format!("{backend}.csi.volagent.io")
}

/// The CSI versions the drivers speak, as kubelet's registration asks.
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];

/// Largest message a driver accepts: requests carry ids, paths, a PV's
/// attributes and secrets — kilobytes, not megabytes.
pub const MAX_MESSAGE: usize = 256 << 10;
