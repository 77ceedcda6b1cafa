//! The generic [`Elector`]: all the timing of leader election, over any [`LeaseStore`](crate::LeaseStore).
//!
//! Every decision is made by the sans-IO state machine in [`machine`]; [`Elector`] is a thin
//! tokio driver that turns its outputs into store calls, a watch and timers, and publishes its
//! status. The deterministic simulator in the test suite drives the same machine through seeded
//! fault schedules and checks the guarantees below on a virtual clock.
//!
//! # Guarantees
//!
//! Under the assumptions listed next, and checked by the simulator (`tests/simulator.rs`) and the
//! named regression tests:
//!
//! 1. **At most one valid term at any instant.** A term is *valid* from the moment its elector
//!    publishes [`LeaderStatus::Leading`] until the earlier of its step-down and
//!    [`Leadership::valid_until`]. Validity terms of different electors never overlap.
//! 2. **Fencing tokens strictly increase from term to term** on a key, also across deletion or
//!    loss of the record where the store has a monotonic source (see
//!    [`LeaseStore::acquire`](crate::LeaseStore::acquire),
//!    [`LeaseStore::fencing_seed`](crate::LeaseStore::fencing_seed) and the README's store
//!    table). On a store that assigns tokens at commit
//!    ([`Capabilities::commit_tokens`](crate::Capabilities::commit_tokens)) no token is issued
//!    twice, not even to a void term. No term starts with a token that is not above the last
//!    one seen: when none can be represented, the elector does not lead and reports
//!    [`Error::TokenExhausted`] through [`Elector::store_health`].
//! 3. **Prompt takeover.** Once faults stop, some elector leads within
//!    `lease_duration + renew_deadline + 2.2 × retry_period` (scaled by the clock-rate bound, plus
//!    a few store round trips), polling followers included.
//!
//! A record lost while its term is valid (deleted, overwritten with data that is not a record,
//! released or replaced by an older term's copy by another client) voids guarantee 1 for that
//! term: an elector that missed it cannot know the term existed. With fencing seeds (no commit
//! tokens) it voids guarantee 2 for that term too: a later term can repeat its token when a
//! create was delayed across the loss.
//!
//! Another writer that edits the record's fields without losing it (holder, times, token, a
//! restored copy of the same term's record) voids nothing. One that **shortens the lease
//! duration** can let followers take over before the leader could know: guarantee 1 does not
//! hold from that write until the leader observes it; from then on the term is valid at most
//! `renew_deadline / lease_duration` of the written duration after its last confirmed renewal
//! ([`machine::Output::Shortened`]), and the next renewal writes the elector's own duration.
//!
//! # Assumptions
//!
//! - **Bounded clock rate drift.** Each elector measures time with its own monotonic clock; their
//!   rates may differ by a factor ρ with `(1 + ρ) × renew_deadline < (1 − ρ) × lease_duration`
//!   (about ±20 % with the defaults). Wall clocks and record timestamps do not matter.
//! - **No suspend of `CLOCK_MONOTONIC`.** A pause of the process (SIGSTOP, a GC or VM stall) is
//!   fine: the monotonic clock keeps running, and [`Leadership::ensure_leading`] fails once the
//!   term's validity passed. A system suspend that stops the monotonic clock is not.
//! - **Fencing for side effects.** Task code that acts on a term calls
//!   [`Leadership::ensure_leading`] (or [`LeaderContext::ensure_leading`](crate::LeaderContext::ensure_leading))
//!   right before the side effect and passes the fencing token to systems that can check it. A
//!   check cannot stop a process that pauses right after it; the token can.
//! - **The store keeps its contract** ([`LeaseStore`](crate::LeaseStore)): compare-and-swap is
//!   atomic, a watch never delivers an older state after a newer one, times are kept to the
//!   microsecond. Replies may be slow, lost, reported as errors after the write landed, or
//!   replayed; watches may fail or end at any time.
//!
//! # Behaviour
//!
//! - **Skew-safe expiry.** A follower takes over when the record stayed unchanged for its lease
//!   duration, measured on its own clock from when it *first observed* that version. Re-reading
//!   an unchanged version (polling, a re-established watch) never postpones expiry.
//! - **A missing record is not proof of a vacant lease.** It is created only after the key was
//!   seen absent for a whole lease duration (unless [`ElectorConfig::trust_absence`]), so a term
//!   that was valid when its record was deleted or lost has ended first. This costs one lease
//!   duration on the first start of a brand-new key; a released lease (an empty holder) is taken
//!   at once.
//! - **Hard term deadline.** The leader's term is valid until `renew_deadline` after it *sent* its
//!   last confirmed renewal; a timer steps it down then, whatever I/O is in flight. Every store
//!   call is bounded by the time left.
//! - **Watch-driven followers.** On release a follower acquires at once; on a silent holder it
//!   tries at the exact expiry instant; in steady state a watching follower sends no requests.
//!   Without a watch (unsupported, or failing: re-opened with jittered backoff) followers poll
//!   every `retry_period`, jittered by client-go's factor 1.2.
//! - **Own writes recognised.** After a write that failed or timed out, the elector reads back
//!   and recognises a write of its own by holder and acquire time, and by fencing token where it
//!   chose the token (and which renewal landed by its renew time; times are written at
//!   microsecond precision, which every store keeps). A change by another writer that keeps the
//!   term (a label edit on a kube Lease, a restored older copy of its record) is adopted; a watch
//!   that delivers a version this term already replaced is ignored. Every renewal writes the
//!   elector's own lease duration. A record this elector instance wrote in an earlier term (its
//!   renewal landed after it stepped down, say after a store pause) is taken back at once, as a
//!   new term.
//! - **Ordered release.** [`Elector::shutdown`] and [`Elector::yield_for`] end the term (status
//!   changes, tasks are cancelled with [`StopCause::SteppedDown`](crate::StopCause::SteppedDown)), **keep renewing** while every
//!   [`Leadership`] guard is dropped (up to [`ElectorConfig::drain_timeout`]), then revoke the term
//!   and write the release (empty holder, lease duration 1 s, as client-go). An in-flight renewal
//!   is awaited, not abandoned, so the release goes to the right version. If tasks outlive the
//!   drain timeout, the term is revoked and the lease is **not** released: it expires, and the next
//!   leader starts only after that.
//! - **Fencing token.** A store with commit tokens assigns each acquisition's token at commit
//!   ([`LeaseStore::acquire`](crate::LeaseStore::acquire)), so a write that lands late still gets
//!   a token above every earlier one. Otherwise each acquisition writes `transitions + 1`, and a
//!   fresh record starts at the store's fencing seed (or one above the highest token this
//!   elector has seen), checked against a second seed after the create.
//! - **Health.** [`Elector::check_health`] fails when the elector believes it leads past its
//!   term's validity (its task is stuck), when its task failed, or once a leader task panicked.
//! - **Leader task panics.** A task run by [`run_leader_tasks`](crate::run_leader_tasks) that
//!   panics ends the term: the elector steps down, stops campaigning and shuts down in order
//!   (the lease is released once the panicked task's guard is gone), `check_health` reports
//!   [`Error::LeaderTaskPanicked`] for the rest of the elector's life, and the panic is resumed
//!   to `run_leader_tasks`' caller. No zombie leader keeps renewing with no leader work running.
//! - **Corrupt records** are treated as held by an unknown holder and replaced only after they
//!   stayed unchanged for a whole lease duration. Absurd lease durations in records are treated as
//!   [`machine::MAX_RECORD_LEASE_DURATION`].
//!
//! Every state change is logged with `tracing`, in a span carrying the lease key and identity.

