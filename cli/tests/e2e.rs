//! End-to-end tests of the `leasehold` binary: real `leasehold run` processes against real
//! redis-server and etcd, `status`/`watch`/`release` against Redis, etcd and the Lease API
//! server, and `/healthz` + `/metrics` over HTTP.
//!
//! The children of `leasehold run` are this test binary in child mode (see `cli/mod.rs`).
//! Measured times are printed (run with `--nocapture` to see them), never asserted against a
//! threshold.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cli;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use cli::*;
use leasehold_test_support::etcd as etcd_common;
use leasehold_test_support::lease_api as kube_support;
use leasehold_test_support::pki::Pki;
use leasehold_test_support::redis as redis_common;
use rustix::process::Signal;

/// Generous bounds for things that must happen (they fail the test only if never).
const LIMIT: Duration = Duration::from_secs(30);

/// Not a test: the recording child, when this binary is started as one (see `cli/mod.rs`).
#[test]
fn child_helper() {
    child_main();
}

fn etcd_url(etcd: &etcd_common::Etcd) -> String {
    let hosts: Vec<String> = etcd
        .endpoints()
        .iter()
        .map(|e| e.trim_start_matches("http://").to_owned())
        .collect();
    format!("etcd://{}", hosts.join(","))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// Three `leasehold run` processes: exactly one child at a time; SIGKILL of the leader's
/// leasehold kills its child at once (parent-death signal) and another child starts; SIGTERM
/// hands over in order; the child's exit code propagates.
fn handover_scenario(store: &str, env: &[(&str, &str)], label: &str) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("children.log");
    let lease = "e2e-handover";
    let mut runners: Vec<Runner> = ["a", "b", "c"]
        .iter()
        .map(|id| start_runner_env(dir.path(), store, lease, id, &[], env))
        .collect();
    let by_id = |runners: &mut Vec<Runner>, id: &str| -> usize {
        runners.iter().position(|r| r.id == id).unwrap()
    };

    // 1. One of them leads and runs its child.
    let (id1, tok1, _, pid1) =
        wait_until("the first child", LIMIT, || starts(&log).first().cloned());

    // 2. SIGKILL its leasehold: the child dies at once, another child starts after expiry.
    let i1 = by_id(&mut runners, &id1);
    let killed_at = mono_ns();
    kill(runners[i1].pid(), Signal::KILL);
    let gone_at = wait_until("the killed leasehold's child to die", LIMIT, || {
        process_gone(pid1).then(mono_ns)
    });
    assert_eq!(
        starts(&log).len(),
        1,
        "no other child may start before the killed leasehold's child is gone"
    );
    let (id2, tok2, started2, _) =
        wait_until("a second child", LIMIT, || starts(&log).get(1).cloned());
    assert_ne!(id2, id1);
    assert!(tok2 > tok1, "fencing tokens increase");

    // 3. SIGTERM the new leader's leasehold: its child stops, then it releases, and the third
    // starts.
    let i2 = by_id(&mut runners, &id2);
    let term_at = mono_ns();
    kill(runners[i2].pid(), Signal::TERM);
    let (id3, tok3, started3, _) =
        wait_until("a third child", LIMIT, || starts(&log).get(2).cloned());
    assert!(tok3 > tok2);
    let status2 = runners[i2].wait(LIMIT);
    assert_eq!(
        status2.code(),
        Some(0),
        "leasehold exits with its child's code (0 after SIGTERM); stderr:\n{}",
        runners[i2].stderr_text()
    );
    let stop2 = read_log(&log)
        .into_iter()
        .find_map(|r| match r {
            Rec::Stop { token, at, .. } if token == tok2 => Some(at),
            _ => None,
        })
        .expect("the SIGTERMed leader's child recorded its stop");

    // 4. The third child exits with 7 by itself: its leasehold releases and exits with 7.
    let i3 = by_id(&mut runners, &id3);
    std::fs::write(dir.path().join(format!("exit-{id3}")), "7").unwrap();
    let status3 = runners[i3].wait(LIMIT);
    assert_eq!(
        status3.code(),
        Some(7),
        "stderr:\n{}",
        runners[i3].stderr_text()
    );
    let stderr3 = runners[i3].stderr_text();
    assert!(stderr3.contains("campaigning for lease"), "{stderr3}");
    assert!(
        stderr3.contains("is held by"),
        "progress while waiting: {stderr3}"
    );

    assert_exclusive(&log, &[(tok1, gone_at)]);
    println!(
        "[{label}] SIGKILL of the leader's leasehold: its child was gone after {:.1} ms \
         (polled every 1 ms); the next child started {:.0} ms after the SIGKILL \
         (lease 2 s, renew deadline 1.5 s, retry 0.3 s)",
        ms(killed_at, gone_at),
        ms(killed_at, started2)
    );
    println!(
        "[{label}] SIGTERM handover: the next child started {:.1} ms after the old child \
         stopped ({:.1} ms after the SIGTERM)",
        ms(stop2, started3),
        ms(term_at, started3)
    );
}

#[test]
fn run_hands_over_on_redis() {
    let server = redis_common::Server::start();
    handover_scenario(&server.url(), &[], "redis");
}

#[test]
fn run_hands_over_on_etcd() {
    let rt = runtime();
    let etcd = rt.block_on(etcd_common::Etcd::start());
    handover_scenario(&etcd_url(&etcd), &[], "etcd");
}

#[test]
fn run_hands_over_on_the_lease_api_server() {
    let rt = runtime();
    let server = rt.block_on(kube_support::LeaseApiServer::start());
    let dir = tempfile::tempdir().unwrap();
    let config = kubeconfig(dir.path(), &server);
    let url = format!("kube://{}", kube_support::NAMESPACE);
    handover_scenario(&url, &[("KUBECONFIG", config.to_str().unwrap())], "kube");
    drop(server);
}

/// `--restart`: after the child exits by itself, leasehold releases, campaigns again and runs
/// it again in a new term; SIGTERM then ends it with the child's code.
#[test]
fn run_restarts_the_command_with_restart() {
    let server = redis_common::Server::start();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("children.log");
    let mut runner = start_runner(
        dir.path(),
        &server.url(),
        "e2e-restart",
        "r",
        &["--restart"],
    );
    let (_, tok1, _, _) = wait_until("the first child", LIMIT, || starts(&log).first().cloned());
    std::fs::write(dir.path().join("exit-r"), "3").unwrap();
    let (_, tok2, _, _) = wait_until("the restarted child", LIMIT, || {
        starts(&log).get(1).cloned()
    });
    assert!(tok2 > tok1, "a new term: {tok1} then {tok2}");
    kill(runner.pid(), Signal::TERM);
    let status = runner.wait(LIMIT);
    assert_eq!(status.code(), Some(0), "{}", runner.stderr_text());
    assert_exclusive(&log, &[]);
    assert!(
        runner.stderr_text().contains("campaigning again"),
        "{}",
        runner.stderr_text()
    );
}

