//! Leadership status, published the way k0s's `CurrentStatus()` does it.
//!
//! A [`StatusSource`] hands out the current [`LeaderStatus`] together with a [`StatusChanged`]
//! future that resolves when that status has been superseded. Callers loop on it; there is
//! nothing to register or deregister, and no caller can block another or the publisher:
//!
//! ```
//! # async fn demo(elector: leasehold::Elector) {
//! use leasehold::StatusSource;
//! loop {
//!     let (status, changed) = elector.current_status();
//!     println!("now: {status:?}");
//!     changed.await;
//! }
//! # }
//! ```
//!
//! Subscribers are woken only by real changes: a renewal does not wake anyone, a new term or a
//! new leader identity does.
//!
//! # Leadership guards
//!
//! A [`LeaderStatus::Leading`] carries a [`Leadership`], which is also a *guard*: while any clone
//! of it is alive, an ordered shutdown (or yield) of the [`Elector`](crate::Elector) waits —
//! bounded by the remaining lease time — before it releases the lease, so the next leader never
//! overlaps work of the old one. Hold a `Leadership` for as long as leader-only work runs, and
//! drop it promptly when that work stops. [`run_leader_tasks`](crate::run_leader_tasks) does this
//! for you.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::SystemTime;

use futures::future::BoxFuture;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

/// Why a term of leadership ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopCause {
    /// The lease was lost: another holder took it, or it could not be renewed within the renew
    /// deadline.
    LeaseLost,
    /// The elector stepped down on purpose: it is shutting down or yielding the lease.
    SteppedDown,
    /// The caller's own cancellation token was cancelled (see
    /// [`run_leader_tasks`](crate::run_leader_tasks)).
    Cancelled,
}

impl fmt::Display for StopCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StopCause::LeaseLost => "the lease was lost",
            StopCause::SteppedDown => "the elector stepped down (shutdown or yield)",
            StopCause::Cancelled => "the caller cancelled",
        })
    }
}

struct Term {
    fencing_token: u64,
    since: Instant,
    since_wall: SystemTime,
    ended: OnceLock<StopCause>,
    on_last_drop: Mutex<Option<oneshot::Sender<()>>>,
}

impl Drop for Term {
    fn drop(&mut self) {
        let tx = self
            .on_last_drop
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(tx) = tx {
            let _ = tx.send(());
        }
    }
}

/// One term of leadership: the fencing token and when it began. Also a guard (see the
/// [module docs](self)). Cheap to clone; clones are the same term.
#[derive(Clone)]
pub struct Leadership {
    term: Arc<Term>,
}

// === impl Leadership ===

impl Leadership {
    /// A term with fencing token `fencing_token` that starts now.
    ///
    /// Electors create these; the constructor is public for fakes in tests and for
    /// always-leading setups. The returned receiver resolves once every clone is dropped.
    pub fn new(fencing_token: u64) -> (Self, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let term = Term {
            fencing_token,
            since: Instant::now(),
            since_wall: SystemTime::now(),
            ended: OnceLock::new(),
            on_last_drop: Mutex::new(Some(tx)),
        };
        (
            Leadership {
                term: Arc::new(term),
            },
            rx,
        )
    }

    /// The fencing token of this term: the lease record's `transitions` after acquisition.
    /// Strictly greater than the token of every earlier term on the same record.
    pub fn fencing_token(&self) -> u64 {
        self.term.fencing_token
    }

    /// When this term began (monotonic clock).
    pub fn since(&self) -> Instant {
        self.term.since
    }

    /// When this term began (wall clock, informational).
    pub fn since_wall(&self) -> SystemTime {
        self.term.since_wall
    }

    /// Why this term ended, once it has.
    pub fn end_cause(&self) -> Option<StopCause> {
        self.term.ended.get().copied()
    }

    /// Records why the term ended (first call wins). Used by the publisher before it publishes
    /// the status that supersedes this term.
    pub fn mark_ended(&self, cause: StopCause) {
        let _ = self.term.ended.set(cause);
    }

    /// Whether `self` and `other` are the same term.
    pub fn same_term(&self, other: &Leadership) -> bool {
        Arc::ptr_eq(&self.term, &other.term)
    }
}

impl PartialEq for Leadership {
    fn eq(&self, other: &Self) -> bool {
        self.same_term(other)
    }
}
impl Eq for Leadership {}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("fencing_token", &self.term.fencing_token)
            .field("since", &self.term.since)
            .finish()
    }
}

/// The status of an elector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaderStatus {
    /// This elector does not lead. `leader` is the identity of the current holder when one is
    /// known and its lease has not expired (client-go's `OnNewLeader`, without a callback).
    NotLeading {
        /// The current leader's identity, if known.
        leader: Option<String>,
    },
    /// This elector leads.
    Leading(Leadership),
}

