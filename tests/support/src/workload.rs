//! A workload for the tiers that replace or kill what serves a volume
//! under it: a thread appending 4 KiB records and fsyncing each, counting
//! what it wrote, the errors it met and the longest wait for one record.
// Test support: a failed step fails the test that called it.
#![allow(clippy::unwrap_used)]

use crate::wait_until_or;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A workload: 4 KiB appended and fsynced to `<dir>/log` without pause;
/// how many, the errors, and the longest wait for one.
pub struct Writer {
    stop: Arc<AtomicBool>,
    pub stats: Arc<Mutex<(u64, Vec<String>, Duration)>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Logs whose tails a failure shows.
    pub logs: Vec<PathBuf>,
    /// What it writes.
    pub file: PathBuf,
}

impl Writer {
    pub fn start(dir: &str) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new((0u64, Vec::new(), Duration::ZERO)));
        // Unique: a shared volume (gluster's) keeps the files of other runs.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        let path =
            PathBuf::from(dir).join(format!("log-{}-{}", std::process::id(), nanos.as_nanos()));
        let file = path.clone();
        let (s, st) = (stop.clone(), stats.clone());
        let thread = std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap();
            let mut n = 0u64;
            while !s.load(Ordering::SeqCst) {
                let started = Instant::now();
                let mut record = format!("{n:016}\n").into_bytes();
                record.resize(4096, b'.');
                *record.last_mut().unwrap() = b'\n';
                let done = f.write_all(&record).and_then(|_| f.sync_data());
                let took = started.elapsed();
                let mut stats = st.lock().unwrap();
                match done {
                    Ok(()) => {
                        stats.0 += 1;
                        n += 1;
                    }
                    Err(e) => stats.1.push(e.to_string()),
                }
                stats.2 = stats.2.max(took);
                if stats.1.len() >= 3 {
                    // A failed filesystem only fails again.
                    break;
                }
            }
        });
        Writer { stop, stats, thread: Some(thread), logs: Vec::new(), file }
    }

    pub fn written(&self) -> u64 {
        self.stats.lock().unwrap().0
    }

    /// Wait for `more` writes beyond now.
    pub fn goes_on(&self, more: u64, when: &str) {
        let from = self.written();
        wait_until_or(
            Duration::from_secs(30),
            &format!("the workload writing {when}"),
            || (self.written() >= from + more).then_some(()),
            || {
                let mut out = format!("{:?}", self.stats.lock().unwrap());
                for log in &self.logs {
                    let text = std::fs::read_to_string(log).unwrap_or_default();
                    let tail: Vec<&str> = text.lines().rev().take(30).collect();
                    out += &format!(
                        "\n--- {}:\n{}",
                        log.display(),
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    );
                }
                out
            },
        );
    }

    /// Stop; (records written, errors, the longest write + fsync).
    pub fn finish(mut self) -> (u64, Vec<String>, Duration) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap();
        self.stats.lock().unwrap().clone()
    }
}

/// `file` holds the `written` records a [`Writer`] wrote, in order; then
/// it is removed.
pub fn every_record_in_place(file: &Path, written: u64) {
    let log = std::fs::read(file).unwrap();
    assert_eq!(log.len() as u64, written * 4096, "every record is in the file");
    for (i, record) in log.chunks(4096).enumerate() {
        assert_eq!(&record[..16], format!("{i:016}").as_bytes(), "record {i} in its place");
    }
    std::fs::remove_file(file).unwrap();
}

/// SIGKILL each of `pids` (one that ended already is fine).
pub fn kill_all(pids: &[i32]) {
    for pid in pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}
