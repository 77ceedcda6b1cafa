//! The shared conformance suite against the test Lease API server (always runs).
//!
//! Every case gets its own server on a free loopback port, living until the case's runtime
//! ends; a real `kube::Client` talks to it.

mod support;

use std::sync::Arc;

async fn make_store() -> leasehold::DynLeaseStore {
    let server = support::LeaseApiServer::start().await;
    let store = support::store(&server);
    // The server's tasks run on this test's runtime and stop with it.
    std::mem::forget(server);
    Arc::new(store)
}

leasehold::conformance_suite!(make_store);
