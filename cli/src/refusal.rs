//! A store wrapper that notices refusals: credentials rejected or a permission denied.
//!
//! The elector retries every failure, as it should for an unreachable store; but a store that
//! refuses this candidate's credentials or lacks an RBAC permission will never let it lead, so
//! `leasehold run` exits (code 77) on the first refusal instead of waiting forever.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use leasehold::{
    Capabilities, DynLeaseStore, Error, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, Result,
    Version, Versioned, WatchStream,
};
use tokio::sync::Notify;

/// Where refusals are reported.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    first: Mutex<Option<String>>,
    notify: Notify,
}

impl Refusals {
    /// Resolves with the first refusal's message.
    pub(crate) async fn first(&self) -> String {
        loop {
            let notified = self.notify.notified();
            if let Some(m) = self.first.lock().unwrap_or_else(|e| e.into_inner()).clone() {
                return m;
            }
            notified.await;
        }
    }

    fn record<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e @ (Error::PermissionDenied { .. } | Error::Unauthenticated { .. })) = &r {
            let mut first = self.first.lock().unwrap_or_else(|e| e.into_inner());
            if first.is_none() {
                *first = Some(e.to_string());
            }
            drop(first);
            self.notify.notify_waiters();
        }
        r
    }
}

/// `store`, reporting refusals to the returned [`Refusals`].
pub(crate) fn watch_refusals(store: DynLeaseStore) -> (DynLeaseStore, Arc<Refusals>) {
    let refusals = Arc::new(Refusals::default());
    let wrapped = Arc::new(Noticing {
        inner: store,
        refusals: refusals.clone(),
    });
    (wrapped, refusals)
}

#[derive(Debug)]
struct Noticing {
    inner: DynLeaseStore,
    refusals: Arc<Refusals>,
}

#[async_trait]
impl LeaseStore for Noticing {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn get(&self, key: &LeaseKey) -> Result<Option<Versioned>> {
        self.refusals.record(self.inner.get(key).await)
    }
    async fn create(&self, key: &LeaseKey, record: &LeaseRecord) -> Result<Version> {
        self.refusals.record(self.inner.create(key, record).await)
    }
    async fn update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> Result<Version> {
        self.refusals
            .record(self.inner.update(key, record, expected).await)
    }
    async fn delete(&self, key: &LeaseKey, expected: &Version) -> Result<()> {
        self.refusals.record(self.inner.delete(key, expected).await)
    }
    async fn watch(&self, key: &LeaseKey, after: Option<&Version>) -> Result<WatchStream> {
        self.refusals.record(self.inner.watch(key, after).await)
    }
    async fn list(&self, prefix: &KeyPrefix) -> Result<Vec<(LeaseKey, Versioned)>> {
        self.refusals.record(self.inner.list(prefix).await)
    }
    async fn fencing_seed(&self, key: &LeaseKey) -> Result<u64> {
        self.refusals.record(self.inner.fencing_seed(key).await)
    }
}
