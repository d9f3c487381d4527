//! The chaos tier: the kernel's shared resources raced for, the agent
//! killed at random moments under load and restarted, kubelet's retries.
//! Each random test prints its seed; `VOLAGENT_CHAOS_SEED` replays one.
//! Needs root (loop devices, mounts).

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use volagent::sys::Devices;
use volagent_test_support::agent::Node;
use volagent_test_support::driver::{kubelet_options, run_driver};
use volagent_test_support::scratch::RootScratch;
use volagent_test_support::{driver, scratch};

/// The agent's binary, as cargo built it for this tier.
const VOLAGENT: &str = env!("CARGO_BIN_EXE_volagent");

/// Loop devices attached while others are detached, all at once, as start-up
/// reconciliation releases devices while kubelet's retries attach new ones:
/// the kernel may hand out a device that is still being released or that
/// another attach binds first; every attach must still succeed.
#[test]
fn loop_attaches_racing_each_other_and_detaches_all_succeed() {
    let scratch = RootScratch::enter();
    std::fs::create_dir_all(scratch.path("disks")).expect("dir");
    let roots = volagent::sys::beneath::Roots::open(&[scratch.path("disks")]).expect("roots");
    let linux = std::sync::Arc::new(volagent::sys::linux::Linux::new(roots, "volagent:chaos"));
    const N: usize = 24;
    let files: Vec<PathBuf> =
        (0..2 * N).map(|i| scratch.image(&format!("disks/f{i}.img"), 4)).collect();
    let first: Vec<PathBuf> =
        files[..N].iter().map(|f| linux.loop_attach(f, false).expect("attach")).collect();

    let mut threads = Vec::new();
    for (i, device) in first.into_iter().enumerate() {
        let l = linux.clone();
        threads.push(std::thread::spawn(move || {
            l.loop_detach(&device).map(|_| None).map_err(|e| format!("detach {i}: {e}"))
        }));
        let (l, file) = (linux.clone(), files[N + i].clone());
        threads.push(std::thread::spawn(move || {
            l.loop_attach(&file, false).map(Some).map_err(|e| format!("attach {}: {e}", N + i))
        }));
    }
    let results: Vec<Result<Option<PathBuf>, String>> =
        threads.into_iter().map(|t| t.join().expect("thread")).collect();
    let failed: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "{failed:?}");
    let attached: Vec<PathBuf> = results.into_iter().filter_map(|r| r.ok().flatten()).collect();
    assert_eq!(attached.len(), N);
    let mut distinct = attached.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), N, "one device per file: {attached:?}");
    // A detached device stays bound until its last opener (udev) closes it.
    settle(&scratch, N);
    for d in attached {
        linux.loop_detach(&d).expect("detach");
    }
    settle(&scratch, 0);
}

/// Wait (a few seconds at most) for `n` loop devices over the scratch dir's files.
#[track_caller]
fn settle(scratch: &RootScratch, n: usize) {
    let start = std::time::Instant::now();
    while scratch.loops().len() != n {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "{n} loop devices expected: {:?}",
            scratch.loops()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The device the kernel calls free is held by someone else for a moment
/// (udev probing it, a detach still completing): binding it fails with
/// EBUSY, again and again while it is held. The attach waits it out within
/// its budget instead of failing the mount.
#[test]
fn a_free_loop_device_held_for_a_moment_is_waited_for() {
    use std::os::unix::fs::OpenOptionsExt;
    let scratch = RootScratch::enter();
    std::fs::create_dir_all(scratch.path("disks")).expect("dir");
    let roots = volagent::sys::beneath::Roots::open(&[scratch.path("disks")]).expect("roots");
    let linux = volagent::sys::linux::Linux::new(roots, "volagent:chaos");
    let file = scratch.image("disks/held.img", 4);

    // The device the kernel hands out next (`losetup -f` asks it).
    let out = std::process::Command::new("losetup").arg("-f").output().expect("losetup");
    let free = String::from_utf8(out.stdout).expect("utf-8").trim().to_string();
    assert!(out.status.success() && free.starts_with("/dev/loop"), "{free}");
    // An exclusive open claims the block device: LOOP_CONFIGURE on it fails
    // with EBUSY while it is held.
    let held = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_EXCL)
        .open(&free)
        .expect("hold the free device");
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(held);
    });
    let device = linux.loop_attach(&file, false).expect("the attach waits for the held device");
    release.join().expect("release");
    assert!(scratch.loops().contains(&device));
    linux.loop_detach(&device).expect("detach");
    settle(&scratch, 0);
}

