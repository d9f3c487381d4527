//! A root test's scratch world (a private mount namespace and a dir whose
//! mounts, loop devices and helper processes go with it), and the seed of a
//! chaos test's random choices.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::Duration;

/// A root test's world: a private mount namespace (mounts vanish with the
/// test process and never reach the host) and a scratch dir. Loop devices
/// are not namespaced: every loop device backed by a file under the scratch
/// dir is detached on drop, even when the test panics, and when the test
/// is ended by SIGTERM (nextest's limit on a test's time).
pub struct RootScratch {
    pub dir: tempfile::TempDir,
    /// What the test leaves to clean up, shared with the SIGTERM listener.
    left: Arc<Leftovers>,
    /// Tells the FUSE watchdog the test is over.
    done: Arc<std::sync::atomic::AtomicBool>,
}

/// A scratch's root and the loop devices' files it made.
struct Leftovers {
    /// The dir's resolved path: the agent names everything by resolved paths.
    root: PathBuf,
    /// The files [`RootScratch::image`] made: a loop device over one is the
    /// test's even when attached through another path (e.g. in a container).
    images: Mutex<Vec<volagent::sys::FileId>>,
}

/// The scratches alive in this process, for the SIGTERM listener.
static LIVE: Mutex<Vec<Weak<Leftovers>>> = Mutex::new(Vec::new());

/// On SIGTERM, cleans every live scratch up as its drop would and exits
/// (143, as the signal would). Mounts go with the process's namespace; loop
/// devices and helpers would outlive it. Started on the first scratch's
/// thread, after its unshare, so it sees that namespace's mounts.
fn listen_for_sigterm() {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM])
            .expect("a SIGTERM listener");
        std::thread::spawn(move || {
            if signals.forever().next().is_some() {
                eprintln!("SIGTERM: cleaning up the root test's scratch before exiting");
                let live = LIVE.lock().unwrap_or_else(|e| e.into_inner()).clone();
                for left in live.iter().filter_map(Weak::upgrade) {
                    left.clean();
                }
                std::process::exit(143);
            }
        });
    });
}

/// How long a root test may run before its FUSE mounts are aborted:
/// a FUSE request to a daemon that hangs blocks its caller in the kernel,
/// where no signal reaches it, so a hung backend would hang CI instead of
/// failing a test.
const FUSE_WATCHDOG: Duration = Duration::from_secs(300);

