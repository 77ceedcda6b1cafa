//! The generic [`Elector`]: all the timing of leader election, over any [`LeaseStore`](crate::LeaseStore).
//!
//! # Semantics
//!
//! - **Skew-safe expiry.** A follower judges expiry by its own monotonic clock: the instant it
//!   *observed* the record last change, plus the record's lease duration. The times written in the
//!   record are informational only, so wall-clock skew between machines does not matter.
//! - **Leader safety margin.** The leader measures its own validity from the instant it *sent*
//!   its last successful acquire or renew, and steps down (status becomes not leading, leader
//!   tasks are cancelled) when it has not renewed successfully within `renew_deadline` of that
//!   instant. Every follower observed that write *after* it was sent and waits a whole
//!   `lease_duration > renew_deadline` from then, so the leader has stepped down before any
//!   follower can consider the lease expired.
//! - **Watch-driven followers.** Followers watch the key. When the holder releases, they try to
//!   acquire at once (the compare-and-swap settles contention; there is no sleep on this path).
//!   When the holder goes silent, a follower tries at the exact expiry instant, not on a polling
//!   grid. In steady state a watching follower sends no requests at all. On a store that cannot
//!   watch, followers poll every `retry_period`, jittered by a factor of 1.2 (a wait between
//!   `retry_period` and `2.2 × retry_period`, as client-go's `wait.Jitter`).
//! - **Renewal.** The leader renews every `retry_period`. Transient errors are retried with
//!   backoff until the renew deadline; an ambiguous failure (a timeout whose write did land) is
//!   recognised by reading the record back. A record showing another holder (seen by the watch
//!   or by a failed compare-and-swap) means the lease is lost at once.
//! - **Ordered release on shutdown.** [`Elector::shutdown`] first ends leadership (status changes,
//!   leader tasks are cancelled with cause [`StopCause::SteppedDown`]), then waits until every
//!   [`Leadership`] guard handed out with the leading status is dropped (bounded by the leader's
//!   remaining validity), and only then writes the release: an empty holder with a lease duration
//!   of 1 s, as client-go does. If the guards outlive that bound, the lease is not released but
//!   left to expire, so the next leader still never overlaps the old one's work.
//! - **Yield.** [`Elector::yield_for`] releases the lease the same ordered way and does not
//!   campaign for the given time (k0s's `YieldLease`).
//! - **Fencing token.** Each acquisition writes `transitions + 1` (a new record starts at 0), also
//!   when the same identity re-acquires from a new elector instance; leader tasks get it through
//!   [`Leadership::fencing_token`]. A record held under this elector's identity that this elector
//!   instance did not write is treated like any other holder's: it is taken over only after it
//!   expired.
//! - **Leader identity.** Followers publish who leads in [`LeaderStatus::NotLeading`].
//! - **Health.** [`Elector::check_health`] fails when the elector believes it leads but its last
//!   successful renewal was sent more than `renew_deadline` ago (client-go's `HealthzAdaptor`).
//! - **Corrupt records.** Data under the key that is not a lease record is treated as held by an
//!   unknown holder; it is replaced (with a warning) only after it stayed unchanged for a whole
//!   lease duration.
//!
//! Every state change is logged with `tracing`, in a span carrying the lease key and identity.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use crate::error::{Error, Result};
use crate::status::{LeaderStatus, Leadership, StatusCell, StatusChanged, StatusSource, StopCause};
use crate::store::{
    DynLeaseStore, LeaseKey, LeaseRecord, Version, Versioned, WatchEvent, WatchStream,
};

/// The longest identity accepted, in bytes.
pub const MAX_IDENTITY_LEN: usize = 1024;

/// The lease duration written on release (client-go writes 1 s).
pub const RELEASE_LEASE_DURATION: Duration = Duration::from_secs(1);

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
/// Defaults follow client-go: lease 15 s, renew deadline 10 s, retry period 2 s. k0s uses
/// 60 s / 15 s / 5 s: `ElectorConfig::new(key, id).with_timings(60s, 15s, 5s)`.
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
    /// How long the leader keeps leading without a successful renewal.
    pub renew_deadline: Duration,
    /// How often the leader renews (and a polling follower polls).
    pub retry_period: Duration,
}

