//! Checking a guest's plan against what its backend declared and the paths
//! this call allows, before anything runs. No step escapes its roots.

use crate::model::{
    AccessMode, BlockSource, Capabilities, CleanupItem, CleanupReason, Consumer, DeviceSpec,
    Format, FormatMode, Holder, MountSource, NodeFacts, NodePaths, PathRoot, Step, StepKind,
    TakeOver, Volume, WipeMethod,
};
use std::collections::BTreeSet;

mod mount_options;
mod provision;

pub use provision::{MAX_ATTRIBUTES, MAX_ID, MAX_SEGMENTS, provision};

/// Most passes a shred step may ask for.
pub const MAX_SHRED_PASSES: u32 = 35;
/// Most steps a plan may have: a cleanup of many volumes has a few per
/// volume; anything near this is a guest gone wrong.
pub const MAX_PLAN_STEPS: usize = 512;
/// Longest path in a step (PATH_MAX).
pub const MAX_PATH: usize = 4096;
/// Longest other string in a step (ids, names, addresses, options).
pub const MAX_TEXT: usize = 1024;
/// Most mount options or monitors one step may list.
pub const MAX_LIST: usize = 64;

/// Why a plan was refused: which step, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("step {} ({step}): {reason}", index + 1)]
pub struct PlanError {
    pub index: usize,
    pub step: &'static str,
    pub reason: String,
}

/// The call a plan answers; it decides which dirs and steps are allowed.
pub enum Operation<'a> {
    Attach {
        volume: &'a Volume,
        consumer: &'a Consumer,
        paths: &'a NodePaths,
    },
    Detach {
        volume: &'a Volume,
        consumer: &'a Consumer,
        paths: &'a NodePaths,
    },
    /// Growing a volume in place where `consumer` has it.
    Expand {
        volume: &'a Volume,
        consumer: &'a Consumer,
        paths: &'a NodePaths,
    },
    Cleanup {
        reason: CleanupReason,
        items: &'a [CleanupItem],
    },
    /// A take-over's fence steps: no dirs, only the paths the volume names
    /// (a detach of a leftover mapping of its file).
    Fence {
        volume: &'a Volume,
    },
}

/// What one plan may touch: the concrete dirs of each root, the paths its
/// volumes name, and the read-only promises it must keep.
#[derive(Debug, Default, Clone)]
pub struct Scope {
    pub pod_mount_dirs: Vec<String>,
    pub staging_dirs: Vec<String>,
    pub state_dirs: Vec<String>,
    pub discovery_dirs: Vec<String>,
    /// The node's discovery dirs, none of which is ever a volume itself.
    pub discovery_roots: Vec<String>,
    /// Absolute paths named by the volumes' options: within the discovery
    /// dirs, a plan may use only these (and what lies below them).
    pub volume_paths: Vec<String>,
    /// Block devices under /dev that the volumes name together with their
    /// identity: the host checks that identity before it asks the policy
    /// (a discovered disk's PV), so a plan may use them.
    pub devices: Vec<String>,
    /// Wipe and format-always are allowed (releasing a local volume).
    pub destructive: bool,
    /// A ReadOnlyMany volume: every attach, mount and bind is read-only.
    pub read_only_volume: bool,
    /// Pod dirs whose consumer mounts read-only.
    pub read_only_pod_dirs: Vec<String>,
    pub secret_keys: Vec<String>,
}

impl Scope {
    pub fn of(op: &Operation) -> Scope {
        let mut scope = Scope::default();
        match op {
            Operation::Attach { volume, consumer, paths }
            | Operation::Detach { volume, consumer, paths }
            | Operation::Expand { volume, consumer, paths } => {
                scope.add(volume, paths);
                scope.pod_mount_dirs.push(consumer.mount_dir.clone());
                if consumer.read_only {
                    scope.read_only_pod_dirs.push(consumer.mount_dir.clone());
                }
            }
            Operation::Cleanup { reason, items } => {
                for item in *items {
                    scope.add(&item.volume, &item.paths);
                    scope
                        .pod_mount_dirs
                        .extend(item.holders.iter().map(|h| h.consumer.mount_dir.clone()));
                }
                scope.destructive = *reason == CleanupReason::LocalVolumeReleased;
            }
            Operation::Fence { volume } => {
                scope.secret_keys = volume.secret_keys.clone();
                scope.volume_paths = volume
                    .options
                    .iter()
                    .map(|kv| kv.value.clone())
                    .filter(|v| v.starts_with('/'))
                    .collect();
                scope.discovery_dirs = scope.volume_paths.clone();
            }
        }
        scope
    }

    fn add(&mut self, volume: &Volume, paths: &NodePaths) {
        self.staging_dirs.push(paths.staging_dir.clone());
        self.state_dirs.push(paths.state_dir.clone());
        self.discovery_dirs.extend(paths.discovery_dirs.iter().cloned());
        self.discovery_roots.extend(paths.discovery_dirs.iter().cloned());
        self.volume_paths.extend(
            volume.options.iter().map(|kv| kv.value.clone()).filter(|v| v.starts_with('/')),
        );
        self.devices.extend(verified_device(volume));
        self.read_only_volume |= volume.access_mode == AccessMode::ReadOnlyMany;
        self.secret_keys.extend(volume.secret_keys.iter().cloned());
    }

    fn of_root(&self, root: PathRoot) -> &[String] {
        match root {
            PathRoot::PodMountDir => &self.pod_mount_dirs,
            PathRoot::StagingDir => &self.staging_dirs,
            PathRoot::StateDir => &self.state_dirs,
            PathRoot::DiscoveryDirs => &self.discovery_dirs,
        }
    }
}

