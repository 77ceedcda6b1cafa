//! [`run_leader_tasks`]: run work only while leading.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::Poll;

use futures::FutureExt;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info};

use crate::status::{LeaderStatus, Leadership, StatusSource, StopCause, Validity};

tokio::task_local! {
    /// The term whose leader task is being polled (by `run_leader_tasks`), named by its validity
    /// cell: an elector called from inside its own term's task must not wait for that task.
    static TASK_TERM: Weak<Mutex<Validity>>;
}

/// The term whose leader task (or k0s lease callback) the caller runs in, if any, named by its
/// validity cell.
pub(crate) fn caller_term() -> Option<Weak<Mutex<Validity>>> {
    TASK_TERM
        .try_with(Weak::clone)
        .ok()
        .or_else(crate::k0s::callback_term)
}

/// The message of a panic payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".to_owned())
}

/// What a leader task gets: a cancellation signal that fires when leadership ends, when the
/// term's validity passes by the monotonic clock, or when the parent is cancelled; the fencing
/// token; a deadline check for side effects; and — once cancelled — the cause.
///
/// [`is_cancelled`](Self::is_cancelled) and [`cancelled`](Self::cancelled) check the term's
/// deadline themselves, so a task that only asks them never acts on a term whose validity
/// passed, even when it runs before the elector has noticed (right after a process pause, or in
/// the same timer tick as the elector's deadline). The check and the side effect are still two
/// steps: pass the fencing token to every system that can reject writes of an older term.
///
/// The context holds the term's [`Leadership`] guard: an ordered shutdown of the elector waits
/// for every clone of the context to be dropped before it releases the lease.
#[derive(Clone, Debug)]
pub struct LeaderContext {
    token: CancellationToken,
    leadership: Leadership,
    parent: CancellationToken,
    cause: Arc<OnceLock<StopCause>>,
}

// === impl LeaderContext ===

impl LeaderContext {
    /// Cancelled when leadership ends or the parent token is cancelled. The token itself is
    /// cancelled by [`run_leader_tasks`] when it notices the end; it does not read the clock:
    /// prefer [`is_cancelled`](Self::is_cancelled) and [`cancelled`](Self::cancelled), which also
    /// check the term's deadline.
    pub fn cancellation_token(&self) -> &CancellationToken {
        &self.token
    }

    /// Resolves once the task should stop: when the token is cancelled, and at the latest at the
    /// instant the term's validity passes ([`valid_until`](Self::valid_until), re-armed as
    /// renewals move it), whether or not the elector has run by then.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn cancelled(&self) {
        tokio::select! {
            biased;
            () = self.token.cancelled() => {}
            () = validity_passed(&self.leadership) => {}
        }
    }

    /// Whether the task should stop: leadership ended, the parent was cancelled, or the term's
    /// validity has passed by the monotonic clock — checked now, whether or not the elector (or
    /// [`run_leader_tasks`]) has noticed yet.
    pub fn is_cancelled(&self) -> bool {
        self.token.is_cancelled() || !self.leadership.is_valid()
    }

    /// Why the task was cancelled (`None` while it may still run): the lease was lost (also when
    /// the term's validity passed before the elector published the loss), the elector stepped
    /// down, or the caller cancelled — k0s's `ErrLostLead` cause, typed. Like Go's
    /// `context.Cause`, the first cause is kept forever.
    pub fn cause(&self) -> Option<StopCause> {
        if !self.is_cancelled() {
            return None;
        }
        Some(*self.cause.get_or_init(|| self.current_cause()))
    }

    fn current_cause(&self) -> StopCause {
        match self.leadership.end_cause() {
            Some(c) => c,
            None if self.parent.is_cancelled() => StopCause::Cancelled,
            None => StopCause::LeaseLost,
        }
    }

    /// Ends the task's context with the cause as it stands now (first cause wins).
    fn cancel(&self) {
        let _ = self.cause.get_or_init(|| self.current_cause());
        self.token.cancel();
    }

    /// The fencing token of this term (see [`Leadership::fencing_token`]). Pass it to every
    /// external system that can reject writes from an older term.
    pub fn fencing_token(&self) -> u64 {
        self.leadership.fencing_token()
    }

    /// Checks against the monotonic clock that the term may still be acted on, and returns its
    /// fencing token: call it right before every leader-only side effect (see
    /// [`Leadership::ensure_leading`]). It can fail before the context is cancelled — after a
    /// process pause, for instance — and can still succeed during a graceful step-down's cleanup,
    /// while the elector keeps renewing.
    ///
    /// # Errors
    /// [`Error::NotLeading`](crate::Error::NotLeading) when the term may not be acted on.
    pub fn ensure_leading(&self) -> crate::Result<u64> {
        self.leadership.ensure_leading()
    }

    /// Until when the term may be acted on, as known now (see [`Leadership::valid_until`]).
    pub fn valid_until(&self) -> Option<Instant> {
        self.leadership.valid_until()
    }

    /// The leadership term this task runs in.
    pub fn leadership(&self) -> &Leadership {
        &self.leadership
    }
}

