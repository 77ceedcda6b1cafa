//! The handover harness (`leasehold_test_support::harness`) against the in-repo Lease API server (the
//! kube-apiserver stand-in), through a real `kube::Client`.
//!
//! `cargo bench -p leasehold-kube --bench handover` (add `-- --quick` for fewer rounds).

#![allow(missing_docs)]

use leasehold_test_support::lease_api as support;

fn main() {
    leasehold_test_support::harness::bench_main(|| async {
        let what = "kube store against the test Lease API server".to_owned();
        // Below the harness's 600 ms renew deadline, which `Elector::spawn` checks.
        let config =
            support::test_config().with_operation_timeout(std::time::Duration::from_millis(400));
        let server = support::LeaseApiServer::start().await;
        let store = leasehold_kube::KubeStore::new(server.client(), config).expect("store");
        // The server's tasks run on the bench's runtime and stop with it.
        std::mem::forget(server);
        (what, std::sync::Arc::new(store) as leasehold::DynLeaseStore)
    });
}
