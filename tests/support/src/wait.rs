//! Waiting for a condition with a deadline: the one poll loop of the tiers
//! and benches, so that every wait fails the same way, naming what it
//! waited for.

use std::time::{Duration, Instant};

/// How long a wait may take, and how often it looks. A bare [`Duration`]
/// looks every [`Deadline::POLL`]; waits that ask an API server or measure
/// nothing fine-grained say how often with [`Deadline::polling`].
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    within: Duration,
    poll: Duration,
}

impl Deadline {
    /// Short: most waits are for a socket or a file, and a bench's timings
    /// include the wait's last sleep.
    pub const POLL: Duration = Duration::from_millis(20);

    pub const fn within(within: Duration) -> Deadline {
        Deadline { within, poll: Deadline::POLL }
    }

    pub const fn polling(self, every: Duration) -> Deadline {
        Deadline { within: self.within, poll: every }
    }
}

impl From<Duration> for Deadline {
    fn from(within: Duration) -> Deadline {
        Deadline::within(within)
    }
}

/// What a check answers: `true` or `Some(value)` once it holds.
pub trait Ready {
    type Output;
    fn ready(self) -> Option<Self::Output>;
}

impl Ready for bool {
    type Output = ();
    fn ready(self) -> Option<()> {
        self.then_some(())
    }
}

impl<T> Ready for Option<T> {
    type Output = T;
    fn ready(self) -> Option<T> {
        self
    }
}

/// Polls `check` until it holds and returns what it gave; panics naming
/// `what` once `deadline` has passed.
pub fn wait_until<R: Ready>(
    deadline: impl Into<Deadline>,
    what: &str,
    check: impl FnMut() -> R,
) -> R::Output {
    wait_until_or(deadline, what, check, String::new)
}

/// [`wait_until`], the panic message followed by what `say` tells (logs,
/// the state last seen).
pub fn wait_until_or<R: Ready>(
    deadline: impl Into<Deadline>,
    what: &str,
    mut check: impl FnMut() -> R,
    say: impl FnOnce() -> String,
) -> R::Output {
    let Deadline { within, poll } = deadline.into();
    let start = Instant::now();
    loop {
        if let Some(out) = check().ready() {
            return out;
        }
        if start.elapsed() > within {
            panic!("timed out after {within:?} waiting for {what}\n{}", say());
        }
        std::thread::sleep(poll);
    }
}

/// [`wait_until`] for an async check, sleeping on tokio's timer.
pub async fn wait_until_async<R: Ready, F: Future<Output = R>>(
    deadline: impl Into<Deadline>,
    what: &str,
    mut check: impl FnMut() -> F,
) -> R::Output {
    let Deadline { within, poll } = deadline.into();
    let start = Instant::now();
    loop {
        if let Some(out) = check().await.ready() {
            return out;
        }
        assert!(start.elapsed() <= within, "timed out after {within:?} waiting for {what}");
        tokio::time::sleep(poll).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gives_what_the_check_found() {
        let mut n = 0;
        let found = wait_until(Duration::from_secs(5), "the third try", || {
            n += 1;
            (n == 3).then_some(n)
        });
        assert_eq!(found, 3);
    }

    #[test]
    #[should_panic(expected = "timed out after 50ms waiting for nothing, forever")]
    fn names_what_it_waited_for() {
        wait_until(Duration::from_millis(50), "nothing, forever", || false);
    }

    #[test]
    #[should_panic(expected = "the last state")]
    fn says_more_on_failure() {
        wait_until_or(Duration::from_millis(10), "x", || false, || "the last state".into());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn waits_asynchronously() {
        let mut n = 0;
        wait_until_async(
            Deadline::within(Duration::from_secs(5)).polling(Duration::ZERO),
            "n",
            || {
                n += 1;
                std::future::ready(n > 2)
            },
        )
        .await;
        assert_eq!(n, 3);
    }
}
