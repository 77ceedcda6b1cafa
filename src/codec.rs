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
//! Times are written as RFC 3339 in UTC with microseconds (`Z` suffix); times with any UTC offset
//! (`+02:00`, `-05:00`) and any number of fractional digits up to nine are read back as the
//! instant they name. `leaseDurationSeconds` is a whole number of seconds, rounded up from a
//! fractional duration.

use std::time::{Duration, SystemTime};

use jiff::Timestamp;
use jiff::fmt::temporal::DateTimeParser;
use jiff::tz::Offset;
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
    /// Written by an acquisition whose token is assigned at commit: the record's token is the
    /// larger of `leaderTransitions` and the version the store gave this write.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    leasehold_token_from_version: bool,
}

/// Rounds a duration up to whole seconds, as stores with second granularity keep it.
pub fn duration_to_whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The earliest and latest times written: the start of year 0000 (RFC 3339 has no earlier
/// year) and the latest time jiff holds (late on 9999-12-30, so that every offset still fits).
fn writable_range() -> (Timestamp, Timestamp) {
    // 0000-01-01T00:00:00Z is within jiff's range, so the fallback is never used.
    let min = Timestamp::new(-62_167_219_200, 0).unwrap_or(Timestamp::MIN);
    (min, Timestamp::MAX)
}

/// Formats a time as RFC 3339 UTC with microseconds (Kubernetes' `MicroTime` format), for
/// example `2026-11-29T20:04:19.123456Z`; sub-microsecond digits are cut off.
///
/// A time before year 0000 (which RFC 3339 cannot express) or after 9999-12-30T22:00Z is
/// written as the nearest of those two bounds instead, never a panic.
pub fn format_micro_time(t: SystemTime) -> String {
    let (min, max) = writable_range();
    let ts = match Timestamp::try_from(t) {
        Ok(ts) => ts.clamp(min, max),
        Err(_) if t < SystemTime::UNIX_EPOCH => min,
        Err(_) => max,
    };
    let dt = Offset::UTC.to_datetime(ts);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
        dt.year(),
        dt.month(),
        dt.day(),
        dt.hour(),
        dt.minute(),
        dt.second(),
        dt.subsec_nanosecond() / 1000
    )
}

/// Parses an RFC 3339 time with any UTC offset (`Z`, `+02:00`, `-05:00`), with or without
/// fractional seconds, into the instant it names.
///
/// # Errors
/// A message saying what is wrong with the text (not RFC 3339, no offset, a field or the year
/// out of range, or an instant this platform's `SystemTime` cannot hold).
pub fn parse_time(s: &str) -> std::result::Result<SystemTime, String> {
    let ts = DateTimeParser::new()
        .parse_timestamp(s)
        .map_err(|e| format!("time {s:?} is not an RFC 3339 time with an offset: {e}"))?;
    let since_epoch = ts.as_duration();
    let magnitude = since_epoch.unsigned_abs();
    let t = if since_epoch.is_negative() {
        SystemTime::UNIX_EPOCH.checked_sub(magnitude)
    } else {
        SystemTime::UNIX_EPOCH.checked_add(magnitude)
    };
    t.ok_or_else(|| format!("time {s:?} is out of the range this platform can represent"))
}

/// Encodes a record as client-go `LeaderElectionRecord` JSON.
pub fn encode(record: &LeaseRecord) -> Vec<u8> {
    encode_wire(record, false)
}

/// Encodes an acquisition whose fencing token a store assigns at commit from the write's own
/// version (a revision or counter that only grows), for
/// [`LeaseStore::acquire`](crate::LeaseStore::acquire): `leaderTransitions` holds `floor` (the
/// caller's lower bound, `record.transitions`) and the field `leaseholdTokenFromVersion: true`
/// tells [`decode`] that the token is the larger of that and the version. Renewals then write
/// the token itself with [`encode`].
///
/// ```
/// use leasehold::{LeaseKey, LeaseRecord, Version, codec};
/// # let record = LeaseRecord { holder_identity: "a".into(), lease_duration: std::time::Duration::from_secs(15), acquire_time: None, renew_time: None, transitions: 5 };
/// let bytes = codec::encode_acquisition(&record);
/// let key = LeaseKey::new("k").unwrap();
/// assert_eq!(codec::decode(&key, &bytes, Some(&Version::from(42u64))).unwrap().transitions, 42);
/// assert_eq!(codec::decode(&key, &bytes, Some(&Version::from(3u64))).unwrap().transitions, 5);
/// ```
pub fn encode_acquisition(record: &LeaseRecord) -> Vec<u8> {
    encode_wire(record, true)
}

/// The fencing token an acquisition encoded by [`encode_acquisition`] gets at `version`.
///
/// # Errors
/// A message when the version is not a whole number (the store cannot assign tokens from it).
pub fn token_at_version(floor: u64, version: &Version) -> std::result::Result<u64, String> {
    version
        .as_str()
        .parse::<u64>()
        .map(|v| v.max(floor))
        .map_err(|_| {
            format!(
                "the record's token is its version, but version {version} is not a whole number"
            )
        })
}

fn encode_wire(record: &LeaseRecord, token_from_version: bool) -> Vec<u8> {
    let wire = Wire {
        holder_identity: record.holder_identity.clone(),
        lease_duration_seconds: duration_to_whole_seconds(record.lease_duration),
        acquire_time: record.acquire_time.map(format_micro_time),
        renew_time: record.renew_time.map(format_micro_time),
        leader_transitions: record.transitions,
        leasehold_token_from_version: token_from_version,
    };
    // Serializing a struct of strings, integers and a bool cannot fail.
    serde_json::to_vec(&wire).unwrap_or_default()
}

