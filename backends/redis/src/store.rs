//! [`RedisStore`]: the [`LeaseStore`] implementation.

use std::fmt;
use std::future::Future;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use leasehold::{
    Acquired, Capabilities, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, Version, Versioned,
    WatchStream,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::{TcpSettings, socket2::TcpKeepalive};
use redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, ConnectionInfo, IntoConnectionInfo,
    TlsCertificates,
};

use crate::STORE;
use crate::config::RedisConfig;
use crate::error::{Error, from_redis};
use crate::scripts::{Call, Scripts};
use crate::watch;

/// How many record keys one `list` script call reads at most.
const LIST_BATCH: usize = 256;

/// After this many operations in a row time out on one connection, the store drops it and
/// builds a new one. redis-rs reconnects by itself only when a connection reports an error; a
/// peer that stops answering on an established connection (a proxy or NAT that lost its state, a
/// half-open TCP connection) produces only timeouts, and would otherwise stay in use until the
/// kernel gives up on it (about 15 minutes). Three keeps a single slow reply from costing a
/// reconnect.
pub const REBUILD_AFTER_TIMEOUTS: u32 = 3;

/// TCP keepalive: first probe after this much idle time.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// TCP keepalive: interval between unanswered probes.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// TCP keepalive: unanswered probes before the kernel drops the connection.
const KEEPALIVE_RETRIES: u32 = 3;
/// `TCP_USER_TIMEOUT`: how long sent data may stay unacknowledged before the kernel drops the
/// connection.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(20);

/// A lease store on one standalone Redis primary or a Redis Cluster (Sentinel is not supported).
///
/// Cheap to clone; clones share the connection. See the [crate docs](crate) for the data
/// layout, the correctness class and the failure behaviour.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// One client per seed node (one for a standalone server): watches subscribe through them.
    pub(crate) clients: Vec<Client>,
    /// The index in `clients` of the node the last watch subscribed through.
    pub(crate) pubsub_node: AtomicUsize,
    conn: Mutex<Conn>,
    kind: Kind,
    pub(crate) keys: Keys,
    scripts: Scripts,
    pub(crate) config: RedisConfig,
}

/// How command connections are made.
enum Kind {
    /// One standalone server: redis-rs's `ConnectionManager`.
    Single(Client, ConnectionManagerConfig),
    /// A Redis Cluster: redis-rs's cluster connection (slot routing, redirections).
    Cluster(ClusterClient, ClusterConfig),
}

impl Kind {
    /// A new command connection; it connects on first use.
    fn connection(&self) -> redis::RedisResult<Connection> {
        match self {
            Kind::Single(client, config) => Ok(Connection::Single(
                ConnectionManager::new_lazy_with_config(client.clone(), config.clone())?,
            )),
            Kind::Cluster(client, config) => Ok(Connection::Cluster(
                client.get_pending_async_connection_with_config(config.clone()),
            )),
        }
    }
}

/// A command connection to a standalone server or a cluster.
#[derive(Clone)]
pub(crate) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

/// The shared command connection and how many operations in a row timed out on it.
struct Conn {
    mgr: Connection,
    generation: u64,
    timeouts: u32,
}

/// The Redis keys and channel of a namespace.
pub(crate) struct Keys {
    tag: String,
}

impl Keys {
    fn new(prefix: &str) -> Self {
        Keys {
            tag: format!("{{{prefix}}}"),
        }
    }
    pub(crate) fn record(&self, key: &str) -> String {
        format!("{}rec:{key}", self.tag)
    }
    pub(crate) fn index(&self) -> String {
        format!("{}index", self.tag)
    }
    pub(crate) fn rev(&self) -> String {
        format!("{}rev", self.tag)
    }
    pub(crate) fn token(&self, key: &str) -> String {
        format!("{}tok:{key}", self.tag)
    }
    pub(crate) fn channel(&self, key: &str) -> String {
        format!("{}chan:{key}", self.tag)
    }
}

