//! Components loaded, by the sha256 of their bytes. A promote, a
//! rollback, a BackendPolicy moved back, or a backend removed and put back
//! serves a version this agent has loaded before: found here, it skips
//! Cranelift, which is nearly all of a reload's time (100–150 ms for one
//! policy on a 2-core node). A version really new is compiled (twice only
//! if two loads of it race, which costs time, not correctness).
//!
//! A component is kept once its load has passed every check of
//! [`super::Plugin`]'s (imports, contract, `info`), so that a refused file
//! never pushes out a version a rollback needs.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Versions kept, the most recently loaded. The ones serving are held by
/// their plugins anyway; each one kept that no longer serves holds its
/// code (0.5–0.7 MiB for local-pv), on every node, idle. Four cover a
/// rollout of one backend on a node of four: its candidate, promoted,
/// and the version it replaced, rolled back to. Older ones compile again.
const KEEP: usize = 4;

pub(crate) struct Compiled {
    engine: Engine,
    /// (sha256, component), the least recently loaded first.
    kept: Mutex<Vec<(String, Component)>>,
    /// Compiles begun (whether they succeeded or not): each may have left
    /// the compiler's memory resident.
    attempts: AtomicU64,
    /// Compiles that succeeded.
    compiles: AtomicU64,
}

impl Compiled {
    /// Components of `engine`, the runtime's.
    pub(crate) fn new(engine: Engine) -> Compiled {
        Compiled {
            engine,
            kept: Mutex::default(),
            attempts: AtomicU64::default(),
            compiles: AtomicU64::default(),
        }
    }

    /// The component of `bytes`, whose sha256 is `sha256`: the one kept,
    /// or compiled now (outside the lock: a compile takes a while, and
    /// another version's load need not wait for it). Not kept until
    /// [`Compiled::keep`].
    pub(crate) fn get(&self, sha256: &str, bytes: &[u8]) -> wasmtime::Result<Component> {
        if let Some(component) = self.hit(sha256) {
            return Ok(component);
        }
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let component = Component::new(&self.engine, bytes)?;
        self.compiles.fetch_add(1, Ordering::Relaxed);
        crate::metrics::get().plugin_compiles.inc();
        Ok(component)
    }

    /// Keep `component`, of a version whose load passed every check, as
    /// the most recently loaded.
    pub(crate) fn keep(&self, sha256: &str, component: &Component) {
        let mut kept = self.lock();
        kept.retain(|(sha, _)| sha != sha256);
        kept.push((sha256.to_string(), component.clone()));
        let over = kept.len().saturating_sub(KEEP);
        kept.drain(..over);
    }

    /// Compiles begun so far, failed ones included (not versions found kept).
    pub(crate) fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// Compiles that succeeded so far (the metric counts them too).
    #[cfg(test)]
    fn compiles(&self) -> u64 {
        self.compiles.load(Ordering::Relaxed)
    }

    fn hit(&self, sha256: &str) -> Option<Component> {
        let mut kept = self.lock();
        let at = kept.iter().position(|(sha, _)| sha == sha256)?;
        let entry = kept.remove(at);
        let component = entry.1.clone();
        kept.push(entry);
        Some(component)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, Component)>> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bytes` with an empty custom section named `name` appended: the same
    /// component under another digest.
    fn renamed(bytes: &[u8], name: &str) -> Vec<u8> {
        // Sizes of one LEB128 byte.
        let size = u8::try_from(name.len() + 1).ok().filter(|n| *n < 0x80).expect("a short name");
        let mut out = bytes.to_vec();
        out.extend([0, size, size - 1]);
        out.extend_from_slice(name.as_bytes());
        out
    }

    #[test]
    fn a_version_is_compiled_once_and_the_least_recently_loaded_go_first() {
        let engine =
            Engine::new(wasmtime::Config::new().wasm_component_model(true)).expect("an engine");
        let base = std::fs::read(volagent_test_artifacts::SHARED_FILE).expect("a guest");
        let versions: Vec<Vec<u8>> =
            (0..=KEEP).map(|n| renamed(&base, &format!("version-{n}"))).collect();
        let sha = |b: &[u8]| {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(b))
        };
        let compiled = Compiled::new(engine);
        let load = |n: usize| {
            let sha = sha(&versions[n]);
            let component = compiled.get(&sha, &versions[n]).expect("compiles");
            compiled.keep(&sha, &component);
        };
        let compiles = |n: usize| u64::try_from(n).expect("small");
        load(0);
        load(1);
        assert_eq!(compiled.compiles(), 2);
        load(0);
        assert_eq!(compiled.compiles(), 2, "a version seen before is not compiled again");
        // KEEP - 1 more versions push out the least recently loaded: 1.
        for n in 2..=KEEP {
            load(n);
        }
        assert_eq!(compiled.compiles(), compiles(KEEP + 1));
        load(0);
        assert_eq!(compiled.compiles(), compiles(KEEP + 1), "0 was kept");
        load(1);
        assert_eq!(compiled.compiles(), compiles(KEEP + 2), "1 was not");
        // A version not kept (its load refused it after the compile) is
        // compiled again.
        let refused = renamed(&base, "refused");
        compiled.get(&sha(&refused), &refused).expect("compiles");
        compiled.get(&sha(&refused), &refused).expect("compiles");
        assert_eq!(compiled.compiles(), compiles(KEEP + 4));
        // Bytes that do not compile are an error, counted as an attempt only.
        let garbage = b"\0asm\x0d\0\x01\0garbage";
        assert!(compiled.get(&sha(garbage), garbage).is_err());
        assert_eq!(compiled.attempts(), compiles(KEEP + 5));
        assert_eq!(compiled.compiles(), compiles(KEEP + 4));
    }
}