/// The leading leasehold and its child are SIGSTOPped past the lease: the shim's watchdog
/// (not paused) kills the stopped child before another child starts; after SIGCONT leasehold
/// exits with 75.
fn pause_scenario(store: &str, label: &str) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("children.log");
    let lease = "e2e-pause";
    let mut runners: Vec<Runner> = ["p", "q"]
        .iter()
        .map(|id| start_runner(dir.path(), store, lease, id, &[]))
        .collect();
    let (id1, tok1, _, pid1) =
        wait_until("the first child", LIMIT, || starts(&log).first().cloned());
    let i1 = runners.iter().position(|r| r.id == id1).unwrap();
    let stopped_at = mono_ns();
    kill(runners[i1].pid(), Signal::STOP);
    kill(pid1, Signal::STOP);
    let mut gone_at = None;
    let (_, tok2, started2, _) =
        wait_until("the other child, after the lease expired", LIMIT, || {
            let next = starts(&log).get(1).cloned();
            if gone_at.is_none() && process_gone(pid1) {
                gone_at = Some(mono_ns());
            }
            next
        });
    assert!(tok2 > tok1);
    assert!(
        process_gone(pid1),
        "the paused leader's stopped child must be dead once another child has started"
    );
    kill(runners[i1].pid(), Signal::CONT);
    let status = runners[i1].wait(LIMIT);
    let err = runners[i1].stderr_text();
    assert_eq!(
        status.code(),
        Some(75),
        "a lost lease exits with 75; stderr:\n{err}"
    );
    assert!(
        err.contains("deadline passed") || err.contains("the lease was lost"),
        "{err}"
    );
    println!(
        "[{label}] SIGSTOP of the leader (leasehold and child): the stopped child was seen gone \
         {:.0} ms after the stop (polled every 1 ms; lease 2 s, renew deadline 1.5 s), the \
         other child started {:.0} ms after the stop",
        gone_at.map_or(f64::NAN, |g| ms(stopped_at, g)),
        ms(stopped_at, started2),
    );
    drop(runners);
}

/// Only the leading `leasehold` is SIGSTOPped (its command runs on, writing every 5 ms): the
/// shim's watchdog stops the command when the term's deadline passes, so the command writes
/// nothing after another holder's command started, and is gone by then. After SIGCONT
/// leasehold exits with 75.
fn pause_leasehold_alone_scenario(store: &str, label: &str) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("children.log");
    let lease = "e2e-pause-alone";
    let env = [("LEASEHOLD_TEST_TICK_MS", "5")];
    let mut runners: Vec<Runner> = ["s", "t"]
        .iter()
        .map(|id| start_runner_env(dir.path(), store, lease, id, &[], &env))
        .collect();
    let (id1, tok1, _, pid1) =
        wait_until("the first child", LIMIT, || starts(&log).first().cloned());
    let i1 = runners.iter().position(|r| r.id == id1).unwrap();
    let stopped_at = mono_ns();
    kill(runners[i1].pid(), Signal::STOP);
    let (_, tok2, started2, _) =
        wait_until("the other child, after the lease expired", LIMIT, || {
            starts(&log).get(1).cloned()
        });
    assert!(tok2 > tok1);
    assert!(
        process_gone(pid1),
        "the paused leasehold's command must be dead once another child has started"
    );
    let recs = read_log(&log);
    let last1 = assert_silent_after(&recs, tok1, started2);
    let ticks1 = recs
        .iter()
        .filter(|r| matches!(r, Rec::Tick { token, .. } if *token == tok1))
        .count();
    assert!(ticks1 > 0, "the old command ran and wrote: {recs:#?}");
    kill(runners[i1].pid(), Signal::CONT);
    let status = runners[i1].wait(LIMIT);
    let err = runners[i1].stderr_text();
    assert_eq!(
        status.code(),
        Some(75),
        "a lost lease exits with 75; stderr:\n{err}"
    );
    println!(
        "[{label}] SIGSTOP of the leader's leasehold alone: its command's last write was \
         {:.0} ms after the stop and {:.0} ms before the other child started (lease 2 s, \
         renew deadline 1.5 s; CLOCK_MONOTONIC stamps)",
        ms(stopped_at, last1),
        ms(last1, started2),
    );
    drop(runners);
}

#[test]
fn run_stops_the_command_of_a_paused_leasehold_on_redis() {
    let server = redis_common::Server::start();
    pause_leasehold_alone_scenario(&server.url(), "redis");
}

#[test]
fn run_stops_the_command_of_a_paused_leasehold_on_etcd() {
    let rt = runtime();
    let etcd = rt.block_on(etcd_common::Etcd::start());
    pause_leasehold_alone_scenario(&etcd_url(&etcd), "etcd");
}

#[test]
fn run_kills_the_stopped_child_of_a_paused_leader_on_redis() {
    let server = redis_common::Server::start();
    pause_scenario(&server.url(), "redis");
}

#[test]
fn run_kills_the_stopped_child_of_a_paused_leader_on_etcd() {
    let rt = runtime();
    let etcd = rt.block_on(etcd_common::Etcd::start());
    pause_scenario(&etcd_url(&etcd), "etcd");
}

/// Runs `leasehold ARGS` to completion, returning (code, stdout, stderr).
fn leasehold(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(leasehold_bin())
        .args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run leasehold");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect()
}

#[test]
fn usage_errors_and_unreachable_stores_have_their_exit_codes() {
    let (code, _, err) = leasehold(&["status", "--store", "ftp://x", "--lease", "a"], &[]);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("Accepted store URLs"), "{err}");
    let port = redis_common::free_port().to_string();
    let url = format!("redis://127.0.0.1:{port}");
    let (code, _, err) = leasehold(&["status", "--store", &url, "--lease", "a"], &[]);
    assert_eq!(code, 69, "{err}");
    // A prefix the store refuses is a usage error about the URL, not a connection failure.
    for (bad, says) in [("a{b}", "prefix"), ("", "the prefix is empty")] {
        let with_prefix = format!("{url}?prefix={bad}");
        let (code, _, err) = leasehold(&["status", "--store", &with_prefix, "--lease", "a"], &[]);
        assert_eq!(code, 64, "{err}");
        assert!(
            err.contains(says) && !err.contains("cannot connect"),
            "{err}"
        );
        let etcd = format!("etcd://127.0.0.1:{port}?prefix={bad}");
        if bad.is_empty() {
            let (code, _, err) = leasehold(&["status", "--store", &etcd, "--lease", "a"], &[]);
            assert_eq!(code, 64, "{err}");
            assert!(err.contains(says), "{err}");
        }
    }
    let url = format!("etcd://127.0.0.1:{port}");
    let (code, _, err) = leasehold(&["status", "--store", &url, "--lease", "a"], &[]);
    assert_eq!(code, 69, "{err}");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: t\n  cluster:\n    server: http://127.0.0.1:{port}\n\
             contexts:\n- name: t\n  context:\n    cluster: t\n    user: t\ncurrent-context: t\n\
             users:\n- name: t\n  user:\n    token: x\n"
        ),
    )
    .unwrap();
    let env = [("KUBECONFIG", kubeconfig.to_str().unwrap())];
    let (code, _, err) = leasehold(
        &["status", "--store", "kube://default", "--lease", "a"],
        &env,
    );
    assert_eq!(code, 69, "{err}");
    assert!(err.contains("unavailable"), "{err}");
    let (code, _, err) = leasehold(
        &["run", "--store", "memory://", "--lease", "a", "--", "true"],
        &[],
    );
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("demo"), "{err}");
    let (code, _, err) = leasehold(
        &["run", "--lease", "a", "--store", "redis://h", "true"],
        &[],
    );
    assert_eq!(code, 64, "clap errors are usage errors: {err}");
}