/// What the `get` script found under a record key.
#[derive(Debug)]
pub(crate) enum Raw {
    /// Nothing.
    None,
    /// One of our hashes: version and record bytes (which may still fail to decode).
    Record(Version, Vec<u8>),
    /// Data of another shape: its content hash version and its Redis type.
    Foreign(Version, String),
}

// === impl RedisStore ===

impl RedisStore {
    /// Validates `config`, connects to the server in it (for a cluster: to the first seed node
    /// that answers) and checks the connection (TCP/TLS, `AUTH`, `SELECT`, `PING`), so that a
    /// wrong address, password or CA fails here with a clear error. Later connection losses are
    /// repaired in the background (redis-rs's `ConnectionManager` or cluster client), and a
    /// connection on which [`REBUILD_AFTER_TIMEOUTS`] operations in a row time out is replaced.
    ///
    /// # Errors
    /// - [`Error::InvalidPrefix`], [`Error::InvalidUrl`] (a cluster seed), [`Error::Tls`],
    ///   [`Error::InvalidConfig`] for settings that are not usable, and [`Error::InvalidConfig`]
    ///   for a server in cluster mode without [`RedisConfig::with_cluster`];
    /// - [`Error::Connect`] when reaching or authenticating to the server failed: it carries
    ///   [`leasehold::Error::Unavailable`] or [`leasehold::Error::Timeout`] naming the URL (the
    ///   server cannot be reached), [`leasehold::Error::Unauthenticated`] (rejected
    ///   credentials), or a non-retryable [`leasehold::Error::Store`] naming the TLS problem (a
    ///   certificate that does not verify).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-made connection.
    pub async fn connect(config: RedisConfig) -> Result<Self, Error> {
        config.validate()?;
        if config.tls {
            // Only installs ring when the process has no provider yet; an error means one is set.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let urls: Vec<&str> = std::iter::once(config.url.as_str())
            .chain(config.cluster.iter().flatten().map(String::as_str))
            .collect();
        let clients = urls
            .iter()
            .map(|url| build_client(&config, url))
            .collect::<Result<Vec<_>, _>>()?;
        let client = clients[0].clone();
        let conn_config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.operation_timeout));
        // Probe the seeds in order (one for a standalone server) until one answers.
        let mut probe = Err(leasehold::Error::InvalidConfig("no redis URL".into()));
        for client in &clients {
            let attempt = async {
                let mut c = client
                    .get_multiplexed_async_connection_with_config(&conn_config)
                    .await?;
                redis::cmd("PING").query_async::<()>(&mut c).await?;
                Ok(c)
            };
            let limit = config.connect_timeout + config.operation_timeout;
            probe = bounded("connect", limit, attempt).await;
            // Only an unreachable node is a reason to try the next seed.
            if !matches!(
                probe,
                Err(leasehold::Error::Unavailable { .. } | leasehold::Error::Timeout { .. })
            ) {
                break;
            }
        }
        let mut probe = probe.map_err(|e| Error::Connect(unreachable_at(&config, &urls, e)))?;
        check_server(&mut probe, &config).await?;
        drop(probe);

        let kind = if config.cluster.is_some() {
            let cluster_config = ClusterConfig::new()
                .set_connection_timeout(config.connect_timeout)
                .set_response_timeout(config.operation_timeout);
            Kind::Cluster(build_cluster_client(&config)?, cluster_config)
        } else {
            let mgr_config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(config.connect_timeout))
                .set_response_timeout(Some(config.operation_timeout))
                .set_number_of_retries(2)
                .set_min_delay(Duration::from_millis(20))
                .set_max_delay(Duration::from_millis(500));
            Kind::Single(client, mgr_config)
        };
        let mgr = kind
            .connection()
            .map_err(|e| Error::Connect(from_redis("connect", e)))?;
        tracing::debug!(url = %config.redacted_url, prefix = %config.prefix, "connected to redis");
        Ok(RedisStore {
            inner: Arc::new(Inner {
                clients,
                pubsub_node: AtomicUsize::new(0),
                conn: Mutex::new(Conn {
                    mgr,
                    generation: 0,
                    timeouts: 0,
                }),
                kind,
                keys: Keys::new(&config.prefix),
                scripts: Scripts::new(),
                config,
            }),
        })
    }

    /// The configuration (its `Debug` output redacts the password).
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// The Redis key that holds the record of `key` (for administration and tests).
    pub fn record_key(&self, key: &LeaseKey) -> String {
        self.inner.keys.record(key.as_str())
    }
}

