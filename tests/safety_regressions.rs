//! One named regression test per schedule of the elector safety review (issue "Elector safety and
//! liveness"), against the real tokio driver and the memory store. Most run on Tokio's paused
//! clock and assert exact instants or orderings; the simulator (`tests/simulator.rs`) explores
//! the same faults at random.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use leasehold::fault::{FaultyStore, Op};
use leasehold::{
    Capabilities, DynLeaseStore, Elector, ElectorConfig, Error, LeaderStatus, LeaseKey,
    LeaseRecord, LeaseStore, MemoryStore, run_leader_tasks,
};
use tokio::sync::watch;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

const LEASE: Duration = Duration::from_secs(15);
const RENEW: Duration = Duration::from_secs(10);
const RETRY: Duration = Duration::from_secs(2);
const TICK: Duration = Duration::from_millis(1);

fn key() -> LeaseKey {
    LeaseKey::new("safety").expect("valid key")
}

fn config(id: &str) -> ElectorConfig {
    ElectorConfig::new(key(), id).with_timings(LEASE, RENEW, RETRY)
}

/// The memory store under fault control, keeping times to the microsecond as the Redis/etcd
/// codecs and kube's MicroTime do, reporting `capabilities` (without commit tokens: the elector
/// computes its tokens from the store's fencing seed, as on a store that keeps no counter).
fn faulty(mem: &MemoryStore, capabilities: Capabilities) -> FaultyStore {
    FaultyStore::new(Arc::new(mem.clone()))
        .with_capabilities(capabilities)
        .with_microsecond_times()
}

/// A watching store (see [`faulty`]).
fn watching(mem: &MemoryStore) -> FaultyStore {
    faulty(mem, Capabilities::WATCH)
}

/// A store that cannot watch (see [`faulty`]): the elector polls.
fn polling(mem: &MemoryStore) -> FaultyStore {
    faulty(mem, Capabilities::POLL)
}

/// Virtual time a wait may take before the test fails (the clock is paused: this costs nothing).
const PATIENCE: Duration = Duration::from_secs(3600);

async fn leading(rx: &mut watch::Receiver<LeaderStatus>) -> leasehold::Leadership {
    let s = tokio::time::timeout(PATIENCE, rx.wait_for(LeaderStatus::is_leading))
        .await
        .expect("leads within an hour")
        .expect("elector alive");
    s.leadership().cloned().expect("leading")
}

async fn not_leading(rx: &mut watch::Receiver<LeaderStatus>) -> Instant {
    tokio::time::timeout(PATIENCE, rx.wait_for(|s| !s.is_leading()))
        .await
        .expect("steps down within an hour")
        .expect("elector alive");
    Instant::now()
}

/// A released record, so a first candidate acquires at once (a missing one waits a lease).
async fn released(store: &MemoryStore) {
    let store: DynLeaseStore = Arc::new(store.clone());
    leasehold::conformance::create_released(&store, &key()).await;
}

/// Schedule 1: a watch that errors on every (re)open neither starves the leader's renewals nor
/// spins: the leader keeps renewing every retry period, and re-opens back off.
#[tokio::test(start_paused = true)]
async fn s01_a_watch_failing_on_every_open_does_not_starve_renewals() {
    let mem = MemoryStore::new();
    released(&mem).await;
    let store = watching(&mem);
    store.faults().set_watch_streams_fail(true);
    let a = Elector::spawn(Arc::new(store.clone()), config("a")).expect("valid config");
    let mut ra = a.subscribe();
    let term = leading(&mut ra).await;
    let before = store.faults().calls(Op::Update);
    sleep(LEASE * 4).await;
    assert!(
        ra.borrow().leadership().is_some_and(|l| l.same_term(&term)),
        "still leading the same term after four lease durations"
    );
    let renewals = store.faults().calls(Op::Update) - before;
    let expected = (LEASE * 4).as_secs() / RETRY.as_secs();
    assert!(
        renewals >= expected - 1,
        "renewed {renewals} times in {:?}; every {RETRY:?} would be {expected}",
        LEASE * 4
    );
    let opens = store.faults().calls(Op::Watch);
    assert!(
        opens < 4 * expected,
        "{opens} watch opens in {:?}: re-opening must back off",
        LEASE * 4
    );
    a.shutdown().await.expect("clean shutdown");
}

