//! [`run_leader_tasks`]: run work only while leading.

use std::future::Future;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::status::{LeaderStatus, Leadership, StatusSource, StopCause};

/// What a leader task gets: a cancellation token that fires when leadership ends (or the parent
/// is cancelled), the fencing token, and — once cancelled — the cause.
///
/// The context holds the term's [`Leadership`] guard: an ordered shutdown of the elector waits
/// for every clone of the context to be dropped before it releases the lease.
#[derive(Clone, Debug)]
pub struct LeaderContext {
    token: CancellationToken,
    leadership: Leadership,
    parent: CancellationToken,
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
    /// elector stepped down, or the caller cancelled — k0s's `ErrLostLead` cause, typed.
    pub fn cause(&self) -> Option<StopCause> {
        if !self.token.is_cancelled() {
            return None;
        }
        if self.parent.is_cancelled() && self.leadership.end_cause().is_none() {
            return Some(StopCause::Cancelled);
        }
        Some(self.leadership.end_cause().unwrap_or(StopCause::Cancelled))
    }

    /// The fencing token of this term (see [`Leadership::fencing_token`]). Pass it to every
    /// external system that can reject writes from an older term.
    pub fn fencing_token(&self) -> u64 {
        self.leadership.fencing_token()
    }

    /// The leadership term this task runs in.
    pub fn leadership(&self) -> &Leadership {
        &self.leadership
    }
}

/// Runs `task` whenever `source` reports leading, and cancels it when leadership ends; returns
/// once `parent` is cancelled and the task has finished.
///
/// The counterpart of k0s's `RunLeaderTasks(ctx, statusFunc, tasks)`:
/// - On each new term, `task` is called once with a [`LeaderContext`] whose token is a child of
///   `parent`. The task should return soon after the token is cancelled.
/// - The task is cancelled only when leadership really ends (a new status that is not the same
///   term), never restarted for an unrelated status change.
/// - If the task returns while still leading, it is **not** run again until leadership is lost
///   and re-acquired.
/// - On a loss, the next term's task starts only after the previous one has returned, so tasks
///   of two terms never overlap inside one process.
///
/// ```no_run
/// # async fn demo(elector: leasehold::Elector) {
/// use tokio_util::sync::CancellationToken;
/// let shutdown = CancellationToken::new();
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
    loop {
        let (status, mut changed) = source.current_status();
        let leadership = match status {
            LeaderStatus::Leading(l) => l,
            LeaderStatus::NotLeading { .. } => {
                tokio::select! {
                    () = parent.cancelled() => return,
                    () = &mut changed => continue,
                }
            }
        };
        if parent.is_cancelled() {
            return;
        }
        let ctx = LeaderContext {
            token: parent.child_token(),
            leadership: leadership.clone(),
            parent: parent.clone(),
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
                () = &mut fut, if !finished => {
                    finished = true;
                    debug!("leader task returned while still leading; it runs again on the next term");
                }
                () = parent.cancelled() => break,
                () = &mut changed => {
                    let (status, next) = source.current_status();
                    match status {
                        LeaderStatus::Leading(l) if l.same_term(&leadership) => changed = next,
                        _ => {
                            if leadership.end_cause().is_none() {
                                leadership.mark_ended(StopCause::LeaseLost);
                            }
                            break;
                        }
                    }
                }
            }
        }
        ctx.token.cancel();
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
