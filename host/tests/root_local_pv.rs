//! local-pv on real loop devices and mounts: the built local-pv component
//! plans, the host checks, the executor runs it. Needs root (CI is root).

use std::sync::Arc;
use volagent::exec::Executor;
use volagent::policy::*;
use volagent::sys::Sys;
use volagent_test_support::policy::*;
use volagent_test_support::scratch::RootScratch;

struct Setup {
    scratch: RootScratch,
    plugin: Plugin,
    volume: Volume,
    paths: NodePaths,
    facts: Arc<RecordedQueries>,
}

fn setup(fs: &str, mib: u64) -> Setup {
    let scratch = RootScratch::enter();
    let disks = scratch.path("disks");
    std::fs::create_dir_all(&disks).expect("disks dir");
    let image = scratch.image("disks/vol1.img", mib);
    let rt = runtime(2000);
    let plugin = load(&rt, volagent_test_artifacts::LOCAL_PV);
    let mut volume = volume("pv1", "local-pv");
    volume.fs_type = fs.into();
    volume.options = vec![
        KeyValue { key: "path".into(), value: image.display().to_string() },
        KeyValue { key: "node".into(), value: "n1".into() },
    ];
    let paths = NodePaths {
        kubelet_root: scratch.path("kubelet").display().to_string(),
        staging_dir: scratch
            .path("kubelet/plugins/volagent/local-pv/mounts/pv1")
            .display()
            .to_string(),
        state_dir: scratch.path("state/pv1").display().to_string(),
        discovery_dirs: vec![disks.display().to_string()],
    };
    let mut facts = RecordedQueries::default();
    facts.paths.insert(image.display().to_string(), PathKind::RegularFile);
    Setup { scratch, plugin, volume, paths, facts: Arc::new(facts) }
}

fn pod(s: &Setup, name: &str) -> Consumer {
    let mut c = consumer("n1", name, "local-pv", "pv1");
    c.mount_dir = s
        .scratch
        .path(&format!("kubelet/pods/uid-{name}/volumes/volagent~local-pv/pv1"))
        .display()
        .to_string();
    std::fs::create_dir_all(&c.mount_dir).expect("kubelet makes the pod dir");
    c
}

/// An executor acting beneath the setup's roots, as the agent's does.
fn executor(s: &Setup) -> Executor {
    let roots = volagent::sys::Roots::open(&[
        s.scratch.path("kubelet"),
        s.scratch.path("disks"),
        s.scratch.path("state"),
    ])
    .expect("roots");
    Executor::new(Sys::linux(roots, "volagent:n1", std::env::temp_dir().join("volagent-no-nbd")))
}

fn mount(s: &Setup, exec: &Executor, c: &Consumer, others: &[Holder]) {
    let plan =
        s.plugin.attach(s.facts.clone(), &s.volume, c, others, &s.paths).expect("attach plan");
    exec.run(&plan).unwrap_or_else(|e| panic!("{e}"));
}

fn unmount(s: &Setup, exec: &Executor, c: &Consumer, remaining: &[Holder]) {
    let plan =
        s.plugin.detach(s.facts.clone(), &s.volume, c, remaining, &s.paths).expect("detach plan");
    exec.run(&plan).unwrap_or_else(|e| panic!("{e}"));
}

fn round_trip(fs: &str, mib: u64) {
    let s = setup(fs, mib);
    let exec = executor(&s);
    let a = pod(&s, "a");
    mount(&s, &exec, &a, &[]);
    assert_eq!(s.scratch.loops().len(), 1);
    assert_eq!(s.scratch.mounts().len(), 2, "staging + pod bind");
    std::fs::write(format!("{}/hello", a.mount_dir), b"persisted")
        .expect("write through the pod's mount");
    // Idempotent: kubelet retrying the same mount changes nothing.
    mount(&s, &exec, &a, &[]);
    assert_eq!((s.scratch.loops().len(), s.scratch.mounts().len()), (1, 2));

    unmount(&s, &exec, &a, &[]);
    assert!(s.scratch.mounts().is_empty(), "{:?}", s.scratch.mounts());
    assert!(s.scratch.loops_left().is_empty(), "{:?}", s.scratch.loops());
    assert!(!std::path::Path::new(&s.paths.staging_dir).exists(), "staging dir removed");

    let b = pod(&s, "b");
    mount(&s, &exec, &b, &[]);
    let read = std::fs::read(format!("{}/hello", b.mount_dir)).expect("the data is back");
    assert_eq!(read, b"persisted");
    let probe = std::process::Command::new("blkid")
        .args(["-o", "value", "-s", "TYPE"])
        .arg(&s.scratch.loops()[0])
        .output()
        .expect("blkid");
    assert_eq!(String::from_utf8_lossy(&probe.stdout).trim(), fs);
    unmount(&s, &exec, &b, &[]);
    assert!(s.scratch.mounts().is_empty() && s.scratch.loops_left().is_empty());
}

