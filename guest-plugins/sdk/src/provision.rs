//! Provisioning in plain values (contract 1.1): what a [`Provisioner`] is
//! asked, and the controller plans it answers with. The controller runs
//! them with its own credentials; a policy only decides.

use crate::{AccessMode, KeyValue, VolumeMode};

/// A topology segment: label keys and the values a node must carry.
pub type Segment = Vec<(String, String)>;

/// What a new volume's content is made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentSource {
    /// A snapshot, by the id [`Provisioner::snapshot`] gave it.
    Snapshot(String),
    /// Another volume, by the id [`Provisioner::create`] gave it.
    Volume(String),
}

/// A volume to make.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CreateRequest {
    /// The same name is the same volume.
    pub name: String,
    /// 0: unspecified.
    pub required_bytes: u64,
    /// 0: unlimited.
    pub limit_bytes: u64,
    /// The class's parameters (and its StorageCluster's, with `endpoints`).
    pub parameters: Vec<KeyValue>,
    pub access_modes: Vec<AccessMode>,
    pub mode: VolumeMode,
    pub fs_type: String,
    /// Segments it must be reachable from (any one); empty: anywhere.
    pub requisite: Vec<Segment>,
    /// Segments, most preferred first.
    pub preferred: Vec<Segment>,
    pub source: Option<ContentSource>,
    /// The free discovered volumes of the request's class on the nodes it
    /// may be placed on, smallest first (SDK feature `local-provisioning`;
    /// empty without it).
    pub local_volumes: Vec<LocalVolume>,
}

/// What a discovered local volume is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalKind {
    /// A mounted filesystem, given as it is.
    Filesystem,
    /// A block device.
    Block,
    /// A regular file, attached as a loop device.
    File,
}

/// A discovered local volume that nothing holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalVolume {
    /// `local-<hash>` of its node, class and path.
    pub name: String,
    pub node: String,
    pub kind: LocalKind,
    pub capacity_bytes: u64,
}

/// An existing volume or snapshot, and what a call asks of it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Target {
    pub id: String,
    /// [`Provisioner::snapshot`]: the snapshot's name.
    pub name: String,
    /// [`Provisioner::expand`]: bytes at least (at most; 0 unlimited).
    pub required_bytes: u64,
    pub limit_bytes: u64,
    /// [`Provisioner::snapshot`]: the snapshot class's parameters.
    pub parameters: Vec<KeyValue>,
}

/// Where capacity is asked about.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CapacityRequest {
    pub parameters: Vec<KeyValue>,
    pub segment: Option<Segment>,
    /// As [`CreateRequest::local_volumes`], in the segment.
    pub local_volumes: Vec<LocalVolume>,
}

/// An RBD image on a StorageCluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// The StorageCluster, whose controller user acts.
    pub cluster: String,
    pub pool: String,
    pub image: String,
}

/// A directory of a gluster volume on a StorageCluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectoryRef {
    /// The StorageCluster, whose servers the controller reaches it by.
    pub cluster: String,
    /// The gluster volume.
    pub volume: String,
    /// Relative to the volume's root: names joined by '/'.
    pub path: String,
}

/// A controller step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControllerStep {
    CreateImage {
        image: ImageRef,
        size_bytes: u64,
        data_pool: Option<String>,
        features: Vec<String>,
    },
    DeleteImage(ImageRef),
    ResizeImage {
        image: ImageRef,
        size_bytes: u64,
    },
    CreateSnapshot {
        image: ImageRef,
        snapshot: String,
    },
    DeleteSnapshot {
        image: ImageRef,
        snapshot: String,
    },
    /// `image` (in the parent's cluster and pool) cloned from
    /// `parent@snapshot`, flattened when deeper than `max_depth`.
    CloneImage {
        parent: ImageRef,
        snapshot: String,
        image: String,
        features: Vec<String>,
        max_depth: u32,
    },
    /// The directory and its missing parents, limited to `quota_bytes`
    /// (0: no limit) by the volume's directory quota.
    CreateDirectory {
        dir: DirectoryRef,
        quota_bytes: u64,
    },
    /// The directory and everything in it.
    RemoveDirectory(DirectoryRef),
    /// The directory's quota limit raised to `bytes` (one without a limit
    /// keeps none).
    SetQuota {
        dir: DirectoryRef,
        bytes: u64,
    },
    /// A discovered local volume, by name, taken by the volume being made
    /// (whose id must be that name).
    TakeVolume(String),
    /// A discovered local volume, by name, wiped by its node's agent and
    /// free again.
    ReleaseVolume(String),
}

