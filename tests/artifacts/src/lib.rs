//! Paths of the guest components built by this crate's build script.
//! Test-only: the host's tests load these.

include!(concat!(env!("OUT_DIR"), "/guests.rs"));

/// The five real backends, as (name, path).
pub const BACKENDS: &[(&str, &str)] =
    &[("rbd", RBD), ("nbd", NBD), ("local-pv", LOCAL_PV), ("gluster", GLUSTER), ("nfs", NFS)];

/// Every guest that loads, as (the backend its `info` names, path): what
/// the tests' agents trust (`--trusted-policies`).
pub const LOADABLE: &[(&str, &str)] = &[
    ("rbd", RBD),
    ("nbd", NBD),
    ("local-pv", LOCAL_PV),
    ("gluster", GLUSTER),
    ("nfs", NFS),
    ("misbehave", MISBEHAVE),
    ("shared-file", SHARED_FILE),
    ("core-only", CORE_ONLY),
    ("local-pv", LOCAL_PV_STRICT),
];
