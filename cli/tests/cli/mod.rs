//! Helpers for the end-to-end tests: start `leasehold` processes, a recording child, and read
//! what the children recorded.
//!
//! # The recording child
//!
//! The children `leasehold run` starts are this test binary itself, run as
//! `TESTBIN child_helper --exact --nocapture` with `LEASEHOLD_TEST_CHILD_LOG` set: the
//! `child_helper` test then acts as the child (see [`child_main`]). It appends to the shared log
//! (`O_APPEND`, one `write` per line):
//! - `start ID TOKEN MONO_NS PID` when it starts;
//! - `term ID TOKEN MONO_NS` when it receives SIGTERM;
//! - `stop ID TOKEN MONO_NS CODE` right before it exits by itself or after SIGTERM.
//!
//! `MONO_NS` is `CLOCK_MONOTONIC` in nanoseconds, comparable with [`mono_ns`] in the test.
//! - `tick ID TOKEN MONO_NS` every `LEASEHOLD_TEST_TICK_MS` milliseconds, when that is set: a
//!   stand-in for the writes a real command makes while it runs.
//!
//! It exits by itself with code N once the file `exit-ID` in the log's directory holds N (and
//! removes the file). After SIGTERM it takes 50 ms to stop, as real programs take a moment;
//! with `LEASEHOLD_TEST_IGNORE_TERM=1` it records the SIGTERM and runs on.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The environment variable that turns the `child_helper` test into the recording child.
pub const CHILD_LOG_ENV: &str = "LEASEHOLD_TEST_CHILD_LOG";

/// The `leasehold` binary under test.
pub fn leasehold_bin() -> &'static str {
    env!("CARGO_BIN_EXE_leasehold")
}

/// `CLOCK_MONOTONIC` now, in nanoseconds.
pub fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    u64::try_from(t.tv_sec).unwrap() * 1_000_000_000 + u64::try_from(t.tv_nsec).unwrap()
}

fn append(log: &Path, line: &str) {
    let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
    else {
        // The test is over (its temp dir is gone).
        std::process::exit(0);
    };
    f.write_all(format!("{line}\n").as_bytes())
        .expect("write the child log");
}

/// The recording child's main (see the module docs); returns only when not in child mode.
pub fn child_main() {
    let Some(log) = std::env::var_os(CHILD_LOG_ENV) else {
        return;
    };
    let log = PathBuf::from(log);
    let id = std::env::var("LEASEHOLD_IDENTITY").unwrap_or_default();
    let token = std::env::var("LEASEHOLD_FENCING_TOKEN").unwrap_or_default();
    let term_code: i32 = std::env::var("LEASEHOLD_TEST_TERM_EXIT")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let exit_file = log.with_file_name(format!("exit-{id}"));
    let tick = std::env::var("LEASEHOLD_TEST_TICK_MS")
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_millis);
    let ignore_term = std::env::var_os("LEASEHOLD_TEST_IGNORE_TERM").is_some();
    let mut last_tick = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // The handler first: the test may signal as soon as it sees the start record.
    let mut term = {
        let _guard = rt.enter();
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap()
    };
    append(
        &log,
        &format!("start {id} {token} {} {}", mono_ns(), std::process::id()),
    );
    let code = rt.block_on(async {
        loop {
            tokio::select! {
                _ = term.recv() => {
                    append(&log, &format!("term {id} {token} {}", mono_ns()));
                    if ignore_term {
                        continue;
                    }
                    // Take a moment to stop, as real programs do: a leasehold that released
                    // the lease before its child is gone would show as an overlap.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    return term_code;
                }
                () = tokio::time::sleep(Duration::from_millis(2)) => {
                    if let Some(every) = tick
                        && last_tick.elapsed() >= every
                    {
                        last_tick = Instant::now();
                        append(&log, &format!("tick {id} {token} {}", mono_ns()));
                    }
                    // The test is over (its temp dir is gone): do not linger as an orphan.
                    if !log.parent().is_some_and(Path::exists) {
                        std::process::exit(0);
                    }
                    if let Ok(c) = std::fs::read_to_string(&exit_file)
                        && let Ok(c) = c.trim().parse::<i32>()
                    {
                        let _ = std::fs::remove_file(&exit_file);
                        return c;
                    }
                }
            }
        }
    });
    append(&log, &format!("stop {id} {token} {} {code}", mono_ns()));
    std::process::exit(code);
}

/// One record of the child log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rec {
    Start {
        id: String,
        token: u64,
        at: u64,
        pid: u32,
    },
    Term {
        id: String,
        token: u64,
        at: u64,
    },
    Stop {
        id: String,
        token: u64,
        at: u64,
        code: i32,
    },
    Tick {
        id: String,
        token: u64,
        at: u64,
    },
}

impl Rec {
    /// The fencing token of the child that wrote it.
    pub fn token(&self) -> u64 {
        match self {
            Rec::Start { token, .. }
            | Rec::Term { token, .. }
            | Rec::Stop { token, .. }
            | Rec::Tick { token, .. } => *token,
        }
    }

    /// When it was written (`CLOCK_MONOTONIC` ns).
    pub fn at(&self) -> u64 {
        match self {
            Rec::Start { at, .. }
            | Rec::Term { at, .. }
            | Rec::Stop { at, .. }
            | Rec::Tick { at, .. } => *at,
        }
    }
}

