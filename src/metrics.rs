//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature `metrics`).
//!
//! Every elector emits, labelled with `lease` (the lease key):
//!
//! | name | type | meaning |
//! |---|---|---|
//! | `leasehold_leader_status` | gauge | 1 while this elector leads, else 0 (client-go's `leader_election_master_status`) |
//! | `leasehold_leader_transitions_total` | counter | terms this elector started |
//! | `leasehold_renew_duration_seconds` | histogram | round trip of each successful renewal |
//! | `leasehold_acquire_duration_seconds` | histogram | from the start of campaigning (start-up, or the end of this elector's previous term) to leading |
//! | `leasehold_store_errors_total` | counter | failed store operations, also labelled `store` (its name) and `kind` (the error kind, such as `unavailable` or `timeout`) |
//!
//! The library installs no exporter: install a recorder (such as `metrics-exporter-prometheus`)
//! in the application, as the `leasehold` command does. Without the feature these calls compile
//! to nothing.

use std::time::Duration;

use crate::Error;

/// The metric names, for exporters and tests.
pub mod names {
    /// Gauge: 1 while leading, else 0.
    pub const LEADER_STATUS: &str = "leasehold_leader_status";
    /// Counter: terms started.
    pub const TRANSITIONS: &str = "leasehold_leader_transitions_total";
    /// Histogram: successful renewal round trips, in seconds.
    pub const RENEW_DURATION: &str = "leasehold_renew_duration_seconds";
    /// Histogram: time from the start of campaigning to leading, in seconds.
    pub const ACQUIRE_DURATION: &str = "leasehold_acquire_duration_seconds";
    /// Counter: failed store operations, by `store` and `kind`.
    pub const STORE_ERRORS: &str = "leasehold_store_errors_total";
}

/// One elector's metric handles.
#[derive(Debug)]
pub(crate) struct Metrics {
    #[cfg(feature = "metrics")]
    lease: String,
}

impl Metrics {
    pub(crate) fn new(lease: &str) -> Self {
        #[cfg(not(feature = "metrics"))]
        let _ = lease;
        Metrics {
            #[cfg(feature = "metrics")]
            lease: lease.to_owned(),
        }
    }

    /// Whether this elector leads now.
    pub(crate) fn leading(&self, leading: bool) {
        #[cfg(feature = "metrics")]
        metrics::gauge!(names::LEADER_STATUS, "lease" => self.lease.clone()).set(if leading {
            1.0
        } else {
            0.0
        });
        #[cfg(not(feature = "metrics"))]
        let _ = leading;
    }

    /// A term started, `after` campaigning for it.
    pub(crate) fn acquired(&self, after: Option<Duration>) {
        #[cfg(feature = "metrics")]
        {
            metrics::counter!(names::TRANSITIONS, "lease" => self.lease.clone()).increment(1);
            if let Some(after) = after {
                metrics::histogram!(names::ACQUIRE_DURATION, "lease" => self.lease.clone())
                    .record(after.as_secs_f64());
            }
        }
        #[cfg(not(feature = "metrics"))]
        let _ = after;
    }

    /// A renewal succeeded after a round trip of `took`.
    pub(crate) fn renewed(&self, took: Duration) {
        #[cfg(feature = "metrics")]
        metrics::histogram!(names::RENEW_DURATION, "lease" => self.lease.clone())
            .record(took.as_secs_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = took;
    }

    /// A store operation failed.
    pub(crate) fn store_error(&self, store: &'static str, e: &Error) {
        #[cfg(feature = "metrics")]
        metrics::counter!(
            names::STORE_ERRORS,
            "lease" => self.lease.clone(),
            "store" => store,
            "kind" => e.kind(),
        )
        .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = (store, e);
    }
}
