//! Test fixture: real etcd servers on free loopback ports.
//!
//! Every etcd runs under a tiny `sh` supervisor whose stdin is a pipe held by the test process.
//! The supervisor answers `stop`/`start` lines (to kill a member with SIGKILL and restart it on
//! the same data dir) and, as soon as its stdin reaches end-of-file, kills etcd with SIGKILL and
//! removes the data directory. The pipe closes when the test process exits for any reason, even
//! when it is killed or a test panics, so no server outlives its test binary (statics are never
//! dropped, so a `Drop` impl alone would not be enough). A TERM/INT/HUP sent to the whole
//! process group (as `timeout` and Ctrl-C do) makes the supervisor clean up the same way.
//!
//! Data directories live in `/dev/shm` when it has room (fsync is cheap there), otherwise in
//! the system temp dir; `LEASEHOLD_ETCD_DATA_ROOT` overrides.
//!
//! `LEASEHOLD_ETCD_ENDPOINTS` (comma-separated) points the tests that need a plain server at an
//! existing cluster instead; tests that need a special setup (cluster, TLS, auth) always start
//! their own and therefore need the `etcd` binary (`LEASEHOLD_ETCD_BIN`, default `etcd` on the
//! PATH).

#![allow(clippy::unwrap_used)] // a fixture that cannot start its server fails the test

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use leasehold_etcd::{EtcdConfig, EtcdStore};

const SUPERVISOR: &str = r#"
dir=$1; shift
bin=$1; shift
pid=
run() { "$bin" "$@" >>"$dir/etcd.log" 2>&1 & pid=$!; }
cleanup() { [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"; }
trap 'cleanup; exit 0' TERM INT HUP
run "$@"
echo started
while read -r cmd; do
  case "$cmd" in
    stop) kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; echo stopped ;;
    start) run "$@"; echo started ;;
    *) break ;;
  esac
done
cleanup
"#;

/// The etcd binary, or a panic that says what to install.
pub fn etcd_binary() -> PathBuf {
    find_etcd(
        std::env::var_os("LEASEHOLD_ETCD_BIN"),
        std::env::var_os("PATH"),
    )
}

/// `bin` if given (it must exist), else `etcd` on `path`; panics naming the Debian package.
pub fn find_etcd(bin: Option<std::ffi::OsString>, path: Option<std::ffi::OsString>) -> PathBuf {
    if let Some(p) = bin {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "LEASEHOLD_ETCD_BIN={} does not exist: install the Debian package `etcd-server` \
             (apt-get install etcd-server) or fix the path",
            p.display()
        );
        return p;
    }
    let found = path.and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    });
    match found {
        Some(p) => p,
        None => panic!(
            "the etcd server binary was not found on the PATH: install the Debian package \
             `etcd-server` (apt-get install etcd-server; `etcd-client` provides etcdctl), set \
             LEASEHOLD_ETCD_BIN to an etcd binary, or set LEASEHOLD_ETCD_ENDPOINTS to an \
             existing cluster"
        ),
    }
}

use crate::{free_port, free_ports};

