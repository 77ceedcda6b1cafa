//! Runs the getting-started example (`examples/kube.rs`) as a user would, against the test
//! Lease API server through a temporary kubeconfig file (`KUBECONFIG`), and checks that it
//! shows a leader, a handover and a clean exit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use leasehold_test_support::getting_started::{assert_leader_and_handover, example_binary, run};
use leasehold_test_support::lease_api as support;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_getting_started_example_leads_and_hands_over() {
    let bin = example_binary("kube", "leasehold-kube");
    let server = support::LeaseApiServer::start().await;
    let kubeconfig = std::env::temp_dir().join(format!(
        "leasehold-kube-getting-started-{}.yaml",
        std::process::id()
    ));
    std::fs::write(&kubeconfig, server.kubeconfig_yaml()).expect("write the kubeconfig");
    let mut cmd = Command::new(bin);
    cmd.env("KUBECONFIG", &kubeconfig);
    let (status, output) = tokio::task::spawn_blocking(move || run(cmd, Duration::from_secs(120)))
        .await
        .expect("run the example");
    let _ = std::fs::remove_file(&kubeconfig);
    assert_leader_and_handover(status, &output);
    assert!(
        output.contains(&format!("Leases in namespace {}", support::NAMESPACE)),
        "{output}"
    );
    assert!(
        server
            .get_raw(support::NAMESPACE, "getting-started")
            .is_some(),
        "the example's Lease is on the test server"
    );
}
