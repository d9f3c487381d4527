//! Between the contract and the plain values policies use: the host's
//! resources read into [`crate::model`] values, plans built through the
//! host's `plan` resource, and the queries of [`WasmHost`].

#[cfg(feature = "ceph")]
use crate::bindings::volagent::policy::ceph;
#[cfg(feature = "loop-devices")]
use crate::bindings::volagent::policy::loop_devices;
#[cfg(feature = "nbd")]
use crate::bindings::volagent::policy::nbd;
use crate::bindings::volagent::policy::{host, types as t};
use crate::model::*;
use crate::{Host, Policy};

/// The real host: the component's imports. Only callable inside a component.
pub struct WasmHost;

impl Host for WasmHost {
    fn log(&self, level: LogLevel, message: &str) {
        let level = match level {
            LogLevel::Debug => t::LogLevel::Debug,
            LogLevel::Info => t::LogLevel::Info,
            LogLevel::Warn => t::LogLevel::Warn,
            LogLevel::Error => t::LogLevel::Error,
        };
        host::log(level, message);
    }
    fn node_state(&self, name: &str) -> NodeFacts {
        node(&host::node_state(name))
    }
    fn path_kind(&self, path: &str) -> PathKind {
        match host::lookup_path(path) {
            t::PathKind::Missing => PathKind::Missing,
            t::PathKind::RegularFile => PathKind::RegularFile,
            t::PathKind::Directory => PathKind::Directory,
            t::PathKind::BlockDevice => PathKind::BlockDevice,
            t::PathKind::Other => PathKind::Other,
        }
    }
    fn filesystem_type(&self, device: &str) -> Option<String> {
        host::filesystem_type(device)
    }
    fn mount_at(&self, target: &str) -> Option<MountEntry> {
        host::mount_at(target).map(|m| MountEntry {
            source: m.source,
            target: m.target,
            fs_type: m.fs_type,
            read_only: m.read_only,
        })
    }
    #[cfg(feature = "ceph")]
    fn image_watchers(&self, pool: &str, image: &str) -> Result<Vec<Watcher>, String> {
        ceph::image_watchers(pool, image).map(|ws| {
            ws.into_iter()
                .map(|w| Watcher { address: w.address, client: w.client, node: w.node })
                .collect()
        })
    }
    #[cfg(not(feature = "ceph"))]
    fn image_watchers(&self, _: &str, _: &str) -> Result<Vec<Watcher>, String> {
        Err(without("ceph"))
    }
}

fn volume(v: &t::Volume) -> Volume {
    Volume {
        name: v.name(),
        backend: v.backend(),
        access_mode: match v.access_mode() {
            t::AccessMode::ReadWriteOnce => AccessMode::ReadWriteOnce,
            t::AccessMode::ReadOnlyMany => AccessMode::ReadOnlyMany,
            t::AccessMode::ReadWriteMany => AccessMode::ReadWriteMany,
            t::AccessMode::ReadWriteOncePod => AccessMode::ReadWriteOncePod,
        },
        fs_type: v.fs_type(),
        mode: match v.mode() {
            t::VolumeMode::Filesystem => VolumeMode::Filesystem,
            t::VolumeMode::Block => VolumeMode::Block,
        },
        mount_flags: v.mount_flags(),
        options: v.options().into_iter().map(|(key, value)| KeyValue { key, value }).collect(),
        secret_keys: v.secret_keys(),
    }
}

fn consumer(c: &t::Consumer) -> Consumer {
    Consumer {
        node: c.node(),
        pod_namespace: c.pod_namespace(),
        pod: c.pod(),
        pod_uid: c.pod_uid(),
        mount_dir: c.mount_dir(),
        read_only: c.read_only(),
        mount_group: c.mount_group(),
    }
}

fn holders(hs: &[t::Consumer]) -> Vec<Holder> {
    hs.iter()
        .map(|c| Holder { consumer: consumer(c), since: c.since().unwrap_or_default() })
        .collect()
}

fn node(n: &t::Node) -> NodeFacts {
    NodeFacts {
        name: n.name(),
        exists: n.exists(),
        ready: n.ready(),
        out_of_service: n.out_of_service(),
    }
}

fn paths(p: &t::NodePaths) -> NodePaths {
    NodePaths {
        kubelet_root: p.kubelet_root(),
        staging_dir: p.staging_dir(),
        state_dir: p.state_dir(),
        discovery_dirs: p.discovery_dirs(),
    }
}

fn block_source(b: &BlockSource) -> t::BlockSource {
    match b {
        BlockSource::Attached(id) => t::BlockSource::Attached(id.clone()),
        BlockSource::Device(d) => t::BlockSource::Device(d.clone()),
    }
}

