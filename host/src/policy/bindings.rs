//! Host-side bindings for `wit/`: the only `bindgen!` in the project.

wasmtime::component::bindgen!({
    world: "backend",
    path: "../wit",
    additional_derives: [PartialEq, serde::Serialize, serde::Deserialize],
    // A host query may refuse to answer (outside the backend's roots, no
    // answer in time): the guest's call then fails.
    imports: { default: trappable },
});

pub use self::volagent::policy::types::*;

impl StepKind {
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

impl DeviceSpec {
    pub fn kind(&self) -> DeviceKind {
        match self {
            DeviceSpec::Loop(_) => DeviceKind::Loop,
            DeviceSpec::Nbd(_) => DeviceKind::Nbd,
            DeviceSpec::Rbd(_) => DeviceKind::Rbd,
        }
    }
}

impl DeviceKind {
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Loop => "loop",
            DeviceKind::Nbd => "nbd",
            DeviceKind::Rbd => "rbd",
        }
    }
}

impl PathRoot {
    pub fn name(self) -> &'static str {
        match self {
            PathRoot::PodMountDir => "pod-mount-dir",
            PathRoot::StagingDir => "staging-dir",
            PathRoot::StateDir => "state-dir",
            PathRoot::DiscoveryDirs => "discovery-dirs",
        }
    }
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
