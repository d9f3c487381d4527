//! The values a policy is called with and answers in: plain Rust, the
//! same in native tests and inside the component. The SDK converts them
//! to and from the contract (`glue`), so a later contract version that adds
//! a fact adds a field here, not a change to every policy.

/// Kubernetes access mode of a persistent volume. Semantics are
/// Kubernetes', not stricter: ReadWriteOnce is per node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AccessMode {
    ReadWriteOnce,
    ReadOnlyMany,
    ReadWriteMany,
    ReadWriteOncePod,
}

impl AccessMode {
    /// Kubernetes' spelling.
    pub fn parse(s: &str) -> Option<AccessMode> {
        Some(match s {
            "ReadWriteOnce" => AccessMode::ReadWriteOnce,
            "ReadOnlyMany" => AccessMode::ReadOnlyMany,
            "ReadWriteMany" => AccessMode::ReadWriteMany,
            "ReadWriteOncePod" => AccessMode::ReadWriteOncePod,
            _ => return None,
        })
    }

    /// The Kubernetes name.
    pub fn name(self) -> &'static str {
        match self {
            AccessMode::ReadWriteOnce => "ReadWriteOnce",
            AccessMode::ReadOnlyMany => "ReadOnlyMany",
            AccessMode::ReadWriteMany => "ReadWriteMany",
            AccessMode::ReadWriteOncePod => "ReadWriteOncePod",
        }
    }
}

/// How a volume reaches its consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum VolumeMode {
    /// A filesystem, mounted at the consumer's dir.
    #[default]
    Filesystem,
    /// The raw block device, published at the consumer's path.
    Block,
}

/// A key/value pair; option values are strings, as Flexvolume sends them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: String,
}

/// The volume a call is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    /// PersistentVolume name (or the inline volume's name).
    pub name: String,
    /// Backend name, e.g. "rbd".
    pub backend: String,
    pub access_mode: AccessMode,
    /// Filesystem type asked for; empty when unspecified (and for block).
    pub fs_type: String,
    pub mode: VolumeMode,
    /// Mount options the volume asks for (a PV's mountOptions).
    pub mount_flags: Vec<String>,
    /// The backend's own options.
    pub options: Vec<KeyValue>,
    /// Names of the keys of the volume's secret; values never reach guests.
    pub secret_keys: Vec<String>,
}

impl Volume {
    /// The value of option `key`, if given.
    pub fn option(&self, key: &str) -> Option<&str> {
        self.options.iter().find(|kv| kv.key == key).map(|kv| kv.value.as_str())
    }
}

/// One pod using a volume on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consumer {
    pub node: String,
    pub pod_namespace: String,
    pub pod: String,
    pub pod_uid: String,
    /// The pod's mount dir for this volume, as kubelet gave it.
    pub mount_dir: String,
    pub read_only: bool,
    /// The group the volume should be writable by (CSI volume_mount_group).
    pub mount_group: Option<String>,
}

/// A consumer recorded in the attachment ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub consumer: Consumer,
    /// When the consumer was recorded, RFC 3339.
    pub since: String,
}

/// What the host knows of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFacts {
    pub name: String,
    /// False when the Node object is gone from the cluster.
    pub exists: bool,
    pub ready: bool,
    /// The node carries the `node.kubernetes.io/out-of-service` taint.
    pub out_of_service: bool,
}

/// Paths on this node a plan for one volume may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePaths {
    pub kubelet_root: String,
    /// <kubelet-root>/plugins/volagent/<backend>/mounts/<volume>
    pub staging_dir: String,
    /// A per-volume dir owned by the agent, for logs of mount helpers.
    pub state_dir: String,
    /// Dirs under which local volumes are discovered (local-pv only).
    pub discovery_dirs: Vec<String>,
}

/// What is at a path on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PathKind {
    Missing,
    RegularFile,
    Directory,
    BlockDevice,
    Other,
}

/// A mount-table entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub source: String,
    pub target: String,
    pub fs_type: String,
    pub read_only: bool,
}

/// A client watching a network block image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watcher {
    /// Client address as the storage cluster reports it.
    pub address: String,
    /// Client id, e.g. "client.4135".
    pub client: String,
    /// Node the host resolved the address to.
    pub node: Option<String>,
}

