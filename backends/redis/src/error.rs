//! This crate's configuration errors and the mapping of redis-rs errors onto
//! [`leasehold::Error`].

use std::error::Error as _;

use redis::{ErrorKind, RedisError, ServerErrorKind};

use crate::STORE;

/// A configuration error of the Redis store. Converts into
/// [`leasehold::Error::InvalidConfig`].
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

    /// TLS settings could not be applied (for example a PEM that does not parse).
    #[error("invalid redis TLS configuration: {0}")]
    Tls(String),
}

impl From<Error> for leasehold::Error {
    fn from(e: Error) -> Self {
        leasehold::Error::InvalidConfig(e.to_string())
    }
}

/// Whether `e`'s source chain holds a rustls certificate error.
fn certificate_problem(e: &RedisError) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = e.source();
    while let Some(err) = cur {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return match tls {
                rustls::Error::InvalidCertificate(_)
                | rustls::Error::NoCertificatesPresented
                | rustls::Error::AlertReceived(_) => Some(tls.to_string()),
                _ => None,
            };
        }
        cur = err.source();
    }
    // redis-rs may flatten the io error into text.
    let text = e.to_string();
    (text.contains("invalid peer certificate") || text.contains("UnknownIssuer")).then_some(text)
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
    if e.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) || code.as_deref() == Some("NOPERM") {
        return leasehold::Error::PermissionDenied {
            store: STORE,
            message: format!(
                "{operation}: {e} (the ACL user needs EVALSHA, EVAL, SCRIPT LOAD, ZRANGEBYLEX, \
                 SUBSCRIBE and PING, and access to the keys and channels of the prefix)"
            ),
        };
    }
    if let Some(problem) = certificate_problem(&e) {
        return leasehold::Error::Store {
            store: STORE,
            message: format!(
                "{operation}: TLS handshake failed: {problem} (check the CA certificate \
                 configured with tls_root_ca_pem and the server's certificate and host name)"
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
