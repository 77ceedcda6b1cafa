//! The core handover harness (`leasehold::harness`) against the in-repo Lease API server (the
//! kube-apiserver stand-in), through a real `kube::Client`.
//!
//! `cargo bench -p leasehold-kube --bench handover` (add `-- --quick` for fewer rounds).

#![allow(missing_docs)]

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

fn main() {
    leasehold::harness::bench_main(|| async {
        let what = "kube store against the test Lease API server".to_owned();
        (what, support::make_store().await)
    });
}
