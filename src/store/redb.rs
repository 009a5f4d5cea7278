//! The embedded store: execution records in one redb file, for a single proxy instance.
//! Writes go through one writer thread that group-commits them (one fsync per batch, see
//! [`writer`]); reads use their own read transactions and never wait for the writer.

mod delivery;
mod tables;
#[cfg(test)]
mod tests;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use ::redb::{CompactionError, Database, DatabaseError};
use async_trait::async_trait;

use self::delivery::Reply;
use self::tables::Snapshot;
use self::writer::{Command, Writer};
use crate::policy::identity::ExecutionId;
use crate::store::{Claim, ListFilter, OperationMark, Record, Store, StoreError, StoreResult};

/// redb's page cache unless `store.cache_bytes` says otherwise (see [`RedbStore::open`]).
pub const DEFAULT_CACHE_BYTES: usize = 8 << 20;

/// Counters that show group commit at work: `writes / commits` is the mean batch size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RedbStats {
    /// Write transactions committed (each one fsync).
    pub commits: u64,
    /// Write commands (claim, update, renew_leases, gc) in those commits.
    pub writes: u64,
}

/// A [`Store`] over one redb file. Open it once per process: redb locks the file, so a
/// second opener (in this process or another) is refused.
pub struct RedbStore {
    shared: Arc<Shared>,
    /// `None` only while [`RedbStore::compact`] has the database to itself.
    writer: Option<Writer>,
}

/// What the writer thread and the read path share.
struct Shared {
    /// The open database. Replaced after a failed commit (redb latches an I/O error for the
    /// life of a `Database`, so only a fresh open can write again); `None` only while that
    /// reopen is under way or failed.
    db: parking_lot::RwLock<Option<Arc<Database>>>,
    cache_bytes: usize,
    /// When the writer last tried to reopen after a failed commit.
    last_reopen: parking_lot::Mutex<Option<std::time::Instant>>,
    path: PathBuf,
    /// Whether writes may go on; shared with the file watcher.
    health: Arc<Health>,
    commits: AtomicU64,
    writes: AtomicU64,
    #[cfg(test)]
    test: writer::TestHooks,
}

/// Whether the store may take writes, and the identity of the file it opened.
struct Health {
    path: PathBuf,
    /// Device and inode of the file at `path` when it was opened: if the path stops
    /// naming that file (deleted, or replaced by another file), every write we make goes
    /// into a file nobody will ever open again, and after a restart the calls it records
    /// would run again. `None` where the platform tells no inode.
    file: Option<(u64, u64)>,
    /// Set once, when the file is lost (deleted or replaced). From then on every write is
    /// refused until a restart: records written into a file nobody will open again would
    /// be forgotten, and every call they record would run again.
    failed: OnceLock<String>,
    /// Why the last commit failed (disk full, read-only file system, an I/O error), until
    /// a reopen succeeds. Nothing of a failed batch is durable and redb re-reads the truth
    /// from disk when it opens, so writes may resume once the condition clears.
    commit_failed: parking_lot::Mutex<Option<String>>,
}

impl Health {
    /// Makes the store sticky-failed and returns the reason for the batch's callers.
    fn fail(&self, reason: String) -> String {
        tracing::error!(path = %self.path.display(), %reason, "redb store failed; refusing all further writes (side effects are answered 503 until it is fixed and the proxy restarted)");
        let _ = self.failed.set(reason.clone());
        self.failed.get().cloned().unwrap_or(reason)
    }

    fn refusal(&self) -> Option<StoreError> {
        self.failed
            .get()
            .map(|reason| StoreError::Backend(format!("store failed earlier: {reason}")))
    }

    /// Remembers a failed commit: writes are refused until the writer reopens the store.
    fn commit_failed(&self, reason: String) -> String {
        tracing::error!(path = %self.path.display(), %reason, "redb commit failed; side effects are refused (503) until the store can be written again, which is retried as writes come in");
        *self.commit_failed.lock() = Some(reason.clone());
        reason
    }

    fn pending_failure(&self) -> Option<String> {
        self.commit_failed.lock().clone()
    }

