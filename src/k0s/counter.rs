//! [`ControllerCounter`]: k0s's `K0sControllersLeaseCounter`, over any store.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use futures::future::BoxFuture;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, warn};

use crate::elector::machine::MAX_RECORD_LEASE_DURATION;
use crate::elector::{Elector, ElectorConfig, MAX_TIMING, default_identity};
use crate::error::{Error, Result};
use crate::status::{LeaderStatus, instant_after};
use crate::store::{
    DynLeaseStore, KeyPrefix, LeaseKey, LeaseRecord, Version, WatchEvent, WatchStream,
};

/// The count a [`ControllerCounter`] publishes before it has listed the leases: 1, this
/// controller, as k0s assumes during start-up.
pub const INITIAL_COUNT: usize = 1;

/// The default [`CounterConfig::skew_tolerance`]: 5 s.
pub const DEFAULT_SKEW_TOLERANCE: Duration = Duration::from_secs(5);

/// Configuration of a [`ControllerCounter`].
///
/// Timings default to k0s's (lease 60 s, renew deadline 15 s, retry period 5 s).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CounterConfig {
    /// The prefix of every controller's lease key (k0s: `k0s-ctrl-`).
    pub prefix: KeyPrefix,
    /// This controller's lease key: `<prefix><node-name>`.
    pub key: LeaseKey,
    /// This controller's identity (k0s: the invocation id); unique per process.
    pub identity: String,
    /// Lease duration of this controller's lease; other controllers' leases carry their own.
    pub lease_duration: Duration,
    /// Renew deadline of this controller's lease.
    pub renew_deadline: Duration,
    /// Retry period of this controller's lease; also the retry period of failed store calls.
    pub retry_period: Duration,
    /// The "doorbell" key: every member bumps it once it holds its own lease, and every counter
    /// watches it, so that new members are discovered within one watch delivery. `None`
    /// disables it; then new members are discovered by re-listing every `retry_period`.
    pub doorbell: Option<LeaseKey>,
    /// How often the prefix is re-listed while the doorbell is watched (a safety net for
    /// members that do not ring it, such as foreign writers). Default: the lease duration.
    /// Greater than zero and at most [`MAX_TIMING`](crate::elector::MAX_TIMING) (one day), as
    /// the three timings; [`ControllerCounter::start`] rejects other values.
    pub relist_interval: Duration,
    /// How far another controller's wall clock may lag behind this one's, for leases found at
    /// start-up (default [`DEFAULT_SKEW_TOLERANCE`], 5 s). A lease found by the counter's first
    /// successful list is counted only while `renew_time + lease_duration + skew_tolerance` is
    /// ahead of the local wall clock, so a lease that was already dead is never counted; after
    /// that first list, expiry is judged by local observation only.
    pub skew_tolerance: Duration,
}

// === impl CounterConfig ===

impl CounterConfig {
    /// A configuration for the controller `node_name` under `prefix`, with a fresh
    /// [`default_identity`] and k0s's timings. The doorbell key is the prefix without its
    /// trailing `-`/`.` (`k0s-ctrl-` → `k0s-ctrl`), which is not itself under the prefix.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] when `<prefix><node_name>` is not a valid key.
    pub fn new(prefix: KeyPrefix, node_name: &str) -> Result<Self> {
        let key = LeaseKey::new(format!("{prefix}{node_name}"))?;
        let doorbell = LeaseKey::new(prefix.as_str().trim_end_matches(['-', '.']))
            .ok()
            .filter(|k| !k.has_prefix(&prefix));
        Ok(CounterConfig {
            prefix,
            key,
            identity: default_identity(),
            lease_duration: super::LEASE_DURATION,
            renew_deadline: super::RENEW_DEADLINE,
            retry_period: super::RETRY_PERIOD,
            doorbell,
            relist_interval: super::LEASE_DURATION,
            skew_tolerance: DEFAULT_SKEW_TOLERANCE,
        })
    }

    /// Sets the identity.
    pub fn with_identity(mut self, identity: impl Into<String>) -> Self {
        self.identity = identity.into();
        self
    }