/// The device a volume names by `path` together with its `identity`: a
/// clean path under /dev. (The host verifies the identity before any policy
/// call of such a volume: `crate::local::discovery::verify_device`.)
pub fn verified_device(volume: &Volume) -> Option<String> {
    volume.option(crate::local::discovery::IDENTITY_OPTION).filter(|i| !i.is_empty())?;
    volume
        .option("path")
        .filter(|p| p.starts_with("/dev/") && clean_absolute(p).is_ok())
        .map(str::to_string)
}

/// Which roots a path in a given role may lie in.
const MOUNT_TARGETS: &[PathRoot] = &[PathRoot::StagingDir, PathRoot::PodMountDir];
const BIND_SOURCES: &[PathRoot] = &[PathRoot::StagingDir, PathRoot::DiscoveryDirs];
const DEVICES: &[PathRoot] = &[PathRoot::DiscoveryDirs];
const OPTION_PATHS: &[PathRoot] = &[PathRoot::StateDir, PathRoot::StagingDir];

/// An absolute path with no `.` or `..` components, no NUL and no empty
/// components, so that a prefix check on it means what it says.
pub fn clean_absolute(path: &str) -> Result<(), String> {
    if path.contains('\0') {
        return Err(format!("path {path:?} contains a NUL byte"));
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err(format!("path {path:?} is not absolute"));
    };
    for c in rest.split('/') {
        match c {
            ".." => return Err(format!("path {path:?} contains \"..\"")),
            "." => return Err(format!("path {path:?} contains \".\"")),
            "" if !rest.is_empty() => return Err(format!("path {path:?} has an empty component")),
            _ => {}
        }
    }
    Ok(())
}

/// `path` equals `root` or lies below it (by whole components).
fn within(path: &str, root: &str) -> bool {
    let root = root.trim_end_matches('/');
    if root.is_empty() {
        return false; // "/" is never a root a plan may use
    }
    path == root || path.strip_prefix(root).is_some_and(|rest| rest.starts_with('/'))
}

struct Checker<'a> {
    caps: &'a Capabilities,
    scope: &'a Scope,
    attached: BTreeSet<String>,
}

/// `text`, used as `what`, is at most `max` bytes.
pub(crate) fn bounded(what: &str, text: &str, max: usize) -> Result<(), String> {
    if text.len() > max {
        return Err(format!("{what} is {} bytes long, more than the {max} allowed", text.len()));
    }
    Ok(())
}

