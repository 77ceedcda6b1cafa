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
//! use leasehold_kube::{KubeStore, KubeStoreConfig};
//!
//! // Kubeconfig or in-cluster service account, namespace from the environment.
//! let store = KubeStore::from_env(KubeStoreConfig::default()).await?;
//! let current = store.get(&LeaseKey::new("my-controller")?).await?;
//! # Ok(()) }
//! ```
//!
//! # Operations
//!
//! | store operation | Kubernetes request | RBAC verb |
//! |---|---|---|
//! | `get` | `GET .../leases/{key}` | `get` |
//! | `create` | `POST .../leases` (labels from [`KubeStoreConfig::labels`]) | `create` |
//! | `update` | `PUT .../leases/{key}` carrying the expected `resourceVersion` | `update` |
//! | `delete` | `DELETE .../leases/{key}` with a `resourceVersion` precondition | `delete` |
//! | `watch` | `GET .../leases?watch=1&fieldSelector=metadata.name={key}&allowWatchBookmarks=true&resourceVersion=…` (plus a `list` to start) | `watch`, `list` |
//! | `list` | `GET .../leases`, filtered by name prefix on the client | `list` |
//!
//! Errors: 409 `Conflict` → [`leasehold::Error::Conflict`]; 409 on create (`AlreadyExists`) →
//! [`leasehold::Error::AlreadyExists`]; 404 → `None` (get) or [`leasehold::Error::NotFound`];
//! 401 → [`leasehold::Error::Unauthenticated`]; 403 → [`leasehold::Error::PermissionDenied`]
//! naming the missing verb, resource and namespace; 422/400 → [`leasehold::Error::Invalid`] with
//! the server's message; 408/429/5xx and connection failures → retryable
//! [`leasehold::Error::Unavailable`]; a request that takes longer than
//! [`KubeStoreConfig::request_timeout`] → [`leasehold::Error::Timeout`]. A Lease whose spec is not
//! a lease record (a negative `leaseDurationSeconds`, a malformed time, no spec) →
//! [`leasehold::Error::Corrupt`] with the key and resourceVersion.
//!
//! The minimal RBAC (a Role and RoleBinding in one namespace) ships in `deploy/rbac.yaml`; the
//! README says what fails without each verb.
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
use std::time::Duration;

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

/// Settings of a [`KubeStore`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct KubeStoreConfig {
    /// The namespace the Leases live in; `None` takes the client's default namespace (the
    /// kubeconfig context's namespace, or the pod's namespace in a cluster).
    pub namespace: Option<String>,
    /// Labels put on Leases this store creates (k0s labels its controller leases this way).
    pub labels: BTreeMap<String, String>,
    /// The bound on every request (default 4 s). Keep it below the elector's renew deadline so a
    /// hung API server turns into a retryable [`leasehold::Error::Timeout`] in time.
    pub request_timeout: Duration,
    /// How long one watch request lasts before the store renews it (server-side
    /// `timeoutSeconds`, 1 s to 290 s, default 60 s). A watch that stays silent (not even a bookmark) for this
    /// long plus [`request_timeout`](Self::request_timeout) is considered dead and resumed.
    pub watch_timeout: Duration,
}

impl Default for KubeStoreConfig {
    fn default() -> Self {
        KubeStoreConfig {
            namespace: None,
            labels: BTreeMap::new(),
            request_timeout: Duration::from_secs(4),
            watch_timeout: Duration::from_secs(60),
        }
    }
}

impl KubeStoreConfig {
    /// Sets the namespace.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// Adds a label to put on created Leases.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Sets the per-request timeout.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets the watch request duration.
    pub fn watch_timeout(mut self, timeout: Duration) -> Self {
        self.watch_timeout = timeout;
        self
    }

    fn validate(&self) -> std::result::Result<(), Error> {
        if self.request_timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "request_timeout must be positive".into(),
            ));
        }
        if self.watch_timeout < Duration::from_secs(1)
            || self.watch_timeout > Duration::from_secs(290)
        {
            return Err(Error::InvalidConfig(format!(
                "watch_timeout must be between 1 s and 290 s, got {:?}",
                self.watch_timeout
            )));
        }
        if let Some(ns) = &self.namespace
            && ns.is_empty()
        {
            return Err(Error::InvalidConfig("namespace must not be empty".into()));
        }
        Ok(())
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
    labels: BTreeMap<String, String>,
    request_timeout: Duration,
    watch_timeout: Duration,
    /// The last object seen per key, so that an update keeps the Lease's metadata (labels,
    /// annotations, owner references) and foreign spec fields, as client-go's get-then-update
    /// does.
    seen: Mutex<HashMap<LeaseKey, DynamicObject>>,
}