    /// Sets the three timings of this controller's lease; the re-list interval follows the
    /// lease duration.
    pub fn with_timings(
        mut self,
        lease: Duration,
        renew_deadline: Duration,
        retry: Duration,
    ) -> Self {
        self.lease_duration = lease;
        self.renew_deadline = renew_deadline;
        self.retry_period = retry;
        self.relist_interval = lease;
        self
    }

    /// Sets the [skew tolerance](CounterConfig::skew_tolerance) for leases found at start-up.
    pub fn with_skew_tolerance(mut self, tolerance: Duration) -> Self {
        self.skew_tolerance = tolerance;
        self
    }

    /// Sets (or, with `None`, disables) the doorbell key.
    pub fn with_doorbell(mut self, doorbell: Option<LeaseKey>) -> Self {
        self.doorbell = doorbell;
        self
    }

    fn validate(&self) -> Result<()> {
        if !self.key.has_prefix(&self.prefix) {
            return Err(Error::InvalidConfig(format!(
                "the lease key {} is not under the prefix {}",
                self.key, self.prefix
            )));
        }
        if let Some(d) = &self.doorbell
            && d.has_prefix(&self.prefix)
        {
            return Err(Error::InvalidConfig(format!(
                "the doorbell key {d} must not be under the counted prefix {}",
                self.prefix
            )));
        }
        if self.skew_tolerance > MAX_RECORD_LEASE_DURATION {
            return Err(Error::InvalidConfig(format!(
                "skew_tolerance {:?} is absurd; keep it at most {MAX_RECORD_LEASE_DURATION:?}",
                self.skew_tolerance
            )));
        }
        if self.relist_interval.is_zero() {
            return Err(Error::InvalidConfig(
                "relist_interval must be greater than zero".into(),
            ));
        }
        if self.relist_interval > MAX_TIMING {
            return Err(Error::InvalidConfig(format!(
                "relist_interval ({:?}) is longer than the maximum of {MAX_TIMING:?}",
                self.relist_interval
            )));
        }
        // The lease's own timings, checked here too so that the error names the counter's
        // fields before an elector is spawned.
        for (name, d) in [
            ("lease_duration", self.lease_duration),
            ("renew_deadline", self.renew_deadline),
            ("retry_period", self.retry_period),
        ] {
            if d > MAX_TIMING {
                return Err(Error::InvalidConfig(format!(
                    "{name} ({d:?}) is longer than the maximum of {MAX_TIMING:?}"
                )));
            }
        }
        Ok(())
    }
}

/// A future that resolves when the count it was handed out with has changed.
///
/// If the counter goes away, it never resolves.
///
/// # Cancel safety
/// Dropping it has no effect on anyone else.
pub struct CountChanged(BoxFuture<'static, ()>);

impl Future for CountChanged {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

impl fmt::Debug for CountChanged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CountChanged")
    }
}

/// Counts the live controllers: k0s's `K0sControllersLeaseCounter`, over any store.
///
/// Each controller holds its own lease `<prefix><node-name>` (through an [`Elector`] on that
/// key), and the counter reports how many leases under the prefix have a holder and are not
/// expired.
///
/// Like k0s:
/// - **The count starts at [`INITIAL_COUNT`] (1, this controller)** and only ever changes to a
///   count that was observed. The first list waits (up to the renew deadline) until this
///   controller holds its own lease, so it includes it.
/// - **During a store outage the last count is kept.** A lease that is not seen to change is
///   dropped only once a list that *started after* its expiry succeeded and still shows it
///   unchanged; while lists fail, nothing expires. (k0s keeps the last listed count when a list
///   fails.)
/// - **A lease that was already dead at start-up is not counted.** For leases found by the first
///   successful list, the record's own renew time is used, with a tolerance for clock skew
///   ([`CounterConfig::skew_tolerance`], 5 s by default).
///
/// Unlike k0s:
/// - **After start-up, expiry is judged by local observation** (skew-safe): a lease is alive
///   until the `lease_duration` written in it has passed on this process's monotonic clock since
///   this counter *observed* the record last change (and a list confirmed it unchanged after
///   that). The record's timestamps are compared to the local wall clock only for the leases
///   found at start-up.
/// - **Watch-driven**: every known key is watched, so the count changes within one watch
///   delivery of a change of a known member (a release, a take-over, a deletion). New members
///   are discovered through the *doorbell* key (see [`CounterConfig::doorbell`]): each member
///   bumps it once it holds its lease, and every counter re-lists the prefix when it changes.
///   A slow safety re-list runs every [`CounterConfig::relist_interval`]. Without a doorbell,
///   the prefix is re-listed every `retry_period`; on a store that cannot watch, the counter
///   polls with a list every `retry_period`.
/// - The count is published like the leader status: [`current_count`](Self::current_count)
///   (value + change future), [`subscribe`](Self::subscribe) (a watch receiver), and the callback
///   adapter [`on_count_changed`](Self::on_count_changed) (k0s's `UpdateControllerCount(count)`).
/// - [`stop`](Self::stop) releases this controller's lease, so the other counters' count drops
///   at once (not after a lease duration).
pub struct ControllerCounter {
    elector: Elector,
    count: Arc<watch::Sender<usize>>,
    cancel: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for ControllerCounter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControllerCounter")
            .field("elector", &self.elector)
            .field("count", &*self.count.borrow())
            .finish_non_exhaustive()
    }
}

