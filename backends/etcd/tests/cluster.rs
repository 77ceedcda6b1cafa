//! A three-member etcd cluster on loopback with electors on top: failover of the client to
//! another member, step-down without quorum, and re-election once quorum is back.
//!
//! Timings: lease 3 s, renew deadline 2 s, retry 500 ms; operation timeout 500 ms. Waits are
//! bounded generously (a slow machine only makes the test slower); the measured times are
//! printed (`--nocapture`), the asserted properties are orderings: never two leaders at once,
//! no leader while quorum is lost, a leader again after recovery.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use common::{Etcd, LeaderSampler, wait_for};
use futures::StreamExt;
use leasehold::{DynLeaseStore, Elector, ElectorConfig, LeaseKey, LeaseStore, WatchEvent};
use leasehold_etcd::{EtcdStore, revision};
use leasehold_test_support::etcd as common;

const LEASE: Duration = Duration::from_secs(3);
const RENEW: Duration = Duration::from_secs(2);
const RETRY: Duration = Duration::from_millis(500);
const LIMIT: Duration = Duration::from_secs(60);

async fn store(etcd: &Etcd, prefix: &str) -> DynLeaseStore {
    let config = etcd
        .config()
        .with_prefix(prefix)
        .with_operation_timeout(Duration::from_millis(500))
        .with_connect_timeout(Duration::from_millis(500));
    Arc::new(EtcdStore::connect(config).await.unwrap())
}

async fn electors(etcd: &Etcd, key: &LeaseKey, n: usize) -> Vec<Arc<Elector>> {
    let mut out = Vec::new();
    for i in 0..n {
        let s = store(etcd, "/cluster-test/").await;
        let config = ElectorConfig::new(key.clone(), format!("candidate-{i}"))
            .with_timings(LEASE, RENEW, RETRY);
        out.push(Arc::new(Elector::spawn(s, config).unwrap()));
    }
    out
}

fn leading(es: &[Arc<Elector>]) -> Vec<usize> {
    (0..es.len()).filter(|i| es[*i].is_leading()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_member_cluster_failover_quorum_loss_and_recovery() {
    let etcd = Etcd::start_cluster(3, None).await;
    let key = LeaseKey::new("cluster-lease").unwrap();
    let es = electors(&etcd, &key, 2).await;
    let sampler = LeaderSampler::start(es.clone());

    let took = wait_for(LIMIT, || leading(&es).len() == 1).await;
    eprintln!("initial election: {took:?}");
    assert!(took.is_some(), "no leader elected");

    // A watch on the lease key from a separate client; it must keep delivering renewals in
    // revision order through the member failure below.
    let observer = store(&etcd, "/cluster-test/").await;
    let mut watch = observer.watch(&key, None).await.unwrap();
    let mut last_rev = 0i64;

    // 1. Stop the raft leader member (every client is connected to every member; this one
    //    also forces a raft election). Leadership continues or is re-acquired.
    let raft_leader = etcd.raft_leader().await.unwrap_or(0);
    eprintln!("stopping raft leader member m{raft_leader}");
    etcd.stop_member(raft_leader);
    let stopped = tokio::time::Instant::now();
    // Let renewals go through the surviving members, then check there is a leader.
    let mut renewals_after_stop = 0;
    while renewals_after_stop < 3 {
        if next_put_in_order(&mut watch, &mut last_rev).await {
            renewals_after_stop += 1;
        }
    }
    let took = wait_for(LIMIT, || leading(&es).len() == 1).await;
    assert!(took.is_some(), "no leader after losing one member");
    eprintln!("a leader {:?} after stopping one member", stopped.elapsed());

    // 2. Stop a second member: no quorum. The leader steps down, and nobody leads.
    let second = (0..3).find(|i| *i != raft_leader).unwrap();
    eprintln!("stopping m{second}: quorum lost");
    etcd.stop_member(second);
    let lost = tokio::time::Instant::now();
    let took = wait_for(LIMIT, || leading(&es).is_empty()).await;
    eprintln!("step-down without quorum after {took:?} (renew deadline {RENEW:?})");
    assert!(
        took.is_some(),
        "the leader did not step down without quorum"
    );
    // Nobody may lead while quorum is lost: watch for longer than a whole lease.
    let stay = LEASE + RENEW;
    let led = wait_for(stay, || !leading(&es).is_empty()).await;
    assert!(led.is_none(), "an elector led without quorum");
    eprintln!("no leader for {:?} without quorum", lost.elapsed());

    // 3. Restore quorum: an elector leads again.
    etcd.restart_member(second);
    let restored = tokio::time::Instant::now();
    etcd.wait_ready(second).await;
    let took = wait_for(LIMIT, || leading(&es).len() == 1).await;
    eprintln!(
        "leader again {:?} after restarting m{second}",
        took.map(|_| restored.elapsed())
    );
    assert!(took.is_some(), "no leader after quorum was restored");

    // The old raft leader rejoins too; the watch still works and never goes back.
    etcd.restart_member(raft_leader);
    etcd.wait_ready(raft_leader).await;
    let mut puts = 0;
    while puts < 2 {
        if next_put_in_order(&mut watch, &mut last_rev).await {
            puts += 1;
        }
    }

    for e in &es {
        e.shutdown().await.expect("the elector shuts down cleanly");
    }
    let report = sampler.finish().await;
    eprintln!(
        "leaderless gaps: {:?} (the first one, if any, is from the member failure; the \
         quorum-loss gap is the last; lease + renew deadline = {:?})",
        report.gaps,
        LEASE + RENEW
    );
    assert_eq!(report.overlaps, 0, "two electors led at the same time");
}

/// Takes the next watch item: a `Put` must carry a revision above `last_rev` (which it then
/// becomes; returns true), an error must be retryable (returns false); anything else fails.
async fn next_put_in_order(watch: &mut leasehold::WatchStream, last_rev: &mut i64) -> bool {
    let item = tokio::time::timeout(LIMIT, watch.next())
        .await
        .expect("the watch kept delivering after a member failure")
        .expect("the watch stream did not end");
    match item {
        Ok(WatchEvent::Put(v)) => {
            let rev = revision(&v.version).unwrap();
            assert!(
                rev > *last_rev,
                "revisions went back: {rev} after {last_rev}"
            );
            *last_rev = rev;
            true
        }
        Ok(other) => panic!("unexpected watch event {other:?}"),
        Err(e) => {
            assert!(e.is_retryable(), "{e:?}");
            false
        }
    }
}
