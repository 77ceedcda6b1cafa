//! One test per error mapping: each provokes the HTTP answer from the test Lease API server and
//! checks the typed `leasehold::Error` the store turns it into.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use leasehold::{Error, LeaseKey, LeaseRecord, LeaseStore, Version, WatchEvent};
use leasehold_kube::{KubeConfig, KubeStore};
use leasehold_test_support::lease_api as support;
use serde_json::json;
use support::{LeaseApiServer, NAMESPACE, store, store_with, test_config};

fn key(k: &str) -> LeaseKey {
    LeaseKey::new(k).expect("valid key")
}

fn record(holder: &str) -> LeaseRecord {
    let now = SystemTime::now();
    LeaseRecord {
        holder_identity: holder.into(),
        lease_duration: Duration::from_secs(15),
        acquire_time: Some(now),
        renew_time: Some(now),
        transitions: 1,
    }
}

#[tokio::test]
async fn http_409_conflict_on_update_is_conflict() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("conflict");
    let v1 = s.create(&k, &record("a")).await.expect("create");
    let _v2 = s.update(&k, &record("b"), &v1).await.expect("update");
    match s.update(&k, &record("c"), &v1).await {
        Err(Error::Conflict { key, expected }) => {
            assert_eq!(key, "conflict");
            assert_eq!(expected, v1);
        }
        other => panic!("expected Conflict, got {other:?}"),
    }
}

#[tokio::test]
async fn http_409_conflict_on_delete_precondition_is_conflict() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("conflict-delete");
    let v1 = s.create(&k, &record("a")).await.expect("create");
    let v2 = s.update(&k, &record("b"), &v1).await.expect("update");
    assert!(matches!(
        s.delete(&k, &v1).await,
        Err(Error::Conflict { .. })
    ));
    s.delete(&k, &v2)
        .await
        .expect("delete at the current version");
    assert!(s.get(&k).await.expect("get").is_none());
}

#[tokio::test]
async fn http_409_already_exists_on_create_is_already_exists() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("exists");
    s.create(&k, &record("a")).await.expect("create");
    match s.create(&k, &record("b")).await {
        Err(Error::AlreadyExists { key }) => assert_eq!(key, "exists"),
        other => panic!("expected AlreadyExists, got {other:?}"),
    }
}

#[tokio::test]
async fn http_404_is_none_on_get_and_not_found_on_update_and_delete() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("missing");
    assert_eq!(s.get(&k).await.expect("get"), None);
    let v = Version::new("12345");
    assert!(matches!(
        s.update(&k, &record("a"), &v).await,
        Err(Error::NotFound { key }) if key == "missing"
    ));
    assert!(matches!(
        s.delete(&k, &v).await,
        Err(Error::NotFound { key }) if key == "missing"
    ));
}