// === impl ControllerCounter ===

impl ControllerCounter {
    /// Validates `config`, starts holding this controller's lease and counting.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the configuration is invalid.
    ///
    /// # Panics
    /// When called outside a Tokio runtime.
    pub fn start(store: DynLeaseStore, config: CounterConfig) -> Result<Self> {
        config.validate()?;
        let elector_config = ElectorConfig::new(config.key.clone(), config.identity.clone())
            .with_timings(
                config.lease_duration,
                config.renew_deadline,
                config.retry_period,
            )
            // Each controller campaigns only on its own key: create it at once.
            .with_trust_absence(true);
        let elector = Elector::spawn(store.clone(), elector_config)?;
        let count = Arc::new(watch::Sender::new(INITIAL_COUNT));
        let cancel = CancellationToken::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let span =
            tracing::info_span!("leasehold_counter", prefix = %config.prefix, key = %config.key);
        let counting = Counting {
            own_status: elector.subscribe(),
            store,
            config,
            members: HashMap::new(),
            next_gen: 0,
            tx,
            rx,
            doorbell: None,
            count: count.clone(),
            last_relist: None,
            confirmed: None,
        };
        let task = tokio::spawn(counting.run(cancel.clone()).instrument(span));
        Ok(ControllerCounter {
            elector,
            count,
            cancel,
            task: Mutex::new(Some(task)),
        })
    }

    /// The number of live controllers right now.
    pub fn count(&self) -> usize {
        *self.count.borrow()
    }

    /// The current count and a future that resolves once it has changed.
    pub fn current_count(&self) -> (usize, CountChanged) {
        let mut rx = self.count.subscribe();
        let count = *rx.borrow_and_update();
        let changed = CountChanged(Box::pin(async move {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }));
        (count, changed)
    }

    /// A `tokio::sync::watch` receiver of the count.
    pub fn subscribe(&self) -> watch::Receiver<usize> {
        self.count.subscribe()
    }

    /// Calls `f` with the current count, then with every new count, until the counter stops:
    /// the adapter for k0s's `UpdateControllerCount(count)`. `f` runs on a blocking-pool thread,
    /// one call at a time; a panic is caught and logged. If counts change faster than `f`
    /// returns, intermediate counts are skipped (`f` always gets the latest).
    pub fn on_count_changed(&self, f: impl Fn(usize) + Send + Sync + 'static) {
        let f = Arc::new(f);
        let mut rx = self.count.subscribe();
        let cancel = self.cancel.clone();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let n = *rx.borrow_and_update();
                if last != Some(n) {
                    last = Some(n);
                    let f = f.clone();
                    super::callbacks::invoke(Arc::new(move || f(n)), "count", 0, None).await;
                }
                tokio::select! {
                    () = cancel.cancelled() => return,
                    r = rx.changed() => if r.is_err() { return },
                }
            }
        });
    }

    /// This controller's own lease elector.
    pub fn elector(&self) -> &Elector {
        &self.elector
    }

    /// Releases this controller's lease (so the others' count drops at once) and stops
    /// counting. Calling it again returns at once.
    ///
    /// # Cancel safety
    /// Cancel safe: the shutdown goes ahead in the background if this future is dropped.
    pub async fn stop(&self) {
        if let Err(e) = self.elector.shutdown().await {
            tracing::error!(error = %e, "the controller lease's elector failed");
        }
        self.cancel.cancel();
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = task
            && let Err(e) = task.await
        {
            warn!(error = %e, "the counting task ended abnormally");
        }
    }
}

