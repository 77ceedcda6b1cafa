//! Issue 25, the way it was found: real worker processes on a real redis-server, each running
//! its leader work through `run_leader_tasks` in the *natural* loop — it asks only
//! `!leader.is_cancelled()` and whether the published status is still `Leading` of this term,
//! never `ensure_leading()` — once in the task itself and once in a task it spawns (as k0s-style
//! code starts its reconciler). The leader is SIGSTOPped past its lease (another worker takes over)
//! and SIGCONTed, again and again. Every action is logged with a `CLOCK_MONOTONIC` stamp (one
//! clock for all processes on Linux); the log must show no action of a term after a later
//! term's first action.
//!
//! The workers are this test binary itself, started with `LEASEHOLD_NATURAL_WORKER` set: then
//! the test `natural_loop_worker` runs the worker until it is killed (without it, that test
//! returns at once).
//!
//! `LEASEHOLD_NATURAL_PAIRS` (default 4) and `LEASEHOLD_NATURAL_SECS` (default 80) set how many
//! independent pairs of workers run, and for how long each is paused and resumed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use leasehold::{ElectorConfig, LeaseKey, LeaseStore, run_leader_tasks};
use leasehold_redis::{RedisConfig, RedisStore};
use leasehold_test_support::redis as common;
use rustix::process::{Pid, Signal, kill_process};
use rustix::time::{ClockId, clock_gettime};

const WORKER_ENV: &str = "LEASEHOLD_NATURAL_WORKER";
const LEASE: Duration = Duration::from_millis(600);
const RENEW: Duration = Duration::from_millis(400);
const RETRY: Duration = Duration::from_millis(100);
/// How often the natural loop acts.
const ACT_EVERY: Duration = Duration::from_millis(20);
/// How long the leader is stopped: past its lease, so that the other worker takes over.
const PAUSE: Duration = Duration::from_millis(1100);
/// After a resume, before the next pause: the new leader acts meanwhile.
const SETTLE: Duration = Duration::from_millis(400);

fn key() -> LeaseKey {
    LeaseKey::new("natural").expect("valid key")
}

/// `CLOCK_MONOTONIC` in nanoseconds: the same clock in every process of the machine.
fn monotonic_ns() -> i64 {
    let t = clock_gettime(ClockId::Monotonic);
    t.tv_sec * 1_000_000_000 + t.tv_nsec
}

async fn store(url: &str, prefix: &str) -> RedisStore {
    let cfg = RedisConfig::new(url)
        .expect("url")
        .with_prefix(prefix)
        .with_operation_timeout(Duration::from_millis(150))
        .with_connect_timeout(Duration::from_millis(300))
        .with_watch_ping_interval(Duration::from_millis(100));
    RedisStore::connect(cfg).await.expect("connect")
}

/// The worker: an elector and the natural leader loop, logging `<monotonic ns> <token>` per
/// action, until killed.
fn worker_main(url: String, prefix: String, identity: String, log: PathBuf) {
    // A multi-thread runtime, as a service would run (the race needs timers fired on one
    // thread while another polls).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let store = Arc::new(store(&url, &prefix).await);
        let config = ElectorConfig::new(key(), identity).with_timings(LEASE, RENEW, RETRY);
        let elector = leasehold::Elector::spawn(store, config).expect("valid config");
        let log = Arc::new(std::sync::Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .expect("open the action log"),
        ));
        let status = elector.clone();
        run_leader_tasks(
            leasehold::CancellationToken::new(),
            elector,
            move |leader| {
                let (status, log) = (status.clone(), log.clone());
                async move {
                    // The loop twice: in the task itself, and in a task it spawns (as k0s-style
                    // code starts its reconciler), which runs beside `run_leader_tasks`.
                    let spawned = tokio::spawn(natural_loop(
                        leader.clone(),
                        status.clone(),
                        log.clone(),
                        's',
                    ));
                    natural_loop(leader, status, log, 'd').await;
                    let _ = spawned.await;
                }
            },
        )
        .await;
    });
}

