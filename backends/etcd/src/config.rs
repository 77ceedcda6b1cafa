//! [`EtcdConfig`]: endpoints, key prefix, timeouts, TLS and credentials.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use crate::error::Error;

/// The default key prefix: records live under `/leasehold/<key>`.
pub const DEFAULT_PREFIX: &str = "/leasehold/";

/// The default bound on one store operation; below the elector's default 10 s renew deadline.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// The default bound on connecting to one endpoint.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The default interval of HTTP/2 keep-alive pings while a watch is open.
pub const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(10);

/// How to reach etcd: endpoints, key prefix, timeouts, TLS and credentials.
///
/// Credentials and private keys never appear in its `Debug` output. The `with_*` setters never
/// fail; [`EtcdStore::connect`](crate::EtcdStore::connect) validates the whole configuration.
///
/// ```
/// use std::time::Duration;
/// use leasehold_etcd::EtcdConfig;
/// let config = EtcdConfig::new(["http://127.0.0.1:2379", "http://127.0.0.1:22379"])
///     .with_prefix("/my-app/leases/")
///     .with_operation_timeout(Duration::from_secs(2))
///     .with_user("app", "s3cret");
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[derive(Clone)]
pub struct EtcdConfig {
    pub(crate) endpoints: Vec<String>,
    pub(crate) prefix: String,
    pub(crate) operation_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) keep_alive: Duration,
    pub(crate) credentials: Option<Credentials>,
    pub(crate) tls: Option<TlsConfig>,
}

// === impl EtcdConfig ===

