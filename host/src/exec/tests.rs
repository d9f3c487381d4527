use super::*;
use crate::model::{AttachDevice, BindMount, DetachDevice, Format, Mount, Unmount, Wipe};
use crate::sys::fake::Fake;

const FILE: &str = "/mnt/disks/a.img";
const STAGING: &str = "/k/plugins/volagent/local-pv/mounts/pv";
const POD: &str = "/k/pods/u/volumes/volagent~local-pv/pv";

fn attach_plan() -> Vec<Step> {
    let dev = || BlockSource::Attached("dev".into());
    vec![
        Step::AttachDevice(AttachDevice {
            id: "dev".into(),
            spec: DeviceSpec::Loop(FILE.into()),
            read_only: false,
        }),
        Step::Format(Format {
            device: dev(),
            fs_type: "ext4".into(),
            mode: FormatMode::IfUnformatted,
        }),
        Step::Mount(Mount {
            source: MountSource::Block(dev()),
            target: STAGING.into(),
            fs_type: "ext4".into(),
            options: vec![],
            read_only: false,
        }),
        Step::BindMount(BindMount { source: STAGING.into(), target: POD.into(), read_only: false }),
    ]
}

fn detach_plan() -> Vec<Step> {
    vec![
        Step::Unmount(Unmount { target: POD.into(), force: false }),
        Step::Unmount(Unmount { target: STAGING.into(), force: false }),
        Step::DetachDevice(DetachDevice { spec: DeviceSpec::Loop(FILE.into()), force: false }),
    ]
}

fn node() -> (std::sync::Arc<Fake>, Executor) {
    let fake = Fake::new();
    fake.state().dirs.insert(POD.into()); // kubelet made it
    let exec = Executor::new(fake.sys());
    (fake, exec)
}

#[test]
fn attach_then_detach_leaves_nothing() {
    let (fake, exec) = node();
    let out = exec.run(&attach_plan()).unwrap();
    assert_eq!(out.devices["dev"], PathBuf::from("/dev/loop0"));
    {
        let s = fake.state();
        assert_eq!(s.mounts.len(), 2);
        assert_eq!(s.filesystems.get(Path::new("/dev/loop0")).map(String::as_str), Some("ext4"));
    }
    exec.run(&detach_plan()).unwrap();
    let s = fake.state();
    assert!(s.mounts.is_empty() && s.loops.is_empty(), "{s:?}");
    assert!(!s.dirs.contains(Path::new(STAGING)));
    // The filesystem stays on the file for the next mount.
    assert_eq!(s.filesystems.get(Path::new(FILE)).map(String::as_str), Some("ext4"));
}

#[test]
fn a_csi_stage_binds_nothing_onto_the_staging_dir_it_mounted() {
    let (fake, exec) = node();
    let mut plan = attach_plan();
    // CSI: the "pod" dir of a stage is its staging dir.
    plan[3] = Step::BindMount(BindMount {
        source: STAGING.into(),
        target: STAGING.into(),
        read_only: false,
    });
    exec.run(&plan).unwrap();
    let s = fake.state();
    assert_eq!(s.mounts.len(), 1, "{:?}", s.mounts);
    assert!(!s.log.iter().any(|op| op.starts_with("bind ")), "{:?}", s.log);
}

#[test]
fn a_rerun_is_idempotent() {
    let (fake, exec) = node();
    exec.run(&attach_plan()).unwrap();
    let before = fake.state().log.len();
    exec.run(&attach_plan()).unwrap();
    let s = fake.state();
    let new: Vec<&String> = s.log[before..].iter().collect();
    assert!(new.iter().all(|op| op.starts_with("probe ")), "a rerun must change nothing: {new:?}");
    assert_eq!((s.mounts.len(), s.loops.len()), (2, 1));
    drop(s);
    exec.run(&detach_plan()).unwrap();
    exec.run(&detach_plan()).unwrap();
}

