//! The node's mount records (its "stash", as its files and messages say):
//! for every pod mount dir this agent mounted, what
//! it needs to unmount it (volume, consumer, paths) — kubelet's `unmount`
//! gives only the dir, and teardown must work with no API at all.

use crate::model::{Consumer, NodePaths, Volume};
use serde::{Deserialize, Serialize};
use sha2::Digest;
use std::collections::BTreeMap;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// A CSI volume published at `target` from its staging path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publication {
    pub volume: String,
    pub backend: String,
    pub staging: String,
    pub target: String,
    pub read_only: bool,
    /// One pod on the node at a time (ReadWriteOncePod).
    pub single_pod: bool,
    /// `<namespace>/<name>` of the pod, when kubelet said (podInfoOnMount).
    pub pod: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MountRecord {
    pub volume: Volume,
    pub consumer: Consumer,
    pub paths: NodePaths,
    /// When the ledger recorded this consumer (its holder's `since`): a
    /// cleanup entry about an earlier mount of the same dir never matches.
    /// None in entries an older agent wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
}

/// An entry as stored, also by an earlier agent: the model's serde form
/// is the records', and what older ones lack has its default.
fn decode_entry(bytes: &[u8]) -> Result<MountRecord, serde_json::Error> {
    serde_json::from_slice(bytes)
}

#[derive(Debug, thiserror::Error)]
#[error("stash {}: {message}", path.display())]
pub struct MountRecordsError {
    path: PathBuf,
    message: String,
}

/// Entries by pod mount dir (or CSI staging path).
const MOUNTS: &str = "mounts";
/// CSI publications, by target path: kubelet's NodeUnpublish gives only
/// the volume and the target.
const PUBLISHED: &str = "published";
/// Entries that could not be decoded, kept (for people) out of the way.
const QUARANTINE: &str = "quarantine";

/// No stash file is larger: one that is has been tampered with.
const MAX_FILE: u64 = 1 << 20;

/// One small file per entry in a dir of the runtime dir (a tmpfs on a
/// node: the stash lives as long as the mounts it describes), and the same
/// in memory: the agent is the stash's one writer, so reads need not touch
/// the files. A write goes whole to a temporary name and is renamed over
/// the entry, so an agent killed mid-write leaves the old entry or the new
/// one, never part of one. A write costs a few syscalls, each named from a
/// handle on its table's dir (no walk of the runtime dir's path each time);
/// a database transaction cost 30–60 µs, on every mount's path.
pub struct MountRecords {
    dir: PathBuf,
    /// Handles on the tables' dirs, by table.
    dirs: BTreeMap<&'static str, std::os::fd::OwnedFd>,
    /// This process's id, in temporary names.
    pid: u32,
    /// Table → key → value, as the files hold them.
    tables: std::sync::Mutex<Tables>,
}

