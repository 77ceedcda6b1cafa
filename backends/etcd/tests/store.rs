//! Store-level tests against a real etcd (one server per test binary, see `common`).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use common::{record, shared_endpoints, shared_store, unique_prefix};
use futures::StreamExt;
use leasehold::{Error, KeyPrefix, LeaseKey, LeaseStore, Version, WatchEvent, WatchStream};
use leasehold_etcd::{EtcdConfig, EtcdStore, TlsConfig, revision};
use leasehold_test_support::etcd as common;

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
async fn a_hung_server_fails_connect_naming_the_endpoint() {
    // Accepts TCP connections (backlog) but never speaks HTTP/2.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let config = EtcdConfig::new([format!("http://{addr}")])
        .with_operation_timeout(Duration::from_millis(500))
        .with_connect_timeout(Duration::from_millis(500));
    let e = EtcdStore::connect(config).await.unwrap_err();
    println!("{e}");
    match &e {
        leasehold_etcd::Error::Connect(Error::Unavailable { message, .. }) => {
            assert!(message.contains(&format!("http://{addr}")), "{message}");
        }
        other => panic!("expected Connect(Unavailable), got {other:?}"),
    }
    drop(listener);
}

#[tokio::test]
async fn a_server_that_hangs_after_connect_gives_typed_timeouts() {
    let eps = shared_endpoints().await;
    let target: std::net::SocketAddr = eps[0]
        .trim_start_matches("http://")
        .parse()
        .expect("the shared endpoint is http://<ip>:<port>");
    let proxy = FreezingProxy::start(target).await;
    let config = EtcdConfig::new([format!("http://{}", proxy.addr)])
        .with_prefix(unique_prefix())
        .with_operation_timeout(Duration::from_millis(500));
    let store = EtcdStore::connect(config).await.unwrap();
    proxy.freeze();
    let k = key("hung");
    for result in [
        store.get(&k).await.map(|_| ()),
        store.create(&k, &record("a", 1)).await.map(|_| ()),
        store.watch(&k, None).await.map(|_| ()),
    ] {
        let e = result.unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        assert!(e.is_retryable(), "{e:?}");
    }
}

/// The port of a loopback listener that was closed again: nothing listens there.
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn connect_to_a_wrong_port_fails_naming_the_endpoint() {
    let endpoint = format!("http://127.0.0.1:{}", closed_port());
    let config =
        EtcdConfig::new([endpoint.clone()]).with_operation_timeout(Duration::from_millis(500));
    let e = EtcdStore::connect(config).await.unwrap_err();
    println!("{e}");
    match &e {
        leasehold_etcd::Error::Connect(Error::Unavailable { message, .. }) => {
            assert!(message.contains(&endpoint), "{message}");
        }
        other => panic!("expected Connect(Unavailable), got {other:?}"),
    }
    assert!(leasehold::Error::from(e).is_retryable());
}

