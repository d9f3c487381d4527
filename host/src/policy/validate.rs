//! Checking a guest's plan against what its backend declared and the paths
//! this call allows, before anything runs. No step escapes its roots.

use super::bindings::{
    BlockSource, Capabilities, CleanupItem, Consumer, DeviceSpec, Holder, MountSource, NodeFacts,
    NodePaths, PathRoot, Step, StepKind, TakeOver, WipeMethod,
};
use std::collections::BTreeSet;
use std::path::{Component, Path};

/// Most passes a shred step may ask for.
pub const MAX_SHRED_PASSES: u32 = 35;

/// Why a plan was refused: which step, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("step {} ({step}): {reason}", index + 1)]
pub struct PlanError {
    pub index: usize,
    pub step: &'static str,
    pub reason: String,
}

/// The concrete dirs each path root stands for in one call.
#[derive(Debug, Default, Clone)]
pub struct Roots {
    pub pod_mount_dirs: Vec<String>,
    pub staging_dirs: Vec<String>,
    pub state_dirs: Vec<String>,
    pub discovery_dirs: Vec<String>,
}

impl Roots {
    pub fn for_consumer<'c>(paths: &NodePaths, consumers: impl IntoIterator<Item = &'c Consumer>) -> Roots {
        let mut roots = Roots::default();
        roots.add_paths(paths);
        roots.pod_mount_dirs.extend(consumers.into_iter().map(|c| c.mount_dir.clone()));
        roots
    }

    pub fn for_cleanup(items: &[CleanupItem]) -> Roots {
        let mut roots = Roots::default();
        for item in items {
            roots.add_paths(&item.paths);
            roots.pod_mount_dirs.extend(item.holders.iter().map(|h| h.consumer.mount_dir.clone()));
        }
        roots
    }

    fn add_paths(&mut self, paths: &NodePaths) {
        self.staging_dirs.push(paths.staging_dir.clone());
        self.state_dirs.push(paths.state_dir.clone());
        self.discovery_dirs.extend(paths.discovery_dirs.iter().cloned());
    }

    fn of(&self, root: PathRoot) -> &[String] {
        match root {
            PathRoot::PodMountDir => &self.pod_mount_dirs,
            PathRoot::StagingDir => &self.staging_dirs,
            PathRoot::StateDir => &self.state_dirs,
            PathRoot::DiscoveryDirs => &self.discovery_dirs,
        }
    }
}

