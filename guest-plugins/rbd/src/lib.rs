//! rbd: Ceph RBD images, mapped on the node, formatted if needed, mounted.
//!
//! Options: `monitors` (comma-separated "host:port"; required unless the
//! volume names a StorageCluster, whose endpoints the host passes as
//! `endpoints`, and whose parameters as options), `pool`
//! (default "rbd"), `image` (required), `user` (default "admin"), `secretKey`
//! (the key name in the volume's secret holding the user's key; default "key"
//! when the secret has one, else the node's keyring), `attach` (how the
//! node maps the image: `auto` — the default — takes the kernel's rbd
//! driver where the node has it, else the agent's NBD server on librbd,
//! else rbd-fuse; `kernel`, `nbd` or `fuse` insist on one).
//!
//! Fencing adds two rules to the standard ones: an exclusive volume is denied
//! while the image has watchers on another node, and a take-over blocklists
//! the old clients first.

use volagent_guest_sdk::staged::{Medium, Staged, StagedBackend};
use volagent_guest_sdk::{
    AccessMode, BlocklistClient, Consumer, Decision, DeviceKind, DeviceSpec, Holder, Host,
    NodeFacts, PolicyError, RbdAttach, RbdSpec, Step, StepKind, Volume, Watcher, fence, options,
};

mod provisioner;

pub struct Rbd;

volagent_guest_sdk::export_policy!(crate::Rbd, provisioner);

/// The image a volume names, from its options.
pub fn image_spec(volume: &Volume) -> Result<RbdSpec, PolicyError> {
    let mut monitors = options::list(volume, "monitors");
    if monitors.is_empty() {
        // The StorageCluster the volume names: the host passes its endpoints.
        monitors = options::list(volume, "endpoints");
    }
    if monitors.is_empty() {
        return Err(PolicyError::InvalidOptions(format!(
            "volume {}: option \"monitors\" is required (comma-separated host:port), unless the volume names a StorageCluster with endpoints",
            volume.name
        )));
    }
    let secret_key = match options::get(volume, "secretKey") {
        Some(key) if volume.secret_keys.iter().any(|k| k == key) => Some(key.to_string()),
        Some(key) => {
            return Err(PolicyError::InvalidOptions(format!(
                "volume {}: secretKey \"{key}\" is not a key of the volume's secret (keys: {})",
                volume.name,
                volume.secret_keys.join(", ")
            )));
        }
        None => volume.secret_keys.iter().find(|k| *k == "key").cloned(),
    };
    let attach = options::choice(
        volume,
        "attach",
        RbdAttach::Auto,
        &[
            ("auto", RbdAttach::Auto),
            ("kernel", RbdAttach::Kernel),
            ("nbd", RbdAttach::Nbd),
            ("fuse", RbdAttach::Fuse),
        ],
    )?;
    Ok(RbdSpec {
        monitors,
        pool: options::get(volume, "pool").unwrap_or("rbd").to_string(),
        image: options::required(volume, "image")?.to_string(),
        user: options::get(volume, "user").unwrap_or("admin").to_string(),
        secret_key,
        attach,
    })
}

fn exclusive(mode: AccessMode) -> bool {
    matches!(mode, AccessMode::ReadWriteOnce | AccessMode::ReadWriteOncePod)
}

fn describe_watcher(w: &Watcher) -> String {
    match &w.node {
        Some(node) => format!("{} ({}) on node {node}", w.client, w.address),
        None => format!("{} ({}) on a node volagent does not know", w.client, w.address),
    }
}

impl StagedBackend for Rbd {
    const NAME: &'static str = "rbd";
    const VERSION: &'static str = env!("CARGO_PKG_VERSION");
    const DESCRIPTION: &'static str =
        "Ceph RBD images: map, format if needed, mount; blocklists stale clients";
    const MEDIUM: Medium = Medium::Block { device: DeviceKind::Rbd, filesystems: &["ext4", "xfs"] };
    const FENCE_STEPS: &'static [StepKind] = &[StepKind::BlocklistClient];

    fn stage(volume: &Volume) -> Result<Staged, PolicyError> {
        Ok(Staged::Block(DeviceSpec::Rbd(image_spec(volume)?)))
    }

