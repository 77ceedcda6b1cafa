//! k0s's own test scenarios, ported, as store-generic cases. **Not API-stable.**
//!
//! Each case is a plain `pub async fn case(store: DynLeaseStore)` that panics on failure, like
//! the cases of [`crate::conformance`]; they use its short timings and a random key prefix, and
//! never assert an upper bound on time (waits fail only after
//! [`WAIT_LIMIT`]). Run them on the memory store with paused
//! time, or on a real store.

#![allow(deprecated)] // the cases exercise the deprecated callback API on purpose

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

use super::{ControllerCounter, CounterConfig, INITIAL_COUNT, LeaderElector, LeaderLease};
use crate::conformance::{
    LEASE, RENEW, RETRY, WAIT_LIMIT, create_released, test_config, unique_prefix,
};
use crate::fault::FaultyStore;
use crate::status::{LeaderStatus, StatusSource, StopCause};
use crate::store::{DynLeaseStore, KeyPrefix, LeaseKey};
use crate::tasks::run_leader_tasks;

/// The lease duration of the take-over case: an hour, as k0s's own test uses, so that only a
/// release (never an expiry) can hand the lease over within the case's waits.
pub const TAKEOVER_LEASE: Duration = Duration::from_secs(60 * 60);

/// Collects callback events (`"<name>-acquired"`, `"<name>-lost"`) in the order they happen.
#[derive(Debug)]
pub struct Events {
    tx: mpsc::UnboundedSender<String>,
    rx: mpsc::UnboundedReceiver<String>,
}

impl Default for Events {
    fn default() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Events { tx, rx }
    }
}

impl Events {
    /// Registers an acquired and a lost callback on `pool` that record `<name>-acquired` and
    /// `<name>-lost`.
    pub fn watch(&self, pool: &dyn LeaderElector, name: &str) {
        let (tx, n) = (self.tx.clone(), name.to_owned());
        pool.add_acquired_lease_callback(Box::new(move || {
            let _ = tx.send(format!("{n}-acquired"));
        }));
        let (tx, n) = (self.tx.clone(), name.to_owned());
        pool.add_lost_lease_callback(Box::new(move || {
            let _ = tx.send(format!("{n}-lost"));
        }));
    }

    /// A sender for custom events.
    pub fn sender(&self) -> mpsc::UnboundedSender<String> {
        self.tx.clone()
    }

