//! Test fixture: real `redis-server` processes on free loopback ports.
//!
//! # How a server is guaranteed to die
//!
//! Rust never drops statics and a test binary can be killed, so `Drop` alone cannot be trusted to
//! stop a server. Each server is therefore started under a tiny `sh` watchdog:
//!
//! ```sh
//! redis-server ARGS & echo $!; cat >/dev/null; kill -9 $!
//! ```
//!
//! The watchdog's stdin is a pipe whose only write end lives in the test process. When the test
//! process exits for any reason (normal end, panic, `SIGKILL`), the kernel closes that end, `cat`
//! sees end-of-file and the watchdog kills redis. [`Server`]'s `Drop` closes the pipe as well, so a
//! per-test server dies at the end of its test. The binary-wide server (`shared()`) lives in a
//! static and dies with the process.
//!
//! `LEASEHOLD_REDIS_URL` points the shared-server tests at an existing server instead (fault and
//! security tests always start their own, because they stop, restart or configure it).
//! `LEASEHOLD_REDIS_SERVER` overrides the `redis-server` binary.
#![allow(clippy::unwrap_used)] // a fixture that cannot start its server fails the test

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use leasehold::DynLeaseStore;
use leasehold_redis::{RedisConfig, RedisStore};

/// How long a starting server may take before the fixture gives up (generous: slow CI).
const START_LIMIT: Duration = Duration::from_secs(30);

/// The `redis-server` binary: `LEASEHOLD_REDIS_SERVER`, or `redis-server` on the `PATH`.
pub fn redis_server_bin() -> String {
    std::env::var("LEASEHOLD_REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned())
}

fn check_binary() {
    let bin = redis_server_bin();
    match Command::new(&bin).arg("--version").output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => panic!(
            "`{bin} --version` failed ({}): install the Debian package `redis-server` \
             (apt-get install redis-server)",
            out.status
        ),
        Err(e) => panic!(
            "cannot run `{bin}` ({e}): the Redis tests need a redis-server binary; install the \
             Debian package `redis-server` (apt-get install redis-server), or set \
             LEASEHOLD_REDIS_SERVER to its path, or LEASEHOLD_REDIS_URL to an existing server \
             for the shared-server tests"
        ),
    }
}

pub use crate::free_port;

/// One running redis-server (see the module docs for how it is cleaned up).
pub struct Server {
    /// The loopback port it listens on.
    pub port: u16,
    /// Its working directory (config, TLS files, dumps); removed when the server is dropped.
    pub dir: tempfile::TempDir,
    extra: Vec<String>,
    tls: bool,
    proc: Option<Proc>,
}

struct Proc {
    watchdog: Child,
    stdin: Option<ChildStdin>,
    pid: u32,
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Closing the pipe makes the watchdog kill redis; reap the watchdog.
        drop(self.stdin.take());
        let _ = self.watchdog.wait();
    }
}

impl Server {
    /// Starts a plain server on a free loopback port.
    pub fn start() -> Server {
        Server::start_with(&[], false)
    }

