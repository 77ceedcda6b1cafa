//! This crate's configuration errors and the mapping of redis-rs errors onto
//! [`leasehold::Error`].

use redis::{ErrorKind, RedisError, ServerErrorKind};

use crate::STORE;

/// What can go wrong while configuring and connecting a [`RedisStore`](crate::RedisStore).
///
/// Errors of store operations are [`leasehold::Error`]s. This type converts into one with
/// `From`: [`Error::Connect`] into the error it carries, every other variant into
/// [`leasehold::Error::InvalidConfig`] with its message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection URL is not usable. The URL shown has its password redacted.
    #[error("invalid redis URL {url}: {reason}")]
    InvalidUrl {
        /// The URL, password redacted.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The key namespace prefix is not usable.
    #[error("invalid redis key prefix {prefix:?}: {reason}")]
    InvalidPrefix {
        /// The rejected prefix.
        prefix: String,
        /// The rule it broke.
        reason: &'static str,
    },

    /// The URL asks to skip TLS certificate verification (`#insecure`), which this store refuses:
    /// anyone on the network path could then impersonate the server and hand out leases. The URL
    /// shown has its password redacted.
    #[error(
        "redis URL {url} asks to skip TLS certificate verification (#insecure), which this store \
         refuses: remove the #insecure fragment and trust the server's CA with \
         RedisConfig::with_tls_ca_pem instead"
    )]
    InsecureTls {
        /// The URL, password redacted.
        url: String,
    },

    /// TLS settings could not be applied (for example a PEM that does not parse).
    #[error("invalid redis TLS configuration: {0}")]
    Tls(String),

    /// Another setting is unusable (a zero timeout), or does not fit the server (a server in
    /// cluster mode without [`RedisConfig::with_cluster`](crate::RedisConfig::with_cluster)).
    #[error("invalid redis configuration: {0}")]
    InvalidConfig(String),

    /// Reaching or authenticating to the server failed at connect:
    /// [`leasehold::Error::Unavailable`] or [`leasehold::Error::Timeout`] (the server is not
    /// reachable), [`leasehold::Error::Unauthenticated`] (rejected credentials),
    /// [`leasehold::Error::PermissionDenied`], or a non-retryable [`leasehold::Error::Store`]
    /// naming a TLS problem.
    #[error(transparent)]
    Connect(leasehold::Error),
}

impl From<Error> for leasehold::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Connect(e) => e,
            other => leasehold::Error::InvalidConfig(other.to_string()),
        }
    }
}

/// A TLS problem that retrying cannot fix, with what to change.
fn certificate_problem(e: &RedisError) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(tls) = as_rustls(err) {
            return tls_advice(tls);
        }
        cur = err.source();
    }
    // redis-rs may flatten the io error into text.
    let text = e.to_string();
    (text.contains("invalid peer certificate") || text.contains("UnknownIssuer")).then(|| {
        format!("{text} (check the CA configured with with_tls_ca_pem and the server's certificate and host name)")
    })
}

/// `err` as a rustls error, also when an `io::Error` wraps it (whose `source()` skips the
/// wrapped error itself), and when redis-rs holds it in an `Arc` (its `source()` hands out the
/// `Arc`, whose own `source()` skips the io error).
fn as_rustls<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let err = match err.downcast_ref::<std::sync::Arc<dyn std::error::Error + Send + Sync>>() {
        Some(arc) => &**arc as &(dyn std::error::Error + 'static),
        None => err,
    };
    if let Some(tls) = err.downcast_ref::<rustls::Error>() {
        return Some(tls);
    }
    err.downcast_ref::<std::io::Error>()?
        .get_ref()?
        .downcast_ref::<rustls::Error>()
}

