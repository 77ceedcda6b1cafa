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
///   roots or against the CA set with [`tls_root_ca_pem`](RedisConfig::tls_root_ca_pem).
///
/// A `#insecure` fragment (redis-rs's switch to skip certificate verification) is refused with
/// [`Error::InsecureTls`]: give the server's CA with
/// [`tls_root_ca_pem`](RedisConfig::tls_root_ca_pem) instead.
///
/// A user name selects an ACL user (`AUTH user password`); a password alone uses `requirepass`.
/// The password never appears in `Debug` output, errors or logs: everything prints
/// [`redacted_url`](RedisConfig::redacted_url).
///
/// ```
/// use leasehold_redis::RedisConfig;
/// let cfg = RedisConfig::new("redis://app:s3cret@127.0.0.1:6379/2")?;
/// assert!(!format!("{cfg:?}").contains("s3cret"));
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
    pub(crate) tls_root_ca_pem: Option<Vec<u8>>,
    pub(crate) tls_client_cert: Option<(Vec<u8>, Vec<u8>)>,
    /// Redis Cluster: the URLs of further seed nodes (the main URL is the first).
    pub(crate) cluster: Option<Vec<String>>,
}

// === impl RedisConfig ===

impl RedisConfig {
    /// Parses `url` (see the type's docs) with the defaults: prefix `leasehold:`, 2 s operation
    /// and connect timeouts.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] (with the credentials redacted) when the URL is not a `redis://` or
    /// `rediss://` URL with a host, or its database is not a number;
    /// [`Error::InsecureTls`] for a `#insecure` fragment.
    pub fn new(url: impl Into<String>) -> Result<Self, Error> {
        let url = url.into();
        let parsed = url::Url::parse(&url).map_err(|e| Error::InvalidUrl {
            url: "<unparsable URL, redacted>".into(),
            reason: e.to_string(),
        })?;
        let redacted_url = redact(&parsed);
        let invalid = |reason: &str| Error::InvalidUrl {
            url: redacted_url.clone(),
            reason: reason.to_owned(),
        };
        let tls = match parsed.scheme() {
            "redis" => false,
            "rediss" => true,
            _ => return Err(invalid("the scheme must be redis:// or rediss://")),
        };
        match parsed.fragment() {
            None => {}
            Some("insecure") => return Err(Error::InsecureTls { url: redacted_url }),
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
        redis::Client::open(url.as_str())
            .map_err(|e| invalid(&format!("rejected by the redis client ({})", e.category())))?;
        Ok(RedisConfig {
            url,
            redacted_url,
            tls,
            prefix: DEFAULT_PREFIX.to_owned(),
            db,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            watch_ping_interval: DEFAULT_WATCH_PING_INTERVAL,
            tls_root_ca_pem: None,
            tls_client_cert: None,
            cluster: None,
        })
    }

    /// Sets the key namespace prefix (default `leasehold:`). Every key this store writes starts
    /// with `{<prefix>}`: the prefix is the Redis Cluster hash tag, so all keys of one namespace
    /// live in one slot and every script's keys share it.
    ///
    /// # Errors
    /// [`Error::InvalidPrefix`] when the prefix is empty, longer than 64 bytes, or contains `{`,
    /// `}`, whitespace or control characters.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Result<Self, Error> {
        let prefix = prefix.into();
        if prefix.is_empty() || prefix.len() > 64 {
            return Err(Error::InvalidPrefix {
                prefix,
                reason: "the prefix must be 1 to 64 bytes long",
            });
        }
        if prefix
            .chars()
            .any(|c| c == '{' || c == '}' || c.is_whitespace() || c.is_control())
        {
            return Err(Error::InvalidPrefix {
                prefix,
                reason: "the prefix must not contain '{', '}', whitespace or control characters",
            });
        }
        self.prefix = prefix;
        Ok(self)
    }

    /// Bounds every store operation (default 2 s); a slower one fails with
    /// [`leasehold::Error::Timeout`]. Choose it well below the elector's renew deadline.
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Bounds connection establishment (default 2 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How often an idle watch connection is checked with `PING` (default 5 s), so that a
    /// connection that died silently is noticed and replaced.
    pub fn watch_ping_interval(mut self, interval: Duration) -> Self {
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
    pub fn cluster(mut self) -> Self {
        self.cluster.get_or_insert_with(Vec::new);
        self
    }

    /// Adds another seed node of the Redis Cluster (and turns on [`cluster`](Self::cluster)):
    /// the store connects through whichever seed answers, and watches fall back to the next
    /// seed when one is down. Same scheme and credentials as the main URL.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] or [`Error::InsecureTls`] as for [`RedisConfig::new`], and
    /// [`Error::InvalidUrl`] when its scheme differs from the main URL's.
    pub fn cluster_seed(mut self, url: impl Into<String>) -> Result<Self, Error> {
        let seed = RedisConfig::new(url)?;
        if seed.tls != self.tls {
            return Err(Error::InvalidUrl {
                url: seed.redacted_url,
                reason: "a cluster seed must use the same scheme as the main URL".into(),
            });
        }
        self.cluster.get_or_insert_with(Vec::new).push(seed.url);
        Ok(self)
    }

    /// Trusts only this CA (PEM) for `rediss://` instead of the system roots.
    pub fn tls_root_ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root_ca_pem = Some(pem.into());
        self
    }

    /// Presents this client certificate chain and key (both PEM) for mutual TLS.
    pub fn tls_client_cert_pem(
        mut self,
        cert: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls_client_cert = Some((cert.into(), key.into()));
        self
    }

    /// The URL with the password replaced by `***`: safe to log.
    pub fn redacted_url(&self) -> &str {
        &self.redacted_url
    }

    /// The key namespace prefix.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The least-privilege `ACL SETUSER` rules for this configuration (without `on` and the
    /// password): only this prefix's keys (`~{P}*`) and channels (`&{P}chan:*`), only
    /// [`ACL_COMMANDS`], plus `SELECT` when the URL names a database other than 0, plus
    /// `CLUSTER SLOTS` (topology discovery) for a [`cluster`](Self::cluster).
    ///
    /// ```
    /// use leasehold_redis::RedisConfig;
    /// let cfg = RedisConfig::new("redis://127.0.0.1")?.prefix("myapp:")?;
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

fn redact(url: &url::Url) -> String {
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
            .field(
                "tls_root_ca_pem",
                &self.tls_root_ca_pem.as_ref().map(|_| "<set>"),
            )
            .field(
                "tls_client_cert",
                &self.tls_client_cert.as_ref().map(|_| "<redacted>"),
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
                    assert!(text.contains("tls_root_ca_pem"), "{text}");
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
        let rules = cfg.prefix("a*b?:").expect("prefix").acl_rules();
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
        assert!(cfg.clone().prefix("app:").is_ok());
        assert!(cfg.clone().prefix("").is_err());
        assert!(cfg.clone().prefix("a{b").is_err());
        assert!(cfg.prefix("a b").is_err());
    }
}
