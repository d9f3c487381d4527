//! The embedded ledger: records in a redb database file (crash-safe,
//! copy-on-write, fsync on commit), for a node with no cluster configured.
//! Agents on one machine may share the file.

use super::{Ledger, LedgerError, Record, Version};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("attachment-records");
/// The store's revision: every write takes the next one as its version, so
/// a version is never reused, even by a record deleted and created again.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const REVISION: &str = "revision";

#[derive(Serialize, Deserialize)]
struct Stored {
    version: u64,
    record: Record,
}

pub struct EmbeddedLedger {
    db: crate::store::Reopening,
    path: PathBuf,
    shared: bool,
}

/// Open the database, its tables made, so readers never meet a missing one.
fn open_db(path: &Path, shared: bool) -> Result<Database, String> {
    // Shared, redb serialises the agents' write transactions, and each
    // commit takes two flushes (it records allocator state for the other
    // writers); alone, a commit takes one.
    let mode = if shared { redb::ConcurrencyMode::MultiWriter } else { redb::ConcurrencyMode::ExclusiveWriter };
    let db = redb::Builder::new().set_concurrency_mode(mode).create(path).map_err(|e| e.to_string())?;
    let txn = db.begin_write().map_err(|e| e.to_string())?;
    txn.open_table(RECORDS).map_err(|e| e.to_string())?;
    txn.open_table(META).map_err(|e| e.to_string())?;
    txn.commit().map_err(|e| e.to_string())?;
    Ok(db)
}

impl EmbeddedLedger {
    /// Open (or create) the database at `path`. `shared`: other processes
    /// (agents of simulated nodes on this machine) use the file too.
    pub fn open(path: &Path, shared: bool) -> Result<EmbeddedLedger, LedgerError> {
        let err = |e: &dyn std::fmt::Display| LedgerError::Store { store: path.display().to_string(), message: e.to_string() };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
        }
        let db = crate::store::Reopening::open(path, move |p| open_db(p, shared)).map_err(|e| err(&e))?;
        Ok(EmbeddedLedger { db, path: path.to_path_buf(), shared })
    }

    /// Run `f` on the database, in place ([`crate::runtime::in_place`]): a
    /// commit is one `fdatasync` on the state dir's disk.
    fn run<R>(&self, f: impl FnOnce(&Database, &dyn Fn(&dyn std::fmt::Display) -> LedgerError) -> Result<R, LedgerError>) -> Result<R, LedgerError> {
        let store = self.path.display().to_string();
        let err = move |e: &dyn std::fmt::Display| LedgerError::Store { store: store.clone(), message: e.to_string() };
        crate::runtime::in_place(|| self.db.with(|db| f(db, &err), |why| err(&why)))
    }
}

fn decode(bytes: &[u8], err: &dyn Fn(&dyn std::fmt::Display) -> LedgerError) -> Result<Stored, LedgerError> {
    serde_json::from_slice(bytes).map_err(|e| err(&format!("a stored record is unreadable: {e}")))
}

fn encode(stored: &Stored, err: &dyn Fn(&dyn std::fmt::Display) -> LedgerError) -> Result<Vec<u8>, LedgerError> {
    serde_json::to_vec(stored).map_err(|e| err(&e))
}

/// Write `record` at the next version if the stored version is `expected`
/// (`None`: must not exist). One write transaction: the check and the write
/// cannot be split by another writer.
fn compare_and_write(
    db: &Database,
    err: &dyn Fn(&dyn std::fmt::Display) -> LedgerError,
    volume: &str,
    expected: Option<&Version>,
    record: Option<&Record>,
) -> Result<Option<Version>, LedgerError> {
    let txn = db.begin_write().map_err(|e| err(&e))?;
    let written = {
        let mut table = txn.open_table(RECORDS).map_err(|e| err(&e))?;
        let current = match table.get(volume).map_err(|e| err(&e))? {
            Some(v) => Some(decode(v.value(), err)?.version),
            None => None,
        };
        match (current, expected) {
            (Some(_), None) => return Err(LedgerError::AlreadyExists { volume: volume.to_string() }),
            (None, Some(_)) => return Err(LedgerError::NotFound { volume: volume.to_string() }),
            (Some(c), Some(e)) if c.to_string() != e.0 => {
                return Err(LedgerError::Conflict { volume: volume.to_string(), expected: e.clone() });
            }
            _ => {}
        }
        match record {
            Some(record) => {
                let mut meta = txn.open_table(META).map_err(|e| err(&e))?;
                let version = meta.get(REVISION).map_err(|e| err(&e))?.map_or(0, |v| v.value()) + 1;
                meta.insert(REVISION, version).map_err(|e| err(&e))?;
                let bytes = encode(&Stored { version, record: record.clone() }, err)?;
                table.insert(volume, bytes.as_slice()).map_err(|e| err(&e))?;
                Some(Version(version.to_string()))
            }
            None => {
                table.remove(volume).map_err(|e| err(&e))?;
                None
            }
        }
    };
    txn.commit().map_err(|e| err(&e))?;
    Ok(written)
}