/// What a policy built without the SDK feature of a device interface gets
/// when it uses one anyway: a feature imports the interface, so a guest
/// imports only the interfaces of the devices it uses.
#[cfg_attr(all(feature = "ceph", feature = "nbd", feature = "loop-devices"), allow(dead_code))]
fn without(feature: &str) -> String {
    format!("the policy was built without the volagent-guest-sdk feature `{feature}`")
}

#[cfg(feature = "nbd")]
fn nbd_export(n: &NbdSpec) -> nbd::NbdExport {
    nbd::NbdExport {
        server: n.server.clone(),
        export_name: n.export_name.clone(),
        local_file: n.local_file.clone(),
        transport: match n.attach {
            NbdAttach::Auto => nbd::Transport::Auto,
            NbdAttach::Kernel => nbd::Transport::Kernel,
            NbdAttach::Userspace => nbd::Transport::Userspace,
        },
        connections: n.connections,
    }
}

#[cfg(feature = "ceph")]
fn rbd_image(r: &RbdSpec) -> ceph::Image {
    ceph::Image {
        monitors: r.monitors.clone(),
        pool: r.pool.clone(),
        image: r.image.clone(),
        user: r.user.clone(),
        secret_key: r.secret_key.clone(),
        attach: match r.attach {
            RbdAttach::Auto => ceph::RbdAttach::Auto,
            RbdAttach::Kernel => ceph::RbdAttach::Kernel,
            RbdAttach::Nbd => ceph::RbdAttach::Nbd,
            RbdAttach::Fuse => ceph::RbdAttach::Fuse,
        },
    }
}

/// `steps`, built into a host plan: each step by the host function of its
/// kind, a device step by its device's interface.
fn plan(steps: &[Step]) -> t::Plan {
    let p = t::Plan::new();
    for step in steps {
        match step {
            Step::AttachDevice(a) => devices::attach(&p, a),
            Step::DetachDevice(d) => devices::detach(&p, d),
            Step::Format(f) => p.format(
                &block_source(&f.device),
                &f.fs_type,
                match f.mode {
                    FormatMode::IfUnformatted => t::FormatMode::IfUnformatted,
                    FormatMode::Always => t::FormatMode::Always,
                },
            ),
            Step::Mount(m) => {
                let source = match &m.source {
                    MountSource::Block(b) => t::MountSource::Block(block_source(b)),
                    MountSource::Network(s) => t::MountSource::Network(s.clone()),
                };
                p.mount(&source, &m.target, &m.fs_type, &m.options, m.read_only);
            }
            Step::BindMount(b) => p.bind_mount(&b.source, &b.target, b.read_only),
            Step::Unmount(u) => p.unmount(&u.target, u.force),
            Step::Wipe(w) => p.wipe(
                &block_source(&w.device),
                match w.method {
                    WipeMethod::Signatures => t::WipeMethod::Signatures,
                    WipeMethod::Discard => t::WipeMethod::Discard,
                    WipeMethod::Zero => t::WipeMethod::Zero,
                    WipeMethod::Shred(n) => t::WipeMethod::Shred(n),
                },
            ),
            Step::ClearDirectory(c) => p.clear_directory(&c.path),
            Step::BlocklistClient(b) => devices::blocklist(&p, b),
            Step::PublishBlock(b) => {
                p.publish_block(&block_source(&b.device), &b.target, b.read_only);
            }
            Step::GrowFilesystem(g) => p.grow_filesystem(&g.target),
        }
    }
    p
}

/// Device steps, each by its device's interface, where the SDK was built
/// with it.
mod devices {
    use super::*;

    #[allow(unused_variables)] // `p`, built with none of the features
    pub fn attach(p: &t::Plan, a: &AttachDevice) {
        match &a.spec {
            #[cfg(feature = "loop-devices")]
            DeviceSpec::Loop(file) => loop_devices::attach(p, &a.id, file, a.read_only),
            #[cfg(feature = "nbd")]
            DeviceSpec::Nbd(n) => nbd::attach(p, &a.id, &nbd_export(n), a.read_only),
            #[cfg(feature = "ceph")]
            DeviceSpec::Rbd(r) => ceph::attach(p, &a.id, &rbd_image(r), a.read_only),
            #[allow(unreachable_patterns)]
            other => panic!("{}", without(other.kind().interface())),
        }
    }

    #[allow(unused_variables)]
    pub fn detach(p: &t::Plan, d: &DetachDevice) {
        match &d.spec {
            #[cfg(feature = "loop-devices")]
            DeviceSpec::Loop(file) => loop_devices::detach(p, file, d.force),
            #[cfg(feature = "nbd")]
            DeviceSpec::Nbd(n) => nbd::detach(p, &nbd_export(n), d.force),
            #[cfg(feature = "ceph")]
            DeviceSpec::Rbd(r) => ceph::detach(p, &rbd_image(r), d.force),
            #[allow(unreachable_patterns)]
            other => panic!("{}", without(other.kind().interface())),
        }
    }