#[test]
fn an_existing_filesystem_is_not_formatted_again() {
    let (fake, exec) = node();
    fake.state().filesystems.insert(FILE.into(), "ext4".into());
    exec.run(&attach_plan()).unwrap();
    assert!(!fake.state().log.iter().any(|op| op.starts_with("mkfs")));
}

#[test]
fn another_filesystem_is_refused_and_rolled_back() {
    let (fake, exec) = node();
    fake.state().filesystems.insert(FILE.into(), "xfs".into());
    let err = exec.run(&attach_plan()).unwrap_err();
    assert_eq!(err.index, 1);
    assert!(err.to_string().contains("already holds xfs, but the volume asks for ext4"), "{err}");
    assert!(err.to_string().contains("rolled back"), "{err}");
    assert!(fake.state().loops.is_empty());
}

#[test]
fn every_failing_step_rolls_back_the_ones_before() {
    for fail in ["loop-attach", "mkfs", &format!("mount {STAGING}"), &format!("bind {POD}")] {
        let (fake, exec) = node();
        fake.fail_next(fail);
        let err = exec.run(&attach_plan()).unwrap_err();
        assert!(err.rollback_failures.is_empty(), "{fail}: {err}");
        let s = fake.state();
        assert!(s.mounts.is_empty() && s.loops.is_empty(), "{fail}: left {s:?}");
        assert!(!s.dirs.contains(Path::new(STAGING)), "{fail}: staging dir left");
        assert!(s.dirs.contains(Path::new(POD)), "{fail}: kubelet's dir must stay");
    }
}

#[test]
fn a_failed_rollback_is_reported() {
    let (fake, exec) = node();
    fake.fail_next(&format!("bind {POD}"));
    fake.fail_next(&format!("unmount {STAGING}"));
    let err = exec.run(&attach_plan()).unwrap_err();
    assert_eq!(err.index, 3);
    assert_eq!(err.rollback_failures.len(), 1, "{err}");
    assert!(
        err.to_string().contains(&format!("rolling back left work undone: unmount {STAGING}")),
        "{err}"
    );
    // The loop device was still detached: rollback goes on past a failure.
    assert!(fake.state().loops.is_empty());
}

fn rbd_spec(secret_key: Option<&str>) -> crate::model::RbdSpec {
    crate::model::RbdSpec {
        monitors: vec!["10.0.0.1:6789".into(), "10.0.0.2:6789".into()],
        pool: "p".into(),
        image: "i".into(),
        user: "u".into(),
        secret_key: secret_key.map(Into::into),
        attach: crate::policy::RbdAttach::Auto,
    }
}

fn rbd_plans(secret_key: Option<&str>) -> (Vec<Step>, Vec<Step>) {
    let mut attach_steps = attach_plan();
    attach_steps[0] = Step::AttachDevice(AttachDevice {
        id: "dev".into(),
        spec: DeviceSpec::Rbd(rbd_spec(secret_key)),
        read_only: false,
    });
    let mut detach_steps = detach_plan();
    detach_steps[2] = Step::DetachDevice(DetachDevice {
        spec: DeviceSpec::Rbd(rbd_spec(secret_key)),
        force: false,
    });
    (attach_steps, detach_steps)
}

fn secrets(pairs: &[(&str, &str)]) -> Arc<crate::secret::Secrets> {
    Arc::new(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), crate::secret::Secret::new(v.as_bytes().to_vec())))
            .collect(),
    )
}

