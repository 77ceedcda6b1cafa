//! The core handover harness (`leasehold::harness`) against a real etcd started on free
//! loopback ports (or `LEASEHOLD_ETCD_ENDPOINTS`).
//!
//! `cargo bench -p leasehold-etcd --bench handover` (add `-- --quick` for fewer rounds).

#![allow(missing_docs)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
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
        let endpoints = common::shared_endpoints().await;
        println!("leasehold handover benchmark: etcd at {endpoints:?}, {settings:?}");
        let store = Arc::new(common::shared_store().await);
        let report = run(store, &settings).await;
        print!("{report}");
    });
}
