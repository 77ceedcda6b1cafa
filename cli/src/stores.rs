//! Store URLs: the one parser, and the one place that builds and connects stores (each store
//! behind its cargo feature, all on by default).
//!
//! Accepted forms (see [`FORMS`]):
//! - `memory://` — an in-process store, only for `leasehold demo`;
//! - `redis://[[user]:password@]host[:port][/db][?prefix=P]`, `rediss://…` (TLS);
//! - `etcd://host:port[,host:port…][?prefix=P]`, `etcds://…` (TLS), user and password as
//!   `etcd://user:password@host:port,…`;
//! - `kube://` (the kubeconfig's or the pod's namespace) or `kube://NAMESPACE`.
//!
//! A password can also come from the `LEASEHOLD_PASSWORD` environment variable (used when the
//! URL has none). Secrets never appear in `Debug` output or messages.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use leasehold::DynLeaseStore;

use crate::exit::CliError;

/// The accepted forms, for error messages and help texts.
pub(crate) const FORMS: &str = "\
Accepted store URLs:
  redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?prefix=P]
  rediss://…                    (TLS; --tls-ca, --tls-cert/--tls-key)
  etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…][?prefix=P]
  etcds://…                     (TLS; --tls-ca, --tls-cert/--tls-key)
  kube://[NAMESPACE]            (kubeconfig, or in-cluster service account)
  memory://                     (leasehold demo only)
a password may also come from the LEASEHOLD_PASSWORD environment variable";

/// The environment variable a password may come from.
pub(crate) const PASSWORD_ENV: &str = "LEASEHOLD_PASSWORD";

/// A secret string whose `Debug` is redacted.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Secret(String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

/// A parsed store URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StoreUrl {
    /// `memory://`.
    Memory,
    /// `redis://` or `rediss://`.
    Redis {
        /// The URL for the client, credentials included (never printed).
        url: Secret,
        /// The URL with the password replaced by `***`.
        redacted: String,
        /// TLS (`rediss://`).
        tls: bool,
        /// The key namespace prefix (`?prefix=`).
        prefix: Option<String>,
        /// The password came from [`PASSWORD_ENV`] (the URL has none).
        password_from_env: bool,
    },
    /// `etcd://` or `etcds://`.
    Etcd {
        /// `https://host:port` or `http://host:port` per endpoint.
        endpoints: Vec<String>,
        /// TLS (`etcds://`).
        tls: bool,
        /// User name and password.
        user: Option<(String, Secret)>,
        /// The key prefix (`?prefix=`).
        prefix: Option<String>,
        /// The password came from [`PASSWORD_ENV`] (the URL has none).
        password_from_env: bool,
    },
    /// `kube://[namespace]`.
    Kube {
        /// The namespace; `None` takes the client's default.
        namespace: Option<String>,
    },
}

impl StoreUrl {
    /// The URL as it may be shown (no secrets).
    pub(crate) fn display(&self) -> String {
        match self {
            StoreUrl::Memory => "memory://".into(),
            StoreUrl::Redis {
                redacted, prefix, ..
            } => match prefix {
                Some(p) => format!("{redacted}?prefix={p}"),
                None => redacted.clone(),
            },
            StoreUrl::Etcd {
                endpoints,
                tls,
                user,
                prefix,
                ..
            } => {
                let hosts: Vec<&str> = endpoints
                    .iter()
                    .map(|e| e.split_once("://").map_or(e.as_str(), |(_, h)| h))
                    .collect();
                let user = match user {
                    Some((u, _)) => format!("{u}:***@"),
                    None => String::new(),
                };
                let prefix = match prefix {
                    Some(p) => format!("?prefix={p}"),
                    None => String::new(),
                };
                format!(
                    "{}://{user}{}{prefix}",
                    if *tls { "etcds" } else { "etcd" },
                    hosts.join(",")
                )
            }
            StoreUrl::Kube { namespace } => {
                format!("kube://{}", namespace.as_deref().unwrap_or(""))
            }
        }
    }
}

/// The message for `?prefix=` with nothing after it.
const EMPTY_PREFIX: &str = "the prefix is empty (leave ?prefix= out for the store's default)";

