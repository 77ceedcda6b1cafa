//! `leasehold status`, `watch` and `release`.

use std::io::{IsTerminal, Write};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use leasehold::{DynLeaseStore, KeyPrefix, LeaseKey, LeaseRecord, Version, Versioned, WatchEvent};
use serde_json::json;
use tokio::signal::unix::{SignalKind, signal};

use crate::exit::{self, CliError};
use crate::stores::{self, StoreUrl};
use crate::{ReleaseArgs, StatusArgs, StoreArgs, WatchArgs};

pub(crate) const STATUS_LONG_ABOUT: &str = "\
Show who holds a lease, or every lease whose name starts with --prefix.

For each lease: the holder, the fencing token (the record's transition count), the lease
duration, when the holder acquired and last renewed it, and whether it looks expired. Whether
it looks expired is judged from the record's timestamps (the holder's wall clock at its last
renewal, plus the lease duration, against this machine's wall clock): clock skew between the
machines shifts it. Electors themselves never use these timestamps. When a row of the table
says \"expired?\", a note on stderr says so.

Output: a table, or with --json one JSON object per lease and line, with the fields lease,
exists, holder (null when vacant), fencing_token, lease_duration_seconds, acquire_time and
renew_time (RFC 3339), version, looks_expired and expiry_judged_from; a key holding data that
is not a lease record shows as {\"lease\", \"exists\": true, \"corrupt\": REASON}.

Examples:
  leasehold status --store redis://127.0.0.1 --lease report
  leasehold status --store kube://prod --prefix '' --json | jq .holder";

pub(crate) const WATCH_LONG_ABOUT: &str = "\
Print one line per change of a lease until interrupted (Ctrl-C, SIGTERM).

By default a line is printed when the holder, the fencing token or the lease duration changes,
or the record is deleted; --renewals prints every change, renewals included. With --json each
line is a JSON object with the fields of `leasehold status --json` plus event (put, deleted,
corrupt) and time (when this process saw it).

Examples:
  leasehold watch --store etcd://127.0.0.1:2379 --lease report
  leasehold watch --store redis://127.0.0.1 --lease report --json";

pub(crate) const RELEASE_LONG_ABOUT: &str = "\
Release a lease administratively.

Reads the lease and, after confirmation, writes a vacant record (empty holder, the fencing
token kept) by compare-and-swap on the version it read: if the lease changed in between,
nothing is released (exit code 75). With --delete the record is deleted instead (the same
compare-and-swap). A waiting candidate takes a released lease at once.

The holder is not told: if it is still alive, it loses its term at its next renewal and campaigns
again like every other candidate, and it may win again. Stop the holder first when you want it
gone for good.

It asks for confirmation on a terminal; without a terminal it refuses unless --yes is given.

Examples:
  leasehold release --store redis://127.0.0.1 --lease report
  leasehold release --store kube://prod --lease cron --yes";

/// Timeouts for one-shot commands.
const TIMEOUTS: stores::Timeouts = stores::Timeouts {
    operation: Duration::from_secs(5),
    connect: Duration::from_secs(5),
};

async fn open(args: &StoreArgs) -> Result<(DynLeaseStore, StoreUrl), CliError> {
    let url = args.url()?;
    let store = stores::connect(&url, &args.tls(), TIMEOUTS).await?;
    Ok((store, url))
}

fn key(name: &str) -> Result<LeaseKey, CliError> {
    LeaseKey::new(name).map_err(|e| CliError::usage(e.to_string()))
}

fn rfc3339(t: Option<SystemTime>) -> Option<String> {
    let t = t?;
    jiff::Timestamp::try_from(t).ok().map(|ts| ts.to_string())
}

/// Whether the record looks expired from its timestamps (see the help text). A lease duration
/// that reaches past the end of time (a record written by another tool) never looks expired.
fn looks_expired(r: &LeaseRecord, now: SystemTime) -> bool {
    if r.is_vacant() {
        return false;
    }
    match r.renew_time.or(r.acquire_time) {
        Some(t) => t.checked_add(r.lease_duration).is_some_and(|end| end < now),
        None => true,
    }
}

fn record_json(lease: &str, v: Option<&Versioned>) -> serde_json::Value {
    let Some(v) = v else {
        return json!({ "lease": lease, "exists": false });
    };
    let r = &v.record;
    json!({
        "lease": lease,
        "exists": true,
        "holder": if r.is_vacant() { None } else { Some(&r.holder_identity) },
        "fencing_token": r.transitions,
        "lease_duration_seconds": r.lease_duration.as_secs_f64(),
        "acquire_time": rfc3339(r.acquire_time),
        "renew_time": rfc3339(r.renew_time),
        "version": v.version.as_str(),
        "looks_expired": looks_expired(r, SystemTime::now()),
        "expiry_judged_from": "record timestamps",
    })
}

fn state_word(r: &LeaseRecord) -> &'static str {
    if r.is_vacant() {
        "vacant"
    } else if looks_expired(r, SystemTime::now()) {
        "expired?"
    } else {
        "held"
    }
}

/// The table, and whether a row says "expired?".
fn table(rows: &[(String, Option<Versioned>)]) -> (String, bool) {
    let mut lines = vec![[
        "LEASE".to_owned(),
        "HOLDER".into(),
        "TOKEN".into(),
        "DURATION".into(),
        "ACQUIRED".into(),
        "RENEWED".into(),
        "STATE".into(),
    ]];
    for (lease, v) in rows {
        lines.push(match v {
            None => [
                lease.clone(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "no record".into(),
            ],
            Some(v) => {
                let r = &v.record;
                [
                    lease.clone(),
                    if r.is_vacant() {
                        "-".into()
                    } else {
                        r.holder_identity.clone()
                    },
                    r.transitions.to_string(),
                    humantime::format_duration(r.lease_duration).to_string(),
                    rfc3339(r.acquire_time).unwrap_or_else(|| "-".into()),
                    rfc3339(r.renew_time).unwrap_or_else(|| "-".into()),
                    state_word(r).into(),
                ]
            }
        });
    }
    let widths: Vec<usize> = (0..7)
        .map(|i| {
            lines
                .iter()
                .map(|l| l[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for l in &lines {
        let cells: Vec<String> = l
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    let expired = lines.iter().any(|l| l[6] == "expired?");
    (out, expired)
}

/// The table's footnote, printed on stderr when a row says "expired?".
const EXPIRED_FOOTNOTE: &str =
    "leasehold: STATE \"expired?\" is judged from the record's timestamps and this machine's clock";

pub(crate) async fn status(args: StatusArgs) -> Result<u8, CliError> {
    let (store, url) = open(&args.store).await?;
    let shown = url.display();
    let rows: Vec<(String, Option<Versioned>)> = match (&args.lease, &args.prefix) {
        (Some(name), _) => {
            let key = key(name)?;
            let v = match store.get(&key).await {
                Ok(v) => v,
                Err(leasehold::Error::Corrupt { reason, .. }) => {
                    if args.json {
                        crate::exit::outln!(
                            "{}",
                            json!({ "lease": key.as_str(), "exists": true, "corrupt": reason })
                        );
                    } else {
                        crate::exit::outln!(
                            "lease {key} holds data that is not a lease record: {reason}\n\
                             (candidates treat it as held by an unknown holder and replace it \
                             after it stayed unchanged for a lease duration)"
                        );
                    }
                    return Ok(0);
                }
                Err(e) => {
                    return Err(stores::store_error(
                        &url,
                        &format!("cannot read lease {key} on {shown}"),
                        e,
                    ));
                }
            };
            vec![(key.to_string(), v)]
        }
        (None, Some(p)) => {
            let prefix = KeyPrefix::new(p).map_err(|e| CliError::usage(e.to_string()))?;
            store
                .list(&prefix)
                .await
                .map_err(|e| {
                    stores::store_error(&url, &format!("cannot list leases {p:?}* on {shown}"), e)
                })?
                .into_iter()
                .map(|(k, v)| (k.to_string(), Some(v)))
                .collect()
        }
        (None, None) => return Err(CliError::usage("give --lease NAME or --prefix P")),
    };
    if args.json {
        for (lease, v) in &rows {
            crate::exit::outln!("{}", record_json(lease, v.as_ref()));
        }
    } else if rows.is_empty() {
        crate::exit::outln!("no leases under that prefix on {shown}");
    } else {
        let (table, expired) = table(&rows);
        crate::exit::outln!("{}", table.trim_end());
        if expired {
            eprintln!("{EXPIRED_FOOTNOTE}");
        }
    }
    Ok(0)
}

/// What a printed line is about: changes of these are shown without --renewals.
fn identity_of(v: Option<&Versioned>) -> Option<(String, u64, Duration)> {
    v.map(|v| {
        (
            v.record.holder_identity.clone(),
            v.record.transitions,
            v.record.lease_duration,
        )
    })
}

fn human_line(lease: &str, v: Option<&Versioned>, corrupt: Option<&str>) -> String {
    let now = jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.3fZ");
    match (v, corrupt) {
        (_, Some(reason)) => {
            format!("{now} {lease}: holds data that is not a lease record: {reason}")
        }
        (None, None) => format!("{now} {lease}: no record"),
        (Some(v), None) => {
            let r = &v.record;
            if r.is_vacant() {
                format!("{now} {lease}: vacant (fencing token {})", r.transitions)
            } else {
                format!(
                    "{now} {lease}: held by {} (fencing token {}, lease {}, renewed {}){}",
                    r.holder_identity,
                    r.transitions,
                    humantime::format_duration(r.lease_duration),
                    rfc3339(r.renew_time).unwrap_or_else(|| "-".into()),
                    if looks_expired(r, SystemTime::now()) {
                        " [looks expired]"
                    } else {
                        ""
                    }
                )
            }
        }
    }
}

pub(crate) async fn watch(args: WatchArgs) -> Result<u8, CliError> {
    let (store, url) = open(&args.store).await?;
    let shown = url.display();
    let key = key(&args.lease)?;
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return Err(CliError::new(exit::OSERR, "cannot install signal handlers"));
    };
    let mut printer = Printer {
        lease: key.to_string(),
        json: args.json,
        renewals: args.renewals,
        last: None,
    };
    let watching = async {
        let mut first = true;
        loop {
            let current = match store.get(&key).await {
                Ok(v) => v,
                Err(e) if first => {
                    return Err(stores::store_error(
                        &url,
                        &format!("cannot read lease {key} on {shown}"),
                        e,
                    ));
                }
                Err(leasehold::Error::Corrupt { reason, .. }) => {
                    printer.corrupt(&reason);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                Err(e) => {
                    eprintln!("leasehold: reading lease {key} failed: {e}; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            first = false;
            printer.state(current.as_ref());
            let after: Option<Version> = current.map(|v| v.version);
            let mut stream = match store.watch(&key, after.as_ref()).await {
                Ok(s) => s,
                Err(leasehold::Error::Unsupported { .. }) => {
                    // Poll instead.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                Err(e) => {
                    eprintln!("leasehold: watching lease {key} failed: {e}; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            while let Some(item) = stream.next().await {
                match item {
                    Ok(WatchEvent::Put(v)) => printer.state(Some(&v)),
                    Ok(WatchEvent::Deleted) => printer.state(None),
                    Ok(WatchEvent::Corrupt { reason, .. }) => printer.corrupt(&reason),
                    Ok(_) => {}
                    Err(e) => {
                        eprintln!("leasehold: the watch on lease {key} failed: {e}; re-reading");
                        break;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        r = watching => r,
        _ = term.recv() => Ok(0),
        _ = int.recv() => Ok(0),
    }
}

struct Printer {
    lease: String,
    json: bool,
    renewals: bool,
    last: Option<Option<(String, u64, Duration)>>,
}

impl Printer {
    fn state(&mut self, v: Option<&Versioned>) {
        let id = identity_of(v);
        if !self.renewals && self.last.as_ref() == Some(&id) {
            return;
        }
        self.last = Some(id);
        let line = if self.json {
            let mut j = record_json(&self.lease, v);
            j["event"] = json!(if v.is_some() { "put" } else { "deleted" });
            j["time"] = json!(jiff::Timestamp::now().to_string());
            j.to_string()
        } else {
            human_line(&self.lease, v, None)
        };
        println_flush(&line);
    }

    fn corrupt(&mut self, reason: &str) {
        self.last = None;
        let line = if self.json {
            json!({
                "lease": self.lease,
                "event": "corrupt",
                "reason": reason,
                "time": jiff::Timestamp::now().to_string(),
            })
            .to_string()
        } else {
            human_line(&self.lease, None, Some(reason))
        };
        println_flush(&line);
    }
}

fn println_flush(line: &str) {
    crate::exit::outln!("{line}");
}

pub(crate) async fn release(args: ReleaseArgs) -> Result<u8, CliError> {
    let key = key(&args.lease)?;
    let interactive = std::io::stdin().is_terminal();
    if !args.yes && !interactive {
        return Err(CliError::usage(
            "refusing to release without confirmation: stdin is not a terminal; pass --yes",
        ));
    }
    let (store, url) = open(&args.store).await?;
    let shown = url.display();
    let current = store.get(&key).await.map_err(|e| {
        stores::store_error(&url, &format!("cannot read lease {key} on {shown}"), e)
    })?;
    let Some(current) = current else {
        crate::exit::outln!("lease {key} has no record on {shown}; nothing to release");
        return Ok(0);
    };
    if current.record.is_vacant() && !args.delete {
        crate::exit::outln!("lease {key} is already vacant; nothing to release");
        return Ok(0);
    }
    let what = if current.record.is_vacant() {
        "vacant".to_owned()
    } else {
        format!(
            "held by {} (fencing token {})",
            current.record.holder_identity, current.record.transitions
        )
    };
    if !args.yes {
        eprint!(
            "{} lease {key} on {shown}, {what}? The holder, if alive, loses it at its next renewal. [y/N] ",
            if args.delete { "Delete" } else { "Release" }
        );
        let _ = std::io::stderr().flush();
        let mut answer = String::new();
        if std::io::stdin().read_line(&mut answer).is_err()
            || !matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes")
        {
            eprintln!("leasehold: not released");
            return Ok(1);
        }
    }
    let result = if args.delete {
        store.delete(&key, &current.version).await.map(|_| ())
    } else {
        let vacant = LeaseRecord {
            holder_identity: String::new(),
            lease_duration: leasehold::elector::RELEASE_LEASE_DURATION,
            acquire_time: current.record.acquire_time,
            renew_time: Some(SystemTime::now()),
            transitions: current.record.transitions,
        };
        store
            .update(&key, &vacant, &current.version)
            .await
            .map(|_| ())
    };
    match result {
        Ok(()) => {
            crate::exit::outln!(
                "{} lease {key} (was {what})",
                if args.delete { "deleted" } else { "released" }
            );
            Ok(0)
        }
        Err(leasehold::Error::Conflict { .. } | leasehold::Error::NotFound { .. }) => {
            Err(CliError::new(
                exit::LEASE_LOST,
                format!(
                    "lease {key} changed after it was read; nothing was released (run the command again)"
                ),
            ))
        }
        Err(e) => Err(stores::store_error(
            &url,
            &format!("cannot release lease {key}"),
            e,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(holder: &str, renewed_ago: Duration, lease: Duration) -> LeaseRecord {
        LeaseRecord {
            holder_identity: holder.into(),
            lease_duration: lease,
            acquire_time: Some(SystemTime::now() - renewed_ago),
            renew_time: Some(SystemTime::now() - renewed_ago),
            transitions: 7,
        }
    }

    #[test]
    fn expiry_is_judged_from_timestamps() {
        let now = SystemTime::now();
        assert!(!looks_expired(
            &rec("a", Duration::from_secs(1), Duration::from_secs(15)),
            now
        ));
        assert!(looks_expired(
            &rec("a", Duration::from_secs(20), Duration::from_secs(15)),
            now
        ));
        assert!(!looks_expired(
            &rec("", Duration::from_secs(20), Duration::from_secs(15)),
            now
        ));
        // A duration past the end of time (written by another tool): held, never a panic.
        assert!(!looks_expired(
            &rec("a", Duration::from_secs(20), Duration::from_secs(u64::MAX)),
            now
        ));
    }

    #[test]
    fn json_has_the_documented_fields() {
        let v = Versioned {
            record: rec("a", Duration::from_secs(1), Duration::from_secs(15)),
            version: Version::new("42"),
        };
        let j = record_json("x", Some(&v));
        for f in [
            "lease",
            "exists",
            "holder",
            "fencing_token",
            "lease_duration_seconds",
            "acquire_time",
            "renew_time",
            "version",
            "looks_expired",
            "expiry_judged_from",
        ] {
            assert!(j.get(f).is_some(), "{f} in {j}");
            assert!(STATUS_LONG_ABOUT.contains(f), "{f} documented");
        }
        assert_eq!(j["holder"], "a");
        assert_eq!(record_json("x", None)["exists"], false);
    }
}
