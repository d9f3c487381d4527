//! The trust boundaries of a standalone agent, tried as a hostile pod's
//! author would: symlinks in a discovery dir (planted, and swapped while
//! mounts run), another pod's volume by name, a discovery dir as a volume,
//! host queries on FIFOs and hung FUSE mounts, oversized guest answers,
//! file descriptor exhaustion, RAID members, damaged state and foreign loop
//! devices. Every refusal must be clear and change nothing. Needs root.

use serde_json::Value;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use volagent_test_support::agent::Node;
use volagent_test_support::driver::{assert_failure, assert_success, kubelet_options, run_driver};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// The options of pod `pod` (uid `uid-<pod>`) mounting `volume` from `path`.
fn options(volume: &str, pod: &str, path: &str) -> Value {
    kubelet_options(volume, pod, &format!("uid-{pod}"), "ext4", path)
}

/// What blkid's full probe finds on `file`, if anything.
fn signature(file: &Path) -> Option<String> {
    let out = Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE"])
        .arg(file)
        .output()
        .expect("blkid");
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!text.is_empty()).then_some(text)
}

/// What of `dir` is in use: mounts at or of it (a bind of it shows its
/// path as the mount's root: the scratch dir is on the root filesystem),
/// and loop devices over files in it.
fn mounts_of(node: &Node, dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string("/proc/thread-self/mountinfo").expect("mountinfo");
    let mut used: Vec<String> = volagent::sys::mountinfo::parse(&text)
        .expect("parse")
        .into_iter()
        .filter(|m| {
            m.root.starts_with(dir)
                || m.mount_point.starts_with(dir)
                || m.source.starts_with(&dir.display().to_string())
        })
        .map(|m| format!("mount {} (root {})", m.mount_point.display(), m.root.display()))
        .collect();
    let linux = volagent::sys::linux::Linux::unrooted();
    for l in volagent::sys::Devices::loop_devices(&linux).expect("loop devices") {
        if l.backing_file.starts_with(dir) {
            used.push(format!("loop {} over {}", l.device.display(), l.backing_file.display()));
        }
    }
    let _ = node;
    used
}

