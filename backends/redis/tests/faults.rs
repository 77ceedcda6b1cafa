//! Fault tests with a real redis-server per test: killed, restarted, paused (SIGSTOP), scripts
//! evicted. They assert behaviour (typed errors, no hang, step-down, recovery) and print the
//! timings they observe; they never assert an upper time bound.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use leasehold::{Elector, ElectorConfig, Error, LeaseStore, WatchEvent, WatchStream};
use leasehold_redis::{RedisConfig, RedisStore};

/// A generous limit for "eventually", so that a hang fails the test instead of blocking CI.
const EVENTUALLY: Duration = Duration::from_secs(60);

async fn fast_store(url: &str) -> RedisStore {
    let cfg = RedisConfig::new(url)
        .unwrap()
        .prefix(unique_prefix())
        .unwrap()
        .operation_timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .watch_ping_interval(Duration::from_millis(200));
    RedisStore::connect(cfg).await.unwrap()
}

/// Retries `get` until it succeeds (bounded).
async fn until_available(s: &RedisStore, k: &leasehold::LeaseKey) {
    let deadline = Instant::now() + EVENTUALLY;
    loop {
        match s.get(k).await {
            Ok(_) => return,
            Err(e) => {
                assert!(e.is_retryable(), "not retryable: {e:?}");
                assert!(Instant::now() < deadline, "store did not recover: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[tokio::test]
async fn killed_server_gives_retryable_errors_and_a_restart_recovers() {
    let mut srv = Server::start();
    let s = fast_store(&srv.url()).await;
    let k = key("lease");
    let v = s.create(&k, &record("a", 1)).await.unwrap();

    srv.kill();
    for _ in 0..3 {
        let r = tokio::time::timeout(EVENTUALLY, s.update(&k, &record("a", 2), &v))
            .await
            .expect("an operation on a dead server returns instead of hanging");
        let e = r.expect_err("the server is dead");
        assert!(
            matches!(e, Error::Unavailable { .. } | Error::Timeout { .. }),
            "{e:?}"
        );
        assert!(e.is_retryable());
    }

    // A restart without persistence: empty data, empty script cache (NOSCRIPT path).
    srv.restart();
    until_available(&s, &k).await;
    assert!(
        s.get(&k).await.unwrap().is_none(),
        "no persistence: the data is gone"
    );
    let v2 = s.create(&k, &record("b", 1)).await.unwrap();
    // Versions keep growing across the data loss (the counter restarts at the server clock), so
    // the version read before the loss cannot match the new record.
    assert_ne!(v2, v);
    assert!(matches!(
        s.update(&k, &record("a", 2), &v).await,
        Err(Error::Conflict { .. })
    ));
}

#[tokio::test]
async fn paused_server_gives_timeouts_and_resuming_recovers() {
    let srv = Server::start();
    let s = fast_store(&srv.url()).await;
    let k = key("lease");
    let v = s.create(&k, &record("a", 1)).await.unwrap();
    srv.pause();
    let r = tokio::time::timeout(EVENTUALLY, s.get(&k))
        .await
        .expect("an operation on a paused server returns instead of hanging");
    match r {
        Err(Error::Timeout {
            store, operation, ..
        }) => assert_eq!((store, operation), ("redis", "get")),
        other => panic!("expected a Timeout, got {other:?}"),
    }
    let r = tokio::time::timeout(EVENTUALLY, s.update(&k, &record("a", 2), &v))
        .await
        .expect("no hang");
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    srv.resume();
    until_available(&s, &k).await;
    // The update may or may not have been applied after the resume: a read tells.
    let cur = s.get(&k).await.unwrap().unwrap();
    assert!(cur.record == record("a", 1) || cur.record == record("a", 2));
    s.update(&k, &record("a", 3), &cur.version).await.unwrap();
}

async fn next_ok(w: &mut WatchStream) -> WatchEvent {
    let deadline = Instant::now() + EVENTUALLY;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, w.next()).await {
            Err(_) => panic!("no watch event within {EVENTUALLY:?}"),
            Ok(None) => panic!("the watch ended"),
            Ok(Some(Err(e))) => assert!(e.is_retryable(), "{e:?}"),
            Ok(Some(Ok(ev))) => return ev,
        }
    }
}

#[tokio::test]
async fn watch_reports_the_loss_then_resubscribes_and_rereads_after_restart() {
    let mut srv = Server::start();
    let s = fast_store(&srv.url()).await;
    let k = key("watched");
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    let mut w = s.watch(&k, Some(&v1)).await.unwrap();

    srv.kill();
    // The loss is reported as one retryable error item; the stream goes on.
    let item = tokio::time::timeout(EVENTUALLY, w.next())
        .await
        .expect("the loss is reported")
        .expect("the stream goes on");
    let e = item.expect_err("an error item");
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");

    srv.restart();
    // The restarted server lost the key: the re-read reports the deletion...
    assert_eq!(next_ok(&mut w).await, WatchEvent::Deleted);
    // ...and changes after the resubscription arrive by pub/sub.
    until_available(&s, &k).await;
    let v2 = s.create(&k, &record("b", 2)).await.unwrap();
    match next_ok(&mut w).await {
        WatchEvent::Put(p) => {
            assert_eq!(p.version, v2);
            assert_eq!(p.record, record("b", 2));
        }
        other => panic!("expected the new record, got {other:?}"),
    }
    let v3 = s.update(&k, &record("c", 3), &v2).await.unwrap();
    match next_ok(&mut w).await {
        WatchEvent::Put(p) => assert_eq!(p.version, v3),
        other => panic!("expected the update, got {other:?}"),
    }
}

#[tokio::test]
async fn watch_catches_up_on_changes_made_while_it_was_paused_out() {
    // Changes made while the watch connection is away are coalesced by the re-read.
    let srv = Server::start();
    let s = fast_store(&srv.url()).await;
    let k = key("paused-watch");
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    let mut w = s.watch(&k, Some(&v1)).await.unwrap();
    srv.pause();
    // The ping fails while paused: an error item.
    let item = tokio::time::timeout(EVENTUALLY, w.next())
        .await
        .expect("the loss is reported")
        .expect("the stream goes on");
    assert!(item.is_err(), "{item:?}");
    srv.resume();
    let v2 = loop {
        match s.update(&k, &record("b", 2), &v1).await {
            Ok(v) => break v,
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(Error::Conflict { .. }) => {
                break s.get(&k).await.unwrap().unwrap().version;
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    match next_ok(&mut w).await {
        WatchEvent::Put(p) => assert_eq!(p.version, v2),
        other => panic!("expected the update, got {other:?}"),
    }
}

fn elector_config(k: &leasehold::LeaseKey, id: &str) -> ElectorConfig {
    ElectorConfig::new(k.clone(), id).with_timings(
        Duration::from_secs(2),
        Duration::from_secs(1),
        Duration::from_millis(250),
    )
}

async fn wait_until(e: &Elector, leading: bool) -> Duration {
    let started = Instant::now();
    let mut rx = e.subscribe();
    tokio::time::timeout(EVENTUALLY, rx.wait_for(|s| s.is_leading() == leading))
        .await
        .unwrap_or_else(|_| panic!("elector did not reach leading={leading} within {EVENTUALLY:?}"))
        .unwrap();
    started.elapsed()
}

async fn any_leads(electors: &[&Elector]) {
    let deadline = Instant::now() + EVENTUALLY;
    loop {
        let n = electors.iter().filter(|e| e.is_leading()).count();
        assert!(n <= 1, "two leaders on a single primary");
        if n == 1 {
            return;
        }
        assert!(Instant::now() < deadline, "no elector leads again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn leader_steps_down_when_the_server_dies_and_an_elector_leads_after_restart() {
    let mut srv = Server::start();
    let url = srv.url();
    let k = key("fault-kill");
    let a = Elector::spawn(Arc::new(fast_store(&url).await), elector_config(&k, "a")).unwrap();
    wait_until(&a, true).await;
    let b = Elector::spawn(Arc::new(fast_store(&url).await), elector_config(&k, "b")).unwrap();

    srv.kill();
    let took = wait_until(&a, false).await;
    println!("leader stepped down {took:?} after the server was killed (renew deadline 1 s)");
    assert!(
        !b.is_leading(),
        "a follower cannot acquire while the server is dead"
    );

    srv.restart();
    any_leads(&[&a, &b]).await;
    a.shutdown().await.expect("the elector shuts down cleanly");
    b.shutdown().await.expect("the elector shuts down cleanly");
}

#[tokio::test]
async fn leader_steps_down_while_the_server_is_paused_and_leads_again_after_resume() {
    let srv = Server::start();
    let url = srv.url();
    let k = key("fault-pause");
    let a = Elector::spawn(Arc::new(fast_store(&url).await), elector_config(&k, "a")).unwrap();
    wait_until(&a, true).await;
    let b = Elector::spawn(Arc::new(fast_store(&url).await), elector_config(&k, "b")).unwrap();

    srv.pause();
    let took = wait_until(&a, false).await;
    println!("leader stepped down {took:?} after the server was paused (renew deadline 1 s)");
    assert!(!b.is_leading());

    srv.resume();
    any_leads(&[&a, &b]).await;
    a.shutdown().await.expect("the elector shuts down cleanly");
    b.shutdown().await.expect("the elector shuts down cleanly");
}
