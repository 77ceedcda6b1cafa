//! Corrupt data under our keys: every shape is a typed `Corrupt` error naming the key, with a
//! version that lets a compare-and-swap replace it while it is unchanged.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use leasehold::{
    Elector, ElectorConfig, Error, KeyPrefix, LeaseKey, LeaseStore, Version, WatchEvent,
};
use leasehold_redis::RedisStore;
use leasehold_test_support::redis as common;

/// Writes foreign data under `k`'s record key with `cmds` (after deleting the key).
async fn write_foreign(url: &str, s: &RedisStore, k: &LeaseKey, cmds: &[Vec<&str>]) {
    let rkey = s.record_key(k);
    raw_cmd(url, redis::cmd("DEL").arg(&rkey)).await;
    for c in cmds {
        let mut cmd = redis::cmd(c[0]);
        cmd.arg(&rkey);
        for a in &c[1..] {
            cmd.arg(*a);
        }
        raw_cmd(url, &cmd).await;
    }
}

fn corrupt_version(k: &LeaseKey, r: leasehold::Result<Option<leasehold::Versioned>>) -> Version {
    match r {
        Err(Error::Corrupt {
            key,
            reason,
            version,
        }) => {
            assert_eq!(key, k.as_str());
            assert!(!reason.is_empty());
            version.expect("the store reports the version of corrupt data")
        }
        other => panic!("expected Corrupt for {k}, got {other:?}"),
    }
}

/// One shape: its name, the commands that write it, and our counter if the version is one.
type Shape = (&'static str, Vec<Vec<&'static str>>, Option<&'static str>);

fn shapes() -> Vec<Shape> {
    vec![
        ("string", vec![vec!["SET", "hello"]], None),
        ("list", vec![vec!["RPUSH", "a", "b"]], None),
        ("set", vec![vec!["SADD", "a", "b"]], None),
        ("foreign-hash", vec![vec!["HSET", "owner", "someone"]], None),
        (
            "truncated-json",
            vec![vec![
                "HSET",
                "v",
                "5",
                "d",
                "{\"holderIdentity\":\"a\",\"leaseDur",
            ]],
            Some("5"),
        ),
        (
            "not-json",
            vec![vec!["HSET", "v", "6", "d", "garbage"]],
            Some("6"),
        ),
        (
            "json-array",
            vec![vec!["HSET", "v", "7", "d", "[1,2,3]"]],
            Some("7"),
        ),
        (
            "bad-counter",
            vec![vec!["HSET", "v", "abc", "d", "{}"]],
            None,
        ),
        ("empty-string", vec![vec!["SET", ""]], None),
    ]
}

#[tokio::test]
async fn every_shape_is_a_typed_corrupt_error_and_replaceable_by_cas() {
    let url = shared_url();
    let s = store_at(&url).await;
    for (name, cmds, counter) in shapes() {
        let k = key(name);
        write_foreign(&url, &s, &k, &cmds).await;
        let v = corrupt_version(&k, s.get(&k).await);
        match counter {
            Some(c) => assert_eq!(v.as_str(), c, "{name}"),
            None => assert!(v.as_str().starts_with('x'), "{name}: {v}"),
        }
        // Unchanged data keeps its version.
        assert_eq!(corrupt_version(&k, s.get(&k).await), v, "{name}");
        // create refuses, a wrong version conflicts.
        assert!(
            matches!(
                s.create(&k, &record("me", 0)).await,
                Err(Error::AlreadyExists { .. })
            ),
            "{name}"
        );
        assert!(
            matches!(
                s.update(&k, &record("me", 0), &Version::new("x00")).await,
                Err(Error::Conflict { .. })
            ),
            "{name}"
        );
        // The reported version replaces it by compare-and-swap.
        let nv = s.update(&k, &record("me", 1), &v).await.unwrap();
        let got = s.get(&k).await.unwrap().unwrap();
        assert_eq!(got.version, nv);
        assert_eq!(got.record, record("me", 1));
    }
}

#[tokio::test]
async fn changed_corrupt_data_gets_a_new_version_and_is_not_overwritten() {
    let url = shared_url();
    let s = store_at(&url).await;
    let k = key("changing");
    write_foreign(&url, &s, &k, &[vec!["SET", "one"]]).await;
    let v1 = corrupt_version(&k, s.get(&k).await);
    write_foreign(&url, &s, &k, &[vec!["SET", "two"]]).await;
    let v2 = corrupt_version(&k, s.get(&k).await);
    assert_ne!(v1, v2);
    assert!(matches!(
        s.update(&k, &record("me", 1), &v1).await,
        Err(Error::Conflict { .. })
    ));
    assert!(matches!(
        s.delete(&k, &v1).await,
        Err(Error::Conflict { .. })
    ));
    s.delete(&k, &v2).await.unwrap();
    assert!(s.get(&k).await.unwrap().is_none());
}

#[tokio::test]
async fn list_leaves_out_corrupt_keys_and_watch_reports_them() {
    let url = shared_url();
    let s = store_at(&url).await;
    let good = key("item-good");
    let bad = key("item-bad");
    s.create(&good, &record("g", 0)).await.unwrap();
    let vb = s.create(&bad, &record("b", 0)).await.unwrap();
    let mut w = s.watch(&bad, Some(&vb)).await.unwrap();
    // A foreign writer truncates the record in place (no publish): list skips it.
    raw_cmd(
        &url,
        redis::cmd("HSET")
            .arg(s.record_key(&bad))
            .arg("d")
            .arg("{\"hold"),
    )
    .await;
    let listed = s.list(&KeyPrefix::new("item-").unwrap()).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].0, good);
    corrupt_version(&bad, s.get(&bad).await);

    // A watch started on foreign data reports it as Corrupt, with the version to replace it.
    write_foreign(&url, &s, &bad, &[vec!["SET", "junk"]]).await;
    let mut w2 = s.watch(&bad, None).await.unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(10), w2.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let WatchEvent::Corrupt { version, .. } = ev else {
        panic!("expected Corrupt, got {ev:?}")
    };
    let version = version.expect("a version");
    assert_eq!(
        Some(version.clone()),
        corrupt_version(&bad, s.get(&bad).await).into()
    );
    // Replacing it reaches both watches as a Put.
    let nv = s.update(&bad, &record("me", 1), &version).await.unwrap();
    for w in [&mut w, &mut w2] {
        let ev = tokio::time::timeout(Duration::from_secs(10), w.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        match ev {
            WatchEvent::Put(p) => assert_eq!(p.version, nv),
            other => panic!("expected the Put, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn an_elector_takes_over_corrupt_data_that_stays_unchanged() {
    let url = shared_url();
    let s = store_at(&url).await;
    let k = key("elector-corrupt");
    write_foreign(&url, &s, &k, &[vec!["SET", "not a lease"]]).await;
    let cfg = ElectorConfig::new(k.clone(), "taker").with_timings(
        Duration::from_secs(2),
        Duration::from_secs(1),
        Duration::from_millis(250),
    );
    let started = Instant::now();
    let e = Elector::spawn(Arc::new(s.clone()), cfg).unwrap();
    let mut rx = e.subscribe();
    tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|st| st.is_leading()))
        .await
        .expect("the elector takes over within 60 s")
        .unwrap();
    let waited = started.elapsed();
    // It waited a whole lease duration of unchanged data before replacing it.
    assert!(
        waited >= Duration::from_secs(2),
        "took over after {waited:?}"
    );
    let got = s.get(&k).await.unwrap().unwrap();
    assert_eq!(got.record.holder_identity, "taker");
    e.shutdown().await.expect("the elector shuts down cleanly");
}
