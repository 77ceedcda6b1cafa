//! Exit codes (sysexits-style) and the command's error type.

use std::fmt;
use std::process::ExitStatus;

/// Prints `line` to stdout and flushes. When stdout is gone (the reader, such as `head`,
/// exited), leasehold exits quietly with 0 instead of failing.
pub(crate) fn write_out(line: impl fmt::Display) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
        std::process::exit(0);
    }
}

/// `println!` that exits quietly when stdout is gone (see [`write_out`]).
macro_rules! outln {
    ($($arg:tt)*) => { $crate::exit::write_out(format_args!($($arg)*)) };
}
pub(crate) use outln;

/// Every exit code `leasehold` uses besides the child's own, for `--help` and the README.
pub(crate) const EXIT_CODES_HELP: &str = "\
Exit codes:
  0      success (run: the command exited with 0)
  1-125  run: the command's own exit code
  126    run: the command was found but could not be executed
  127    run: the command was not found
  128+N  run: the command was killed by signal N; also leasehold's own exit when it
         was stopped by signal N before the command started (130 SIGINT, 143 SIGTERM)
  64     usage error: bad arguments, an invalid store URL, lease name or timings
  69     the store is unreachable (connection refused, timeout, no quorum)
  70     internal error (the elector failed); please report it
  71     the command could not be started (operating-system error)
  75     run: the lease was lost while the command ran (it was stopped);
         release: the lease changed after it was read (nothing released)
  77     the store rejected the credentials or denied permission (RBAC)";

/// Bad arguments, URL, lease name or timings (`EX_USAGE`).
pub(crate) const USAGE: u8 = 64;
/// The store cannot be reached (`EX_UNAVAILABLE`).
pub(crate) const UNAVAILABLE: u8 = 69;
/// Internal error (`EX_SOFTWARE`).
pub(crate) const SOFTWARE: u8 = 70;
/// Operating-system error, such as failing to start the command (`EX_OSERR`).
pub(crate) const OSERR: u8 = 71;
/// The lease was lost, or changed under a release (`EX_TEMPFAIL`).
pub(crate) const LEASE_LOST: u8 = 75;
/// Credentials rejected or permission denied (`EX_NOPERM`).
pub(crate) const NOPERM: u8 = 77;
/// The command was not found (as shells report it).
pub(crate) const NOT_FOUND: u8 = 127;
/// The command could not be executed (as shells report it).
pub(crate) const NOT_EXECUTABLE: u8 = 126;

/// An error that ends the command: a message for stderr and an exit code.
#[derive(Debug)]
pub(crate) struct CliError {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl CliError {
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        CliError {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Self::new(USAGE, message)
    }

    /// A store or elector error, with the exit code for its kind and `context` in front.
    pub(crate) fn store(context: &str, e: leasehold::Error) -> Self {
        let code = code_for(&e);
        let hint = match &e {
            leasehold::Error::PermissionDenied { .. } => {
                " (grant the missing permission; for Kubernetes see the RBAC in backends/kube/deploy/rbac.yaml)"
            }
            leasehold::Error::Unavailable { .. } | leasehold::Error::Timeout { .. } => {
                " (is the store running and the URL right?)"
            }
            _ => "",
        };
        let message = e.to_string();
        // A store's own message usually ends with its advice in brackets already.
        let hint = if message.ends_with(')') { "" } else { hint };
        CliError::new(code, format!("{context}: {message}{hint}"))
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The exit code for a leasehold error.
pub(crate) fn code_for(e: &leasehold::Error) -> u8 {
    use leasehold::Error as E;
    match e {
        E::InvalidKey { .. } | E::InvalidConfig(_) => USAGE,
        E::Unavailable { .. } | E::Timeout { .. } | E::Store { .. } => UNAVAILABLE,
        E::Unauthenticated { .. } | E::PermissionDenied { .. } => NOPERM,
        _ => SOFTWARE,
    }
}

/// The exit code that reports `status` the way a shell does: the code, or 128 + the signal.
pub(crate) fn code_of_status(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        // Exit codes are 0-255 on unix; `code()` already holds the low byte.
        return u8::try_from(code & 0xff).unwrap_or(SOFTWARE);
    }
    match status.signal() {
        Some(sig) => u8::try_from(128 + (sig & 0x7f)).unwrap_or(SOFTWARE),
        None => SOFTWARE,
    }
}

/// Describes an exit status in words.
pub(crate) fn describe_status(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        return format!("exited with code {code}");
    }
    match status.signal() {
        Some(sig) => format!(
            "was killed by signal {sig} ({}) [exit code {}]",
            signal_name(sig),
            128 + sig
        ),
        None => "ended".to_owned(),
    }
}

/// A signal's usual name.
pub(crate) fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => "signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn statuses_map_like_a_shell() {
        assert_eq!(code_of_status(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(code_of_status(ExitStatus::from_raw(0)), 0);
        // Killed by SIGTERM (15) / SIGKILL (9).
        assert_eq!(code_of_status(ExitStatus::from_raw(15)), 143);
        assert_eq!(code_of_status(ExitStatus::from_raw(9)), 137);
    }

    #[test]
    fn error_kinds_map_to_documented_codes() {
        let e = leasehold::Error::Unavailable {
            store: "redis",
            message: "connection refused".into(),
            source: None,
        };
        assert_eq!(code_for(&e), UNAVAILABLE);
        let e = leasehold::Error::PermissionDenied {
            store: "kubernetes",
            message: "no".into(),
        };
        assert_eq!(code_for(&e), NOPERM);
        assert_eq!(
            code_for(&leasehold::Error::InvalidConfig("x".into())),
            USAGE
        );
        for code in [USAGE, UNAVAILABLE, SOFTWARE, OSERR, LEASE_LOST, NOPERM] {
            assert!(
                EXIT_CODES_HELP.contains(&format!("  {code} ")),
                "{code} is documented"
            );
        }
    }
}
