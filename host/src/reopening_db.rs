//! redb databases that outlive an I/O error. After a write fails in the
//! middle (a full disk), redb refuses every later transaction until the
//! database is closed and opened again; the agent must serve again as soon
//! as there is space, without a restart.

use redb::Database;
use std::path::{Path, PathBuf};
use std::sync::{RwLock, RwLockReadGuard};

type Opener = Box<dyn Fn(&Path) -> Result<Database, String> + Send + Sync>;

pub struct Reopening {
    path: PathBuf,
    open: Opener,
    /// None while closed: a reopening failed, the next call tries again.
    db: RwLock<Option<Database>>,
}

impl Reopening {
    /// Open the database at `path` with `open`, which is also how it is
    /// opened again.
    pub fn open(
        path: &Path,
        open: impl Fn(&Path) -> Result<Database, String> + Send + Sync + 'static,
    ) -> Result<Reopening, String> {
        let db = open(path)?;
        Ok(Reopening { path: path.to_path_buf(), open: Box::new(open), db: RwLock::new(Some(db)) })
    }

    /// Run `f` on the database. When `f` fails and the database then
    /// refuses to begin a write, it is closed and opened again for the
    /// next call; a failure of `f` that leaves it usable (a lost race, a
    /// bad record) costs nothing more. `closed` words the error of a call
    /// made while the database cannot be opened.
    pub fn with<R, E>(
        &self,
        f: impl FnOnce(&Database) -> Result<R, E>,
        closed: impl FnOnce(String) -> E,
    ) -> Result<R, E> {
        let mut guard = self.read();
        if guard.is_none() {
            drop(guard);
            if let Err(why) = self.reopen() {
                return Err(closed(why));
            }
            guard = self.read();
        }
        let Some(db) = guard.as_ref() else { return Err(closed("the database was closed".into())) };
        let result = f(db);
        if result.is_err() && db.begin_write().is_err() {
            drop(guard);
            match self.reopen() {
                Ok(()) => {
                    tracing::warn!(path = %self.path.display(), "database opened again after a failed write");
                }
                Err(why) => {
                    tracing::error!(path = %self.path.display(), "database closed after a failed write; opening it again failed: {why}");
                }
            }
        }
        result
    }

    fn read(&self) -> RwLockReadGuard<'_, Option<Database>> {
        self.db.read().unwrap_or_else(|p| p.into_inner())
    }

    fn reopen(&self) -> Result<(), String> {
        let mut db = self.db.write().unwrap_or_else(|p| p.into_inner());
        // Closed first: redb locks the file while it is open.
        drop(db.take());
        *db = Some((self.open)(&self.path)?);
        Ok(())
    }
}
