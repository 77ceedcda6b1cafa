//! The elector's lifecycle as a user meets it: a cheap `Clone` handle, status loops and
//! `run_leader_tasks` that end when the elector stops (however it stops), store failures that
//! show in `store_health`, and a store timeout that could never fit in the renew deadline.

use std::sync::Arc;
use std::time::Duration;

use leasehold::fault::FaultyStore;
use leasehold::{
    Capabilities, DynLeaseStore, Elector, ElectorConfig, Error, LeaderStatus, LeaseKey, LeaseStore,
    MemoryStore, run_leader_tasks,
};
use tokio_util::sync::CancellationToken;

fn config(identity: &str) -> ElectorConfig {
    ElectorConfig::new(LeaseKey::new("lifecycle").expect("valid key"), identity)
        .with_timings(
            Duration::from_secs(2),
            Duration::from_millis(1500),
            Duration::from_millis(300),
        )
        .with_trust_absence(true)
}

async fn leading(e: &Elector) {
    let mut rx = e.subscribe();
    rx.wait_for(LeaderStatus::is_leading)
        .await
        .expect("the elector leads");
}

#[tokio::test(start_paused = true)]
async fn clones_share_one_elector_that_stops_with_the_last_handle() {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let a = Elector::spawn(store.clone(), config("a")).expect("valid config");
    let clone = a.clone();
    leading(&clone).await;
    // A clone moves into a spawned task like any owned value.
    let task = tokio::spawn({
        let clone = clone.clone();
        async move { clone.is_leading() }
    });
    assert!(task.await.expect("the task runs"));

    let mut status = a.subscribe();
    drop(clone);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(a.is_leading(), "dropping a clone does not stop the elector");

    drop(a);
    tokio::time::timeout(
        Duration::from_secs(60),
        status.wait_for(LeaderStatus::is_stopped),
    )
    .await
    .expect("dropping the last handle stops the elector")
    .expect("the status reports the stop");
    let record = store
        .get(&LeaseKey::new("lifecycle").expect("valid key"))
        .await
        .expect("the store answers")
        .expect("the record exists");
    assert_eq!(
        record.record.holder_identity, "",
        "dropping the last handle released the lease in order"
    );
}

#[tokio::test(start_paused = true)]
async fn run_leader_tasks_and_status_loops_end_when_the_elector_shuts_down() {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let elector = Elector::spawn(store, config("a")).expect("valid config");

    // `run_leader_tasks` with a parent token that nobody cancels.
    let tasks = tokio::spawn(run_leader_tasks(
        CancellationToken::new(),
        elector.clone(),
        |leader| async move { leader.cancelled().await },
    ));
    // The README's status loop.
    let status_loop = tokio::spawn({
        let elector = elector.clone();
        async move {
            let mut seen = Vec::new();
            loop {
                let (status, changed) = elector.current_status();
                let stopped = status.is_stopped();
                seen.push(status.is_leading());
                if stopped {
                    return seen;
                }
                changed.await;
            }
        }
    });
    leading(&elector).await;
    elector.shutdown().await.expect("a clean shutdown");

    tokio::time::timeout(Duration::from_secs(60), tasks)
        .await
        .expect("run_leader_tasks returns when the elector stops")
        .expect("no panic");
    let seen = tokio::time::timeout(Duration::from_secs(60), status_loop)
        .await
        .expect("the status loop ends when the elector stops")
        .expect("no panic");
    assert!(seen.contains(&true), "the loop saw the term: {seen:?}");

    // After the stop, the status stays `Stopped`; nothing changes any more.
    let (status, changed) = elector.current_status();
    assert!(status.is_stopped(), "{status:?}");
    assert!(
        tokio::time::timeout(Duration::from_secs(1), changed)
            .await
            .is_err(),
        "a Stopped status never changes"
    );
}