/// Where data dirs go: `LEASEHOLD_ETCD_DATA_ROOT`, else `/dev/shm` when it has at least 1 GiB
/// free (etcd preallocates 64 MiB WAL segments; Docker's default `/dev/shm` is only 64 MiB),
/// else the system temp dir.
fn scratch_root() -> PathBuf {
    if let Some(root) = std::env::var_os("LEASEHOLD_ETCD_DATA_ROOT") {
        return PathBuf::from(root);
    }
    let shm = Path::new("/dev/shm");
    if shm.is_dir() && free_kib(shm).is_some_and(|kib| kib >= 1024 * 1024) {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// Free space in KiB, from `df -Pk` (no unsafe `statvfs` here).
fn free_kib(path: &Path) -> Option<u64> {
    let out = Command::new("df").arg("-Pk").arg(path).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    text.lines().nth(1)?.split_whitespace().nth(3)?.parse().ok()
}

/// Server-side TLS files (PEM).
#[derive(Clone)]
pub struct ServerTls {
    /// The CA that signed the server (and client) certificates.
    pub ca_pem: String,
    /// The server certificate.
    pub cert_pem: String,
    /// The server certificate's key.
    pub key_pem: String,
    /// Require client certificates signed by the CA.
    pub client_cert_auth: bool,
    /// The client certificate and key (PEM) the fixture's own health checks present.
    pub client_identity: Option<(String, String)>,
}

struct Supervisor {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Supervisor {
    fn command(&mut self, cmd: &str, ack: &str) {
        writeln!(self.stdin, "{cmd}").expect("write to the etcd supervisor");
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .expect("read from the etcd supervisor");
        assert_eq!(
            line.trim(),
            ack,
            "etcd supervisor answered {line:?} to {cmd}"
        );
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
}

/// One etcd member of an [`Etcd`] cluster.
pub struct Member {
    /// Its member name (`m0`, `m1`, …).
    pub name: String,
    /// Its client URL (`http://` or `https://127.0.0.1:<port>`).
    pub client_url: String,
    dir: PathBuf,
    sup: Mutex<Supervisor>,
}

impl Member {
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// One etcd server or cluster started by a test.
pub struct Etcd {
    /// The members, in start order.
    pub members: Vec<Member>,
    tls: Option<ServerTls>,
}

impl Etcd {
    /// A single-member etcd.
    pub async fn start() -> Etcd {
        Self::start_cluster(1, None).await
    }

    /// A single-member etcd with TLS on the client port.
    pub async fn start_tls(tls: ServerTls) -> Etcd {
        Self::start_cluster(1, Some(tls)).await
    }

    /// An `n`-member cluster on loopback; returns when every member serves linearizable reads.
    pub async fn start_cluster(n: usize, tls: Option<ServerTls>) -> Etcd {
        let bin = etcd_binary();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let free = free_ports(2 * n);
        let ports: Vec<(u16, u16)> = (0..n).map(|i| (free[2 * i], free[2 * i + 1])).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let token = format!("lh-{}-{}", std::process::id(), free_port());
        let mut members = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let dir = tempfile::Builder::new()
                .prefix("leasehold-etcd-")
                .tempdir_in(scratch_root())
                .expect("a temp dir")
                .keep();
            let name = format!("m{i}");
            let client_url = format!("{scheme}://127.0.0.1:{client}");
            let mut args: Vec<String> = vec![
                "--name".into(),
                name.clone(),
                "--data-dir".into(),
                dir.join("data").display().to_string(),
                "--listen-client-urls".into(),
                client_url.clone(),
                "--advertise-client-urls".into(),
                client_url.clone(),
                "--listen-peer-urls".into(),
                format!("http://127.0.0.1:{peer}"),
                "--initial-advertise-peer-urls".into(),
                format!("http://127.0.0.1:{peer}"),
                "--initial-cluster".into(),
                initial.join(","),
                "--initial-cluster-state".into(),
                "new".into(),
                "--initial-cluster-token".into(),
                token.clone(),
                "--heartbeat-interval".into(),
                "50".into(),
                "--election-timeout".into(),
                "500".into(),
            ];
            if let Some(t) = &tls {
                std::fs::write(dir.join("ca.pem"), &t.ca_pem).unwrap();
                std::fs::write(dir.join("server.pem"), &t.cert_pem).unwrap();
                std::fs::write(dir.join("server-key.pem"), &t.key_pem).unwrap();
                for (flag, file) in [
                    ("--cert-file", "server.pem"),
                    ("--key-file", "server-key.pem"),
                    ("--trusted-ca-file", "ca.pem"),
                ] {
                    args.push(flag.into());
                    args.push(dir.join(file).display().to_string());
                }
                if t.client_cert_auth {
                    args.push("--client-cert-auth".into());
                }
            }
            let mut child = Command::new("sh")
                .arg("-c")
                .arg(SUPERVISOR)
                .arg("sh")
                .arg(&dir)
                .arg(&bin)
                .args(&args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start sh (the etcd supervisor)");
            let stdin = child.stdin.take().unwrap();
            let mut stdout = BufReader::new(child.stdout.take().unwrap());
            let mut line = String::new();
            stdout.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "started");
            members.push(Member {
                name,
                client_url,
                dir,
                sup: Mutex::new(Supervisor {
                    child,
                    stdin,
                    stdout,
                }),
            });
        }
        let etcd = Etcd { members, tls };
        for i in 0..n {
            etcd.wait_ready(i).await;
        }
        etcd
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    /// A client configuration for all members (with the CA, when TLS is on).
    pub fn config(&self) -> EtcdConfig {
        self.config_for(&self.endpoints())
    }

    /// A store configuration for `endpoints` (2 s operations, 1 s connects), with the cluster's TLS.
    pub fn config_for(&self, endpoints: &[String]) -> EtcdConfig {
        let mut c = EtcdConfig::new(endpoints.to_vec())
            .with_operation_timeout(Duration::from_secs(2))
            .with_connect_timeout(Duration::from_secs(1));
        if let Some(t) = &self.tls {
            c = c.with_tls(tls_client(t));
        }
        c
    }

    /// Waits (bounded) until member `i` answers a linearizable read.
    pub async fn wait_ready(&self, i: usize) {
        let m = &self.members[i];
        let config = self.config_for(std::slice::from_ref(&m.client_url));
        for _ in 0..300 {
            if let Ok(status) = m.sup.lock().unwrap().child.try_wait()
                && status.is_some()
            {
                panic!("the etcd supervisor of {} exited", m.name);
            }
            if let Ok(store) = EtcdStore::connect(config.clone()).await {
                let mut kv = store.client().kv_client();
                let read = tokio::time::timeout(Duration::from_secs(1), kv.get("health", None));
                if let Ok(Ok(_)) = read.await {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "etcd member {} ({}) did not become ready; log tail:\n{}",
            m.name,
            m.client_url,
            m.log_tail()
        );
    }

    /// Kills member `i` with SIGKILL (its data dir stays).
    pub fn stop_member(&self, i: usize) {
        self.members[i]
            .sup
            .lock()
            .unwrap()
            .command("stop", "stopped");
    }

    /// Restarts member `i` on its data dir (does not wait for it to be ready).
    pub fn restart_member(&self, i: usize) {
        self.members[i]
            .sup
            .lock()
            .unwrap()
            .command("start", "started");
    }
}

/// A client TLS configuration trusting the server's CA, with the fixture's client identity.
pub fn tls_client(t: &ServerTls) -> leasehold_etcd::TlsConfig {
    let c = leasehold_etcd::TlsConfig::new().with_ca_pem(t.ca_pem.clone());
    match &t.client_identity {
        Some((cert, key)) => c.with_client_identity_pem(cert.clone(), key.clone()),
        None => c,
    }
}

/// Endpoints of the server shared by the plain tests of this test binary: the
/// `LEASEHOLD_ETCD_ENDPOINTS` cluster, or one etcd started once per test binary.
pub async fn shared_endpoints() -> Vec<String> {
    static SHARED: tokio::sync::OnceCell<Vec<String>> = tokio::sync::OnceCell::const_new();
    static SERVER: std::sync::OnceLock<Etcd> = std::sync::OnceLock::new();
    SHARED
        .get_or_init(|| async {
            if let Ok(list) = std::env::var("LEASEHOLD_ETCD_ENDPOINTS") {
                let eps: Vec<String> = list
                    .split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
                    .collect();
                if !eps.is_empty() {
                    return eps;
                }
            }
            let etcd = Etcd::start().await;
            let eps = etcd.endpoints();
            let _ = SERVER.set(etcd);
            eps
        })
        .await
        .clone()
}

/// A unique prefix per call, so tests never collide on a shared server.
pub fn unique_prefix() -> String {
    format!("/leasehold-test/{}/", crate::unique_id())
}

pub use crate::TEST_OPERATION_TIMEOUT;

/// A store on the shared server under a fresh prefix.
pub async fn shared_store() -> EtcdStore {
    shared_store_with(TEST_OPERATION_TIMEOUT).await
}

/// A store on the shared server under a fresh prefix, with operations bounded by `timeout`.
pub async fn shared_store_with(timeout: Duration) -> EtcdStore {
    let eps = shared_endpoints().await;
    let config = EtcdConfig::new(eps)
        .with_prefix(unique_prefix())
        .with_operation_timeout(timeout);
    EtcdStore::connect(config).await.expect("connect to etcd")
}

pub use crate::record;

impl Etcd {
    /// The index of the member that is the raft leader, if any member knows one.
    pub async fn raft_leader(&self) -> Option<usize> {
        for m in &self.members {
            let config = self
                .config_for(std::slice::from_ref(&m.client_url))
                .with_operation_timeout(Duration::from_secs(1));
            let Ok(store) = EtcdStore::connect(config).await else {
                continue;
            };
            let mut c = store.client().clone();
            let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(1), c.status()).await
            else {
                continue;
            };
            let leader = status.leader();
            let mut list = store.client().clone();
            let Ok(Ok(members)) =
                tokio::time::timeout(Duration::from_secs(1), list.member_list()).await
            else {
                continue;
            };
            for mem in members.members() {
                if mem.id() == leader {
                    return self.members.iter().position(|x| x.name == mem.name());
                }
            }
        }
        None
    }
}

/// Samples electors' leading flags every 5 ms: counts samples at which more than one leads,
/// and measures every leaderless gap (after the first leader was seen).
pub struct LeaderSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<SampleReport>,
}

/// What a [`LeaderSampler`] saw.
#[derive(Debug, Default)]
pub struct SampleReport {
    /// Samples with two or more leaders.
    pub overlaps: usize,
    /// Leaderless gaps that ended with a new leader.
    pub gaps: Vec<Duration>,
}

impl LeaderSampler {
    /// Starts sampling `electors`.
    pub fn start(electors: Vec<std::sync::Arc<leasehold::Elector>>) -> Self {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut report = SampleReport::default();
            let mut seen_leader = false;
            let mut gap_start: Option<tokio::time::Instant> = None;
            while !flag.load(Ordering::Relaxed) {
                // One instant for all electors (see `leasehold::testing::valid_at`).
                let now = tokio::time::Instant::now();
                let leading = electors
                    .iter()
                    .filter(|e| leasehold::testing::valid_at(&e.current_status().0, now))
                    .count();
                if leading > 1 {
                    report.overlaps += 1;
                }
                if leading == 0 && seen_leader && gap_start.is_none() {
                    gap_start = Some(tokio::time::Instant::now());
                }
                if leading > 0 {
                    seen_leader = true;
                    if let Some(g) = gap_start.take() {
                        report.gaps.push(g.elapsed());
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            report
        });
        LeaderSampler { stop, task }
    }

    /// Stops sampling and reports.
    pub async fn finish(self) -> SampleReport {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

/// Waits (bounded by `limit`) until `cond` holds; returns how long it took, or `None`.
pub async fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> Option<Duration> {
    let start = tokio::time::Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}