    /// Waits for the next event and asserts it is `expected`.
    pub async fn expect(&mut self, expected: &str) {
        let got = timeout(WAIT_LIMIT, self.rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no event within {WAIT_LIMIT:?}; expected {expected:?}"));
        assert_eq!(got.as_deref(), Some(expected), "events out of order");
    }

    /// Asserts that no event is pending right now.
    pub fn expect_none(&mut self) {
        if let Ok(e) = self.rx.try_recv() {
            panic!("unexpected event {e:?}");
        }
    }
}

fn key(name: &str) -> LeaseKey {
    let k = format!("{}{name}", unique_prefix());
    LeaseKey::new(&k).unwrap_or_else(|e| panic!("test key {k:?}: {e}"))
}

/// Waits until `source` reports a status satisfying `pred`.
pub async fn wait_status(
    source: &impl StatusSource,
    what: &str,
    pred: impl Fn(&LeaderStatus) -> bool,
) {
    let wait = async {
        loop {
            let (s, changed) = source.current_status();
            if pred(&s) {
                return;
            }
            changed.await;
        }
    };
    timeout(WAIT_LIMIT, wait)
        .await
        .unwrap_or_else(|_| panic!("not {what} within {WAIT_LIMIT:?}"));
}

/// k0s `TestClient_Reacquisition` / `TestLeasePoolWatcherReacquiresLostLease`: a leading pool
/// whose updates fail loses the lead, regains it once the store works again, and drops it on
/// stop: exactly acquired, lost, acquired, lost.
///
/// The leader tasks of the two terms see the real causes: [`StopCause::LeaseLost`] for the
/// first (the renewals failed), [`StopCause::SteppedDown`] for the second (stopped).
pub async fn pool_reacquires_after_update_errors(store: DynLeaseStore) {
    let key = key("reacquire");
    create_released(&store, &key).await;
    let faulty = FaultyStore::new(store);
    let faults = faulty.faults().clone();
    let pool = Arc::new(
        LeaderLease::start(Arc::new(faulty), test_config(&key, "reacquirer"))
            .unwrap_or_else(|e| panic!("start: {e}")),
    );
    let mut events = Events::default();
    events.watch(&*pool, "pool");
    let (causes_tx, mut causes) = mpsc::unbounded_channel();
    let parent = CancellationToken::new();
    let tasks = tokio::spawn(run_leader_tasks(
        parent.clone(),
        pool.clone(),
        move |leader| {
            let causes_tx = causes_tx.clone();
            async move {
                leader.cancelled().await;
                let _ = causes_tx.send(leader.cause());
            }
        },
    ));
    events.expect("pool-acquired").await;
    // Disrupt: every operation fails for longer than the renew deadline.
    faults.fail_for(LEASE);
    events.expect("pool-lost").await;
    // The lost callback runs once the term is no longer valid (at its deadline, possibly a
    // moment before the elector publishes the end).
    assert!(!pool.is_leader());
    events.expect("pool-acquired").await;
    assert!(pool.is_leader());
    pool.stop().await;
    events.expect("pool-lost").await;
    events.expect_none();
    assert!(!pool.is_leader());
    parent.cancel();
    tasks
        .await
        .unwrap_or_else(|e| panic!("the leader task runner failed: {e}"));
    let mut seen = Vec::new();
    while let Ok(cause) = causes.try_recv() {
        seen.push(cause);
    }
    assert_eq!(
        seen,
        vec![Some(StopCause::LeaseLost), Some(StopCause::SteppedDown)],
        "the causes of the two terms: lost through failed renewals, then stopped"
    );
}

/// k0s `TestClient_LeadTakeover` / `TestSecondWatcherAcquiresReleasedLease`: A leads, B waits;
/// stopping A hands the lead to B; stopping B ends it. Exactly: A acquired, A lost, B acquired,
/// B lost.
///
/// The lease lasts [`TAKEOVER_LEASE`] (an hour): only A's release can hand it to B within the
/// case's waits. The key starts out released, so that A acquires at once.
pub async fn pool_lead_takeover(store: DynLeaseStore) {
    let key = key("takeover");
    create_released(&store, &key).await;
    let config = |id: &str| test_config(&key, id).with_timings(TAKEOVER_LEASE, RENEW, RETRY);
    let mut events = Events::default();
    let a =
        LeaderLease::start(store.clone(), config("a")).unwrap_or_else(|e| panic!("start a: {e}"));
    events.watch(&a, "a");
    events.expect("a-acquired").await;
    let b = LeaderLease::start(store, config("b")).unwrap_or_else(|e| panic!("start b: {e}"));
    events.watch(&b, "b");
    wait_status(&b, "following a", |s| s.leader() == Some("a")).await;
    a.stop().await;
    events.expect("a-lost").await;
    events.expect("b-acquired").await;
    b.stop().await;
    events.expect("b-lost").await;
    events.expect_none();
}

/// Callbacks fire sequentially in registration order, a callback registered while leading runs
/// promptly, and a panicking callback stops neither the others nor the elector.
pub async fn pool_callbacks_in_order(store: DynLeaseStore) {
    let pool = LeaderLease::start(store, test_config(&key("order"), "ordered"))
        .unwrap_or_else(|e| panic!("start: {e}"));
    let mut events = Events::default();
    let tx = events.sender();
    for i in 1..=3 {
        let acquired = tx.clone();
        pool.add_acquired_lease_callback(Box::new(move || {
            if i == 2 {
                panic!("callback 2 panics on purpose (the test checks it is contained)");
            }
            let _ = acquired.send(format!("acquired-{i}"));
        }));
        let lost = tx.clone();
        pool.add_lost_lease_callback(Box::new(move || {
            let _ = lost.send(format!("lost-{i}"));
        }));
    }
    events.expect("acquired-1").await;
    events.expect("acquired-3").await;
    wait_status(&pool, "leading", LeaderStatus::is_leading).await;
    // Registered while leading: runs promptly, once.
    let late = tx.clone();
    pool.add_acquired_lease_callback(Box::new(move || {
        let _ = late.send("acquired-late".to_owned());
    }));
    events.expect("acquired-late").await;
    // The panicking callback stopped neither the others nor the elector. (That a slow callback
    // holds up neither the status nor the runtime is checked in `tests/k0s_pool.rs`.)
    let (status, _) = pool.current_status();
    assert!(
        status.is_leading(),
        "the elector still leads after a panicking callback"
    );
    pool.stop().await;
    events.expect("lost-1").await;
    events.expect("lost-2").await;
    events.expect("lost-3").await;
    events.expect_none();
}

/// The lease duration of the counter case: longer than [`WAIT_LIMIT`], so that a count that
/// dropped only by expiry fails the case.
pub const COUNTER_LEASE: Duration = Duration::from_secs(120);

/// k0s's controller lease counter: 1 → 2 → 1 as a second controller starts and stops (the
/// count starts at [`INITIAL_COUNT`], this controller, as in k0s, and never shows a count that
/// was not observed, such as 0); the count drops when a controller stops (its lease is
/// released), not after a lease duration (the leases last [`COUNTER_LEASE`], longer than the
/// case waits).
///
/// Run it on a current-thread runtime: the first count is read right after the start, before
/// the counter's task had a chance to run.
pub async fn counter_counts_controllers(store: DynLeaseStore) {
    let prefix = KeyPrefix::new(format!("{}ctrl-", unique_prefix()))
        .unwrap_or_else(|e| panic!("prefix: {e}"));
    let config = |node: &str| {
        CounterConfig::new(prefix.clone(), node)
            .unwrap_or_else(|e| panic!("config: {e}"))
            .with_identity(format!("{node}-id"))
            .with_timings(COUNTER_LEASE, RENEW, RETRY)
    };
    let a = ControllerCounter::start(store.clone(), config("node-a"))
        .unwrap_or_else(|e| panic!("start a: {e}"));
    // Read the first value before this task yields, so that it is the count before anything
    // was observed (on a current-thread runtime the counter cannot have run yet).
    let mut rx = a.subscribe();
    let first = *rx.borrow_and_update();
    assert_eq!(first, INITIAL_COUNT, "the count before anything was listed");
    let history = Arc::new(std::sync::Mutex::new(vec![first]));
    let seen = {
        let history = history.clone();
        tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let n = *rx.borrow_and_update();
                history.lock().unwrap_or_else(|e| e.into_inner()).push(n);
            }
        })
    };
    // k0s's UpdateControllerCount(count), through the callback adapter.
    let (calls_tx, mut calls) = mpsc::unbounded_channel();
    a.on_count_changed(move |n| {
        let _ = calls_tx.send(n);
    });
    wait_count(&a, 1).await;
    callback_sees(&mut calls, 1).await;
    let b = ControllerCounter::start(store.clone(), config("node-b"))
        .unwrap_or_else(|e| panic!("start b: {e}"));
    wait_count(&a, 2).await;
    wait_count(&b, 2).await;
    callback_sees(&mut calls, 2).await;
    b.stop().await;
    wait_count(&a, 1).await;
    callback_sees(&mut calls, 1).await;
    seen.abort();
    let history = history.lock().unwrap_or_else(|e| e.into_inner()).clone();
    a.stop().await;
    let mut distinct = history.clone();
    distinct.dedup();
    assert_eq!(distinct, vec![1, 2, 1], "count history (raw: {history:?})");
}

