//! [`ElectorConfig`]: the timings, identity and options of an elector, and their validation.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::store::LeaseKey;

/// The longest identity accepted, in bytes.
pub const MAX_IDENTITY_LEN: usize = 1024;

/// The longest accepted value of each duration in [`ElectorConfig`] (one day).
pub const MAX_TIMING: Duration = Duration::from_secs(24 * 60 * 60);

/// A unique default identity: the host name plus a random suffix, so two elector instances on
/// one host (or a restarted one) never share an identity (as k0s's invocation id does).
pub fn default_identity() -> String {
    let host = gethostname::gethostname().to_string_lossy().into_owned();
    let host = if host.is_empty() {
        "leasehold".to_owned()
    } else {
        host
    };
    format!("{host}-{:016x}", rand::random::<u64>())
}

/// Configuration of an [`Elector`](crate::Elector).
///
/// Defaults follow client-go: lease 15 s, renew deadline 10 s, retry period 2 s; drain timeout
/// 30 s. k0s uses 60 s / 15 s / 5 s: `ElectorConfig::new(key, id).with_timings(60s, 15s, 5s)`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ElectorConfig {
    /// The lease key.
    pub key: LeaseKey,
    /// This candidate's identity (non-empty, at most [`MAX_IDENTITY_LEN`] bytes, no control
    /// characters).
    pub identity: String,
    /// How long followers wait after observing the last change before they consider the lease
    /// expired.
    pub lease_duration: Duration,
    /// How long the leader's term stays valid after it sent its last confirmed renewal.
    pub renew_deadline: Duration,
    /// How often the leader renews (and a polling follower polls).
    pub retry_period: Duration,
    /// How long a graceful step-down (shutdown, yield) keeps renewing while leader tasks finish,
    /// before it gives up on them: the term is then revoked and the lease left to expire.
    pub drain_timeout: Duration,
    /// Whether a missing record means the key was never held, so it may be created at once
    /// (client-go's behaviour). Default `false`: a missing record is treated like one held by an
    /// unknown holder and created only after the key was seen absent for a whole lease duration.
    /// The store cannot tell "never created" from "deleted" or "lost" (`kubectl delete lease`,
    /// a Redis restart without persistence), and a term that was valid when the record vanished
    /// stays valid up to `renew_deadline`. Waiting costs one lease duration on the first start
    /// of a brand-new key. Set it only where a key has a single campaigner, or where that overlap
    /// is acceptable.
    pub trust_absence: bool,
}

// === impl ElectorConfig ===

impl ElectorConfig {
    /// A configuration with client-go's default timings and a 30 s drain timeout.
    pub fn new(key: LeaseKey, identity: impl Into<String>) -> Self {
        ElectorConfig {
            key,
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            drain_timeout: Duration::from_secs(30),
            trust_absence: false,
        }
    }

    /// Sets the three timings.
    pub fn with_timings(
        mut self,
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Self {
        self.lease_duration = lease_duration;
        self.renew_deadline = renew_deadline;
        self.retry_period = retry_period;
        self
    }

    /// Sets [`ElectorConfig::trust_absence`].
    pub fn with_trust_absence(mut self, trust_absence: bool) -> Self {
        self.trust_absence = trust_absence;
        self
    }

    /// Sets the drain timeout (see [`ElectorConfig::drain_timeout`]).
    pub fn with_drain_timeout(mut self, drain_timeout: Duration) -> Self {
        self.drain_timeout = drain_timeout;
        self
    }

    /// Checks `lease_duration > renew_deadline > 1.2 × retry_period`, `retry_period > 0`, a
    /// non-zero drain timeout, every duration at most [`MAX_TIMING`], and the identity rules.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the offending values.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        if self.identity.is_empty() {
            return bad("identity must not be empty (use leasehold::default_identity())".into());
        }
        if self.identity.len() > MAX_IDENTITY_LEN {
            return bad(format!(
                "identity is {} bytes long; at most {MAX_IDENTITY_LEN} are allowed",
                self.identity.len()
            ));
        }
        if self.identity.chars().any(char::is_control) {
            return bad(format!(
                "identity {:?} contains control characters",
                self.identity
            ));
        }
        for (name, d) in [
            ("lease_duration", self.lease_duration),
            ("renew_deadline", self.renew_deadline),
            ("retry_period", self.retry_period),
            ("drain_timeout", self.drain_timeout),
        ] {
            if d > MAX_TIMING {
                return bad(format!(
                    "{name} ({d:?}) is longer than the maximum of {MAX_TIMING:?}"
                ));
            }
        }
        if self.retry_period.is_zero() {
            return bad("retry_period must be greater than zero".into());
        }
        if self.drain_timeout.is_zero() {
            return bad("drain_timeout must be greater than zero".into());
        }
        if self.lease_duration <= self.renew_deadline {
            return bad(format!(
                "lease_duration ({:?}) must be greater than renew_deadline ({:?})",
                self.lease_duration, self.renew_deadline
            ));
        }
        if self.renew_deadline.as_secs_f64() <= 1.2 * self.retry_period.as_secs_f64() {
            return bad(format!(
                "renew_deadline ({:?}) must be greater than 1.2 × retry_period ({:?} × 1.2 = {:?})",
                self.renew_deadline,
                self.retry_period,
                self.retry_period.mul_f64(1.2)
            ));
        }
        Ok(())
    }
}