/// An absolute path with no `.`/`..` components, no NUL and no doubled
/// slashes, so that a prefix check on it means what it says.
pub fn clean_absolute(path: &str) -> Result<(), String> {
    if path.contains('\0') {
        return Err(format!("path {path:?} contains a NUL byte"));
    }
    if !path.starts_with('/') {
        return Err(format!("path {path:?} is not absolute"));
    }
    if path.contains("//") {
        return Err(format!("path {path:?} has an empty component"));
    }
    for c in Path::new(path).components() {
        match c {
            Component::ParentDir => return Err(format!("path {path:?} contains \"..\"")),
            Component::CurDir => return Err(format!("path {path:?} contains \".\"")),
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
    roots: &'a Roots,
    secret_keys: &'a [String],
    attached: BTreeSet<String>,
}

impl Checker<'_> {
    fn path(&self, what: &str, path: &str) -> Result<(), String> {
        clean_absolute(path).map_err(|e| format!("{what}: {e}"))?;
        for &root in &self.caps.path_roots {
            if self.roots.of(root).iter().any(|r| clean_absolute(r).is_ok() && within(path, r)) {
                return Ok(());
            }
        }
        let allowed: Vec<String> = self
            .caps
            .path_roots
            .iter()
            .flat_map(|&r| self.roots.of(r).iter().map(move |d| format!("{d} ({})", r.name())))
            .collect();
        Err(format!(
            "{what} {path} is outside the dirs this backend may use here: {}",
            if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
        ))
    }

    fn device_spec(&self, spec: &DeviceSpec) -> Result<(), String> {
        let kind = spec.kind();
        if !self.caps.device_kinds.contains(&kind) {
            return Err(format!("device kind {} is not declared in the backend's capabilities", kind.name()));
        }
        match spec {
            DeviceSpec::Loop(file) => self.path("loop backing file", file),
            DeviceSpec::Nbd(nbd) => {
                if nbd.server.is_empty() || nbd.server.contains(char::is_whitespace) {
                    return Err(format!("nbd server {:?} is not an address", nbd.server));
                }
                if let Some(sock) = nbd.server.strip_prefix("unix:") {
                    clean_absolute(sock).map_err(|e| format!("nbd server socket: {e}"))?;
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
                self.secret_key(rbd.secret_key.as_deref())
            }
        }
    }

    fn secret_key(&self, key: Option<&str>) -> Result<(), String> {
        match key {
            Some(k) if !self.secret_keys.iter().any(|s| s == k) => {
                Err(format!("secret key {k:?} is not a key of the volume's secret"))
            }
            _ => Ok(()),
        }
    }

    fn block(&self, source: &BlockSource) -> Result<(), String> {
        match source {
            BlockSource::Attached(id) if self.attached.contains(id) => Ok(()),
            BlockSource::Attached(id) => Err(format!("device {id:?} is not attached by an earlier step of this plan")),
            BlockSource::Device(path) => self.path("block device", path),
        }
    }

    fn filesystem(&self, fs: &str, declared: &[String], what: &str) -> Result<(), String> {
        if declared.iter().any(|d| d == fs) {
            Ok(())
        } else {
            Err(format!("{what} {fs:?} is not declared in the backend's capabilities"))
        }
    }

    fn step(&mut self, step: &Step) -> Result<(), String> {
        let kind = step.kind();
        if !self.caps.steps.contains(&kind) {
            return Err(format!("step kind {} is not declared in the backend's capabilities", kind.name()));
        }
        match step {
            Step::AttachDevice(a) => {
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
                        self.filesystem(&m.fs_type, &self.caps.network_filesystems, "network filesystem")?;
                        if src.is_empty() || src.contains(['\0', ',', ' ']) {
                            return Err(format!("network source {src:?} is malformed"));
                        }
                    }
                }
                self.path("mount target", &m.target)?;
                for option in &m.options {
                    self.mount_option(option)?;
                }
                Ok(())
            }
            Step::BindMount(b) => {
                self.path("bind source", &b.source)?;
                self.path("bind target", &b.target)
            }
            Step::Unmount(u) => self.path("unmount target", &u.target),
            Step::DetachDevice(d) => self.device_spec(&d.spec),
            Step::Wipe(w) => {
                if let WipeMethod::Shred(passes) = w.method
                    && (passes == 0 || passes > MAX_SHRED_PASSES) {
                        return Err(format!("shred with {passes} passes (1 to {MAX_SHRED_PASSES} allowed)"));
                    }
                self.block(&w.device)
            }
            Step::BlocklistClient(b) => {
                if b.address.is_empty() || b.address.contains(char::is_whitespace) {
                    return Err(format!("client address {:?} is malformed", b.address));
                }
                if b.monitors.is_empty() {
                    return Err("blocklist-client has no monitors".to_string());
                }
                name_ok("ceph user", &b.user)?;
                self.secret_key(b.secret_key.as_deref())
            }
        }
    }

    /// Options are joined with ',' by the host, so one option is one option;
    /// any path an option names must lie within the backend's roots.
    fn mount_option(&self, option: &str) -> Result<(), String> {
        if option.is_empty() || option.contains([',', '\0', '\n']) {
            return Err(format!("mount option {option:?} is malformed"));
        }
        if let Some((key, value)) = option.split_once('=')
            && value.starts_with('/') {
                self.path(&format!("mount option {key}"), value)?;
            }
        Ok(())
    }
}

fn name_ok(what: &str, name: &str) -> Result<(), String> {
    if !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) && !name.starts_with('.') {
        Ok(())
    } else {
        Err(format!("{what} {name:?} is not a valid name"))
    }
}

/// Check every step of `plan` in order.
pub fn plan(plan: &[Step], caps: &Capabilities, roots: &Roots, secret_keys: &[String]) -> Result<(), PlanError> {
    let mut checker = Checker { caps, roots, secret_keys, attached: BTreeSet::new() };
    for (index, step) in plan.iter().enumerate() {
        checker
            .step(step)
            .map_err(|reason| PlanError { index, step: step.kind().name(), reason })?;
    }
    Ok(())
}

