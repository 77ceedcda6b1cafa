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
// Parsed once per process: the size of the `run` variant does not matter.
#[allow(clippy::large_enum_variant)]
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

/// A duration argument: its value and the text it was given as (messages echo the text, so
/// `0s` reads as `0s`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct DurationArg {
    value: Duration,
    text: String,
}

/// What each duration flag defaults to and the rule it must meet (for messages).
fn duration_rule(flag: &str) -> (&'static str, &'static str) {
    match flag {
        "lease_duration" => ("15s", "it must be longer than --renew-deadline"),
        "renew_deadline" => (
            "10s",
            "it must be shorter than --lease-duration and longer than 1.2 × --retry-period",
        ),
        "retry_period" => (
            "2s",
            "it must be longer than zero, and --renew-deadline longer than 1.2 times it",
        ),
        "grace" => ("10s", "it must be longer than zero"),
        "healthz_timeout" => ("10s", "it may be zero"),
        "demo_lease_duration" => ("1s", "it must be between 300ms and 60s"),
        _ => ("none", "it is a length of time"),
    }
}

/// The value parser of every duration flag: humantime durations (`15s`, `500ms`, `1m`). Its
/// flags accept values that start with `-` (`allow_hyphen_values`), so that `-5s` is reported
/// as a bad duration for its flag instead of as an unexpected argument.
#[derive(Clone, Copy, Debug)]
struct DurationParser;

impl clap::builder::TypedValueParser for DurationParser {
    type Value = DurationArg;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<DurationArg, clap::Error> {
        let id = arg.map_or("", |a| a.get_id().as_str());
        let flag = arg
            .and_then(clap::Arg::get_long)
            .map_or_else(|| "the duration".to_owned(), |l| format!("--{l}"));
        let text = value.to_string_lossy();
        match parse_duration(&text) {
            Ok(value) => Ok(DurationArg {
                value,
                text: text.trim().to_owned(),
            }),
            Err(why) => {
                let (default, rule) = duration_rule(id);
                let message = format!(
                    "invalid value {text:?} for {flag}: {why}\n  {flag} takes a length of time \
                     such as 15s, 500ms or 1m (default {default}; {rule})\n"
                );
                Err(
                    clap::Error::raw(clap::error::ErrorKind::ValueValidation, message)
                        .with_cmd(cmd),
                )
            }
        }
    }
}

/// Parses a duration, with the reason in words when it is not one.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if let Some(rest) = t.strip_prefix('-') {
        return Err(
            if rest.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
                "a duration cannot be negative".to_owned()
            } else {
                "that is an option, not a duration (the value goes right after the flag)".to_owned()
            },
        );
    }
    humantime::parse_duration(t).map_err(|e| format!("not a duration: {e}"))
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
    /// How long followers wait after the holder's last renewal before taking over
    /// [default: 15s].
    #[arg(long, value_name = "DURATION", value_parser = DurationParser, allow_hyphen_values = true)]
    lease_duration: Option<DurationArg>,
    /// How long a term stays valid after its last confirmed renewal; the command is stopped
    /// when it passes without a renewal [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = DurationParser, allow_hyphen_values = true)]
    renew_deadline: Option<DurationArg>,
    /// How often the holder renews (and a follower without a watch polls) [default: 2s].
    #[arg(long, value_name = "DURATION", value_parser = DurationParser, allow_hyphen_values = true)]
    retry_period: Option<DurationArg>,
    /// How long the command gets between SIGTERM and SIGKILL when leasehold stops it (on a
    /// lost lease at most lease-duration - renew-deadline, see below).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = DurationParser, allow_hyphen_values = true)]
    grace: DurationArg,
    /// Create a lease that has no record at once, instead of after it stayed absent for one
    /// lease duration. Only safe when no holder can exist while the record is missing (see
    /// "A brand-new lease" below).
    #[arg(long)]
    trust_absence: bool,
    /// Campaign again after the command exits (or the lease is lost), and run it again.
    #[arg(long)]
    restart: bool,
    /// Serve /healthz and /metrics (Prometheus) on this address, e.g. 127.0.0.1:9090.
    #[arg(long, value_name = "ADDR")]
    http: Option<std::net::SocketAddr>,
    /// /healthz fails when leasehold believes it leads but its last renewal is older than
    /// --renew-deadline plus this (client-go's HealthzAdaptor timeout), or when it failed.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = DurationParser, allow_hyphen_values = true)]
    healthz_timeout: DurationArg,
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
    #[arg(id = "demo_lease_duration", long = "lease-duration", value_name = "DURATION", default_value = "1s", value_parser = DurationParser, allow_hyphen_values = true)]
    lease_duration: DurationArg,
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
/// (kube-rs's own request errors are left out: leasehold reports them itself). Without
/// `RUST_LOG` they read like leasehold's own lines (`leasehold: warning: …`); with it, they
/// have tracing's full format (time, level, spans) for debugging.
fn init_logging() {
    let from_env = tracing_subscriber::EnvFilter::try_from_default_env().ok();
    let verbose = from_env.is_some();
    let filter =
        from_env.unwrap_or_else(|| tracing_subscriber::EnvFilter::new("warn,kube_client=off"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false);
    let _ = if verbose {
        builder.try_init()
    } else {
        builder
            .with_ansi(false)
            .event_format(PlainFormat)
            .try_init()
    };
}

/// `leasehold: LEVEL: message fields`, one line per event (see [`init_logging`]).
struct PlainFormat;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for PlainFormat
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let level = match *event.metadata().level() {
            tracing::Level::ERROR => "error",
            tracing::Level::WARN => "warning",
            tracing::Level::INFO => "info",
            tracing::Level::DEBUG => "debug",
            tracing::Level::TRACE => "trace",
        };
        write!(writer, "leasehold: {level}: ")?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
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
                assert_eq!(
                    a.lease_duration.map(|d| d.value),
                    Some(Duration::from_secs(2))
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