// === impl ElectorConfig ===

impl ElectorConfig {
    /// A configuration with client-go's default timings.
    pub fn new(key: LeaseKey, identity: impl Into<String>) -> Self {
        ElectorConfig {
            key,
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
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

    /// Checks `lease_duration > renew_deadline > 1.2 × retry_period`, `retry_period > 0`, and the
    /// identity rules.
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
        if self.retry_period.is_zero() {
            return bad("retry_period must be greater than zero".into());
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

/// Requests to the background task (a queue plus a wake-up: lighter than a channel).
#[derive(Default)]
struct Commands {
    queue: Mutex<Vec<Command>>,
    wake: tokio::sync::Notify,
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
        self.wake.notify_one();
        Ok(())
    }

    fn try_recv(&self) -> Option<Command> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.is_empty() {
            None
        } else {
            Some(q.remove(0))
        }
    }

    async fn recv(&self) -> Option<Command> {
        loop {
            if let Some(c) = self.try_recv() {
                return Some(c);
            }
            if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
                return None;
            }
            self.wake.notified().await;
        }
    }

    fn close(&self) {
        let _q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

struct Shared {
    config: ElectorConfig,
    status: StatusCell,
    /// When leading: the instant the last successful acquire/renew was sent.
    last_renew: Mutex<Option<Instant>>,
    commands: Commands,
    /// Cancelled once the background task has finished.
    stopped: CancellationToken,
}

/// A leader elector for one lease key. See the [module docs](self) for its semantics.
///
/// Created by [`Elector::spawn`], which starts a background task on the current Tokio runtime.
/// Dropping the `Elector` shuts it down in the background (in order, as [`Elector::shutdown`]
/// does); call `shutdown` to wait for that.
pub struct Elector {
    shared: Arc<Shared>,
    cancel: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for Elector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Elector")
            .field("key", &self.shared.config.key)
            .field("identity", &self.shared.config.identity)
            .field("status", &self.shared.status.get())
            .finish_non_exhaustive()
    }
}

// === impl Elector ===

impl Elector {
    /// Validates `config` and starts campaigning on `store` in a background task.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the configuration is invalid.
    ///
    /// # Panics
    /// When called outside a Tokio runtime.
    pub fn spawn(store: DynLeaseStore, config: ElectorConfig) -> Result<Elector> {
        config.validate()?;
        let shared = Arc::new(Shared {
            config,
            status: StatusCell::default(),
            last_renew: Mutex::new(None),
            commands: Commands::default(),
            stopped: CancellationToken::new(),
        });
        let cancel = CancellationToken::new();
        let span = tracing::info_span!(
            "leasehold_elector",
            key = %shared.config.key,
            identity = %shared.config.identity,
        );
        let runner = Runner {
            shared: shared.clone(),
            store,
            cancel: cancel.clone(),
            observed: None,
            watch: None,
            watch_retry_at: None,
            yield_until: None,
            awaiting_watch: false,
        };
        let task = tokio::spawn(runner.run().instrument(span));
        Ok(Elector {
            shared,
            cancel,
            task: Mutex::new(Some(task)),
        })
    }

    /// The configuration this elector runs with.
    pub fn config(&self) -> &ElectorConfig {
        &self.shared.config
    }

    /// The current status and a future that resolves when it is superseded (k0s's
    /// `CurrentStatus()`). Also available through [`StatusSource`].
    pub fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        self.shared.status.current_status()
    }

    /// A `tokio::sync::watch` receiver of the status.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<LeaderStatus> {
        self.shared.status.subscribe()
    }

    /// Whether this elector leads right now.
    pub fn is_leading(&self) -> bool {
        self.shared.status.get().is_leading()
    }

