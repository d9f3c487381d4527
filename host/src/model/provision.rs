//! Provisioning: what a provisioner is asked (make, remove, grow, snapshot
//! a volume) and the controller plans it answers with.

use super::{AccessMode, KeyValue, VolumeMode};
use serde::{Deserialize, Serialize};

/// A topology segment: label keys and the values a node must carry.
pub type Segment = Vec<(String, String)>;

/// What a new volume's content is made from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ContentSource {
    /// A snapshot, by its id.
    Snapshot(String),
    /// Another volume, by its id.
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
    pub parameters: Vec<KeyValue>,
    pub access_modes: Vec<AccessMode>,
    pub mode: VolumeMode,
    pub fs_type: String,
    pub requisite: Vec<Segment>,
    pub preferred: Vec<Segment>,
    pub source: Option<ContentSource>,
    /// For a backend that places volumes on discovered local volumes: the
    /// free ones it may take (filled in by the controller, not the caller;
    /// not part of what makes two requests the same).
    pub local_volumes: Vec<LocalVolume>,
}

/// What a discovered local volume is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LocalKind {
    Filesystem,
    Block,
    File,
}

/// A discovered local volume free to be taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalVolume {
    pub name: String,
    pub node: String,
    pub kind: LocalKind,
    pub capacity_bytes: u64,
}

/// An existing volume or snapshot, and what a call asks of it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Target {
    pub id: String,
    /// The snapshot's name (snapshot calls).
    pub name: String,
    pub required_bytes: u64,
    pub limit_bytes: u64,
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

/// A controller step: what the controller does to the storage, as its own
/// user of the StorageCluster the step names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControllerStep {
    CreateImage(CreateImage),
    DeleteImage(ImageRef),
    ResizeImage(ResizeImage),
    CreateSnapshot(SnapshotRef),
    DeleteSnapshot(SnapshotRef),
    CloneImage(CloneImage),
    CreateDirectory(CreateDirectory),
    RemoveDirectory(DirectoryRef),
    SetQuota(SetQuota),
    /// A discovered local volume, by name, taken by the volume being made.
    TakeLocalVolume(String),
    /// A discovered local volume, by name, wiped and free again.
    ReleaseLocalVolume(String),
}

impl ControllerStep {
    pub fn kind(&self) -> ControllerStepKind {
        match self {
            ControllerStep::CreateImage(_) => ControllerStepKind::CreateImage,
            ControllerStep::DeleteImage(_) => ControllerStepKind::DeleteImage,
            ControllerStep::ResizeImage(_) => ControllerStepKind::ResizeImage,
            ControllerStep::CreateSnapshot(_) => ControllerStepKind::CreateSnapshot,
            ControllerStep::DeleteSnapshot(_) => ControllerStepKind::DeleteSnapshot,
            ControllerStep::CloneImage(_) => ControllerStepKind::CloneImage,
            ControllerStep::CreateDirectory(_) => ControllerStepKind::CreateDirectory,
            ControllerStep::RemoveDirectory(_) => ControllerStepKind::RemoveDirectory,
            ControllerStep::SetQuota(_) => ControllerStepKind::SetQuota,
            ControllerStep::TakeLocalVolume(_) => ControllerStepKind::TakeLocalVolume,
            ControllerStep::ReleaseLocalVolume(_) => ControllerStepKind::ReleaseLocalVolume,
        }
    }

    /// The StorageCluster whose storage the step acts on; none for a
    /// local volume's (nodes' disks, reached through their agents).
    pub fn cluster(&self) -> Option<&str> {
        Some(match self {
            ControllerStep::CreateImage(c) => &c.image.cluster,
            ControllerStep::DeleteImage(i) => &i.cluster,
            ControllerStep::ResizeImage(r) => &r.image.cluster,
            ControllerStep::CreateSnapshot(s) | ControllerStep::DeleteSnapshot(s) => {
                &s.image.cluster
            }
            ControllerStep::CloneImage(c) => &c.parent.image.cluster,
            ControllerStep::CreateDirectory(c) => &c.dir.cluster,
            ControllerStep::RemoveDirectory(d) => &d.cluster,
            ControllerStep::SetQuota(q) => &q.dir.cluster,
            ControllerStep::TakeLocalVolume(_) | ControllerStep::ReleaseLocalVolume(_) => {
                return None;
            }
        })
    }
}

/// An RBD image on a StorageCluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRef {
    pub cluster: String,
    pub pool: String,
    pub image: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateImage {
    pub image: ImageRef,
    pub size_bytes: u64,
    pub data_pool: Option<String>,
    pub features: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResizeImage {
    pub image: ImageRef,
    pub size_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRef {
    pub image: ImageRef,
    pub snapshot: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloneImage {
    /// The parent's snapshot (same cluster and pool as the clone).
    pub parent: SnapshotRef,
    pub image: String,
    pub features: Vec<String>,
    /// Flattened when its chain of parents is deeper than this.
    pub max_depth: u32,
}

/// A directory of a gluster volume on a StorageCluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectoryRef {
    pub cluster: String,
    /// The gluster volume.
    pub volume: String,
    /// Relative to the volume's root.
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateDirectory {
    pub dir: DirectoryRef,
    /// 0: no quota limit.
    pub quota_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetQuota {
    pub dir: DirectoryRef,
    pub bytes: u64,
}

/// Kinds of controller step, as capabilities declare them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
    TakeLocalVolume,
    ReleaseLocalVolume,
}

impl ControllerStepKind {
    pub const ALL: [ControllerStepKind; 11] = [
        ControllerStepKind::CreateImage,
        ControllerStepKind::DeleteImage,
        ControllerStepKind::ResizeImage,
        ControllerStepKind::CreateSnapshot,
        ControllerStepKind::DeleteSnapshot,
        ControllerStepKind::CloneImage,
        ControllerStepKind::CreateDirectory,
        ControllerStepKind::RemoveDirectory,
        ControllerStepKind::SetQuota,
        ControllerStepKind::TakeLocalVolume,
        ControllerStepKind::ReleaseLocalVolume,
    ];

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
            ControllerStepKind::TakeLocalVolume => "take-volume",
            ControllerStepKind::ReleaseLocalVolume => "release-volume",
        }
    }
}

/// A controller plan and what the volume or snapshot is once it ran.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Provision {
    pub steps: Vec<ControllerStep>,
    pub id: String,
    /// 0: what the steps made.
    pub capacity_bytes: u64,
    pub attributes: Vec<KeyValue>,
    pub topology: Vec<Segment>,
}

/// A provisioner's refusal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProvisionError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("no capacity: {0}")]
    Exhausted(String),
    #[error("out of range: {0}")]
    OutOfRange(String),
}
