//! One engine per process: Cranelift, component model, pooling allocator and
//! epoch interruption ticked from a dedicated thread — only while a guest
//! call runs, so that an idle agent does not wake 200 times a second — and
//! the prewarmer ([`super::spare`]), which makes instances ahead of calls.

use super::imports::CallState;
use super::limits::Limits;
#[cfg(test)]
use super::ticker::LINGER;
use super::ticker::{Calling, Ticker};
use std::sync::{Arc, Mutex};
#[cfg(test)]
use std::time::Duration;
use wasmtime::component::Linker;
use wasmtime::{Config, Enabled, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

/// Memory of a freed instance slot kept mapped for the next call.
const KEEP_RESIDENT: usize = 2 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("cannot configure the WebAssembly engine: {0:#}")]
    Engine(wasmtime::Error),
    #[error("cannot link the host interfaces: {0:#}")]
    Link(wasmtime::Error),
    #[error("cannot start the epoch ticker thread: {0}")]
    Ticker(std::io::Error),
    #[error("cannot start the thread that makes instances ahead of calls: {0}")]
    Prewarmer(std::io::Error),
}

/// The engine, the linker with the `host` and WASI imports, and the ticker.
pub struct Runtime {
    pub(crate) engine: Engine,
    pub(crate) linker: Linker<CallState>,
    pub(crate) limits: Limits,
    ticker: Ticker,
    pub(crate) prewarmer: super::prewarm::Prewarmer,
    /// Every backend's instances made ahead: given back when a call finds
    /// the pool full.
    spares: Mutex<Vec<std::sync::Weak<super::prewarm::Prewarmed>>>,
    /// The versions compiled, by digest.
    pub(crate) compiled: super::compiled::Compiled,
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
        // Every contract version's `host`: each guest links to its own.
        super::contract::add_to_linker(&mut linker).map_err(RuntimeError::Link)?;

        let ticker = Ticker::start(engine.clone()).map_err(RuntimeError::Ticker)?;
        let prewarmer = super::prewarm::Prewarmer::start(engine.clone(), limits, ticker.handle())
            .map_err(RuntimeError::Prewarmer)?;
        let compiled = super::compiled::Compiled::new(engine.clone());
        Ok(Arc::new(Runtime {
            engine,
            linker,
            limits,
            ticker,
            prewarmer,
            spares: Mutex::default(),
            compiled,
        }))
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // The prewarmer first: what it makes counts as calls for the ticker.
        self.prewarmer.stop();
        self.ticker.stop();
    }
}

impl Runtime {
    /// Held for the length of a guest call: the epoch advances meanwhile.
    pub(crate) fn calling(&self) -> Calling {
        self.ticker.begin()
    }

    /// Compiles begun so far, failed ones included: each may have left the
    /// compiler's memory resident.
    pub(crate) fn compile_attempts(&self) -> u64 {
        self.compiled.attempts()
    }

    /// Count `spares` among the backends' instances made ahead.
    pub(crate) fn register_spares(&self, spares: &Arc<super::prewarm::Prewarmed>) {
        let mut all = self.spares.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|s| s.strong_count() > 0);
        all.push(Arc::downgrade(spares));
    }

    /// Drop every instance made ahead, of every backend, so that their pool
    /// slots serve calls.
    pub(crate) fn release_spares(&self) {
        let all: Vec<_> = self
            .spares
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|s| s.upgrade())
            .collect();
        // Every backend's, not only up to the first that had some.
        for spares in &all {
            spares.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticks(rt: &Runtime) -> u64 {
        rt.ticker.ticks()
    }

    #[test]
    fn the_epoch_advances_only_while_a_call_runs() {
        let rt = Runtime::new(Limits::default()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(ticks(&rt), 0, "parked with no call");
        let calling = rt.calling();
        let start = std::time::Instant::now();
        while ticks(&rt) < 2 {
            assert!(start.elapsed() < Duration::from_secs(5), "no tick while a call runs");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(calling);
        // It ticks on for a while after the call, then parks.
        let ended = ticks(&rt);
        std::thread::sleep(Duration::from_millis(100));
        assert!(ticks(&rt) > ended, "lingers after a call");
        std::thread::sleep(LINGER + Duration::from_millis(250));
        let after = ticks(&rt);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(ticks(&rt), after, "parked again");
    }
}
