//! Handover, failover and steady-state request benchmark on the in-memory store, plus status
//! fan-out and memory per elector.
//!
//! `cargo bench --bench handover` (add `-- --quick` for fewer rounds).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use leasehold::{
    DynLeaseStore, Elector, ElectorConfig, LeaderStatus, LeaseKey, MemoryStore, StatusCell,
    StatusSource, testing,
};
use leasehold_test_support::harness::Stats;
use tokio::time::Instant;

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map(|pages| pages * 4096)
        .unwrap_or(0)
}

async fn fan_out(waiters: usize, rounds: usize) -> Stats {
    let mut samples = Vec::new();
    for round in 0..rounds {
        let cell = StatusCell::default();
        let woken = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(tokio::sync::Notify::new());
        let mut handles = Vec::with_capacity(waiters);
        for i in 0..waiters {
            let (woken, done) = (woken.clone(), done.clone());
            if i % 2 == 0 {
                let (_, changed) = cell.current_status();
                handles.push(tokio::spawn(async move {
                    changed.await;
                    if woken.fetch_add(1, Ordering::SeqCst) + 1 == waiters {
                        done.notify_one();
                    }
                }));
            } else {
                let mut rx = cell.subscribe();
                rx.borrow_and_update();
                handles.push(tokio::spawn(async move {
                    let _ = rx.changed().await;
                    if woken.fetch_add(1, Ordering::SeqCst) + 1 == waiters {
                        done.notify_one();
                    }
                }));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await; // all parked
        let start = Instant::now();
        testing::set_status(
            &cell,
            LeaderStatus::NotLeading {
                leader: Some(format!("leader-{round}")),
            },
        );
        done.notified().await;
        samples.push(start.elapsed());
        for h in handles {
            let _ = h.await;
        }
    }
    Stats::of(samples)
}

async fn memory_per_elector(n: usize) -> f64 {
    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    // Warm up allocator and runtime with a few electors first.
    let warm: Vec<Elector> = (0..100)
        .map(|i| spawn_elector(&store, &format!("warm-{i}")))
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = rss_bytes();
    let electors: Vec<Elector> = (0..n)
        .map(|i| spawn_elector(&store, &format!("mem-{i}")))
        .collect();
    // Let every elector acquire its lease and settle into the renew loop.
    loop {
        let leading = electors.iter().filter(|e| e.is_leading()).count();
        if leading == n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_bytes();
    drop(electors);
    drop(warm);
    (after.saturating_sub(before)) as f64 / n as f64
}

fn spawn_elector(store: &DynLeaseStore, key: &str) -> Elector {
    let cfg = ElectorConfig::new(LeaseKey::new(key).expect("valid key"), "bench");
    Elector::spawn(store.clone(), cfg).expect("valid config")
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    leasehold_test_support::harness::bench_main(|| async {
        (
            "memory store".to_owned(),
            Arc::new(MemoryStore::new()) as DynLeaseStore,
        )
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let fan = fan_out(10_000, if quick { 3 } else { 10 }).await;
        println!("status fan-out (10,000 waiters, half current_status, half subscribe): {fan}");
        let per = memory_per_elector(10_000).await;
        println!(
            "memory: {:.0} bytes ({:.2} KiB) RSS per elector on a distinct lease (10,000 electors, memory store included)",
            per,
            per / 1024.0
        );
    });
}