impl ControllerStep {
    pub fn kind(&self) -> ControllerStepKind {
        match self {
            ControllerStep::CreateImage { .. } => ControllerStepKind::CreateImage,
            ControllerStep::DeleteImage(_) => ControllerStepKind::DeleteImage,
            ControllerStep::ResizeImage { .. } => ControllerStepKind::ResizeImage,
            ControllerStep::CreateSnapshot { .. } => ControllerStepKind::CreateSnapshot,
            ControllerStep::DeleteSnapshot { .. } => ControllerStepKind::DeleteSnapshot,
            ControllerStep::CloneImage { .. } => ControllerStepKind::CloneImage,
            ControllerStep::CreateDirectory { .. } => ControllerStepKind::CreateDirectory,
            ControllerStep::RemoveDirectory(_) => ControllerStepKind::RemoveDirectory,
            ControllerStep::SetQuota { .. } => ControllerStepKind::SetQuota,
            ControllerStep::TakeVolume(_) => ControllerStepKind::TakeVolume,
            ControllerStep::ReleaseVolume(_) => ControllerStepKind::ReleaseVolume,
        }
    }
}

/// Kinds of controller step, as capabilities declare them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ControllerStepKind {
    CreateImage,
    DeleteImage,
    ResizeImage,
    CreateSnapshot,
    DeleteSnapshot,
    CloneImage,
    CreateDirectory,
    RemoveDirectory,
    SetQuota,
    TakeVolume,
    ReleaseVolume,
}

impl ControllerStepKind {
    pub fn name(self) -> &'static str {
        match self {
            ControllerStepKind::CreateImage => "create-image",
            ControllerStepKind::DeleteImage => "delete-image",
            ControllerStepKind::ResizeImage => "resize-image",
            ControllerStepKind::CreateSnapshot => "create-snapshot",
            ControllerStepKind::DeleteSnapshot => "delete-snapshot",
            ControllerStepKind::CloneImage => "clone-image",
            ControllerStepKind::CreateDirectory => "create-directory",
            ControllerStepKind::RemoveDirectory => "remove-directory",
            ControllerStepKind::SetQuota => "set-quota",
            ControllerStepKind::TakeVolume => "take-volume",
            ControllerStepKind::ReleaseVolume => "release-volume",
        }
    }
}

/// A controller plan and what the volume or snapshot is once it ran.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Provision {
    pub steps: Vec<ControllerStep>,
    /// Printable ASCII, at most 128 bytes; the same for the same request.
    pub id: String,
    /// 0: what the steps made.
    pub capacity_bytes: u64,
    /// What the volume's node calls get as options.
    pub attributes: Vec<KeyValue>,
    /// Where it is reachable from; empty: every node.
    pub topology: Vec<Segment>,
}

/// A provisioner's refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProvisionError {
    /// Parameters missing or malformed.
    Invalid(String),
    /// The backend cannot do what is asked.
    Unsupported(String),
    /// The source or volume named does not exist.
    NotFound(String),
    /// No capacity where the request may be placed.
    Exhausted(String),
    /// The size asked for is outside what the backend can make.
    OutOfRange(String),
}

/// A provisioner in plain Rust: controller plans for making, growing,
/// snapshotting and removing volumes. Exported with
/// `export_policy!(Type, provisioner)` by an SDK built with the
/// `provisioner` feature.
pub trait Provisioner {
    /// The controller steps its plans use.
    const CONTROLLER_STEPS: &'static [ControllerStepKind];
    fn create(request: CreateRequest) -> Result<Provision, ProvisionError>;
    fn delete(volume: Target) -> Result<Provision, ProvisionError>;
    fn expand(volume: Target) -> Result<Provision, ProvisionError>;
    fn snapshot(volume: Target) -> Result<Provision, ProvisionError> {
        Err(ProvisionError::Unsupported(format!(
            "volume {}: this backend takes no snapshots",
            volume.id
        )))
    }
    fn delete_snapshot(snapshot: Target) -> Result<Provision, ProvisionError> {
        Err(ProvisionError::Unsupported(format!(
            "snapshot {}: this backend takes no snapshots",
            snapshot.id
        )))
    }
    /// Bytes a new volume could get; none when the backend does not know.
    fn capacity(_request: CapacityRequest) -> Result<Option<u64>, ProvisionError> {
        Ok(None)
    }
}

