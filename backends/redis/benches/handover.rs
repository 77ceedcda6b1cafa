//! The handover harness (`leasehold_test_support::harness`) against a real redis-server started on a
//! free loopback port (or `LEASEHOLD_REDIS_URL`).
//!
//! `cargo bench -p leasehold-redis --bench handover` (add `-- --quick` for fewer rounds).

#![allow(missing_docs)]

use leasehold_test_support::redis as common;

fn main() {
    leasehold_test_support::harness::bench_main(|| async {
        let what = format!("redis at {}", common::shared_url());
        // Below the harness's 600 ms renew deadline, which `Elector::spawn` checks.
        let timeout = std::time::Duration::from_millis(400);
        let store = common::store_at_with(&common::shared_url(), timeout).await;
        (what, std::sync::Arc::new(store) as leasehold::DynLeaseStore)
    });
}