fn nothing_mounted(node: &Node) {
    assert!(node.scratch.mounts().is_empty(), "mounts left: {:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "loop devices left: {:?}", node.scratch.loops());
}

/// A symlink in a discovery dir — to a dir outside, to an image outside,
/// through an intermediate dir, to a block device — is never followed:
/// each mount is refused and nothing outside is mounted, formatted or
/// attached.
#[test]
fn symlinks_in_a_discovery_dir_are_never_followed() {
    let node = Node::start(VOLAGENT);
    let outside = node.scratch.path("outside");
    std::fs::create_dir_all(&outside).expect("dir");
    std::fs::write(outside.join("secret"), b"the host's").expect("write");
    let victim = node.scratch.image("outside/victim.img", 64);
    let disks = node.scratch.path("disks");
    symlink(&outside, disks.join("etc-link")).expect("symlink");
    symlink(&victim, disks.join("img-link")).expect("symlink");
    symlink(&outside, disks.join("sub")).expect("symlink");
    symlink("/etc", disks.join("real-etc")).expect("symlink");
    // A loop device nobody told the agent about, linked into the disks.
    let dev = String::from_utf8(
        Command::new("losetup")
            .args(["-f", "--show"])
            .arg(&victim)
            .output()
            .expect("losetup")
            .stdout,
    )
    .expect("utf8");
    let dev = dev.trim().to_string();
    symlink(&dev, disks.join("blk-link")).expect("symlink");

    for (i, path) in
        ["etc-link", "real-etc", "img-link", "sub/victim.img", "blk-link"].iter().enumerate()
    {
        let volume = format!("pv{i}");
        let dir = node.mount_dir(&format!("uid-{i}"), &volume);
        let r = node.mount(
            &dir,
            &kubelet_options(
                &volume,
                &format!("p{i}"),
                &format!("uid-{i}"),
                "ext4",
                &disks.join(path).display().to_string(),
            ),
        );
        assert_failure(&r, "neither a regular file, a block device nor a directory");
        // Only the foreign device, which nothing here attached.
        let used: Vec<String> = mounts_of(&node, &outside)
            .into_iter()
            .filter(|u| !u.starts_with(&format!("loop {dev} ")))
            .collect();
        assert!(used.is_empty(), "{path}: something outside got used: {used:?}");
        assert!(mounts_of(&node, Path::new("/etc")).is_empty(), "{path}: /etc got mounted");
    }
    assert_eq!(signature(&victim), None, "nothing was formatted outside");
    assert_eq!(std::fs::read(outside.join("secret")).expect("read"), b"the host's");
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    let _ = Command::new("losetup").args(["-d", &dev]).status();
}

/// A directory volume's path flips between a real dir and a symlink to a
/// dir outside, as fast as it can, while mounts run: every mount either
/// gets the real dir or is refused, and nothing outside is ever mounted.
/// The same for a file volume flipping to an image outside: nothing
/// outside is attached or formatted.
#[test]
fn a_symlink_swapped_during_mounts_never_leads_outside() {
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    let node = Node::start(VOLAGENT);
    let disks = node.scratch.path("disks");
    let outside = node.scratch.path("outside");
    std::fs::create_dir_all(outside.join("dir")).expect("dir");
    std::fs::write(outside.join("dir/marker"), b"OUTSIDE").expect("write");
    let victim = node.scratch.image("outside/victim.img", 64);
    // "flip" and "flip-other" trade places: a real dir and a symlink out.
    std::fs::create_dir_all(disks.join("flip")).expect("dir");
    std::fs::write(disks.join("flip/marker"), b"inside").expect("write");
    symlink(outside.join("dir"), disks.join("flip-other")).expect("symlink");
    // The same for a file: a real image and a symlink to one outside.
    node.scratch.image("disks/flipimg", 64);
    assert!(
        Command::new("mkfs.ext4")
            .args(["-F", "-q"])
            .arg(disks.join("flipimg"))
            .status()
            .expect("mkfs")
            .success()
    );
    symlink(&victim, disks.join("flipimg-other")).expect("symlink");

    /// Stops the flipper however the rounds end (a failed assertion too).
    struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (mut granted, mut refused) = (0, 0);
    std::thread::scope(|s| {
        let _stop = Stop(&stop);
        s.spawn(|| {
            let mut flips = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for (a, b) in [("flip", "flip-other"), ("flipimg", "flipimg-other")] {
                    renameat2(
                        AT_FDCWD,
                        &disks.join(a),
                        AT_FDCWD,
                        &disks.join(b),
                        RenameFlags::RENAME_EXCHANGE,
                    )
                    .expect("exchange");
                }
                flips += 1;
            }
            assert!(flips > 100, "the flipper ran ({flips} flips)");
        });
        for round in 0..40 {
            for (volume, path) in [("pv-dir", "flip"), ("pv-file", "flipimg")] {
                let uid = format!("uid-{volume}-{round}");
                let dir = node.mount_dir(&uid, volume);
                let r = node.mount(
                    &dir,
                    &kubelet_options(
                        volume,
                        "p",
                        &uid,
                        "ext4",
                        &disks.join(path).display().to_string(),
                    ),
                );
                assert!(
                    mounts_of(&node, &outside).is_empty(),
                    "round {round}: something outside got mounted: {}",
                    r.1
                );
                if r.0 == 0 {
                    granted += 1;
                    if volume == "pv-dir" {
                        assert_eq!(
                            std::fs::read(format!("{dir}/marker")).expect("marker"),
                            b"inside",
                            "round {round}"
                        );
                    }
                    // While the image's path is a symlink, its loop device
                    // cannot be found by it: the unmount fails, clearly, and
                    // kubelet's retry finishes it.
                    let mut tries = 0;
                    loop {
                        let r = node.driver(&["unmount", &dir]);
                        if r.0 == 0 {
                            break;
                        }
                        assert_failure(
                            &r,
                            "is or passes through a symbolic link, which the agent does not follow",
                        );
                        tries += 1;
                        assert!(tries < 200, "round {round}: the unmount never got through");
                    }
                } else {
                    refused += 1;
                }
            }
        }
    });
    eprintln!("granted {granted}, refused {refused}");
    assert!(granted > 0, "some mounts got the real dir or image");
    assert_eq!(signature(&victim), None, "the image outside was never formatted");
    assert_eq!(std::fs::read(outside.join("dir/marker")).expect("marker"), b"OUTSIDE");
    nothing_mounted(&node);
}