#[test]
fn ext4_file_volume_round_trip() {
    round_trip("ext4", 64);
}

#[test]
fn xfs_file_volume_round_trip() {
    // mkfs.xfs refuses devices under 300 MB.
    round_trip("xfs", 320);
}

#[test]
fn two_pods_share_one_device_and_the_last_detaches_it() {
    let s = setup("ext4", 64);
    let exec = executor(&s);
    let (a, b) = (pod(&s, "a"), pod(&s, "b"));
    mount(&s, &exec, &a, &[]);
    mount(&s, &exec, &b, &[holder(&a)]);
    assert_eq!((s.scratch.loops().len(), s.scratch.mounts().len()), (1, 3));
    std::fs::write(format!("{}/x", a.mount_dir), b"shared").expect("write");
    assert_eq!(std::fs::read(format!("{}/x", b.mount_dir)).expect("read"), b"shared");
    unmount(&s, &exec, &a, &[holder(&b)]);
    assert_eq!((s.scratch.loops().len(), s.scratch.mounts().len()), (1, 2));
    unmount(&s, &exec, &b, &[]);
    assert!(s.scratch.mounts().is_empty() && s.scratch.loops_left().is_empty());
}

#[test]
fn a_failing_mount_rolls_back_its_loop_device() {
    let s = setup("ext4", 64);
    let exec = executor(&s);
    let a = pod(&s, "a");
    // The pod dir is a file: the bind mount (the last step) fails.
    std::fs::remove_dir(&a.mount_dir).expect("rmdir");
    std::fs::write(&a.mount_dir, b"not a dir").expect("file in the way");
    let plan = s.plugin.attach(s.facts.clone(), &s.volume, &a, &[], &s.paths).expect("plan");
    let err = exec.run(&plan).unwrap_err();
    assert_eq!(err.index, 3, "{err}");
    assert!(err.rollback_failures.is_empty(), "{err}");
    assert!(s.scratch.mounts().is_empty(), "{:?}", s.scratch.mounts());
    assert!(s.scratch.loops_left().is_empty(), "{:?}", s.scratch.loops());
}

#[test]
fn release_wipes_the_filesystem() {
    let s = setup("ext4", 64);
    let exec = executor(&s);
    let a = pod(&s, "a");
    mount(&s, &exec, &a, &[]);
    std::fs::write(format!("{}/secret", a.mount_dir), b"old tenant").expect("write");
    unmount(&s, &exec, &a, &[]);
    let item = CleanupItem { volume: s.volume.clone(), paths: s.paths.clone(), holders: vec![] };
    let plan = s
        .plugin
        .cleanup(s.facts.clone(), CleanupReason::LocalVolumeReleased, &[item])
        .expect("release plan");
    exec.run(&plan).unwrap_or_else(|e| panic!("{e}"));
    assert!(s.scratch.loops_left().is_empty());
    let b = pod(&s, "b");
    mount(&s, &exec, &b, &[]);
    assert!(
        !std::path::Path::new(&format!("{}/secret", b.mount_dir)).exists(),
        "a quick reset leaves a fresh filesystem"
    );
    unmount(&s, &exec, &b, &[]);
}

/// The mount options of the mount at `dir`.
fn flags_of(dir: &str) -> Vec<String> {
    let text = std::fs::read_to_string("/proc/thread-self/mountinfo").expect("mountinfo");
    let table = volagent::sys::mountinfo::parse(&text).expect("parse");
    let m =
        table.iter().rev().find(|m| m.mount_point == std::path::Path::new(dir)).expect("mounted");
    m.options.split(',').map(String::from).collect()
}

