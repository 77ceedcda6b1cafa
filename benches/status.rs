//! Criterion micro-benchmarks: the cost of `current_status()`, of a no-op status publish, and of
//! the record codec used by the Redis and etcd stores.
//!
//! `cargo bench --bench status`

use std::time::{Duration, SystemTime};

use criterion::{Criterion, criterion_group, criterion_main};
use leasehold::{LeaderStatus, LeaseKey, LeaseRecord, StatusCell, StatusSource, codec, testing};

fn status(c: &mut Criterion) {
    let cell = StatusCell::new(LeaderStatus::NotLeading {
        leader: Some("leader-0".into()),
    });
    c.bench_function("current_status", |b| {
        b.iter(|| std::hint::black_box(cell.current_status()))
    });
    c.bench_function("publish an unchanged status (no wake-up)", |b| {
        b.iter(|| {
            testing::set_status(
                &cell,
                LeaderStatus::NotLeading {
                    leader: Some("leader-0".into()),
                },
            )
        })
    });
}

fn record_codec(c: &mut Criterion) {
    let now = SystemTime::now();
    let rec = LeaseRecord {
        holder_identity: "controller-0123456789abcdef".into(),
        lease_duration: Duration::from_secs(15),
        acquire_time: Some(now),
        renew_time: Some(now),
        transitions: 42,
    };
    let key = LeaseKey::new("bench").expect("valid key");
    let bytes = codec::encode(&rec);
    c.bench_function("codec encode", |b| b.iter(|| codec::encode(&rec)));
    c.bench_function("codec decode", |b| {
        b.iter(|| codec::decode(&key, &bytes, None))
    });
}

criterion_group!(benches, status, record_codec);
criterion_main!(benches);
