//! The per-call store state, and what the `host` imports of every contract
//! version do with it.

use super::queries::Queries;
use crate::model::LogLevel;
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
    /// Resources the host made for the guest in this call, plans and
    /// answers (contract 1.x), by kind: bounded, so that a guest keeping
    /// them cannot grow the host's memory without end.
    made: [u32; 2],
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
            made: [0; 2],
            memory: MemoryCap { cap: limits.memory_bytes, refused: false },
            limits,
        }
    }

    /// An instance made ahead ([`super::spare`]) starts its call: the
    /// call's queries, and the call's own count of log lines.
    pub(crate) fn begin_call(&mut self, queries: Arc<dyn Queries>) {
        self.queries = queries;
        self.logged = 0;
        self.made = [0; 2];
    }

    pub(crate) fn dropped_log_lines(&self) -> u32 {
        self.logged.saturating_sub(MAX_LOG_LINES)
    }
}

/// Kinds of resource the host makes for a guest during a call.
#[derive(Clone, Copy)]
pub(crate) enum Made {
    /// A plan (`plan::new`).
    Plan,
    /// A node's facts (`host.node-state`).
    Node,
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

impl CallState {
    /// The call's resources: what the host lends a guest, and the plans it
    /// builds.
    pub(crate) fn table(&mut self) -> &mut ResourceTable {
        &mut self.table
    }

    /// Count one resource more of `kind` made in this call; false past
    /// `max`.
    pub(crate) fn count_made(&mut self, kind: Made, max: u32) -> bool {
        let n = &mut self.made[kind as usize];
        *n += 1;
        *n <= max
    }

    /// The call's queries, as the `host` imports answer them.
    pub(crate) fn queries(&self) -> &dyn Queries {
        &*self.queries
    }

    /// A guest's log line, attributed to its backend; bounded per call in
    /// count and length so a guest cannot flood the agent's log.
    pub(crate) fn guest_log(&mut self, level: LogLevel, message: String) {
        self.logged += 1;
        if self.logged > MAX_LOG_LINES {
            return;
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
    }
}
