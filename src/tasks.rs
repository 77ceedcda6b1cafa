//! [`run_leader_tasks`]: run work only while leading.

use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::status::{LeaderStatus, Leadership, StatusSource, StopCause};

/// What a leader task gets: a cancellation token that fires when leadership ends (or the parent
/// is cancelled), the fencing token, a deadline check for side effects, and — once cancelled —
/// the cause.
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
    /// Cancelled when leadership ends or the parent token is cancelled.
    pub fn cancellation_token(&self) -> &CancellationToken {
        &self.token
    }

    /// Resolves once the task should stop.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn cancelled(&self) {
        self.token.cancelled().await;
    }

    /// Whether the task should stop.
    pub fn is_cancelled(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Why the task was cancelled (`None` while it may still run): the lease was lost, the
    /// elector stepped down, or the caller cancelled — k0s's `ErrLostLead` cause, typed. Like Go's
    /// `context.Cause`, the first cause is kept forever.
    pub fn cause(&self) -> Option<StopCause> {
        if !self.token.is_cancelled() {
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

/// Resolves once `l`'s validity has passed (re-armed as renewals move it).
async fn validity_passed(l: &Leadership) {
    loop {
        if !l.is_valid() {
            return;
        }
        match l.valid_until() {
            Some(t) => tokio::time::sleep_until(t).await,
            // Valid until ended: the status change reports the end.
            None => std::future::pending::<()>().await,
        }
    }
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
        let fut = task(ctx.clone());
        let mut fut = std::pin::pin!(fut);
        let mut finished = false;
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
                () = &mut fut, if !finished => {
                    finished = true;
                    debug!("leader task returned while still leading; it runs again on the next term");
                }
            }
        }
        ctx.cancel();
        if !finished {
            fut.await;
        }
        info!(cause = ?ctx.cause(), "leader task finished");
        drop(ctx);
        drop(leadership);
        if parent.is_cancelled() {
            return;
        }
    }
}
