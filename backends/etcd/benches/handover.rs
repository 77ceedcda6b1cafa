//! The handover harness (`leasehold_test_support::harness`) against a real etcd started on free
//! loopback ports (or `LEASEHOLD_ETCD_ENDPOINTS`).
//!
//! `cargo bench -p leasehold-etcd --bench handover` (add `-- --quick` for fewer rounds).

#![allow(missing_docs)]

use std::sync::Arc;

use leasehold_test_support::etcd as common;

fn main() {
    leasehold_test_support::harness::bench_main(|| async {
        let what = format!("etcd at {:?}", common::shared_endpoints().await);
        // Below the harness's 600 ms renew deadline, which `Elector::spawn` checks.
        let timeout = std::time::Duration::from_millis(400);
        let store: leasehold::DynLeaseStore = Arc::new(common::shared_store_with(timeout).await);
        (what, store)
    });
}