#[async_trait::async_trait]
impl Ledger for EmbeddedLedger {
    /// Read inline: a read transaction neither waits for writers nor
    /// syncs, and a trip to a blocking thread costs more than the read.
    async fn get(&self, volume: &str) -> Result<Option<(Record, Version)>, LedgerError> {
        let store = self.path.display().to_string();
        let err = |e: &dyn std::fmt::Display| LedgerError::Store { store: store.clone(), message: e.to_string() };
        self.db.with(
            |db| {
                let txn = db.begin_read().map_err(|e| err(&e))?;
                let table = txn.open_table(RECORDS).map_err(|e| err(&e))?;
                match table.get(volume).map_err(|e| err(&e))? {
                    Some(v) => {
                        let s = decode(v.value(), &err)?;
                        Ok(Some((s.record, Version(s.version.to_string()))))
                    }
                    None => Ok(None),
                }
            },
            |why| err(&why),
        )
    }

    async fn create(&self, record: &Record) -> Result<Version, LedgerError> {
        let record = record.clone();
        self.run(move |db, err| {
            compare_and_write(db, err, &record.volume, None, Some(&record))?
                .ok_or_else(|| err(&"a create wrote no version"))
        })
    }

    async fn update(&self, record: &Record, expected: &Version) -> Result<Version, LedgerError> {
        let (record, expected) = (record.clone(), expected.clone());
        self.run(move |db, err| {
            compare_and_write(db, err, &record.volume, Some(&expected), Some(&record))?
                .ok_or_else(|| err(&"an update wrote no version"))
        })
    }

    async fn delete(&self, volume: &str, expected: &Version) -> Result<(), LedgerError> {
        let (volume, expected) = (volume.to_string(), expected.clone());
        self.run(move |db, err| compare_and_write(db, err, &volume, Some(&expected), None).map(drop))
    }

    async fn list_by_node(&self, node: &str) -> Result<Vec<(Record, Version)>, LedgerError> {
        let node = node.to_string();
        self.run(move |db, err| {
            let txn = db.begin_read().map_err(|e| err(&e))?;
            let table = txn.open_table(RECORDS).map_err(|e| err(&e))?;
            let mut found = Vec::new();
            for entry in table.iter().map_err(|e| err(&e))? {
                let (_, v) = entry.map_err(|e| err(&e))?;
                let s = decode(v.value(), err)?;
                if s.record.on_node(&node).next().is_some() {
                    found.push((s.record, Version(s.version.to_string())));
                }
            }
            Ok(found)
        })
    }

    /// Alone, redb holds the file locked for this process.
    fn node_private(&self) -> bool {
        !self.shared
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conforms_alone_and_shared() {
        for shared in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let ledger = Arc::new(EmbeddedLedger::open(&dir.path().join("ledger.redb"), shared).unwrap());
            crate::ledger::conformance::run_all(ledger).await;
        }
    }

    #[tokio::test]
    async fn records_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/ledger.redb");
        let record = crate::ledger::conformance::record("pv-keep", &[("n1", "a")]);
        {
            let ledger = EmbeddedLedger::open(&path, false).unwrap();
            ledger.create(&record).await.unwrap();
        }
        let ledger = EmbeddedLedger::open(&path, false).unwrap();
        let (back, _) = ledger.get("pv-keep").await.unwrap().unwrap();
        assert_eq!(back, record);
    }

    #[test]
    fn an_unusable_store_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("not-a-db");
        std::fs::write(&path, b"garbage that is not a redb file, long enough to have a header.....").unwrap();
        let err = EmbeddedLedger::open(&path, false).err().expect("garbage must not open");
        assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    }
}
