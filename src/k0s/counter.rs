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

use crate::elector::{Elector, ElectorConfig, default_identity};
use crate::error::{Error, Result};
use crate::status::LeaderStatus;
use crate::store::{
    DynLeaseStore, KeyPrefix, LeaseKey, LeaseRecord, Version, WatchEvent, WatchStream,
};

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
    pub relist_interval: Duration,
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
            lease_duration: Duration::from_secs(60),
            renew_deadline: Duration::from_secs(15),
            retry_period: Duration::from_secs(5),
            doorbell,
            relist_interval: Duration::from_secs(60),
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
        if self.relist_interval.is_zero() {
            return Err(Error::InvalidConfig(
                "relist_interval must be greater than zero".into(),
            ));
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
/// expired. Unlike k0s:
/// - **Expiry is judged by local observation** (skew-safe): a lease is alive until the
///   `lease_duration` written in it has passed on this process's monotonic clock since this
///   counter *observed* the record last change. The record's timestamps are never compared to
///   the local wall clock. (A lease seen for the first time counts as just changed, so a dead
///   controller found at start counts for up to one lease duration.)
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
        let count = Arc::new(watch::Sender::new(0));
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
                    super::callbacks::invoke(Arc::new(move || f(n)), "count", 0).await;
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
    /// `None` when the key holds data that is not a record.
    record: Option<LeaseRecord>,
    version: Option<Version>,
    /// When this counter observed the current state (monotonic).
    observed_at: Instant,
    /// Generation of the current watcher; events from older watchers are ignored.
    generation: u64,
    watcher: Option<AbortOnDrop>,
}

impl Member {
    fn expires_at(&self) -> Option<Instant> {
        let r = self.record.as_ref()?;
        (!r.is_vacant()).then(|| self.observed_at + r.lease_duration)
    }
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
        let mut next_relist = Instant::now();
        loop {
            let now = Instant::now();
            if now >= next_relist {
                if self.doorbell.is_none() {
                    self.watch_doorbell().await;
                }
                next_relist = match self.relist().await {
                    Ok(()) => Instant::now() + self.relist_every(),
                    Err(e) => {
                        warn!(error = %e, "cannot list the controller leases; retrying");
                        Instant::now() + self.config.retry_period
                    }
                };
            }
            let now = Instant::now();
            let wake = self
                .publish(now)
                .map_or(next_relist, |t| t.min(next_relist));
            tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                msg = self.rx.recv() => if let Some(msg) = msg && self.handle(msg) {
                    // A watch broke: re-read soon, but not in a hot loop.
                    let earliest = self
                        .last_relist
                        .map_or(Instant::now(), |t| t + self.config.retry_period);
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
                        next_relist = next_relist.min(Instant::now() + self.config.retry_period);
                    }
                    None => {
                        self.doorbell = None;
                        next_relist = next_relist.min(Instant::now() + self.config.retry_period);
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
                () = sleep_until(wake) => {}
            }
        }
        debug!("stopped counting controllers");
    }

    /// Publishes the count at `now`; returns the next instant a live lease expires.
    fn publish(&self, now: Instant) -> Option<Instant> {
        let mut count = 0;
        let mut next = None::<Instant>;
        for m in self.members.values() {
            if let Some(t) = m.expires_at()
                && now < t
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
        self.last_relist = Some(Instant::now());
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
        let mut seen = std::collections::HashSet::new();
        for (key, v) in items {
            seen.insert(key.clone());
            let can_watch = self.can_watch();
            let generation = self.next_gen;
            let m = self.members.entry(key.clone()).or_insert_with(|| Member {
                record: None,
                version: None,
                observed_at: now,
                generation,
                watcher: None,
            });
            if m.version.as_ref() != Some(&v.version) || m.record.is_none() {
                m.record = Some(v.record);
                m.version = Some(v.version);
                m.observed_at = now;
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
                            m.record = Some(v.record);
                            m.version = Some(v.version);
                            m.observed_at = now;
                        }
                    }
                    WatchEvent::Deleted => {
                        debug!(key = %key, "a controller lease was deleted");
                        self.members.remove(&key);
                    }
                    WatchEvent::Corrupt { reason, version } => {
                        warn!(key = %key, reason, "a controller lease holds data that is not a lease record; not counting it");
                        m.record = None;
                        m.version = version;
                        m.observed_at = now;
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