#[test]
fn help_documents_exit_codes_and_url_forms() {
    for sub in [
        &["--help"][..],
        &["run", "--help"],
        &["status", "--help"],
        &["release", "--help"],
    ] {
        let (code, out, _) = leasehold(sub, &[]);
        assert_eq!(code, 0);
        assert!(out.contains("Exit codes:") && out.contains("75"), "{out}");
        assert!(out.contains("etcd://"), "{out}");
    }
    let (_, out, _) = leasehold(&["run", "--help"], &[]);
    for s in [
        "LEASEHOLD_FENCING_TOKEN",
        "SIGTERM",
        "--grace",
        "supervisor",
    ] {
        assert!(out.contains(s), "{s}: {out}");
    }
}

/// A process killed when the test ends, also when it fails (an orphaned `watch` would hold
/// the test's output pipe open).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn record(holder: &str, token: u64) -> leasehold::LeaseRecord {
    leasehold::LeaseRecord {
        holder_identity: holder.to_owned(),
        lease_duration: Duration::from_secs(15),
        acquire_time: Some(std::time::SystemTime::now()),
        renew_time: Some(std::time::SystemTime::now()),
        transitions: token,
    }
}

/// `status`, `watch` and `release` against `url`, with the record written by `store` (the
/// same store, reached from the test).
fn inspect_scenario(
    rt: &tokio::runtime::Runtime,
    store: leasehold::DynLeaseStore,
    url: &str,
    env: &[(&str, &str)],
    label: &str,
) {
    let lease = "e2e-inspect";
    let key = leasehold::LeaseKey::new(lease).unwrap();
    let v1 = rt
        .block_on(store.create(&key, &record("holder-x", 5)))
        .unwrap();

    // status, one lease and by prefix.
    let (code, out, err) = leasehold(&["status", "--store", url, "--lease", lease, "--json"], env);
    assert_eq!(code, 0, "{err}");
    let j = &json_lines(&out)[0];
    assert_eq!(j["holder"], "holder-x", "{j}");
    assert_eq!(j["fencing_token"], 5, "{j}");
    assert_eq!(j["exists"], true, "{j}");
    assert_eq!(j["looks_expired"], false, "{j}");
    assert_eq!(j["expiry_judged_from"], "record timestamps", "{j}");
    assert_eq!(j["lease_duration_seconds"], 15.0, "{j}");
    let (code, out, err) = leasehold(
        &["status", "--store", url, "--prefix", "e2e-", "--json"],
        env,
    );
    assert_eq!(code, 0, "{err}");
    let leases: Vec<_> = json_lines(&out)
        .into_iter()
        .map(|j| j["lease"].clone())
        .collect();
    assert!(leases.contains(&serde_json::json!(lease)), "{out}");
    let (code, out, err) = leasehold(&["status", "--store", url, "--lease", lease], env);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("holder-x") && out.contains("held"), "{out}");

    // watch: the current state, then a change of holder.
    let mut watch = KillOnDrop(
        Command::new(leasehold_bin())
            .args(["watch", "--store", url, "--lease", lease, "--json"])
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = watch.0.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let next = || -> serde_json::Value {
        let line = rx.recv_timeout(LIMIT).expect("a watch line");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    };
    let first = next();
    assert_eq!(first["holder"], "holder-x", "{first}");
    assert_eq!(first["event"], "put", "{first}");
    rt.block_on(store.update(&key, &record("holder-y", 6), &v1))
        .unwrap();
    let second = next();
    assert_eq!(second["holder"], "holder-y", "{second}");
    assert_eq!(second["fencing_token"], 6, "{second}");

    // release: refused without a terminal and without --yes; done with --yes.
    let (code, _, err) = leasehold(&["release", "--store", url, "--lease", lease], env);
    assert_eq!(code, 64, "{err}");
    assert!(err.contains("--yes"), "{err}");
    let (code, out, err) = leasehold(&["release", "--store", url, "--lease", lease, "--yes"], env);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("released lease"), "{out}");
    let third = next();
    assert_eq!(third["holder"], serde_json::Value::Null, "{third}");
    assert_eq!(third["fencing_token"], 6, "the token is kept: {third}");
    let (_, out, _) = leasehold(&["status", "--store", url, "--lease", lease, "--json"], env);
    assert_eq!(
        json_lines(&out)[0]["holder"],
        serde_json::Value::Null,
        "{out}"
    );

    // release --delete removes the record; watch reports it.
    let (code, out, err) = leasehold(
        &[
            "release", "--store", url, "--lease", lease, "--yes", "--delete",
        ],
        env,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("deleted lease"), "{out}");
    let fourth = next();
    assert_eq!(fourth["event"], "deleted", "{fourth}");
    let (_, out, _) = leasehold(&["status", "--store", url, "--lease", lease, "--json"], env);
    assert_eq!(json_lines(&out)[0]["exists"], false, "{out}");

    kill(watch.0.id(), Signal::TERM);
    let status = watch.0.wait().unwrap();
    assert_eq!(status.code(), Some(0), "watch ends cleanly on SIGTERM");
    reader.join().unwrap();
    println!("[{label}] status, watch and release work");
}

#[test]
fn status_watch_release_on_redis() {
    let server = redis_common::Server::start();
    let rt = runtime();
    let config = leasehold_redis::RedisConfig::new(server.url()).unwrap();
    let store = rt
        .block_on(leasehold_redis::RedisStore::connect(config))
        .unwrap();
    inspect_scenario(&rt, std::sync::Arc::new(store), &server.url(), &[], "redis");
    // A key holding something that is not a lease record.
    rt.block_on(redis_common::raw_cmd(
        &server.url(),
        redis::cmd("HSET")
            .arg("{leasehold:}rec:e2e-corrupt")
            .arg("d")
            .arg("garbage"),
    ));
    let (code, out, err) = leasehold(
        &[
            "status",
            "--store",
            &server.url(),
            "--lease",
            "e2e-corrupt",
            "--json",
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let j = &json_lines(&out)[0];
    assert!(j["corrupt"].is_string(), "{j}");
}

#[test]
fn status_watch_release_on_etcd() {
    let rt = runtime();
    let etcd = rt.block_on(etcd_common::Etcd::start());
    let store = rt
        .block_on(leasehold_etcd::EtcdStore::connect(etcd.config()))
        .unwrap();
    inspect_scenario(
        &rt,
        std::sync::Arc::new(store),
        &etcd_url(&etcd),
        &[],
        "etcd",
    );
}

/// A kubeconfig for the test Lease API server, with the admin token.
fn kubeconfig(dir: &Path, server: &kube_support::LeaseApiServer) -> std::path::PathBuf {
    kubeconfig_with_token(dir, server, kube_support::ADMIN_TOKEN)
}

/// A kubeconfig for the test Lease API server with `token`.
fn kubeconfig_with_token(
    dir: &Path,
    server: &kube_support::LeaseApiServer,
    token: &str,
) -> std::path::PathBuf {
    let path = dir.join(format!("kubeconfig-{token}"));
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n    namespace: default\n\
             current-context: test\nusers:\n- name: test\n  user:\n    token: {}\n",
            server.url(),
            token
        ),
    )
    .unwrap();
    path
}

