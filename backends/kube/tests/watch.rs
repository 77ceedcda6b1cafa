//! Watch resilience: resume after a dropped connection, re-read after 410 Gone, bookmarks, and
//! never an older state after a newer one.

use std::time::{Duration, SystemTime};

use futures::StreamExt;
use leasehold::{LeaseKey, LeaseRecord, LeaseStore, Version, WatchEvent, WatchStream};
use leasehold_test_support::lease_api as support;
use support::{LeaseApiServer, ServerOptions, store};

fn key(k: &str) -> LeaseKey {
    LeaseKey::new(k).expect("valid key")
}

fn record(holder: &str, transitions: u64) -> LeaseRecord {
    LeaseRecord {
        holder_identity: holder.into(),
        lease_duration: Duration::from_secs(15),
        acquire_time: Some(SystemTime::now()),
        renew_time: Some(SystemTime::now()),
        transitions,
    }
}

/// The next event, with a generous limit so a broken watch fails instead of hanging.
async fn next(w: &mut WatchStream) -> WatchEvent {
    match tokio::time::timeout(Duration::from_secs(20), w.next()).await {
        Ok(Some(Ok(ev))) => ev,
        other => panic!("expected a watch event, got {other:?}"),
    }
}

/// Unrelated writes (a create and three updates of `other`) that move the store-wide
/// resourceVersion on, past the server's history once it is compacted.
async fn churn(s: &impl LeaseStore, other: &LeaseKey) {
    let mut ov = s
        .create(other, &record("x", 0))
        .await
        .expect("create other");
    for i in 0..3 {
        ov = s
            .update(other, &record("x", i), &ov)
            .await
            .expect("update other");
    }
}

fn put_version(ev: &WatchEvent) -> Version {
    match ev {
        WatchEvent::Put(v) => v.version.clone(),
        other => panic!("expected Put, got {other:?}"),
    }
}

#[tokio::test]
async fn resumes_after_dropped_connections_without_loss_or_repeats() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("resume");
    let mut v = s.create(&k, &record("a", 1)).await.expect("create");
    let mut w = s.watch(&k, Some(&v)).await.expect("watch");
    for i in 0..5u64 {
        server.drop_connections();
        v = s.update(&k, &record("a", i + 2), &v).await.expect("update");
        let got = next(&mut w).await;
        assert_eq!(put_version(&got), v, "round {i}");
    }
}

#[tokio::test]
async fn expired_resource_version_rereads_and_delivers_only_the_latest_state() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("gone");
    let v1 = s.create(&k, &record("a", 1)).await.expect("create");
    let v2 = s.update(&k, &record("b", 2), &v1).await.expect("update");
    let v3 = s.update(&k, &record("c", 3), &v2).await.expect("update");
    server.compact(); // v1 is now too old to watch from: 410 Expired
    let mut w = s.watch(&k, Some(&v1)).await.expect("watch");
    let got = next(&mut w).await;
    assert_eq!(put_version(&got), v3, "the latest state, coalescing v2");
    let v4 = s.update(&k, &record("d", 4), &v3).await.expect("update");
    assert_eq!(put_version(&next(&mut w).await), v4);
}

#[tokio::test]
async fn expired_resource_version_as_http_410_also_rereads() {
    let server = LeaseApiServer::start_with(ServerOptions {
        expired_as_http_410: true,
        ..ServerOptions::default()
    })
    .await;
    let s = store(&server);
    let k = key("gone-http");
    let v1 = s.create(&k, &record("a", 1)).await.expect("create");
    let v2 = s.update(&k, &record("b", 2), &v1).await.expect("update");
    server.compact();
    let mut w = s.watch(&k, Some(&v1)).await.expect("watch");
    assert_eq!(put_version(&next(&mut w).await), v2);
    let v3 = s.update(&k, &record("c", 3), &v2).await.expect("update");
    assert_eq!(put_version(&next(&mut w).await), v3);
}