/// Resolves once `l`'s validity has passed (re-armed as renewals move it). Every poll reads the
/// clock, so it is ready as soon as the deadline has passed, even before its timer has fired
/// (timers that expired together fire one after another).
async fn validity_passed(l: &Leadership) {
    let mut sleep: Option<Pin<Box<Sleep>>> = None;
    std::future::poll_fn(|cx| {
        loop {
            if !l.is_valid() {
                return Poll::Ready(());
            }
            let Some(t) = l.valid_until() else {
                // Valid until ended: the end is published (and the token cancelled).
                return Poll::Pending;
            };
            let timer = match &mut sleep {
                Some(s) if s.deadline() == t => s,
                _ => sleep.insert(Box::pin(tokio::time::sleep_until(t))),
            };
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            // The timer fired but the term is still valid: the deadline moved, or the timer's
            // resolution rounded it; re-arm a little later.
            if l.valid_until() == Some(t) {
                let later = Instant::now().max(t) + std::time::Duration::from_millis(1);
                sleep = Some(Box::pin(tokio::time::sleep_until(later)));
                if let Some(s) = &mut sleep
                    && s.as_mut().poll(cx).is_pending()
                {
                    return Poll::Pending;
                }
            }
        }
    })
    .await;
}

/// Runs `task` whenever `source` reports leading, and cancels it when leadership ends; returns
/// once `parent` is cancelled or the source has stopped ([`LeaderStatus::Stopped`]: the
/// elector was shut down, or failed), and the task has finished.
///
/// The counterpart of k0s's `RunLeaderTasks(ctx, statusFunc, tasks)`:
/// - On each new term, `task` is called once with a [`LeaderContext`] whose token is a child of
///   `parent`. The task should return soon after the token is cancelled.
/// - The task is cancelled when leadership ends (a new status that is not the same term), or as
///   soon as the term's validity passes by the monotonic clock, even before the elector publishes
///   the loss (a process resumed after a pause cancels its task first). It is never restarted
///   for an unrelated status change. Cancellation is checked before the task is polled again.
/// - If the task returns while still leading, it is **not** run again until leadership is lost
///   and re-acquired. A term whose validity has passed is not started (or restarted) at all.
/// - On a loss, the next term's task starts only after the previous one has returned, so tasks
///   of two terms never overlap inside one process.
/// - **A task may end its own term**: [`Elector::yield_for`](crate::Elector::yield_for) and
///   [`Elector::shutdown`](crate::Elector::shutdown) called from inside the task (not from a task
///   it spawned) of that elector's term return once the step-down has begun, instead of waiting
///   for a release that waits for the caller; the release follows once the task has returned.
/// - **A task that panics ends its term and the panic reaches the caller.** The panic is caught;
///   the task's context is cancelled; an [`Elector`](crate::Elector) source is told, steps down, stops campaigning and shuts
///   down in order — it releases the lease once the panicked task's guard is dropped (a healthy
///   candidate elsewhere takes over), and its
///   [`check_health`](crate::Elector::check_health) reports
///   [`Error::LeaderTaskPanicked`](crate::Error::LeaderTaskPanicked) from then on, for the rest
///   of its life. Then `run_leader_tasks` drops the task and resumes the panic, so it reaches
///   whoever awaits `run_leader_tasks` (the `JoinError` of a spawned one). Other sources (a
///   [`StatusCell`](crate::StatusCell), the k0s stand-ins) are not told; the panic still reaches
///   the caller.
///
/// ```no_run
/// # async fn demo(elector: leasehold::Elector) {
/// use leasehold::CancellationToken;
/// let shutdown = CancellationToken::new();
/// // A clone of the elector (a cheap handle) can also be moved into `tokio::spawn` with this.
/// leasehold::run_leader_tasks(shutdown.clone(), &elector, |leader| async move {
///     println!("leading with fencing token {}", leader.fencing_token());
///     leader.cancelled().await;
///     println!("stopped: {:?}", leader.cause());
/// })
/// .await;
/// # }
/// ```
///
/// # Panics
/// When a task panics: the panic is resumed after the term was ended (see above).
///
/// # Cancel safety
/// Not cancel safe: dropping the future drops a running task mid-way. Cancel `parent` instead
/// and await the returned future.
pub async fn run_leader_tasks<S, F, Fut>(parent: CancellationToken, source: S, mut task: F)
where
    S: StatusSource,
    F: FnMut(LeaderContext) -> Fut,
    Fut: Future<Output = ()>,
{
    // The last term a task ran for, by token and start (not a guard: holding one would delay
    // the release). A term's task runs at most once.
    let mut last: Option<(u64, Instant)> = None;
    loop {
        let (status, mut changed) = source.current_status();
        let leadership = match status {
            // A term already handled, or one whose validity passed before its end was
            // published, is never (re)started: the elector is about to publish its end.
            // (Restarting it would spin, and on a current-thread runtime starve the elector so
            // that it never does.)
            LeaderStatus::Leading(l)
                if last != Some((l.fencing_token(), l.since())) && l.is_valid() =>
            {
                l
            }
            // The elector has stopped: no term can come any more.
            LeaderStatus::Stopped => return,
            other => {
                drop(other);
                tokio::select! {
                    () = parent.cancelled() => return,
                    () = &mut changed => continue,
                }
            }
        };
        last = Some((leadership.fencing_token(), leadership.since()));
        if parent.is_cancelled() {
            return;
        }
        let ctx = LeaderContext {
            token: parent.child_token(),
            leadership: leadership.clone(),
            parent: parent.clone(),
            cause: Arc::new(OnceLock::new()),
        };
        info!(
            fencing_token = leadership.fencing_token(),
            "starting leader task"
        );
        let fut = TASK_TERM.scope(
            Arc::downgrade(&leadership.validity_cell()),
            std::panic::AssertUnwindSafe(task(ctx.clone())).catch_unwind(),
        );
        // Boxed so that a panicked task is dropped (with whatever guard it still holds) before
        // the panic is resumed.
        let mut fut = Box::pin(fut);
        let mut finished = false;
        let mut panicked = None;
        loop {
            tokio::select! {
                // Cancellation first: a ready task is never polled once its term is over.
                biased;
                () = parent.cancelled() => break,
                () = &mut changed => {
                    let (status, next) = source.current_status();
                    match status {
                        LeaderStatus::Leading(l) if l.same_term(&leadership) => changed = next,
                        _ => break,
                    }
                }
                () = validity_passed(&leadership) => {
                    info!("the leadership term's validity passed; cancelling the leader task");
                    break;
                }
                r = &mut fut, if !finished => {
                    finished = true;
                    if let Err(panic) = r {
                        panicked = Some(panic);
                        break;
                    }
                    debug!("leader task returned while still leading; it runs again on the next term");
                }
            }
        }
        ctx.cancel();
        if !finished && let Err(panic) = fut.as_mut().await {
            panicked = Some(panic);
        }
        if let Some(panic) = panicked {
            let message = panic_message(&*panic);
            error!(
                message,
                fencing_token = leadership.fencing_token(),
                "a leader task panicked; ending the term and resuming the panic"
            );
            // The publisher (an elector) steps down and stops; it releases the lease once the
            // guards below are gone.
            leadership.report_panic(message);
            drop(fut);
            drop(ctx);
            drop(leadership);
            std::panic::resume_unwind(panic);
        }
        info!(cause = ?ctx.cause(), "leader task finished");
        drop(fut);
        drop(ctx);
        drop(leadership);
        if parent.is_cancelled() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::status::Validity;

    fn context(valid_for: Duration) -> (LeaderContext, Instant) {
        let deadline = Instant::now() + valid_for;
        let (leadership, _drained) = Leadership::new_term(5, Validity::Until(deadline));
        let parent = CancellationToken::new();
        let ctx = LeaderContext {
            token: parent.child_token(),
            leadership,
            parent,
            cause: Arc::new(OnceLock::new()),
        };
        (ctx, deadline)
    }

    /// Issue 25: a task whose wake-up falls on the very instant its term's validity passes, with
    /// nobody else running first (no elector, no `run_leader_tasks` to cancel the token): the
    /// natural questions — `is_cancelled()`, the status's `is_leading()` — already answer "no".
    #[tokio::test(start_paused = true)]
    async fn at_the_deadline_the_natural_answers_say_stop() {
        let (ctx, deadline) = context(Duration::from_secs(10));
        let status = LeaderStatus::Leading(ctx.leadership().clone());
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(!ctx.is_cancelled() && status.is_leading() && ctx.cause().is_none());
        tokio::time::sleep_until(deadline).await;
        assert_eq!(Instant::now(), deadline, "woken on the deadline itself");
        assert!(ctx.is_cancelled(), "is_cancelled checks the clock");
        assert!(
            !status.is_leading(),
            "a Leading status past its deadline is not leading"
        );
        assert!(status.is_leading_variant(), "the variant is still Leading");
        assert_eq!(ctx.cause(), Some(StopCause::LeaseLost));
        assert!(ctx.ensure_leading().is_err());
    }

    /// Issue 25: `cancelled()` resolves by the term's deadline at the latest, also when nothing
    /// cancels the token; a renewal that moves the deadline moves it along.
    #[tokio::test(start_paused = true)]
    async fn cancelled_resolves_by_the_deadline() {
        let (ctx, deadline) = context(Duration::from_secs(10));
        let waiter = tokio::spawn({
            let ctx = ctx.clone();
            async move {
                ctx.cancelled().await;
                Instant::now()
            }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        // A renewal moves the deadline 3 s later.
        let moved = deadline + Duration::from_secs(3);
        crate::status::set_validity(&ctx.leadership().validity_cell(), Validity::Until(moved));
        let woke = tokio::time::timeout(Duration::from_secs(3600), waiter)
            .await
            .expect("cancelled() resolves without anyone cancelling the token")
            .expect("no panic");
        assert_eq!(woke, moved, "at the (moved) deadline, not later");
    }
}
