//! k0s's own leader-election scenarios (ported into `leasehold::k0s::conformance`) against the
//! test Lease API server: the controller counter lists `k0s-ctrl-*` Leases as k0s does.

use leasehold_test_support::lease_api as support;

leasehold::k0s_conformance_suite!(support::make_store);