fn invalid(url_shown: &str, why: impl fmt::Display) -> CliError {
    CliError::usage(format!("invalid store URL {url_shown:?}: {why}\n{FORMS}"))
}

/// Parses a store URL; `env_password` is the value of [`PASSWORD_ENV`], if set.
pub(crate) fn parse(input: &str, env_password: Option<&str>) -> Result<StoreUrl, CliError> {
    let Some((scheme, rest)) = input.split_once("://") else {
        return Err(invalid(&redact_loose(input), "it has no scheme"));
    };
    match scheme {
        "memory" => {
            if rest.is_empty() {
                Ok(StoreUrl::Memory)
            } else {
                Err(invalid(input, "memory:// takes nothing after the scheme"))
            }
        }
        "redis" | "rediss" => parse_redis(input, env_password),
        "etcd" | "etcds" => parse_etcd(scheme == "etcds", rest, env_password),
        "kube" => parse_kube(rest),
        other => Err(invalid(
            &redact_loose(input),
            format!("unknown scheme {other:?}"),
        )),
    }
}

/// Replaces whatever sits between `://` and `@` by `***` (for URLs we could not parse).
fn redact_loose(input: &str) -> String {
    match (input.find("://"), input.rfind('@')) {
        (Some(s), Some(a)) if a > s => format!("{}***{}", &input[..s + 3], &input[a..]),
        _ => input.to_owned(),
    }
}

fn parse_redis(input: &str, env_password: Option<&str>) -> Result<StoreUrl, CliError> {
    let shown = redact_loose(input);
    let mut url = url::Url::parse(input).map_err(|e| invalid(&shown, e))?;
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid(&shown, "it has no host"));
    }
    let mut prefix = None;
    for (k, v) in url.query_pairs() {
        match &*k {
            "prefix" if !v.is_empty() => prefix = Some(v.into_owned()),
            "prefix" => return Err(invalid(&shown, EMPTY_PREFIX)),
            _ => {
                return Err(invalid(
                    &shown,
                    format!("unknown query parameter {k:?} (only ?prefix=P is accepted)"),
                ));
            }
        }
    }
    url.set_query(None);
    let mut password_from_env = false;
    if url.password().is_none()
        && let Some(p) = env_password.filter(|p| !p.is_empty())
    {
        if url.set_password(Some(p)).is_err() {
            return Err(invalid(&shown, "cannot add the password to this URL"));
        }
        password_from_env = true;
    }
    let tls = url.scheme() == "rediss";
    // Validate with the store's own parser now, so that a bad URL is a usage error.
    #[cfg(feature = "redis")]
    leasehold_redis::RedisConfig::new(url.to_string())
        .map_err(|e| invalid(&shown, leasehold::Error::from(e)))?;
    let mut redacted = url.clone();
    if redacted.password().is_some() {
        // Replacing a password that is there cannot fail.
        let _ = redacted.set_password(Some("***"));
    }
    Ok(StoreUrl::Redis {
        redacted: redacted.to_string(),
        url: Secret(url.to_string()),
        tls,
        prefix,
        password_from_env,
    })
}