/// A second pod (another namespace, another UID) naming the first one's
/// volume with a source of its own gets nothing of the first one's; the
/// same source on the same node is the volume, and is shared. Another
/// volume name over the same file does not get its mounted filesystem.
#[test]
fn a_second_pod_cannot_take_a_volume_by_naming_it() {
    let node = Node::start(VOLAGENT);
    let image = node.image("a.img", 64);
    let a = node.mount_dir("uid-a", "pv1");
    assert_success(&node.mount(&a, &options("pv1", "a", &image)));
    std::fs::write(format!("{a}/secret"), b"tenant a").expect("write");

    let b = node.mount_dir("uid-b", "pv1");
    let mut other =
        options("pv1", "b", &node.scratch.path("disks/missing.img").display().to_string());
    other["kubernetes.io/pod.namespace"] = Value::from("other");
    assert_failure(&node.mount(&b, &other), "volume pv1 is in use with another source");
    let mut xfs = options("pv1", "b", &image);
    xfs["kubernetes.io/fsType"] = Value::from("xfs");
    assert_failure(&node.mount(&b, &xfs), "volume pv1 is in use with another source");
    assert!(std::fs::read_dir(&b).expect("b's dir").next().is_none(), "b's dir got nothing");
    assert_eq!(node.scratch.mounts().len(), 2, "a's staging and pod mounts only");

    // The same volume (name and source): a second pod on the node shares it.
    let a2 = node.mount_dir("uid-a2", "pv1");
    assert_success(&node.mount(&a2, &options("pv1", "a2", &image)));
    // Another name for the same file: refused, the device serves pv1.
    let c = node.mount_dir("uid-c", "pv2");
    assert_failure(&node.mount(&c, &options("pv2", "c", &image)), "one device serves one volume");
    assert_eq!(node.scratch.mounts().len(), 3);

    // A request whose dir is another volume's.
    let wrong = node.mount_dir("uid-d", "pv3");
    assert_failure(
        &node.mount(&wrong, &options("pv1", "d", &image)),
        "does not match the mount dir's last component",
    );

    assert_success(&node.driver(&["unmount", &a2]));
    assert_success(&node.driver(&["unmount", &a]));
    nothing_mounted(&node);
}

/// A discovery dir is never a volume, however it is spelled.
#[test]
fn a_discovery_dir_is_never_a_volume() {
    let node = Node::start(VOLAGENT);
    let disks = node.scratch.path("disks");
    std::fs::create_dir_all(disks.join("vol")).expect("dir");
    let dir = node.mount_dir("uid-a", "pv1");
    let r = node.mount(&dir, &options("pv1", "a", &disks.display().to_string()));
    assert_failure(&r, "outside the dirs this backend may ask about");
    let r = node.mount(&dir, &options("pv1", "a", &format!("{}/", disks.display())));
    assert_failure(&r, "outside the dirs this backend may ask about");
    let r = node.mount(&dir, &options("pv1", "a", &format!("{}/vol/..", disks.display())));
    assert_failure(&r, "outside the dirs this backend may ask about");
    nothing_mounted(&node);
    // A dir below it is a volume.
    assert_success(
        &node.mount(&dir, &options("pv1", "a", &disks.join("vol").display().to_string())),
    );
    assert_success(&node.driver(&["unmount", &dir]));
    nothing_mounted(&node);
}

/// Mount a FUSE filesystem at `at` whose daemon never answers: every lookup
/// below it blocks until the returned device handle is closed.
fn hung_fuse(at: &Path) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let dev =
        std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse").expect("/dev/fuse");
    std::fs::create_dir_all(at).expect("dir");
    let data = format!("fd={},rootmode=40000,user_id=0,group_id=0", dev.as_raw_fd());
    nix::mount::mount(
        Some("hung"),
        at,
        Some("fuse"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        Some(data.as_str()),
    )
    .expect("mount a FUSE filesystem");
    dev
}

