//! The node-local stash: for every pod mount dir this agent mounted, what
//! it needs to unmount it (volume, consumer, paths) — kubelet's `unmount`
//! gives only the dir, and teardown must work with no API at all.

use crate::policy::{Consumer, NodePaths, Volume};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

const ENTRIES: TableDefinition<&str, &[u8]> = TableDefinition::new("mounts");
/// Entries that could not be decoded, kept (for people) out of the way.
const QUARANTINE: TableDefinition<&str, &[u8]> = TableDefinition::new("quarantine");
/// CSI publications (a staged volume bound into a pod's target path), by
/// target path: kubelet's NodeUnpublish gives only the volume and target.
const PUBLISHED: TableDefinition<&str, &[u8]> = TableDefinition::new("published");

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
pub struct Entry {
    pub volume: Volume,
    pub consumer: Consumer,
    pub paths: NodePaths,
}

/// An entry as stored, also by an agent of contract 0.4 (whose volumes
/// had no mode or mount flags: filesystem volumes, none).
fn decode_entry(bytes: &[u8]) -> Result<Entry, serde_json::Error> {
    let mut value: serde_json::Value = serde_json::from_slice(bytes)?;
    if let Some(volume) = value.get_mut("volume") {
        crate::policy::volume_defaults(volume);
    }
    serde_json::from_value(value)
}

#[derive(Debug, thiserror::Error)]
#[error("stash {}: {message}", path.display())]
pub struct StashError {
    path: PathBuf,
    message: String,
}

pub struct Stash {
    db: crate::store::Reopening,
    path: PathBuf,
}

/// Open the stash at `path`, its tables made. A file redb finds corrupted
/// is moved aside and a new one started: what it held is also in the ledger
/// and the mount table, which unmounts fall back to.
fn open_db(path: &Path) -> Result<Database, String> {
    let db = match Database::create(path) {
        Err(redb::DatabaseError::Storage(redb::StorageError::Corrupted(why))) => {
            let aside = path.with_extension(format!("corrupt-{}", std::process::id()));
            tracing::error!(stash = %path.display(), moved_to = %aside.display(), "the stash is corrupted ({why}); starting a new one");
            std::fs::rename(path, &aside).map_err(|e| e.to_string())?;
            Database::create(path).map_err(|e| e.to_string())?
        }
        other => other.map_err(|e| e.to_string())?,
    };
    let txn = db.begin_write().map_err(|e| e.to_string())?;
    txn.open_table(ENTRIES).map_err(|e| e.to_string())?;
    txn.open_table(QUARANTINE).map_err(|e| e.to_string())?;
    txn.open_table(PUBLISHED).map_err(|e| e.to_string())?;
    txn.commit().map_err(|e| e.to_string())?;
    Ok(db)
}

