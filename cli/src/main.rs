//! `leasehold`: run a process only while holding a lease, inspect, watch and release leases,
//! and a live demo of leader election. See `leasehold --help` and the crate README.

mod child;
mod demo;
mod exit;
mod http;
mod inspect;
mod refusal;
mod run;
mod stores;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::exit::CliError;

const ABOUT: &str = "Run a process only while holding a lease; inspect, watch and release leases";

const LONG_ABOUT: &str = "\
leasehold: leader election for processes and shell scripts, on Redis, etcd or Kubernetes Leases.

`leasehold run` campaigns for a lease and runs a command only while it holds it (like
`consul lock`); `status`, `watch` and `release` inspect and administer leases; `demo` shows a
live handover and a crash failover on an in-process store.

Start here:
  leasehold demo";

const AFTER_HELP: &str = "\
Examples:
  leasehold demo
  leasehold run --store redis://127.0.0.1:6379 --lease nightly-report -- ./report.sh
  leasehold run --store etcd://10.0.0.1:2379,10.0.0.2:2379 --lease cron --restart -- ./worker
  leasehold status --store kube://default --prefix ''
  leasehold watch --store redis://127.0.0.1 --lease nightly-report --json";

#[derive(Parser, Debug)]
#[command(
    name = "leasehold",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP,
    after_long_help = format!("{AFTER_HELP}\n\n{}\n\n{}", stores::FORMS, exit::EXIT_CODES_HELP),
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand, Debug)]
enum Commands {
    /// Campaign for a lease and run a command only while holding it.
    #[command(
        long_about = run::LONG_ABOUT,
        after_long_help = format!("{}\n\n{}\n\n{}", run::EXAMPLES, stores::FORMS, exit::EXIT_CODES_HELP)
    )]
    Run(RunArgs),
    /// Show who holds a lease (or every lease under a prefix).
    #[command(
        long_about = inspect::STATUS_LONG_ABOUT,
        after_long_help = format!("{}\n\n{}", stores::FORMS, exit::EXIT_CODES_HELP)
    )]
    Status(StatusArgs),
    /// Print one line per change of a lease until interrupted.
    #[command(
        long_about = inspect::WATCH_LONG_ABOUT,
        after_long_help = format!("{}\n\n{}", stores::FORMS, exit::EXIT_CODES_HELP)
    )]
    Watch(WatchArgs),
    /// Release a lease administratively (compare-and-swap on the version read).
    #[command(
        long_about = inspect::RELEASE_LONG_ABOUT,
        after_long_help = format!("{}\n\n{}", stores::FORMS, exit::EXIT_CODES_HELP)
    )]
    Release(ReleaseArgs),
    /// A live demo: three candidates on an in-process store, a handover and a crash failover.
    #[command(long_about = demo::LONG_ABOUT)]
    Demo(DemoArgs),
    /// (internal) The command's supervisor (see `child`); used by `run`.
    #[command(name = "__exec", hide = true)]
    Exec(ExecArgs),
}

/// Where the lease lives.
#[derive(Args, Debug, Clone)]
struct StoreArgs {
    /// The store URL: redis://, rediss://, etcd://, etcds:// or kube:// (see below).
    #[arg(long, value_name = "URL", env = "LEASEHOLD_STORE")]
    store: String,
    /// CA certificate (PEM) that signed the server's certificate (rediss://, etcds://).
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS; needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

impl StoreArgs {
    fn url(&self) -> Result<stores::StoreUrl, CliError> {
        let env = std::env::var(stores::PASSWORD_ENV).ok();
        stores::parse(&self.store, env.as_deref())
    }

    fn tls(&self) -> stores::TlsFiles {
        stores::TlsFiles {
            ca: self.tls_ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
        }
    }
}

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write e.g. 15s, 500ms, 1m)"))
}

/// Arguments of `leasehold run`.
#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The lease name (lower-case letters, digits, '-' and '.').
    #[arg(long, value_name = "NAME")]
    lease: String,
    /// This candidate's identity [default: HOSTNAME-RANDOM].
    #[arg(long, value_name = "ID")]
    identity: Option<String>,
    /// How long followers wait after the holder's last renewal before taking over.
    #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = duration)]
    lease_duration: Duration,
    /// How long a term stays valid after its last confirmed renewal; the command is stopped
    /// when it passes without a renewal.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration)]
    renew_deadline: Duration,
    /// How often the holder renews (and a follower without a watch polls).
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = duration)]
    retry_period: Duration,
    /// How long the command gets between SIGTERM and SIGKILL when leasehold stops it (on a
    /// lost lease at most lease-duration - renew-deadline, see below).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration)]
    grace: Duration,
    /// Campaign again after the command exits (or the lease is lost), and run it again.
    #[arg(long)]
    restart: bool,
    /// Serve /healthz and /metrics (Prometheus) on this address, e.g. 127.0.0.1:9090.
    #[arg(long, value_name = "ADDR")]
    http: Option<std::net::SocketAddr>,
    /// /healthz fails when leasehold believes it leads but its last renewal is older than
    /// --renew-deadline plus this (client-go's HealthzAdaptor timeout), or when it failed.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration)]
    healthz_timeout: Duration,
    /// The command and its arguments (after `--`).
    #[arg(
        last = true,
        required = true,
        value_name = "CMD",
        allow_hyphen_values = true
    )]
    cmd: Vec<OsString>,
}

