//! [`LeaderLease`] (k0s's `LeasePool`), [`AlwaysLeading`], and their common interface
//! [`LeaderElector`].

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::callbacks::{CallbackDriver, LeaseCallback};
use crate::elector::{Elector, ElectorConfig};
use crate::error::Result;
use crate::status::{
    LeaderStatus, Leadership, StatusCell, StatusChanged, StatusSource, StopCause, Validity,
};
use crate::store::{DynLeaseStore, LeaseKey};

/// What a controller component gets to find out whether it leads: k0s's
/// `leaderelector.Interface`.
///
/// Use [`current_status`](StatusSource::current_status) (with
/// [`run_leader_tasks`](crate::run_leader_tasks)); the callback methods are kept for code that
/// has not migrated yet (see the README section "Migrating from callbacks to current_status").
pub trait LeaderElector: StatusSource {
    /// Whether this instance leads right now: its status is `Leading` and the term is still
    /// valid by the monotonic clock ([`LeaderStatus::is_leading`]).
    #[deprecated(
        note = "use `current_status()` (and `run_leader_tasks`): a boolean snapshot can be stale by the time it is acted on"
    )]
    fn is_leader(&self) -> bool {
        // Deadline-checked: a term whose validity passed is not leading, even before its end is
        // published.
        self.current_status().0.is_leading()
    }

    /// Registers a callback run each time leadership is acquired (and promptly, if registered
    /// while leading). Callbacks run sequentially, in registration order, on a blocking-pool
    /// thread; a panic is caught and logged.
    #[deprecated(
        note = "use `run_leader_tasks(token, &elector, |leader| ...)`: work started there is cancelled when leadership ends"
    )]
    fn add_acquired_lease_callback(&self, f: LeaseCallback);

    /// Registers a callback run each time a term of leadership ends (lost, stopped or yielded),
    /// after the acquired callbacks of that term. Sequential, in registration order, on a
    /// blocking-pool thread; a panic is caught and logged.
    #[deprecated(
        note = "use `run_leader_tasks(token, &elector, |leader| ...)` and react to `leader.cancelled()` (the cause is `leader.cause()`)"
    )]
    fn add_lost_lease_callback(&self, f: LeaseCallback);
}

/// One leader lease with a lifecycle: k0s's `LeasePool` (which, despite its name, is a single
/// lease that the controllers compete for).
///
/// [`start`](LeaderLease::start) spawns an [`Elector`] and the callback adapter of the
/// deprecated API; [`stop`](LeaderLease::stop) ends leadership in order (leader tasks and
/// lost-lease callbacks finish first), releases the lease and waits for everything to stop.
///
/// Use [`LeaderLease::default_config`] for k0s's timings (lease 60 s, renew deadline 15 s,
/// retry period 5 s: [`LEASE_DURATION`](super::LEASE_DURATION),
/// [`RENEW_DEADLINE`](super::RENEW_DEADLINE), [`RETRY_PERIOD`](super::RETRY_PERIOD));
/// [`ElectorConfig::new`] has client-go's shorter ones (15 s / 10 s / 2 s). On Kubernetes, k0s
/// keeps its Leases in the `kube-node-lease` namespace
/// ([`NODE_LEASE_NAMESPACE`](super::NODE_LEASE_NAMESPACE)).
///
/// ```no_run
/// # async fn demo(store: leasehold::DynLeaseStore) -> leasehold::Result<()> {
/// use leasehold::{LeaseKey, run_leader_tasks};
/// use leasehold::k0s::LeaderLease;
/// use tokio_util::sync::CancellationToken;
///
/// // On Kubernetes, as k0s does (crate `leasehold-kube`):
/// //   let store = Arc::new(KubeStore::connect(
/// //       KubeConfig::new().with_namespace(leasehold::k0s::NODE_LEASE_NAMESPACE),
/// //   ).await?);
/// let config = LeaderLease::default_config(LeaseKey::new("k0s-endpoint-reconciler")?, "node-1");
/// assert_eq!(
///     (config.lease_duration.as_secs(), config.renew_deadline.as_secs(), config.retry_period.as_secs()),
///     (60, 15, 5), // k0s's LeasePool timings
/// );
/// let lease = LeaderLease::start(store, config)?;
/// let shutdown = CancellationToken::new();
/// run_leader_tasks(shutdown.clone(), &lease, |leader| async move {
///     // leader-only work, until leader.cancelled()
///     leader.cancelled().await;
/// })
/// .await;
/// lease.stop().await;
/// # Ok(()) }
/// ```
#[doc(alias = "LeasePool")]
pub struct LeaderLease {
    elector: Arc<Elector>,
    callbacks: CallbackDriver,
}

