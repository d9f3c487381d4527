//! Where the agent keeps its recordings of policy calls: one small file
//! per call under `<dir>/<backend>/`, named so that their names sort in
//! the order they were written, bounded in count and bytes (the oldest go
//! first). Files are the owner's alone: they name pods and nodes.

use super::{SysError, io};
use std::collections::VecDeque;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The files kept, oldest first, and their total size.
pub struct RecordingStore {
    dir: PathBuf,
    max_files: usize,
    max_bytes: u64,
    files: VecDeque<(String, PathBuf, u64)>,
    bytes: u64,
    seq: u64,
}

/// Backend names become dir names: only a DNS label is taken.
fn backend_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn make_dir(path: &Path) -> Result<(), SysError> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(path).map_err(io("mkdir", path))
}

impl RecordingStore {
    /// The store at `dir` (made when missing), with what an earlier agent
    /// left there counted against the bounds.
    pub fn open(dir: &Path, max_files: usize, max_bytes: u64) -> Result<RecordingStore, SysError> {
        make_dir(dir)?;
        // Made by an admin perhaps, with other modes: the owner's alone.
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(io("chmod", dir))?;
        let mut found = Vec::new();
        for backend in std::fs::read_dir(dir).map_err(io("read dir", dir))? {
            let backend = backend.map_err(io("read dir", dir))?;
            let name = backend.file_name().to_string_lossy().into_owned();
            // Not followed: a link here could point anywhere.
            if !backend_ok(&name) || !backend.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let sub = backend.path();
            for file in std::fs::read_dir(&sub).map_err(io("read dir", &sub))? {
                let file = file.map_err(io("read dir", &sub))?;
                let fname = file.file_name().to_string_lossy().into_owned();
                let meta = file.metadata().map_err(io("stat", &file.path()))?;
                if fname.starts_with('.') && fname.ends_with(".tmp") {
                    // Left by a write a crash cut short.
                    let _ = std::fs::remove_file(file.path());
                } else if fname.ends_with(".json") && !fname.starts_with('.') && meta.is_file() {
                    found.push((fname, file.path(), meta.len()));
                }
            }
        }
        found.sort();
        let bytes = found.iter().map(|f| f.2).sum();
        let mut store = RecordingStore {
            dir: dir.to_path_buf(),
            max_files: max_files.max(1),
            max_bytes,
            files: found.into(),
            bytes,
            seq: 0,
        };
        store.evict();
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Files kept now, and their bytes.
    pub fn usage(&self) -> (usize, u64) {
        (self.files.len(), self.bytes)
    }

    /// Keep `bytes` as `<dir>/<backend>/<stamp>-<n>-<call>.json`, written
    /// whole or not at all; the oldest files go while over the bounds.
    /// `stamp` must sort by time (e.g. `20261129T010203.123456Z`).
    pub fn write(
        &mut self,
        backend: &str,
        stamp: &str,
        call: &str,
        bytes: &[u8],
    ) -> Result<PathBuf, SysError> {
        let refused = |what: String| SysError::Refused { path: self.dir.clone(), what };
        if !backend_ok(backend) || !backend_ok(call) {
            return Err(refused(format!("backend {backend:?} or call {call:?} is not a name")));
        }
        if !stamp.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.') {
            return Err(refused(format!("stamp {stamp:?} is not a time stamp")));
        }
        let size = bytes.len() as u64;
        if size > self.max_bytes {
            return Err(refused(format!(
                "a recording of {size} bytes is over the store's bound of {} bytes",
                self.max_bytes
            )));
        }
        let sub = self.dir.join(backend);
        // Only a dir of its own: never through a link planted there.
        match std::fs::symlink_metadata(&sub) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(refused(format!("{} is not a directory", sub.display()))),
            Err(_) => make_dir(&sub)?,
        }
        self.seq += 1;
        let name = format!("{stamp}-{:06}-{call}.json", self.seq % 1_000_000);
        let path = sub.join(&name);
        let temp = sub.join(format!(".{name}.tmp"));
        let written = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
                .open(&temp)?;
            f.write_all(bytes)?;
            std::fs::rename(&temp, &path)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temp);
            return Err(SysError::Io { op: "write", path, source: e });
        }
        self.files.push_back((name, path.clone(), size));
        self.bytes += size;
        self.evict();
        Ok(path)
    }

    /// The oldest files go until the store is within its bounds.
    fn evict(&mut self) {
        while self.files.len() > self.max_files || self.bytes > self.max_bytes {
            let Some((_, path, size)) = self.files.pop_front() else { break };
            self.bytes -= size;
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(file = %path.display(), "recording not removed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_in_count_and_bytes_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rec");
        let mut store = RecordingStore::open(&root, 3, 1000).unwrap();
        for i in 0..5 {
            store.write("rbd", &format!("2026112{i}T000000.000000Z"), "fence", b"{}").unwrap();
        }
        assert_eq!(store.usage(), (3, 6));
        let mut names: Vec<String> = std::fs::read_dir(root.join("rbd"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert!(names[0].starts_with("20261122T"), "the oldest went: {names:?}");
        let mode = std::fs::metadata(root.join("rbd").join(&names[0])).unwrap();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777, 0o600);
        // Bytes bound the store too, and a reopened store counts what is there.
        let mut store = RecordingStore::open(&root, 100, 700).unwrap();
        assert_eq!(store.usage(), (3, 6));
        store.write("nbd", "20261130T000000.000000Z", "attach", &[b'x'; 500]).unwrap();
        store.write("nbd", "20261130T000001.000000Z", "attach", &[b'x'; 500]).unwrap();
        assert_eq!(store.usage(), (1, 500), "over 700 bytes: all but the newest went");
        assert!(store.write("nbd", "20261130T000002.000000Z", "attach", &[0; 701]).is_err());
        assert!(store.write("../x", "20261130T000002.000000Z", "attach", b"{}").is_err());
        assert!(store.write("nbd", "../../x", "attach", b"{}").is_err());
    }
}