/// A host query on a FIFO does not block (nothing is opened), and one on a
/// hung FUSE mount fails the guest's call at its deadline; the agent goes
/// on serving, and the stuck lookup ends when the mount is aborted.
#[test]
fn host_queries_on_a_fifo_or_a_hung_fuse_mount_fail_in_time() {
    let node = Node::start(VOLAGENT);
    let disks = node.scratch.path("disks");
    nix::unistd::mkfifo(&disks.join("fifo.img"), nix::sys::stat::Mode::from_bits_truncate(0o600))
        .expect("mkfifo");
    let dir = node.mount_dir("uid-a", "pv1");
    let start = Instant::now();
    let r = node.mount(&dir, &options("pv1", "a", &disks.join("fifo.img").display().to_string()));
    assert_failure(&r, "neither a regular file, a block device nor a directory");
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());

    let fuse = hung_fuse(&disks.join("hung"));
    let start = Instant::now();
    let r =
        node.mount(&dir, &options("pv1", "a", &disks.join("hung/vol.img").display().to_string()));
    assert_failure(&r, "lookup-path");
    assert_failure(&r, "no answer within 500 ms");
    assert!(start.elapsed() < Duration::from_secs(5), "failed in time: {:?}", start.elapsed());
    // The in-place answer asks nothing of the hung server: its mount's
    // root is known without it, what is below it is not answered there.
    let (tx, rx) = std::sync::mpsc::channel();
    let hung = disks.join("hung");
    let roots = volagent::sys::Roots::open(std::slice::from_ref(&disks)).expect("roots");
    std::thread::spawn(move || {
        use volagent::sys::{Devices, Kind};
        let linux = volagent::sys::linux::Linux::new(roots, "volagent:trust");
        let root = linux.kind_of_cached(&hung).map(|r| r.map_err(|e| e.to_string()));
        let below =
            linux.kind_of_cached(&hung.join("vol.img")).map(|r| r.map_err(|e| e.to_string()));
        let _ = tx.send((root == Some(Ok(Some(Kind::Dir))), below));
    });
    let (root_known, below) = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("an in-place lookup waited on the hung server");
    assert!(root_known, "the FUSE mount's root is a dir the kernel knows");
    assert_eq!(below, None, "a path below the hung mount is left to a query thread");
    // The agent serves on.
    assert_eq!(node.driver(&["init"]).0, 0);
    let image = node.image("ok.img", 64);
    assert_success(&node.mount(&dir, &options("pv1", "a", &image)));
    assert_success(&node.driver(&["unmount", &dir]));
    // Aborting the connection ends the stuck lookup.
    drop(fuse);
    nix::mount::umount2(&disks.join("hung"), nix::mount::MntFlags::MNT_DETACH)
        .expect("unmount the FUSE mount");
    nothing_mounted(&node);
}

/// A guest that refuses with a 2 MiB message gets a reply of bounded size
/// (kubelet gets one JSON object), and the agent serves on.
#[test]
fn a_two_mib_error_from_a_guest_still_gets_a_reply() {
    let node = Node::start_with(VOLAGENT, &[(volagent_test_artifacts::MISBEHAVE, "misbehave")]);
    let dir = node.mount_dir_of("node-a", "misbehave", "uid-a", "huge-error");
    let opts = kubelet_options("huge-error", "a", "uid-a", "ext4", "/x");
    let r = run_driver(Command::new(node.driver_of("node-a", "misbehave")).args([
        "mount",
        &dir,
        &opts.to_string(),
    ]));
    assert_failure(&r, "invalid options: xxxx");
    let message = r.1["message"].as_str().expect("message");
    assert!(message.len() <= volagent::ops::MAX_MESSAGE, "{} bytes", message.len());
    assert!(message.ends_with("bytes cut)"), "{}", &message[message.len() - 60..]);
    // A guest asking about a path outside its roots fails its own call.
    let dir = node.mount_dir_of("node-a", "misbehave", "uid-a", "ask-etc");
    let opts = kubelet_options("ask-etc", "a", "uid-a", "ext4", "/x");
    let r = run_driver(Command::new(node.driver_of("node-a", "misbehave")).args([
        "mount",
        &dir,
        &opts.to_string(),
    ]));
    assert_failure(&r, "lookup-path /etc/shadow: outside the dirs this backend may ask about");
    assert_eq!(node.driver(&["init"]).0, 0);
}