impl Drop for ControllerCounter {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

// ---------------------------------------------------------------------------------------------
// The counting task.

struct Member {
    version: Option<Version>,
    /// When the lease ends unless its record changes (monotonic); `None` when it is not counted
    /// (released, not a record, or already dead when found at start-up).
    expires_at: Option<Instant>,
    /// Generation of the current watcher; events from older watchers are ignored.
    generation: u64,
    watcher: Option<AbortOnDrop>,
}

/// When a lease observed (changed) at `now` ends unless it changes again; `None` if it is not
/// to be counted at all. `startup` carries the local wall clock and the skew tolerance for a
/// record found by the first list: its own renew time counts then.
fn expiry(
    now: Instant,
    record: &LeaseRecord,
    startup: Option<(SystemTime, Duration)>,
) -> Option<Instant> {
    if record.is_vacant() {
        return None;
    }
    let duration = record.lease_duration.min(MAX_RECORD_LEASE_DURATION);
    let remaining = match (startup, record.renew_time) {
        (Some((wall_now, tolerance)), Some(renewed)) => {
            let age = wall_now.duration_since(renewed).unwrap_or(Duration::ZERO);
            duration.checked_sub(age.saturating_sub(tolerance))?
        }
        _ => duration,
    };
    if remaining.is_zero() {
        return None;
    }
    now.checked_add(remaining)
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

enum Msg {
    Event(LeaseKey, u64, WatchEvent),
    Broken(LeaseKey, u64),
}

struct Counting {
    own_status: watch::Receiver<LeaderStatus>,
    store: DynLeaseStore,
    config: CounterConfig,
    members: HashMap<LeaseKey, Member>,
    next_gen: u64,
    tx: mpsc::UnboundedSender<Msg>,
    rx: mpsc::UnboundedReceiver<Msg>,
    doorbell: Option<WatchStream>,
    count: Arc<watch::Sender<usize>>,
    last_relist: Option<Instant>,
    /// When the last successful list started: leases whose expiry is not after it were seen
    /// unchanged after they expired.
    confirmed: Option<Instant>,
}

impl Counting {
    fn can_watch(&self) -> bool {
        self.store.capabilities().watch
    }

    fn op_timeout(&self) -> Duration {
        self.config.renew_deadline
    }

    fn relist_every(&self) -> Duration {
        if self.can_watch() && self.config.doorbell.is_some() {
            self.config.relist_interval
        } else {
            self.config.retry_period
        }
    }

    async fn run(mut self, cancel: CancellationToken) {
        info!("counting controllers");
        // List first once this controller holds its own lease (bounded), so that the first
        // count includes it and the count does not dip below the initial 1 for no reason.
        let mut own = self.own_status.clone();
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            _ = timeout(self.config.renew_deadline, own.wait_for(LeaderStatus::is_leading)) => {}
        }
        // The next re-list for discovery (periodic, doorbell, broken watch).
        let mut next_relist = Instant::now();
        // After a failed list: no new attempt before this.
        let mut not_before: Option<Instant> = None;
        loop {
            let now = Instant::now();
            // A lease past its expiry is dropped only after a list confirmed it: re-list then.
            let confirm_at = self.publish();
            let mut relist_at = confirm_at.map_or(next_relist, |t| t.min(next_relist));
            if let Some(t) = not_before {
                relist_at = relist_at.max(t);
            }
            if now >= relist_at {
                if self.doorbell.is_none() {
                    self.watch_doorbell().await;
                }
                match self.relist().await {
                    Ok(()) => {
                        not_before = None;
                        next_relist = instant_after(Instant::now(), self.relist_every());
                    }
                    Err(e) => {
                        warn!(error = %e, "cannot list the controller leases; keeping the last count and retrying");
                        let retry = instant_after(Instant::now(), self.config.retry_period);
                        not_before = Some(retry);
                        next_relist = retry;
                    }
                }
                continue;
            }
            tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                msg = self.rx.recv() => if let Some(msg) = msg && self.handle(msg) {
                    // A watch broke: re-read soon, but not in a hot loop.
                    let earliest = self
                        .last_relist
                        .map_or(Instant::now(), |t| instant_after(t, self.config.retry_period));
                    next_relist = next_relist.min(earliest.max(Instant::now()));
                },
                item = next_item(&mut self.doorbell) => match item {
                    Some(Ok(_)) => {
                        debug!("the doorbell rang; re-listing");
                        next_relist = Instant::now();
                    }
                    Some(Err(e)) => {
                        warn!(error = %e, "the doorbell watch failed; watching again at the next re-list");
                        self.doorbell = None;
                        next_relist = next_relist.min(instant_after(Instant::now(), self.config.retry_period));
                    }
                    None => {
                        self.doorbell = None;
                        next_relist = next_relist.min(instant_after(Instant::now(), self.config.retry_period));
                    }
                },
                r = self.own_status.changed() => {
                    if r.is_err() {
                        // The elector is gone: keep counting until cancelled.
                        cancel.cancelled().await;
                        break;
                    }
                    let leading = self.own_status.borrow_and_update().is_leading();
                    if leading {
                        info!("holding this controller's lease");
                        self.ring_doorbell().await;
                        next_relist = Instant::now();
                    }
                },
                () = sleep_until(relist_at) => {}
            }
        }
        debug!("stopped counting controllers");
    }