// === impl LeaderStatus ===

impl LeaderStatus {
    /// Whether this status is `Leading`.
    pub fn is_leading(&self) -> bool {
        matches!(self, LeaderStatus::Leading(_))
    }

    /// The leadership term, when leading.
    pub fn leadership(&self) -> Option<&Leadership> {
        match self {
            LeaderStatus::Leading(l) => Some(l),
            LeaderStatus::NotLeading { .. } => None,
        }
    }

    /// The known leader's identity when not leading.
    pub fn leader(&self) -> Option<&str> {
        match self {
            LeaderStatus::NotLeading { leader } => leader.as_deref(),
            LeaderStatus::Leading(_) => None,
        }
    }
}

/// A future that resolves when the status it was handed out with has been superseded.
///
/// If the publisher goes away, no change can come any more and the future never resolves.
///
/// # Cancel safety
///
/// Dropping it has no effect on anyone else.
pub struct StatusChanged(BoxFuture<'static, ()>);

impl Future for StatusChanged {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

impl fmt::Debug for StatusChanged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StatusChanged")
    }
}

// === impl StatusChanged ===

impl StatusChanged {
    /// Wraps any future as a change signal (for fakes and adapters).
    pub fn from_future(f: impl Future<Output = ()> + Send + 'static) -> Self {
        StatusChanged(Box::pin(f))
    }
}

/// Anything that publishes a leadership status with a change signal: an
/// [`Elector`](crate::Elector), a [`StatusCell`], or a fake in a test.
pub trait StatusSource: Send + Sync {
    /// The current status and a future that resolves once it has been superseded.
    fn current_status(&self) -> (LeaderStatus, StatusChanged);
}

impl<T: StatusSource + ?Sized> StatusSource for Arc<T> {
    fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        (**self).current_status()
    }
}

impl<T: StatusSource + ?Sized> StatusSource for &T {
    fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        (**self).current_status()
    }
}

/// A published status: the current value plus change notification, notifying only on real
/// changes. Electors publish through one; tests use one as a fake [`StatusSource`].
#[derive(Clone, Debug)]
pub struct StatusCell {
    tx: Arc<watch::Sender<LeaderStatus>>,
}

impl Default for StatusCell {
    fn default() -> Self {
        Self::new(LeaderStatus::NotLeading { leader: None })
    }
}

// === impl StatusCell ===

impl StatusCell {
    /// A cell holding `initial`.
    pub fn new(initial: LeaderStatus) -> Self {
        StatusCell {
            tx: Arc::new(watch::Sender::new(initial)),
        }
    }

    /// Publishes `status` if it differs from the current one; returns whether it did.
    /// When a `Leading` term is superseded, the cell's own clone of its guard is dropped.
    pub fn set(&self, status: LeaderStatus) -> bool {
        self.tx.send_if_modified(|cur| {
            if *cur == status {
                false
            } else {
                *cur = status;
                true
            }
        })
    }

    /// The current status.
    pub fn get(&self) -> LeaderStatus {
        self.tx.borrow().clone()
    }

    /// A `tokio::sync::watch` receiver, for callers who prefer that idiom.
    pub fn subscribe(&self) -> watch::Receiver<LeaderStatus> {
        self.tx.subscribe()
    }
}

impl StatusSource for StatusCell {
    fn current_status(&self) -> (LeaderStatus, StatusChanged) {
        let mut rx = self.tx.subscribe();
        let status = rx.borrow_and_update().clone();
        let changed = StatusChanged(Box::pin(async move {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }));
        (status, changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn notifies_only_on_real_changes() {
        let cell = StatusCell::default();
        let (_, changed) = cell.current_status();
        assert!(!cell.set(LeaderStatus::NotLeading { leader: None }));
        let mut changed = Box::pin(changed);
        assert!(futures::poll!(changed.as_mut()).is_pending());
        assert!(cell.set(LeaderStatus::NotLeading {
            leader: Some("a".into())
        }));
        changed.await;
    }

    #[tokio::test]
    async fn guard_fires_when_last_clone_drops() {
        let (l, mut rx) = Leadership::new(3);
        let cell = StatusCell::new(LeaderStatus::Leading(l.clone()));
        drop(l);
        assert!(rx.try_recv().is_err());
        let held = cell.get();
        cell.set(LeaderStatus::NotLeading { leader: None });
        assert!(rx.try_recv().is_err(), "a caller still holds the term");
        drop(held);
        assert!(rx.try_recv().is_ok());
    }
}
