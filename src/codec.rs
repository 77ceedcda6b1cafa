//! The byte encoding of a [`LeaseRecord`] for stores that keep opaque values (Redis, etcd).
//!
//! It is the JSON of client-go's `LeaderElectionRecord` (the format client-go's old
//! ConfigMap/Endpoints locks kept in their `control-plane.alpha.kubernetes.io/leader`
//! annotation), so other tools can read it:
//!
//! ```json
//! {"holderIdentity":"node-a","leaseDurationSeconds":15,
//!  "acquireTime":"2026-11-29T20:04:19.123456Z","renewTime":"2026-11-29T20:04:21.123456Z",
//!  "leaderTransitions":3}
//! ```
//!
//! Times are RFC 3339 in UTC with microseconds; `leaseDurationSeconds` is a whole number of
//! seconds, rounded up from a fractional duration.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::store::{LeaseKey, LeaseRecord, Version};

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Wire {
    holder_identity: String,
    lease_duration_seconds: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    acquire_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    renew_time: Option<String>,
    leader_transitions: u64,
}

/// Rounds a duration up to whole seconds, as stores with second granularity keep it.
pub fn duration_to_whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Formats a time as RFC 3339 UTC with microseconds (Kubernetes' `MicroTime` format).
pub fn format_micro_time(t: SystemTime) -> String {
    humantime::format_rfc3339_micros(t).to_string()
}

/// Parses an RFC 3339 UTC time (`Z` suffix), with or without fractional seconds.
///
/// # Errors
/// A message saying what is wrong with the text.
pub fn parse_time(s: &str) -> std::result::Result<SystemTime, String> {
    humantime::parse_rfc3339_weak(s).map_err(|e| format!("time {s:?} is not RFC 3339 in UTC: {e}"))
}

/// Encodes a record as client-go `LeaderElectionRecord` JSON.
pub fn encode(record: &LeaseRecord) -> Vec<u8> {
    let wire = Wire {
        holder_identity: record.holder_identity.clone(),
        lease_duration_seconds: duration_to_whole_seconds(record.lease_duration),
        acquire_time: record.acquire_time.map(format_micro_time),
        renew_time: record.renew_time.map(format_micro_time),
        leader_transitions: record.transitions,
    };
    // Serializing a struct of strings and integers cannot fail.
    serde_json::to_vec(&wire).unwrap_or_default()
}

/// Decodes bytes written by [`encode`].
///
/// # Errors
/// [`Error::Corrupt`] naming `key` and saying what is wrong when the bytes are not such a record
/// (not UTF-8, not JSON, a missing or mistyped field, an unparsable time).
pub fn decode(key: &LeaseKey, bytes: &[u8], version: Option<&Version>) -> Result<LeaseRecord> {
    let corrupt = |reason: String| Error::Corrupt {
        key: key.to_string(),
        reason,
        version: version.cloned(),
    };
    let wire: Wire = serde_json::from_slice(bytes).map_err(|e| {
        corrupt(format!(
            "expected a JSON lease record ({} bytes could not be decoded: {e})",
            bytes.len()
        ))
    })?;
    let acquire_time = wire
        .acquire_time
        .as_deref()
        .map(parse_time)
        .transpose()
        .map_err(|e| corrupt(format!("acquireTime: {e}")))?;
    let renew_time = wire
        .renew_time
        .as_deref()
        .map(parse_time)
        .transpose()
        .map_err(|e| corrupt(format!("renewTime: {e}")))?;
    Ok(LeaseRecord {
        holder_identity: wire.holder_identity,
        lease_duration: Duration::from_secs(wire.lease_duration_seconds),
        acquire_time,
        renew_time,
        transitions: wire.leader_transitions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> LeaseKey {
        LeaseKey::new("k").expect("valid key")
    }

    #[test]
    fn round_trips_with_microseconds() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_micros(1_764_446_659_123_456);
        let rec = LeaseRecord {
            holder_identity: "node-ä".into(),
            lease_duration: Duration::from_secs(15),
            acquire_time: Some(t),
            renew_time: Some(t + Duration::from_micros(1)),
            transitions: 7,
        };
        let bytes = encode(&rec);
        assert_eq!(decode(&key(), &bytes, None).expect("decodes"), rec);
    }

    #[test]
    fn fractional_durations_round_up() {
        let rec = LeaseRecord {
            holder_identity: String::new(),
            lease_duration: Duration::from_millis(1500),
            acquire_time: None,
            renew_time: None,
            transitions: 0,
        };
        let back = decode(&key(), &encode(&rec), None).expect("decodes");
        assert_eq!(back.lease_duration, Duration::from_secs(2));
    }

    #[test]
    fn corrupt_shapes_are_typed_errors() {
        for bytes in [
            &b"not json"[..],
            b"{\"holderIdentity\":\"a\"",
            b"[1,2]",
            b"{\"holderIdentity\":1,\"leaseDurationSeconds\":1,\"leaderTransitions\":0}",
            b"{\"holderIdentity\":\"a\",\"leaseDurationSeconds\":-1,\"leaderTransitions\":0}",
            b"{\"holderIdentity\":\"a\",\"leaseDurationSeconds\":1,\"leaderTransitions\":0,\"renewTime\":\"yesterday\"}",
            b"\xff\xfe",
        ] {
            match decode(&key(), bytes, Some(&Version::from(3u64))) {
                Err(Error::Corrupt { key, version, .. }) => {
                    assert_eq!(key, "k");
                    assert_eq!(version, Some(Version::from(3u64)));
                }
                other => panic!("expected Corrupt for {bytes:?}, got {other:?}"),
            }
        }
    }
}
