//! Test servers and tools for leasehold's own tests and benches. **Unpublished** (`publish =
//! false`); nothing here is API.
//!
//! Every crate of the workspace takes this crate as a normal dev-dependency, with the features
//! for the servers it needs, instead of sharing test files by path:
//!
//! | module | feature | what it is for |
//! |---|---|---|
//! | [`getting_started`] | — | runs a store crate's getting-started example and checks its output |
//! | [`harness`] | — | the handover/failover benchmark harness every bench runs over its store |
//! | [`pki`] | `pki` | test certificates (CA, server, client) for the TLS tests |
//! | `redis` | `redis` | `redis-server` processes (single, TLS, cluster) on free loopback ports, and RedisStore helpers |
//! | `etcd` | `etcd` | etcd members and clusters (TLS, restarts) on free loopback ports, and EtcdStore helpers |
//! | `lease_api` | `kube` | the in-repo Lease API server: a fake kube-apiserver for `coordination.k8s.io/v1` Leases with fault controls |
//! | `kube_cluster` | `kube` | stores on real Kubernetes clusters: a kubeconfig from the environment, or (feature `k3s`) K3s in a container |
//!
//! Real Kubernetes control planes (a kube-apiserver started by the tests) belong in
//! `kube_cluster`, beside the kubeconfig and K3s stores: the in-repo `lease_api` server stays
//! the fast default, a real control plane checks that it behaves like the real thing.
//!
//! The servers are real processes (redis-server, etcd) or real HTTP servers on free loopback
//! ports, each killed when its test ends or its test binary exits. A missing server binary is a
//! failure with a message naming the binary and the variable that overrides it, never a skip.
//!
//! `tests/k3s.rs` of this crate runs the conformance suite against K3s (feature `k3s`; needs a
//! Docker engine): `cargo test -p leasehold-test-support --features k3s --test k3s`.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod getting_started;
pub mod harness;

#[cfg(feature = "pki")]
pub mod pki;

#[cfg(feature = "redis")]
pub mod redis;

#[cfg(feature = "etcd")]
pub mod etcd;

#[cfg(feature = "kube")]
pub mod lease_api;

#[cfg(feature = "kube")]
pub mod kube_cluster;

use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use leasehold::{LeaseKey, LeaseRecord};

/// The key `s`.
///
/// # Panics
/// When `s` is not a valid key.
pub fn key(s: &str) -> LeaseKey {
    LeaseKey::new(s).expect("valid key")
}

/// A record held by `holder` with fencing token `transitions`, a 15 s lease and fixed times in
/// whole microseconds (what every store keeps), for store tests that compare round trips.
pub fn record(holder: &str, transitions: u64) -> LeaseRecord {
    LeaseRecord {
        holder_identity: holder.to_owned(),
        lease_duration: Duration::from_secs(15),
        acquire_time: Some(SystemTime::UNIX_EPOCH + Duration::from_micros(1_764_446_659_123_456)),
        renew_time: Some(SystemTime::UNIX_EPOCH + Duration::from_micros(1_764_446_660_000_001)),
        transitions,
    }
}

/// The operation timeout of the tests' stores: below the conformance suite's 1 s renew deadline
/// (`Elector::spawn` refuses a store timeout that is not).
pub const TEST_OPERATION_TIMEOUT: Duration = Duration::from_millis(900);

/// `<pid>-<nanoseconds>-<counter>`: different on every call, in every process, for key prefixes
/// that never collide on a shared server.
pub fn unique_id() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct free loopback ports (all bound at once, so none repeats, then released for a
/// server to take).
///
/// # Panics
/// When no loopback port can be bound.
pub fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("a bound address").port())
        .collect()
}
