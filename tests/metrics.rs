//! The `metrics` feature: what an elector reports through the `metrics` facade.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use leasehold::fault::FaultyStore;
use leasehold::metrics::names;
use leasehold::{Elector, ElectorConfig, LeaderStatus, LeaseKey, MemoryStore};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::registry::{AtomicStorage, Registry};

/// A recorder whose values can be read without resetting them.
struct TestRecorder(Registry<Key, AtomicStorage>);

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.0
            .get_or_create_counter(key, |c| Counter::from_arc(c.clone()))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.0
            .get_or_create_gauge(key, |g| Gauge::from_arc(g.clone()))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.0
            .get_or_create_histogram(key, |h| Histogram::from_arc(h.clone()))
    }
}

fn labels(key: &Key) -> Vec<(String, String)> {
    key.labels()
        .map(|l| (l.key().to_owned(), l.value().to_owned()))
        .collect()
}

impl TestRecorder {
    fn gauge(&self, name: &str) -> Option<f64> {
        self.0
            .get_gauge_handles()
            .into_iter()
            .find(|(k, _)| k.name() == name)
            .map(|(_, g)| f64::from_bits(g.load(Ordering::SeqCst)))
    }

    fn counter(&self, name: &str) -> u64 {
        self.0
            .get_counter_handles()
            .into_iter()
            .filter(|(k, _)| k.name() == name)
            .map(|(_, c)| c.load(Ordering::SeqCst))
            .sum()
    }

    /// Each series of counter `name`: its labels and value.
    fn counters(&self, name: &str) -> Vec<(Vec<(String, String)>, u64)> {
        self.0
            .get_counter_handles()
            .into_iter()
            .filter(|(k, _)| k.name() == name)
            .map(|(k, c)| (labels(&k), c.load(Ordering::SeqCst)))
            .collect()
    }

    fn histogram_len(&self, name: &str) -> usize {
        self.0
            .get_histogram_handles()
            .into_iter()
            .filter(|(k, _)| k.name() == name)
            .map(|(_, h)| h.data().len())
            .sum()
    }
}

#[test]
fn an_elector_reports_status_transitions_latencies_and_store_errors() {
    let recorder = TestRecorder(Registry::atomic());
    let m = &recorder;
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

            assert_eq!(m.gauge(names::LEADER_STATUS), Some(1.0));
            assert_eq!(m.counter(names::TRANSITIONS), 1);
            assert_eq!(m.histogram_len(names::ACQUIRE_DURATION), 1);
            assert!(
                m.histogram_len(names::RENEW_DURATION) >= 3,
                "a renewal every 300 ms"
            );
            assert_eq!(m.counter(names::STORE_ERRORS), 0);

            // The store fails: errors by kind, and the leader steps down.
            faults.set_partitioned(true);
            rx.wait_for(|s| !s.is_leading()).await.expect("steps down");
            assert_eq!(m.gauge(names::LEADER_STATUS), Some(0.0));
            let errors = m.counters(names::STORE_ERRORS);
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
            assert_eq!(m.counter(names::TRANSITIONS), 2, "one more term");
            assert_eq!(m.gauge(names::LEADER_STATUS), Some(1.0));
            elector.shutdown().await.expect("clean");
            assert_eq!(m.gauge(names::LEADER_STATUS), Some(0.0));
        });
    });
}
