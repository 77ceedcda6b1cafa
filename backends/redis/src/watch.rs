//! Watch: pub/sub messages from the write scripts, re-read after every (re)subscription.
//!
//! Each watch owns one dedicated pub/sub connection (redis-rs's `PubSub`), subscribed to the
//! key's channel. Order of operations, so that nothing is lost:
//!
//! 1. `SUBSCRIBE` and wait for the confirmation;
//! 2. read the key and the namespace revision `R` in one script call, and deliver that state if
//!    it differs from what the caller already has (`after`);
//! 3. deliver every message with a version above the highest one seen (`R` or a later message),
//!    dropping older or equal ones: versions come from the namespace counter, so "older" is a
//!    plain number comparison, also across delete and re-create.
//!
//! Every write script publishes the new version **and** the record, so a change reaches the
//! watcher without another read. The connection is checked with `PING` every
//! `watch_ping_interval`; when it is lost the stream yields one retryable
//! [`leasehold::Error::Unavailable`] and the watch reconnects with backoff, re-subscribes and
//! re-reads (step 1 and 2), coalescing whatever it missed into the latest state. The task stops
//! when the stream is dropped.
//!
//! The buffer between the task and the stream is bounded ([`WATCH_BUFFER`] items). A consumer
//! that falls further behind gets the changes coalesced: the task keeps reading the connection,
//! holds only the latest state not yet delivered, and delivers it once there is room, so memory
//! stays bounded and an older state never follows a newer one. Error items that find the buffer
//! full are dropped (the consumer is behind anyway; the state that follows is the truth).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use leasehold::{LeaseKey, Version, Versioned, WatchEvent, WatchStream};
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::{OwnedPermit, Sender};
use tokio_stream::wrappers::ReceiverStream;

use crate::STORE;
use crate::store::{Inner, Raw, bounded};

/// How many items a watch stream buffers for a consumer that does not keep up; beyond that the
/// changes are coalesced into the latest state (see the module docs).
pub const WATCH_BUFFER: usize = 64;

type Item = leasehold::Result<WatchEvent>;

/// The sending side of a watch stream: a bounded channel and the latest state that did not fit.
struct Tx {
    tx: Sender<Item>,
    /// The newest event not yet delivered because the buffer was full. Later events replace it
    /// (coalescing), and nothing else is sent before it, so order is kept.
    pending: Option<WatchEvent>,
}

impl Tx {
    fn send(&mut self, ev: WatchEvent) {
        if self.pending.is_some() {
            self.pending = Some(ev);
            return;
        }
        match self.tx.try_send(Ok(ev)) {
            Ok(()) | Err(TrySendError::Closed(_)) => {}
            Err(TrySendError::Full(Ok(ev))) => self.pending = Some(ev),
            Err(TrySendError::Full(Err(_))) => {}
        }
    }

    fn error(&mut self, e: leasehold::Error) {
        if self.pending.is_none() {
            // A full buffer drops the error: the consumer is behind, the state that follows is
            // what counts.
            let _ = self.tx.try_send(Err(e));
        }
    }

    /// Waits for room for the pending event; never completes when there is none.
    async fn room(&self) -> Option<OwnedPermit<Item>> {
        if self.pending.is_none() {
            return std::future::pending().await;
        }
        self.tx.clone().reserve_owned().await.ok()
    }

    fn flush(&mut self, permit: Option<OwnedPermit<Item>>) {
        if let (Some(permit), Some(ev)) = (permit, self.pending.take()) {
            permit.send(Ok(ev));
        }
    }
}

const MIN_BACKOFF: Duration = Duration::from_millis(20);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// What the caller has been told about the key.
#[derive(Debug, PartialEq, Eq)]
enum Last {
    /// The key does not exist.
    Absent,
    /// The key holds data at this version (a record or corrupt data).
    At(Version),
}

struct Watcher {
    key: LeaseKey,
    last: Last,
    /// The highest namespace revision already reflected in what was delivered.
    floor: u64,
}

impl Watcher {
    fn emit(&self, tx: &mut Tx, ev: WatchEvent) {
        tx.send(ev);
    }

    fn put(&mut self, tx: &mut Tx, version: Version, data: &[u8]) {
        if self.last == Last::At(version.clone()) {
            return;
        }
        self.last = Last::At(version.clone());
        let ev = match leasehold::codec::decode(&self.key, data, Some(&version)) {
            Ok(record) => WatchEvent::Put(Versioned { record, version }),
            Err(e) => WatchEvent::Corrupt {
                reason: corrupt_reason(e),
                version: Some(version),
            },
        };
        self.emit(tx, ev);
    }

    fn deleted(&mut self, tx: &mut Tx) {
        if self.last != Last::Absent {
            self.last = Last::Absent;
            self.emit(tx, WatchEvent::Deleted);
        }
    }

    fn apply_read(&mut self, tx: &mut Tx, raw: Raw, rev: u64) {
        // The read is the current state: messages at or below its revision are older. (After a
        // restart that lost data the counter may restart lower; the read is still the truth.)
        self.floor = rev;
        match raw {
            Raw::None => self.deleted(tx),
            Raw::Record(version, data) => self.put(tx, version, &data),
            Raw::Foreign(version, kind) => {
                if self.last != Last::At(version.clone()) {
                    self.last = Last::At(version.clone());
                    self.emit(
                        tx,
                        WatchEvent::Corrupt {
                            reason: format!("expected a leasehold record, found a redis {kind}"),
                            version: Some(version),
                        },
                    );
                }
            }
        }
    }