impl fmt::Debug for LeaderLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaderLease")
            .field("elector", &self.elector)
            .finish_non_exhaustive()
    }
}

// === impl LeaderLease ===

impl LeaderLease {
    /// An elector configuration with k0s's `LeasePool` timings: lease 60 s, renew deadline 15 s,
    /// retry period 5 s (and the default drain timeout of 30 s). A missing record is created only
    /// after a lease duration (see [`ElectorConfig::trust_absence`]); a released one is taken at
    /// once.
    pub fn default_config(key: LeaseKey, identity: impl Into<String>) -> ElectorConfig {
        ElectorConfig::new(key, identity).with_timings(
            super::LEASE_DURATION,
            super::RENEW_DEADLINE,
            super::RETRY_PERIOD,
        )
    }

    /// Validates `config` and starts campaigning on `store`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) when the configuration is invalid.
    ///
    /// # Panics
    /// When called outside a Tokio runtime.
    pub fn start(store: DynLeaseStore, config: ElectorConfig) -> Result<Self> {
        let elector = Arc::new(Elector::spawn(store, config)?);
        let callbacks = CallbackDriver::spawn(elector.clone());
        Ok(LeaderLease { elector, callbacks })
    }

    /// The elector behind this lease (for its health check, leader identity, configuration).
    pub fn elector(&self) -> &Elector {
        &self.elector
    }

    /// A `tokio::sync::watch` receiver of the status.
    pub fn subscribe(&self) -> watch::Receiver<LeaderStatus> {
        self.elector.subscribe()
    }

    /// Gives up the lease (in order: leader tasks and lost-lease callbacks finish first) and does
    /// not campaign for `duration` (k0s's `YieldLease`), counted from when the yield is applied.
    ///
    /// A later yield **replaces** the duration of an earlier one, counted from when the later
    /// one is applied: it neither adds to it nor keeps the longer of the two. Yielding 10 min and
    /// then, a minute later, 30 s means campaigning again 30 s after the second call; yielding
    /// 30 s and then 10 min means 10 min after the second call.
    ///
    /// # Errors
    /// [`Error::Shutdown`](crate::Error::Shutdown) when the lease has been stopped.
    ///
    /// # Cancel safety
    /// Cancel safe: once the request reached the elector, the yield goes ahead regardless.
    pub async fn yield_lease(&self, duration: Duration) -> Result<()> {
        self.elector.yield_for(duration).await
    }

    /// Stops in order: ends leadership (leader tasks are cancelled with
    /// [`StopCause::SteppedDown`] and the lost-lease callbacks run), releases the lease once they
    /// have finished (the lease is renewed meanwhile, up to the drain timeout), then stops the
    /// callback adapter. Calling it again returns at once. A failure of the elector's task is
    /// logged.
    ///
    /// Called from inside one of this lease's callbacks (on the callback's thread, for instance
    /// through `Handle::current().block_on(lease.stop())`), it cannot wait for the callbacks to
    /// finish — they include the caller — so it returns once the step-down has begun (the
    /// status no longer says leading); the lost-lease callbacks, the release and the rest of the
    /// stop follow in the background once the calling callback has returned.
    ///
    /// # Cancel safety
    /// Cancel safe: the shutdown goes ahead in the background if this future is dropped.
    pub async fn stop(&self) {
        if let Err(e) = self.elector.shutdown().await {
            tracing::error!(error = %e, "the leader lease's elector failed");
        }
        self.callbacks.stop(|| {}).await;
    }
}

impl StatusSource for LeaderLease {
    fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        self.elector.current_status()
    }
}

#[allow(deprecated)]
impl LeaderElector for LeaderLease {
    fn add_acquired_lease_callback(&self, f: LeaseCallback) {
        self.callbacks.add_acquired(f);
    }

    fn add_lost_lease_callback(&self, f: LeaseCallback) {
        self.callbacks.add_lost(f);
    }
}

/// A leader elector that leads from creation until [`stop`](AlwaysLeading::stop), for
/// single-controller setups (k0s's `Dummy` / `AlwaysLeading`).
///
/// Unlike k0s's, it ends its single term on `stop`: leader tasks are cancelled with
/// [`StopCause::SteppedDown`] and the lost-lease callbacks run, so components behave the same
/// as with a [`LeaderLease`]. The fencing token is 0.
pub struct AlwaysLeading {
    cell: StatusCell,
    term: Mutex<Option<Leadership>>,
    callbacks: CallbackDriver,
}

impl fmt::Debug for AlwaysLeading {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlwaysLeading")
            .field("status", &self.cell.get())
            .finish_non_exhaustive()
    }
}

// === impl AlwaysLeading ===

