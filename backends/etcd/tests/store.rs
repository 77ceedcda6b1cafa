//! Store-level tests against a real etcd (one server per test binary, see `common`).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{record, shared_endpoints, shared_store, unique_prefix};
use futures::StreamExt;
use leasehold::{Error, KeyPrefix, LeaseKey, LeaseStore, Version, WatchEvent, WatchStream};
use leasehold_etcd::{EtcdConfig, EtcdStore, TlsConfig, revision};

fn key(s: &str) -> LeaseKey {
    LeaseKey::new(s).unwrap()
}

/// The next watch item, bounded so a missing event fails instead of hanging.
async fn next(w: &mut WatchStream) -> WatchEvent {
    match tokio::time::timeout(Duration::from_secs(20), w.next()).await {
        Ok(Some(Ok(ev))) => ev,
        other => panic!("expected a watch event, got {other:?}"),
    }
}

fn put_version(ev: &WatchEvent) -> Version {
    match ev {
        WatchEvent::Put(v) => v.version.clone(),
        other => panic!("expected a Put, got {other:?}"),
    }
}

async fn raw_mod_revision(store: &EtcdStore, k: &LeaseKey) -> i64 {
    let mut kv = store.client().kv_client();
    let resp = kv.get(store.etcd_key(k), None).await.unwrap();
    resp.kvs()[0].mod_revision()
}

#[tokio::test]
async fn crud_with_typed_outcomes() {
    let store = shared_store().await;
    let k = key("crud");
    assert!(store.get(&k).await.unwrap().is_none());

    let v1 = store.create(&k, &record("a", 1)).await.unwrap();
    assert_eq!(revision(&v1), Some(raw_mod_revision(&store, &k).await));
    let got = store.get(&k).await.unwrap().unwrap();
    assert_eq!(got.record, record("a", 1));
    assert_eq!(got.version, v1);

    assert!(matches!(
        store.create(&k, &record("b", 1)).await,
        Err(Error::AlreadyExists { .. })
    ));

    let v2 = store.update(&k, &record("b", 2), &v1).await.unwrap();
    assert!(revision(&v2).unwrap() > revision(&v1).unwrap());
    assert_eq!(revision(&v2), Some(raw_mod_revision(&store, &k).await));

    // Stale and garbage versions conflict; nothing changes.
    for stale in [
        v1.clone(),
        Version::new("0"),
        Version::new("not-a-revision"),
    ] {
        assert!(matches!(
            store.update(&k, &record("c", 3), &stale).await,
            Err(Error::Conflict { .. })
        ));
        assert!(matches!(
            store.delete(&k, &stale).await,
            Err(Error::Conflict { .. })
        ));
    }
    assert_eq!(store.get(&k).await.unwrap().unwrap().record, record("b", 2));

    store.delete(&k, &v2).await.unwrap();
    assert!(store.get(&k).await.unwrap().is_none());
    for v in [v2.clone(), Version::new("0"), Version::new("x")] {
        assert!(matches!(
            store.update(&k, &record("d", 4), &v).await,
            Err(Error::NotFound { .. })
        ));
        assert!(matches!(
            store.delete(&k, &v).await,
            Err(Error::NotFound { .. })
        ));
    }
    // Updating a missing key with version "0" must not create it (mod_revision of a missing
    // key is 0 in etcd).
    assert!(store.get(&k).await.unwrap().is_none());
}

#[tokio::test]
async fn records_live_under_the_prefix_as_client_go_json() {
    let store = shared_store().await;
    let k = key("layout");
    store.create(&k, &record("node-a", 7)).await.unwrap();
    let mut kv = store.client().kv_client();
    let resp = kv
        .get(format!("{}layout", store.prefix()), None)
        .await
        .unwrap();
    let text = std::str::from_utf8(resp.kvs()[0].value()).unwrap();
    assert!(text.contains("\"holderIdentity\":\"node-a\""), "{text}");
    assert!(text.contains("\"leaderTransitions\":7"), "{text}");
}