#[test]
fn an_rbd_image_is_served_by_a_helper_with_the_secrets_key_and_detached_whole() {
    let fake = Fake::new();
    fake.state().dirs.insert(POD.into());
    let exec = Executor::new(fake.sys()).with_secrets(secrets(&[("key", "AQBkey==")]));
    let (attach, detach) = rbd_plans(Some("key"));
    let key = rbd_key(&rbd_spec(None));
    exec.run(&attach).unwrap();
    {
        let s = fake.state();
        assert_eq!(
            s.rbd_servers.get(&key),
            Some(&("p/i".to_string(), Some("AQBkey==".to_string()), 5000))
        );
        assert_eq!(
            s.nbd_clients.get(&key).map(|c| c.0.as_str()),
            Some(format!("nbd+unix:///?socket=/fake-nbd/{key}.sock").as_str())
        );
        assert_eq!((s.loops.len(), s.mounts.len()), (1, 2));
    }
    exec.run(&attach).unwrap();
    assert_eq!(
        fake.state().log.iter().filter(|op| op.starts_with("nbd-serve-rbd")).count(),
        1,
        "a rerun reuses the device"
    );
    exec.run(&detach).unwrap();
    let s = fake.state();
    assert!(
        s.loops.is_empty()
            && s.mounts.is_empty()
            && s.nbd_clients.is_empty()
            && s.rbd_servers.is_empty(),
        "{s:?}"
    );
}

#[test]
fn where_the_kernel_has_rbd_an_image_is_mapped_by_it_and_unmapped_whole() {
    let fake = Fake::new();
    {
        let mut s = fake.state();
        s.dirs.insert(POD.into());
        s.krbd = true;
    }
    let exec = Executor::new(fake.sys()).with_secrets(secrets(&[("key", "AQBkey==")]));
    let (attach, detach) = rbd_plans(Some("key"));
    let outcome = exec.run(&attach).unwrap();
    assert_eq!(
        outcome.devices.get("dev").map(|d| d.display().to_string()).as_deref(),
        Some("/dev/rbd0")
    );
    assert_eq!(
        outcome.storage_clients,
        vec![(7000, "10.0.0.9:0/70".to_string())],
        "the kernel client goes to the ledger"
    );
    {
        let s = fake.state();
        assert_eq!(s.krbd_mappings.len(), 1);
        assert_eq!(s.krbd_mappings[0].monitors, "10.0.0.1:6789,10.0.0.2:6789");
        assert!(s.rbd_servers.is_empty() && s.loops.is_empty(), "no helper, no loop device: {s:?}");
    }
    exec.run(&attach).unwrap();
    assert_eq!(
        fake.state().log.iter().filter(|op| op.starts_with("krbd-map")).count(),
        1,
        "a rerun reuses the mapping"
    );
    exec.run(&detach).unwrap();
    assert!(fake.state().krbd_mappings.is_empty());
    // A failed mount unmaps what the plan mapped.
    fake.fail_next("mount ");
    assert!(exec.run(&attach).is_err());
    let s = fake.state();
    assert!(s.krbd_mappings.is_empty() && s.mounts.is_empty(), "{s:?}");
}

#[test]
fn an_admins_own_mapping_of_the_image_is_neither_reused_nor_unmapped() {
    let fake = Fake::new();
    {
        let mut s = fake.state();
        s.dirs.insert(POD.into());
        s.krbd = true;
        s.krbd_mappings.push(crate::sys::krbd::KernelMapping {
            id: 0,
            pool: "p".into(),
            image: "i".into(),
            monitors: "10.0.0.1:6789,10.0.0.2:6789".into(),
            client_id: 1,
            client_addr: "10.0.0.9:0/1".into(),
            device: "/dev/rbd0".into(),
            ours: false,
        });
    }
    let exec = Executor::new(fake.sys()).with_secrets(secrets(&[("key", "AQBkey==")]));
    let (attach, detach) = rbd_plans(Some("key"));
    exec.run(&attach).unwrap();
    exec.run(&detach).unwrap();
    let s = fake.state();
    assert_eq!(s.krbd_mappings.len(), 1);
    assert!(!s.krbd_mappings[0].ours);
    assert!(!s.log.iter().any(|op| op.starts_with("krbd-unmap")), "{:?}", s.log);
}

