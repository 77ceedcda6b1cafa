//! Watching one key with etcd's watch API, resuming after compaction and broken streams.
//!
//! A watch starts at revision `after + 1` (or, without `after`, reads the current state at
//! revision `R` and watches from `R + 1`), so nothing between a `get` and the watch is lost.
//! A background task forwards etcd's events into the returned stream. When etcd reports that
//! the next revision was compacted, or the stream breaks (member restart, lost leader,
//! connection reset), the task re-reads the key and resumes: from the next unseen revision if
//! it is still available, otherwise from the revision of the re-read, delivering the latest
//! state if it differs from the last one delivered. Every event carries the key's
//! `mod_revision`; nothing at or below the last delivered revision is delivered again, so an
//! older state never follows a newer one. A failed reconnection is delivered as an `Err` item
//! (retryable ones are then retried; a permission or certificate error ends the stream). The
//! task ends when the stream is dropped.
//!
//! Reopening backs off with jitter (50 ms doubling to 2 s) after every failed attempt and
//! after every stream that ended without delivering an event within 2 s, so a server or proxy
//! that accepts watches and ends them at once is not hammered; after a healthy stream the
//! first reopen is immediate. Events pass through a bounded buffer of 16 items.

use std::time::Duration;

use etcd_client::{EventType, WatchOptions, WatchResponse};
use futures::StreamExt;
use leasehold::{Error, LeaseKey, Result, Version, WatchEvent, WatchStream};
use tokio::sync::mpsc;

use crate::STORE;
use crate::error::from_status;
use crate::store::{EtcdStore, decode_kv, revision};

const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// A stream that lived this long (or delivered an event) was healthy: the next reopen after it
/// ends is immediate and the backoff starts over.
const HEALTHY_AFTER: Duration = MAX_BACKOFF;
/// Items buffered between the background task and the consumer; the task waits when it is
/// full (etcd then holds further events on its side), so memory stays bounded.
const BUFFER: usize = 16;

/// Bounded exponential backoff with jitter between reopen attempts: none after a healthy
/// stream, then 50 ms doubling up to 2 s per consecutive failure (a failed reopen, or a stream
/// that ended early without delivering anything), each delay drawn from its upper half.
#[derive(Debug, Default)]
struct Backoff {
    failures: u32,
}

impl Backoff {
    /// The wait before the next attempt, if any.
    fn delay(&self) -> Option<Duration> {
        let n = self.failures.checked_sub(1)?;
        let cap = MIN_BACKOFF
            .checked_mul(1u32 << n.min(16))
            .map_or(MAX_BACKOFF, |d| d.min(MAX_BACKOFF));
        Some(rand::random_range(cap / 2..=cap))
    }

    fn failed(&mut self) {
        self.failures = self.failures.saturating_add(1);
    }

    fn reset(&mut self) {
        self.failures = 0;
    }
}

/// How the open stream fared, to tell a healthy stream from one that ends at once.
struct Lifetime {
    opened: tokio::time::Instant,
    delivered: bool,
}

impl Lifetime {
    fn start() -> Self {
        Lifetime {
            opened: tokio::time::Instant::now(),
            delivered: false,
        }
    }

    fn healthy(&self) -> bool {
        self.delivered || self.opened.elapsed() >= HEALTHY_AFTER
    }
}

/// What the consumer has been told so far.
struct State {
    /// Every change up to this revision is reflected in what was delivered (or was known to
    /// the caller through `after`).
    last: i64,
    /// Whether the key existed in the last delivered state (`None`: nothing known yet).
    present: Option<bool>,
    /// The next (re)start must re-read the key first (compaction or first start without
    /// `after`).
    resync: bool,
}

enum Opened {
    Stream(Box<etcd_client::WatchStream>),
    Compacted,
}

type Tx = mpsc::Sender<Result<WatchEvent>>;

pub(crate) async fn start(
    store: EtcdStore,
    key: LeaseKey,
    after: Option<Version>,
) -> Result<WatchStream> {
    let (tx, rx) = mpsc::channel(BUFFER);
    let mut st = match after.as_ref() {
        Some(v) => match revision(v) {
            Some(rev) => State {
                last: rev,
                present: Some(true),
                resync: false,
            },
            // Not a revision of ours: treat the caller as having seen "some record".
            None => State {
                last: 0,
                present: Some(true),
                resync: true,
            },
        },
        None => State {
            last: 0,
            present: None,
            resync: true,
        },
    };
    // Establish the first watch here so that errors (unreachable, permission denied) surface
    // from `watch` itself.
    let stream = establish(&store, &key, &mut st, &tx).await?;
    tokio::spawn(run(store, key, st, Some(stream), tx));
    let out = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Ok(out.boxed())
}

/// Re-reads if needed and opens a watch from the next unseen revision. Bounded: every step has
/// the operation timeout, and compaction races are retried a few times only.
async fn establish(
    store: &EtcdStore,
    key: &LeaseKey,
    st: &mut State,
    tx: &Tx,
) -> Result<etcd_client::WatchStream> {
    for _ in 0..5 {
        if st.resync {
            resync(store, key, st, tx).await?;
            st.resync = false;
        }
        match open(store, key, st.last + 1).await? {
            Opened::Stream(s) => return Ok(*s),
            Opened::Compacted => st.resync = true,
        }
    }
    Err(store.at_endpoints(Error::Unavailable {
        store: STORE,
        message: format!("watch {key}: the revision history kept being compacted under the watch"),
        source: None,
    }))
}

