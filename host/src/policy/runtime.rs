//! One engine per process: Cranelift, component model, pooling allocator and
//! epoch interruption ticked from a dedicated thread.

use super::bindings::Backend;
use super::imports::CallState;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;
use wasmtime::component::{HasSelf, Linker};
use wasmtime::{Config, Enabled, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

/// Memory of a freed instance slot kept mapped for the next call.
const KEEP_RESIDENT: usize = 2 << 20;

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
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            deadline: Duration::from_millis(500),
            memory_bytes: 64 << 20,
            max_file_bytes: 16 << 20,
            concurrent_calls: 64,
        }
    }
}

impl Limits {
    /// The deadline in epoch ticks (at least one full tick past it).
    pub(crate) fn deadline_ticks(&self) -> u64 {
        (self.deadline.as_micros() / EPOCH_TICK.as_micros()) as u64 + 1
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("cannot configure the WebAssembly engine: {0:#}")]
    Engine(wasmtime::Error),
    #[error("cannot link the host interfaces: {0:#}")]
    Link(wasmtime::Error),
    #[error("cannot start the epoch ticker thread: {0}")]
    Ticker(std::io::Error),
}

/// The engine, the linker with the `host` and WASI imports, and the ticker.
pub struct Runtime {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<CallState>,
    pub(crate) limits: Limits,
    ticker: Ticker,
}

impl Runtime {
    pub fn new(limits: Limits) -> Result<Arc<Self>, RuntimeError> {
        let mut pool = PoolingAllocationConfig::default();
        // A std Rust guest has a few core instances (its module and the
        // WASI adapter's), each with at most one memory and a table or two.
        let slots = limits.concurrent_calls.max(1);
        pool.total_component_instances(slots)
            .total_core_instances(slots * 8)
            .total_memories(slots * 4)
            .total_tables(slots * 8)
            .total_stacks(slots)
            .max_memory_size(limits.memory_bytes)
            // Reset a freed slot's memory by rewriting only the pages the
            // last call touched (PAGEMAP_SCAN, Linux 6.7+) instead of
            // dropping them: the next instance then takes no page faults.
            // Halves the cost of a call.
            .linear_memory_keep_resident(KEEP_RESIDENT)
            .table_keep_resident(KEEP_RESIDENT / 8)
            .pagemap_scan(Enabled::Auto);
        let mut config = Config::new();
        config
            .wasm_component_model(true)
            .epoch_interruption(true)
            .cranelift_opt_level(wasmtime::OptLevel::Speed)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&config).map_err(RuntimeError::Engine)?;

        let mut linker = Linker::new(&engine);
        // WASI with an empty context: a std guest needs the interfaces to
        // link, but gets no preopens, environment, arguments or sockets.
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(RuntimeError::Link)?;
        Backend::add_to_linker::<CallState, HasSelf<CallState>>(&mut linker, |s| s)
            .map_err(RuntimeError::Link)?;
        // The previous contract's `host`, for guests built against it.
        super::compat::v0_4::Backend::add_to_linker::<CallState, HasSelf<CallState>>(&mut linker, |s| s)
            .map_err(RuntimeError::Link)?;

        let ticker = Ticker::start(engine.clone()).map_err(RuntimeError::Ticker)?;
        Ok(Arc::new(Runtime { engine, linker, limits, ticker }))
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.ticker.stop();
    }
}

/// Advances the engine's epoch every [`EPOCH_TICK`] so that guest calls
/// past their deadline trap.
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    fn start(engine: Engine) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new().name("volagent-epoch".into()).spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(EPOCH_TICK);
                engine.increment_epoch();
            }
        })?;
        Ok(Ticker { stop, thread: Some(thread) })
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
