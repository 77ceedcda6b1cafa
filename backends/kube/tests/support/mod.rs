//! A Lease API server that behaves like kube-apiserver for `coordination.k8s.io/v1` Leases, for
//! tests. It listens on a free loopback port and a real `kube::Client` talks to it.
//!
//! # What it serves
//!
//! `/apis/coordination.k8s.io/v1/namespaces/{ns}/leases` and `.../leases/{name}`:
//! - `GET` (one Lease), `GET` collection (list; `fieldSelector=metadata.name=…` and equality
//!   `labelSelector`s), `GET ?watch=1` (watch), `POST` (create, 201), `PUT` (replace, with
//!   optimistic concurrency on `metadata.resourceVersion`), `DELETE` (with `preconditions`).
//! - One store-wide resourceVersion counter that increases by one on every write, as etcd's
//!   revision does; a write that changes nothing (an identical `PUT`) keeps the resourceVersion,
//!   as kube-apiserver does.
//! - Watches stream newline-separated JSON events (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`,
//!   `ERROR`) over a chunked response. `resourceVersion=""`/`"0"` starts with synthetic `ADDED`
//!   events for the current objects; `resourceVersion=N` replays every event after `N` from a
//!   bounded history and answers an `ERROR` event with a `410 Expired` Status (`too old resource
//!   version: N (M)`) when `N` is older than the history. `allowWatchBookmarks=true` gets a
//!   `BOOKMARK` every bookmark interval and one before the server ends the watch at
//!   `timeoutSeconds`.
//! - Status bodies with kube-apiserver's wording (apimachinery `errors.go`): 409 `Conflict`
//!   (`Operation cannot be fulfilled on leases.coordination.k8s.io "x": the object has been
//!   modified; please apply your changes to the latest version and try again`), 409
//!   `AlreadyExists` (`leases.coordination.k8s.io "x" already exists`), 404 `NotFound`
//!   (`leases.coordination.k8s.io "x" not found`), 422 `Invalid` for names that are not
//!   lower-case RFC 1123 subdomains and for `leaseDurationSeconds <= 0` / `leaseTransitions < 0`
//!   (Lease validation), 401 `Unauthorized` for a missing or unknown bearer token, 403
//!   `Forbidden` (`leases.coordination.k8s.io "x" is forbidden: User "u" cannot update resource
//!   "leases" in API group "coordination.k8s.io" in the namespace "ns"`) when the token's user
//!   lacks the verb.
//!
//! # Fault controls
//! [`LeaseApiServer::fail_next`] (answer the next N requests with an error Status),
//! [`LeaseApiServer::drop_next`] (close the connection of the next N requests without an
//! answer), [`LeaseApiServer::set_delay`] (delay every answer), [`LeaseApiServer::drop_connections`]
//! (close every open connection, watches included), [`LeaseApiServer::compact`] (forget the
//! event history, so older watch resourceVersions are Gone), [`LeaseApiServer::put_raw`] (store a
//! Lease without validation, as a foreign writer with etcd access could).
//!
//! # What it does not emulate
//! - TLS, client certificates, and any authentication other than static bearer tokens; RBAC is
//!   a per-token verb set on `leases` (no Roles, no resourceNames, no namespaces scoping).
//! - Other resources, API discovery, `PATCH` (405), server-side apply, `managedFields`,
//!   `generateName`, `dryRun`, finalizers and graceful deletion, `fieldValidation`, protobuf.
//! - List paging (`limit`/`continue` are ignored: everything comes in one page),
//!   `resourceVersionMatch`, `sendInitialEvents`, consistent reads from a cache at an older
//!   resourceVersion, set-based label selectors and field selectors other than `metadata.name`.
//! - A watch from a resourceVersion newer than the store's is served as a watch from now (the
//!   real server waits, then fails with "Too large resource version").
//! - Spec validation beyond `leaseDurationSeconds > 0` and `leaseTransitions >= 0`; unknown
//!   spec fields are dropped (as kube-apiserver prunes them) and times are re-serialized in
//!   `MicroTime` form.
//! - HTTP/2, request priority and fairness (429), and the apiserver's own timeouts (504).
// Test support: not every test binary uses every helper, and error answers are whole responses.
#![allow(dead_code, clippy::result_large_err)]

