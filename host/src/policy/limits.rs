//! Bounds on what one guest call and one plugin file may use.

use std::time::Duration;

/// How often the epoch advances; deadlines are rounded up to it.
pub const EPOCH_TICK: Duration = Duration::from_millis(5);

/// Bounds on what one guest call and one plugin file may use.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Wall-clock budget of one call, instantiation included.
    pub deadline: Duration,
    /// Linear memory one call may grow to, in bytes.
    pub memory_bytes: usize,
    /// Largest `.wasm` file accepted.
    pub max_file_bytes: u64,
    /// Guest calls that may run at once (pooling allocator slots).
    pub concurrent_calls: u32,
    /// Instances made ahead of calls, per backend (see `prewarm`): each
    /// keeps its linear memory resident while it waits.
    pub instances_ahead: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            deadline: Duration::from_millis(500),
            memory_bytes: 64 << 20,
            max_file_bytes: 16 << 20,
            concurrent_calls: 64,
            instances_ahead: 2,
        }
    }
}

impl Limits {
    /// The deadline in epoch ticks (at least one full tick past it).
    pub(crate) fn deadline_ticks(&self) -> u64 {
        (self.deadline.as_micros() / EPOCH_TICK.as_micros()) as u64 + 1
    }
}
