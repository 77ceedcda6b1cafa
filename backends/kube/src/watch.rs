//! `watch` on one Lease: a raw Kubernetes watch with a field selector on `metadata.name`,
//! resumed from the last resourceVersion seen.
//!
//! - `after = None`: a list (with the same field selector) gives the current state, delivered
//!   first, and the resourceVersion to watch from.
//! - `after = Some(v)`: the watch starts at `v`, so the server replays every change after it.
//! - Bookmarks advance the resume point without delivering anything.
//! - When the server ends a watch (its `timeoutSeconds`, a dropped connection, or silence
//!   longer than the watch timeout plus the operation timeout), the watch resumes from the last
//!   resourceVersion seen: nothing is lost and nothing is repeated.
//! - When the resume point has expired (410 Gone), the Lease is read again; its current state is
//!   delivered if it differs from the last one delivered (changes in between are coalesced), and
//!   the watch resumes from the list's resourceVersion. An older state never follows a newer one.
//! - When the API server cannot be reached, or keeps closing watches immediately, the stream
//!   delivers one retryable `Err` and ends; the caller re-reads and watches again.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use kube::api::{DynamicObject, ListParams, WatchEvent as KubeEvent, WatchParams};
use kube::core::Status;
use leasehold::{Error, LeaseKey, Result, Version, WatchEvent, WatchStream};

use crate::error::{Ctx, Op, map_kube, map_status, timeout};
use crate::{Inner, STORE_NAME, mapping};

/// After this many consecutive watch requests that ended before delivering anything, the stream
/// gives up with an error.
const MAX_IDLE_RECONNECTS: u32 = 5;

/// What the consumer was last told about the key.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seen {
    /// Nothing delivered yet and nothing known.
    Unknown,
    /// The key does not exist.
    Absent,
    /// The key exists at this version.
    Present(Version),
}

type KubeStream = BoxStream<'static, kube::Result<KubeEvent<DynamicObject>>>;

struct Watcher {
    inner: Arc<Inner>,
    key: LeaseKey,
    /// The resourceVersion to resume from.
    resume_from: String,
    seen: Seen,
    /// Events decided but not yet handed to the consumer. Bounded by construction: the stream
    /// is pull-based (no task, no channel), `next_event` drains this queue before it reads
    /// anything more from the server, and one server event or one re-read queues at most one
    /// item; only a 410 answered to the very first watch request can queue a second (the
    /// initial read, then the re-read). The server's event stream itself is read only as fast
    /// as the consumer pulls (HTTP flow control), so nothing buffers without bound.
    pending: VecDeque<Result<WatchEvent>>,
    stream: Option<KubeStream>,
    /// Whether the current watch request delivered anything (an event or a bookmark).
    progressed: bool,
    idle_reconnects: u32,
    done: bool,
}

pub(crate) async fn start(
    inner: Arc<Inner>,
    key: LeaseKey,
    after: Option<Version>,
) -> Result<WatchStream> {
    let mut w = Watcher {
        inner,
        key,
        resume_from: String::new(),
        seen: Seen::Unknown,
        pending: VecDeque::with_capacity(2),
        stream: None,
        progressed: false,
        idle_reconnects: 0,
        done: false,
    };
    match after {
        Some(v) => {
            w.resume_from = v.as_str().to_owned();
            w.seen = Seen::Present(v);
        }
        None => w.relist().await?,
    }
    // Open the first watch request now, so that errors (RBAC, unreachable) surface here.
    w.connect().await?;
    Ok(futures::stream::unfold(
        w,
        |mut w| async move { w.next_event().await.map(|ev| (ev, w)) },
    )
    .boxed())
}

