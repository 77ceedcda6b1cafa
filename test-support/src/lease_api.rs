//! A Lease API server that behaves like kube-apiserver for `coordination.k8s.io/v1` Leases, for
//! tests. It listens on a free loopback port and a real `kube::Client` talks to it.
//!
//! # What it serves
//!
//! `/apis/coordination.k8s.io/v1/namespaces/{ns}/leases` and `.../leases/{name}`:
//! - `GET` (one Lease), `GET` collection (list; `fieldSelector=metadata.name=…` and equality
//!   `labelSelector`s), `GET ?watch=1` (watch), `POST` (create, 201), `PUT` (replace), `DELETE`
//!   (with `preconditions`, answered with a success `Status` carrying the uid, as the generic
//!   registry answers for Leases).
//! - `PUT` as the generic registry does it for Leases: a `metadata.uid` in the body is a
//!   precondition, checked first (409 `Precondition failed: UID in precondition: …, UID in object
//!   meta: …`, also when the Lease does not exist); a missing Lease is **created** (201; the
//!   Lease strategy allows create-on-update, `resourceVersion` is ignored on that path, and the
//!   user needs the `create` verb as well); an existing Lease needs `metadata.resourceVersion`
//!   (422 `metadata.resourceVersion: Invalid value: 0x0: must be specified for an update`) and
//!   it must match (409 Conflict).
//! - Metadata kept on create and update: labels, annotations, `ownerReferences`, `finalizers`
//!   (each dropped when the client omits it, as a PUT replaces the object).
//! - Lease validation as `ValidateLeaseSpec`: `leaseDurationSeconds > 0`, `leaseTransitions >=
//!   0`, `strategy` either `OldestEmulationVersion` or a qualified `prefix/name`,
//!   `preferredHolder` only with a `strategy` (several errors in one `[…]` message). The server
//!   acts as a cluster with the `CoordinatedLeaderElection` feature gate on (the fields are kept).
//! - `MicroTime`s (`acquireTime`, `renewTime`) decode only from Go's `RFC3339Micro`
//!   (`2006-01-02T15:04:05.000000Z07:00`: exactly six fractional digits; `null` is the zero
//!   time); anything else is 400 BadRequest, as Go's decoder rejects it. Stored in UTC.
//! - One store-wide resourceVersion counter that increases by one on every write, as etcd's
//!   revision does; a write that changes nothing (an identical `PUT`) keeps the resourceVersion,
//!   as kube-apiserver does.
//! - List paging: `limit` (optionally capped by [`ServerOptions::max_page_size`], as a server may
//!   return fewer), a `continue` token and `remainingItemCount`; continued pages carry the first
//!   page's resourceVersion; a token older than the compacted history is 410 `Expired` with
//!   kube-apiserver's message.
//! - Watches stream newline-separated JSON events (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`,
//!   `ERROR`) over a chunked response. `resourceVersion=""`/`"0"` starts with synthetic `ADDED`
//!   events for the current objects; `resourceVersion=N` replays every event after `N` from a
//!   bounded history and answers an `ERROR` event with a `410 Expired` Status (`too old resource
//!   version: N (M)`) when `N` is older than the history. A resourceVersion newer than the
//!   server's waits up to [`ServerOptions::too_large_rv_wait`] (3 s, as the watch cache) and then
//!   fails with 504 `Too large resource version: N, current: M`. `allowWatchBookmarks=true` gets
//!   a `BOOKMARK` every [`ServerOptions::bookmark_interval`] (60 s by default, about
//!   kube-apiserver's cadence) and one when the server ends the watch at `timeoutSeconds`.
//! - Status bodies with kube-apiserver's wording (apimachinery `errors.go`): 409 `Conflict`
//!   (`Operation cannot be fulfilled on leases.coordination.k8s.io "x": the object has been
//!   modified; please apply your changes to the latest version and try again`), 409
//!   `AlreadyExists` (`leases.coordination.k8s.io "x" already exists`), 404 `NotFound`
//!   (`leases.coordination.k8s.io "x" not found`), 422 `Invalid` for names that are not
//!   lower-case RFC 1123 subdomains and for invalid specs, 401 `Unauthorized` for a missing or
//!   unknown bearer token, 403 `Forbidden` (`leases.coordination.k8s.io "x" is forbidden: User
//!   "u" cannot update resource "leases" in API group "coordination.k8s.io" in the namespace
//!   "ns"`) when the token's user lacks the verb.
//!
//! # Fault controls
//! [`LeaseApiServer::fail_next`] (answer the next N requests with an error Status: 500, 503,
//! 504 Timeout, or 429 TooManyRequests with `Retry-After: 1`),
//! [`LeaseApiServer::fail_after_commit_next`] (commit the next N writes, then answer 504),
//! [`LeaseApiServer::expire_next_continue`] (410 for the next N continued lists),
//! [`LeaseApiServer::drop_next`] (close the connection of the next N requests without an
//! answer), [`LeaseApiServer::set_delay`] (delay every answer), [`LeaseApiServer::drop_connections`]
//! (close every open connection, watches included), [`LeaseApiServer::compact`] (forget the
//! event history, so older watch resourceVersions and continue tokens are Gone),
//! [`LeaseApiServer::put_raw`] (store a Lease without validation, as a foreign writer with etcd
//! access could).
//!
//! # What it does not emulate
//! - TLS, client certificates, and any authentication other than static bearer tokens; RBAC is
//!   a per-token verb set on `leases` (no Roles, no resourceNames, no namespaces scoping). The
//!   403 for a create-on-update names the `create` verb in the filter's wording; the real
//!   server words it with the authorizer's reason.
//! - Other resources, API discovery, `PATCH` (405), server-side apply, `managedFields`,
//!   `generateName`, `dryRun`, graceful deletion and deletion blocked by finalizers (a
//!   `DELETE` removes the Lease at once whatever its finalizers), owner-reference garbage
//!   collection, `fieldValidation`, protobuf, admission.
//! - Consistent list snapshots: a continued page shows the current Leases after the token's
//!   last name, not the state at the first page's resourceVersion. `resourceVersionMatch`,
//!   `sendInitialEvents`, reads from a cache at an older resourceVersion, set-based label
//!   selectors and field selectors other than `metadata.name`.
//! - The order of checks only approximates the registry's (uid precondition, then
//!   resourceVersion, then validation).
//! - Unknown spec fields are dropped (as kube-apiserver prunes them) and times are
//!   re-serialized in `MicroTime` form.
//! - HTTP/2, request priority and fairness (429 only by injection), slow-watcher termination,
//!   and the apiserver's own timeouts (504 only by injection or for too-large resourceVersions).
// Error answers are whole HTTP responses.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::coordination::v1::LeaseSpec;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

