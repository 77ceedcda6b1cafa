//! The command's supervisor: `leasehold run` starts its own binary as the hidden shim
//! `leasehold __exec … -- CMD ARGS…`, which starts the command in a new process group and stays
//! beside it as a small supervisor. The shim, not `leasehold`, signals the command's group.
//!
//! # Why a supervisor
//!
//! `leasehold` itself can die (SIGKILL, the OOM killer) or be paused (SIGSTOP, a VM stall) while
//! its command runs. Neither may leave the command's group running beside the next holder's
//! command, grandchildren included. The shim is a separate process that is neither killed nor
//! paused with `leasehold`, and it kills the command's whole process group
//! - with **SIGKILL at once when `leasehold` dies**: the end of its control pipe closes;
//! - when **the term's deadline passes** (the watchdog): SIGTERM to the group, then SIGKILL
//!   after the lost-term grace (`min(--grace, --lease-duration − --renew-deadline)`). The
//!   deadline is the term's `valid_until`, sent over the control pipe as a `CLOCK_MONOTONIC`
//!   reading (both processes share that clock) when the shim starts and again whenever a
//!   renewal moves it; once passed it is never taken back. It applies in every state, an
//!   ordered stop's grace included;
//! - on `leasehold`'s **stop** (`stop GRACE` on the pipe): SIGTERM, SIGKILL after `GRACE`;
//! - when the command exits by itself: what is left of its group gets SIGTERM and, after
//!   `--grace`, SIGKILL, under the same watchdog.
//!
//! The shim exits once the command has exited and its group is empty, and reports the command's
//! exit status back over its own pipe (`exit code N` or `exit signal N`) so that `leasehold`
//! exits exactly as documented (the code, or 128+N for a signal); its own exit code is the
//! command's code, or 128+N. It also reports the command's process group (`pid N`) and a
//! passed deadline (`expired`). It ignores SIGTERM, SIGINT and SIGHUP sent to it (a supervisor
//! signalling every process of a service must not take the watchdog away), and starts nothing
//! when `leasehold` is already gone or the deadline has already passed. Should the shim itself
//! die without its report (killed by someone), `leasehold` stops what is left of the group it
//! reported: SIGTERM, and SIGKILL after 5 s. If the shim does not end the group within a stop's
//! grace plus 2 s, `leasehold` closes the control pipe and SIGKILLs the group itself.
//!
//! # The pipes, without `unsafe`
//!
//! The workspace forbids `unsafe` code, so no file descriptor can be handed to the shim by
//! number (that needs `pre_exec` or `OwnedFd::from_raw_fd`). `leasehold` keeps both ends of two
//! pipes open, close-on-exec, and the shim opens its ends through `/proc/PARENT/fd/N` (Linux
//! opens the same pipe again); the command inherits neither. The control pipe's only writer is
//! `leasehold`, so its end closes exactly when `leasehold` dies.
//!
//! # Other platforms
//!
//! Without `/proc` (macOS, the BSDs) there are no pipes: the shim notices `leasehold`'s death by
//! its parent changing (checked every 20 ms) and then SIGKILLs the group, but there is no
//! watchdog: a paused `leasehold` does not stop its command before it resumes, and the
//! command's exit code is reported through the shim's own exit code only.

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use leasehold::LeaderContext;
use rustix::process::{Pid, Signal};
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::exit;

/// The hidden subcommand name of the shim.
pub(crate) const SHIM: &str = "__exec";

