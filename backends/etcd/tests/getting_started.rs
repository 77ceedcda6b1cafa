//! Runs the getting-started example (`examples/etcd.rs`) as a user would, against a real etcd
//! on free ports, and checks that it shows a leader, a handover and a clean exit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use leasehold_test_support::etcd as common;
use leasehold_test_support::getting_started::{assert_leader_and_handover, example_binary, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_getting_started_example_leads_and_hands_over() {
    let bin = example_binary("etcd", "leasehold-etcd");
    let etcd = common::Etcd::start().await;
    let endpoints = etcd.endpoints().join(",");
    let mut cmd = Command::new(bin);
    cmd.env("LEASEHOLD_ETCD_ENDPOINTS", &endpoints);
    let (status, output) = tokio::task::spawn_blocking(move || run(cmd, Duration::from_secs(120)))
        .await
        .expect("run the example");
    assert_leader_and_handover(status, &output);
    assert!(
        output.contains(&format!("connected to etcd at {endpoints}")),
        "{output}"
    );
}
