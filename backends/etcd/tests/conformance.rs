//! The shared conformance suite (`leasehold::conformance`), unchanged, against a real etcd.
//!
//! One etcd per test binary (see `common`); every case gets its own store under a fresh etcd
//! prefix (the suite adds random lease-key prefixes of its own on top).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use leasehold_test_support::etcd as common;

async fn make_store() -> leasehold::DynLeaseStore {
    Arc::new(common::shared_store().await)
}

leasehold::conformance_suite!(make_store);
