//! OPT-IN EXTRA: the shared conformance suite against an existing Kubernetes cluster.
//!
//! Runs only when `LEASEHOLD_KUBECONFIG` (a kubeconfig file) and `LEASEHOLD_KUBE_NAMESPACE` (an
//! existing namespace) are set; otherwise each case prints that it was not run and passes. The
//! suite that always runs is `tests/conformance.rs`, against the test Lease API server.
//!
//! ```sh
//! LEASEHOLD_KUBECONFIG=$HOME/.kube/config LEASEHOLD_KUBE_NAMESPACE=leasehold-test \
//!   cargo test -p leasehold-kube --test cluster
//! ```

mod support;

macro_rules! cluster_cases {
    ($($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some(store) = support::cluster::store_from_env().await else {
                    eprintln!(
                        "not run: set {} and {} to run the conformance suite against a real cluster",
                        support::cluster::KUBECONFIG_VAR,
                        support::cluster::NAMESPACE_VAR,
                    );
                    return;
                };
                leasehold::conformance::$case(store).await;
            }
        )*
    };
}

/// The cases, named `opt_in_real_cluster::<case>` in the test output so that a run without the
/// variables is plainly not a cluster run.
mod opt_in_real_cluster {
    use super::support;

    crate::for_each_conformance_case!(cluster_cases);
}
