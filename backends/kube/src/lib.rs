//! A [`LeaseStore`] over Kubernetes `coordination.k8s.io/v1` Leases, interoperable with
//! client-go's `LeaseLock`.
//!
//! A Go controller using client-go's leader election and a leasehold
//! [`Elector`](https://docs.rs/leasehold) can contend for the same Lease: the record maps 1:1 onto
//! the Lease spec exactly as client-go writes it (see [`mapping`]), an empty holder is vacant, and
//! every change is a compare-and-swap on `metadata.resourceVersion`.
//!
//! ```no_run
//! # async fn demo() -> leasehold::Result<()> {
//! use leasehold::{LeaseKey, LeaseStore};
//! use leasehold_kube::{KubeConfig, KubeStore};
//!
//! // Kubeconfig or in-cluster service account, namespace from the environment.
//! let store = KubeStore::connect(KubeConfig::new()).await?;
//! let current = store.get(&LeaseKey::new("my-controller")?).await?;
//! # Ok(()) }
//! ```
//!
//! A complete program with two candidates and a leader task is the `kube` example
//! (`cargo run -p leasehold-kube --example kube`, against the current kubeconfig).
//!
//! # Operations
//!
//! | store operation | Kubernetes request | RBAC verb |
//! |---|---|---|
//! | `get` | `GET .../leases/{key}` | `get` |
//! | `create` | `POST .../leases` (labels from [`KubeConfig::with_label`]) | `create` |
//! | `update` | `PUT .../leases/{key}` carrying the expected `resourceVersion` and the Lease's `uid` (plus a `GET` first when the store has not seen that version, and after a 409) | `update` (and `get`) |
//! | `delete` | `DELETE .../leases/{key}` with a `resourceVersion` precondition | `delete` |
//! | `watch` | `GET .../leases?watch=1&fieldSelector=metadata.name={key}&allowWatchBookmarks=true&resourceVersion=…` (plus a `list` to start) | `watch`, `list` |
//! | `list` | `GET .../leases?limit=500`, page by page (`continue`), filtered by name prefix on the client | `list` |
//! | `fencing_seed` | none: the client's clock, see [`fencing_seed_at`] | |
//!
//! Errors: 409 `Conflict` → [`leasehold::Error::Conflict`]; 409 on create (`AlreadyExists`) →
//! [`leasehold::Error::AlreadyExists`]; 404 → `None` (get) or [`leasehold::Error::NotFound`];
//! 401 → [`leasehold::Error::Unauthenticated`]; 403 → [`leasehold::Error::PermissionDenied`]
//! naming the missing verb, resource and namespace; 422/400 → [`leasehold::Error::Invalid`] with
//! the server's message; 408/429/5xx and connection failures → retryable
//! [`leasehold::Error::Unavailable`]; a request that takes longer than
//! the operation timeout ([`KubeConfig::with_operation_timeout`]) → [`leasehold::Error::Timeout`]. A Lease whose spec is not
//! a lease record (a negative `leaseDurationSeconds`, a malformed time) →
//! [`leasehold::Error::Corrupt`] with the key and resourceVersion; a Lease without a spec reads
//! as vacant, as client-go reads it.
//!
//! # Updates never re-create a deleted Lease
//!
//! kube-apiserver lets a `PUT` to a missing Lease **create** it (the Lease strategy allows
//! create-on-update and ignores `resourceVersion` on that path). The only precondition that path
//! honours is a `metadata.uid` in the body. So `update` always sends the uid of the Lease as it
//! was at `expected`: from the object the store last saw at that version (every `get`, `create`,
//! `update`, `list` and watch event is remembered per key), or, when it has not seen that
//! version, from a `GET` it makes first (absent → [`leasehold::Error::NotFound`], another
//! version → [`leasehold::Error::Conflict`], without a `PUT`). A 409 on the `PUT` is followed by
//! a `GET`: the Lease is gone → `NotFound`; it exists (another version, or re-created with
//! another uid) → `Conflict`.
//!
//! # Retried writes
//!
//! kube-rs's default client retries requests answered with 429, 503 or 504, writes included,
//! and this store cannot switch that off on a client it is given. A write the server committed
//! before answering 504 is therefore replayed: a replayed `PUT` fails its resourceVersion
//! precondition and `update` returns `Conflict` although the store holds our record; a replayed
//! `POST` makes `create` return `AlreadyExists`. The elector handles both by reading the record
//! back and recognising its own write (holder, transitions and acquire time), as it does after
//! any failed write. Other users of the store must do the same.
//!
//! The minimal RBAC (a Role and RoleBinding in one namespace) ships in `deploy/rbac.yaml`; the
//! README says what fails without each verb. [`KubeStore::connect`] lists Leases once (at most
//! one), so a missing `list` verb, wrong credentials or an unreachable API server fail there.
//!
//! # k8s-openapi version
//!
//! This crate does not pick a k8s-openapi Kubernetes version feature; the application does, as
//! for any kube-rs library (for example `k8s-openapi = { version = "0.29", features = ["latest"] }`).
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
pub mod mapping;
mod watch;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams, Preconditions,
};
use leasehold::{
    Capabilities, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, Result, Version, Versioned,
    WatchStream,
};