impl AlwaysLeading {
    /// A leader elector that leads at once.
    ///
    /// # Panics
    /// When called outside a Tokio runtime.
    pub fn new() -> Self {
        let (leadership, _released) = Leadership::new_term(0, Validity::UntilEnded);
        let cell = StatusCell::new(LeaderStatus::Leading(leadership.clone()));
        let callbacks = CallbackDriver::spawn(cell.clone());
        AlwaysLeading {
            cell,
            term: Mutex::new(Some(leadership)),
            callbacks,
        }
    }

    /// A `tokio::sync::watch` receiver of the status.
    pub fn subscribe(&self) -> watch::Receiver<LeaderStatus> {
        self.cell.subscribe()
    }

    /// Does nothing: there is nobody to yield to. Returns at once.
    ///
    /// # Errors
    /// Never.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn yield_lease(&self, duration: Duration) -> Result<()> {
        tracing::debug!(?duration, "always leading: nothing to yield");
        Ok(())
    }

    /// Ends the term: the status becomes not leading, leader tasks are cancelled with
    /// [`StopCause::SteppedDown`], and the lost-lease callbacks run; once they have, the status
    /// becomes [`LeaderStatus::Stopped`] (so [`run_leader_tasks`](crate::run_leader_tasks)
    /// returns) and `stop` returns. Calling it again returns at once. Called from inside one of
    /// its own callbacks, it returns once the term has ended, and publishes `Stopped` in the
    /// background after the callbacks have returned.
    ///
    /// # Cancel safety
    /// Cancel safe: the term has ended once the first poll returned; the callbacks finish in the
    /// background.
    pub async fn stop(&self) {
        let term = self.term.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(term) = term {
            term.mark_ended(StopCause::SteppedDown);
            self.cell.set(LeaderStatus::NotLeading { leader: None });
        }
        let cell = self.cell.clone();
        self.callbacks
            .stop(move || {
                cell.set(LeaderStatus::Stopped);
            })
            .await;
    }
}

impl Default for AlwaysLeading {
    fn default() -> Self {
        Self::new()
    }
}

impl StatusSource for AlwaysLeading {
    fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        self.cell.current_status()
    }
}

#[allow(deprecated)]
impl LeaderElector for AlwaysLeading {
    fn add_acquired_lease_callback(&self, f: LeaseCallback) {
        self.callbacks.add_acquired(f);
    }

    fn add_lost_lease_callback(&self, f: LeaseCallback) {
        self.callbacks.add_lost(f);
    }
}

/// A leader elector that never leads (k0s's `Dummy{Leader: false}`): for tests of components
/// in their follower role, and for setups where this process must never run leader-only work.
///
/// Its status is [`LeaderStatus::NotLeading`] with no known leader until `stop`, so [`run_leader_tasks`](crate::run_leader_tasks) never starts a task.
/// Callbacks of the deprecated API are accepted and never run (there is no term to start or
/// end). [`yield_lease`](NeverLeading::yield_lease) does nothing; [`stop`](NeverLeading::stop)
/// publishes [`LeaderStatus::Stopped`].
/// It needs no runtime.
pub struct NeverLeading {
    cell: StatusCell,
}

impl fmt::Debug for NeverLeading {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NeverLeading").finish_non_exhaustive()
    }
}

// === impl NeverLeading ===

impl NeverLeading {
    /// A leader elector that never leads.
    pub fn new() -> Self {
        NeverLeading {
            cell: StatusCell::new(LeaderStatus::NotLeading { leader: None }),
        }
    }

    /// A `tokio::sync::watch` receiver of the status (it never changes).
    pub fn subscribe(&self) -> watch::Receiver<LeaderStatus> {
        self.cell.subscribe()
    }

    /// Does nothing: there is no lease to yield. Returns at once.
    ///
    /// # Errors
    /// Never.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn yield_lease(&self, duration: Duration) -> Result<()> {
        tracing::debug!(?duration, "never leading: nothing to yield");
        Ok(())
    }

    /// Publishes [`LeaderStatus::Stopped`] (there is no term to end), so
    /// [`run_leader_tasks`](crate::run_leader_tasks) returns. Returns at once.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn stop(&self) {
        self.cell.set(LeaderStatus::Stopped);
    }
}

impl Default for NeverLeading {
    fn default() -> Self {
        Self::new()
    }
}

impl StatusSource for NeverLeading {
    fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        self.cell.current_status()
    }
}

#[allow(deprecated)]
impl LeaderElector for NeverLeading {
    /// Accepted and never run: a term never starts.
    fn add_acquired_lease_callback(&self, f: LeaseCallback) {
        drop(f);
    }

    /// Accepted and never run: a term never ends.
    fn add_lost_lease_callback(&self, f: LeaseCallback) {
        drop(f);
    }
}