/// Decodes bytes written by [`encode`] or [`encode_acquisition`] (then the token is resolved
/// against `version`).
///
/// # Errors
/// [`Error::Corrupt`] naming `key` and saying what is wrong when the bytes are not such a record
/// (not UTF-8, not JSON, a missing or mistyped field, an unparsable time, an acquisition without
/// a usable version).
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
    let transitions = if wire.leasehold_token_from_version {
        let version = version.ok_or_else(|| {
            corrupt("an acquisition whose token is its version, read without a version".into())
        })?;
        token_at_version(wire.leader_transitions, version).map_err(corrupt)?
    } else {
        wire.leader_transitions
    };
    Ok(LeaseRecord {
        holder_identity: wire.holder_identity,
        lease_duration: Duration::from_secs(wire.lease_duration_seconds),
        acquire_time,
        renew_time,
        transitions,
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

    fn with_times(acquire: &str, renew: &str) -> Vec<u8> {
        format!(
            "{{\"holderIdentity\":\"a\",\"leaseDurationSeconds\":15,\"acquireTime\":\"{acquire}\",\"renewTime\":\"{renew}\",\"leaderTransitions\":1}}"
        )
        .into_bytes()
    }

    fn at(secs: u64, micros: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_micros(micros)
    }

    /// 2026-11-29T20:04:19Z
    const T: u64 = 1_795_982_659;

    #[test]
    fn writes_utc_with_microseconds() {
        assert_eq!(
            format_micro_time(at(T, 123_456)),
            "2026-11-29T20:04:19.123456Z"
        );
        assert_eq!(format_micro_time(at(T, 0)), "2026-11-29T20:04:19.000000Z");
        // Sub-microsecond digits are cut off, not rounded.
        let t = at(T, 5) + Duration::from_nanos(999);
        assert_eq!(format_micro_time(t), "2026-11-29T20:04:19.000005Z");
        assert_eq!(
            format_micro_time(SystemTime::UNIX_EPOCH),
            "1970-01-01T00:00:00.000000Z"
        );
    }

    #[test]
    fn offsets_of_both_signs_are_read_as_the_instant_they_name() {
        for (text, expected) in [
            ("2026-11-29T20:04:19Z", at(T, 0)),
            ("2026-11-29T20:04:19.123456Z", at(T, 123_456)),
            ("2026-11-29T22:04:19+02:00", at(T, 0)),
            ("2026-11-29T22:04:19.123456+02:00", at(T, 123_456)),
            ("2026-11-29T15:04:19-05:00", at(T, 0)),
            ("2026-11-29T15:04:19.5-05:00", at(T, 500_000)),
            ("2026-11-30T01:34:19.000001+05:30", at(T, 1)),
            ("2026-11-29T20:04:19+00:00", at(T, 0)),
            (
                "2026-11-29T20:04:19.123456789Z",
                at(T, 123_456) + Duration::from_nanos(789),
            ),
            // An offset that crosses a day, month and year boundary.
            ("2027-01-01T03:00:00+05:00", at(1_798_754_400, 0)),
        ] {
            assert_eq!(parse_time(text), Ok(expected), "{text}");
            let bytes = with_times(text, text);
            let rec = decode(&key(), &bytes, None).expect(text);
            assert_eq!(rec.acquire_time, Some(expected), "{text}");
            assert_eq!(rec.renew_time, Some(expected), "{text}");
        }
    }

    #[test]
    fn odd_times_are_corrupt_never_a_panic() {
        for text in [
            "",
            "yesterday",
            "2026-11-29T20:04:19",
            "2026-11-29",
            "2026-13-01T00:00:00Z",
            "2026-02-30T00:00:00Z",
            "2026-11-29T24:00:01Z",
            "2026-11-29T20:04:19+26:00",
            "9999-12-31T23:59:59Z",
            "10000-01-01T00:00:00Z",
            "+999999-01-01T00:00:00Z",
            "-999999-01-01T00:00:00Z",
            "2026-11-29T20:04:19.1234567891Z",
            "2026-11-29T20:04:19.Z",
            "2026-11-29T20:04:19+02:00garbage",
            "2026-11-29T20:04:19ZZ",
        ] {
            let bytes = with_times("2026-11-29T20:04:19Z", text);
            match decode(&key(), &bytes, Some(&Version::from(9u64))) {
                Err(Error::Corrupt {
                    reason, version, ..
                }) => {
                    assert!(reason.starts_with("renewTime: "), "{reason}");
                    assert_eq!(version, Some(Version::from(9u64)));
                }
                other => panic!("expected Corrupt for {text:?}, got {other:?}"),
            }
        }
    }

    #[test]
    fn times_rfc3339_cannot_express_are_written_clamped_never_a_panic() {
        let before_year_0 = SystemTime::UNIX_EPOCH - Duration::from_secs(70_000_000_000);
        assert_eq!(
            format_micro_time(before_year_0),
            "0000-01-01T00:00:00.000000Z"
        );
        let after_9999 = SystemTime::UNIX_EPOCH + Duration::from_secs(300_000_000_000);
        assert_eq!(format_micro_time(after_9999), "9999-12-30T22:00:00.999999Z");
        let before_epoch = SystemTime::UNIX_EPOCH - Duration::from_micros(1);
        assert_eq!(
            format_micro_time(before_epoch),
            "1969-12-31T23:59:59.999999Z"
        );
        // And each of them reads back.
        for t in [before_year_0, after_9999, before_epoch] {
            assert!(parse_time(&format_micro_time(t)).is_ok());
        }
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