/// Abort every FUSE connection mounted below `root` (fusectl) and kill
/// every process naming `root` (the FUSE daemons): blocked requests fail.
fn abort_fuse_below(root: &Path) {
    let fusectl = Path::new("/sys/fs/fuse/connections");
    if std::fs::read_dir(fusectl).map(|mut d| d.next().is_none()).unwrap_or(true) {
        let _ = nix::mount::mount(
            Some("fusectl"),
            fusectl,
            Some("fusectl"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        );
    }
    let text = std::fs::read_to_string("/proc/thread-self/mountinfo").unwrap_or_default();
    for m in volagent::sys::mountinfo::parse(&text).unwrap_or_default() {
        if m.mount_point.starts_with(root) && m.fs_type.starts_with("fuse") {
            eprintln!(
                "FUSE watchdog: aborting the hung FUSE mount {} (connection {})",
                m.mount_point.display(),
                m.device.1
            );
            let _ = std::fs::write(fusectl.join(m.device.1.to_string()).join("abort"), "1");
        }
    }
    for pid in processes_naming(root) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

impl RootScratch {
    pub fn enter() -> RootScratch {
        RootScratch::enter_with_watchdog(FUSE_WATCHDOG)
    }

    /// [`enter`](Self::enter), aborting FUSE mounts after `watchdog`.
    pub fn enter_with_watchdog(watchdog: Duration) -> RootScratch {
        use nix::mount::{MsFlags, mount};
        assert!(
            nix::unistd::geteuid().is_root(),
            "needs root: this test uses loop devices and mounts (CI runs it as root)"
        );
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
            .expect("a private mount namespace");
        mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
            .expect("make / private");
        let dir = tempfile::Builder::new()
            .prefix("volagent-root-")
            .tempdir_in("/var/tmp")
            .expect("scratch dir");
        let root = std::fs::canonicalize(dir.path()).expect("resolve the scratch dir");
        // Started after unshare: the watchdog thread sees the test's mounts.
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, below) = (done.clone(), root.clone());
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            while !flag.load(std::sync::atomic::Ordering::SeqCst) {
                if start.elapsed() > watchdog {
                    eprintln!("FUSE watchdog: the test has run for {watchdog:?}");
                    abort_fuse_below(&below);
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        let left = Arc::new(Leftovers { root, images: Mutex::default() });
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|l| l.strong_count() > 0);
        live.push(Arc::downgrade(&left));
        drop(live);
        listen_for_sigterm();
        RootScratch { dir, left, done }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.left.root.join(rel)
    }

    /// A sparse file of `mib` MiB.
    pub fn image(&self, name: &str, mib: u64) -> PathBuf {
        let p = self.path(name);
        let f = std::fs::File::create(&p).expect("create image");
        f.set_len(mib << 20).expect("size image");
        use std::os::unix::fs::MetadataExt as _;
        let meta = f.metadata().expect("stat image");
        self.left
            .images
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(volagent::sys::FileId { dev: meta.dev(), ino: meta.ino() });
        p
    }

    /// Mounts below the scratch dir, deepest last.
    pub fn mounts(&self) -> Vec<PathBuf> {
        self.left.mounts()
    }

    /// Loop devices backed by files below the scratch dir (by path, or by
    /// identity for the files [`Self::image`] made).
    pub fn loops(&self) -> Vec<PathBuf> {
        self.left.loops()
    }
}

impl Leftovers {
    fn mounts(&self) -> Vec<PathBuf> {
        let text = std::fs::read_to_string("/proc/thread-self/mountinfo").expect("mountinfo");
        volagent::sys::mountinfo::parse(&text)
            .expect("parse mountinfo")
            .into_iter()
            .map(|m| m.mount_point)
            .filter(|p| p.starts_with(&self.root))
            .collect()
    }

    fn loops(&self) -> Vec<PathBuf> {
        use volagent::sys::Devices;
        let root = &self.root;
        let images = self.images.lock().unwrap_or_else(|e| e.into_inner()).clone();
        volagent::sys::linux::Linux::unrooted()
            .loop_devices()
            .expect("list loop devices")
            .into_iter()
            .filter(|l| {
                l.backing_file.starts_with(root) || l.backing.is_some_and(|b| images.contains(&b))
            })
            .map(|l| l.device)
            .collect()
    }
}

impl RootScratch {
    /// [`Self::loops`], once the devices detached while something else had
    /// them open are gone: LOOP_CLR_FD then only sets autoclear, and the
    /// device goes at that opener's close (another test listing devices,
    /// udev's probe). At most 3 s; a device attached without autoclear is
    /// listed at once, as nothing detached it.
    pub fn loops_left(&self) -> Vec<PathBuf> {
        let start = std::time::Instant::now();
        loop {
            let left = self.loops();
            let detaching = |d: &PathBuf| {
                let name = d.file_name().unwrap_or_default().to_string_lossy().into_owned();
                // Unreadable: gone meanwhile.
                std::fs::read_to_string(format!("/sys/block/{name}/loop/autoclear"))
                    .map_or(true, |a| a.trim() == "1")
            };
            if left.is_empty()
                || !left.iter().all(detaching)
                || start.elapsed() > std::time::Duration::from_secs(3)
            {
                return left;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

impl Drop for RootScratch {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::SeqCst);
        self.left.clean();
    }
}

impl Leftovers {
    /// Unmounts, detaches and kills what the test left below its root.
    fn clean(&self) {
        use volagent::sys::Devices;
        // Listed first: a loop device over an NBD client's file is known by
        // that path only while the client's FUSE mount is there.
        let loops = self.loops();
        for m in self.mounts().into_iter().rev() {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
        for d in loops {
            let _ = volagent::sys::linux::Linux::unrooted().loop_detach(&d);
        }
        // Helpers a failed test left (NBD servers and clients outlive the
        // agent by design): every process with an argument under the root.
        for pid in processes_naming(&self.root) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Processes (not this one) with a command-line argument under `root`.
fn processes_naming(root: &Path) -> Vec<i32> {
    processes_under(root, |_| true)
}

/// Processes (not this one) whose command line `is` matches and has an
/// argument under `dir`.
pub fn processes_under(dir: &Path, is: impl Fn(&[String]) -> bool) -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return false };
            let args: Vec<String> = cmdline
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            is(&args) && args.iter().any(|a| Path::new(a).starts_with(dir))
        })
        .collect()
}

/// The seed of this run's random choices, printed so a failure can be
/// replayed (`VOLAGENT_CHAOS_SEED`); threads still interleave as they will.
pub fn chaos_seed(test: &str) -> u64 {
    let seed = std::env::var("VOLAGENT_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("{test}: chaos seed {seed} (replay with VOLAGENT_CHAOS_SEED={seed})");
    seed
}