/// With the agent out of file descriptors, both listeners (the socket and
/// the metrics endpoint) pause instead of failing, and serve again once
/// descriptors are back.
#[test]
fn both_listeners_survive_running_out_of_file_descriptors() {
    use std::io::{Read, Write};
    let mut node = Node::start(VOLAGENT);
    node.stop_agent();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a free port")
        .local_addr()
        .expect("addr")
        .port();
    let metrics = format!("127.0.0.1:{port}");
    node.spawn_agent_env("node-a", &[], &["--metrics-addr", &metrics]);
    let pid = node.pid_of("node-a");
    let open_fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fds").count();
    // Room for one more descriptor: the next accepts fail with EMFILE.
    let limit = |soft: usize| {
        assert!(
            Command::new("prlimit")
                .arg(format!("--pid={pid}"))
                .arg(format!("--nofile={soft}:"))
                .status()
                .expect("prlimit")
                .success()
        );
    };
    limit(open_fds + 1);
    let held: Vec<std::os::unix::net::UnixStream> = (0..8)
        .map(|_| std::os::unix::net::UnixStream::connect(&node.socket).expect("connect"))
        .collect();
    let tcp: Vec<std::net::TcpStream> =
        (0..8).map(|_| std::net::TcpStream::connect(&metrics).expect("connect")).collect();
    let log = node.log_path("node-a");
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("agent socket: cannot accept a connection")
            && text.contains("metrics endpoint: cannot accept a connection")
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "both accept loops must hit EMFILE; log:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(held);
    drop(tcp);
    limit(4096);
    // Both serve again.
    assert_eq!(node.driver(&["init"]).0, 0);
    let mut s = std::net::TcpStream::connect(&metrics).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").expect("send");
    let mut reply = String::new();
    s.read_to_string(&mut reply).expect("read");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(text.contains("accepting connections again"), "{text}");
}

/// A read-only pod keeps `ro,nosuid,nodev`; a read-write one `nosuid,nodev`.
#[test]
fn binds_keep_their_safety_flags() {
    let node = Node::start(VOLAGENT);
    let image = node.image("a.img", 64);
    let (rw, ro) = (node.mount_dir("uid-rw", "pv1"), node.mount_dir("uid-ro", "pv1"));
    assert_success(&node.mount(&rw, &options("pv1", "rw", &image)));
    let mut reader = options("pv1", "ro", &image);
    reader["kubernetes.io/readwrite"] = Value::from("ro");
    assert_success(&node.mount(&ro, &reader));
    let text = std::fs::read_to_string("/proc/thread-self/mountinfo").expect("mountinfo");
    let table = volagent::sys::mountinfo::parse(&text).expect("parse");
    let flags = |dir: &str| -> Vec<String> {
        let m = table.iter().rev().find(|m| m.mount_point == Path::new(dir)).expect("mounted");
        m.options.split(',').map(String::from).collect()
    };
    for f in ["ro", "nosuid", "nodev"] {
        assert!(flags(&ro).contains(&f.to_string()), "{f} on the read-only bind: {:?}", flags(&ro));
    }
    for f in ["rw", "nosuid", "nodev"] {
        assert!(
            flags(&rw).contains(&f.to_string()),
            "{f} on the read-write bind: {:?}",
            flags(&rw)
        );
    }
    assert!(std::fs::write(format!("{ro}/x"), b"x").is_err(), "the read-only pod cannot write");
    assert_success(&node.driver(&["unmount", &ro]));
    assert_success(&node.driver(&["unmount", &rw]));
    nothing_mounted(&node);
}

/// An md 1.0 superblock (at the end of the device) at `image`'s end.
fn write_md_1_0_superblock(image: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(image).expect("open");
    let size = f.metadata().expect("size").len();
    let at = (size & !0xfff) - 0x2000;
    let mut sb = [0u8; 256];
    let put32 =
        |sb: &mut [u8; 256], off: usize, v: u32| sb[off..off + 4].copy_from_slice(&v.to_le_bytes());
    put32(&mut sb, 0, 0xa92b4efc); // magic
    put32(&mut sb, 4, 1); // major version
    put32(&mut sb, 72, 1); // level: raid1
    put32(&mut sb, 92, 2); // raid disks
    sb[144..152].copy_from_slice(&(at >> 9).to_le_bytes()); // super_offset, in sectors
    let sum: u64 = (0..256)
        .step_by(4)
        .filter(|i| *i != 216)
        .map(|i| u64::from(u32::from_le_bytes(sb[i..i + 4].try_into().expect("4 bytes"))))
        .sum();
    let csum = ((sum & 0xffff_ffff) + (sum >> 32)) as u32;
    put32(&mut sb, 216, csum);
    f.write_all_at(&sb, at).expect("write the superblock");
}

