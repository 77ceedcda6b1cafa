//! The shared conformance suite (store and elector cases) against a real redis-server.

mod common;

leasehold::conformance_suite!(common::make_store);
