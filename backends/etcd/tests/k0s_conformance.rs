//! k0s's scenarios (pool, callbacks, controller counter), ported as store-generic cases
//! (`leasehold::k0s_conformance_suite!`), against a real etcd (one server per test binary).

use std::sync::Arc;

use leasehold_test_support::etcd as common;

async fn make_store() -> leasehold::DynLeaseStore {
    Arc::new(common::shared_store().await)
}

leasehold::k0s_conformance_suite!(make_store);
