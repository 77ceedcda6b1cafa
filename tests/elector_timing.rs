//! Deterministic elector tests on the memory store with Tokio's paused clock: exact instants
//! for expiry takeover, step-down at the renew deadline, release handover and jittered polling.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use leasehold::fault::{FaultyStore, Op};
use leasehold::{
    Capabilities, DynLeaseStore, Elector, ElectorConfig, LeaderStatus, LeaseKey, LeaseRecord,
    LeaseStore, MemoryStore,
};
use tokio::sync::watch;
use tokio::time::{Instant, sleep};

const LEASE: Duration = Duration::from_secs(15);
const RENEW: Duration = Duration::from_secs(10);
const RETRY: Duration = Duration::from_secs(2);
/// Tokio's timer wheel has millisecond resolution.
const TICK: Duration = Duration::from_millis(1);

fn key() -> LeaseKey {
    LeaseKey::new("timing").expect("valid key")
}

fn config(id: &str) -> ElectorConfig {
    ElectorConfig::new(key(), id).with_timings(LEASE, RENEW, RETRY)
}

fn spawn(store: DynLeaseStore, id: &str) -> Elector {
    Elector::spawn(store, config(id)).expect("valid config")
}

async fn leading(rx: &mut watch::Receiver<LeaderStatus>) -> leasehold::Leadership {
    let s = rx
        .wait_for(LeaderStatus::is_leading)
        .await
        .expect("elector alive");
    s.leadership().cloned().expect("leading")
}

async fn not_leading(rx: &mut watch::Receiver<LeaderStatus>) -> Instant {
    rx.wait_for(|s| !s.is_leading())
        .await
        .expect("elector alive");
    Instant::now()
}

fn assert_at(what: &str, got: Instant, want: Instant) {
    assert!(
        got >= want && got <= want + TICK,
        "{what}: happened at {:?} after the expected instant (want 0..=1ms); early by {:?}",
        got.saturating_duration_since(want),
        want.saturating_duration_since(got)
    );
}

/// A follower takes a silent holder's lease at the exact expiry instant: the moment it observed
/// the last renewal plus the lease duration.
#[tokio::test(start_paused = true)]
async fn expiry_takeover_at_the_exact_instant() {
    let shared: DynLeaseStore = Arc::new(MemoryStore::new());
    let ha = FaultyStore::new(shared.clone());
    let a = spawn(Arc::new(ha.clone()), "a");
    let mut ra = a.subscribe();
    let la = leading(&mut ra).await;
    let t0 = la.since();
    let b = spawn(shared.clone(), "b");
    let mut rb = b.subscribe();
    // Renewals happen at t0 + k·RETRY; cut a off between the 2nd and 3rd.
    sleep(RETRY * 2 + RETRY / 2).await;
    ha.faults().set_partitioned(true);
    let last_renewal = t0 + RETRY * 2;
    let tb = leading(&mut rb).await;
    assert_at("takeover", tb.since(), last_renewal + LEASE);
    assert!(
        tb.fencing_token() > la.fencing_token(),
        "the takeover has a higher token"
    );
    a.shutdown().await.expect("the elector shuts down cleanly");
    b.shutdown().await.expect("the elector shuts down cleanly");
}

/// A leader whose renewals fail steps down exactly at its renew deadline, measured from when it
/// sent its last successful renewal.
#[tokio::test(start_paused = true)]
async fn step_down_at_the_renew_deadline() {
    let shared: DynLeaseStore = Arc::new(MemoryStore::new());
    let ha = FaultyStore::new(shared);
    let a = spawn(Arc::new(ha.clone()), "a");
    let mut ra = a.subscribe();
    let t0 = leading(&mut ra).await.since();
    sleep(RETRY + RETRY / 2).await;
    ha.faults().fail_for(Duration::from_secs(3600));
    let down = not_leading(&mut ra).await;
    assert_at("step-down", down, t0 + RETRY + RENEW);
    assert!(a.check_health().is_ok(), "not leading is healthy");
    a.shutdown().await.expect("the elector shuts down cleanly");
}

/// Transient renewal errors shorter than the renew deadline do not cost the lease.
#[tokio::test(start_paused = true)]
async fn transient_renew_errors_are_retried() {
    let shared: DynLeaseStore = Arc::new(MemoryStore::new());
    let ha = FaultyStore::new(shared.clone());
    let a = spawn(Arc::new(ha.clone()), "a");
    let mut ra = a.subscribe();
    let term = leading(&mut ra).await;
    ha.faults().fail_for(RENEW / 2);
    sleep(RENEW * 2).await;
    let now = a.current_status().0;
    assert_eq!(now.leadership(), Some(&term), "still the same term");
    let rec = shared.get(&key()).await.expect("get").expect("present");
    assert_eq!(rec.record.holder_identity, "a");
    a.shutdown().await.expect("the elector shuts down cleanly");
}

/// On release, a watching follower acquires at the same instant (no sleep on that path).
#[tokio::test(start_paused = true)]
async fn release_handover_is_immediate() {
    let shared: DynLeaseStore = Arc::new(MemoryStore::new());
    let a = spawn(shared.clone(), "a");
    leading(&mut a.subscribe()).await;
    let b = spawn(shared.clone(), "b");
    let mut rb = b.subscribe();
    rb.wait_for(|s| s.leader() == Some("a"))
        .await
        .expect("alive");
    sleep(Duration::from_millis(3333)).await;
    let released = Instant::now();
    a.shutdown().await.expect("the elector shuts down cleanly");
    let tb = leading(&mut rb).await;
    assert_eq!(tb.since(), released, "b acquired at the release instant");
    b.shutdown().await.expect("the elector shuts down cleanly");
}

