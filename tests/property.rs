//! Property test: several electors under random fault schedules (latency, errors, partitions,
//! crashes) never lead at the same instant, and a leader exists again within
//! lease_duration + renew_deadline after the faults stop. Runs on Tokio's paused clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold::fault::FaultyStore;
use leasehold::{DynLeaseStore, Elector, ElectorConfig, LeaseKey, MemoryStore};
use proptest::prelude::*;
use tokio::time::{Instant, sleep};

const N: usize = 3;
const LEASE: Duration = Duration::from_secs(6);
const RENEW: Duration = Duration::from_secs(4);
const RETRY: Duration = Duration::from_secs(1);

#[derive(Clone, Debug)]
enum Fault {
    Latency(usize, u64),
    FailNext(usize, u64),
    FailFor(usize, u64),
    Partition(usize),
    Heal(usize),
    /// The elector is stopped without a chance to release (its handle is cut off first), and a
    /// new instance with a new identity starts in its place.
    Crash(usize),
    /// A graceful restart.
    Restart(usize),
    Wait(u64),
}

fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        (0..N, 0u64..1500).prop_map(|(i, ms)| Fault::Latency(i, ms)),
        (0..N, 1u64..6).prop_map(|(i, n)| Fault::FailNext(i, n)),
        (0..N, 100u64..8000).prop_map(|(i, ms)| Fault::FailFor(i, ms)),
        (0..N).prop_map(Fault::Partition),
        (0..N).prop_map(Fault::Heal),
        (0..N).prop_map(Fault::Crash),
        (0..N).prop_map(Fault::Restart),
        (0u64..10_000).prop_map(Fault::Wait),
    ]
}

/// Leading intervals per identity, recorded by status watchers.
type Log = Arc<Mutex<Vec<(String, Instant, Option<Instant>)>>>;

struct Node {
    handle: FaultyStore,
    elector: Elector,
}

fn start(shared: &DynLeaseStore, key: &LeaseKey, id: String, log: &Log) -> Node {
    let handle = FaultyStore::new(shared.clone());
    let cfg = ElectorConfig::new(key.clone(), id.clone()).with_timings(LEASE, RENEW, RETRY);
    let elector = Elector::spawn(Arc::new(handle.clone()), cfg).expect("valid config");
    let mut rx = elector.subscribe();
    let log = log.clone();
    tokio::spawn(async move {
        let mut open: Option<usize> = None;
        loop {
            let leading = rx.borrow_and_update().is_leading();
            {
                let mut l = log.lock().unwrap_or_else(|e| e.into_inner());
                match (leading, open) {
                    (true, None) => {
                        l.push((id.clone(), Instant::now(), None));
                        open = Some(l.len() - 1);
                    }
                    (false, Some(i)) => {
                        l[i].2 = Some(Instant::now());
                        open = None;
                    }
                    _ => {}
                }
            }
            if rx.changed().await.is_err() {
                if let Some(i) = open {
                    log.lock().unwrap_or_else(|e| e.into_inner())[i].2 = Some(Instant::now());
                }
                return;
            }
        }
    });
    Node { handle, elector }
}

fn check_no_overlap(log: &Log) {
    let l = log.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for (i, a) in l.iter().enumerate() {
        for b in &l[i + 1..] {
            let a_end = a.2.unwrap_or(Instant::now() + Duration::from_secs(1 << 20));
            let b_end = b.2.unwrap_or(Instant::now() + Duration::from_secs(1 << 20));
            assert!(
                a_end <= b.1 || b_end <= a.1,
                "two leaders at once: {a:?} and {b:?}"
            );
        }
    }
}

async fn scenario(faults: Vec<Fault>) {
    let shared: DynLeaseStore = Arc::new(MemoryStore::new());
    let key = LeaseKey::new("prop").expect("valid");
    let log: Log = Arc::default();
    let mut gen_ = 0u32;
    let mut nodes: Vec<Node> = (0..N)
        .map(|i| start(&shared, &key, format!("n{i}-g0"), &log))
        .collect();
    for f in faults {
        match f {
            Fault::Latency(i, ms) => nodes[i]
                .handle
                .faults()
                .set_latency(Duration::from_millis(ms)),
            Fault::FailNext(i, n) => nodes[i].handle.faults().fail_next(n),
            Fault::FailFor(i, ms) => nodes[i].handle.faults().fail_for(Duration::from_millis(ms)),
            Fault::Partition(i) => nodes[i].handle.faults().set_partitioned(true),
            Fault::Heal(i) => nodes[i].handle.faults().heal(),
            Fault::Crash(i) | Fault::Restart(i) => {
                if matches!(f, Fault::Crash(_)) {
                    nodes[i].handle.faults().set_partitioned(true);
                }
                nodes[i]
                    .elector
                    .shutdown()
                    .await
                    .expect("the elector shuts down cleanly");
                gen_ += 1;
                nodes[i] = start(&shared, &key, format!("n{i}-g{gen_}"), &log);
            }
            Fault::Wait(ms) => sleep(Duration::from_millis(ms)).await,
        }
        check_no_overlap(&log);
    }
    for n in &nodes {
        n.handle.faults().heal();
    }
    let healed = Instant::now();
    sleep(LEASE + RENEW).await;
    check_no_overlap(&log);
    let leaders: Vec<_> = nodes.iter().filter(|n| n.elector.is_leading()).collect();
    assert_eq!(
        leaders.len(),
        1,
        "exactly one leader {:?} after the faults stopped",
        healed.elapsed()
    );
    for n in &nodes {
        n.elector
            .shutdown()
            .await
            .expect("the elector shuts down cleanly");
    }
    check_no_overlap(&log);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    #[test]
    fn never_two_leaders_and_recovery(faults in proptest::collection::vec(fault(), 1..25)) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        rt.block_on(scenario(faults));
    }
}