fn parse_etcd(tls: bool, rest: &str, env_password: Option<&str>) -> Result<StoreUrl, CliError> {
    let scheme = if tls { "etcds" } else { "etcd" };
    let shown = redact_loose(&format!("{scheme}://{rest}"));
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    let mut prefix = None;
    if let Some(q) = query {
        for (k, v) in url::form_urlencoded::parse(q.as_bytes()) {
            match &*k {
                "prefix" if !v.is_empty() => prefix = Some(v.into_owned()),
                "prefix" => return Err(invalid(&shown, EMPTY_PREFIX)),
                _ => {
                    return Err(invalid(
                        &shown,
                        format!("unknown query parameter {k:?} (only ?prefix=P is accepted)"),
                    ));
                }
            }
        }
    }
    let rest = rest.trim_end_matches('/');
    let (userinfo, hosts) = match rest.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, rest),
    };
    let mut password_from_env = false;
    let user = match userinfo {
        None => None,
        Some(u) => {
            let (name, pass) = match u.split_once(':') {
                Some((n, p)) => (n, Some(p)),
                None => (u, None),
            };
            let name = decode(name);
            if name.is_empty() {
                return Err(invalid(&shown, "the user name is empty"));
            }
            let pass = match pass.map(decode).filter(|p| !p.is_empty()) {
                Some(p) => p,
                None => match env_password.filter(|p| !p.is_empty()) {
                    Some(p) => {
                        password_from_env = true;
                        p.to_owned()
                    }
                    None => {
                        return Err(invalid(
                            &shown,
                            format!(
                                "user {name:?} has no password: put it in the URL or in {PASSWORD_ENV}"
                            ),
                        ));
                    }
                },
            };
            Some((name, Secret(pass)))
        }
    };
    let mut endpoints = Vec::new();
    for host in hosts.split(',') {
        let host = host.trim();
        if host.is_empty() {
            return Err(invalid(
                &shown,
                "an endpoint is empty (write host:port,host:port)",
            ));
        }
        if host.contains('/') {
            return Err(invalid(
                &shown,
                format!("endpoint {host:?} has a path; write host:port"),
            ));
        }
        let Some((h, port)) = host.rsplit_once(':') else {
            return Err(invalid(
                &shown,
                format!("endpoint {host:?} has no port (etcd's is usually 2379)"),
            ));
        };
        if h.is_empty() || port.parse::<u16>().is_err() {
            return Err(invalid(
                &shown,
                format!("endpoint {host:?} is not host:port"),
            ));
        }
        endpoints.push(format!("{}://{host}", if tls { "https" } else { "http" }));
    }
    Ok(StoreUrl::Etcd {
        endpoints,
        tls,
        user,
        prefix,
        password_from_env,
    })
}

fn decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={s}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

fn parse_kube(rest: &str) -> Result<StoreUrl, CliError> {
    let ns = rest.trim_end_matches('/');
    if ns.is_empty() {
        return Ok(StoreUrl::Kube { namespace: None });
    }
    let ok = ns.len() <= 63
        && ns
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        && !ns.starts_with('-')
        && !ns.ends_with('-');
    if !ok {
        return Err(invalid(
            &format!("kube://{rest}"),
            format!(
                "{ns:?} is not a Kubernetes namespace name (lower-case letters, digits and '-', at most 63)"
            ),
        ));
    }
    Ok(StoreUrl::Kube {
        namespace: Some(ns.to_owned()),
    })
}

/// The contents of a PEM file.
type Pem = Vec<u8>;

/// The CA and the client identity (certificate, key), read from their files.
type TlsPems = (Option<Pem>, Option<(Pem, Pem)>);

/// TLS files given on the command line.
#[derive(Clone, Debug, Default)]
pub(crate) struct TlsFiles {
    pub(crate) ca: Option<PathBuf>,
    pub(crate) cert: Option<PathBuf>,
    pub(crate) key: Option<PathBuf>,
}

impl TlsFiles {
    fn is_empty(&self) -> bool {
        self.ca.is_none() && self.cert.is_none() && self.key.is_none()
    }

    fn read(&self) -> Result<TlsPems, CliError> {
        let read = |what: &str, p: &PathBuf| {
            std::fs::read(p).map_err(|e| {
                CliError::usage(format!("cannot read the {what} file {}: {e}", p.display()))
            })
        };
        let ca = self.ca.as_ref().map(|p| read("--tls-ca", p)).transpose()?;
        let identity = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => Some((read("--tls-cert", c)?, read("--tls-key", k)?)),
            (None, None) => None,
            _ => {
                return Err(CliError::usage(
                    "--tls-cert and --tls-key go together (a client certificate and its key)",
                ));
            }
        };
        Ok((ca, identity))
    }
}

/// Store timeouts.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(
    not(any(feature = "redis", feature = "etcd", feature = "kube")),
    allow(dead_code)
)]
pub(crate) struct Timeouts {
    /// Bound on one store operation.
    pub(crate) operation: Duration,
    /// Bound on connecting.
    pub(crate) connect: Duration,
}