pub mod cluster;

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
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            history: 1000,
            bookmark_interval: Duration::from_secs(1),
            expired_as_http_410: false,
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
        let mut config = kube::Config::new(self.url().parse().expect("server URL"));
        config.default_namespace = "default".into();
        config.connect_timeout = Some(Duration::from_secs(5));
        if let Some(t) = token {
            config.auth_info.token = Some(t.to_owned().into());
        }
        kube::Client::try_from(config).expect("kube client for the test server")
    }

    /// A kube client with the admin token.
    pub fn client(&self) -> kube::Client {
        self.client_with_token(Some(ADMIN_TOKEN))
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

    /// Answers the next `n` requests with a Status of HTTP `code` (503 ServiceUnavailable or
    /// 500 InternalError wording).
    pub fn fail_next(&self, n: u32, code: u16) {
        self.shared
            .fail_code
            .store(u32::from(code), Ordering::SeqCst);
        self.shared.fail_next.store(n, Ordering::SeqCst);
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
        return Ok(if code == 500 {
            status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "Internal error occurred: injected failure".into(),
                None,
            )
        } else {
            status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "the server is currently unable to handle the request".into(),
                None,
            )
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
            let why = format!(
                "User {:?} cannot {verb} resource {RESOURCE:?} in API group {GROUP:?} in the namespace {ns:?}",
                p.user
            );
            let (message, d) = match &name {
                Some(n) => (format!("{QUALIFIED} {n:?} is forbidden: {why}"), details(n)),
                None => (
                    format!("{QUALIFIED} is forbidden: {why}"),
                    json!({ "group": GROUP, "kind": RESOURCE }),
                ),
            };
            return Ok(status(StatusCode::FORBIDDEN, "Forbidden", message, Some(d)));
        }
    }

    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Err(Dropped),
    };
    Ok(match verb {
        "get" => do_get(&shared, &ns, name.as_deref().unwrap_or_default()),
        "list" => do_list(&shared, &ns, &q),
        "watch" => do_watch(&shared, &ns, &q),
        "create" => do_create(&shared, &ns, &body),
        "update" => do_update(&shared, &ns, name.as_deref().unwrap_or_default(), &body),
        _ => do_delete(&shared, &ns, name.as_deref().unwrap_or_default(), &body),
    })
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
    let items: Vec<Value> = st
        .objects
        .iter()
        .filter(|((n, k), o)| {
            n == ns && name.as_deref().is_none_or(|x| x == k) && matches_labels(o, &labels)
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
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "LeaseList",
            "apiVersion": "coordination.k8s.io/v1",
            "metadata": { "resourceVersion": st.rv.to_string() },
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

fn do_watch(shared: &Arc<Shared>, ns: &str, q: &HashMap<String, String>) -> Response<Body> {
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

/// Decodes and validates a Lease body; returns (name, labels, annotations, normalized spec, rv).
struct ParsedLease {
    name: Option<String>,
    namespace: Option<String>,
    labels: Option<Value>,
    annotations: Option<Value>,
    spec: Value,
    rv: Option<String>,
}

fn decode_lease(body: &[u8]) -> Result<ParsedLease, Response<Body>> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        bad_request(format!(
            "Lease in version \"v1\" cannot be handled as a Lease: {e}"
        ))
    })?;
    let raw_spec = v.get("spec").cloned().unwrap_or(json!({}));
    let spec: LeaseSpec = serde_json::from_value(raw_spec).map_err(|e| {
        bad_request(format!(
            "Lease in version \"v1\" cannot be handled as a Lease: {e}"
        ))
    })?;
    let spec = serde_json::to_value(&spec).unwrap_or(json!({}));
    let md = &v["metadata"];
    let s = |f: &str| {
        md.get(f)
            .and_then(Value::as_str)
            .filter(|x| !x.is_empty())
            .map(str::to_owned)
    };
    Ok(ParsedLease {
        name: s("name"),
        namespace: s("namespace"),
        labels: md.get("labels").filter(|l| l.is_object()).cloned(),
        annotations: md.get("annotations").filter(|l| l.is_object()).cloned(),
        spec,
        rv: s("resourceVersion"),
    })
}

