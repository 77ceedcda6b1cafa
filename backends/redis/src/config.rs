//! [`RedisConfig`]: where the server is, how to reach it, and the key namespace.

use std::fmt;
use std::time::Duration;

use crate::error::Error;

/// The default key namespace prefix.
pub const DEFAULT_PREFIX: &str = "leasehold:";

/// The default bound on one store operation.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(2);

/// The default bound on establishing a connection (TCP, TLS handshake, `AUTH`, `SELECT`).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The default interval at which an idle watch connection is checked with `PING`.
pub const DEFAULT_WATCH_PING_INTERVAL: Duration = Duration::from_secs(5);

/// The commands the store's ACL user needs, as `ACL SETUSER` rules: the commands it sends
/// (`EVALSHA`, `EVAL` and `SCRIPT LOAD` for the scripts, `ZRANGEBYLEX` for `list`, `SUBSCRIBE`,
/// `UNSUBSCRIBE` and `PING` for watches), the commands its scripts run (`TYPE`, `HMGET`, `DUMP`,
/// `GET`, `SET`, `EXISTS`, `HSET`, `DEL`, `ZADD`, `ZREM`, `PUBLISH`, `TIME`), and `INFO` for the
/// checks at connect (cluster mode, `maxmemory-policy`; optional: without it they are skipped). Redis checks
/// a script's commands and keys against the ACL as well.
///
/// [`RedisConfig::acl_rules`] adds the key and channel patterns of a prefix; the README shows
/// the full `ACL SETUSER` line, and a test creates its user from exactly these rules.
pub const ACL_COMMANDS: &str = "-@all +evalsha +eval +script|load +zrangebylex +subscribe \
+unsubscribe +ping +type +hmget +dump +get +set +exists +hset +del +zadd +zrem +publish +time \
+info";

/// How to connect to Redis and where to keep the leases.
///
/// Built from a URL:
/// - `redis://[[user]:password@]host[:port][/db]` — plain TCP;
/// - `rediss://[[user]:password@]host[:port][/db]` — TLS (rustls), verified against the system
///   roots or against the CA set with [`with_tls_ca_pem`](RedisConfig::with_tls_ca_pem).
///
/// A `#insecure` fragment (redis-rs's switch to skip certificate verification) is refused with
/// [`Error::InsecureTls`]: give the server's CA with
/// [`with_tls_ca_pem`](RedisConfig::with_tls_ca_pem) instead.
///
/// A user name selects an ACL user (`AUTH user password`); a password alone uses `requirepass`.
/// The password never appears in `Debug` output, errors or logs: everything prints
/// [`redacted_url`](RedisConfig::redacted_url).
///
/// The `with_*` setters never fail; [`RedisStore::connect`](crate::RedisStore::connect)
/// validates the whole configuration.
///
/// ```
/// use std::time::Duration;
/// use leasehold_redis::RedisConfig;
/// let cfg = RedisConfig::new("redis://app:s3cret@127.0.0.1:6379/2")?
///     .with_prefix("myapp:")
///     .with_operation_timeout(Duration::from_secs(1));
/// assert!(!format!("{cfg:?}").contains("s3cret"));
/// assert_eq!(cfg.prefix(), "myapp:");
/// # Ok::<(), leasehold_redis::Error>(())
/// ```
#[derive(Clone)]
pub struct RedisConfig {
    pub(crate) url: String,
    pub(crate) redacted_url: String,
    pub(crate) tls: bool,
    pub(crate) prefix: String,
    pub(crate) db: u32,
    pub(crate) operation_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) watch_ping_interval: Duration,
    pub(crate) tls_ca_pem: Option<Vec<u8>>,
    pub(crate) tls_client_identity: Option<(Vec<u8>, Vec<u8>)>,
    /// Redis Cluster: the URLs of further seed nodes (the main URL is the first), as given;
    /// `connect` validates them.
    pub(crate) cluster: Option<Vec<String>>,
}

/// A URL [`parse_url`] accepted.
struct ParsedUrl {
    redacted: String,
    tls: bool,
    db: u32,
}