/// Builds and connects the store `url` names. Every store construction lives here.
pub(crate) async fn connect(
    url: &StoreUrl,
    tls: &TlsFiles,
    timeouts: Timeouts,
) -> Result<DynLeaseStore, CliError> {
    let shown = url.display();
    let tls_ok = matches!(
        url,
        StoreUrl::Redis { tls: true, .. } | StoreUrl::Etcd { tls: true, .. }
    );
    if !tls.is_empty() && !tls_ok {
        return Err(CliError::usage(format!(
            "--tls-ca/--tls-cert/--tls-key need a TLS store URL (rediss:// or etcds://), not {shown}"
        )));
    }
    let pems = tls.read()?;
    match url {
        StoreUrl::Memory => Err(CliError::usage(format!(
            "memory:// is only for `leasehold demo`: each process would have its own store\n{FORMS}"
        ))),
        StoreUrl::Redis { .. } => connect_redis(url, pems, timeouts).await,
        StoreUrl::Etcd { .. } => connect_etcd(url, pems, timeouts).await,
        StoreUrl::Kube { .. } => connect_kube(url, timeouts).await,
    }
}

/// The error for a connect failure.
#[cfg(any(feature = "redis", feature = "etcd", feature = "kube"))]
fn failed(url: &StoreUrl, e: leasehold::Error) -> CliError {
    store_error(url, &format!("cannot connect to {}", url.display()), e)
}

/// A store's message without the advice in brackets at its end (for advice of our own).
fn without_advice(message: &str) -> &str {
    match message.rfind(" (") {
        Some(i) if message.ends_with(')') => &message[..i],
        _ => message,
    }
}

/// A store error on `url`, with `context` in front: [`CliError::store`], except that settings
/// the store refuses (such as a bad `?prefix=`) are usage errors about the URL, and rejected
/// credentials get advice that says where this command took them from (the URL or
/// [`PASSWORD_ENV`]).
pub(crate) fn store_error(url: &StoreUrl, context: &str, e: leasehold::Error) -> CliError {
    let shown = url.display();
    match e {
        leasehold::Error::InvalidConfig(m) => CliError::usage(format!(
            "invalid store URL or settings {shown}: {m}\n{FORMS}"
        )),
        leasehold::Error::Unauthenticated { store, message } => {
            let (from_env, in_url, server) = match url {
                StoreUrl::Redis {
                    password_from_env,
                    redacted,
                    ..
                } => (
                    *password_from_env,
                    redacted.contains('@'),
                    "the server's requirepass/ACL users",
                ),
                StoreUrl::Etcd {
                    password_from_env,
                    user,
                    ..
                } => (*password_from_env, user.is_some(), "the etcd users"),
                _ => (false, false, "the server's users"),
            };
            let advice = if from_env {
                format!(
                    "the password came from {PASSWORD_ENV}, as the URL has none: check \
                     {PASSWORD_ENV}, the user name in the URL and {server}"
                )
            } else if in_url {
                format!("check the user name and password in the store URL, and {server}")
            } else {
                format!(
                    "the server wants credentials: put USER:PASSWORD@ in the store URL, or the \
                     password in {PASSWORD_ENV}"
                )
            };
            CliError::new(
                crate::exit::NOPERM,
                format!(
                    "{context}: {store} rejected the credentials: {} ({advice})",
                    without_advice(&message)
                ),
            )
        }
        e => CliError::store(context, e),
    }
}

/// The error for a store this binary was built without.
#[cfg(not(all(feature = "redis", feature = "etcd", feature = "kube")))]
fn not_built(feature: &str) -> CliError {
    CliError::usage(format!(
        "this leasehold was built without the {feature} store: build it with \
         `--features {feature}` (the default features include every store)"
    ))
}