impl Stash {
    /// Open (or create) the stash.
    pub fn open(path: &Path) -> Result<Stash, StashError> {
        let err = |e: &dyn std::fmt::Display| StashError { path: path.to_path_buf(), message: e.to_string() };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
        }
        let db = crate::store::Reopening::open(path, open_db).map_err(|e| err(&e))?;
        Ok(Stash { db, path: path.to_path_buf() })
    }

    /// Run `f` on the database (opened again after a failed write).
    fn with<R>(&self, f: impl FnOnce(&Database) -> Result<R, StashError>) -> Result<R, StashError> {
        self.db.with(f, |why| self.err(&why))
    }

    /// A write transaction of `f`, committed.
    fn write(&self, f: impl FnOnce(&redb::WriteTransaction) -> Result<(), StashError>) -> Result<(), StashError> {
        self.with(|db| {
            let txn = db.begin_write().map_err(|e| self.err(&e))?;
            f(&txn)?;
            txn.commit().map_err(|e| self.err(&e))
        })
    }

    /// Move the entry of `key` out of the way: it cannot be decoded, and
    /// must neither fail every read of the stash nor be acted on.
    fn quarantine(&self, key: &str, why: &dyn std::fmt::Display) -> Result<(), StashError> {
        tracing::error!(stash = %self.path.display(), mount_dir = key, "undecodable stash entry quarantined ({why}); that dir's unmount falls back to the ledger");
        crate::metrics::get().stash_quarantined.inc();
        self.write(|txn| {
            let mut entries = txn.open_table(ENTRIES).map_err(|e| self.err(&e))?;
            let raw = entries.remove(key).map_err(|e| self.err(&e))?.map(|v| v.value().to_vec());
            if let Some(raw) = raw {
                txn.open_table(QUARANTINE).map_err(|e| self.err(&e))?.insert(key, raw.as_slice()).map_err(|e| self.err(&e))?;
            }
            Ok(())
        })
    }

    /// The keys (mount dirs) of quarantined entries.
    pub fn quarantined(&self) -> Result<Vec<String>, StashError> {
        self.with(|db| {
            let txn = db.begin_read().map_err(|e| self.err(&e))?;
            let table = txn.open_table(QUARANTINE).map_err(|e| self.err(&e))?;
            let mut keys = Vec::new();
            for item in table.iter().map_err(|e| self.err(&e))? {
                keys.push(item.map_err(|e| self.err(&e))?.0.value().to_string());
            }
            Ok(keys)
        })
    }

    fn err(&self, e: &dyn std::fmt::Display) -> StashError {
        StashError { path: self.path.clone(), message: e.to_string() }
    }

    pub fn put(&self, entry: &Entry) -> Result<(), StashError> {
        let bytes = serde_json::to_vec(entry).map_err(|e| self.err(&e))?;
        self.write(|txn| {
            txn.open_table(ENTRIES).map_err(|e| self.err(&e))?.insert(entry.consumer.mount_dir.as_str(), bytes.as_slice()).map_err(|e| self.err(&e))?;
            Ok(())
        })
    }

    /// The entry of `mount_dir`; none when there is none or it could not
    /// be decoded (it is then quarantined).
    pub fn get(&self, mount_dir: &str) -> Result<Option<Entry>, StashError> {
        let decoded = self.with(|db| {
            let txn = db.begin_read().map_err(|e| self.err(&e))?;
            let table = txn.open_table(ENTRIES).map_err(|e| self.err(&e))?;
            Ok(table.get(mount_dir).map_err(|e| self.err(&e))?.map(|v| decode_entry(v.value())))
        })?;
        match decoded {
            None => Ok(None),
            Some(Ok(entry)) => Ok(Some(entry)),
            Some(Err(e)) => {
                self.quarantine(mount_dir, &e)?;
                Ok(None)
            }
        }
    }

    pub fn remove(&self, mount_dir: &str) -> Result<(), StashError> {
        self.write(|txn| {
            txn.open_table(ENTRIES).map_err(|e| self.err(&e))?.remove(mount_dir).map_err(|e| self.err(&e))?;
            Ok(())
        })
    }

    pub fn put_publication(&self, p: &Publication) -> Result<(), StashError> {
        let bytes = serde_json::to_vec(p).map_err(|e| self.err(&e))?;
        self.write(|txn| {
            txn.open_table(PUBLISHED).map_err(|e| self.err(&e))?.insert(p.target.as_str(), bytes.as_slice()).map_err(|e| self.err(&e))?;
            Ok(())
        })
    }

    pub fn remove_publication(&self, target: &str) -> Result<(), StashError> {
        self.write(|txn| {
            txn.open_table(PUBLISHED).map_err(|e| self.err(&e))?.remove(target).map_err(|e| self.err(&e))?;
            Ok(())
        })
    }

    /// Every publication; one that cannot be decoded is dropped (its target
    /// is then unpublished from the mount table alone).
    pub fn publications(&self) -> Result<Vec<Publication>, StashError> {
        self.with(|db| {
            let txn = db.begin_read().map_err(|e| self.err(&e))?;
            let table = txn.open_table(PUBLISHED).map_err(|e| self.err(&e))?;
            let mut out = Vec::new();
            for item in table.iter().map_err(|e| self.err(&e))? {
                let (k, v) = item.map_err(|e| self.err(&e))?;
                match serde_json::from_slice(v.value()) {
                    Ok(p) => out.push(p),
                    Err(e) => tracing::error!(stash = %self.path.display(), target = k.value(), "undecodable publication ignored: {e}"),
                }
            }
            Ok(out)
        })
    }

    /// Every entry that can be decoded; the others are quarantined.
    pub fn all(&self) -> Result<Vec<Entry>, StashError> {
        let (out, bad) = self.with(|db| {
            let (mut out, mut bad) = (Vec::new(), Vec::new());
            let txn = db.begin_read().map_err(|e| self.err(&e))?;
            let table = txn.open_table(ENTRIES).map_err(|e| self.err(&e))?;
            for item in table.iter().map_err(|e| self.err(&e))? {
                let (k, v) = item.map_err(|e| self.err(&e))?;
                match decode_entry(v.value()) {
                    Ok(entry) => out.push(entry),
                    Err(e) => bad.push((k.value().to_string(), e)),
                }
            }
            Ok((out, bad))
        })?;
        for (key, why) in bad {
            self.quarantine(&key, &why)?;
        }
        Ok(out)
    }

    /// Store raw bytes as the entry of `key`: for tests of damaged state.
    #[doc(hidden)]
    pub fn put_raw(&self, key: &str, bytes: &[u8]) -> Result<(), StashError> {
        self.write(|txn| {
            txn.open_table(ENTRIES).map_err(|e| self.err(&e))?.insert(key, bytes).map_err(|e| self.err(&e))?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(dir: &str) -> Entry {
        let volume = crate::policy::Volume {
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
        let paths = NodePaths { kubelet_root: "/k".into(), staging_dir: "/k/s".into(), state_dir: "/s".into(), discovery_dirs: vec![] };
        Entry { volume, consumer, paths }
    }

    #[test]
    fn an_undecodable_entry_is_quarantined_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let stash = Stash::open(&dir.path().join("stash.redb")).unwrap();
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
    }
}
