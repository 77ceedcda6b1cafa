//! The store under the faults of a real cluster: Leases deleted or re-created behind its back
//! (kube-apiserver's create-on-update), writes that commit and then fail, and lists that come in
//! many pages or whose continue token expires.

use std::time::{Duration, SystemTime};

use futures::StreamExt;
use leasehold::{Error, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, WatchEvent};
use leasehold_test_support::lease_api as support;
use support::{LeaseApiServer, NAMESPACE, ServerOptions, store, store_with, test_config};

fn key(k: &str) -> LeaseKey {
    LeaseKey::new(k).expect("valid key")
}

fn record(holder: &str, transitions: u64) -> LeaseRecord {
    let now = SystemTime::now();
    LeaseRecord {
        holder_identity: holder.into(),
        lease_duration: Duration::from_secs(15),
        acquire_time: Some(now),
        renew_time: Some(now),
        transitions,
    }
}

fn holder(server: &LeaseApiServer, name: &str) -> Option<String> {
    server.get_raw(NAMESPACE, name).map(|o| {
        o["spec"]["holderIdentity"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    })
}

/// After the store's own delete, an update at the old version is NotFound and does not
/// re-create the Lease (kube-apiserver would create it from a PUT without a uid).
#[tokio::test]
async fn update_after_delete_is_not_found_and_creates_nothing() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("deleted");
    let v1 = s.create(&k, &record("a", 1)).await.expect("create");
    s.delete(&k, &v1).await.expect("delete");
    match s.update(&k, &record("b", 2), &v1).await {
        Err(Error::NotFound { key }) => assert_eq!(key, "deleted"),
        other => panic!("expected NotFound, got {other:?}"),
    }
    assert!(server.get_raw(NAMESPACE, "deleted").is_none());
}

/// Another client deletes the Lease the store has cached: the PUT carries the cached uid, the
/// server answers 409, and the store reports NotFound after reading again.
#[tokio::test]
async fn update_of_a_lease_deleted_by_another_client_is_not_found() {
    let server = LeaseApiServer::start().await;
    let mine = store(&server);
    let other = store(&server);
    let k = key("deleted-elsewhere");
    let v1 = mine.create(&k, &record("a", 1)).await.expect("create");
    other
        .delete(&k, &v1)
        .await
        .expect("delete by another client");
    assert!(matches!(
        mine.update(&k, &record("a", 1), &v1).await,
        Err(Error::NotFound { .. })
    ));
    assert!(server.get_raw(NAMESPACE, "deleted-elsewhere").is_none());
}

/// The same after `get` found nothing and after the watch reported the deletion (the store
/// forgets the object, reads again before the PUT and answers NotFound without writing).
#[tokio::test]
async fn update_after_get_none_or_watch_deleted_is_not_found() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let other = store(&server);
    let k = key("gone");
    let v1 = s.create(&k, &record("a", 1)).await.expect("create");
    let mut w = s.watch(&k, Some(&v1)).await.expect("watch");
    other.delete(&k, &v1).await.expect("delete");
    match w.next().await {
        Some(Ok(WatchEvent::Deleted)) => {}
        other => panic!("expected Deleted, got {other:?}"),
    }
    assert!(matches!(
        s.update(&k, &record("a", 1), &v1).await,
        Err(Error::NotFound { .. })
    ));
    assert_eq!(s.get(&k).await.expect("get"), None);
    assert!(matches!(
        s.update(&k, &record("a", 1), &v1).await,
        Err(Error::NotFound { .. })
    ));
    assert!(server.get_raw(NAMESPACE, "gone").is_none());
}

/// A Lease deleted and re-created by someone else has a new uid: an update from the old version
/// is a Conflict and leaves the new Lease alone.
#[tokio::test]
async fn update_of_a_recreated_lease_is_conflict() {
    let server = LeaseApiServer::start().await;
    let mine = store(&server);
    let other = store(&server);
    let k = key("recreated");
    let v1 = mine.create(&k, &record("a", 1)).await.expect("create");
    other.delete(&k, &v1).await.expect("delete");
    other.create(&k, &record("b", 5)).await.expect("re-create");
    assert!(matches!(
        mine.update(&k, &record("a", 2), &v1).await,
        Err(Error::Conflict { .. })
    ));
    assert_eq!(holder(&server, "recreated").as_deref(), Some("b"));
}