    /// The identity of the current leader as far as this elector knows (its own when leading).
    pub fn leader(&self) -> Option<String> {
        match self.shared.status.get() {
            LeaderStatus::Leading(_) => Some(self.shared.config.identity.clone()),
            LeaderStatus::NotLeading { leader } => leader,
        }
    }

    /// Health check: fails when the elector believes it leads but its last successful renewal
    /// was sent more than `renew_deadline` ago (the elector's task is stuck).
    ///
    /// # Errors
    /// [`Error::Unhealthy`].
    pub fn check_health(&self) -> Result<()> {
        let last = *self
            .shared
            .last_renew
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let cfg = &self.shared.config;
        match last {
            Some(t) if self.is_leading() && t.elapsed() > cfg.renew_deadline => {
                Err(Error::Unhealthy {
                    key: cfg.key.to_string(),
                    identity: cfg.identity.clone(),
                    since: t.elapsed(),
                    renew_deadline: cfg.renew_deadline,
                })
            }
            _ => Ok(()),
        }
    }

    /// Releases the lease if held (in order: status, then leader tasks, then the release write)
    /// and does not campaign for `duration`. Returns once the lease is released (or was not
    /// held).
    ///
    /// # Errors
    /// [`Error::Shutdown`] when the elector has shut down.
    ///
    /// # Cancel safety
    /// Cancel safe: once the request reached the elector, the yield goes ahead regardless.
    pub async fn yield_for(&self, duration: Duration) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        let shut = || Error::Shutdown {
            key: self.shared.config.key.to_string(),
        };
        self.shared
            .commands
            .send(Command::Yield(duration, tx))
            .map_err(|_| shut())?;
        rx.await.map_err(|_| shut())
    }

    /// Shuts the elector down in order (see the [module docs](self)) and waits until it has
    /// released the lease and stopped. Concurrent and repeated calls all wait for the same end.
    ///
    /// # Cancel safety
    /// Cancel safe: the shutdown goes ahead in the background if this future is dropped.
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        match task {
            Some(task) => {
                if let Err(e) = task.await {
                    warn!(error = %e, "elector task ended abnormally");
                }
            }
            // Another caller is waiting for the task; wait for the same end.
            None => self.shared.stopped.cancelled().await,
        }
    }

    /// A future that resolves once the elector has stopped: after a shutdown was requested and
    /// the lease was released (or left to expire).
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn stopped(&self) {
        self.shared.stopped.cancelled().await;
    }
}

impl Drop for Elector {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl StatusSource for Elector {
    fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        self.shared.status.current_status()
    }
}

// ---------------------------------------------------------------------------------------------
// The background task.

#[derive(Clone, Debug)]
enum Seen {
    Absent,
    Record(Versioned),
    Corrupt { version: Option<Version> },
}

#[derive(Clone, Debug)]
struct Observed {
    seen: Seen,
    /// When this state was first observed (monotonic).
    at: Instant,
}

struct TermState {
    leadership: Leadership,
    done: oneshot::Receiver<()>,
    record: LeaseRecord,
    version: Version,
    /// When the last successful write of this term was sent.
    sent: Instant,
}

enum TermEnd {
    Lost,
    Shutdown,
    Yield(Duration, oneshot::Sender<()>),
}

struct Runner {
    shared: Arc<Shared>,
    store: DynLeaseStore,
    cancel: CancellationToken,
    observed: Option<Observed>,
    watch: Option<WatchStream>,
    watch_retry_at: Option<Instant>,
    yield_until: Option<Instant>,
    /// A compare-and-swap lost against a change the watch has not delivered yet.
    awaiting_watch: bool,
}

fn jittered(d: Duration, factor: f64) -> Duration {
    d + d.mul_f64(factor * rand::random::<f64>())
}

impl Runner {
    fn cfg(&self) -> &ElectorConfig {
        &self.shared.config
    }

    fn set_last_renew(&self, t: Option<Instant>) {
        *self
            .shared
            .last_renew
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = t;
    }

