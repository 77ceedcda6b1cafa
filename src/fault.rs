//! Fault injection for tests: [`FaultyStore`] wraps any store and adds latency, errors,
//! partitions, and request counting.
//!
//! Several `FaultyStore`s over one inner store behave like several clients of one server: a
//! partition of one handle makes that handle fail while the others keep working.
//!
//! ```
//! # async fn demo() {
//! use std::sync::Arc;
//! use leasehold::{MemoryStore, fault::FaultyStore};
//! let shared = Arc::new(MemoryStore::new());
//! let a = FaultyStore::new(shared.clone());
//! let b = FaultyStore::new(shared);
//! a.faults().set_partitioned(true); // a's operations now fail; b's work
//! # }
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::{Error, Result};
use crate::store::{
    Acquired, Capabilities, DynLeaseStore, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, Version,
    Versioned, WatchStream,
};

#[derive(Debug, Default)]
struct FaultState {
    latency: Duration,
    fail_next: u64,
    fail_until: Option<Instant>,
}

/// The fault controls of one [`FaultyStore`] handle. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Faults {
    state: Arc<Mutex<FaultState>>,
    partitioned: Arc<watch::Sender<bool>>,
    requests: Arc<AtomicU64>,
    writes: Arc<AtomicU64>,
}

// === impl Faults ===

impl Faults {
    fn new() -> Self {
        Faults {
            state: Arc::default(),
            partitioned: Arc::new(watch::Sender::new(false)),
            requests: Arc::default(),
            writes: Arc::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FaultState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `latency` before every operation (and before each watch event is delivered).
    pub fn set_latency(&self, latency: Duration) {
        self.lock().latency = latency;
    }

    /// Makes the next `n` operations fail with [`Error::Unavailable`].
    pub fn fail_next(&self, n: u64) {
        self.lock().fail_next = n;
    }

    /// Makes every operation fail with [`Error::Unavailable`] for `window` from now (any
    /// duration; one too large to represent means "until healed").
    pub fn fail_for(&self, window: Duration) {
        self.lock().fail_until = Some(crate::status::instant_after(Instant::now(), window));
    }

    /// Cuts this handle off (or reconnects it): while partitioned every operation fails with
    /// [`Error::Unavailable`] and open watch streams end with an error.
    pub fn set_partitioned(&self, partitioned: bool) {
        self.partitioned.send_replace(partitioned);
    }

    /// Clears every fault.
    pub fn heal(&self) {
        *self.lock() = FaultState::default();
        self.set_partitioned(false);
    }

    /// How many operations (of any kind, failed or not) this handle has been asked to do.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// How many writes (`create`, `update`, `delete`) this handle has been asked to do.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    async fn before(&self, store: &'static str, op: &'static str) -> Result<()> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if matches!(op, "create" | "update" | "delete") {
            self.writes.fetch_add(1, Ordering::Relaxed);
        }
        let latency = self.lock().latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let injected = {
            let mut st = self.lock();
            if st.fail_next > 0 {
                st.fail_next -= 1;
                Some("an injected failure")
            } else if st.fail_until.is_some_and(|t| Instant::now() < t) {
                Some("an injected failure window")
            } else {
                None
            }
        };
        if *self.partitioned.borrow() {
            return Err(Error::Unavailable {
                store,
                message: format!("{op}: this handle is partitioned from the store (injected)"),
                source: None,
            });
        }
        if let Some(what) = injected {
            return Err(Error::Unavailable {
                store,
                message: format!("{op}: {what}"),
                source: None,
            });
        }
        Ok(())
    }
}

/// A store wrapper that injects faults and counts requests. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct FaultyStore {
    inner: DynLeaseStore,
    faults: Faults,
    capabilities: Option<Capabilities>,
}

// === impl FaultyStore ===

impl FaultyStore {
    /// Wraps `inner` with no faults active.
    pub fn new(inner: DynLeaseStore) -> Self {
        FaultyStore {
            inner,
            faults: Faults::new(),
            capabilities: None,
        }
    }

    /// Reports `capabilities` instead of the wrapped store's (to test how the elector reacts
    /// to them).
    pub fn with_capabilities(mut self, capabilities: Capabilities) -> Self {
        self.capabilities = Some(capabilities);
        self
    }

    /// This handle's fault controls.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// The wrapped store.
    pub fn inner(&self) -> &DynLeaseStore {
        &self.inner
    }
}

#[async_trait]
impl LeaseStore for FaultyStore {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.capabilities
            .unwrap_or_else(|| self.inner.capabilities())
    }
    async fn get(&self, key: &LeaseKey) -> Result<Option<Versioned>> {
        self.faults.before(self.name(), "get").await?;
        self.inner.get(key).await
    }
    async fn create(&self, key: &LeaseKey, record: &LeaseRecord) -> Result<Version> {
        self.faults.before(self.name(), "create").await?;
        self.inner.create(key, record).await
    }
    async fn update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> Result<Version> {
        self.faults.before(self.name(), "update").await?;
        self.inner.update(key, record, expected).await
    }
    async fn delete(&self, key: &LeaseKey, expected: &Version) -> Result<()> {
        self.faults.before(self.name(), "delete").await?;
        self.inner.delete(key, expected).await
    }
    async fn watch(&self, key: &LeaseKey, after: Option<&Version>) -> Result<WatchStream> {
        self.faults.before(self.name(), "watch").await?;
        let mut inner = self.inner.watch(key, after).await?;
        let mut partitioned = self.faults.partitioned.subscribe();
        let faults = self.faults.clone();
        let store = self.name();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    cut = async { partitioned.wait_for(|p| *p).await.is_ok() } => {
                        if cut {
                            let _ = tx
                                .send(Err(Error::Unavailable {
                                    store,
                                    message: "watch: this handle is partitioned from the store (injected)".into(),
                                    source: None,
                                }))
                                .await;
                        }
                        return;
                    }
                    item = inner.next() => {
                        let Some(item) = item else { return };
                        let latency = faults.lock().latency;
                        if !latency.is_zero() {
                            tokio::time::sleep(latency).await;
                        }
                        if tx.send(item).await.is_err() {
                            return;
                        }
                    }
                    () = tx.closed() => return,
                }
            }
        });
        Ok(ReceiverStream::new(rx).boxed())
    }
    async fn list(&self, prefix: &KeyPrefix) -> Result<Vec<(LeaseKey, Versioned)>> {
        self.faults.before(self.name(), "list").await?;
        self.inner.list(prefix).await
    }

    async fn acquire(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: Option<&Version>,
    ) -> Result<Acquired> {
        self.faults.before(self.name(), "acquire").await?;
        self.inner.acquire(key, record, expected).await
    }

    async fn fencing_seed(&self, key: &LeaseKey) -> Result<u64> {
        self.faults.before(self.name(), "fencing_seed").await?;
        self.inner.fencing_seed(key).await
    }
}