pub mod machine;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, warn};

use crate::error::{Error, Result};
use crate::status::{
    LeaderStatus, Leadership, StatusCell, StatusChanged, StatusSource, Validity, set_validity,
};
use crate::store::{DynLeaseStore, LeaseKey, WatchStream};
use machine::{Machine, Now, Op, Output, Reply, RequestId, WatchId};

pub use machine::RELEASE_LEASE_DURATION;

/// The longest identity accepted, in bytes.
pub const MAX_IDENTITY_LEN: usize = 1024;

/// The longest accepted value of each duration in [`ElectorConfig`] (one day).
pub const MAX_TIMING: Duration = Duration::from_secs(24 * 60 * 60);

/// A unique default identity: the host name plus a random suffix, so two elector instances on
/// one host (or a restarted one) never share an identity (as k0s's invocation id does).
pub fn default_identity() -> String {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let host = if host.is_empty() {
        "leasehold".to_owned()
    } else {
        host
    };
    format!("{host}-{:016x}", rand::random::<u64>())
}

/// Configuration of an [`Elector`].
///
/// Defaults follow client-go: lease 15 s, renew deadline 10 s, retry period 2 s; drain timeout
/// 30 s. k0s uses 60 s / 15 s / 5 s: `ElectorConfig::new(key, id).with_timings(60s, 15s, 5s)`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ElectorConfig {
    /// The lease key.
    pub key: LeaseKey,
    /// This candidate's identity (non-empty, at most [`MAX_IDENTITY_LEN`] bytes, no control
    /// characters).
    pub identity: String,
    /// How long followers wait after observing the last change before they consider the lease
    /// expired.
    pub lease_duration: Duration,
    /// How long the leader's term stays valid after it sent its last confirmed renewal.
    pub renew_deadline: Duration,
    /// How often the leader renews (and a polling follower polls).
    pub retry_period: Duration,
    /// How long a graceful step-down (shutdown, yield) keeps renewing while leader tasks finish,
    /// before it gives up on them: the term is then revoked and the lease left to expire.
    pub drain_timeout: Duration,
    /// Whether a missing record means the key was never held, so it may be created at once
    /// (client-go's behaviour). Default `false`: a missing record is treated like one held by an
    /// unknown holder and created only after the key was seen absent for a whole lease duration.
    /// The store cannot tell "never created" from "deleted" or "lost" (`kubectl delete lease`,
    /// a Redis restart without persistence), and a term that was valid when the record vanished
    /// stays valid up to `renew_deadline`. Waiting costs one lease duration on the first start
    /// of a brand-new key. Set it only where a key has a single campaigner, or where that overlap
    /// is acceptable.
    pub trust_absence: bool,
}