impl Checker<'_> {
    /// `path`, used as `what`, must lie in one of `roles` that the backend
    /// declared; in the discovery dirs, only where its volume points, and
    /// strictly below them (a discovery dir is never a volume itself).
    fn path(&self, what: &str, path: &str, roles: &[PathRoot]) -> Result<(), String> {
        bounded(what, path, MAX_PATH)?;
        clean_absolute(path).map_err(|e| format!("{what}: {e}"))?;
        let usable = || self.caps.path_roots.iter().copied().filter(|r| roles.contains(r));
        for root in usable() {
            if !self
                .scope
                .of_root(root)
                .iter()
                .any(|r| clean_absolute(r).is_ok() && within(path, r))
            {
                continue;
            }
            if root == PathRoot::DiscoveryDirs {
                if self.scope.discovery_roots.iter().any(|r| r.trim_end_matches('/') == path) {
                    return Err(format!(
                        "{what} {path} is a discovery dir itself, which is never a volume: a local volume is a path below it"
                    ));
                }
                if !self.scope.volume_paths.iter().any(|v| within(path, v)) {
                    return Err(format!(
                        "{what} {path} is a local volume this plan's volume does not name"
                    ));
                }
            }
            return Ok(());
        }
        let allowed: Vec<String> = usable()
            .flat_map(|r| self.scope.of_root(r).iter().map(move |d| format!("{d} ({})", r.name())))
            .collect();
        Err(format!(
            "{what} {path} is outside the dirs this backend may use here: {}",
            if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
        ))
    }

    fn device_spec(&self, spec: &DeviceSpec) -> Result<(), String> {
        let kind = spec.kind();
        if !self.caps.device_kinds.contains(&kind) {
            return Err(format!(
                "device kind {} is not declared in the backend's capabilities",
                kind.name()
            ));
        }
        match spec {
            DeviceSpec::Loop(file) => self.path("loop backing file", file, DEVICES),
            DeviceSpec::Nbd(nbd) => {
                if let Some(file) = &nbd.local_file {
                    if !nbd.server.is_empty() {
                        return Err(format!(
                            "nbd spec names both a server ({:?}) and a local file ({file})",
                            nbd.server
                        ));
                    }
                    self.path("nbd local file", file, DEVICES)?;
                } else if nbd.server.is_empty() || nbd.server.contains(char::is_whitespace) {
                    return Err(format!("nbd server {:?} is not an address", nbd.server));
                } else {
                    match nbd.server.strip_prefix("unix:") {
                        Some(sock) => {
                            clean_absolute(sock).map_err(|e| format!("nbd server socket: {e}"))?;
                        }
                        None => host_port(&nbd.server)
                            .map_err(|e| format!("nbd server {:?}: {e}", nbd.server))?,
                    }
                }
                if nbd.export_name.contains('\0') {
                    return Err("nbd export name contains NUL".to_string());
                }
                if !(1..=16).contains(&nbd.connections) {
                    return Err(format!("nbd connections {} is not from 1 to 16", nbd.connections));
                }
                Ok(())
            }
            DeviceSpec::Rbd(rbd) => {
                name_ok("rbd pool", &rbd.pool)?;
                name_ok("rbd image", &rbd.image)?;
                name_ok("ceph user", &rbd.user)?;
                if rbd.monitors.is_empty() {
                    return Err("rbd image has no monitors".to_string());
                }
                for m in &rbd.monitors {
                    host_port(m).map_err(|e| format!("rbd monitor {m:?}: {e}"))?;
                }
                self.secret_key(rbd.secret_key.as_deref())
            }
        }
    }

    fn secret_key(&self, key: Option<&str>) -> Result<(), String> {
        match key {
            Some(k) if !self.scope.secret_keys.iter().any(|s| s == k) => {
                Err(format!("secret key {k:?} is not a key of the volume's secret"))
            }
            _ => Ok(()),
        }
    }

    fn block(&self, source: &BlockSource) -> Result<(), String> {
        match source {
            BlockSource::Attached(id) if self.attached.contains(id) => Ok(()),
            BlockSource::Attached(id) => {
                Err(format!("device {id:?} is not attached by an earlier step of this plan"))
            }
            BlockSource::Device(path) if self.scope.devices.iter().any(|d| d == path) => Ok(()),
            BlockSource::Device(path) => self.path("block device", path, DEVICES),
        }
    }

    fn filesystem(&self, fs: &str, declared: &[String], what: &str) -> Result<(), String> {
        if declared.iter().any(|d| d == fs) {
            Ok(())
        } else {
            Err(format!("{what} {fs:?} is not declared in the backend's capabilities"))
        }
    }

    /// A ReadOnlyMany volume is never attached or mounted writable, nor a
    /// read-only consumer's dir bound writable.
    fn read_only(&self, what: &str, read_only: bool, target: Option<&str>) -> Result<(), String> {
        if read_only {
            return Ok(());
        }
        if self.scope.read_only_volume {
            return Err(format!("{what} is read-write, but the volume is ReadOnlyMany"));
        }
        if let Some(t) = target.filter(|t| self.scope.read_only_pod_dirs.iter().any(|d| d == t)) {
            return Err(format!(
                "{what} at {t} is read-write, but the pod mounts the volume read-only"
            ));
        }
        Ok(())
    }

    fn step(&mut self, step: &Step) -> Result<(), String> {
        texts_bounded(step)?;
        let kind = step.kind();
        if !self.caps.steps.contains(&kind) {
            return Err(format!(
                "step kind {} is not declared in the backend's capabilities",
                kind.name()
            ));
        }
        let destructive = matches!(
            step,
            Step::Wipe(_)
                | Step::ClearDirectory(_)
                | Step::Format(Format { mode: FormatMode::Always, .. })
        );
        if destructive && !self.scope.destructive {
            return Err("destroys data, which only the cleanup of a released local volume may do"
                .to_string());
        }
        match step {
            Step::AttachDevice(a) => {
                self.read_only("the device", a.read_only, None)?;
                if a.id.is_empty() {
                    return Err("attach-device has an empty id".to_string());
                }
                self.device_spec(&a.spec)?;
                if !self.attached.insert(a.id.clone()) {
                    return Err(format!("device id {:?} is attached twice", a.id));
                }
                Ok(())
            }
            Step::Format(f) => {
                self.filesystem(&f.fs_type, &self.caps.filesystems, "filesystem")?;
                self.block(&f.device)
            }
            Step::Mount(m) => {
                match &m.source {
                    MountSource::Block(b) => {
                        self.filesystem(&m.fs_type, &self.caps.filesystems, "filesystem")?;
                        self.block(b)?;
                    }
                    MountSource::Network(src) => {
                        self.filesystem(
                            &m.fs_type,
                            &self.caps.network_filesystems,
                            "network filesystem",
                        )?;
                        if src.is_empty() || src.contains(['\0', ',', ' ']) {
                            return Err(format!("network source {src:?} is malformed"));
                        }
                    }
                }
                self.path("mount target", &m.target, MOUNT_TARGETS)?;
                self.read_only("the mount", m.read_only, Some(&m.target))?;
                for option in &m.options {
                    self.mount_option(&m.fs_type, option)?;
                }
                Ok(())
            }
            Step::BindMount(b) => {
                self.path("bind source", &b.source, BIND_SOURCES)?;
                self.path("bind target", &b.target, MOUNT_TARGETS)?;
                self.read_only("the bind mount", b.read_only, Some(&b.target))
            }
            Step::Unmount(u) => self.path("unmount target", &u.target, MOUNT_TARGETS),
            Step::DetachDevice(d) => self.device_spec(&d.spec),
            Step::Wipe(w) => {
                if let WipeMethod::Shred(passes) = w.method
                    && (passes == 0 || passes > MAX_SHRED_PASSES)
                {
                    return Err(format!(
                        "shred with {passes} passes (1 to {MAX_SHRED_PASSES} allowed)"
                    ));
                }
                self.block(&w.device)
            }
            // Only the volume's own path (or below it) in a discovery dir.
            Step::ClearDirectory(c) => self.path("directory to clear", &c.path, DEVICES),
            Step::PublishBlock(p) => {
                self.block(&p.device)?;
                self.path("block publish target", &p.target, MOUNT_TARGETS)?;
                self.read_only("the block publish", p.read_only, Some(&p.target))
            }
            Step::GrowFilesystem(g) => self.path("filesystem to grow", &g.target, MOUNT_TARGETS),
            Step::BlocklistClient(b) => {
                if b.address.is_empty() || b.address.contains(char::is_whitespace) {
                    return Err(format!("client address {:?} is malformed", b.address));
                }
                if b.monitors.is_empty() {
                    return Err("blocklist-client has no monitors".to_string());
                }
                for m in &b.monitors {
                    host_port(m).map_err(|e| format!("monitor {m:?}: {e}"))?;
                }
                name_ok("ceph user", &b.user)?;
                self.secret_key(b.secret_key.as_deref())
            }
        }
    }

    /// Options are joined with ',' by the host, so one option is one option;
    /// each must be one the filesystem `fs` is known to take and that names
    /// no other device or file (no `journal_dev`, `logdev`, `rtdev`, …); a
    /// path value must lie within the volume's state or staging dir.
    fn mount_option(&self, fs: &str, option: &str) -> Result<(), String> {
        if option.is_empty() || option.contains([',', '\0', '\n']) {
            return Err(format!("mount option {option:?} is malformed"));
        }
        let (key, value) = match option.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (option, None),
        };
        let Some(kind) = mount_options::allowed(fs, key) else {
            return Err(format!(
                "mount option {key:?} is not one the host allows for {fs} (see docs/security.md)"
            ));
        };
        match (kind, value) {
            (mount_options::Value::None, None) => Ok(()),
            (mount_options::Value::Number, Some(v))
                if !v.is_empty() && v.len() <= 20 && v.bytes().all(|b| b.is_ascii_digit()) =>
            {
                Ok(())
            }
            (mount_options::Value::OneOf(choices), Some(v)) if choices.contains(&v) => Ok(()),
            (mount_options::Value::Name, Some(v)) if name_ok("", v).is_ok() => Ok(()),
            (mount_options::Value::Servers, Some(v))
                if !v.is_empty()
                    && v.split(':').all(|h| {
                        !h.is_empty()
                            && h.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.".contains(&b))
                    }) =>
            {
                Ok(())
            }
            (mount_options::Value::Path, Some(v)) => {
                self.path(&format!("mount option {key}"), v, OPTION_PATHS)
            }
            _ => Err(format!("mount option {option:?} does not have the value {fs}'s {key} takes")),
        }
    }
}

