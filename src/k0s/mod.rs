//! The k0s compatibility layer: what k0s's `leaderelector` package offers, built on the
//! [`Elector`](crate::Elector) and the [`StatusSource`](crate::StatusSource) pattern.
//!
//! - [`LeaderLease`] (k0s's `LeasePool`): one leader lease with a start/stop lifecycle. Its API
//!   is [`current_status`](crate::StatusSource::current_status), to be consumed with
//!   [`run_leader_tasks`](crate::run_leader_tasks). The old callback API of k0s
//!   ([`LeaderElector::is_leader`], [`LeaderElector::add_acquired_lease_callback`],
//!   [`LeaderElector::add_lost_lease_callback`]) is still there, deprecated, and implemented
//!   only on top of the new one.
//! - [`AlwaysLeading`] (k0s's `Dummy`/`AlwaysLeading`): the same interface for single-controller
//!   setups, where leader election is unnecessary.
//! - [`NeverLeading`] (k0s's `Dummy{Leader: false}`): the same interface, never leading, for
//!   tests and for processes that must never run leader-only work.
//! - [`ControllerCounter`] (k0s's `K0sControllersLeaseCounter`): every controller holds its own
//!   lease `<prefix><node-name>`; the counter reports how many controllers are alive.
//!
//! # Callbacks (deprecated API), improved over k0s
//!
//! - Callbacks may be registered at any time, also after the start. An acquired-lease callback
//!   registered while leading runs promptly.
//! - One task, driven by [`run_leader_tasks`](crate::run_leader_tasks), runs the acquired
//!   callbacks when a term starts and the lost callbacks when it ends (also on stop while
//!   leading), sequentially, in registration order. A lost callback runs before the lease is
//!   released on an ordered stop or yield, so the next leader never overlaps it.
//! - Each callback runs on a blocking-pool thread ([`tokio::task::spawn_blocking`]), so a slow
//!   or blocking callback never blocks the elector, the async runtime, or any other caller of
//!   `current_status`; a panicking callback is caught and logged, and the next callback runs.
//!   A callback still running after 10 s is logged as slow.
//! - The log line on the end of a term names the real cause ([`StopCause`](crate::StopCause)).

mod callbacks;
mod counter;
mod pool;

#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;

pub use callbacks::LeaseCallback;
pub(crate) use callbacks::callback_term;
pub use counter::{
    ControllerCounter, CountChanged, CounterConfig, DEFAULT_SKEW_TOLERANCE, INITIAL_COUNT,
};
pub use pool::{AlwaysLeading, LeaderElector, LeaderLease, NeverLeading};

use std::time::Duration;

/// k0s's lease duration (its `LeasePool` and controller leases): 60 s.
pub const LEASE_DURATION: Duration = Duration::from_secs(60);
/// k0s's renew deadline: 15 s.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(15);
/// k0s's retry period: 5 s.
pub const RETRY_PERIOD: Duration = Duration::from_secs(5);
/// The Kubernetes namespace k0s keeps its Leases in (its leader lease and the per-controller
/// leases): pass it to the Kubernetes store's configuration (`leasehold-kube`).
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";