#[tokio::test]
async fn an_endpoint_that_goes_away_is_unavailable_naming_it() {
    let eps = shared_endpoints().await;
    let target: std::net::SocketAddr = eps[0]
        .trim_start_matches("http://")
        .parse()
        .expect("the shared endpoint is http://<ip>:<port>");
    let proxy = FreezingProxy::start(target).await;
    let endpoint = format!("http://{}", proxy.addr);
    let config = EtcdConfig::new([endpoint.clone()])
        .with_prefix(unique_prefix())
        .with_operation_timeout(Duration::from_secs(2));
    let store = EtcdStore::connect(config).await.unwrap();
    drop(proxy);
    // The proxy no longer listens and its connections are closed.
    let mut last = None;
    for _ in 0..20 {
        match store.get(&key("gone")).await {
            Err(e @ Error::Unavailable { .. }) => {
                last = Some(e);
                break;
            }
            Err(e) => {
                assert!(e.is_retryable(), "{e:?}");
                last = Some(e);
            }
            Ok(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let e = last.expect("an error once the endpoint is gone");
    println!("{e}");
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
    assert!(e.to_string().contains(&endpoint), "{e}");
}

/// A TCP proxy to `target` that relays until [`freeze`](Self::freeze), then holds every
/// connection open without relaying anything (a hung server). Dropping it closes everything.
struct FreezingProxy {
    addr: std::net::SocketAddr,
    frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl FreezingProxy {
    async fn start(target: std::net::SocketAddr) -> Self {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let frozen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (flag, list) = (frozen.clone(), conns.clone());
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let (ir, iw) = inbound.into_split();
                let (or, ow) = outbound.into_split();
                for (mut from, mut to) in [
                    (
                        Box::new(ir) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                        Box::new(ow) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                    ),
                    (Box::new(or) as _, Box::new(iw) as _),
                ] {
                    let flag = flag.clone();
                    let h = tokio::spawn(async move {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match from.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            while flag.load(Ordering::SeqCst) {
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            if to.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                    list.lock().unwrap().push(h.abort_handle());
                }
            }
        });
        FreezingProxy {
            addr,
            frozen,
            task,
            conns,
        }
    }

    fn freeze(&self) {
        self.frozen.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for FreezingProxy {
    fn drop(&mut self) {
        self.task.abort();
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
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

/// A client-go style record with the given times, as raw JSON.
fn json_with_times(acquire: &str, renew: &str) -> String {
    format!(
        "{{\"holderIdentity\":\"a\",\"leaseDurationSeconds\":15,\"acquireTime\":\"{acquire}\",\"renewTime\":\"{renew}\",\"leaderTransitions\":2}}"
    )
}

#[tokio::test]
async fn get_reads_times_with_utc_offsets_as_the_instant_they_name() {
    let store = shared_store().await;
    let mut kv = store.client().kv_client();
    // 2026-11-29T20:04:19.123456Z, and the same instant with offsets of both signs.
    let instant = std::time::SystemTime::UNIX_EPOCH + Duration::from_micros(1_795_982_659_123_456);
    let whole = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_982_659);
    for (name, text, expected) in [
        ("utc", "2026-11-29T20:04:19.123456Z", instant),
        ("plus-frac", "2026-11-29T22:04:19.123456+02:00", instant),
        ("minus-frac", "2026-11-29T15:04:19.123456-05:00", instant),
        ("plus-whole", "2026-11-29T22:04:19+02:00", whole),
        ("minus-whole", "2026-11-29T15:04:19-05:00", whole),
    ] {
        let k = key(name);
        kv.put(store.etcd_key(&k), json_with_times(text, text), None)
            .await
            .unwrap();
        let got = store.get(&k).await.unwrap().unwrap().record;
        assert_eq!(got.acquire_time, Some(expected), "{text}");
        assert_eq!(got.renew_time, Some(expected), "{text}");
        assert_eq!(got.transitions, 2);
    }
    // An out-of-range time is corrupt data, not a panic.
    let k = key("far-future");
    kv.put(
        store.etcd_key(&k),
        json_with_times("2026-11-29T20:04:19Z", "99999-01-01T00:00:00Z"),
        None,
    )
    .await
    .unwrap();
    assert!(matches!(store.get(&k).await, Err(Error::Corrupt { .. })));
}

#[tokio::test]
async fn acquisition_revision_restarts_after_delete_and_recreate() {
    let store = shared_store().await;
    let k = key("recreated");
    let v1 = store.create(&k, &record("a", 1)).await.unwrap();
    let v2 = store.update(&k, &record("a", 1), &v1).await.unwrap();
    assert_eq!(store.acquisition_revision(&k, 1), revision(&v1));
    store.delete(&k, &v2).await.unwrap();
    assert_eq!(store.acquisition_revision(&k, 1), None);

    // Recreated with the same transitions: a new term, acquired by the new write.
    let v3 = store.create(&k, &record("b", 1)).await.unwrap();
    assert_eq!(store.acquisition_revision(&k, 1), revision(&v3));
    let v4 = store.update(&k, &record("b", 1), &v3).await.unwrap();
    assert_eq!(store.acquisition_revision(&k, 1), revision(&v3));

    // Someone else (another process) deletes and recreates it; an update of their record
    // with the same transitions is a new term too, not a renewal of ours.
    let other = EtcdStore::connect(
        EtcdConfig::new(shared_endpoints().await).with_prefix(store.prefix().to_owned()),
    )
    .await
    .unwrap();
    other.delete(&k, &v4).await.unwrap();
    let v5 = other.create(&k, &record("c", 1)).await.unwrap();
    let v6 = store.update(&k, &record("b", 1), &v5).await.unwrap();
    assert_eq!(store.acquisition_revision(&k, 1), revision(&v6));
    assert!(revision(&v6) > revision(&v3));
}

#[tokio::test]
async fn prefixes_without_a_trailing_separator_do_not_overlap() {
    let eps = shared_endpoints().await;
    for (a, b, a_key) in [
        // Without a separator, `/app` + `x-k` and `/appx-` + `k` were the same etcd key.
        ("/app", "/appx-", "x-k"),
        ("/app", "/app-x", "x-k"),
        ("/app", "/app1", "1k"),
    ] {
        // A fresh namespace per case, on the shared server.
        let base = unique_prefix();
        let base = base.trim_end_matches('/');
        let (a, b) = (format!("{base}{a}"), format!("{base}{b}"));
        let connect =
            |p: String| EtcdStore::connect(EtcdConfig::new(eps.clone()).with_prefix(p.clone()));
        let sa = connect(a.clone()).await.unwrap();
        let sb = connect(b.clone()).await.unwrap();
        assert!(sa.prefix().ends_with('/') && sb.prefix().ends_with('/'));
        let (ka, kb) = (key(a_key), key("k"));
        let mut wa = sa.watch(&ka, None).await.unwrap();

        // b writes its key; a sees nothing of it, under any operation.
        let vb = sb.create(&kb, &record("b", 1)).await.unwrap();
        assert!(sa.get(&ka).await.unwrap().is_none(), "{a} sees {b}");
        assert!(
            sa.list(&KeyPrefix::new("").unwrap())
                .await
                .unwrap()
                .is_empty(),
            "{a} lists {b}'s keys"
        );
        // a's own write is the first thing its watch delivers.
        let va = sa.create(&ka, &record("a", 1)).await.unwrap();
        assert_eq!(put_version(&next(&mut wa).await), va);
        // And b does not see a's key either.
        assert_eq!(sb.get(&kb).await.unwrap().unwrap().version, vb);
        let listed = sb.list(&KeyPrefix::new("").unwrap()).await.unwrap();
        assert_eq!(listed.len(), 1, "{b} lists {a}'s keys: {listed:?}");
    }
}

#[tokio::test]
async fn the_fencing_seed_exceeds_every_revision_seen() {
    let store = shared_store().await;
    let (k, elsewhere) = (key("seeded"), key("elsewhere"));
    let mut seen = Vec::new();
    let seed0 = store.fencing_seed(&k).await.unwrap();
    let v1 = store.create(&k, &record("a", 1)).await.unwrap();
    let v2 = store.update(&k, &record("a", 2), &v1).await.unwrap();
    seen.extend([revision(&v1).unwrap(), revision(&v2).unwrap()]);
    assert!(
        seed0 <= revision(&v1).unwrap() as u64,
        "the seed is not ahead of writes"
    );
    store.delete(&k, &v2).await.unwrap();
    let mut v = store.create(&elsewhere, &record("x", 1)).await.unwrap();
    seen.push(revision(&v).unwrap());
    for i in 2..5 {
        v = store.update(&elsewhere, &record("x", i), &v).await.unwrap();
        seen.push(revision(&v).unwrap());
    }
    let seed = store.fencing_seed(&k).await.unwrap();
    for rev in &seen {
        assert!(seed > *rev as u64, "seed {seed} <= mod_revision {rev}");
    }
    // It never goes backwards, and grows with every write.
    assert!(store.fencing_seed(&k).await.unwrap() >= seed);
    let v1 = store.create(&k, &record("b", seed)).await.unwrap();
    assert!(store.fencing_seed(&k).await.unwrap() > revision(&v1).unwrap() as u64);
}

/// A TCP proxy to `target` that cuts every connection `after` it was accepted, and counts the
/// connections it accepted.
struct CuttingProxy {
    addr: std::net::SocketAddr,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl CuttingProxy {
    async fn start(target: std::net::SocketAddr, after: Duration) -> Self {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    let relay = tokio::io::copy_bidirectional(&mut inbound, &mut outbound);
                    // Dropping both sockets when the time is up cuts the connection.
                    let _ = tokio::time::timeout(after, relay).await;
                });
            }
        });
        CuttingProxy {
            addr,
            accepted,
            task,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn a_watch_whose_streams_end_at_once_reopens_with_backoff() {
    let eps = shared_endpoints().await;
    let target: std::net::SocketAddr = eps[0]
        .trim_start_matches("http://")
        .parse()
        .expect("the shared endpoint is http://<ip>:<port>");
    // Every connection through the proxy (and so every watch stream on it) ends soon after
    // it was opened, having delivered nothing: the condition that made the old code reopen
    // in a tight loop.
    let proxy = CuttingProxy::start(target, Duration::from_millis(150)).await;
    let prefix = unique_prefix();
    let direct = EtcdStore::connect(EtcdConfig::new(eps).with_prefix(prefix.clone()))
        .await
        .unwrap();
    let k = key("cut");
    let v = direct.create(&k, &record("a", 1)).await.unwrap();
    let via = EtcdStore::connect(
        EtcdConfig::new([format!("http://{}", proxy.addr)])
            .with_prefix(prefix)
            .with_operation_timeout(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let mut w = via.watch(&k, Some(&v)).await.unwrap();
    // Consume the stream (reopen failures arrive as retryable errors; nothing else may).
    let consumer = tokio::spawn(async move {
        while let Some(item) = w.next().await {
            if let Err(e) = item {
                assert!(e.is_retryable(), "{e:?}");
            }
        }
    });
    let before = proxy.accepted();
    // Count reopen attempts over a window: without backoff every cut is followed by a new
    // connection at once (about 40 in 6 s); with it the waits grow to 2 s (about 10).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let reopened = proxy.accepted() - before;
    assert!(!consumer.is_finished(), "the watch stream ended");
    consumer.abort();
    eprintln!("{reopened} connections through the cutting proxy in the window");
    assert!(
        reopened >= 2,
        "the proxy did not cut the watch ({reopened})"
    );
    assert!(
        reopened <= 20,
        "{reopened} reopen attempts: the watch reopens without backing off"
    );
}

#[tokio::test]
async fn the_store_reports_its_operation_timeout_and_the_elector_checks_it() {
    let s = common::shared_store_with(Duration::from_millis(700)).await;
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
