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
use std::time::{Duration, SystemTime};

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

/// How long a term may be acted on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Validity {
    /// Until this instant (monotonic), unless moved by a renewal.
    Until(Instant),
    /// Until the term is ended (terms that need no lease, such as k0s's always-leading).
    UntilEnded,
    /// Not any more.
    Revoked,
}

struct Term {
    fencing_token: u64,
    since: Instant,
    since_wall: SystemTime,
    ended: OnceLock<StopCause>,
    validity: Arc<Mutex<Validity>>,
    on_last_drop: Mutex<Option<oneshot::Sender<()>>>,
    /// Told when a leader task of this term panicked (an elector sets it to step down).
    on_panic: Mutex<Option<PanicHook>>,
}

/// What a term's publisher is told when a leader task of the term panicked: the panic message.
pub(crate) type PanicHook = Box<dyn FnOnce(String) + Send>;

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

/// One term of leadership: the fencing token, when it began, and until when it may be acted on.
/// Also a guard (see the [module docs](self)). Cheap to clone; clones are the same term.
///
/// Only an elector (or the k0s layer's stand-ins) creates and ends terms; user code cannot forge
/// one. Tests fake them through the `testing` feature.
///
/// # Acting on a term
///
/// Call [`ensure_leading`](Leadership::ensure_leading) right before every side effect that only
/// the leader may perform: it checks the term against the monotonic clock *now*, so it also
/// catches a process that was paused (SIGSTOP, a GC or VM stall) past its term and has not yet
/// heard that it lost it. The check narrows the window but cannot close it (the process can pause
/// between the check and the effect): pass [`fencing_token`](Leadership::fencing_token) to every
/// system that can reject writes from an older term. That is the real protection.
#[derive(Clone)]
pub struct Leadership {
    term: Arc<Term>,
}

// === impl Leadership ===

impl Leadership {
    /// A term with fencing token `fencing_token` that starts now and may be acted on as
    /// `validity` says. The returned receiver resolves once every clone is dropped.
    pub(crate) fn new_term(
        fencing_token: u64,
        validity: Validity,
    ) -> (Self, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let term = Term {
            fencing_token,
            since: Instant::now(),
            since_wall: SystemTime::now(),
            ended: OnceLock::new(),
            validity: Arc::new(Mutex::new(validity)),
            on_last_drop: Mutex::new(Some(tx)),
            on_panic: Mutex::new(None),
        };
        (
            Leadership {
                term: Arc::new(term),
            },
            rx,
        )
    }

    /// The fencing token of this term: the lease record's `transitions` after acquisition.
    /// Strictly greater than the token of every earlier term on the same key (see the README's
    /// store table for what each store's guarantee survives).
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

    /// Why this term ended, once it has. The first cause recorded is kept forever.
    pub fn end_cause(&self) -> Option<StopCause> {
        self.term.ended.get().copied()
    }

    /// Records why the term ended (first call wins).
    pub(crate) fn mark_ended(&self, cause: StopCause) {
        let _ = self.term.ended.set(cause);
    }

    fn validity(&self) -> Validity {
        *self.term.validity.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(feature = "testing")]
    pub(crate) fn set_validity(&self, v: Validity) {
        set_validity(&self.term.validity, v);
    }

    /// The term's validity cell, for the publisher to update without holding a guard.
    pub(crate) fn validity_cell(&self) -> Arc<Mutex<Validity>> {
        self.term.validity.clone()
    }

    /// Whether `cell` is this term's validity cell (it identifies the term without a guard).
    pub(crate) fn has_validity_cell(&self, cell: &Arc<Mutex<Validity>>) -> bool {
        Arc::ptr_eq(&self.term.validity, cell)
    }

    /// Sets what is called when a leader task of this term panics (see
    /// [`report_panic`](Self::report_panic)).
    pub(crate) fn set_panic_hook(&self, hook: PanicHook) {
        *self.term.on_panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(hook);
    }

    /// Tells the term's publisher (once) that a leader task of this term panicked.
    pub(crate) fn report_panic(&self, message: String) {
        let hook = self
            .term
            .on_panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(hook) = hook {
            hook(message);
        }
    }

    /// Until when this term may be acted on, as known now (monotonic clock): the instant its
    /// last confirmed renewal was sent plus the renew deadline. Renewals move it later; it is
    /// `None` once the term has been revoked (lost, or released) and for terms that need no
    /// lease (see [`ensure_leading`](Self::ensure_leading) for those).
    ///
    /// A graceful step-down keeps renewing while leader tasks drain, so a task's cleanup may
    /// still act on the term until the elector revokes it right before releasing the lease.
    pub fn valid_until(&self) -> Option<Instant> {
        match self.validity() {
            Validity::Until(t) => Some(t),
            Validity::UntilEnded | Validity::Revoked => None,
        }
    }

    /// Whether this term may be acted on right now (see [`ensure_leading`](Self::ensure_leading)).
    pub fn is_valid(&self) -> bool {
        match self.validity() {
            Validity::Until(t) => Instant::now() < t,
            Validity::UntilEnded => self.end_cause().is_none(),
            Validity::Revoked => false,
        }
    }

    /// Checks, against the monotonic clock, that this term may still be acted on, and returns
    /// its fencing token. Call it right before each leader-only side effect, and pass the token
    /// along to whatever can check it.
    ///
    /// # Errors
    /// [`Error::NotLeading`](crate::Error::NotLeading) when the term's validity has passed (its
    /// last confirmed renewal is older than the renew deadline: the process may have been
    /// paused), or the term was revoked (lost, released, or ended).
    pub fn ensure_leading(&self) -> crate::Result<u64> {
        if self.is_valid() {
            Ok(self.term.fencing_token)
        } else {
            Err(crate::Error::NotLeading {
                fencing_token: self.term.fencing_token,
                cause: self.end_cause(),
            })
        }
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
            .field("valid_until", &self.valid_until())
            .finish()
    }
}

