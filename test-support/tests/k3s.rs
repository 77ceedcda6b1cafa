//! Feature `k3s` of this crate: the shared conformance suite against leasehold-kube's store on
//! K3s in a container (testcontainers).
//!
//! Needs a Docker engine; UNVERIFIED on the development machines (they have none). CI only
//! compiles it (`cargo clippy --all-features`). Run it with
//! `cargo test -p leasehold-test-support --features k3s --test k3s`.
#![cfg(feature = "k3s")]

use std::sync::Arc;

use leasehold_kube::KubeStore;
use leasehold_test_support::kube_cluster::{client_from_kubeconfig, cluster_config};
use testcontainers_modules::k3s::{K3s, KUBE_SECURE_PORT};
use testcontainers_modules::testcontainers::ImageExt;
use testcontainers_modules::testcontainers::runners::AsyncRunner;

/// Starts K3s once, then runs every conformance case against it, in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k3s_conformance_suite() {
    let conf_dir = std::env::temp_dir().join(format!("leasehold-k3s-{}", std::process::id()));
    std::fs::create_dir_all(&conf_dir).expect("a temp dir for the K3s kubeconfig");
    let container = K3s::default()
        .with_conf_mount(&conf_dir)
        .with_privileged(true)
        .with_userns_mode("host")
        .start()
        .await
        .expect("start K3s (needs a running Docker engine)");
    let yaml = container
        .image()
        .read_kube_config()
        .expect("K3s kubeconfig");
    let port = container
        .get_host_port_ipv4(KUBE_SECURE_PORT)
        .await
        .expect("K3s API port");
    // The kubeconfig names the container's own port; use the port mapped on 127.0.0.1.
    let yaml = yaml.replace(
        "https://127.0.0.1:6443",
        &format!("https://127.0.0.1:{port}"),
    );
    let client = client_from_kubeconfig(&yaml).await;
    let store: leasehold::DynLeaseStore =
        Arc::new(KubeStore::new(client, cluster_config("default")).expect("store"));
    macro_rules! run_all {
        ($($case:ident),* $(,)?) => {
            $(
                eprintln!("k3s: {}", stringify!($case));
                leasehold::conformance::$case(store.clone()).await;
            )*
        };
    }
    leasehold::for_each_conformance_case!(run_all);
    drop(container);
    let _ = std::fs::remove_dir_all(&conf_dir);
}