// === impl ElectorConfig ===

impl ElectorConfig {
    /// A configuration with client-go's default timings and a 30 s drain timeout.
    pub fn new(key: LeaseKey, identity: impl Into<String>) -> Self {
        ElectorConfig {
            key,
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            drain_timeout: Duration::from_secs(30),
            trust_absence: false,
        }
    }

    /// Sets the three timings.
    pub fn with_timings(
        mut self,
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Self {
        self.lease_duration = lease_duration;
        self.renew_deadline = renew_deadline;
        self.retry_period = retry_period;
        self
    }

    /// Sets [`ElectorConfig::trust_absence`].
    pub fn with_trust_absence(mut self, trust_absence: bool) -> Self {
        self.trust_absence = trust_absence;
        self
    }

    /// Sets the drain timeout (see [`ElectorConfig::drain_timeout`]).
    pub fn with_drain_timeout(mut self, drain_timeout: Duration) -> Self {
        self.drain_timeout = drain_timeout;
        self
    }

    /// Checks `lease_duration > renew_deadline > 1.2 × retry_period`, `retry_period > 0`, a
    /// non-zero drain timeout, every duration at most [`MAX_TIMING`], and the identity rules.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the offending values.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.identity.is_empty() {
            return bad("identity must not be empty (use leasehold::default_identity())".into());
        }
        if self.identity.len() > MAX_IDENTITY_LEN {
            return bad(format!(
                "identity is {} bytes long; at most {MAX_IDENTITY_LEN} are allowed",
                self.identity.len()
            ));
        }
        if self.identity.chars().any(char::is_control) {
            return bad(format!(
                "identity {:?} contains control characters",
                self.identity
            ));
        }
        for (name, d) in [
            ("lease_duration", self.lease_duration),
            ("renew_deadline", self.renew_deadline),
            ("retry_period", self.retry_period),
            ("drain_timeout", self.drain_timeout),
        ] {
            if d > MAX_TIMING {
                return bad(format!(
                    "{name} ({d:?}) is longer than the maximum of {MAX_TIMING:?}"
                ));
            }
        }
        if self.retry_period.is_zero() {
            return bad("retry_period must be greater than zero".into());
        }
        if self.drain_timeout.is_zero() {
            return bad("drain_timeout must be greater than zero".into());
        }
        if self.lease_duration <= self.renew_deadline {
            return bad(format!(
                "lease_duration ({:?}) must be greater than renew_deadline ({:?})",
                self.lease_duration, self.renew_deadline
            ));
        }
        if self.renew_deadline.as_secs_f64() <= 1.2 * self.retry_period.as_secs_f64() {
            return bad(format!(
                "renew_deadline ({:?}) must be greater than 1.2 × retry_period ({:?} × 1.2 = {:?})",
                self.renew_deadline,
                self.retry_period,
                self.retry_period.mul_f64(1.2)
            ));
        }
        Ok(())
    }
}