    /// Checks that the path still names the file we hold (one `stat`): called by the
    /// writer before every batch and by the watcher thread every [`WATCH_EVERY`].
    fn check_file(&self) -> Result<(), String> {
        if let Some(reason) = self.failed.get() {
            return Err(reason.clone());
        }
        let Some(held) = self.file else {
            return Ok(());
        };
        let lost = match std::fs::metadata(&self.path) {
            Ok(m) if file_id(&m) == held => return Ok(()),
            Ok(_) => "was replaced by another file".to_string(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "was deleted".to_string(),
            // Permission or I/O trouble on the directory: not proof the file is gone;
            // the commit itself will tell.
            Err(_) => return Ok(()),
        };
        Err(self.fail(format!(
            "the store file {} {lost} while the proxy was running; records written now would \
             be lost (restore the file, or start a new store deliberately, and restart)",
            self.path.display()
        )))
    }
}

/// How often the writer may try to reopen the store after a failed commit.
const REOPEN_EVERY: std::time::Duration = std::time::Duration::from_millis(500);
/// Size of the probe written before a reopen: room for a commit's pages, roughly.
const PROBE_BYTES: usize = 256 << 10;

/// How often the watcher thread checks that the store file is still there.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

fn file_id(m: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (m.dev(), m.ino())
}

/// Checks the file every [`WATCH_EVERY`], so a lost file is noticed (readiness, logs) even
/// when nothing is written. Ends with the store (the last other holder of `health`).
fn spawn_watcher(health: &Arc<Health>) {
    let health = health.clone();
    let _ = std::thread::Builder::new()
        .name("idemproxy-redb-watch".into())
        .spawn(move || {
            while Arc::strong_count(&health) > 1 {
                if health.check_file().is_err() {
                    return;
                }
                std::thread::sleep(WATCH_EVERY);
            }
        });
}

impl Shared {
    /// The current database handle (a clone of the `Arc`: a reopen never pulls a file out
    /// from under a read in progress).
    fn db(&self) -> StoreResult<Arc<Database>> {
        self.db.read().clone().ok_or_else(|| {
            StoreError::Backend(format!(
                "the store {} is being reopened after a failed commit",
                self.path.display()
            ))
        })
    }

    /// `read` on the current database, under the read lock (one uncontended atomic; no
    /// reference count moves): the point reads on the request path use this.
    fn with_db<T>(&self, read: impl FnOnce(&Database) -> StoreResult<T>) -> StoreResult<T> {
        match self.db.read().as_deref() {
            Some(db) => read(db),
            None => Err(StoreError::Backend(format!(
                "the store {} is being reopened after a failed commit",
                self.path.display()
            ))),
        }
    }

    /// After a failed commit: if the file can be written again (a probe file of
    /// [`PROBE_BYTES`] written and synced beside it), close the database and open it
    /// afresh, which recovers from disk exactly what was committed. At most every
    /// [`REOPEN_EVERY`]; returns whether the store is writable now.
    fn try_reopen(&self) -> bool {
        let Some(reason) = self.health.pending_failure() else {
            return true;
        };
        {
            let mut last = self.last_reopen.lock();
            if last.is_some_and(|t| t.elapsed() < REOPEN_EVERY) {
                return false;
            }
            *last = Some(std::time::Instant::now());
        }
        if let Err(e) = self.probe_write() {
            tracing::debug!(path = %self.path.display(), error = %e, "store still not writable");
            return false;
        }
        let mut slot = self.db.write();
        // Reads hold the handle for a moment: wait for them (new ones wait on the lock).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while slot.as_ref().is_some_and(|db| Arc::strong_count(db) > 1) {
            if std::time::Instant::now() > deadline {
                tracing::warn!("store reopen postponed: a read still holds the database");
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        if let Some(old) = slot.take().and_then(Arc::into_inner) {
            let _ = old.close();
        }
        match RedbStore::open_database(&self.path, self.cache_bytes, false) {
            Ok(db) => {
                *slot = Some(Arc::new(db));
                *self.health.commit_failed.lock() = None;
                tracing::warn!(path = %self.path.display(), earlier = %reason, "redb store reopened after a failed commit; writes resume");
                true
            }
            Err(e) => {
                tracing::error!(path = %self.path.display(), error = %e, "redb store could not be reopened; retrying as writes come in");
                false
            }
        }
    }

    /// Writes and syncs a small file beside the store: proof that the disk takes writes
    /// again (space freed, file system writable) before the store is reopened.
    fn probe_write(&self) -> std::io::Result<()> {
        use std::io::Write;
        #[cfg(test)]
        if self.test.probe_fails.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("injected by a test"));
        }
        let mut name = self.path.as_os_str().to_owned();
        name.push(".probe");
        let probe = PathBuf::from(name);
        let result = (|| {
            let mut f = std::fs::File::create(&probe)?;
            f.write_all(&[0u8; PROBE_BYTES])?;
            f.sync_all()
        })();
        let _ = std::fs::remove_file(&probe);
        result
    }