/// Arguments of the hidden `leasehold __exec` (see `child`).
#[derive(Args, Debug)]
struct ExecArgs {
    /// The pid of the `leasehold` that starts it.
    #[arg(long)]
    parent: i32,
    /// `leasehold`'s fds of the control pipe's read end and the report pipe's write end.
    #[arg(long, value_name = "R,W", value_parser = fd_pair)]
    pipes: Option<(i32, i32)>,
    /// The term's deadline, CLOCK_MONOTONIC nanoseconds.
    #[arg(long)]
    deadline_ns: Option<u64>,
    /// --grace in nanoseconds.
    #[arg(long)]
    grace_ns: u64,
    /// The lost-term grace in nanoseconds.
    #[arg(long)]
    lost_grace_ns: u64,
    /// The command and its arguments.
    #[arg(last = true, required = true, allow_hyphen_values = true)]
    cmd: Vec<OsString>,
}

fn fd_pair(s: &str) -> Result<(i32, i32), String> {
    let (a, b) = s.split_once(',').ok_or("expected R,W")?;
    Ok((
        a.parse().map_err(|e| format!("{e}"))?,
        b.parse().map_err(|e| format!("{e}"))?,
    ))
}

/// Arguments of `leasehold status`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["lease", "prefix"])))]
struct StatusArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The lease to show.
    #[arg(long, value_name = "NAME")]
    lease: Option<String>,
    /// Show every lease whose name starts with this (may be empty: all leases).
    #[arg(long, value_name = "P")]
    prefix: Option<String>,
    /// One JSON object per lease and line instead of a table.
    #[arg(long)]
    json: bool,
}

/// Arguments of `leasehold watch`.
#[derive(Args, Debug)]
struct WatchArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The lease to watch.
    #[arg(long, value_name = "NAME")]
    lease: String,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// Print every change, renewals included (by default: changes of holder, fencing token or
    /// lease duration, and deletions).
    #[arg(long)]
    renewals: bool,
}

/// Arguments of `leasehold release`.
#[derive(Args, Debug)]
struct ReleaseArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// The lease to release.
    #[arg(long, value_name = "NAME")]
    lease: String,
    /// Do not ask for confirmation (required when stdin is not a terminal).
    #[arg(long, short = 'y')]
    yes: bool,
    /// Delete the record instead of writing a vacant one (the fencing-token count restarts from
    /// the store's fencing seed).
    #[arg(long)]
    delete: bool,
}

/// Arguments of `leasehold demo`.
#[derive(Args, Debug)]
struct DemoArgs {
    /// Lease duration of the demo's candidates (renew deadline and retry period scale with it).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = duration)]
    lease_duration: Duration,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = match e.kind() {
                clap::error::ErrorKind::DisplayHelp
                | clap::error::ErrorKind::DisplayVersion
                | clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => 0,
                _ => exit::USAGE,
            };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    // The shim: no logging, its own small runtime.
    if let Commands::Exec(a) = cli.command {
        return ExitCode::from(child::shim(child::ShimArgs {
            parent: a.parent,
            pipes: a.pipes,
            deadline: a.deadline_ns,
            grace: Duration::from_nanos(a.grace_ns),
            lost_grace: Duration::from_nanos(a.lost_grace_ns),
            cmd: a.cmd,
        }));
    }
    init_logging();
    // One current-thread runtime on the main thread.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("leasehold: cannot start the async runtime: {e}");
            return ExitCode::from(exit::OSERR);
        }
    };
    let result = match cli.command {
        Commands::Run(args) => runtime.block_on(run::run(args)),
        Commands::Status(args) => runtime.block_on(inspect::status(args)),
        Commands::Watch(args) => runtime.block_on(inspect::watch(args)),
        Commands::Release(args) => runtime.block_on(inspect::release(args)),
        Commands::Demo(args) => demo::demo(args),
        Commands::Exec(_) => Ok(0),
    };
    // Do not wait for stray background tasks (a watch, a connection) at exit.
    runtime.shutdown_background();
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("leasehold: {e}");
            ExitCode::from(e.code)
        }
    }
}

/// Logs from the library go to stderr, `warn` and above unless `RUST_LOG` says otherwise
/// (kube-rs's own request errors are left out: leasehold reports them itself).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,kube_client=off"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_takes_the_command_after_a_double_dash() {
        let cli = Cli::try_parse_from([
            "leasehold",
            "run",
            "--store",
            "redis://127.0.0.1",
            "--lease",
            "x",
            "--lease-duration",
            "2s",
            "--",
            "sh",
            "-c",
            "echo hi",
        ])
        .expect("parses");
        match cli.command {
            Commands::Run(a) => {
                assert_eq!(a.cmd, ["sh", "-c", "echo hi"]);
                assert_eq!(a.lease_duration, Duration::from_secs(2));
            }
            other => panic!("{other:?}"),
        }
    }
}
