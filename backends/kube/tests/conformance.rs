//! The shared conformance suite against the test Lease API server (always runs).
//!
//! Every case gets its own server on a free loopback port, living until the case's runtime
//! ends; a real `kube::Client` talks to it.

use leasehold_test_support::lease_api as support;

leasehold::conformance_suite!(support::make_store);
