//! The `metrics` feature: what an elector reports through the `metrics` facade.

use std::sync::Arc;
use std::time::Duration;

use leasehold::fault::FaultyStore;
use leasehold::metrics::names;
use leasehold::{Elector, ElectorConfig, LeaderStatus, LeaseKey, MemoryStore};
use metrics_util::CompositeKey;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// Snapshot items: taking a snapshot resets counters, gauges and histograms, so each check
/// works on one snapshot and counts what happened since the previous one.
type Items = Vec<(
    CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

/// A metric's value in one snapshot.
enum Value {
    Counter(u64),
    Gauge(f64),
    Histogram(usize),
}

/// The values of metric `name`, with their labels.
fn values(items: &Items, name: &str) -> Vec<(Vec<(String, String)>, Value)> {
    items
        .iter()
        .filter(|(k, _, _, _)| k.key().name() == name)
        .map(|(k, _, _, v)| {
            let labels = k
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            let v = match v {
                DebugValue::Counter(c) => Value::Counter(*c),
                DebugValue::Gauge(g) => Value::Gauge(g.into_inner()),
                DebugValue::Histogram(h) => Value::Histogram(h.len()),
            };
            (labels, v)
        })
        .collect()
}

fn gauge(snap: &Items, name: &str) -> Option<f64> {
    values(snap, name).into_iter().find_map(|(_, v)| match v {
        Value::Gauge(g) => Some(g),
        _ => None,
    })
}

fn counter(snap: &Items, name: &str) -> u64 {
    values(snap, name)
        .into_iter()
        .map(|(_, v)| match v {
            Value::Counter(c) => c,
            _ => 0,
        })
        .sum()
}

fn histogram_len(snap: &Items, name: &str) -> usize {
    values(snap, name)
        .into_iter()
        .map(|(_, v)| match v {
            Value::Histogram(n) => n,
            _ => 0,
        })
        .sum()
}

#[test]
fn an_elector_reports_status_transitions_latencies_and_store_errors() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let faulty = FaultyStore::new(Arc::new(MemoryStore::new()));
            let faults = faulty.faults().clone();
            let config = ElectorConfig::new(LeaseKey::new("metrics").expect("valid"), "a")
                .with_timings(
                    Duration::from_secs(2),
                    Duration::from_millis(1500),
                    Duration::from_millis(300),
                )
                .with_trust_absence(true);
            let elector = Elector::spawn(Arc::new(faulty), config).expect("valid config");
            let mut rx = elector.subscribe();
            rx.wait_for(LeaderStatus::is_leading).await.expect("leads");
            tokio::time::sleep(Duration::from_secs(2)).await;

            let snap1: Items = snap.snapshot().into_vec();
            assert_eq!(gauge(&snap1, names::LEADER_STATUS), Some(1.0));
            assert_eq!(counter(&snap1, names::TRANSITIONS), 1);
            assert_eq!(histogram_len(&snap1, names::ACQUIRE_DURATION), 1);
            assert!(
                histogram_len(&snap1, names::RENEW_DURATION) >= 3,
                "a renewal every 300 ms"
            );
            assert_eq!(counter(&snap1, names::STORE_ERRORS), 0);

            // The store fails: errors by kind, and the leader steps down.
            faults.set_partitioned(true);
            rx.wait_for(|s| !s.is_leading()).await.expect("steps down");
            let snap2: Items = snap.snapshot().into_vec();
            assert_eq!(gauge(&snap2, names::LEADER_STATUS), Some(0.0));
            let errors = values(&snap2, names::STORE_ERRORS);
            assert!(!errors.is_empty(), "store errors are counted");
            for (labels, _) in &errors {
                assert!(
                    labels.contains(&("lease".into(), "metrics".into())),
                    "{labels:?}"
                );
                assert!(
                    labels.contains(&("store".into(), "memory".into())),
                    "{labels:?}"
                );
                assert!(labels.iter().any(|(k, _)| k == "kind"), "{labels:?}");
            }

            faults.heal();
            rx.wait_for(LeaderStatus::is_leading)
                .await
                .expect("leads again");
            let snap3: Items = snap.snapshot().into_vec();
            assert_eq!(counter(&snap3, names::TRANSITIONS), 1, "one more term");
            assert_eq!(gauge(&snap3, names::LEADER_STATUS), Some(1.0));
            elector.shutdown().await.expect("clean");
            let snap4: Items = snap.snapshot().into_vec();
            assert_eq!(gauge(&snap4, names::LEADER_STATUS), Some(0.0));
        });
    });
}