enum Command {
    Yield(Duration, oneshot::Sender<()>),
}

/// Requests to the background task: a queue, a shutdown flag and a waker (lighter than a
/// channel, and polled without a stored future).
#[derive(Default)]
struct Commands {
    queue: Mutex<Vec<Command>>,
    waker: futures::task::AtomicWaker,
    shutdown: std::sync::atomic::AtomicBool,
    closed: std::sync::atomic::AtomicBool,
}

impl Commands {
    fn send(&self, c: Command) -> std::result::Result<(), Command> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(c);
        }
        q.push(c);
        drop(q);
        self.waker.wake();
        Ok(())
    }

    fn request_shutdown(&self) {
        self.shutdown
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.waker.wake();
    }

    /// The next command, or whether a shutdown was requested (`Ready(None)`); registers the
    /// waker first, so that nothing sent meanwhile is missed.
    fn poll_recv(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Command>> {
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
    fn close(&self) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        q.clear();
    }
}

struct Shared {
    config: Arc<ElectorConfig>,
    status: StatusCell,
    commands: Commands,
    /// The current (or draining) term's validity, for health checks and for revoking it if the
    /// task fails.
    validity: Mutex<Option<Arc<Mutex<Validity>>>>,
    /// Set when the background task panicked.
    failed: Mutex<Option<String>>,
    /// Set when a leader task of one of its terms panicked (see `run_leader_tasks`).
    task_panicked: Mutex<Option<String>>,
    /// The store's failures in a row, if its last operation failed.
    store_failure: Mutex<Option<StoreFailure>>,
    /// The highest token seen, when no higher one could be issued (sticky until a term starts).
    tokens_exhausted: Mutex<Option<u64>>,
    /// The store's name, for errors.
    store_name: &'static str,
    metrics: crate::metrics::Metrics,
    /// Cancelled once the background task has finished.
    stopped: CancellationToken,
}

/// A run of failed store operations.
struct StoreFailure {
    first: Instant,
    failures: u64,
    last_error: String,
}

