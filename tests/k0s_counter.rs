//! The controller lease counter on the memory store with paused time: where it behaves like
//! k0s (start at 1, keep the last count during an outage, drop leases that were dead at
//! start-up) and its improvements (skew-safe expiry by local observation after start-up, prompt
//! discovery through the doorbell, the polling fallback without a doorbell).

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use leasehold::fault::FaultyStore;
use leasehold::k0s::conformance::wait_count;
use leasehold::k0s::{ControllerCounter, CounterConfig, INITIAL_COUNT};
use leasehold::{DynLeaseStore, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, MemoryStore};
use tokio::time::Instant;

const LEASE: Duration = Duration::from_secs(20);
const RENEW: Duration = Duration::from_secs(10);
const RETRY: Duration = Duration::from_secs(2);

fn config(prefix: &KeyPrefix, node: &str) -> CounterConfig {
    CounterConfig::new(prefix.clone(), node)
        .expect("config")
        .with_identity(format!("{node}-id"))
        .with_timings(LEASE, RENEW, RETRY)
}

fn foreign(holder: &str, renewed: SystemTime) -> LeaseRecord {
    LeaseRecord {
        holder_identity: holder.into(),
        lease_duration: Duration::from_secs(25),
        acquire_time: Some(renewed),
        renew_time: Some(renewed),
        transitions: 0,
    }
}

/// Records the distinct counts `counter` publishes from now on.
fn record_counts(counter: &ControllerCounter) -> Arc<Mutex<Vec<usize>>> {
    let mut rx = counter.subscribe();
    let history = Arc::new(Mutex::new(vec![*rx.borrow_and_update()]));
    let h = history.clone();
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let n = *rx.borrow_and_update();
            let mut h = h.lock().unwrap_or_else(|e| e.into_inner());
            if h.last() != Some(&n) {
                h.push(n);
            }
        }
    });
    history
}

