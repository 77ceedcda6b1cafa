//! Leader code that ends its own term, panics, or asks the health check with an absurd
//! tolerance (issue 18, schedules 3, 5 and 6), against the real tokio driver and the memory
//! store on Tokio's paused clock: instants are virtual, so the assertions compare orderings and
//! exact instants, never wall-clock durations.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::{
    DynLeaseStore, Elector, ElectorConfig, Error, LeaderStatus, LeaseKey, LeaseStore, MemoryStore,
    StopCause, run_leader_tasks,
};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const LEASE: Duration = Duration::from_secs(15);
const RENEW: Duration = Duration::from_secs(10);
const RETRY: Duration = Duration::from_secs(2);
/// The default drain timeout, spelled out: the self-deadlock waited exactly this long.
const DRAIN: Duration = Duration::from_secs(30);
/// Virtual time a wait may take before the test fails (the clock is paused: this costs nothing).
const PATIENCE: Duration = Duration::from_secs(3600);

fn key() -> LeaseKey {
    LeaseKey::new("task-safety").expect("valid key")
}

fn config(id: &str) -> ElectorConfig {
    ElectorConfig::new(key(), id)
        .with_timings(LEASE, RENEW, RETRY)
        .with_drain_timeout(DRAIN)
}

/// A released record, so the first candidate acquires at once.
async fn released(store: &MemoryStore) {
    let store: DynLeaseStore = Arc::new(store.clone());
    leasehold::conformance::create_released(&store, &key()).await;
}

async fn leads(rx: &mut watch::Receiver<LeaderStatus>) -> Instant {
    tokio::time::timeout(PATIENCE, rx.wait_for(LeaderStatus::is_leading))
        .await
        .expect("leads within an hour")
        .expect("elector alive");
    Instant::now()
}

/// `a` leads, then `b` (following) is started.
async fn pair() -> (MemoryStore, Elector, Elector) {
    let mem = MemoryStore::new();
    released(&mem).await;
    let store: DynLeaseStore = Arc::new(mem.clone());
    let a = Elector::spawn(store.clone(), config("a")).expect("valid");
    leads(&mut a.subscribe()).await;
    let b = Elector::spawn(store, config("b")).expect("valid");
    (mem, a, b)
}

/// What the leader task saw of its own call.
#[derive(Debug, Default)]
struct Seen {
    called: Option<Instant>,
    returned: Option<Instant>,
    result: Option<String>,
    cancelled_when_returned: Option<bool>,
    cause: Option<StopCause>,
}

/// Schedule 3: `yield_for` called from inside the leader's own `run_leader_tasks` task used to
/// wait for that same task to drain — it returned only after the drain timeout, with the lease
/// still held. It now returns once the step-down has begun, the task's context is cancelled as
/// a step-down, and the next leader starts as soon as the task has returned.
#[tokio::test(start_paused = true)]
async fn s18_3_yield_for_from_inside_the_leaders_own_task_does_not_wait_for_itself() {
    let (mem, a, b) = pair().await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let tasks = tokio::spawn({
        let (a, seen) = (a.clone(), seen.clone());
        let elector = a.clone();
        // Only the first term's task yields (its token is the store's, not necessarily 1).
        let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
        async move {
            run_leader_tasks(CancellationToken::new(), elector, move |leader| {
                let (a, seen, first) = (a.clone(), seen.clone(), first.clone());
                async move {
                    if !first.swap(false, std::sync::atomic::Ordering::SeqCst) {
                        leader.cancelled().await;
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    seen.lock().expect("lock").called = Some(Instant::now());
                    let r = a.yield_for(Duration::from_secs(600)).await;
                    let mut s = seen.lock().expect("lock");
                    s.returned = Some(Instant::now());
                    s.result = Some(format!("{r:?}"));
                    s.cancelled_when_returned = Some(leader.is_cancelled());
                    s.cause = leader.cause();
                }
            })
            .await;
        }
    });
    let b_leads = leads(&mut b.subscribe()).await;
    let s = std::mem::take(&mut *seen.lock().expect("lock"));
    let (called, returned) = (
        s.called.expect("the task called yield_for"),
        s.returned.expect("yield_for returned"),
    );
    assert_eq!(s.result.as_deref(), Some("Ok(())"));
    assert!(
        returned < called + DRAIN,
        "yield_for returned before the drain timeout (virtual time): called {called:?}, returned {returned:?}"
    );
    assert_eq!(s.cancelled_when_returned, Some(true), "the term was over");
    assert_eq!(s.cause, Some(StopCause::SteppedDown));
    assert!(
        b_leads < called + DRAIN,
        "the next leader started before the drain timeout: the lease was released, not left to expire"
    );
    assert!(b_leads >= returned, "b led only after the yield had begun");
    let record = mem.get(&key()).await.expect("get").expect("record");
    assert_eq!(record.record.holder_identity, "b");
    assert!(!a.is_leading(), "a stays out for the yield");
    b.shutdown().await.expect("b shuts down");
    a.shutdown().await.expect("a shuts down");
    tokio::time::timeout(PATIENCE, tasks)
        .await
        .expect("run_leader_tasks returns")
        .expect("no panic");
}

/// Schedule 3, for `shutdown`: called from inside the leader's own task it used to wait for the
/// elector's task, which waited for the calling task to drain. It now returns once the
/// step-down has begun; the release follows when the task returns.
#[tokio::test(start_paused = true)]
async fn s18_3_shutdown_from_inside_the_leaders_own_task_does_not_wait_for_itself() {
    let (mem, a, b) = pair().await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let tasks = tokio::spawn({
        let (a, seen) = (a.clone(), seen.clone());
        let elector = a.clone();
        async move {
            run_leader_tasks(CancellationToken::new(), elector, move |leader| {
                let (a, seen) = (a.clone(), seen.clone());
                async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    seen.lock().expect("lock").called = Some(Instant::now());
                    let r = a.shutdown().await;
                    let mut s = seen.lock().expect("lock");
                    s.returned = Some(Instant::now());
                    s.result = Some(format!("{r:?}"));
                    s.cancelled_when_returned = Some(leader.is_cancelled());
                    s.cause = leader.cause();
                }
            })
            .await;
        }
    });
    let b_leads = leads(&mut b.subscribe()).await;
    tokio::time::timeout(PATIENCE, a.stopped())
        .await
        .expect("a stops once its task returned");
    let s = std::mem::take(&mut *seen.lock().expect("lock"));
    let (called, returned) = (
        s.called.expect("the task called shutdown"),
        s.returned.expect("shutdown returned"),
    );
    assert_eq!(s.result.as_deref(), Some("Ok(())"));
    assert!(returned < called + DRAIN, "{called:?} {returned:?}");
    assert_eq!(s.cancelled_when_returned, Some(true));
    assert_eq!(s.cause, Some(StopCause::SteppedDown));
    assert!(b_leads < called + DRAIN, "the lease was released");
    let record = mem.get(&key()).await.expect("get").expect("record");
    assert_eq!(record.record.holder_identity, "b");
    tokio::time::timeout(PATIENCE, tasks)
        .await
        .expect("run_leader_tasks returns once the elector stopped")
        .expect("no panic");
    b.shutdown().await.expect("b shuts down");
}

