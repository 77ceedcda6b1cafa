//! The shared conformance suite (store and elector cases) against a real redis-server.

use leasehold_test_support::redis as common;

leasehold::conformance_suite!(common::make_store);