    fn refusal(&self) -> Option<StoreError> {
        self.health.refusal()
    }
}

impl RedbStore {
    /// Opens (or creates, with its parent directories) the store at `path`. Blocking: a
    /// file left by a crash is repaired here, so call it at startup, not on a hot path.
    pub fn open(path: &Path) -> StoreResult<RedbStore> {
        Self::open_with_cache(path, DEFAULT_CACHE_BYTES)
    }

    /// [`RedbStore::open`] with a page cache of `cache_bytes`.
    ///
    /// A missing file is created (a first run). An existing empty file is refused: a store
    /// that existed (then truncated by a bad copy, a full disk, a restore gone wrong) must
    /// never silently become a new, empty store, because every call it recorded would run
    /// again; [`RedbStore::discard_empty`] (`serve --init-store`) makes the choice
    /// explicit. The integrity of the whole file is checked at every open, and a file
    /// redb cannot read (a panic inside redb included) is an error naming the file.
    pub fn open_with_cache(path: &Path, cache_bytes: usize) -> StoreResult<RedbStore> {
        if std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == 0) {
            return Err(StoreError::Backend(format!(
                "the store file {} is empty (0 bytes); refusing to start on it, since a store \
                 that existed must never silently start over (every call it recorded would run \
                 again): restore the file from a backup, or, to create a new store there, start \
                 once with `idemproxy serve --init-store`",
                path.display()
            )));
        }
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| {
                StoreError::Backend(format!("cannot create directory {}: {e}", parent.display()))
            })?;
        }
        // redb may panic on a file altered outside it (it promises an error only with the
        // integrity check on); either way the caller gets an error naming the file.
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Self::open_database(path, cache_bytes, true)
        }));
        let db = match opened {
            Ok(db) => db?,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "no message".into());
                return Err(StoreError::Backend(format!(
                    "cannot open {}: the file is corrupt (redb failed reading it: {what}); \
                     restore it from a backup",
                    path.display()
                )));
            }
        };
        let health = Arc::new(Health {
            path: path.to_path_buf(),
            file: std::fs::metadata(path).ok().map(|m| file_id(&m)),
            failed: OnceLock::new(),
            commit_failed: parking_lot::Mutex::new(None),
        });
        spawn_watcher(&health);
        let shared = Arc::new(Shared {
            db: parking_lot::RwLock::new(Some(Arc::new(db))),
            cache_bytes,
            last_reopen: parking_lot::Mutex::new(None),
            path: path.to_path_buf(),
            health,
            commits: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            #[cfg(test)]
            test: writer::TestHooks::default(),
        });
        let writer = Writer::spawn(shared.clone())?;
        Ok(RedbStore {
            shared,
            writer: Some(writer),
        })
    }

    fn open_database(path: &Path, cache_bytes: usize, check: bool) -> StoreResult<Database> {
        // redb's own page cache defaults to 1 GiB and fills with every page a replay
        // touches: resident memory then grows with the store (100 MiB at 10k records).
        // The kernel's page cache holds the file anyway; redb keeps the hot upper B-tree
        // levels in this much, and a miss is one pread from the page cache.
        let db = Database::builder()
            .set_cache_size(cache_bytes)
            // Reads the whole file once per start (about a second per GiB here): a file
            // altered outside redb is then refused instead of trusted.
            .set_check_integrity_on_open(check)
            .create(path)
            .map_err(|e| match e {
                DatabaseError::DatabaseAlreadyOpen => StoreError::Backend(format!(
                    "{} is already open in another process (redb locks the file); \
                 stop that process or use a different store path",
                    path.display()
                )),
                e => StoreError::Backend(format!("cannot open {}: {e}", path.display())),
            })?;
        tables::create_all(&db, tables::MIGRATE_CHUNK).map_err(|e| {
            StoreError::Backend(format!("cannot initialise {}: {e}", path.display()))
        })?;
        Ok(db)
    }

    /// `serve --init-store`: the operator says a new store may be created at `path`. An
    /// existing empty file is removed so that the open creates a store there (a missing
    /// file is created anyway); a file with content is left alone and opened as usual.
    /// Returns whether an empty file was removed.
    pub fn discard_empty(path: &Path) -> StoreResult<bool> {
        match std::fs::metadata(path) {
            Ok(m) if m.is_file() && m.len() == 0 => {
                std::fs::remove_file(path).map_err(|e| {
                    StoreError::Backend(format!("cannot remove the empty {}: {e}", path.display()))
                })?;
                tracing::warn!(path = %path.display(), "--init-store: creating a new store in place of an empty file");
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    pub fn stats(&self) -> RedbStats {
        RedbStats {
            commits: self.shared.commits.load(Ordering::Relaxed),
            writes: self.shared.writes.load(Ordering::Relaxed),
        }
    }

    /// A cheap estimate of the bytes the live records need on disk: the record count
    /// (kept by redb) times the mean size of a sample, plus their index entries.
    /// Used to decide whether compaction is worth its time (it reads the whole file).
    pub fn estimated_live_bytes(&self) -> StoreResult<u64> {
        let (count, mean) = Snapshot::begin(&*self.shared.db()?)?.size_sample(64)?;
        // An index entry is the execution id plus a key part of about 8 bytes (a time,
        // a state, or an id of the caller's); counted for seven indexes (status, expiry,
        // operation, tool call, key, route, created), though delivered records have no
        // status entry and not every record has an operation, tool call or key (an
        // over-estimate).
        let id = 28;
        Ok(count.saturating_mul(mean + 7 * (id + 8)))
    }

    /// Shrinks the file after deletions (run it at startup or after a large `gc`). Returns
    /// whether redb could compact anything.
    ///
    /// redb compacts only with no transaction alive, so this stops the writer thread for
    /// its duration and needs `&mut self`: with the store behind an `Arc`, call it before
    /// sharing the store (or through `Arc::get_mut`). It fails without harm if a read task
    /// whose caller gave up (a dropped `list` future) is still running.
    pub fn compact(&mut self) -> StoreResult<bool> {
        if let Some(e) = self.shared.refusal() {
            return Err(e);
        }
        if let Some(reason) = self.shared.health.pending_failure() {
            return Err(StoreError::Backend(format!("store write failed: {reason}")));
        }
        if let Some(writer) = self.writer.take() {
            writer.stop();
        }
        let result = match Arc::get_mut(&mut self.shared)
            .and_then(|shared| shared.db.get_mut().as_mut())
            .and_then(Arc::get_mut)
        {
            Some(db) => match db.compact() {
                Ok(done) => Ok(done),
                // A storage error part way through a compaction leaves the file in a state
                // we did not commit to: fail closed, as for a failed commit.
                Err(CompactionError::Storage(e)) => Err(StoreError::Backend(
                    self.shared
                        .health
                        .commit_failed(format!("compaction failed: {e}")),
                )),
                Err(e) => Err(StoreError::Backend(format!("cannot compact now: {e}"))),
            },
            None => Err(StoreError::Backend(
                "cannot compact now: a read of this store is still running".into(),
            )),
        };
        self.writer = Some(Writer::spawn(self.shared.clone())?);
        result
    }

    /// Hands a write to the writer thread and waits until its batch is durable.
    async fn submit<T: Send>(
        &self,
        command: impl FnOnce(Reply<T>) -> Command + Send,
    ) -> StoreResult<T> {
        // Checked here too (the writer checks again) so a failed store answers at once.
        if let Some(e) = self.shared.refusal() {
            return Err(e);
        }
        let writer = self
            .writer
            .as_ref()
            .ok_or_else(|| StoreError::Backend("the redb writer is not running".into()))?;
        let (reply, answer) = delivery::channel();
        writer.send(command(reply))?;
        #[cfg(test)]
        self.shared.test.submitted.fetch_add(1, Ordering::SeqCst);
        answer.await.map_err(|_| {
            StoreError::Backend("the redb writer stopped before answering (it panicked)".into())
        })?
    }

    /// Runs a scan on the blocking pool: it reads up to `limit` records and decodes their
    /// JSON, which is too long to hold a runtime worker for.
    async fn scan<T: Send + 'static>(
        &self,
        read: impl FnOnce(&Snapshot) -> StoreResult<T> + Send + 'static,
    ) -> StoreResult<T> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || read(&Snapshot::begin(&*shared.db()?)?))
            .await
            .map_err(|e| StoreError::Backend(format!("store read task failed: {e}")))?
    }
}

