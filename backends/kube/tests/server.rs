//! Fidelity of the test Lease API server: the JSON a plain kube client gets back matches what
//! kube-apiserver answers (Status bodies with apimachinery's wording, watch events, bookmarks,
//! 410 Expired).

use leasehold_test_support::lease_api as support;

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

async fn put_json(
    api: &Api<Lease>,
    name: &str,
    body: serde_json::Value,
) -> Result<Lease, kube::core::Status> {
    let lease: Lease = serde_json::from_value(body).expect("lease json");
    api.replace(name, &PostParams::default(), &lease)
        .await
        .map_err(status_of)
}

/// kube-apiserver's Lease strategy allows create-on-update: a PUT to a missing name creates it
/// (ignoring resourceVersion) unless the body carries a uid, which is a precondition.
#[tokio::test]
async fn put_to_a_missing_lease_creates_it_unless_a_uid_is_given() {
    let server = LeaseApiServer::start().await;
    let api = api(&server);
    let created = put_json(
        &api,
        "made-by-put",
        json!({"metadata": {"name": "made-by-put", "resourceVersion": "12345"}, "spec": {"holderIdentity": "a"}}),
    )
    .await
    .expect("create-on-update");
    assert!(created.metadata.uid.is_some());
    assert!(server.get_raw(NAMESPACE, "made-by-put").is_some());

    let s = put_json(
        &api,
        "not-there",
        json!({"metadata": {"name": "not-there", "uid": "6f1b7c2e-0000-4000-8000-00000000abcd", "resourceVersion": "1"}, "spec": {}}),
    )
    .await
    .expect_err("uid precondition on a missing Lease");
    assert_eq!((s.code, s.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        s.message,
        r#"Operation cannot be fulfilled on leases.coordination.k8s.io "not-there": Precondition failed: UID in precondition: 6f1b7c2e-0000-4000-8000-00000000abcd, UID in object meta: "#
    );
    assert!(server.get_raw(NAMESPACE, "not-there").is_none());

    // On an existing Lease, another uid fails the same way.
    let mut other = created.clone();
    other.metadata.uid = Some("another-uid".into());
    let s = api
        .replace("made-by-put", &PostParams::default(), &other)
        .await
        .map_err(status_of)
        .expect_err("uid mismatch");
    assert_eq!(s.code, 409);
    assert!(
        s.message
            .contains("Precondition failed: UID in precondition: another-uid")
    );

    // Creating through PUT needs the create verb.
    server.add_token(
        "updater",
        "system:serviceaccount:leasehold-test:updater",
        &["get", "update"],
    );
    let updater: Api<Lease> = Api::namespaced(server.client_with_token(Some("updater")), NAMESPACE);
    let s = put_json(
        &updater,
        "needs-create",
        json!({"metadata": {"name": "needs-create"}, "spec": {}}),
    )
    .await
    .expect_err("403");
    assert_eq!((s.code, s.reason.as_str()), (403, "Forbidden"));
    assert!(
        s.message.contains("cannot create resource"),
        "{}",
        s.message
    );
}

#[tokio::test]
async fn put_without_resource_version_on_an_existing_lease_is_invalid() {
    let server = LeaseApiServer::start().await;
    let api = api(&server);
    let mut created = api
        .create(&PostParams::default(), &lease("no-rv"))
        .await
        .expect("create");
    created.metadata.resource_version = None;
    let s = api
        .replace("no-rv", &PostParams::default(), &created)
        .await
        .map_err(status_of)
        .expect_err("422");
    assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
    assert_eq!(
        s.message,
        r#"leases.coordination.k8s.io "no-rv" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update"#
    );
}

#[tokio::test]
async fn owner_references_and_finalizers_are_stored_and_dropped_when_omitted() {
    let server = LeaseApiServer::start().await;
    let api = api(&server);
    let owner = json!([{"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "0f0f0f0f-0000-4000-8000-000000000001"}]);
    let with_meta: Lease = serde_json::from_value(json!({
        "metadata": {"name": "owned", "ownerReferences": owner, "finalizers": ["example.com/keep"]},
        "spec": {"holderIdentity": "a"},
    }))
    .expect("lease");
    let created = api
        .create(&PostParams::default(), &with_meta)
        .await
        .expect("create");
    let raw = server.get_raw(NAMESPACE, "owned").expect("stored");
    assert_eq!(raw["metadata"]["ownerReferences"], owner);
    assert_eq!(raw["metadata"]["finalizers"], json!(["example.com/keep"]));

    let mut changed = created.clone();
    changed.metadata.finalizers = Some(vec!["example.com/other".into()]);
    let updated = api
        .replace("owned", &PostParams::default(), &changed)
        .await
        .expect("update");
    let raw = server.get_raw(NAMESPACE, "owned").expect("stored");
    assert_eq!(raw["metadata"]["finalizers"], json!(["example.com/other"]));
    assert_eq!(raw["metadata"]["ownerReferences"], owner);

    let mut bare = updated.clone();
    bare.metadata.owner_references = None;
    bare.metadata.finalizers = None;
    api.replace("owned", &PostParams::default(), &bare)
        .await
        .expect("update");
    let raw = server.get_raw(NAMESPACE, "owned").expect("stored");
    assert!(raw["metadata"].get("ownerReferences").is_none(), "{raw}");
    assert!(raw["metadata"].get("finalizers").is_none(), "{raw}");
}

#[tokio::test]
async fn strategy_and_preferred_holder_are_validated() {
    let server = LeaseApiServer::start().await;
    let api = api(&server);
    let create = |name: &str, spec: serde_json::Value| {
        let l: Lease = serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec}))
            .expect("lease");
        let api = api.clone();
        async move {
            api.create(&PostParams::default(), &l)
                .await
                .map_err(status_of)
        }
    };
    let s = create("bad-strategy", json!({"strategy": "Newest"}))
        .await
        .expect_err("unsupported");
    assert_eq!(s.code, 422);
    assert_eq!(
        s.message,
        r#"Lease.coordination.k8s.io "bad-strategy" is invalid: spec.strategy: Unsupported value: "Newest": supported values: "OldestEmulationVersion""#
    );
    let s = create("orphan-preferred", json!({"preferredHolder": "b"}))
        .await
        .expect_err("forbidden");
    assert_eq!(
        s.message,
        "Lease.coordination.k8s.io \"orphan-preferred\" is invalid: spec.preferredHolder: Forbidden: may only be specified if `strategy` is defined"
    );
    let s = create(
        "two-errors",
        json!({"leaseDurationSeconds": 0, "preferredHolder": "b"}),
    )
    .await
    .expect_err("two errors");
    assert!(s.message.contains(": [spec.leaseDurationSeconds: Invalid value: 0: must be greater than 0, spec.preferredHolder: Forbidden"), "{}", s.message);
    assert!(
        create("bad-qualified", json!({"strategy": "example.com/"}))
            .await
            .is_err()
    );
    create(
        "ok-builtin",
        json!({"strategy": "OldestEmulationVersion", "preferredHolder": "b"}),
    )
    .await
    .expect("a Kubernetes-defined strategy");
    create("ok-qualified", json!({"strategy": "example.com/mine"}))
        .await
        .expect("a qualified strategy name");
}

/// MicroTime decodes only from Go's RFC3339Micro: exactly six fractional digits.
#[tokio::test]
async fn micro_times_are_parsed_strictly() {
    let server = LeaseApiServer::start().await;
    let client = server.client();
    let raw: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client,
        NAMESPACE,
        &kube::api::ApiResource::erase::<Lease>(&()),
    );
    let post = |name: &str, t: serde_json::Value| {
        let obj: kube::api::DynamicObject = serde_json::from_value(json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name}, "spec": {"renewTime": t},
        }))
        .expect("object");
        let raw = raw.clone();
        async move {
            raw.create(&PostParams::default(), &obj)
                .await
                .map_err(status_of)
        }
    };
    for (i, bad) in [
        "2026-11-29T20:04:19Z",
        "2026-11-29T20:04:19.123Z",
        "2026-11-29T20:04:19.1234567Z",
        "2026-11-29 20:04:19.123456Z",
        "2026-11-29T20:04:19.123456",
        "2026-13-29T20:04:19.123456Z",
        "",
    ]
    .into_iter()
    .enumerate()
    {
        let s = post(&format!("bad-{i}"), json!(bad)).await.expect_err(bad);
        assert_eq!((s.code, s.reason.as_str()), (400, "BadRequest"), "{bad}");
        assert!(
            s.message.contains("2006-01-02T15:04:05.000000Z07:00"),
            "{}",
            s.message
        );
    }
    post("good-utc", json!("2026-11-29T20:04:19.123456Z"))
        .await
        .expect("six digits, Z");
    post("good-offset", json!("2026-11-29T21:04:19.123456+01:00"))
        .await
        .expect("six digits, offset");
    post("good-null", serde_json::Value::Null)
        .await
        .expect("null is the zero time");
    let stored = server.get_raw(NAMESPACE, "good-offset").expect("stored");
    assert_eq!(
        stored["spec"]["renewTime"],
        json!("2026-11-29T20:04:19.123456Z")
    );
}

