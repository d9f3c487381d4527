//! The node-local stash: for every pod mount dir this agent mounted, what
//! it needs to unmount it (volume, consumer, paths) — kubelet's `unmount`
//! gives only the dir, and teardown must work with no API at all.

use crate::policy::{Consumer, NodePaths, Volume};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

const ENTRIES: TableDefinition<&str, &[u8]> = TableDefinition::new("mounts");

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub volume: Volume,
    pub consumer: Consumer,
    pub paths: NodePaths,
}

#[derive(Debug, thiserror::Error)]
#[error("stash {}: {message}", path.display())]
pub struct StashError {
    path: PathBuf,
    message: String,
}

pub struct Stash {
    db: Database,
    path: PathBuf,
}

impl Stash {
    pub fn open(path: &Path) -> Result<Stash, StashError> {
        let err = |e: &dyn std::fmt::Display| StashError { path: path.to_path_buf(), message: e.to_string() };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
        }
        let db = Database::create(path).map_err(|e| err(&e))?;
        let txn = db.begin_write().map_err(|e| err(&e))?;
        txn.open_table(ENTRIES).map_err(|e| err(&e))?;
        txn.commit().map_err(|e| err(&e))?;
        Ok(Stash { db, path: path.to_path_buf() })
    }

    fn err(&self, e: &dyn std::fmt::Display) -> StashError {
        StashError { path: self.path.clone(), message: e.to_string() }
    }

    pub fn put(&self, entry: &Entry) -> Result<(), StashError> {
        let bytes = serde_json::to_vec(entry).map_err(|e| self.err(&e))?;
        let txn = self.db.begin_write().map_err(|e| self.err(&e))?;
        txn.open_table(ENTRIES)
            .map_err(|e| self.err(&e))?
            .insert(entry.consumer.mount_dir.as_str(), bytes.as_slice())
            .map_err(|e| self.err(&e))?;
        txn.commit().map_err(|e| self.err(&e))
    }

    pub fn get(&self, mount_dir: &str) -> Result<Option<Entry>, StashError> {
        let txn = self.db.begin_read().map_err(|e| self.err(&e))?;
        let table = txn.open_table(ENTRIES).map_err(|e| self.err(&e))?;
        match table.get(mount_dir).map_err(|e| self.err(&e))? {
            Some(v) => Ok(Some(serde_json::from_slice(v.value()).map_err(|e| self.err(&e))?)),
            None => Ok(None),
        }
    }

    pub fn remove(&self, mount_dir: &str) -> Result<(), StashError> {
        let txn = self.db.begin_write().map_err(|e| self.err(&e))?;
        txn.open_table(ENTRIES).map_err(|e| self.err(&e))?.remove(mount_dir).map_err(|e| self.err(&e))?;
        txn.commit().map_err(|e| self.err(&e))
    }

    pub fn all(&self) -> Result<Vec<Entry>, StashError> {
        let txn = self.db.begin_read().map_err(|e| self.err(&e))?;
        let table = txn.open_table(ENTRIES).map_err(|e| self.err(&e))?;
        let mut out = Vec::new();
        for item in table.iter().map_err(|e| self.err(&e))? {
            let (_, v) = item.map_err(|e| self.err(&e))?;
            out.push(serde_json::from_slice(v.value()).map_err(|e| self.err(&e))?);
        }
        Ok(out)
    }
}
