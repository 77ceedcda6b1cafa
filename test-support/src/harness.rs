//! A handover/failover benchmark harness that works over any store.
//!
//! Used by `benches/handover.rs` (memory store) and by each backend's own bench. It measures:
//! - **graceful handover**: from the leader's `shutdown()` call (which writes the release) until
//!   a waiting, watching follower reports leading;
//! - **crash failover**: the leader is cut off right after a renewal was seen in the store; the
//!   excess is the time until a follower leads minus the lease duration;
//! - **steady-state requests**: store requests per second sent by a follower, and writes per
//!   second by the leader.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::time::{Instant, timeout};

use leasehold::fault::FaultyStore;
use leasehold::{DynLeaseStore, Elector, ElectorConfig, LeaderStatus, LeaseKey, WatchEvent};

/// Percentile summary of a sample set.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Number of samples.
    pub n: usize,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Largest sample.
    pub max: Duration,
    /// Smallest sample.
    pub min: Duration,
}

impl Stats {
    /// Summarises `samples`.
    pub fn of(mut samples: Vec<Duration>) -> Stats {
        samples.sort();
        let n = samples.len();
        if n == 0 {
            return Stats::default();
        }
        let at = |q: f64| samples[((q * (n - 1) as f64).round() as usize).min(n - 1)];
        Stats {
            n,
            p50: at(0.5),
            p99: at(0.99),
            max: samples[n - 1],
            min: samples[0],
        }
    }
}

impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "n={} min={:?} p50={:?} p99={:?} max={:?}",
            self.n, self.min, self.p50, self.p99, self.max
        )
    }
}

/// Harness settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Graceful handover rounds.
    pub handover_rounds: usize,
    /// Crash failover rounds.
    pub failover_rounds: usize,
    /// Steady-state observation window.
    pub steady_window: Duration,
    /// Lease duration (whole seconds for stores that round).
    pub lease: Duration,
    /// Renew deadline.
    pub renew: Duration,
    /// Retry period.
    pub retry: Duration,
}

impl Settings {
    /// The default settings, or fewer rounds and a shorter window when the program was started
    /// with `--quick` (as in `cargo bench --bench handover -- --quick`).
    pub fn from_args() -> Settings {
        let mut s = Settings::default();
        if std::env::args().any(|a| a == "--quick") {
            s.handover_rounds = 50;
            s.failover_rounds = 2;
            s.steady_window = Duration::from_secs(2);
        }
        s
    }
}

/// The `main` of a store's handover bench: builds a runtime, makes the store (`make` returns a
/// description for the report and the store), runs [`run`] with [`Settings::from_args`] and
/// prints the report.
///
/// # Panics
/// When the runtime cannot be built or the store misbehaves.
pub fn bench_main<F, Fut>(make: F)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = (String, DynLeaseStore)>,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("harness: cannot build a Tokio runtime: {e}"));
    rt.block_on(async {
        let settings = Settings::from_args();
        let (what, store) = make().await;
        println!("leasehold handover benchmark: {what}, {settings:?}");
        print!("{}", run(store, &settings).await);
    });
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            handover_rounds: 200,
            failover_rounds: 5,
            steady_window: Duration::from_secs(5),
            lease: Duration::from_secs(1),
            renew: Duration::from_millis(600),
            retry: Duration::from_millis(200),
        }
    }
}

/// What the harness measured.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Graceful handover latency.
    pub handover: Stats,
    /// Crash failover time minus the lease duration.
    pub failover_excess: Stats,
    /// Follower store requests per second in steady state.
    pub follower_requests_per_sec: f64,
    /// Leader store writes per second in steady state.
    pub leader_writes_per_sec: f64,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "graceful handover:        {}", self.handover)?;
        writeln!(f, "crash failover excess:    {}", self.failover_excess)?;
        writeln!(
            f,
            "steady state:             follower {:.2} requests/s, leader {:.2} writes/s",
            self.follower_requests_per_sec, self.leader_writes_per_sec
        )
    }
}

const LIMIT: Duration = Duration::from_secs(60);

async fn until_leading(e: &Elector) -> Instant {
    let mut rx = e.subscribe();
    match timeout(LIMIT, rx.wait_for(LeaderStatus::is_leading)).await {
        Ok(Ok(_)) => Instant::now(),
        _ => panic!("harness: no leadership within {LIMIT:?}"),
    }
}

