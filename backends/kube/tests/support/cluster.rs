//! Stores on real clusters: a kubeconfig named by environment variables, or (feature `k3s`) a
//! K3s container.

use std::sync::Arc;
use std::time::Duration;

use leasehold_kube::{KubeStore, KubeStoreConfig};

/// The kubeconfig file of an existing cluster to run the suite against.
pub const KUBECONFIG_VAR: &str = "LEASEHOLD_KUBECONFIG";
/// The namespace on that cluster (must exist; the credentials need get, list, watch, create,
/// update and delete on leases there).
pub const NAMESPACE_VAR: &str = "LEASEHOLD_KUBE_NAMESPACE";

/// The store settings for real clusters: a request timeout below the conformance suite's 1 s
/// renew deadline.
pub fn cluster_config(namespace: &str) -> KubeStoreConfig {
    KubeStoreConfig::default()
        .namespace(namespace)
        .request_timeout(Duration::from_millis(900))
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

/// Calls `$body!(case)` for every case of the shared conformance suite (the list in
/// `leasehold::conformance_suite!`; keep in step with it).
#[macro_export]
macro_rules! for_each_conformance_case {
    ($body:ident) => {
        $body!(
            store_create_get_update_delete,
            store_create_existing_fails,
            store_stale_versions_conflict,
            store_concurrent_updates_one_wins,
            store_concurrent_creates_one_wins,
            store_watch_delivers_changes_in_order,
            store_watch_loses_nothing_after_get,
            store_watch_from_current_state,
            store_list_by_prefix,
            store_invalid_keys_rejected,
            store_unicode_and_max_length_round_trip,
            store_record_fields_round_trip,
            store_independent_keys_do_not_interfere,
            elector_single_candidate_acquires,
            elector_exactly_one_leader,
            elector_graceful_handover,
            elector_crash_takeover_after_expiry,
            elector_renew_failure_steps_down_first,
            elector_fencing_token_increases,
            elector_release_after_leader_tasks,
            elector_yield,
            elector_followers_see_leader,
            elector_watching_follower_is_quiet
        );
    };
}