#[test]
fn status_watch_release_on_the_lease_api_server() {
    let rt = runtime();
    let server = rt.block_on(kube_support::LeaseApiServer::start());
    let dir = tempfile::tempdir().unwrap();
    let config = kubeconfig(dir.path(), &server);
    let store = {
        let _guard = rt.enter();
        kube_support::store(&server)
    };
    let url = format!("kube://{}", kube_support::NAMESPACE);
    let env = [("KUBECONFIG", config.to_str().unwrap())];
    inspect_scenario(&rt, std::sync::Arc::new(store), &url, &env, "kube");
    drop(server);
}

/// `GET path` over plain HTTP/1.1; returns (status code, body).
fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(LIMIT)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

#[test]
fn run_serves_healthz_and_metrics() {
    let server = redis_common::Server::start();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("children.log");
    let lease = "e2e-http";
    let runner = start_runner(
        dir.path(),
        &server.url(),
        lease,
        "m",
        &["--http", "127.0.0.1:0"],
    );
    let addr = wait_until("the HTTP address on stderr", LIMIT, || {
        runner
            .stderr_text()
            .lines()
            .find_map(|l| l.split_once("on http://").map(|(_, a)| a.trim().to_owned()))
    });
    wait_until("the child", LIMIT, || starts(&log).first().cloned());
    let (code, body) = http_get(&addr, "/healthz");
    assert_eq!((code, body.trim()), (200, "ok"));
    // The library's metrics (feature `metrics`) and the command's own, once a renewal landed.
    let l = format!("lease=\"{lease}\"");
    let body = wait_until("a renewal in /metrics", LIMIT, || {
        let (code, body) = http_get(&addr, "/metrics");
        assert_eq!(code, 200, "{body}");
        body.contains(&format!("leasehold_renew_duration_seconds_count{{{l}}}"))
            .then_some(body)
    });
    for line in [
        format!("leasehold_leader_status{{{l}}} 1"),
        format!("leasehold_leader_transitions_total{{{l}}} 1"),
        format!("leasehold_acquire_duration_seconds_count{{{l}}} 1"),
        format!("leasehold_command_running{{{l}}} 1"),
        format!("leasehold_command_starts_total{{{l}}} 1"),
    ] {
        assert!(body.contains(&line), "{line} in:\n{body}");
    }
    // A store that stops answering: errors are counted by kind, the term is lost, the command
    // stopped, and leasehold exits with 75.
    server.pause();
    let body = wait_until("a store error in /metrics", LIMIT, || {
        let (_, body) = http_get(&addr, "/metrics");
        body.lines()
            .any(|m| {
                m.starts_with("leasehold_store_errors_total{")
                    && m.contains(&l)
                    && m.contains("store=\"redis\"")
            })
            .then_some(body)
    });
    assert!(
        body.contains(&format!("leasehold_leader_status{{{l}}} 0")) || body.contains("kind="),
        "{body}"
    );
    let (code, _) = http_get(&addr, "/nope");
    assert_eq!(code, 404);
    let mut runner = runner;
    let status = runner.wait(LIMIT);
    server.resume();
    assert_eq!(status.code(), Some(75), "{}", runner.stderr_text());
    assert!(
        runner.stderr_text().contains("the store is failing"),
        "{}",
        runner.stderr_text()
    );
}

#[test]
fn demo_shows_a_handover_and_a_crash_failover() {
    let (code, out, err) = leasehold(&["demo", "--lease-duration", "500ms"], &[]);
    assert_eq!(code, 0, "{err}");
    for s in [
        "graceful handover",
        "handover latency",
        "CRASHED",
        "failover latency",
        "summary:",
    ] {
        assert!(out.contains(s), "{s} in:\n{out}");
    }
    // Three terms, with fencing tokens that strictly increase (the store assigns them).
    let tokens: Vec<u64> = out
        .lines()
        .filter_map(|l| l.split("(fencing token ").nth(1))
        .filter_map(|t| t.trim_end_matches(')').parse().ok())
        .collect();
    assert_eq!(tokens.len(), 3, "three terms in:\n{out}");
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "increasing tokens in:\n{out}"
    );
    println!("{out}");
}

/// Missing RBAC: a token that may read leases but not create or update them. `run` exits with
/// 77 and says what is missing, instead of waiting forever.
#[test]
fn run_exits_on_missing_rbac() {
    let rt = runtime();
    let server = rt.block_on(kube_support::LeaseApiServer::start());
    server.add_token("read-only", "reader", &["get", "list", "watch"]);
    let dir = tempfile::tempdir().unwrap();
    let config = kubeconfig_with_token(dir.path(), &server, "read-only");
    let url = format!("kube://{}", kube_support::NAMESPACE);
    let mut runner = start_runner_env(
        dir.path(),
        &url,
        "e2e-rbac",
        "reader",
        &[],
        &[("KUBECONFIG", config.to_str().unwrap())],
    );
    let status = runner.wait(LIMIT);
    let err = runner.stderr_text();
    assert_eq!(status.code(), Some(77), "{err}");
    assert!(err.contains("forbidden") || err.contains("denied"), "{err}");
    assert!(starts(&dir.path().join("children.log")).is_empty());
    // A token that may not even read fails at once, before campaigning.
    server.add_token("nothing", "nobody", &[]);
    let config = kubeconfig_with_token(dir.path(), &server, "nothing");
    let env = [("KUBECONFIG", config.to_str().unwrap())];
    let (code, _, err) = leasehold(&["status", "--store", &url, "--lease", "e2e-rbac"], &env);
    assert_eq!(code, 77, "{err}");
    drop(server);
}