/// The TCP options of every connection: `TCP_NODELAY` (small request/reply exchanges), keepalive
/// probes and `TCP_USER_TIMEOUT`, so that the kernel drops a connection whose peer vanished
/// instead of keeping it for about 15 minutes.
fn tcp_settings() -> TcpSettings {
    let keepalive = TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL);
    #[cfg(any(
        target_os = "android",
        target_os = "fuchsia",
        target_os = "linux",
        target_os = "macos",
        target_os = "freebsd"
    ))]
    let keepalive = keepalive.with_retries(KEEPALIVE_RETRIES);
    let settings = TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive);
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    let settings = settings.set_user_timeout(TCP_USER_TIMEOUT);
    settings
}

fn connection_info(config: &RedisConfig, url: &str) -> Result<ConnectionInfo, Error> {
    let info = url.into_connection_info().map_err(|e| Error::InvalidUrl {
        url: config.redacted_url.clone(),
        reason: e.category().to_owned(),
    })?;
    Ok(info.set_tcp_settings(tcp_settings()))
}

fn certificates(config: &RedisConfig) -> TlsCertificates {
    TlsCertificates {
        client_tls: config
            .tls_client_identity
            .as_ref()
            .map(|(cert, key)| ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
        root_cert: config.tls_ca_pem.clone(),
    }
}

fn build_cluster_client(config: &RedisConfig) -> Result<ClusterClient, Error> {
    let nodes = std::iter::once(config.url.as_str())
        .chain(config.cluster.iter().flatten().map(String::as_str))
        .map(|url| connection_info(config, url))
        .collect::<Result<Vec<_>, _>>()?;
    let mut builder = ClusterClientBuilder::new(nodes)
        .tcp_settings(tcp_settings())
        .connection_timeout(config.connect_timeout)
        .response_timeout(config.operation_timeout);
    if config.tls && (config.tls_ca_pem.is_some() || config.tls_client_identity.is_some()) {
        builder = builder.certs(certificates(config));
    }
    builder.build().map_err(|e| Error::InvalidUrl {
        url: config.redacted_url.clone(),
        reason: format!("rejected by the redis cluster client ({})", e.category()),
    })
}

fn build_client(config: &RedisConfig, url: &str) -> Result<Client, Error> {
    let redacted = || config.redacted_url.clone();
    let info = connection_info(config, url)?;
    if config.tls && (config.tls_ca_pem.is_some() || config.tls_client_identity.is_some()) {
        return Client::build_with_tls(info, certificates(config))
            .map_err(|e| Error::Tls(format!("{} ({})", e.category(), detail(&e))));
    }
    if !config.tls && (config.tls_ca_pem.is_some() || config.tls_client_identity.is_some()) {
        return Err(Error::InvalidUrl {
            url: redacted(),
            reason: "TLS certificates are set but the URL is not rediss://".into(),
        });
    }
    Client::open(info).map_err(|e| Error::InvalidUrl {
        url: redacted(),
        reason: e.category().to_owned(),
    })
}

/// Whether a `maxmemory-policy` may evict lease keys. They carry no TTL, so the `volatile-*`
/// policies (which evict only keys with a TTL) and `noeviction` leave them alone; the
/// `allkeys-*` policies may evict them once `maxmemory` is reached, and an evicted lease is a
/// lost write (two leaders become possible).
pub(crate) fn policy_can_evict_leases(policy: &str) -> bool {
    policy.trim().to_ascii_lowercase().starts_with("allkeys-")
}

/// Checks the server at connect, from `INFO`: refuses a cluster-mode server unless the store is
/// configured for a cluster, and warns
/// (once, here) when `maxmemory-policy` can evict lease keys. Best effort: an ACL user without
/// `INFO`, or a server that does not report a field, only skips that check.
async fn check_server(
    conn: &mut impl redis::aio::ConnectionLike,
    config: &RedisConfig,
) -> Result<(), Error> {
    let info = bounded(
        "connect",
        config.operation_timeout,
        redis::cmd("INFO").query_async::<String>(conn),
    )
    .await;
    let info = match info {
        Ok(info) => info,
        Err(e) => {
            tracing::debug!(error = %e, "cannot read INFO; skipping the cluster and eviction checks");
            return Ok(());
        }
    };
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    if field("cluster_enabled") == Some("1") && config.cluster.is_none() {
        return Err(Error::InvalidConfig(format!(
            "redis at {} runs in cluster mode: configure the store with \
             RedisConfig::with_cluster() (or point it at a standalone redis)",
            config.redacted_url
        )));
    }
    if let Some(policy) = field("maxmemory_policy")
        && policy_can_evict_leases(policy)
    {
        tracing::warn!(
            url = %config.redacted_url,
            maxmemory_policy = policy,
            maxmemory = field("maxmemory").unwrap_or("unknown"),
            "redis maxmemory-policy {policy} can evict lease keys when memory runs short, which \
             loses acquisitions (two leaders become possible); use noeviction or a volatile-* \
             policy (lease keys have no TTL), or a dedicated redis"
        );
    }
    Ok(())
}

/// A failed connect probe, with the server's address in the message when it was not reachable
/// (redis-rs's own message does not name it).
fn unreachable_at(config: &RedisConfig, urls: &[&str], e: leasehold::Error) -> leasehold::Error {
    let at = || {
        let shown: Vec<String> = urls
            .iter()
            .map(|u| match url::Url::parse(u) {
                Ok(u) => crate::config::redact(&u),
                Err(_) => config.redacted_url.clone(),
            })
            .collect();
        shown.join(", ")
    };
    match e {
        leasehold::Error::Unavailable {
            store,
            message,
            source,
        } => leasehold::Error::Unavailable {
            store,
            message: format!(
                "cannot reach {}: {message} (is redis-server running there? check the host and \
                 port in the URL)",
                at()
            ),
            source,
        },
        leasehold::Error::Timeout { after, .. } => leasehold::Error::Unavailable {
            store: STORE,
            message: format!(
                "connect: no answer from {} within {after:?} (connect timeout plus operation \
                 timeout; check the host, port and firewall)",
                at()
            ),
            source: None,
        },
        other => other,
    }
}

fn detail(e: &redis::RedisError) -> String {
    e.detail().unwrap_or("no detail").to_owned()
}

/// Runs a redis future under `limit`, mapping a timeout and a redis error.
pub(crate) async fn bounded<T>(
    operation: &'static str,
    limit: Duration,
    fut: impl Future<Output = redis::RedisResult<T>>,
) -> leasehold::Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) if e.is_timeout() => Err(leasehold::Error::Timeout {
            store: STORE,
            operation,
            after: limit,
        }),
        Ok(Err(e)) => Err(from_redis(operation, e)),
        Err(_) => Err(leasehold::Error::Timeout {
            store: STORE,
            operation,
            after: limit,
        }),
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn unexpected(operation: &str, reply: &[Vec<u8>]) -> leasehold::Error {
    leasehold::Error::Store {
        store: STORE,
        message: format!(
            "{operation}: unexpected script reply {:?}",
            reply.iter().map(|b| text(b)).collect::<Vec<_>>()
        ),
        retryable: false,
        source: None,
    }
}