fn validate_spec(name: &str, spec: &Value) -> Result<(), Response<Body>> {
    if let Some(d) = spec.get("leaseDurationSeconds").and_then(Value::as_i64)
        && d <= 0
    {
        return Err(invalid(
            name,
            "spec.leaseDurationSeconds",
            &d.to_string(),
            "must be greater than 0",
        ));
    }
    if let Some(t) = spec.get("leaseTransitions").and_then(Value::as_i64)
        && t < 0
    {
        return Err(invalid(
            name,
            "spec.leaseTransitions",
            &t.to_string(),
            "must be greater than or equal to 0",
        ));
    }
    Ok(())
}

fn apply_meta(obj: &mut Value, b: &ParsedLease) {
    let md = &mut obj["metadata"];
    if let Some(m) = md.as_object_mut() {
        m.remove("labels");
        m.remove("annotations");
    }
    if let Some(l) = &b.labels {
        md["labels"] = l.clone();
    }
    if let Some(a) = &b.annotations {
        md["annotations"] = a.clone();
    }
    obj["spec"] = b.spec.clone();
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
        return bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
                .into(),
        );
    }
    if !is_rfc1123_subdomain(&name) {
        let why = if name.len() > 253 {
            "must be no more than 253 characters"
        } else {
            RFC1123_MSG
        };
        return invalid(&name, "metadata.name", &format!("{name:?}"), why);
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

fn do_update(shared: &Arc<Shared>, ns: &str, name: &str, body: &[u8]) -> Response<Body> {
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
        return bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
                .into(),
        );
    }
    if let Err(r) = validate_spec(name, &b.spec) {
        return r;
    }
    let mut st = lock(&shared.state);
    let k = (ns.to_owned(), name.to_owned());
    let Some(current) = st.objects.get(&k).cloned() else {
        return not_found(name);
    };
    let current_rv = current["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    if let Some(rv) = &b.rv
        && *rv != current_rv
    {
        return conflict(
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        );
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
    if let Some(uid) = pre.uid.as_deref()
        && Some(uid) != current["metadata"]["uid"].as_str()
    {
        return conflict(
            name,
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                current["metadata"]["uid"].as_str().unwrap_or("")
            ),
        );
    }
    let rv = commit(shared, &mut st, ns, name, "DELETED", current.clone());
    let mut gone = current;
    gone["metadata"]["resourceVersion"] = json!(rv.to_string());
    json_response(StatusCode::OK, &gone)
}

/// The namespace the tests' stores use.
pub const NAMESPACE: &str = "leasehold-test";

/// The store configuration tests use: the test namespace and a request timeout below the
/// conformance suite's 1 s renew deadline.
pub fn test_config() -> leasehold_kube::KubeStoreConfig {
    leasehold_kube::KubeStoreConfig::default()
        .namespace(NAMESPACE)
        .request_timeout(Duration::from_millis(900))
        .watch_timeout(Duration::from_secs(30))
}

/// A store on `server` with the admin token.
pub fn store(server: &LeaseApiServer) -> leasehold_kube::KubeStore {
    leasehold_kube::KubeStore::new(server.client(), test_config()).expect("valid store config")
}

/// A store on `server` with `token` and `config`.
pub fn store_with(
    server: &LeaseApiServer,
    token: Option<&str>,
    config: leasehold_kube::KubeStoreConfig,
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