/// Every string in `step` within its bound, and lists within theirs, before
/// anything looks at them.
fn texts_bounded(step: &Step) -> Result<(), String> {
    let spec = |spec: &DeviceSpec| -> Result<(), String> {
        match spec {
            DeviceSpec::Loop(file) => bounded("loop backing file", file, MAX_PATH),
            DeviceSpec::Nbd(n) => bounded("nbd server", &n.server, MAX_TEXT)
                .and(bounded("nbd export", &n.export_name, MAX_TEXT))
                .and(bounded("nbd local file", n.local_file.as_deref().unwrap_or(""), MAX_PATH)),
            DeviceSpec::Rbd(r) => {
                if r.monitors.len() > MAX_LIST {
                    return Err(format!(
                        "rbd image lists {} monitors, more than the {MAX_LIST} allowed",
                        r.monitors.len()
                    ));
                }
                for t in r.monitors.iter().chain([&r.pool, &r.image, &r.user]).chain(&r.secret_key)
                {
                    bounded("an rbd field", t, MAX_TEXT)?;
                }
                Ok(())
            }
        }
    };
    let block = |b: &BlockSource| match b {
        BlockSource::Attached(id) => bounded("device id", id, MAX_TEXT),
        BlockSource::Device(p) => bounded("block device", p, MAX_PATH),
    };
    match step {
        Step::AttachDevice(a) => bounded("device id", &a.id, MAX_TEXT).and(spec(&a.spec)),
        Step::Format(f) => block(&f.device).and(bounded("filesystem", &f.fs_type, MAX_TEXT)),
        Step::Mount(m) => {
            if m.options.len() > MAX_LIST {
                return Err(format!(
                    "{} mount options, more than the {MAX_LIST} allowed",
                    m.options.len()
                ));
            }
            for o in &m.options {
                bounded("a mount option", o, MAX_PATH)?;
            }
            match &m.source {
                MountSource::Block(b) => block(b)?,
                MountSource::Network(n) => bounded("network source", n, MAX_TEXT)?,
            }
            bounded("filesystem", &m.fs_type, MAX_TEXT)
        }
        Step::Wipe(w) => block(&w.device),
        Step::ClearDirectory(c) => bounded("directory to clear", &c.path, MAX_PATH),
        Step::DetachDevice(d) => spec(&d.spec),
        Step::BlocklistClient(b) => {
            if b.monitors.len() > MAX_LIST {
                return Err(format!(
                    "{} monitors, more than the {MAX_LIST} allowed",
                    b.monitors.len()
                ));
            }
            for t in b.monitors.iter().chain([&b.user, &b.address]).chain(&b.secret_key) {
                bounded("a blocklist-client field", t, MAX_TEXT)?;
            }
            Ok(())
        }
        Step::PublishBlock(p) => block(&p.device),
        Step::BindMount(_) | Step::Unmount(_) | Step::GrowFilesystem(_) => Ok(()),
    }
}

