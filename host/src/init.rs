//! The agent as PID 1 (a container started without an init): PID 1 inherits
//! every orphaned process in its PID namespace — a mount helper's daemon,
//! a tool's stray child — and must reap them, or they stay zombies. Doing
//! that inside the agent would race with its own waits for the tools it
//! runs, so PID 1 becomes a small supervisor instead: it runs the agent as
//! its child, forwards termination signals to it, reaps everything, and
//! exits as the agent does.

use nix::sys::signal::{SigSet, Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use std::process::{Command, ExitCode};

/// Set in the supervised child, so it does not supervise again.
const CHILD_ENV: &str = "VOLAGENT_SUPERVISED";

/// When this process is PID 1 (and not already the supervised child), run
/// the same command line as a child and supervise it; returns its exit
/// code. Otherwise None: carry on.
pub fn supervise_if_pid1() -> Option<ExitCode> {
    if nix::unistd::getpid().as_raw() != 1 || std::env::var_os(CHILD_ENV).is_some() {
        return None;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!(
                "volagent: running as PID 1 but cannot find this binary ({e}); running without a reaper"
            );
            return None;
        }
    };
    let child = match Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(CHILD_ENV, "1")
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "volagent: running as PID 1 but cannot start the supervised agent ({e}); running without a reaper"
            );
            return None;
        }
    };
    Some(supervise(Pid::from_raw(child.id() as i32)))
}

fn supervise(child: Pid) -> ExitCode {
    let mut signals = SigSet::empty();
    for s in [Signal::SIGCHLD, Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGQUIT] {
        signals.add(s);
    }
    // Blocked, they queue for sigwait; the child was started before, with
    // the default mask.
    if let Err(e) = signals.thread_block() {
        eprintln!("volagent: PID 1 cannot block signals ({e})");
    }
    loop {
        // Reap everything that has exited (also what exited before the
        // signals were blocked).
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) if pid == child => {
                    return ExitCode::from(code.clamp(0, 255) as u8);
                }
                Ok(WaitStatus::Signaled(pid, sig, _)) if pid == child => {
                    return ExitCode::from(128u8.saturating_add(sig as u8));
                }
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => continue,
            }
        }
        match signals.wait() {
            Ok(Signal::SIGCHLD) | Err(_) => {}
            Ok(sig) => {
                let _ = kill(child, sig);
            }
        }
    }
}