impl Drop for RedbStore {
    /// Closes the queue and joins the writer, which answers everything already queued
    /// first. The file itself closes when the last read task lets go of it.
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take() {
            writer.stop();
        }
    }
}

#[async_trait]
impl Store for RedbStore {
    /// The record is encoded here, on the caller's thread: the one writer applies batches
    /// one after another, so encoding there lengthened every commit.
    async fn claim(&self, mut record: Record) -> StoreResult<Claim> {
        record.version = 1;
        let bytes = record.to_bytes();
        self.submit(|reply| Command::Claim {
            record,
            bytes,
            reply,
        })
        .await
    }

    /// Runs on the caller's thread: a point read is one B-tree lookup in pages that are
    /// almost always in redb's cache (about a microsecond), well below what a hop to the
    /// blocking pool costs, and redb's read transactions never wait for the writer (its
    /// fsync happens outside the lock readers take).
    async fn get(&self, id: &ExecutionId) -> StoreResult<Option<Record>> {
        self.shared
            .with_db(|db| Snapshot::begin(db)?.get(id.as_str()))
    }

    /// Encoded on the caller's thread too. A compare-and-set that succeeds always writes
    /// the version after the one the caller read, so it can be encoded before the check.
    async fn update(&self, mut record: Record) -> StoreResult<Record> {
        let expected = record.version;
        record.version = expected.checked_add(1).ok_or_else(|| StoreError::Corrupt {
            id: record.id.to_string(),
            reason: "version counter exhausted".into(),
        })?;
        let bytes = record.to_bytes();
        self.submit(|reply| Command::Update {
            record,
            expected,
            bytes,
            reply,
        })
        .await
    }

    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        let filter = filter.clone();
        self.scan(move |snapshot| snapshot.list(&filter)).await
    }

    async fn stale_executing(&self, now_ms: i64, limit: usize) -> StoreResult<Vec<Record>> {
        self.scan(move |snapshot| snapshot.stale_executing(now_ms, limit))
            .await
    }

    async fn renew_leases(&self, owner: &str, until_ms: i64) -> StoreResult<u64> {
        let owner = owner.to_string();
        self.submit(|reply| Command::RenewLeases {
            owner,
            until_ms,
            reply,
        })
        .await
    }

    async fn gc(&self, now_ms: i64, limit: usize) -> StoreResult<u64> {
        self.submit(|reply| Command::Gc {
            now_ms,
            limit,
            reply,
        })
        .await
    }

    async fn mark_operation(&self, mark: OperationMark) -> StoreResult<OperationMark> {
        self.submit(|reply| Command::MarkOperation { mark, reply })
            .await
    }

    /// A point read on the caller's thread, like `get`.
    async fn operation(&self, operation_id: &str) -> StoreResult<Option<OperationMark>> {
        self.shared
            .with_db(|db| Snapshot::begin(db)?.operation(operation_id))
    }

    async fn ready(&self) -> Result<(), String> {
        self.shared.health.check_file()?;
        if let Some(reason) = self.shared.health.pending_failure() {
            return Err(format!("the last commit failed: {reason}"));
        }
        if self.writer.is_none() {
            return Err("the redb writer is not running".into());
        }
        self.shared
            .db()
            .and_then(|db| Snapshot::begin(&db)?.get("readyz-probe"))
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}