/// A RAID member — blank at its start, or holding the array's ext4 there
/// as a RAID 1 member does — is never formatted nor mounted: its superblock
/// at the end says what it is.
#[test]
fn an_md_1_0_member_is_not_formatted_or_mounted() {
    let node = Node::start(VOLAGENT);
    let blank = node.image("blank-member.img", 64);
    write_md_1_0_superblock(Path::new(&blank));
    let ext4 = node.image("ext4-member.img", 64);
    assert!(Command::new("mkfs.ext4").args(["-F", "-q", &ext4]).status().expect("mkfs").success());
    write_md_1_0_superblock(Path::new(&ext4));
    for (volume, image) in [("pv1", &blank), ("pv2", &ext4)] {
        assert_eq!(signature(Path::new(image)).as_deref(), Some("linux_raid_member"));
        let dir = node.mount_dir("uid-a", volume);
        assert_failure(
            &node.mount(&dir, &options(volume, "a", image)),
            "already holds linux_raid_member",
        );
        assert_eq!(
            signature(Path::new(image)).as_deref(),
            Some("linux_raid_member"),
            "{volume}: untouched"
        );
    }
    nothing_mounted(&node);
}

/// A stash entry that cannot be decoded is set aside, not fatal; the pod's
/// unmount then comes from the ledger's record and leaves nothing behind.
/// A stash lost altogether strands no pod either.
#[test]
fn damaged_or_lost_stash_entries_strand_no_pod() {
    let mut node = Node::start(VOLAGENT);
    let (one, two) = (node.image("one.img", 64), node.image("two.img", 64));
    let (a, b) = (node.mount_dir("uid-a", "pv1"), node.mount_dir("uid-b", "pv2"));
    assert_success(&node.mount(&a, &options("pv1", "a", &one)));
    assert_success(&node.mount(&b, &options("pv2", "b", &two)));
    node.stop_agent();
    let stash_path = node.scratch.path("node-a/run/stash");
    {
        let stash = volagent::ops::mount_records::MountRecords::open(&stash_path).expect("stash");
        stash.put_raw(&a, b"{\"volume\": garbage").expect("damage a's entry");
    }
    node.spawn_agent("node-a");
    assert_eq!(node.scratch.mounts().len(), 4, "reconciliation left both volumes mounted");
    assert_success(&node.driver(&["unmount", &a]));
    assert_eq!(node.scratch.mounts().len(), 2, "only pv2 is left");
    let log = std::fs::read_to_string(node.log_path("node-a")).expect("log");
    assert!(log.contains("undecodable stash entry quarantined"), "{log}");

    // The whole stash gone (not a reboot: the mounts stay).
    node.stop_agent();
    std::fs::remove_dir_all(&stash_path).expect("lose the stash");
    node.spawn_agent("node-a");
    assert_eq!(node.scratch.mounts().len(), 2, "pv2 stays mounted for its pod");
    assert_success(&node.driver(&["unmount", &b]));
    nothing_mounted(&node);
}

/// A loop device the agent did not attach — over a file in its discovery
/// dir, mounted nowhere — is left alone by the start-up sweep.
#[test]
fn a_foreign_loop_device_is_kept() {
    let mut node = Node::start(VOLAGENT);
    let image = node.image("admin.img", 16);
    let dev = String::from_utf8(
        Command::new("losetup").args(["-f", "--show", &image]).output().expect("losetup").stdout,
    )
    .expect("utf8");
    let dev = dev.trim().to_string();
    node.stop_agent();
    node.spawn_agent("node-a");
    assert_eq!(node.scratch.loops(), [PathBuf::from(&dev)], "the admin's device is still attached");
    let _ = Command::new("losetup").args(["-d", &dev]).status();
}