/// Schedule 2: the step-down is a timer. Renewals that hang for 7.5 s each do not keep the leader
/// leading past its deadline: it steps down exactly at the instant its last confirmed renewal was
/// sent plus the renew deadline, while a renewal is still in flight.
#[tokio::test(start_paused = true)]
async fn s02_the_term_ends_at_its_deadline_even_with_a_renewal_in_flight() {
    let mem = MemoryStore::new();
    released(&mem).await;
    let store = watching(&mem);
    let a = Elector::spawn(Arc::new(store.clone()), config("a")).expect("valid config");
    let mut ra = a.subscribe();
    let term = leading(&mut ra).await;
    // Renewals from now on hang for 7.5 s (inside the renew deadline) and then fail, so no
    // renewal is confirmed again while one is nearly always in flight.
    sleep(RETRY / 2).await;
    let last_confirmed = term.valid_until().expect("valid") - RENEW;
    store
        .faults()
        .set_delay(Op::Update, Duration::from_millis(7500));
    store.faults().set_failing(&[Op::Create, Op::Update], true);
    let down = not_leading(&mut ra).await;
    assert!(
        down >= last_confirmed + RENEW && down <= last_confirmed + RENEW + TICK,
        "stepped down {:?} after the last confirmed renewal was sent; want {RENEW:?}",
        down - last_confirmed
    );
    assert!(term.ensure_leading().is_err());
    a.shutdown().await.expect("clean shutdown");
}

/// Schedule 3: a paused leader (here: its runtime thread blocked, as SIGSTOP or a GC pause would)
/// resumes with a term whose validity has passed. Its status still says leading until the
/// elector runs again, but the deadline check says no, before any side effect.
#[test]
fn s03_a_paused_leader_cannot_act_on_its_term_after_resuming() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mem = MemoryStore::new();
        released(&mem).await;
        let cfg = ElectorConfig::new(key(), "a").with_timings(
            Duration::from_secs(2),
            Duration::from_millis(600),
            Duration::from_millis(200),
        );
        let a = Elector::spawn(Arc::new(mem.clone()), cfg).expect("valid config");
        let mut ra = a.subscribe();
        let term = leading(&mut ra).await;
        assert_eq!(term.ensure_leading().ok(), Some(term.fencing_token()));
        // Block the only runtime thread: nothing of the elector can run meanwhile.
        std::thread::sleep(Duration::from_millis(1500));
        assert!(
            ra.borrow().is_leading_variant(),
            "the elector has not run yet, so its published status is stale"
        );
        assert!(
            !ra.borrow().is_leading(),
            "but a Leading status past its deadline does not say leading"
        );
        assert_eq!(a.leader(), None, "nor does the elector's leader()");
        let err = term
            .ensure_leading()
            .expect_err("the term's validity passed during the pause");
        assert!(matches!(err, Error::NotLeading { .. }), "{err}");
        assert!(!a.is_leading(), "is_leading checks the deadline too");
        a.shutdown().await.expect("clean shutdown");
    });
}

/// Schedule 4: after the record is deleted (`kubectl delete lease`, data loss), the next leader's
/// fencing token is still greater than every earlier one.
#[tokio::test(start_paused = true)]
async fn s04_fencing_tokens_never_repeat_after_the_record_is_deleted() {
    let mem = MemoryStore::new();
    let store: DynLeaseStore = Arc::new(mem.clone());
    let mut last = None;
    for round in 0..3 {
        let e = Elector::spawn(store.clone(), config(&format!("e{round}"))).expect("valid");
        let t = leading(&mut e.subscribe()).await.fencing_token();
        if let Some(prev) = last {
            assert!(t > prev, "round {round}: token {t} after {prev}");
        }
        last = Some(t);
        e.shutdown().await.expect("clean shutdown");
        let v = mem.get(&key()).await.expect("get").expect("present");
        mem.delete(&key(), &v.version).await.expect("deleted");
    }
}