impl EtcdConfig {
    /// A configuration for these endpoints (`http://host:port`, `https://host:port` or
    /// `host:port`), with the default prefix [`DEFAULT_PREFIX`], a 5 s operation timeout
    /// ([`DEFAULT_OPERATION_TIMEOUT`]), a 5 s connect timeout and HTTP/2 keep-alive pings every
    /// 10 s while a watch is open.
    ///
    /// The client spreads requests over all endpoints and skips unreachable ones.
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        EtcdConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: DEFAULT_PREFIX.to_owned(),
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            keep_alive: DEFAULT_KEEP_ALIVE,
            credentials: None,
            tls: None,
        }
    }

    /// The etcd key prefix under which records are stored (`<prefix><lease key>`). Give each
    /// application its own prefix.
    ///
    /// A prefix that does not end with `/` gets one appended, so that prefixes cannot overlap:
    /// `/app` becomes `/app/`, and its keys never mix with those of `/app-x` (`/app-x/`) or
    /// `/app1` (`/app1/`).
    ///
    /// ```
    /// let config = leasehold_etcd::EtcdConfig::new(["http://127.0.0.1:2379"]).with_prefix("/app");
    /// assert_eq!(config.prefix(), "/app/");
    /// ```
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        let mut prefix = prefix.into();
        if !prefix.is_empty() && !prefix.ends_with('/') {
            prefix.push('/');
        }
        self.prefix = prefix;
        self
    }

    /// The longest any single operation may take before it fails with
    /// [`leasehold::Error::Timeout`] (default 5 s). The store reports it in its
    /// [`Capabilities`](leasehold::Capabilities), and [`leasehold::Elector::spawn`] refuses a
    /// `renew_deadline` that is not longer.
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// The longest connecting to one endpoint may take (default 5 s).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The interval of HTTP/2 keep-alive pings, sent while a watch is open; a connection whose
    /// ping goes unanswered for the operation timeout is dropped, so a watch on a hung or
    /// partitioned member fails over (a crashed member is noticed at once anyway).
    ///
    /// Keep it at or above the server's `--grpc-keepalive-min-time` (etcd's default is 5 s):
    /// etcd closes connections that ping more often (`too_many_pings`).
    pub fn with_keep_alive(mut self, interval: Duration) -> Self {
        self.keep_alive = interval;
        self
    }

    /// Authenticates as `user` with `password` (etcd's user/password authentication).
    pub fn with_user(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.credentials = Some(Credentials {
            user: user.into(),
            password: password.into(),
        });
        self
    }

    /// Uses TLS with these settings (endpoints then should be `https://…`), replacing any set
    /// before. [`with_tls_ca_pem`](Self::with_tls_ca_pem) and
    /// [`with_tls_client_identity_pem`](Self::with_tls_client_identity_pem) are shorthands; this
    /// one also takes a [domain name](TlsConfig::with_domain_name).
    pub fn with_tls(mut self, tls: TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Uses TLS and trusts this CA certificate (PEM) for the servers' certificates.
    pub fn with_tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls = Some(self.tls.take().unwrap_or_default().with_ca_pem(pem));
        self
    }

    /// Uses TLS and presents this client certificate and private key (both PEM) for mutual TLS.
    /// With etcd's `--client-cert-auth` and authentication enabled, the certificate's common
    /// name is the etcd user. The key never appears in `Debug` output.
    pub fn with_tls_client_identity_pem(
        mut self,
        cert: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        let tls = self.tls.take().unwrap_or_default();
        self.tls = Some(tls.with_client_identity_pem(cert, key));
        self
    }

    /// The key prefix, ending with `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The configured endpoints.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The bound on one store operation.
    pub fn operation_timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// The bound on connecting to one endpoint.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The interval of HTTP/2 keep-alive pings while a watch is open.
    pub fn keep_alive(&self) -> Duration {
        self.keep_alive
    }

    /// The user name given to [`with_user`](Self::with_user), if any (never the password).
    pub fn user(&self) -> Option<&str> {
        self.credentials.as_ref().map(|c| c.user.as_str())
    }

    /// The TLS settings, if TLS is on.
    pub fn tls(&self) -> Option<&TlsConfig> {
        self.tls.as_ref()
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.endpoints.is_empty() {
            return Err(Error::InvalidConfig(
                "at least one endpoint is needed, such as http://127.0.0.1:2379".into(),
            ));
        }
        if let Some(e) = self.endpoints.iter().find(|e| e.trim().is_empty()) {
            return Err(Error::InvalidConfig(format!(
                "endpoint {e:?} is empty; give host:port, http://host:port or https://host:port"
            )));
        }
        if self.prefix.is_empty() {
            return Err(Error::InvalidConfig(
                "the key prefix must not be empty (the default is \"/leasehold/\")".into(),
            ));
        }
        for (name, d) in [
            ("operation timeout", self.operation_timeout),
            ("connect timeout", self.connect_timeout),
            ("keep-alive interval", self.keep_alive),
        ] {
            if d.is_zero() {
                return Err(Error::InvalidConfig(format!("the {name} must not be zero")));
            }
        }
        if let Some(c) = &self.credentials
            && c.user.is_empty()
        {
            return Err(Error::InvalidConfig(
                "the user name must not be empty".into(),
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("operation_timeout", &self.operation_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("keep_alive", &self.keep_alive)
            .field("credentials", &self.credentials)
            .field("tls", &self.tls)
            .finish()
    }
}

/// A user name and password. `Debug` shows the user name only.
#[derive(Clone)]
pub(crate) struct Credentials {
    pub(crate) user: String,
    pub(crate) password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// TLS settings: the CA that signed the servers' certificates and, for mutual TLS, a client
/// certificate and private key (all PEM). `Debug` never shows the private key.
#[derive(Clone, Default)]
pub struct TlsConfig {
    pub(crate) ca_pem: Option<Vec<u8>>,
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
    pub(crate) domain_name: Option<String>,
}

// === impl TlsConfig ===

impl TlsConfig {
    /// TLS that trusts the CA given with [`with_ca_pem`](Self::with_ca_pem).
    pub fn new() -> Self {
        Self::default()
    }

    /// Trusts this CA certificate (PEM) for the servers' certificates.
    pub fn with_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// Presents this client certificate and private key (both PEM) for mutual TLS. With
    /// etcd's `--client-cert-auth` and authentication enabled, the certificate's common name is
    /// the etcd user.
    pub fn with_client_identity_pem(
        mut self,
        cert: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.identity = Some((cert.into(), key.into()));
        self
    }

    /// Verifies the servers' certificates against this name instead of the endpoint's host.
    pub fn with_domain_name(mut self, name: impl Into<String>) -> Self {
        self.domain_name = Some(name.into());
        self
    }

    /// Reads the CA certificate and, if given, the client certificate and key from PEM files.
    ///
    /// # Errors
    /// [`Error::ReadFile`] naming the file that could not be read.
    pub fn from_files(ca: impl AsRef<Path>, client: Option<(&Path, &Path)>) -> Result<Self, Error> {
        let read = |what: &'static str, p: &Path| {
            std::fs::read(p).map_err(|source| Error::ReadFile {
                what,
                path: p.to_owned(),
                source,
            })
        };
        let mut tls = TlsConfig::new().with_ca_pem(read("CA certificate", ca.as_ref())?);
        if let Some((cert, key)) = client {
            tls = tls.with_client_identity_pem(
                read("client certificate", cert)?,
                read("client private key", key)?,
            );
        }
        Ok(tls)
    }

    pub(crate) fn to_options(&self) -> etcd_client::TlsOptions {
        let mut o = etcd_client::TlsOptions::new();
        if let Some(ca) = &self.ca_pem {
            o = o.ca_certificate(etcd_client::Certificate::from_pem(ca));
        }
        if let Some((cert, key)) = &self.identity {
            o = o.identity(etcd_client::Identity::from_pem(cert, key));
        }
        if let Some(d) = &self.domain_name {
            o = o.domain_name(d.clone());
        }
        o
    }
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("ca", &self.ca_pem.as_ref().map(|_| "<pem>"))
            .field(
                "client_identity",
                &self
                    .identity
                    .as_ref()
                    .map(|_| "<certificate and redacted key>"),
            )
            .field("domain_name", &self.domain_name)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_operation_timeout_is_below_the_default_renew_deadline() {
        let key = leasehold::LeaseKey::new("k").expect("valid key");
        let elector = leasehold::ElectorConfig::new(key, "id");
        assert!(DEFAULT_OPERATION_TIMEOUT < elector.renew_deadline);
    }
}
