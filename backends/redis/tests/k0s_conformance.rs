//! k0s's scenarios (pool, callbacks, controller counter), ported as store-generic cases, against
//! a real redis-server.

mod common;

leasehold::k0s_conformance_suite!(common::make_store);