#[cfg(feature = "redis")]
async fn connect_redis(
    url: &StoreUrl,
    (ca, identity): TlsPems,
    timeouts: Timeouts,
) -> Result<DynLeaseStore, CliError> {
    let StoreUrl::Redis {
        url: secret,
        prefix,
        ..
    } = url
    else {
        return Err(CliError::new(crate::exit::SOFTWARE, "not a Redis URL"));
    };
    let mut config = leasehold_redis::RedisConfig::new(secret.0.clone())
        .map_err(|e| failed(url, e.into()))?
        .with_operation_timeout(timeouts.operation)
        .with_connect_timeout(timeouts.connect);
    if let Some(p) = prefix {
        config = config.with_prefix(p.clone());
    }
    if let Some(ca) = ca {
        config = config.with_tls_ca_pem(ca);
    }
    if let Some((cert, key)) = identity {
        config = config.with_tls_client_identity_pem(cert, key);
    }
    let store = leasehold_redis::RedisStore::connect(config)
        .await
        .map_err(|e| failed(url, e.into()))?;
    Ok(std::sync::Arc::new(store))
}

#[cfg(not(feature = "redis"))]
async fn connect_redis(_: &StoreUrl, _: TlsPems, _: Timeouts) -> Result<DynLeaseStore, CliError> {
    Err(not_built("redis"))
}

#[cfg(feature = "etcd")]
async fn connect_etcd(
    url: &StoreUrl,
    (ca, identity): TlsPems,
    timeouts: Timeouts,
) -> Result<DynLeaseStore, CliError> {
    let StoreUrl::Etcd {
        endpoints,
        user,
        prefix,
        tls,
        ..
    } = url
    else {
        return Err(CliError::new(crate::exit::SOFTWARE, "not an etcd URL"));
    };
    let mut config = leasehold_etcd::EtcdConfig::new(endpoints.clone())
        .with_operation_timeout(timeouts.operation)
        .with_connect_timeout(timeouts.connect);
    if let Some(p) = prefix {
        config = config.with_prefix(p.clone());
    }
    if let Some((u, p)) = user {
        config = config.with_user(u.clone(), p.0.clone());
    }
    if *tls {
        // TLS with the system's roots unless --tls-ca names a CA.
        config = config.with_tls(leasehold_etcd::TlsConfig::new());
    }
    if let Some(ca) = ca {
        config = config.with_tls_ca_pem(ca);
    }
    if let Some((cert, key)) = identity {
        config = config.with_tls_client_identity_pem(cert, key);
    }
    let store = leasehold_etcd::EtcdStore::connect(config)
        .await
        .map_err(|e| failed(url, e.into()))?;
    Ok(std::sync::Arc::new(store))
}

#[cfg(not(feature = "etcd"))]
async fn connect_etcd(_: &StoreUrl, _: TlsPems, _: Timeouts) -> Result<DynLeaseStore, CliError> {
    Err(not_built("etcd"))
}

#[cfg(feature = "kube")]
async fn connect_kube(url: &StoreUrl, timeouts: Timeouts) -> Result<DynLeaseStore, CliError> {
    let StoreUrl::Kube { namespace } = url else {
        return Err(CliError::new(crate::exit::SOFTWARE, "not a kube URL"));
    };
    let mut config = leasehold_kube::KubeConfig::new()
        .with_operation_timeout(timeouts.operation)
        .with_connect_timeout(timeouts.connect);
    if let Some(ns) = namespace {
        config = config.with_namespace(ns.clone());
    }
    let store = leasehold_kube::KubeStore::connect(config)
        .await
        .map_err(|e| failed(url, e.into()))?;
    Ok(std::sync::Arc::new(store))
}