/// Waits until the count callback has been called with `n`.
async fn callback_sees(calls: &mut mpsc::UnboundedReceiver<usize>, n: usize) {
    let wait = async {
        while let Some(got) = calls.recv().await {
            if got == n {
                return;
            }
        }
        panic!("the count callback adapter stopped");
    };
    timeout(WAIT_LIMIT, wait).await.unwrap_or_else(|_| {
        panic!("the count callback was not called with {n} within {WAIT_LIMIT:?}")
    });
}

/// Waits until `counter` reports `n`.
pub async fn wait_count(counter: &ControllerCounter, n: usize) {
    let wait = async {
        loop {
            let (c, changed) = counter.current_count();
            if c == n {
                return;
            }
            changed.await;
        }
    };
    timeout(WAIT_LIMIT, wait).await.unwrap_or_else(|_| {
        panic!(
            "the count did not become {n} within {WAIT_LIMIT:?}; it is {}",
            counter.count()
        )
    });
}

/// Expands to one `#[tokio::test]` per k0s scenario above for a store constructor, like
/// [`conformance_suite!`](crate::conformance_suite): `leasehold::k0s_conformance_suite!(make_store);`
#[macro_export]
macro_rules! k0s_conformance_suite {
    ($make:path) => {
        $crate::k0s_conformance_suite!(@multi $make;
            pool_reacquires_after_update_errors => k0s_pool_reacquires_after_update_errors,
            pool_lead_takeover => k0s_pool_lead_takeover,
            pool_callbacks_in_order => k0s_pool_callbacks_in_order
        );
        #[::tokio::test(flavor = "current_thread")]
        async fn k0s_counter_counts_controllers() {
            $crate::k0s::conformance::counter_counts_controllers($make().await).await;
        }
    };
    (@multi $make:path; $($case:ident => $name:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::k0s::conformance::$case($make().await).await;
            }
        )*
    };
}