/// Whether `e` says the store failed, as opposed to an ordinary outcome of a compare-and-swap
/// (a conflict, an existing or missing key), an unsupported optional operation, or corrupt data
/// (which the machine handles).
fn is_store_failure(e: &Error) -> bool {
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
    fn store_outcome(&self, error: Option<&Error>) {
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
    fn leader_task_panicked(&self, message: String) {
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

    fn failure(&self) -> Option<Error> {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.as_ref().map(|m| Error::ElectorFailed {
            key: self.config.key.to_string(),
            message: m.clone(),
        })
    }
}

/// A leader elector for one lease key. See the [module docs](self) for its semantics.
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
#[derive(Clone)]
pub struct Elector {
    inner: Arc<Handle>,
}

/// What every clone of an [`Elector`] shares; dropping it (the last handle) shuts down.
struct Handle {
    shared: Arc<Shared>,
    task: Mutex<Option<JoinHandle<()>>>,
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

fn now() -> Now {
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

    /// Shuts the elector down in order (see the [module docs](self)) and waits until it has
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

/// Ends an elector, however its task ends (returned, panicked, or dropped with its runtime):
/// revokes any term still valid, publishes the terminal [`LeaderStatus::Stopped`], closes the
/// command queue and wakes every waiter of [`Elector::stopped`].
struct StopGuard(Arc<Shared>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        let shared = &self.0;
        if let Some(v) = shared
            .validity
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            set_validity(&v, Validity::Revoked);
        }
        shared.status.set(LeaderStatus::Stopped);
        shared.metrics.leading(false);
        shared.commands.close();
        shared.stopped.cancel();
    }
}

// ---------------------------------------------------------------------------------------------
// The driver: turns the machine's outputs into I/O and timers, and I/O results back into inputs.

type Pending<T> = Option<BoxFuture<'static, T>>;

struct Driver {
    machine: Machine,
    store: DynLeaseStore,
    shared: Arc<Shared>,
}

async fn call(store: DynLeaseStore, key: LeaseKey, op: Op) -> Result<Reply> {
    match op {
        Op::Get => store.get(&key).await.map(Reply::Record),
        Op::Create(r) => store.create(&key, &r).await.map(Reply::Written),
        Op::Update { record, expected } => store
            .update(&key, &record, &expected)
            .await
            .map(Reply::Written),
        Op::FencingSeed => store.fencing_seed(&key).await.map(Reply::Seed),
        Op::Acquire { record, expected } => store
            .acquire(&key, &record, expected.as_ref())
            .await
            .map(Reply::Acquired),
    }
}

fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Get => "get",
        Op::Create(_) => "create",
        Op::Update { .. } => "update",
        Op::FencingSeed => "fencing_seed",
        Op::Acquire { .. } => "acquire",
    }
}

