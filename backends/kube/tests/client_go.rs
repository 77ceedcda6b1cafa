//! The Lease spec exactly as client-go's `LeaseLock` writes and reads it
//! (`LeaderElectionRecordToLeaseSpec` / `LeaseSpecToLeaderElectionRecord`): `holderIdentity`,
//! `leaseDurationSeconds`, `acquireTime` and `renewTime` as `MicroTime` (RFC 3339 UTC with six
//! fractional digits), `leaseTransitions`.

use std::time::{Duration, SystemTime};

use futures::StreamExt;
use leasehold::{LeaseKey, LeaseRecord, LeaseStore, Version, WatchEvent};
use leasehold_kube::KubeConfig;
use leasehold_kube::mapping::record_to_spec;
use leasehold_test_support::lease_api as support;
use serde_json::json;
use support::{LeaseApiServer, NAMESPACE, store, store_with};

/// 2026-11-29T20:04:19.123456Z
fn t0() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_micros(1_795_982_659_123_456)
}

fn key(k: &str) -> LeaseKey {
    LeaseKey::new(k).expect("valid key")
}

/// A Lease as kube-apiserver serves one written by client-go (from `kubectl get lease -o json`
/// of a client-go leader-election lock).
fn client_go_lease(name: &str, holder: &str, transitions: i64) -> serde_json::Value {
    json!({
        "holderIdentity": holder,
        "leaseDurationSeconds": 15,
        "acquireTime": "2026-11-29T20:04:19.123456Z",
        "renewTime": "2026-11-29T20:04:21.000001Z",
        "leaseTransitions": transitions,
        "_name": name,
    })
}

#[test]
fn encodes_exactly_like_client_go() {
    let rec = LeaseRecord {
        holder_identity: "node-a_3f2b9c".into(),
        lease_duration: Duration::from_secs(15),
        acquire_time: Some(t0()),
        renew_time: Some(t0() + Duration::from_micros(1_876_545)),
        transitions: 3,
    };
    let spec = serde_json::to_value(record_to_spec(&rec).expect("fits")).expect("json");
    assert_eq!(
        spec,
        json!({
            "holderIdentity": "node-a_3f2b9c",
            "leaseDurationSeconds": 15,
            "acquireTime": "2026-11-29T20:04:19.123456Z",
            "renewTime": "2026-11-29T20:04:21.000001Z",
            "leaseTransitions": 3,
        })
    );
}

#[test]
fn release_is_written_as_client_go_writes_it() {
    // client-go's release: empty holder, lease duration 1 s, transitions kept.
    let rec = LeaseRecord {
        holder_identity: String::new(),
        lease_duration: Duration::from_millis(500),
        acquire_time: Some(t0()),
        renew_time: Some(t0()),
        transitions: 7,
    };
    let spec = serde_json::to_value(record_to_spec(&rec).expect("fits")).expect("json");
    assert_eq!(spec["holderIdentity"], json!(""));
    // Fractional durations round up to whole seconds.
    assert_eq!(spec["leaseDurationSeconds"], json!(1));
    assert_eq!(spec["leaseTransitions"], json!(7));
}

#[tokio::test]
async fn decodes_a_lease_written_by_client_go() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let mut spec = client_go_lease("go-lock", "go-controller-7d9f", 4);
    spec.as_object_mut().expect("object").remove("_name");
    let rv = server.put_raw(NAMESPACE, "go-lock", Some(spec));
    let got = s.get(&key("go-lock")).await.expect("get").expect("exists");
    assert_eq!(got.version, Version::from(rv));
    assert_eq!(
        got.record,
        LeaseRecord {
            holder_identity: "go-controller-7d9f".into(),
            lease_duration: Duration::from_secs(15),
            acquire_time: Some(t0()),
            renew_time: Some(SystemTime::UNIX_EPOCH + Duration::from_micros(1_795_982_661_000_001)),
            transitions: 4,
        }
    );
}

#[tokio::test]
async fn decodes_sparse_specs_as_client_go_does() {
    // client-go reads absent fields as empty/zero, and a zero MicroTime is written as null.
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    server.put_raw(NAMESPACE, "sparse", Some(json!({})));
    server.put_raw(
        NAMESPACE,
        "released",
        Some(json!({"holderIdentity": "", "leaseDurationSeconds": 1, "acquireTime": null, "renewTime": null, "leaseTransitions": 2})),
    );
    let sparse = s
        .get(&key("sparse"))
        .await
        .expect("get")
        .expect("exists")
        .record;
    assert!(sparse.is_vacant());
    assert_eq!(sparse.lease_duration, Duration::ZERO);
    assert_eq!(
        (sparse.acquire_time, sparse.renew_time, sparse.transitions),
        (None, None, 0)
    );
    let released = s
        .get(&key("released"))
        .await
        .expect("get")
        .expect("exists")
        .record;
    assert!(released.is_vacant());
    assert_eq!(released.lease_duration, Duration::from_secs(1));
    assert_eq!(released.transitions, 2);
}