/// The token every test client uses unless it asks for another.
pub const ADMIN_TOKEN: &str = "leasehold-test-admin-token";
const GROUP: &str = "coordination.k8s.io";
const RESOURCE: &str = "leases";
const QUALIFIED: &str = "leases.coordination.k8s.io";
const PREFIX: &str = "/apis/coordination.k8s.io/v1/namespaces/";
const RFC1123_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";

type Body = BoxBody<Bytes, Infallible>;

/// Options for [`LeaseApiServer::start_with`].
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// How many events the watch history keeps (kube-apiserver's watch cache keeps a bounded
    /// window too).
    pub history: usize,
    /// How often a bookmark-enabled watch gets a BOOKMARK.
    pub bookmark_interval: Duration,
    /// Answer a watch from an expired resourceVersion with an HTTP 410 Status instead of
    /// kube-apiserver's usual 200 response carrying an `ERROR` event (some servers and
    /// proxies do this).
    pub expired_as_http_410: bool,
    /// The most Leases one list page holds, whatever the client's `limit` (the API lets a
    /// server return fewer than `limit`); `None`: exactly `limit`.
    pub max_page_size: Option<usize>,
    /// How long a watch from a resourceVersion newer than the server's waits for it before
    /// failing with 504 "Too large resource version" (kube-apiserver's watch cache waits 3 s).
    pub too_large_rv_wait: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            history: 1000,
            // kube-apiserver's watch cache sends a bookmark about once a minute (and one just
            // before the watch's timeout).
            bookmark_interval: Duration::from_secs(60),
            expired_as_http_410: false,
            max_page_size: None,
            too_large_rv_wait: Duration::from_secs(3),
        }
    }
}

struct Principal {
    user: String,
    /// `None`: every verb.
    verbs: Option<HashSet<String>>,
}

struct HistEvent {
    rv: u64,
    ns: String,
    name: String,
    kind: &'static str,
    object: Value,
}

struct Watcher {
    id: u64,
    ns: String,
    name: Option<String>,
    tx: mpsc::UnboundedSender<Bytes>,
}

#[derive(Default)]
struct State {
    rv: u64,
    /// Every event with a resourceVersion above this one is still in `history`.
    floor: u64,
    objects: BTreeMap<(String, String), Value>,
    history: VecDeque<HistEvent>,
    watchers: Vec<Watcher>,
    next_id: u64,
}

struct Shared {
    opts: ServerOptions,
    state: Mutex<State>,
    tokens: Mutex<HashMap<String, Principal>>,
    fail_next: AtomicU32,
    fail_code: AtomicU32,
    fail_after_commit_next: AtomicU32,
    expire_continue_next: AtomicU32,
    drop_next: AtomicU32,
    delay_ms: AtomicU64,
    requests: AtomicU64,
    kill: watch::Sender<u64>,
}

/// The running test server; stops (and closes every connection) when dropped.
pub struct LeaseApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for LeaseApiServer {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.kill.send_modify(|g| *g += 1);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl LeaseApiServer {
    /// Starts a server with default options on a free loopback port.
    pub async fn start() -> Self {
        Self::start_with(ServerOptions::default()).await
    }

