//! Stores on real Kubernetes clusters: a kubeconfig named by environment variables
//! (leasehold-kube's opt-in `tests/cluster.rs`), or K3s in a container (this crate's
//! `tests/k3s.rs`, feature `k3s`).
//!
//! A kube-apiserver control plane started by the tests themselves belongs here too.

use std::sync::Arc;

use leasehold_kube::{KubeConfig, KubeStore};

/// The kubeconfig file of an existing cluster to run the suite against.
pub const KUBECONFIG_VAR: &str = "LEASEHOLD_KUBECONFIG";
/// The namespace on that cluster (must exist; the credentials need get, list, watch, create,
/// update and delete on leases there).
pub const NAMESPACE_VAR: &str = "LEASEHOLD_KUBE_NAMESPACE";

/// The store settings for real clusters: an operation timeout below the conformance suite's 1 s
/// renew deadline.
pub fn cluster_config(namespace: &str) -> KubeConfig {
    KubeConfig::new()
        .with_namespace(namespace)
        .with_operation_timeout(crate::TEST_OPERATION_TIMEOUT)
}

/// A client from kubeconfig YAML.
pub async fn client_from_kubeconfig(yaml: &str) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(yaml).expect("a valid kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("a usable kubeconfig context");
    kube::Client::try_from(config).expect("a kube client")
}

/// The store on the cluster named by the environment, or `None` when the variables are unset.
///
/// # Panics
/// When only one of the variables is set, or the kubeconfig cannot be read.
pub async fn store_from_env() -> Option<leasehold::DynLeaseStore> {
    let path = std::env::var(KUBECONFIG_VAR).ok();
    let ns = std::env::var(NAMESPACE_VAR).ok();
    let (path, ns) = match (path, ns) {
        (None, None) => return None,
        (Some(p), Some(n)) => (p, n),
        _ => panic!("set both {KUBECONFIG_VAR} and {NAMESPACE_VAR} (or neither)"),
    };
    let yaml = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {KUBECONFIG_VAR}={path}: {e}"));
    let client = client_from_kubeconfig(&yaml).await;
    Some(Arc::new(
        KubeStore::new(client, cluster_config(&ns)).expect("valid store config"),
    ))
}