impl Driver {
    /// The task: `drive`, plus failure handling. Built so that the task's future holds the driver
    /// once (inside `drive`'s future), not twice.
    fn run(self) -> impl Future<Output = ()> + Send + 'static {
        let shared = self.shared.clone();
        // Marks the elector stopped when this task ends, also if it panics or is aborted (its
        // runtime shut down).
        let stopped = StopGuard(shared.clone());
        std::panic::AssertUnwindSafe(self.drive())
            .catch_unwind()
            .map(move |result| {
                if let Err(panic) = result {
                    let message = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic with a non-string payload".to_owned());
                    tracing::error!(message, "the elector's task panicked; it has stopped");
                    *shared.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
                    if let Some(v) = shared
                        .validity
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .take()
                    {
                        set_validity(&v, Validity::Revoked);
                    }
                }
                drop(stopped);
            })
    }

    /// Carries out the machine's outputs.
    fn apply(&mut self, io: &mut Io) {
        while let Some(out) = self.machine.poll_output() {
            match out {
                Output::Request(req) => {
                    let store = self.store.clone();
                    let key = self.shared.config.key.clone();
                    let operation = op_name(&req.op);
                    let deadline = Instant::from_std(req.deadline);
                    let after = deadline.saturating_duration_since(Instant::now());
                    let id = req.id;
                    let op = req.op;
                    let store_name = self.shared.store_name;
                    io.request_sent = Some(Instant::now());
                    io.request = Some(Box::pin(async move {
                        let r = tokio::time::timeout_at(deadline, call(store, key, op))
                            .await
                            .unwrap_or(Err(Error::Timeout {
                                store: store_name,
                                operation,
                                after,
                            }));
                        (id, r)
                    }));
                }
                Output::OpenWatch {
                    id,
                    after,
                    deadline,
                } => {
                    io.watch = None;
                    let store = self.store.clone();
                    let key = self.shared.config.key.clone();
                    let deadline = Instant::from_std(deadline);
                    let limit = deadline.saturating_duration_since(Instant::now());
                    let store_name = self.shared.store_name;
                    io.opening = Some(Box::pin(async move {
                        let r =
                            tokio::time::timeout_at(deadline, store.watch(&key, after.as_ref()))
                                .await
                                .unwrap_or(Err(Error::Timeout {
                                    store: store_name,
                                    operation: "watch",
                                    after: limit,
                                }));
                        (id, r)
                    }));
                }
                Output::CloseWatch => {
                    io.watch = None;
                    io.opening = None;
                }
                Output::Leading {
                    fencing_token,
                    valid_until,
                } => {
                    let (l, rx) = Leadership::new_term(
                        fencing_token,
                        Validity::Until(Instant::from_std(valid_until)),
                    );
                    *self
                        .shared
                        .validity
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = Some(l.validity_cell());
                    let shared = Arc::downgrade(&self.shared);
                    l.set_panic_hook(Box::new(move |message| {
                        if let Some(shared) = shared.upgrade() {
                            shared.leader_task_panicked(message);
                        }
                    }));
                    self.shared.status.set(LeaderStatus::Leading(l.clone()));
                    *self
                        .shared
                        .tokens_exhausted
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = None;
                    self.shared.metrics.leading(true);
                    self.shared
                        .metrics
                        .acquired(io.campaign_since.take().map(|t| t.elapsed()));
                    io.term = Some(l);
                    io.drained = Some(Box::pin(async move {
                        let _ = rx.await;
                    }));
                }
                Output::Renewed { valid_until } => {
                    if let Some(sent) = io.request_sent {
                        self.shared.metrics.renewed(sent.elapsed());
                    }
                    if let Some(v) = &*self
                        .shared
                        .validity
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                    {
                        set_validity(v, Validity::Until(Instant::from_std(valid_until)));
                    }
                }
                Output::Shortened { valid_until } => {
                    if let Some(v) = &*self
                        .shared
                        .validity
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                    {
                        set_validity(v, Validity::Until(Instant::from_std(valid_until)));
                    }
                }
                Output::TokensExhausted { last } => {
                    *self
                        .shared
                        .tokens_exhausted
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = Some(last);
                }
                Output::TermEnded { cause } => {
                    self.shared.metrics.leading(false);
                    io.campaign_since = Some(Instant::now());
                    if let Some(l) = io.term.take() {
                        l.mark_ended(cause);
                    }
                    self.shared
                        .status
                        .set(LeaderStatus::NotLeading { leader: None });
                }
                Output::Revoked => {
                    if let Some(v) = self
                        .shared
                        .validity
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .take()
                    {
                        set_validity(&v, Validity::Revoked);
                    }
                }
                Output::Following { leader } => {
                    self.shared.status.set(LeaderStatus::NotLeading { leader });
                }
                Output::YieldDone { id } => {
                    if let Some(tx) = io.yields.remove(&id) {
                        let _ = tx.send(());
                    }
                }
                Output::Stopped => {}
            }
        }
    }

    /// Feeds one event back into the machine.
    fn handle(&mut self, io: &mut Io, ev: Ev) {
        match ev {
            Ev::Timer => {
                io.armed = None;
                self.machine.handle_timeout(now());
            }
            Ev::Shutdown => {
                io.shutdown_sent = true;
                self.machine
                    .handle_command(now(), machine::Command::Shutdown);
            }
            Ev::Command(Command::Yield(duration, tx)) => {
                io.next_yield += 1;
                io.yields.insert(io.next_yield, tx);
                self.machine.handle_command(
                    now(),
                    machine::Command::Yield {
                        id: io.next_yield,
                        duration,
                    },
                );
            }
            Ev::Reply(id, r) => {
                io.request = None;
                self.shared.store_outcome(r.as_ref().err());
                self.machine.handle_reply(now(), id, r);
            }
            Ev::Opened(id, r) => {
                io.opening = None;
                self.shared.store_outcome(r.as_ref().err());
                match r {
                    Ok(s) => {
                        io.watch = Some((id, s));
                        self.machine.handle_watch_opened(now(), id, Ok(()));
                    }
                    Err(e) => self.machine.handle_watch_opened(now(), id, Err(e)),
                }
            }
            Ev::Item(id, item) => {
                if !matches!(item, Some(Ok(_))) {
                    io.watch = None;
                }
                self.machine.handle_watch_item(now(), id, item);
            }
            Ev::Drained => {
                io.drained = None;
                self.machine.handle_tasks_drained(now());
            }
        }
    }

    /// The driver loop. (An `async move` block rather than an `async fn`: an `async fn` keeps a
    /// second copy of its by-value arguments in its future, rust-lang/rust#62958.)
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    fn drive(mut self) -> impl Future<Output = ()> + Send + 'static {
        async move {
            let mut io = Io {
                campaign_since: Some(Instant::now()),
                ..Io::default()
            };
            let mut sleep = Box::pin(tokio::time::sleep_until(Instant::now()));
            loop {
                self.apply(&mut io);
                if self.machine.is_stopped() {
                    return;
                }
                let wake = self.machine.poll_timeout().map(Instant::from_std);
                if wake != io.armed {
                    if let Some(t) = wake {
                        sleep.as_mut().reset(t);
                    }
                    io.armed = wake;
                }
                // One poll over every source, timers first: no ready input can starve a deadline
                // (the machine also processes due timers on every input). Polling persistent
                // sources keeps the task small (no per-branch futures held across the wait).
                let shared = &self.shared;
                let ev = std::future::poll_fn(|cx| io.poll(cx, shared, sleep.as_mut())).await;
                self.handle(&mut io, ev);
            }
        }
    }
}