    /// Starts a server with `opts`.
    pub async fn start_with(opts: ServerOptions) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port for the Lease API server");
        let addr = listener.local_addr().expect("local address");
        let (kill, _) = watch::channel(0u64);
        let mut tokens = HashMap::new();
        tokens.insert(
            ADMIN_TOKEN.to_owned(),
            Principal {
                user: "leasehold-admin".into(),
                verbs: None,
            },
        );
        let shared = Arc::new(Shared {
            opts,
            state: Mutex::new(State::default()),
            tokens: Mutex::new(tokens),
            fail_next: AtomicU32::new(0),
            fail_code: AtomicU32::new(503),
            fail_after_commit_next: AtomicU32::new(0),
            expire_continue_next: AtomicU32::new(0),
            drop_next: AtomicU32::new(0),
            delay_ms: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            kill,
        });
        let s = shared.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                // As kube-apiserver (Go's net/http) does: no Nagle delay on small writes such as
                // watch events.
                let _ = tcp.set_nodelay(true);
                let s = s.clone();
                let mut kill = s.kill.subscribe();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(s.clone(), req));
                    let conn = http1::Builder::new().serve_connection(TokioIo::new(tcp), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = kill.changed() => {}
                    }
                });
            }
        });
        LeaseApiServer {
            addr,
            shared,
            accept,
        }
    }

    /// The base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client for this server with `token` (None: no credentials) and default namespace
    /// `default`.
    pub fn client_with_token(&self, token: Option<&str>) -> kube::Client {
        kube::Client::try_from(self.client_config(token)).expect("kube client for the test server")
    }

    /// A kube client configuration for this server with `token` (None: no credentials) and
    /// default namespace `default`.
    pub fn client_config(&self, token: Option<&str>) -> kube::Config {
        let mut config = kube::Config::new(self.url().parse().expect("server URL"));
        config.default_namespace = "default".into();
        config.connect_timeout = Some(Duration::from_secs(5));
        if let Some(t) = token {
            config.auth_info.token = Some(t.to_owned().into());
        }
        config
    }

    /// A kubeconfig file (YAML) pointing at this server with the admin token, its context's
    /// namespace [`NAMESPACE`].
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n\
             users:\n- name: admin\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context:\n    \
             cluster: test\n    user: admin\n    namespace: {ns}\ncurrent-context: test\n",
            url = self.url(),
            token = ADMIN_TOKEN,
            ns = NAMESPACE,
        )
    }

    /// A kube client with the admin token.
    pub fn client(&self) -> kube::Client {
        self.client_with_token(Some(ADMIN_TOKEN))
    }

    /// A kube client with the admin token and without kube-rs's retry of 429/503/504, to see
    /// the server's first answer.
    pub fn client_without_retry(&self) -> kube::Client {
        let mut config = kube::Config::new(self.url().parse().expect("server URL"));
        config.default_namespace = "default".into();
        config.default_retry = false;
        config.auth_info.token = Some(ADMIN_TOKEN.to_owned().into());
        kube::Client::try_from(config).expect("kube client for the test server")
    }

    /// Adds a token whose user may use only `verbs` on leases.
    pub fn add_token(&self, token: &str, user: &str, verbs: &[&str]) {
        lock(&self.shared.tokens).insert(
            token.to_owned(),
            Principal {
                user: user.to_owned(),
                verbs: Some(verbs.iter().map(|v| (*v).to_owned()).collect()),
            },
        );
    }

    /// Answers the next `n` requests with a Status of HTTP `code`, in kube-apiserver's wording:
    /// 500 InternalError, 504 Timeout, 429 TooManyRequests (with `Retry-After: 1`, as priority
    /// and fairness answers), anything else 503 ServiceUnavailable.
    pub fn fail_next(&self, n: u32, code: u16) {
        self.shared
            .fail_code
            .store(u32::from(code), Ordering::SeqCst);
        self.shared.fail_next.store(n, Ordering::SeqCst);
    }

    /// The next `n` writes (create, update, delete) are committed and then answered with 504
    /// Timeout, as kube-apiserver does when its request deadline passes after etcd accepted the
    /// write: the client cannot tell that the write happened.
    pub fn fail_after_commit_next(&self, n: u32) {
        self.shared
            .fail_after_commit_next
            .store(n, Ordering::SeqCst);
    }

    /// Answers the next `n` list requests that carry a `continue` token with 410 Expired, as
    /// when the token's resourceVersion is compacted between two pages.
    pub fn expire_next_continue(&self, n: u32) {
        self.shared.expire_continue_next.store(n, Ordering::SeqCst);
    }

    /// Closes the connection of the next `n` requests without answering.
    pub fn drop_next(&self, n: u32) {
        self.shared.drop_next.store(n, Ordering::SeqCst);
    }

    /// Delays every answer by `d` (zero: no delay).
    pub fn set_delay(&self, d: Duration) {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        self.shared.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Closes every open connection now, watches included.
    pub fn drop_connections(&self) {
        self.shared.kill.send_modify(|g| *g += 1);
    }

    /// Forgets the watch history: a watch from any resourceVersion older than the current one
    /// gets 410 Expired.
    pub fn compact(&self) {
        let mut st = lock(&self.shared.state);
        st.history.clear();
        st.floor = st.rv;
    }

    /// The number of requests served so far.
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// The store's current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.shared.state).rv
    }

    /// Stores `spec` under `ns/name` without any validation (as a writer with direct etcd
    /// access could), notifying watchers. `spec: None` stores a Lease without a spec.
    pub fn put_raw(&self, ns: &str, name: &str, spec: Option<Value>) -> u64 {
        let mut st = lock(&self.shared.state);
        let existing = st.objects.get(&(ns.to_owned(), name.to_owned())).cloned();
        let mut obj = existing
            .clone()
            .unwrap_or_else(|| new_object(ns, name, &mut st.next_id));
        match spec {
            Some(spec) => obj["spec"] = spec,
            None => {
                if let Some(m) = obj.as_object_mut() {
                    m.remove("spec");
                }
            }
        }
        let kind = if existing.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        commit(&self.shared, &mut st, ns, name, kind, obj)
    }
}

fn new_object(ns: &str, name: &str, next_id: &mut u64) -> Value {
    *next_id += 1;
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let created = k8s_openapi::jiff::Timestamp::from_second(i64::try_from(now).unwrap_or(0))
        .map(|t| t.to_string())
        .unwrap_or_default();
    json!({
        "kind": "Lease",
        "apiVersion": "coordination.k8s.io/v1",
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": format!("6f1b7c2e-0000-4000-8000-{:012x}", *next_id),
            "creationTimestamp": created,
        },
        "spec": {},
    })
}

/// Writes `obj` (or deletes, for kind DELETED) at the next resourceVersion, records the event
/// and sends it to matching watchers. Returns the new resourceVersion.
fn commit(
    shared: &Shared,
    st: &mut State,
    ns: &str,
    name: &str,
    kind: &'static str,
    mut obj: Value,
) -> u64 {
    st.rv += 1;
    let rv = st.rv;
    obj["metadata"]["resourceVersion"] = json!(rv.to_string());
    let k = (ns.to_owned(), name.to_owned());
    if kind == "DELETED" {
        st.objects.remove(&k);
    } else {
        st.objects.insert(k, obj.clone());
    }
    let line = event_line(kind, &obj);
    st.watchers.retain(|w| {
        if w.ns != ns || w.name.as_deref().is_some_and(|n| n != name) {
            return true;
        }
        w.tx.send(line.clone()).is_ok()
    });
    st.history.push_back(HistEvent {
        rv,
        ns: ns.to_owned(),
        name: name.to_owned(),
        kind,
        object: obj,
    });
    while st.history.len() > shared.opts.history {
        if let Some(old) = st.history.pop_front() {
            st.floor = old.rv;
        }
    }
    rv
}