pub(crate) fn parse_raw(kind: &[u8], version: &[u8], data: Vec<u8>) -> Option<Raw> {
    match kind {
        b"none" => Some(Raw::None),
        b"rec" => Some(Raw::Record(Version::new(text(version)), data)),
        b"foreign" => Some(Raw::Foreign(Version::new(text(version)), text(&data))),
        _ => None,
    }
}

/// Turns a raw read into the contract's answer.
pub(crate) fn decode_raw(key: &LeaseKey, raw: Raw) -> leasehold::Result<Option<Versioned>> {
    match raw {
        Raw::None => Ok(None),
        Raw::Record(version, data) => {
            let record = leasehold::codec::decode(key, &data, Some(&version))?;
            Ok(Some(Versioned { record, version }))
        }
        Raw::Foreign(version, kind) => Err(leasehold::Error::Corrupt {
            key: key.to_string(),
            reason: format!(
                "expected a leasehold record (a hash with fields v and d), found a redis {kind}"
            ),
            version: Some(version),
        }),
    }
}

impl Inner {
    fn timeout(&self) -> Duration {
        self.config.operation_timeout
    }

    /// The current command connection and its generation.
    fn conn(&self) -> (Connection, u64) {
        let c = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        (c.mgr.clone(), c.generation)
    }