pub use error::Error;
use error::{Ctx, Op, map_kube, timeout};

/// The store's name in errors and logs.
pub const STORE_NAME: &str = "kubernetes";

/// The default bound on one store operation.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(4);

/// The default bound on connecting to the API server, for the client
/// [`KubeStore::connect`] builds.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The default duration of one watch request.
pub const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(60);

/// Settings of a [`KubeStore`]: namespace, labels and timeouts. Not a kubeconfig: where the API
/// server is and how to authenticate come from the `kube::Client` (or, for
/// [`KubeStore::connect`], from the environment).
///
/// The `with_*` setters never fail; [`KubeStore::connect`] and [`KubeStore::new`] validate the
/// whole configuration.
///
/// ```
/// use std::time::Duration;
/// use leasehold_kube::KubeConfig;
/// let config = KubeConfig::new()
///     .with_namespace("kube-system")
///     .with_label("app.kubernetes.io/managed-by", "my-controller")
///     .with_operation_timeout(Duration::from_secs(2));
/// assert_eq!(config.namespace(), Some("kube-system"));
/// ```
#[derive(Clone, Debug)]
pub struct KubeConfig {
    namespace: Option<String>,
    labels: BTreeMap<String, String>,
    operation_timeout: Duration,
    connect_timeout: Duration,
    watch_timeout: Duration,
}

impl Default for KubeConfig {
    fn default() -> Self {
        KubeConfig {
            namespace: None,
            labels: BTreeMap::new(),
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            watch_timeout: DEFAULT_WATCH_TIMEOUT,
        }
    }
}

impl KubeConfig {
    /// The defaults: the client's namespace, no labels, a 4 s operation timeout, a 5 s connect
    /// timeout and 60 s watch requests.
    pub fn new() -> Self {
        Self::default()
    }

    /// The namespace the Leases live in (an RFC 1123 label). Without it the store takes the
    /// client's default namespace (the kubeconfig context's namespace, or the pod's namespace
    /// in a cluster).
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// Adds a label to put on Leases this store creates (k0s labels its controller leases this
    /// way).
    pub fn with_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// The bound on every store operation (default 4 s), all its requests included; a slower
    /// one fails with a retryable [`leasehold::Error::Timeout`]. The store reports it in its
    /// [`Capabilities`], and [`leasehold::Elector::spawn`] refuses a
    /// `renew_deadline` that is not longer. `list` bounds each page by it.
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// The bound on opening a connection to the API server (default 5 s), for the client
    /// [`KubeStore::connect`] and [`KubeStore::connect_with`] build. A client given to
    /// [`KubeStore::new`] keeps its own.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one watch request lasts before the store renews it (server-side
    /// `timeoutSeconds`, 1 s to 290 s, default 60 s). A watch that stays silent (not even a
    /// bookmark) for this long plus the operation timeout is considered dead and resumed.
    pub fn with_watch_timeout(mut self, timeout: Duration) -> Self {
        self.watch_timeout = timeout;
        self
    }