/// The natural loop: every `ACT_EVERY`, act unless the context is cancelled or the published
/// status is no longer `Leading` of this term. Logs `<monotonic ns> <token> <where>` per action.
async fn natural_loop(
    leader: leasehold::LeaderContext,
    status: leasehold::Elector,
    log: Arc<std::sync::Mutex<std::fs::File>>,
    place: char,
) {
    let token = leader.fencing_token();
    loop {
        tokio::time::sleep(ACT_EVERY).await;
        // The act's instant, read before the checks: an act the checks allow was allowed at
        // this instant.
        let at = monotonic_ns();
        if leader.is_cancelled() {
            break;
        }
        let (published, _) = status.current_status();
        if !published
            .leadership()
            .is_some_and(|l| l.same_term(leader.leadership()))
        {
            break;
        }
        let line = format!("{at} {token} {place}\n");
        let mut f = log.lock().unwrap_or_else(|e| e.into_inner());
        f.write_all(line.as_bytes()).expect("log the action");
    }
}

/// Runs the worker when started as one (see the module docs); otherwise does nothing.
#[test]
fn natural_loop_worker() {
    if std::env::var_os(WORKER_ENV).is_none() {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    worker_main(
        var("LEASEHOLD_NATURAL_URL"),
        var("LEASEHOLD_NATURAL_PREFIX"),
        var("LEASEHOLD_NATURAL_ID"),
        PathBuf::from(var("LEASEHOLD_NATURAL_LOG")),
    );
}

/// A worker process, killed when dropped.
struct Worker {
    identity: String,
    child: Child,
    log: PathBuf,
}

impl Worker {
    fn start(url: &str, prefix: &str, identity: &str, dir: &Path) -> Worker {
        let log = dir.join(format!("{identity}.log"));
        let stderr = std::fs::File::create(dir.join(format!("{identity}.stderr"))).expect("file");
        let child = Command::new(std::env::current_exe().expect("the test binary"))
            .args(["natural_loop_worker", "--exact", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(WORKER_ENV, "1")
            .env("LEASEHOLD_NATURAL_URL", url)
            .env("LEASEHOLD_NATURAL_PREFIX", prefix)
            .env("LEASEHOLD_NATURAL_ID", identity)
            .env("LEASEHOLD_NATURAL_LOG", &log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start a worker");
        Worker {
            identity: identity.to_owned(),
            child,
            log,
        }
    }

    fn signal(&self, sig: Signal) {
        let pid = Pid::from_child(&self.child);
        kill_process(pid, sig).expect("signal a worker");
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let pid = Pid::from_child(&self.child);
        let _ = kill_process(pid, Signal::CONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An action of a term stamped after a later term's first action: (term, stamp, later term,
/// its first action, which loop: 'd'irect or 's'pawned).
type Stale = (u64, i64, u64, i64, char);

/// What one pair saw.
#[derive(Debug, Default)]
struct Outcome {
    /// Pauses after which another worker held the lease.
    takeovers: usize,
    pauses: usize,
    /// Actions of a term stamped after a later term's first action.
    stale: Vec<Stale>,
    terms: usize,
    actions: usize,
}

/// Reads the workers' logs and finds every action of a term after a later term's first action.
fn check(logs: &[PathBuf]) -> (Vec<Stale>, usize, usize) {
    let mut actions = Vec::new();
    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines() {
            let mut it = line.split(' ');
            let (Some(at), Some(token), Some(place)) = (it.next(), it.next(), it.next()) else {
                continue; // a line cut by the kill at the end
            };
            let (Ok(at), Ok(token)) = (at.parse::<i64>(), token.parse::<u64>()) else {
                continue;
            };
            actions.push((at, token, place.chars().next().unwrap_or('?')));
        }
    }
    let mut first: BTreeMap<u64, i64> = BTreeMap::new();
    for &(at, token, _) in &actions {
        let f = first.entry(token).or_insert(at);
        *f = (*f).min(at);
    }
    let mut stale = Vec::new();
    for &(at, token, place) in &actions {
        // The earliest first action among the later terms.
        if let Some((&later, &start)) = first.range(token + 1..).min_by_key(|(_, start)| **start)
            && start < at
        {
            stale.push((token, at, later, start, place));
        }
    }
    (stale, first.len(), actions.len())
}

async fn run_pair(url: String, n: usize, dir: PathBuf, run_for: Duration) -> Outcome {
    let prefix = unique_prefix();
    let workers = [
        Worker::start(&url, &prefix, &format!("p{n}-a"), &dir),
        Worker::start(&url, &prefix, &format!("p{n}-b"), &dir),
    ];
    let probe = store(&url, &prefix).await;
    let holder = async || {
        probe
            .get(&key())
            .await
            .ok()
            .flatten()
            .map(|v| v.record.holder_identity)
            .filter(|h| !h.is_empty())
    };
    let mut out = Outcome::default();
    let started = Instant::now();
    let limit = started + Duration::from_secs(60);
    // The first leader (a missing key is taken after one lease duration).
    while holder().await.is_none() {
        assert!(Instant::now() < limit, "hang guard: nobody leads pair {n}");
        tokio::time::sleep(RETRY).await;
    }
    while started.elapsed() < run_for {
        let Some(leader) = holder().await else {
            tokio::time::sleep(RETRY).await;
            continue;
        };
        let Some(w) = workers.iter().find(|w| w.identity == leader) else {
            panic!("unknown holder {leader:?}");
        };
        w.signal(Signal::STOP);
        tokio::time::sleep(PAUSE).await;
        let after = holder().await;
        w.signal(Signal::CONT);
        out.pauses += 1;
        if after.is_some_and(|h| h != leader) {
            out.takeovers += 1;
        }
        tokio::time::sleep(SETTLE).await;
    }
    // Let the last resumed worker run its loop once more, then stop everything.
    tokio::time::sleep(SETTLE).await;
    let logs: Vec<PathBuf> = workers.iter().map(|w| w.log.clone()).collect();
    drop(workers);
    let (stale, terms, actions) = check(&logs);
    out.stale = stale;
    out.terms = terms;
    out.actions = actions;
    out
}

/// The natural loop never acts on an old term after the next term has acted, across SIGSTOP
/// pauses of the leader past its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_natural_leader_loop_never_acts_after_the_next_term_started() {
    if std::env::var_os(WORKER_ENV).is_some() {
        return; // a worker runs only its own test
    }
    let pairs: usize = std::env::var("LEASEHOLD_NATURAL_PAIRS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let secs: u64 = std::env::var("LEASEHOLD_NATURAL_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(80);
    let server = Server::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let runs: Vec<_> = (0..pairs)
        .map(|n| {
            tokio::spawn(run_pair(
                server.url(),
                n,
                dir.path().to_owned(),
                Duration::from_secs(secs),
            ))
        })
        .collect();
    let mut outcomes = Vec::new();
    for r in runs {
        outcomes.push(r.await.expect("a pair ran"));
    }
    let pauses: usize = outcomes.iter().map(|o| o.pauses).sum();
    let takeovers: usize = outcomes.iter().map(|o| o.takeovers).sum();
    let terms: usize = outcomes.iter().map(|o| o.terms).sum();
    let actions: usize = outcomes.iter().map(|o| o.actions).sum();
    let stale: Vec<_> = outcomes.iter().flat_map(|o| o.stale.iter()).collect();
    let stale_terms: std::collections::BTreeSet<_> = outcomes
        .iter()
        .enumerate()
        .flat_map(|(n, o)| o.stale.iter().map(move |s| (n, s.0)))
        .collect();
    println!(
        "natural loop: {pairs} pairs, {pauses} pauses, {takeovers} takeovers during a pause, \
         {terms} terms, {actions} actions; {} stale actions in {} terms",
        stale.len(),
        stale_terms.len()
    );
    for (term, at, later, start, place) in stale.iter().take(10) {
        let place = if *place == 's' { "spawned" } else { "direct" };
        println!(
            "  stale: term {term} ({place} loop) acted {:.3} ms after term {later}'s first action",
            (at - start) as f64 / 1e6
        );
    }
    assert!(
        takeovers > 0,
        "the pauses never caused a takeover: the test exercised nothing ({outcomes:?})"
    );
    assert!(
        stale.is_empty(),
        "{} actions of an old term after the next term's first action (in {} terms)",
        stale.len(),
        stale_terms.len()
    );
}
