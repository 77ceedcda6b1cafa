//! The child process: started through the `__exec` shim, in its own process group, with a
//! parent-death signal; stopped by signalling the whole group.
//!
//! # Why a shim
//!
//! The workspace forbids `unsafe` code, so `pre_exec` (which would run `prctl` between `fork`
//! and `exec`) is not available. Instead `leasehold run` starts its own binary as
//! `leasehold __exec -- CMD ARGS…`. The shim sets the parent-death signal on itself
//! (`PR_SET_PDEATHSIG` = SIGKILL on Linux, `PROC_PDEATHSIG_CTL` on FreeBSD), checks that its
//! parent is still the `leasehold` that started it (otherwise the parent died before the signal
//! was armed, and the shim exits), and then `exec`s the command, which keeps the setting.
//!
//! # Threads
//!
//! Linux delivers the parent-death signal when the *thread* that forked the child exits, not
//! the process. `leasehold run` therefore runs everything, the spawn included, on a
//! current-thread Tokio runtime on the main thread, which lives as long as the process; it never
//! spawns from a blocking pool thread, which Tokio may retire while the child runs.
//!
//! # Other platforms
//!
//! Where no parent-death signal exists (macOS and other unixes), the command is not killed if
//! `leasehold` itself is killed with SIGKILL; it is still stopped on every orderly path.

use std::ffi::OsString;
use std::process::ExitStatus;
use std::time::Duration;

use rustix::process::{Pid, Signal};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::exit;

/// The hidden subcommand name of the shim.
pub(crate) const SHIM: &str = "__exec";

/// The environment variable naming the pid the shim's parent must have.
const PARENT_ENV: &str = "LEASEHOLD_SHIM_PARENT_PID";

/// The shim: arms the parent-death signal, checks the parent, and execs `cmd`. Never returns
/// on success; returns the exit code to use on failure.
pub(crate) fn shim(cmd: &[OsString]) -> u8 {
    use std::os::unix::process::CommandExt;
    let Some((program, args)) = cmd.split_first() else {
        eprintln!("leasehold {SHIM}: no command given");
        return exit::USAGE;
    };
    let expected = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|p| p.parse::<i32>().ok());
    arm_parent_death_signal();
    if let Some(expected) = expected {
        let parent = rustix::process::getppid().map(Pid::as_raw_nonzero);
        if parent.map(|p| p.get()) != Some(expected) {
            // The parent died before the signal was armed: do not start the command.
            eprintln!(
                "leasehold {SHIM}: the leasehold process {expected} is gone; not starting the command"
            );
            return exit::SOFTWARE;
        }
    }
    let err = std::process::Command::new(program)
        .args(args)
        .env_remove(PARENT_ENV)
        .exec();
    eprintln!("leasehold: cannot run {}: {err}", program.to_string_lossy());
    if err.kind() == std::io::ErrorKind::NotFound {
        exit::NOT_FOUND
    } else {
        exit::NOT_EXECUTABLE
    }
}

#[cfg(any(
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd",
    target_os = "dragonfly"
))]
fn arm_parent_death_signal() {
    if let Err(e) = rustix::process::set_parent_process_death_signal(Some(Signal::KILL)) {
        eprintln!("leasehold {SHIM}: cannot set the parent-death signal: {e}");
    }
}

#[cfg(not(any(
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd",
    target_os = "dragonfly"
)))]
fn arm_parent_death_signal() {}

/// What the command gets in its environment.
pub(crate) struct ChildEnv<'a> {
    pub(crate) lease: &'a str,
    pub(crate) identity: &'a str,
    pub(crate) fencing_token: u64,
}

/// Starts `cmd` through the shim in a new process group. Call it on the main thread (see the
/// module docs).
pub(crate) fn spawn(cmd: &[OsString], env: &ChildEnv<'_>) -> std::io::Result<Child> {
    let exe = std::env::current_exe()?;
    Command::new(exe)
        .arg(SHIM)
        .arg("--")
        .args(cmd)
        .env(PARENT_ENV, std::process::id().to_string())
        .env("LEASEHOLD_LEASE", env.lease)
        .env("LEASEHOLD_IDENTITY", env.identity)
        .env("LEASEHOLD_FENCING_TOKEN", env.fencing_token.to_string())
        .process_group(0)
        .kill_on_drop(false)
        .spawn()
}

/// The child's process group (its pid: it leads a new group).
pub(crate) fn group_of(child: &Child) -> Option<Pid> {
    child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .and_then(Pid::from_raw)
}

fn group_alive(pgid: Pid) -> bool {
    rustix::process::test_kill_process_group(pgid).is_ok()
}

fn signal_group(pgid: Pid, sig: Signal) {
    // ESRCH: the group is gone already.
    let _ = rustix::process::kill_process_group(pgid, sig);
}

/// Sends SIGTERM to the group, waits up to `grace` for the child and the rest of its group,
/// then SIGKILLs the group; returns the child's exit status.
pub(crate) async fn stop(child: &mut Child, pgid: Pid, grace: Duration) -> ExitStatus {
    signal_group(pgid, Signal::TERM);
    let deadline = Instant::now() + grace;
    let status = tokio::select! {
        s = child.wait() => s.ok(),
        () = tokio::time::sleep_until(deadline) => None,
    };
    finish_group(pgid, deadline).await;
    match status {
        Some(s) => s,
        None => wait_after_kill(child, pgid).await,
    }
}

/// After the group leader exited: gives what is left of its group until `grace` after a
/// SIGTERM, then SIGKILLs it, so that nothing of a term outlives it.
pub(crate) async fn reap_rest(pgid: Pid, grace: Duration) {
    if !group_alive(pgid) {
        return;
    }
    signal_group(pgid, Signal::TERM);
    finish_group(pgid, Instant::now() + grace).await;
}

/// Waits until the group is empty or `deadline`, then SIGKILLs whatever is left.
async fn finish_group(pgid: Pid, deadline: Instant) {
    while group_alive(pgid) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if group_alive(pgid) {
        signal_group(pgid, Signal::KILL);
    }
}

async fn wait_after_kill(child: &mut Child, pgid: Pid) -> ExitStatus {
    signal_group(pgid, Signal::KILL);
    loop {
        match child.wait().await {
            Ok(s) => return s,
            Err(e) => {
                eprintln!("leasehold: waiting for the command failed: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