/// Whether `name` is a DNS label: lowercase letters, digits and '-', 1 to
/// 63, starting and ending with a letter or digit. Ids made of such parts
/// joined by '.' are Kubernetes object names, as nodes name records after
/// volume ids.
pub fn dns_label(name: &str) -> bool {
    let alnum = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    name.len() <= 63
        && alnum(name.as_bytes().first())
        && alnum(name.as_bytes().last())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// [`dns_label`]'s rule, for refusals.
pub const DNS_LABEL_RULE: &str =
    "lowercase letters, digits and '-', 1 to 63, starting and ending with a letter or digit";

/// The value of parameter `key`, if set and not blank (the last one wins).
pub fn parameter<'p>(parameters: &'p [KeyValue], key: &str) -> Option<&'p str> {
    parameters
        .iter()
        .rev()
        .find(|kv| kv.key == key)
        .map(|kv| kv.value.trim())
        .filter(|v| !v.is_empty())
}

/// The value of a required parameter, or an error naming it.
pub fn required_parameter<'p>(
    parameters: &'p [KeyValue],
    key: &str,
) -> Result<&'p str, ProvisionError> {
    parameter(parameters, key)
        .ok_or_else(|| ProvisionError::Invalid(format!("parameter \"{key}\" is required")))
}

/// The size to make for `required`/`limit` bytes (0: unspecified /
/// unlimited), rounded up to `granule`; `default` when nothing is asked.
pub fn size_for(
    required: u64,
    limit: u64,
    granule: u64,
    default: u64,
) -> Result<u64, ProvisionError> {
    let wanted = if required == 0 { default.max(1) } else { required };
    let size = wanted.div_ceil(granule).checked_mul(granule).ok_or_else(|| {
        ProvisionError::OutOfRange(format!("{wanted} bytes is more than this backend can make"))
    })?;
    if limit != 0 && size > limit {
        let floor = (limit / granule) * granule;
        if floor >= required && floor > 0 {
            return Ok(floor);
        }
        return Err(ProvisionError::OutOfRange(format!(
            "{required} to {limit} bytes: this backend makes volumes in steps of {granule} bytes, and none fits"
        )));
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_the_granule_within_the_limit() {
        const MIB: u64 = 1 << 20;
        assert_eq!(size_for(1, 0, MIB, 0), Ok(MIB));
        assert_eq!(size_for(0, 0, MIB, 5 * MIB), Ok(5 * MIB));
        assert_eq!(size_for(3 * MIB + 1, 0, MIB, 0), Ok(4 * MIB));
        assert_eq!(size_for(MIB, 2 * MIB, MIB, 0), Ok(MIB));
        assert_eq!(size_for(MIB + 1, MIB + 10, MIB, 0).unwrap_err(), ProvisionError::OutOfRange("1048577 to 1048586 bytes: this backend makes volumes in steps of 1048576 bytes, and none fits".into()));
        assert!(matches!(size_for(u64::MAX, 0, MIB, 0), Err(ProvisionError::OutOfRange(_))));
    }

    #[test]
    fn dns_labels() {
        for ok in ["a", "pvc-1", "0", &"a".repeat(63)] {
            assert!(dns_label(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", &"a".repeat(64)] {
            assert!(!dns_label(bad), "{bad}");
        }
    }

    #[test]
    fn parameters_are_read_trimmed_and_required_ones_named() {
        let p = vec![KeyValue { key: "pool".into(), value: " rbd ".into() }];
        assert_eq!(parameter(&p, "pool"), Some("rbd"));
        assert_eq!(parameter(&p, "x"), None);
        assert_eq!(
            required_parameter(&p, "x"),
            Err(ProvisionError::Invalid("parameter \"x\" is required".into()))
        );
    }
}
