//! The embedded ledger: records in a redb database file (crash-safe,
//! copy-on-write, fsync on commit), for a node with no cluster configured.
//! Alone on the file, its writes are stored behind the operations
//! ([`super::write_behind`]); agents on one machine that share the file
//! commit each write before it returns.

use super::write_behind::{Batch, Pending, WriteBehind};
use super::{Ledger, LedgerError, Record, Version};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    db: Arc<crate::reopening_db::Reopening>,
    path: PathBuf,
    /// Alone on the file: the writes not yet committed. Dropping it
    /// commits them (its flusher holds a handle on the database of its own).
    behind: Option<WriteBehind>,
}

type ErrFn<'a> = &'a dyn Fn(&dyn std::fmt::Display) -> LedgerError;

fn store_error(path: &Path) -> impl Fn(&dyn std::fmt::Display) -> LedgerError + Clone + use<> {
    let store = path.display().to_string();
    move |e: &dyn std::fmt::Display| LedgerError::Store {
        store: store.clone(),
        message: e.to_string(),
    }
}

/// Open the database, its tables made, so readers never meet a missing one.
fn open_db(path: &Path, shared: bool) -> Result<Database, String> {
    // Shared, redb serialises the agents' write transactions, and each
    // commit takes two flushes (it records allocator state for the other
    // writers); alone, a commit takes one.
    let mode = if shared {
        redb::ConcurrencyMode::MultiWriter
    } else {
        redb::ConcurrencyMode::ExclusiveWriter
    };
    let db =
        redb::Builder::new().set_concurrency_mode(mode).create(path).map_err(|e| e.to_string())?;
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
        let err = store_error(path);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
        }
        let db = Arc::new(
            crate::reopening_db::Reopening::open(path, move |p| open_db(p, shared))
                .map_err(|e| err(&e))?,
        );
        let behind = if shared {
            None
        } else {
            let revision = db.with(|db| read_revision(db, &err), |why| err(&why))?;
            let (store, commit_err) = (db.clone(), err.clone());
            let commit = Box::new(move |batch: &Batch, revision: u64| {
                store
                    .with(
                        |db| commit_batch(db, &commit_err, batch, revision),
                        |why| commit_err(&why),
                    )
                    .map_err(|e| match e {
                        LedgerError::Store { message, .. } => message,
                        other => other.to_string(),
                    })
            });
            Some(
                WriteBehind::start(revision, commit)
                    .map_err(|e| err(&format!("cannot start its flusher thread: {e}")))?,
            )
        };
        Ok(EmbeddedLedger { db, path: path.to_path_buf(), behind })
    }

    /// Run `f` on the database, in place ([`crate::workers::in_place`]): a
    /// commit is one `fdatasync` on the state dir's disk.
    fn run<R>(
        &self,
        f: impl FnOnce(&Database, ErrFn<'_>) -> Result<R, LedgerError>,
    ) -> Result<R, LedgerError> {
        let err = store_error(&self.path);
        crate::workers::in_place(|| self.db.with(|db| f(db, &err), |why| err(&why)))
    }

    /// Run `f` on the database right here: reads neither wait for writers
    /// nor sync, and a trip to another thread costs more than the read.
    fn read<R>(
        &self,
        f: impl FnOnce(&Database, ErrFn<'_>) -> Result<R, LedgerError>,
    ) -> Result<R, LedgerError> {
        let err = store_error(&self.path);
        self.db.with(|db| f(db, &err), |why| err(&why))
    }

    /// A write, alone on the file: checked against the pending writes and
    /// the store under one lock, and taken to be committed behind.
    fn write_behind(
        &self,
        behind: &WriteBehind,
        volume: &str,
        expected: Option<&Version>,
        record: Option<&Record>,
    ) -> Result<Option<Version>, LedgerError> {
        let mut locked = behind.lock();
        let current = match locked.get(volume) {
            Some(pending) => pending.map(|(_, version)| version),
            None => self.read(|db, err| Ok(read_stored(db, err, volume)?.map(|s| s.version)))?,
        };
        check(volume, current, expected)?;
        let version = locked.put(volume, record.cloned()).map_err(|why| {
            store_error(&self.path)(&format!("record {volume} not written: {why}"))
        })?;
        Ok(record.map(|_| Version(version.to_string())))
    }

    fn write(
        &self,
        volume: &str,
        expected: Option<&Version>,
        record: Option<&Record>,
    ) -> Result<Option<Version>, LedgerError> {
        match &self.behind {
            Some(behind) => self.write_behind(behind, volume, expected, record),
            None => self.run(|db, err| compare_and_write(db, err, volume, expected, record)),
        }
    }
}

fn decode(bytes: &[u8], err: ErrFn<'_>) -> Result<Stored, LedgerError> {
    serde_json::from_slice(bytes).map_err(|e| err(&format!("a stored record is unreadable: {e}")))
}

fn encode(stored: &Stored, err: ErrFn<'_>) -> Result<Vec<u8>, LedgerError> {
    serde_json::to_vec(stored).map_err(|e| err(&e))
}

fn read_revision(db: &Database, err: ErrFn<'_>) -> Result<u64, LedgerError> {
    let txn = db.begin_read().map_err(|e| err(&e))?;
    let meta = txn.open_table(META).map_err(|e| err(&e))?;
    Ok(meta.get(REVISION).map_err(|e| err(&e))?.map_or(0, |v| v.value()))
}

fn read_stored(db: &Database, err: ErrFn<'_>, volume: &str) -> Result<Option<Stored>, LedgerError> {
    let txn = db.begin_read().map_err(|e| err(&e))?;
    let table = txn.open_table(RECORDS).map_err(|e| err(&e))?;
    match table.get(volume).map_err(|e| err(&e))? {
        Some(v) => Ok(Some(decode(v.value(), err)?)),
        None => Ok(None),
    }
}

/// Whether a write expecting `expected` (`None`: no record) may replace
/// the record now at `current`.
fn check(
    volume: &str,
    current: Option<u64>,
    expected: Option<&Version>,
) -> Result<(), LedgerError> {
    match (current, expected) {
        (Some(_), None) => Err(LedgerError::AlreadyExists { volume: volume.to_string() }),
        (None, Some(_)) => Err(LedgerError::NotFound { volume: volume.to_string() }),
        (Some(c), Some(e)) if c.to_string() != e.0 => {
            Err(LedgerError::Conflict { volume: volume.to_string(), expected: e.clone() })
        }
        _ => Ok(()),
    }
}

/// Write `record` at the next version if the stored version is `expected`
/// (`None`: must not exist). One write transaction: the check and the write
/// cannot be split by another writer.
fn compare_and_write(
    db: &Database,
    err: ErrFn<'_>,
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
        check(volume, current, expected)?;
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

/// Store the writes taken behind, and the last version handed out, in one
/// durable commit.
fn commit_batch(
    db: &Database,
    err: ErrFn<'_>,
    batch: &Batch,
    revision: u64,
) -> Result<(), LedgerError> {
    let txn = db.begin_write().map_err(|e| err(&e))?;
    {
        let mut table = txn.open_table(RECORDS).map_err(|e| err(&e))?;
        for (volume, pending) in batch {
            match pending {
                Pending::Put { version, record } => {
                    let bytes = encode(&Stored { version: *version, record: record.clone() }, err)?;
                    table.insert(volume.as_str(), bytes.as_slice()).map_err(|e| err(&e))?;
                }
                Pending::Gone { .. } => {
                    table.remove(volume.as_str()).map_err(|e| err(&e))?;
                }
            }
        }
        let mut meta = txn.open_table(META).map_err(|e| err(&e))?;
        meta.insert(REVISION, revision).map_err(|e| err(&e))?;
    }
    txn.commit().map_err(|e| err(&e))
}

#[async_trait::async_trait]
impl Ledger for EmbeddedLedger {
    async fn get(&self, volume: &str) -> Result<Option<(Record, Version)>, LedgerError> {
        let read = || {
            self.read(|db, err| {
                Ok(read_stored(db, err, volume)?
                    .map(|s| (s.record, Version(s.version.to_string()))))
            })
        };
        let Some(behind) = &self.behind else { return read() };
        // Held across the read: a write being committed is either still
        // pending or already stored.
        let locked = behind.lock();
        match locked.get(volume) {
            Some(pending) => {
                Ok(pending.map(|(record, version)| (record.clone(), Version(version.to_string()))))
            }
            None => read(),
        }
    }

    async fn create(&self, record: &Record) -> Result<Version, LedgerError> {
        self.write(&record.volume, None, Some(record))?
            .ok_or_else(|| store_error(&self.path)(&"a create wrote no version"))
    }

    async fn update(&self, record: &Record, expected: &Version) -> Result<Version, LedgerError> {
        self.write(&record.volume, Some(expected), Some(record))?
            .ok_or_else(|| store_error(&self.path)(&"an update wrote no version"))
    }

    async fn delete(&self, volume: &str, expected: &Version) -> Result<(), LedgerError> {
        self.write(volume, Some(expected), None).map(drop)
    }

    async fn list_by_node(&self, node: &str) -> Result<Vec<(Record, Version)>, LedgerError> {
        let locked = self.behind.as_ref().map(|b| b.lock());
        let mut found: std::collections::BTreeMap<String, (Record, u64)> =
            self.run(|db, err| {
                let txn = db.begin_read().map_err(|e| err(&e))?;
                let table = txn.open_table(RECORDS).map_err(|e| err(&e))?;
                let mut found = std::collections::BTreeMap::new();
                for entry in table.iter().map_err(|e| err(&e))? {
                    let (k, v) = entry.map_err(|e| err(&e))?;
                    let s = decode(v.value(), err)?;
                    found.insert(k.value().to_string(), (s.record, s.version));
                }
                Ok(found)
            })?;
        if let Some(locked) = &locked {
            for (volume, pending) in locked.all() {
                match pending {
                    Pending::Put { version, record } => {
                        found.insert(volume.clone(), (record.clone(), *version))
                    }
                    Pending::Gone { .. } => found.remove(volume),
                };
            }
        }
        Ok(found
            .into_values()
            .filter(|(r, _)| r.on_node(node).next().is_some())
            .map(|(r, v)| (r, Version(v.to_string())))
            .collect())
    }

    /// Alone, redb holds the file locked for this process.
    fn node_private(&self) -> bool {
        self.behind.is_some()
    }

    fn flush(&self) -> Result<(), LedgerError> {
        match &self.behind {
            Some(behind) => crate::workers::in_place(|| behind.flush())
                .map_err(|why| store_error(&self.path)(&why)),
            None => Ok(()),
        }
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
            let ledger =
                Arc::new(EmbeddedLedger::open(&dir.path().join("ledger.redb"), shared).unwrap());
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

    /// What a crash leaves: the file as it is on disk while the agent runs.
    #[tokio::test]
    async fn records_reach_the_disk_behind_the_writes_without_a_close() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.redb");
        let ledger = EmbeddedLedger::open(&path, false).unwrap();
        let record = crate::ledger::conformance::record("pv-behind", &[("n1", "a")]);
        let version = ledger.create(&record).await.unwrap();
        assert_eq!(
            ledger.get("pv-behind").await.unwrap(),
            Some((record.clone(), version.clone())),
            "seen at once"
        );
        let crashed = dir.path().join("crashed.redb");
        let start = std::time::Instant::now();
        loop {
            std::fs::copy(&path, &crashed).unwrap();
            let found =
                EmbeddedLedger::open(&crashed, false).unwrap().get("pv-behind").await.unwrap();
            if found.is_some() {
                assert_eq!(found, Some((record, version)));
                break;
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(5),
                "not committed behind the write"
            );
            tokio::time::sleep(super::super::write_behind::GATHER / 4).await;
        }
    }

    #[test]
    fn an_unusable_store_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("not-a-db");
        std::fs::write(
            &path,
            b"garbage that is not a redb file, long enough to have a header.....",
        )
        .unwrap();
        let err = EmbeddedLedger::open(&path, false).err().expect("garbage must not open");
        assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    }
}