#[tokio::test]
async fn expired_resource_version_of_a_deleted_key_delivers_deleted() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("gone-deleted");
    let v1 = s.create(&k, &record("a", 1)).await.expect("create");
    s.delete(&k, &v1).await.expect("delete");
    server.compact();
    let mut w = s.watch(&k, Some(&v1)).await.expect("watch");
    assert_eq!(next(&mut w).await, WatchEvent::Deleted);
    let v = s.create(&k, &record("b", 0)).await.expect("create again");
    assert_eq!(put_version(&next(&mut w).await), v);
}

#[tokio::test]
async fn expired_resource_version_with_no_change_delivers_nothing_old() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("gone-unchanged");
    let other = key("gone-other");
    let v1 = s.create(&k, &record("a", 1)).await.expect("create");
    // Unrelated writes move the store's resourceVersion past the history.
    churn(&s, &other).await;
    server.compact();
    let mut w = s.watch(&k, Some(&v1)).await.expect("watch");
    // The key is unchanged since v1: the re-read delivers nothing, the next change comes next.
    let v2 = s.update(&k, &record("b", 2), &v1).await.expect("update");
    assert_eq!(put_version(&next(&mut w).await), v2);
}

/// With bookmarks flowing, compaction plus a dropped connection still resumes correctly:
/// either from a bookmark's resourceVersion, or (if none was processed yet) via 410 and a
/// re-read. Both paths must deliver exactly the next change.
#[tokio::test]
async fn resumes_correctly_with_bookmarks_and_compaction() {
    let server = LeaseApiServer::start_with(ServerOptions {
        bookmark_interval: Duration::from_millis(50),
        ..ServerOptions::default()
    })
    .await;
    let s = store(&server);
    let k = key("bookmarked");
    let other = key("bookmarked-other");
    let v1 = s.create(&k, &record("a", 1)).await.expect("create");
    let mut w = s.watch(&k, Some(&v1)).await.expect("watch");
    // Consume the stream in the background so bookmarks are processed as they arrive.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let consumer = tokio::spawn(async move {
        while let Some(item) = w.next().await {
            if tx.send(item).is_err() {
                break;
            }
        }
    });
    churn(&s, &other).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.compact();
    server.drop_connections();
    let v2 = s.update(&k, &record("b", 2), &v1).await.expect("update");
    let got = tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .expect("no hang");
    match got {
        Some(Ok(ev)) => assert_eq!(put_version(&ev), v2),
        other => panic!("expected the update, got {other:?}"),
    }
    consumer.abort();
}

#[tokio::test]
async fn watch_from_none_starts_with_the_current_state_then_follows() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("from-none");
    let mut w = s.watch(&k, None).await.expect("watch absent");
    let v1 = s.create(&k, &record("a", 1)).await.expect("create");
    assert_eq!(put_version(&next(&mut w).await), v1);
    let mut w2 = s.watch(&k, None).await.expect("watch present");
    assert_eq!(put_version(&next(&mut w2).await), v1);
    s.delete(&k, &v1).await.expect("delete");
    assert_eq!(next(&mut w).await, WatchEvent::Deleted);
    assert_eq!(next(&mut w2).await, WatchEvent::Deleted);
}

#[tokio::test]
async fn watch_ends_with_a_retryable_error_when_the_server_is_gone() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("server-gone");
    let v1 = s.create(&k, &record("a", 1)).await.expect("create");
    let mut w = s.watch(&k, Some(&v1)).await.expect("watch");
    drop(server);
    let item = tokio::time::timeout(Duration::from_secs(30), w.next())
        .await
        .expect("the stream must not hang");
    match item {
        Some(Err(e)) => assert!(e.is_retryable(), "{e:?}"),
        other => panic!("expected a retryable error, got {other:?}"),
    }
    assert!(w.next().await.is_none(), "the stream ends after the error");
}