/// `t + d`, or a far-future instant where that cannot be represented (for durations such as
/// `Duration::MAX` meaning "never").
pub(crate) fn instant_after(t: Instant, d: Duration) -> Instant {
    /// About 30 years: later than anything a lease needs, and representable.
    const FAR: Duration = Duration::from_secs(30 * 365 * 24 * 60 * 60);
    t.checked_add(d.min(FAR))
        .or_else(|| t.checked_add(Duration::from_secs(24 * 60 * 60)))
        .unwrap_or(t)
}

/// Updates a validity cell; a revoked term stays revoked.
pub(crate) fn set_validity(cell: &Mutex<Validity>, v: Validity) {
    let mut cur = cell.lock().unwrap_or_else(|e| e.into_inner());
    if *cur != Validity::Revoked {
        *cur = v;
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
    /// This elector won the term it carries. It may act as the leader only while that term is
    /// valid ([`LeaderStatus::is_leading`] checks the clock; the elector publishes the end of the
    /// term at its deadline, but a reader can run first, for instance right after a pause).
    Leading(Leadership),
    /// The elector has stopped (it was shut down, every handle was dropped, its runtime went
    /// away, or its task failed). Terminal: the status never changes again, and a
    /// [`StatusChanged`] handed out with it resolves at once, so a status loop must end on it.
    /// [`run_leader_tasks`](crate::run_leader_tasks) returns when it sees it.
    Stopped,
}

// === impl LeaderStatus ===

impl LeaderStatus {
    /// Whether this status says leading **now**: it is `Leading` and its term is still valid by
    /// the monotonic clock ([`Leadership::is_valid`]). A `Leading` status read after its term's
    /// deadline (the elector has not published the end yet, say right after a process pause)
    /// answers `false`. For the variant alone, see
    /// [`is_leading_variant`](Self::is_leading_variant).
    pub fn is_leading(&self) -> bool {
        self.leadership().is_some_and(Leadership::is_valid)
    }

    /// Whether this status is the `Leading` variant, whatever the clock says: the term it
    /// carries may already be past its deadline. To ask whether this elector may act as the
    /// leader now, use [`is_leading`](Self::is_leading) (or, right before a side effect,
    /// [`Leadership::ensure_leading`]).
    pub fn is_leading_variant(&self) -> bool {
        matches!(self, LeaderStatus::Leading(_))
    }

    /// Whether this status is the terminal `Stopped`.
    pub fn is_stopped(&self) -> bool {
        matches!(self, LeaderStatus::Stopped)
    }

    /// The leadership term when the status is `Leading` (it may already be past its deadline:
    /// check it with [`Leadership::is_valid`] or [`Leadership::ensure_leading`]).
    pub fn leadership(&self) -> Option<&Leadership> {
        match self {
            LeaderStatus::Leading(l) => Some(l),
            LeaderStatus::NotLeading { .. } | LeaderStatus::Stopped => None,
        }
    }

    /// The known leader's identity when not leading.
    pub fn leader(&self) -> Option<&str> {
        match self {
            LeaderStatus::NotLeading { leader } => leader.as_deref(),
            LeaderStatus::Leading(_) | LeaderStatus::Stopped => None,
        }
    }
}

/// A future that resolves when the status it was handed out with has been superseded.
///
/// It also resolves when the publisher stops: an elector publishes the terminal
/// [`LeaderStatus::Stopped`] when it stops (shut down, every handle dropped, its runtime gone,
/// or its task failed), and a [`StatusCell`] whose publishers are all gone ends the wait too.
/// A `StatusChanged` handed out *with* `Stopped` never resolves, since nothing changes any more
/// (resolving at once would make a loop that misses `Stopped` spin). A status loop therefore
/// ends on `Stopped`:
///
/// ```
/// # async fn demo(elector: leasehold::Elector) {
/// use leasehold::LeaderStatus;
/// loop {
///     let (status, changed) = elector.current_status();
///     match status {
///         LeaderStatus::Leading(term) => println!("leading, token {}", term.fencing_token()),
///         LeaderStatus::NotLeading { leader } => println!("following {leader:?}"),
///         LeaderStatus::Stopped => break,
///     }
///     changed.await;
/// }
/// # }
/// ```
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
/// changes. Electors publish through one; only the crate (and tests, through the `testing`
/// feature) can set it.
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
    pub(crate) fn set(&self, status: LeaderStatus) -> bool {
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
        let stopped = status.is_stopped();
        let changed = StatusChanged(Box::pin(async move {
            if stopped {
                // Terminal: nothing changes any more. Resolving here would turn a loop that
                // misses `Stopped` into a busy loop that starves its runtime.
                std::future::pending::<()>().await;
            }
            // An error means every publisher is gone: no change can come any more, which ends
            // the wait as a stop does.
            let _ = rx.changed().await;
        }));
        (status, changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_wait_ends_when_every_publisher_is_gone() {
        let cell = StatusCell::default();
        let (_, changed) = cell.current_status();
        let mut changed = Box::pin(changed);
        assert!(futures::poll!(changed.as_mut()).is_pending());
        drop(cell);
        tokio::time::timeout(std::time::Duration::from_secs(5), changed)
            .await
            .expect("the wait ends once the cell is gone");
    }

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
        let (l, mut rx) = Leadership::new_term(3, Validity::UntilEnded);
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
