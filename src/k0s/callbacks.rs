//! The callback adapter: k0s's old callback API, driven only by `run_leader_tasks`.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::status::{StatusSource, StopCause, Validity};
use crate::tasks::{LeaderContext, run_leader_tasks};

/// What the callback running on this (blocking-pool) thread belongs to.
#[derive(Clone)]
pub(crate) struct CallbackScope {
    /// The callback driver, by the address of its callbacks.
    driver: usize,
    /// The term the callback runs for, by its validity cell.
    term: Option<Weak<Mutex<Validity>>>,
}

thread_local! {
    static IN_CALLBACK: RefCell<Option<CallbackScope>> = const { RefCell::new(None) };
}

/// Restores the thread's previous callback scope when dropped (also on a panic).
struct ScopeGuard(Option<CallbackScope>);

impl ScopeGuard {
    fn enter(scope: CallbackScope) -> Self {
        ScopeGuard(IN_CALLBACK.with(|c| c.replace(Some(scope))))
    }
}

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        let prev = self.0.take();
        IN_CALLBACK.with(|c| *c.borrow_mut() = prev);
    }
}

/// The term whose lease callback runs on this thread, if any.
pub(crate) fn callback_term() -> Option<Weak<Mutex<Validity>>> {
    IN_CALLBACK.with(|c| c.borrow().as_ref().and_then(|s| s.term.clone()))
}

/// A callback of the deprecated callback API (k0s's `func()`).
pub type LeaseCallback = Box<dyn Fn() + Send + Sync + 'static>;

type Shared = Arc<dyn Fn() + Send + Sync + 'static>;

/// After how long a running callback is logged as slow.
const SLOW_CALLBACK: Duration = Duration::from_secs(10);

struct Callbacks {
    acquired: watch::Sender<Vec<Shared>>,
    lost: Mutex<Vec<Shared>>,
}

/// Runs registered callbacks as leadership starts and ends. Owned by a pool.
pub(crate) struct CallbackDriver {
    callbacks: Arc<Callbacks>,
    parent: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl CallbackDriver {
    /// Starts the driver over `source` on the current runtime.
    pub(crate) fn spawn<S: StatusSource + 'static>(source: S) -> Self {
        let callbacks = Arc::new(Callbacks {
            acquired: watch::Sender::new(Vec::new()),
            lost: Mutex::new(Vec::new()),
        });
        let parent = CancellationToken::new();
        let cbs = callbacks.clone();
        let task = tokio::spawn(run_leader_tasks(parent.clone(), source, move |leader| {
            lead(cbs.clone(), leader)
        }));
        CallbackDriver {
            callbacks,
            parent,
            task: Mutex::new(Some(task)),
        }
    }

    pub(crate) fn add_acquired(&self, f: LeaseCallback) {
        let f: Shared = Arc::from(f);
        self.callbacks.acquired.send_modify(|v| v.push(f));
    }

    pub(crate) fn add_lost(&self, f: LeaseCallback) {
        let f: Shared = Arc::from(f);
        self.callbacks
            .lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(f);
    }

    /// Stops the driver, waits until the running callbacks (the lost callbacks of a term that
    /// just ended, if any) have returned, then calls `after`. Called from inside one of this
    /// driver's own callbacks (which the wait would wait for), it does not wait: the rest, and
    /// `after`, happen in the background once the callbacks have returned.
    pub(crate) async fn stop(&self, after: impl FnOnce() + Send + 'static) {
        self.parent.cancel();
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        let finish = async move {
            if let Some(task) = task
                && let Err(e) = task.await
            {
                warn!(error = %e, "the lease callback task ended abnormally");
            }
            after();
        };
        if self.in_own_callback() {
            tokio::spawn(finish);
        } else {
            finish.await;
        }
    }

    fn id(&self) -> usize {
        Arc::as_ptr(&self.callbacks) as *const () as usize
    }

    /// Whether the caller is one of this driver's callbacks.
    fn in_own_callback(&self) -> bool {
        let id = self.id();
        IN_CALLBACK.with(|c| c.borrow().as_ref().is_some_and(|s| s.driver == id))
    }
}

impl Drop for CallbackDriver {
    fn drop(&mut self) {
        self.parent.cancel();
    }
}

/// One term: runs the acquired callbacks (also those registered during the term), then, once
/// the term ends, the lost callbacks.
async fn lead(cbs: Arc<Callbacks>, leader: LeaderContext) {
    info!(
        fencing_token = leader.fencing_token(),
        "acquired the leader lease"
    );
    let scope = CallbackScope {
        driver: Arc::as_ptr(&cbs) as *const () as usize,
        term: Some(Arc::downgrade(&leader.leadership().validity_cell())),
    };
    let mut rx = cbs.acquired.subscribe();
    let mut ran = 0;
    'term: loop {
        let pending: Vec<Shared> = rx.borrow_and_update().iter().skip(ran).cloned().collect();
        for cb in pending {
            if leader.is_cancelled() {
                // Don't start leader work once the term is over; the lost callbacks follow.
                break 'term;
            }
            invoke(cb, "acquired", ran, Some(scope.clone())).await;
            ran += 1;
        }
        tokio::select! {
            () = leader.cancelled() => break,
            r = rx.changed() => if r.is_err() {
                leader.cancelled().await;
                break;
            },
        }
    }
    leader.cancelled().await;
    match leader.cause() {
        Some(cause @ StopCause::LeaseLost) => {
            warn!(cause = %cause, "lost the leader lease; running the lost-lease callbacks");
        }
        cause => info!(
            cause = %cause.unwrap_or(StopCause::Cancelled),
            "gave up the leader lease; running the lost-lease callbacks"
        ),
    }
    let lost: Vec<Shared> = cbs.lost.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for (i, cb) in lost.into_iter().enumerate() {
        invoke(cb, "lost", i, Some(scope.clone())).await;
    }
}

/// Runs one callback on the blocking pool and waits for it; a panic is logged, not propagated.
/// `scope` names the driver and term a lease callback belongs to (see [`callback_term`]).
pub(crate) async fn invoke(
    cb: Shared,
    kind: &'static str,
    index: usize,
    scope: Option<CallbackScope>,
) {
    let mut handle = tokio::task::spawn_blocking(move || {
        let _scope = scope.map(ScopeGuard::enter);
        cb()
    });
    let slow = tokio::time::sleep(SLOW_CALLBACK);
    tokio::pin!(slow);
    let mut warned = false;
    loop {
        tokio::select! {
            r = &mut handle => {
                match r {
                    Ok(()) => {}
                    Err(e) if e.is_panic() => {
                        error!(kind, index, "a lease callback panicked; continuing with the next one");
                    }
                    Err(e) => warn!(kind, index, error = %e, "a lease callback did not complete"),
                }
                return;
            }
            () = &mut slow, if !warned => {
                warned = true;
                warn!(kind, index, after = ?SLOW_CALLBACK, "a lease callback is still running");
            }
        }
    }
}
