//! Store-level tests against a real redis-server (one per test binary, see `common`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use common::*;
use futures::StreamExt;
use leasehold::{Error, KeyPrefix, LeaseStore, Version, WatchEvent, WatchStream};
use leasehold_test_support::redis as common;

async fn next(w: &mut WatchStream) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .expect("a watch event within 10 s")
        .expect("stream open")
        .expect("no error")
}

/// Asserts nothing is pending on the stream: a marker write made afterwards must be the next event.
async fn expect_next_put_version(w: &mut WatchStream, v: &Version) {
    match next(w).await {
        WatchEvent::Put(p) => assert_eq!(&p.version, v),
        other => panic!("expected Put({v}), got {other:?}"),
    }
}

#[tokio::test]
async fn crud_round_trip() {
    let s = store().await;
    let k = key("crud");
    assert!(s.get(&k).await.unwrap().is_none());
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    let got = s.get(&k).await.unwrap().unwrap();
    assert_eq!(got.record, record("a", 1));
    assert_eq!(got.version, v1);

    let v2 = s.update(&k, &record("b", 2), &v1).await.unwrap();
    assert_ne!(v1, v2);
    assert_eq!(s.get(&k).await.unwrap().unwrap().record, record("b", 2));

    assert!(matches!(
        s.update(&k, &record("c", 3), &v1).await,
        Err(Error::Conflict { .. })
    ));
    assert!(matches!(
        s.create(&k, &record("c", 3)).await,
        Err(Error::AlreadyExists { .. })
    ));
    assert!(matches!(
        s.delete(&k, &v1).await,
        Err(Error::Conflict { .. })
    ));
    s.delete(&k, &v2).await.unwrap();
    assert!(s.get(&k).await.unwrap().is_none());
    assert!(matches!(
        s.delete(&k, &v2).await,
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        s.update(&k, &record("c", 3), &v2).await,
        Err(Error::NotFound { .. })
    ));
    // Versions never repeat across delete and re-create.
    let v3 = s.create(&k, &record("d", 4)).await.unwrap();
    assert!(v3 != v1 && v3 != v2);
}

#[tokio::test]
async fn exactly_one_racing_update_wins() {
    let s = store().await;
    let k = key("race");
    let v = s.create(&k, &record("a", 0)).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (s, k, v) = (s.clone(), k.clone(), v.clone());
        tasks.push(tokio::spawn(async move {
            s.update(&k, &record(&format!("n{i}"), 1), &v).await
        }));
    }
    let mut wins = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => wins += 1,
            Err(Error::Conflict { .. }) => {}
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    assert_eq!(wins, 1);
}

#[tokio::test]
async fn scripts_survive_script_flush() {
    let url = shared_url();
    let s = store_at(&url).await;
    let k = key("flushed");
    let v = s.create(&k, &record("a", 1)).await.unwrap();
    raw_cmd(&url, redis::cmd("SCRIPT").arg("FLUSH")).await;
    let v2 = s.update(&k, &record("b", 2), &v).await.unwrap();
    raw_cmd(&url, redis::cmd("SCRIPT").arg("FLUSH")).await;
    assert_eq!(s.get(&k).await.unwrap().unwrap().version, v2);
    raw_cmd(&url, redis::cmd("SCRIPT").arg("FLUSH")).await;
    s.delete(&k, &v2).await.unwrap();
}

#[tokio::test]
async fn list_uses_the_index_and_the_prefix() {
    let s = store().await;
    for name in ["app-a", "app-b", "app.c", "other", "ap"] {
        s.create(&key(name), &record(name, 0)).await.unwrap();
    }
    let got: Vec<String> = s
        .list(&KeyPrefix::new("app").unwrap())
        .await
        .unwrap()
        .into_iter()
        .map(|(k, _)| k.to_string())
        .collect();
    assert_eq!(got, ["app-a", "app-b", "app.c"]);
    let all = s.list(&KeyPrefix::new("").unwrap()).await.unwrap();
    assert_eq!(all.len(), 5);
    // Deleted keys leave the index.
    let v = s.get(&key("app-b")).await.unwrap().unwrap().version;
    s.delete(&key("app-b"), &v).await.unwrap();
    let got = s.list(&KeyPrefix::new("app-").unwrap()).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0.as_str(), "app-a");
    assert_eq!(got[0].1.record, record("app-a", 0));
}

