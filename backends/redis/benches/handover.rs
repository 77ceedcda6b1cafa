//! The core handover harness (`leasehold::harness`) against a real redis-server started on a
//! free loopback port (or `LEASEHOLD_REDIS_URL`).
//!
//! `cargo bench -p leasehold-redis --bench handover` (add `-- --quick` for fewer rounds).

#![allow(missing_docs)]

#[path = "../tests/common/mod.rs"]
mod common;

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
        let url = common::shared_url();
        println!("leasehold handover benchmark: redis at {url}, {settings:?}");
        let report = run(common::make_store().await, &settings).await;
        print!("{report}");
    });
}
