//! Plans: the effects the host performs for a policy, step by step, and
//! the capabilities that bound them.

use serde::{Deserialize, Serialize};

/// Kinds of block device a backend attaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceKind {
    Loop,
    Nbd,
    Rbd,
}

impl DeviceKind {
    pub const ALL: [DeviceKind; 3] = [DeviceKind::Loop, DeviceKind::Nbd, DeviceKind::Rbd];

    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Loop => "loop",
            DeviceKind::Nbd => "nbd",
            DeviceKind::Rbd => "rbd",
        }
    }
}

/// Which block device an attach-device / detach-device step concerns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceSpec {
    /// A loop device backed by this regular file.
    Loop(String),
    Nbd(NbdSpec),
    Rbd(RbdSpec),
}

impl DeviceSpec {
    pub fn kind(&self) -> DeviceKind {
        match self {
            DeviceSpec::Loop(_) => DeviceKind::Loop,
            DeviceSpec::Nbd(_) => DeviceKind::Nbd,
            DeviceSpec::Rbd(_) => DeviceKind::Rbd,
        }
    }
}

/// How the host connects this node's block layer to an NBD export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NbdAttach {
    Auto,
    Kernel,
    Userspace,
}

/// An NBD export: a server's, or the agent's own export of a local file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NbdSpec {
    /// "unix:/path/to.sock" or "host:port"; empty with `local_file`.
    pub server: String,
    pub export_name: String,
    pub local_file: Option<String>,
    pub attach: NbdAttach,
    /// Connections the client opens (1 to 16).
    pub connections: u8,
}

/// How the host maps an RBD image on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RbdAttach {
    Auto,
    Kernel,
    Nbd,
    Fuse,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RbdSpec {
    pub monitors: Vec<String>,
    pub pool: String,
    pub image: String,
    /// Ceph user, without the "client." prefix.
    pub user: String,
    /// Key name in the volume's secret holding the user's key.
    pub secret_key: Option<String>,
    pub attach: RbdAttach,
}

/// Where a step takes a block device from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockSource {
    /// The device attached by this plan's attach-device step with that id.
    Attached(String),
    /// An existing block device.
    Device(String),
}

/// When a format step runs mkfs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FormatMode {
    IfUnformatted,
    Always,
}

/// How a released volume's data is destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WipeMethod {
    Signatures,
    Discard,
    Zero,
    /// Overwrite with random data this many times.
    Shred(u32),
}

/// What a mount step mounts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MountSource {
    Block(BlockSource),
    /// A network filesystem source, e.g. "server1:/gv0".
    Network(String),
}

/// One effect the host performs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Step {
    AttachDevice(AttachDevice),
    Format(Format),
    Mount(Mount),
    BindMount(BindMount),
    Unmount(Unmount),
    DetachDevice(DetachDevice),
    Wipe(Wipe),
    ClearDirectory(ClearDirectory),
    BlocklistClient(BlocklistClient),
    PublishBlock(PublishBlock),
    GrowFilesystem(GrowFilesystem),
}

impl Step {
    pub fn kind(&self) -> StepKind {
        match self {
            Step::AttachDevice(_) => StepKind::AttachDevice,
            Step::Format(_) => StepKind::Format,
            Step::Mount(_) => StepKind::Mount,
            Step::BindMount(_) => StepKind::BindMount,
            Step::Unmount(_) => StepKind::Unmount,
            Step::DetachDevice(_) => StepKind::DetachDevice,
            Step::Wipe(_) => StepKind::Wipe,
            Step::BlocklistClient(_) => StepKind::BlocklistClient,
            Step::ClearDirectory(_) => StepKind::ClearDirectory,
            Step::PublishBlock(_) => StepKind::PublishBlock,
            Step::GrowFilesystem(_) => StepKind::GrowFilesystem,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachDevice {
    /// Names the device for later steps (`BlockSource::Attached`).
    pub id: String,
    pub spec: DeviceSpec,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Format {
    pub device: BlockSource,
    pub fs_type: String,
    pub mode: FormatMode,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mount {
    pub source: MountSource,
    pub target: String,
    pub fs_type: String,
    pub options: Vec<String>,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindMount {
    pub source: String,
    pub target: String,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unmount {
    pub target: String,
    pub force: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DetachDevice {
    pub spec: DeviceSpec,
    pub force: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wipe {
    pub device: BlockSource,
    pub method: WipeMethod,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClearDirectory {
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlocklistClient {
    pub monitors: Vec<String>,
    pub user: String,
    pub secret_key: Option<String>,
    pub address: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishBlock {
    pub device: BlockSource,
    pub target: String,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrowFilesystem {
    pub target: String,
}

/// Steps run in order; a failing step rolls back those before it.
pub type Plan = Vec<Step>;

/// Kinds of step, as capabilities declare them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StepKind {
    AttachDevice,
    Format,
    Mount,
    BindMount,
    Unmount,
    DetachDevice,
    Wipe,
    BlocklistClient,
    ClearDirectory,
    PublishBlock,
    GrowFilesystem,
}

impl StepKind {
    pub const ALL: [StepKind; 11] = [
        StepKind::AttachDevice,
        StepKind::Format,
        StepKind::Mount,
        StepKind::BindMount,
        StepKind::Unmount,
        StepKind::DetachDevice,
        StepKind::Wipe,
        StepKind::BlocklistClient,
        StepKind::ClearDirectory,
        StepKind::PublishBlock,
        StepKind::GrowFilesystem,
    ];

    pub fn name(self) -> &'static str {
        match self {
            StepKind::AttachDevice => "attach-device",
            StepKind::Format => "format",
            StepKind::Mount => "mount",
            StepKind::BindMount => "bind-mount",
            StepKind::Unmount => "unmount",
            StepKind::DetachDevice => "detach-device",
            StepKind::Wipe => "wipe",
            StepKind::BlocklistClient => "blocklist-client",
            StepKind::ClearDirectory => "clear-directory",
            StepKind::PublishBlock => "publish-block",
            StepKind::GrowFilesystem => "grow-filesystem",
        }
    }
}

/// Path roots a backend may use in its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PathRoot {
    PodMountDir,
    StagingDir,
    StateDir,
    DiscoveryDirs,
}

impl PathRoot {
    pub const ALL: [PathRoot; 4] =
        [PathRoot::PodMountDir, PathRoot::StagingDir, PathRoot::StateDir, PathRoot::DiscoveryDirs];

    pub fn name(self) -> &'static str {
        match self {
            PathRoot::PodMountDir => "pod-mount-dir",
            PathRoot::StagingDir => "staging-dir",
            PathRoot::StateDir => "state-dir",
            PathRoot::DiscoveryDirs => "discovery-dirs",
        }
    }
}

/// Everything a backend's plans may need; the host refuses any step
/// outside it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    pub steps: Vec<StepKind>,
    pub device_kinds: Vec<DeviceKind>,
    /// Filesystems made or mounted from block devices.
    pub filesystems: Vec<String>,
    /// Network filesystems mounted from a network source.
    pub network_filesystems: Vec<String>,
    pub path_roots: Vec<PathRoot>,
    /// Controller steps its provisioner's plans use (contract 1.1).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub controller_steps: Vec<super::ControllerStepKind>,
}