#[test]
fn without_the_kernel_driver_or_librbd_an_image_is_reached_through_rbd_fuse() {
    let fake = Fake::new();
    let key = rbd_key(&rbd_spec(None));
    {
        let mut s = fake.state();
        s.dirs.insert(POD.into());
        s.no_rbd_helper = true;
        s.rbd_fuse = true;
        // Another node's client watches the image already.
        s.rbd_watchers.insert("p/i".into(), vec![(4000, "10.0.0.2:0/40".into())]);
    }
    let exec = Executor::new(fake.sys()).with_secrets(secrets(&[("key", "AQBkey==")]));
    let (attach, detach) = rbd_plans(Some("key"));
    let outcome = exec.run(&attach).unwrap();
    assert_eq!(
        outcome.storage_clients,
        vec![(4100, "10.0.0.9:0/41".to_string())],
        "the watcher rbd-fuse added is its client"
    );
    {
        let s = fake.state();
        assert_eq!(s.rbd_fuse_clients.get(&key), Some(&("p/i".to_string(), false)));
        assert!(s.rbd_servers.is_empty(), "no helper: {s:?}");
        assert_eq!(s.loops.len(), 1);
        assert_eq!(s.loops[0].backing_file, Path::new("/fake-nbd").join(&key).join("i"));
    }
    exec.run(&attach).unwrap();
    assert_eq!(
        fake.state().log.iter().filter(|op| op.starts_with("rbd-fuse-connect")).count(),
        1,
        "a rerun reuses the device"
    );
    exec.run(&detach).unwrap();
    let s = fake.state();
    assert!(
        s.rbd_fuse_clients.is_empty()
            && s.loops.is_empty()
            && s.mounts.is_empty()
            && s.client_ids.is_empty(),
        "{s:?}"
    );
}

#[test]
fn a_volume_that_insists_on_a_path_the_node_lacks_is_refused_by_name() {
    let (fake, _) = node();
    for (attach, says) in [
        (crate::policy::RbdAttach::Kernel, "the kernel's rbd driver"),
        (crate::policy::RbdAttach::Fuse, "rbd-fuse (not installed)"),
    ] {
        let mut spec = rbd_spec(Some("key"));
        spec.attach = attach;
        let mut plan = rbd_plans(Some("key")).0;
        plan[0] = Step::AttachDevice(AttachDevice {
            id: "dev".into(),
            spec: DeviceSpec::Rbd(spec),
            read_only: false,
        });
        let exec = Executor::new(fake.sys()).with_secrets(secrets(&[("key", "AQBkey==")]));
        let err = exec.run(&plan).unwrap_err().to_string();
        assert!(err.contains("rbd image p/i") && err.contains(says), "{err}");
    }
    fake.state().no_rbd_helper = true;
    let exec = Executor::new(fake.sys()).with_secrets(secrets(&[("key", "AQBkey==")]));
    let err = exec.run(&rbd_plans(Some("key")).0).unwrap_err().to_string();
    assert!(err.contains("no way to map it"), "{err}");
    let s = fake.state();
    assert!(s.rbd_servers.is_empty() && s.loops.is_empty() && s.krbd_mappings.is_empty(), "{s:?}");
}

#[test]
fn an_rbd_key_names_the_image_of_a_cluster_whatever_order_its_monitors_come_in() {
    let mut other_order = rbd_spec(Some("key"));
    other_order.monitors.reverse();
    assert_eq!(rbd_key(&rbd_spec(None)), rbd_key(&other_order));
    let mut other_image = rbd_spec(None);
    other_image.image = "j".into();
    assert_ne!(rbd_key(&rbd_spec(None)), rbd_key(&other_image));
    assert!(rbd_key(&other_image).starts_with("export-"), "reconciliation sweeps export-* keys");
}

