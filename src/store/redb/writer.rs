//! The single writer thread: group commit. It takes every command queued at that moment
//! (up to [`BATCH_CAP`]), applies them in order in one fsync'd write transaction, commits,
//! and only then answers the callers, so N concurrent writes cost one fsync instead of N.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use ::redb::Durability;

use super::delivery::{self, Reply};
use super::tables::WriteTables;
use super::Shared;
use crate::store::{Claim, OperationMark, Record, StoreError, StoreResult};

/// Commands per write transaction. Large enough that a burst shares one fsync; small
/// enough that one batch's transaction (and the wait of its first caller) stays short.
pub(super) const BATCH_CAP: usize = 256;

/// One write, with the channel its caller waits on.
pub(super) enum Command {
    /// `record` has version 1; `bytes` is its encoding.
    Claim {
        record: Record,
        bytes: Vec<u8>,
        reply: Reply<Claim>,
    },
    /// `record` has the version after `expected`; `bytes` is its encoding.
    Update {
        record: Record,
        expected: u64,
        bytes: Vec<u8>,
        reply: Reply<Record>,
    },
    RenewLeases {
        owner: String,
        until_ms: i64,
        reply: Reply<u64>,
    },
    Gc {
        now_ms: i64,
        limit: usize,
        reply: Reply<u64>,
    },
    MarkOperation {
        mark: OperationMark,
        reply: Reply<OperationMark>,
    },
}

impl Command {
    fn refuse(self, reason: &str) {
        match self {
            Command::Claim { reply, .. } => refuse(reply, reason),
            Command::Update { reply, .. } => refuse(reply, reason),
            Command::RenewLeases { reply, .. } | Command::Gc { reply, .. } => refuse(reply, reason),
            Command::MarkOperation { reply, .. } => refuse(reply, reason),
        }
    }
}

fn refuse<T>(reply: Reply<T>, reason: &str) {
    reply.send(Err(StoreError::Backend(reason.to_string())));
}

/// A command applied inside the open transaction; its result is held until the commit.
pub(super) struct Answer<T> {
    reply: Reply<T>,
    result: StoreResult<T>,
}

impl<T> Answer<T> {
    fn send(self) {
        self.reply.send(self.result);
    }
}

/// A command's answer, held until its batch is durable.
pub(super) enum Applied {
    Claim(Answer<Claim>),
    Record(Answer<Record>),
    Count(Answer<u64>),
    Mark(Answer<OperationMark>),
}

impl Applied {
    pub(super) fn send(self) {
        match self {
            Applied::Claim(a) => a.send(),
            Applied::Record(a) => a.send(),
            Applied::Count(a) => a.send(),
            Applied::Mark(a) => a.send(),
        }
    }

    /// The mailbox of the runtime its caller waits on, if it has one.
    pub(super) fn home(&self) -> Option<&Arc<delivery::Home>> {
        match self {
            Applied::Claim(a) => a.reply.home(),
            Applied::Record(a) => a.reply.home(),
            Applied::Count(a) => a.reply.home(),
            Applied::Mark(a) => a.reply.home(),
        }
    }

    fn refuse(self, reason: &str) {
        match self {
            Applied::Claim(a) => refuse(a.reply, reason),
            Applied::Record(a) => refuse(a.reply, reason),
            Applied::Count(a) => refuse(a.reply, reason),
            Applied::Mark(a) => refuse(a.reply, reason),
        }
    }
}

pub(super) struct Writer {
    tx: Sender<Command>,
    thread: JoinHandle<()>,
}

impl Writer {
    pub(super) fn spawn(shared: Arc<Shared>) -> StoreResult<Writer> {
        let (tx, rx) = mpsc::channel();
        let thread = thread::Builder::new()
            .name("idemproxy-redb-writer".into())
            .spawn(move || run(&shared, &rx))
            .map_err(|e| {
                StoreError::Backend(format!("cannot start the redb writer thread: {e}"))
            })?;
        Ok(Writer { tx, thread })
    }

    /// Queues a command; fails only when the thread is gone (it panicked).
    pub(super) fn send(&self, command: Command) -> StoreResult<()> {
        self.tx
            .send(command)
            .map_err(|_| StoreError::Backend("the redb writer thread has stopped".into()))
    }

    /// Closes the queue, lets the thread finish what is queued, and waits for it.
    pub(super) fn stop(self) {
        drop(self.tx);
        if self.thread.join().is_err() {
            tracing::error!("the redb writer thread panicked");
        }
    }
}

fn run(shared: &Shared, rx: &Receiver<Command>) {
    let mut batch = Vec::with_capacity(BATCH_CAP);
    // `recv` fails once the store dropped its sender: that is the shutdown signal.
    while let Ok(first) = rx.recv() {
        #[cfg(test)]
        shared.test.wait_while_paused();
        batch.push(first);
        batch.extend(rx.try_iter().take(BATCH_CAP - 1));
        commit_batch(shared, &mut batch);
    }
}