/// Expiry is judged by the follower's own clock: record timestamps in the past or the future
/// change nothing.
#[tokio::test(start_paused = true)]
async fn expiry_ignores_record_timestamps() {
    for renew_time in [
        SystemTime::UNIX_EPOCH + Duration::from_secs(946_684_800), // 2000
        SystemTime::UNIX_EPOCH + Duration::from_secs(4_102_444_800), // 2100
    ] {
        let shared: DynLeaseStore = Arc::new(MemoryStore::new());
        let ghost = LeaseRecord {
            holder_identity: "ghost".into(),
            lease_duration: Duration::from_secs(30),
            acquire_time: Some(renew_time),
            renew_time: Some(renew_time),
            transitions: 5,
        };
        shared.create(&key(), &ghost).await.expect("create");
        let start = Instant::now();
        let b = spawn(shared.clone(), "b");
        let mut rb = b.subscribe();
        rb.wait_for(|s| s.leader() == Some("ghost"))
            .await
            .expect("alive");
        let tb = leading(&mut rb).await;
        assert_at("takeover", tb.since(), start + Duration::from_secs(30));
        assert_eq!(tb.fencing_token(), 6);
        b.shutdown().await.expect("the elector shuts down cleanly");
    }
}

/// A changing corrupt value is never overwritten; once it stays unchanged for a lease duration
/// it is replaced, with a fencing token from the store's seed (above every earlier revision).
#[tokio::test(start_paused = true)]
async fn corrupt_data_is_replaced_only_after_it_stays_unchanged() {
    let mem = MemoryStore::new();
    mem.write_corrupt(&key(), "foreign bytes 1");
    let shared: DynLeaseStore = Arc::new(mem.clone());
    let b = spawn(shared.clone(), "b");
    let mut rb = b.subscribe();
    sleep(LEASE - Duration::from_secs(1)).await;
    assert!(!b.is_leading());
    let rewritten = Instant::now();
    let v2 = mem.write_corrupt(&key(), "foreign bytes 2");
    let tb = leading(&mut rb).await;
    assert_at("takeover", tb.since(), rewritten + LEASE);
    let rev: u64 = v2.as_str().parse().expect("memory versions are numbers");
    assert!(
        tb.fencing_token() > rev,
        "token {} from the store's seed is above revision {rev}",
        tb.fencing_token()
    );
    b.shutdown().await.expect("the elector shuts down cleanly");
}

#[tokio::test(start_paused = true)]
async fn polling_follower_jitters_within_bounds() {
    let mem = MemoryStore::new();
    let a = spawn(Arc::new(mem.clone()), "a");
    leading(&mut a.subscribe()).await;
    // A store that cannot watch: the follower polls, each wait between RETRY and 2.2 × RETRY.
    let poll = FaultyStore::new(Arc::new(mem)).with_capabilities(Capabilities::POLL);
    poll.faults().set_call_log(true);
    let b = spawn(Arc::new(poll.clone()), "b");
    sleep(RETRY * 120).await;
    assert!(!b.is_leading());
    let gets = poll.faults().call_times(Op::Get);
    assert!(gets.len() > 50, "polled {} times", gets.len());
    let gaps: Vec<Duration> = gets.windows(2).map(|w| w[1] - w[0]).collect();
    for g in &gaps {
        assert!(
            *g >= RETRY && *g <= RETRY.mul_f64(2.2) + TICK,
            "poll gap {g:?} outside [{RETRY:?}, 2.2 × {RETRY:?}]"
        );
    }
    let distinct: std::collections::HashSet<_> = gaps.iter().collect();
    assert!(distinct.len() > 10, "polls are jittered, not on a grid");
    a.shutdown().await.expect("the elector shuts down cleanly");
    b.shutdown().await.expect("the elector shuts down cleanly");
}

/// Yield keeps a lone elector from campaigning for exactly the yield time.
#[tokio::test(start_paused = true)]
async fn yield_holds_off_for_exactly_the_duration() {
    let shared: DynLeaseStore = Arc::new(MemoryStore::new());
    let a = spawn(shared, "a");
    let mut ra = a.subscribe();
    let t0 = leading(&mut ra).await.fencing_token();
    let start = Instant::now();
    a.yield_for(Duration::from_secs(42)).await.expect("yield");
    let t1 = leading(&mut ra).await;
    assert_at("re-acquire", t1.since(), start + Duration::from_secs(42));
    assert!(t1.fencing_token() > t0, "the next term has a higher token");
    a.shutdown().await.expect("the elector shuts down cleanly");
}

/// A missing record may have been deleted or lost while a term on it was valid: it is created
/// only a whole lease duration after the key was first seen absent, never sooner.
#[tokio::test(start_paused = true)]
async fn a_missing_record_is_created_a_lease_after_it_was_seen_absent() {
    let shared: DynLeaseStore = Arc::new(MemoryStore::new());
    let started = Instant::now();
    let a = spawn(shared.clone(), "a");
    let mut ra = a.subscribe();
    let la = leading(&mut ra).await;
    assert_at("creation", la.since(), started + LEASE);
    a.shutdown().await.expect("the elector shuts down cleanly");
}

/// With `trust_absence`, a missing record is created at once (client-go's behaviour).
#[tokio::test(start_paused = true)]
async fn trust_absence_creates_a_missing_record_at_once() {
    let shared: DynLeaseStore = Arc::new(MemoryStore::new());
    let started = Instant::now();
    let a =
        Elector::spawn(shared.clone(), config("a").with_trust_absence(true)).expect("valid config");
    let mut ra = a.subscribe();
    let la = leading(&mut ra).await;
    assert_at("creation", la.since(), started);
    a.shutdown().await.expect("the elector shuts down cleanly");
}