fn event_line(kind: &str, obj: &Value) -> Bytes {
    let mut s = json!({ "type": kind, "object": obj }).to_string();
    s.push('\n');
    Bytes::from(s)
}

fn status(
    code: StatusCode,
    reason: &str,
    message: String,
    details: Option<Value>,
) -> Response<Body> {
    let mut body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    if let Some(d) = details {
        body["details"] = d;
    }
    json_response(code, &body)
}

fn details(name: &str) -> Value {
    json!({ "name": name, "group": GROUP, "kind": RESOURCE })
}

fn not_found(name: &str) -> Response<Body> {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{QUALIFIED} {name:?} not found"),
        Some(details(name)),
    )
}

fn conflict(name: &str, why: &str) -> Response<Body> {
    status(
        StatusCode::CONFLICT,
        "Conflict",
        format!("Operation cannot be fulfilled on {QUALIFIED} {name:?}: {why}"),
        Some(details(name)),
    )
}

/// 422 for several field errors, worded as `NewInvalid` does (one error bare, several in
/// brackets).
fn invalid_errors(name: &str, errs: &[FieldError]) -> Response<Body> {
    let printed: Vec<String> = errs
        .iter()
        .map(|e| format!("{}: {}", e.field, e.message))
        .collect();
    let summary = if printed.len() == 1 {
        printed[0].clone()
    } else {
        format!("[{}]", printed.join(", "))
    };
    let causes: Vec<Value> = errs
        .iter()
        .map(|e| json!({ "reason": e.reason, "message": e.message, "field": e.field }))
        .collect();
    status(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        format!("Lease.{GROUP} {name:?} is invalid: {summary}"),
        Some(json!({ "name": name, "group": GROUP, "kind": "Lease", "causes": causes })),
    )
}

fn invalid(name: &str, field: &str, value: &str, why: &str) -> Response<Body> {
    let cause = format!("Invalid value: {value}: {why}");
    status(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        format!("Lease.{GROUP} {name:?} is invalid: {field}: {cause}"),
        Some(json!({
            "name": name, "group": GROUP, "kind": "Lease",
            "causes": [{ "reason": "FieldValueInvalid", "message": cause, "field": field }],
        })),
    )
}

fn bad_request(message: String) -> Response<Body> {
    status(StatusCode::BAD_REQUEST, "BadRequest", message, None)
}

fn json_response(code: StatusCode, v: &Value) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// Whether `name` is a lower-case RFC 1123 subdomain (Kubernetes object names).
pub fn is_rfc1123_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(req: &Request<Incoming>) -> HashMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// A request the service refuses to answer: hyper closes the connection.
#[derive(Debug)]
struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped by fault injection")
    }
}

impl std::error::Error for Dropped {}

fn take_one(counter: &AtomicU32) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Dropped> {
    shared.requests.fetch_add(1, Ordering::SeqCst);
    if take_one(&shared.drop_next) {
        return Err(Dropped);
    }
    let delay = shared.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if take_one(&shared.fail_next) {
        let code = shared.fail_code.load(Ordering::SeqCst);
        return Ok(match code {
            500 => status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "Internal error occurred: injected failure".into(),
                None,
            ),
            504 => timeout_status(),
            429 => {
                let mut resp = status(
                    StatusCode::TOO_MANY_REQUESTS,
                    "TooManyRequests",
                    "Too many requests, please try again later.".into(),
                    Some(json!({ "retryAfterSeconds": 1 })),
                );
                resp.headers_mut().insert(
                    hyper::header::RETRY_AFTER,
                    hyper::header::HeaderValue::from_static("1"),
                );
                resp
            }
            _ => status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "the server is currently unable to handle the request".into(),
                None,
            ),
        });
    }

    // Route.
    let path = req.uri().path().to_owned();
    let Some(rest) = path.strip_prefix(PREFIX) else {
        return Ok(status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource".into(),
            None,
        ));
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let (ns, name) = match parts.as_slice() {
        [ns, "leases"] => ((*ns).to_owned(), None),
        [ns, "leases", name] => ((*ns).to_owned(), Some((*name).to_owned())),
        _ => {
            return Ok(status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource".into(),
                None,
            ));
        }
    };
    let q = query(&req);
    let watching = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
    let verb = match (req.method(), &name) {
        (&Method::GET, None) if watching => "watch",
        (&Method::GET, None) => "list",
        (&Method::GET, Some(_)) => "get",
        (&Method::POST, None) => "create",
        (&Method::PUT, Some(_)) => "update",
        (&Method::DELETE, Some(_)) => "delete",
        (m, _) => {
            return Ok(status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                format!("{m} is not supported on resources of kind {QUALIFIED:?}"),
                Some(json!({ "group": GROUP, "kind": RESOURCE })),
            ));
        }
    };

    // Authentication and authorization.
    let token = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
        .map(str::to_owned);
    let can_create;
    {
        let tokens = lock(&shared.tokens);
        let Some(p) = token.as_deref().and_then(|t| tokens.get(t)) else {
            return Ok(status(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "Unauthorized".into(),
                None,
            ));
        };
        if p.verbs.as_ref().is_some_and(|v| !v.contains(verb)) {
            return Ok(forbidden(&p.user, verb, &ns, name.as_deref()));
        }
        // A PUT that creates needs `create` too (checked when it turns out to create).
        can_create = match p.verbs.as_ref() {
            Some(v) if !v.contains("create") => Err(p.user.clone()),
            _ => Ok(()),
        };
    }

    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Err(Dropped),
    };
    let name = name.unwrap_or_default();
    let resp = match verb {
        "get" => do_get(&shared, &ns, &name),
        "list" => do_list(&shared, &ns, &q),
        "watch" => do_watch(&shared, &ns, &q).await,
        "create" => do_create(&shared, &ns, &body),
        "update" => do_update(&shared, &ns, &name, &body, can_create),
        _ => do_delete(&shared, &ns, &name, &body),
    };
    let write = matches!(verb, "create" | "update" | "delete");
    if write && resp.status().is_success() && take_one(&shared.fail_after_commit_next) {
        return Ok(timeout_status());
    }
    Ok(resp)
}

