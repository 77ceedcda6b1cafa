//! k0s's scenarios (ported) on the memory store with paused time, plus the always-leading pool.
#![allow(deprecated)] // exercises the deprecated callback API on purpose

use std::sync::Arc;

use leasehold::k0s::conformance as k0s;
use leasehold::k0s::{AlwaysLeading, LeaderElector};
use leasehold::{
    DynLeaseStore, LeaderStatus, MemoryStore, StatusSource, StopCause, run_leader_tasks,
};
use tokio_util::sync::CancellationToken;

fn store() -> DynLeaseStore {
    Arc::new(MemoryStore::new())
}

#[tokio::test(start_paused = true)]
async fn k0s_pool_reacquires_after_update_errors() {
    k0s::pool_reacquires_after_update_errors(store()).await;
}

#[tokio::test(start_paused = true)]
async fn k0s_pool_lead_takeover() {
    k0s::pool_lead_takeover(store()).await;
}

#[tokio::test(start_paused = true)]
async fn k0s_pool_callbacks_in_order() {
    k0s::pool_callbacks_in_order(store()).await;
}

#[tokio::test(start_paused = true)]
async fn k0s_counter_counts_0_1_2_1() {
    k0s::counter_counts_controllers(store()).await;
}

/// The same scenarios on the real clock (as the backends run them on real stores).
#[tokio::test]
async fn k0s_scenarios_on_a_real_clock() {
    k0s::pool_lead_takeover(store()).await;
    k0s::pool_callbacks_in_order(store()).await;
    k0s::counter_counts_controllers(store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k0s_takeover_on_a_multi_thread_runtime() {
    k0s::pool_lead_takeover(store()).await;
}

#[tokio::test(start_paused = true)]
async fn k0s_always_leading() {
    let pool = AlwaysLeading::new();
    assert!(pool.is_leader());
    let (status, _) = pool.current_status();
    assert_eq!(status.leadership().map(|l| l.fencing_token()), Some(0));

    let mut events = k0s::Events::default();
    // Registered after creation, while leading: runs promptly.
    events.watch(&pool, "always");
    events.expect("always-acquired").await;

    let shutdown = CancellationToken::new();

    // run_leader_tasks on the always-leading pool: the task runs at once and is stopped by stop().
    let pool = Arc::new(pool);
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tasks = tokio::spawn({
        let pool = pool.clone();
        let shutdown = shutdown.clone();
        async move {
            let mut tx = Some(tx);
            run_leader_tasks(shutdown, &*pool, |leader| {
                let tx = tx.take();
                async move {
                    leader.cancelled().await;
                    if let Some(tx) = tx {
                        let _ = tx.send(leader.cause());
                    }
                }
            })
            .await;
        }
    });
    tokio::task::yield_now().await;
    pool.yield_lease(std::time::Duration::from_secs(1))
        .await
        .expect("yield");
    assert!(pool.is_leader(), "always leading: yield is a no-op");
    pool.stop().await;
    events.expect("always-lost").await;
    events.expect_none();
    assert_eq!(rx.await.expect("task ran"), Some(StopCause::SteppedDown));
    assert_eq!(
        pool.current_status().0,
        LeaderStatus::NotLeading { leader: None }
    );
    shutdown.cancel();
    tasks.await.expect("tasks");
}
