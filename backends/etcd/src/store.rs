//! [`EtcdStore`]: the [`LeaseStore`] over etcd's v3 API.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse,
};
use leasehold::{
    Acquired, Capabilities, Error, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, Result, Version,
    Versioned, WatchStream, codec,
};

use crate::STORE;
use crate::config::EtcdConfig;
use crate::error::{Error as ConfigError, from_client};

/// A [`LeaseStore`] on etcd.
///
/// Each record is the JSON of [`leasehold::codec`] under the etcd key `<prefix><lease key>`; its
/// [`Version`] is the key's `mod_revision`. Writes are transactions that compare
/// `create_revision == 0` (create) or `mod_revision == expected` (update, delete), so they are
/// linearizable compare-and-swaps. Cheap to clone; clones share the connection.
///
/// # Fencing
///
/// The store assigns fencing tokens at commit ([`LeaseStore::acquire`],
/// [`Capabilities::commit_tokens`]): an acquisition is written by the same transactions as
/// `create` and `update`, and its token is the `mod_revision` of that write, or the token the
/// caller asks for at least (one above the record it replaces) when that is higher. etcd's
/// revision grows with every write to the cluster and never goes back, also across deletes, so
/// a write that commits late still gets a token above every revision committed before it.
/// Followers read the token as the record's `transitions` (the record carries the floor and a
/// marker; [`codec::decode`] resolves it against the `mod_revision`).
///
/// The revision of the write that *acquired* a term is a second token, global across keys,
/// like the `ETCD_LOCK_REV` that `etcdctl lock` exports: [`EtcdStore::acquisition_revision`]
/// returns it for a term this store wrote. For a term acquired by `acquire` it **is** the
/// fencing token, unless a floor above the revision raised the token. Renewals change the key's
/// `mod_revision`, so a transaction that guards a write in the same etcd by comparing the lease
/// key's `mod_revision` must use the version of the latest renewal, not the acquisition
/// revision.
///
/// A floor above the revision (a foreign writer's high token) lives only in the record: once
/// the record is deleted, a later acquisition gets the revision again, which can be lower.
#[derive(Clone)]
pub struct EtcdStore {
    pub(crate) client: Client,
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    /// The configured endpoints, comma-separated, for error messages.
    pub(crate) endpoints: Arc<str>,
    config: EtcdConfig,
    /// Per key: the term of the last record this store wrote.
    acquisitions: Arc<Mutex<HashMap<LeaseKey, Term>>>,
}

/// The term of the last record a store wrote under one key.
#[derive(Clone, Copy, Debug)]
struct Term {
    /// The record's `transitions`; `None` once the store deleted the key.
    transitions: Option<u64>,
    /// The revision of the write that started the chain of writes carrying `transitions`.
    acquired: i64,
    /// The revision of the latest write in that chain (or of the delete).
    last: i64,
}

/// Parses a [`Version`] from this store as the etcd revision it is (the record's
/// `mod_revision`); `None` for a version that is not a positive revision.
///
/// ```
/// assert_eq!(leasehold_etcd::revision(&leasehold::Version::from(42u64)), Some(42));
/// ```
pub fn revision(version: &Version) -> Option<i64> {
    version.as_str().parse::<i64>().ok().filter(|r| *r > 0)
}

// === impl EtcdStore ===