#[tokio::test]
async fn list_pages_with_limit_and_continue_and_expires_old_tokens() {
    let server = LeaseApiServer::start().await;
    let api = api(&server);
    for n in ["a", "b", "c", "d", "e"] {
        api.create(&PostParams::default(), &lease(n))
            .await
            .expect("create");
    }
    let first = api
        .list(&kube::api::ListParams::default().limit(2))
        .await
        .expect("page 1");
    let names = |l: &kube::core::ObjectList<Lease>| -> Vec<String> {
        l.items
            .iter()
            .map(|o| o.metadata.name.clone().unwrap_or_default())
            .collect()
    };
    assert_eq!(names(&first), ["a", "b"]);
    assert_eq!(first.metadata.remaining_item_count, Some(3));
    let token = first.metadata.continue_.clone().expect("continue");
    let second = api
        .list(
            &kube::api::ListParams::default()
                .limit(2)
                .continue_token(&token),
        )
        .await
        .expect("page 2");
    assert_eq!(names(&second), ["c", "d"]);
    assert_eq!(
        second.metadata.resource_version,
        first.metadata.resource_version
    );
    let token2 = second.metadata.continue_.clone().expect("continue");
    let third = api
        .list(
            &kube::api::ListParams::default()
                .limit(2)
                .continue_token(&token2),
        )
        .await
        .expect("page 3");
    assert_eq!(names(&third), ["e"]);
    assert!(third.metadata.continue_.is_none());

    // A write and a compaction later, the token is too old.
    api.create(&PostParams::default(), &lease("f"))
        .await
        .expect("create");
    server.compact();
    let s = status_of(
        api.list(
            &kube::api::ListParams::default()
                .limit(2)
                .continue_token(&token),
        )
        .await
        .expect_err("expired"),
    );
    assert_eq!((s.code, s.reason.as_str()), (410, "Expired"));
    assert!(
        s.message
            .starts_with("The provided continue parameter is too old")
    );
}

