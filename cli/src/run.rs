//! `leasehold run`: campaign, run the command only while leading, stop it in order.

use std::cell::RefCell;
use std::process::ExitStatus;
use std::time::Duration;

use leasehold::{Elector, ElectorConfig, LeaderContext, LeaderStatus, LeaseKey, StopCause};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::exit::{self, CliError};
use crate::{DurationArg, RunArgs, child, http, refusal, stores};

pub(crate) const LONG_ABOUT: &str = "\
Campaign for a lease and run a command only while holding it.

leasehold campaigns for --lease on --store. Once it holds the lease it starts the command in
its own process group, with these variables in its environment:
  LEASEHOLD_LEASE           the lease name
  LEASEHOLD_IDENTITY        this candidate's identity
  LEASEHOLD_FENCING_TOKEN   the term's fencing token: pass it to systems that can reject
                            writes of an older term
stdin, stdout and stderr pass through. While it waits, leasehold says on stderr who holds the
lease.

When leadership ends, the command is stopped before anything else: SIGTERM to its process
group, SIGKILL after --grace, and leasehold waits for it. Leadership ends when
  - the lease is lost (another holder took it, or no renewal landed within --renew-deadline).
    The command is signalled as soon as the term's deadline passes by the monotonic clock, even
    if leasehold itself is paused (SIGSTOP, a VM stall): its supervisor (below) holds the
    deadline. The grace is then at most --lease-duration minus --renew-deadline, the time
    before another candidate may take over, also when the term is lost during the grace of an
    ordered stop;
  - leasehold gets SIGTERM, SIGINT or SIGHUP: it stops the command while it still renews the
    lease, and only then releases it (ordered release), so the next holder starts right after.
When the command exits by itself, leasehold releases the lease and exits with the command's
exit code (128+N if a signal N killed it), or with --restart releases it and campaigns again.
What the command left in its process group gets SIGTERM, and SIGKILL after --grace.

The command runs under a small supervisor process, `leasehold __exec`, that is neither killed
nor paused with leasehold. If leasehold dies (SIGKILL, OOM kill), the supervisor SIGKILLs the
command's whole process group at once, so nothing of it runs beside the next holder's command.
If leasehold is paused, the supervisor stops the command's group at the term's deadline.
Processes the command started in other process groups are not covered. On platforms other
than Linux the supervisor has no deadline, and it checks every 20 ms whether leasehold died.
The command runs in a background process group: it must not read from the terminal (that
stops it with SIGTTIN); give it its input through a pipe or a file.

