//! OPT-IN: the shared conformance suite against an existing Kubernetes cluster.
//!
//! Compiled only with `--cfg leasehold_real_cluster`, so that a normal run never reports cases
//! that tested nothing. Once enabled, the variables `LEASEHOLD_KUBECONFIG` (a kubeconfig file)
//! and `LEASEHOLD_KUBE_NAMESPACE` (an existing namespace) are required; without them every case
//! fails saying so. The suite that always runs is `tests/conformance.rs`, against the test Lease
//! API server.
//!
//! ```sh
//! RUSTFLAGS="--cfg leasehold_real_cluster" \
//! LEASEHOLD_KUBECONFIG=$HOME/.kube/config LEASEHOLD_KUBE_NAMESPACE=leasehold-test \
//!   cargo test -p leasehold-kube --test cluster
//! ```
#![cfg(leasehold_real_cluster)]

use leasehold_test_support::lease_api as support;

async fn make_cluster_store() -> leasehold::DynLeaseStore {
    leasehold_test_support::kube_cluster::store_from_env()
        .await
        .unwrap_or_else(|| {
            panic!(
                "set {} and {} to run the conformance suite against a real cluster",
                leasehold_test_support::kube_cluster::KUBECONFIG_VAR,
                leasehold_test_support::kube_cluster::NAMESPACE_VAR,
            )
        })
}

leasehold::conformance_suite!(make_cluster_store);
leasehold::k0s_conformance_suite!(make_cluster_store);