/// Asserts that the command of the term with `token` wrote nothing at or after `next_start`
/// (the next holder's command's start, `CLOCK_MONOTONIC` ns) and returns its last write.
pub fn assert_silent_after(recs: &[Rec], token: u64, next_start: u64) -> u64 {
    let last = recs
        .iter()
        .filter(|r| r.token() == token)
        .map(Rec::at)
        .max()
        .unwrap_or_else(|| panic!("the command of token {token} wrote nothing: {recs:#?}"));
    assert!(
        last < next_start,
        "the old command wrote after the next holder's command started: {recs:#?}"
    );
    last
}

pub fn read_log(log: &Path) -> Vec<Rec> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                ["start", id, token, at, pid] => Some(Rec::Start {
                    id: (*id).into(),
                    token: token.parse().ok()?,
                    at: at.parse().ok()?,
                    pid: pid.parse().ok()?,
                }),
                ["term", id, token, at] => Some(Rec::Term {
                    id: (*id).into(),
                    token: token.parse().ok()?,
                    at: at.parse().ok()?,
                }),
                ["stop", id, token, at, code] => Some(Rec::Stop {
                    id: (*id).into(),
                    token: token.parse().ok()?,
                    at: at.parse().ok()?,
                    code: code.parse().ok()?,
                }),
                ["tick", id, token, at] => Some(Rec::Tick {
                    id: (*id).into(),
                    token: token.parse().ok()?,
                    at: at.parse().ok()?,
                }),
                _ => None,
            }
        })
        .collect()
}

/// The starts in the log, in order.
pub fn starts(log: &Path) -> Vec<(String, u64, u64, u32)> {
    read_log(log)
        .into_iter()
        .filter_map(|r| match r {
            Rec::Start { id, token, at, pid } => Some((id, token, at, pid)),
            _ => None,
        })
        .collect()
}

/// Waits (bounded by a generous limit, failing the test) until `cond` holds, checking every
/// millisecond.
pub fn wait_until<T>(what: &str, limit: Duration, mut cond: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = cond() {
            return v;
        }
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether `pid` is gone (or a zombie nobody reaps yet: it runs no more code).
pub fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

/// Sends `sig` to `pid`.
pub fn kill(pid: u32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap();
    let _ = rustix::process::kill_process(pid, sig);
}

/// A `leasehold run` process whose command is the recording child.
pub struct Runner {
    pub id: String,
    pub child: Child,
    pub stderr: PathBuf,
}

impl Runner {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for it to exit (bounded), returning its status.
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                start.elapsed() < limit,
                "leasehold {} did not exit; its stderr:\n{}",
                self.id,
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The test timings: lease 2 s, renew deadline 1.5 s, retry period 0.3 s.
pub const TIMINGS: [&str; 6] = [
    "--lease-duration",
    "2s",
    "--renew-deadline",
    "1.5s",
    "--retry-period",
    "0.3s",
];

/// Starts `leasehold run --store URL --lease LEASE --identity ID [extra] -- <recording child>`.
pub fn start_runner(dir: &Path, store: &str, lease: &str, id: &str, extra: &[&str]) -> Runner {
    start_runner_env(dir, store, lease, id, extra, &[])
}

/// [`start_runner`] with extra environment variables for `leasehold`.
pub fn start_runner_env(
    dir: &Path,
    store: &str,
    lease: &str,
    id: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Runner {
    let stderr = dir.join(format!("leasehold-{id}.stderr"));
    let child = Command::new(leasehold_bin())
        .args(["run", "--store", store, "--lease", lease, "--identity", id])
        .args(TIMINGS)
        .args(extra)
        .arg("--")
        .arg(std::env::current_exe().unwrap())
        .args(["child_helper", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_LOG_ENV, dir.join("children.log"))
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .expect("start leasehold");
    Runner {
        id: id.to_owned(),
        child,
        stderr,
    }
}

/// Checks the log: terms never overlap (each start comes after the previous child's stop) and
/// fencing tokens strictly increase. `killed` are children known to have been killed (no stop
/// record): their end is taken as `ended_at`.
pub fn assert_exclusive(log: &Path, killed: &[(u64, u64)]) {
    let recs = read_log(log);
    let mut last_token = None;
    let mut running: Option<(String, u64)> = None;
    for r in &recs {
        match r {
            Rec::Start { id, token, at, .. } => {
                if let Some((rid, rtoken)) = &running {
                    let end = killed.iter().find(|(t, _)| t == rtoken).map(|(_, e)| *e);
                    match end {
                        Some(end) => assert!(
                            end <= *at,
                            "{id}'s child started while {rid}'s killed child was alive: {recs:#?}"
                        ),
                        None => panic!("{id}'s child started while {rid}'s ran: {recs:#?}"),
                    }
                }
                if let Some(prev) = last_token {
                    assert!(*token > prev, "tokens must increase: {recs:#?}");
                }
                last_token = Some(*token);
                running = Some((id.clone(), *token));
            }
            Rec::Stop { token, .. } => {
                if running.as_ref().is_some_and(|(_, t)| t == token) {
                    running = None;
                }
            }
            Rec::Term { .. } | Rec::Tick { .. } => {}
        }
    }
}

/// Milliseconds between two monotonic stamps.
pub fn ms(from: u64, to: u64) -> f64 {
    (to as f64 - from as f64) / 1e6
}
