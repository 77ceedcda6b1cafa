//! Runs the getting-started example (`examples/redis.rs`) as a user would, against a real
//! redis-server on a free port, and checks that it shows a leader, a handover and a clean exit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use leasehold_test_support::getting_started::{assert_leader_and_handover, example_binary, run};
use leasehold_test_support::redis as common;

#[test]
fn the_getting_started_example_leads_and_hands_over() {
    let bin = example_binary("redis", "leasehold-redis");
    let srv = common::Server::start();
    let mut cmd = Command::new(bin);
    cmd.env("LEASEHOLD_REDIS_URL", srv.url());
    let (status, output) = run(cmd, Duration::from_secs(120));
    assert_leader_and_handover(status, &output);
    assert!(
        output.contains(&format!("connected to {}", srv.url())),
        "{output}"
    );
}