    #[cfg(feature = "ceph")]
    pub fn blocklist(p: &t::Plan, b: &BlocklistClient) {
        ceph::blocklist_client(p, &b.monitors, &b.user, b.secret_key.as_deref(), &b.address);
    }

    #[cfg(not(feature = "ceph"))]
    pub fn blocklist(_: &t::Plan, _: &BlocklistClient) {
        panic!("{}", without("ceph"))
    }
}

fn error(e: PolicyError) -> t::PolicyError {
    match e {
        PolicyError::InvalidOptions(m) => t::PolicyError::InvalidOptions(m),
        PolicyError::Unsupported(m) => t::PolicyError::Unsupported(m),
    }
}

fn answer(r: Result<Plan, PolicyError>) -> Result<t::Plan, t::PolicyError> {
    r.map(|steps| plan(&steps)).map_err(error)
}

/// What [`crate::export_policy!`] calls: each export of the contract, in
/// the policy's plain values.
pub mod export {
    use super::*;

    pub fn info<P: Policy>() -> t::BackendInfo {
        let info = P::info();
        let caps = info.capabilities;
        t::BackendInfo {
            name: info.name,
            version: info.version,
            description: info.description,
            steps: caps.steps.iter().map(|k| k.name().to_string()).collect(),
            device_kinds: caps.device_kinds.iter().map(|k| k.name().to_string()).collect(),
            filesystems: caps.filesystems,
            network_filesystems: caps.network_filesystems,
            path_roots: caps.path_roots.iter().map(|r| r.name().to_string()).collect(),
        }
    }

    pub fn fence<P: Policy>(
        v: &t::Volume,
        requester: &t::Consumer,
        hs: Vec<t::Consumer>,
        nodes: Vec<t::Node>,
    ) -> Result<t::Decision, t::PolicyError> {
        let given = holders(&hs);
        let nodes = nodes.iter().map(node).collect();
        let decision = P::fence(&WasmHost, volume(v), consumer(requester), given.clone(), nodes)
            .map_err(error)?;
        Ok(match decision {
            Decision::Grant => t::Decision::Grant,
            Decision::Deny(why) => t::Decision::Deny(why),
            Decision::TakeOver(take) => t::Decision::TakeOver(t::TakeOver {
                // By place in the holders given; one not among them is
                // named past their end, and the host refuses the take-over.
                stale: take
                    .stale
                    .iter()
                    .map(|s| given.iter().position(|h| h == s).map_or(u32::MAX, |i| i as u32))
                    .collect(),
                fence_steps: plan(&take.fence_steps),
            }),
        })
    }

    pub fn attach<P: Policy>(
        v: &t::Volume,
        requester: &t::Consumer,
        local_holders: Vec<t::Consumer>,
        p: &t::NodePaths,
    ) -> Result<t::Plan, t::PolicyError> {
        answer(P::attach(
            &WasmHost,
            volume(v),
            consumer(requester),
            holders(&local_holders),
            paths(p),
        ))
    }

    pub fn detach<P: Policy>(
        v: &t::Volume,
        c: &t::Consumer,
        local_holders: Vec<t::Consumer>,
        p: &t::NodePaths,
    ) -> Result<t::Plan, t::PolicyError> {
        answer(P::detach(&WasmHost, volume(v), consumer(c), holders(&local_holders), paths(p)))
    }

    pub fn expand<P: Policy>(
        v: &t::Volume,
        c: &t::Consumer,
        p: &t::NodePaths,
    ) -> Result<t::Plan, t::PolicyError> {
        answer(P::expand(&WasmHost, volume(v), consumer(c), paths(p)))
    }

    pub fn condition<P: Policy>(
        v: &t::Volume,
        c: &t::Consumer,
        p: &t::NodePaths,
    ) -> Option<String> {
        P::condition(&WasmHost, volume(v), consumer(c), paths(p))
    }

    pub fn cleanup<P: Policy>(
        reason: t::CleanupReason,
        items: Vec<t::CleanupItem>,
    ) -> Result<t::Plan, t::PolicyError> {
        let reason = match reason {
            t::CleanupReason::StaleNode => CleanupReason::StaleNode,
            t::CleanupReason::StorageClusterDeleted => CleanupReason::StorageClusterDeleted,
            t::CleanupReason::LocalVolumeReleased => CleanupReason::LocalVolumeReleased,
        };
        let items = items
            .iter()
            .map(|i| CleanupItem {
                volume: volume(&i.volume),
                paths: paths(&i.paths),
                holders: holders(&i.holders),
            })
            .collect();
        answer(P::cleanup(&WasmHost, reason, items))
    }
}