/// `CLOCK_MONOTONIC` now, in nanoseconds (std's and Tokio's `Instant` use the same clock on
/// Linux, and so does the other process).
pub(crate) fn mono_now_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let secs = u64::try_from(t.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(t.tv_nsec).unwrap_or(0);
    secs.saturating_mul(1_000_000_000).saturating_add(nanos)
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// `t` as a `CLOCK_MONOTONIC` reading, never later than `t` (the clock is read before the
/// `Instant`); an instant already past gives now.
fn mono_of(t: Instant) -> u64 {
    let mono = mono_now_ns();
    let left = t.saturating_duration_since(Instant::now());
    mono.saturating_add(nanos(left))
}

/// A `CLOCK_MONOTONIC` reading as an `Instant`, never later than it (the `Instant` is read
/// before the clock); `None` when it does not fit.
fn instant_of(mono: u64) -> Option<Instant> {
    let now = Instant::now();
    let left = mono.saturating_sub(mono_now_ns());
    now.checked_add(Duration::from_nanos(left))
}

/// `now + d`, or `None` when that does not fit (a grace too long to ever end).
fn after(d: Duration) -> Option<Instant> {
    Instant::now().checked_add(d)
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Sleeps until `at`, or forever when `None`.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn group_alive(pgid: Pid) -> bool {
    rustix::process::test_kill_process_group(pgid).is_ok()
}

fn signal_group(pgid: Pid, sig: Signal) {
    // ESRCH: the group is gone already.
    let _ = rustix::process::kill_process_group(pgid, sig);
}

fn pid_of(raw: u32) -> Option<Pid> {
    i32::try_from(raw).ok().and_then(Pid::from_raw)
}

fn parent_pid() -> Option<i32> {
    rustix::process::getppid().map(|p| p.as_raw_nonzero().get())
}

// ---------------------------------------------------------------------------------------------
// The shim (runs in its own process).

/// The shim's arguments (see `Commands::Exec`).
pub(crate) struct ShimArgs {
    /// The `leasehold` process that started it.
    pub(crate) parent: i32,
    /// `leasehold`'s fd numbers of the control pipe's read end and the report pipe's write end.
    pub(crate) pipes: Option<(i32, i32)>,
    /// The term's deadline (`CLOCK_MONOTONIC` ns).
    pub(crate) deadline: Option<u64>,
    /// `--grace`: for what is left of the group after the command exits.
    pub(crate) grace: Duration,
    /// The grace after the deadline passed.
    pub(crate) lost_grace: Duration,
    /// The command and its arguments.
    pub(crate) cmd: Vec<OsString>,
}

/// The shim's main: supervises `cmd` (see the module docs); returns the exit code.
pub(crate) fn shim(args: ShimArgs) -> u8 {
    if args.cmd.is_empty() {
        eprintln!("leasehold {SHIM}: no command given");
        return exit::USAGE;
    }
    if parent_pid() != Some(args.parent) {
        eprintln!(
            "leasehold {SHIM}: the leasehold process {} is gone; not starting the command",
            args.parent
        );
        return exit::SOFTWARE;
    }
    let files = match args.pipes {
        Some((control, report)) => match open_pipes(args.parent, control, report) {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!(
                    "leasehold {SHIM}: cannot open the pipes of leasehold process {} through \
                     /proc: {e}; not starting the command without its watchdog",
                    args.parent
                );
                return exit::OSERR;
            }
        },
        None => None,
    };
    // Opened through /proc: make sure they are still the parent's.
    if parent_pid() != Some(args.parent) {
        return exit::SOFTWARE;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("leasehold {SHIM}: cannot start the async runtime: {e}");
            return exit::OSERR;
        }
    };
    runtime.block_on(supervise(args, files))
}

fn open_pipes(parent: i32, control: i32, report: i32) -> std::io::Result<(File, File)> {
    let control = File::open(format!("/proc/{parent}/fd/{control}"))?;
    let report = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{parent}/fd/{report}"))?;
    Ok((control, report))
}

/// The shim's view of the command's group.
struct Supervisor {
    pgid: Pid,
    report: Option<File>,
    lost_grace: Duration,
    term_sent: bool,
    /// When the group gets SIGKILL.
    kill_at: Option<Instant>,
    killed: bool,
    deadline: Option<u64>,
    expired: bool,
}

impl Supervisor {
    fn report(&mut self, line: &str) {
        if let Some(r) = &mut self.report {
            // EPIPE: leasehold is gone, and the control pipe says so too.
            let _ = r.write_all(format!("{line}\n").as_bytes());
        }
    }

    /// SIGTERM to the group (once), SIGKILL at `kill_at` or earlier.
    fn stop(&mut self, kill_at: Option<Instant>) {
        if !self.term_sent {
            self.term_sent = true;
            signal_group(self.pgid, Signal::TERM);
        }
        self.kill_at = earliest(self.kill_at, kill_at);
        if self.kill_at.is_some_and(|t| t <= Instant::now()) {
            self.kill();
        }
    }

    fn kill(&mut self) {
        self.killed = true;
        signal_group(self.pgid, Signal::KILL);
    }

    /// Checks the deadline by the monotonic clock; once passed, the watchdog fires (for good).
    fn check_deadline(&mut self) {
        if self.expired || self.deadline.is_none_or(|d| mono_now_ns() < d) {
            return;
        }
        self.expired = true;
        self.report("expired");
        self.stop(after(self.lost_grace));
    }

