//! Redis Cluster: real local clusters (started here with `redis-server --cluster-enabled yes`
//! and `redis-cli --cluster create`), the store routed by slot, a slot migration and a failover
//! in the middle of its work.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use common::*;
use futures::StreamExt;
use leasehold::{Error, KeyPrefix, LeaseStore, WatchEvent, WatchStream};
use leasehold_redis::{RedisConfig, RedisStore};
use leasehold_test_support::redis as common;

const EVENTUALLY: Duration = Duration::from_secs(60);

async fn next_put(w: &mut WatchStream) -> leasehold::Versioned {
    loop {
        match tokio::time::timeout(EVENTUALLY, w.next()).await {
            Err(_) => panic!("no watch event within {EVENTUALLY:?}"),
            Ok(None) => panic!("the watch ended"),
            Ok(Some(Err(e))) => assert!(e.is_retryable(), "{e:?}"),
            Ok(Some(Ok(WatchEvent::Put(p)))) => return p,
            Ok(Some(Ok(other))) => panic!("expected a Put, got {other:?}"),
        }
    }
}

fn keyslot(port: u16, key: &str) -> u16 {
    Cluster::cli(port, &["CLUSTER", "KEYSLOT", key])
        .trim()
        .parse()
        .expect("a slot number")
}

#[tokio::test]
async fn a_cluster_store_keeps_a_namespace_in_one_slot_and_survives_a_slot_migration() {
    let cluster = Cluster::start(3);
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let prefix = unique_prefix();
    let cfg = cluster_config(&ports, &prefix).with_operation_timeout(Duration::from_secs(5));
    let s = RedisStore::connect(cfg).await.unwrap();
    let k = key("clustered");

    // Every key of the namespace is in the slot of the hash tag.
    let slot = keyslot(ports[0], &format!("{{{prefix}}}"));
    for name in [
        s.record_key(&k),
        s.record_key(&key("other")),
        format!("{{{prefix}}}index"),
        format!("{{{prefix}}}rev"),
        format!("{{{prefix}}}tok:{}", k.as_str()),
    ] {
        assert_eq!(keyslot(ports[0], &name), slot, "{name}");
    }

    let seed = s.fencing_seed(&k).await.unwrap();
    let v1 = s.create(&k, &record("a", seed)).await.unwrap();
    let mut w = s.watch(&k, Some(&v1)).await.unwrap();
    let v2 = s.update(&k, &record("a", seed + 1), &v1).await.unwrap();
    assert_eq!(next_put(&mut w).await.version, v2);
    let listed = s.list(&KeyPrefix::new("clu").unwrap()).await.unwrap();
    assert_eq!(listed.len(), 1);

    // Move the namespace's slot to another master while the store is in use.
    let from = cluster.owner(slot);
    let to = *ports.iter().find(|p| **p != from).unwrap();
    cluster.migrate_slot(slot, to);
    assert_eq!(cluster.owner(slot), to);
    println!("moved slot {slot} from :{from} to :{to}");

    // The store follows the redirection: the record, versions and CAS carry on.
    let got = s
        .get(&k)
        .await
        .unwrap()
        .expect("the record moved with its slot");
    assert_eq!(got.version, v2);
    assert!(matches!(
        s.update(&k, &record("x", 0), &v1).await,
        Err(Error::Conflict { .. })
    ));
    let v3 = s.update(&k, &record("b", seed + 2), &v2).await.unwrap();
    assert_eq!(next_put(&mut w).await.version, v3);
    let after = s.fencing_seed(&k).await.unwrap();
    assert!(after > seed + 2);
    assert!(after > v3.as_str().parse::<u64>().unwrap());
    // An acquisition (token high-water mark in the same slot) after the migration.
    let a = s
        .acquire(&k, &record("c", seed + 3), Some(&v3))
        .await
        .unwrap();
    assert!(a.fencing_token > after);
    s.delete(&k, &a.version).await.unwrap();
    assert!(s.get(&k).await.unwrap().is_none());
}

