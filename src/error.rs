//! The crate's error type.

use std::time::Duration;

use crate::store::Version;

/// A boxed error from a store's client library, kept as the [`std::error::Error::source`] of an
/// [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result type used throughout leasehold.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in leasehold: invalid input, store outcomes the elector acts on
/// (conflicts, missing keys, corrupt data) and store failures.
///
/// Each variant says whether the operation may be retried as it is; see
/// [`Error::is_retryable`]. Backends convert their own errors into this type at the
/// [`LeaseStore`](crate::LeaseStore) boundary.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A lease key broke the key rules (see [`LeaseKey`](crate::LeaseKey)). Fix the key; do not
    /// retry.
    #[error("invalid lease key {key:?}: {rule}")]
    InvalidKey {
        /// The rejected key (as given).
        key: String,
        /// The rule it broke, in words.
        rule: &'static str,
    },

    /// A configuration value was out of range or inconsistent. Fix the configuration; do not
    /// retry.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// `create` found the key already present. Read it and update it instead.
    #[error("lease {key:?} already exists")]
    AlreadyExists {
        /// The key.
        key: String,
    },

    /// A compare-and-swap (`update` or `delete`) found a different version than expected: someone
    /// else changed the record first. Read it again and decide anew.
    #[error("lease {key:?} was changed concurrently (expected version {expected})")]
    Conflict {
        /// The key.
        key: String,
        /// The version the caller expected.
        expected: Version,
    },

    /// `update` or `delete` found no record under the key.
    #[error("lease {key:?} does not exist")]
    NotFound {
        /// The key.
        key: String,
    },

    /// The bytes stored under the key are not a lease record in leasehold's format (someone else
    /// wrote them, or they were truncated). The elector treats such a key as held by an unknown
    /// holder and takes it over only after it stayed unchanged for a whole lease duration.
    #[error("lease {key:?} holds data that is not a lease record: {reason}")]
    Corrupt {
        /// The key.
        key: String,
        /// What was wrong with the data.
        reason: String,
        /// The version of the corrupt data, when the store can tell it, so that it can be
        /// replaced by compare-and-swap.
        version: Option<Version>,
    },

    /// A store operation did not finish in time. It may or may not have taken effect; retrying is
    /// safe because every write is a compare-and-swap.
    #[error("{store} {operation} timed out after {after:?}")]
    Timeout {
        /// The store's name (for example `"redis"`).
        store: &'static str,
        /// The operation (for example `"update"`).
        operation: &'static str,
        /// How long it was given.
        after: Duration,
    },

    /// The store could not be reached or answered with a transient failure (connection refused,
    /// reset, no quorum, server busy). Retry with backoff.
    #[error("{store} is unavailable: {message}")]
    Unavailable {
        /// The store's name.
        store: &'static str,
        /// What happened, in words.
        message: String,
        /// The client library's error, if any.
        #[source]
        source: Option<BoxError>,
    },

    /// The store refused the credentials (authentication failed). Fix the credentials; retrying
    /// will not help.
    #[error("{store} rejected the credentials: {message}")]
    Unauthenticated {
        /// The store's name.
        store: &'static str,
        /// What the store said, with a hint on what to fix.
        message: String,
    },

    /// The credentials are valid but lack a permission. The message names what is missing.
    #[error("{store} denied permission: {message}")]
    PermissionDenied {
        /// The store's name.
        store: &'static str,
        /// What the store said, with the permission that is missing.
        message: String,
    },

    /// The store rejected the request as invalid (for example a name its server does not
    /// accept). Do not retry.
    #[error("{store} rejected the request as invalid: {message}")]
    Invalid {
        /// The store's name.
        store: &'static str,
        /// What the store said.
        message: String,
    },

    /// The store does not offer this operation (see [`Capabilities`](crate::Capabilities)).
    #[error("{store} does not support {operation}")]
    Unsupported {
        /// The store's name.
        store: &'static str,
        /// The operation.
        operation: &'static str,
    },

    /// The store failed in a way none of the other variants describe.
    #[error("{store} failed: {message}")]
    Store {
        /// The store's name.
        store: &'static str,
        /// What happened, in words.
        message: String,
        /// Whether the caller may retry the operation as it is.
        retryable: bool,
        /// The client library's error, if any.
        #[source]
        source: Option<BoxError>,
    },

    /// No fencing token above `last` can be issued for the lease: the token space is used up, or
    /// (on a store that cannot compare it at commit) the record carries a token above what the
    /// store's source can issue. Another writer most likely put it there. No new term can start
    /// on the key until an operator deletes it (tokens then start from the store's source
    /// again, which fencing systems that saw the high value will reject). Do not retry.
    #[error(
        "no fencing token above {last} can be issued for lease {key:?}, so no new term can start on it; another writer probably set it: delete the key to start over"
    )]
    TokenExhausted {
        /// The key.
        key: String,
        /// The highest token seen.
        last: u64,
    },

    /// The elector has been shut down; the call cannot be served any more.
    #[error("the elector for lease {key:?} has shut down")]
    Shutdown {
        /// The elector's lease key.
        key: String,
    },

    /// A leadership term may not be acted on any more: its validity passed (no confirmed renewal
    /// within the renew deadline; the process may have been paused) or it was revoked. Stop the
    /// leader-only work; a new term, if any, comes with a new fencing token.
    #[error(
        "the leadership term with fencing token {fencing_token} is no longer valid{}: do not act on it",
        match cause { Some(c) => format!(" ({c})"), None => String::new() }
    )]
    NotLeading {
        /// The term's fencing token.
        fencing_token: u64,
        /// Why the term ended, when it has been ended (it may only have run out of validity).
        cause: Option<crate::status::StopCause>,
    },

    /// The elector's background task failed (it panicked); the elector has stopped. This is a bug:
    /// please report it with the message.
    #[error("the elector for lease {key:?} failed and has stopped: {message}")]
    ElectorFailed {
        /// The elector's lease key.
        key: String,
        /// What happened.
        message: String,
    },

    /// A leader task of one of the elector's terms panicked (reported by
    /// [`Elector::check_health`](crate::Elector::check_health) from then on). The elector ended
    /// the term, released the lease once the task's guard was gone, and shut down; the panic
    /// itself was resumed to the caller of [`run_leader_tasks`](crate::run_leader_tasks). Fix the
    /// task; restart the process (or spawn a new elector) to campaign again.
    #[error(
        "a leader task of elector {identity:?} for lease {key:?} panicked ({message}); the elector stepped down and shut down"
    )]
    LeaderTaskPanicked {
        /// The lease key.
        key: String,
        /// The elector's identity.
        identity: String,
        /// The panic message.
        message: String,
    },

    /// The elector's store keeps failing: every operation since `since` ago failed (reported by
    /// [`Elector::store_health`](crate::Elector::store_health)).
    #[error(
        "the {store} store has failed the last {failures} operation(s) of the elector for lease {key:?}, for {since:?}; the last error: {last_error}"
    )]
    StoreFailing {
        /// The lease key.
        key: String,
        /// The store's name.
        store: &'static str,
        /// How many operations in a row failed.
        failures: u64,
        /// Time since the first of them failed.
        since: Duration,
        /// The last error's message.
        last_error: String,
    },

    /// A health check failed: the elector believes it leads but has not renewed in time.
    #[error(
        "elector {identity:?} believes it leads lease {key:?} but its last successful renewal was {since:?} ago (renew deadline {renew_deadline:?})"
    )]
    Unhealthy {
        /// The lease key.
        key: String,
        /// The elector's identity.
        identity: String,
        /// Time since the last successful renewal was sent.
        since: Duration,
        /// The configured renew deadline.
        renew_deadline: Duration,
    },
}

