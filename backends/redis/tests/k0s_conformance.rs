//! k0s's scenarios (pool, callbacks, controller counter), ported as store-generic cases, against
//! a real redis-server.

use leasehold_test_support::redis as common;

leasehold::k0s_conformance_suite!(common::make_store);