#[tokio::test]
async fn http_401_is_unauthenticated() {
    let server = LeaseApiServer::start().await;
    for token in [Some("not-a-known-token"), None] {
        let s = store_with(&server, token, test_config());
        match s.get(&key("auth")).await {
            Err(e @ Error::Unauthenticated { .. }) => {
                assert!(!e.is_retryable());
                assert!(e.to_string().contains("Unauthorized"), "{e}");
            }
            other => panic!("expected Unauthenticated for token {token:?}, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn http_401_message_never_contains_the_token() {
    let server = LeaseApiServer::start().await;
    let secret = "super-secret-token-value";
    let s = store_with(&server, Some(secret), test_config());
    let err = s.get(&key("auth")).await.expect_err("unknown token");
    assert!(!format!("{err} {err:?}").contains(secret));
    assert!(!format!("{s:?}").contains(secret));
}

/// For every operation: a token without that one RBAC verb gets 403, which the store reports as
/// PermissionDenied naming the verb, the resource and the namespace.
#[tokio::test]
async fn http_403_is_permission_denied_naming_the_missing_verb() {
    let server = LeaseApiServer::start().await;
    let admin = store(&server);
    let k = key("rbac");
    let v = admin.create(&k, &record("a")).await.expect("create");
    let all = ["get", "list", "watch", "create", "update", "delete"];
    for missing in all {
        let verbs: Vec<&str> = all.iter().copied().filter(|v| *v != missing).collect();
        let token = format!("token-without-{missing}");
        server.add_token(
            &token,
            &format!("system:serviceaccount:{NAMESPACE}:no-{missing}"),
            &verbs,
        );
        let s = store_with(&server, Some(&token), test_config());
        let other = key("rbac-other");
        let result = match missing {
            "get" => s.get(&k).await.map(|_| ()),
            "list" => s
                .list(&leasehold::KeyPrefix::new("rbac").expect("prefix"))
                .await
                .map(|_| ()),
            // A watch from None lists first (list verb) and then watches.
            "watch" => s.watch(&k, Some(&v)).await.map(|_| ()),
            "create" => s.create(&other, &record("b")).await.map(|_| ()),
            "update" => s.update(&k, &record("b"), &v).await.map(|_| ()),
            _ => s.delete(&k, &v).await,
        };
        match result {
            Err(e @ Error::PermissionDenied { .. }) => {
                let text = e.to_string();
                let want = format!(
                    "missing RBAC permission: {missing} leases.coordination.k8s.io in namespace {NAMESPACE}"
                );
                assert!(text.contains(&want), "{text:?} should contain {want:?}");
                assert!(!e.is_retryable());
            }
            other => panic!("expected PermissionDenied without {missing}, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn http_422_is_invalid_with_the_server_message() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    // kube-apiserver's Lease validation rejects leaseDurationSeconds <= 0.
    let rec = LeaseRecord {
        lease_duration: Duration::ZERO,
        ..record("a")
    };
    match s.create(&key("zero"), &rec).await {
        Err(e @ Error::Invalid { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains(r#"Lease.coordination.k8s.io "zero" is invalid: spec.leaseDurationSeconds: Invalid value: 0: must be greater than 0"#),
                "{text}"
            );
            assert!(!e.is_retryable());
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[tokio::test]
async fn http_500_is_retryable_unavailable() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    server.fail_next(1, 500);
    match s.get(&key("flaky")).await {
        Err(e @ Error::Unavailable { .. }) => {
            assert!(e.is_retryable());
            assert!(e.to_string().contains("HTTP 500"), "{e}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // The next request goes through again.
    assert_eq!(s.get(&key("flaky")).await.expect("get"), None);
}

/// kube-rs itself retries 429/503/504 with backoff (inside the store's operation timeout); a
/// server that keeps answering 503 ends as a retryable error.
#[tokio::test]
async fn http_503_is_retryable() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    server.fail_next(1000, 503);
    let err = s.get(&key("busy")).await.expect_err("server busy");
    assert!(
        matches!(err, Error::Unavailable { .. } | Error::Timeout { .. }),
        "{err:?}"
    );
    assert!(err.is_retryable());
    server.fail_next(0, 503);
    assert_eq!(s.get(&key("busy")).await.expect("get"), None);
}

#[tokio::test]
async fn dropped_connection_is_retryable() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    server.drop_next(1);
    let err = s
        .get(&key("dropped"))
        .await
        .expect_err("connection dropped");
    assert!(err.is_retryable(), "{err:?}");
    assert_eq!(s.get(&key("dropped")).await.expect("get"), None);
}

#[tokio::test]
async fn unreachable_server_is_retryable_unavailable() {
    let server = LeaseApiServer::start().await;
    let client = server.client();
    drop(server); // nothing listens on the port any more
    let s = KubeStore::new(client, test_config()).expect("store");
    let err = s.get(&key("nobody")).await.expect_err("no server");
    assert!(err.is_retryable(), "{err:?}");
}

#[tokio::test]
async fn connect_probes_the_server_and_names_it_when_unreachable() {
    let server = LeaseApiServer::start().await;
    // Reachable, with the admin token: connected.
    let s = KubeStore::connect_with(
        server.client_config(Some(support::ADMIN_TOKEN)),
        test_config(),
    )
    .await
    .expect("connect");
    assert_eq!(s.namespace(), support::NAMESPACE);
    let url = server.url();
    let client_config = server.client_config(Some(support::ADMIN_TOKEN));
    drop(server); // nothing listens on the port any more
    // Operations of a connected store name the server too.
    let err = s.get(&key("gone")).await.expect_err("no server");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains(&format!("(Kubernetes API server at {url})")),
        "{err}"
    );
    let err = KubeStore::connect_with(client_config, test_config())
        .await
        .expect_err("no server");
    println!("{err}");
    match &err {
        leasehold_kube::Error::Connect(Error::Unavailable { message, .. }) => {
            assert!(
                message.contains(&format!("Kubernetes API server at {url}")),
                "{message}"
            );
        }
        other => panic!("expected Connect(Unavailable), got {other:?}"),
    }
    assert!(Error::from(err).is_retryable());
}

#[tokio::test]
async fn connect_to_a_hung_server_fails_naming_it() {
    let server = LeaseApiServer::start().await;
    server.set_delay(Duration::from_secs(5));
    let config = test_config()
        .with_operation_timeout(Duration::from_millis(200))
        .with_connect_timeout(Duration::from_millis(200));
    let err = KubeStore::connect_with(server.client_config(Some(support::ADMIN_TOKEN)), config)
        .await
        .expect_err("hung server");
    println!("{err}");
    match &err {
        leasehold_kube::Error::Connect(Error::Unavailable { message, .. }) => {
            assert!(message.contains(&server.url()), "{message}");
            assert!(message.contains("no answer"), "{message}");
        }
        other => panic!("expected Connect(Unavailable), got {other:?}"),
    }
    server.set_delay(Duration::ZERO);
}

#[tokio::test]
async fn connect_without_the_list_verb_is_permission_denied_naming_it() {
    let server = LeaseApiServer::start().await;
    server.add_token(
        "no-list",
        "no-list-user",
        &["get", "create", "update", "watch"],
    );
    let err = KubeStore::connect_with(server.client_config(Some("no-list")), test_config())
        .await
        .expect_err("no list permission");
    println!("{err}");
    match &err {
        leasehold_kube::Error::Connect(Error::PermissionDenied { message, .. }) => {
            assert!(
                message.contains("missing RBAC permission: list leases.coordination.k8s.io"),
                "{message}"
            );
            assert!(message.contains(support::NAMESPACE), "{message}");
        }
        other => panic!("expected Connect(PermissionDenied), got {other:?}"),
    }
    // No token at all: the credentials are refused at connect.
    let err = KubeStore::connect_with(server.client_config(None), test_config())
        .await
        .expect_err("no credentials");
    assert!(
        matches!(
            err,
            leasehold_kube::Error::Connect(Error::Unauthenticated { .. })
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn the_store_reports_its_operation_timeout_and_the_elector_checks_it() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let timeout = test_config().operation_timeout();
    assert_eq!(s.capabilities().operation_timeout, Some(timeout));
    let config = leasehold::ElectorConfig::new(key("timed"), "a").with_timings(
        Duration::from_secs(2),
        timeout,
        Duration::from_millis(100),
    );
    let err = leasehold::Elector::spawn(Arc::new(s), config).expect_err("renew deadline too short");
    assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
}

#[tokio::test]
async fn an_update_is_bounded_as_a_whole() {
    // An update the store has not seen the version of makes a GET and then a PUT; each alone
    // fits the operation timeout, both together do not.
    let server = LeaseApiServer::start().await;
    let writer = store(&server);
    let k = key("bounded");
    let v = writer.create(&k, &record("a")).await.expect("create");
    let config = test_config().with_operation_timeout(Duration::from_millis(600));
    let s = store_with(&server, Some(support::ADMIN_TOKEN), config);
    server.set_delay(Duration::from_millis(400));
    match s.update(&k, &record("b"), &v).await {
        Err(e @ Error::Timeout { .. }) => {
            assert!(
                e.to_string().contains("update timed out after 600ms"),
                "{e}"
            );
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    server.set_delay(Duration::ZERO);
}

#[tokio::test]
async fn hung_server_times_out() {
    let server = LeaseApiServer::start().await;
    let config = test_config().with_operation_timeout(Duration::from_millis(200));
    let s = store_with(&server, Some(support::ADMIN_TOKEN), config);
    server.set_delay(Duration::from_secs(5));
    match s.get(&key("slow")).await {
        Err(e @ Error::Timeout { .. }) => {
            assert!(e.is_retryable());
            assert!(e.to_string().contains("get timed out after 200ms"), "{e}");
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    server.set_delay(Duration::ZERO);
}

#[tokio::test]
async fn malformed_lease_specs_are_corrupt_with_key_and_version() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let cases = [
        (
            "negative-duration",
            Some(json!({"holderIdentity": "a", "leaseDurationSeconds": -5})),
        ),
        (
            "negative-transitions",
            Some(json!({"holderIdentity": "a", "leaseDurationSeconds": 5, "leaseTransitions": -1})),
        ),
        (
            "bad-time",
            Some(
                json!({"holderIdentity": "a", "leaseDurationSeconds": 5, "renewTime": "yesterday"}),
            ),
        ),
        ("wrong-type", Some(json!({"holderIdentity": 7}))),
    ];
    for (name, spec) in cases {
        let rv = server.put_raw(NAMESPACE, name, spec);
        match s.get(&key(name)).await {
            Err(Error::Corrupt {
                key,
                version,
                reason,
            }) => {
                assert_eq!(key, name);
                assert_eq!(version, Some(Version::from(rv)), "{reason}");
            }
            other => panic!("expected Corrupt for {name}, got {other:?}"),
        }
    }
    // list leaves them out; the watch reports them as Corrupt events.
    let listed = s
        .list(&leasehold::KeyPrefix::new("").expect("prefix"))
        .await
        .expect("list");
    assert!(listed.is_empty(), "{listed:?}");
    let mut w = s.watch(&key("bad-time"), None).await.expect("watch");
    use futures::StreamExt;
    match w.next().await {
        Some(Ok(WatchEvent::Corrupt { version, .. })) => assert!(version.is_some()),
        other => panic!("expected a Corrupt event, got {other:?}"),
    }
    // A corrupt Lease can be replaced by compare-and-swap at its version.
    let Err(Error::Corrupt {
        version: Some(v), ..
    }) = s.get(&key("negative-duration")).await
    else {
        panic!("still corrupt");
    };
    s.update(&key("negative-duration"), &record("fixed"), &v)
        .await
        .expect("replace corrupt data");
    let fixed = s
        .get(&key("negative-duration"))
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(fixed.record.holder_identity, "fixed");
}

#[tokio::test]
async fn records_that_do_not_fit_a_lease_are_invalid_before_any_request() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let before = server.requests();
    let rec = LeaseRecord {
        transitions: u64::from(u32::MAX),
        ..record("a")
    };
    assert!(matches!(
        s.create(&key("huge"), &rec).await,
        Err(Error::Invalid { .. })
    ));
    assert_eq!(server.requests(), before);
}

#[tokio::test]
async fn invalid_configuration_is_rejected() {
    let server = LeaseApiServer::start().await;
    for config in [
        KubeConfig::new().with_operation_timeout(Duration::ZERO),
        KubeConfig::new().with_watch_timeout(Duration::from_secs(1000)),
        KubeConfig::new().with_namespace(""),
    ] {
        let err = KubeStore::new(server.client(), config).expect_err("invalid");
        assert!(matches!(
            leasehold::Error::from(err),
            Error::InvalidConfig(_)
        ));
    }
}

/// A namespace goes into every request path, so it must be an RFC 1123 label; the error names
/// the rule, at construction, before any request.
#[tokio::test]
async fn namespaces_that_are_not_rfc_1123_labels_are_rejected_at_construction() {
    let server = LeaseApiServer::start().await;
    let long = "a".repeat(64);
    let cases = [
        ("", "must not be empty"),
        (long.as_str(), "at most 63 characters"),
        ("Kube-System", "may only contain lower-case letters"),
        ("a/b", "may only contain lower-case letters"),
        ("a.b", "may only contain lower-case letters"),
        ("ns%2F..", "may only contain lower-case letters"),
        (
            "-ns",
            "must start and end with a lower-case letter or digit",
        ),
        (
            "ns-",
            "must start and end with a lower-case letter or digit",
        ),
    ];
    let before = server.requests();
    for (ns, rule) in cases {
        let err = KubeStore::new(server.client(), KubeConfig::new().with_namespace(ns))
            .expect_err("invalid namespace");
        match &err {
            leasehold_kube::Error::InvalidNamespace { namespace, rule: r } => {
                assert_eq!(namespace, ns);
                assert!(r.contains(rule), "{r:?} should contain {rule:?}");
            }
            other => panic!("expected InvalidNamespace for {ns:?}, got {other:?}"),
        }
        assert!(matches!(Error::from(err), Error::InvalidConfig(m) if m.contains(rule)));
    }
    for ok in ["a", "leasehold-test", "0", &"a".repeat(63)] {
        KubeStore::new(server.client(), KubeConfig::new().with_namespace(ok))
            .expect("a valid namespace");
    }
    // The client's default namespace is checked too.
    let mut config = kube::Config::new(server.url().parse().expect("url"));
    config.default_namespace = "Not_A_Label".into();
    let client = kube::Client::try_from(config).expect("client");
    assert!(matches!(
        KubeStore::new(client, KubeConfig::new()),
        Err(leasehold_kube::Error::InvalidNamespace { .. })
    ));
    assert_eq!(server.requests(), before);
}

/// client-go reads a Lease without a spec as an empty record: vacant, not corrupt.
#[tokio::test]
async fn a_lease_without_spec_reads_as_vacant() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let rv = server.put_raw(NAMESPACE, "no-spec", None);
    let got = s
        .get(&key("no-spec"))
        .await
        .expect("not corrupt")
        .expect("exists");
    assert!(got.record.is_vacant());
    assert_eq!(got.record.transitions, 0);
    assert_eq!(got.version, Version::from(rv));
    let listed = s
        .list(&leasehold::KeyPrefix::new("no-").expect("prefix"))
        .await
        .expect("list");
    assert_eq!(listed.len(), 1);
    use futures::StreamExt;
    let mut w = s.watch(&key("no-spec"), None).await.expect("watch");
    match w.next().await {
        Some(Ok(WatchEvent::Put(v))) => assert!(v.record.is_vacant()),
        other => panic!("expected a vacant Put, got {other:?}"),
    }
    // It can be acquired at its version.
    s.update(&key("no-spec"), &record("a"), &got.version)
        .await
        .expect("acquire a spec-less Lease");
}
