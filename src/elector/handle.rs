//! [`Elector`]: the handle callers hold, and the state it shares with the driver task.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, warn};

use super::ElectorConfig;
use super::driver::Driver;
use super::machine::{Machine, Now};
use crate::error::{Error, Result};
use crate::status::{LeaderStatus, StatusCell, StatusChanged, StatusSource, Validity};
use crate::store::DynLeaseStore;

pub(super) enum Command {
    Yield(Duration, oneshot::Sender<()>),
}

/// Requests to the background task: a queue, a shutdown flag and a waker (lighter than a
/// channel, and polled without a stored future).
#[derive(Default)]
pub(super) struct Commands {
    pub(super) queue: Mutex<Vec<Command>>,
    pub(super) waker: futures::task::AtomicWaker,
    pub(super) shutdown: std::sync::atomic::AtomicBool,
    pub(super) closed: std::sync::atomic::AtomicBool,
}

impl Commands {
    pub(super) fn send(&self, c: Command) -> std::result::Result<(), Command> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(c);
        }
        q.push(c);
        drop(q);
        self.waker.wake();
        Ok(())
    }

    pub(super) fn request_shutdown(&self) {
        self.shutdown
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.waker.wake();
    }

    /// The next command, or whether a shutdown was requested (`Ready(None)`); registers the
    /// waker first, so that nothing sent meanwhile is missed.
    pub(super) fn poll_recv(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Command>> {
        self.waker.register(cx.waker());
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if !q.is_empty() {
            return std::task::Poll::Ready(Some(q.remove(0)));
        }
        if self.shutdown.load(std::sync::atomic::Ordering::SeqCst) {
            return std::task::Poll::Ready(None);
        }
        std::task::Poll::Pending
    }

    /// Closes the queue and drops what is left in it (their callers see the elector gone).
    pub(super) fn close(&self) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        q.clear();
    }
}

pub(super) struct Shared {
    pub(super) config: Arc<ElectorConfig>,
    pub(super) status: StatusCell,
    pub(super) commands: Commands,
    /// The current (or draining) term's validity, for health checks and for revoking it if the
    /// task fails.
    pub(super) validity: Mutex<Option<Arc<Mutex<Validity>>>>,
    /// Set when the background task panicked.
    pub(super) failed: Mutex<Option<String>>,
    /// Set when a leader task of one of its terms panicked (see `run_leader_tasks`).
    pub(super) task_panicked: Mutex<Option<String>>,
    /// The store's failures in a row, if its last operation failed.
    pub(super) store_failure: Mutex<Option<StoreFailure>>,
    /// The highest token seen, when no higher one could be issued (sticky until a term starts).
    pub(super) tokens_exhausted: Mutex<Option<u64>>,
    /// The store's name, for errors.
    pub(super) store_name: &'static str,
    pub(super) metrics: crate::metrics::Metrics,
    /// Cancelled once the background task has finished.
    pub(super) stopped: CancellationToken,
}

/// A run of failed store operations.
pub(super) struct StoreFailure {
    pub(super) first: Instant,
    pub(super) failures: u64,
    pub(super) last_error: String,
}

/// Whether `e` says the store failed, as opposed to an ordinary outcome of a compare-and-swap
/// (a conflict, an existing or missing key), an unsupported optional operation, or corrupt data
/// (which the machine handles).
pub(super) fn is_store_failure(e: &Error) -> bool {
    !matches!(
        e,
        Error::AlreadyExists { .. }
            | Error::Conflict { .. }
            | Error::NotFound { .. }
            | Error::Unsupported { .. }
            | Error::Corrupt { .. }
    )
}

impl Shared {
    /// Records the outcome of a store operation for [`Elector::store_health`].
    pub(super) fn store_outcome(&self, error: Option<&Error>) {
        if let Some(e) = error.filter(|e| is_store_failure(e)) {
            self.metrics.store_error(self.store_name, e);
        }
        let mut cur = self.store_failure.lock().unwrap_or_else(|e| e.into_inner());
        match error {
            None => *cur = None,
            Some(e) if is_store_failure(e) => match cur.as_mut() {
                Some(f) => {
                    f.failures += 1;
                    f.last_error = e.to_string();
                }
                None => {
                    *cur = Some(StoreFailure {
                        first: Instant::now(),
                        failures: 1,
                        last_error: e.to_string(),
                    });
                }
            },
            // An ordinary outcome is an answer from the store.
            Some(_) => *cur = None,
        }
    }

