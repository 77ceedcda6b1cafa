//! Test tools (feature `testing`, not API-stable): fake leadership terms and statuses for code
//! that consumes a [`StatusSource`](crate::StatusSource).
//!
//! Production code cannot create, end or publish terms; an elector does that. Tests of leader
//! tasks and adapters can, through these functions:
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use leasehold::{LeaderStatus, StatusCell, StopCause, testing};
//! let (term, _drained) = testing::new_term(7);
//! let cell = StatusCell::new(LeaderStatus::Leading(term.clone()));
//! assert_eq!(term.ensure_leading().unwrap(), 7);
//! testing::end_term(&term, StopCause::LeaseLost);
//! testing::set_status(&cell, LeaderStatus::NotLeading { leader: None });
//! assert!(term.ensure_leading().is_err());
//! # }
//! ```

use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::status::{LeaderStatus, Leadership, StatusCell, StopCause, Validity};

/// A term with `fencing_token` that is valid until [`end_term`] (or [`revoke`]); the receiver
/// resolves once every clone of it is dropped.
pub fn new_term(fencing_token: u64) -> (Leadership, oneshot::Receiver<()>) {
    Leadership::new_term(fencing_token, Validity::UntilEnded)
}

/// A term with `fencing_token` that is valid for `validity` from now (monotonic clock). Any
/// duration is accepted; one too large to represent means "practically forever".
pub fn new_term_valid_for(
    fencing_token: u64,
    validity: Duration,
) -> (Leadership, oneshot::Receiver<()>) {
    Leadership::new_term(
        fencing_token,
        Validity::Until(crate::status::instant_after(Instant::now(), validity)),
    )
}

/// Ends `term` for `cause` (the first cause recorded wins); it is no longer valid.
pub fn end_term(term: &Leadership, cause: StopCause) {
    term.mark_ended(cause);
    revoke(term);
}

/// Revokes `term`'s validity without ending it (as an elector does before it releases).
pub fn revoke(term: &Leadership) {
    term.set_validity(Validity::Revoked);
}

/// Publishes `status` on `cell` if it differs from the current one; returns whether it did.
pub fn set_status(cell: &StatusCell, status: LeaderStatus) -> bool {
    cell.set(status)
}

/// Whether `status` holds a term that was valid at the instant `at`: it began by then and its
/// validity reached past it. Compare several electors against **one** instant (read the clock
/// once): checking `is_leading()` of one elector after another can straddle a handover and
/// count the old and the new leader together.
pub fn valid_at(status: &LeaderStatus, at: Instant) -> bool {
    match status.leadership() {
        Some(l) => l.since() <= at && l.valid_until().is_some_and(|v| v > at),
        None => false,
    }
}