fn commit_batch(shared: &Shared, batch: &mut Vec<Command>) {
    // One `stat` per batch: a store file deleted or replaced under us fails the store
    // before this batch could go into a file nobody will open again.
    if let Err(reason) = shared.health.check_file() {
        let reason = format!("store failed earlier: {reason}");
        batch.drain(..).for_each(|c| c.refuse(&reason));
        return;
    }
    // After a failed commit: reopen once the disk takes writes again, else refuse.
    if !shared.try_reopen() {
        let reason = shared.health.pending_failure().unwrap_or_default();
        let reason = format!(
            "store write failed: {reason}; writes resume once the store can be written again"
        );
        batch.drain(..).for_each(|c| c.refuse(&reason));
        return;
    }
    let count = batch.len() as u64;
    match write_batch(shared, batch) {
        Ok(applied) => {
            shared.commits.fetch_add(1, Ordering::Relaxed);
            shared.writes.fetch_add(count, Ordering::Relaxed);
            // Lets a test of the real binary see that concurrent writes shared a commit.
            tracing::debug!(writes = count, "group commit durable");
            let _woken = delivery::deliver(applied);
            #[cfg(test)]
            shared.test.homes_woken.fetch_add(_woken, Ordering::SeqCst);
        }
        Err((reason, applied)) => {
            let reason = shared.health.commit_failed(reason);
            applied.into_iter().for_each(|a| a.refuse(&reason));
            batch.drain(..).for_each(|c| c.refuse(&reason));
        }
    }
}

/// Applies and commits the whole batch. `Ok` holds the answers, to be sent now that they
/// are durable. `Err` means nothing of the batch is durable: it holds the reason and the
/// commands already applied; any not yet applied are still in `batch`.
fn write_batch(
    shared: &Shared,
    batch: &mut Vec<Command>,
) -> Result<Vec<Applied>, (String, Vec<Applied>)> {
    let db = shared.db().map_err(|e| (reason(e), Vec::new()))?;
    let mut txn = db
        .begin_write()
        .map_err(|e| (format!("cannot begin a write transaction: {e}"), Vec::new()))?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| (format!("cannot make the write durable: {e}"), Vec::new()))?;

    let mut applied = Vec::with_capacity(batch.len());
    let mut fatal = None;
    {
        let mut tables = WriteTables::open(&txn).map_err(|e| (reason(e), Vec::new()))?;
        for command in batch.drain(..) {
            applied.push(apply(&mut tables, command, &mut fatal));
        }
    }
    if let Some(reason) = fatal {
        // redb failed part way: roll the whole batch back rather than commit half of it.
        let _ = txn.abort();
        return Err((reason, applied));
    }
    #[cfg(test)]
    if shared.test.fail_next_commit.swap(false, Ordering::SeqCst) {
        let _ = txn.abort();
        return Err(("commit failed: injected by a test".into(), applied));
    }
    match txn.commit() {
        Ok(()) => Ok(applied),
        Err(e) => Err((format!("commit failed: {e}"), applied)),
    }
}

/// The message of a storage failure, without `StoreError`'s own prefix.
fn reason(e: StoreError) -> String {
    match e {
        StoreError::Backend(reason) => reason,
        other => other.to_string(),
    }
}

fn apply(t: &mut WriteTables<'_>, command: Command, fatal: &mut Option<String>) -> Applied {
    match command {
        Command::Claim {
            record,
            bytes,
            reply,
        } => Applied::Claim(Answer {
            reply,
            result: guarded(fatal, || t.claim(record, &bytes)),
        }),
        Command::Update {
            record,
            expected,
            bytes,
            reply,
        } => Applied::Record(Answer {
            reply,
            result: guarded(fatal, || t.update(record, expected, &bytes)),
        }),
        Command::RenewLeases {
            owner,
            until_ms,
            reply,
        } => Applied::Count(Answer {
            reply,
            result: guarded(fatal, || t.renew_leases(&owner, until_ms)),
        }),
        Command::Gc {
            now_ms,
            limit,
            reply,
        } => Applied::Count(Answer {
            reply,
            result: guarded(fatal, || t.gc(now_ms, limit)),
        }),
        Command::MarkOperation { mark, reply } => Applied::Mark(Answer {
            reply,
            result: guarded(fatal, || t.mark_operation(mark)),
        }),
    }
}

/// Runs one command unless an earlier one in the batch hit a storage failure. A logical
/// refusal (Conflict, NotFound, Corrupt) stays that command's answer; a Backend error means
/// redb itself failed mid-transaction, so the batch is abandoned.
fn guarded<T>(fatal: &mut Option<String>, op: impl FnOnce() -> StoreResult<T>) -> StoreResult<T> {
    if let Some(reason) = fatal {
        return Err(StoreError::Backend(reason.clone()));
    }
    let result = op();
    if let Err(StoreError::Backend(reason)) = &result {
        *fatal = Some(reason.clone());
    }
    result
}

/// Switches the writer thread's behaviour in tests only.
#[cfg(test)]
#[derive(Default)]
pub(super) struct TestHooks {
    /// The next commit returns an error instead of committing.
    pub(super) fail_next_commit: std::sync::atomic::AtomicBool,
    /// While set, the disk "still refuses writes": no reopen after a failed commit.
    pub(super) probe_fails: std::sync::atomic::AtomicBool,
    /// While set, the writer holds the first command of its next batch and lets the others
    /// queue up behind it, so a test can choose what shares one batch.
    pub(super) paused: std::sync::atomic::AtomicBool,
    /// Commands handed to the writer so far.
    pub(super) submitted: std::sync::atomic::AtomicUsize,
    /// Caller runtimes woken to take a batch's answers, over all batches.
    pub(super) homes_woken: std::sync::atomic::AtomicUsize,
}

#[cfg(test)]
impl TestHooks {
    pub(super) fn wait_while_paused(&self) {
        while self.paused.load(Ordering::SeqCst) {
            thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