/// kube-apiserver's answer when a request outlives its deadline (the write may have happened).
fn timeout_status() -> Response<Body> {
    status(
        StatusCode::GATEWAY_TIMEOUT,
        "Timeout",
        "Timeout: request did not complete within requested timeout - context deadline exceeded"
            .into(),
        None,
    )
}

/// 403 in kube-apiserver's wording.
fn forbidden(user: &str, verb: &str, ns: &str, name: Option<&str>) -> Response<Body> {
    let why = format!(
        "User {user:?} cannot {verb} resource {RESOURCE:?} in API group {GROUP:?} in the namespace {ns:?}"
    );
    let (message, d) = match name {
        Some(n) => (format!("{QUALIFIED} {n:?} is forbidden: {why}"), details(n)),
        None => (
            format!("{QUALIFIED} is forbidden: {why}"),
            json!({ "group": GROUP, "kind": RESOURCE }),
        ),
    };
    status(StatusCode::FORBIDDEN, "Forbidden", message, Some(d))
}

fn do_get(shared: &Shared, ns: &str, name: &str) -> Response<Body> {
    let st = lock(&shared.state);
    match st.objects.get(&(ns.to_owned(), name.to_owned())) {
        Some(o) => json_response(StatusCode::OK, o),
        None => not_found(name),
    }
}

/// Parses `fieldSelector` (only `metadata.name=`) and equality `labelSelector`s.
#[allow(clippy::type_complexity)]
fn selectors(
    q: &HashMap<String, String>,
) -> Result<(Option<String>, Vec<(String, String)>), Response<Body>> {
    let mut name = None;
    if let Some(fs) = q.get("fieldSelector").filter(|s| !s.is_empty()) {
        for term in fs.split(',') {
            let term = term.trim();
            let v = term
                .strip_prefix("metadata.name==")
                .or_else(|| term.strip_prefix("metadata.name="));
            match v {
                Some(v) => name = Some(v.to_owned()),
                None => {
                    return Err(bad_request(format!(
                        "field label not supported by this test server: {term}"
                    )));
                }
            }
        }
    }
    let mut labels = Vec::new();
    if let Some(ls) = q.get("labelSelector").filter(|s| !s.is_empty()) {
        for term in ls.split(',') {
            let Some((k, v)) = term.split_once('=') else {
                return Err(bad_request(format!(
                    "label selector not supported by this test server: {term}"
                )));
            };
            labels.push((k.trim_end_matches('=').to_owned(), v.to_owned()));
        }
    }
    Ok((name, labels))
}

fn matches_labels(obj: &Value, labels: &[(String, String)]) -> bool {
    labels
        .iter()
        .all(|(k, v)| obj["metadata"]["labels"][k].as_str() == Some(v.as_str()))
}

fn do_list(shared: &Shared, ns: &str, q: &HashMap<String, String>) -> Response<Body> {
    let (name, labels) = match selectors(q) {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let st = lock(&shared.state);
    let limit = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        .map(|l| shared.opts.max_page_size.map_or(l, |m| l.min(m)));
    // A continue token is "<list resourceVersion>/<last name served>".
    let (list_rv, after) = match q.get("continue").filter(|c| !c.is_empty()) {
        None => (st.rv, None),
        Some(token) => {
            let parsed = token
                .split_once('/')
                .and_then(|(rv, last)| Some((rv.parse::<u64>().ok()?, last.to_owned())));
            let Some((rv, last)) = parsed else {
                return bad_request(format!("continue key is not valid: {token:?}"));
            };
            if rv < st.floor || take_one(&shared.expire_continue_next) {
                return status(
                    StatusCode::GONE,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.".into(),
                    None,
                );
            }
            (rv, Some(last))
        }
    };
    let mut items: Vec<Value> = st
        .objects
        .iter()
        .filter(|((n, k), o)| {
            n == ns
                && name.as_deref().is_none_or(|x| x == k)
                && after.as_deref().is_none_or(|a| k.as_str() > a)
                && matches_labels(o, &labels)
        })
        .map(|(_, o)| {
            let mut o = o.clone();
            if let Some(m) = o.as_object_mut() {
                // List items carry no kind/apiVersion, as kube-apiserver serves them.
                m.remove("kind");
                m.remove("apiVersion");
            }
            o
        })
        .collect();
    let mut metadata = json!({ "resourceVersion": list_rv.to_string() });
    if let Some(limit) = limit
        && items.len() > limit
    {
        let remaining = items.len() - limit;
        items.truncate(limit);
        let last = items
            .last()
            .and_then(|o| o["metadata"]["name"].as_str())
            .unwrap_or_default();
        metadata["continue"] = json!(format!("{list_rv}/{last}"));
        metadata["remainingItemCount"] = json!(remaining);
    }
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "LeaseList",
            "apiVersion": "coordination.k8s.io/v1",
            "metadata": metadata,
            "items": items,
        }),
    )
}

fn bookmark_line(rv: u64) -> Bytes {
    event_line(
        "BOOKMARK",
        &json!({
            "kind": "Lease",
            "apiVersion": "coordination.k8s.io/v1",
            "metadata": { "resourceVersion": rv.to_string(), "creationTimestamp": null },
            "spec": {},
        }),
    )
}