#[cfg(not(feature = "kube"))]
async fn connect_kube(_: &StoreUrl, _: Timeouts) -> Result<DynLeaseStore, CliError> {
    Err(not_built("kube"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> StoreUrl {
        parse(s, None).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn err(s: &str) -> String {
        match parse(s, None) {
            Ok(u) => panic!("{s} parsed as {u:?}"),
            Err(e) => {
                assert_eq!(e.code, crate::exit::USAGE);
                e.message
            }
        }
    }

    #[test]
    fn memory_and_kube() {
        assert_eq!(ok("memory://"), StoreUrl::Memory);
        assert_eq!(ok("kube://"), StoreUrl::Kube { namespace: None });
        assert_eq!(
            ok("kube://prod-1"),
            StoreUrl::Kube {
                namespace: Some("prod-1".into())
            }
        );
        assert!(err("kube://Prod").contains("namespace"));
        assert!(err("memory://x").contains("memory://"));
    }

    #[test]
    fn redis_forms() {
        match ok("redis://127.0.0.1:6379/2?prefix=app:") {
            StoreUrl::Redis {
                tls,
                prefix,
                redacted,
                ..
            } => {
                assert!(!tls);
                assert_eq!(prefix.as_deref(), Some("app:"));
                assert_eq!(redacted, "redis://127.0.0.1:6379/2");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            ok("rediss://u:p@h:6380"),
            StoreUrl::Redis { tls: true, .. }
        ));
        #[cfg(feature = "redis")]
        assert!(err("redis://127.0.0.1/x").contains("database"));
        assert!(err("redis://h/0?db=1").contains("unknown query parameter"));
    }

    #[test]
    fn etcd_forms() {
        match ok("etcd://a:2379,b:22379?prefix=/app/") {
            StoreUrl::Etcd {
                endpoints,
                tls,
                user,
                prefix,
                password_from_env,
            } => {
                assert!(!password_from_env);
                assert_eq!(endpoints, ["http://a:2379", "http://b:22379"]);
                assert!(!tls && user.is_none());
                assert_eq!(prefix.as_deref(), Some("/app/"));
            }
            other => panic!("{other:?}"),
        }
        match ok("etcds://root:pw%40x@[::1]:2379") {
            StoreUrl::Etcd {
                endpoints, user, ..
            } => {
                assert_eq!(endpoints, ["https://[::1]:2379"]);
                assert_eq!(user, Some(("root".into(), Secret("pw@x".into()))));
            }
            other => panic!("{other:?}"),
        }
        assert!(err("etcd://a").contains("no port"));
        assert!(err("etcd://a:2379,").contains("empty"));
        assert!(err("etcd://a:x").contains("host:port"));
        assert!(err("etcd://a:2379/path").contains("path"));
        assert!(err("etcd://root@a:2379").contains(PASSWORD_ENV));
    }

    #[test]
    fn password_from_the_environment() {
        match parse("etcd://root@a:2379", Some("envpw")).expect("parses") {
            StoreUrl::Etcd { user, .. } => {
                assert_eq!(user, Some(("root".into(), Secret("envpw".into()))));
            }
            other => panic!("{other:?}"),
        }
        match parse("redis://h:1/0", Some("envpw")).expect("parses") {
            StoreUrl::Redis { url, redacted, .. } => {
                assert_eq!(url.0, "redis://:envpw@h:1/0");
                assert!(!redacted.contains("envpw"), "{redacted}");
            }
            other => panic!("{other:?}"),
        }
        // A password in the URL wins.
        match parse("redis://:urlpw@h:1/0", Some("envpw")).expect("parses") {
            StoreUrl::Redis { url, .. } => assert_eq!(url.0, "redis://:urlpw@h:1/0"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn secrets_are_never_shown() {
        for s in [
            "redis://user:hunter2@h:1/0",
            "rediss://:hunter2@h:1",
            "etcd://root:hunter2@a:2379",
            "etcds://root:hunter2@a:2379,b:2379",
        ] {
            let u = ok(s);
            assert!(!format!("{u:?}").contains("hunter2"), "{u:?}");
            assert!(!u.display().contains("hunter2"), "{}", u.display());
        }
        for s in [
            #[cfg(feature = "redis")]
            "redis://user:hunter2@h:1/notadb",
            "redis://user:hunter2@",
            "etcd://root:hunter2@a",
            "ftp://user:hunter2@h",
            "redis://user:hunter2@h/0?x=1",
        ] {
            let e = err(s);
            assert!(!e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn errors_name_the_accepted_forms() {
        for s in ["ftp://h", "localhost:6379", "etcd://a", "kube://A_B"] {
            let e = err(s);
            assert!(e.contains("Accepted store URLs"), "{e}");
            assert!(e.contains("etcd://") && e.contains("kube://"), "{e}");
        }
    }
}
