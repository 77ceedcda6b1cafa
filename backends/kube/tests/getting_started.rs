//! Runs the getting-started example (`examples/kube.rs`) as a user would, against the test
//! Lease API server through a temporary kubeconfig file (`KUBECONFIG`), and checks that it
//! shows a leader, a handover and a clean exit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

/// The example binary `name` that `cargo test` built next to this test binary
/// (`<target>/<profile>/examples/<name>`). `cargo test -p <crate>` builds it; a run narrowed with
/// `--test getting_started` alone does not rebuild it.
fn example_binary(name: &str, package: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // <target>/<profile>/deps/<this test> → <target>/<profile>/examples/<name>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in <target>/<profile>/deps");
    let bin = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "the example binary {} is missing: run `cargo test -p {package}`, which builds the \
         examples before the tests",
        bin.display()
    );
    bin
}

/// Runs `cmd`, killing it if it has not exited after `limit` (a hang guard, not a performance
/// bound), and returns its exit status and output.
fn run(mut cmd: Command, limit: Duration) -> (std::process::ExitStatus, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the example");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the example") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let mut out = String::new();
            if let Some(mut s) = child.stdout.take() {
                let _ = s.read_to_string(&mut out);
            }
            panic!("the example did not exit within {limit:?}; its output:\n{out}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut out, mut err) = (String::new(), String::new());
    if let Some(mut s) = child.stdout.take() {
        s.read_to_string(&mut out).expect("read stdout");
    }
    if let Some(mut s) = child.stderr.take() {
        s.read_to_string(&mut err).expect("read stderr");
    }
    (status, format!("{out}{err}"))
}

/// Checks that the example's output shows a leader with its fencing token, a handover to the
/// other candidate with a larger token, and a clean end.
fn assert_leader_and_handover(status: std::process::ExitStatus, output: &str) {
    println!("{output}");
    assert!(status.success(), "the example failed ({status}):\n{output}");
    let leads: Vec<(&str, u64)> = output
        .lines()
        .filter_map(|l| {
            let (name, token) = l.split_once(" leads with fencing token ")?;
            Some((name, token.trim().parse().ok()?))
        })
        .collect();
    assert_eq!(leads.len(), 2, "two terms, one per candidate:\n{output}");
    assert_ne!(
        leads[0].0, leads[1].0,
        "the other candidate took over:\n{output}"
    );
    assert!(
        leads[1].1 > leads[0].1,
        "the fencing token grew across the handover:\n{output}"
    );
    assert!(
        output.contains(&format!("handover done: {} leads now", leads[1].0)),
        "{output}"
    );
    assert!(
        output.contains(&format!("{} stopped leading", leads[0].0)),
        "{output}"
    );
    assert!(output.contains("all candidates stopped"), "{output}");
}
