//! The per-call store state and the `host` imports a guest may call.

use super::bindings::volagent::policy::{host, types};
use super::bindings::{LogLevel, MountEntry, NodeFacts, PathKind, Watcher};
use super::queries::Queries;
use std::sync::Arc;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// Log lines one call may write; more are dropped (and counted) so a guest
/// cannot flood the agent's log.
const MAX_LOG_LINES: u32 = 64;
const MAX_LOG_BYTES: usize = 4096;

/// Everything one guest call's store holds. A fresh one per call.
pub struct CallState {
    wasi: WasiCtx,
    table: ResourceTable,
    queries: Arc<dyn Queries>,
    backend: Arc<str>,
    logged: u32,
    pub(crate) memory: MemoryCap,
    pub(crate) limits: super::limits::Limits,
}

impl CallState {
    pub(crate) fn new(
        backend: Arc<str>,
        queries: Arc<dyn Queries>,
        limits: super::limits::Limits,
    ) -> Self {
        CallState {
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
            queries,
            backend,
            logged: 0,
            memory: MemoryCap { cap: limits.memory_bytes, refused: false },
            limits,
        }
    }

    /// An instance made ahead ([`super::spare`]) starts its call: the
    /// call's queries, and the call's own count of log lines.
    pub(crate) fn begin_call(&mut self, queries: Arc<dyn Queries>) {
        self.queries = queries;
        self.logged = 0;
    }

    pub(crate) fn dropped_log_lines(&self) -> u32 {
        self.logged.saturating_sub(MAX_LOG_LINES)
    }
}

/// Refuses memory growth past the cap and remembers it did, so that the
/// trap that follows is reported as what it is.
pub(crate) struct MemoryCap {
    cap: usize,
    pub(crate) refused: bool,
}

impl wasmtime::ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _max: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.cap {
            self.refused = true;
            return Ok(false);
        }
        Ok(true)
    }
    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _max: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl types::Host for CallState {}

impl host::Host for CallState {
    fn log(&mut self, level: LogLevel, message: String) -> wasmtime::Result<()> {
        self.logged += 1;
        if self.logged > MAX_LOG_LINES {
            return Ok(());
        }
        let mut message = message;
        if message.len() > MAX_LOG_BYTES {
            let mut cut = MAX_LOG_BYTES;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push('…');
        }
        let backend = &*self.backend;
        match level {
            LogLevel::Debug => tracing::debug!(backend, "{message}"),
            LogLevel::Info => tracing::info!(backend, "{message}"),
            LogLevel::Warn => tracing::warn!(backend, "{message}"),
            LogLevel::Error => tracing::error!(backend, "{message}"),
        }
        Ok(())
    }

    fn node_state(&mut self, name: String) -> wasmtime::Result<NodeFacts> {
        Ok(self.queries.node_state(&name))
    }

    // A query the host will not answer fails the guest's call (a trap
    // carrying the QueryError): no answer the contract has would be true.
    fn lookup_path(&mut self, path: String) -> wasmtime::Result<PathKind> {
        Ok(self.queries.lookup_path(&path)?)
    }

    fn filesystem_type(&mut self, device: String) -> wasmtime::Result<Option<String>> {
        Ok(self.queries.filesystem_type(&device)?)
    }

    fn mount_at(&mut self, target: String) -> wasmtime::Result<Option<MountEntry>> {
        Ok(self.queries.mount_at(&target)?)
    }

    fn image_watchers(
        &mut self,
        pool: String,
        image: String,
    ) -> wasmtime::Result<Result<Vec<Watcher>, String>> {
        Ok(self.queries.image_watchers(&pool, &image))
    }
}