    fn fence(
        host: &dyn Host,
        volume: &Volume,
        requester: &Consumer,
        holders: &[Holder],
        nodes: &[NodeFacts],
    ) -> Result<Decision, PolicyError> {
        let spec = image_spec(volume)?;
        let decision = fence::standard(&volume.name, volume.access_mode, requester, holders, nodes);
        if !exclusive(volume.access_mode) || matches!(decision, Decision::Deny(_)) {
            return Ok(decision);
        }
        let image = format!("{}/{}", spec.pool, spec.image);
        let watchers = match host.image_watchers(&spec.pool, &spec.image) {
            Ok(w) => w,
            // Fail closed: without the watcher list we cannot tell who writes.
            Err(e) => {
                return Ok(Decision::Deny(format!(
                    "volume {}: cannot list the watchers of image {image}: {e}",
                    volume.name
                )));
            }
        };
        let foreign: Vec<&Watcher> = watchers
            .iter()
            .filter(|w| w.node.as_deref() != Some(requester.node.as_str()))
            .collect();
        match decision {
            Decision::TakeOver(mut take) => {
                // Only clients of the gone holders' nodes are cut off. A
                // watcher anywhere else (a live node, or one we cannot place)
                // may be a healthy writer: deny rather than fence it.
                let stale_nodes: Vec<&str> =
                    take.stale.iter().map(|h| h.consumer.node.as_str()).collect();
                let (stale, other): (Vec<&Watcher>, Vec<&Watcher>) = foreign
                    .into_iter()
                    .partition(|w| w.node.as_deref().is_some_and(|n| stale_nodes.contains(&n)));
                if let Some(w) = other.first() {
                    return Ok(Decision::Deny(format!(
                        "volume {}: image {image} is in use by watcher {}, which is not a client of the gone holder's node",
                        volume.name,
                        describe_watcher(w)
                    )));
                }
                for w in &stale {
                    host.log(
                        volagent_guest_sdk::LogLevel::Warn,
                        &format!("blocklisting {} before taking over {image}", describe_watcher(w)),
                    );
                }
                take.fence_steps = stale
                    .into_iter()
                    .map(|w| {
                        Step::BlocklistClient(BlocklistClient {
                            monitors: spec.monitors.clone(),
                            user: spec.user.clone(),
                            secret_key: spec.secret_key.clone(),
                            address: w.address.clone(),
                        })
                    })
                    .collect();
                Ok(Decision::TakeOver(take))
            }
            grant => match foreign.first() {
                Some(w) => Ok(Decision::Deny(format!(
                    "volume {} ({}): image {image} is in use by watcher {}",
                    volume.name,
                    volagent_guest_sdk::mode_name(volume.access_mode),
                    describe_watcher(w)
                ))),
                None => Ok(grant),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use volagent_guest_sdk::fake::{FakeHost, consumer, holder, live_node};
    use volagent_guest_sdk::{CleanupItem, CleanupReason, KeyValue, NodePaths, Policy};

    fn volume(mode: AccessMode) -> Volume {
        Volume {
            name: "pv1".into(),
            backend: "rbd".into(),
            access_mode: mode,
            fs_type: "xfs".into(),
            mode: volagent_guest_sdk::VolumeMode::Filesystem,
            mount_flags: Vec::new(),
            options: [
                ("monitors", "10.0.0.1:6789,10.0.0.2:6789"),
                ("pool", "kube"),
                ("image", "img1"),
            ]
            .into_iter()
            .map(|(k, v)| KeyValue { key: k.into(), value: v.into() })
            .collect(),
            secret_keys: vec!["key".into()],
        }
    }

    fn watcher(node: Option<&str>, addr: &str) -> Watcher {
        Watcher { address: addr.into(), client: "client.4100".into(), node: node.map(Into::into) }
    }

    fn host(watchers: Result<Vec<Watcher>, String>) -> FakeHost {
        let mut h = FakeHost::default();
        h.watchers.insert("kube/img1".into(), watchers);
        h
    }

    #[test]
    fn spec_comes_from_options_with_defaults() {
        let s = image_spec(&volume(AccessMode::ReadWriteOnce)).unwrap();
        assert_eq!(s.monitors, vec!["10.0.0.1:6789", "10.0.0.2:6789"]);
        assert_eq!((s.pool.as_str(), s.image.as_str(), s.user.as_str()), ("kube", "img1", "admin"));
        assert_eq!(s.secret_key.as_deref(), Some("key"));
        assert_eq!(s.attach, RbdAttach::Auto);
        for (name, attach) in
            [("kernel", RbdAttach::Kernel), ("nbd", RbdAttach::Nbd), ("fuse", RbdAttach::Fuse)]
        {
            let mut v = volume(AccessMode::ReadWriteOnce);
            v.options.push(KeyValue { key: "attach".into(), value: name.into() });
            assert_eq!(image_spec(&v).unwrap().attach, attach);
        }
        let mut v = volume(AccessMode::ReadWriteOnce);
        v.options.push(KeyValue { key: "attach".into(), value: "krbd".into() });
        assert!(
            matches!(image_spec(&v), Err(PolicyError::InvalidOptions(m)) if m.contains("\"krbd\" is not auto, kernel, nbd or fuse"))
        );
        let mut v = volume(AccessMode::ReadWriteOnce);
        v.options.retain(|kv| kv.key != "image");
        assert!(
            matches!(image_spec(&v), Err(PolicyError::InvalidOptions(m)) if m.contains("\"image\""))
        );
        let mut v = volume(AccessMode::ReadWriteOnce);
        v.options.push(KeyValue { key: "secretKey".into(), value: "nope".into() });
        assert!(
            matches!(image_spec(&v), Err(PolicyError::InvalidOptions(m)) if m.contains("nope"))
        );
        // A StorageCluster's endpoints stand in for monitors.
        let mut v = volume(AccessMode::ReadWriteOnce);
        v.options.retain(|kv| kv.key != "monitors");
        assert!(
            matches!(image_spec(&v), Err(PolicyError::InvalidOptions(m)) if m.contains("\"monitors\""))
        );
        v.options.push(KeyValue { key: "endpoints".into(), value: "10.0.0.3:6789".into() });
        assert_eq!(image_spec(&v).unwrap().monitors, vec!["10.0.0.3:6789"]);
    }

    #[test]
    fn foreign_watcher_denies_an_exclusive_volume() {
        let h = host(Ok(vec![watcher(Some("n9"), "10.0.0.9:0/1")]));
        let d = <Rbd as Policy>::fence(
            &h,
            volume(AccessMode::ReadWriteOnce),
            consumer("n1", "a"),
            vec![],
            vec![live_node("n1")],
        )
        .unwrap();
        assert!(
            matches!(&d, Decision::Deny(r) if r.contains("node n9") && r.contains("kube/img1")),
            "{d:?}"
        );
        // Our own node's watcher is fine.
        let h = host(Ok(vec![watcher(Some("n1"), "10.0.0.1:0/1")]));
        let d = <Rbd as Policy>::fence(
            &h,
            volume(AccessMode::ReadWriteOnce),
            consumer("n1", "a"),
            vec![],
            vec![],
        )
        .unwrap();
        assert_eq!(d, Decision::Grant);
        // RWX does not care.
        let h = host(Ok(vec![watcher(Some("n9"), "10.0.0.9:0/1")]));
        let d = <Rbd as Policy>::fence(
            &h,
            volume(AccessMode::ReadWriteMany),
            consumer("n1", "a"),
            vec![],
            vec![],
        )
        .unwrap();
        assert_eq!(d, Decision::Grant);
    }

    #[test]
    fn unknown_watchers_fail_closed() {
        let d = <Rbd as Policy>::fence(
            &host(Err("timed out".into())),
            volume(AccessMode::ReadWriteOnce),
            consumer("n1", "a"),
            vec![],
            vec![],
        )
        .unwrap();
        assert!(matches!(&d, Decision::Deny(r) if r.contains("timed out")));
    }

    #[test]
    fn takeover_blocklists_the_old_client_first() {
        let old = consumer("n2", "old");
        let h = host(Ok(vec![
            watcher(Some("n2"), "10.0.0.2:0/77"),
            watcher(Some("n1"), "10.0.0.1:0/5"),
        ]));
        let gone =
            NodeFacts { name: "n2".into(), exists: false, ready: false, out_of_service: false };
        let d = <Rbd as Policy>::fence(
            &h,
            volume(AccessMode::ReadWriteOnce),
            consumer("n1", "new"),
            vec![holder(&old)],
            vec![gone, live_node("n1")],
        )
        .unwrap();
        let Decision::TakeOver(t) = d else { panic!("expected take-over, got {d:?}") };
        assert_eq!(t.stale, vec![holder(&old)]);
        assert!(
            matches!(t.fence_steps.as_slice(), [Step::BlocklistClient(b)] if b.address == "10.0.0.2:0/77")
        );
        // A watcher on a live third node during a take-over: deny, never fence it.
        let h3 = host(Ok(vec![
            watcher(Some("n2"), "10.0.0.2:0/77"),
            watcher(Some("n3"), "10.0.0.3:0/9"),
        ]));
        let gone =
            NodeFacts { name: "n2".into(), exists: false, ready: false, out_of_service: false };
        let d = <Rbd as Policy>::fence(
            &h3,
            volume(AccessMode::ReadWriteOnce),
            consumer("n1", "new"),
            vec![holder(&old)],
            vec![gone.clone(), live_node("n1"), live_node("n3")],
        )
        .unwrap();
        assert!(
            matches!(&d, Decision::Deny(r) if r.contains("node n3") && r.contains("not a client of the gone holder")),
            "{d:?}"
        );
        // A watcher we cannot place: deny too.
        let h4 = host(Ok(vec![watcher(None, "10.0.0.8:0/1")]));
        let d = <Rbd as Policy>::fence(
            &h4,
            volume(AccessMode::ReadWriteOnce),
            consumer("n1", "new"),
            vec![holder(&old)],
            vec![gone, live_node("n1")],
        )
        .unwrap();
        assert!(matches!(d, Decision::Deny(_)), "{d:?}");
        // A live old node: never taken over.
        let d = <Rbd as Policy>::fence(
            &h,
            volume(AccessMode::ReadWriteOnce),
            consumer("n1", "new"),
            vec![holder(&old)],
            vec![live_node("n2")],
        )
        .unwrap();
        assert!(matches!(d, Decision::Deny(r) if r.contains("pod default/old on node n2")));
    }

    #[test]
    fn cluster_deletion_forces_unmount_and_unmap() {
        let item = CleanupItem {
            volume: volume(AccessMode::ReadWriteOnce),
            paths: NodePaths {
                kubelet_root: "/var/lib/kubelet".into(),
                staging_dir: "/var/lib/kubelet/plugins/volagent/rbd/mounts/pv1".into(),
                state_dir: "/var/lib/volagent/volumes/pv1".into(),
                discovery_dirs: vec![],
            },
            holders: vec![holder(&consumer("n1", "a"))],
        };
        let plan =
            Rbd::cleanup(&FakeHost::default(), CleanupReason::StorageClusterDeleted, vec![item])
                .unwrap();
        assert_eq!(plan.len(), 3);
        assert!(plan.iter().all(|s| match s {
            Step::Unmount(u) => u.force,
            Step::DetachDevice(d) =>
                d.force && matches!(&d.spec, DeviceSpec::Rbd(r) if r.image == "img1"),
            _ => false,
        }));
    }

    #[test]
    fn attach_maps_formats_mounts_and_binds() {
        let paths = NodePaths {
            kubelet_root: "/k".into(),
            staging_dir: "/k/plugins/volagent/rbd/mounts/pv1".into(),
            state_dir: "/s".into(),
            discovery_dirs: vec![],
        };
        let plan = Rbd::attach(
            &FakeHost::default(),
            volume(AccessMode::ReadWriteOnce),
            consumer("n1", "a"),
            vec![],
            paths,
        )
        .unwrap();
        let kinds: Vec<&str> = plan
            .iter()
            .map(|s| match s {
                Step::AttachDevice(_) => "attach",
                Step::Format(f) if f.fs_type == "xfs" => "format-xfs",
                Step::Mount(_) => "mount",
                Step::BindMount(_) => "bind",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, ["attach", "format-xfs", "mount", "bind"]);
    }
}