    /// The configured namespace, if any.
    pub fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref()
    }

    /// The labels put on created Leases.
    pub fn labels(&self) -> &BTreeMap<String, String> {
        &self.labels
    }

    /// The bound on one store operation.
    pub fn operation_timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// The bound on connecting to the API server.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The duration of one watch request.
    pub fn watch_timeout(&self) -> Duration {
        self.watch_timeout
    }

    fn validate(&self) -> std::result::Result<(), Error> {
        if self.operation_timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "the operation timeout must not be zero".into(),
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "the connect timeout must not be zero".into(),
            ));
        }
        if self.watch_timeout < Duration::from_secs(1)
            || self.watch_timeout > Duration::from_secs(290)
        {
            return Err(Error::InvalidConfig(format!(
                "the watch timeout must be between 1 s and 290 s, got {:?}",
                self.watch_timeout
            )));
        }
        if let Some(ns) = &self.namespace {
            validate_namespace(ns)?;
        }
        Ok(())
    }
}

/// Checks that `ns` is a Kubernetes namespace name (an RFC 1123 label) before it goes into a
/// request path.
fn validate_namespace(ns: &str) -> std::result::Result<(), Error> {
    let rule = if ns.is_empty() {
        Some("a namespace must not be empty")
    } else if ns.len() > 63 {
        Some("a namespace must be at most 63 characters long (an RFC 1123 label)")
    } else if !ns
        .bytes()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
    {
        Some(
            "a namespace may only contain lower-case letters a-z, digits 0-9 and '-' (an RFC 1123 label)",
        )
    } else if ns.starts_with('-') || ns.ends_with('-') {
        Some("a namespace must start and end with a lower-case letter or digit (an RFC 1123 label)")
    } else {
        None
    };
    match rule {
        Some(rule) => Err(Error::InvalidNamespace {
            namespace: ns.to_owned(),
            rule,
        }),
        None => Ok(()),
    }
}

/// A lease store over Kubernetes Leases in one namespace. Cheap to clone.
///
/// Its `Debug` output shows the namespace and settings, never credentials.
#[derive(Clone)]
pub struct KubeStore {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    api: Api<DynamicObject>,
    namespace: String,
    /// The API server's address, when the store built its client ([`KubeStore::connect`]);
    /// named in the message of every [`leasehold::Error::Unavailable`].
    server: Option<String>,
    labels: BTreeMap<String, String>,
    operation_timeout: Duration,
    watch_timeout: Duration,
    /// The last object seen per key, so that an update keeps the Lease's metadata (labels,
    /// annotations, owner references) and foreign spec fields, as client-go's get-then-update
    /// does.
    seen: Mutex<HashMap<LeaseKey, DynamicObject>>,
}

impl fmt::Debug for KubeStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeStore")
            .field("server", &self.inner.server)
            .field("namespace", &self.inner.namespace)
            .field("labels", &self.inner.labels)
            .field("operation_timeout", &self.inner.operation_timeout)
            .field("watch_timeout", &self.inner.watch_timeout)
            .finish_non_exhaustive()
    }
}

fn lease_resource() -> ApiResource {
    ApiResource::erase::<Lease>(&())
}