A brand-new lease: when the lease has no record yet, leasehold creates it only after the
record stayed absent for one lease duration, so the first start on a new lease waits that long
(15 s by default). A missing record is no proof that nobody holds the lease: the store cannot
tell a lease never created from one whose record was deleted (`leasehold release --delete`,
`kubectl delete lease`) or lost (a Redis restart without persistence) while its holder runs,
and that holder's term stays valid until its renew deadline. --trust-absence creates a missing
record at once (client-go's behaviour). It risks two commands running at once, for up to
--renew-deadline, if a holder was running when the record vanished: use it only where nothing
can hold the lease while its record is missing, such as a lease with a single candidate.";

pub(crate) const EXAMPLES: &str = "\
Examples:
  leasehold run --store redis://127.0.0.1:6379 --lease report -- ./report.sh --daily
  leasehold run --store etcds://etcd-1:2379,etcd-2:2379 --tls-ca ca.pem \\
      --lease billing --restart --grace 30s -- billing-worker
  leasehold run --store kube://prod --lease cron --http 127.0.0.1:9090 -- ./cron.sh";

/// How one term's command ended.
enum Outcome {
    /// It exited by itself.
    Exited(ExitStatus),
    /// leasehold stopped it because it was told to stop (a signal).
    Stopped(ExitStatus),
    /// leasehold stopped it because the lease was lost.
    Lost(ExitStatus),
    /// It could not be started.
    SpawnFailed(CliError),
}

struct State {
    outcome: RefCell<Option<Outcome>>,
    signal: RefCell<Option<i32>>,
    /// A store failure no retry can fix (credentials rejected, permission denied).
    fatal: RefCell<Option<CliError>>,
}

fn say(msg: impl AsRef<str>) {
    eprintln!("leasehold: {}", msg.as_ref());
}

pub(crate) async fn run(args: RunArgs) -> Result<u8, CliError> {
    // Before anything that takes time: a signal from now on means an ordered stop.
    let handlers = install_handlers()?;
    let url = args.store.url()?;
    let key = LeaseKey::new(&args.lease).map_err(|e| CliError::usage(e.to_string()))?;
    let t = timings(&args)?;
    // A command that cannot be started is reported now, not after taking the lease.
    if let Some(program) = args.cmd.first() {
        let path = std::env::var_os("PATH");
        match child::check_program(program, path.as_deref()) {
            Ok(_) => {}
            Err(child::NotRunnable::NotFound(why)) => {
                return Err(CliError::new(
                    exit::NOT_FOUND,
                    format!("cannot run the command: {why}; not campaigning"),
                ));
            }
            Err(child::NotRunnable::NotExecutable(why)) => {
                return Err(CliError::new(
                    exit::NOT_EXECUTABLE,
                    format!("cannot run the command: {why}; not campaigning"),
                ));
            }
        }
    }
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(leasehold::default_identity);
    let config = ElectorConfig::new(key.clone(), identity.clone())
        .with_timings(t.lease_duration, t.renew_deadline, t.retry_period)
        .with_trust_absence(args.trust_absence)
        // The command is stopped (SIGTERM, --grace, SIGKILL) before the release: give the
        // drain that long and a little more.
        .with_drain_timeout(t.grace.saturating_add(Duration::from_secs(5)));
    config.validate().map_err(|e| {
        CliError::usage(format!(
            "{e} (--lease-duration, --renew-deadline, --retry-period, --grace)"
        ))
    })?;
    // A store operation must end well inside the renew deadline.
    let timeouts = stores::Timeouts {
        operation: (t.renew_deadline / 2).min(Duration::from_secs(2)),
        connect: Duration::from_secs(3),
    };
    let shown = url.display();
    let store = stores::connect(&url, &args.store.tls(), timeouts).await?;
    let (store, refusals) = refusal::watch_refusals(store);
    // Fail early, with a clear message, on an unreachable store or missing permissions.
    let absent = match store.get(&key).await {
        Ok(v) => v.is_none(),
        Err(leasehold::Error::Corrupt { .. }) => false,
        Err(e) => {
            return Err(stores::store_error(
                &url,
                &format!("cannot read lease {key} on {shown}"),
                e,
            ));
        }
    };
    let metrics = match args.http {
        Some(addr) => Some(http::Server::bind(addr).await?),
        None => None,
    };
    let elector = Elector::spawn(store, config)
        .map_err(|e| CliError::store("cannot start the elector", e))?;
    if let Some(server) = metrics {
        let addr = server.local_addr();
        server.serve(elector.clone(), args.healthz_timeout.value);
        say(format!("serving /healthz and /metrics on http://{addr}"));
    }
    say(format!(
        "campaigning for lease {key} on {shown} as {identity}"
    ));
    if absent && args.trust_absence {
        say(format!(
            "lease {key} has no record yet: creating it at once (--trust-absence)"
        ));
    } else if absent {
        say(format!(
            "lease {key} has no record yet: it is created after it stayed absent for one lease \
             duration ({}; a missing record is no proof that nobody holds it, see \
             --trust-absence in --help)",
            humantime::format_duration(t.lease_duration)
        ));
    }

    let state = State {
        outcome: RefCell::new(None),
        signal: RefCell::new(None),
        fatal: RefCell::new(None),
    };
    let parent = CancellationToken::new();
    // After a lost term the command must be gone before another candidate may take over
    // (lease − renew deadline after the deadline); a tenth of that, at most 1 s, is left for
    // the scheduling of the processes that kill it.
    let slack = t.lease_duration.saturating_sub(t.renew_deadline);
    let lost_grace = t
        .grace
        .min(slack.saturating_sub((slack / 10).min(Duration::from_secs(1))))
        .max(Duration::from_millis(1));
    let ctx = TaskCtx {
        args: &args,
        timings: t,
        key: &key,
        identity: &identity,
        state: &state,
        parent: &parent,
        elector: &elector,
        lost_grace,
    };
    let tasks = leasehold::run_leader_tasks(parent.clone(), &elector, |leader| {
        let ctx = &ctx;
        async move { ctx.term(leader).await }
    });
    let mut tasks = std::pin::pin!(tasks);
    tokio::select! {
        () = &mut tasks => {}
        () = signals(handlers, &state, &parent) => {}
        () = progress(&elector, &key, t.retry_period) => {}
        e = refusals.first() => {
            // The store refuses us for good: stop (in order) and exit.
            *state.fatal.borrow_mut() = Some(CliError::new(
                exit::NOPERM,
                format!(
                    "the store refuses this candidate: {e} (fix the credentials or grant the \
                     permission; for Kubernetes: get, list, watch, create and update on leases, \
                     see backends/kube/deploy/rbac.yaml)"
                ),
            ));
            parent.cancel();
            // Let the task stop the command, if one runs, before the elector shuts down.
            run_rest(&mut tasks).await;
        }
        () = elector.stopped() => {
            // Not asked to stop: the elector failed. Stop the command, if one runs.
            parent.cancel();
            run_rest(&mut tasks).await;
        }
    }
    let shutdown = elector.shutdown().await;
    let outcome = state.outcome.borrow_mut().take();
    let sig = *state.signal.borrow();
    if let Err(e) = shutdown {
        return Err(CliError::new(
            exit::SOFTWARE,
            format!("the elector failed: {e}"),
        ));
    }
    if let Some(e) = state.fatal.borrow_mut().take() {
        return Err(e);
    }
    match outcome {
        Some(Outcome::SpawnFailed(e)) => Err(e),
        Some(Outcome::Lost(s)) => {
            say(format!(
                "exiting with {}: the lease {key} was lost while the command ran (it {})",
                exit::LEASE_LOST,
                exit::describe_status(s)
            ));
            Ok(exit::LEASE_LOST)
        }
        Some(Outcome::Exited(s) | Outcome::Stopped(s)) => {
            // The elector logs whether the release write landed; a failed one leaves the
            // lease to expire.
            say(format!("done with lease {key}"));
            Ok(exit::code_of_status(s))
        }
        None => match sig {
            Some(sig) => Ok(u8::try_from(128 + sig).unwrap_or(exit::SOFTWARE)),
            None => Err(CliError::new(
                exit::SOFTWARE,
                "the elector stopped unexpectedly",
            )),
        },
    }
}

/// Handlers for SIGTERM, SIGINT and SIGHUP.
type Handlers = (
    tokio::signal::unix::Signal,
    tokio::signal::unix::Signal,
    tokio::signal::unix::Signal,
);

/// Installs the handlers (from then on these signals no longer kill leasehold).
fn install_handlers() -> Result<Handlers, CliError> {
    let install = |kind| {
        signal(kind)
            .map_err(|e| CliError::new(exit::OSERR, format!("cannot install signal handlers: {e}")))
    };
    Ok((
        install(SignalKind::terminate())?,
        install(SignalKind::interrupt())?,
        install(SignalKind::hangup())?,
    ))
}

/// Waits for SIGTERM, SIGINT or SIGHUP; the first starts the ordered stop (a second one is only
/// reported: the grace still applies).
async fn signals(handlers: Handlers, state: &State, parent: &CancellationToken) {
    let (mut term, mut int, mut hup) = handlers;
    loop {
        let sig = tokio::select! {
            _ = term.recv() => 15,
            _ = int.recv() => 2,
            _ = hup.recv() => 1,
        };
        if state.signal.borrow().is_none() {
            *state.signal.borrow_mut() = Some(sig);
            say(format!(
                "got {}; stopping the command (if running), then releasing the lease",
                exit::signal_name(sig)
            ));
            parent.cancel();
        } else {
            say(format!(
                "got {} again; still waiting for the command to stop",
                exit::signal_name(sig)
            ));
        }
    }
}

/// Awaits the rest of `run_leader_tasks` after its parent token was cancelled.
async fn run_rest(tasks: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>) {
    tasks.as_mut().await;
}

/// Reports who holds the lease while waiting, on every change, and a failing store (checked
/// every `every`).
async fn progress(elector: &Elector, key: &LeaseKey, every: Duration) {
    let mut last: Option<Option<String>> = None;
    let mut failing = false;
    loop {
        match elector.store_health() {
            Err(e) if !failing => {
                failing = true;
                say(format!("the store is failing: {e}"));
            }
            Ok(()) if failing => {
                failing = false;
                say("the store answers again");
            }
            _ => {}
        }
        let (status, changed) = elector.current_status();
        if status.is_stopped() {
            return std::future::pending().await;
        }
        if let LeaderStatus::NotLeading { leader } = &status
            && last.as_ref() != Some(leader)
        {
            match leader {
                Some(l) => say(format!("lease {key} is held by {l}; waiting")),
                None if last.is_some() => {
                    say(format!("lease {key} has no live holder; campaigning"))
                }
                None => {}
            }
            last = Some(leader.clone());
        }
        if status.is_leading() {
            last = None;
        }
        drop(status);
        let _ = tokio::time::timeout(every, changed).await;
    }
}

struct TaskCtx<'a> {
    args: &'a RunArgs,
    timings: Timings,
    key: &'a LeaseKey,
    identity: &'a str,
    state: &'a State,
    parent: &'a CancellationToken,
    elector: &'a Elector,
    lost_grace: Duration,
}