/// A watch from a resourceVersion the server has not reached waits for it, and then fails with
/// 504 "Too large resource version".
#[tokio::test]
async fn watch_from_a_future_resource_version_waits_then_times_out() {
    let server = LeaseApiServer::start_with(ServerOptions {
        too_large_rv_wait: std::time::Duration::from_millis(200),
        ..ServerOptions::default()
    })
    .await;
    let api: Api<Lease> = Api::namespaced(server.client_without_retry(), NAMESPACE);
    api.create(&PostParams::default(), &lease("w"))
        .await
        .expect("create");
    let params = WatchParams::default().fields("metadata.name=w");
    let err = match api.watch(&params, "5").await {
        Err(e) => e,
        Ok(_) => panic!("a watch from a future resourceVersion must fail"),
    };
    let s = status_of(err);
    assert_eq!((s.code, s.reason.as_str()), (504, "Timeout"));
    assert_eq!(s.message, "Too large resource version: 5, current: 1");
}

#[test]
fn bookmarks_come_about_once_a_minute_by_default() {
    assert_eq!(
        ServerOptions::default().bookmark_interval,
        std::time::Duration::from_secs(60)
    );
}

#[tokio::test]
async fn injected_faults_answer_as_kube_apiserver() {
    let server = LeaseApiServer::start().await;
    let api: Api<Lease> = Api::namespaced(server.client_without_retry(), NAMESPACE);

    // Committed, then 504.
    server.fail_after_commit_next(1);
    let s = status_of(
        api.create(&PostParams::default(), &lease("committed"))
            .await
            .expect_err("504"),
    );
    assert_eq!((s.code, s.reason.as_str()), (504, "Timeout"));
    assert!(server.get_raw(NAMESPACE, "committed").is_some());

    // 429 with Retry-After.
    server.fail_next(1, 429);
    let s = status_of(api.get("committed").await.expect_err("429"));
    assert_eq!((s.code, s.reason.as_str()), (429, "TooManyRequests"));
    assert_eq!(s.details.map(|d| d.retry_after_seconds), Some(1));
    api.get("committed")
        .await
        .expect("the next request is served");
}

#[tokio::test]
async fn delete_answers_with_a_success_status() {
    let server = LeaseApiServer::start().await;
    let api = api(&server);
    let created = api
        .create(&PostParams::default(), &lease("deleted"))
        .await
        .expect("create");
    let answer = api
        .delete("deleted", &kube::api::DeleteParams::default())
        .await
        .expect("delete");
    let s = answer.right().expect("a Status, not the deleted object");
    assert_eq!(s.status, Some(kube::core::response::StatusSummary::Success));
    let d = s.details.expect("details");
    assert_eq!((d.name.as_str(), d.kind.as_str()), ("deleted", "leases"));
    assert_eq!(Some(d.uid), created.metadata.uid);
}