/// A take-over may only remove recorded holders whose nodes the host itself
/// reported gone, and may only run storage-level fence steps.
pub fn take_over(
    take: &TakeOver,
    holders: &[Holder],
    nodes: &[NodeFacts],
    caps: &Capabilities,
    secret_keys: &[String],
) -> Result<(), String> {
    if take.stale.is_empty() {
        return Err("it names no stale holder".to_string());
    }
    for stale in &take.stale {
        let who = format!("pod {}/{} on node {}", stale.consumer.pod_namespace, stale.consumer.pod, stale.consumer.node);
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
    for (index, step) in take.fence_steps.iter().enumerate() {
        if step.kind() != StepKind::BlocklistClient {
            return Err(format!("fence step {} is {}, but only blocklist-client may fence", index + 1, step.kind().name()));
        }
    }
    plan(&take.fence_steps, caps, &Roots::default(), secret_keys).map_err(|e| format!("fence {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::bindings::*;

    fn caps() -> Capabilities {
        Capabilities {
            steps: vec![StepKind::AttachDevice, StepKind::Format, StepKind::Mount, StepKind::BindMount, StepKind::Unmount, StepKind::DetachDevice],
            device_kinds: vec![DeviceKind::Loop],
            filesystems: vec!["ext4".into()],
            network_filesystems: vec![],
            path_roots: vec![PathRoot::PodMountDir, PathRoot::StagingDir, PathRoot::DiscoveryDirs],
        }
    }

    fn roots() -> Roots {
        Roots {
            pod_mount_dirs: vec!["/k/pods/u/volumes/volagent~local-pv/pv".into()],
            staging_dirs: vec!["/k/plugins/volagent/local-pv/mounts/pv".into()],
            state_dirs: vec!["/s/pv".into()],
            discovery_dirs: vec!["/mnt/disks".into()],
        }
    }

    fn good() -> Vec<Step> {
        vec![
            Step::AttachDevice(AttachDevice { id: "d".into(), spec: DeviceSpec::Loop("/mnt/disks/a.img".into()), read_only: false }),
            Step::Format(Format { device: BlockSource::Attached("d".into()), fs_type: "ext4".into(), mode: FormatMode::IfUnformatted }),
            Step::Mount(Mount {
                source: MountSource::Block(BlockSource::Attached("d".into())),
                target: "/k/plugins/volagent/local-pv/mounts/pv".into(),
                fs_type: "ext4".into(),
                options: vec!["noatime".into()],
                read_only: false,
            }),
            Step::BindMount(BindMount {
                source: "/k/plugins/volagent/local-pv/mounts/pv".into(),
                target: "/k/pods/u/volumes/volagent~local-pv/pv".into(),
                read_only: false,
            }),
        ]
    }

    fn refused(mut p: Vec<Step>, at: usize, change: impl FnOnce(&mut Step)) -> PlanError {
        change(&mut p[at]);
        plan(&p, &caps(), &roots(), &[]).expect_err("plan must be refused")
    }

    #[test]
    fn a_good_plan_passes() {
        plan(&good(), &caps(), &roots(), &[]).unwrap();
    }

    #[test]
    fn escapes_are_refused() {
        for bad in ["/etc", "/k/plugins/volagent/local-pv/mounts/pv/../../../etc", "/k/plugins/volagent/local-pv/mounts/pvX", "relative", "/mnt/disks//x"] {
            let e = refused(good(), 3, |s| if let Step::BindMount(b) = s { b.target = bad.into() });
            assert_eq!((e.index, e.step), (3, "bind-mount"), "{bad}: {e}");
        }
        let e = refused(good(), 0, |s| if let Step::AttachDevice(a) = s { a.spec = DeviceSpec::Loop("/var/secret.img".into()) });
        assert!(e.reason.contains("/var/secret.img"), "{e}");
    }

    #[test]
    fn undeclared_kinds_are_refused() {
        let e = refused(good(), 0, |s| {
            *s = Step::AttachDevice(AttachDevice {
                id: "d".into(),
                spec: DeviceSpec::Nbd(NbdSpec { server: "unix:/run/x".into(), export_name: String::new() }),
                read_only: false,
            })
        });
        assert!(e.reason.contains("device kind nbd"), "{e}");
        let e = refused(good(), 1, |s| if let Step::Format(f) = s { f.fs_type = "btrfs".into() });
        assert!(e.reason.contains("btrfs"), "{e}");
        let mut p = good();
        p.push(Step::Wipe(Wipe { device: BlockSource::Attached("d".into()), method: WipeMethod::Zero }));
        let e = plan(&p, &caps(), &roots(), &[]).unwrap_err();
        assert!(e.reason.contains("step kind wipe"), "{e}");
    }

    #[test]
    fn devices_must_be_attached_first() {
        let mut p = good();
        p.remove(0);
        let e = plan(&p, &caps(), &roots(), &[]).unwrap_err();
        assert_eq!(e.index, 0);
        assert!(e.reason.contains("not attached"), "{e}");
    }

    #[test]
    fn option_paths_and_separators_are_checked() {
        let e = refused(good(), 2, |s| if let Step::Mount(m) = s { m.options = vec!["ro,exec".into()] });
        assert!(e.reason.contains("malformed"), "{e}");
        let e = refused(good(), 2, |s| if let Step::Mount(m) = s { m.options = vec!["log-file=/etc/passwd".into()] });
        assert!(e.reason.contains("/etc/passwd"), "{e}");
    }
}
