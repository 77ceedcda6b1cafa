//! The shared conformance suite against the in-memory store, and against the memory store behind
//! a [`FaultyStore`] that reports neither watch nor commit tokens: there the watch and acquire
//! cases check that the store answers `Unsupported` (and the elector cases run on polling).

use std::sync::Arc;

use leasehold::fault::FaultyStore;
use leasehold::{Capabilities, DynLeaseStore, MemoryStore};

async fn make_store() -> DynLeaseStore {
    Arc::new(MemoryStore::new())
}

leasehold::conformance_suite!(make_store);

leasehold::k0s_conformance_suite!(make_store);

/// The suite on a store that can neither watch nor assign fencing tokens at commit.
mod without_watch_or_commit_tokens {
    use super::*;

    async fn make_store() -> DynLeaseStore {
        Arc::new(
            FaultyStore::new(Arc::new(MemoryStore::new())).with_capabilities(Capabilities::POLL),
        )
    }

    leasehold::conformance_suite!(make_store);
}
