//! [`MemoryStore`]: the embedded, always-compiled store, and the test bed.
//!
//! It implements the whole [`LeaseStore`] contract, watch and list included, in one process.
//! Versions are a store-wide revision counter (like etcd's), so every write gets a new version.
//! Wrap it in a [`FaultyStore`](crate::fault::FaultyStore) to add latency, errors and partitions.
//!
//! ```
//! # async fn demo() -> leasehold::Result<()> {
//! use leasehold::{LeaseKey, LeaseStore, MemoryStore};
//! let store = MemoryStore::new();
//! assert!(store.get(&LeaseKey::new("my-lease")?).await?.is_none());
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use async_trait::async_trait;
use futures::StreamExt;
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::store::{
    Acquired, Capabilities, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, Version, Versioned,
    WatchEvent, WatchStream,
};

#[derive(Clone, Debug)]
enum Value {
    Record(LeaseRecord),
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    Corrupt(String),
}

#[derive(Clone, Debug)]
struct Entry {
    value: Value,
    revision: u64,
}

#[derive(Default, Debug)]
struct State {
    revision: u64,
    /// The highest fencing token assigned at commit or written into any record (store-wide, so
    /// it survives deletes).
    last_token: u64,
    entries: BTreeMap<LeaseKey, Entry>,
    // Events are boxed so that an idle watcher's channel block stays small.
    watchers: HashMap<LeaseKey, Vec<Watcher>>,
}

/// An in-process lease store. Cheap to clone; clones share the same data.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
}

// === impl MemoryStore ===

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere while holding it; the map is still
        // consistent because every mutation is a single insert/remove.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Test helper: replaces whatever is under `key` with data that is not a lease record, as a
    /// foreign writer would. Reads then fail with [`Error::Corrupt`].
    #[cfg(feature = "testing")]
    #[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
    pub fn write_corrupt(&self, key: &LeaseKey, reason: &str) -> Version {
        let mut st = self.lock();
        st.revision += 1;
        let revision = st.revision;
        st.entries.insert(
            key.clone(),
            Entry {
                value: Value::Corrupt(reason.to_owned()),
                revision,
            },
        );
        let ev = WatchEvent::Corrupt {
            reason: reason.to_owned(),
            version: Some(Version::from(revision)),
        };
        notify(&mut st, key, ev);
        Version::from(revision)
    }
}

/// How many changes a watcher may have queued; past that, newer changes are coalesced into the
/// latest state (delivered after the queued ones), as the store contract allows.
pub const WATCH_BUFFER: usize = 64;

/// What a watcher has not delivered yet. One lock covers both the queue and the coalesced
/// latest state, so the receiver can never take the latest state while older changes are being
/// queued (that would deliver an older state after a newer one).
#[derive(Debug, Default)]
struct Pending {
    queue: VecDeque<Box<WatchEvent>>,
    /// The latest change that did not fit in the queue; newer than everything queued.
    overflow: Option<Box<WatchEvent>>,
    /// The store side is gone: nothing more will come after what is pending.
    closed: bool,
}

#[derive(Debug, Default)]
struct Channel {
    pending: Mutex<Pending>,
    ready: Notify,
}

impl Channel {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The store's side of one watch; the stream holds the only strong reference to the channel.
#[derive(Debug)]
struct Watcher {
    channel: Weak<Channel>,
}

impl Watcher {
    /// Queues `ev`; false once the receiver is gone.
    fn send(&self, ev: WatchEvent) -> bool {
        let Some(channel) = self.channel.upgrade() else {
            return false;
        };
        {
            let mut p = channel.lock();
            if p.overflow.is_some() || p.queue.len() >= WATCH_BUFFER {
                // Keep the order: once something overflowed, newer changes coalesce behind it.
                p.overflow = Some(Box::new(ev));
            } else {
                p.queue.push_back(Box::new(ev));
            }
        }
        channel.ready.notify_one();
        true
    }