/// The driver's I/O in flight.
#[derive(Default)]
struct Io {
    request: Pending<(RequestId, Result<Reply>)>,
    /// When the request in flight was sent.
    request_sent: Option<Instant>,
    /// When campaigning for the next term started (start-up or the end of a term).
    campaign_since: Option<Instant>,
    opening: Pending<(WatchId, Result<WatchStream>)>,
    watch: Option<(WatchId, WatchStream)>,
    term: Option<Leadership>,
    drained: Pending<()>,
    yields: HashMap<u64, oneshot::Sender<()>>,
    next_yield: u64,
    shutdown_sent: bool,
    armed: Option<Instant>,
}

impl Io {
    fn poll(
        &mut self,
        cx: &mut std::task::Context<'_>,
        shared: &Shared,
        sleep: std::pin::Pin<&mut tokio::time::Sleep>,
    ) -> std::task::Poll<Ev> {
        use std::task::Poll;
        if self.armed.is_some() && sleep.poll(cx).is_ready() {
            return Poll::Ready(Ev::Timer);
        }
        if let Poll::Ready(c) = shared.commands.poll_recv(cx) {
            match c {
                Some(c) => return Poll::Ready(Ev::Command(c)),
                None if !self.shutdown_sent => return Poll::Ready(Ev::Shutdown),
                None => {}
            }
        }
        if let Some(f) = self.request.as_mut()
            && let Poll::Ready((id, r)) = f.as_mut().poll(cx)
        {
            return Poll::Ready(Ev::Reply(id, r));
        }
        if let Some(f) = self.opening.as_mut()
            && let Poll::Ready((id, r)) = f.as_mut().poll(cx)
        {
            return Poll::Ready(Ev::Opened(id, r));
        }
        if let Some((id, s)) = self.watch.as_mut()
            && let Poll::Ready(item) = s.poll_next_unpin(cx)
        {
            return Poll::Ready(Ev::Item(*id, item));
        }
        if let Some(f) = self.drained.as_mut()
            && f.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Ev::Drained);
        }
        Poll::Pending
    }
}

/// What woke the driver.
enum Ev {
    Timer,
    Shutdown,
    Command(Command),
    Reply(RequestId, Result<Reply>),
    Opened(WatchId, Result<WatchStream>),
    Item(WatchId, Option<Result<crate::WatchEvent>>),
    Drained,
}
