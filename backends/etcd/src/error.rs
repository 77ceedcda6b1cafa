//! The crate's error type and the mapping of etcd failures onto [`leasehold::Error`].

use std::error::Error as StdError;
use std::path::PathBuf;

use etcd_client::Error as ClientError;

use crate::STORE;

/// What can go wrong while configuring and connecting an [`EtcdStore`](crate::EtcdStore)
/// (configuration, certificate files, reaching the servers).
///
/// Everything a [`LeaseStore`](leasehold::LeaseStore) operation returns is a
/// [`leasehold::Error`]; this type converts into one with `From`: [`Error::Connect`] into the
/// error it carries, every other variant into [`leasehold::Error::InvalidConfig`] with its
/// message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is missing or inconsistent.
    #[error("invalid etcd configuration: {0}")]
    InvalidConfig(String),

    /// A PEM file named in the TLS configuration could not be read.
    #[error("cannot read {what} from {path:?}: {source}")]
    ReadFile {
        /// What the file should hold (for example "CA certificate").
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// Reaching or authenticating to etcd failed at connect:
    /// [`leasehold::Error::Unavailable`] naming the endpoints (none answered in time),
    /// [`leasehold::Error::Unauthenticated`] (rejected credentials),
    /// [`leasehold::Error::PermissionDenied`] (the user may not read the prefix), or a
    /// non-retryable [`leasehold::Error::Store`] naming a TLS problem.
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

/// A gRPC status code number, as `tonic::Code as i32` gives it.
type Code = i32;

/// The gRPC code numbers (<https://grpc.github.io/grpc/core/md_doc_statuscodes.html>).
mod grpc {
    use super::Code;
    pub(crate) const CANCELLED: Code = 1;
    pub(crate) const UNKNOWN: Code = 2;
    pub(crate) const INVALID_ARGUMENT: Code = 3;
    pub(crate) const DEADLINE_EXCEEDED: Code = 4;
    pub(crate) const FAILED_PRECONDITION: Code = 9;
    pub(crate) const PERMISSION_DENIED: Code = 7;
    pub(crate) const RESOURCE_EXHAUSTED: Code = 8;
    pub(crate) const ABORTED: Code = 10;
    pub(crate) const INTERNAL: Code = 13;
    pub(crate) const UNAVAILABLE: Code = 14;
    pub(crate) const UNAUTHENTICATED: Code = 16;
}

/// The error and all its sources, joined with ": ", so a TLS or connection failure says why.
pub(crate) fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    let mut depth = 0;
    while let Some(s) = cur {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cur = s.source();
        depth += 1;
        if depth > 16 {
            break;
        }
    }
    out
}