    /// Counts timeouts in a row on connection `generation` and replaces it after
    /// [`REBUILD_AFTER_TIMEOUTS`] of them; any other outcome resets the count.
    fn observe<T>(&self, generation: u64, result: &leasehold::Result<T>) {
        let mut c = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        if c.generation != generation {
            return;
        }
        if !matches!(result, Err(leasehold::Error::Timeout { .. })) {
            c.timeouts = 0;
            return;
        }
        c.timeouts += 1;
        if c.timeouts < REBUILD_AFTER_TIMEOUTS {
            return;
        }
        match self.kind.connection() {
            Ok(mgr) => {
                tracing::warn!(
                    url = %self.config.redacted_url,
                    timeouts = c.timeouts,
                    "redis: {} operations in a row timed out on one connection; replacing it",
                    c.timeouts
                );
                c.mgr = mgr;
                c.generation += 1;
                c.timeouts = 0;
            }
            Err(e) => tracing::warn!(error = %e, "redis: cannot build a new connection"),
        }
    }

    /// Runs a script call on the command connection, bounded by the operation timeout.
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        operation: &'static str,
        call: Call<'_>,
    ) -> leasehold::Result<T> {
        let (mut conn, generation) = self.conn();
        let r = bounded(operation, self.timeout(), call.invoke(&mut conn)).await;
        self.observe(generation, &r);
        r
    }

    /// Runs a command on the command connection, bounded by the operation timeout.
    async fn query<T: redis::FromRedisValue>(
        &self,
        operation: &'static str,
        cmd: &redis::Cmd,
    ) -> leasehold::Result<T> {
        let (mut conn, generation) = self.conn();
        let r = bounded(operation, self.timeout(), cmd.query_async(&mut conn)).await;
        self.observe(generation, &r);
        r
    }

    /// Reads a record key and the namespace revision in one script call.
    pub(crate) async fn read(&self, key: &LeaseKey) -> leasehold::Result<(Raw, u64)> {
        let call = (self.scripts.get.call())
            .key(self.keys.record(key.as_str()))
            .key(self.keys.rev());
        let reply: Vec<Vec<u8>> = self.invoke("get", call).await?;
        let mut it = reply.clone().into_iter();
        let (Some(kind), Some(version), Some(data), Some(rev), None) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            return Err(unexpected("get", &reply));
        };
        let raw = parse_raw(&kind, &version, data).ok_or_else(|| unexpected("get", &reply))?;
        // A namespace counter that is not a number can only come from a foreign writer; reading
        // it as 0 only makes a watch deliver a state it might have skipped, never lose one.
        let rev = text(&rev).parse().unwrap_or(0);
        Ok((raw, rev))
    }

    async fn write(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        call: Call<'_>,
        expected: Option<&Version>,
    ) -> leasehold::Result<Version> {
        let reply = self.write_reply(operation, key, call, expected).await?;
        match reply.as_slice() {
            [v] => Ok(Version::new(text(v))),
            _ => Err(unexpected(operation, &reply)),
        }
    }

    /// Runs a write script and returns what follows `ok` in its reply, or the typed error of
    /// any other reply.
    async fn write_reply(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        call: Call<'_>,
        expected: Option<&Version>,
    ) -> leasehold::Result<Vec<Vec<u8>>> {
        let mut reply: Vec<Vec<u8>> = self.invoke(operation, call).await?;
        match reply.first().map(Vec::as_slice) {
            Some(b"ok") => Ok(reply.split_off(1)),
            Some(b"exists") => Err(leasehold::Error::AlreadyExists {
                key: key.to_string(),
            }),
            Some(b"notfound") => Err(leasehold::Error::NotFound {
                key: key.to_string(),
            }),
            Some(b"conflict") => Err(leasehold::Error::Conflict {
                key: key.to_string(),
                expected: expected.cloned().unwrap_or_else(|| Version::new("")),
            }),
            Some(b"badnum") => Err(self.refused(operation, key, &reply)),
            _ => Err(unexpected(operation, &reply)),
        }
    }

    /// The error for a `badnum` reply `{'badnum', role, value, reason}`: a counter, version or
    /// token the scripts cannot count on exactly (see [`crate::scripts`]).
    fn refused(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        reply: &[Vec<u8>],
    ) -> leasehold::Error {
        let [_, role, held, reason] = reply else {
            return unexpected(operation, reply);
        };
        let held = shown(held);
        let k = &self.keys;
        let message = match (role.as_slice(), reason.as_slice()) {
            (b"token", b"overflow") => {
                return leasehold::Error::TokenExhausted {
                    key: key.to_string(),
                    last: held.parse().unwrap_or(u64::MAX),
                };
            }
            (b"counter", b"notint") => format!(
                "the namespace counter {} holds {held:?}, which is not a decimal integer of at \
                 most {U64_MAX}; set it to a decimal integer no lower than the highest version \
                 in the namespace (deleting it lets versions continue from the server clock in \
                 microseconds)",
                k.rev()
            ),
            (b"counter", b"overflow") => format!(
                "the namespace counter {} holds {held}, and the next version would exceed \
                 {U64_MAX} (the largest 64-bit version); versions cannot continue in this \
                 namespace: move the leases to a new prefix",
                k.rev()
            ),
            (b"version", b"overflow") => format!(
                "the record {} has version {held}, and the next version would exceed {U64_MAX} \
                 (the largest 64-bit version); delete the record key (the lease is then vacant)",
                k.record(key.as_str())
            ),
            (b"token", b"notint") => format!(
                "the token high-water mark {} holds {held:?}, which is not a decimal integer of \
                 at most {U64_MAX}; set it to a decimal integer no lower than the lease's highest \
                 fencing token",
                k.token(key.as_str())
            ),
            _ => return unexpected(operation, reply),
        };
        leasehold::Error::Store {
            store: STORE,
            message: format!("{operation}: {message}"),
            retryable: false,
            source: None,
        }
    }
}