#[test]
fn the_status_is_stopped_when_the_runtime_goes_away() {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let elector_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let elector = elector_rt.block_on(async {
        let e = Elector::spawn(store, config("a")).expect("valid config");
        leading(&e).await;
        e
    });
    let (status, changed) = elector.current_status();
    let term = status.leadership().expect("leading").clone();
    // Like a crash of the elector's runtime: its task is dropped without an orderly stop.
    elector_rt.shutdown_background();

    let watcher = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    watcher.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), changed)
            .await
            .expect("the change signal fires when the elector's task is dropped");
    });
    assert!(elector.current_status().0.is_stopped());
    assert!(
        !term.is_valid(),
        "a term whose elector task is gone is revoked"
    );
    assert!(term.ensure_leading().is_err());
}

#[tokio::test(start_paused = true)]
async fn a_failing_store_shows_in_store_health() {
    let faulty = FaultyStore::new(Arc::new(MemoryStore::new()));
    let faults = faulty.faults().clone();
    faults.set_partitioned(true);
    let elector = Elector::spawn(Arc::new(faulty), config("a")).expect("valid config");
    tokio::time::sleep(Duration::from_secs(3)).await;
    match elector.store_health() {
        Err(Error::StoreFailing {
            failures,
            since,
            last_error,
            ..
        }) => {
            assert!(failures >= 2, "{failures} failures");
            assert!(since >= Duration::from_secs(1), "failing for {since:?}");
            assert!(!last_error.is_empty());
        }
        other => panic!("expected StoreFailing, got {other:?}"),
    }
    assert!(
        elector.check_health().is_ok(),
        "a follower's leader health is unaffected"
    );
    let message = elector.store_health().expect_err("failing").to_string();
    assert!(message.contains("lifecycle"), "{message}");

    faults.heal();
    leading(&elector).await;
    elector.store_health().expect("the store answers again");
}

#[tokio::test]
async fn spawn_rejects_a_store_timeout_not_shorter_than_the_renew_deadline() {
    for timeout in [Duration::from_millis(1500), Duration::from_secs(5)] {
        let store = FaultyStore::new(Arc::new(MemoryStore::new()))
            .with_capabilities(Capabilities::WATCH.with_operation_timeout(timeout));
        let err = Elector::spawn(Arc::new(store), config("a")).expect_err("rejected");
        let message = err.to_string();
        assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
        assert!(
            message.contains(&format!("{timeout:?}")) && message.contains("1.5s"),
            "names both values: {message}"
        );
    }
    let store = FaultyStore::new(Arc::new(MemoryStore::new()))
        .with_capabilities(Capabilities::WATCH.with_operation_timeout(Duration::from_secs(1)));
    let elector = Elector::spawn(Arc::new(store), config("a")).expect("a shorter timeout is fine");
    elector.shutdown().await.expect("clean");
}

#[test]
fn a_process_restarted_with_the_same_identity_waits_a_whole_lease() {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let lease = Duration::from_secs(2);
    // The first process leads, then crashes: its runtime goes away without a release.
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    first.block_on(async {
        let e = Elector::spawn(store.clone(), config("same-id")).expect("valid config");
        leading(&e).await;
        std::mem::forget(e);
    });
    first.shutdown_background();

    // The restarted process has the same identity but cannot know it is the same process: two
    // live processes may share an identity by mistake. It waits for the lease to expire.
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    second.block_on(async {
        let held = store
            .get(&LeaseKey::new("lifecycle").expect("valid key"))
            .await
            .expect("the store answers")
            .expect("the crashed leader's record");
        assert_eq!(held.record.holder_identity, "same-id");
        let start = tokio::time::Instant::now();
        let e = Elector::spawn(store.clone(), config("same-id")).expect("valid config");
        leading(&e).await;
        // A lower bound only: a slow machine makes it later, never earlier.
        assert!(
            start.elapsed() >= lease,
            "took over its own identity's record after {:?}, before the lease of {lease:?} expired",
            start.elapsed()
        );
        e.shutdown().await.expect("clean");
    });
}