/// Schedule 5: ordered release really orders. While the leader task drains (slower than the
/// renew deadline), the lease is still renewed and the task may still act on its term; the next
/// leader starts only after the task finished.
#[tokio::test(start_paused = true)]
async fn s05_the_next_leader_starts_only_after_the_old_task_finished() {
    let mem = MemoryStore::new();
    released(&mem).await;
    let store: DynLeaseStore = Arc::new(mem.clone());
    let a = Arc::new(Elector::spawn(store.clone(), config("a")).expect("valid"));
    let term = leading(&mut a.subscribe()).await;
    let b = Elector::spawn(store.clone(), config("b")).expect("valid");
    let mut rb = b.subscribe();
    let stop = CancellationToken::new();
    let finished: Arc<Mutex<Option<(Instant, bool)>>> = Arc::default();
    let tasks = {
        let (a, stop, finished) = (a.clone(), stop.clone(), finished.clone());
        tokio::spawn(async move {
            run_leader_tasks(stop, a, move |leader| {
                let finished = finished.clone();
                async move {
                    leader.cancelled().await;
                    // Cleanup that outlasts the renew deadline, then a last fenced write.
                    sleep(RENEW * 2).await;
                    let ok = leader.ensure_leading().is_ok();
                    *finished.lock().expect("lock") = Some((Instant::now(), ok));
                }
            })
            .await;
        })
    };
    sleep(RETRY).await;
    let shutting = {
        let a = a.clone();
        tokio::spawn(async move { a.shutdown().await })
    };
    let lb = leading(&mut rb).await;
    let (done, valid_during_cleanup) = finished.lock().expect("lock").expect("task finished");
    assert!(
        lb.since() >= done,
        "b led at {:?}, before a's task finished at {:?}",
        lb.since(),
        done
    );
    assert!(
        valid_during_cleanup,
        "the draining term stays valid while the elector renews it"
    );
    assert!(term.ensure_leading().is_err(), "revoked before the release");
    assert!(lb.fencing_token() > term.fencing_token());
    shutting.await.expect("joined").expect("clean shutdown");
    stop.cancel();
    tasks.await.expect("joined");
    b.shutdown().await.expect("clean shutdown");
}

/// Schedule 6: a polling follower (a store without watch) takes over a crashed leader: each poll
/// of the unchanged record keeps the first observation time, so expiry comes a lease after it.
#[tokio::test(start_paused = true)]
async fn s06_a_polling_follower_takes_over_a_crashed_leader() {
    let mem = MemoryStore::new();
    released(&mem).await;
    let ha = polling(&mem);
    let a = Elector::spawn(Arc::new(ha.clone()), config("a")).expect("valid");
    leading(&mut a.subscribe()).await;
    let b = Elector::spawn(Arc::new(polling(&mem)), config("b")).expect("valid");
    let mut rb = b.subscribe();
    rb.wait_for(|s| s.leader() == Some("a"))
        .await
        .expect("alive");
    // a crashes: its writes fail from now on and it never releases.
    ha.faults().set_failing(&[Op::Create, Op::Update], true);
    let crashed = Instant::now();
    let lb = leading(&mut rb).await;
    let waited = lb.since() - crashed;
    assert!(
        waited <= LEASE + RETRY.mul_f64(2.2) + RETRY,
        "b took over {waited:?} after the crash; the last renewal is at most a retry period \
         old, b first sees it within 2.2 retry periods, and then waits a lease"
    );
    assert!(
        waited >= LEASE - RETRY,
        "not before the lease expired ({waited:?})"
    );
    a.shutdown().await.expect("clean shutdown");
    b.shutdown().await.expect("clean shutdown");
}

/// Schedule 7: ambiguous writes are recognised on stores that keep microseconds. A renewal that
/// landed but reported an error keeps the term; a create that landed but reported an error
/// makes the lone candidate lead at once, not a lease later.
#[tokio::test(start_paused = true)]
async fn s07_writes_that_landed_but_reported_an_error_are_recognised() {
    let mem = MemoryStore::new();
    released(&mem).await;
    let store = watching(&mem);
    store.faults().error_after_commit(1); // the acquisition itself
    let started = Instant::now();
    let a = Elector::spawn(Arc::new(store.clone()), config("a")).expect("valid");
    let mut ra = a.subscribe();
    let term = leading(&mut ra).await;
    assert!(
        term.since() - started < RETRY,
        "led {:?} after starting: the landed acquire was recognised",
        term.since() - started
    );
    store.faults().error_after_commit(3); // three renewals in a row land but report errors
    store.faults().replay_after_commit(2); // then two come back as a retried write's conflict
    sleep(LEASE * 2).await;
    assert!(
        ra.borrow().leadership().is_some_and(|l| l.same_term(&term)),
        "the term survived renewals that landed but reported errors"
    );
    a.shutdown().await.expect("clean shutdown");
}

