//! Used by the store crates' `tests/getting_started.rs`: finds the
//! getting-started example binary that `cargo test` built, runs it with a hang guard, and checks
//! that its output shows a leader, a graceful handover to the other candidate and a clean exit.
//! Every store's example prints the same lines, so one check serves them all.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The example binary `name` that `cargo test` built next to this test binary
/// (`<target>/<profile>/examples/<name>`). `cargo test -p <crate>` builds it; a run narrowed with
/// `--test getting_started` alone does not rebuild it.
pub fn example_binary(name: &str, package: &str) -> PathBuf {
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
pub fn run(mut cmd: Command, limit: Duration) -> (std::process::ExitStatus, String) {
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
pub fn assert_leader_and_handover(status: std::process::ExitStatus, output: &str) {
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