    fn on_message(&mut self, tx: &mut Tx, payload: &[u8]) {
        let Some((kind, rest)) = split_once(payload, b':') else {
            tracing::warn!(key = %self.key, "watch: ignoring a malformed message");
            return;
        };
        let (num, data) = match kind {
            b"p" => match split_once(rest, b':') {
                Some((num, data)) => (num, Some(data)),
                None => {
                    tracing::warn!(key = %self.key, "watch: ignoring a malformed message");
                    return;
                }
            },
            b"d" => (rest, None),
            _ => {
                tracing::warn!(key = %self.key, "watch: ignoring a malformed message");
                return;
            }
        };
        let Some(n) = std::str::from_utf8(num)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
        else {
            tracing::warn!(key = %self.key, "watch: ignoring a message without a version");
            return;
        };
        if n <= self.floor {
            return;
        }
        self.floor = n;
        match data {
            Some(data) => self.put(tx, Version::from(n), data),
            None => self.deleted(tx),
        }
    }
}

fn corrupt_reason(e: leasehold::Error) -> String {
    match e {
        leasehold::Error::Corrupt { reason, .. } => reason,
        other => other.to_string(),
    }
}

fn split_once(b: &[u8], sep: u8) -> Option<(&[u8], &[u8])> {
    let i = b.iter().position(|&c| c == sep)?;
    Some((&b[..i], &b[i + 1..]))
}

/// Subscribes on the first node that answers, starting with the one that worked last (a
/// standalone server has one; a cluster's pub/sub reaches every node, so any seed will do).
async fn subscribe(inner: &Inner, channel: &str) -> leasehold::Result<(PubSubSink, PubSubStream)> {
    let limit = inner.config.connect_timeout + inner.config.operation_timeout;
    let n = inner.clients.len();
    let first = inner.pubsub_node.load(Ordering::Relaxed);
    let mut last_err = None;
    for i in 0..n {
        let node = (first + i) % n;
        let client = &inner.clients[node];
        let r = bounded("watch", limit, async {
            let (mut sink, stream) = client.get_async_pubsub().await?.split();
            sink.subscribe(channel).await?;
            Ok((sink, stream))
        })
        .await;
        match r {
            Ok(ok) => {
                inner.pubsub_node.store(node, Ordering::Relaxed);
                return Ok(ok);
            }
            Err(e) => last_err = Some(e),
        }
    }
    Err(last_err.unwrap_or_else(|| leasehold::Error::Unavailable {
        store: STORE,
        message: "watch: no redis node configured".into(),
        source: None,
    }))
}

/// Subscribes, reads, and spawns the task that feeds the returned stream.
pub(crate) async fn start(
    inner: Arc<Inner>,
    key: LeaseKey,
    after: Option<Version>,
) -> leasehold::Result<WatchStream> {
    let channel = inner.keys.channel(key.as_str());
    let (sink, stream) = subscribe(&inner, &channel).await?;
    let (raw, rev) = inner.read(&key).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(WATCH_BUFFER);
    let mut tx = Tx { tx, pending: None };
    let mut w = Watcher {
        key,
        last: after.map_or(Last::Absent, Last::At),
        floor: 0,
    };
    w.apply_read(&mut tx, raw, rev);
    tokio::spawn(run(inner, w, channel, sink, stream, tx));
    Ok(ReceiverStream::new(rx).boxed())
}

async fn run(
    inner: Arc<Inner>,
    mut w: Watcher,
    channel: String,
    mut sink: PubSubSink,
    mut stream: PubSubStream,
    mut tx: Tx,
) {
    let closed = tx.tx.clone();
    let ping_every = inner.config.watch_ping_interval;
    let ping_limit = inner.config.operation_timeout;
    loop {
        let mut ping =
            tokio::time::interval_at(tokio::time::Instant::now() + ping_every, ping_every);
        let lost = loop {
            tokio::select! {
                () = closed.closed() => return,
                permit = tx.room() => tx.flush(permit),
                msg = stream.next() => match msg {
                    Some(msg) => w.on_message(&mut tx, msg.get_payload_bytes()),
                    None => break "the connection was closed".to_owned(),
                },
                _ = ping.tick() => {
                    match tokio::time::timeout(ping_limit, sink.ping::<redis::Value>()).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => break format!("ping failed: {e}"),
                        Err(_) => break format!("ping got no answer within {ping_limit:?}"),
                    }
                }
            }
        };
        tracing::debug!(key = %w.key, reason = %lost, "watch connection lost; reconnecting");
        tx.error(leasehold::Error::Unavailable {
            store: STORE,
            message: format!("watch of {:?}: {lost}; reconnecting", w.key.as_str()),
            source: None,
        });
        let mut backoff = MIN_BACKOFF;
        loop {
            let attempt = async {
                let (s, st) = subscribe(&inner, &channel).await?;
                let (raw, rev) = inner.read(&w.key).await?;
                Ok::<_, leasehold::Error>((s, st, raw, rev))
            };
            let result = tokio::select! {
                () = closed.closed() => return,
                r = attempt => r,
            };
            match result {
                Ok((s, st, raw, rev)) => {
                    sink = s;
                    stream = st;
                    w.apply_read(&mut tx, raw, rev);
                    tracing::debug!(key = %w.key, "watch resubscribed");
                    break;
                }
                Err(e) => {
                    tracing::debug!(key = %w.key, error = %e, "watch reconnect failed");
                    tokio::select! {
                        () = closed.closed() => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }
}
