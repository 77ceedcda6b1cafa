//! The mapping between a [`LeaseRecord`] and a `coordination.k8s.io/v1` Lease, exactly as
//! client-go's `LeaseLock` reads and writes it.
//!
//! | record field      | Lease field                  | notes                                          |
//! |-------------------|------------------------------|------------------------------------------------|
//! | `holder_identity` | `spec.holderIdentity`        | always written, `""` when vacant (as client-go releases it); absent reads as vacant |
//! | `lease_duration`  | `spec.leaseDurationSeconds`  | whole seconds, a fractional duration rounds **up**; absent reads as 0 |
//! | `acquire_time`    | `spec.acquireTime`           | `MicroTime`: RFC 3339 UTC with 6 fractional digits |
//! | `renew_time`      | `spec.renewTime`             | `MicroTime`                                    |
//! | `transitions`     | `spec.leaseTransitions`      | absent reads as 0                               |
//! | version           | `metadata.resourceVersion`   | opaque, compared only for equality              |
//!
//! A Lease without a `spec` reads as a vacant record (client-go reads it the same way).
//!
//! Other spec fields (`preferredHolder`, `strategy`) and the metadata (labels, annotations,
//! owner references, finalizers) are left as the store found them when it updates a Lease.

use std::time::{Duration, SystemTime};

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::DynamicObject;
use leasehold::codec::duration_to_whole_seconds;
use leasehold::{Error, LeaseKey, LeaseRecord, Result, Version, Versioned};

use crate::STORE_NAME;

/// Converts a wall-clock time to a Kubernetes `MicroTime`, truncated to the microsecond.
///
/// # Errors
/// [`Error::Invalid`] when the time is outside the years 1 to 9999, which a Lease cannot hold.
pub fn to_micro_time(t: SystemTime) -> Result<MicroTime> {
    let micros: i128 = match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i128::try_from(d.as_micros()).unwrap_or(i128::MAX),
        Err(e) => -i128::try_from(e.duration().as_micros()).unwrap_or(i128::MAX),
    };
    i64::try_from(micros)
        .ok()
        .and_then(|m| Timestamp::from_microsecond(m).ok())
        .map(MicroTime)
        .ok_or_else(|| Error::Invalid {
            store: STORE_NAME,
            message: format!("time {t:?} cannot be written as a Kubernetes MicroTime"),
        })
}

/// Converts a Kubernetes `MicroTime` back to a wall-clock time (microsecond precision).
pub fn from_micro_time(t: &MicroTime) -> SystemTime {
    let micros = t.0.as_microsecond();
    let magnitude = Duration::from_micros(micros.unsigned_abs());
    if micros >= 0 {
        SystemTime::UNIX_EPOCH + magnitude
    } else {
        SystemTime::UNIX_EPOCH - magnitude
    }
}

/// Builds the Lease spec client-go's `LeaderElectionRecordToLeaseSpec` would write for `record`.
///
/// # Errors
/// [`Error::Invalid`] when a value does not fit a Lease (a duration or transition count above
/// `i32::MAX`, a time outside the years 1 to 9999).
pub fn record_to_spec(record: &LeaseRecord) -> Result<LeaseSpec> {
    let secs = duration_to_whole_seconds(record.lease_duration);
    let lease_duration_seconds = i32::try_from(secs).map_err(|_| Error::Invalid {
        store: STORE_NAME,
        message: format!(
            "lease duration of {secs} s does not fit spec.leaseDurationSeconds (int32)"
        ),
    })?;
    let lease_transitions = i32::try_from(record.transitions).map_err(|_| Error::Invalid {
        store: STORE_NAME,
        message: format!(
            "{} transitions do not fit spec.leaseTransitions (int32)",
            record.transitions
        ),
    })?;
    Ok(LeaseSpec {
        holder_identity: Some(record.holder_identity.clone()),
        lease_duration_seconds: Some(lease_duration_seconds),
        acquire_time: record.acquire_time.map(to_micro_time).transpose()?,
        renew_time: record.renew_time.map(to_micro_time).transpose()?,
        lease_transitions: Some(lease_transitions),
        ..LeaseSpec::default()
    })
}