impl TaskCtx<'_> {
    /// One term: start the command, and stop it when the term ends.
    async fn term(&self, leader: LeaderContext) {
        let Ok(token) = leader.ensure_leading() else {
            return;
        };
        say(format!(
            "acquired lease {} (fencing token {token}); starting {}",
            self.key,
            shell_words(&self.args.cmd)
        ));
        let env = child::ChildEnv {
            lease: self.key.as_str(),
            identity: self.identity,
            fencing_token: token,
        };
        let timing = child::Timing {
            grace: self.timings.grace,
            lost_grace: self.lost_grace,
            feed_every: (self.timings.retry_period / 4)
                .clamp(Duration::from_millis(5), Duration::from_millis(100)),
        };
        let mut proc = match child::spawn(&self.args.cmd, &env, &leader, &timing) {
            Ok(p) => p,
            Err(e) => {
                *self.state.outcome.borrow_mut() = Some(Outcome::SpawnFailed(CliError::new(
                    exit::OSERR,
                    format!("cannot start the command: {e}"),
                )));
                self.parent.cancel();
                return;
            }
        };
        http::command_running(self.key, true);
        let outcome = tokio::select! {
            biased;
            () = leader.cancelled() => {
                let cause = leader.cause();
                let lost = cause == Some(StopCause::LeaseLost);
                let grace = if lost { self.lost_grace } else { self.timings.grace };
                say(format!(
                    "{}; stopping the command: SIGTERM to {}, SIGKILL after {}",
                    match cause {
                        Some(StopCause::LeaseLost) => "leadership ended: the lease was lost",
                        Some(StopCause::SteppedDown) => "leadership ended: stepping down",
                        _ => "leasehold is stopping",
                    },
                    group_words(&proc),
                    humantime::format_duration(grace)
                ));
                let status = proc.stop(grace, lost, &leader).await;
                say(format!("the command {}", exit::describe_status(status)));
                if lost || proc.expired() {
                    if !lost {
                        say("the term's deadline passed while the command stopped: it got the lost-term grace");
                    }
                    Outcome::Lost(status)
                } else {
                    Outcome::Stopped(status)
                }
            }
            status = proc.wait(&leader) => {
                if proc.expired() {
                    say(format!(
                        "the term's deadline passed: the command was stopped (SIGTERM, SIGKILL \
                         after {}) and {}",
                        humantime::format_duration(self.lost_grace),
                        exit::describe_status(status)
                    ));
                    Outcome::Lost(status)
                } else {
                    say(format!("the command {}", exit::describe_status(status)));
                    Outcome::Exited(status)
                }
            }
        };
        http::command_running(self.key, false);
        let lost = matches!(outcome, Outcome::Lost(_));
        let exited = matches!(outcome, Outcome::Exited(_));
        if !self.args.restart || self.parent.is_cancelled() {
            *self.state.outcome.borrow_mut() = Some(outcome);
            self.parent.cancel();
            return;
        }
        // Campaigning again: a signal from now until the next command starts ends leasehold
        // with 128 + the signal, as while campaigning at first.
        *self.state.outcome.borrow_mut() = None;
        if lost {
            say(format!("campaigning again for lease {}", self.key));
        } else if exited {
            // Let the others have a go: release, and stay out for one retry period.
            say(format!(
                "releasing lease {} and campaigning again (--restart)",
                self.key
            ));
            // Called from inside the leader task: returns once the step-down has begun; the
            // release follows when this task returns.
            let _ = self.elector.yield_for(self.timings.retry_period).await;
        }
    }
}