impl KubeStore {
    /// [`LeaseStore::update`] without the overall bound.
    async fn update_unbounded(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> Result<Version> {
        let inner = &self.inner;
        // The object at `expected`: seen before (get, list, watch, create, update), or read now.
        // Its uid goes into the PUT as a precondition.
        let base = match inner.seen_at(key, expected) {
            Some(obj) => obj,
            None => {
                let current = inner
                    .bounded(Op::Get, Some(key), None, inner.api.get_opt(key.as_str()))
                    .await?;
                let Some(obj) = current else {
                    inner.forget(key);
                    return Err(leasehold::Error::NotFound {
                        key: key.to_string(),
                    });
                };
                inner.remember(key, &obj);
                if mapping::object_version(&obj).as_ref() != Some(expected) {
                    return Err(leasehold::Error::Conflict {
                        key: key.to_string(),
                        expected: expected.clone(),
                    });
                }
                obj
            }
        };
        let obj = inner.object_for_update(key, record, expected, base)?;
        let params = PostParams::default();
        let put = inner.api.replace(key.as_str(), &params, &obj);
        let updated = match tokio::time::timeout(inner.operation_timeout, put).await {
            Err(_) => return Err(timeout(Op::Update, inner.operation_timeout)),
            Ok(Err(kube::Error::Api(status))) if status.code == 409 => {
                return Err(inner.conflict_or_not_found(key, expected).await);
            }
            Ok(Err(e)) => {
                return Err(map_kube(
                    e,
                    &inner.ctx(Op::Update, Some(key), Some(expected)),
                ));
            }
            Ok(Ok(updated)) => updated,
        };
        inner.remember(key, &updated);
        version_of(key, &updated)
    }

    /// A store using `client` (its credentials, TLS settings and connect timeout). It does not
    /// contact the API server; [`connect`](Self::connect) does.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when a setting is out of range; [`Error::InvalidNamespace`] when
    /// the namespace (configured, or the client's default) is not an RFC 1123 label.
    pub fn new(client: kube::Client, config: KubeConfig) -> std::result::Result<Self, Error> {
        Self::build(client, config, None)
    }

    fn build(
        client: kube::Client,
        config: KubeConfig,
        server: Option<String>,
    ) -> std::result::Result<Self, Error> {
        config.validate()?;
        let namespace = config
            .namespace
            .unwrap_or_else(|| client.default_namespace().to_owned());
        validate_namespace(&namespace)?;
        let api = Api::namespaced_with(client, &namespace, &lease_resource());
        Ok(KubeStore {
            inner: Arc::new(Inner {
                api,
                namespace,
                server,
                labels: config.labels,
                operation_timeout: config.operation_timeout,
                watch_timeout: config.watch_timeout,
                seen: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// Connects with a client from the environment, as `kube::Client::try_default` finds it
    /// (`KUBECONFIG` or `~/.kube/config` and its current context, or the pod's service account
    /// in a cluster), with the configured connect timeout, and checks that the API server
    /// answers: one list of at most one Lease in the namespace, bounded by the connect timeout
    /// plus the operation timeout. So an unreachable API server fails here naming its address,
    /// and missing RBAC fails with the [`leasehold::Error::PermissionDenied`] that names the
    /// verb, instead of leaving an elector without a leader.
    ///
    /// # Errors
    /// [`Error::Kubeconfig`] when no client configuration is found; [`Error::Client`] when no
    /// client can be built from it; [`Error::InvalidConfig`] and [`Error::InvalidNamespace`]
    /// for settings out of range; [`Error::Connect`] carrying
    /// [`leasehold::Error::Unavailable`] naming the API server when it cannot be reached,
    /// [`leasehold::Error::Unauthenticated`] or [`leasehold::Error::PermissionDenied`] when it
    /// refuses the credentials or the `list` verb on Leases.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future only abandons reading the configuration and the probe.
    pub async fn connect(config: KubeConfig) -> std::result::Result<Self, Error> {
        config.validate()?;
        let client_config = kube::Config::infer().await.map_err(Error::Kubeconfig)?;
        Self::connect_with(client_config, config).await
    }

    /// [`connect`](Self::connect) with this client configuration instead of the environment's
    /// (for example from `kube::Config::from_custom_kubeconfig`); the configured connect timeout
    /// replaces the one in `client_config`.
    ///
    /// # Errors
    /// As [`connect`](Self::connect), without [`Error::Kubeconfig`].
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future only abandons the probe.
    pub async fn connect_with(
        mut client_config: kube::Config,
        config: KubeConfig,
    ) -> std::result::Result<Self, Error> {
        config.validate()?;
        client_config.connect_timeout = Some(config.connect_timeout);
        let server = server_address(&client_config.cluster_url);
        let limit = config.connect_timeout + config.operation_timeout;
        let client = kube::Client::try_from(client_config).map_err(Error::Client)?;
        let store = Self::build(client, config, Some(server.clone()))?;
        let inner = &store.inner;
        let params = ListParams::default().limit(1);
        let probe = inner.api.list(&params);
        match tokio::time::timeout(limit, probe).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                return Err(Error::Connect(map_kube(
                    e,
                    &inner.ctx(Op::List, None, None),
                )));
            }
            Err(_) => {
                return Err(Error::Connect(leasehold::Error::Unavailable {
                    store: STORE_NAME,
                    message: format!(
                        "no answer from the Kubernetes API server at {server} within {limit:?} \
                         (check the server address in the kubeconfig and that it is reachable)"
                    ),
                    source: None,
                }));
            }
        }
        tracing::debug!(server = %server, namespace = %inner.namespace, "connected to the Kubernetes API server");
        Ok(store)
    }

    /// The namespace the store's Leases live in.
    pub fn namespace(&self) -> &str {
        &self.inner.namespace
    }
}

/// The API server's address for messages: scheme, host and port, never user information.
fn server_address(uri: &http::Uri) -> String {
    let scheme = uri.scheme_str().unwrap_or("https");
    let host = uri.host().unwrap_or("<no host>");
    match uri.port_u16() {
        Some(port) => format!("{scheme}://{host}:{port}"),
        None => format!("{scheme}://{host}"),
    }
}

impl Inner {
    fn ctx<'a>(
        &'a self,
        op: Op,
        key: Option<&'a LeaseKey>,
        expected: Option<&'a Version>,
    ) -> Ctx<'a> {
        Ctx {
            op,
            namespace: &self.namespace,
            server: self.server.as_deref(),
            key,
            expected,
        }
    }

    /// Runs one request bounded by the operation timeout.
    async fn bounded<T>(
        &self,
        op: Op,
        key: Option<&LeaseKey>,
        expected: Option<&Version>,
        fut: impl Future<Output = kube::Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.operation_timeout, fut).await {
            Err(_) => Err(timeout(op, self.operation_timeout)),
            Ok(Err(e)) => Err(map_kube(e, &self.ctx(op, key, expected))),
            Ok(Ok(v)) => Ok(v),
        }
    }

    fn seen(&self) -> MutexGuard<'_, HashMap<LeaseKey, DynamicObject>> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn remember(&self, key: &LeaseKey, obj: &DynamicObject) {
        self.seen().insert(key.clone(), obj.clone());
    }