/// The largest version and token: u64::MAX.
const U64_MAX: u64 = u64::MAX;

/// A value from the server for an error message: at most 64 characters of it.
fn shown(b: &[u8]) -> String {
    let t = text(b);
    match t.char_indices().nth(64) {
        Some((i, _)) => format!("{}…", &t[..i]),
        None => t,
    }
}

/// The record JSON of an acquisition split around its token: `head` ends with
/// `"leaderTransitions":` and `tail` is the rest, so the acquire script writes
/// `head .. token .. tail`, a plain record carrying the token it assigned.
fn acquisition_parts(record: &LeaseRecord) -> leasehold::Result<(Vec<u8>, Vec<u8>)> {
    const FIELD: &[u8] = b"\"leaderTransitions\":0";
    let bytes = leasehold::codec::encode(&LeaseRecord {
        transitions: 0,
        ..record.clone()
    });
    // Inside JSON strings every `"` is escaped, so the field name with its quotes and colon
    // occurs once: as the key.
    let at = bytes
        .windows(FIELD.len())
        .position(|w| w == FIELD)
        .ok_or_else(|| leasehold::Error::Store {
            store: STORE,
            message: "acquire: the encoded record has no leaderTransitions field".into(),
            retryable: false,
            source: None,
        })?;
    let digit = at + FIELD.len() - 1;
    Ok((bytes[..digit].to_vec(), bytes[digit + 1..].to_vec()))
}