/// "process group N", or "its process group" before the shim reported it.
fn group_words(proc: &child::Supervised) -> String {
    match proc.group() {
        Some(g) => format!("process group {}", g.as_raw_nonzero()),
        None => "the command's process group".to_owned(),
    }
}

/// The command as a person would type it (for messages).
fn shell_words(cmd: &[std::ffi::OsString]) -> String {
    cmd.iter()
        .map(|a| {
            let s = a.to_string_lossy();
            if s.is_empty() || s.contains(|c: char| c.is_whitespace() || "'\"$\\".contains(c)) {
                format!("'{}'", s.replace('\'', r"'\''"))
            } else {
                s.into_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The timings of `leasehold run`, checked.
#[derive(Clone, Copy, Debug)]
struct Timings {
    lease_duration: Duration,
    renew_deadline: Duration,
    retry_period: Duration,
    grace: Duration,
}

/// One timing flag: its name, what was given (if anything) and its default.
struct Flag<'a> {
    name: &'static str,
    given: Option<&'a DurationArg>,
    default: Duration,
}

impl Flag<'_> {
    fn value(&self) -> Duration {
        self.given.map_or(self.default, |g| g.value)
    }

    /// "--renew-deadline 3s" when given, else "the default --renew-deadline of 10s (not given)".
    fn shown(&self) -> String {
        match self.given {
            Some(g) => format!("{} {}", self.name, g.text),
            None => format!(
                "{} (not given: its default is {})",
                self.name,
                humantime::format_duration(self.default)
            ),
        }
    }
}

/// A duration as a flag value in whole milliseconds: `3s`, or `3333ms`.
fn ms(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// Checks the timing flags against the elector's rules, naming the flags, the defaults that
/// apply and the rule in each message.
fn timings(args: &RunArgs) -> Result<Timings, CliError> {
    let lease = Flag {
        name: "--lease-duration",
        given: args.lease_duration.as_ref(),
        default: Duration::from_secs(15),
    };
    let renew = Flag {
        name: "--renew-deadline",
        given: args.renew_deadline.as_ref(),
        default: Duration::from_secs(10),
    };
    let retry = Flag {
        name: "--retry-period",
        given: args.retry_period.as_ref(),
        default: Duration::from_secs(2),
    };
    let max = leasehold::elector::MAX_TIMING;
    for f in [&lease, &renew, &retry] {
        if f.value() > max {
            return Err(CliError::usage(format!(
                "{} is longer than the maximum of {}",
                f.shown(),
                humantime::format_duration(max)
            )));
        }
    }
    // client-go's ratio (15 s, 10 s, 2 s) for a suggestion that meets every rule.
    let suggest = |l: Duration| {
        format!(
            "for example --lease-duration {} --renew-deadline {} --retry-period {} \
             (client-go's 15s/10s/2s ratio)",
            ms(l),
            ms(l.mul_f64(2.0 / 3.0)),
            ms(l.mul_f64(2.0 / 15.0))
        )
    };
    if retry.value().is_zero() {
        return Err(CliError::usage(format!(
            "{} must be longer than zero (the default is 2s)",
            retry.shown()
        )));
    }
    if lease.value().is_zero() {
        return Err(CliError::usage(format!(
            "{} must be longer than zero (the default is 15s) and longer than {}",
            lease.shown(),
            renew.shown()
        )));
    }
    if lease.value() <= renew.value() {
        return Err(CliError::usage(format!(
            "{} must be longer than {}: the lease may only expire after the holder's renew \
             deadline has passed; {}",
            lease.shown(),
            renew.shown(),
            suggest(lease.value())
        )));
    }
    if renew.value().as_secs_f64() <= 1.2 * retry.value().as_secs_f64() {
        return Err(CliError::usage(format!(
            "{} must be longer than {}, 1.2 times {}: a renewal must have time for a retry \
             before the deadline; {}",
            renew.shown(),
            ms(retry.value().mul_f64(1.2)),
            retry.shown(),
            suggest(lease.value())
        )));
    }
    if args.grace.value.is_zero() {
        return Err(CliError::usage(format!(
            "--grace {} must be longer than zero (the default is 10s): it is how long the \
             command has between SIGTERM and SIGKILL",
            args.grace.text
        )));
    }
    Ok(Timings {
        lease_duration: lease.value(),
        renew_deadline: renew.value(),
        retry_period: retry.value(),
        grace: args.grace.value,
    })
}