/// Schedule 5: a leader task that panics used to leave a zombie leader — the elector renewed
/// forever, nothing ran, `check_health` said Ok. Now the term ends, the lease is released once
/// the panicked task is gone (another candidate leads before the lease could have expired), the
/// panic reaches `run_leader_tasks`' caller, and `check_health` reports it from then on.
#[tokio::test(start_paused = true)]
async fn s18_5_a_panicking_leader_task_ends_the_term_and_is_reported() {
    let (mem, a, b) = pair().await;
    let panicked_at = Arc::new(Mutex::new(None));
    let tasks = tokio::spawn({
        let elector = a.clone();
        let panicked_at = panicked_at.clone();
        async move {
            run_leader_tasks(CancellationToken::new(), elector, move |_leader| {
                let panicked_at = panicked_at.clone();
                async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    *panicked_at.lock().expect("lock") = Some(Instant::now());
                    panic!("injected panic in a leader task");
                }
            })
            .await;
        }
    });
    let joined = tokio::time::timeout(PATIENCE, tasks)
        .await
        .expect("run_leader_tasks ends");
    let err = joined.expect_err("the panic reached run_leader_tasks' caller");
    assert!(err.is_panic(), "{err:?}");
    let b_leads = leads(&mut b.subscribe()).await;
    let panicked = panicked_at.lock().expect("lock").expect("the task ran");
    assert!(
        b_leads < panicked + LEASE,
        "the lease was released, not left to expire: panic at {panicked:?}, b led at {b_leads:?}"
    );
    let record = mem.get(&key()).await.expect("get").expect("record");
    assert_eq!(record.record.holder_identity, "b");
    match a.check_health() {
        Err(Error::LeaderTaskPanicked { message, .. }) => {
            assert!(message.contains("injected panic"), "{message}");
        }
        other => panic!("check_health must report the panic, got {other:?}"),
    }
    tokio::time::timeout(PATIENCE, a.stopped())
        .await
        .expect("the elector stopped");
    assert!(a.current_status().0.is_stopped());
    tokio::time::sleep(LEASE * 4).await;
    assert!(
        matches!(a.check_health(), Err(Error::LeaderTaskPanicked { .. })),
        "still reported later"
    );
    b.shutdown().await.expect("b shuts down");
}

/// Schedule 6: `check_health_within(Duration::MAX)` overflowed while leading.
#[tokio::test(start_paused = true)]
async fn s18_6_check_health_within_accepts_any_tolerance() {
    let (_mem, a, b) = pair().await;
    assert!(a.is_leading());
    a.check_health_within(Duration::MAX)
        .expect("a leader renewing on time is healthy");
    b.check_health_within(Duration::MAX)
        .expect("a follower is healthy");
    a.shutdown().await.expect("a shuts down");
    b.shutdown().await.expect("b shuts down");
}