/// Without the `create` verb, an update of a deleted Lease is still NotFound (the store never
/// asks the server to create through a PUT), not a PermissionDenied naming the wrong verb.
#[tokio::test]
async fn update_of_a_deleted_lease_without_the_create_verb_is_not_found() {
    let server = LeaseApiServer::start().await;
    server.add_token(
        "no-create",
        "system:serviceaccount:leasehold-test:no-create",
        &["get", "list", "watch", "update", "delete"],
    );
    let admin = store(&server);
    let s = store_with(&server, Some("no-create"), test_config());
    let k = key("no-create");
    let v1 = admin.create(&k, &record("a", 1)).await.expect("create");
    assert!(s.get(&k).await.expect("get").is_some());
    admin.delete(&k, &v1).await.expect("delete");
    match s.update(&k, &record("a", 1), &v1).await {
        Err(Error::NotFound { .. }) => {}
        other => panic!("expected NotFound, got {other:?}"),
    }
    assert!(server.get_raw(NAMESPACE, "no-create").is_none());
}

/// kube-rs retries a write answered with 504. When the server had committed it, the replay
/// fails: `update` returns Conflict and `create` AlreadyExists although the store holds our
/// record. The store reports that as it is; the elector reads back and recognises its write.
#[tokio::test]
async fn a_write_committed_then_answered_504_is_replayed_by_kube_rs() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let k = key("replayed");

    server.fail_after_commit_next(1);
    match s.create(&k, &record("a", 1)).await {
        Err(Error::AlreadyExists { .. }) => {}
        other => panic!("expected AlreadyExists from the replayed POST, got {other:?}"),
    }
    let v1 = s.get(&k).await.expect("get").expect("our create happened");
    assert_eq!(v1.record.holder_identity, "a");

    server.fail_after_commit_next(1);
    match s.update(&k, &record("b", 2), &v1.version).await {
        Err(Error::Conflict { .. }) => {}
        other => panic!("expected Conflict from the replayed PUT, got {other:?}"),
    }
    let v2 = s.get(&k).await.expect("get").expect("exists");
    assert_eq!(
        (v2.record.holder_identity.as_str(), v2.record.transitions),
        ("b", 2),
        "our update happened"
    );
}

/// `list` follows `continue` tokens through many pages.
#[tokio::test]
async fn list_reads_every_page() {
    let server = LeaseApiServer::start_with(ServerOptions {
        max_page_size: Some(3),
        ..ServerOptions::default()
    })
    .await;
    let s = store(&server);
    let mut want = Vec::new();
    for i in 0..20 {
        let k = key(&format!("paged-{i:02}"));
        s.create(&k, &record("a", 1)).await.expect("create");
        want.push(k);
        s.create(&key(&format!("other-{i:02}")), &record("a", 1))
            .await
            .expect("create");
    }
    let before = server.requests();
    let listed = s
        .list(&KeyPrefix::new("paged-").expect("prefix"))
        .await
        .expect("list");
    let got: Vec<LeaseKey> = listed.into_iter().map(|(k, _)| k).collect();
    assert_eq!(got, want);
    // 40 Leases, 3 per page.
    assert_eq!(server.requests() - before, 14);
}

/// A continue token that expires between pages (410) makes `list` start over.
#[tokio::test]
async fn list_starts_over_when_its_continue_token_expires() {
    let server = LeaseApiServer::start_with(ServerOptions {
        max_page_size: Some(2),
        ..ServerOptions::default()
    })
    .await;
    let s = store(&server);
    for i in 0..5 {
        s.create(&key(&format!("expiring-{i}")), &record("a", 1))
            .await
            .expect("create");
    }
    server.expire_next_continue(1);
    let listed = s
        .list(&KeyPrefix::new("expiring-").expect("prefix"))
        .await
        .expect("list");
    assert_eq!(listed.len(), 5);
    // A server that keeps expiring them ends as an error.
    server.expire_next_continue(1000);
    let err = s
        .list(&KeyPrefix::new("expiring-").expect("prefix"))
        .await
        .expect_err("always expired");
    assert!(err.to_string().contains("too old"), "{err}");
}

/// `fencing_seed` is the client's clock in seconds since 2020, so a fresh Lease starts above
/// any count a client-go record begun at 0 could have reached.
#[tokio::test]
async fn fencing_seed_is_seconds_since_2020() {
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    let secs_since_2020 = || {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs()
            - leasehold_kube::FENCING_EPOCH_UNIX_SECS
    };
    let before = secs_since_2020();
    let seed = s.fencing_seed(&key("seeded")).await.expect("seed");
    let after = secs_since_2020();
    assert!(
        before <= seed && seed <= after,
        "{before} <= {seed} <= {after}"
    );
    assert!(i32::try_from(seed).is_ok());
    // A record seeded with it fits spec.leaseTransitions.
    s.create(&key("seeded"), &record("a", seed))
        .await
        .expect("create");
}
