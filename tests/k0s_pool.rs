//! k0s's scenarios (ported) on the memory store with paused time; the always- and
//! never-leading stand-ins; yield, cause and callback-isolation details of the k0s layer.
#![allow(deprecated)] // exercises the deprecated callback API on purpose

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use leasehold::conformance::{create_released, unique_key};
use leasehold::k0s::conformance as k0s;
use leasehold::k0s::{AlwaysLeading, CounterConfig, LeaderElector, LeaderLease, NeverLeading};
use leasehold::{
    DynLeaseStore, KeyPrefix, LeaderStatus, LeaseStore, MemoryStore, StatusSource, StopCause,
    run_leader_tasks,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
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
async fn k0s_counter_counts_1_2_1() {
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

/// A pool on a fresh memory store whose key starts out released (so it leads at once), with
/// k0s's timings.
async fn leading_pool() -> (Arc<LeaderLease>, DynLeaseStore) {
    let store = store();
    let key = unique_key("pool");
    create_released(&store, &key).await;
    let pool = LeaderLease::start(store.clone(), LeaderLease::default_config(key, "me"))
        .expect("start the pool");
    k0s::wait_status(&pool, "leading", LeaderStatus::is_leading).await;
    (Arc::new(pool), store)
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
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let tasks = tokio::spawn({
        let pool = pool.clone();
        let shutdown = shutdown.clone();
        async move {
            let mut tx = Some(tx);
            run_leader_tasks(shutdown, &*pool, |leader| {
                let tx = tx.take();
                let _ = started_tx.send(leader.fencing_token());
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
    assert_eq!(started.recv().await, Some(0), "the leader task started");
    let (before, changed) = pool.current_status();
    pool.yield_lease(Duration::from_secs(1))
        .await
        .expect("yield");
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    // A yield does nothing at all: the same term goes on, nobody was notified of a change, the
    // leader task was not cancelled or restarted, and no callback ran.
    let (after, _) = pool.current_status();
    let same_term = match (before.leadership(), after.leadership()) {
        (Some(b), Some(a)) => a.same_term(b),
        _ => false,
    };
    assert!(
        same_term,
        "the yield ended the term: {before:?} -> {after:?}"
    );
    assert!(
        changed.now_or_never().is_none(),
        "the yield published a status change"
    );
    assert!(
        rx.try_recv().is_err(),
        "the yield cancelled the leader task"
    );
    assert!(
        started.try_recv().is_err(),
        "the yield restarted the leader task"
    );
    events.expect_none();

    pool.stop().await;
    events.expect("always-lost").await;
    events.expect_none();
    assert_eq!(rx.await.expect("task ran"), Some(StopCause::SteppedDown));
    assert_eq!(pool.current_status().0, LeaderStatus::Stopped);
    // run_leader_tasks returns on the stop by itself.
    tokio::time::timeout(Duration::from_secs(60), tasks)
        .await
        .expect("run_leader_tasks returns once the pool has stopped")
        .expect("tasks");
    drop(shutdown);
}

/// k0s's `Dummy{Leader: false}`: never leads, never runs a leader task or a callback, and its
/// status never changes until `stop`, which publishes `Stopped`.
#[tokio::test(start_paused = true)]
async fn k0s_never_leading() {
    let pool = Arc::new(NeverLeading::new());
    assert!(!pool.is_leader());
    let (status, changed) = pool.current_status();
    assert_eq!(status, LeaderStatus::NotLeading { leader: None });
    let mut events = k0s::Events::default();
    events.watch(&*pool, "never");
    let shutdown = CancellationToken::new();
    let (ran_tx, mut ran) = mpsc::unbounded_channel();
    let tasks = tokio::spawn(run_leader_tasks(
        shutdown.clone(),
        pool.clone(),
        move |_| {
            let _ = ran_tx.send(());
            async {}
        },
    ));
    pool.yield_lease(Duration::from_secs(1))
        .await
        .expect("yield");
    tokio::time::sleep(Duration::from_secs(3_600)).await;
    assert!(ran.try_recv().is_err(), "a leader task ran");
    events.expect_none();
    assert!(!pool.is_leader());
    assert!(changed.now_or_never().is_none(), "the status changed");
    assert!(!pool.subscribe().borrow().is_leading());
    pool.stop().await;
    assert_eq!(pool.current_status().0, LeaderStatus::Stopped);
    tokio::time::timeout(Duration::from_secs(60), tasks)
        .await
        .expect("run_leader_tasks returns once the pool has stopped")
        .expect("tasks");
    events.expect_none();
    drop(shutdown);
}

/// k0s's pool timings (60 s / 15 s / 5 s) are the k0s layer's defaults, for the leader lease and
/// the controller counter alike; k0s keeps its Leases in `kube-node-lease`.
#[test]
fn k0s_defaults_are_k0s_timings() {
    let key = leasehold::LeaseKey::new("k0s-endpoint-reconciler").expect("key");
    let c = LeaderLease::default_config(key, "id");
    let timings = (c.lease_duration, c.renew_deadline, c.retry_period);
    let k0s = (
        Duration::from_secs(60),
        Duration::from_secs(15),
        Duration::from_secs(5),
    );
    assert_eq!(timings, k0s);
    c.validate().expect("the defaults are valid");
    let counter = CounterConfig::new(KeyPrefix::new("k0s-ctrl-").expect("prefix"), "n")
        .expect("counter config");
    assert_eq!(
        (
            counter.lease_duration,
            counter.renew_deadline,
            counter.retry_period
        ),
        k0s
    );
    assert_eq!(leasehold::k0s::NODE_LEASE_NAMESPACE, "kube-node-lease");
}

/// Like Go's `context.Cause`, the first cause wins: a task cancelled by its caller sees
/// `Cancelled`, and still does after the elector then steps down during the task's cleanup.
#[tokio::test(start_paused = true)]
async fn k0s_cause_first_wins_through_a_step_down() {
    let (pool, _store) = leading_pool().await;
    let parent = CancellationToken::new();
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let tasks = tokio::spawn(run_leader_tasks(
        parent.clone(),
        pool.clone(),
        move |leader| {
            let seen_tx = seen_tx.clone();
            async move {
                let _ = seen_tx.send(("started", leader.cause()));
                leader.cancelled().await;
                let _ = seen_tx.send(("cancelled", leader.cause()));
                // Cleanup runs on; meanwhile the elector steps down.
                while leader.leadership().end_cause().is_none() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let _ = seen_tx.send(("after the step-down", leader.cause()));
            }
        },
    ));
    assert_eq!(seen.recv().await, Some(("started", None)));
    parent.cancel();
    assert_eq!(
        seen.recv().await,
        Some(("cancelled", Some(StopCause::Cancelled)))
    );
    let stop = tokio::spawn({
        let pool = pool.clone();
        async move { pool.stop().await }
    });
    assert_eq!(
        seen.recv().await,
        Some(("after the step-down", Some(StopCause::Cancelled))),
        "the cause changed after it was first seen"
    );
    stop.await.expect("stop");
    tasks.await.expect("tasks");
}

/// A later yield replaces the duration of an earlier one, counted from when it is applied: a
/// shorter second yield shortens, a longer one lengthens.
#[tokio::test(start_paused = true)]
async fn k0s_yield_replaces_the_earlier_duration() {
    let (pool, _store) = leading_pool().await;
    let long = Duration::from_secs(600);
    let short = Duration::from_secs(30);

    // 10 min, then a minute later 30 s: leads again 30 s after the second yield.
    pool.yield_lease(long).await.expect("yield");
    assert!(!pool.current_status().0.is_leading());
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!pool.current_status().0.is_leading(), "yielding");
    pool.yield_lease(short).await.expect("second yield");
    let second = Instant::now();
    let led = leads_within(&pool, long).await;
    assert!(
        led.is_some_and(|t| t >= second + short && t < second + short + Duration::from_secs(10)),
        "a shorter second yield did not replace the first: led again at {:?} after it",
        led.map(|t| t - second)
    );

    // 30 s, then 10 s later 10 min: does not lead again before 10 min after the second yield.
    pool.yield_lease(short).await.expect("yield");
    tokio::time::sleep(Duration::from_secs(10)).await;
    pool.yield_lease(long).await.expect("second yield");
    let second = Instant::now();
    let led = leads_within(&pool, long * 2).await;
    assert!(
        led.is_some_and(|t| t >= second + long && t < second + long + Duration::from_secs(10)),
        "a longer second yield did not replace the first: led again at {:?} after it",
        led.map(|t| t - second)
    );
    pool.stop().await;
}

/// When `source` leads again within `limit` (virtual time), or `None`.
async fn leads_within(source: &impl StatusSource, limit: Duration) -> Option<Instant> {
    let wait = async {
        loop {
            let (s, changed) = source.current_status();
            if s.is_leading() {
                return Instant::now();
            }
            changed.await;
        }
    };
    tokio::time::timeout(limit, wait).await.ok()
}

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

/// A genuinely slow (blocking) callback runs on the blocking pool: on this single-threaded
/// runtime the elector keeps renewing and the status stays available while it blocks, and
/// after 10 s it is logged as slow.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn k0s_slow_callback_is_isolated_and_reported() {
    let logs = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let logs = logs.clone();
            move || logs.clone()
        })
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let (pool, _store) = leading_pool().await;
    let (release, released) = std::sync::mpsc::channel::<()>();
    let released = Mutex::new(released);
    let (events_tx, mut events) = mpsc::unbounded_channel();
    pool.add_acquired_lease_callback(Box::new(move || {
        let _ = events_tx.send("entered");
        // Blocks its thread until the test releases it (bounded, so that a callback run on
        // the runtime's only thread ends the test instead of hanging it).
        let outcome = released
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .recv_timeout(Duration::from_secs(20));
        let _ = events_tx.send(if outcome.is_ok() {
            "released"
        } else {
            "timed out: the callback blocked the runtime"
        });
    }));
    assert_eq!(events.recv().await, Some("entered"));
    // While the callback blocks, 20 s pass (k0s timings: renew every 5 s, renew deadline 15 s):
    // the elector must keep renewing on this very thread.
    let (term, _) = pool.current_status();
    let term = term.leadership().cloned().expect("leading");
    for _ in 0..20 {
        tokio::time::advance(Duration::from_secs(1)).await;
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }
    assert!(
        events.try_recv().is_err(),
        "the callback returned early (it blocked the runtime until it timed out)"
    );
    let (now, _) = pool.current_status();
    assert!(
        now.leadership().is_some_and(|l| l.same_term(&term)),
        "the elector did not keep its term while a callback blocked: {now:?}"
    );
    term.ensure_leading()
        .expect("the term was renewed while the callback blocked");
    drop(now);
    let text = logs.text();
    assert!(
        text.contains("a lease callback is still running"),
        "no slow-callback warning; captured logs:\n{text}"
    );
    release.send(()).expect("release the callback");
    assert_eq!(events.recv().await, Some("released"));
    drop(term);
    pool.stop().await;
}

/// A real loss: another holder overwrites the record while the pool leads. The leader task sees
/// `LeaseLost` (not `SteppedDown`) as the elector publishes it: at once, long before the term's
/// validity (15 s) would have passed.
#[tokio::test(start_paused = true)]
async fn k0s_cause_on_a_real_loss_is_lease_lost() {
    let store = store();
    let key = unique_key("stolen");
    create_released(&store, &key).await;
    let pool = Arc::new(
        LeaderLease::start(
            store.clone(),
            LeaderLease::default_config(key.clone(), "me"),
        )
        .expect("start the pool"),
    );
    let parent = CancellationToken::new();
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let tasks = tokio::spawn(run_leader_tasks(
        parent.clone(),
        pool.clone(),
        move |leader| {
            let seen_tx = seen_tx.clone();
            async move {
                let _ = seen_tx.send(("started", leader.cause()));
                leader.cancelled().await;
                let _ = seen_tx.send(("ended", leader.cause()));
            }
        },
    ));
    assert_eq!(seen.recv().await, Some(("started", None)));
    let t0 = Instant::now();
    let current = store
        .get(&key)
        .await
        .expect("get")
        .expect("the pool's record");
    let mut stolen = current.record.clone();
    stolen.holder_identity = "thief".into();
    stolen.transitions += 1;
    store
        .update(&key, &stolen, &current.version)
        .await
        .expect("overwrite the record");
    assert_eq!(
        seen.recv().await,
        Some(("ended", Some(StopCause::LeaseLost)))
    );
    assert!(
        t0.elapsed() < leasehold::k0s::RENEW_DEADLINE,
        "the loss was not published by the elector but found by the task's deadline"
    );
    k0s::wait_status(&*pool, "following the thief", |s| {
        s.leader() == Some("thief")
    })
    .await;
    parent.cancel();
    tasks.await.expect("tasks");
    pool.stop().await;
}

/// Schedule 4 of issue 18: `LeaderLease::stop()` called from inside a lease callback never
/// returned (the stop waited for the callbacks, the callback waited for the stop), and the lease
/// was not released. Now the call returns once the step-down has begun; the lost callbacks run
/// and the lease is released (an empty holder appears before the next leader's record) once
/// the calling callback has returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k0s_stop_called_from_a_lease_callback_returns_and_releases() {
    const HANG_GUARD: Duration = Duration::from_secs(60);
    let mem = MemoryStore::new();
    let store: DynLeaseStore = Arc::new(mem.clone());
    let key = unique_key("stop-in-callback");
    create_released(&store, &key).await;
    let config = |id: &str| {
        LeaderLease::default_config(key.clone(), id).with_timings(
            Duration::from_secs(2),
            Duration::from_millis(1500),
            Duration::from_millis(300),
        )
    };
    let mut holders = mem.watch(&key, None).await.expect("watch");
    let a = Arc::new(LeaderLease::start(store.clone(), config("a")).expect("start a"));
    k0s::wait_status(&*a, "a leading", LeaderStatus::is_leading).await;
    let b = LeaderLease::start(store.clone(), config("b")).expect("start b");

    let (tx, mut events) = mpsc::unbounded_channel::<&'static str>();
    a.add_lost_lease_callback(Box::new({
        let tx = tx.clone();
        move || {
            let _ = tx.send("lost callback");
        }
    }));
    let weak = Arc::downgrade(&a);
    a.add_acquired_lease_callback(Box::new(move || {
        let Some(lease) = weak.upgrade() else { return };
        let _ = tx.send("calling stop");
        tokio::runtime::Handle::current().block_on(lease.stop());
        let _ = tx.send("stop returned");
    }));
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let ev = tokio::time::timeout(HANG_GUARD, events.recv())
            .await
            .unwrap_or_else(|_| panic!("hang guard: events so far {seen:?}"))
            .expect("the callbacks are alive");
        seen.push(ev);
    }
    assert_eq!(seen, ["calling stop", "stop returned", "lost callback"]);
    k0s::wait_status(&b, "b leading", LeaderStatus::is_leading).await;
    tokio::time::timeout(HANG_GUARD, a.elector().stopped())
        .await
        .expect("a's elector stops");
    // The holders the store went through: a, then the release (empty), then b.
    let mut order = Vec::new();
    while order.last().map(String::as_str) != Some("b") {
        let ev = tokio::time::timeout(HANG_GUARD, holders.next())
            .await
            .expect("hang guard: b's record is watched")
            .expect("watch open")
            .expect("no error");
        if let leasehold::WatchEvent::Put(v) = ev
            && order.last() != Some(&v.record.holder_identity)
        {
            order.push(v.record.holder_identity);
        }
    }
    let a_pos = order.iter().position(|h| h == "a").expect("a held it");
    assert_eq!(
        order[a_pos..],
        ["a", "", "b"],
        "a released the lease before b took it: {order:?}"
    );
    b.stop().await;
}

/// The same for `AlwaysLeading::stop()` from inside its own acquired callback: it returns once
/// the term has ended; the lost callbacks run and `Stopped` is published afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k0s_always_leading_stop_called_from_a_callback_returns() {
    const HANG_GUARD: Duration = Duration::from_secs(60);
    let pool = Arc::new(AlwaysLeading::new());
    let (tx, mut events) = mpsc::unbounded_channel::<&'static str>();
    pool.add_lost_lease_callback(Box::new({
        let tx = tx.clone();
        move || {
            let _ = tx.send("lost callback");
        }
    }));
    let weak = Arc::downgrade(&pool);
    pool.add_acquired_lease_callback(Box::new(move || {
        let Some(pool) = weak.upgrade() else { return };
        tokio::runtime::Handle::current().block_on(pool.stop());
        let _ = tx.send("stop returned");
    }));
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let ev = tokio::time::timeout(HANG_GUARD, events.recv())
            .await
            .unwrap_or_else(|_| panic!("hang guard: events so far {seen:?}"))
            .expect("the callbacks are alive");
        seen.push(ev);
    }
    assert_eq!(seen, ["stop returned", "lost callback"]);
    k0s::wait_status(&*pool, "stopped", LeaderStatus::is_stopped).await;
}
