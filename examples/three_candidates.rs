//! Three candidates on the in-memory store: one leads, a graceful handover, then a crash
//! failover, with the fencing token of every term printed.
//!
//! Run it with `cargo run --example three_candidates`.

use std::sync::Arc;
use std::time::Duration;

use leasehold::fault::FaultyStore;
use leasehold::{DynLeaseStore, Elector, ElectorConfig, LeaseKey, MemoryStore, run_leader_tasks};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const LEASE: Duration = Duration::from_secs(2);
const RENEW: Duration = Duration::from_secs(1);
const RETRY: Duration = Duration::from_millis(250);

struct Candidate {
    name: &'static str,
    /// This candidate's connection to the store; cutting it off simulates a crash.
    link: FaultyStore,
    elector: Arc<Elector>,
    tasks: tokio::task::JoinHandle<()>,
    stop: CancellationToken,
}

fn start(
    store: &DynLeaseStore,
    key: &LeaseKey,
    name: &'static str,
    t0: Instant,
) -> leasehold::Result<Candidate> {
    let link = FaultyStore::new(store.clone());
    let config = ElectorConfig::new(key.clone(), name).with_timings(LEASE, RENEW, RETRY);
    let elector = Arc::new(Elector::spawn(Arc::new(link.clone()), config)?);
    let stop = CancellationToken::new();
    // Leader-only work: runs while leading, cancelled when leadership ends.
    let tasks = tokio::spawn(run_leader_tasks(
        stop.clone(),
        elector.clone(),
        move |leader| async move {
            println!(
                "{:>8.3}s  {name} leads   (fencing token {})",
                t0.elapsed().as_secs_f64(),
                leader.fencing_token()
            );
            leader.cancelled().await;
            println!(
                "{:>8.3}s  {name} stops   ({})",
                t0.elapsed().as_secs_f64(),
                leader.cause().map(|c| c.to_string()).unwrap_or_default()
            );
        },
    ));
    Ok(Candidate {
        name,
        link,
        elector,
        tasks,
        stop,
    })
}

async fn wait_for_leader(cands: &[Candidate]) -> usize {
    loop {
        if let Some(i) = cands.iter().position(|c| c.elector.is_leading()) {
            return i;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::main]
async fn main() -> leasehold::Result<()> {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let key = LeaseKey::new("example-lease")?;
    let t0 = Instant::now();
    println!("lease {LEASE:?}, renew deadline {RENEW:?}, retry period {RETRY:?}");
    let mut cands = Vec::new();
    for name in ["alpha", "bravo", "charlie"] {
        cands.push(start(&store, &key, name, t0)?);
    }
    let first = wait_for_leader(&cands).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for c in &cands {
        if !c.elector.is_leading() {
            println!(
                "{:>8.3}s  {} follows {:?}",
                t0.elapsed().as_secs_f64(),
                c.name,
                c.elector.leader().unwrap_or_default()
            );
        }
    }

    // 1. Graceful handover: the leader shuts down and releases; a watching follower takes over at once.
    println!("--- graceful handover: {} shuts down", cands[first].name);
    let leaving = cands.remove(first);
    let released = Instant::now();
    leaving
        .elector
        .shutdown()
        .await
        .expect("the elector shuts down cleanly");
    leaving.stop.cancel();
    let _ = leaving.tasks.await;
    let second = wait_for_leader(&cands).await;
    println!("           handover took {:?}", released.elapsed());

    // 2. Crash failover: the leader is cut off and never releases; the follower waits for expiry.
    println!(
        "--- crash: {} is cut off from the store",
        cands[second].name
    );
    let crashed_at = Instant::now();
    cands[second].link.faults().set_partitioned(true);
    let crashed = cands.remove(second);
    wait_for_leader(&cands).await;
    let took = crashed_at.elapsed();
    println!(
        "           failover took {took:?} (lease {LEASE:?}: the new leader waited for expiry)"
    );

    crashed.stop.cancel();
    let _ = crashed.tasks.await;
    crashed
        .elector
        .shutdown()
        .await
        .expect("the elector shuts down cleanly");
    for c in cands {
        c.elector
            .shutdown()
            .await
            .expect("the elector shuts down cleanly");
        c.stop.cancel();
        let _ = c.tasks.await;
    }
    let rec = store.get(&key).await?;
    if let Some(v) = rec {
        println!(
            "final record: holder {:?}, transitions (fencing token) {}",
            v.record.holder_identity, v.record.transitions
        );
    }
    Ok(())
}