/// `rediss://` with --tls-ca, a client certificate (mutual TLS) and a password from
/// LEASEHOLD_PASSWORD; a wrong password exits 77 without printing it.
#[test]
fn tls_flags_and_passwords_on_rediss() {
    let pki = Pki::generate();
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let (ca, cert, key) = (
        file("ca.pem", &pki.ca_pem),
        file("server.pem", &pki.cert_pem),
        file("server.key", &pki.key_pem),
    );
    let (client_cert, client_key) = (
        file("client.pem", &pki.client_cert_pem),
        file("client.key", &pki.client_key_pem),
    );
    let server = redis_common::Server::start_with(
        &[
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            "yes",
            "--requirepass",
            "s3cret-horse",
        ],
        true,
    );
    let url = server.url();
    assert!(url.starts_with("rediss://"));
    let tls = [
        "--tls-ca",
        ca.as_str(),
        "--tls-cert",
        client_cert.as_str(),
        "--tls-key",
        client_key.as_str(),
    ];
    let status = |url: &str, tls: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["status", "--store", url, "--lease", "tls-lease", "--json"];
        args.extend_from_slice(tls);
        leasehold(&args, env)
    };
    let (code, out, err) = status(&url, &tls, &[("LEASEHOLD_PASSWORD", "s3cret-horse")]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json_lines(&out)[0]["exists"], false, "{out}");
    let with_pw = url.replacen("rediss://", "rediss://:s3cret-horse@", 1);
    let (code, _, err) = status(&with_pw, &tls, &[]);
    assert_eq!(code, 0, "the password in the URL: {err}");
    let (code, _, err) = status(&url, &tls, &[("LEASEHOLD_PASSWORD", "wrong-horse")]);
    assert_eq!(code, 77, "{err}");
    assert!(!err.contains("wrong-horse"), "the password leaked: {err}");
    // The advice names where the wrong password came from.
    assert!(
        err.contains("the password came from LEASEHOLD_PASSWORD")
            && !err.contains("in the redis URL"),
        "{err}"
    );
    let wrong_in_url = url.replacen("rediss://", "rediss://:wrong-horse@", 1);
    let (code, _, err) = status(&wrong_in_url, &tls, &[]);
    assert_eq!(code, 77, "{err}");
    assert!(
        err.contains("password in the store URL") && !err.contains("LEASEHOLD_PASSWORD,"),
        "{err}"
    );
    assert!(!err.contains("wrong-horse"), "the password leaked: {err}");
    let (code, _, err) = status(&url, &tls[..2], &[("LEASEHOLD_PASSWORD", "s3cret-horse")]);
    assert_ne!(
        code, 0,
        "without a client certificate the server refuses: {err}"
    );
    let (code, _, err) = status("redis://127.0.0.1:1", &tls, &[]);
    assert_eq!(code, 64, "TLS flags need a TLS URL: {err}");
}

/// A record written by another tool with the largest lease duration the format holds
/// (`leaseDurationSeconds: 18446744073709551615`): `status` (table and JSON) and `watch` show
/// it and exit 0 instead of panicking on the time arithmetic.
#[test]
fn status_and_watch_show_a_huge_lease_duration() {
    let server = redis_common::Server::start();
    let url = server.url();
    let lease = "e2e-huge";
    let rt = runtime();
    let data = format!(
        "{{\"holderIdentity\":\"other-tool\",\"leaseDurationSeconds\":{},\
         \"acquireTime\":\"2026-11-29T20:04:19.123456Z\",\
         \"renewTime\":\"2026-11-29T20:04:21.123456Z\",\"leaderTransitions\":4}}",
        u64::MAX
    );
    rt.block_on(redis_common::raw_cmd(
        &url,
        redis::cmd("HSET")
            .arg(format!("{{leasehold:}}rec:{lease}"))
            .arg("v")
            .arg("1")
            .arg("d")
            .arg(&data),
    ));
    let (code, out, err) = leasehold(
        &["status", "--store", &url, "--lease", lease, "--json"],
        &[],
    );
    assert_eq!(code, 0, "status --json: {err}");
    let j = &json_lines(&out)[0];
    assert_eq!(j["holder"], "other-tool", "{j}");
    assert_eq!(j["fencing_token"], 4, "{j}");
    assert_eq!(j["lease_duration_seconds"], u64::MAX as f64, "{j}");
    assert_eq!(j["looks_expired"], false, "{j}");
    let (code, out, err) = leasehold(&["status", "--store", &url, "--lease", lease], &[]);
    assert_eq!(code, 0, "status: {err}");
    assert!(out.contains("other-tool") && out.contains("held"), "{out}");
    for json in [true, false] {
        let mut args = vec!["watch", "--store", url.as_str(), "--lease", lease];
        if json {
            args.push("--json");
        }
        let mut watch = KillOnDrop(
            Command::new(leasehold_bin())
                .args(&args)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut first = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(watch.0.stdout.take().unwrap()),
            &mut first,
        )
        .unwrap();
        assert!(
            first.contains("other-tool"),
            "watch (json: {json}): {first:?}"
        );
        kill(watch.0.id(), Signal::TERM);
        let status = watch.0.wait().unwrap();
        assert_eq!(status.code(), Some(0), "watch (json: {json}) ends cleanly");
    }
}

/// `leasehold run` SIGKILLed while its command, a shell script, waits for a grandchild in the
/// same process group (a shell that ignores SIGTERM, running a foreground `sleep`, then writing
/// a file): the whole group dies with `leasehold`, so the grandchild never writes. The term's deadline (15 s) is
/// far beyond the grandchild's write (2 s): it is the death of `leasehold` that kills the
/// group, not the watchdog.
#[test]
fn run_killed_takes_the_commands_whole_group_with_it() {
    let server = redis_common::Server::start();
    let rt = runtime();
    let store = rt
        .block_on(leasehold_redis::RedisStore::connect(
            leasehold_redis::RedisConfig::new(server.url()).unwrap(),
        ))
        .unwrap();
    // A vacant record: taken at once (an absent one waits a lease duration).
    let vacant = leasehold::LeaseRecord {
        holder_identity: String::new(),
        ..record("", 1)
    };
    rt.block_on(leasehold::LeaseStore::create(
        &store,
        &leasehold::LeaseKey::new("e2e-group").unwrap(),
        &vacant,
    ))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let script = d.join("report.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n\
         echo $$ > \"$1/top.pid\"\n\
         sh -c 'trap \"\" TERM; echo $$ > \"$1/grand.pid.tmp\"; mv \"$1/grand.pid.tmp\" \"$1/grand.pid\"; \
         sleep 2; echo late >> \"$1/written\"' grandchild \"$1\"\n\
         echo done >> \"$1/written\"\n",
    )
    .unwrap();
    let stderr = d.join("leasehold.stderr");
    let mut run = KillOnDrop(
        Command::new(leasehold_bin())
            .args(["run", "--store", &server.url(), "--lease", "e2e-group"])
            .args(["--identity", "g"])
            .args(["--lease-duration", "20s", "--renew-deadline", "15s"])
            .args(["--retry-period", "1s"])
            .arg("--")
            .arg("sh")
            .arg(&script)
            .arg(d)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap(),
    );
    let pid_in = |name: &str| -> Option<u32> {
        std::fs::read_to_string(d.join(name))
            .ok()
            .and_then(|p| p.trim().parse().ok())
    };
    let (top, grand) = wait_until("the script and its grandchild", LIMIT, || {
        Some((pid_in("top.pid")?, pid_in("grand.pid")?))
    });
    let killed_at = mono_ns();
    kill(run.0.id(), Signal::KILL);
    let _ = run.0.wait();
    // Bounded: without the group kill the grandchild lives on for its 2 s and writes.
    let gone_at = wait_until("the script and its grandchild to be gone", LIMIT, || {
        (process_gone(top) && process_gone(grand)).then(mono_ns)
    });
    assert!(
        !d.join("written").exists(),
        "a process of the killed leasehold's command wrote after the SIGKILL: {:?}; stderr:\n{}",
        std::fs::read_to_string(d.join("written")),
        std::fs::read_to_string(&stderr).unwrap_or_default()
    );
    println!(
        "SIGKILL of leasehold: its command's script and grandchild were gone {:.1} ms after \
         (polled every 1 ms)",
        ms(killed_at, gone_at)
    );
}