    /// A leader task of a term of this elector panicked: remember it for the health check,
    /// step down and stop (in order: the lease is released once the task's guard is gone).
    pub(super) fn leader_task_panicked(&self, message: String) {
        tracing::error!(
            message,
            "a leader task panicked; the elector steps down, releases the lease and shuts down"
        );
        self.task_panicked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(message);
        self.commands.request_shutdown();
    }

    pub(super) fn failure(&self) -> Option<Error> {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.as_ref().map(|m| Error::ElectorFailed {
            key: self.config.key.to_string(),
            message: m.clone(),
        })
    }
}

/// A leader elector for one lease key. See the [module docs](crate::elector) for its semantics.
///
/// Created by [`Elector::spawn`], which starts a background task on the current Tokio runtime.
/// An `Elector` is a cheap handle: clones share the one elector (like `kube::Client`), so a
/// clone can be moved into `tokio::spawn` or [`run_leader_tasks`](crate::run_leader_tasks).
/// Dropping the last handle shuts the elector down in the background (in order, as
/// [`Elector::shutdown`] does); call `shutdown` on any handle to wait for that. A clone given to
/// [`run_leader_tasks`](crate::run_leader_tasks) is a handle too and keeps the elector running:
/// end it with `shutdown` (then `run_leader_tasks` returns) or by cancelling its token (then
/// `run_leader_tasks` drops its handle, and if that was the last one, the elector shuts down).
///
/// Leader code may end its own term: [`yield_for`](Elector::yield_for) and
/// [`shutdown`](Elector::shutdown) called from inside a `run_leader_tasks` task of this
/// elector's term return once the step-down has begun (see their docs). A leader task that
/// panics makes the elector step down and shut down, and [`check_health`](Elector::check_health)
/// report [`Error::LeaderTaskPanicked`] from then on (see
/// [`run_leader_tasks`](crate::run_leader_tasks)).
///
/// # Examples
///
/// Two candidates on the memory store; the first leads, hands over on shutdown, and the second
/// leads with a higher fencing token:
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use leasehold::{Elector, ElectorConfig, LeaseKey, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() -> leasehold::Result<()> {
/// let store = Arc::new(MemoryStore::new());
/// let key = LeaseKey::new("example")?;
/// let timings = (Duration::from_secs(2), Duration::from_millis(1500), Duration::from_millis(300));
/// let config = |id: &str| ElectorConfig::new(key.clone(), id)
///     .with_timings(timings.0, timings.1, timings.2)
///     .with_trust_absence(true); // a brand-new key with one campaigner at first: take it at once
/// let a = Elector::spawn(store.clone(), config("a"))?;
/// let mut status = a.subscribe();
/// status.wait_for(|s| s.is_leading()).await.expect("a runs");
/// let first = a.current_status().0.leadership().map(|l| l.fencing_token());
///
/// let b = Elector::spawn(store, config("b"))?;
/// a.shutdown().await?; // ordered: releases the lease, so b takes it at once
/// let mut status = b.subscribe();
/// let term = status.wait_for(|s| s.is_leading()).await.expect("b runs").leadership().cloned();
/// assert!(term.map(|t| t.fencing_token()) > first);
/// b.shutdown().await
/// # }
/// ```
#[derive(Clone)]
pub struct Elector {
    inner: Arc<Handle>,
}

/// What every clone of an [`Elector`] shares; dropping it (the last handle) shuts down.
pub(super) struct Handle {
    pub(super) shared: Arc<Shared>,
    pub(super) task: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.commands.request_shutdown();
    }
}

impl fmt::Debug for Elector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Elector")
            .field("key", &self.inner.shared.config.key)
            .field("identity", &self.inner.shared.config.identity)
            .field("status", &self.inner.shared.status.get())
            .finish_non_exhaustive()
    }
}

pub(super) fn now() -> Now {
    Now {
        instant: Instant::now().into_std(),
        wall: SystemTime::now(),
    }
}

// === impl Elector ===