#[async_trait]
impl LeaseStore for RedisStore {
    fn name(&self) -> &'static str {
        STORE
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::WATCH
            .with_commit_tokens()
            .with_operation_timeout(self.inner.config.operation_timeout)
    }

    async fn get(&self, key: &LeaseKey) -> leasehold::Result<Option<Versioned>> {
        let (raw, _) = self.inner.read(key).await?;
        decode_raw(key, raw)
    }

    async fn create(&self, key: &LeaseKey, record: &LeaseRecord) -> leasehold::Result<Version> {
        let k = &self.inner.keys;
        let inv = (self.inner.scripts.create.call())
            .key(k.record(key.as_str()))
            .key(k.index())
            .key(k.rev())
            .arg(leasehold::codec::encode(record))
            .arg(key.as_str())
            .arg(k.channel(key.as_str()));
        self.inner.write("create", key, inv, None).await
    }

    async fn update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> leasehold::Result<Version> {
        let k = &self.inner.keys;
        let inv = (self.inner.scripts.update.call())
            .key(k.record(key.as_str()))
            .key(k.index())
            .key(k.rev())
            .arg(expected.as_str())
            .arg(leasehold::codec::encode(record))
            .arg(key.as_str())
            .arg(k.channel(key.as_str()));
        self.inner.write("update", key, inv, Some(expected)).await
    }

    async fn delete(&self, key: &LeaseKey, expected: &Version) -> leasehold::Result<()> {
        let k = &self.inner.keys;
        let inv = (self.inner.scripts.delete.call())
            .key(k.record(key.as_str()))
            .key(k.index())
            .key(k.rev())
            .arg(expected.as_str())
            .arg(key.as_str())
            .arg(k.channel(key.as_str()));
        self.inner
            .write("delete", key, inv, Some(expected))
            .await
            .map(|_| ())
    }

    async fn watch(
        &self,
        key: &LeaseKey,
        after: Option<&Version>,
    ) -> leasehold::Result<WatchStream> {
        watch::start(self.inner.clone(), key.clone(), after.cloned()).await
    }

    async fn list(&self, prefix: &KeyPrefix) -> leasehold::Result<Vec<(LeaseKey, Versioned)>> {
        let inner = &self.inner;
        let (min, max) = if prefix.as_str().is_empty() {
            ("-".to_owned(), "+".to_owned())
        } else {
            // Lease keys are ASCII, so every key under the prefix sorts below prefix + 0xff.
            (format!("[{prefix}"), format!("({prefix}\u{7f}"))
        };
        let names: Vec<String> = inner
            .query(
                "list",
                redis::cmd("ZRANGEBYLEX")
                    .arg(inner.keys.index())
                    .arg(min)
                    .arg(max),
            )
            .await?;
        let mut out = Vec::with_capacity(names.len());
        for chunk in names.chunks(LIST_BATCH) {
            let keys: Vec<LeaseKey> = chunk
                .iter()
                .filter_map(|n| match LeaseKey::new(n) {
                    Ok(k) => Some(k),
                    Err(e) => {
                        tracing::warn!(name = %n, error = %e, "list: ignoring an invalid name in the index");
                        None
                    }
                })
                .collect();
            if keys.is_empty() {
                continue;
            }
            let mut inv = inner.scripts.get_many.call();
            for k in &keys {
                inv = inv.key(inner.keys.record(k.as_str()));
            }
            let reply: Vec<Vec<u8>> = inner.invoke("list", inv).await?;
            if reply.len() != keys.len() * 3 {
                return Err(unexpected("list", &reply));
            }
            let mut it = reply.into_iter();
            for key in keys {
                let (Some(kind), Some(version), Some(data)) = (it.next(), it.next(), it.next())
                else {
                    break;
                };
                let Some(raw) = parse_raw(&kind, &version, data) else {
                    return Err(unexpected("list", &[kind]));
                };
                match decode_raw(&key, raw) {
                    Ok(Some(v)) => out.push((key, v)),
                    // Deleted by a foreign writer after the index was read: not there.
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(key = %key, error = %e, "list: leaving out a key with corrupt data")
                    }
                }
            }
        }
        Ok(out)
    }

    /// One script, atomic: the token is the largest of the write's new version (never below
    /// the server clock in microseconds), the key's token high-water mark plus one (kept across
    /// deletes of the record) and the record's `transitions` (the caller's floor). The record is
    /// stored with that token and the high-water mark is raised to it.
    async fn acquire(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: Option<&Version>,
    ) -> leasehold::Result<Acquired> {
        let k = &self.inner.keys;
        let (head, tail) = acquisition_parts(record)?;
        let (mode, expected_arg) = match expected {
            None => ("create", ""),
            Some(v) => ("update", v.as_str()),
        };
        let inv = (self.inner.scripts.acquire.call())
            .key(k.record(key.as_str()))
            .key(k.index())
            .key(k.rev())
            .key(k.token(key.as_str()))
            .arg(mode)
            .arg(expected_arg)
            .arg(head)
            .arg(tail)
            .arg(record.transitions.to_string())
            .arg(key.as_str())
            .arg(k.channel(key.as_str()));
        let reply = self
            .inner
            .write_reply("acquire", key, inv, expected)
            .await?;
        match reply.as_slice() {
            [v, token] => match text(token).parse() {
                Ok(fencing_token) => Ok(Acquired {
                    version: Version::new(text(v)),
                    fencing_token,
                }),
                Err(_) => Err(unexpected("acquire", &reply)),
            },
            _ => Err(unexpected("acquire", &reply)),
        }
    }

    async fn fencing_seed(&self, key: &LeaseKey) -> leasehold::Result<u64> {
        let k = &self.inner.keys;
        let call = (self.inner.scripts.seed.call())
            .key(k.record(key.as_str()))
            .key(k.rev())
            .key(k.token(key.as_str()));
        let reply = self
            .inner
            .write_reply("fencing_seed", key, call, None)
            .await?;
        match reply.as_slice() {
            [seed] => text(seed)
                .parse()
                .map_err(|_| unexpected("fencing_seed", &reply)),
            _ => Err(unexpected("fencing_seed", &reply)),
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.inner.config.redacted_url)
            .field("prefix", &self.inner.config.prefix)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::{acquisition_parts, policy_can_evict_leases};
    use leasehold::{LeaseKey, LeaseRecord, codec};
    use std::time::{Duration, SystemTime};

    #[test]
    fn an_acquisition_spliced_around_its_token_decodes_to_that_token() {
        let key = LeaseKey::new("k").expect("a valid key");
        for holder in [
            "a",
            "\"leaderTransitions\":0",
            "x\\\"leaderTransitions\":0,",
        ] {
            let record = LeaseRecord {
                holder_identity: holder.into(),
                lease_duration: Duration::from_secs(15),
                acquire_time: Some(SystemTime::UNIX_EPOCH),
                renew_time: None,
                transitions: 7,
            };
            let (head, tail) = acquisition_parts(&record).expect("the record has the field");
            for token in [1u64, 9_007_199_254_740_993, u64::MAX] {
                let mut bytes = head.clone();
                bytes.extend_from_slice(token.to_string().as_bytes());
                bytes.extend_from_slice(&tail);
                let back = codec::decode(&key, &bytes, None).expect("the spliced record decodes");
                assert_eq!(
                    back,
                    LeaseRecord {
                        transitions: token,
                        ..record.clone()
                    },
                    "{holder}"
                );
            }
        }
    }

    #[test]
    fn only_allkeys_policies_can_evict_lease_keys() {
        for policy in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            " ALLKEYS-LRU\r",
        ] {
            assert!(policy_can_evict_leases(policy), "{policy}");
        }
        for policy in [
            "noeviction",
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
            "",
        ] {
            assert!(!policy_can_evict_leases(policy), "{policy}");
        }
    }
}