/// "host:port": a DNS name or IPv4 address, or an IPv6 address in
/// brackets, and a port. Nothing else gets into the client's NBD URI (a
/// '?', '/' or '@' there would add query parameters, paths or users).
pub(crate) fn host_port(server: &str) -> Result<(), String> {
    let (host, port) = server.rsplit_once(':').ok_or("not host:port")?;
    if !port.parse::<u16>().is_ok_and(|p| p != 0) {
        return Err(format!("port {port:?} is not from 1 to 65535"));
    }
    let ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host.len() <= 253
                && host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.".contains(&b))
        }
    };
    if ok {
        Ok(())
    } else {
        Err(format!("host {host:?} is not a DNS name, an IPv4 address or a bracketed IPv6 address"))
    }
}

pub(crate) fn name_ok(what: &str, name: &str) -> Result<(), String> {
    if !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && !name.starts_with('.')
    {
        Ok(())
    } else {
        Err(format!("{what} {name:?} is not a valid name"))
    }
}

/// Check every step of `plan`, the answer to `op`, in order.
pub fn plan(plan: &[Step], caps: &Capabilities, op: &Operation) -> Result<(), PlanError> {
    if plan.len() > MAX_PLAN_STEPS {
        return Err(PlanError {
            index: MAX_PLAN_STEPS,
            step: "plan",
            // A 1.x guest's plan is kept only up to one step past the
            // limit while it is built: its length says no more than that.
            reason: format!("the plan has more steps than the {MAX_PLAN_STEPS} allowed"),
        });
    }
    let scope = Scope::of(op);
    let mut checker = Checker { caps, scope: &scope, attached: BTreeSet::new() };
    for (index, step) in plan.iter().enumerate() {
        checker.step(step).map_err(|reason| PlanError {
            index,
            step: step.kind().name(),
            reason,
        })?;
    }
    Ok(())
}

