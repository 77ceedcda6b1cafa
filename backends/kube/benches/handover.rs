//! The core handover harness (`leasehold::harness`) against the in-repo Lease API server (the
//! kube-apiserver stand-in), through a real `kube::Client`.
//!
//! `cargo bench -p leasehold-kube --bench handover` (add `-- --quick` for fewer rounds).

#![allow(missing_docs)]

#[path = "../tests/support/mod.rs"]
#[allow(unused_imports)]
mod support;

use std::time::Duration;

use leasehold::harness::{Settings, run};

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut settings = Settings::default();
        if quick {
            settings.handover_rounds = 50;
            settings.failover_rounds = 2;
            settings.steady_window = Duration::from_secs(2);
        }
        println!("leasehold handover benchmark: kube store against the test Lease API server, {settings:?}");
        let report = run(support::make_store().await, &settings).await;
        print!("{report}");
    });
}