async fn until_following(e: &Elector, leader: &str) {
    let mut rx = e.subscribe();
    if !matches!(
        timeout(LIMIT, rx.wait_for(|s| s.leader() == Some(leader))).await,
        Ok(Ok(_))
    ) {
        panic!("harness: follower never saw {leader} lead");
    }
}

fn key(tag: &str) -> LeaseKey {
    let k = format!("bench-{tag}-{:016x}", rand::random::<u64>());
    LeaseKey::new(&k).unwrap_or_else(|e| panic!("harness key {k:?}: {e}"))
}

fn spawn(store: &FaultyStore, key: &LeaseKey, id: &str, s: &Settings) -> Elector {
    let cfg = ElectorConfig::new(key.clone(), id).with_timings(s.lease, s.renew, s.retry);
    Elector::spawn(Arc::new(store.clone()), cfg).unwrap_or_else(|e| panic!("harness: {e}"))
}

/// Runs every measurement against `store`.
///
/// # Panics
/// When the store misbehaves (no leader within a minute).
///
/// # Cancel safety
/// Not cancel safe: dropping it mid-way leaves electors to shut down in the background.
pub async fn run(store: DynLeaseStore, s: &Settings) -> Report {
    let mut report = Report::default();

    // Graceful handover: A leads, B waits (watching); A shuts down; B leads.
    let mut samples = Vec::with_capacity(s.handover_rounds);
    let k = key("handover");
    let mut leader = spawn(&FaultyStore::new(store.clone()), &k, "h-0", s);
    until_leading(&leader).await;
    for round in 1..=s.handover_rounds {
        let id = format!("h-{round}");
        let next = spawn(&FaultyStore::new(store.clone()), &k, &id, s);
        until_following(&next, &leader.config().identity).await;
        // Let the follower's watch settle.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let start = Instant::now();
        let (_, led) = tokio::join!(leader.shutdown(), until_leading(&next));
        samples.push(led.duration_since(start));
        leader = next;
    }
    report.handover = Stats::of(samples);

    // Steady state with the current leader and a fresh follower.
    let hf = FaultyStore::new(store.clone());
    let follower = spawn(&hf, &k, "steady-follower", s);
    until_following(&follower, &leader.config().identity).await;
    tokio::time::sleep(s.retry * 2).await;
    let r0 = hf.faults().requests();
    let start = Instant::now();
    tokio::time::sleep(s.steady_window).await;
    let secs = start.elapsed().as_secs_f64();
    report.follower_requests_per_sec = (hf.faults().requests() - r0) as f64 / secs;
    // The leader's writes, read from the store's watch of the key.
    let mut w = store
        .watch(&k, None)
        .await
        .unwrap_or_else(|e| panic!("harness watch: {e}"));
    let _ = w.next().await;
    let start = Instant::now();
    let mut writes = 0u64;
    while start.elapsed() < s.steady_window {
        if let Ok(Some(Ok(WatchEvent::Put(_)))) = timeout(s.steady_window, w.next()).await {
            writes += 1;
        }
    }
    report.leader_writes_per_sec = writes as f64 / start.elapsed().as_secs_f64();
    drop(w);
    follower
        .shutdown()
        .await
        .expect("the elector shuts down cleanly");
    leader
        .shutdown()
        .await
        .expect("the elector shuts down cleanly");

    // Crash failover: cut the leader off right after one of its renewals lands.
    let mut samples = Vec::with_capacity(s.failover_rounds);
    for round in 0..s.failover_rounds {
        let k = key("failover");
        let ha = FaultyStore::new(store.clone());
        let a = spawn(&ha, &k, &format!("f-a-{round}"), s);
        until_leading(&a).await;
        let b = spawn(
            &FaultyStore::new(store.clone()),
            &k,
            &format!("f-b-{round}"),
            s,
        );
        until_following(&b, &a.config().identity).await;
        let mut w = store
            .watch(&k, None)
            .await
            .unwrap_or_else(|e| panic!("harness watch: {e}"));
        let _ = w.next().await; // current state
        let _ = timeout(LIMIT, w.next()).await; // a renewal
        let renewed = Instant::now();
        ha.faults().set_partitioned(true);
        let led = until_leading(&b).await;
        let took = led.duration_since(renewed);
        samples.push(took.saturating_sub(s.lease));
        a.shutdown().await.expect("the elector shuts down cleanly");
        b.shutdown().await.expect("the elector shuts down cleanly");
    }
    report.failover_excess = Stats::of(samples);
    report
}