impl fmt::Debug for KubeStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeStore")
            .field("namespace", &self.inner.namespace)
            .field("labels", &self.inner.labels)
            .field("request_timeout", &self.inner.request_timeout)
            .field("watch_timeout", &self.inner.watch_timeout)
            .finish_non_exhaustive()
    }
}

fn lease_resource() -> ApiResource {
    ApiResource::erase::<Lease>(&())
}

impl KubeStore {
    /// A store using `client` (its credentials and TLS settings).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when a setting is out of range.
    pub fn new(client: kube::Client, config: KubeStoreConfig) -> std::result::Result<Self, Error> {
        config.validate()?;
        let namespace = config
            .namespace
            .unwrap_or_else(|| client.default_namespace().to_owned());
        let api = Api::namespaced_with(client, &namespace, &lease_resource());
        Ok(KubeStore {
            inner: Arc::new(Inner {
                api,
                namespace,
                labels: config.labels,
                request_timeout: config.request_timeout,
                watch_timeout: config.watch_timeout,
                seen: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// A store with a client from the environment (`KUBECONFIG`/`~/.kube/config`, or the pod's
    /// service account in a cluster), as `kube::Client::try_default` finds it.
    ///
    /// # Errors
    /// [`Error::Client`] when no configuration is found; [`Error::InvalidConfig`].
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads configuration.
    pub async fn from_env(config: KubeStoreConfig) -> std::result::Result<Self, Error> {
        config.validate()?;
        let client = kube::Client::try_default().await.map_err(Error::Client)?;
        Self::new(client, config)
    }

    /// The namespace the store's Leases live in.
    pub fn namespace(&self) -> &str {
        &self.inner.namespace
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
            key,
            expected,
        }
    }

    /// Runs one request bounded by the request timeout.
    async fn bounded<T>(
        &self,
        op: Op,
        key: Option<&LeaseKey>,
        expected: Option<&Version>,
        fut: impl Future<Output = kube::Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.request_timeout, fut).await {
            Err(_) => Err(timeout(op, self.request_timeout)),
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

    /// The object to PUT: the last one seen at `expected` with its spec replaced, or a fresh one.
    fn object_for_update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> Result<DynamicObject> {
        let spec = serde_json::to_value(mapping::record_to_spec(record)?).map_err(|e| {
            leasehold::Error::Invalid {
                store: STORE_NAME,
                message: format!("cannot encode the Lease spec: {e}"),
            }
        })?;
        let cached = self
            .seen()
            .get(key)
            .filter(|o| mapping::object_version(o).as_ref() == Some(expected))
            .cloned();
        let mut obj = match cached {
            Some(mut obj) => {
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
                obj
            }
            None => self.new_object(key, spec),
        };
        obj.metadata.resource_version = Some(expected.as_str().to_owned());
        Ok(obj)
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
        Capabilities::WATCH
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

    async fn update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> Result<Version> {
        let inner = &self.inner;
        let obj = inner.object_for_update(key, record, expected)?;
        let updated = inner
            .bounded(
                Op::Update,
                Some(key),
                Some(expected),
                inner
                    .api
                    .replace(key.as_str(), &PostParams::default(), &obj),
            )
            .await?;
        inner.remember(key, &updated);
        version_of(key, &updated)
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

    async fn watch(&self, key: &LeaseKey, after: Option<&Version>) -> Result<WatchStream> {
        watch::start(self.inner.clone(), key.clone(), after.cloned()).await
    }

    async fn list(&self, prefix: &KeyPrefix) -> Result<Vec<(LeaseKey, Versioned)>> {
        let inner = &self.inner;
        let mut out = Vec::new();
        let mut continue_token: Option<String> = None;
        // Bounded: at most 1000 pages of 500 Leases.
        for _ in 0..1000 {
            let mut params = ListParams::default().limit(500);
            if let Some(token) = continue_token.take() {
                params = params.continue_token(&token);
            }
            let page = inner
                .bounded(Op::List, None, None, inner.api.list(&params))
                .await?;
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
                        inner.remember(&key, obj);
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
}