const VOLUMES: usize = 200;
const CONCURRENT: usize = 50;
/// SIGKILLs of the agent per phase (fewer when the calls end first).
const KILLS: usize = 5;
/// kubelet's retry of a failed mount or unmount: exponential backoff (its
/// 500 ms start is shortened here), within a budget.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
const RETRY_BUDGET: Duration = Duration::from_secs(120);

/// A failure that says the agent was not there to answer (down, or killed
/// mid-call): kubelet retries those. Anything else a running agent said.
fn agent_absent(message: &str) -> bool {
    message.contains("volagent agent is not reachable") || message.contains("volagent agent at ")
}

struct Volume {
    name: String,
    image: String,
    dir: String,
    staging: String,
}

/// Run `args_of(volume)` through the installed driver for every volume, 50
/// at a time, each retried as kubelet retries until it succeeds. Meanwhile
/// the agent is killed (SIGKILL) `kills` times at random moments and
/// started again at once. Returns what running agents answered with a
/// failure (every answer must be a success once the agent is up).
fn under_kills(
    node: &mut Node,
    volumes: &[Volume],
    rng: &mut fastrand::Rng,
    kills: usize,
    args_of: &(dyn Fn(&Volume) -> Vec<String> + Sync),
) -> Vec<String> {
    let driver = node.driver_path();
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let refused = Mutex::new(Vec::new());
    let retries = AtomicUsize::new(0);
    let mut killed = 0;
    std::thread::scope(|s| {
        for _ in 0..CONCURRENT {
            s.spawn(|| {
                while let Some(v) = volumes.get(next.fetch_add(1, Ordering::SeqCst)) {
                    let (start, mut backoff) = (Instant::now(), FIRST_BACKOFF);
                    loop {
                        let (code, reply) =
                            run_driver(std::process::Command::new(&driver).args(args_of(v)));
                        if code == 0 && reply["status"] == "Success" {
                            break;
                        }
                        let message = reply["message"].as_str().unwrap_or_default().to_string();
                        retries.fetch_add(1, Ordering::SeqCst);
                        if !agent_absent(&message) {
                            refused
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push(format!("{}: {message}", v.name));
                        }
                        assert!(
                            start.elapsed() < RETRY_BUDGET,
                            "{} did not succeed within {RETRY_BUDGET:?}: {message}",
                            v.name
                        );
                        std::thread::sleep(backoff);
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                    done.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
        for _ in 0..kills {
            std::thread::sleep(Duration::from_millis(rng.u64(50..1000)));
            if done.load(Ordering::SeqCst) == volumes.len() {
                break;
            }
            let at = done.load(Ordering::SeqCst);
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(node.pid_of("node-a")),
                nix::sys::signal::Signal::SIGKILL,
            )
            .expect("kill the agent");
            node.stop_agent_of("node-a");
            eprintln!("killed the agent with {at}/{} calls done", volumes.len());
            killed += 1;
            node.spawn_agent("node-a");
        }
    });
    eprintln!(
        "{} calls, {killed} kills, {} retries",
        volumes.len(),
        retries.load(Ordering::SeqCst)
    );
    refused.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// How many times each path is a mount point now.
fn mount_counts(node: &Node) -> std::collections::HashMap<String, usize> {
    let mut counts = std::collections::HashMap::new();
    for m in node.scratch.mounts() {
        *counts.entry(m.display().to_string()).or_insert(0) += 1;
    }
    counts
}

/// Every record in the agent's ledger (read with the agent stopped): volume
/// and the mount dirs of its holders.
fn records(node: &mut Node) -> std::collections::BTreeMap<String, Vec<String>> {
    node.stop_agent_of("node-a");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let found = rt.block_on(async {
        use volagent::ledger::Ledger;
        let ledger =
            volagent::ledger::embedded::EmbeddedLedger::open(&node.ledger_path("node-a"), false)
                .expect("open the ledger");
        ledger.list_by_node("node-a").await.expect("list the ledger")
    });
    node.spawn_agent("node-a");
    found
        .into_iter()
        .map(|(r, _)| (r.volume, r.holders.into_iter().map(|h| h.consumer.mount_dir).collect()))
        .collect()
}

/// 200 local volumes mounted and then unmounted by kubelet-style driver
/// calls, 50 at a time, on one standalone agent killed with SIGKILL at
/// random moments through both and started again: every call succeeds once
/// an agent answers it, each staging dir and pod dir is mounted once, the
/// records name exactly what is mounted, and nothing is left at the end.
/// The agent records its policy calls all along: every recorded file is
/// whole, and the recording replays on the shipped policy with no
/// difference.
#[test]
fn the_agent_killed_at_random_under_load_loses_nothing() {
    let mut rng = fastrand::Rng::with_seed(scratch::chaos_seed(
        "the_agent_killed_at_random_under_load_loses_nothing",
    ));
    let mut node = Node::start_alone_recording(VOLAGENT);
    let kubelet = node.scratch.path("node-a/kubelet");
    let volumes: Vec<Volume> = (0..VOLUMES)
        .map(|i| Volume {
            name: format!("pv-c{i}"),
            image: node.image(&format!("c{i}.img"), 16),
            dir: node.mount_dir(&format!("uid-c{i}"), &format!("pv-c{i}")),
            staging: kubelet
                .join(format!("plugins/volagent/local-pv/mounts/pv-c{i}"))
                .display()
                .to_string(),
        })
        .collect();

    let mount = |v: &Volume| {
        let i = &v.name[4..];
        vec![
            "mount".into(),
            v.dir.clone(),
            kubelet_options(&v.name, &format!("pod-c{i}"), &format!("uid-c{i}"), "ext4", &v.image)
                .to_string(),
        ]
    };
    let refused = under_kills(&mut node, &volumes, &mut rng, KILLS, &mount);
    assert!(refused.is_empty(), "mounts a running agent failed: {refused:#?}");
    let counts = mount_counts(&node);
    for v in &volumes {
        assert_eq!(
            (counts.get(&v.dir), counts.get(&v.staging)),
            (Some(&1), Some(&1)),
            "{}: mounted once at its pod dir and its staging dir",
            v.name
        );
    }
    assert_eq!(counts.len(), 2 * VOLUMES, "nothing else is mounted: {counts:?}");
    assert_eq!(node.scratch.loops().len(), VOLUMES, "one loop device per volume");
    let recorded = records(&mut node);
    assert_eq!(recorded.len(), VOLUMES);
    for v in &volumes {
        assert_eq!(
            recorded.get(&v.name),
            Some(&vec![v.dir.clone()]),
            "{}'s record names its one pod",
            v.name
        );
    }

    let unmount = |v: &Volume| vec!["unmount".into(), v.dir.clone()];
    let refused = under_kills(&mut node, &volumes, &mut rng, KILLS, &unmount);
    assert!(refused.is_empty(), "unmounts a running agent failed: {refused:#?}");
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
    assert!(records(&mut node).is_empty(), "no record is left");
    replays_the_same(&node.recordings(), VOLUMES);
}

/// The recording `dir` (of local-pv calls, at least `calls` of each of
/// fence, attach and detach) replays on each shipped policy that has calls
/// in it with every call answered the same, and every file in it parses.
fn replays_the_same(dir: &std::path::Path, calls: usize) {
    let backends: Vec<String> = std::fs::read_dir(dir)
        .expect("the recording dir")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    assert_eq!(backends, ["local-pv"], "only local-pv was called");
    let files: Vec<String> = std::fs::read_dir(dir.join("local-pv"))
        .expect("local-pv's recordings")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    for call in ["fence", "attach", "detach"] {
        let n = files.iter().filter(|f| f.ends_with(&format!("-{call}.json"))).count();
        assert!(n >= calls, "{n} {call} calls recorded, fewer than {calls}");
    }
    for (backend, policy) in volagent_test_artifacts::BACKENDS {
        if !backends.iter().any(|b| b == backend) {
            continue;
        }
        let out = std::process::Command::new(VOLAGENT)
            .args(["plugin", "replay", policy])
            .arg(dir)
            .output()
            .expect("volagent plugin replay");
        let text = String::from_utf8_lossy(&out.stdout);
        eprintln!("replay on {backend}: {}", text.lines().next().unwrap_or_default());
        assert!(
            out.status.success(),
            "the recording replays differently on {backend}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.lines().next().is_some_and(|l| l.ends_with(", 0 otherwise")), "{text}");
    }
}

/// The faults injected at each step kind of a local volume's mount and
/// unmount plans.
const FAULTS: &[&str] = &["EIO", "ENOSPC", "EBUSY", "hang"];
const MOUNT_STEPS: &[&str] = &["attach-device", "format", "mount", "bind-mount"];
const UNMOUNT_STEPS: &[&str] = &["unmount", "detach-device"];

/// Retry `args` through the driver as kubelet does until it succeeds.
#[track_caller]
fn until_success(node: &Node, args: &[&str]) {
    let (start, mut backoff) = (Instant::now(), FIRST_BACKOFF);
    loop {
        let (code, reply) =
            driver::run_driver(std::process::Command::new(node.driver_path()).args(args));
        if code == 0 && reply["status"] == "Success" {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{args:?} kept failing: {reply}");
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Faults injected at the sys seam (a layer over the real node) into every
/// step kind of a local volume's mount and unmount plans — EIO, ENOSPC,
/// EBUSY, and a hang past the plan deadline: the call fails naming the step
/// and the fault (or the deadline), the steps before it are rolled back (no
/// mount or loop device of the volume is left), and once the fault is gone
/// kubelet's retry succeeds and the volume unmounts clean.
#[test]
fn faults_at_every_step_kind_fail_clearly_roll_back_and_retries_succeed() {
    let mut node = Node::start_alone(VOLAGENT);
    let rules = node.restart_with_faults(&["--plan-deadline-secs", "2"]);
    let expect_fault = |r: &(i32, serde_json::Value), step: &str, fault: &str| {
        let said = |s: &str| r.1["message"].as_str().unwrap_or_default().contains(s);
        assert_eq!(r.0, 1, "{step} {fault}: {}", r.1);
        if fault == "hang" {
            assert!(said("still running after"), "{step} {fault}: the deadline is said: {}", r.1);
        } else {
            assert!(
                said(&format!("({step}) failed")) && said("injected fault") && said(fault),
                "{step} {fault}: step and fault are said: {}",
                r.1
            );
        }
    };
    let mut case = 0;
    for step in MOUNT_STEPS.iter().chain(UNMOUNT_STEPS) {
        for fault in FAULTS {
            case += 1;
            let (name, pod, uid) =
                (format!("pv-f{case}"), format!("pod-f{case}"), format!("uid-f{case}"));
            let image = node.image(&format!("f{case}.img"), 16);
            let dir = node.mount_dir(&uid, &name);
            let opts = kubelet_options(&name, &pod, &uid, "ext4", &image).to_string();
            let mount = ["mount", dir.as_str(), opts.as_str()];
            let unmount = ["unmount", dir.as_str()];
            let on_mount = MOUNT_STEPS.contains(step);
            if !on_mount {
                until_success(&node, &mount);
            }
            std::fs::write(&rules, format!("{step} {fault}\n")).expect("rules");
            let r = driver::run_driver(
                std::process::Command::new(node.driver_path()).args(if on_mount {
                    &mount[..]
                } else {
                    &unmount[..]
                }),
            );
            expect_fault(&r, step, fault);
            if *fault == "hang" {
                // Locked while the step hangs: the retry is told to wait.
                let again = driver::run_driver(
                    std::process::Command::new(node.driver_path()).args(if on_mount {
                        &mount[..]
                    } else {
                        &unmount[..]
                    }),
                );
                assert!(
                    again.1["message"].as_str().unwrap_or_default().contains("in progress"),
                    "{step} hang: {}",
                    again.1
                );
            } else if on_mount {
                assert!(
                    node.scratch.mounts().is_empty(),
                    "{step} {fault}: rolled back: {:?}",
                    node.scratch.mounts()
                );
                assert!(
                    node.scratch.loops_left().is_empty(),
                    "{step} {fault}: rolled back: {:?}",
                    node.scratch.loops()
                );
            }
            std::fs::remove_file(&rules).expect("the fault is gone");
            if on_mount {
                until_success(&node, &mount);
                std::fs::write(format!("{dir}/data"), b"after the fault").expect("write");
            }
            until_success(&node, &unmount);
            assert!(
                node.scratch.mounts().is_empty(),
                "{step} {fault}: {:?}",
                node.scratch.mounts()
            );
            assert!(
                node.scratch.loops_left().is_empty(),
                "{step} {fault}: {:?}",
                node.scratch.loops()
            );
        }
    }
    eprintln!("{case} faults injected, {} per step kind", FAULTS.len());
    assert!(records(&mut node).is_empty(), "no record is left");
}

/// A mount failing at any of its steps leaves no holder in the ledger,
/// however fast it fails: the record's write runs alongside the steps, and
/// a step failing before it landed must not have its rollback overtaken by
/// it (which would leave the volume held by a mount that never happened).
#[test]
fn a_mount_failing_at_any_step_leaves_no_holder_recorded() {
    let mut node = Node::start_alone(VOLAGENT);
    let rules = node.restart_with_faults(&[]);
    for (case, step) in MOUNT_STEPS.iter().enumerate() {
        let (name, pod, uid) =
            (format!("pv-r{case}"), format!("pod-r{case}"), format!("uid-r{case}"));
        let image = node.image(&format!("r{case}.img"), 16);
        let dir = node.mount_dir(&uid, &name);
        let opts = kubelet_options(&name, &pod, &uid, "ext4", &image).to_string();
        std::fs::write(&rules, format!("{step} EIO\n")).expect("rules");
        let r = driver::run_driver(std::process::Command::new(node.driver_path()).args([
            "mount",
            dir.as_str(),
            opts.as_str(),
        ]));
        assert_eq!(r.0, 1, "{step}: the mount fails: {}", r.1);
        assert!(
            r.1["message"].as_str().unwrap_or_default().contains("injected fault"),
            "{step}: {}",
            r.1
        );
    }
    std::fs::remove_file(&rules).expect("the faults are gone");
    assert!(node.scratch.mounts().is_empty(), "rolled back: {:?}", node.scratch.mounts());
    assert!(node.scratch.loops_left().is_empty(), "rolled back: {:?}", node.scratch.loops());
    assert_eq!(records(&mut node), Default::default(), "no volume is held");
}

/// Someone (an admin, a cleanup script) detaches a volume's mounts lazily
/// while a process still has a file open in it: the filesystem and its
/// loop device live on, out of sight, until that file closes. kubelet's
/// unmount then succeeds (the device's release waits for its last user),
/// the next mount of the volume, for another pod, takes back the
/// still-bound device (not a second one over the file) and gets the same
/// filesystem — what the open file writes meanwhile included — and once
/// all is closed and unmounted nothing is left.
#[test]
fn a_volume_torn_down_lazily_while_in_use_mounts_again_and_leaves_nothing() {
    use std::io::Write;
    let mut node = Node::start_alone(VOLAGENT);
    let image = node.image("lazy.img", 16);
    let staging = node.scratch.path("node-a/kubelet/plugins/volagent/local-pv/mounts/pv-lazy");
    let options =
        |pod: &str, uid: &str| kubelet_options("pv-lazy", pod, uid, "ext4", &image).to_string();
    let dir_a = node.mount_dir("uid-la", "pv-lazy");
    until_success(&node, &["mount", &dir_a, &options("pod-la", "uid-la")]);
    let mut held = std::fs::File::create(format!("{dir_a}/held")).expect("a file in the volume");
    held.write_all(b"before; ").expect("write");
    for m in [std::path::Path::new(&dir_a), staging.as_path()] {
        nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH).expect("lazy unmount");
    }
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    assert_eq!(node.scratch.loops().len(), 1, "the device lives on under the open file");
    let device = node.scratch.loops()[0].clone();
    let autoclear = || {
        std::fs::read_to_string(format!(
            "/sys/block/{}/loop/autoclear",
            device.display().to_string().trim_start_matches("/dev/")
        ))
        .expect("autoclear")
        .trim()
            == "1"
    };

    let first_try = |node: &Node, args: &[&str]| {
        let (code, reply) = run_driver(std::process::Command::new(node.driver_path()).args(args));
        assert!(code == 0 && reply["status"] == "Success", "{args:?}: {reply}");
    };
    first_try(&node, &["unmount", &dir_a]);
    assert!(records(&mut node).is_empty(), "released: {:?}", records(&mut node));
    assert!(autoclear(), "its detach waits for the open file");
    let dir_b = node.mount_dir("uid-lb", "pv-lazy");
    first_try(&node, &["mount", &dir_b, &options("pod-lb", "uid-lb")]);
    assert_eq!(node.scratch.loops(), vec![device.clone()], "one device for the volume, the same");
    assert!(
        !autoclear(),
        "taken back: the open file's close does not take the device from under pod b"
    );
    held.write_all(b"after").expect("write through the detached mount");
    held.sync_all().expect("sync");
    drop(held);
    assert_eq!(
        std::fs::read(format!("{dir_b}/held")).expect("read"),
        b"before; after",
        "the same filesystem"
    );
    std::fs::write(format!("{dir_b}/data"), b"pod b").expect("write");

    first_try(&node, &["unmount", &dir_b]);
    assert!(node.scratch.mounts().is_empty(), "{:?}", node.scratch.mounts());
    settle(&node.scratch, 0);
    assert!(records(&mut node).is_empty(), "no record is left");
    // Written through to the file: mounted once more by hand, it holds both.
    let check = node.scratch.path("check");
    std::fs::create_dir_all(&check).expect("dir");
    let out = std::process::Command::new("mount")
        .args(["-o", "loop,ro"])
        .arg(&image)
        .arg(&check)
        .output()
        .expect("mount");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (held, data) = (std::fs::read(check.join("held")), std::fs::read(check.join("data")));
    nix::mount::umount2(&check, nix::mount::MntFlags::empty()).expect("unmount");
    assert_eq!(
        (held.expect("held"), data.expect("data")),
        (b"before; after".to_vec(), b"pod b".to_vec())
    );
    settle(&node.scratch, 0);
}

/// Fill the filesystem `dir` is on (a small tmpfs) with a file in it.
fn fill(dir: &std::path::Path) -> PathBuf {
    use std::io::Write;
    let filler = dir.join("filler");
    let mut f = std::fs::File::create(&filler).expect("filler");
    let chunk = vec![0x5au8; 64 << 10];
    while f.write_all(&chunk).is_ok() {}
    filler
}

/// The disks under the state dir (ledger) and the runtime dir (stash)
/// full: a mount fails with a clear error and leaves nothing of its volume;
/// a mounted volume stays mounted; both stores read back uncorrupted; and
/// once there is space the agent serves again — without a restart.
#[test]
fn full_state_and_runtime_disks_fail_calls_cleanly_and_the_agent_serves_again() {
    let mut node = Node::start_alone(VOLAGENT);
    node.stop_agent_of("node-a");
    let (state, run) = (node.scratch.path("node-a/state"), node.scratch.path("node-a/run"));
    for dir in [&state, &run] {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).expect("dir");
        nix::mount::mount(
            Some("tmpfs"),
            dir,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=8m"),
        )
        .expect("a small disk");
    }
    node.spawn_agent("node-a");
    let volume = |i: usize| {
        let (name, uid) = (format!("pv-d{i}"), format!("uid-d{i}"));
        let image = node.image(&format!("d{i}.img"), 16);
        let dir = node.mount_dir(&uid, &name);
        let opts = kubelet_options(&name, &format!("pod-d{i}"), &uid, "ext4", &image).to_string();
        (dir, opts)
    };
    let volume_mounts = || {
        node.scratch.mounts().into_iter().filter(|m| *m != state && *m != run).collect::<Vec<_>>()
    };
    let ((a_dir, a_opts), (b_dir, b_opts)) = (volume(1), volume(2));
    until_success(&node, &["mount", &a_dir, &a_opts]);
    std::fs::write(format!("{a_dir}/data"), b"mounted before").expect("write");
    let before = volume_mounts();

    let fillers = [fill(&state), fill(&run)];
    let r = driver::run_driver(
        std::process::Command::new(node.driver_path()).args(["mount", &b_dir, &b_opts]),
    );
    assert_eq!(r.0, 1, "{}", r.1);
    let message = r.1["message"].as_str().unwrap_or_default();
    assert!(message.contains("No space left on device"), "the full disk is said: {message}");
    assert_eq!(volume_mounts(), before, "nothing of the failed mount is left");
    assert_eq!(node.scratch.loops().len(), 1);
    assert_eq!(std::fs::read(format!("{a_dir}/data")).expect("still mounted"), b"mounted before");
    // An unmount still takes the volume down. Forgetting it takes no room
    // in the stash (a file removed); the ledger's commit may find none: the
    // unmount then fails, saying why, and its retry finishes the job.
    let r = driver::run_driver(
        std::process::Command::new(node.driver_path()).args(["unmount", &a_dir]),
    );
    assert!(
        r.0 == 0 || r.1["message"].as_str().unwrap_or_default().contains("No space left on device"),
        "{}",
        r.1
    );
    assert!(volume_mounts().is_empty(), "taken down: {:?}", volume_mounts());

    for f in &fillers {
        std::fs::remove_file(f).expect("space again");
    }
    until_success(&node, &["mount", &b_dir, &b_opts]);
    until_success(&node, &["unmount", &a_dir]);
    until_success(&node, &["unmount", &b_dir]);
    assert!(volume_mounts().is_empty(), "{:?}", volume_mounts());
    assert!(node.scratch.loops_left().is_empty(), "{:?}", node.scratch.loops());
    assert!(records(&mut node).is_empty(), "the ledger reads back, with nothing held");
}