#[tokio::test]
async fn the_least_privilege_acl_user_works_on_a_cluster() {
    let cluster = Cluster::start(3);
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let cfg = RedisConfig::new(format!("redis://app:app-pass@127.0.0.1:{}", ports[0]))
        .unwrap()
        .with_prefix(unique_prefix())
        .with_cluster();
    let rules = cfg.acl_rules();
    assert!(rules.ends_with(" +cluster|slots"), "{rules}");
    // ACL users are per node.
    for p in &ports {
        let mut args = vec!["ACL", "SETUSER", "app", "reset", "on", ">app-pass"];
        args.extend(rules.split_whitespace());
        assert!(Cluster::cli(*p, &args).contains("OK"));
    }
    let s = RedisStore::connect(cfg).await.unwrap();
    let k = key("acl-cluster");
    let seed = s.fencing_seed(&k).await.unwrap();
    let v1 = s.create(&k, &record("a", seed)).await.unwrap();
    let mut w = s.watch(&k, Some(&v1)).await.unwrap();
    let v2 = s.update(&k, &record("b", seed + 1), &v1).await.unwrap();
    assert_eq!(next_put(&mut w).await.version, v2);
    assert_eq!(
        s.list(&KeyPrefix::new("acl").unwrap()).await.unwrap().len(),
        1
    );
    s.delete(&k, &v2).await.unwrap();
}

#[tokio::test]
async fn a_cluster_store_carries_on_after_the_master_of_its_slot_fails_over() {
    let mut cluster = Cluster::start_with_replicas(3, 1);
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let prefix = unique_prefix();
    let cfg = cluster_config(&ports, &prefix)
        .with_operation_timeout(Duration::from_secs(2))
        .with_watch_ping_interval(Duration::from_millis(200));
    let s = RedisStore::connect(cfg).await.unwrap();
    let k = key("failover");
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    let mut w = s.watch(&k, Some(&v1)).await.unwrap();
    let v2 = s.update(&k, &record("a", 2), &v1).await.unwrap();
    assert_eq!(next_put(&mut w).await.version, v2);
    // Let the replica catch up, as a healthy cluster's would (WAIT 1 replica).
    let slot = keyslot(ports[0], &format!("{{{prefix}}}"));
    let master = cluster.owner(slot);
    let synced = Cluster::cli(master, &["WAIT", "1", "5000"]);
    assert_eq!(synced.trim(), "1", "the replica acknowledged the writes");

    // Kill the master of the namespace's slot; its replica takes over.
    let i = ports.iter().position(|p| *p == master).unwrap();
    cluster.nodes[i].kill();
    let started = std::time::Instant::now();
    let got = loop {
        match s.get(&k).await {
            Ok(got) => break got,
            Err(e) => {
                assert!(e.is_retryable(), "{e:?}");
                assert!(started.elapsed() < EVENTUALLY, "no failover: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let promoted = cluster.owner(slot);
    println!(
        "slot {slot}: master :{master} killed, :{promoted} serves it after {:?}",
        started.elapsed()
    );
    assert_ne!(promoted, master);
    assert_eq!(got.unwrap().version, v2);
    let v3 = s.update(&k, &record("b", 3), &v2).await.unwrap();
    assert!(![&v1, &v2].contains(&&v3));
    // The watch follows, through another seed if its node died.
    assert_eq!(next_put(&mut w).await.version, v3);
}

/// A cluster configuration under `prefix`, seeded with every node of the cluster.
fn cluster_config(ports: &[u16], prefix: &str) -> RedisConfig {
    let mut cfg = RedisConfig::new(format!("redis://127.0.0.1:{}", ports[0]))
        .unwrap()
        .with_prefix(prefix.to_owned())
        .with_cluster();
    for p in &ports[1..] {
        cfg = cfg.with_cluster_seed(format!("redis://127.0.0.1:{p}"));
    }
    cfg
}