/// Parses and checks a `redis://` or `rediss://` URL, without ever echoing its password.
fn parse_url(url: &str) -> Result<ParsedUrl, Error> {
    if !url.contains("://") {
        // "127.0.0.1:6379" or "localhost:6379": url would call the first a relative URL and
        // the second a URL with the scheme "localhost".
        let shown = url::Url::parse(&format!("redis://{url}"))
            .map(|u| redact(&u).trim_start_matches("redis://").to_owned())
            .unwrap_or_else(|_| "<unparsable URL, redacted>".into());
        return Err(Error::InvalidUrl {
            url: shown,
            reason: "the URL has no scheme: add redis:// (or rediss:// for TLS), as in \
                     redis://127.0.0.1:6379"
                .into(),
        });
    }
    let parsed = url::Url::parse(url).map_err(|e| Error::InvalidUrl {
        url: "<unparsable URL, redacted>".into(),
        reason: format!(
            "{e} (expected redis://[[user]:password@]host[:port][/db] or rediss://… for TLS)"
        ),
    })?;
    let redacted = redact(&parsed);
    let invalid = |reason: &str| Error::InvalidUrl {
        url: redacted.clone(),
        reason: reason.to_owned(),
    };
    let tls = match parsed.scheme() {
        "redis" => false,
        "rediss" => true,
        other => {
            return Err(invalid(&format!(
                "unsupported scheme {other}://: use redis:// (plain TCP) or rediss:// (TLS)"
            )));
        }
    };
    match parsed.fragment() {
        None => {}
        Some("insecure") => return Err(Error::InsecureTls { url: redacted }),
        Some(_) => return Err(invalid("the URL must not have a #fragment")),
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(invalid("the URL has no host"));
    }
    let db = parsed.path().trim_start_matches('/');
    let db = if db.is_empty() {
        0
    } else {
        db.parse::<u32>()
            .map_err(|_| invalid("the path must be a database number, such as /0"))?
    };
    // Validate the rest as redis-rs will see it, without echoing its message (which may
    // quote the URL).
    redis::Client::open(url)
        .map_err(|e| invalid(&format!("rejected by the redis client ({})", e.category())))?;
    Ok(ParsedUrl { redacted, tls, db })
}

/// Checks a key namespace prefix.
fn validate_prefix(prefix: &str) -> Result<(), Error> {
    let reason = if prefix.is_empty() || prefix.len() > 64 {
        "the prefix must be 1 to 64 bytes long"
    } else if prefix
        .chars()
        .any(|c| c == '{' || c == '}' || c.is_whitespace() || c.is_control())
    {
        "the prefix must not contain '{', '}', whitespace or control characters"
    } else {
        return Ok(());
    };
    Err(Error::InvalidPrefix {
        prefix: prefix.to_owned(),
        reason,
    })
}

// === impl RedisConfig ===

impl RedisConfig {
    /// Parses `url` (see the type's docs) with the defaults: prefix `leasehold:`, 2 s operation
    /// and connect timeouts, a watch `PING` every 5 s.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] (with the credentials redacted) when the URL is not a `redis://` or
    /// `rediss://` URL with a host (a URL without a scheme, such as `127.0.0.1:6379`, is told to
    /// add `redis://`), or its database is not a number; [`Error::InsecureTls`] for a
    /// `#insecure` fragment.
    pub fn new(url: impl Into<String>) -> Result<Self, Error> {
        let url = url.into();
        let ParsedUrl { redacted, tls, db } = parse_url(&url)?;
        Ok(RedisConfig {
            url,
            redacted_url: redacted,
            tls,
            prefix: DEFAULT_PREFIX.to_owned(),
            db,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            watch_ping_interval: DEFAULT_WATCH_PING_INTERVAL,
            tls_ca_pem: None,
            tls_client_identity: None,
            cluster: None,
        })
    }

    /// Sets the key namespace prefix (default `leasehold:`). Every key this store writes starts
    /// with `{<prefix>}`: the prefix is the Redis Cluster hash tag, so all keys of one namespace
    /// live in one slot and every script's keys share it.
    ///
    /// It must be 1 to 64 bytes long without `{`, `}`, whitespace or control characters;
    /// [`connect`](crate::RedisStore::connect) refuses another with [`Error::InvalidPrefix`].
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Bounds every store operation (default 2 s); a slower one fails with
    /// [`leasehold::Error::Timeout`]. The store reports it in its
    /// [`Capabilities`](leasehold::Capabilities), and [`leasehold::Elector::spawn`] refuses a
    /// `renew_deadline` that is not longer.
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Bounds connection establishment: TCP, TLS handshake, `AUTH`, `SELECT` (default 2 s).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How often an idle watch connection is checked with `PING` (default 5 s), so that a
    /// connection that died silently is noticed and replaced.
    pub fn with_watch_ping_interval(mut self, interval: Duration) -> Self {
        self.watch_ping_interval = interval;
        self
    }

    /// Talks to a Redis Cluster: the URL names one of its nodes (a seed), and the store discovers
    /// the others (`CLUSTER SLOTS`), follows `MOVED`/`ASK` redirections (slot migrations,
    /// failovers) and routes every script to the node that owns the namespace's slot (all keys
    /// of a namespace share one slot through the `{<prefix>}` hash tag). Watches subscribe on
    /// any reachable seed node (cluster pub/sub reaches every node).
    ///
    /// A Redis Cluster fails over asynchronously, like a replicated primary: see the crate docs
    /// for what a failover can lose.
    pub fn with_cluster(mut self) -> Self {
        self.cluster.get_or_insert_with(Vec::new);
        self
    }

