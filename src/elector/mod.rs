//! The generic [`Elector`]: all the timing of leader election, over any [`LeaseStore`](crate::LeaseStore).
//!
//! Every decision is made by the sans-IO state machine in [`machine`]; [`Elector`] is a thin
//! tokio driver that turns its outputs into store calls, a watch and timers, and publishes its
//! status. The deterministic simulator in the test suite drives the same machine through seeded
//! fault schedules and checks the guarantees below on a virtual clock.
//!
//! # Guarantees
//!
//! Under the assumptions listed next, and checked by the simulator (`tests/simulator.rs`) and the
//! named regression tests:
//!
//! 1. **At most one valid term at any instant.** A term is *valid* from the moment its elector
//!    publishes [`LeaderStatus::Leading`](crate::LeaderStatus::Leading) until the earlier of its step-down and
//!    [`Leadership::valid_until`](crate::Leadership::valid_until). Validity terms of different electors never overlap.
//! 2. **Fencing tokens strictly increase from term to term** on a key, also across deletion or
//!    loss of the record where the store has a monotonic source (see
//!    [`LeaseStore::acquire`](crate::LeaseStore::acquire),
//!    [`LeaseStore::fencing_seed`](crate::LeaseStore::fencing_seed) and the README's store
//!    table). On a store that assigns tokens at commit
//!    ([`Capabilities::commit_tokens`](crate::Capabilities::commit_tokens)) no token is issued
//!    twice, not even to a void term. No term starts with a token that is not above the last
//!    one seen: when none can be represented, the elector does not lead and reports
//!    [`Error::TokenExhausted`](crate::Error::TokenExhausted) through [`Elector::store_health`].
//! 3. **Prompt takeover.** Once faults stop, some elector leads within
//!    `lease_duration + renew_deadline + 2.2 × retry_period` (scaled by the clock-rate bound, plus
//!    a few store round trips), polling followers included.
//!
//! A record lost while its term is valid (deleted, overwritten with data that is not a record,
//! released or replaced by an older term's copy by another client) voids guarantee 1 for that
//! term: an elector that missed it cannot know the term existed. With fencing seeds (no commit
//! tokens) a loss can break guarantee 2 as well: a create whose seed was read before the loss (a
//! delayed request, a paused process) can commit a low token afterwards, and later terms can
//! then repeat earlier tokens.
//!
//! Another writer that edits the record's fields without losing it (holder, times, token, a
//! restored copy of the same term's record) voids nothing. One that **shortens the lease
//! duration** can let followers take over before the leader could know: guarantee 1 does not
//! hold from that write until the leader observes it; from then on the term is valid at most
//! `renew_deadline / lease_duration` of the written duration after its last confirmed renewal
//! ([`machine::Output::Shortened`]), and the next renewal writes the elector's own duration.
//!
//! # Assumptions
//!
//! - **Bounded clock rate drift.** Each elector measures time with its own monotonic clock; their
//!   rates may differ by a factor ρ with `(1 + ρ) × renew_deadline < (1 − ρ) × lease_duration`
//!   (about ±20 % with the defaults). Wall clocks and record timestamps do not matter.
//! - **No suspend of `CLOCK_MONOTONIC`.** A pause of the process (SIGSTOP, a GC or VM stall) is
//!   fine: the monotonic clock keeps running, and [`Leadership::ensure_leading`](crate::Leadership::ensure_leading) fails once the
//!   term's validity passed. A system suspend that stops the monotonic clock is not.
//! - **Fencing for side effects.** Task code that acts on a term calls
//!   [`Leadership::ensure_leading`](crate::Leadership::ensure_leading) (or [`LeaderContext::ensure_leading`](crate::LeaderContext::ensure_leading))
//!   right before the side effect and passes the fencing token to systems that can check it. A
//!   check cannot stop a process that pauses right after it; the token can.
//! - **The store keeps its contract** ([`LeaseStore`](crate::LeaseStore)): compare-and-swap is
//!   atomic, a watch never delivers an older state after a newer one, times are kept to the
//!   microsecond. Replies may be slow, lost, reported as errors after the write landed, or
//!   replayed; watches may fail or end at any time.
//!
//! # Behaviour
//!
//! - **Skew-safe expiry.** A follower takes over when the record stayed unchanged for its lease
//!   duration, measured on its own clock from when it *first observed* that version. Re-reading
//!   an unchanged version (polling, a re-established watch) never postpones expiry.
//! - **A missing record is not proof of a vacant lease.** It is created only after the key was
//!   seen absent for a whole lease duration (unless [`ElectorConfig::trust_absence`]), so a term
//!   that was valid when its record was deleted or lost has ended first. This costs one lease
//!   duration on the first start of a brand-new key; a released lease (an empty holder) is taken
//!   at once.
//! - **Hard term deadline.** The leader's term is valid until `renew_deadline` after it *sent* its
//!   last confirmed renewal; a timer steps it down then, whatever I/O is in flight. Every store
//!   call is bounded by the time left.
//! - **Watch-driven followers.** On release a follower acquires at once; on a silent holder it
//!   tries at the exact expiry instant; in steady state a watching follower sends no requests.
//!   Without a watch (unsupported, or failing: re-opened with jittered backoff) followers poll
//!   every `retry_period`, jittered by client-go's factor 1.2.
//! - **Own writes recognised.** After a write that failed or timed out, the elector reads back
//!   and recognises a write of its own by holder and acquire time, and by fencing token where it
//!   chose the token (and which renewal landed by its renew time; times are written at
//!   microsecond precision, which every store keeps). A change by another writer that keeps the
//!   term (a label edit on a kube Lease, a restored older copy of its record) is adopted; a watch
//!   that delivers a version this term already replaced is ignored. Every renewal writes the
//!   elector's own lease duration. A record this elector instance wrote in an earlier term (its
//!   renewal landed after it stepped down, say after a store pause) is taken back at once, as a
//!   new term.
//! - **Ordered release.** [`Elector::shutdown`] and [`Elector::yield_for`] end the term (status
//!   changes, tasks are cancelled with [`StopCause::SteppedDown`](crate::StopCause::SteppedDown)), **keep renewing** while every
//!   [`Leadership`](crate::Leadership) guard is dropped (up to [`ElectorConfig::drain_timeout`]), then revoke the term
//!   and write the release (empty holder, lease duration 1 s, as client-go). An in-flight renewal
//!   is awaited, not abandoned, so the release goes to the right version. If tasks outlive the
//!   drain timeout, the term is revoked and the lease is **not** released: it expires, and the next
//!   leader starts only after that.
//! - **Fencing token.** A store with commit tokens assigns each acquisition's token at commit
//!   ([`LeaseStore::acquire`](crate::LeaseStore::acquire)), so a write that lands late still gets
//!   a token above every earlier one. Otherwise each acquisition writes `transitions + 1`, and a
//!   fresh record starts at the store's fencing seed (or one above the highest token this
//!   elector has seen), checked against a second seed after the create.
//! - **Health.** [`Elector::check_health`] fails when the elector believes it leads past its
//!   term's validity (its task is stuck), when its task failed, or once a leader task panicked.
//! - **Leader task panics.** A task run by [`run_leader_tasks`](crate::run_leader_tasks) that
//!   panics ends the term: the elector steps down, stops campaigning and shuts down in order
//!   (the lease is released once the panicked task's guard is gone), `check_health` reports
//!   [`Error::LeaderTaskPanicked`](crate::Error::LeaderTaskPanicked) for the rest of the elector's life, and the panic is resumed
//!   to `run_leader_tasks`' caller. No zombie leader keeps renewing with no leader work running.
//! - **Corrupt records** are treated as held by an unknown holder and replaced only after they
//!   stayed unchanged for a whole lease duration. Absurd lease durations in records are treated as
//!   [`machine::MAX_RECORD_LEASE_DURATION`].
//!
//! Every state change is logged with `tracing`, in a span carrying the lease key and identity.

mod config;
mod driver;
mod handle;
pub mod machine;

pub use config::{ElectorConfig, MAX_IDENTITY_LEN, MAX_TIMING, default_identity};
pub use handle::Elector;
pub use machine::RELEASE_LEASE_DURATION;