/// Schedule 8: a foreign write that changes only the version (a label edit on a kube Lease) is
/// adopted: the leader neither steps down nor sits out a lease.
#[tokio::test(start_paused = true)]
async fn s08_a_version_only_change_is_adopted() {
    let mem = MemoryStore::new();
    released(&mem).await;
    let a = Elector::spawn(Arc::new(mem.clone()), config("a")).expect("valid");
    let mut ra = a.subscribe();
    let term = leading(&mut ra).await;
    for _ in 0..3 {
        sleep(RETRY / 2).await;
        let cur = mem.get(&key()).await.expect("get").expect("present");
        mem.update(&key(), &cur.record, &cur.version)
            .await
            .expect("a foreign no-op write");
        sleep(RETRY).await;
    }
    sleep(LEASE).await;
    assert!(
        ra.borrow().leadership().is_some_and(|l| l.same_term(&term)),
        "still the same term"
    );
    assert!(term.ensure_leading().is_ok());
    a.shutdown().await.expect("clean shutdown");
}

/// Schedule 9: no panics on any duration: `yield_for(Duration::MAX)` works and the elector stays
/// healthy; a record claiming a lease of u64::MAX seconds does not panic its followers.
#[tokio::test(start_paused = true)]
async fn s09_absurd_durations_do_not_panic() {
    let mem = MemoryStore::new();
    let store: DynLeaseStore = Arc::new(mem.clone());
    let now = SystemTime::now();
    mem.create(
        &key(),
        &LeaseRecord {
            holder_identity: "hostile".into(),
            lease_duration: Duration::from_secs(u64::MAX),
            acquire_time: Some(now),
            renew_time: Some(now),
            transitions: 7,
        },
    )
    .await
    .expect("created");
    let a = Elector::spawn(store.clone(), config("a")).expect("valid");
    let mut ra = a.subscribe();
    tokio::time::timeout(PATIENCE, ra.wait_for(|s| s.leader() == Some("hostile")))
        .await
        .expect("follows the hostile holder")
        .expect("alive");
    a.yield_for(Duration::MAX).await.expect("yield accepted");
    sleep(LEASE).await;
    assert!(a.check_health().is_ok(), "{:?}", a.check_health());
    a.yield_for(Duration::MAX).await.expect("still answering");
    assert!(
        ElectorConfig::new(key(), "b")
            .with_timings(Duration::MAX, RENEW, RETRY)
            .validate()
            .is_err(),
        "absurd timings are rejected by validation"
    );
    a.shutdown().await.expect("clean shutdown");
}

/// Schedule 10: a graceful stop while a renewal is in flight (it lands, then answers late)
/// awaits it and releases at the new version: the next candidate takes over at once. (On a store
/// without watch, so that no watch event tells the leader its renewal's version first.)
#[tokio::test(start_paused = true)]
async fn s10_shutdown_during_an_in_flight_renewal_still_releases() {
    let mem = MemoryStore::new();
    released(&mem).await;
    let store = polling(&mem);
    let a = Elector::spawn(Arc::new(store.clone()), config("a")).expect("valid");
    leading(&mut a.subscribe()).await;
    store
        .faults()
        .set_reply_delay(Op::Update, Duration::from_millis(800));
    // The next renewal is sent at RETRY after the acquisition; shut down 650 ms into it.
    sleep(RETRY + Duration::from_millis(650)).await;
    a.shutdown().await.expect("clean shutdown");
    let rec = mem.get(&key()).await.expect("get").expect("present");
    assert!(
        rec.record.is_vacant(),
        "released, not left to expire: {:?}",
        rec.record
    );
}