/// Maps a gRPC status (code and message) onto a leasehold error.
pub(crate) fn from_status(operation: &'static str, code: Code, message: &str) -> leasehold::Error {
    let lower = message.to_ascii_lowercase();
    if lower.contains("authentication failed") || lower.contains("invalid user id or password") {
        return leasehold::Error::Unauthenticated {
            store: STORE,
            message: format!(
                "{message} (check the user name and password given to EtcdConfig::with_user)"
            ),
        };
    }
    if lower.contains("user name is empty") || lower.contains("user name not found") {
        return leasehold::Error::Unauthenticated {
            store: STORE,
            message: format!(
                "{message} (the server has authentication enabled: configure a user with EtcdConfig::with_user, or a client certificate whose common name is an etcd user)"
            ),
        };
    }
    if lower.contains("invalid auth token") {
        // The token expired or the server restarted with new token keys: the client refreshes it.
        return leasehold::Error::Store {
            store: STORE,
            message: format!("{operation}: {message}"),
            retryable: true,
            source: None,
        };
    }
    match code {
        grpc::PERMISSION_DENIED => leasehold::Error::PermissionDenied {
            store: STORE,
            message: format!(
                "{operation}: {message} (the user's role needs read and write permission on the key range under the configured prefix)"
            ),
        },
        grpc::UNAUTHENTICATED => leasehold::Error::Unauthenticated {
            store: STORE,
            message: message.to_owned(),
        },
        grpc::UNAVAILABLE | grpc::RESOURCE_EXHAUSTED | grpc::CANCELLED => {
            leasehold::Error::Unavailable {
                store: STORE,
                message: format!("{operation}: {message}"),
                source: None,
            }
        }
        grpc::DEADLINE_EXCEEDED => leasehold::Error::Unavailable {
            store: STORE,
            message: format!("{operation}: deadline exceeded: {message}"),
            source: None,
        },
        grpc::INVALID_ARGUMENT => leasehold::Error::Invalid {
            store: STORE,
            message: format!("{operation}: {message}"),
        },
        grpc::UNKNOWN | grpc::ABORTED | grpc::INTERNAL => leasehold::Error::Store {
            store: STORE,
            message: format!("{operation}: {message}"),
            retryable: true,
            source: None,
        },
        grpc::FAILED_PRECONDITION => leasehold::Error::Store {
            store: STORE,
            message: format!("{operation}: {message}"),
            retryable: false,
            source: None,
        },
        _ => leasehold::Error::Store {
            store: STORE,
            message: format!("{operation}: {message} (grpc code {code})"),
            retryable: false,
            source: None,
        },
    }
}

/// Whether a status message describes a failed connection rather than a server answer.
pub(crate) fn is_transport_message(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("transport error")
        || m.contains("tcp connect error")
        || m.contains("error trying to connect")
        || m.contains("connection refused")
        || m.contains("connection reset")
        || m.contains("broken pipe")
        || m.contains("handshake")
}

/// What to fix when `message` (an error with its sources) says that the TLS handshake failed
/// over a certificate; `None` for any other failure.
pub(crate) fn certificate_hint(message: &str) -> Option<&'static str> {
    let m = message.to_ascii_lowercase();
    if m.contains("invalid peer certificate") {
        return Some(
            if m.contains("unknownissuer") || m.contains("badsignature") || m.contains("unknown ca")
            {
                "the server's certificate is not trusted by the configured CA: check the CA \
                 certificate given to TlsConfig::with_ca_pem (it must be the CA that signed the \
                 server's certificate)"
            } else if m.contains("not valid for name") || m.contains("notvalidforname") {
                "the server's certificate does not name the host in the endpoint: use a host \
                 name or IP address the certificate lists, or set TlsConfig::with_domain_name"
            } else if m.contains("expired") || m.contains("not valid yet") {
                "the server's certificate is outside its validity period: renew it (or check \
                 this machine's clock)"
            } else {
                "the server's certificate was rejected: check the CA certificate given to \
                 TlsConfig::with_ca_pem and the server's certificate"
            },
        );
    }
    let alert = m.contains("received fatal alert")
        && [
            "certificaterequired",
            "badcertificate",
            "unknownca",
            "certificateunknown",
            "unsupportedcertificate",
            "certificateexpired",
            "certificaterevoked",
        ]
        .iter()
        .any(|a| m.contains(a));
    alert.then_some(
        "the server rejected this client's certificate: configure a client certificate and key \
         signed by a CA the server trusts with TlsConfig::with_client_identity_pem",
    )
}

/// A certificate failure: never retryable (retrying cannot fix it), with what to fix.
fn certificate_error(operation: &'static str, hint: &str, message: &str) -> leasehold::Error {
    leasehold::Error::Store {
        store: STORE,
        message: format!("{operation}: TLS handshake failed: {hint} ({message})"),
        retryable: false,
        source: None,
    }
}

