//! [`RedisStore`]: the [`LeaseStore`] implementation.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold::{
    Capabilities, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, Version, Versioned, WatchStream,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncConnectionConfig, Client, ClientTlsConfig, TlsCertificates};

use crate::STORE;
use crate::config::RedisConfig;
use crate::error::{Error, from_redis};
use crate::scripts::{Call, Scripts};
use crate::watch;

/// How many record keys one `list` script call reads at most.
const LIST_BATCH: usize = 256;

/// A lease store on one Redis server (or one Redis Cluster slot).
///
/// Cheap to clone; clones share the connection. See the [crate docs](crate) for the data
/// layout, the correctness class and the failure behaviour.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: Client,
    conn: ConnectionManager,
    pub(crate) keys: Keys,
    scripts: Scripts,
    pub(crate) config: RedisConfig,
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
    /// Connects to the server in `config` and checks the connection (TCP/TLS, `AUTH`, `SELECT`,
    /// `PING`), so that a wrong password or CA fails here with a clear error. Later connection
    /// losses are repaired in the background (redis-rs's `ConnectionManager`).
    ///
    /// # Errors
    /// [`leasehold::Error::Unauthenticated`] for rejected credentials, a non-retryable
    /// [`leasehold::Error::Store`] naming the TLS problem for a certificate that does not verify,
    /// [`leasehold::Error::Unavailable`] or [`leasehold::Error::Timeout`] when the server cannot be
    /// reached, [`leasehold::Error::InvalidConfig`] for unusable TLS settings.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-made connection.
    pub async fn connect(config: RedisConfig) -> leasehold::Result<Self> {
        if config.tls {
            // Only installs ring when the process has no provider yet; an error means one is set.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let client = build_client(&config)?;
        let conn_config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.operation_timeout));
        let probe = async {
            let mut c = client
                .get_multiplexed_async_connection_with_config(&conn_config)
                .await?;
            redis::cmd("PING").query_async::<()>(&mut c).await
        };
        bounded(
            "connect",
            config.connect_timeout + config.operation_timeout,
            probe,
        )
        .await?;

        let mgr_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.operation_timeout))
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), mgr_config)
            .map_err(|e| from_redis("connect", e))?;
        tracing::debug!(url = %config.redacted_url, prefix = %config.prefix, "connected to redis");
        Ok(RedisStore {
            inner: Arc::new(Inner {
                client,
                conn,
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

fn build_client(config: &RedisConfig) -> Result<Client, Error> {
    let redacted = || config.redacted_url.clone();
    if config.tls && (config.tls_root_ca_pem.is_some() || config.tls_client_cert.is_some()) {
        let certs = TlsCertificates {
            client_tls: config
                .tls_client_cert
                .as_ref()
                .map(|(cert, key)| ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: config.tls_root_ca_pem.clone(),
        };
        return Client::build_with_tls(config.url.as_str(), certs)
            .map_err(|e| Error::Tls(format!("{} ({})", e.category(), detail(&e))));
    }
    if !config.tls && (config.tls_root_ca_pem.is_some() || config.tls_client_cert.is_some()) {
        return Err(Error::InvalidUrl {
            url: redacted(),
            reason: "TLS certificates are set but the URL is not rediss://".into(),
        });
    }
    Client::open(config.url.as_str()).map_err(|e| Error::InvalidUrl {
        url: redacted(),
        reason: e.category().to_owned(),
    })
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

    /// Reads a record key and the namespace revision in one script call.
    pub(crate) async fn read(&self, key: &LeaseKey) -> leasehold::Result<(Raw, u64)> {
        let mut conn = self.conn.clone();
        let reply: Vec<Vec<u8>> = bounded(
            "get",
            self.timeout(),
            self.scripts
                .get
                .call()
                .key(self.keys.record(key.as_str()))
                .key(self.keys.rev())
                .invoke(&mut conn),
        )
        .await?;
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
        let mut conn = self.conn.clone();
        let reply: Vec<Vec<u8>> =
            bounded(operation, self.timeout(), call.invoke(&mut conn)).await?;
        match reply.first().map(Vec::as_slice) {
            Some(b"ok") if reply.len() == 2 => Ok(Version::new(text(&reply[1]))),
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
            _ => Err(unexpected(operation, &reply)),
        }
    }
}

#[async_trait]
impl LeaseStore for RedisStore {
    fn name(&self) -> &'static str {
        STORE
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::WATCH
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
        let mut conn = inner.conn.clone();
        let names: Vec<String> = bounded(
            "list",
            inner.timeout(),
            redis::cmd("ZRANGEBYLEX")
                .arg(inner.keys.index())
                .arg(min)
                .arg(max)
                .query_async(&mut conn),
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
            let reply: Vec<Vec<u8>> =
                bounded("list", inner.timeout(), inv.invoke(&mut conn)).await?;
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
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.inner.config.redacted_url)
            .field("prefix", &self.inner.config.prefix)
            .finish_non_exhaustive()
    }
}