/// A read-only bind of a `noexec` staging mount is `ro,nosuid,nodev,noexec`:
/// its flags are set while it is detached, never lost to a remount.
#[test]
fn a_read_only_bind_keeps_nosuid_nodev_and_noexec() {
    let s = setup("ext4", 64);
    let exec = executor(&s);
    let a = pod(&s, "a");
    let dev = || BlockSource::Attached("dev".into());
    let plan = vec![
        Step::AttachDevice(AttachDevice {
            id: "dev".into(),
            spec: DeviceSpec::Loop(s.volume.options[0].value.clone()),
            read_only: false,
        }),
        Step::Format(Format {
            device: dev(),
            fs_type: "ext4".into(),
            mode: FormatMode::IfUnformatted,
        }),
        Step::Mount(Mount {
            source: MountSource::Block(dev()),
            target: s.paths.staging_dir.clone(),
            fs_type: "ext4".into(),
            options: vec!["noexec".into(), "noatime".into()],
            read_only: false,
        }),
        Step::BindMount(BindMount {
            source: s.paths.staging_dir.clone(),
            target: a.mount_dir.clone(),
            read_only: true,
        }),
    ];
    exec.run(&plan).unwrap_or_else(|e| panic!("{e}"));
    let staging = flags_of(&s.paths.staging_dir);
    for f in ["rw", "nosuid", "nodev", "noexec", "noatime"] {
        assert!(staging.contains(&f.to_string()), "{f} on the staging mount: {staging:?}");
    }
    let bind = flags_of(&a.mount_dir);
    for f in ["ro", "nosuid", "nodev", "noexec"] {
        assert!(bind.contains(&f.to_string()), "{f} on the read-only bind: {bind:?}");
    }
    unmount(&s, &exec, &a, &[]);
    assert!(s.scratch.mounts().is_empty() && s.scratch.loops_left().is_empty());
}

/// A block device in a discovery dir: a `mknod` node of a loop device the
/// test attached (as an admin would put a disk there).
fn disk_node(s: &Setup, name: &str, mib: u64) -> (std::path::PathBuf, String) {
    use std::os::unix::fs::MetadataExt;
    let image = s.scratch.image(&format!("{name}.img"), mib);
    let out = std::process::Command::new("losetup")
        .args(["-f", "--show"])
        .arg(&image)
        .output()
        .expect("losetup");
    let dev = String::from_utf8(out.stdout).expect("utf8").trim().to_string();
    let rdev = std::fs::metadata(&dev).expect("stat").rdev();
    let node = s.scratch.path(&format!("disks/{name}"));
    nix::sys::stat::mknod(
        &node,
        nix::sys::stat::SFlag::S_IFBLK,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
        rdev,
    )
    .expect("mknod");
    (node, dev)
}