    /// Starts a server with extra `redis-server` arguments. With `tls`, `port` is the TLS port
    /// and the plain port is disabled.
    pub fn start_with(extra: &[&str], tls: bool) -> Server {
        check_binary();
        let mut last_log = String::new();
        for _ in 0..5 {
            let mut s = Server {
                port: free_port(),
                dir: tempfile::tempdir().expect("temp dir"),
                extra: extra.iter().map(|s| s.to_string()).collect(),
                tls,
                proc: None,
            };
            match s.spawn() {
                Ok(()) => return s,
                Err(log) => last_log = log, // most likely the port was taken meanwhile
            }
        }
        panic!("redis-server did not start; its log:\n{last_log}");
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    fn spawn(&mut self) -> Result<(), String> {
        let log = self.log_path();
        let _ = std::fs::remove_file(&log);
        let port = self.port.to_string();
        let mut args: Vec<String> = vec![
            "--bind".into(),
            "127.0.0.1".into(),
            "--dir".into(),
            self.dir.path().display().to_string(),
            "--logfile".into(),
            log.display().to_string(),
            "--daemonize".into(),
            "no".into(),
            "--save".into(),
            "".into(),
            "--appendonly".into(),
            "no".into(),
        ];
        if self.tls {
            args.extend(["--port".into(), "0".into(), "--tls-port".into(), port]);
        } else {
            args.extend(["--port".into(), port]);
        }
        args.extend(self.extra.iter().cloned());
        let mut watchdog = Command::new("sh")
            .arg("-c")
            .arg(r#""$0" "$@" & pid=$!; echo "$pid"; cat >/dev/null; kill -9 "$pid" 2>/dev/null; wait"#)
            .arg(redis_server_bin())
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start sh for the redis-server watchdog: {e}"))?;
        let stdin = watchdog.stdin.take();
        let stdout = watchdog.stdout.take().ok_or("no stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let pid: u32 = line
            .trim()
            .parse()
            .map_err(|_| format!("watchdog said {line:?}"))?;
        let proc = Proc {
            watchdog,
            stdin,
            pid,
        };
        let deadline = Instant::now() + START_LIMIT;
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("Ready to accept connections") {
                self.proc = Some(proc);
                return Ok(());
            }
            if !alive(pid) || Instant::now() > deadline {
                drop(proc);
                return Err(text);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The process id of the running redis-server.
    pub fn pid(&self) -> u32 {
        self.proc.as_ref().expect("server running").pid
    }

    /// Its URL: `redis://127.0.0.1:<port>`, or `rediss://` when it serves TLS.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Kills the server with SIGKILL (no shutdown, no persistence).
    pub fn kill(&mut self) {
        if let Some(p) = self.proc.take() {
            signal("KILL", p.pid);
            drop(p);
        }
    }

    /// Starts the server again on the same port and directory.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + START_LIMIT;
        // The port may linger briefly; retry until the deadline.
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(log) if Instant::now() > deadline => panic!("restart failed:\n{log}"),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Freezes the server (`SIGSTOP`): connections stay open, nothing is answered.
    pub fn pause(&self) {
        signal("STOP", self.pid());
    }

    /// Thaws a [`pause`](Self::pause)d server (`SIGCONT`).
    pub fn resume(&self) {
        signal("CONT", self.pid());
    }

    /// Its working directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

fn signal(sig: &str, pid: u32) {
    let st = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(st.success(), "kill -{sig} {pid} failed");
}

static SHARED: OnceLock<(Option<Server>, String)> = OnceLock::new();

/// The URL of this test binary's shared server (started on first use), or `LEASEHOLD_REDIS_URL`.
pub fn shared_url() -> String {
    let (_, url) = SHARED.get_or_init(|| match std::env::var("LEASEHOLD_REDIS_URL") {
        Ok(url) if !url.is_empty() => (None, url),
        _ => {
            let s = Server::start();
            let url = s.url();
            (Some(s), url)
        }
    });
    url.clone()
}

/// A unique namespace prefix so tests (and runs on a shared server) never collide.
pub fn unique_prefix() -> String {
    format!("lh-test-{}:", crate::unique_id())
}

pub use crate::TEST_OPERATION_TIMEOUT;

/// A store on `url` with [`TEST_OPERATION_TIMEOUT`].
pub async fn store_at(url: &str) -> RedisStore {
    store_at_with(url, TEST_OPERATION_TIMEOUT).await
}

/// A store at `url` under a fresh prefix, with operations bounded by `timeout`.
pub async fn store_at_with(url: &str, timeout: Duration) -> RedisStore {
    let cfg = RedisConfig::new(url)
        .expect("url")
        .with_prefix(unique_prefix())
        .with_operation_timeout(timeout);
    RedisStore::connect(cfg).await.expect("connect")
}

/// A store on the shared server with a fresh prefix.
pub async fn store() -> RedisStore {
    store_at(&shared_url()).await
}

/// A store on the shared server, as the conformance suites take it.
pub async fn make_store() -> DynLeaseStore {
    std::sync::Arc::new(store().await)
}

pub use crate::{key, record};

/// Runs a raw command on `url` (for tests that write foreign data or flush scripts).
pub async fn raw_cmd(url: &str, cmd: &redis::Cmd) -> redis::Value {
    let client = redis::Client::open(url).expect("client");
    let mut c = client
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection");
    cmd.query_async(&mut c).await.expect("raw command")
}

/// A local Redis Cluster of `Server`s with `--cluster-enabled yes`, joined by
/// `redis-cli --cluster create` (masters only).
pub struct Cluster {
    /// Its nodes, masters first.
    pub nodes: Vec<Server>,
}

impl Cluster {
    /// Starts a cluster of `masters` masters and no replicas.
    pub fn start(masters: usize) -> Cluster {
        Cluster::start_with_replicas(masters, 0)
    }

    /// `masters * (1 + replicas)` nodes, `replicas` replicas per master.
    pub fn start_with_replicas(masters: usize, replicas: usize) -> Cluster {
        let nodes: Vec<Server> = (0..masters * (1 + replicas))
            .map(|_| {
                Server::start_with(
                    &["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"],
                    false,
                )
            })
            .collect();
        let mut cli = Command::new("redis-cli");
        cli.arg("--cluster").arg("create");
        for n in &nodes {
            cli.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = cli
            .arg("--cluster-replicas")
            .arg(replicas.to_string())
            .arg("--cluster-yes")
            .output()
            .expect("run redis-cli (Debian package redis-tools) to create the cluster");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let c = Cluster { nodes };
        c.wait_until_ok();
        c
    }

    /// Runs `redis-cli -p PORT ARGS` and returns its output.
    pub fn cli(port: u16, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .arg("-p")
            .arg(port.to_string())
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until every node reports `cluster_state:ok` and agrees on the slot owners.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + START_LIMIT;
        loop {
            let ok =
                self.nodes.iter().filter(|n| n.proc.is_some()).all(|n| {
                    Cluster::cli(n.port, &["CLUSTER", "INFO"]).contains("cluster_state:ok")
                });
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster did not become ok");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The node id of the node on `port`.
    pub fn node_id(port: u16) -> String {
        Cluster::cli(port, &["CLUSTER", "MYID"]).trim().to_owned()
    }

    /// The port of the node that owns `slot`, from `CLUSTER NODES` on `ask_port`.
    pub fn owner(&self, slot: u16) -> u16 {
        let alive = self
            .nodes
            .iter()
            .find(|n| n.proc.is_some())
            .expect("a live node");
        let nodes = Cluster::cli(alive.port, &["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let port: u16 = f[1]
                .split('@')
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .expect("node address");
            for range in &f[8..] {
                let (lo, hi) = match range.split_once('-') {
                    Some((lo, hi)) => (lo.parse::<u16>(), hi.parse::<u16>()),
                    None => (range.parse::<u16>(), range.parse::<u16>()),
                };
                if let (Ok(lo), Ok(hi)) = (lo, hi)
                    && (lo..=hi).contains(&slot)
                {
                    return port;
                }
            }
        }
        panic!("no owner for slot {slot}:\n{nodes}");
    }

    /// Moves `slot` from its owner to the node on `to` the way `redis-cli --cluster reshard`
    /// does: IMPORTING/MIGRATING, MIGRATE every key, then SETSLOT NODE on every node.
    pub fn migrate_slot(&self, slot: u16, to: u16) {
        let from = self.owner(slot);
        assert_ne!(from, to);
        let (from_id, to_id) = (Cluster::node_id(from), Cluster::node_id(to));
        let s = slot.to_string();
        assert!(
            Cluster::cli(to, &["CLUSTER", "SETSLOT", &s, "IMPORTING", &from_id]).contains("OK")
        );
        assert!(
            Cluster::cli(from, &["CLUSTER", "SETSLOT", &s, "MIGRATING", &to_id]).contains("OK")
        );
        loop {
            let keys = Cluster::cli(from, &["CLUSTER", "GETKEYSINSLOT", &s, "100"]);
            let keys: Vec<&str> = keys.lines().filter(|l| !l.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            let port = to.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(keys);
            let out = Cluster::cli(from, &args);
            assert!(out.contains("OK"), "MIGRATE failed: {out}");
        }
        for n in &self.nodes {
            Cluster::cli(n.port, &["CLUSTER", "SETSLOT", &s, "NODE", &to_id]);
        }
        self.wait_until_ok();
    }
}