    fn is_closed(&self) -> bool {
        self.channel.strong_count() == 0
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        if let Some(channel) = self.channel.upgrade() {
            channel.lock().closed = true;
            channel.ready.notify_one();
        }
    }
}

fn notify(st: &mut State, key: &LeaseKey, ev: WatchEvent) {
    if let Some(list) = st.watchers.get_mut(key) {
        list.retain(|w| w.send(ev.clone()));
        if list.is_empty() {
            st.watchers.remove(key);
        }
    }
}

/// The receiving side: queued changes in order, then the coalesced latest one; ends once the
/// store is gone and everything pending was delivered.
fn watch_stream(channel: Arc<Channel>) -> WatchStream {
    futures::stream::unfold(channel, |channel| async move {
        loop {
            let next = {
                let mut p = channel.lock();
                match p.queue.pop_front().or_else(|| p.overflow.take()) {
                    Some(ev) => Some(ev),
                    None if p.closed => return None,
                    None => None,
                }
            };
            if let Some(ev) = next {
                return Some((Ok(*ev), channel));
            }
            // A permit stored by a send after the lock was released makes this return at once.
            channel.ready.notified().await;
        }
    })
    .boxed()
}

fn entry_event(key: &LeaseKey, e: &Entry) -> WatchEvent {
    let _ = key;
    match &e.value {
        Value::Record(r) => WatchEvent::Put(Versioned {
            record: r.clone(),
            version: Version::from(e.revision),
        }),
        Value::Corrupt(reason) => WatchEvent::Corrupt {
            reason: reason.clone(),
            version: Some(Version::from(e.revision)),
        },
    }
}

fn parse_version(v: &Version) -> Option<u64> {
    v.as_str().parse().ok()
}

#[async_trait]
impl LeaseStore for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::WATCH.with_commit_tokens()
    }

    async fn get(&self, key: &LeaseKey) -> Result<Option<Versioned>> {
        let st = self.lock();
        match st.entries.get(key) {
            None => Ok(None),
            Some(Entry {
                value: Value::Record(r),
                revision,
            }) => Ok(Some(Versioned {
                record: r.clone(),
                version: Version::from(*revision),
            })),
            Some(Entry {
                value: Value::Corrupt(reason),
                revision,
            }) => Err(Error::Corrupt {
                key: key.to_string(),
                reason: reason.clone(),
                version: Some(Version::from(*revision)),
            }),
        }
    }

    async fn create(&self, key: &LeaseKey, record: &LeaseRecord) -> Result<Version> {
        let mut st = self.lock();
        if st.entries.contains_key(key) {
            return Err(Error::AlreadyExists {
                key: key.to_string(),
            });
        }
        st.revision += 1;
        st.last_token = st.last_token.max(record.transitions);
        let revision = st.revision;
        let entry = Entry {
            value: Value::Record(record.clone()),
            revision,
        };
        let ev = entry_event(key, &entry);
        st.entries.insert(key.clone(), entry);
        notify(&mut st, key, ev);
        Ok(Version::from(revision))
    }

    async fn update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> Result<Version> {
        let mut st = self.lock();
        let Some(current) = st.entries.get(key) else {
            return Err(Error::NotFound {
                key: key.to_string(),
            });
        };
        if Some(current.revision) != parse_version(expected) {
            return Err(Error::Conflict {
                key: key.to_string(),
                expected: expected.clone(),
            });
        }
        st.revision += 1;
        st.last_token = st.last_token.max(record.transitions);
        let revision = st.revision;
        let entry = Entry {
            value: Value::Record(record.clone()),
            revision,
        };
        let ev = entry_event(key, &entry);
        st.entries.insert(key.clone(), entry);
        notify(&mut st, key, ev);
        Ok(Version::from(revision))
    }

    async fn delete(&self, key: &LeaseKey, expected: &Version) -> Result<()> {
        let mut st = self.lock();
        let Some(current) = st.entries.get(key) else {
            return Err(Error::NotFound {
                key: key.to_string(),
            });
        };
        if Some(current.revision) != parse_version(expected) {
            return Err(Error::Conflict {
                key: key.to_string(),
                expected: expected.clone(),
            });
        }
        st.revision += 1;
        st.entries.remove(key);
        notify(&mut st, key, WatchEvent::Deleted);
        Ok(())
    }

    async fn watch(&self, key: &LeaseKey, after: Option<&Version>) -> Result<WatchStream> {
        let channel = Arc::new(Channel::default());
        let watcher = Watcher {
            channel: Arc::downgrade(&channel),
        };
        let mut st = self.lock();
        match (st.entries.get(key), after) {
            (Some(e), Some(v)) if Some(e.revision) == parse_version(v) => {}
            (Some(e), _) => {
                watcher.send(entry_event(key, e));
            }
            (None, Some(_)) => {
                watcher.send(WatchEvent::Deleted);
            }
            (None, None) => {}
        }
        let list = st.watchers.entry(key.clone()).or_default();
        // Drop watchers whose receiver is gone (a leader re-opens its watch every term).
        list.retain(|w| !w.is_closed());
        list.push(watcher);
        Ok(watch_stream(channel))
    }

    async fn list(&self, prefix: &KeyPrefix) -> Result<Vec<(LeaseKey, Versioned)>> {
        let st = self.lock();
        let out = st
            .entries
            .range(..)
            .filter(|(k, _)| k.has_prefix(prefix))
            .filter_map(|(k, e)| match &e.value {
                Value::Record(r) => Some((
                    k.clone(),
                    Versioned {
                        record: r.clone(),
                        version: Version::from(e.revision),
                    },
                )),
                Value::Corrupt(reason) => {
                    tracing::warn!(key = %k, reason, "list: leaving out a key with corrupt data");
                    None
                }
            })
            .collect();
        Ok(out)
    }

    /// The token is one above the largest of: the store-wide revision, every token assigned or
    /// written into a record before (by anyone), and the replaced record's token; and at least
    /// the record's `transitions` (the caller's floor). Neither source goes back, also when a key is deleted, so
    /// a token is never assigned twice while the process lives.
    async fn acquire(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: Option<&Version>,
    ) -> Result<Acquired> {
        let mut st = self.lock();
        let replaced = match (st.entries.get(key), expected) {
            (Some(_), None) => {
                return Err(Error::AlreadyExists {
                    key: key.to_string(),
                });
            }
            (None, Some(_)) => {
                return Err(Error::NotFound {
                    key: key.to_string(),
                });
            }
            (None, None) => 0,
            (Some(current), Some(expected)) => {
                if Some(current.revision) != parse_version(expected) {
                    return Err(Error::Conflict {
                        key: key.to_string(),
                        expected: expected.clone(),
                    });
                }
                match &current.value {
                    Value::Record(r) => r.transitions,
                    Value::Corrupt(_) => 0,
                }
            }
        };
        let floor = st.revision.max(st.last_token).max(replaced);
        let token = floor
            .checked_add(1)
            .map(|t| t.max(record.transitions))
            .ok_or_else(|| Error::TokenExhausted {
                key: key.to_string(),
                last: floor,
            })?;
        st.last_token = token;
        st.revision += 1;
        let revision = st.revision;
        let entry = Entry {
            value: Value::Record(LeaseRecord {
                transitions: token,
                ..record.clone()
            }),
            revision,
        };
        let ev = entry_event(key, &entry);
        st.entries.insert(key.clone(), entry);
        notify(&mut st, key, ev);
        Ok(Acquired {
            version: Version::from(revision),
            fencing_token: token,
        })
    }

    /// One above the store-wide revision: every accepted write raises the revision, and deleting
    /// a key does not lower it.
    async fn fencing_seed(&self, key: &LeaseKey) -> Result<u64> {
        let st = self.lock();
        let last = st.revision.max(st.last_token);
        last.checked_add(1).ok_or_else(|| Error::TokenExhausted {
            key: key.to_string(),
            last,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    fn record(transitions: u64) -> LeaseRecord {
        LeaseRecord {
            holder_identity: "a".into(),
            lease_duration: Duration::from_secs(1),
            acquire_time: Some(SystemTime::UNIX_EPOCH),
            renew_time: Some(SystemTime::UNIX_EPOCH),
            transitions,
        }
    }

    /// A watch that is not read buffers at most WATCH_BUFFER changes plus the coalesced latest
    /// one, in order, and never an older state after a newer one.
    #[tokio::test]
    async fn an_unread_watch_buffers_a_bounded_number_of_changes() {
        let store = MemoryStore::new();
        let key = LeaseKey::new("bounded").expect("valid");
        let mut v = store.create(&key, &record(0)).await.expect("created");
        let mut w = store.watch(&key, Some(&v)).await.expect("watch");
        let writes = WATCH_BUFFER as u64 * 4;
        for t in 1..=writes {
            v = store.update(&key, &record(t), &v).await.expect("updated");
        }
        let mut seen = Vec::new();
        while let Ok(Some(item)) = tokio::time::timeout(Duration::from_millis(50), w.next()).await {
            match item.expect("ok") {
                WatchEvent::Put(p) => seen.push(p.record.transitions),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(seen.len(), WATCH_BUFFER + 1, "{seen:?}");
        assert!(seen.windows(2).all(|w| w[0] < w[1]), "in order: {seen:?}");
        assert_eq!(seen.last(), Some(&writes), "ends with the latest state");
    }

    /// A store watch never goes backwards, also while a writer refills the queue as fast as
    /// the reader drains it (issue 18, schedule 8: the coalesced latest state was taken under a
    /// second lock, after older changes had been queued behind the reader's back).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watch_never_delivers_an_older_state_after_a_newer_one() {
        const WRITES: u64 = 200_000;
        let store = MemoryStore::new();
        let key = LeaseKey::new("monotonic").expect("valid");
        let v0 = store.create(&key, &record(0)).await.expect("created");
        let mut w = store.watch(&key, Some(&v0)).await.expect("watch");
        // The writer hammers on its own thread, as fast as it can.
        let writer = std::thread::spawn({
            let (store, key) = (store.clone(), key.clone());
            move || {
                let mut v = v0;
                for t in 1..=WRITES {
                    v = futures::executor::block_on(store.update(&key, &record(t), &v))
                        .expect("updated");
                }
            }
        });
        let (mut last, mut delivered, mut backwards) = (0, 0u64, Vec::new());
        while last < WRITES {
            let item = tokio::time::timeout(Duration::from_secs(120), w.next())
                .await
                .expect("hang guard: the latest state is delivered")
                .expect("the watch stays open");
            let WatchEvent::Put(p) = item.expect("no error") else {
                panic!("only updates were written");
            };
            let t = p.record.transitions;
            if t <= last {
                backwards.push((last, t));
            }
            last = last.max(t);
            delivered += 1;
            // A reader slower than the writer: the queue fills and overflows again and again.
            if delivered % 16 == 0 {
                tokio::task::yield_now().await;
            }
        }
        writer.join().expect("the writer finished");
        assert!(
            backwards.is_empty(),
            "{} of {delivered} deliveries went back (newest seen, then delivered), first: {:?}",
            backwards.len(),
            &backwards[..backwards.len().min(5)]
        );
    }
}