    async fn run(mut self) {
        // Marks the elector stopped when this task ends, also if it panics or is aborted.
        let _stopped = self.shared.stopped.clone().drop_guard();
        info!("elector started");
        loop {
            let Some(term) = Box::pin(self.follow()).await else {
                break;
            };
            match Box::pin(self.lead(term)).await {
                (TermEnd::Lost, _) => continue,
                (TermEnd::Shutdown, term) => {
                    Box::pin(self.step_down_and_release(term, StopCause::SteppedDown)).await;
                    break;
                }
                (TermEnd::Yield(d, reply), term) => {
                    Box::pin(self.step_down_and_release(term, StopCause::SteppedDown)).await;
                    self.yield_until = Some(Instant::now() + d);
                    info!(duration = ?d, "yielded the lease");
                    let _ = reply.send(());
                }
            }
        }
        self.shared
            .status
            .set(LeaderStatus::NotLeading { leader: None });
        // Answer pending yield requests so that callers don't hang.
        self.shared.commands.close();
        while let Some(Command::Yield(_, reply)) = self.shared.commands.try_recv() {
            let _ = reply.send(());
        }
        info!("elector stopped");
    }

    // === observation ===

    fn observe(&mut self, seen: Seen) {
        let same = match (&self.observed, &seen) {
            (
                Some(Observed {
                    seen: Seen::Absent, ..
                }),
                Seen::Absent,
            ) => true,
            (
                Some(Observed {
                    seen: Seen::Record(a),
                    ..
                }),
                Seen::Record(b),
            ) => a.version == b.version,
            (
                Some(Observed {
                    seen: Seen::Corrupt { version: a },
                    ..
                }),
                Seen::Corrupt { version: b },
            ) => a.is_some() && a == b,
            _ => false,
        };
        if !same {
            if let Seen::Record(v) = &seen {
                debug!(holder = %v.record.holder_identity, version = %v.version, "observed a change");
            }
            self.observed = Some(Observed {
                seen,
                at: Instant::now(),
            });
        }
    }

    /// When the observed lease can be taken: `None` = now (vacant/absent), `Some(t)` = at `t`.
    fn acquirable_at(&self, obs: &Observed) -> Option<Instant> {
        match &obs.seen {
            Seen::Absent => None,
            Seen::Record(v) if v.record.is_vacant() => None,
            Seen::Record(v) => Some(obs.at + v.record.lease_duration),
            Seen::Corrupt { .. } => Some(obs.at + self.cfg().lease_duration),
        }
    }

    fn publish_follower(&self, now: Instant) {
        let leader = match &self.observed {
            Some(obs) => match (&obs.seen, self.acquirable_at(obs)) {
                (Seen::Record(v), Some(t)) if now < t => Some(v.record.holder_identity.clone()),
                _ => None,
            },
            None => self.shared.status.get().leader().map(str::to_owned),
        };
        if self.shared.status.set(LeaderStatus::NotLeading {
            leader: leader.clone(),
        }) {
            info!(leader = ?leader, "following");
        }
    }

    async fn refresh(&mut self) -> Result<()> {
        let key = self.cfg().key.clone();
        let t = self.cfg().renew_deadline;
        match timeout(t, self.store.get(&key)).await {
            Err(_) => Err(Error::Timeout {
                store: self.store.name(),
                operation: "get",
                after: t,
            }),
            Ok(Ok(Some(v))) => {
                self.observe(Seen::Record(v));
                Ok(())
            }
            Ok(Ok(None)) => {
                self.observe(Seen::Absent);
                Ok(())
            }
            Ok(Err(Error::Corrupt {
                version, reason, ..
            })) => {
                warn!(
                    reason,
                    "the lease key holds data that is not a lease record"
                );
                self.observe(Seen::Corrupt { version });
                Ok(())
            }
            Ok(Err(e)) => Err(e),
        }
    }

