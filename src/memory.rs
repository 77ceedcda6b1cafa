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

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::error::{Error, Result};
use crate::store::{
    Capabilities, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, Version, Versioned, WatchEvent,
    WatchStream,
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
    entries: BTreeMap<LeaseKey, Entry>,
    // Events are boxed so that an idle watcher's channel block stays small.
    watchers: HashMap<LeaseKey, Vec<mpsc::UnboundedSender<Box<WatchEvent>>>>,
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

fn notify(st: &mut State, key: &LeaseKey, ev: WatchEvent) {
    if let Some(list) = st.watchers.get_mut(key) {
        list.retain(|tx| tx.send(Box::new(ev.clone())).is_ok());
        if list.is_empty() {
            st.watchers.remove(key);
        }
    }
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
        Capabilities::WATCH
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
        let (tx, rx) = mpsc::unbounded_channel();
        let mut st = self.lock();
        match (st.entries.get(key), after) {
            (Some(e), Some(v)) if Some(e.revision) == parse_version(v) => {}
            (Some(e), _) => {
                let _ = tx.send(Box::new(entry_event(key, e)));
            }
            (None, Some(_)) => {
                let _ = tx.send(Box::new(WatchEvent::Deleted));
            }
            (None, None) => {}
        }
        st.watchers.entry(key.clone()).or_default().push(tx);
        Ok(UnboundedReceiverStream::new(rx).map(|ev| Ok(*ev)).boxed())
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

    /// One above the store-wide revision: every accepted write raises the revision, and deleting
    /// a key does not lower it.
    async fn fencing_seed(&self, key: &LeaseKey) -> Result<u64> {
        let _ = key;
        Ok(self.lock().revision.saturating_add(1))
    }
}
