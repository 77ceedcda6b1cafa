//! The controller lease counter's improvements over k0s, on the memory store with paused time:
//! skew-safe expiry by local observation, prompt discovery through the doorbell, and the
//! polling fallback without a doorbell.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use leasehold::k0s::conformance::wait_count;
use leasehold::k0s::{ControllerCounter, CounterConfig};
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

/// A foreign controller's record whose wall-clock renew time is a day in the past (a skewed
/// clock): k0s would count it as expired; we count it until `lease_duration` has passed on our
/// own clock since we saw it change, and not a moment longer.
#[tokio::test(start_paused = true)]
async fn k0s_counter_expiry_by_local_observation() {
    let mem = Arc::new(MemoryStore::new());
    let store: DynLeaseStore = mem.clone();
    let prefix = KeyPrefix::new("k0s-ctrl-").expect("prefix");
    let day_ago = SystemTime::now() - Duration::from_secs(86_400);
    let foreign = LeaseRecord {
        holder_identity: "skewed".into(),
        lease_duration: Duration::from_secs(25),
        acquire_time: Some(day_ago),
        renew_time: Some(day_ago),
        transitions: 0,
    };
    let key = LeaseKey::new("k0s-ctrl-skewed").expect("key");
    mem.create(&key, &foreign).await.expect("create");
    let start = Instant::now();
    let a = ControllerCounter::start(store, config(&prefix, "a")).expect("start");
    wait_count(&a, 2).await;
    // The foreign lease is never renewed: it counts until 25 s after we first saw it.
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