/// Ordered release with a task that ignores cancellation past the drain timeout: the term is
/// revoked at the drain timeout, the lease is not released but left to expire, and the next
/// leader starts only after that expiry.
#[tokio::test(start_paused = true)]
async fn s05b_tasks_outliving_the_drain_timeout_lose_their_term_and_the_lease_expires() {
    let mem = MemoryStore::new();
    released(&mem).await;
    let store: DynLeaseStore = Arc::new(mem.clone());
    let drain = Duration::from_secs(5);
    let a = Arc::new(
        Elector::spawn(store.clone(), config("a").with_drain_timeout(drain)).expect("valid"),
    );
    let term = leading(&mut a.subscribe()).await;
    let b = Elector::spawn(store.clone(), config("b")).expect("valid");
    let mut rb = b.subscribe();
    // A guard held far past the drain timeout, as a task that ignores cancellation would.
    let stubborn = term.clone();
    sleep(RETRY).await;
    let shutdown_at = Instant::now();
    a.shutdown().await.expect("clean shutdown");
    assert!(
        Instant::now() >= shutdown_at + drain,
        "shutdown waited for the drain timeout"
    );
    assert!(
        stubborn.ensure_leading().is_err(),
        "revoked at the drain timeout"
    );
    let rec = mem.get(&key()).await.expect("get").expect("present");
    assert_eq!(
        rec.record.holder_identity, "a",
        "not released while a task still runs"
    );
    let lb = leading(&mut rb).await;
    assert!(
        lb.since() >= shutdown_at + drain + LEASE - RENEW,
        "b led {:?} after the shutdown began: only once the unreleased lease expired",
        lb.since() - shutdown_at
    );
    drop(stubborn);
    b.shutdown().await.expect("clean shutdown");
}

/// A store call that panics inside the elector's task: the elector reports it everywhere
/// (health, shutdown, commands) instead of pretending to be healthy, and its term is revoked.
#[tokio::test(start_paused = true)]
async fn s12_a_failed_elector_task_is_reported_and_its_term_revoked() {
    let mem = MemoryStore::new();
    released(&mem).await;
    let store = FaultyStore::new(Arc::new(mem.clone())).with_capabilities(Capabilities::WATCH);
    // The acquisition (an update of the released record) passes; the first renewal panics.
    store.faults().panic_after(Op::Update, 1);
    let a = Elector::spawn(Arc::new(store), config("a")).expect("valid");
    let term = leading(&mut a.subscribe()).await;
    // The first renewal panics.
    tokio::time::timeout(PATIENCE, a.stopped())
        .await
        .expect("the failed task is noticed");
    assert!(term.ensure_leading().is_err(), "the term was revoked");
    assert!(!a.is_leading());
    assert!(matches!(a.check_health(), Err(Error::ElectorFailed { .. })));
    assert!(matches!(
        a.yield_for(Duration::from_secs(1)).await,
        Err(Error::ElectorFailed { .. })
    ));
    assert!(matches!(
        a.shutdown().await,
        Err(Error::ElectorFailed { .. })
    ));
}

/// A store pause longer than the renew deadline: the leader steps down at its deadline while its
/// renewal waits in the paused server; the renewal lands afterwards, so the record is still this
/// elector's own. It takes the record back at once, as a new term with the next token, instead
/// of waiting out a whole lease like everyone else.
#[tokio::test(start_paused = true)]
async fn s13_a_renewal_landing_after_a_store_pause_is_taken_back_at_once() {
    let mem = MemoryStore::new();
    released(&mem).await;
    let store = watching(&mem);
    let a = Elector::spawn(Arc::new(store.clone()), config("a")).expect("valid");
    let mut ra = a.subscribe();
    let first = leading(&mut ra).await;
    // The server pauses right after the acquisition, for longer than the renew deadline.
    store.faults().pause_for(RENEW + RETRY);
    let down = not_leading(&mut ra).await;
    let second = leading(&mut ra).await;
    assert!(second.fencing_token() > first.fencing_token(), "a new term");
    let back = second.since() - down;
    assert!(
        back < LEASE - RENEW,
        "led again {back:?} after stepping down: at once when the renewal landed, not after a lease"
    );
    a.shutdown().await.expect("clean shutdown");
}
