//! Answers from the writer thread back to the callers: one wake per caller runtime per
//! batch, not one per answer.
//!
//! A caller waits on a oneshot channel. Completing one from the writer thread wakes a task
//! of another runtime, and for the server's single-threaded worker runtimes tokio does that
//! with a write to the runtime's eventfd, every time: a batch of 60 answers was 60 system
//! calls on the writer thread (14% of its samples at 64 clients), and the first of them
//! woke a worker pinned to the writer's CPU, which took the CPU from the writer while the
//! rest of the batch waited (docs/PERFORMANCE.md, "Store: group commit and the redb
//! writer"). The writer is the serial stage of every first execution, so its time is the
//! durable path's throughput.
//!
//! So a caller on a current-thread runtime gets a [`Home`]: its runtime's mailbox. The
//! writer puts the batch's answers for that runtime into the mailbox at once and spawns
//! one task there, which completes them all where completing a oneshot is a push onto the
//! runtime's own run queue. Callers on a multi-threaded runtime (the admin API, tools,
//! tests) are answered directly, as before.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use smallvec::SmallVec;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::oneshot;

use super::writer::Applied;
use crate::store::StoreResult;

/// Where a caller waits for one write's answer.
pub(super) struct Reply<T> {
    tx: oneshot::Sender<StoreResult<T>>,
    home: Option<Arc<Home>>,
}

/// A reply for a caller on the current thread, and what it waits on.
pub(super) fn channel<T>() -> (Reply<T>, oneshot::Receiver<StoreResult<T>>) {
    let (tx, rx) = oneshot::channel();
    (Reply { tx, home: here() }, rx)
}

impl<T> Reply<T> {
    /// Answers now, from whatever thread this runs on.
    pub(super) fn send(self, result: StoreResult<T>) {
        // A caller that went away (its future was dropped) needs no answer.
        let _ = self.tx.send(result);
    }

    pub(super) fn home(&self) -> Option<&Arc<Home>> {
        self.home.as_ref()
    }
}

/// One current-thread runtime's mailbox for the writer's answers.
pub(super) struct Home {
    runtime: Handle,
    pending: Mutex<Vec<Applied>>,
    /// A drain task is spawned and has not yet taken `pending`.
    scheduled: AtomicBool,
}

thread_local! {
    /// The mailbox of the runtime this thread last ran a caller on.
    static HOME: RefCell<Option<Arc<Home>>> = const { RefCell::new(None) };
}

/// The mailbox of the current-thread runtime this code runs on, if it runs on one.
fn here() -> Option<Arc<Home>> {
    let runtime = Handle::try_current().ok()?;
    if runtime.runtime_flavor() != RuntimeFlavor::CurrentThread {
        return None;
    }
    HOME.with(|slot| {
        let mut slot = slot.borrow_mut();
        match slot.as_ref() {
            // A thread may run one runtime after another (tests do): a mailbox is only
            // reused for the runtime it was made for.
            Some(home) if home.runtime.id() == runtime.id() => Some(home.clone()),
            _ => {
                let home = Arc::new(Home {
                    runtime,
                    pending: Mutex::new(Vec::new()),
                    scheduled: AtomicBool::new(false),
                });
                *slot = Some(home.clone());
                Some(home)
            }
        }
    })
}

/// Sends a committed batch's answers: directly to callers without a mailbox, and to each
/// mailbox all of its answers with one wake. Returns the number of mailboxes woken.
pub(super) fn deliver(applied: Vec<Applied>) -> usize {
    // One or two homes in practice (one per server worker thread).
    let mut homes: SmallVec<[(Arc<Home>, Vec<Applied>); 4]> = SmallVec::new();
    for answer in applied {
        let Some(home) = answer.home() else {
            answer.send();
            continue;
        };
        match homes.iter_mut().find(|(h, _)| Arc::ptr_eq(h, home)) {
            Some((_, answers)) => answers.push(answer),
            None => homes.push((home.clone(), vec![answer])),
        }
    }
    let mut woken = 0;
    for (home, answers) in homes {
        woken += usize::from(home.post(answers));
    }
    woken
}

impl Home {
    /// Queues `answers` and makes sure a drain task will take them. Returns whether it
    /// spawned one (a task spawned earlier may not have run yet, and takes these too).
    fn post(self: &Arc<Self>, answers: Vec<Applied>) -> bool {
        self.pending.lock().extend(answers);
        if self.scheduled.swap(true, Ordering::SeqCst) {
            return false;
        }
        let home = self.clone();
        // If that runtime has shut down, the task is dropped unrun and so are the answers:
        // their callers were that runtime's tasks, and are gone too.
        drop(self.runtime.spawn(async move { home.drain() }));
        true
    }

    /// On the home runtime: completes every queued answer.
    fn drain(&self) {
        // Cleared before taking: answers posted after the take find it clear and spawn
        // another drain; answers posted before it are in what is taken.
        self.scheduled.store(false, Ordering::SeqCst);
        let answers = std::mem::take(&mut *self.pending.lock());
        answers.into_iter().for_each(Applied::send);
    }
}
