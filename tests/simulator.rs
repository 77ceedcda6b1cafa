//! The deterministic simulator (see `tests/sim/mod.rs`): many seeded fault schedules against
//! several elector state machines, checking mutual exclusion, fencing-token order and prompt
//! takeover on the simulator's true clock.
//!
//! - `LEASEHOLD_SIM_SCHEDULES=N` runs N schedules (default 20,000); `LEASEHOLD_SIM_BASE_SEED=S`
//!   starts at seed S. A long hunt: `LEASEHOLD_SIM_SCHEDULES=1000000 cargo test --release --test
//!   simulator -- --nocapture`.
//! - `LEASEHOLD_SIM_SEED=S` replays one seed and prints its event trace.

mod sim;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    match v.trim().parse() {
        Ok(n) => Some(n),
        Err(_) => panic!("{name}={v:?} is not a whole number"),
    }
}

/// Every schedule keeps the three invariants; a violation prints the seed and its trace.
#[test]
fn simulator_schedules() {
    if let Some(seed) = env_u64("LEASEHOLD_SIM_SEED") {
        let report = sim::report(seed, None);
        println!("{report}");
        let out = sim::Sim::new(seed, None, false).run();
        assert!(out.violation.is_none(), "{report}");
        return;
    }
    let count = env_u64("LEASEHOLD_SIM_SCHEDULES").unwrap_or(20_000);
    let base = env_u64("LEASEHOLD_SIM_BASE_SEED").unwrap_or(0);
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(8) as u64;
    let next = AtomicU64::new(0);
    let terms = AtomicU64::new(0);
    let events = AtomicU64::new(0);
    let failed: Arc<Mutex<Option<u64>>> = Arc::default();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count || failed.lock().map(|f| f.is_some()).unwrap_or(true) {
                        return;
                    }
                    let seed = base + i;
                    let out = sim::Sim::new(seed, None, false).run();
                    terms.fetch_add(out.terms as u64, Ordering::Relaxed);
                    events.fetch_add(out.events, Ordering::Relaxed);
                    if out.violation.is_some() {
                        let mut f = failed.lock().unwrap_or_else(|e| e.into_inner());
                        if f.is_none_or(|s| seed < s) {
                            *f = Some(seed);
                        }
                    }
                }
            });
        }
    });
    let failed = *failed.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(seed) = failed {
        panic!("{}", sim::report(seed, None));
    }
    println!(
        "simulator: {count} schedules (seeds {base}..{}), {} terms, {} events, 0 violations",
        base + count,
        terms.load(Ordering::Relaxed),
        events.load(Ordering::Relaxed)
    );
}

/// The seeds that earlier hunts stopped at still hold: the reviews' (13, 1031661, 20186385,
/// 50749446) and this fault model's own finds (1000551 and on: elector bugs with foreign
/// writers — an edited renewal, a stale read-back of an acquire after a watch ran ahead — and
/// checker bugs). A seed names a different schedule once the fault model grows;
/// `tests/machine_scripts.rs` pins the schedules themselves where a script can express them.
#[test]
fn seeds_of_earlier_reviews_hold() {
    for seed in [
        13,
        1_031_661,
        20_186_385,
        50_749_446,
        1_000_551,
        1_007_356,
        1_031_639,
        1_044_207,
        1_129_105,
        1_170_915,
        100_065_071,
        100_096_667,
        101_492_148,
        101_718_339,
        103_195_427,
    ] {
        let out = sim::Sim::new(seed, None, false).run();
        assert!(out.violation.is_none(), "{}", sim::report(seed, None));
    }
}