impl EtcdStore {
    /// Validates `config`, connects to etcd (authenticating right away when it has
    /// credentials) and reads the key prefix once (a count-only range read bounded by the
    /// connect timeout plus the operation timeout), so that an unreachable endpoint, wrong
    /// credentials or a user that may not read the prefix fail here, naming the endpoints,
    /// instead of leaving an elector without a leader.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] for a bad configuration;
    /// [`crate::Error::Connect`] carrying [`Error::Unavailable`] naming
    /// the endpoints when none answered in time, [`Error::Unauthenticated`] for rejected
    /// credentials, [`Error::PermissionDenied`] when the user may not read the prefix, or a
    /// non-retryable [`Error::Store`] naming a TLS problem.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future only abandons the connection attempt and the probe.
    pub async fn connect(config: EtcdConfig) -> std::result::Result<Self, ConfigError> {
        config.validate()?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_keep_alive(config.keep_alive, config.operation_timeout)
            // Idle pings without an open stream count against etcd's ping policy
            // (grpc's PermitWithoutStream is off in etcd), so ping only while watching.
            .with_keep_alive_while_idle(false)
            .with_require_leader(true)
            .with_auto_token_refresh(true);
        if let Some(c) = &config.credentials {
            options = options.with_user(c.user.clone(), c.password.clone());
        }
        if let Some(tls) = &config.tls {
            options = options.with_tls(tls.to_options());
        }
        let endpoints: Arc<str> = config.endpoints.join(", ").into();
        // Authentication (with credentials) happens inside connect; bound it like the probe.
        let limit = config.connect_timeout + config.operation_timeout;
        let client =
            match tokio::time::timeout(limit, Client::connect(&config.endpoints, Some(options)))
                .await
            {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    let e = with_endpoints(from_client("connect", e), &endpoints);
                    return Err(ConfigError::Connect(e));
                }
                Err(_) => return Err(ConfigError::Connect(no_answer(&endpoints, limit))),
            };
        let store = EtcdStore {
            client,
            prefix: config.prefix.clone(),
            timeout: config.operation_timeout,
            endpoints,
            config,
            acquisitions: Arc::default(),
        };
        // The client connects lazily: without this read, a wrong port would only show up as an
        // elector that never finds a leader.
        let probe = store
            .bounded_for("connect", limit, || {
                let (mut kv, prefix) = (store.client.kv_client(), store.prefix.clone());
                let options = GetOptions::new().with_prefix().with_count_only();
                async move { kv.get(prefix, Some(options)).await }
            })
            .await;
        match probe {
            Ok(_) => {}
            Err(Error::Timeout { after, .. }) => {
                return Err(ConfigError::Connect(no_answer(&store.endpoints, after)));
            }
            Err(e) => return Err(ConfigError::Connect(e)),
        }
        tracing::debug!(endpoints = %store.endpoints, prefix = %store.prefix, "connected to etcd");
        Ok(store)
    }

    /// The etcd revision of the write that acquired the term with fencing token `transitions`
    /// on `key`, if this store (or a clone of it) wrote it: the first of an unbroken chain of
    /// writes it made carrying that `transitions` value (an acquisition, a create, or an update
    /// of a version it did not write itself). Strictly increasing across terms, like
    /// `ETCD_LOCK_REV`. For a term acquired by [`LeaseStore::acquire`] (what the elector does on
    /// etcd) it equals the fencing token unless a floor above the revision raised the token. A
    /// delete through this store ends the term, so a record created afterwards with the same
    /// `transitions` gets the revision of its own creation.
    ///
    /// ```no_run
    /// # async fn demo(store: leasehold_etcd::EtcdStore, elector: leasehold::Elector) {
    /// let (status, _changed) = elector.current_status();
    /// if let Some(term) = status.leadership() {
    ///     let rev = store.acquisition_revision(&elector.config().key, term.fencing_token());
    ///     // hand `rev` to the protected resource
    /// #   let _ = rev;
    /// }
    /// # }
    /// ```
    pub fn acquisition_revision(&self, key: &LeaseKey, transitions: u64) -> Option<i64> {
        let map = self.acquisitions.lock().unwrap_or_else(|e| e.into_inner());
        map.get(key)
            .filter(|t| t.transitions == Some(transitions))
            .map(|t| t.acquired)
    }

    /// Notes a successful write of `record` at `version`. `expected` is the version the write
    /// replaced (`None` for a create). The write continues the current term only when it
    /// replaced this store's own latest write and carries the same `transitions`; any other
    /// write (a create, a write over someone else's record) starts a new term at its revision.
    /// Notes arrive in any order from concurrent calls; one older than the latest noted write
    /// or delete is ignored (etcd's revisions order them).
    fn note_write(
        &self,
        key: &LeaseKey,
        transitions: u64,
        expected: Option<&Version>,
        version: &Version,
    ) {
        let Some(rev) = revision(version) else { return };
        let replaced = expected.and_then(revision);
        let mut map = self.acquisitions.lock().unwrap_or_else(|e| e.into_inner());
        match map.get_mut(key) {
            Some(t) if t.last >= rev => {}
            Some(t) if t.transitions == Some(transitions) && Some(t.last) == replaced => {
                t.last = rev;
            }
            _ => {
                map.insert(
                    key.clone(),
                    Term {
                        transitions: Some(transitions),
                        acquired: rev,
                        last: rev,
                    },
                );
            }
        }
    }

    /// Ends the term of `key`: the store deleted it at revision `rev`, so a record created
    /// later starts a new term even when it carries the same `transitions`.
    fn note_delete(&self, key: &LeaseKey, rev: i64) {
        let mut map = self.acquisitions.lock().unwrap_or_else(|e| e.into_inner());
        match map.get_mut(key) {
            Some(t) if rev <= 0 => t.transitions = None,
            Some(t) if t.last >= rev => {}
            _ => {
                map.insert(
                    key.clone(),
                    Term {
                        transitions: None,
                        acquired: rev,
                        last: rev,
                    },
                );
            }
        }
    }

    /// The etcd key a lease key is stored under: `<prefix><key>`.
    pub fn etcd_key(&self, key: &LeaseKey) -> String {
        format!("{}{}", self.prefix, key.as_str())
    }

    /// The underlying `etcd-client` client, for fencing your own writes with the lease's
    /// revision in one transaction.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The configured key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Runs one etcd call bounded by the operation timeout.
    ///
    /// A call that failed to *connect* (so it never reached a server) is repeated on another
    /// endpoint within the same time bound: the client's balancer may still pick a member that
    /// just went down. Nothing else is retried here.
    pub(crate) async fn bounded<T, F, Fut>(&self, operation: &'static str, call: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        self.bounded_for(operation, self.timeout, call).await
    }

    /// [`bounded`](Self::bounded) with another time limit. An [`Error::Unavailable`] names the
    /// configured endpoints.
    async fn bounded_for<T, F, Fut>(
        &self,
        operation: &'static str,
        limit: Duration,
        mut call: F,
    ) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let attempts = async {
            let mut tries = 0u32;
            loop {
                match call().await {
                    Ok(v) => return Ok(v),
                    Err(e) if tries < MAX_CONNECT_RETRIES && is_connect_error(&e) => {
                        tries += 1;
                        tracing::debug!(operation, error = %crate::error::chain(&e), "etcd endpoint unreachable; trying another");
                        tokio::time::sleep(Duration::from_millis(10 * u64::from(tries))).await;
                    }
                    Err(e) => {
                        return Err(with_endpoints(from_client(operation, e), &self.endpoints));
                    }
                }
            }
        };
        match tokio::time::timeout(limit, attempts).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                store: STORE,
                operation,
                after: limit,
            }),
        }
    }

    /// `e` with the endpoints in its message when it is [`Error::Unavailable`].
    pub(crate) fn at_endpoints(&self, e: Error) -> Error {
        with_endpoints(e, &self.endpoints)
    }

    /// Compare-and-swap: `op` runs only when the key's `mod_revision` is `expected`; otherwise a
    /// get in the same transaction tells `Conflict` from `NotFound`.
    async fn cas(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        expected: &Version,
        op: TxnOp,
    ) -> Result<i64> {
        let full = self.etcd_key(key);
        let probe = || TxnOp::get(full.clone(), Some(GetOptions::new().with_keys_only()));
        let kv = self.client.kv_client();
        // A missing key has mod_revision 0, so only a positive revision may be compared; any
        // other version matches nothing and only the probe runs.
        let resp = match revision(expected) {
            Some(rev) => {
                let txn = Txn::new()
                    .when([Compare::mod_revision(full.clone(), CompareOp::Equal, rev)])
                    .and_then([op])
                    .or_else([probe()]);
                let resp = self
                    .bounded(operation, || {
                        let (mut kv, txn) = (kv.clone(), txn.clone());
                        async move { kv.txn(txn).await }
                    })
                    .await?;
                if resp.succeeded() {
                    return Ok(resp.header().map(|h| h.revision()).unwrap_or_default());
                }
                resp
            }
            None => {
                let txn = Txn::new().and_then([probe()]);
                self.bounded(operation, || {
                    let (mut kv, txn) = (kv.clone(), txn.clone());
                    async move { kv.txn(txn).await }
                })
                .await?
            }
        };
        let exists = resp.op_responses().into_iter().any(|r| match r {
            TxnOpResponse::Get(g) => !g.kvs().is_empty(),
            _ => false,
        });
        if exists {
            Err(Error::Conflict {
                key: key.to_string(),
                expected: expected.clone(),
            })
        } else {
            Err(Error::NotFound {
                key: key.to_string(),
            })
        }
    }
}