    /// Publishes the count; returns the earliest expiry of a counted lease (in the
    /// past if one expired and awaits a confirming list).
    ///
    /// A lease counts until a list that started at or after its expiry confirmed it unchanged:
    /// during an outage, when no list succeeds, the count stays as it was.
    fn publish(&self) -> Option<Instant> {
        // Nothing is known before the first successful list: keep the initial count.
        let confirmed = self.confirmed?;
        let mut count = 0;
        let mut next = None::<Instant>;
        for m in self.members.values() {
            if let Some(t) = m.expires_at
                && t > confirmed
            {
                count += 1;
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        if self
            .count
            .send_if_modified(|c| std::mem::replace(c, count) != count)
        {
            info!(count, "controller count changed");
        }
        next
    }

    async fn relist(&mut self) -> Result<()> {
        let started = Instant::now();
        self.last_relist = Some(started);
        let t = self.op_timeout();
        let items = match timeout(t, self.store.list(&self.config.prefix)).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::Timeout {
                    store: self.store.name(),
                    operation: "list",
                    after: t,
                });
            }
        };
        let now = Instant::now();
        // Leases found by the first successful list: their own renew time counts.
        let startup = self
            .confirmed
            .is_none()
            .then(|| (SystemTime::now(), self.config.skew_tolerance));
        let mut seen = std::collections::HashSet::new();
        for (key, v) in items {
            seen.insert(key.clone());
            let can_watch = self.can_watch();
            let generation = self.next_gen;
            let m = self.members.entry(key.clone()).or_insert_with(|| Member {
                version: None,
                expires_at: None,
                generation,
                watcher: None,
            });
            if m.version.as_ref() != Some(&v.version) {
                m.expires_at = expiry(now, &v.record, startup);
                m.version = Some(v.version);
            }
            if can_watch && m.watcher.is_none() {
                self.next_gen += 1;
                m.generation = self.next_gen;
                m.watcher = Some(spawn_watcher(
                    self.store.clone(),
                    key,
                    m.version.clone(),
                    m.generation,
                    self.tx.clone(),
                    t,
                ));
            }
        }
        self.members.retain(|k, _| seen.contains(k));
        self.confirmed = Some(started);
        Ok(())
    }

    /// Applies one message; returns true when a watch broke.
    fn handle(&mut self, msg: Msg) -> bool {
        let now = Instant::now();
        match msg {
            Msg::Event(key, generation, ev) => {
                let Some(m) = self
                    .members
                    .get_mut(&key)
                    .filter(|m| m.generation == generation)
                else {
                    return false;
                };
                match ev {
                    WatchEvent::Put(v) => {
                        if m.version.as_ref() != Some(&v.version) {
                            debug!(key = %key, holder = %v.record.holder_identity, "a controller lease changed");
                            m.expires_at = expiry(now, &v.record, None);
                            m.version = Some(v.version);
                        }
                    }
                    WatchEvent::Deleted => {
                        debug!(key = %key, "a controller lease was deleted");
                        self.members.remove(&key);
                    }
                    WatchEvent::Corrupt { reason, version } => {
                        warn!(key = %key, reason, "a controller lease holds data that is not a lease record; not counting it");
                        m.expires_at = None;
                        m.version = version;
                    }
                }
                false
            }
            Msg::Broken(key, generation) => {
                if let Some(m) = self
                    .members
                    .get_mut(&key)
                    .filter(|m| m.generation == generation)
                {
                    m.watcher = None;
                    return true;
                }
                false
            }
        }
    }

    async fn watch_doorbell(&mut self) {
        let Some(bell) = self.config.doorbell.clone() else {
            return;
        };
        if !self.can_watch() {
            return;
        }
        match timeout(self.op_timeout(), self.store.watch(&bell, None)).await {
            Ok(Ok(s)) => self.doorbell = Some(s),
            Ok(Err(e)) => warn!(error = %e, "cannot watch the doorbell key; relying on re-lists"),
            Err(_) => warn!("watching the doorbell key timed out; relying on re-lists"),
        }
    }

    fn ring_doorbell(&self) -> impl Future<Output = ()> + Send + 'static {
        let bell = self.config.doorbell.clone();
        let store = self.store.clone();
        let (lease, t) = (self.config.lease_duration, self.op_timeout());
        async move {
            if let Some(bell) = bell {
                ring_doorbell(store, bell, lease, t).await;
            }
        }
    }
}

