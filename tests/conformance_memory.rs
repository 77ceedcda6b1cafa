//! The shared conformance suite against the in-memory store.

use std::sync::Arc;

async fn make_store() -> leasehold::DynLeaseStore {
    Arc::new(leasehold::MemoryStore::new())
}

leasehold::conformance_suite!(make_store);

leasehold::k0s_conformance_suite!(make_store);
