//! Fidelity of the test Lease API server: the JSON a plain kube client gets back matches what
//! kube-apiserver answers (Status bodies with apimachinery's wording, watch events, bookmarks,
//! 410 Expired).

mod support;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, PostParams, WatchEvent, WatchParams};
use serde_json::json;
use support::{LeaseApiServer, NAMESPACE, ServerOptions};

fn lease(name: &str) -> Lease {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "leaseTransitions": 0},
    }))
    .expect("lease")
}

fn api(server: &LeaseApiServer) -> Api<Lease> {
    Api::namespaced(server.client(), NAMESPACE)
}

fn status_of(err: kube::Error) -> kube::core::Status {
    match err {
        kube::Error::Api(s) => *s,
        other => panic!("expected an API Status, got {other:?}"),
    }
}

#[tokio::test]
async fn status_bodies_use_kube_apiserver_wording() {
    let server = LeaseApiServer::start().await;
    let api = api(&server);
    let created = api
        .create(&PostParams::default(), &lease("x"))
        .await
        .expect("create");
    let rv = created
        .metadata
        .resource_version
        .clone()
        .expect("resourceVersion");
    assert_eq!(rv, "1");
    assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());

    let s = status_of(
        api.create(&PostParams::default(), &lease("x"))
            .await
            .expect_err("exists"),
    );
    assert_eq!((s.code, s.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(
        s.message,
        r#"leases.coordination.k8s.io "x" already exists"#
    );

    let mut changed = created.clone();
    changed.spec.as_mut().expect("spec").holder_identity = Some("b".into());
    api.replace("x", &PostParams::default(), &changed)
        .await
        .expect("replace");
    let s = status_of(
        api.replace("x", &PostParams::default(), &changed)
            .await
            .expect_err("stale"),
    );
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        s.message,
        r#"Operation cannot be fulfilled on leases.coordination.k8s.io "x": the object has been modified; please apply your changes to the latest version and try again"#
    );

    let s = status_of(api.get("nope").await.expect_err("missing"));
    assert_eq!((s.code, s.reason.as_str()), (404, "NotFound"));
    assert_eq!(s.message, r#"leases.coordination.k8s.io "nope" not found"#);

    let s = status_of(
        api.create(&PostParams::default(), &lease("Bad_Name"))
            .await
            .expect_err("invalid"),
    );
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert!(
        s.message.starts_with(r#"Lease.coordination.k8s.io "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters"#),
        "{}",
        s.message
    );
}

#[tokio::test]
async fn unchanged_replace_keeps_the_resource_version() {
    let server = LeaseApiServer::start().await;
    let api = api(&server);
    let created = api
        .create(&PostParams::default(), &lease("same"))
        .await
        .expect("create");
    let again = api
        .replace("same", &PostParams::default(), &created)
        .await
        .expect("replace");
    assert_eq!(
        again.metadata.resource_version,
        created.metadata.resource_version
    );
}

#[tokio::test]
async fn authentication_and_authorization_answers() {
    let server = LeaseApiServer::start().await;
    let anon: Api<Lease> = Api::namespaced(server.client_with_token(Some("wrong")), NAMESPACE);
    let s = status_of(anon.get("x").await.expect_err("401"));
    assert_eq!(
        (s.code, s.reason.as_str(), s.message.as_str()),
        (401, "Unauthorized", "Unauthorized")
    );

    server.add_token(
        "reader",
        "system:serviceaccount:leasehold-test:reader",
        &["get"],
    );
    let reader: Api<Lease> = Api::namespaced(server.client_with_token(Some("reader")), NAMESPACE);
    let s = status_of(
        reader
            .create(&PostParams::default(), &lease("x"))
            .await
            .expect_err("403"),
    );
    assert_eq!((s.code, s.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        s.message,
        r#"leases.coordination.k8s.io is forbidden: User "system:serviceaccount:leasehold-test:reader" cannot create resource "leases" in API group "coordination.k8s.io" in the namespace "leasehold-test""#
    );
}

#[tokio::test]
async fn watch_streams_events_bookmarks_and_410_expired() {
    let server = LeaseApiServer::start_with(ServerOptions {
        bookmark_interval: std::time::Duration::from_millis(50),
        ..ServerOptions::default()
    })
    .await;
    let api = api(&server);
    let created = api
        .create(&PostParams::default(), &lease("w"))
        .await
        .expect("create");
    let params = WatchParams::default().fields("metadata.name=w");
    let mut events = api.watch(&params, "0").await.expect("watch").boxed();
    match events.try_next().await.expect("event") {
        Some(WatchEvent::Added(l)) => assert_eq!(
            l.metadata.resource_version,
            created.metadata.resource_version
        ),
        other => panic!("expected ADDED, got {other:?}"),
    }
    // Bookmarks arrive on an otherwise quiet watch.
    match events.try_next().await.expect("event") {
        Some(WatchEvent::Bookmark(b)) => assert_eq!(b.metadata.resource_version, "1"),
        other => panic!("expected BOOKMARK, got {other:?}"),
    }
    drop(events);

    let mut changed = created.clone();
    changed.spec.as_mut().expect("spec").holder_identity = Some("b".into());
    api.replace("w", &PostParams::default(), &changed)
        .await
        .expect("replace");
    server.compact();
    let mut events = api.watch(&params, "1").await.expect("watch").boxed();
    match events.try_next().await.expect("event") {
        Some(WatchEvent::Error(s)) => {
            assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
            assert_eq!(s.message, "too old resource version: 1 (2)");
        }
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
}