/// A watch from a resourceVersion newer than the server's: wait for the server to catch up, then
/// give up with kube-apiserver's 504 "Too large resource version".
async fn wait_for_rv(shared: &Shared, from: u64) -> Result<(), Response<Body>> {
    let deadline = tokio::time::Instant::now() + shared.opts.too_large_rv_wait;
    loop {
        let current = lock(&shared.state).rv;
        if current >= from {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(status(
                StatusCode::GATEWAY_TIMEOUT,
                "Timeout",
                format!("Too large resource version: {from}, current: {current}"),
                Some(json!({
                    "causes": [{ "reason": "ResourceVersionTooLarge", "message": "Too large resource version" }],
                    "retryAfterSeconds": 1,
                })),
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn do_watch(shared: &Arc<Shared>, ns: &str, q: &HashMap<String, String>) -> Response<Body> {
    let (name, labels) = match selectors(q) {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    if !labels.is_empty() {
        return bad_request(
            "label selectors on watches are not supported by this test server".into(),
        );
    }
    let bookmarks = q
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true" || v == "1");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(1800);
    let rv = q.get("resourceVersion").cloned().unwrap_or_default();
    if let Ok(from) = rv.parse::<u64>()
        && let Err(resp) = wait_for_rv(shared, from).await
    {
        return resp;
    }
    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
    let matches = |n: &str, k: &str| n == ns && name.as_deref().is_none_or(|x| x == k);
    let id;
    {
        let mut st = lock(&shared.state);
        if rv.is_empty() || rv == "0" {
            for ((n, k), o) in &st.objects {
                if matches(n, k) {
                    let _ = tx.send(event_line("ADDED", o));
                }
            }
        } else {
            let Ok(from) = rv.parse::<u64>() else {
                return bad_request(format!("invalid resource version {rv:?}"));
            };
            if from < st.floor {
                let msg = format!("too old resource version: {from} ({})", st.floor);
                if shared.opts.expired_as_http_410 {
                    return status(StatusCode::GONE, "Expired", msg, None);
                }
                let ev = json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "message": msg, "reason": "Expired", "code": 410,
                });
                let _ = tx.send(event_line("ERROR", &ev));
                drop(tx);
                return stream_response(rx);
            }
            for e in &st.history {
                if e.rv > from && matches(&e.ns, &e.name) {
                    let _ = tx.send(event_line(e.kind, &e.object));
                }
            }
        }
        st.next_id += 1;
        id = st.next_id;
        st.watchers.push(Watcher {
            id,
            ns: ns.to_owned(),
            name: name.clone(),
            tx: tx.clone(),
        });
    }
    // Bookmarks and the server-side timeout.
    let shared = shared.clone();
    let interval = shared.opts.bookmark_interval;
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval), if bookmarks => {
                    let st = lock(&shared.state);
                    if tx.send(bookmark_line(st.rv)).is_err() { break; }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let st = lock(&shared.state);
                    if bookmarks { let _ = tx.send(bookmark_line(st.rv)); }
                    break;
                }
                _ = tx.closed() => break,
            }
        }
        lock(&shared.state).watchers.retain(|w| w.id != id);
    });
    stream_response(rx)
}

fn stream_response(rx: mpsc::UnboundedReceiver<Bytes>) -> Response<Body> {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    let mut resp = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// A decoded Lease body.
struct ParsedLease {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    labels: Option<Value>,
    annotations: Option<Value>,
    owner_references: Option<Value>,
    finalizers: Option<Value>,
    spec: Value,
    rv: Option<String>,
}

/// Whether `s` is what Go's `time.Parse(RFC3339Micro, s)` accepts (the only form a `MicroTime`
/// decodes from): `YYYY-MM-DDTHH:MM:SS.ffffff` with exactly six fractional digits, then `Z` or
/// `±HH:MM`, and a real date and time.
pub fn is_rfc3339_micro(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() < 27 {
        return false;
    }
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    let shape = digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && b[10] == b'T'
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19)
        && b[19] == b'.'
        && digits(20..26);
    let zone = &b[26..];
    let zone_ok = zone == b"Z"
        || (zone.len() == 6
            && (zone[0] == b'+' || zone[0] == b'-')
            && zone[1..3].iter().all(u8::is_ascii_digit)
            && zone[3] == b':'
            && zone[4..6].iter().all(u8::is_ascii_digit));
    shape && zone_ok && s.parse::<k8s_openapi::jiff::Timestamp>().is_ok()
}

fn cannot_handle(e: impl std::fmt::Display) -> Response<Body> {
    bad_request(format!(
        "Lease in version \"v1\" cannot be handled as a Lease: {e}"
    ))
}

fn decode_lease(body: &[u8]) -> Result<ParsedLease, Response<Body>> {
    let v: Value = serde_json::from_slice(body).map_err(cannot_handle)?;
    let raw_spec = v.get("spec").cloned().unwrap_or(json!({}));
    for field in ["acquireTime", "renewTime"] {
        match raw_spec.get(field) {
            None | Some(Value::Null) => {}
            Some(Value::String(t)) if is_rfc3339_micro(t) => {}
            Some(Value::String(t)) => {
                return Err(cannot_handle(format!(
                    "parsing time {t:?} as \"2006-01-02T15:04:05.000000Z07:00\": cannot parse {t:?} as RFC3339Micro"
                )));
            }
            Some(other) => {
                return Err(cannot_handle(format!(
                    "json: cannot unmarshal {other} into Go struct field LeaseSpec.spec.{field} of type string"
                )));
            }
        }
    }
    let spec: LeaseSpec = serde_json::from_value(raw_spec).map_err(cannot_handle)?;
    let spec = serde_json::to_value(&spec).unwrap_or(json!({}));
    let md = &v["metadata"];
    let s = |f: &str| {
        md.get(f)
            .and_then(Value::as_str)
            .filter(|x| !x.is_empty())
            .map(str::to_owned)
    };
    let non_empty_array = |f: &str| {
        md.get(f)
            .filter(|l| l.as_array().is_some_and(|a| !a.is_empty()))
            .cloned()
    };
    Ok(ParsedLease {
        name: s("name"),
        namespace: s("namespace"),
        uid: s("uid"),
        labels: md.get("labels").filter(|l| l.is_object()).cloned(),
        annotations: md.get("annotations").filter(|l| l.is_object()).cloned(),
        owner_references: non_empty_array("ownerReferences"),
        finalizers: non_empty_array("finalizers"),
        spec,
        rv: s("resourceVersion"),
    })
}