/// A TCP proxy the test can cut: every connection through it is shut down, and new ones are
/// closed at once.
struct Proxy {
    port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Proxy {
    fn start(upstream_port: u16) -> Proxy {
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (cut2, conns2) = (cut.clone(), conns.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if cut2.load(Ordering::SeqCst) {
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    continue;
                }
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", upstream_port)) else {
                    continue;
                };
                let mut list = conns2.lock().unwrap();
                list.push(client.try_clone().unwrap());
                list.push(server.try_clone().unwrap());
                drop(list);
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Proxy { port, cut, conns }
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        for c in self.conns.lock().unwrap().iter() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// An ordered stop whose grace outlives the term: lease 2 s, renew deadline 1.5 s,
/// `--grace 20s`, a command that ignores SIGTERM, and the leader's connection to the store cut
/// right after its SIGTERM. The term's deadline passes during the grace, and the command is
/// killed within the lost-term grace (lease − renew deadline) of it: it is dead, and wrote
/// nothing, before the next holder's command starts.
#[test]
fn run_stop_grace_ends_with_the_term() {
    let server = redis_common::Server::start();
    let proxy = Proxy::start(server.port);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("children.log");
    let lease = "e2e-stop-grace";
    let env = [
        ("LEASEHOLD_TEST_TICK_MS", "5"),
        ("LEASEHOLD_TEST_IGNORE_TERM", "1"),
    ];
    let through_proxy = format!("redis://127.0.0.1:{}", proxy.port);
    let mut leader = start_runner_env(
        dir.path(),
        &through_proxy,
        lease,
        "old",
        &["--grace", "20s"],
        &env,
    );
    let (_, tok1, _, pid1) = wait_until("the first child", LIMIT, || starts(&log).first().cloned());
    let _next = start_runner_env(dir.path(), &server.url(), lease, "new", &[], &env);
    // Renewals move the term's deadline in the shim: the leader's command runs on past twice
    // the renew deadline (and the follower sees the renewals).
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        !process_gone(pid1) && !read_log(&log).iter().any(|r| matches!(r, Rec::Term { .. })),
        "a renewing leader's command must run on; leasehold:\n{}",
        leader.stderr_text()
    );
    let term_at = mono_ns();
    kill(leader.pid(), Signal::TERM);
    wait_until("the old child to get SIGTERM", LIMIT, || {
        read_log(&log)
            .iter()
            .any(|r| matches!(r, Rec::Term { token, .. } if *token == tok1))
            .then_some(())
    });
    proxy.cut();
    let cut_at = mono_ns();
    let (_, tok2, started2, _) = wait_until("the next holder's child", LIMIT, || {
        starts(&log).get(1).cloned()
    });
    assert!(tok2 > tok1);
    assert!(
        process_gone(pid1),
        "the old command must be dead once the next holder's command started; old leasehold:\n{}",
        leader.stderr_text()
    );
    let recs = read_log(&log);
    let last1 = assert_silent_after(&recs, tok1, started2);
    let status = leader.wait(LIMIT);
    let err = leader.stderr_text();
    assert_eq!(
        status.code(),
        Some(75),
        "the term was lost during the stop:\n{err}"
    );
    println!(
        "stop grace 20 s with the store cut {:.0} ms after the SIGTERM: the old command's last \
         write was {:.0} ms after the cut, {:.0} ms before the next holder's command started \
         (lease 2 s, renew deadline 1.5 s)",
        ms(term_at, cut_at),
        ms(cut_at, last1),
        ms(last1, started2)
    );
}

/// The command's exit status reaches `leasehold`'s exit code through the shim: its code, 128+N
/// when signal N killed it, 127 when it does not exist.
#[test]
fn run_exits_with_the_commands_status() {
    let server = redis_common::Server::start();
    let url = server.url();
    for (i, (cmd, code)) in [
        (&["sh", "-c", "exit 7"][..], 7),
        (&["sh", "-c", "kill -USR1 $$"][..], 128 + 10),
        (&["/nonexistent/leasehold-test-command"][..], 127),
    ]
    .into_iter()
    .enumerate()
    {
        let lease = format!("e2e-status-{i}");
        let mut args = vec!["run", "--store", url.as_str(), "--lease", lease.as_str()];
        args.extend(TIMINGS);
        args.push("--");
        args.extend(cmd);
        let (got, _, err) = leasehold(&args, &[]);
        assert_eq!(got, code, "{cmd:?}: {err}");
        if code == 128 + 10 {
            assert!(err.contains("killed by signal 10"), "{err}");
        }
    }
}

/// A command that exits (code 3) leaving a grandchild in its process group that ignores
/// SIGTERM and would write a file after 2 s: the rest of the group gets SIGTERM, then SIGKILL
/// after `--grace` (200 ms), before `leasehold` exits with the command's code.
#[test]
fn run_reaps_what_the_command_left_in_its_group() {
    let server = redis_common::Server::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_owned();
    let script = "sh -c 'trap \"\" TERM; echo $$ > \"$0/grand.pid\"; sleep 2; \
                  echo late > \"$0/written\"' \"$0\" &\n\
                  while [ ! -s \"$0/grand.pid\" ]; do sleep 0.01; done; exit 3";
    let url = server.url();
    let mut args = vec![
        "run",
        "--store",
        url.as_str(),
        "--lease",
        "e2e-reap",
        "--grace",
        "200ms",
    ];
    args.extend(TIMINGS);
    args.extend(["--", "sh", "-c", script, d.as_str()]);
    let (code, _, err) = leasehold(&args, &[]);
    assert_eq!(code, 3, "{err}");
    let grand: u32 = std::fs::read_to_string(dir.path().join("grand.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        process_gone(grand),
        "the grandchild outlived leasehold: {err}"
    );
    assert!(!dir.path().join("written").exists(), "{err}");
}

/// An ordered stop while the store answers: renewals keep moving the term's deadline in the
/// supervisor, so a command that ignores SIGTERM gets the whole `--grace` (3 s, longer than
/// the renew deadline plus the lost-term grace) before its SIGKILL, and `leasehold` exits with
/// 137.
#[test]
fn run_ordered_stop_keeps_the_whole_grace_while_renewing() {
    let server = redis_common::Server::start();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("children.log");
    let env = [
        ("LEASEHOLD_TEST_TICK_MS", "5"),
        ("LEASEHOLD_TEST_IGNORE_TERM", "1"),
    ];
    let mut runner = start_runner_env(
        dir.path(),
        &server.url(),
        "e2e-whole-grace",
        "w",
        &["--grace", "3s"],
        &env,
    );
    let (_, tok, _, _) = wait_until("the child", LIMIT, || starts(&log).first().cloned());
    kill(runner.pid(), Signal::TERM);
    let status = runner.wait(LIMIT);
    assert_eq!(status.code(), Some(137), "{}", runner.stderr_text());
    let recs = read_log(&log);
    let term_at = recs
        .iter()
        .find_map(|r| match r {
            Rec::Term { token, at, .. } if *token == tok => Some(*at),
            _ => None,
        })
        .expect("the child got SIGTERM");
    let last = recs.iter().map(Rec::at).max().unwrap();
    // Lower bound only: a deadline not moved by the renewals during the stop would have ended
    // the command at most 1.95 s after the SIGTERM.
    assert!(
        ms(term_at, last) >= 2500.0,
        "the command was killed {:.0} ms after its SIGTERM, before its 3 s grace: {}",
        ms(term_at, last),
        runner.stderr_text()
    );
    println!(
        "ordered stop, --grace 3s, SIGTERM ignored: the command's last write {:.0} ms after its \
         SIGTERM",
        ms(term_at, last)
    );
}

/// The credentials-refused path: the leader's Redis user loses its permissions while its
/// command (which ignores SIGTERM) runs with `--grace 20s`. `leasehold` starts the ordered stop
/// at the refusal and exits with 77; renewals are refused, the term's deadline passes during the
/// grace, and the command is dead, and wrote nothing, before the next holder's command starts.
#[test]
fn run_refused_stop_grace_ends_with_the_term() {
    let server = redis_common::Server::start();
    let rt = runtime();
    rt.block_on(redis_common::raw_cmd(
        &server.url(),
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("old")
            .arg("on")
            .arg(">old-pw")
            .arg("~*")
            .arg("&*")
            .arg("+@all"),
    ));
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("children.log");
    let lease = "e2e-refused-grace";
    let env = [
        ("LEASEHOLD_TEST_TICK_MS", "5"),
        ("LEASEHOLD_TEST_IGNORE_TERM", "1"),
    ];
    let as_old = format!("redis://old:old-pw@127.0.0.1:{}", server.port);
    let mut leader = start_runner_env(dir.path(), &as_old, lease, "old", &["--grace", "20s"], &env);
    let (_, tok1, _, pid1) = wait_until("the first child", LIMIT, || starts(&log).first().cloned());
    let _next = start_runner_env(dir.path(), &server.url(), lease, "new", &[], &env);
    std::thread::sleep(Duration::from_millis(500));
    let refused_at = mono_ns();
    rt.block_on(redis_common::raw_cmd(
        &server.url(),
        redis::cmd("ACL").arg("SETUSER").arg("old").arg("-@all"),
    ));
    let (_, tok2, started2, _) = wait_until("the next holder's child", LIMIT, || {
        starts(&log).get(1).cloned()
    });
    assert!(tok2 > tok1);
    assert!(
        process_gone(pid1),
        "the old command must be dead once the next holder's command started; old leasehold:\n{}",
        leader.stderr_text()
    );
    let recs = read_log(&log);
    assert!(
        recs.iter()
            .any(|r| matches!(r, Rec::Term { token, .. } if *token == tok1)),
        "the refusal started an ordered stop: {recs:#?}"
    );
    let last1 = assert_silent_after(&recs, tok1, started2);
    let status = leader.wait(LIMIT);
    let err = leader.stderr_text();
    assert_eq!(
        status.code(),
        Some(77),
        "refused credentials exit with 77:\n{err}"
    );
    println!(
        "permissions revoked during the term, --grace 20s: the old command's last write was \
         {:.0} ms after the revocation, {:.0} ms before the next holder's command started",
        ms(refused_at, last1),
        ms(last1, started2)
    );
}

/// Runs `leasehold ARGS` like [`leasehold`], failing the test if it has not exited within
/// `LIMIT` (a hang guard): returns (code, stdout, stderr).
fn leasehold_within(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = KillOnDrop(
        Command::new(leasehold_bin())
            .args(args)
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("run leasehold"),
    );
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < LIMIT,
            "leasehold {args:?} did not exit; its stderr:\n{}",
            std::fs::read_to_string(&err).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    (
        status.code().unwrap_or(-1),
        std::fs::read_to_string(&out).unwrap_or_default(),
        std::fs::read_to_string(&err).unwrap_or_default(),
    )
}

/// Whether the lease has a record on `url` (read with `leasehold status`).
fn lease_exists(url: &str, lease: &str) -> bool {
    let (code, out, err) = leasehold(&["status", "--store", url, "--lease", lease, "--json"], &[]);
    assert_eq!(code, 0, "{err}");
    json_lines(&out)[0]["exists"] == serde_json::json!(true)
}

/// A command that cannot be found (127) or executed (126) is reported before campaigning: the
/// lease gets no record, and no "campaigning" line is printed. Bare names are looked up in PATH
/// as the shim's exec does.
#[test]
fn run_checks_the_command_before_campaigning() {
    use std::os::unix::fs::PermissionsExt;
    let server = redis_common::Server::start();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("not-executable.sh");
    std::fs::write(&plain, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::fs::write(bin.join("plain-tool"), "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(
        bin.join("plain-tool"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let path_env = format!("{}:/usr/bin:/bin", bin.display());
    let plain = plain.display().to_string();
    let subdir = dir.path().display().to_string();
    for (i, (cmd, code, says, path)) in [
        (
            "/nonexistent/leasehold-test-command",
            127,
            "no such file",
            None,
        ),
        (
            "leasehold-no-such-command",
            127,
            "command not found in PATH",
            None,
        ),
        (plain.as_str(), 126, "is not executable", None),
        (subdir.as_str(), 126, "is a directory", None),
        (
            "plain-tool",
            126,
            "plain-tool is not executable",
            Some(path_env.as_str()),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let lease = format!("e2e-precheck-{i}");
        let mut args = vec!["run", "--store", url.as_str(), "--lease", lease.as_str()];
        args.extend(TIMINGS);
        args.extend(["--", cmd]);
        let env: Vec<(&str, &str)> = path.map(|p| ("PATH", p)).into_iter().collect();
        let (got, _, err) = leasehold_within(&args, &env);
        assert_eq!(got, code, "{cmd}: {err}");
        assert!(
            err.contains(says) && err.contains("not campaigning"),
            "{cmd}: {err}"
        );
        assert!(!err.contains("campaigning for lease"), "{cmd}: {err}");
        assert!(
            !lease_exists(&url, &lease),
            "{cmd}: leasehold took the lease before finding out: {err}"
        );
    }
}

/// `--trust-absence` creates a lease that has no record at once: with a lease duration of an
/// hour, the command still starts (the test's 30 s limit is a hang guard). Without the flag,
/// leasehold says why it waits and names the flag; `--help` explains both.
#[test]
fn run_trust_absence_takes_a_new_lease_at_once() {
    let server = redis_common::Server::start();
    let url = server.url();
    let timings = [
        "--lease-duration",
        "1h",
        "--renew-deadline",
        "1.5s",
        "--retry-period",
        "0.3s",
    ];
    let mut args = vec!["run", "--store", url.as_str(), "--lease", "e2e-trusting"];
    args.extend(timings);
    args.extend(["--trust-absence", "--", "sh", "-c", "exit 4"]);
    let (code, _, err) = leasehold_within(&args, &[]);
    assert_eq!(code, 4, "{err}");
    assert!(
        err.contains("has no record yet: creating it at once (--trust-absence)"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let errfile = dir.path().join("stderr");
    let mut args = vec!["run", "--store", url.as_str(), "--lease", "e2e-waiting"];
    args.extend(timings);
    args.extend(["--", "sh", "-c", "exit 0"]);
    let _waiting = KillOnDrop(
        Command::new(leasehold_bin())
            .args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&errfile).unwrap())
            .spawn()
            .unwrap(),
    );
    let said = wait_until("the waiting message", LIMIT, || {
        let t = std::fs::read_to_string(&errfile).unwrap_or_default();
        t.contains("has no record yet").then_some(t)
    });
    assert!(
        said.contains("one lease duration (1h;") && said.contains("--trust-absence"),
        "{said}"
    );

    let (_, help, _) = leasehold(&["run", "--help"], &[]);
    for s in [
        "--trust-absence",
        "A brand-new lease",
        "waits that long",
        "two commands running at once",
    ] {
        assert!(help.contains(s), "{s}: {help}");
    }
}

/// Duration flags: a negative value is a bad value for its flag (not an unexpected argument),
/// each message names the flag, the default that applied and the rule, and values are echoed
/// as given (`0s`, not `0ns`).
#[test]
fn duration_arguments_name_the_flag_the_default_and_the_rule() {
    // Nothing listens there: every case fails before connecting.
    let url = format!("redis://127.0.0.1:{}", redis_common::free_port());
    let run = |flags: &[&str]| {
        let mut args = vec!["run", "--store", url.as_str(), "--lease", "e2e-durations"];
        args.extend_from_slice(flags);
        args.extend(["--", "true"]);
        let (code, out, err) = leasehold(&args, &[]);
        assert_eq!(code, 64, "{flags:?}: {out}{err}");
        assert!(!err.contains("0ns"), "{flags:?}: {err}");
        err
    };
    let err = run(&["--lease-duration", "-5s"]);
    for s in [
        "--lease-duration",
        "cannot be negative",
        "default 15s",
        "longer than --renew-deadline",
    ] {
        assert!(err.contains(s), "{s}: {err}");
    }
    assert!(
        !err.contains("unexpected argument") && !err.contains("tip:"),
        "{err}"
    );
    let err = run(&["--grace", "-1s"]);
    assert!(
        err.contains("--grace") && err.contains("negative") && err.contains("default 10s"),
        "{err}"
    );
    let err = run(&["--lease-duration", "soon"]);
    assert!(
        err.contains("--lease-duration") && err.contains("not a duration"),
        "{err}"
    );
    let err = run(&["--lease-duration", "--restart"]);
    assert!(
        err.contains("--lease-duration") && err.contains("not a duration"),
        "{err}"
    );
    let err = run(&["--lease-duration", "5s"]);
    for s in [
        "--lease-duration 5s must be longer than --renew-deadline",
        "not given: its default is 10s",
        "--renew-deadline 3333ms",
    ] {
        assert!(err.contains(s), "{s}: {err}");
    }
    let err = run(&["--renew-deadline", "20s"]);
    assert!(
        err.contains("--lease-duration (not given: its default is 15s) must be longer than --renew-deadline 20s"),
        "{err}"
    );
    let err = run(&["--lease-duration", "0s"]);
    assert!(
        err.contains("--lease-duration 0s must be longer than zero") && err.contains("15s"),
        "{err}"
    );
    let err = run(&["--retry-period", "0s"]);
    assert!(
        err.contains("--retry-period 0s must be longer than zero") && err.contains("2s"),
        "{err}"
    );
    let err = run(&["--renew-deadline", "2s"]);
    assert!(
        err.contains("--renew-deadline 2s must be longer than 2400ms, 1.2 times --retry-period (not given: its default is 2s)"),
        "{err}"
    );
    let err = run(&["--grace", "0s"]);
    assert!(
        err.contains("--grace 0s must be longer than zero") && err.contains("10s"),
        "{err}"
    );
    let (code, _, err) = leasehold(&["demo", "--lease-duration", "0s"], &[]);
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("--lease-duration 0s") && err.contains("default 1s") && !err.contains("0ns"),
        "{err}"
    );
}

/// `status`'s note about "expired?" goes to stderr, and only when a row says "expired?".
#[test]
fn status_notes_expiry_on_stderr_only_when_a_row_looks_expired() {
    let server = redis_common::Server::start();
    let rt = runtime();
    let store = rt
        .block_on(leasehold_redis::RedisStore::connect(
            leasehold_redis::RedisConfig::new(server.url()).unwrap(),
        ))
        .unwrap();
    let fresh = leasehold::LeaseKey::new("e2e-note-fresh").unwrap();
    rt.block_on(leasehold::LeaseStore::create(
        &store,
        &fresh,
        &record("alive", 1),
    ))
    .unwrap();
    let old = leasehold::LeaseKey::new("e2e-note-old").unwrap();
    let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    let mut stale = record("gone", 2);
    stale.acquire_time = Some(hour_ago);
    stale.renew_time = Some(hour_ago);
    rt.block_on(leasehold::LeaseStore::create(&store, &old, &stale))
        .unwrap();
    let url = server.url();
    let note = "judged from the record's timestamps";
    let (code, out, err) = leasehold(
        &["status", "--store", &url, "--lease", "e2e-note-fresh"],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("held") && !out.contains(note), "{out}");
    assert!(!err.contains(note), "no row says expired?: {err}");
    for args in [
        &["--lease", "e2e-note-old"][..],
        &["--prefix", "e2e-note-"][..],
    ] {
        let mut a = vec!["status", "--store", url.as_str()];
        a.extend_from_slice(args);
        let (code, out, err) = leasehold(&a, &[]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("expired?") && !out.contains(note), "{out}");
        assert!(err.contains(note), "{args:?}: {err}");
    }
}

/// A lease released by someone else while `leasehold run` holds it: the command is stopped,
/// leasehold exits with 75, and every line on its stderr is a `leasehold:` line, the library's
/// warning included, with no empty `holder=`.
#[test]
fn run_reports_a_lease_released_under_it_in_leasehold_lines() {
    let server = redis_common::Server::start();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("children.log");
    let mut runner = start_runner(dir.path(), &server.url(), "e2e-released", "r", &[]);
    wait_until("the child", LIMIT, || starts(&log).first().cloned());
    let (code, out, err) = leasehold(
        &[
            "release",
            "--store",
            &server.url(),
            "--lease",
            "e2e-released",
            "--yes",
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    let status = runner.wait(LIMIT);
    let err = runner.stderr_text();
    assert_eq!(status.code(), Some(75), "{err}");
    assert!(
        err.contains("leasehold: warning: lease lost: someone else released it"),
        "{err}"
    );
    for line in err.lines().filter(|l| !l.trim().is_empty()) {
        assert!(line.starts_with("leasehold"), "{line:?} in\n{err}");
        assert!(!line.trim_end().ends_with("holder="), "{line:?}");
        assert!(!line.contains("holder= "), "{line:?}");
    }
}