#[test]
fn an_rbd_attach_whose_secret_value_is_missing_or_not_a_key_starts_nothing() {
    let (fake, exec) = node();
    let err = exec.run(&rbd_plans(Some("key")).0).unwrap_err();
    assert!(err.to_string().contains("no value for key \"key\""), "{err}");
    let exec = Executor::new(fake.sys()).with_secrets(secrets(&[("key", "AQB=\n[client.admin]")]));
    let err = exec.run(&rbd_plans(Some("key")).0).unwrap_err();
    assert!(err.to_string().contains("does not hold a Ceph key"), "{err}");
    assert!(!err.to_string().contains("client.admin"), "the value is never quoted: {err}");
    let s = fake.state();
    assert!(s.rbd_servers.is_empty() && s.loops.is_empty(), "{s:?}");
}

#[test]
fn a_failed_mount_of_an_rbd_image_stops_its_helper() {
    let fake = Fake::new();
    fake.state().dirs.insert(POD.into());
    let exec = Executor::new(fake.sys()).with_secrets(secrets(&[("key", "AQBkey==")]));
    fake.fail_next("mount ");
    assert!(exec.run(&rbd_plans(Some("key")).0).is_err());
    let s = fake.state();
    assert!(s.rbd_servers.is_empty() && s.nbd_clients.is_empty() && s.loops.is_empty(), "{s:?}");
}

#[test]
fn blocklisting_uses_the_secrets_key_and_names_the_client() {
    let fake = Fake::new();
    let exec = Executor::new(fake.sys()).with_secrets(secrets(&[("admin", "AQBadmin==")]));
    let step = |key: &str| {
        [Step::BlocklistClient(crate::model::BlocklistClient {
            monitors: vec!["10.0.0.1:6789".into()],
            user: "admin".into(),
            secret_key: Some(key.into()),
            address: "10.0.0.7:0/123".into(),
        })]
    };
    exec.run(&step("admin")).unwrap();
    assert_eq!(
        fake.state().blocklisted,
        vec![("10.0.0.7:0/123".to_string(), Some("AQBadmin==".to_string()))]
    );
    fake.fail_next("blocklist");
    let err = exec.run(&step("admin")).unwrap_err();
    assert!(err.to_string().contains("10.0.0.7:0/123"), "{err}");
    assert!(exec.run(&step("nope")).unwrap_err().to_string().contains("no value for key"));
}

#[test]
fn a_device_this_plan_attached_is_probed_through_its_file_until_written_to() {
    let (fake, exec) = node();
    fake.state().filesystems.insert(FILE.into(), "ext4".into());
    exec.run(&attach_plan()).unwrap();
    assert!(fake.state().log.contains(&format!("probe {FILE}")), "{:?}", fake.state().log);
    exec.run(&detach_plan()).unwrap();

    // Once a step has written through the device, the device itself is
    // probed: its bytes may no longer be the file's.
    let dev = || BlockSource::Attached("dev".into());
    let mut plan = attach_plan();
    plan.insert(1, Step::Wipe(Wipe { device: dev(), method: WipeMethod::Signatures }));
    exec.run(&plan).unwrap();
    let s = fake.state();
    let probes: Vec<&String> = s.log.iter().filter(|op| op.starts_with("probe ")).collect();
    assert_eq!(probes.last().map(|p| p.as_str()), Some("probe /dev/loop0"), "{probes:?}");
    assert!(
        s.log.iter().any(|op| op == "mkfs /dev/loop0"),
        "the wiped device gets a filesystem: {:?}",
        s.log
    );
}

#[test]
fn a_detach_frees_the_volumes_device_even_when_its_path_is_a_symlink_now() {
    let (fake, exec) = node();
    exec.run(&attach_plan()).unwrap();
    fake.state().links.insert(FILE.into());
    exec.run(&detach_plan()).unwrap();
    let s = fake.state();
    assert!(s.loops.is_empty(), "the device the plan unmounted was detached: {:?}", s.loops);
    assert!(s.mounts.is_empty());
}

