//! Components compiled, by the sha256 of their bytes. A promote, a
//! rollback, a BackendPolicy moved back, or a backend removed and put back
//! serves a version this agent has compiled before: found here, it skips
//! Cranelift, which is nearly all of a reload's time (100–150 ms for one
//! policy on a 2-core node). A version really new is compiled once.
//!
//! Only components that compiled are kept: a file refused is refused again
//! by its digest before it gets here ([`crate::plugin::reload`]).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Versions kept, the most recently loaded. Enough for each of a node's
/// usual backends with a candidate and a previous version; a version's
/// compiled code is about 2–3 times its `.wasm` (a few hundred KB), and
/// the ones serving are held by their plugins anyway.
const KEEP: usize = 8;

#[derive(Default)]
pub(crate) struct Compiled {
    /// (sha256, component), the least recently loaded first.
    kept: Mutex<Vec<(String, Component)>>,
    compiles: AtomicU64,
}

impl Compiled {
    /// The component of `bytes`, whose sha256 is `sha256`: the one kept,
    /// or compiled now (outside the lock: a compile takes a while, and
    /// another version's load need not wait for it).
    pub(crate) fn get(
        &self,
        engine: &Engine,
        sha256: &str,
        bytes: &[u8],
    ) -> wasmtime::Result<Component> {
        if let Some(component) = self.hit(sha256) {
            return Ok(component);
        }
        let component = Component::new(engine, bytes)?;
        self.compiles.fetch_add(1, Ordering::Relaxed);
        crate::metrics::get().plugin_compiles.inc();
        let mut kept = self.lock();
        kept.retain(|(sha, _)| sha != sha256);
        kept.push((sha256.to_string(), component.clone()));
        let over = kept.len().saturating_sub(KEEP);
        kept.drain(..over);
        Ok(component)
    }

    /// Components compiled so far (not those found kept).
    pub(crate) fn compiles(&self) -> u64 {
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
        let mut out = bytes.to_vec();
        out.push(0);
        out.push(u8::try_from(name.len() + 1).expect("a short name"));
        out.push(u8::try_from(name.len()).expect("a short name"));
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
        let compiled = Compiled::default();
        let load =
            |n: usize| compiled.get(&engine, &sha(&versions[n]), &versions[n]).expect("compiles");
        load(0);
        load(1);
        assert_eq!(compiled.compiles(), 2);
        load(0);
        assert_eq!(compiled.compiles(), 2, "a version seen before is not compiled again");
        // KEEP - 1 more versions push out the least recently loaded: 1.
        for n in 2..=KEEP {
            load(n);
        }
        assert_eq!(compiled.compiles(), u64::try_from(KEEP + 1).expect("small"));
        load(0);
        assert_eq!(compiled.compiles(), u64::try_from(KEEP + 1).expect("small"), "0 was kept");
        load(1);
        assert_eq!(compiled.compiles(), u64::try_from(KEEP + 2).expect("small"), "1 was not");
        // Bytes that do not compile are an error, and nothing is kept for them.
        let garbage = b"\0asm\x0d\0\x01\0garbage";
        assert!(compiled.get(&engine, &sha(garbage), garbage).is_err());
        assert!(compiled.hit(&sha(garbage)).is_none());
    }
}