// === impl Error ===

impl Error {
    /// A short snake-case name of the error's kind (`timeout`, `unavailable`, `conflict`, …),
    /// stable for metrics labels and scripts.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::InvalidKey { .. } => "invalid_key",
            Error::InvalidConfig(_) => "invalid_config",
            Error::AlreadyExists { .. } => "already_exists",
            Error::Conflict { .. } => "conflict",
            Error::NotFound { .. } => "not_found",
            Error::Corrupt { .. } => "corrupt",
            Error::Timeout { .. } => "timeout",
            Error::Unavailable { .. } => "unavailable",
            Error::Unauthenticated { .. } => "unauthenticated",
            Error::PermissionDenied { .. } => "permission_denied",
            Error::Invalid { .. } => "invalid",
            Error::Unsupported { .. } => "unsupported",
            Error::Store { .. } => "store",
            Error::TokenExhausted { .. } => "token_exhausted",
            Error::Shutdown { .. } => "shutdown",
            Error::NotLeading { .. } => "not_leading",
            Error::ElectorFailed { .. } => "elector_failed",
            Error::LeaderTaskPanicked { .. } => "leader_task_panicked",
            Error::StoreFailing { .. } => "store_failing",
            Error::Unhealthy { .. } => "unhealthy",
        }
    }

    /// Whether the failed operation may be retried as it is (possibly after a backoff).
    ///
    /// Conflicts and `AlreadyExists` are not retryable as they are: the caller must read the
    /// record again first.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Timeout { .. } | Error::Unavailable { .. } => true,
            Error::Store { retryable, .. } => *retryable,
            _ => false,
        }
    }
}