    /// Adds another seed node of the Redis Cluster (and turns on
    /// [`with_cluster`](Self::with_cluster)): the store connects through whichever seed answers,
    /// and watches fall back to the next seed when one is down. Same scheme and credentials as
    /// the main URL; [`connect`](crate::RedisStore::connect) checks it as [`RedisConfig::new`]
    /// checks the main URL.
    pub fn with_cluster_seed(mut self, url: impl Into<String>) -> Self {
        self.cluster.get_or_insert_with(Vec::new).push(url.into());
        self
    }

    /// Trusts only this CA (PEM) for `rediss://` instead of the system roots.
    pub fn with_tls_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_ca_pem = Some(pem.into());
        self
    }

    /// Presents this client certificate chain and private key (both PEM) for mutual TLS (for
    /// a server with `tls-auth-clients yes`). The key never appears in `Debug` output.
    pub fn with_tls_client_identity_pem(
        mut self,
        cert: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls_client_identity = Some((cert.into(), key.into()));
        self
    }

    /// The URL with the password replaced by `***`: safe to log.
    pub fn redacted_url(&self) -> &str {
        &self.redacted_url
    }

    /// The key namespace prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The bound on one store operation.
    pub fn operation_timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// The bound on establishing a connection.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// How often an idle watch connection is checked with `PING`.
    pub fn watch_ping_interval(&self) -> Duration {
        self.watch_ping_interval
    }

    /// Whether the store talks to a Redis Cluster ([`with_cluster`](Self::with_cluster)).
    pub fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// Checks everything the setters accepted without looking: the prefix, the timeouts, the
    /// cluster seeds, and TLS settings on a non-TLS URL.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        validate_prefix(&self.prefix)?;
        for (name, d) in [
            ("operation timeout", self.operation_timeout),
            ("connect timeout", self.connect_timeout),
            ("watch ping interval", self.watch_ping_interval),
        ] {
            if d.is_zero() {
                return Err(Error::InvalidConfig(format!("the {name} must not be zero")));
            }
        }
        for seed in self.cluster.iter().flatten() {
            let parsed = parse_url(seed)?;
            if parsed.tls != self.tls {
                return Err(Error::InvalidUrl {
                    url: parsed.redacted,
                    reason: "a cluster seed must use the same scheme as the main URL".into(),
                });
            }
        }
        if !self.tls && (self.tls_ca_pem.is_some() || self.tls_client_identity.is_some()) {
            return Err(Error::InvalidUrl {
                url: self.redacted_url.clone(),
                reason: "TLS certificates are set but the URL is not rediss://".into(),
            });
        }
        Ok(())
    }

    /// The least-privilege `ACL SETUSER` rules for this configuration (without `on` and the
    /// password): only this prefix's keys (`~{P}*`) and channels (`&{P}chan:*`), only
    /// [`ACL_COMMANDS`], plus `SELECT` when the URL names a database other than 0, plus
    /// `CLUSTER SLOTS` (topology discovery) for a [cluster](Self::with_cluster).
    ///
    /// ```
    /// use leasehold_redis::RedisConfig;
    /// let cfg = RedisConfig::new("redis://127.0.0.1")?.with_prefix("myapp:");
    /// assert!(cfg.acl_rules().starts_with("resetkeys ~{myapp:}* resetchannels &{myapp:}chan:* -@all "));
    /// # Ok::<(), leasehold_redis::Error>(())
    /// ```
    pub fn acl_rules(&self) -> String {
        let tag = glob_escape(&format!("{{{}}}", self.prefix));
        let mut rules = format!("resetkeys ~{tag}* resetchannels &{tag}chan:* {ACL_COMMANDS}");
        if self.db != 0 {
            rules.push_str(" +select");
        }
        if self.cluster.is_some() {
            rules.push_str(" +cluster|slots");
        }
        rules
    }
}

/// Escapes the characters Redis's glob patterns treat specially.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