#[test]
fn a_detach_leaves_other_agents_devices_alone() {
    let (fake, exec) = node();
    exec.run(&attach_plan()).unwrap();
    // As if another agent on this machine had attached it.
    fake.state().loops[0].tag = "volagent:someone-else".into();
    fake.state().links.insert(FILE.into());
    exec.run(&detach_plan()).unwrap();
    assert_eq!(fake.state().loops.len(), 1, "not this agent's to detach");
}

fn nbd_spec(attach: NbdAttach) -> NbdSpec {
    NbdSpec {
        server: "unix:/run/nbd.sock".into(),
        export_name: "disk0".into(),
        local_file: None,
        attach,
        connections: 2,
    }
}

fn nbd_plans(attach: NbdAttach) -> (Vec<Step>, Vec<Step>) {
    let mut attach_steps = attach_plan();
    attach_steps[0] = Step::AttachDevice(AttachDevice {
        id: "dev".into(),
        spec: DeviceSpec::Nbd(nbd_spec(attach)),
        read_only: false,
    });
    let mut detach_steps = detach_plan();
    detach_steps[2] =
        Step::DetachDevice(DetachDevice { spec: DeviceSpec::Nbd(nbd_spec(attach)), force: false });
    (attach_steps, detach_steps)
}

#[test]
fn an_nbd_export_is_attached_through_a_userspace_client_and_detached_whole() {
    let (fake, exec) = node();
    let (attach, detach) = nbd_plans(NbdAttach::Auto);
    let key = nbd_key(&nbd_spec(NbdAttach::Auto));
    let file = Path::new("/fake-nbd").join(&key).join(&key);
    exec.run(&attach).unwrap();
    {
        let s = fake.state();
        assert_eq!(
            s.nbd_clients.get(&key),
            Some(&("nbd+unix:///disk0?socket=/run/nbd.sock".to_string(), false))
        );
        assert_eq!(s.loops.len(), 1);
        assert_eq!(s.loops[0].backing_file, file);
        assert_eq!(s.mounts.len(), 2);
    }
    // A rerun finds the device over the client's file: nothing new.
    exec.run(&attach).unwrap();
    assert_eq!(fake.state().log.iter().filter(|op| op.starts_with("nbd-connect")).count(), 1);
    exec.run(&detach).unwrap();
    let s = fake.state();
    assert!(s.loops.is_empty() && s.mounts.is_empty() && s.nbd_clients.is_empty(), "{s:?}");
    let tail: Vec<&String> = s.log.iter().rev().take(4).collect();
    assert!(
        tail[3].starts_with("loop-detach")
            && tail[2].starts_with("nbd-disconnect")
            && tail[1].starts_with("nbd-kernel-disconnect")
            && tail[0].starts_with("nbd-stop-serving"),
        "the loop goes before its client (and any helper server last): {tail:?}"
    );
}

#[test]
fn a_failed_nbd_attach_rolls_back_the_client_too() {
    let (fake, exec) = node();
    let (attach, _) = nbd_plans(NbdAttach::Userspace);
    fake.fail_next(&format!("mount {STAGING}"));
    exec.run(&attach).unwrap_err();
    let s = fake.state();
    assert!(s.loops.is_empty() && s.nbd_clients.is_empty(), "{s:?}");
}

#[test]
fn the_kernel_attach_path_is_refused_where_it_is_not_available() {
    let (fake, exec) = node();
    let (attach, _) = nbd_plans(NbdAttach::Kernel);
    let err = exec.run(&attach).unwrap_err();
    assert!(
        err.to_string().contains("kernel's nbd driver, which this node does not have"),
        "{err}"
    );
    assert!(fake.state().nbd_clients.is_empty());
}