    fn on_message(&mut self, line: &str) {
        let mut words = line.split_whitespace();
        match (
            words.next(),
            words.next().and_then(|n| n.parse::<u64>().ok()),
        ) {
            (Some("deadline"), Some(d)) if !self.expired => {
                self.deadline = Some(d);
                self.check_deadline();
            }
            (Some("stop"), Some(g)) => self.stop(after(Duration::from_nanos(g))),
            _ => {}
        }
    }
}

/// Reads complete lines from a non-blocking pipe into `buf`; returns them and whether the pipe
/// reached its end (or failed).
fn read_lines(rx: &pipe::Receiver, buf: &mut Vec<u8>) -> (Vec<String>, bool) {
    let mut chunk = [0u8; 512];
    let mut eof = false;
    loop {
        match rx.try_read(&mut chunk) {
            Ok(0) => {
                eof = true;
                break;
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => {
                eof = true;
                break;
            }
        }
    }
    let mut lines = Vec::new();
    while let Some(i) = buf.iter().position(|&b| b == b'\n') {
        let line: Vec<u8> = buf.drain(..=i).collect();
        lines.push(String::from_utf8_lossy(&line).trim().to_owned());
    }
    (lines, eof)
}

/// Resolves when `rx` is readable (never without one).
async fn readable(rx: Option<&pipe::Receiver>) {
    match rx {
        Some(rx) => {
            let _ = rx.readable().await;
        }
        None => std::future::pending().await,
    }
}

/// Resolves when the parent is no longer `parent` (polled: platforms without the pipes).
async fn parent_gone(parent: i32) {
    loop {
        if parent_pid() != Some(parent) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn supervise(args: ShimArgs, files: Option<(File, File)>) -> u8 {
    use tokio::signal::unix::{SignalKind, signal};
    // SIGTERM, SIGINT and SIGHUP sent to the shim are handled (so that the command still gets
    // the default dispositions after exec) and, with the pipes, ignored.
    let (Ok(mut term), Ok(mut usr1), Ok(_int), Ok(_hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::user_defined1()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        eprintln!("leasehold {SHIM}: cannot install signal handlers");
        return exit::OSERR;
    };
    let (control, report) = match files {
        Some((c, r)) => match pipe::Receiver::from_file(c) {
            Ok(c) => (Some(c), Some(r)),
            Err(e) => {
                eprintln!("leasehold {SHIM}: cannot read the control pipe: {e}");
                return exit::OSERR;
            }
        },
        None => (None, None),
    };
    let mut buf = Vec::new();
    let mut pending = Vec::new();
    if let Some(c) = &control {
        let (lines, eof) = read_lines(c, &mut buf);
        if eof {
            eprintln!("leasehold {SHIM}: the leasehold process is gone; not starting the command");
            return exit::SOFTWARE;
        }
        pending = lines;
    }
    let mut deadline = args.deadline;
    for l in &pending {
        if let Some(d) = l.strip_prefix("deadline ").and_then(|d| d.parse().ok()) {
            deadline = Some(d);
        }
    }
    if deadline.is_some_and(|d| mono_now_ns() >= d) {
        if let Some(mut r) = report {
            let _ = r.write_all(b"expired\n");
        }
        eprintln!("leasehold {SHIM}: the term's deadline has passed; not starting the command");
        return exit::LEASE_LOST;
    }

    let Some((program, rest)) = args.cmd.split_first() else {
        return exit::USAGE;
    };
    let mut child = match Command::new(program)
        .args(rest)
        .process_group(0)
        .kill_on_drop(false)
        .spawn()
    {
        Ok(c) => c,
        Err(err) => {
            eprintln!("leasehold: cannot run {}: {err}", program.to_string_lossy());
            return if err.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::NOT_EXECUTABLE
            };
        }
    };
    let Some(pgid) = child.id().and_then(pid_of) else {
        return exit::SOFTWARE;
    };
    let mut sup = Supervisor {
        pgid,
        report,
        lost_grace: args.lost_grace,
        term_sent: false,
        kill_at: None,
        killed: false,
        deadline,
        expired: false,
    };
    sup.report(&format!("pid {}", pgid.as_raw_nonzero()));
    let mut control_open = control.is_some();
    let mut status: Option<ExitStatus> = None;
    let parent = args.parent;
    loop {
        if status.is_some() && !group_alive(pgid) {
            break;
        }
        let deadline_at = match sup.deadline {
            Some(d) if !sup.expired => instant_of(d),
            _ => None,
        };
        let kill_at = if sup.killed { None } else { sup.kill_at };
        tokio::select! {
            () = readable(control.as_ref()), if control_open => {
                if let Some(c) = &control {
                    // `read_lines` takes only what is there (a wake-up may be spurious).
                    let (lines, eof) = read_lines(c, &mut buf);
                    for l in &lines {
                        sup.on_message(l);
                    }
                    if eof {
                        // leasehold is gone: nothing of its term may run on.
                        control_open = false;
                        sup.kill();
                    }
                }
            }
            // Without pipes: SIGTERM asks for a stop with --grace, SIGUSR1 with the lost-term
            // grace.
            _ = term.recv(), if control.is_none() => sup.stop(after(args.grace)),
            _ = usr1.recv(), if control.is_none() => sup.stop(after(args.lost_grace)),
            () = parent_gone(parent), if control.is_none() && !sup.killed => sup.kill(),
            () = sleep_until(deadline_at), if deadline_at.is_some() => sup.check_deadline(),
            () = sleep_until(kill_at), if kill_at.is_some() => sup.kill(),
            s = child.wait(), if status.is_none() => match s {
                Ok(s) => {
                    status = Some(s);
                    if group_alive(pgid) {
                        // What the command left in its group gets the same stop.
                        sup.stop(after(args.grace));
                    }
                }
                Err(e) => {
                    eprintln!("leasehold {SHIM}: waiting for the command failed: {e}");
                    sup.kill();
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            () = tokio::time::sleep(Duration::from_millis(10)), if status.is_some() => {}
        }
    }
    let status = status.unwrap_or_else(|| ExitStatus::from_raw(9));
    match (status.code(), status.signal()) {
        (Some(code), _) => sup.report(&format!("exit code {code}")),
        (None, Some(sig)) => sup.report(&format!("exit signal {sig}")),
        (None, None) => {}
    }
    exit::code_of_status(status)
}

// ---------------------------------------------------------------------------------------------
// The `leasehold run` side.

/// What the command gets in its environment.
pub(crate) struct ChildEnv<'a> {
    pub(crate) lease: &'a str,
    pub(crate) identity: &'a str,
    pub(crate) fencing_token: u64,
}

/// The term's timings for the shim.
pub(crate) struct Timing {
    /// `--grace`.
    pub(crate) grace: Duration,
    /// The grace after a lost term: `min(--grace, --lease-duration − --renew-deadline)`.
    pub(crate) lost_grace: Duration,
    /// How often the term's `valid_until` is looked at and, when it moved, sent to the shim.
    pub(crate) feed_every: Duration,
}

/// A command running under its shim.
pub(crate) struct Supervised {
    shim: Child,
    /// `None` once closed (the shim then SIGKILLs the group).
    control: Option<pipe::Sender>,
    report: Option<pipe::Receiver>,
    /// The shim's ends, kept open (close-on-exec) for the shim to open through /proc.
    _ends: Option<(std::io::PipeReader, std::io::PipeWriter)>,
    buf: Vec<u8>,
    group: Option<Pid>,
    expired: bool,
    reported: Option<ExitStatus>,
    sent: Option<u64>,
    feed_every: Duration,
    done: Option<ExitStatus>,
}

/// Why a command cannot be run, found before campaigning.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NotRunnable {
    /// No such file (or not on `PATH`): exit code 127, as shells report it.
    NotFound(String),
    /// It exists but cannot be executed (no execute permission, a directory): exit code 126.
    NotExecutable(String),
}

/// Checks that `program` can be executed the way the shim will start it (`execvp`'s rules: a
/// name with a `/` is a path, any other name is looked up in the directories of `path`, the
/// value of `PATH`, an empty entry meaning the current directory), before `leasehold run`
/// campaigns. Returns the path found. Whatever changes after the check (a file removed, an
/// interpreter missing) is still reported when the shim starts the command (127 or 126).
pub(crate) fn check_program(
    program: &std::ffi::OsStr,
    path: Option<&std::ffi::OsStr>,
) -> Result<std::path::PathBuf, NotRunnable> {
    use std::os::unix::ffi::OsStrExt;
    use std::path::{Path, PathBuf};
    let shown = program.to_string_lossy().into_owned();
    if program.is_empty() {
        return Err(NotRunnable::NotFound(
            "the command name is empty".to_owned(),
        ));
    }
    let executable = |p: &Path| -> Result<(), String> {
        match std::fs::metadata(p) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(String::new()),
            Err(e) => Err(format!("{}: {e}", p.display())),
            Ok(m) if m.is_dir() => Err(format!("{} is a directory", p.display())),
            Ok(_) => rustix::fs::access(p, rustix::fs::Access::EXEC_OK).map_err(|e| {
                format!(
                    "{} is not executable ({}; chmod +x it, or run it through its interpreter)",
                    p.display(),
                    std::io::Error::from(e)
                )
            }),
        }
    };
    if program.as_bytes().contains(&b'/') {
        let p = PathBuf::from(program);
        return match executable(&p) {
            Ok(()) => Ok(p),
            Err(why) if why.is_empty() => {
                Err(NotRunnable::NotFound(format!("{shown}: no such file")))
            }
            Err(why) => Err(NotRunnable::NotExecutable(why)),
        };
    }
    // execvp's search list when PATH is unset (glibc's).
    let dirs = path.map_or_else(
        || std::ffi::OsString::from("/bin:/usr/bin"),
        std::ffi::OsStr::to_os_string,
    );
    let mut refused = None;
    for dir in std::env::split_paths(&dirs) {
        let dir = if dir.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            dir
        };
        let p = dir.join(program);
        match executable(&p) {
            Ok(()) => return Ok(p),
            Err(why) if why.is_empty() => {}
            // execvp goes on searching, and reports the refusal only if nothing else is found.
            Err(why) => {
                refused.get_or_insert(why);
            }
        }
    }
    Err(match refused {
        Some(why) => NotRunnable::NotExecutable(why),
        None => NotRunnable::NotFound(format!(
            "{shown}: command not found in PATH ({})",
            dirs.to_string_lossy()
        )),
    })
}

/// Whether the shim talks to `leasehold` over pipes on this platform.
const PIPES: bool = cfg!(any(target_os = "linux", target_os = "android"));

/// Starts `cmd` under the shim, its deadline the term's `valid_until` as known now.
pub(crate) fn spawn(
    cmd: &[OsString],
    env: &ChildEnv<'_>,
    leader: &LeaderContext,
    timing: &Timing,
) -> std::io::Result<Supervised> {
    let exe = std::env::current_exe()?;
    let mut command = Command::new(exe);
    command
        .arg(SHIM)
        .arg("--parent")
        .arg(std::process::id().to_string())
        .arg("--grace-ns")
        .arg(nanos(timing.grace).to_string())
        .arg("--lost-grace-ns")
        .arg(nanos(timing.lost_grace).to_string());
    let deadline = deadline_of(leader);
    let mut pipes = None;
    if PIPES {
        command.arg("--deadline-ns").arg(deadline.to_string());
        let (control_rx, control_tx) = std::io::pipe()?;
        let (report_rx, report_tx) = std::io::pipe()?;
        command.arg("--pipes").arg(format!(
            "{},{}",
            control_rx.as_raw_fd(),
            report_tx.as_raw_fd()
        ));
        pipes = Some((control_rx, control_tx, report_rx, report_tx));
    }
    let shim = command
        .arg("--")
        .args(cmd)
        .env("LEASEHOLD_LEASE", env.lease)
        .env("LEASEHOLD_IDENTITY", env.identity)
        .env("LEASEHOLD_FENCING_TOKEN", env.fencing_token.to_string())
        // Its own group: a terminal's signals do not reach it.
        .process_group(0)
        .kill_on_drop(false)
        .spawn()?;
    let (control, report, ends) = match pipes {
        Some((control_rx, control_tx, report_rx, report_tx)) => (
            Some(pipe::Sender::from_owned_fd(control_tx.into())?),
            Some(pipe::Receiver::from_owned_fd(report_rx.into())?),
            Some((control_rx, report_tx)),
        ),
        None => (None, None, None),
    };
    Ok(Supervised {
        shim,
        control,
        report,
        _ends: ends,
        buf: Vec::new(),
        group: None,
        expired: false,
        reported: None,
        sent: Some(deadline),
        feed_every: timing.feed_every,
        done: None,
    })
}

/// The term's deadline as a `CLOCK_MONOTONIC` reading: its `valid_until`, or now once it has
/// none (revoked: the term is over).
fn deadline_of(leader: &LeaderContext) -> u64 {
    match leader.valid_until() {
        Some(t) => mono_of(t),
        None => mono_now_ns(),
    }
}

impl Supervised {
    /// The command's process group, once the shim reported it.
    pub(crate) fn group(&self) -> Option<Pid> {
        self.group
    }

    /// Whether the shim's watchdog saw the term's deadline pass.
    pub(crate) fn expired(&self) -> bool {
        self.expired
    }

    fn send(&mut self, line: &str) {
        if let Some(c) = &self.control {
            // Tiny lines (atomic below PIPE_BUF); a full pipe drops a deadline extension,
            // which only makes the watchdog fire earlier.
            let _ = c.try_write(format!("{line}\n").as_bytes());
        }
    }

    /// Sends the term's deadline when it moved.
    fn feed(&mut self, leader: &LeaderContext) {
        let d = deadline_of(leader);
        // A revoked term's "now" moves every time: send it once.
        if leader.valid_until().is_none() && self.sent.is_some_and(|s| s <= d) {
            return;
        }
        if self.sent != Some(d) {
            self.sent = Some(d);
            self.send(&format!("deadline {d}"));
        }
    }

    fn read_reports(&mut self) {
        let Some(r) = &self.report else { return };
        let (lines, _) = read_lines(r, &mut self.buf);
        for l in lines {
            let mut w = l.split_whitespace();
            match (w.next(), w.next(), w.next()) {
                (Some("pid"), Some(p), None) => {
                    self.group = p.parse::<u32>().ok().and_then(pid_of);
                }
                (Some("expired"), None, None) => self.expired = true,
                (Some("exit"), Some("code"), Some(c)) => {
                    self.reported = c.parse::<i32>().ok().map(|c| ExitStatus::from_raw(c << 8));
                }
                (Some("exit"), Some("signal"), Some(s)) => {
                    self.reported = s.parse::<i32>().ok().map(ExitStatus::from_raw);
                }
                _ => {}
            }
        }
    }

    /// Waits until the shim has exited (the command exited and its group is empty), feeding it
    /// the term's deadline meanwhile; returns the command's exit status.
    ///
    /// # Cancel safety
    /// Cancel safe: the state lives in `self`.
    pub(crate) async fn wait(&mut self, leader: &LeaderContext) -> ExitStatus {
        if let Some(s) = self.done {
            return s;
        }
        let mut tick = tokio::time::interval(self.feed_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let shim_status = loop {
            let report = self.report.as_ref();
            tokio::select! {
                s = self.shim.wait() => match s {
                    Ok(s) => break s,
                    Err(e) => {
                        eprintln!("leasehold: waiting for the command failed: {e}; retrying");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                () = readable(report), if report.is_some() => self.read_reports(),
                _ = tick.tick() => self.feed(leader),
            }
        };
        // Everything the shim wrote is in the pipe by now.
        self.read_reports();
        let status = self.reported.unwrap_or(shim_status);
        if self.reported.is_none()
            && let Some(g) = self.group
            && group_alive(g)
        {
            // The shim died without finishing (killed by someone): stop what is left.
            eprintln!(
                "leasehold: the command's supervisor ended ({shim_status}); stopping the rest of its process group"
            );
            signal_group(g, Signal::TERM);
            let until = after(Duration::from_secs(5));
            while group_alive(g) && until.is_none_or(|u| Instant::now() < u) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            signal_group(g, Signal::KILL);
        }
        self.done = Some(status);
        status
    }

    /// Stops the command: SIGTERM to its group, SIGKILL after `grace` (the shim does both, and
    /// its watchdog still applies; `lost`: the lost-term grace); returns the command's exit
    /// status.
    pub(crate) async fn stop(
        &mut self,
        grace: Duration,
        lost: bool,
        leader: &LeaderContext,
    ) -> ExitStatus {
        if self.control.is_some() {
            self.send(&format!("stop {}", nanos(grace)));
        } else if let Some(shim) = self.shim.id().and_then(pid_of) {
            // No pipes: a signal to the shim says which grace (see `supervise`).
            let sig = if lost { Signal::USR1 } else { Signal::TERM };
            let _ = rustix::process::kill_process(shim, sig);
        }
        let limit = after(grace.saturating_add(Duration::from_secs(2)));
        tokio::select! {
            s = self.wait(leader) => return s,
            () = sleep_until(limit) => {}
        }
        // The shim did not end the group in time: closing the control pipe makes it SIGKILL
        // the group; so does this process, when it knows the group.
        eprintln!(
            "leasehold: the command did not stop within its grace; killing its process group"
        );
        self.control = None;
        if let Some(g) = self.group {
            signal_group(g, Signal::KILL);
        }
        self.wait(leader).await
    }
}
