//! `run_leader_tasks` against a fake status source, and configuration validation.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use leasehold::{
    ElectorConfig, Error, LeaderStatus, LeaseKey, StatusCell, StatusChanged, StatusSource,
    StopCause, default_identity, run_leader_tasks, testing,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

fn leading(token: u64) -> (LeaderStatus, tokio::sync::oneshot::Receiver<()>) {
    let (l, rx) = testing::new_term(token);
    (LeaderStatus::Leading(l), rx)
}

/// (event, fencing token, cause) of a task run.
type Event = (&'static str, u64, Option<StopCause>);

/// Records the events of each task run.
fn recorder() -> (mpsc::UnboundedSender<Event>, mpsc::UnboundedReceiver<Event>) {
    mpsc::unbounded_channel()
}

#[tokio::test(start_paused = true)]
async fn runs_only_while_leading_and_reports_the_cause() {
    let cell = StatusCell::default();
    let parent = CancellationToken::new();
    let (tx, mut rx) = recorder();
    let runner = tokio::spawn({
        let (cell, parent) = (cell.clone(), parent.clone());
        async move {
            run_leader_tasks(parent, cell, move |leader| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(("start", leader.fencing_token(), leader.cause()));
                    leader.cancelled().await;
                    let _ = tx.send(("stop", leader.fencing_token(), leader.cause()));
                }
            })
            .await;
        }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(rx.try_recv().is_err(), "nothing runs while not leading");

    let (s, _) = leading(1);
    testing::set_status(&cell, s.clone());
    assert_eq!(rx.recv().await, Some(("start", 1, None)));
    // Losing the lease: the publisher marks the cause, then publishes.
    testing::end_term(s.leadership().expect("leading"), StopCause::LeaseLost);
    testing::set_status(
        &cell,
        LeaderStatus::NotLeading {
            leader: Some("other".into()),
        },
    );
    drop(s);
    assert_eq!(
        rx.recv().await,
        Some(("stop", 1, Some(StopCause::LeaseLost)))
    );

    let (s, _) = leading(2);
    testing::set_status(&cell, s);
    assert_eq!(rx.recv().await, Some(("start", 2, None)));
    parent.cancel();
    assert_eq!(
        rx.recv().await,
        Some(("stop", 2, Some(StopCause::Cancelled)))
    );
    runner.await.expect("run_leader_tasks returns after cancel");
}

/// A status source whose change signal fires without a real change.
struct Spurious {
    cell: StatusCell,
    pokes: Arc<tokio::sync::Notify>,
}

impl StatusSource for Spurious {
    fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        let (status, real) = self.cell.current_status();
        let pokes = self.pokes.clone();
        let changed = StatusChanged::from_future(async move {
            tokio::select! {
                () = real => {}
                () = pokes.notified() => {}
            }
        });
        (status, changed)
    }
}

#[tokio::test(start_paused = true)]
async fn unrelated_signals_do_not_restart_the_task() {
    let (s, _) = leading(7);
    let cell = StatusCell::new(s);
    let pokes = Arc::new(tokio::sync::Notify::new());
    let source = Spurious {
        cell: cell.clone(),
        pokes: pokes.clone(),
    };
    let starts = Arc::new(AtomicUsize::new(0));
    let parent = CancellationToken::new();
    let runner = tokio::spawn({
        let (starts, parent) = (starts.clone(), parent.clone());
        async move {
            run_leader_tasks(parent, source, move |leader| {
                let starts = starts.clone();
                async move {
                    starts.fetch_add(1, Ordering::SeqCst);
                    leader.cancelled().await;
                }
            })
            .await;
        }
    });
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        pokes.notify_waiters();
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        starts.load(Ordering::SeqCst),
        1,
        "started once for one term"
    );
    parent.cancel();
    runner.await.expect("runner");
}