#[test]
fn where_the_kernel_has_nbd_an_export_is_attached_through_it_and_detached_whole() {
    let (fake, exec) = node();
    fake.state().nbd_kernel_driver = true;
    let (attach, detach) = nbd_plans(NbdAttach::Auto);
    let key = nbd_key(&nbd_spec(NbdAttach::Auto));
    exec.run(&attach).unwrap();
    {
        let s = fake.state();
        assert_eq!(
            s.nbd_kernel.get(&key),
            Some(&("/dev/nbd0".into(), "unix:/run/nbd.sock".into(), "disk0".into(), false))
        );
        assert!(s.loops.is_empty() && s.nbd_clients.is_empty(), "no userspace pieces: {s:?}");
        assert!(
            s.mounts.iter().any(|m| m.source == "/dev/nbd0" && m.mount_point == Path::new(STAGING)),
            "{:?}",
            s.mounts
        );
    }
    // A rerun finds the connected device: nothing new.
    exec.run(&attach).unwrap();
    assert_eq!(
        fake.state().log.iter().filter(|op| op.starts_with("nbd-kernel-connect")).count(),
        1
    );
    exec.run(&detach).unwrap();
    let s = fake.state();
    assert!(s.nbd_kernel.is_empty() && s.mounts.is_empty(), "{s:?}");
}

#[test]
fn a_volume_that_asks_for_userspace_gets_it_even_where_the_kernel_has_nbd() {
    let (fake, exec) = node();
    fake.state().nbd_kernel_driver = true;
    let (attach, _) = nbd_plans(NbdAttach::Userspace);
    exec.run(&attach).unwrap();
    let s = fake.state();
    assert!(s.nbd_kernel.is_empty() && s.nbd_clients.len() == 1 && s.loops.len() == 1, "{s:?}");
}

#[test]
fn a_failed_mount_disconnects_the_kernel_device_it_connected() {
    let (fake, exec) = node();
    fake.state().nbd_kernel_driver = true;
    let (attach, _) = nbd_plans(NbdAttach::Kernel);
    fake.fail_next(&format!("mount {STAGING}"));
    exec.run(&attach).unwrap_err();
    let s = fake.state();
    assert!(s.nbd_kernel.is_empty() && s.mounts.is_empty(), "{s:?}");
    assert!(s.log.iter().any(|op| op.starts_with("nbd-kernel-disconnect")), "{:?}", s.log);
}

#[test]
fn a_local_file_reaches_the_kernel_device_through_the_helper_server() {
    let (fake, exec) = node();
    fake.state().nbd_kernel_driver = true;
    fake.state().files.insert(FILE.into());
    let spec = NbdSpec {
        server: String::new(),
        export_name: String::new(),
        local_file: Some(FILE.into()),
        attach: NbdAttach::Auto,
        connections: 1,
    };
    let key = nbd_key(&spec);
    let mut attach = attach_plan();
    attach[0] = Step::AttachDevice(AttachDevice {
        id: "dev".into(),
        spec: DeviceSpec::Nbd(spec),
        read_only: false,
    });
    exec.run(&attach).unwrap();
    let s = fake.state();
    assert_eq!(s.nbd_servers.get(&key), Some(&false));
    assert_eq!(
        s.nbd_kernel.get(&key).map(|c| (c.1.clone(), c.2.clone())),
        Some((format!("unix:/fake-nbd/{key}.sock"), String::new()))
    );
}

#[test]
fn a_local_file_is_served_by_a_helper_and_attached_through_it() {
    let (fake, exec) = node();
    fake.state().files.insert(FILE.into());
    let spec = NbdSpec {
        server: String::new(),
        export_name: String::new(),
        local_file: Some(FILE.into()),
        attach: NbdAttach::Auto,
        connections: 1,
    };
    let key = nbd_key(&spec);
    let mut attach = attach_plan();
    attach[0] = Step::AttachDevice(AttachDevice {
        id: "dev".into(),
        spec: DeviceSpec::Nbd(spec.clone()),
        read_only: false,
    });
    exec.run(&attach).unwrap();
    {
        let s = fake.state();
        assert_eq!(s.nbd_servers.get(&key), Some(&false));
        let socket = format!("/fake-nbd/{key}.sock");
        assert_eq!(
            s.nbd_clients.get(&key).map(|c| c.0.clone()),
            Some(format!("nbd+unix:///?socket={socket}"))
        );
        assert!(
            s.log.iter().any(|op| op == &format!("open {FILE}")),
            "the file is opened beneath the roots by the agent"
        );
    }
    let mut detach = detach_plan();
    detach[2] =
        Step::DetachDevice(DetachDevice { spec: DeviceSpec::Nbd(spec.clone()), force: false });
    exec.run(&detach).unwrap();
    let s = fake.state();
    assert!(s.nbd_servers.is_empty() && s.nbd_clients.is_empty() && s.loops.is_empty(), "{s:?}");
    assert!(
        s.log.last().is_some_and(|op| op.starts_with("nbd-stop-serving")),
        "the server goes last: {:?}",
        s.log
    );
}