/// Reads the key and delivers its state if it is newer than what was delivered.
async fn resync(store: &EtcdStore, key: &LeaseKey, st: &mut State, tx: &Tx) -> Result<()> {
    let resp = store
        .bounded("watch", || {
            let (mut kv, k) = (store.client.kv_client(), store.etcd_key(key));
            async move { kv.get(k, None).await }
        })
        .await?;
    let header = resp.header().map(|h| h.revision()).unwrap_or_default();
    match resp.kvs().first() {
        Some(kv) => {
            if kv.mod_revision() > st.last || st.present != Some(true) {
                let ev = to_event(key, kv);
                st.present = Some(true);
                let _ = tx.send(Ok(ev)).await;
            }
        }
        None => {
            if st.present == Some(true) {
                let _ = tx.send(Ok(WatchEvent::Deleted)).await;
            }
            st.present = Some(false);
        }
    }
    st.last = st.last.max(header);
    Ok(())
}

/// Opens a watch starting at revision `from` and waits for etcd to confirm it.
async fn open(store: &EtcdStore, key: &LeaseKey, from: i64) -> Result<Opened> {
    let options = WatchOptions::new().with_start_revision(from);
    let (stream, first) = store
        .bounded("watch", || {
            let (mut wc, k, options) = (
                store.client.watch_client(),
                store.etcd_key(key),
                options.clone(),
            );
            async move {
                let mut stream = wc.watch(k, Some(options)).await?;
                let first = stream.message().await?;
                Ok((stream, first))
            }
        })
        .await?;
    let Some(resp) = first else {
        return Err(store.at_endpoints(Error::Unavailable {
            store: STORE,
            message: format!("watch {key}: the stream ended before the watch was created"),
            source: None,
        }));
    };
    if resp.compact_revision() > 0 {
        return Ok(Opened::Compacted);
    }
    if resp.canceled() {
        return Err(store.at_endpoints(canceled(key, &resp)));
    }
    Ok(Opened::Stream(Box::new(stream)))
}

fn canceled(key: &LeaseKey, resp: &WatchResponse) -> Error {
    let reason = resp.cancel_reason();
    let code = if reason.contains("permission denied") {
        7 // PERMISSION_DENIED
    } else {
        14 // UNAVAILABLE: no leader, server shutting down, ...
    };
    let message = if reason.is_empty() {
        format!("watch on {key} was canceled by the server")
    } else {
        format!("watch on {key} was canceled: {reason}")
    };
    from_status("watch", code, &message)
}

fn to_event(key: &LeaseKey, kv: &etcd_client::KeyValue) -> WatchEvent {
    match decode_kv(key, kv) {
        Ok(v) => WatchEvent::Put(v),
        Err(Error::Corrupt {
            reason, version, ..
        }) => WatchEvent::Corrupt { reason, version },
        Err(other) => WatchEvent::Corrupt {
            reason: other.to_string(),
            version: Some(Version::from(kv.mod_revision())),
        },
    }
}

async fn run(
    store: EtcdStore,
    key: LeaseKey,
    mut st: State,
    mut stream: Option<etcd_client::WatchStream>,
    tx: Tx,
) {
    let mut backoff = Backoff::default();
    let mut life = Lifetime::start();
    loop {
        let Some(s) = stream.as_mut() else {
            if let Some(delay) = backoff.delay() {
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            let attempt = tokio::select! {
                _ = tx.closed() => return,
                r = establish(&store, &key, &mut st, &tx) => r,
            };
            match attempt {
                Ok(s) => {
                    tracing::debug!(key = %key, from = st.last + 1, "etcd watch resumed");
                    stream = Some(s);
                    life = Lifetime::start();
                }
                Err(e) => {
                    let retry = e.is_retryable();
                    tracing::debug!(key = %key, error = %e, "etcd watch could not resume");
                    if tx.send(Err(e)).await.is_err() || !retry {
                        return;
                    }
                    backoff.failed();
                }
            }
            continue;
        };
        let msg = tokio::select! {
            _ = tx.closed() => return,
            m = s.message() => m,
        };
        let ended = match msg {
            Ok(Some(resp)) => {
                if resp.compact_revision() > 0 {
                    tracing::debug!(key = %key, compact_revision = resp.compact_revision(), "etcd watch fell behind a compaction; re-reading");
                    st.resync = true;
                    true
                } else if resp.canceled() {
                    let e = store.at_endpoints(canceled(&key, &resp));
                    tracing::debug!(key = %key, error = %e, "etcd watch canceled");
                    if !e.is_retryable() {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                    true
                } else {
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        if kv.mod_revision() <= st.last {
                            continue;
                        }
                        st.last = kv.mod_revision();
                        let item = match ev.event_type() {
                            EventType::Put => {
                                st.present = Some(true);
                                to_event(&key, kv)
                            }
                            EventType::Delete => {
                                st.present = Some(false);
                                WatchEvent::Deleted
                            }
                        };
                        life.delivered = true;
                        if tx.send(Ok(item)).await.is_err() {
                            return;
                        }
                    }
                    false
                }
            }
            Ok(None) => {
                tracing::debug!(key = %key, "etcd watch stream ended; resuming");
                true
            }
            Err(e) => {
                tracing::debug!(key = %key, error = %crate::error::chain(&e), "etcd watch stream broke; resuming");
                true
            }
        };
        if ended {
            stream = None;
            // A stream that ends at once without delivering anything (a member that accepts
            // watches and drops them, a proxy that cuts connections) must not make the task
            // reopen in a tight loop.
            if life.healthy() {
                backoff.reset();
            } else {
                backoff.failed();
            }
        }
    }
}