/// A file's name: the key's hash (keys are paths, longer than a name may be).
fn file_name(key: &str) -> String {
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

/// A file holds its key (the name is only its hash) and the value:
/// the key's length (u32, little-endian), the key, the value.
fn encode_record(key: &str, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + key.len() + value.len());
    out.extend_from_slice(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(value);
    out
}

fn decode_record(bytes: &[u8]) -> Option<(String, &[u8])> {
    let (len, rest) = bytes.split_first_chunk::<4>()?;
    let len = usize::try_from(u32::from_le_bytes(*len)).ok()?;
    if len > rest.len() {
        return None;
    }
    let (key, value) = rest.split_at(len);
    Some((String::from_utf8(key.to_vec()).ok()?, value))
}

type Tables = BTreeMap<&'static str, BTreeMap<String, Row>>;

/// A value as its file holds it, and once read, as what it decodes to: the
/// publish and unpublish paths read the same entries several times, and a
/// decode costs more than the rest of such a read.
struct Row {
    bytes: Vec<u8>,
    decoded: std::sync::OnceLock<Decoded>,
}

enum Decoded {
    MountRecord(Box<MountRecord>),
    Publication(Publication),
}

impl Row {
    fn new(bytes: Vec<u8>) -> Row {
        Row { bytes, decoded: std::sync::OnceLock::new() }
    }

    /// A row of `bytes` whose value is known: written from it.
    fn known(bytes: Vec<u8>, decoded: Decoded) -> Row {
        Row { bytes, decoded: std::sync::OnceLock::from(decoded) }
    }

    /// The entry the row holds, decoded at the first read. A value that
    /// does not decode is not kept: its error comes at every read.
    fn entry(&self) -> Result<MountRecord, serde_json::Error> {
        if let Some(Decoded::MountRecord(e)) = self.decoded.get() {
            return Ok(MountRecord::clone(e));
        }
        let entry = decode_entry(&self.bytes)?;
        let _ = self.decoded.set(Decoded::MountRecord(Box::new(entry.clone())));
        Ok(entry)
    }

    fn publication(&self) -> Result<Publication, serde_json::Error> {
        if let Some(Decoded::Publication(p)) = self.decoded.get() {
            return Ok(p.clone());
        }
        let publication: Publication = serde_json::from_slice(&self.bytes)?;
        let _ = self.decoded.set(Decoded::Publication(publication.clone()));
        Ok(publication)
    }
}

impl MountRecords {
    /// Open (or create) the stash in `dir` and read it. Temporary files
    /// an agent killed mid-write left behind are removed; a file that is
    /// no record (damaged, or too large) is quarantined under its name.
    pub fn open(dir: &Path) -> Result<MountRecords, MountRecordsError> {
        let err = |path: &Path, e: &dyn std::fmt::Display| MountRecordsError {
            path: path.to_path_buf(),
            message: e.to_string(),
        };
        let mut tables = Tables::new();
        let mut damaged = Vec::new();
        // The runtime dir as it comes (others reach the socket in it); the
        // stash's own dirs are the agent's alone.
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent).map_err(|e| err(parent, &e))?;
        }
        let private_dir = |path: &Path| match std::fs::DirBuilder::new().mode(0o700).create(path) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(err(path, &e)),
            _ => Ok(()),
        };
        private_dir(dir)?;
        for table in [MOUNTS, PUBLISHED, QUARANTINE] {
            let path = dir.join(table);
            private_dir(&path)?;
            let rows = tables.entry(table).or_default();
            for item in std::fs::read_dir(&path).map_err(|e| err(&path, &e))? {
                let item = item.map_err(|e| err(&path, &e))?;
                let name = item.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    let _ = std::fs::remove_file(item.path());
                    continue;
                }
                // Not a regular file within the cap: no record the agent wrote.
                let record = read_record_file(&item.path())
                    .map_err(|e| err(&item.path(), &e))?
                    .unwrap_or_default();
                match decode_record(&record) {
                    Some((key, value)) if file_name(&key) == name => {
                        rows.insert(key, Row::new(value.to_vec()));
                    }
                    _ if table == QUARANTINE => {
                        rows.insert(name, Row::new(record));
                    }
                    _ => damaged.push((table, name)),
                }
            }
        }
        let mut dirs = BTreeMap::new();
        for table in [MOUNTS, PUBLISHED, QUARANTINE] {
            let path = dir.join(table);
            let fd = nix::fcntl::open(
                &path,
                nix::fcntl::OFlag::O_PATH
                    | nix::fcntl::OFlag::O_DIRECTORY
                    | nix::fcntl::OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            )
            .map_err(|e| err(&path, &e))?;
            dirs.insert(table, fd);
        }
        let stash = MountRecords {
            dir: dir.to_path_buf(),
            dirs,
            pid: std::process::id(),
            tables: std::sync::Mutex::new(tables),
        };
        for (table, name) in damaged {
            match table {
                MOUNTS => stash.quarantine(&name, &name, &"not a stash record")?,
                _ => {
                    tracing::error!(stash = %dir.display(), file = name, "undecodable publication ignored: not a stash record");
                }
            }
        }
        Ok(stash)
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err_at(&self, path: &Path, e: &dyn std::fmt::Display) -> MountRecordsError {
        MountRecordsError { path: path.to_path_buf(), message: e.to_string() }
    }

    fn err(&self, e: &dyn std::fmt::Display) -> MountRecordsError {
        self.err_at(&self.dir, e)
    }

    fn dir_of(&self, table: &'static str) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        // Every table's dir is opened with the stash.
        self.dirs[table].as_fd()
    }

    /// Write the file of `key`, then (under the same lock, so that the
    /// two agree) its value in memory: `decoded` when the caller has it.
    fn write(
        &self,
        table: &'static str,
        key: &str,
        value: &[u8],
        decoded: Option<Decoded>,
    ) -> Result<(), MountRecordsError> {
        use nix::fcntl::OFlag;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut tables = self.tables();
        let name = file_name(key);
        let path = self.dir.join(table).join(&name);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = format!(".{name}.{}.{n}", self.pid);
        let dir = self.dir_of(table);
        let flags =
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let written = nix::fcntl::openat(
            dir,
            tmp.as_str(),
            flags,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .map_err(std::io::Error::from)
        .and_then(|fd| {
            std::io::Write::write_all(&mut std::fs::File::from(fd), &encode_record(key, value))
        })
        .and_then(|()| {
            nix::fcntl::renameat(dir, tmp.as_str(), dir, name.as_str())
                .map_err(std::io::Error::from)
        });
        if let Err(e) = written {
            let _ =
                nix::unistd::unlinkat(dir, tmp.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
            return Err(self.err_at(&path, &e));
        }
        let row = match decoded {
            Some(d) => Row::known(value.to_vec(), d),
            None => Row::new(value.to_vec()),
        };
        tables.entry(table).or_default().insert(key.to_string(), row);
        Ok(())
    }

    fn contains(&self, table: &str, key: &str) -> bool {
        self.tables().get(table).is_some_and(|rows| rows.contains_key(key))
    }

    fn remove_key(&self, table: &'static str, key: &str) -> Result<(), MountRecordsError> {
        let mut tables = self.tables();
        let name = file_name(key);
        match nix::unistd::unlinkat(
            self.dir_of(table),
            name.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        ) {
            Err(e) if e != nix::errno::Errno::ENOENT => {
                Err(self.err_at(&self.dir.join(table).join(name), &e))
            }
            _ => {
                tables.entry(table).or_default().remove(key);
                Ok(())
            }
        }
    }

    /// What `f` makes of each row of `table` (under the lock: `f` must not
    /// touch the stash).
    fn rows<T>(&self, table: &str, f: impl Fn(&String, &Row) -> T) -> Vec<T> {
        self.tables()
            .get(table)
            .map(|rows| rows.iter().map(|(k, v)| f(k, v)).collect())
            .unwrap_or_default()
    }

    /// Move the entry of `key` (its file `name`) out of the way: it cannot
    /// be decoded, and must neither fail every read of the stash nor be
    /// acted on.
    fn quarantine(
        &self,
        key: &str,
        name: &str,
        why: &dyn std::fmt::Display,
    ) -> Result<(), MountRecordsError> {
        tracing::error!(stash = %self.dir.display(), mount_dir = key, "undecodable stash entry quarantined ({why}); that dir's unmount falls back to the ledger");
        crate::metrics::get().stash_quarantined.inc();
        let mut tables = self.tables();
        match nix::fcntl::renameat(self.dir_of(MOUNTS), name, self.dir_of(QUARANTINE), name) {
            Err(e) if e != nix::errno::Errno::ENOENT => {
                return Err(self.err_at(&self.dir.join(MOUNTS).join(name), &e));
            }
            _ => {}
        }
        let value =
            tables.entry(MOUNTS).or_default().remove(key).map(|row| row.bytes).unwrap_or_default();
        tables.entry(QUARANTINE).or_default().insert(key.to_string(), Row::new(value));
        Ok(())
    }

    /// The keys (mount dirs) of quarantined entries; a file that was no
    /// record is named by its file name.
    pub fn quarantined(&self) -> Result<Vec<String>, MountRecordsError> {
        Ok(self.rows(QUARANTINE, |key, _| key.clone()))
    }

    pub fn put(&self, entry: &MountRecord) -> Result<(), MountRecordsError> {
        let bytes = serde_json::to_vec(entry).map_err(|e| self.err(&e))?;
        self.write(
            MOUNTS,
            &entry.consumer.mount_dir,
            &bytes,
            Some(Decoded::MountRecord(Box::new(entry.clone()))),
        )
    }

    /// The entry of `mount_dir`; none when there is none or it could not
    /// be decoded (it is then quarantined).
    pub fn get(&self, mount_dir: &str) -> Result<Option<MountRecord>, MountRecordsError> {
        let decoded =
            self.tables().get(MOUNTS).and_then(|rows| rows.get(mount_dir)).map(Row::entry);
        match decoded {
            None => Ok(None),
            Some(Ok(entry)) => Ok(Some(entry)),
            Some(Err(e)) => {
                self.quarantine(mount_dir, &file_name(mount_dir), &e)?;
                Ok(None)
            }
        }
    }

    pub fn remove(&self, mount_dir: &str) -> Result<(), MountRecordsError> {
        self.remove_key(MOUNTS, mount_dir)
    }

    pub fn put_publication(&self, p: &Publication) -> Result<(), MountRecordsError> {
        let bytes = serde_json::to_vec(p).map_err(|e| self.err(&e))?;
        self.write(PUBLISHED, &p.target, &bytes, Some(Decoded::Publication(p.clone())))
    }

    pub fn remove_publication(&self, target: &str) -> Result<(), MountRecordsError> {
        self.remove_key(PUBLISHED, target)
    }

    /// Every publication; one that cannot be decoded is dropped (its target
    /// is then unpublished from the mount table alone).
    pub fn publications(&self) -> Result<Vec<Publication>, MountRecordsError> {
        let mut out = Vec::new();
        for (target, decoded) in
            self.rows(PUBLISHED, |target, row| (target.clone(), row.publication()))
        {
            match decoded {
                Ok(p) => out.push(p),
                Err(e) => {
                    tracing::error!(stash = %self.dir.display(), target, "undecodable publication ignored: {e}");
                }
            }
        }
        Ok(out)
    }

    /// Every entry that can be decoded; the others are quarantined.
    pub fn all(&self) -> Result<Vec<MountRecord>, MountRecordsError> {
        let mut out = Vec::new();
        for (key, decoded) in self.rows(MOUNTS, |key, row| (key.clone(), row.entry())) {
            match decoded {
                Ok(entry) => out.push(entry),
                Err(e) => self.quarantine(&key, &file_name(&key), &e)?,
            }
        }
        Ok(out)
    }

    /// Store raw bytes as the entry of `key`: for tests of damaged state.
    #[cfg(any(test, feature = "testing"))]
    pub fn put_raw(&self, key: &str, bytes: &[u8]) -> Result<(), MountRecordsError> {
        self.write(MOUNTS, key, bytes, None)
    }

    /// Take in the stash an earlier agent kept in a redb database at
    /// `file` (an agent upgraded while its volumes stay mounted), then set
    /// the file aside. Entries this stash already has win. A file redb
    /// cannot read is set aside too: what it held is also in the ledger
    /// and the mount table, which unmounts fall back to. A failed write
    /// leaves the file in place, for the next start to take in.
    pub fn import_legacy(&self, file: &Path) -> Result<usize, MountRecordsError> {
        if !file.exists() {
            return Ok(0);
        }
        let aside = file.with_extension("redb-imported");
        let set_aside = || std::fs::rename(file, &aside).map_err(|e| self.err_at(file, &e));
        let tables = match legacy::read(file) {
            Ok(tables) => tables,
            Err(e) => {
                set_aside()?;
                tracing::error!(from = %file.display(), moved_to = %aside.display(), "the earlier stash database is unreadable ({e}); unmounts of what it held fall back to the ledger");
                return Ok(0);
            }
        };
        let mut n = 0;
        for (table, rows) in [
            (MOUNTS, tables.mounts),
            (PUBLISHED, tables.published),
            (QUARANTINE, tables.quarantine),
        ] {
            for (key, value) in rows {
                if !self.contains(table, &key) {
                    self.write(table, &key, &value, None)?;
                    n += 1;
                }
            }
        }
        set_aside()?;
        tracing::info!(from = %file.display(), to = %self.dir.display(), entries = n, "took in the earlier stash database");
        Ok(n)
    }
}

/// The bytes of the stash file `path`; none when it is not a regular file
/// of at most [`MAX_FILE`] bytes (a symlink is not followed, and a FIFO or
/// a device is not waited on: it is opened non-blocking).
fn read_record_file(path: &Path) -> Result<Option<Vec<u8>>, crate::sys::SysError> {
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(
            nix::libc::O_NOFOLLOW
                | nix::libc::O_NONBLOCK
                | nix::libc::O_CLOEXEC
                | nix::libc::O_NOCTTY,
        )
        .open(path);
    let file = match opened {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => return Ok(None),
        Err(e) => {
            return Err(crate::sys::SysError::Io {
                op: "open",
                path: path.to_path_buf(),
                source: e,
            });
        }
    };
    match crate::sys::beneath::read_regular(file, path, MAX_FILE) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(crate::sys::SysError::Refused { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The redb database earlier agents kept the stash in.
mod legacy {
    use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
    use std::path::Path;

    const ENTRIES: TableDefinition<&str, &[u8]> = TableDefinition::new("mounts");
    const QUARANTINE: TableDefinition<&str, &[u8]> = TableDefinition::new("quarantine");
    const PUBLISHED: TableDefinition<&str, &[u8]> = TableDefinition::new("published");

    pub struct Tables {
        pub mounts: Vec<(String, Vec<u8>)>,
        pub published: Vec<(String, Vec<u8>)>,
        pub quarantine: Vec<(String, Vec<u8>)>,
    }

    pub fn read(file: &Path) -> Result<Tables, super::MountRecordsError> {
        let err = |e: &dyn std::fmt::Display| super::MountRecordsError {
            path: file.to_path_buf(),
            message: e.to_string(),
        };
        let db = Database::open(file).map_err(|e| err(&e))?;
        let txn = db.begin_read().map_err(|e| err(&e))?;
        let rows = |def: TableDefinition<&str, &[u8]>| -> Result<Vec<(String, Vec<u8>)>, super::MountRecordsError> {
            let table = match txn.open_table(def) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(err(&e)),
            };
            let mut out = Vec::new();
            for item in table.iter().map_err(|e| err(&e))? {
                let (k, v) = item.map_err(|e| err(&e))?;
                out.push((k.value().to_string(), v.value().to_vec()));
            }
            Ok(out)
        };
        Ok(Tables {
            mounts: rows(ENTRIES)?,
            published: rows(PUBLISHED)?,
            quarantine: rows(QUARANTINE)?,
        })
    }

    /// A database as an earlier agent left it (for the tests).
    #[cfg(test)]
    pub fn write(file: &Path, mounts: &[(&str, &[u8])], published: &[(&str, &[u8])]) {
        let db = Database::create(file).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut t = txn.open_table(ENTRIES).unwrap();
            for (k, v) in mounts {
                t.insert(*k, *v).unwrap();
            }
            let mut t = txn.open_table(PUBLISHED).unwrap();
            for (k, v) in published {
                t.insert(*k, *v).unwrap();
            }
            txn.open_table(QUARANTINE).unwrap();
        }
        txn.commit().unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(dir: &str) -> MountRecord {
        let volume = crate::model::Volume {
            name: "pv1".into(),
            backend: "local-pv".into(),
            access_mode: crate::policy::AccessMode::ReadWriteOnce,
            fs_type: "ext4".into(),
            mode: crate::policy::VolumeMode::Filesystem,
            mount_flags: Vec::new(),
            options: vec![],
            secret_keys: vec![],
        };
        let consumer = Consumer {
            node: "n1".into(),
            pod_namespace: "ns".into(),
            pod: "p".into(),
            pod_uid: "u".into(),
            mount_dir: dir.into(),
            read_only: false,
            mount_group: None,
        };
        let paths = NodePaths {
            kubelet_root: "/k".into(),
            staging_dir: "/k/s".into(),
            state_dir: "/s".into(),
            discovery_dirs: vec![],
        };
        MountRecord { volume, consumer, paths, since: None }
    }

    #[test]
    fn an_undecodable_entry_is_quarantined_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let stash = MountRecords::open(&dir.path().join("stash")).unwrap();
        stash.put(&entry("/k/pods/a")).unwrap();
        stash.put_raw("/k/pods/b", b"{not json").unwrap();
        let all = stash.all().expect("the good entries");
        assert_eq!(all.len(), 1);
        assert_eq!(stash.quarantined().unwrap(), vec!["/k/pods/b".to_string()]);
        assert!(stash.get("/k/pods/b").unwrap().is_none(), "gone from the entries");
        stash.put_raw("/k/pods/c", b"\xff").unwrap();
        assert!(stash.get("/k/pods/c").unwrap().is_none());
        assert_eq!(stash.quarantined().unwrap().len(), 2);
        assert!(stash.get("/k/pods/a").unwrap().is_some());
        // Files damaged while no agent ran — no record at all, or too
        // large — go the same way when the stash is opened.
        drop(stash);
        std::fs::write(dir.path().join("stash/mounts/junk"), b"\x01").unwrap();
        std::fs::write(dir.path().join("stash/mounts/big"), vec![b'x'; (MAX_FILE + 1) as usize])
            .unwrap();
        // A FIFO is not waited on.
        nix::unistd::mkfifo(
            &dir.path().join("stash/mounts/fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let stash = MountRecords::open(&dir.path().join("stash")).unwrap();
        assert_eq!(stash.all().unwrap(), vec![entry("/k/pods/a")]);
        assert_eq!(stash.quarantined().unwrap(), ["/k/pods/b", "/k/pods/c", "big", "fifo", "junk"]);
        assert!(
            !dir.path().join("stash/mounts/junk").exists()
                && dir.path().join("stash/quarantine/junk").exists()
        );
    }

    #[test]
    fn entries_and_publications_round_trip_and_go() {
        let dir = tempfile::tempdir().unwrap();
        let stash = MountRecords::open(&dir.path().join("stash")).unwrap();
        // Keys longer than a file name may be.
        let long = format!("/k/pods/{}", "d/".repeat(200));
        for key in ["/k/pods/a", long.as_str()] {
            stash.put(&entry(key)).unwrap();
            assert_eq!(stash.get(key).unwrap(), Some(entry(key)));
        }
        let mut changed = entry("/k/pods/a");
        changed.consumer.read_only = true;
        stash.put(&changed).unwrap();
        assert_eq!(stash.all().unwrap(), vec![changed, entry(&long)]);
        let p = Publication {
            volume: "pv1".into(),
            backend: "local-pv".into(),
            staging: "/s".into(),
            target: "/t".into(),
            read_only: false,
            single_pod: true,
            pod: "ns/p".into(),
        };
        stash.put_publication(&p).unwrap();
        assert_eq!(stash.publications().unwrap(), vec![p]);
        stash.remove_publication("/t").unwrap();
        stash.remove_publication("/t").expect("gone is fine");
        stash.remove("/k/pods/a").unwrap();
        stash.remove("/k/pods/a").expect("gone is fine");
        assert!(stash.publications().unwrap().is_empty());
        assert_eq!(stash.all().unwrap(), vec![entry(&long)]);
        // What an agent killed mid-write left is cleared when the stash opens;
        // the entries stay.
        std::fs::write(dir.path().join("stash/mounts/.half-written"), b"x").unwrap();
        let stash = MountRecords::open(&dir.path().join("stash")).unwrap();
        assert!(!dir.path().join("stash/mounts/.half-written").exists());
        assert_eq!(stash.all().unwrap(), vec![entry(&long)]);
        assert!(stash.quarantined().unwrap().is_empty());
    }

    #[test]
    fn a_read_entry_is_what_its_file_holds_now() {
        // Entries are decoded once and kept: every change of the file must
        // reach the reads after it.
        let dir = tempfile::tempdir().unwrap();
        let stash = MountRecords::open(&dir.path().join("stash")).unwrap();
        stash.put(&entry("/k/pods/a")).unwrap();
        assert_eq!(stash.get("/k/pods/a").unwrap(), Some(entry("/k/pods/a")));
        let mut changed = entry("/k/pods/a");
        changed.volume.name = "pv2".into();
        stash.put(&changed).unwrap();
        assert_eq!(
            stash.get("/k/pods/a").unwrap(),
            Some(changed.clone()),
            "the new entry, not the one read before"
        );
        assert_eq!(stash.all().unwrap(), vec![changed]);
        stash.put_raw("/k/pods/a", b"{not json").unwrap();
        assert_eq!(
            stash.get("/k/pods/a").unwrap(),
            None,
            "damaged since the last read: quarantined"
        );
        assert_eq!(stash.quarantined().unwrap(), ["/k/pods/a"]);
        stash.put(&entry("/k/pods/a")).unwrap();
        stash.remove("/k/pods/a").unwrap();
        assert_eq!(stash.get("/k/pods/a").unwrap(), None);
        let mut p = Publication {
            volume: "pv1".into(),
            backend: "local-pv".into(),
            staging: "/s".into(),
            target: "/t".into(),
            read_only: false,
            single_pod: true,
            pod: "ns/p".into(),
        };
        stash.put_publication(&p).unwrap();
        assert_eq!(stash.publications().unwrap(), vec![p.clone()]);
        p.read_only = true;
        stash.put_publication(&p).unwrap();
        assert_eq!(stash.publications().unwrap(), vec![p]);
    }

    #[test]
    fn an_earlier_agents_database_is_taken_in_and_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("stash.redb");
        let (a, b) = (
            serde_json::to_vec(&entry("/k/pods/a")).unwrap(),
            serde_json::to_vec(&entry("/k/pods/b")).unwrap(),
        );
        let p = Publication {
            volume: "pv1".into(),
            backend: "local-pv".into(),
            staging: "/s".into(),
            target: "/t".into(),
            read_only: false,
            single_pod: false,
            pod: String::new(),
        };
        legacy::write(
            &file,
            &[("/k/pods/a", &a), ("/k/pods/b", &b)],
            &[("/t", &serde_json::to_vec(&p).unwrap())],
        );
        let stash = MountRecords::open(&dir.path().join("stash")).unwrap();
        // A write that fails keeps the database for the next start.
        std::fs::remove_dir(dir.path().join("stash/published")).unwrap();
        std::fs::write(dir.path().join("stash/published"), b"in the way").unwrap();
        assert!(stash.import_legacy(&file).is_err());
        assert!(file.exists(), "kept");
        std::fs::remove_file(dir.path().join("stash/published")).unwrap();
        let stash = MountRecords::open(&dir.path().join("stash")).unwrap();
        // (What that try took in stays; a is taken out again to be taken in below.)
        stash.remove("/k/pods/a").unwrap();
        let mut newer = entry("/k/pods/b");
        newer.consumer.read_only = true;
        stash.put(&newer).unwrap();
        assert_eq!(
            stash.import_legacy(&file).unwrap(),
            2,
            "a and the publication; b is newer here"
        );
        assert_eq!(stash.all().unwrap(), vec![entry("/k/pods/a"), newer]);
        assert_eq!(stash.publications().unwrap(), vec![p]);
        assert!(!file.exists() && dir.path().join("stash.redb-imported").exists(), "set aside");
        assert_eq!(stash.import_legacy(&file).unwrap(), 0, "once");
        // An unreadable one is set aside, not fatal.
        std::fs::write(&file, b"not a database").unwrap();
        assert_eq!(stash.import_legacy(&file).unwrap(), 0);
        assert!(!file.exists());
    }
}