#[test]
fn a_missing_local_file_starts_nothing() {
    let (fake, exec) = node();
    let spec = NbdSpec {
        server: String::new(),
        export_name: String::new(),
        local_file: Some(FILE.into()),
        attach: NbdAttach::Auto,
        connections: 1,
    };
    let mut attach = attach_plan();
    attach[0] = Step::AttachDevice(AttachDevice {
        id: "dev".into(),
        spec: DeviceSpec::Nbd(spec),
        read_only: false,
    });
    let err = exec.run(&attach).unwrap_err();
    assert!(err.to_string().contains(FILE), "{err}");
    let s = fake.state();
    assert!(s.nbd_servers.is_empty() && s.nbd_clients.is_empty());
}

#[test]
fn only_plans_on_local_disks_run_locally() {
    let ext4 = Some("ext4");
    assert!(runs_locally(ext4, &attach_plan()) && runs_locally(ext4, &detach_plan()));
    assert!(runs_locally(
        Some("xfs"),
        &[Step::BindMount(BindMount {
            source: STAGING.into(),
            target: POD.into(),
            read_only: true
        })]
    ));
    assert!(
        runs_locally(None, &[Step::Unmount(Unmount { target: POD.into(), force: false })]),
        "a raw block volume's"
    );
    // A network filesystem's volume, one that names no filesystem (a
    // gluster PV's), or a forced unmount (of a dead one).
    assert!(!runs_locally(Some("glusterfs"), &detach_plan()));
    assert!(!runs_locally(
        Some(""),
        &[Step::Unmount(Unmount { target: POD.into(), force: false })]
    ));
    assert!(!runs_locally(ext4, &[Step::Unmount(Unmount { target: POD.into(), force: true })]));
    // Devices served over the network.
    let (nbd_attach, nbd_detach) = nbd_plans(NbdAttach::Auto);
    assert!(!runs_locally(ext4, &nbd_attach) && !runs_locally(ext4, &nbd_detach));
    let rbd = Step::AttachDevice(AttachDevice {
        id: "dev".into(),
        spec: DeviceSpec::Rbd(rbd_spec(None)),
        read_only: false,
    });
    assert!(!runs_locally(ext4, &[rbd]));
    let mount = |source: &str, fs: &str| {
        Step::Mount(Mount {
            source: MountSource::Block(BlockSource::Device(source.into())),
            target: STAGING.into(),
            fs_type: fs.into(),
            options: vec![],
            read_only: false,
        })
    };
    assert!(runs_locally(ext4, &[mount("/dev/sdb", "ext4")]));
    assert!(
        !runs_locally(ext4, &[mount("/dev/nbd0", "ext4")])
            && !runs_locally(ext4, &[mount("/dev/rbd0", "ext4")])
    );
    assert!(!runs_locally(ext4, &[mount("/dev/sdb", "nfs")]));
    // Steps that run tools over a whole device or a dir tree.
    let wipe = Step::Wipe(Wipe {
        device: BlockSource::Device("/dev/sdb".into()),
        method: WipeMethod::Zero,
    });
    assert!(!runs_locally(ext4, &[wipe]));
}