impl Watcher {
    fn ctx(&self, op: Op) -> Ctx<'_> {
        Ctx {
            op,
            namespace: &self.inner.namespace,
            server: self.inner.server.as_deref(),
            key: Some(&self.key),
            expected: None,
        }
    }

    fn selector(&self) -> String {
        format!("metadata.name={}", self.key)
    }

    /// Reads the key's current state, queues it if it differs from what was delivered, and
    /// moves the resume point to the list's resourceVersion.
    async fn relist(&mut self) -> Result<()> {
        let params = ListParams::default().fields(&self.selector());
        let list =
            match tokio::time::timeout(self.inner.operation_timeout, self.inner.api.list(&params))
                .await
            {
                Err(_) => return Err(timeout(Op::List, self.inner.operation_timeout)),
                Ok(Err(e)) => return Err(map_kube(e, &self.ctx(Op::List))),
                Ok(Ok(list)) => list,
            };
        let current = list
            .items
            .iter()
            .find(|o| o.metadata.name.as_deref() == Some(self.key.as_str()));
        match current {
            None => {
                if matches!(self.seen, Seen::Present(_)) {
                    self.pending.push_back(Ok(WatchEvent::Deleted));
                }
                self.seen = Seen::Absent;
            }
            Some(obj) => {
                let version = mapping::object_version(obj);
                let changed = match (&self.seen, &version) {
                    (Seen::Present(seen), Some(v)) => seen != v,
                    _ => true,
                };
                if changed {
                    self.deliver_object(obj);
                }
            }
        }
        self.resume_from = list.metadata.resource_version.unwrap_or_default();
        if self.resume_from.is_empty() {
            return Err(Error::Store {
                store: STORE_NAME,
                message: "the API server listed Leases without a resourceVersion".into(),
                retryable: true,
                source: None,
            });
        }
        Ok(())
    }

    /// Queues a Put (or Corrupt) for `obj` and records it as delivered.
    fn deliver_object(&mut self, obj: &DynamicObject) {
        self.inner.remember(&self.key, obj);
        let version = mapping::object_version(obj);
        let ev = match mapping::object_to_versioned(&self.key, obj) {
            Ok(v) => WatchEvent::Put(v),
            Err(Error::Corrupt {
                reason, version, ..
            }) => WatchEvent::Corrupt { reason, version },
            Err(e) => WatchEvent::Corrupt {
                reason: e.to_string(),
                version: version.clone(),
            },
        };
        self.pending.push_back(Ok(ev));
        if let Some(v) = version {
            self.resume_from = v.as_str().to_owned();
            self.seen = Seen::Present(v);
        }
    }

    /// Opens a watch request from the resume point.
    async fn connect(&mut self) -> Result<()> {
        let secs = u32::try_from(self.inner.watch_timeout.as_secs()).unwrap_or(u32::MAX);
        let mut params = WatchParams::default()
            .fields(&self.selector())
            .timeout(secs);
        params.bookmarks = true;
        // At most one re-read: a resourceVersion fresh from a list is never expired on a sane
        // server.
        for attempt in 0..2 {
            let fut = self.inner.api.watch(&params, &self.resume_from);
            match tokio::time::timeout(self.inner.operation_timeout, fut).await {
                Err(_) => return Err(timeout(Op::Watch, self.inner.operation_timeout)),
                Ok(Err(kube::Error::Api(status))) if is_gone(&status) && attempt == 0 => {
                    // Some servers answer an expired resourceVersion with HTTP 410 directly.
                    self.relist().await?;
                }
                Ok(Err(e)) => return Err(map_kube(e, &self.ctx(Op::Watch))),
                Ok(Ok(stream)) => {
                    self.stream = Some(stream.boxed());
                    self.progressed = false;
                    return Ok(());
                }
            }
        }
        Err(Error::Unavailable {
            store: STORE_NAME,
            message: format!(
                "the API server answered 410 Gone to a watch on Lease {} from a fresh resourceVersion",
                self.key
            ),
            source: None,
        })
    }

    /// Ends the current watch request; decides whether to resume or give up.
    fn end_request(&mut self) -> Option<Error> {
        self.stream = None;
        if self.progressed {
            self.idle_reconnects = 0;
        } else {
            self.idle_reconnects += 1;
        }
        if self.idle_reconnects >= MAX_IDLE_RECONNECTS {
            return Some(Error::Unavailable {
                store: STORE_NAME,
                message: format!(
                    "the watch on Lease {} ended {MAX_IDLE_RECONNECTS} times in a row without delivering anything",
                    self.key
                ),
                source: None,
            });
        }
        None
    }

    fn fail(&mut self, e: Error) -> Option<Result<WatchEvent>> {
        self.done = true;
        self.stream = None;
        Some(Err(e))
    }

    async fn next_event(&mut self) -> Option<Result<WatchEvent>> {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return Some(ev);
            }
            if self.done {
                return None;
            }
            if self.stream.is_none() {
                if self.idle_reconnects > 0 {
                    // A short, bounded pause before resuming a watch that ended without news.
                    let pause = Duration::from_millis(50) * self.idle_reconnects;
                    tokio::time::sleep(pause).await;
                }
                if let Err(e) = self.connect().await {
                    return self.fail(e);
                }
            }
            let idle = self.inner.watch_timeout + self.inner.operation_timeout;
            let Some(stream) = self.stream.as_mut() else {
                continue;
            };
            let item = match tokio::time::timeout(idle, stream.try_next()).await {
                // Silent for too long: assume a dead connection and resume.
                Err(_) => None,
                Ok(Ok(None)) => None,
                Ok(Ok(Some(ev))) => Some(Ok(ev)),
                Ok(Err(e)) => Some(Err(e)),
            };
            match item {
                None => {
                    if let Some(e) = self.end_request() {
                        return self.fail(e);
                    }
                }
                Some(Err(e)) => {
                    let mapped = map_kube(e, &self.ctx(Op::Watch));
                    if !mapped.is_retryable() {
                        return self.fail(mapped);
                    }
                    tracing::debug!(key = %self.key, error = %mapped, "watch interrupted; resuming");
                    if let Some(e) = self.end_request() {
                        return self.fail(e);
                    }
                }
                Some(Ok(ev)) => {
                    self.progressed = true;
                    if let Err(e) = self.handle(ev).await {
                        return self.fail(e);
                    }
                }
            }
        }
    }

    async fn handle(&mut self, ev: KubeEvent<DynamicObject>) -> Result<()> {
        match ev {
            KubeEvent::Added(obj) | KubeEvent::Modified(obj) => {
                if obj.metadata.name.as_deref() == Some(self.key.as_str()) {
                    self.deliver_object(&obj);
                }
            }
            KubeEvent::Deleted(obj) => {
                if obj.metadata.name.as_deref() == Some(self.key.as_str()) {
                    self.inner.forget(&self.key);
                    if let Some(v) = mapping::object_version(&obj) {
                        self.resume_from = v.as_str().to_owned();
                    }
                    self.pending.push_back(Ok(WatchEvent::Deleted));
                    self.seen = Seen::Absent;
                }
            }
            KubeEvent::Bookmark(b) => {
                if !b.metadata.resource_version.is_empty() {
                    self.resume_from = b.metadata.resource_version;
                }
            }
            KubeEvent::Error(status) if is_gone(&status) => {
                tracing::debug!(key = %self.key, resume_from = %self.resume_from, "watch resourceVersion expired; re-reading");
                self.stream = None;
                self.relist().await?;
            }
            KubeEvent::Error(status) => {
                let e = map_status(&status, &self.ctx(Op::Watch));
                if !e.is_retryable() {
                    return Err(e);
                }
                if let Some(e) = self.end_request() {
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

fn is_gone(status: &Status) -> bool {
    status.code == 410 || status.reason == "Expired" || status.reason == "Gone"
}