/// One field error, as apimachinery's `field.Error` prints it.
struct FieldError {
    field: &'static str,
    /// `FieldValueInvalid`, `FieldValueNotSupported` or `FieldValueForbidden`.
    reason: &'static str,
    /// The cause message, without the field.
    message: String,
}

/// Lease validation (`ValidateLeaseSpec` of kube-apiserver's coordination API).
fn validate_spec(name: &str, spec: &Value) -> Result<(), Response<Body>> {
    let mut errs = Vec::new();
    if let Some(d) = spec.get("leaseDurationSeconds").and_then(Value::as_i64)
        && d <= 0
    {
        errs.push(FieldError {
            field: "spec.leaseDurationSeconds",
            reason: "FieldValueInvalid",
            message: format!("Invalid value: {d}: must be greater than 0"),
        });
    }
    if let Some(t) = spec.get("leaseTransitions").and_then(Value::as_i64)
        && t < 0
    {
        errs.push(FieldError {
            field: "spec.leaseTransitions",
            reason: "FieldValueInvalid",
            message: format!("Invalid value: {t}: must be greater than or equal to 0"),
        });
    }
    let strategy = spec.get("strategy").and_then(Value::as_str);
    if let Some(st) = strategy {
        if st.contains('/') {
            if !is_qualified_name(st) {
                errs.push(FieldError {
                    field: "spec.strategy",
                    reason: "FieldValueInvalid",
                    message: format!(
                        "Invalid value: {st:?}: a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character, with an optional DNS subdomain prefix and '/'"
                    ),
                });
            }
        } else if st != "OldestEmulationVersion" {
            errs.push(FieldError {
                field: "spec.strategy",
                reason: "FieldValueNotSupported",
                message: format!(
                    "Unsupported value: {st:?}: supported values: \"OldestEmulationVersion\""
                ),
            });
        }
    }
    if spec
        .get("preferredHolder")
        .and_then(Value::as_str)
        .is_some_and(|p| !p.is_empty())
        && strategy.is_none_or(str::is_empty)
    {
        errs.push(FieldError {
            field: "spec.preferredHolder",
            reason: "FieldValueForbidden",
            message: "Forbidden: may only be specified if `strategy` is defined".into(),
        });
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(invalid_errors(name, &errs))
    }
}

/// `prefix/name` as `IsQualifiedName` accepts it (a DNS subdomain prefix, a name of at most 63
/// characters).
fn is_qualified_name(s: &str) -> bool {
    let Some((prefix, name)) = s.split_once('/') else {
        return false;
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric();
    name_ok && is_rfc1123_subdomain(prefix)
}

fn invalid_name(name: &str) -> Option<Response<Body>> {
    if is_rfc1123_subdomain(name) {
        return None;
    }
    let why = if name.len() > 253 {
        "must be no more than 253 characters"
    } else {
        RFC1123_MSG
    };
    Some(invalid(name, "metadata.name", &format!("{name:?}"), why))
}

fn apply_meta(obj: &mut Value, b: &ParsedLease) {
    let md = &mut obj["metadata"];
    if let Some(m) = md.as_object_mut() {
        for f in ["labels", "annotations", "ownerReferences", "finalizers"] {
            m.remove(f);
        }
    }
    for (f, v) in [
        ("labels", &b.labels),
        ("annotations", &b.annotations),
        ("ownerReferences", &b.owner_references),
        ("finalizers", &b.finalizers),
    ] {
        if let Some(v) = v {
            md[f] = v.clone();
        }
    }
    obj["spec"] = b.spec.clone();
}

fn namespace_mismatch() -> Response<Body> {
    bad_request(
        "the namespace of the provided object does not match the namespace sent on the request"
            .into(),
    )
}

fn do_create(shared: &Arc<Shared>, ns: &str, body: &[u8]) -> Response<Body> {
    let b = match decode_lease(body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let Some(name) = b.name.clone() else {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!(
                "Lease.{GROUP} \"\" is invalid: metadata.name: Required value: name or generateName is required"
            ),
            None,
        );
    };
    if b.namespace.as_deref().is_some_and(|n| n != ns) {
        return namespace_mismatch();
    }
    if let Some(r) = invalid_name(&name) {
        return r;
    }
    if let Err(r) = validate_spec(&name, &b.spec) {
        return r;
    }
    let mut st = lock(&shared.state);
    if st.objects.contains_key(&(ns.to_owned(), name.clone())) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("{QUALIFIED} {name:?} already exists"),
            Some(details(&name)),
        );
    }
    let mut obj = new_object(ns, &name, &mut st.next_id);
    apply_meta(&mut obj, &b);
    commit(shared, &mut st, ns, &name, "ADDED", obj);
    let stored = st
        .objects
        .get(&(ns.to_owned(), name))
        .cloned()
        .unwrap_or_default();
    json_response(StatusCode::CREATED, &stored)
}

fn uid_precondition_failed(name: &str, want: &str, have: &str) -> Response<Body> {
    conflict(
        name,
        &format!("Precondition failed: UID in precondition: {want}, UID in object meta: {have}"),
    )
}

