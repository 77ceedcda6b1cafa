//! The crate's own error type and the conversion of kube-rs errors into [`leasehold::Error`].

use std::time::Duration;

use kube::core::Status;
use leasehold::{LeaseKey, Version};

use crate::STORE_NAME;

/// What can go wrong while configuring and connecting a [`KubeStore`](crate::KubeStore).
///
/// Errors of store operations are [`leasehold::Error`]s. This type converts into one with
/// `From`: [`Error::Connect`] into the error it carries, every other variant into
/// [`leasehold::Error::InvalidConfig`] with its message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No Kubernetes client configuration could be found: no kubeconfig (`KUBECONFIG`,
    /// `~/.kube/config`) and not in a cluster.
    #[error(
        "cannot find a Kubernetes client configuration (set KUBECONFIG, create ~/.kube/config, \
         or run in a pod with a service account): {0}"
    )]
    Kubeconfig(#[source] kube::config::InferConfigError),

    /// No Kubernetes client could be built from the configuration.
    #[error("cannot build a Kubernetes client from the configuration: {0}")]
    Client(#[source] kube::Error),

    /// A configuration value was out of range.
    #[error("invalid kubernetes store configuration: {0}")]
    InvalidConfig(String),

    /// The namespace is not a Kubernetes namespace name (an RFC 1123 label: at most 63
    /// characters from `a-z`, `0-9` and `-`, starting and ending with a letter or digit).
    #[error("invalid kubernetes namespace {namespace:?}: {rule}")]
    InvalidNamespace {
        /// The namespace as given.
        namespace: String,
        /// The rule it breaks.
        rule: &'static str,
    },

    /// Reaching the API server failed at connect: [`leasehold::Error::Unavailable`] naming the
    /// server (not reachable, or no answer in time), [`leasehold::Error::Unauthenticated`]
    /// (credentials refused) or [`leasehold::Error::PermissionDenied`] naming the missing RBAC
    /// verb.
    #[error(transparent)]
    Connect(leasehold::Error),
}

impl From<Error> for leasehold::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Connect(e) => e,
            Error::InvalidConfig(msg) => leasehold::Error::InvalidConfig(msg),
            other => leasehold::Error::InvalidConfig(other.to_string()),
        }
    }
}

/// A store operation, for error messages and the RBAC verb it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Get,
    Create,
    Update,
    Delete,
    Watch,
    List,
}

impl Op {
    /// The operation's name in [`leasehold::Error::Timeout`].
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Get => "get",
            Op::Create => "create",
            Op::Update => "update",
            Op::Delete => "delete",
            Op::Watch => "watch",
            Op::List => "list",
        }
    }

    /// The RBAC verb the operation needs on `leases`.
    pub(crate) fn verb(self) -> &'static str {
        // The verbs coincide with the operation names.
        self.name()
    }
}

/// The context an error happened in.
pub(crate) struct Ctx<'a> {
    pub(crate) op: Op,
    pub(crate) namespace: &'a str,
    /// The API server's address, when the store knows it ([`KubeStore::connect`]).
    ///
    /// [`KubeStore::connect`]: crate::KubeStore::connect
    pub(crate) server: Option<&'a str>,
    pub(crate) key: Option<&'a LeaseKey>,
    pub(crate) expected: Option<&'a Version>,
}

impl Ctx<'_> {
    fn key_string(&self) -> String {
        self.key.map(ToString::to_string).unwrap_or_default()
    }

    /// ` (Kubernetes API server at …)` when the server's address is known, for messages of
    /// errors that say it could not be reached.
    fn at_server(&self) -> String {
        self.server
            .map(|s| format!(" (Kubernetes API server at {s})"))
            .unwrap_or_default()
    }
}

/// The operation did not finish within `after`.
pub(crate) fn timeout(op: Op, after: Duration) -> leasehold::Error {
    leasehold::Error::Timeout {
        store: STORE_NAME,
        operation: op.name(),
        after,
    }
}