impl Elector {
    /// Validates `config` and starts campaigning on `store` in a background task.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the configuration is invalid (see
    /// [`ElectorConfig::validate`]), or when the store's operation timeout
    /// ([`Capabilities::operation_timeout`](crate::Capabilities::operation_timeout)) is not
    /// shorter than `renew_deadline`.
    ///
    /// # Panics
    /// When called outside a Tokio runtime.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use leasehold::{Elector, ElectorConfig, Error, LeaseKey, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> leasehold::Result<()> {
    /// let config = ElectorConfig::new(LeaseKey::new("my-controller")?, leasehold::default_identity());
    /// let elector = Elector::spawn(Arc::new(MemoryStore::new()), config)?; // client-go's timings
    /// elector.shutdown().await?;
    ///
    /// // A configuration that cannot work is refused with what to fix.
    /// let bad = ElectorConfig::new(LeaseKey::new("my-controller")?, "a")
    ///     .with_timings(std::time::Duration::from_secs(5), std::time::Duration::from_secs(10),
    ///                   std::time::Duration::from_secs(2));
    /// match Elector::spawn(Arc::new(MemoryStore::new()), bad) {
    ///     Err(Error::InvalidConfig(why)) => assert!(why.contains("lease_duration")),
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn spawn(store: DynLeaseStore, config: ElectorConfig) -> Result<Elector> {
        let caps = store.capabilities();
        if let Some(timeout) = caps.operation_timeout
            && timeout >= config.renew_deadline
        {
            return Err(Error::InvalidConfig(format!(
                "the {} store's operation timeout ({timeout:?}) is not shorter than the elector's \
                 renew_deadline ({:?}): a leader could never learn in time whether a renewal \
                 landed; lower the store's operation timeout or raise renew_deadline",
                store.name(),
                config.renew_deadline
            )));
        }
        let metrics = crate::metrics::Metrics::new(config.key.as_str());
        let machine = Machine::new(config, caps, rand::random(), now())?;
        let shared = Arc::new(Shared {
            config: machine.shared_config(),
            status: StatusCell::default(),
            commands: Commands::default(),
            validity: Mutex::new(None),
            failed: Mutex::new(None),
            task_panicked: Mutex::new(None),
            store_failure: Mutex::new(None),
            tokens_exhausted: Mutex::new(None),
            store_name: store.name(),
            metrics,
            stopped: CancellationToken::new(),
        });
        let span = tracing::info_span!(
            "leasehold_elector",
            key = %shared.config.key,
            identity = %shared.config.identity,
        );
        let driver = Driver {
            machine,
            store,
            shared: shared.clone(),
        };
        let task = tokio::spawn(driver.run().instrument(span));
        Ok(Elector {
            inner: Arc::new(Handle {
                shared,
                task: Mutex::new(Some(task)),
            }),
        })
    }

    /// The configuration this elector runs with.
    pub fn config(&self) -> &ElectorConfig {
        &self.inner.shared.config
    }