/// `PUT`, as kube-apiserver's generic registry does it for Leases: a `metadata.uid` in the body
/// is a precondition (checked first, also when the Lease does not exist); a missing Lease is
/// created (the Lease strategy allows create-on-update, which needs the `create` verb too, and
/// ignores `resourceVersion`); an existing one needs `resourceVersion`, which must match.
fn do_update(
    shared: &Arc<Shared>,
    ns: &str,
    name: &str,
    body: &[u8],
    can_create: Result<(), String>,
) -> Response<Body> {
    let b = match decode_lease(body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    if b.name.as_deref() != Some(name) {
        return bad_request(format!(
            "the name of the object ({}) does not match the name on the URL ({name})",
            b.name.clone().unwrap_or_default()
        ));
    }
    if b.namespace.as_deref().is_some_and(|n| n != ns) {
        return namespace_mismatch();
    }
    let mut st = lock(&shared.state);
    let k = (ns.to_owned(), name.to_owned());
    let Some(current) = st.objects.get(&k).cloned() else {
        if let Some(uid) = &b.uid {
            return uid_precondition_failed(name, uid, "");
        }
        if let Err(user) = can_create {
            return forbidden(&user, "create", ns, Some(name));
        }
        if let Some(r) = invalid_name(name) {
            return r;
        }
        if let Err(r) = validate_spec(name, &b.spec) {
            return r;
        }
        let mut obj = new_object(ns, name, &mut st.next_id);
        apply_meta(&mut obj, &b);
        commit(shared, &mut st, ns, name, "ADDED", obj);
        let stored = st.objects.get(&k).cloned().unwrap_or_default();
        return json_response(StatusCode::CREATED, &stored);
    };
    let current_uid = current["metadata"]["uid"].as_str().unwrap_or("");
    if let Some(uid) = &b.uid
        && uid != current_uid
    {
        return uid_precondition_failed(name, uid, current_uid);
    }
    let current_rv = current["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    let Some(rv) = &b.rv else {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!(
                "{QUALIFIED} {name:?} is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update"
            ),
            Some(json!({
                "name": name, "group": GROUP, "kind": RESOURCE,
                "causes": [{
                    "reason": "FieldValueInvalid",
                    "message": "Invalid value: 0x0: must be specified for an update",
                    "field": "metadata.resourceVersion",
                }],
            })),
        );
    };
    if *rv != current_rv {
        return conflict(
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        );
    }
    if let Err(r) = validate_spec(name, &b.spec) {
        return r;
    }
    let mut obj = current.clone();
    apply_meta(&mut obj, &b);
    if obj == current {
        // Nothing changed: kube-apiserver does not write, and the resourceVersion stays.
        return json_response(StatusCode::OK, &current);
    }
    commit(shared, &mut st, ns, name, "MODIFIED", obj);
    let stored = st.objects.get(&k).cloned().unwrap_or_default();
    json_response(StatusCode::OK, &stored)
}

/// The part of `DeleteOptions` the server honours.
#[derive(serde::Deserialize, Default)]
struct DeleteOptions {
    #[serde(default)]
    preconditions: Option<DeletePreconditions>,
}

#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct DeletePreconditions {
    resource_version: Option<String>,
    uid: Option<String>,
}

/// `DELETE`: immediate (Leases have no graceful deletion), answered with a success `Status`
/// as kube-apiserver's generic registry answers it.
fn do_delete(shared: &Arc<Shared>, ns: &str, name: &str, body: &[u8]) -> Response<Body> {
    let opts: DeleteOptions = if body.is_empty() {
        DeleteOptions::default()
    } else {
        match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return bad_request(format!("invalid DeleteOptions: {e}")),
        }
    };
    let pre = opts.preconditions.unwrap_or_default();
    let mut st = lock(&shared.state);
    let k = (ns.to_owned(), name.to_owned());
    let Some(current) = st.objects.get(&k).cloned() else {
        return not_found(name);
    };
    let current_rv = current["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    let current_uid = current["metadata"]["uid"].as_str().unwrap_or("").to_owned();
    if let Some(uid) = pre.uid.as_deref()
        && uid != current_uid
    {
        return uid_precondition_failed(name, uid, &current_uid);
    }
    if let Some(rv) = pre.resource_version.as_deref()
        && rv != current_rv
    {
        return conflict(
            name,
            &format!(
                "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {current_rv}"
            ),
        );
    }
    commit(shared, &mut st, ns, name, "DELETED", current);
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": { "name": name, "group": GROUP, "kind": RESOURCE, "uid": current_uid },
        }),
    )
}

/// The namespace the tests' stores use.
pub const NAMESPACE: &str = "leasehold-test";

/// The store configuration tests use: the test namespace and a request timeout below the
/// conformance suite's 1 s renew deadline.
pub fn test_config() -> leasehold_kube::KubeConfig {
    leasehold_kube::KubeConfig::new()
        .with_namespace(NAMESPACE)
        .with_operation_timeout(crate::TEST_OPERATION_TIMEOUT)
        .with_watch_timeout(Duration::from_secs(30))
}

/// A store on `server` with the admin token.
pub fn store(server: &LeaseApiServer) -> leasehold_kube::KubeStore {
    leasehold_kube::KubeStore::new(server.client(), test_config()).expect("valid store config")
}

/// A store on `server` with `token` and `config`.
pub fn store_with(
    server: &LeaseApiServer,
    token: Option<&str>,
    config: leasehold_kube::KubeConfig,
) -> leasehold_kube::KubeStore {
    leasehold_kube::KubeStore::new(server.client_with_token(token), config)
        .expect("valid store config")
}

impl LeaseApiServer {
    /// The stored object `ns/name` as JSON, if any.
    pub fn get_raw(&self, ns: &str, name: &str) -> Option<Value> {
        lock(&self.shared.state)
            .objects
            .get(&(ns.to_owned(), name.to_owned()))
            .cloned()
    }
}

/// Logs to the test output when `RUST_LOG` is set (e.g. `RUST_LOG=leasehold_kube=debug`).
pub fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// A store on a fresh test server that lives until the calling test's runtime ends (the
/// server's tasks run on that runtime and stop with it).
pub async fn make_store() -> leasehold::DynLeaseStore {
    init_tracing();
    let server = LeaseApiServer::start().await;
    let s = store(&server);
    std::mem::forget(server);
    Arc::new(s)
}