/// Maps a `Status` the API server answered with.
pub(crate) fn map_status(status: &Status, ctx: &Ctx<'_>) -> leasehold::Error {
    let msg = if status.message.is_empty() {
        format!("HTTP {} {}", status.code, status.reason)
    } else {
        status.message.clone()
    };
    match status.code {
        409 if status.reason == "AlreadyExists" || ctx.op == Op::Create => {
            leasehold::Error::AlreadyExists {
                key: ctx.key_string(),
            }
        }
        409 => match ctx.expected {
            Some(expected) => leasehold::Error::Conflict {
                key: ctx.key_string(),
                expected: expected.clone(),
            },
            None => leasehold::Error::Store {
                store: STORE_NAME,
                message: msg,
                retryable: false,
                source: None,
            },
        },
        404 if matches!(ctx.op, Op::Update | Op::Delete) => leasehold::Error::NotFound {
            key: ctx.key_string(),
        },
        401 => leasehold::Error::Unauthenticated {
            store: STORE_NAME,
            message: format!(
                "{msg} (the API server did not accept the client's credentials: check the token, \
                 client certificate or kubeconfig)"
            ),
        },
        403 => leasehold::Error::PermissionDenied {
            store: STORE_NAME,
            message: format!(
                "missing RBAC permission: {} leases.coordination.k8s.io in namespace {} \
                 (grant it with a Role, see deploy/rbac.yaml; server said: {msg})",
                verb_in_message(&msg).unwrap_or(ctx.op.verb()),
                ctx.namespace
            ),
        },
        422 => leasehold::Error::Invalid {
            store: STORE_NAME,
            message: msg,
        },
        400 => leasehold::Error::Invalid {
            store: STORE_NAME,
            message: msg,
        },
        408 | 429 | 500..=599 => leasehold::Error::Unavailable {
            store: STORE_NAME,
            message: format!(
                "{} failed with HTTP {}: {msg}{}",
                ctx.op.name(),
                status.code,
                ctx.at_server()
            ),
            source: None,
        },
        _ => leasehold::Error::Store {
            store: STORE_NAME,
            message: format!("{} failed with HTTP {}: {msg}", ctx.op.name(), status.code),
            retryable: false,
            source: None,
        },
    }
}

/// The RBAC verb a 403 message names (`User "u" cannot create resource "leases" …`), so that a
/// request that needs another verb than its operation's (a `PUT` that would create needs
/// `create`) is reported with the verb that is actually missing.
fn verb_in_message(msg: &str) -> Option<&'static str> {
    let (_, rest) = msg.split_once(" cannot ")?;
    let verb = rest.split(' ').next()?;
    [
        "get", "list", "watch", "create", "update", "delete", "patch",
    ]
    .into_iter()
    .find(|v| *v == verb)
}

/// Maps any kube-rs error.
pub(crate) fn map_kube(err: kube::Error, ctx: &Ctx<'_>) -> leasehold::Error {
    match err {
        kube::Error::Api(status) => map_status(&status, ctx),
        e @ (kube::Error::HyperError(_)
        | kube::Error::Service(_)
        | kube::Error::ReadEvents(_)
        | kube::Error::LinesCodecMaxLineLengthExceeded
        | kube::Error::FromUtf8(_)) => leasehold::Error::Unavailable {
            store: STORE_NAME,
            message: format!("{} request failed: {e}{}", ctx.op.name(), ctx.at_server()),
            source: Some(Box::new(e)),
        },
        e @ kube::Error::SerdeError(_) => leasehold::Error::Store {
            store: STORE_NAME,
            message: format!(
                "{}: the API server's answer could not be decoded: {e}",
                ctx.op.name()
            ),
            retryable: true,
            source: Some(Box::new(e)),
        },
        e @ kube::Error::Auth(_) => leasehold::Error::Unauthenticated {
            store: STORE_NAME,
            message: format!("cannot obtain credentials for the API server: {e}"),
        },
        e => leasehold::Error::Store {
            store: STORE_NAME,
            message: format!("{} failed: {e}", ctx.op.name()),
            retryable: false,
            source: Some(Box::new(e)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_403_names_the_verb_the_server_names() {
        let create_on_update = r#"leases.coordination.k8s.io "x" is forbidden: User "u" cannot create resource "leases" in API group "coordination.k8s.io" in the namespace "ns""#;
        assert_eq!(verb_in_message(create_on_update), Some("create"));
        // No verb named (an authorizer's own reason): the operation's verb is used.
        assert_eq!(
            verb_in_message(r#"leases.coordination.k8s.io "x" is forbidden: "#),
            None
        );
        assert_eq!(
            verb_in_message("User \"u\" cannot frobnicate resource"),
            None
        );
        let status = Status {
            code: 403,
            reason: "Forbidden".into(),
            message: create_on_update.into(),
            ..Status::default()
        };
        let ctx = Ctx {
            op: Op::Update,
            namespace: "ns",
            server: None,
            key: None,
            expected: None,
        };
        let e = map_status(&status, &ctx).to_string();
        assert!(
            e.contains(
                "missing RBAC permission: create leases.coordination.k8s.io in namespace ns"
            ),
            "{e}"
        );
    }
}