#[tokio::test]
async fn watch_from_now_delivers_every_change_in_order() {
    let s = store().await;
    let k = key("w");
    let mut w = s.watch(&k, None).await.unwrap();
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    let v2 = s.update(&k, &record("b", 2), &v1).await.unwrap();
    s.delete(&k, &v2).await.unwrap();
    let v3 = s.create(&k, &record("c", 3)).await.unwrap();
    match next(&mut w).await {
        WatchEvent::Put(p) => assert_eq!((p.version, p.record), (v1, record("a", 1))),
        e => panic!("{e:?}"),
    }
    match next(&mut w).await {
        WatchEvent::Put(p) => assert_eq!((p.version, p.record), (v2, record("b", 2))),
        e => panic!("{e:?}"),
    }
    assert_eq!(next(&mut w).await, WatchEvent::Deleted);
    expect_next_put_version(&mut w, &v3).await;
}

#[tokio::test]
async fn watch_after_a_version_skips_what_the_caller_saw() {
    let s = store().await;
    let k = key("after");
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    // Watching at the current version delivers nothing until the next change.
    let mut w = s.watch(&k, Some(&v1)).await.unwrap();
    let v2 = s.update(&k, &record("b", 2), &v1).await.unwrap();
    expect_next_put_version(&mut w, &v2).await;

    // Watching from an older version delivers the current state first.
    let mut w2 = s.watch(&k, Some(&v1)).await.unwrap();
    expect_next_put_version(&mut w2, &v2).await;

    // With None the current state comes first.
    let mut w3 = s.watch(&k, None).await.unwrap();
    expect_next_put_version(&mut w3, &v2).await;

    // After a version of a key that is gone: Deleted.
    s.delete(&k, &v2).await.unwrap();
    let mut w4 = s.watch(&k, Some(&v2)).await.unwrap();
    assert_eq!(next(&mut w4).await, WatchEvent::Deleted);
    assert_eq!(next(&mut w).await, WatchEvent::Deleted);
}