#[tokio::test]
async fn corrupt_data_is_typed_and_replaceable_by_cas() {
    let store = shared_store().await;
    let k = key("corrupt");
    let mut kv = store.client().kv_client();
    let put = kv
        .put(store.etcd_key(&k), "not a lease record", None)
        .await
        .unwrap();
    let rev = put.header().unwrap().revision();

    match store.get(&k).await {
        Err(Error::Corrupt { key, version, .. }) => {
            assert_eq!(key, "corrupt");
            assert_eq!(version, Some(Version::from(rev)));
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert!(matches!(
        store.create(&k, &record("a", 1)).await,
        Err(Error::AlreadyExists { .. })
    ));
    // Listed keys leave it out.
    assert!(
        store
            .list(&KeyPrefix::new("").unwrap())
            .await
            .unwrap()
            .is_empty()
    );
    // Watching from before it reports Corrupt with its version.
    let mut w = store.watch(&k, None).await.unwrap();
    match next(&mut w).await {
        WatchEvent::Corrupt { version, .. } => assert_eq!(version, Some(Version::from(rev))),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    // The elector may replace it by compare-and-swap on its version.
    let v = store
        .update(&k, &record("a", 1), &Version::from(rev))
        .await
        .unwrap();
    assert_eq!(store.get(&k).await.unwrap().unwrap().version, v);
    assert_eq!(put_version(&next(&mut w).await), v);
}

#[tokio::test]
async fn watch_after_a_get_loses_nothing() {
    let store = shared_store().await;
    let k = key("watch-after");
    let v0 = store.create(&k, &record("a", 1)).await.unwrap();
    // Changes made between the get and the watch are delivered.
    let v1 = store.update(&k, &record("b", 2), &v0).await.unwrap();
    let v2 = store.update(&k, &record("c", 3), &v1).await.unwrap();
    let mut w = store.watch(&k, Some(&v0)).await.unwrap();
    assert_eq!(put_version(&next(&mut w).await), v1);
    assert_eq!(put_version(&next(&mut w).await), v2);
    let v3 = store.update(&k, &record("d", 4), &v2).await.unwrap();
    match next(&mut w).await {
        WatchEvent::Put(v) => {
            assert_eq!(v.version, v3);
            assert_eq!(v.record, record("d", 4));
        }
        other => panic!("{other:?}"),
    }
    store.delete(&k, &v3).await.unwrap();
    assert_eq!(next(&mut w).await, WatchEvent::Deleted);
    let v4 = store.create(&k, &record("e", 5)).await.unwrap();
    assert_eq!(put_version(&next(&mut w).await), v4);
}

#[tokio::test]
async fn watch_without_after_starts_with_the_current_state() {
    let store = shared_store().await;
    let k = key("watch-now");
    // Missing key: nothing first, then the creation.
    let mut w = store.watch(&k, None).await.unwrap();
    let v0 = store.create(&k, &record("a", 1)).await.unwrap();
    assert_eq!(put_version(&next(&mut w).await), v0);
    drop(w);

    let v1 = store.update(&k, &record("b", 2), &v0).await.unwrap();
    let mut w = store.watch(&k, None).await.unwrap();
    assert_eq!(put_version(&next(&mut w).await), v1);
    let v2 = store.update(&k, &record("c", 3), &v1).await.unwrap();
    assert_eq!(put_version(&next(&mut w).await), v2);
}

#[tokio::test]
async fn watch_resumes_after_compaction_without_going_back() {
    let store = shared_store().await;
    let k = key("compacted");
    let other = key("other");
    let v0 = store.create(&k, &record("a", 0)).await.unwrap();
    let mut v = v0.clone();
    for i in 1..=5 {
        v = store.update(&k, &record("a", i), &v).await.unwrap();
    }
    let latest = v.clone();
    // Unrelated writes, then compact everything up to now: revision v0 + 1 is gone.
    let mut ov = store.create(&other, &record("x", 0)).await.unwrap();
    for i in 1..=3 {
        ov = store.update(&other, &record("x", i), &ov).await.unwrap();
    }
    let mut kv = store.client().kv_client();
    kv.compact(revision(&ov).unwrap(), None).await.unwrap();

    // A watch from before the compaction cannot replay history: it re-reads and delivers the
    // latest state (coalescing the compacted changes), never an older one.
    let mut w = store.watch(&k, Some(&v0)).await.unwrap();
    match next(&mut w).await {
        WatchEvent::Put(got) => {
            assert_eq!(got.version, latest);
            assert_eq!(got.record.transitions, 5);
        }
        other => panic!("{other:?}"),
    }
    // And it keeps delivering every later change.
    let v6 = store.update(&k, &record("b", 6), &latest).await.unwrap();
    assert_eq!(put_version(&next(&mut w).await), v6);

    // A watch from the current version after compaction delivers nothing old either.
    let mut w2 = store.watch(&k, Some(&v6)).await.unwrap();
    let v7 = store.update(&k, &record("c", 7), &v6).await.unwrap();
    assert_eq!(put_version(&next(&mut w2).await), v7);
    assert_eq!(put_version(&next(&mut w).await), v7);

    // A key deleted and compacted away while unwatched is reported deleted.
    store.delete(&k, &v7).await.unwrap();
    let ov2 = store.update(&other, &record("x", 9), &ov).await.unwrap();
    kv.compact(revision(&ov2).unwrap(), None).await.unwrap();
    assert_eq!(next(&mut w).await, WatchEvent::Deleted);
    let mut w3 = store.watch(&k, Some(&v7)).await.unwrap();
    assert_eq!(next(&mut w3).await, WatchEvent::Deleted);
}

#[tokio::test]
async fn list_returns_exactly_the_keys_under_the_prefix_sorted() {
    let store = shared_store().await;
    for name in ["b-2", "a-1", "b-1", "bb"] {
        store.create(&key(name), &record(name, 1)).await.unwrap();
    }
    let names = |l: Vec<(LeaseKey, leasehold::Versioned)>| {
        l.into_iter()
            .map(|(k, v)| {
                assert_eq!(v.record.holder_identity, k.as_str());
                k.to_string()
            })
            .collect::<Vec<_>>()
    };
    let all = store.list(&KeyPrefix::new("").unwrap()).await.unwrap();
    assert_eq!(names(all), ["a-1", "b-1", "b-2", "bb"]);
    let b = store.list(&KeyPrefix::new("b-").unwrap()).await.unwrap();
    assert_eq!(names(b), ["b-1", "b-2"]);
    assert!(
        store
            .list(&KeyPrefix::new("c").unwrap())
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn a_hung_server_gives_a_typed_timeout() {
    // Accepts TCP connections (backlog) but never speaks HTTP/2.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let config = EtcdConfig::new([format!("http://{addr}")])
        .with_operation_timeout(Duration::from_millis(500))
        .with_connect_timeout(Duration::from_secs(30));
    let store = EtcdStore::connect(config).await.unwrap();
    let k = key("hung");
    let started = std::time::Instant::now();
    for result in [
        store.get(&k).await.map(|_| ()),
        store.create(&k, &record("a", 1)).await.map(|_| ()),
        store.watch(&k, None).await.map(|_| ()),
    ] {
        let e = result.unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        assert!(e.is_retryable(), "{e:?}");
    }
    // Bounded: three operations, each cut off (generous bound; this asserts "no hang").
    assert!(started.elapsed() < Duration::from_secs(60));
    drop(listener);
}

#[tokio::test]
async fn an_unreachable_endpoint_is_unavailable_and_retryable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = EtcdConfig::new([format!("http://127.0.0.1:{port}")])
        .with_operation_timeout(Duration::from_millis(500));
    let store = EtcdStore::connect(config).await.unwrap();
    let e = store.get(&key("x")).await.unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
}

#[tokio::test]
async fn several_endpoints_skip_a_dead_one() {
    let mut eps = shared_endpoints().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    eps.insert(0, format!("http://127.0.0.1:{port}"));
    let config = EtcdConfig::new(eps).with_prefix(unique_prefix());
    let store = EtcdStore::connect(config).await.unwrap();
    // Some requests may go to the dead endpoint first; a bounded retry must succeed.
    let k = key("multi");
    let mut created = None;
    for _ in 0..50 {
        match store.create(&k, &record("a", 1)).await {
            Ok(v) => {
                created = Some(v);
                break;
            }
            Err(Error::AlreadyExists { .. }) => break,
            Err(e) => assert!(e.is_retryable(), "{e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = created;
    for _ in 0..20 {
        assert!(store.get(&k).await.unwrap().is_some());
    }
}

#[test]
fn debug_output_redacts_credentials() {
    let config = EtcdConfig::new(["https://127.0.0.1:2379"])
        .with_user("app", "hunter2-secret")
        .with_tls(
            TlsConfig::new()
                .with_ca_pem("CA-PEM")
                .with_client_identity_pem("CERT-PEM", "PRIVATE-KEY-PEM"),
        );
    let text = format!("{config:?} {config:#?}");
    assert!(text.contains("app"), "{text}");
    for secret in ["hunter2-secret", "PRIVATE-KEY-PEM"] {
        assert!(!text.contains(secret), "{text}");
    }
}

#[tokio::test]
async fn invalid_configuration_is_rejected() {
    for config in [
        EtcdConfig::new(Vec::<String>::new()),
        EtcdConfig::new(["http://127.0.0.1:1"]).with_prefix(""),
        EtcdConfig::new(["http://127.0.0.1:1"]).with_operation_timeout(Duration::ZERO),
    ] {
        let e = EtcdStore::connect(config).await.unwrap_err();
        let e: Error = e.into();
        assert!(matches!(e, Error::InvalidConfig(_)), "{e:?}");
    }
}

#[test]
#[should_panic(expected = "install the Debian package `etcd-server`")]
fn a_missing_etcd_binary_names_the_package_to_install() {
    let empty = tempfile::tempdir().unwrap();
    common::find_etcd(None, Some(empty.path().as_os_str().to_owned()));
}

#[test]
fn the_fixture_finds_etcd_here() {
    // This machine has etcd installed (scripts/test installs it); the fixture must find it.
    assert!(common::etcd_binary().is_file());
}