    async fn start_watch(&mut self) {
        if !self.store.capabilities().watch || self.watch.is_some() {
            return;
        }
        if self.watch_retry_at.is_some_and(|t| Instant::now() < t) {
            return;
        }
        let key = self.cfg().key.clone();
        let after = match &self.observed {
            Some(Observed {
                seen: Seen::Record(v),
                ..
            }) => Some(v.version.clone()),
            Some(Observed {
                seen: Seen::Corrupt { version: Some(v) },
                ..
            }) => Some(v.clone()),
            _ => None,
        };
        let t = self.cfg().renew_deadline;
        match timeout(t, self.store.watch(&key, after.as_ref())).await {
            Ok(Ok(s)) => {
                self.watch = Some(s);
                self.watch_retry_at = None;
            }
            Ok(Err(e)) => {
                warn!(error = %e, "cannot watch the lease; retrying later");
                self.watch_retry_at = Some(Instant::now() + jittered(self.cfg().retry_period, 1.2));
            }
            Err(_) => {
                warn!("watch request timed out; retrying later");
                self.watch_retry_at = Some(Instant::now() + jittered(self.cfg().retry_period, 1.2));
            }
        }
    }

    /// Applies one watch item; returns false when the watch broke.
    fn apply_watch_item(&mut self, item: Option<Result<WatchEvent>>) -> bool {
        match item {
            Some(Ok(WatchEvent::Put(v))) => {
                self.observe(Seen::Record(v));
                true
            }
            Some(Ok(WatchEvent::Deleted)) => {
                self.observe(Seen::Absent);
                true
            }
            Some(Ok(WatchEvent::Corrupt { reason, version })) => {
                warn!(
                    reason,
                    "the lease key now holds data that is not a lease record"
                );
                self.observe(Seen::Corrupt { version });
                true
            }
            Some(Err(e)) => {
                warn!(error = %e, "lease watch failed; re-reading and watching again");
                self.watch = None;
                false
            }
            None => {
                debug!("lease watch ended; re-reading and watching again");
                self.watch = None;
                false
            }
        }
    }

    // === following ===

