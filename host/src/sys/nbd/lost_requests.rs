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
/// Idle looks in a row, with requests waiting and none taken since the
/// first of them, that mean those requests are lost: a request on its way
/// to a reader is there for microseconds, and readers that wait take it.
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
    /// Idle looks in a row with requests waiting, and the successor's
    /// count of requests taken at the first of them.
    idle_since: Option<(u32, u64)>,
}

impl Watch {
    /// One look: whether the successor held no request and took none
    /// while it looked (`idle`), how many it has taken in all, and how
    /// many the kernel counted waiting. A busy look, or one after a
    /// request was taken, starts the count again: the requests queued
    /// for its readers are counted too.
    pub fn look(&mut self, idle: bool, taken: u64, waiting: u64) -> Verdict {
        if waiting == 0 {
            return Verdict::NoneLost;
        }
        self.idle_since = match self.idle_since {
            Some((n, since)) if idle && since == taken => Some((n + 1, since)),
            _ if idle => Some((1, taken)),
            _ => None,
        };
        match self.idle_since {
            Some((n, _)) if n >= IDLE_LOOKS => Verdict::Lost(waiting),
            _ => Verdict::Watching,
        }
    }
}

/// Watch `connection`, mounted at `dir`, until nothing was lost, or abort
/// it when requests were; returns when either is known (or the connection
/// cannot be looked at).
pub fn watch(connection: &Connection, dir: &Path, stop: &crate::fuse::Stop) {
    // From the mount table: a stat of the mount would be a request to
    // this very client, which may be stopping.
    let conn = match crate::sys::mountinfo::own() {
        Ok(table) => match table.iter().rev().find(|m| m.mount_point == dir) {
            Some(m) => m.device.1,
            None => {
                tracing::warn!(dir = %dir.display(), "requests the last client took cannot be looked for: not mounted");
                return;
            }
        },
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
        match watch.look(idle, after, waiting) {
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
    fn none_waiting_ends_the_watch_and_idle_with_some_waiting_in_a_row_is_a_loss() {
        let mut w = Watch::default();
        assert_eq!(w.look(false, 9, 5), Verdict::Watching, "busy: others may be queued");
        assert_eq!(w.look(false, 12, 0), Verdict::NoneLost);

        let mut w = Watch::default();
        for _ in 1..IDLE_LOOKS {
            assert_eq!(w.look(true, 40, 2), Verdict::Watching);
        }
        assert_eq!(w.look(true, 40, 2), Verdict::Lost(2));
    }

    #[test]
    fn a_busy_look_or_a_request_taken_between_idle_looks_starts_the_count_again() {
        let mut w = Watch::default();
        for i in 0..3 * IDLE_LOOKS {
            let taken = u64::from(i);
            // Each idle look after a request was taken since the last.
            assert_eq!(w.look(true, taken, 1), Verdict::Watching, "look {i}");
        }
        let mut w = Watch::default();
        for i in 0..3 * IDLE_LOOKS {
            let verdict = if i % 4 == 3 { w.look(false, 7, 3) } else { w.look(true, 7, 1) };
            assert_eq!(verdict, Verdict::Watching, "look {i}");
        }
    }
}