#[tokio::test(start_paused = true)]
async fn a_task_that_returns_is_not_rerun_until_the_next_term() {
    let cell = StatusCell::default();
    let starts = Arc::new(AtomicUsize::new(0));
    let parent = CancellationToken::new();
    let runner = tokio::spawn({
        let (cell, starts, parent) = (cell.clone(), starts.clone(), parent.clone());
        async move {
            run_leader_tasks(parent, cell, move |_leader| {
                let starts = starts.clone();
                async move {
                    starts.fetch_add(1, Ordering::SeqCst);
                }
            })
            .await;
        }
    });
    let (s, _) = leading(1);
    testing::set_status(&cell, s);
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        starts.load(Ordering::SeqCst),
        1,
        "not re-run within the term"
    );
    testing::set_status(&cell, LeaderStatus::NotLeading { leader: None });
    let (s, _) = leading(2);
    testing::set_status(&cell, s);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        starts.load(Ordering::SeqCst),
        2,
        "run again on the next term"
    );
    parent.cancel();
    runner.await.expect("runner");
}

#[tokio::test(start_paused = true)]
async fn the_term_guard_is_held_until_the_task_returns() {
    let cell = StatusCell::default();
    let parent = CancellationToken::new();
    let runner = tokio::spawn({
        let (cell, parent) = (cell.clone(), parent.clone());
        async move {
            run_leader_tasks(parent, cell, |leader| async move {
                leader.cancelled().await;
                tokio::time::sleep(Duration::from_secs(5)).await; // slow cleanup
            })
            .await;
        }
    });
    let (s, mut all_dropped) = leading(1);
    testing::set_status(&cell, s.clone());
    drop(s);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let ended = tokio::time::Instant::now();
    testing::set_status(&cell, LeaderStatus::NotLeading { leader: None });
    (&mut all_dropped).await.expect("guard released");
    assert!(
        ended.elapsed() >= Duration::from_secs(5),
        "guard held during cleanup"
    );
    parent.cancel();
    runner.await.expect("runner");
}

#[test]
fn config_validation_names_the_offending_values() {
    let key = LeaseKey::new("cfg").expect("valid");
    let ok = ElectorConfig::new(key.clone(), "id");
    assert!(ok.validate().is_ok(), "client-go defaults are valid");
    let k0s = ElectorConfig::new(key.clone(), "id").with_timings(
        Duration::from_secs(60),
        Duration::from_secs(15),
        Duration::from_secs(5),
    );
    assert!(k0s.validate().is_ok(), "k0s's 60/15/5 is expressible");
    let cases = [
        (
            ElectorConfig::new(key.clone(), "id").with_timings(
                Duration::from_secs(10),
                Duration::from_secs(10),
                Duration::from_secs(2),
            ),
            "lease_duration (10s) must be greater than renew_deadline (10s)",
        ),
        (
            ElectorConfig::new(key.clone(), "id").with_timings(
                Duration::from_secs(15),
                Duration::from_secs(2),
                Duration::from_secs(2),
            ),
            "renew_deadline (2s) must be greater than 1.2 × retry_period (2s",
        ),
        (
            ElectorConfig::new(key.clone(), ""),
            "identity must not be empty",
        ),
        (
            ElectorConfig::new(key.clone(), "x".repeat(2000)),
            "identity is 2000 bytes long",
        ),
        (
            ElectorConfig::new(key.clone(), "a\nb"),
            "control characters",
        ),
        (
            ElectorConfig::new(key.clone(), "id").with_timings(
                Duration::from_secs(15),
                Duration::from_secs(10),
                Duration::ZERO,
            ),
            "retry_period must be greater than zero",
        ),
    ];
    for (cfg, want) in cases {
        match cfg.validate() {
            Err(Error::InvalidConfig(msg)) => {
                assert!(
                    msg.contains(want),
                    "message {msg:?} should contain {want:?}"
                )
            }
            other => panic!("expected InvalidConfig containing {want:?}, got {other:?}"),
        }
    }
}