/// Announces a member: bumps the doorbell record by compare-and-swap.
async fn ring_doorbell(
    store: DynLeaseStore,
    bell: LeaseKey,
    lease_duration: Duration,
    t: Duration,
) {
    let bell = &bell;
    {
        for _ in 0..8 {
            let wall = SystemTime::now();
            let rec = |transitions| LeaseRecord {
                holder_identity: String::new(),
                lease_duration,
                acquire_time: Some(wall),
                renew_time: Some(wall),
                transitions,
            };
            let res = timeout(t, async {
                match store.get(bell).await? {
                    None => store.create(bell, &rec(0)).await.map(drop),
                    Some(v) => {
                        let next = v.record.transitions.wrapping_add(1);
                        store.update(bell, &rec(next), &v.version).await.map(drop)
                    }
                }
            })
            .await;
            match res {
                Ok(Ok(())) => return,
                Ok(Err(
                    Error::Conflict { .. } | Error::AlreadyExists { .. } | Error::NotFound { .. },
                )) => {}
                Ok(Err(e)) => {
                    warn!(error = %e, "cannot ring the doorbell; other counters find this controller at their next re-list");
                    return;
                }
                Err(_) => {
                    warn!(
                        "ringing the doorbell timed out; other counters find this controller at their next re-list"
                    );
                    return;
                }
            }
        }
        warn!(
            "the doorbell is too contended; other counters find this controller at their next re-list"
        );
    }
}

fn spawn_watcher(
    store: DynLeaseStore,
    key: LeaseKey,
    after: Option<Version>,
    generation: u64,
    tx: mpsc::UnboundedSender<Msg>,
    op_timeout: Duration,
) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(async move {
        let mut stream = match timeout(op_timeout, store.watch(&key, after.as_ref())).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                warn!(key = %key, error = %e, "cannot watch a controller lease");
                let _ = tx.send(Msg::Broken(key, generation));
                return;
            }
            Err(_) => {
                warn!(key = %key, "watching a controller lease timed out");
                let _ = tx.send(Msg::Broken(key, generation));
                return;
            }
        };
        while let Some(item) = stream.next().await {
            match item {
                Ok(ev) => {
                    if tx.send(Msg::Event(key.clone(), generation, ev)).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    debug!(key = %key, error = %e, "a controller lease watch failed");
                    break;
                }
            }
        }
        let _ = tx.send(Msg::Broken(key, generation));
    }))
}

async fn next_item(watch: &mut Option<WatchStream>) -> Option<Result<WatchEvent>> {
    match watch {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}