/// Reads a record from a Lease spec the way client-go's `LeaseSpecToLeaderElectionRecord` does
/// (absent fields read as empty/zero).
///
/// # Errors
/// A reason (for [`Error::Corrupt`]) when a value cannot be a lease record: a negative
/// `leaseDurationSeconds` or `leaseTransitions`.
pub fn spec_to_record(spec: &LeaseSpec) -> std::result::Result<LeaseRecord, String> {
    let secs = spec.lease_duration_seconds.unwrap_or(0);
    let secs = u64::try_from(secs)
        .map_err(|_| format!("spec.leaseDurationSeconds is negative ({secs})"))?;
    let transitions = spec.lease_transitions.unwrap_or(0);
    let transitions = u64::try_from(transitions)
        .map_err(|_| format!("spec.leaseTransitions is negative ({transitions})"))?;
    Ok(LeaseRecord {
        holder_identity: spec.holder_identity.clone().unwrap_or_default(),
        lease_duration: Duration::from_secs(secs),
        acquire_time: spec.acquire_time.as_ref().map(from_micro_time),
        renew_time: spec.renew_time.as_ref().map(from_micro_time),
        transitions,
    })
}

/// The `metadata.resourceVersion` of an object, if it has one.
pub(crate) fn object_version(obj: &DynamicObject) -> Option<Version> {
    obj.metadata
        .resource_version
        .as_deref()
        .filter(|v| !v.is_empty())
        .map(Version::new)
}

/// Decodes a Lease object (read untyped, so that a Lease with a malformed spec is reported as
/// [`Error::Corrupt`] with its key and version rather than as an undecodable response).
///
/// # Errors
/// [`Error::Corrupt`] naming `key`, the reason and the object's resourceVersion.
pub(crate) fn object_to_versioned(key: &LeaseKey, obj: &DynamicObject) -> Result<Versioned> {
    let version = object_version(obj);
    let corrupt = |reason: String| Error::Corrupt {
        key: key.to_string(),
        reason,
        version: version.clone(),
    };
    let Some(version) = version.clone() else {
        return Err(corrupt("the Lease has no metadata.resourceVersion".into()));
    };
    // A Lease without a spec reads as an empty spec (a vacant record), as client-go reads it.
    let spec: LeaseSpec = match obj.data.get("spec") {
        None | Some(serde_json::Value::Null) => LeaseSpec::default(),
        Some(spec) => serde_json::from_value(spec.clone())
            .map_err(|e| corrupt(format!("the Lease spec cannot be decoded: {e}")))?,
    };
    let record = spec_to_record(&spec).map_err(corrupt)?;
    Ok(Versioned { record, version })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_time_round_trips_and_truncates_to_microseconds() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_nanos(1_764_446_659_123_456_789);
        let mt = to_micro_time(t).expect("in range");
        assert_eq!(
            from_micro_time(&mt),
            SystemTime::UNIX_EPOCH + Duration::from_micros(1_764_446_659_123_456)
        );
        let before = SystemTime::UNIX_EPOCH - Duration::from_micros(1_500_000);
        assert_eq!(
            from_micro_time(&to_micro_time(before).expect("in range")),
            before
        );
    }

    #[test]
    fn out_of_range_values_are_invalid() {
        let rec = LeaseRecord {
            holder_identity: "a".into(),
            lease_duration: Duration::from_secs(u64::from(u32::MAX)),
            acquire_time: None,
            renew_time: None,
            transitions: 0,
        };
        assert!(matches!(record_to_spec(&rec), Err(Error::Invalid { .. })));
        let rec = LeaseRecord {
            lease_duration: Duration::from_secs(1),
            transitions: u64::from(u32::MAX),
            ..rec
        };
        assert!(matches!(record_to_spec(&rec), Err(Error::Invalid { .. })));
    }
}