/// Severity of a guest's log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
}

/// Kinds of block device a backend attaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Loop,
    Nbd,
    Rbd,
}

impl DeviceKind {
    /// The contract interface (and SDK feature) that attaches it.
    pub fn interface(self) -> &'static str {
        match self {
            DeviceKind::Loop => "loop-devices",
            DeviceKind::Nbd => "nbd",
            DeviceKind::Rbd => "ceph",
        }
    }

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
#[derive(Debug, Clone, PartialEq, Eq)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NbdAttach {
    Auto,
    Kernel,
    Userspace,
}

/// An NBD export: a server's, or the agent's own export of a local file.
#[derive(Debug, Clone, PartialEq, Eq)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RbdAttach {
    Auto,
    Kernel,
    Nbd,
    Fuse,
}

#[derive(Debug, Clone, PartialEq, Eq)]
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockSource {
    /// The device attached by this plan's attach-device step with that id.
    Attached(String),
    /// An existing block device.
    Device(String),
}

/// When a format step runs mkfs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatMode {
    IfUnformatted,
    Always,
}

/// How a released volume's data is destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WipeMethod {
    Signatures,
    Discard,
    Zero,
    /// Overwrite with random data this many times.
    Shred(u32),
}

/// What a mount step mounts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountSource {
    Block(BlockSource),
    /// A network filesystem source, e.g. "server1:/gv0".
    Network(String),
}

/// One effect the host performs.
#[derive(Debug, Clone, PartialEq, Eq)]
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachDevice {
    /// Names the device for later steps (`BlockSource::Attached`).
    pub id: String,
    pub spec: DeviceSpec,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Format {
    pub device: BlockSource,
    pub fs_type: String,
    pub mode: FormatMode,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub source: MountSource,
    pub target: String,
    pub fs_type: String,
    pub options: Vec<String>,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    pub source: String,
    pub target: String,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unmount {
    pub target: String,
    pub force: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetachDevice {
    pub spec: DeviceSpec,
    pub force: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wipe {
    pub device: BlockSource,
    pub method: WipeMethod,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClearDirectory {
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlocklistClient {
    pub monitors: Vec<String>,
    pub user: String,
    pub secret_key: Option<String>,
    pub address: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishBlock {
    pub device: BlockSource,
    pub target: String,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrowFilesystem {
    pub target: String,
}

/// Steps run in order; a failing step rolls back those before it.
pub type Plan = Vec<Step>;

/// Kinds of step, as capabilities declare them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    pub steps: Vec<StepKind>,
    pub device_kinds: Vec<DeviceKind>,
    /// Filesystems made or mounted from block devices.
    pub filesystems: Vec<String>,
    /// Network filesystems mounted from a network source.
    pub network_filesystems: Vec<String>,
    pub path_roots: Vec<PathRoot>,
}

/// What a backend is and what its plans may need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendInfo {
    pub name: String,
    /// The policy's own version (semver).
    pub version: String,
    pub description: String,
    pub capabilities: Capabilities,
}

/// A fence decision for one consumer of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Grant,
    /// The reason is shown to users and names the conflicting holder.
    Deny(String),
    TakeOver(TakeOver),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakeOver {
    /// Holders to remove from the record (their nodes are gone).
    pub stale: Vec<Holder>,
    /// Fencing run on the requester's node before the record changes hands.
    pub fence_steps: Plan,
}

/// Why a cleanup is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CleanupReason {
    StaleNode,
    StorageClusterDeleted,
    LocalVolumeReleased,
}

/// A volume to clean up and what the ledger knew of it on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanupItem {
    pub volume: Volume,
    pub paths: NodePaths,
    pub holders: Vec<Holder>,
}

/// A refusal by the policy itself (as opposed to a trap).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyError {
    /// The volume's options are missing or malformed.
    InvalidOptions(String),
    /// The request is valid but this backend cannot do it.
    Unsupported(String),
}

impl PolicyError {
    /// For users: what kind of refusal, and the policy's message.
    pub fn describe(&self) -> String {
        match self {
            PolicyError::InvalidOptions(m) => format!("invalid options: {m}"),
            PolicyError::Unsupported(m) => format!("unsupported: {m}"),
        }
    }
}