/// Destroying data is exclusive: a wipe or re-format of a block device in a
/// discovery dir that is mounted (here, elsewhere) is refused and changes
/// nothing; once it is free, the same steps go through.
#[test]
fn a_mounted_devices_wipe_or_format_is_refused() {
    let s = setup("ext4", 64);
    let exec = executor(&s);
    let (node, dev) = disk_node(&s, "ssd0", 64);
    assert!(
        std::process::Command::new("mkfs.ext4")
            .args(["-F", "-q", &dev])
            .status()
            .expect("mkfs")
            .success()
    );
    let elsewhere = s.scratch.path("elsewhere");
    std::fs::create_dir_all(&elsewhere).expect("dir");
    nix::mount::mount(
        Some(dev.as_str()),
        &elsewhere,
        Some("ext4"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .expect("mount");
    std::fs::write(elsewhere.join("data"), b"in use").expect("write");
    let device = || BlockSource::Device(node.display().to_string());
    for step in [
        Step::Wipe(Wipe { device: device(), method: WipeMethod::Signatures }),
        Step::Wipe(Wipe { device: device(), method: WipeMethod::Zero }),
        Step::Wipe(Wipe { device: device(), method: WipeMethod::Discard }),
        Step::Wipe(Wipe { device: device(), method: WipeMethod::Shred(1) }),
        Step::Format(Format { device: device(), fs_type: "ext4".into(), mode: FormatMode::Always }),
    ] {
        let err = exec.run(std::slice::from_ref(&step)).unwrap_err();
        assert!(
            err.to_string()
                .contains("is in use (mounted, or held open exclusively by another program)"),
            "{err}"
        );
    }
    assert_eq!(std::fs::read(elsewhere.join("data")).expect("read"), b"in use", "nothing changed");
    nix::mount::umount2(&elsewhere, nix::mount::MntFlags::empty()).expect("unmount");
    exec.run(&[Step::Wipe(Wipe { device: device(), method: WipeMethod::Zero })])
        .unwrap_or_else(|e| panic!("{e}"));
    let head = std::fs::read(&dev).map(|b| b[..2048].iter().all(|x| *x == 0));
    assert!(head.expect("read the device"), "zeroed once free");
    let _ = std::process::Command::new("losetup").args(["-d", &dev]).status();
}

/// A block device reached through a symlink in a discovery dir (the way
/// `/dev/disk/by-id` links look) is not followed by any step.
#[test]
fn a_symlink_to_a_block_device_is_not_followed() {
    let s = setup("ext4", 64);
    let exec = executor(&s);
    let (node, dev) = disk_node(&s, "ssd1", 16);
    let link = s.scratch.path("disks/by-id-link");
    std::os::unix::fs::symlink(&node, &link).expect("symlink");
    let err = exec
        .run(&[Step::Format(Format {
            device: BlockSource::Device(link.display().to_string()),
            fs_type: "ext4".into(),
            mode: FormatMode::IfUnformatted,
        })])
        .unwrap_err();
    assert!(err.to_string().contains("symbolic link"), "{err}");
    let out = std::process::Command::new("blkid").args(["-p", &dev]).output().expect("blkid");
    assert_eq!(out.status.code(), Some(2), "nothing was made on it");
    let _ = std::process::Command::new("losetup").args(["-d", &dev]).status();
}

/// The loop devices someone else attached or moved since the last lookup.
fn losetup(args: &[&str]) -> String {
    let out = std::process::Command::new("losetup").args(args).output().expect("losetup");
    assert!(out.status.success(), "losetup {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn the_loop_index_sees_every_device_someone_else_attached_or_moved() {
    use volagent::sys::{Devices, LoopAttach};
    let scratch = RootScratch::enter();
    let dir = scratch.path("");
    let roots = volagent::sys::Roots::open(std::slice::from_ref(&dir)).expect("roots");
    let linux = volagent::sys::linux::Linux::new(roots, "volagent:index");
    let [a, b, c] = ["a.img", "b.img", "c.img"].map(|f| scratch.image(f, 4));
    let id = |f: &std::path::Path| linux.file_id(f).expect("stat").expect("there");
    let attach = |f: &std::path::Path| linux.loop_attach_or_reuse(f, false).expect("attach");
    // The agent's own first attach proves that the kernel's events are heard.
    let LoopAttach::Attached { device: mine, .. } = attach(&a) else { panic!("a reused device") };
    assert!(linux.loops_indexed(), "the kernel's event for the agent's own attach was heard");
    assert!(matches!(attach(&a), LoopAttach::Reused(d) if d == mine), "found again by its file");
    // Someone else's device over b, attached after the index was seeded, is b's.
    let theirs = losetup(&["-f", "--show", &b.display().to_string()]);
    assert!(matches!(attach(&b), LoopAttach::Reused(d) if d.display().to_string() == theirs));
    // The same device moved to c behind the index: found over c, not b.
    // (Its detach completes once udev's probe, if any, lets go of it.)
    losetup(&["-d", &theirs]);
    let c_path = c.display().to_string();
    volagent_test_support::wait_until(
        volagent_test_support::Deadline::within(std::time::Duration::from_secs(10)),
        "the detached device to be free for another file",
        || {
            std::process::Command::new("losetup")
                .args([&theirs, &c_path])
                .status()
                .is_ok_and(|s| s.success())
        },
    );
    let over_c = linux.loops_over(Some(id(&c)), &[]).expect("lookup");
    assert_eq!(
        over_c.iter().map(|l| l.device.display().to_string()).collect::<Vec<_>>(),
        std::slice::from_ref(&theirs)
    );
    assert!(linux.loops_over(Some(id(&b)), &[]).expect("lookup").is_empty(), "b has none now");
    let LoopAttach::Attached { device: b_own, .. } = attach(&b) else { panic!("b was reused") };
    // Detached: gone from the index, by file and by number.
    let number = linux.loops_over(Some(id(&a)), &[]).expect("lookup")[0].number;
    linux.loop_detach(&mine).expect("detach");
    volagent_test_support::wait_until(
        volagent_test_support::Deadline::within(std::time::Duration::from_secs(10)),
        "the detached device to be gone from the index, by file and by number",
        || linux.loops_over(Some(id(&a)), &[number]).expect("lookup").is_empty(),
    );
    assert!(linux.loops_indexed(), "still in use");
    for d in [b_own.display().to_string(), theirs] {
        losetup(&["-d", &d]);
    }
}