fn history(h: &Arc<Mutex<Vec<usize>>>) -> Vec<usize> {
    h.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Leases found at start-up are judged by their own renew time (with the skew tolerance): one
/// whose renew time is a day old was dead before the counter started and is never counted (k0s
/// drops it at once, too). After that, expiry is by local observation: a lease renewed "now",
/// and one whose writer's clock runs an hour ahead, both count until 25 s (their lease
/// duration) have passed on our own clock without a change, not a moment longer and not an
/// hour.
#[tokio::test(start_paused = true)]
async fn k0s_counter_expiry_by_local_observation() {
    let mem = Arc::new(MemoryStore::new());
    let store: DynLeaseStore = mem.clone();
    let prefix = KeyPrefix::new("k0s-ctrl-").expect("prefix");
    let now = SystemTime::now();
    for (name, renewed) in [
        ("dead", now - Duration::from_secs(86_400)),
        ("fresh", now),
        ("ahead", now + Duration::from_secs(3_600)),
    ] {
        let key = LeaseKey::new(format!("k0s-ctrl-{name}")).expect("key");
        mem.create(&key, &foreign(name, renewed))
            .await
            .expect("create");
    }
    let start = Instant::now();
    let a = ControllerCounter::start(store, config(&prefix, "a")).expect("start");
    let counts = record_counts(&a);
    wait_count(&a, 3).await;
    // Neither renewed: they count until 25 s after we first saw them.
    wait_count(&a, 1).await;
    let dropped_after = start.elapsed();
    assert!(
        dropped_after >= Duration::from_secs(25),
        "counted as expired after {dropped_after:?}, before its lease duration passed locally"
    );
    assert!(
        dropped_after < Duration::from_secs(25) + RETRY,
        "expiry is detected at the expiry instant, not on a polling grid: {dropped_after:?}"
    );
    assert_eq!(
        history(&counts),
        vec![1, 3, 1],
        "the dead lease was counted (or an unobserved count was published)"
    );
    a.stop().await;
}

/// During a store outage the count stays at the last listed value (as in k0s), however long the
/// outage lasts: leases that are not seen to change are dropped only once a list confirms them
/// unchanged after their expiry, and no list succeeds meanwhile.
#[tokio::test(start_paused = true)]
async fn k0s_counter_keeps_the_last_count_during_an_outage() {
    let mem: DynLeaseStore = Arc::new(MemoryStore::new());
    let prefix = KeyPrefix::new("k0s-ctrl-").expect("prefix");
    let faulty = FaultyStore::new(mem.clone());
    let faults = faulty.faults().clone();
    let a = ControllerCounter::start(Arc::new(faulty), config(&prefix, "a")).expect("start a");
    let b = ControllerCounter::start(mem.clone(), config(&prefix, "b")).expect("start b");
    wait_count(&a, 2).await;
    wait_count(&b, 2).await;
    tokio::time::sleep(RETRY).await;
    let during = record_counts(&a);
    // a is cut off from the store for five lease durations.
    faults.set_partitioned(true);
    tokio::time::sleep(LEASE * 5).await;
    assert_eq!(
        history(&during),
        vec![2],
        "a published a count it never observed during the outage"
    );
    // b saw a's lease expire (a could not renew it).
    wait_count(&b, 1).await;
    faults.heal();
    wait_count(&a, 2).await;
    wait_count(&b, 2).await;
    b.stop().await;
    wait_count(&a, 1).await;
    a.stop().await;
}

/// The count starts at 1 (this controller, as k0s assumes) and is kept when the store cannot be
/// reached at all: no list ever succeeded, so nothing was observed.
#[tokio::test(start_paused = true)]
async fn k0s_counter_starts_at_one_and_keeps_it_without_a_store() {
    let faulty = FaultyStore::new(Arc::new(MemoryStore::new()));
    faulty.faults().set_partitioned(true);
    let prefix = KeyPrefix::new("k0s-ctrl-").expect("prefix");
    let a = ControllerCounter::start(Arc::new(faulty), config(&prefix, "a")).expect("start a");
    let counts = record_counts(&a);
    tokio::time::sleep(LEASE * 3).await;
    assert_eq!(history(&counts), vec![INITIAL_COUNT]);
    assert_eq!(INITIAL_COUNT, 1);
    a.stop().await;
}

/// A new member is discovered through the doorbell without waiting for a re-list (paused
/// time: no time passes at all), and a member's release is seen at once.
#[tokio::test(start_paused = true)]
async fn k0s_counter_discovers_members_promptly() {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let prefix = KeyPrefix::new("k0s-ctrl-").expect("prefix");
    let a = ControllerCounter::start(store.clone(), config(&prefix, "a")).expect("start a");
    wait_count(&a, 1).await;
    // Let a settle into its steady state (next safety re-list is a lease duration away).
    tokio::time::sleep(RETRY).await;
    let t0 = Instant::now();
    let b = ControllerCounter::start(store.clone(), config(&prefix, "b")).expect("start b");
    wait_count(&a, 2).await;
    assert!(
        t0.elapsed() < RETRY,
        "b was found by a re-list ({:?}), not by the doorbell",
        t0.elapsed()
    );
    let t1 = Instant::now();
    b.stop().await;
    wait_count(&a, 1).await;
    assert!(t1.elapsed() < RETRY, "the release was not seen at once");
    a.stop().await;
}

/// Without a doorbell, new members are found by the re-list every retry period.
#[tokio::test(start_paused = true)]
async fn k0s_counter_without_doorbell_relists() {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let prefix = KeyPrefix::new("ctrl-").expect("prefix");
    let a = ControllerCounter::start(store.clone(), config(&prefix, "a").with_doorbell(None))
        .expect("start a");
    wait_count(&a, 1).await;
    let b = ControllerCounter::start(store.clone(), config(&prefix, "b").with_doorbell(None))
        .expect("start b");
    wait_count(&a, 2).await;
    b.stop().await;
    wait_count(&a, 1).await;
    a.stop().await;
}

/// Configuration checks: the doorbell must not be under the counted prefix.
#[tokio::test]
async fn k0s_counter_rejects_doorbell_under_prefix() {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let prefix = KeyPrefix::new("ctrl-").expect("prefix");
    let bad = config(&prefix, "a").with_doorbell(Some(LeaseKey::new("ctrl-bell").expect("key")));
    assert!(ControllerCounter::start(store, bad).is_err());
    // The default doorbell of a prefix without a trailing separator would be under it: none.
    let p = KeyPrefix::new("ctrl").expect("prefix");
    assert_eq!(CounterConfig::new(p, "x").expect("config").doorbell, None);
}

/// Schedule 7 of issue 18: `relist_interval = Duration::MAX` panicked the counting task (the
/// count stayed 1 forever). Every duration knob of the counter is bounded at start.
#[tokio::test(start_paused = true)]
async fn absurd_durations_are_rejected_with_a_typed_error() {
    let prefix = KeyPrefix::new("absurd-").expect("prefix");
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    type Knob = fn(&mut CounterConfig);
    let knobs: [(&str, Knob); 4] = [
        ("relist_interval", |c| c.relist_interval = Duration::MAX),
        ("lease_duration", |c| c.lease_duration = Duration::MAX),
        ("renew_deadline", |c| c.renew_deadline = Duration::MAX),
        ("skew_tolerance", |c| c.skew_tolerance = Duration::MAX),
    ];
    for (name, set) in knobs {
        let mut c = config(&prefix, "n1");
        set(&mut c);
        match ControllerCounter::start(store.clone(), c) {
            Err(leasehold::Error::InvalidConfig(m)) => {
                assert!(m.contains(name), "{name}: the message names it: {m}");
            }
            Err(e) => panic!("{name}: expected InvalidConfig, got {e}"),
            Ok(_) => panic!("{name}: Duration::MAX must be rejected"),
        }
    }
}