/// A loop device someone else attached over a volume's file (an admin's
/// losetup) is the one the volume is mounted from: a second device over
/// the file would put a second filesystem instance on the same bytes.
#[test]
fn a_volume_whose_file_has_a_loop_device_is_mounted_from_that_device() {
    use std::os::unix::fs::MetadataExt;
    let node = Node::start(VOLAGENT);
    let image = node.image("shared.img", 64);
    let out = Command::new("losetup").args(["-f", "--show"]).arg(&image).output().expect("losetup");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dev = PathBuf::from(String::from_utf8(out.stdout).expect("utf8").trim());
    let dir = node.mount_dir("uid-a", "pv1");
    let mounted = node.mount(&dir, &options("pv1", "a", &image));
    let seen = (
        node.scratch.loops(),
        std::fs::metadata(&dir).map(|m| m.dev()),
        std::fs::metadata(&dev).map(|m| m.rdev()),
    );
    let unmounted = node.driver(&["unmount", &dir]);
    let _ = Command::new("losetup").arg("-d").arg(&dev).status();
    assert_success(&mounted);
    assert_eq!(seen.0, std::slice::from_ref(&dev), "one device over the file");
    assert_eq!(
        seen.1.expect("stat the pod dir"),
        seen.2.expect("stat the device"),
        "the pod dir is the filesystem on {}",
        dev.display()
    );
    assert_success(&unmounted);
    nothing_mounted(&node);
}

/// The listing by status (for lookups by identity or tag) finds what the
/// full listing finds, the backing files' paths aside.
#[test]
fn loop_devices_by_status_are_the_full_listing_without_paths() {
    use volagent::sys::{Devices, LoopStatus};
    let node = Node::start(VOLAGENT);
    let images = [node.image("s1.img", 4), node.image("s2.img", 4)];
    let devices: Vec<PathBuf> = images
        .iter()
        .map(|image| {
            let out = Command::new("losetup")
                .args(["-f", "--show"])
                .arg(image)
                .output()
                .expect("losetup");
            assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
            PathBuf::from(String::from_utf8(out.stdout).expect("utf8").trim())
        })
        .collect();
    let linux = volagent::sys::linux::Linux::unrooted();
    let ours = |l: &LoopStatus| devices.contains(&l.device);
    let full: Vec<LoopStatus> = linux
        .loop_devices()
        .expect("list")
        .into_iter()
        .map(LoopStatus::from)
        .filter(ours)
        .collect();
    let by_status: Vec<LoopStatus> =
        linux.loop_statuses().expect("statuses").into_iter().filter(ours).collect();
    for d in &devices {
        let _ = Command::new("losetup").arg("-d").arg(d).status();
    }
    assert_eq!(full.len(), 2, "both devices listed: {full:?}");
    assert!(full.iter().all(|l| l.backing.is_some()), "{full:?}");
    assert_eq!(by_status, full);
    nothing_mounted(&node);
}

/// kubelet bind-mounts its root dir onto itself when it starts, which may
/// be after the agent: the agent must act on the root as the mount table
/// shows it then, or its mounts land under the bind, where neither kubelet
/// nor a container sees them (and kubelet's cleanup finds a dir it cannot
/// remove).
#[test]
fn a_root_mounted_over_after_start_up_is_acted_on_as_it_is_now() {
    use nix::mount::{MsFlags, mount};
    let node = Node::start(VOLAGENT);
    let root = node.scratch.path("node-a/kubelet");
    mount(Some(&root), &root, None::<&str>, MsFlags::MS_BIND, None::<&str>)
        .expect("bind the kubelet root onto itself");
    mount(None::<&str>, &root, None::<&str>, MsFlags::MS_SHARED | MsFlags::MS_REC, None::<&str>)
        .expect("make it rshared");
    let image = node.image("v.img", 64);
    let dir = node.mount_dir("uid-a", "pv1");
    assert_success(&node.mount(&dir, &options("pv1", "a", &image)));
    // Seen through the path, as kubelet and the container runtime see it.
    assert!(Path::new(&dir).join("lost+found").is_dir(), "the volume is visible at {dir}");
    std::fs::write(Path::new(&dir).join("f"), b"x").expect("write into the volume");
    assert_success(&node.driver(&["unmount", &dir]));
    // The driver may remove the dir itself; if it is there, it is empty.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "after unmount the pod dir is gone or empty, as kubelet needs to remove it: {left:?}"
    );
    nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH).expect("unbind the root");
    nothing_mounted(&node);
}
