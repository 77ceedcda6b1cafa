//! Getting started with leasehold on Redis: two candidates campaign for one lease, the leader
//! runs a task that prints its fencing token, then the leader shuts down and the other one takes
//! over (a graceful handover).
//!
//! Start a local Redis (`redis-server`, listening on 127.0.0.1:6379) and run:
//!
//! ```text
//! cargo run -p leasehold-redis --example redis
//! ```
//!
//! `LEASEHOLD_REDIS_URL` points it at another server (`redis://host:port/db`, or `rediss://`
//! for TLS).
//!
//! A program of your own needs these `[dependencies]`:
//!
//! ```toml
//! # Not on crates.io yet: paths into a checkout of this repository (here ../leasehold), or
//! # `git = "<this repository's URL>"` in place of each `path`.
//! leasehold = { path = "../leasehold" }
//! leasehold-redis = { path = "../leasehold/backends/redis" }
//! tokio = { version = "1.47", features = ["macros", "rt-multi-thread", "time"] }
//! ```

use std::sync::Arc;
use std::time::Duration;

use leasehold::{CancellationToken, Elector, ElectorConfig, LeaseKey, run_leader_tasks};
use leasehold_redis::{RedisConfig, RedisStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url =
        std::env::var("LEASEHOLD_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let config = RedisConfig::new(url)?
        .with_prefix("getting-started:")
        // Every store operation must end well within the elector's renew deadline (below).
        .with_operation_timeout(Duration::from_secs(2));
    let store = Arc::new(RedisStore::connect(config).await?);
    println!("connected to {}", store.config().redacted_url());

    let key = LeaseKey::new("example")?;
    let mut candidates = Vec::new();
    for name in ["alpha", "bravo"] {
        // Lease 4 s, renew deadline 3 s, retry every 500 ms (client-go's defaults are 15/10/2 s).
        let config = ElectorConfig::new(key.clone(), name).with_timings(
            Duration::from_secs(4),
            Duration::from_secs(3),
            Duration::from_millis(500),
        );
        let elector = Elector::spawn(store.clone(), config)?;
        // Leader-only work: started when this candidate leads, cancelled when it stops; it ends
        // when the elector stops (or when the token, unused here, is cancelled). `Elector` is a
        // cheap handle: clone it into the task.
        let tasks = tokio::spawn(run_leader_tasks(
            CancellationToken::new(),
            elector.clone(),
            move |leader| async move {
                println!("{name} leads with fencing token {}", leader.fencing_token());
                leader.cancelled().await;
                println!("{name} stopped leading");
            },
        ));
        candidates.push((name, elector, tasks));
    }

    println!("waiting for a leader (a lease key never used before is taken after 4 s)");
    let first = wait_for_leader(&candidates).await?;
    let (name, elector, _) = &candidates[first];
    println!("handover: {name} shuts down and releases the lease");
    elector.shutdown().await?;
    let second = wait_for_leader(&candidates).await?;
    println!("handover done: {} leads now", candidates[second].0);

    for (_, elector, tasks) in candidates {
        elector.shutdown().await?; // releases the lease if it holds it
        tasks.await?; // run_leader_tasks returns once its elector has stopped
    }
    println!("all candidates stopped");
    Ok(())
}

/// Waits (at most 30 s) until one of the candidates leads and returns its index.
async fn wait_for_leader<T>(
    candidates: &[(&str, Elector, T)],
) -> Result<usize, Box<dyn std::error::Error>> {
    for _ in 0..600 {
        if let Some(i) = candidates.iter().position(|(_, e, _)| e.is_leading()) {
            return Ok(i);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err("no candidate became leader within 30 s".into())
}