impl EtcdStore {
    /// Puts `bytes` under a key that does not exist (`create_revision == 0`); the version is the
    /// write's revision.
    async fn put_new(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        bytes: Vec<u8>,
    ) -> Result<Version> {
        let full = self.etcd_key(key);
        let txn = Txn::new()
            .when([Compare::create_revision(full.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(full, bytes, None)]);
        let resp = self
            .bounded(operation, || {
                let (mut kv, txn) = (self.client.kv_client(), txn.clone());
                async move { kv.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            return Err(Error::AlreadyExists {
                key: key.to_string(),
            });
        }
        header_version(operation, resp.header())
    }

    /// Puts `bytes` over the record at version `expected` (compare-and-swap on `mod_revision`).
    async fn put_over(
        &self,
        operation: &'static str,
        key: &LeaseKey,
        expected: &Version,
        bytes: Vec<u8>,
    ) -> Result<Version> {
        let op = TxnOp::put(self.etcd_key(key), bytes, None);
        let rev = self.cas(operation, key, expected, op).await?;
        positive(operation, rev)
    }
}

const MAX_CONNECT_RETRIES: u32 = 8;

/// `e` with the endpoints in its message when it is [`Error::Unavailable`], so that an
/// unreachable or misconfigured endpoint can be found from the error alone.
fn with_endpoints(e: Error, endpoints: &str) -> Error {
    match e {
        Error::Unavailable {
            store,
            message,
            source,
        } => Error::Unavailable {
            store,
            message: format!("{message} (etcd endpoints: {endpoints})"),
            source,
        },
        other => other,
    }
}

/// No endpoint answered the connect probe within `after`.
fn no_answer(endpoints: &str, after: Duration) -> Error {
    Error::Unavailable {
        store: STORE,
        message: format!(
            "no answer from etcd at {endpoints} within {after:?} (is etcd running there? check \
             the endpoints' hosts, ports and http/https scheme)"
        ),
        source: None,
    }
}

/// Whether the call failed before reaching any server (the connection could not be made), so
/// repeating it cannot apply a write twice.
fn is_connect_error(e: &etcd_client::Error) -> bool {
    if crate::error::certificate_hint(&crate::error::chain(e)).is_some() {
        // Another endpoint will not trust the configured CA any better.
        return false;
    }
    match e {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(s) if s.code() as i32 == 14 => {
            let m = s.message();
            m.contains("tcp connect error")
                || m.contains("error trying to connect")
                || m.contains("Connection refused")
                || m.contains("dns error")
        }
        _ => false,
    }
}

/// The record in `kv`, or `Corrupt` naming the key and the data's `mod_revision`.
pub(crate) fn decode_kv(key: &LeaseKey, kv: &KeyValue) -> Result<Versioned> {
    let version = Version::from(kv.mod_revision());
    let record = codec::decode(key, kv.value(), Some(&version))?;
    Ok(Versioned { record, version })
}

impl fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdStore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl LeaseStore for EtcdStore {
    fn name(&self) -> &'static str {
        STORE
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::WATCH
            .with_commit_tokens()
            .with_operation_timeout(self.timeout)
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Versioned>> {
        let resp = self
            .bounded("get", || {
                let (mut kv, k) = (self.client.kv_client(), self.etcd_key(key));
                async move { kv.get(k, None).await }
            })
            .await?;
        match resp.kvs().first() {
            None => Ok(None),
            Some(kv) => decode_kv(key, kv).map(Some),
        }
    }

    async fn create(&self, key: &LeaseKey, record: &LeaseRecord) -> Result<Version> {
        let version = self.put_new("create", key, codec::encode(record)).await?;
        self.note_write(key, record.transitions, None, &version);
        Ok(version)
    }

    async fn update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> Result<Version> {
        let version = self
            .put_over("update", key, expected, codec::encode(record))
            .await?;
        self.note_write(key, record.transitions, Some(expected), &version);
        Ok(version)
    }

    /// The same transactions as `create` and `update`, with the record written by
    /// [`codec::encode_acquisition`]: the fencing token is the `mod_revision` of this write, or
    /// the record's `transitions` (the caller's floor) when that is higher. etcd's revision only
    /// grows, also across deletes, so a write that commits late still gets a token above every
    /// revision committed before it. A floor above the revision is not remembered once the record
    /// is deleted (nothing stores it but the record), so a later create may get a lower token
    /// than a floor-raised one before the delete.
    async fn acquire(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: Option<&Version>,
    ) -> Result<Acquired> {
        let bytes = codec::encode_acquisition(record);
        let version = match expected {
            None => self.put_new("acquire", key, bytes).await?,
            Some(expected) => self.put_over("acquire", key, expected, bytes).await?,
        };
        let fencing_token =
            codec::token_at_version(record.transitions, &version).map_err(|reason| {
                Error::Store {
                    store: STORE,
                    message: format!("acquire: {reason}"),
                    retryable: false,
                    source: None,
                }
            })?;
        self.note_write(key, fencing_token, expected, &version);
        Ok(Acquired {
            version,
            fencing_token,
        })
    }

    async fn delete(&self, key: &LeaseKey, expected: &Version) -> Result<()> {
        let op = TxnOp::delete(self.etcd_key(key), None);
        let rev = self.cas("delete", key, expected, op).await?;
        self.note_delete(key, rev);
        Ok(())
    }

    async fn watch(&self, key: &LeaseKey, after: Option<&Version>) -> Result<WatchStream> {
        crate::watch::start(self.clone(), key.clone(), after.cloned()).await
    }

    /// etcd's cluster revision plus one, from the header of a linearizable read of `key`: the
    /// revision grows with every write to any key and never goes backwards, not across leader
    /// changes or member restarts either (it is part of the replicated state; only restoring
    /// a backup taken earlier or recreating the cluster resets it).
    async fn fencing_seed(&self, key: &LeaseKey) -> Result<u64> {
        // A count-only read: linearizable (etcd-client's default), no value transferred.
        let resp = self
            .bounded("fencing_seed", || {
                let (mut kv, k) = (self.client.kv_client(), self.etcd_key(key));
                async move { kv.get(k, Some(GetOptions::new().with_count_only())).await }
            })
            .await?;
        let rev = header_version("fencing_seed", resp.header())?;
        revision(&rev)
            .and_then(|r| u64::try_from(r).ok())
            .and_then(|r| r.checked_add(1))
            .ok_or_else(|| Error::Store {
                store: STORE,
                message: format!("fencing_seed: etcd answered with an unusable revision {rev}"),
                retryable: false,
                source: None,
            })
    }

    async fn list(&self, prefix: &KeyPrefix) -> Result<Vec<(LeaseKey, Versioned)>> {
        let range = format!("{}{}", self.prefix, prefix.as_str());
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Key, SortOrder::Ascend);
        let resp = self
            .bounded("list", || {
                let (mut kv, range, options) =
                    (self.client.kv_client(), range.clone(), options.clone());
                async move { kv.get(range, Some(options)).await }
            })
            .await?;
        let mut out = Vec::with_capacity(resp.kvs().len());
        for kv in resp.kvs() {
            let Some(name) = kv.key().strip_prefix(self.prefix.as_bytes()) else {
                continue;
            };
            let Ok(key) = std::str::from_utf8(name)
                .map_err(|_| ())
                .and_then(|s| LeaseKey::new(s).map_err(|_| ()))
            else {
                tracing::warn!(etcd_key = %String::from_utf8_lossy(kv.key()), "list: leaving out an etcd key that is not a valid lease key");
                continue;
            };
            match decode_kv(&key, kv) {
                Ok(v) => out.push((key, v)),
                Err(e) => {
                    tracing::warn!(key = %key, error = %e, "list: leaving out a key with corrupt data")
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

fn positive(operation: &'static str, rev: i64) -> Result<Version> {
    if rev > 0 {
        Ok(Version::from(rev))
    } else {
        Err(Error::Store {
            store: STORE,
            message: format!("{operation}: etcd answered without a response header revision"),
            retryable: true,
            source: None,
        })
    }
}

fn header_version(
    operation: &'static str,
    header: Option<&etcd_client::ResponseHeader>,
) -> Result<Version> {
    positive(operation, header.map(|h| h.revision()).unwrap_or_default())
}
