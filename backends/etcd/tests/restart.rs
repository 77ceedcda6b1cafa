//! A watch survives the restart of the etcd member it is connected to, and resumes from the
//! last revision it delivered.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use common::{Etcd, record};
use futures::StreamExt;
use leasehold::{LeaseKey, LeaseStore, Version, WatchEvent, WatchStream};
use leasehold_etcd::EtcdStore;
use leasehold_test_support::etcd as common;

/// The next Put, skipping (retryable) errors reported while the member is down.
async fn next_put(w: &mut WatchStream) -> Version {
    for _ in 0..1000 {
        match tokio::time::timeout(Duration::from_secs(60), w.next()).await {
            Ok(Some(Ok(WatchEvent::Put(v)))) => return v.version,
            Ok(Some(Ok(other))) => panic!("unexpected event {other:?}"),
            Ok(Some(Err(e))) => assert!(e.is_retryable(), "{e:?}"),
            Ok(None) => panic!("the watch stream ended"),
            Err(_) => panic!("no watch event within 60 s"),
        }
    }
    panic!("only errors from the watch")
}

#[tokio::test]
async fn watch_survives_a_member_restart() {
    let etcd = Etcd::start().await;
    let config = etcd
        .config()
        .with_operation_timeout(Duration::from_millis(500));
    let store = EtcdStore::connect(config).await.unwrap();
    let k = LeaseKey::new("restart").unwrap();
    let v1 = store.create(&k, &record("a", 1)).await.unwrap();
    let mut w = store.watch(&k, Some(&v1)).await.unwrap();
    let v2 = store.update(&k, &record("a", 2), &v1).await.unwrap();
    assert_eq!(next_put(&mut w).await, v2);

    etcd.stop_member(0);
    // While it is down, operations fail with retryable errors (never hang).
    let e = store.get(&k).await.unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
    etcd.restart_member(0);
    etcd.wait_ready(0).await;

    // Changes after the restart arrive on the same stream, none twice, none lost.
    let mut v = v2;
    for i in 3..6 {
        let mut attempt = 0;
        let next = loop {
            match store.update(&k, &record("a", i), &v).await {
                Ok(n) => break n,
                Err(e) if e.is_retryable() && attempt < 100 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("{e:?}"),
            }
        };
        assert_eq!(next_put(&mut w).await, next);
        v = next;
    }
}