    /// Campaigns until this elector acquires the lease (`Some`) or shuts down (`None`).
    async fn follow(&mut self) -> Option<TermState> {
        let mut backoff_until: Option<Instant> = None;
        loop {
            if self.cancel.is_cancelled() {
                return None;
            }
            let now = Instant::now();
            let can_watch = self.store.capabilities().watch;
            // Re-read when we know nothing, or when polling is due.
            if self.observed.is_none() && backoff_until.is_none_or(|t| now >= t) {
                match Box::pin(self.refresh()).await {
                    Ok(()) => backoff_until = None,
                    Err(e) => {
                        warn!(error = %e, "cannot read the lease; retrying");
                        backoff_until =
                            Some(Instant::now() + jittered(self.cfg().retry_period, 1.2));
                    }
                }
            }
            if self.observed.is_some() && can_watch && self.watch.is_none() {
                Box::pin(self.start_watch()).await;
            }
            let now = Instant::now();
            self.publish_follower(now);

            let yielding = self.yield_until.filter(|t| now < *t);
            let mut wake: Option<Instant> = backoff_until.filter(|t| *t > now);
            if let Some(obs) = self.observed.clone() {
                match (yielding, self.acquirable_at(&obs)) {
                    (Some(y), _) => wake = Some(y),
                    (None, at) if at.is_none_or(|t| now >= t) && !self.awaiting_watch => {
                        match Box::pin(self.try_acquire(&obs)).await {
                            Ok(term) => return Some(term),
                            Err(AcquireFailed::Conflict) => {
                                if self.watch.is_some() {
                                    // The watch will deliver the winner's record; don't poll.
                                    self.awaiting_watch = true;
                                    wake = Some(Instant::now() + self.cfg().retry_period);
                                } else {
                                    self.observed = None;
                                }
                                continue;
                            }
                            Err(AcquireFailed::Other) => {
                                self.observed = None;
                                backoff_until =
                                    Some(Instant::now() + jittered(self.cfg().retry_period, 1.2));
                                continue;
                            }
                        }
                    }
                    (None, at) => wake = earliest(wake, at),
                }
                if self.watch.is_none() {
                    // Polling: re-read every retry period (jittered), or sooner at expiry.
                    let poll = Instant::now() + jittered(self.cfg().retry_period, 1.2);
                    wake = earliest(wake, Some(poll));
                    if let Some(t) = self.watch_retry_at {
                        wake = earliest(wake, Some(t));
                    }
                }
            }
            if self.awaiting_watch && wake.is_none() {
                wake = Some(Instant::now() + self.cfg().retry_period);
            }
            let sleep_fut = async {
                match wake {
                    Some(t) => sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => return None,
                cmd = self.shared.commands.recv() => match cmd {
                    Some(Command::Yield(d, reply)) => {
                        self.yield_until = Some(Instant::now() + d);
                        info!(duration = ?d, "yielding: not campaigning");
                        let _ = reply.send(());
                    }
                    None => return None,
                },
                item = next_item(&mut self.watch) => {
                    self.awaiting_watch = false;
                    if !self.apply_watch_item(item) {
                        self.observed = None;
                    }
                }
                () = sleep_fut => {
                    if self.awaiting_watch {
                        // The watch did not tell us in time: read instead.
                        self.awaiting_watch = false;
                        self.observed = None;
                    } else if self.watch.is_none() && self.yield_until.is_none_or(|t| Instant::now() >= t) {
                        self.observed = None; // poll
                    }
                }
            }
        }
    }

    async fn try_acquire(
        &mut self,
        obs: &Observed,
    ) -> std::result::Result<TermState, AcquireFailed> {
        let cfg = self.cfg().clone();
        let now_wall = SystemTime::now();
        let (transitions, expected) = match &obs.seen {
            Seen::Absent => (0, None),
            Seen::Record(v) => (
                v.record.transitions.saturating_add(1),
                Some(v.version.clone()),
            ),
            Seen::Corrupt { version: Some(v) } => {
                warn!(
                    "replacing data that is not a lease record and stayed unchanged for a lease duration; the fencing token restarts at 0"
                );
                (0, Some(v.clone()))
            }
            Seen::Corrupt { version: None } => {
                warn!(
                    "the lease key holds unreadable data and the store gives no version to replace it by compare-and-swap; delete it by hand"
                );
                return Err(AcquireFailed::Other);
            }
        };
        let record = LeaseRecord {
            holder_identity: cfg.identity.clone(),
            lease_duration: cfg.lease_duration,
            acquire_time: Some(now_wall),
            renew_time: Some(now_wall),
            transitions,
        };
        let sent = Instant::now();
        let res = match &expected {
            None => timeout(cfg.renew_deadline, self.store.create(&cfg.key, &record)).await,
            Some(v) => timeout(cfg.renew_deadline, self.store.update(&cfg.key, &record, v)).await,
        };
        let version = match res {
            Ok(Ok(version)) => version,
            Ok(Err(
                Error::Conflict { .. } | Error::AlreadyExists { .. } | Error::NotFound { .. },
            )) => {
                debug!("lost the race to acquire");
                return Err(AcquireFailed::Conflict);
            }
            Ok(Err(e)) => {
                // The write may have landed (ambiguous): read back and recognise our own record.
                warn!(error = %e, "acquire failed");
                return self.recover_ambiguous_acquire(record, sent).await;
            }
            Err(_) => {
                warn!(after = ?cfg.renew_deadline, "acquire timed out");
                return self.recover_ambiguous_acquire(record, sent).await;
            }
        };
        Ok(self.begin_term(record, version, sent))
    }

    async fn recover_ambiguous_acquire(
        &mut self,
        record: LeaseRecord,
        sent: Instant,
    ) -> std::result::Result<TermState, AcquireFailed> {
        let key = self.cfg().key.clone();
        match timeout(self.cfg().renew_deadline, self.store.get(&key)).await {
            Ok(Ok(Some(v))) if v.record == record => {
                info!("an acquire that reported an error did land");
                Ok(self.begin_term(record, v.version, sent))
            }
            _ => Err(AcquireFailed::Other),
        }
    }

    fn begin_term(&mut self, record: LeaseRecord, version: Version, sent: Instant) -> TermState {
        let (leadership, done) = Leadership::new(record.transitions);
        self.set_last_renew(Some(sent));
        self.observe(Seen::Record(Versioned {
            record: record.clone(),
            version: version.clone(),
        }));
        self.shared
            .status
            .set(LeaderStatus::Leading(leadership.clone()));
        info!(
            fencing_token = record.transitions,
            "acquired the lease; leading"
        );
        TermState {
            leadership,
            done,
            record,
            version,
            sent,
        }
    }

    // === leading ===

    async fn lead(&mut self, mut term: TermState) -> (TermEnd, TermState) {
        loop {
            if self.watch.is_none() {
                Box::pin(self.start_watch()).await;
            }
            let next_renew = term.sent + self.cfg().retry_period;
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => return (TermEnd::Shutdown, term),
                cmd = self.shared.commands.recv() => match cmd {
                    Some(Command::Yield(d, reply)) => return (TermEnd::Yield(d, reply), term),
                    None => return (TermEnd::Shutdown, term),
                },
                item = next_item(&mut self.watch) => {
                    match &item {
                        Some(Ok(WatchEvent::Put(v)))
                            if v.record.holder_identity == self.cfg().identity
                                && v.record.transitions == term.record.transitions => {}
                        Some(Ok(WatchEvent::Put(v))) => {
                            warn!(holder = %v.record.holder_identity, "lease lost: another holder took it");
                            self.lose(&term, v.record.holder_identity.clone());
                            self.apply_watch_item(item);
                            return (TermEnd::Lost, term);
                        }
                        Some(Ok(_)) => {
                            warn!("lease lost: the record was deleted or overwritten");
                            self.lose(&term, String::new());
                            self.apply_watch_item(item);
                            return (TermEnd::Lost, term);
                        }
                        _ => {
                            self.apply_watch_item(item);
                        }
                    }
                }
                () = sleep_until(next_renew) => {
                    if let Err(end) = Box::pin(self.renew(&mut term)).await {
                        return (end, term);
                    }
                }
            }
        }
    }