/// A take-over may only remove recorded holders whose nodes the host itself
/// reported gone, and may only run fence steps (blocklist, detach).
pub fn take_over(
    take: &TakeOver,
    holders: &[Holder],
    nodes: &[NodeFacts],
    caps: &Capabilities,
    volume: &Volume,
) -> Result<(), String> {
    if take.stale.is_empty() {
        return Err("it names no stale holder".to_string());
    }
    for stale in &take.stale {
        let who = format!(
            "pod {}/{} on node {}",
            stale.consumer.pod_namespace, stale.consumer.pod, stale.consumer.node
        );
        if !holders.contains(stale) {
            return Err(format!("{who} is not a recorded holder"));
        }
        let gone = nodes
            .iter()
            .find(|n| n.name == stale.consumer.node)
            .is_some_and(|n| !n.exists || n.out_of_service);
        if !gone {
            return Err(format!(
                "{who}: node {} is not known to be gone (deleted or tainted node.kubernetes.io/out-of-service)",
                stale.consumer.node
            ));
        }
    }
    // Fencing cuts a gone writer's path to the data: at the storage
    // (blocklist) or a mapping of it left on this node (detach). Nothing
    // that mounts, formats or wipes.
    for (index, step) in take.fence_steps.iter().enumerate() {
        if !matches!(step.kind(), StepKind::BlocklistClient | StepKind::DetachDevice) {
            return Err(format!(
                "fence step {} is {}, but only blocklist-client and detach-device may fence",
                index + 1,
                step.kind().name()
            ));
        }
    }
    plan(&take.fence_steps, caps, &Operation::Fence { volume }).map_err(|e| format!("fence {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    const POD: &str = "/k/pods/u/volumes/volagent~local-pv/pv";
    const STAGING: &str = "/k/plugins/volagent/local-pv/mounts/pv";

    fn caps() -> Capabilities {
        Capabilities {
            steps: vec![
                StepKind::AttachDevice,
                StepKind::Format,
                StepKind::Mount,
                StepKind::BindMount,
                StepKind::Unmount,
                StepKind::DetachDevice,
                StepKind::Wipe,
                StepKind::ClearDirectory,
            ],
            device_kinds: vec![DeviceKind::Loop],
            filesystems: vec!["ext4".into()],
            network_filesystems: vec![],
            path_roots: vec![
                PathRoot::PodMountDir,
                PathRoot::StagingDir,
                PathRoot::DiscoveryDirs,
                PathRoot::StateDir,
            ],
            controller_steps: vec![],
        }
    }

    fn volume() -> Volume {
        Volume {
            name: "pv".into(),
            backend: "local-pv".into(),
            access_mode: AccessMode::ReadWriteOnce,
            fs_type: "ext4".into(),
            mode: crate::policy::VolumeMode::Filesystem,
            mount_flags: Vec::new(),
            options: vec![KeyValue { key: "path".into(), value: "/mnt/disks/a.img".into() }],
            secret_keys: vec![],
        }
    }

    fn consumer() -> Consumer {
        Consumer {
            node: "n1".into(),
            pod_namespace: "ns".into(),
            pod: "p".into(),
            pod_uid: "u".into(),
            mount_dir: POD.into(),
            read_only: false,
            mount_group: None,
        }
    }

    fn paths() -> NodePaths {
        NodePaths {
            kubelet_root: "/k".into(),
            staging_dir: STAGING.into(),
            state_dir: "/s/pv".into(),
            discovery_dirs: vec!["/mnt/disks".into()],
        }
    }

    fn good() -> Vec<Step> {
        vec![
            Step::AttachDevice(AttachDevice {
                id: "d".into(),
                spec: DeviceSpec::Loop("/mnt/disks/a.img".into()),
                read_only: false,
            }),
            Step::Format(Format {
                device: BlockSource::Attached("d".into()),
                fs_type: "ext4".into(),
                mode: FormatMode::IfUnformatted,
            }),
            Step::Mount(Mount {
                source: MountSource::Block(BlockSource::Attached("d".into())),
                target: STAGING.into(),
                fs_type: "ext4".into(),
                options: vec!["noatime".into()],
                read_only: false,
            }),
            Step::BindMount(BindMount {
                source: STAGING.into(),
                target: POD.into(),
                read_only: false,
            }),
        ]
    }

    fn check(p: &[Step], v: &Volume, c: &Consumer) -> Result<(), PlanError> {
        plan(p, &caps(), &Operation::Attach { volume: v, consumer: c, paths: &paths() })
    }

    fn refused(mut p: Vec<Step>, at: usize, change: impl FnOnce(&mut Step)) -> PlanError {
        change(&mut p[at]);
        check(&p, &volume(), &consumer()).expect_err("plan must be refused")
    }

    #[test]
    fn fencing_detaches_only_the_volumes_own_file_and_does_nothing_else() {
        let gone =
            NodeFacts { name: "n2".into(), exists: false, ready: false, out_of_service: false };
        let mut stale = consumer();
        stale.node = "n2".into();
        let holders = vec![Holder { consumer: stale, since: "t".into() }];
        let take = |step: Step| TakeOver { stale: holders.clone(), fence_steps: vec![step] };
        let detach = |file: &str| {
            Step::DetachDevice(DetachDevice { spec: DeviceSpec::Loop(file.into()), force: true })
        };
        take_over(
            &take(detach("/mnt/disks/a.img")),
            &holders,
            std::slice::from_ref(&gone),
            &caps(),
            &volume(),
        )
        .expect("its own file");
        let e = take_over(
            &take(detach("/mnt/disks/other.img")),
            &holders,
            std::slice::from_ref(&gone),
            &caps(),
            &volume(),
        )
        .unwrap_err();
        assert!(e.contains("fence step 1"), "{e}");
        let e =
            take_over(&take(good().remove(2)), &holders, &[gone], &caps(), &volume()).unwrap_err();
        assert!(e.contains("only blocklist-client and detach-device may fence"), "{e}");
    }

    #[test]
    fn a_good_plan_passes() {
        check(&good(), &volume(), &consumer()).unwrap();
    }

    #[test]
    fn escapes_are_refused() {
        for bad in [
            "/etc",
            "/k/plugins/volagent/local-pv/mounts/pv/../../../etc",
            "/k/plugins/volagent/local-pv/mounts/pvX",
            "relative",
            "/k/plugins/volagent/local-pv/mounts/pv/./x",
            "/mnt/disks//x",
            "/s/pv",
        ] {
            let e = refused(good(), 3, |s| {
                if let Step::BindMount(b) = s {
                    b.target = bad.into();
                }
            });
            assert_eq!((e.index, e.step), (3, "bind-mount"), "{bad}: {e}");
        }
        let e = refused(good(), 0, |s| {
            if let Step::AttachDevice(a) = s {
                a.spec = DeviceSpec::Loop("/var/secret.img".into());
            }
        });
        assert!(e.reason.contains("/var/secret.img"), "{e}");
    }

    #[test]
    fn only_the_volumes_own_local_path_may_be_used() {
        let e = refused(good(), 0, |s| {
            if let Step::AttachDevice(a) = s {
                a.spec = DeviceSpec::Loop("/mnt/disks/other.img".into());
            }
        });
        assert!(e.reason.contains("a local volume this plan's volume does not name"), "{e}");
    }

    #[test]
    fn nbd_servers_are_host_and_port_and_nothing_more() {
        for good in ["10.0.0.5:10809", "nbd.example.com:10809", "[::1]:10809", "[fd00::5]:1"] {
            assert!(host_port(good).is_ok(), "{good}");
        }
        for bad in [
            "10.0.0.5",
            "h:0",
            "h:70000",
            ":10809",
            "h?tls-psk-file=/etc/shadow:10809",
            "u@h:10809",
            "h/x:10809",
            "[nonsense]:10809",
            "::1:10809",
        ] {
            assert!(host_port(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn undeclared_kinds_are_refused() {
        let e = refused(good(), 0, |s| {
            *s = Step::AttachDevice(AttachDevice {
                id: "d".into(),
                spec: DeviceSpec::Nbd(NbdSpec {
                    server: "unix:/run/x".into(),
                    export_name: String::new(),
                    local_file: None,
                    attach: NbdAttach::Auto,
                    connections: 1,
                }),
                read_only: false,
            });
        });
        assert!(e.reason.contains("device kind nbd"), "{e}");
        let e = refused(good(), 1, |s| {
            if let Step::Format(f) = s {
                f.fs_type = "btrfs".into();
            }
        });
        assert!(e.reason.contains("btrfs"), "{e}");
        let mut p = good();
        p.push(Step::BlocklistClient(BlocklistClient {
            monitors: vec!["m:1".into()],
            user: "u".into(),
            secret_key: None,
            address: "a".into(),
        }));
        let e = check(&p, &volume(), &consumer()).unwrap_err();
        assert!(e.reason.contains("step kind blocklist-client"), "{e}");
    }

    #[test]
    fn rbd_monitors_are_host_and_port_each() {
        let mut c = caps();
        c.device_kinds = vec![DeviceKind::Rbd];
        c.steps.push(StepKind::BlocklistClient);
        let rbd = |monitor: &str| {
            let mut p = good();
            p[0] = Step::AttachDevice(AttachDevice {
                id: "d".into(),
                spec: DeviceSpec::Rbd(RbdSpec {
                    monitors: vec!["10.0.0.1:6789".into(), monitor.into()],
                    pool: "rbd".into(),
                    image: "i".into(),
                    user: "u".into(),
                    secret_key: None,
                    attach: RbdAttach::Auto,
                }),
                read_only: false,
            });
            p.push(Step::BlocklistClient(BlocklistClient {
                monitors: vec![monitor.into()],
                user: "u".into(),
                secret_key: None,
                address: "10.0.0.7:0/1".into(),
            }));
            plan(
                &p,
                &c,
                &Operation::Attach { volume: &volume(), consumer: &consumer(), paths: &paths() },
            )
        };
        rbd("ceph-mon.example:6789").unwrap();
        for bad in ["--ceph-conf=/etc/x", "10.0.0.2", "m:0", "a b:6789"] {
            let e = rbd(bad).expect_err(bad);
            assert!(e.reason.contains("monitor"), "{bad}: {e}");
        }
    }

    #[test]
    fn data_is_destroyed_only_when_releasing_a_local_volume() {
        let mut p = good();
        p.insert(
            1,
            Step::Wipe(Wipe {
                device: BlockSource::Attached("d".into()),
                method: WipeMethod::Zero,
            }),
        );
        let e = check(&p, &volume(), &consumer()).unwrap_err();
        assert!(e.reason.contains("destroys data"), "{e}");
        let e = refused(good(), 1, |s| {
            if let Step::Format(f) = s {
                f.mode = FormatMode::Always;
            }
        });
        assert!(e.reason.contains("destroys data"), "{e}");
        let release = [
            Step::AttachDevice(AttachDevice {
                id: "d".into(),
                spec: DeviceSpec::Loop("/mnt/disks/a.img".into()),
                read_only: false,
            }),
            p[1].clone(),
        ];
        let items = [CleanupItem { volume: volume(), paths: paths(), holders: vec![] }];
        plan(
            &release,
            &caps(),
            &Operation::Cleanup { reason: CleanupReason::LocalVolumeReleased, items: &items },
        )
        .unwrap();
        assert!(
            plan(
                &release,
                &caps(),
                &Operation::Cleanup { reason: CleanupReason::StaleNode, items: &items }
            )
            .is_err()
        );
    }

    #[test]
    fn only_a_released_volumes_own_dir_is_cleared() {
        let mut dir_volume = volume();
        dir_volume.options = vec![KeyValue { key: "path".into(), value: "/mnt/disks/fs1".into() }];
        let items = [CleanupItem { volume: dir_volume, paths: paths(), holders: vec![] }];
        let release =
            Operation::Cleanup { reason: CleanupReason::LocalVolumeReleased, items: &items };
        let clear = |p: &str| [Step::ClearDirectory(ClearDirectory { path: p.into() })];
        plan(&clear("/mnt/disks/fs1"), &caps(), &release).unwrap();
        for bad in ["/mnt/disks/fs2", "/mnt/disks", "/etc", "/mnt/disks/fs1/../fs2", STAGING] {
            assert!(plan(&clear(bad), &caps(), &release).is_err(), "{bad}");
        }
        let stale = Operation::Cleanup { reason: CleanupReason::StaleNode, items: &items };
        let e = plan(&clear("/mnt/disks/fs1"), &caps(), &stale).unwrap_err();
        assert!(e.reason.contains("destroys data"), "{e}");
    }

    #[test]
    fn a_device_under_dev_is_usable_only_when_named_with_its_identity() {
        let attach = |options: Vec<KeyValue>| {
            let mut v = volume();
            v.options = options;
            let p = vec![
                Step::Format(Format {
                    device: BlockSource::Device("/dev/loop7".into()),
                    fs_type: "ext4".into(),
                    mode: FormatMode::IfUnformatted,
                }),
                Step::Mount(Mount {
                    source: MountSource::Block(BlockSource::Device("/dev/loop7".into())),
                    target: STAGING.into(),
                    fs_type: "ext4".into(),
                    options: vec![],
                    read_only: false,
                }),
            ];
            plan(
                &p,
                &caps(),
                &Operation::Attach { volume: &v, consumer: &consumer(), paths: &paths() },
            )
        };
        let kv = |k: &str, v: &str| KeyValue { key: k.into(), value: v.into() };
        attach(vec![kv("path", "/dev/loop7"), kv("identity", "loop:/x.img")]).unwrap();
        let e = attach(vec![kv("path", "/dev/loop7")]).unwrap_err();
        assert!(e.reason.contains("outside"), "{e}");
        assert!(
            attach(vec![kv("path", "/dev/loop8"), kv("identity", "loop:/x.img")]).is_err(),
            "another device than the one named"
        );
        assert!(attach(vec![kv("path", "/dev/../etc/x"), kv("identity", "i")]).is_err());
    }

    #[test]
    fn read_only_promises_are_kept() {
        let mut rox = volume();
        rox.access_mode = AccessMode::ReadOnlyMany;
        let e = check(&good(), &rox, &consumer()).unwrap_err();
        assert!(e.reason.contains("ReadOnlyMany"), "{e}");
        let mut reader = consumer();
        reader.read_only = true;
        let e = check(&good(), &volume(), &reader).unwrap_err();
        assert_eq!(e.index, 3);
        assert!(e.reason.contains("the pod mounts the volume read-only"), "{e}");
        let mut p = good();
        if let Step::BindMount(b) = &mut p[3] {
            b.read_only = true;
        }
        check(&p, &volume(), &reader).unwrap();
    }

    #[test]
    fn devices_must_be_attached_first() {
        let mut p = good();
        p.remove(0);
        let e = check(&p, &volume(), &consumer()).unwrap_err();
        assert_eq!(e.index, 0);
        assert!(e.reason.contains("not attached"), "{e}");
    }

    /// A gluster mount of the staging dir with `options`.
    fn gluster_mount(options: &[&str]) -> Result<(), PlanError> {
        let mut caps = caps();
        caps.network_filesystems = vec!["glusterfs".into()];
        let step = Step::Mount(Mount {
            source: MountSource::Network("server1:/gv0".into()),
            target: STAGING.into(),
            fs_type: "glusterfs".into(),
            options: options.iter().map(|o| o.to_string()).collect(),
            read_only: false,
        });
        plan(
            &[step],
            &caps,
            &Operation::Attach { volume: &volume(), consumer: &consumer(), paths: &paths() },
        )
    }

    #[test]
    fn option_paths_and_separators_are_checked() {
        for (option, expected) in [
            ("ro,exec", "malformed"),
            ("log-file=/etc/passwd", "/etc/passwd"),
            ("log-file=etc/cron.d/x", "not absolute"),
            ("log-file=../../x", "not absolute"),
            ("backup-volfile-servers=a:b/c", "does not have the value"),
            ("log-level=LOUD", "does not have the value"),
        ] {
            let e = gluster_mount(&[option]).unwrap_err();
            assert!(e.reason.contains(expected), "{option}: {e}");
        }
        gluster_mount(&[
            "log-file=/s/pv/gluster.log",
            "backup-volfile-servers=a:b",
            "auto_unmount",
            "noatime",
        ])
        .unwrap();
    }

    #[test]
    fn mount_options_are_the_filesystems_own() {
        for (option, expected) in [
            ("journal_dev=0x801", "not one the host allows for ext4"),
            ("journal_path=/dev/sda", "not one the host allows for ext4"),
            ("errors=panic", "does not have the value"),
            ("noload", "not one the host allows"),
            ("suid", "not one the host allows"),
            ("commit=5s", "does not have the value"),
            ("discard=1", "does not have the value"),
        ] {
            let e = refused(good(), 2, |s| {
                if let Step::Mount(m) = s {
                    m.options = vec![option.into()];
                }
            });
            assert!(e.reason.contains(expected), "{option}: {e}");
        }
        let mut p = good();
        if let Step::Mount(m) = &mut p[2] {
            m.options =
                vec!["noatime".into(), "data=ordered".into(), "commit=30".into(), "discard".into()];
        }
        check(&p, &volume(), &consumer()).unwrap();
    }

    #[test]
    fn a_discovery_dir_itself_is_never_a_volume() {
        let mut v = volume();
        v.options = vec![KeyValue { key: "path".into(), value: "/mnt/disks".into() }];
        let bind = Step::BindMount(BindMount {
            source: "/mnt/disks".into(),
            target: STAGING.into(),
            read_only: false,
        });
        let e = plan(
            &[bind],
            &caps(),
            &Operation::Attach { volume: &v, consumer: &consumer(), paths: &paths() },
        )
        .unwrap_err();
        assert!(e.reason.contains("a discovery dir itself"), "{e}");
    }

    #[test]
    fn plans_and_their_strings_are_bounded() {
        let many = vec![good()[3].clone(); MAX_PLAN_STEPS + 1];
        let e = check(&many, &volume(), &consumer()).unwrap_err();
        assert!(e.reason.contains("more steps than the 512 allowed"), "{e}");
        let long = format!("{STAGING}/{}", "x".repeat(MAX_PATH));
        let e = refused(good(), 3, |s| {
            if let Step::BindMount(b) = s {
                b.target = long.clone();
            }
        });
        assert!(e.reason.contains("bytes long"), "{e}");
        let e = refused(good(), 0, |s| {
            if let Step::AttachDevice(a) = s {
                a.id = "d".repeat(MAX_TEXT + 1);
            }
        });
        assert!(e.reason.contains("bytes long"), "{e}");
        let e = refused(good(), 2, |s| {
            if let Step::Mount(m) = s {
                m.options = vec!["noatime".into(); MAX_LIST + 1];
            }
        });
        assert!(e.reason.contains("mount options, more than"), "{e}");
    }

    #[test]
    fn clean_paths() {
        assert!(clean_absolute("/").is_ok());
        assert!(clean_absolute("/a/b").is_ok());
        for bad in ["/a/./b", "/a/../b", "a/b", "/a//b", "/a/\0"] {
            assert!(clean_absolute(bad).is_err(), "{bad}");
        }
    }
}

#[cfg(test)]
mod seed_tests {
    /// The plan fuzzer's seeds are plans of this contract: a seed that no
    /// longer parses (a field added to a step) would start it from nothing.
    #[test]
    fn the_plan_fuzzers_seeds_parse_as_plans() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/plan");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).expect("fuzz/seeds/plan") {
            let path = entry.expect("entry").path();
            let text = std::fs::read_to_string(&path).expect("seed");
            let plan: Result<Vec<super::Step>, _> = serde_json::from_str(&text);
            assert!(plan.is_ok(), "{}: {:?}", path.display(), plan.err());
            seen += 1;
        }
        assert!(seen >= 5, "only {seen} seeds in {}", dir.display());
    }
}