pub(crate) fn redact(url: &url::Url) -> String {
    let mut shown = url.clone();
    if shown.password().is_some() {
        // Setting a password on a URL that already has one cannot fail.
        let _ = shown.set_password(Some("***"));
    }
    shown.to_string()
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.redacted_url)
            .field("prefix", &self.prefix)
            .field("operation_timeout", &self.operation_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("watch_ping_interval", &self.watch_ping_interval)
            .field("cluster", &self.cluster.as_ref().map(Vec::len))
            .field("tls_ca_pem", &self.tls_ca_pem.as_ref().map(|_| "<set>"))
            .field(
                "tls_client_identity",
                &self.tls_client_identity.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_errors_redact_the_password() {
        let cfg = RedisConfig::new("rediss://user:hunter2@127.0.0.1:6380/3").expect("valid");
        assert!(cfg.tls);
        let dbg = format!("{cfg:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("user:***@127.0.0.1:6380/3"), "{dbg}");

        let err =
            RedisConfig::new("redis://user:hunter2@127.0.0.1/notanumber").expect_err("bad db");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let err = RedisConfig::new("http://user:hunter2@127.0.0.1/").expect_err("bad scheme");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let err = RedisConfig::new("redis://user:hunter2@").expect_err("no host");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn insecure_fragment_is_rejected_with_a_typed_error() {
        for url in [
            "rediss://u:hunter2@127.0.0.1:6380/0#insecure",
            "redis://u:hunter2@127.0.0.1:6379#insecure",
        ] {
            match RedisConfig::new(url) {
                Err(e @ Error::InsecureTls { .. }) => {
                    let text = e.to_string();
                    assert!(!text.contains("hunter2"), "{text}");
                    assert!(text.contains("with_tls_ca_pem"), "{text}");
                    assert!(matches!(
                        leasehold::Error::from(e),
                        leasehold::Error::InvalidConfig(_)
                    ));
                }
                other => panic!("expected InsecureTls for {url}, got {other:?}"),
            }
        }
        assert!(matches!(
            RedisConfig::new("rediss://127.0.0.1:6380/0#other"),
            Err(Error::InvalidUrl { .. })
        ));
    }

    #[test]
    fn acl_rules_escape_glob_characters_and_add_select_for_a_database() {
        let cfg = RedisConfig::new("redis://127.0.0.1/2").expect("valid");
        let rules = cfg.with_prefix("a*b?:").acl_rules();
        assert!(
            rules.starts_with("resetkeys ~{a\\*b\\?:}* resetchannels &{a\\*b\\?:}chan:* -@all "),
            "{rules}"
        );
        assert!(rules.ends_with(" +select"), "{rules}");
        let rules = RedisConfig::new("redis://127.0.0.1")
            .expect("valid")
            .acl_rules();
        assert!(!rules.contains("select"), "{rules}");
    }

    #[test]
    fn prefixes_are_validated() {
        let cfg = RedisConfig::new("redis://127.0.0.1").expect("valid");
        assert!(cfg.clone().with_prefix("app:").validate().is_ok());
        for bad in ["", "a{b", "a b"] {
            assert!(matches!(
                cfg.clone().with_prefix(bad).validate(),
                Err(Error::InvalidPrefix { .. })
            ));
        }
    }

    #[test]
    fn a_url_without_a_scheme_is_told_to_add_one() {
        for url in [
            "127.0.0.1:6379",
            "localhost:6379",
            "app:hunter2@redis.internal:6379/0",
        ] {
            let text = RedisConfig::new(url).expect_err(url).to_string();
            assert!(
                text.contains("add redis:// (or rediss:// for TLS)"),
                "{text}"
            );
            assert!(!text.contains("relative URL"), "{text}");
            assert!(!text.contains("hunter2"), "{text}");
        }
        let text = RedisConfig::new("http://127.0.0.1:6379")
            .expect_err("http")
            .to_string();
        assert!(
            text.contains(
                "unsupported scheme http://: use redis:// (plain TCP) or rediss:// (TLS)"
            ),
            "{text}"
        );
    }

    #[test]
    fn cluster_seeds_and_timeouts_are_checked_when_connecting() {
        let cfg = RedisConfig::new("redis://127.0.0.1:7000").expect("valid");
        assert!(
            cfg.clone()
                .with_cluster_seed("redis://127.0.0.1:7001")
                .validate()
                .is_ok()
        );
        assert!(matches!(
            cfg.clone()
                .with_cluster_seed("rediss://127.0.0.1:7001")
                .validate(),
            Err(Error::InvalidUrl { .. })
        ));
        assert!(matches!(
            cfg.clone().with_cluster_seed("127.0.0.1:7001").validate(),
            Err(Error::InvalidUrl { .. })
        ));
        assert!(matches!(
            cfg.with_operation_timeout(Duration::ZERO).validate(),
            Err(Error::InvalidConfig(_))
        ));
    }

    #[test]
    fn the_default_operation_timeout_is_below_the_default_renew_deadline() {
        let key = leasehold::LeaseKey::new("k").expect("valid key");
        let elector = leasehold::ElectorConfig::new(key, "id");
        assert!(DEFAULT_OPERATION_TIMEOUT < elector.renew_deadline);
    }
}