#[tokio::test]
async fn stored_lease_is_what_client_go_would_store() {
    let server = LeaseApiServer::start().await;
    let s = store_with(
        &server,
        Some(support::ADMIN_TOKEN),
        support::test_config().with_label("app.kubernetes.io/managed-by", "leasehold"),
    );
    let rec = LeaseRecord {
        holder_identity: "node-b".into(),
        lease_duration: Duration::from_secs(60),
        acquire_time: Some(t0()),
        renew_time: Some(t0()),
        transitions: 1,
    };
    let v = s
        .create(&key("k0s-ctrl-node-b"), &rec)
        .await
        .expect("create");
    let raw = server
        .get_raw(NAMESPACE, "k0s-ctrl-node-b")
        .expect("stored");
    assert_eq!(raw["kind"], json!("Lease"));
    assert_eq!(raw["apiVersion"], json!("coordination.k8s.io/v1"));
    assert_eq!(raw["metadata"]["resourceVersion"], json!(v.as_str()));
    assert_eq!(
        raw["metadata"]["labels"],
        json!({"app.kubernetes.io/managed-by": "leasehold"})
    );
    assert_eq!(
        raw["spec"],
        json!({
            "holderIdentity": "node-b",
            "leaseDurationSeconds": 60,
            "acquireTime": "2026-11-29T20:04:19.123456Z",
            "renewTime": "2026-11-29T20:04:19.123456Z",
            "leaseTransitions": 1,
        })
    );
}

/// An update keeps metadata and spec fields someone else set (as client-go's get-then-update
/// does), when the store has seen the Lease at the expected version.
#[tokio::test]
async fn update_keeps_foreign_metadata_and_spec_fields() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("shared-lock");
    let admin = server.client();
    let api: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(admin, NAMESPACE);
    let lease: k8s_openapi::api::coordination::v1::Lease = serde_json::from_value(json!({
        "metadata": {"name": "shared-lock", "labels": {"team": "infra"}, "annotations": {"note": "keep"}},
        "spec": {"holderIdentity": "go", "leaseDurationSeconds": 15, "leaseTransitions": 0, "preferredHolder": "node-z", "strategy": "OldestEmulationVersion"},
    }))
    .expect("lease");
    api.create(&Default::default(), &lease)
        .await
        .expect("create via kube");
    let current = s.get(&k).await.expect("get").expect("exists");
    let rec = LeaseRecord {
        holder_identity: "rust".into(),
        transitions: 1,
        ..current.record.clone()
    };
    s.update(&k, &rec, &current.version).await.expect("update");
    let raw = server.get_raw(NAMESPACE, "shared-lock").expect("stored");
    assert_eq!(raw["metadata"]["labels"], json!({"team": "infra"}));
    assert_eq!(raw["metadata"]["annotations"], json!({"note": "keep"}));
    assert_eq!(raw["spec"]["preferredHolder"], json!("node-z"));
    assert_eq!(raw["spec"]["holderIdentity"], json!("rust"));
    assert_eq!(raw["spec"]["leaseTransitions"], json!(1));
}

/// A client-go writer and a leasehold store contend for the same Lease: each sees the other's
/// writes, and compare-and-swap holds across them.
#[tokio::test]
async fn a_client_go_writer_and_the_store_see_each_other() {
    let server = LeaseApiServer::start().await;
    let s = store_with(
        &server,
        Some(support::ADMIN_TOKEN),
        KubeConfig::new().with_namespace(NAMESPACE),
    );
    let k = key("contended");
    let mut spec = client_go_lease("contended", "go-controller", 0);
    spec.as_object_mut().expect("object").remove("_name");
    let rv = server.put_raw(NAMESPACE, "contended", Some(spec));
    let mut watch = s.watch(&k, None).await.expect("watch");
    match watch.next().await {
        Some(Ok(WatchEvent::Put(v))) => {
            assert_eq!(v.record.holder_identity, "go-controller");
            assert_eq!(v.version, Version::from(rv));
        }
        other => panic!("expected the current state, got {other:?}"),
    }
    // client-go renews (a foreign PUT): the store's watch sees it, and a write at the old
    // version conflicts.
    let mut renewed = client_go_lease("contended", "go-controller", 0);
    renewed["renewTime"] = json!("2026-11-29T20:04:23.500000Z");
    renewed.as_object_mut().expect("object").remove("_name");
    let rv2 = server.put_raw(NAMESPACE, "contended", Some(renewed));
    match watch.next().await {
        Some(Ok(WatchEvent::Put(v))) => assert_eq!(v.version, Version::from(rv2)),
        other => panic!("expected the renewal, got {other:?}"),
    }
    let takeover = LeaseRecord {
        holder_identity: "rust-node".into(),
        lease_duration: Duration::from_secs(15),
        acquire_time: Some(SystemTime::now()),
        renew_time: Some(SystemTime::now()),
        transitions: 1,
    };
    assert!(matches!(
        s.update(&k, &takeover, &Version::from(rv)).await,
        Err(leasehold::Error::Conflict { .. })
    ));
    let v3 = s
        .update(&k, &takeover, &Version::from(rv2))
        .await
        .expect("take over");
    match watch.next().await {
        Some(Ok(WatchEvent::Put(v))) => {
            assert_eq!(v.version, v3);
            assert_eq!(v.record.holder_identity, "rust-node");
        }
        other => panic!("expected the takeover, got {other:?}"),
    }
    let raw = server.get_raw(NAMESPACE, "contended").expect("stored");
    assert_eq!(raw["spec"]["holderIdentity"], json!("rust-node"));
    assert_eq!(raw["spec"]["leaseTransitions"], json!(1));
}