fn tls_advice(tls: &rustls::Error) -> Option<String> {
    use rustls::AlertDescription as A;
    match tls {
        rustls::Error::InvalidCertificate(_) => Some(format!(
            "{tls} (check the CA configured with with_tls_ca_pem, the server's certificate and \
             that the URL's host name is one the certificate names)"
        )),
        rustls::Error::NoCertificatesPresented => Some(format!(
            "{tls} (the server presented no certificate; check its tls-cert-file)"
        )),
        rustls::Error::AlertReceived(
            A::CertificateRequired
            | A::BadCertificate
            | A::UnknownCA
            | A::CertificateExpired
            | A::CertificateRevoked
            | A::CertificateUnknown
            | A::UnsupportedCertificate
            | A::AccessDenied
            | A::DecryptError,
        ) => Some(format!(
            "{tls} (the server rejected this client's certificate: set one its tls-ca-cert-file \
             trusts with RedisConfig::with_tls_client_identity_pem)"
        )),
        rustls::Error::AlertReceived(_) | rustls::Error::PeerIncompatible(_) => Some(format!(
            "{tls} (the server refused the TLS handshake: check its TLS settings, such as \
             tls-protocols and tls-ciphersuites, against a TLS 1.2/1.3 client)"
        )),
        _ => None,
    }
}

/// Converts a redis-rs error from `operation` into the leasehold error the elector acts on.
///
/// The redis-rs error text never contains the password (it does not echo `AUTH`), so it is kept.
pub(crate) fn from_redis(operation: &'static str, e: RedisError) -> leasehold::Error {
    let code = e.code().map(str::to_owned);
    if e.kind() == ErrorKind::AuthenticationFailed
        || matches!(code.as_deref(), Some("WRONGPASS" | "NOAUTH"))
    {
        return leasehold::Error::Unauthenticated {
            store: STORE,
            message: format!(
                "{operation}: {e} (check the user name and password in the redis URL, \
                 or the server's requirepass/ACL)"
            ),
        };
    }
    // A command a script runs that the ACL denies comes back as a plain script error.
    let denied_in_script = e
        .to_string()
        .contains("user executing the script can't run");
    if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm)
        || code.as_deref() == Some("NOPERM")
        || denied_in_script
    {
        return leasehold::Error::PermissionDenied {
            store: STORE,
            message: format!(
                "{operation}: {e} (the ACL user needs the rules RedisConfig::acl_rules gives: \
                 EVALSHA, EVAL, SCRIPT LOAD and the commands the scripts run, on the prefix's \
                 keys and channels; see the README)"
            ),
        };
    }
    if let Some(problem) = certificate_problem(&e) {
        return leasehold::Error::Store {
            store: STORE,
            message: format!("{operation}: TLS handshake failed: {problem}"),
            retryable: false,
            source: Some(Box::new(e)),
        };
    }
    if matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved | ServerErrorKind::Ask | ServerErrorKind::CrossSlot
        )
    ) {
        return leasehold::Error::Store {
            store: STORE,
            message: format!(
                "{operation}: {e} (a Redis Cluster redirection: the store is configured for a \
                 standalone server; configure it with RedisConfig::with_cluster() for a cluster)"
            ),
            retryable: false,
            source: Some(Box::new(e)),
        };
    }
    if e.kind() == ErrorKind::InvalidClientConfig {
        return leasehold::Error::InvalidConfig(format!("redis {operation}: {e}"));
    }
    let transient = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        // The cluster client reaches no node for the slot (all down, or topology unknown yet).
        || e.kind() == ErrorKind::ClusterConnectionNotFound
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
            )
        )
        || matches!(
            code.as_deref(),
            Some("BUSY" | "LOADING" | "OOM" | "MISCONF")
        );
    if transient {
        return leasehold::Error::Unavailable {
            store: STORE,
            message: format!("{operation}: {e}"),
            source: Some(Box::new(e)),
        };
    }
    leasehold::Error::Store {
        store: STORE,
        message: format!("{operation}: {e}"),
        retryable: false,
        source: Some(Box::new(e)),
    }
}