    fn lose(&mut self, term: &TermState, holder: String) {
        term.leadership.mark_ended(StopCause::LeaseLost);
        self.set_last_renew(None);
        let leader = (!holder.is_empty()).then_some(holder);
        self.shared.status.set(LeaderStatus::NotLeading { leader });
        self.observed = None;
    }

    async fn renew(&mut self, term: &mut TermState) -> std::result::Result<(), TermEnd> {
        let cfg = self.cfg().clone();
        let deadline = term.sent + cfg.renew_deadline;
        let mut attempts: Vec<(Instant, LeaseRecord)> = Vec::new();
        let mut backoff = cfg.retry_period / 8;
        loop {
            let now = Instant::now();
            if now >= deadline {
                warn!(renew_deadline = ?cfg.renew_deadline, "lease lost: no successful renewal within the renew deadline; stepping down");
                self.lose(term, String::new());
                return Err(TermEnd::Lost);
            }
            let wall = SystemTime::now();
            let record = LeaseRecord {
                renew_time: Some(wall),
                lease_duration: cfg.lease_duration,
                ..term.record.clone()
            };
            attempts.push((now, record.clone()));
            let res = tokio::select! {
                biased;
                () = self.cancel.cancelled() => return Err(TermEnd::Shutdown),
                r = timeout(deadline - now, self.store.update(&cfg.key, &record, &term.version)) => r,
            };
            match res {
                Ok(Ok(version)) => {
                    self.commit_renewal(term, record, version, now);
                    return Ok(());
                }
                Ok(Err(Error::Conflict { .. } | Error::NotFound { .. })) => {
                    // Either someone else wrote, or an earlier attempt of ours landed.
                    match timeout(
                        deadline.saturating_duration_since(Instant::now()),
                        self.store.get(&cfg.key),
                    )
                    .await
                    {
                        Ok(Ok(Some(v))) => {
                            if let Some((sent, rec)) = attempts.iter().find(|(_, r)| *r == v.record)
                            {
                                let (sent, rec) = (*sent, rec.clone());
                                self.commit_renewal(term, rec, v.version, sent);
                                return Ok(());
                            }
                            let holder = v.record.holder_identity.clone();
                            warn!(holder = %holder, "lease lost: the record changed under us");
                            self.lose(term, holder);
                            self.observe(Seen::Record(v));
                            return Err(TermEnd::Lost);
                        }
                        Ok(Ok(None)) => {
                            warn!("lease lost: the record was deleted");
                            self.lose(term, String::new());
                            return Err(TermEnd::Lost);
                        }
                        Ok(Err(e)) => {
                            warn!(error = %e, "cannot read the lease after a conflict; retrying")
                        }
                        Err(_) => {}
                    }
                }
                Ok(Err(e)) => {
                    warn!(error = %e, retryable = e.is_retryable(), "renewal failed; retrying until the renew deadline")
                }
                Err(_) => warn!("renewal timed out"),
            }
            let wait = backoff.min(deadline.saturating_duration_since(Instant::now()));
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => return Err(TermEnd::Shutdown),
                () = sleep(wait) => {}
            }
            backoff = (backoff * 2).min(cfg.retry_period);
        }
    }

    fn commit_renewal(
        &mut self,
        term: &mut TermState,
        record: LeaseRecord,
        version: Version,
        sent: Instant,
    ) {
        term.record = record.clone();
        term.version = version.clone();
        term.sent = sent;
        self.set_last_renew(Some(sent));
        self.observe(Seen::Record(Versioned { record, version }));
    }

    /// Ends leadership in order: status, then waits for every leadership guard (bounded by the
    /// leader's remaining validity), then writes the release.
    async fn step_down_and_release(&mut self, term: TermState, cause: StopCause) {
        let cfg = self.cfg().clone();
        let TermState {
            leadership,
            mut done,
            record,
            version,
            sent,
        } = term;
        leadership.mark_ended(cause);
        drop(leadership);
        self.set_last_renew(None);
        self.shared
            .status
            .set(LeaderStatus::NotLeading { leader: None });
        info!("stepping down; waiting for leader tasks to finish");
        let valid_until = sent + cfg.renew_deadline;
        let finished = timeout(
            valid_until.saturating_duration_since(Instant::now()),
            &mut done,
        )
        .await
        .is_ok();
        if !finished {
            warn!(
                "leader tasks still run at the end of the lease's validity; not releasing, the lease will expire"
            );
            return;
        }
        let wall = SystemTime::now();
        let release = LeaseRecord {
            holder_identity: String::new(),
            lease_duration: RELEASE_LEASE_DURATION,
            acquire_time: Some(wall),
            renew_time: Some(wall),
            transitions: record.transitions,
        };
        let left = valid_until.saturating_duration_since(Instant::now());
        match timeout(left, self.store.update(&cfg.key, &release, &version)).await {
            Ok(Ok(v)) => {
                info!("released the lease");
                self.observe(Seen::Record(Versioned {
                    record: release,
                    version: v,
                }));
            }
            Ok(Err(e)) => {
                warn!(error = %e, "could not release the lease; it will expire");
                self.observed = None;
            }
            Err(_) => {
                warn!("releasing the lease timed out; it will expire");
                self.observed = None;
            }
        }
    }
}

enum AcquireFailed {
    Conflict,
    Other,
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

async fn next_item(watch: &mut Option<WatchStream>) -> Option<Result<WatchEvent>> {
    match watch {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}