/// Maps an `etcd-client` error onto a leasehold error.
pub(crate) fn from_client(operation: &'static str, e: ClientError) -> leasehold::Error {
    if !matches!(e, ClientError::GRpcStatus(_)) {
        let full = chain(&e);
        if let Some(hint) = certificate_hint(&full) {
            return certificate_error(operation, hint, &full);
        }
    }
    match e {
        ClientError::GRpcStatus(status) => {
            // Connection-level failures come as a status whose source says what went wrong
            // (TLS handshake, refused connection); keep that in the message.
            let mut message = status.message().to_owned();
            if let Some(source) = StdError::source(&status) {
                let detail = chain(source);
                if !message.contains(&detail) {
                    message = format!("{message}: {detail}");
                }
            }
            if let Some(hint) = certificate_hint(&message) {
                return certificate_error(operation, hint, &message);
            }
            let code = status.code() as i32;
            let code = if code == grpc::UNKNOWN && is_transport_message(&message) {
                grpc::UNAVAILABLE
            } else {
                code
            };
            from_status(operation, code, &message)
        }
        ClientError::TransportError(_)
        | ClientError::IoError(_)
        | ClientError::WatchError(_)
        | ClientError::EndpointError(_) => {
            let message = format!("{operation}: {}", chain(&e));
            leasehold::Error::Unavailable {
                store: STORE,
                message,
                source: Some(Box::new(e)),
            }
        }
        ClientError::InvalidArgs(_) | ClientError::InvalidUri(_) => {
            leasehold::Error::InvalidConfig(format!("etcd {operation}: {}", chain(&e)))
        }
        other => leasehold::Error::Store {
            store: STORE,
            message: format!("{operation}: {}", chain(&other)),
            retryable: false,
            source: Some(Box::new(other)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_leader_and_timeouts_are_retryable() {
        for (code, msg) in [
            (grpc::UNAVAILABLE, "etcdserver: no leader"),
            (grpc::UNAVAILABLE, "etcdserver: leader changed"),
            (grpc::UNAVAILABLE, "etcdserver: request timed out"),
            (grpc::DEADLINE_EXCEEDED, "context deadline exceeded"),
            (grpc::UNAUTHENTICATED, "etcdserver: invalid auth token"),
        ] {
            assert!(from_status("get", code, msg).is_retryable(), "{msg}");
        }
    }

    #[test]
    fn auth_errors_are_typed_and_explained() {
        let e = from_status(
            "connect",
            grpc::INVALID_ARGUMENT,
            "etcdserver: authentication failed, invalid user ID or password",
        );
        assert!(
            matches!(e, leasehold::Error::Unauthenticated { .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("user name and password"), "{e}");
        let e = from_status(
            "get",
            grpc::INVALID_ARGUMENT,
            "etcdserver: user name is empty",
        );
        assert!(
            matches!(e, leasehold::Error::Unauthenticated { .. }),
            "{e:?}"
        );
        let e = from_status(
            "get",
            grpc::PERMISSION_DENIED,
            "etcdserver: permission denied",
        );
        assert!(
            matches!(e, leasehold::Error::PermissionDenied { .. }),
            "{e:?}"
        );
        assert!(!e.is_retryable());
    }

    #[test]
    fn certificate_failures_say_what_to_fix() {
        for (text, fix) in [
            (
                "transport error: invalid peer certificate: UnknownIssuer",
                "with_ca_pem",
            ),
            (
                "invalid peer certificate: certificate not valid for name \"etcd\"; certificate is only valid for localhost",
                "with_domain_name",
            ),
            (
                "invalid peer certificate: certificate expired: verification time 2 (UNIX), but certificate is not valid after 1 (1 seconds ago)",
                "renew",
            ),
            (
                "connection error: received fatal alert: CertificateRequired",
                "with_client_identity_pem",
            ),
        ] {
            let hint = certificate_hint(text).unwrap_or_else(|| panic!("no hint for {text}"));
            assert!(hint.contains(fix), "{hint}");
            let e = certificate_error("get", hint, text);
            assert!(!e.is_retryable(), "{e}");
        }
        for text in [
            "transport error: tcp connect error: Connection refused",
            "received fatal alert: InternalError",
            "etcdserver: no leader",
        ] {
            assert_eq!(certificate_hint(text), None, "{text}");
        }
    }
}