#[test]
fn a_stuck_leader_is_unhealthy_after_its_deadline_plus_the_tolerance() {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let tolerance = Duration::from_millis(500);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let elector = rt.block_on(async {
        let e = Elector::spawn(store, config("stuck")).expect("valid config");
        leading(&e).await;
        e
    });
    // Nobody drives the elector's runtime any more: its task is stuck, as in a starved process.
    let valid_until = elector
        .current_status()
        .0
        .leadership()
        .and_then(|l| l.valid_until())
        .expect("a leading term with a deadline");
    let mut saw_tolerated = false;
    loop {
        let before = tokio::time::Instant::now();
        let plain = elector.check_health();
        let tolerant = elector.check_health_within(tolerance);
        let after = tokio::time::Instant::now();
        // Judged against instants measured around the checks: never flaky on a slow machine.
        if after < valid_until {
            assert!(plain.is_ok(), "healthy before the deadline: {plain:?}");
        }
        if before > valid_until {
            assert!(
                matches!(plain, Err(Error::Unhealthy { .. })),
                "unhealthy after the deadline: {plain:?}"
            );
        }
        if after < valid_until + tolerance {
            assert!(tolerant.is_ok(), "tolerated: {tolerant:?}");
            saw_tolerated |= plain.is_err();
        }
        if before > valid_until + tolerance {
            match tolerant {
                Err(Error::Unhealthy {
                    since,
                    renew_deadline,
                    ..
                }) => {
                    assert!(since > renew_deadline + tolerance, "{since:?}");
                    break;
                }
                other => panic!("unhealthy past the tolerance: {other:?}"),
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Usually seen; only a very slow machine skips the window between the two.
    println!("saw a stale leader within the tolerance: {saw_tolerated}");
    rt.block_on(async { elector.shutdown().await.expect("clean") });
}

#[tokio::test(start_paused = true)]
async fn a_clone_held_by_run_leader_tasks_keeps_the_elector_running() {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let elector = Elector::spawn(store, config("held")).expect("valid config");
    let mut status = elector.subscribe();
    let token = CancellationToken::new();
    let tasks = tokio::spawn(run_leader_tasks(
        token.clone(),
        elector.clone(),
        |leader| async move { leader.cancelled().await },
    ));
    leading(&elector).await;
    drop(elector);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        status.borrow_and_update().is_leading(),
        "the clone inside run_leader_tasks keeps the elector leading"
    );
    // Cancelling the token ends run_leader_tasks, which drops the last handle: the elector stops.
    token.cancel();
    tasks.await.expect("run_leader_tasks returned");
    tokio::time::timeout(
        Duration::from_secs(60),
        status.wait_for(LeaderStatus::is_stopped),
    )
    .await
    .expect("the last handle's drop stops the elector")
    .expect("the status reports the stop");
}

/// A record whose token is at `u64::MAX` (written by another tool): the elector never starts a
/// term on a token that is not above it, and says why through `store_health`.
#[tokio::test(start_paused = true)]
async fn an_exhausted_fencing_token_is_refused_and_reported() {
    let store = Arc::new(MemoryStore::new());
    let key = LeaseKey::new("exhausted").expect("valid key");
    let vacant = leasehold::LeaseRecord {
        holder_identity: String::new(),
        lease_duration: Duration::from_secs(1),
        acquire_time: None,
        renew_time: None,
        transitions: u64::MAX,
    };
    store.create(&key, &vacant).await.expect("created");
    let config = ElectorConfig::new(key, "a").with_timings(
        Duration::from_secs(2),
        Duration::from_millis(1500),
        Duration::from_millis(300),
    );
    let elector = Elector::spawn(store, config).expect("spawned");
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        !elector.is_leading(),
        "no term starts on an exhausted token"
    );
    match elector.store_health() {
        Err(Error::TokenExhausted { last, .. }) => assert_eq!(last, u64::MAX),
        other => panic!("store_health says {other:?}"),
    }
    elector.shutdown().await.expect("shuts down");
}