    /// The current status and a future that resolves when it is superseded (k0s's
    /// `CurrentStatus()`). Also available through [`StatusSource`].
    pub fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        self.inner.shared.status.current_status()
    }

    /// A `tokio::sync::watch` receiver of the status.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<LeaderStatus> {
        self.inner.shared.status.subscribe()
    }

    /// Whether this elector leads right now: its status is leading and the term is still valid
    /// by the monotonic clock.
    pub fn is_leading(&self) -> bool {
        match self.inner.shared.status.get() {
            LeaderStatus::Leading(l) => l.is_valid(),
            LeaderStatus::NotLeading { .. } | LeaderStatus::Stopped => false,
        }
    }

    /// The identity of the current leader as far as this elector knows: its own while it leads
    /// (by the same clock check as [`is_leading`](Self::is_leading)); `None` once its term's
    /// validity has passed, even before the end of the term is published.
    pub fn leader(&self) -> Option<String> {
        match self.inner.shared.status.get() {
            LeaderStatus::Leading(l) if l.is_valid() => {
                Some(self.inner.shared.config.identity.clone())
            }
            LeaderStatus::Leading(_) | LeaderStatus::Stopped => None,
            LeaderStatus::NotLeading { leader } => leader,
        }
    }

    /// Health check (client-go's `HealthzAdaptor`): fails when the elector believes it leads but
    /// its term's validity has passed — its last confirmed renewal was sent more than
    /// `renew_deadline` ago, so its task is stuck — when its task failed, or when a leader task
    /// of one of its terms panicked (then for the rest of the elector's life: it has stepped
    /// down and shut down, see [`run_leader_tasks`](crate::run_leader_tasks)). The same as
    /// [`check_health_within`](Self::check_health_within) with no tolerance.
    ///
    /// # Errors
    /// [`Error::Unhealthy`], [`Error::ElectorFailed`], or [`Error::LeaderTaskPanicked`].
    pub fn check_health(&self) -> Result<()> {
        self.check_health_within(Duration::ZERO)
    }

    /// Health check with a tolerance, as client-go's `HealthzAdaptor` with a timeout: fails
    /// when the elector believes it leads but its last confirmed renewal was sent more than
    /// `renew_deadline + tolerance` ago, when its task failed, or when a leader task panicked
    /// (as [`check_health`](Self::check_health)). Use a tolerance for a liveness probe that
    /// should not restart a process over a short stall. Any tolerance is accepted; one too large
    /// to add to the renew deadline means "never stale".
    ///
    /// # Errors
    /// [`Error::Unhealthy`], [`Error::ElectorFailed`], or [`Error::LeaderTaskPanicked`].
    pub fn check_health_within(&self, tolerance: Duration) -> Result<()> {
        if let Some(e) = self.inner.shared.failure() {
            return Err(e);
        }
        let cfg = &self.inner.shared.config;
        if let Some(message) = self
            .inner
            .shared
            .task_panicked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Err(Error::LeaderTaskPanicked {
                key: cfg.key.to_string(),
                identity: cfg.identity.clone(),
                message,
            });
        }
        if let LeaderStatus::Leading(l) = self.inner.shared.status.get() {
            let now = Instant::now();
            let stale = match l.valid_until() {
                Some(v) => {
                    // Since the last confirmed renewal was sent: now - (v - renew_deadline).
                    let since = now
                        .saturating_duration_since(v)
                        .saturating_add(cfg.renew_deadline);
                    (since > cfg.renew_deadline.saturating_add(tolerance)).then_some(since)
                }
                None => (!l.is_valid()).then_some(cfg.renew_deadline),
            };
            if let Some(since) = stale {
                return Err(Error::Unhealthy {
                    key: cfg.key.to_string(),
                    identity: cfg.identity.clone(),
                    since,
                    renew_deadline: cfg.renew_deadline,
                });
            }
        }
        Ok(())
    }

    /// Whether the store answers: fails when the elector's last store operation (a read, a
    /// write or opening the watch) failed, with how many failed in a row, for how long, and the
    /// last error. A store that is down, unreachable or rejecting the credentials shows here, not
    /// only in the logs; a follower that cannot reach its store otherwise just sees no leader.
    /// Conflicts and other ordinary compare-and-swap outcomes are answers, not failures.
    ///
    /// A watching follower sends no requests in steady state, so a store that fails while it
    /// is idle shows once the watch breaks and cannot be reopened.
    ///
    /// # Errors
    /// [`Error::StoreFailing`]; [`Error::TokenExhausted`] while no fencing token above the last
    /// one can be issued for the key (the elector does not lead; see the module docs);
    /// [`Error::ElectorFailed`] when the elector's task failed.
    pub fn store_health(&self) -> Result<()> {
        let shared = &self.inner.shared;
        if let Some(e) = shared.failure() {
            return Err(e);
        }
        if let Some(last) = *shared
            .tokens_exhausted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            return Err(Error::TokenExhausted {
                key: shared.config.key.to_string(),
                last,
            });
        }
        let cur = shared
            .store_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match cur.as_ref() {
            None => Ok(()),
            Some(f) => Err(Error::StoreFailing {
                key: shared.config.key.to_string(),
                store: shared.store_name,
                failures: f.failures,
                since: f.first.elapsed(),
                last_error: f.last_error.clone(),
            }),
        }
    }

    /// Releases the lease if held (in order: status, then leader tasks drain while the lease is
    /// still renewed, then the release write) and does not campaign for `duration` (a later
    /// yield replaces the duration of an earlier one). Returns once the lease is released (or
    /// was not held). Any duration is accepted; one too large to represent means "until
    /// shutdown".
    ///
    /// **Called from inside a leader task of this elector's own term** (the task future that
    /// [`run_leader_tasks`](crate::run_leader_tasks) runs, or a k0s lease callback), it cannot
    /// wait for the release — the release waits for that task to return — so it returns as soon
    /// as the step-down has begun: the status no longer says `Leading` for that term, and the
    /// task's context is cancelled (cause [`StopCause::SteppedDown`](crate::StopCause::SteppedDown)).
    /// The lease is released once the task (and every other guard of the term) has returned, so
    /// the task should return soon after. A task it spawned with `tokio::spawn` is not "inside";
    /// there the call waits for the release as usual.
    ///
    /// # Errors
    /// [`Error::Shutdown`] when the elector has shut down; [`Error::ElectorFailed`] when its task
    /// failed.
    ///
    /// # Cancel safety
    /// Cancel safe: once the request reached the elector, the yield goes ahead regardless.
    pub async fn yield_for(&self, duration: Duration) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        let gone = || {
            self.inner
                .shared
                .failure()
                .unwrap_or_else(|| Error::Shutdown {
                    key: self.inner.shared.config.key.to_string(),
                })
        };
        let own = self.callers_own_term();
        self.inner
            .shared
            .commands
            .send(Command::Yield(duration, tx))
            .map_err(|_| gone())?;
        match own {
            None => rx.await.map_err(|_| gone()),
            Some(cell) => {
                tokio::select! {
                    r = rx => r.map_err(|_| gone()),
                    () = self.stepped_down_from(&cell) => match self.inner.shared.failure() {
                        Some(e) => Err(e),
                        None => Ok(()),
                    },
                }
            }
        }
    }

    /// The validity cell of this elector's current (or draining) term when the caller runs
    /// inside a leader task (or a k0s lease callback) of that term.
    fn callers_own_term(&self) -> Option<Arc<Mutex<Validity>>> {
        let caller = crate::tasks::caller_term()?;
        let current = self
            .inner
            .shared
            .validity
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        (std::ptr::eq(caller.as_ptr(), Arc::as_ptr(&current))).then_some(current)
    }

    /// Resolves once the status no longer says `Leading` for the term with validity `cell`.
    async fn stepped_down_from(&self, cell: &Arc<Mutex<Validity>>) {
        loop {
            let (status, changed) = self.current_status();
            match &status {
                LeaderStatus::Leading(l) if l.has_validity_cell(cell) => {}
                _ => return,
            }
            drop(status);
            changed.await;
        }
    }

    /// Shuts the elector down in order (see the [module docs](crate::elector)) and waits until it has
    /// released the lease and stopped. Concurrent and repeated calls all wait for the same end.
    ///
    /// **Called from inside a leader task of this elector's own term** (see
    /// [`yield_for`](Self::yield_for)), it cannot wait for the release, which waits for that
    /// task: it returns once the step-down has begun (the status no longer says `Leading` for
    /// that term); the release and the stop follow once the task has returned. Await
    /// [`stopped`](Self::stopped) elsewhere, or call `shutdown` again from outside the task, to
    /// wait for the end.
    ///
    /// # Errors
    /// [`Error::ElectorFailed`] when the elector's task failed (it panicked): its term, if any,
    /// was revoked, and the lease was not released.
    ///
    /// # Cancel safety
    /// Cancel safe: the shutdown goes ahead in the background if this future is dropped.
    pub async fn shutdown(&self) -> Result<()> {
        self.inner.shared.commands.request_shutdown();
        if let Some(cell) = self.callers_own_term() {
            self.stepped_down_from(&cell).await;
            return match self.inner.shared.failure() {
                Some(e) => Err(e),
                None => Ok(()),
            };
        }
        let task = self
            .inner
            .task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        match task {
            Some(task) => {
                if let Err(e) = task.await {
                    warn!(error = %e, "elector task ended abnormally");
                }
            }
            // Another caller is waiting for the task; wait for the same end.
            None => self.inner.shared.stopped.cancelled().await,
        }
        match self.inner.shared.failure() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A future that resolves once the elector has stopped: after a shutdown was requested and
    /// the lease was released (or left to expire), or after its task failed.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn stopped(&self) {
        self.inner.shared.stopped.cancelled().await;
    }
}

impl StatusSource for Elector {
    fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        self.inner.shared.status.current_status()
    }
}