#[test]
fn default_identities_are_unique() {
    let a = default_identity();
    let b = default_identity();
    assert!(!a.is_empty());
    assert_ne!(a, b);
}

/// A term whose validity passes while the source still reports it (the elector has not
/// published the end yet, say after a pause): the task is cancelled with cause `LeaseLost` at
/// the deadline and is not started again for that term.
#[tokio::test(start_paused = true)]
async fn a_task_is_cancelled_at_its_terms_deadline_and_not_restarted() {
    let (l, _drained) = testing::new_term_valid_for(4, Duration::from_secs(10));
    let cell = StatusCell::new(LeaderStatus::Leading(l.clone()));
    drop(l);
    let parent = CancellationToken::new();
    let starts = Arc::new(AtomicUsize::new(0));
    let (tx, mut rx) = recorder();
    let runner = tokio::spawn({
        let (cell, parent, starts) = (cell.clone(), parent.clone(), starts.clone());
        let stop = parent.clone();
        async move {
            run_leader_tasks(parent, cell, move |leader| {
                let (tx, starts, stop) = (tx.clone(), starts.clone(), stop.clone());
                async move {
                    if starts.fetch_add(1, Ordering::SeqCst) > 0 {
                        stop.cancel(); // a second start for the same term: end the run
                    }
                    leader.cancelled().await;
                    let _ = tx.send(("stop", leader.fencing_token(), leader.cause()));
                }
            })
            .await;
        }
    });
    let started = tokio::time::Instant::now();
    assert_eq!(
        rx.recv().await,
        Some(("stop", 4, Some(StopCause::LeaseLost)))
    );
    assert!(tokio::time::Instant::now() - started >= Duration::from_secs(10));
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        starts.load(Ordering::SeqCst),
        1,
        "not restarted for the same term"
    );
    parent.cancel();
    runner.await.expect("joined");
}

/// Wakes itself and returns `Pending` once: the task is polled again at once, before the
/// runtime processes its timers.
struct WakeAtOnce(bool);

impl std::future::Future for WakeAtOnce {
    type Output = ();
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.0 {
            return std::task::Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

/// Issue 25: `run_leader_tasks` reads the clock each time it is polled, not only when its
/// deadline timer has fired. A task whose thread was blocked past the term's deadline (a pause)
/// and that is polled again before the runtime has fired any timer is polled only with its
/// token already cancelled.
#[tokio::test]
async fn a_task_is_not_polled_uncancelled_after_its_deadline() {
    let (l, _drained) = testing::new_term_valid_for(1, Duration::from_millis(50));
    let deadline = l.valid_until().expect("a deadline");
    let cell = StatusCell::new(LeaderStatus::Leading(l));
    let parent = CancellationToken::new();
    let (done_tx, done) = tokio::sync::oneshot::channel();
    let uncancelled_after_deadline = Arc::new(AtomicUsize::new(0));
    let runner = tokio::spawn({
        let (parent, bad) = (parent.clone(), uncancelled_after_deadline.clone());
        let mut done_tx = Some(done_tx);
        async move {
            run_leader_tasks(parent, cell, move |leader| {
                let bad = bad.clone();
                let done_tx = done_tx.take();
                async move {
                    // Block the only runtime thread past the deadline, as a pause would.
                    std::thread::sleep(Duration::from_millis(150));
                    for _ in 0..3 {
                        WakeAtOnce(false).await;
                        if tokio::time::Instant::now() >= deadline
                            && !leader.cancellation_token().is_cancelled()
                        {
                            bad.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    if let Some(tx) = done_tx {
                        let _ = tx.send(());
                    }
                }
            })
            .await;
        }
    });
    tokio::time::timeout(Duration::from_secs(60), done)
        .await
        .expect("hang guard: the task finished")
        .expect("the task ran");
    assert_eq!(
        uncancelled_after_deadline.load(Ordering::SeqCst),
        0,
        "polled after the deadline with its token not cancelled"
    );
    parent.cancel();
    runner.await.expect("runner");
}
