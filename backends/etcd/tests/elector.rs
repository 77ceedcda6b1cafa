//! Elector-level behaviour specific to etcd: corrupt data under the key, and the acquisition
//! revision (etcd-native fencing, like `ETCD_LOCK_REV`).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use common::{shared_store, wait_for};
use leasehold::{Elector, ElectorConfig, LeaseKey, LeaseStore};
use leasehold_etcd::{EtcdStore, etcd_client::GetOptions, revision};
use leasehold_test_support::etcd as common;

const LEASE: Duration = Duration::from_secs(2);
const RENEW: Duration = Duration::from_secs(1);
const RETRY: Duration = Duration::from_millis(250);
const LIMIT: Duration = Duration::from_secs(60);

fn spawn(store: &EtcdStore, key: &LeaseKey, id: &str) -> Elector {
    let config = ElectorConfig::new(key.clone(), id).with_timings(LEASE, RENEW, RETRY);
    Elector::spawn(Arc::new(store.clone()), config).unwrap()
}

/// The record stored at revision `rev` (etcd keeps history until compaction).
async fn record_at(store: &EtcdStore, key: &LeaseKey, rev: i64) -> Option<leasehold::LeaseRecord> {
    let mut kv = store.client().kv_client();
    let resp = kv
        .get(
            store.etcd_key(key),
            Some(GetOptions::new().with_revision(rev)),
        )
        .await
        .unwrap();
    resp.kvs().first().map(|kv| {
        let version = leasehold::Version::from(kv.mod_revision());
        leasehold::codec::decode(key, kv.value(), Some(&version)).unwrap()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_data_is_taken_over_only_after_a_whole_lease() {
    let store = shared_store().await;
    let key = LeaseKey::new("corrupt-elector").unwrap();
    let mut kv = store.client().kv_client();
    let put = kv
        .put(store.etcd_key(&key), "{\"foreign\":true}", None)
        .await
        .unwrap();
    let garbage_rev = put.header().unwrap().revision();

    let spawned = tokio::time::Instant::now();
    let e = spawn(&store, &key, "replacer");
    let took = wait_for(LIMIT, || e.is_leading()).await;
    assert!(
        took.is_some(),
        "the elector never replaced the corrupt data"
    );
    // It observed the data after spawning, so it must have waited a whole lease.
    assert!(
        spawned.elapsed() >= LEASE,
        "took over after {:?}",
        spawned.elapsed()
    );
    let now = store.get(&key).await.unwrap().unwrap();
    assert_eq!(now.record.holder_identity, "replacer");
    assert!(revision(&now.version).unwrap() > garbage_rev);
    e.shutdown().await.expect("the elector shuts down cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisition_revision_is_the_acquiring_write_and_increases() {
    let store = shared_store().await;
    let key = LeaseKey::new("fencing").unwrap();

    let a = spawn(&store, &key, "a");
    assert!(wait_for(LIMIT, || a.is_leading()).await.is_some());
    let token_a = a.current_status().0.leadership().unwrap().fencing_token();
    let rev_a = store.acquisition_revision(&key, token_a).unwrap();
    // The elector acquires with a token assigned at commit: the acquiring write's revision.
    assert_eq!(u64::try_from(rev_a).ok(), Some(token_a));
    // The write at that revision is a's acquisition, and it stays the same across renewals.
    let rec = record_at(&store, &key, rev_a).await.unwrap();
    assert_eq!(
        (rec.holder_identity.as_str(), rec.transitions),
        ("a", token_a)
    );
    let before = record_at(&store, &key, rev_a - 1).await;
    assert!(
        before.as_ref().is_none_or(|r| r.transitions != token_a),
        "{before:?}"
    );
    tokio::time::sleep(RETRY * 3).await;
    assert_eq!(store.acquisition_revision(&key, token_a), Some(rev_a));
    assert!(revision(&store.get(&key).await.unwrap().unwrap().version).unwrap() > rev_a);

    // Hand over to b (same store instance, so it sees b's acquisition too).
    let b = spawn(&store, &key, "b");
    a.shutdown().await.expect("the elector shuts down cleanly");
    assert!(wait_for(LIMIT, || b.is_leading()).await.is_some());
    let token_b = b.current_status().0.leadership().unwrap().fencing_token();
    assert!(token_b > token_a);
    let rev_b = store.acquisition_revision(&key, token_b).unwrap();
    assert_eq!(u64::try_from(rev_b).ok(), Some(token_b));
    assert!(rev_b > rev_a, "{rev_b} <= {rev_a}");
    assert_eq!(store.acquisition_revision(&key, token_a), None);
    let rec = record_at(&store, &key, rev_b).await.unwrap();
    assert_eq!(
        (rec.holder_identity.as_str(), rec.transitions),
        ("b", token_b)
    );
    b.shutdown().await.expect("the elector shuts down cleanly");
}
