//! Requests a dead client took and never answered, on a kernel that cannot
//! queue them again (`FUSE_NOTIFY_RESEND` came with Linux 6.9). They would
//! wait forever, and so would the writes and the unmount behind them. A
//! successor on such a kernel watches its connection: the kernel counts
//! every request waiting for an answer (fusectl's `waiting`), and the
//! successor knows which of them it holds. Seen idle with none waiting,
//! nothing was lost and the watch ends; seen idle with some waiting, again
//! and again, they are the dead client's, and the connection is aborted so
//! that they fail — the volume's I/O fails, as it did before clients were
//! handed over — instead of hanging.

use crate::fuse::Connection;
use std::path::Path;
use std::time::Duration;

/// How often the connection is looked at.
const EVERY: Duration = Duration::from_secs(1);
/// Idle looks with requests waiting that mean they are lost: a request on
/// its way to a reader is there for microseconds, a lost one for good.
const IDLE_LOOKS: u32 = 5;

/// What the looks so far say.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Watching,
    NoneLost,
    /// This many requests wait that no client holds.
    Lost(u64),
}

/// The looks at one connection.
#[derive(Debug, Default)]
pub struct Watch {
    idle_with_waiting: u32,
}

impl Watch {
    /// One look: whether the successor held no request and took none
    /// while it looked (`idle`), and how many the kernel counted waiting.
    /// Busy looks tell only that none waits at all; the requests queued
    /// for its readers are counted too.
    pub fn look(&mut self, idle: bool, waiting: u64) -> Verdict {
        if waiting == 0 {
            return Verdict::NoneLost;
        }
        if idle {
            self.idle_with_waiting += 1;
            if self.idle_with_waiting >= IDLE_LOOKS {
                return Verdict::Lost(waiting);
            }
        }
        Verdict::Watching
    }
}

/// Watch `connection`, mounted at `dir`, until nothing was lost, or abort
/// it when requests were; returns when either is known (or the connection
/// cannot be looked at).
pub fn watch(connection: &Connection, dir: &Path, stop: &crate::fuse::Stop) {
    let conn = match nix::sys::stat::stat(dir) {
        Ok(st) => nix::sys::stat::minor(st.st_dev) as u32,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), "requests the last client took cannot be looked for: {e}");
            return;
        }
    };
    // Opened now, while the mount is known to be this connection's.
    let switch = match crate::sys::fusectl::AbortSwitch::open(conn) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(conn, "requests the last client took cannot be looked for: {e}");
            return;
        }
    };
    let mut watch = Watch::default();
    while !stop.wait(EVERY) {
        let (held, before) = connection.activity();
        let Ok(waiting) = crate::sys::fusectl::waiting(conn) else { return };
        let (held_after, after) = connection.activity();
        let idle = held == 0 && held_after == 0 && before == after;
        match watch.look(idle, waiting) {
            Verdict::Watching => {}
            Verdict::NoneLost => {
                tracing::info!(conn, "the last client left no request unanswered");
                return;
            }
            Verdict::Lost(n) => {
                tracing::error!(
                    conn,
                    "the last client died holding {n} requests, which this kernel (without FUSE_NOTIFY_RESEND, before Linux 6.9) cannot give to a successor: aborting the connection, so that they fail instead of waiting forever"
                );
                switch.pull();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_waiting_ends_the_watch_and_idle_with_some_waiting_again_and_again_is_a_loss() {
        let mut w = Watch::default();
        assert_eq!(w.look(false, 5), Verdict::Watching, "busy: others may be queued");
        assert_eq!(w.look(false, 0), Verdict::NoneLost);

        let mut w = Watch::default();
        for _ in 1..IDLE_LOOKS {
            assert_eq!(w.look(true, 2), Verdict::Watching);
            assert_eq!(w.look(false, 4), Verdict::Watching, "busy looks count for nothing");
        }
        assert_eq!(w.look(true, 2), Verdict::Lost(2));
    }
}