#[tokio::test]
async fn watch_stream_drop_stops_the_subscription() {
    let url = shared_url();
    let s = store_at(&url).await;
    let k = key("dropped");
    let before = numsub(&url, &s, &k).await;
    let w = s.watch(&k, None).await.unwrap();
    assert_eq!(numsub(&url, &s, &k).await, before + 1);
    drop(w);
    // Bounded wait for the task to notice and close its connection.
    for _ in 0..500 {
        if numsub(&url, &s, &k).await == before {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the subscription outlived its stream");
}

async fn numsub(url: &str, s: &leasehold_redis::RedisStore, k: &leasehold::LeaseKey) -> i64 {
    let chan = s.record_key(k).replace("rec:", "chan:");
    match raw_cmd(url, redis::cmd("PUBSUB").arg("NUMSUB").arg(&chan)).await {
        redis::Value::Array(v) => match v.get(1) {
            Some(redis::Value::Int(n)) => *n,
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn unicode_and_long_identities_round_trip() {
    let s = store().await;
    let long = "ü".repeat(2000);
    let k = key(&"k".repeat(253));
    let v = s.create(&k, &record(&long, 9)).await.unwrap();
    let got = s.get(&k).await.unwrap().unwrap();
    assert_eq!(got.record.holder_identity, long);
    assert_eq!(got.version, v);
}

#[tokio::test]
async fn keys_carry_the_prefix_as_a_hash_tag() {
    let cfg = leasehold_redis::RedisConfig::new(shared_url())
        .unwrap()
        .with_prefix("tagged-test:");
    assert_eq!(cfg.prefix(), "tagged-test:");
    let s = leasehold_redis::RedisStore::connect(cfg).await.unwrap();
    assert_eq!(s.record_key(&key("x")), "{tagged-test:}rec:x");
}

#[tokio::test]
async fn debug_never_shows_the_password() {
    let cfg = leasehold_redis::RedisConfig::new("redis://u:topsecret@127.0.0.1:1/0").unwrap();
    assert!(!format!("{cfg:?}").contains("topsecret"));
    // Nothing listens on port 1: the error must be typed, retryable and free of the password.
    let err = leasehold_redis::RedisStore::connect(cfg).await.unwrap_err();
    assert!(
        matches!(
            err,
            leasehold_redis::Error::Connect(leasehold::Error::Unavailable { .. })
        ),
        "{err:?}"
    );
    assert!(!format!("{err:?} {err}").contains("topsecret"));
    let err = leasehold::Error::from(err);
    assert!(err.is_retryable(), "{err:?}");
}

#[tokio::test]
async fn connect_to_a_closed_port_names_the_server() {
    let port = common::free_port();
    let cfg =
        leasehold_redis::RedisConfig::new(format!("redis://u:topsecret@127.0.0.1:{port}")).unwrap();
    let err = leasehold_redis::RedisStore::connect(cfg).await.unwrap_err();
    let text = err.to_string();
    println!("{text}");
    assert!(
        text.contains(&format!("cannot reach redis://u:***@127.0.0.1:{port}")),
        "{text}"
    );
    assert!(!text.contains("topsecret"), "{text}");
}

#[tokio::test]
async fn watch_sees_every_rapid_update_in_strictly_increasing_order() {
    let s = store().await;
    let k = key("rapid");
    let mut v = s.create(&k, &record("w", 0)).await.unwrap();
    let mut w = s.watch(&k, Some(&v)).await.unwrap();
    let writer = {
        let (s, k) = (s.clone(), k.clone());
        tokio::spawn(async move {
            for i in 1..=200u64 {
                v = s.update(&k, &record("w", i), &v).await.unwrap();
            }
            v
        })
    };
    let mut last = 0u64;
    let mut seen = 0u64;
    loop {
        match next(&mut w).await {
            WatchEvent::Put(p) => {
                let n: u64 = p.version.as_str().parse().unwrap();
                assert!(n > last, "version {n} after {last}");
                last = n;
                seen += 1;
                // Every change is published with its record: none is coalesced while connected.
                assert_eq!(p.record.transitions, seen);
                if seen == 200 {
                    break;
                }
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(writer.await.unwrap().as_str(), last.to_string());
}

#[tokio::test]
async fn a_watch_that_is_not_read_buffers_a_bounded_number_of_events_and_coalesces_the_rest() {
    let s = store().await;
    let k = key("slow-consumer");
    let mut v = s.create(&k, &record("a", 0)).await.unwrap();
    let mut w = s.watch(&k, Some(&v)).await.unwrap();
    let writes = 4 * leasehold_redis::watch::WATCH_BUFFER as u64;
    for i in 1..=writes {
        v = s.update(&k, &record("a", i), &v).await.unwrap();
    }
    // Give the watch task a moment to read the rest of its connection (this only makes the
    // count below tighter when the machine is slow; it asserts nothing about time).
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Read until the last write shows up: everything before it arrives in order, and the
    // buffer held at most WATCH_BUFFER items plus the coalesced latest state.
    let mut events = 0;
    let mut last = 0u64;
    loop {
        match next(&mut w).await {
            WatchEvent::Put(p) => {
                events += 1;
                let n: u64 = p.version.as_str().parse().unwrap();
                assert!(n > last, "an older state after a newer one");
                last = n;
                if p.version == v {
                    assert_eq!(p.record.transitions, writes);
                    break;
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    println!("{writes} writes arrived as {events} events");
    assert!(
        events <= leasehold_redis::watch::WATCH_BUFFER + 1,
        "{events} events buffered for {writes} writes"
    );
    // And the stream keeps delivering after it caught up.
    let v2 = s.update(&k, &record("b", 0), &v).await.unwrap();
    expect_next_put_version(&mut w, &v2).await;
}

#[tokio::test]
async fn the_store_reports_its_operation_timeout_and_the_elector_checks_it() {
    let s = store_at_with(&shared_url(), Duration::from_millis(700)).await;
    assert_eq!(
        s.capabilities().operation_timeout,
        Some(Duration::from_millis(700))
    );
    let config = leasehold::ElectorConfig::new(key("timed"), "a").with_timings(
        Duration::from_secs(2),
        Duration::from_millis(700),
        Duration::from_millis(100),
    );
    let err = leasehold::Elector::spawn(std::sync::Arc::new(s), config)
        .expect_err("renew deadline not above the store timeout");
    assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
}

/// The namespace counter of `s` (the key every write increments).
fn counter_key(s: &leasehold_redis::RedisStore) -> String {
    format!("{{{}}}rev", s.config().prefix())
}

/// The token high-water mark of `k` in the namespace of `s`.
fn token_key(s: &leasehold_redis::RedisStore, k: &leasehold::LeaseKey) -> String {
    format!("{{{}}}tok:{}", s.config().prefix(), k.as_str())
}

fn big(v: &Version) -> u128 {
    v.as_str()
        .parse()
        .unwrap_or_else(|_| panic!("version {v} is not a number"))
}

/// Creates `k` with the counter set to `start`, updates it twice and checks that the versions
/// strictly increase and that every version but the last is refused by compare-and-swap.
async fn versions_count_exactly_from(s: &leasehold_redis::RedisStore, start: &str, name: &str) {
    let url = shared_url();
    let k = key(name);
    raw_cmd(&url, redis::cmd("SET").arg(counter_key(s)).arg(start)).await;
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    let v2 = s.update(&k, &record("b", 2), &v1).await.unwrap();
    let v3 = s.update(&k, &record("c", 3), &v2).await.unwrap();
    println!("counter {start}: versions {v1} {v2} {v3}");
    assert_eq!(big(&v1), start.parse::<u128>().unwrap() + 1);
    assert!(big(&v1) < big(&v2) && big(&v2) < big(&v3), "{v1} {v2} {v3}");
    for stale in [&v1, &v2] {
        match s.update(&k, &record("stale", 9), stale).await {
            Err(Error::Conflict { .. }) => {}
            other => panic!("an update from stale version {stale} (current {v3}): {other:?}"),
        }
        assert!(matches!(
            s.delete(&k, stale).await,
            Err(Error::Conflict { .. })
        ));
    }
    let got = s.get(&k).await.unwrap().unwrap();
    assert_eq!(
        (got.record.holder_identity.as_str(), got.version),
        ("c", v3)
    );
}

#[tokio::test]
async fn versions_stay_exact_above_2_pow_53_and_across_a_digit() {
    let s = store().await;
    // 2^53 - 2: doubles lose +1 after two more writes.
    versions_count_exactly_from(&s, "9007199254740990", "near-2-53").await;
    // The next version gains a digit: compared by length first, not as text.
    versions_count_exactly_from(&s, "99999999999999998", "new-digit").await;
    // The fencing seed is exact too.
    let k = key("seed");
    raw_cmd(
        &shared_url(),
        redis::cmd("SET")
            .arg(counter_key(&s))
            .arg("9007199254740992"),
    )
    .await;
    assert_eq!(s.fencing_seed(&k).await.unwrap(), 9_007_199_254_740_993);
}

#[tokio::test]
async fn versions_and_tokens_past_u64_max_are_refused_and_write_nothing() {
    let s = store().await;
    let url = shared_url();
    let k = key("top");
    raw_cmd(
        &url,
        redis::cmd("SET")
            .arg(counter_key(&s))
            .arg("18446744073709551613"),
    )
    .await;
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    let v2 = s.update(&k, &record("b", 2), &v1).await.unwrap();
    assert_eq!(v2.as_str(), "18446744073709551615");
    match s.update(&k, &record("c", 3), &v2).await {
        Err(Error::Store {
            retryable: false,
            message,
            ..
        }) => {
            assert!(message.contains(&counter_key(&s)), "{message}");
            assert!(
                message.contains("would exceed 18446744073709551615"),
                "{message}"
            );
        }
        other => panic!("an update past u64::MAX: {other:?}"),
    }
    let got = s.get(&k).await.unwrap().unwrap();
    assert_eq!(
        (got.record.holder_identity.as_str(), &got.version),
        ("b", &v2)
    );

    // A token high-water mark at u64::MAX: no higher token exists, nothing is written.
    let fresh = key("exhausted");
    raw_cmd(&url, redis::cmd("DEL").arg(counter_key(&s))).await;
    raw_cmd(
        &url,
        redis::cmd("SET").arg(token_key(&s, &fresh)).arg(u64::MAX),
    )
    .await;
    match s.acquire(&fresh, &record("a", 1), None).await {
        Err(Error::TokenExhausted { key, last }) => {
            assert_eq!((key.as_str(), last), ("exhausted", u64::MAX));
        }
        other => panic!("an acquire above the last token: {other:?}"),
    }
    assert!(s.get(&fresh).await.unwrap().is_none());
    assert!(matches!(
        s.fencing_seed(&fresh).await,
        Err(Error::TokenExhausted { .. })
    ));
}

#[tokio::test]
async fn a_counter_that_is_not_a_decimal_integer_is_a_typed_error_and_writes_nothing() {
    let s = store().await;
    let url = shared_url();
    let k = key("garbage");
    let rev = counter_key(&s);
    for (set, shown) in [
        (
            redis::cmd("SET").arg(&rev).arg("12abc").clone(),
            "\"12abc\"",
        ),
        (redis::cmd("SET").arg(&rev).arg("-5").clone(), "\"-5\""),
        (
            redis::cmd("SET").arg(&rev).arg("1e300").clone(),
            "\"1e300\"",
        ),
        (
            redis::cmd("SET")
                .arg(&rev)
                .arg("18446744073709551616")
                .clone(),
            "\"18446744073709551616\"",
        ),
        (
            redis::cmd("HSET").arg(&rev).arg("f").arg("1").clone(),
            "\"a redis hash\"",
        ),
    ] {
        raw_cmd(&url, redis::cmd("DEL").arg(&rev)).await;
        raw_cmd(&url, &set).await;
        for (op, result) in [
            ("create", s.create(&k, &record("a", 1)).await.map(|_| ())),
            (
                "acquire",
                s.acquire(&k, &record("a", 1), None).await.map(|_| ()),
            ),
            ("fencing_seed", s.fencing_seed(&k).await.map(|_| ())),
        ] {
            match result {
                Err(Error::Store {
                    retryable: false,
                    message,
                    ..
                }) => {
                    assert!(message.starts_with(&format!("{op}: ")), "{message}");
                    assert!(
                        message.contains(&format!("namespace counter {rev} holds {shown}")),
                        "{message}"
                    );
                    assert!(message.contains("not a decimal integer"), "{message}");
                    assert!(message.contains("set it to"), "{message}");
                }
                other => panic!("{op} with the counter holding {shown}: {other:?}"),
            }
        }
        assert!(s.get(&k).await.unwrap().is_none(), "nothing was written");
    }
    // Once the counter holds a number again, writes go on.
    raw_cmd(&url, redis::cmd("SET").arg(&rev).arg("7")).await;
    let v = s.create(&k, &record("a", 1)).await.unwrap();
    assert!(big(&v) > 7);

    // A token high-water mark holding garbage refuses the acquisition the same way.
    raw_cmd(&url, redis::cmd("SET").arg(token_key(&s, &k)).arg("lots")).await;
    match s.acquire(&k, &record("b", 2), Some(&v)).await {
        Err(Error::Store {
            retryable: false,
            message,
            ..
        }) => assert!(
            message.contains(&format!(
                "high-water mark {} holds \"lots\"",
                token_key(&s, &k)
            )),
            "{message}"
        ),
        other => panic!("acquire with a garbage high-water mark: {other:?}"),
    }
    assert_eq!(s.get(&k).await.unwrap().unwrap().version, v);
}

#[tokio::test]
async fn an_acquire_after_a_delete_stays_above_a_token_a_floor_raised() {
    let s = store().await;
    let url = shared_url();
    let k = key("floor-then-delete");
    let high = 1u64 << 60;
    let v = s.create(&k, &record("foreign", high)).await.unwrap();
    let a = s
        .acquire(&k, &record("a", high + 1), Some(&v))
        .await
        .unwrap();
    assert_eq!(a.fencing_token, high + 1);
    s.delete(&k, &a.version).await.unwrap();
    // The record is gone, with the floor it carried; the next acquisition asks for no floor.
    let b = s.acquire(&k, &record("b", 0), None).await.unwrap();
    println!(
        "tokens {} then {} after the delete",
        a.fencing_token, b.fencing_token
    );
    assert!(
        b.fencing_token > a.fencing_token,
        "{} after {}",
        b.fencing_token,
        a.fencing_token
    );
    assert!(s.fencing_seed(&k).await.unwrap() > b.fencing_token);
    // The stored JSON carries the token itself, for any reader.
    let raw = raw_cmd(&url, redis::cmd("HGET").arg(s.record_key(&k)).arg("d")).await;
    let redis::Value::BulkString(json) = raw else {
        panic!("record data {raw:?}")
    };
    let stored = leasehold::codec::decode(&k, &json, None).unwrap();
    assert_eq!(
        (stored.holder_identity.as_str(), stored.transitions),
        ("b", b.fencing_token)
    );
}