    fn forget(&self, key: &LeaseKey) {
        self.seen().remove(key);
    }

    /// The last object seen for `key`, if it is at version `expected`.
    fn seen_at(&self, key: &LeaseKey, expected: &Version) -> Option<DynamicObject> {
        self.seen()
            .get(key)
            .filter(|o| mapping::object_version(o).as_ref() == Some(expected))
            .cloned()
    }

    /// The object to PUT: `base` (the Lease as stored at `expected`) with our spec fields
    /// replaced. It keeps `base`'s `metadata.uid`, which kube-apiserver treats as a precondition:
    /// a `PUT` to a Lease that no longer exists (or was re-created) fails with 409 instead of
    /// creating it.
    fn object_for_update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
        mut obj: DynamicObject,
    ) -> Result<DynamicObject> {
        let spec = serde_json::to_value(mapping::record_to_spec(record)?).map_err(|e| {
            leasehold::Error::Invalid {
                store: STORE_NAME,
                message: format!("cannot encode the Lease spec: {e}"),
            }
        })?;
        if obj.metadata.uid.as_deref().is_none_or(str::is_empty) {
            return Err(leasehold::Error::Store {
                store: STORE_NAME,
                message: format!(
                    "the API server served Lease {key} without a metadata.uid; refusing to update \
                     it without a uid precondition (the update could re-create a deleted Lease)"
                ),
                retryable: false,
                source: None,
            });
        }
        // Keep foreign spec fields (preferredHolder, strategy); replace ours.
        let mut merged = match obj.data.get("spec") {
            Some(serde_json::Value::Object(m)) => m.clone(),
            _ => serde_json::Map::new(),
        };
        if let serde_json::Value::Object(ours) = spec {
            for f in [
                "holderIdentity",
                "leaseDurationSeconds",
                "acquireTime",
                "renewTime",
                "leaseTransitions",
            ] {
                merged.remove(f);
            }
            merged.extend(ours);
        }
        obj.data = serde_json::json!({ "spec": merged });
        // The server fills these in itself; sending stale ones is pointless.
        obj.metadata.managed_fields = None;
        obj.metadata.resource_version = Some(expected.as_str().to_owned());
        Ok(obj)
    }

    /// After a 409 on a `PUT`: [`NotFound`](leasehold::Error::NotFound) when the Lease is gone
    /// (the uid precondition failed on a missing object), otherwise
    /// [`Conflict`](leasehold::Error::Conflict).
    async fn conflict_or_not_found(&self, key: &LeaseKey, expected: &Version) -> leasehold::Error {
        let current = self
            .bounded(Op::Get, Some(key), None, self.api.get_opt(key.as_str()))
            .await;
        match current {
            Err(e) => e,
            Ok(None) => {
                self.forget(key);
                leasehold::Error::NotFound {
                    key: key.to_string(),
                }
            }
            Ok(Some(obj)) => {
                self.remember(key, &obj);
                leasehold::Error::Conflict {
                    key: key.to_string(),
                    expected: expected.clone(),
                }
            }
        }
    }

    /// One paged list of every Lease under `prefix`, sorted by key.
    async fn list_pages(
        &self,
        prefix: &KeyPrefix,
    ) -> std::result::Result<Vec<(LeaseKey, Versioned)>, ListError> {
        let mut out = Vec::new();
        let mut continue_token: Option<String> = None;
        // Bounded: at most 1000 pages.
        for _ in 0..1000 {
            let mut params = ListParams::default().limit(LIST_PAGE_SIZE);
            let continued = continue_token.is_some();
            if let Some(token) = continue_token.take() {
                params = params.continue_token(&token);
            }
            let page = match tokio::time::timeout(self.operation_timeout, self.api.list(&params))
                .await
            {
                Err(_) => return Err(ListError::Other(timeout(Op::List, self.operation_timeout))),
                Ok(Err(kube::Error::Api(status))) if continued && status.code == 410 => {
                    let e = error::map_status(&status, &self.ctx(Op::List, None, None));
                    return Err(ListError::ContinueExpired(e));
                }
                Ok(Err(e)) => {
                    return Err(ListError::Other(map_kube(
                        e,
                        &self.ctx(Op::List, None, None),
                    )));
                }
                Ok(Ok(page)) => page,
            };
            for obj in &page.items {
                let Some(name) = obj.metadata.name.as_deref() else {
                    continue;
                };
                if !name.starts_with(prefix.as_str()) {
                    continue;
                }
                let Ok(key) = LeaseKey::new(name) else {
                    tracing::warn!(
                        name,
                        "list: leaving out a Lease whose name is not a lease key"
                    );
                    continue;
                };
                match mapping::object_to_versioned(&key, obj) {
                    Ok(v) => {
                        self.remember(&key, obj);
                        out.push((key, v));
                    }
                    Err(e) => {
                        tracing::warn!(key = %key, error = %e, "list: leaving out a Lease that is not a lease record");
                    }
                }
            }
            match page.metadata.continue_.filter(|t| !t.is_empty()) {
                Some(token) => continue_token = Some(token),
                None => break,
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    fn new_object(&self, key: &LeaseKey, spec: serde_json::Value) -> DynamicObject {
        let mut obj = DynamicObject::new(key.as_str(), &lease_resource())
            .within(&self.namespace)
            .data(serde_json::json!({ "spec": spec }));
        if !self.labels.is_empty() {
            obj.metadata.labels = Some(self.labels.clone());
        }
        obj
    }
}

/// Leases per list page (`limit`); the server may return fewer.
const LIST_PAGE_SIZE: u32 = 500;

/// How often `list` starts over after the server expired its continue token.
const MAX_LIST_RESTARTS: u32 = 3;

enum ListError {
    /// 410 on a continued page: the list can start over.
    ContinueExpired(leasehold::Error),
    Other(leasehold::Error),
}

/// 2020-01-01T00:00:00Z in seconds since the Unix epoch: the origin of [`fencing_seed_at`].
pub const FENCING_EPOCH_UNIX_SECS: u64 = 1_577_836_800;

/// The fencing-token seed [`KubeStore`] gives a fresh Lease when the clock reads `now`: whole
/// seconds since 2020-01-01T00:00:00Z ([`FENCING_EPOCH_UNIX_SECS`]), at least 1.
///
/// It fits `spec.leaseTransitions` (int32) until January 2088; after that, creating a Lease
/// fails with [`leasehold::Error::Invalid`]. A clock before 2020 gives 1. It never panics.
///
/// What it guarantees, and no more: a fresh record starts above any token that a record begun
/// at 0 (as client-go begins one) could plausibly have reached, and above any token of an
/// earlier record of the same key unless that record averaged more than one acquisition per
/// second over its whole life before it was deleted, or the clocks of the writers disagree (a
/// client whose clock is behind can seed below an earlier record's tokens).
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use leasehold_kube::{FENCING_EPOCH_UNIX_SECS, fencing_seed_at};
/// let t = SystemTime::UNIX_EPOCH + Duration::from_secs(FENCING_EPOCH_UNIX_SECS + 90);
/// assert_eq!(fencing_seed_at(t), 90);
/// assert_eq!(fencing_seed_at(SystemTime::UNIX_EPOCH), 1);
/// ```
pub fn fencing_seed_at(now: SystemTime) -> u64 {
    now.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs().saturating_sub(FENCING_EPOCH_UNIX_SECS))
        .unwrap_or(0)
        .max(1)
}

fn version_of(key: &LeaseKey, obj: &DynamicObject) -> Result<Version> {
    mapping::object_version(obj).ok_or_else(|| leasehold::Error::Store {
        store: STORE_NAME,
        message: format!("the API server answered for Lease {key} without a resourceVersion"),
        retryable: false,
        source: None,
    })
}

#[async_trait]
impl LeaseStore for KubeStore {
    fn name(&self) -> &'static str {
        STORE_NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::WATCH.with_operation_timeout(self.inner.operation_timeout)
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Versioned>> {
        let inner = &self.inner;
        let obj = inner
            .bounded(Op::Get, Some(key), None, inner.api.get_opt(key.as_str()))
            .await?;
        match obj {
            None => {
                inner.forget(key);
                Ok(None)
            }
            Some(obj) => {
                inner.remember(key, &obj);
                mapping::object_to_versioned(key, &obj).map(Some)
            }
        }
    }

    async fn create(&self, key: &LeaseKey, record: &LeaseRecord) -> Result<Version> {
        let inner = &self.inner;
        let spec = serde_json::to_value(mapping::record_to_spec(record)?).map_err(|e| {
            leasehold::Error::Invalid {
                store: STORE_NAME,
                message: format!("cannot encode the Lease spec: {e}"),
            }
        })?;
        let obj = inner.new_object(key, spec);
        let created = inner
            .bounded(
                Op::Create,
                Some(key),
                None,
                inner.api.create(&PostParams::default(), &obj),
            )
            .await?;
        inner.remember(key, &created);
        version_of(key, &created)
    }

    /// Bounded as a whole by the operation timeout (a `GET` first, the `PUT`, a `GET` after a
    /// 409).
    async fn update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> Result<Version> {
        let limit = self.inner.operation_timeout;
        tokio::time::timeout(limit, self.update_unbounded(key, record, expected))
            .await
            .unwrap_or_else(|_| Err(timeout(Op::Update, limit)))
    }

    async fn delete(&self, key: &LeaseKey, expected: &Version) -> Result<()> {
        let inner = &self.inner;
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: Some(expected.as_str().to_owned()),
                uid: None,
            }),
            ..DeleteParams::default()
        };
        inner
            .bounded(
                Op::Delete,
                Some(key),
                Some(expected),
                inner.api.delete(key.as_str(), &params),
            )
            .await?;
        inner.forget(key);
        Ok(())
    }

    /// The client's wall clock in whole seconds since 2020-01-01T00:00:00Z, at least 1 (see
    /// [`fencing_seed_at`]). Kubernetes offers no monotonic counter to a client.
    async fn fencing_seed(&self, key: &LeaseKey) -> Result<u64> {
        let _ = key;
        Ok(fencing_seed_at(SystemTime::now()))
    }

    async fn watch(&self, key: &LeaseKey, after: Option<&Version>) -> Result<WatchStream> {
        watch::start(self.inner.clone(), key.clone(), after.cloned()).await
    }

    async fn list(&self, prefix: &KeyPrefix) -> Result<Vec<(LeaseKey, Versioned)>> {
        // A continue token the server has expired (410: its resourceVersion was compacted
        // between pages) restarts the list from the beginning, at most a few times.
        let mut restarts = 0;
        loop {
            match self.inner.list_pages(prefix).await {
                Err(ListError::ContinueExpired(e)) if restarts < MAX_LIST_RESTARTS => {
                    tracing::debug!(error = %e, "list: continue token expired; listing again");
                    restarts += 1;
                }
                Err(ListError::ContinueExpired(e) | ListError::Other(e)) => return Err(e),
                Ok(out) => return Ok(out),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(unix_secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(unix_secs)
    }

    #[test]
    fn fencing_seed_counts_seconds_since_2020_and_is_at_least_one() {
        assert_eq!(fencing_seed_at(at(FENCING_EPOCH_UNIX_SECS)), 1);
        assert_eq!(fencing_seed_at(at(FENCING_EPOCH_UNIX_SECS + 1)), 1);
        assert_eq!(fencing_seed_at(at(FENCING_EPOCH_UNIX_SECS + 2)), 2);
        // 2026-01-01T00:00:00Z
        assert_eq!(fencing_seed_at(at(1_767_225_600)), 189_388_800);
        // A clock before 2020, or before 1970, gives 1 and never panics.
        assert_eq!(fencing_seed_at(at(1_000)), 1);
        assert_eq!(fencing_seed_at(SystemTime::UNIX_EPOCH), 1);
        assert_eq!(
            fencing_seed_at(SystemTime::UNIX_EPOCH - Duration::from_secs(86_400)),
            1
        );
        // Fits spec.leaseTransitions (int32) until 2088-01-19.
        let last_fitting = FENCING_EPOCH_UNIX_SECS + u64::try_from(i32::MAX).expect("fits");
        assert_eq!(fencing_seed_at(at(last_fitting)), 2_147_483_647);
        assert!(fencing_seed_at(at(last_fitting + 1)) > 2_147_483_647);
    }

    #[test]
    fn fencing_seed_never_decreases_with_the_clock() {
        let mut last = 0;
        for secs in (0..4_000_000_000u64).step_by(50_000_000) {
            let seed = fencing_seed_at(at(secs));
            assert!(seed >= last && seed >= 1);
            last = seed;
        }
    }

    #[test]
    fn the_default_operation_timeout_is_below_the_default_renew_deadline() {
        let key = leasehold::LeaseKey::new("k").expect("valid key");
        let elector = leasehold::ElectorConfig::new(key, "id");
        assert!(DEFAULT_OPERATION_TIMEOUT < elector.renew_deadline);
    }
}

/// The README's code blocks, compiled as doctests (not part of the API).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
