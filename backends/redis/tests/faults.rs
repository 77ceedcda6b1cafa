//! Fault tests with a real redis-server per test: killed, restarted, paused (SIGSTOP), scripts
//! evicted. They assert behaviour (typed errors, no hang, step-down, recovery) and print the
//! timings they observe; they never assert an upper time bound.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use leasehold::{Elector, ElectorConfig, Error, LeaseStore, WatchEvent, WatchStream};
use leasehold_redis::{RedisConfig, RedisStore};
use leasehold_test_support::redis as common;

/// A generous limit for "eventually", so that a hang fails the test instead of blocking CI.
const EVENTUALLY: Duration = Duration::from_secs(60);

async fn fast_store(url: &str) -> RedisStore {
    fast_store_in(url, &unique_prefix()).await
}

/// A store with its own connections on the key namespace `prefix`: candidates that must
/// compete for one lease need the same prefix (a store of their own each, as separate
/// processes have).
async fn fast_store_in(url: &str, prefix: &str) -> RedisStore {
    let cfg = RedisConfig::new(url)
        .unwrap()
        .with_prefix(prefix)
        .with_operation_timeout(Duration::from_millis(300))
        .with_connect_timeout(Duration::from_millis(300))
        .with_watch_ping_interval(Duration::from_millis(200));
    RedisStore::connect(cfg).await.unwrap()
}

/// Retries `get` until it succeeds (bounded).
async fn until_available(s: &RedisStore, k: &leasehold::LeaseKey) {
    let deadline = Instant::now() + EVENTUALLY;
    loop {
        match s.get(k).await {
            Ok(_) => return,
            Err(e) => {
                assert!(e.is_retryable(), "not retryable: {e:?}");
                assert!(Instant::now() < deadline, "store did not recover: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[tokio::test]
async fn killed_server_gives_retryable_errors_and_a_restart_recovers() {
    let mut srv = Server::start();
    let s = fast_store(&srv.url()).await;
    let k = key("lease");
    let v = s.create(&k, &record("a", 1)).await.unwrap();

    srv.kill();
    for _ in 0..3 {
        let r = tokio::time::timeout(EVENTUALLY, s.update(&k, &record("a", 2), &v))
            .await
            .expect("an operation on a dead server returns instead of hanging");
        let e = r.expect_err("the server is dead");
        assert!(
            matches!(e, Error::Unavailable { .. } | Error::Timeout { .. }),
            "{e:?}"
        );
        assert!(e.is_retryable());
    }

    // A restart without persistence: empty data, empty script cache (NOSCRIPT path).
    srv.restart();
    until_available(&s, &k).await;
    assert!(
        s.get(&k).await.unwrap().is_none(),
        "no persistence: the data is gone"
    );
    let v2 = s.create(&k, &record("b", 1)).await.unwrap();
    // Versions keep growing across the data loss (the counter restarts at the server clock), so
    // the version read before the loss cannot match the new record.
    assert_ne!(v2, v);
    assert!(matches!(
        s.update(&k, &record("a", 2), &v).await,
        Err(Error::Conflict { .. })
    ));
}

#[tokio::test]
async fn paused_server_gives_timeouts_and_resuming_recovers() {
    let srv = Server::start();
    let s = fast_store(&srv.url()).await;
    let k = key("lease");
    let v = s.create(&k, &record("a", 1)).await.unwrap();
    srv.pause();
    let r = tokio::time::timeout(EVENTUALLY, s.get(&k))
        .await
        .expect("an operation on a paused server returns instead of hanging");
    match r {
        Err(Error::Timeout {
            store, operation, ..
        }) => assert_eq!((store, operation), ("redis", "get")),
        other => panic!("expected a Timeout, got {other:?}"),
    }
    let r = tokio::time::timeout(EVENTUALLY, s.update(&k, &record("a", 2), &v))
        .await
        .expect("no hang");
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    srv.resume();
    until_available(&s, &k).await;
    // The update may or may not have been applied after the resume: a read tells.
    let cur = s.get(&k).await.unwrap().unwrap();
    assert!(cur.record == record("a", 1) || cur.record == record("a", 2));
    s.update(&k, &record("a", 3), &cur.version).await.unwrap();
}

async fn next_ok(w: &mut WatchStream) -> WatchEvent {
    let deadline = Instant::now() + EVENTUALLY;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, w.next()).await {
            Err(_) => panic!("no watch event within {EVENTUALLY:?}"),
            Ok(None) => panic!("the watch ended"),
            Ok(Some(Err(e))) => assert!(e.is_retryable(), "{e:?}"),
            Ok(Some(Ok(ev))) => return ev,
        }
    }
}

#[tokio::test]
async fn watch_reports_the_loss_then_resubscribes_and_rereads_after_restart() {
    let mut srv = Server::start();
    let s = fast_store(&srv.url()).await;
    let k = key("watched");
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    let mut w = s.watch(&k, Some(&v1)).await.unwrap();

    srv.kill();
    // The loss is reported as one retryable error item; the stream goes on.
    let item = tokio::time::timeout(EVENTUALLY, w.next())
        .await
        .expect("the loss is reported")
        .expect("the stream goes on");
    let e = item.expect_err("an error item");
    assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");

    srv.restart();
    // The restarted server lost the key: the re-read reports the deletion...
    assert_eq!(next_ok(&mut w).await, WatchEvent::Deleted);
    // ...and changes after the resubscription arrive by pub/sub.
    until_available(&s, &k).await;
    let v2 = s.create(&k, &record("b", 2)).await.unwrap();
    match next_ok(&mut w).await {
        WatchEvent::Put(p) => {
            assert_eq!(p.version, v2);
            assert_eq!(p.record, record("b", 2));
        }
        other => panic!("expected the new record, got {other:?}"),
    }
    let v3 = s.update(&k, &record("c", 3), &v2).await.unwrap();
    match next_ok(&mut w).await {
        WatchEvent::Put(p) => assert_eq!(p.version, v3),
        other => panic!("expected the update, got {other:?}"),
    }
}

#[tokio::test]
async fn watch_catches_up_on_changes_made_while_it_was_paused_out() {
    // Changes made while the watch connection is away are coalesced by the re-read.
    let srv = Server::start();
    let s = fast_store(&srv.url()).await;
    let k = key("paused-watch");
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    let mut w = s.watch(&k, Some(&v1)).await.unwrap();
    srv.pause();
    // The ping fails while paused: an error item.
    let item = tokio::time::timeout(EVENTUALLY, w.next())
        .await
        .expect("the loss is reported")
        .expect("the stream goes on");
    assert!(item.is_err(), "{item:?}");
    srv.resume();
    let v2 = loop {
        match s.update(&k, &record("b", 2), &v1).await {
            Ok(v) => break v,
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(Error::Conflict { .. }) => {
                break s.get(&k).await.unwrap().unwrap().version;
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    match next_ok(&mut w).await {
        WatchEvent::Put(p) => assert_eq!(p.version, v2),
        other => panic!("expected the update, got {other:?}"),
    }
}

fn elector_config(k: &leasehold::LeaseKey, id: &str) -> ElectorConfig {
    ElectorConfig::new(k.clone(), id).with_timings(
        Duration::from_secs(2),
        Duration::from_secs(1),
        Duration::from_millis(250),
    )
}

async fn wait_until(e: &Elector, leading: bool) -> Duration {
    let started = Instant::now();
    let mut rx = e.subscribe();
    tokio::time::timeout(EVENTUALLY, rx.wait_for(|s| s.is_leading() == leading))
        .await
        .unwrap_or_else(|_| panic!("elector did not reach leading={leading} within {EVENTUALLY:?}"))
        .unwrap();
    started.elapsed()
}

async fn any_leads(electors: &[&Elector]) {
    let deadline = Instant::now() + EVENTUALLY;
    loop {
        // One instant for all electors: sampling them one after another could straddle a
        // handover and count the old and the new leader together.
        let now = tokio::time::Instant::now();
        let n = electors
            .iter()
            .filter(|e| leasehold::testing::valid_at(&e.current_status().0, now))
            .count();
        assert!(n <= 1, "two valid terms at one instant on a single primary");
        if n == 1 {
            return;
        }
        assert!(Instant::now() < deadline, "no elector leads again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn leader_steps_down_when_the_server_dies_and_an_elector_leads_after_restart() {
    let mut srv = Server::start();
    let url = srv.url();
    let k = key("fault-kill");
    let prefix = unique_prefix();
    let a = Elector::spawn(
        Arc::new(fast_store_in(&url, &prefix).await),
        elector_config(&k, "a"),
    )
    .unwrap();
    wait_until(&a, true).await;
    let b = Elector::spawn(
        Arc::new(fast_store_in(&url, &prefix).await),
        elector_config(&k, "b"),
    )
    .unwrap();

    srv.kill();
    let took = wait_until(&a, false).await;
    println!("leader stepped down {took:?} after the server was killed (renew deadline 1 s)");
    assert!(
        !b.is_leading(),
        "a follower cannot acquire while the server is dead"
    );

    srv.restart();
    any_leads(&[&a, &b]).await;
    a.shutdown().await.expect("the elector shuts down cleanly");
    b.shutdown().await.expect("the elector shuts down cleanly");
}

#[tokio::test]
async fn leader_steps_down_while_the_server_is_paused_and_leads_again_after_resume() {
    let srv = Server::start();
    let url = srv.url();
    let k = key("fault-pause");
    let prefix = unique_prefix();
    let a = Elector::spawn(
        Arc::new(fast_store_in(&url, &prefix).await),
        elector_config(&k, "a"),
    )
    .unwrap();
    wait_until(&a, true).await;
    let b = Elector::spawn(
        Arc::new(fast_store_in(&url, &prefix).await),
        elector_config(&k, "b"),
    )
    .unwrap();

    srv.pause();
    let took = wait_until(&a, false).await;
    println!("leader stepped down {took:?} after the server was paused (renew deadline 1 s)");
    assert!(!b.is_leading());

    srv.resume();
    any_leads(&[&a, &b]).await;
    a.shutdown().await.expect("the elector shuts down cleanly");
    b.shutdown().await.expect("the elector shuts down cleanly");
}

/// The server's clock in microseconds (`TIME`).
async fn server_time_us(url: &str) -> u64 {
    let t: Vec<String> =
        redis::FromRedisValue::from_redis_value(raw_cmd(url, &redis::cmd("TIME")).await).unwrap();
    t[0].parse::<u64>().unwrap() * 1_000_000 + t[1].parse::<u64>().unwrap()
}

fn num(v: &leasehold::Version) -> u64 {
    v.as_str().parse().unwrap()
}

#[tokio::test]
async fn versions_never_repeat_after_a_restore_from_an_older_snapshot() {
    // A real restore: SAVE writes dump.rdb, two more writes follow, then the server is killed
    // and restarts from that older snapshot (lower counter, older record).
    let mut srv = Server::start();
    let url = srv.url();
    let s = fast_store(&url).await;
    let k = key("restored");
    let v1 = s.create(&k, &record("a", 1)).await.unwrap();
    raw_cmd(&url, &redis::cmd("SAVE")).await;
    let v2 = s.update(&k, &record("b", 2), &v1).await.unwrap();
    let v3 = s.update(&k, &record("c", 3), &v2).await.unwrap();
    srv.kill();
    srv.restart();
    until_available(&s, &k).await;
    let restored = s
        .get(&k)
        .await
        .unwrap()
        .expect("the snapshot holds the record");
    assert_eq!(restored.version, v1, "the snapshot is the older state");

    let before = server_time_us(&url).await;
    let v4 = s.update(&k, &record("d", 4), &v1).await.unwrap();
    println!("versions {v1} {v2} {v3}, after the restore {v4}, server clock {before}");
    assert!(
        ![&v1, &v2, &v3].contains(&&v4),
        "a version issued before the restore was issued again: {v4}"
    );
    assert!(
        num(&v4) >= before,
        "{v4} is below the server clock {before}"
    );
}

#[tokio::test]
async fn versions_stay_above_the_server_clock_when_the_counter_is_set_back() {
    let srv = Server::start();
    let url = srv.url();
    let s = fast_store(&url).await;
    let rev = format!("{{{}}}rev", s.config().prefix());
    let k = key("set-back");
    let other = key("other");
    let mut seen = vec![s.create(&k, &record("a", 1)).await.unwrap()];
    let vo = s.create(&other, &record("o", 1)).await.unwrap();
    seen.push(vo.clone());
    s.delete(&other, &vo).await.unwrap();
    // An older restore or a lagging replica: the counter is far behind.
    raw_cmd(&url, redis::cmd("SET").arg(&rev).arg(5)).await;
    let before = server_time_us(&url).await;
    let v = s.create(&other, &record("o", 2)).await.unwrap();
    assert!(!seen.contains(&v), "{v} repeats one of {seen:?}");
    assert!(num(&v) >= before, "{v} is below the server clock {before}");
    seen.push(v);
    let v = s.update(&k, &record("a", 2), &seen[0]).await.unwrap();
    assert!(!seen.contains(&v), "{v} repeats one of {seen:?}");
    assert!(seen.iter().all(|o| num(&v) > num(o)), "{v} after {seen:?}");
}

#[tokio::test]
async fn fencing_seed_exceeds_every_earlier_version_and_token_after_delete_and_flushall() {
    let srv = Server::start();
    let url = srv.url();
    let s = fast_store(&url).await;
    let k = key("fenced");
    let mut highest = 0u64;
    let seed = s.fencing_seed(&k).await.unwrap();
    let before = server_time_us(&url).await;
    assert!(seed > 0);
    let mut v = s.create(&k, &record("a", seed)).await.unwrap();
    highest = highest.max(seed).max(num(&v));
    for i in 1..=5 {
        v = s.update(&k, &record("a", seed + i), &v).await.unwrap();
        highest = highest.max(seed + i).max(num(&v));
    }
    s.delete(&k, &v).await.unwrap();
    let after_delete = s.fencing_seed(&k).await.unwrap();
    assert!(
        after_delete > highest,
        "seed {after_delete} after delete, highest seen {highest}"
    );
    assert!(after_delete > before);

    // A restart without persistence, as FLUSHALL: the counter is gone, the clock is not.
    raw_cmd(&url, &redis::cmd("FLUSHALL")).await;
    let after_flush = s.fencing_seed(&k).await.unwrap();
    println!("seeds {seed} → {after_delete} → {after_flush}; highest seen {highest}");
    assert!(after_flush > highest);
    assert!(after_flush > after_delete);
    // The seed does not write: asking twice keeps growing with the clock only.
    assert!(s.get(&k).await.unwrap().is_none());
}

#[tokio::test]
async fn acquired_tokens_grow_across_delete_and_flushall_and_stay_above_the_clock() {
    let srv = Server::start();
    let url = srv.url();
    let s = fast_store(&url).await;
    let k = key("acquired");
    let before = server_time_us(&url).await;
    let a = s.acquire(&k, &record("a", 0), None).await.unwrap();
    assert!(
        a.fencing_token >= before,
        "{} below the clock {before}",
        a.fencing_token
    );
    let v = s
        .update(&k, &record("a", a.fencing_token), &a.version)
        .await
        .unwrap();
    let b = s
        .acquire(&k, &record("b", a.fencing_token + 1), Some(&v))
        .await
        .unwrap();
    s.delete(&k, &b.version).await.unwrap();
    let c = s.acquire(&k, &record("c", 0), None).await.unwrap();
    s.delete(&k, &c.version).await.unwrap();
    // A restart without persistence, as FLUSHALL: the counter and the token high-water mark are
    // gone, the clock is not.
    raw_cmd(&url, &redis::cmd("FLUSHALL")).await;
    let d = s.acquire(&k, &record("d", 0), None).await.unwrap();
    let tokens = [
        a.fencing_token,
        b.fencing_token,
        c.fencing_token,
        d.fencing_token,
    ];
    println!("tokens {tokens:?}");
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
    assert_eq!(
        s.get(&k).await.unwrap().unwrap().record.transitions,
        d.fencing_token
    );
}

/// A loopback TCP proxy that can stop forwarding on its established connections while leaving
/// them open (a middlebox that lost its state: the peer neither answers nor resets), while new
/// connections are forwarded again.
struct StallingProxy {
    port: u16,
    stall: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl StallingProxy {
    async fn start(upstream: u16) -> StallingProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stall, rx) = tokio::sync::watch::channel(0u64);
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let mut rx = rx.clone();
                let epoch = *rx.borrow_and_update();
                conns.spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let forward = async {
                        tokio::select! {
                            _ = tokio::io::copy(&mut cr, &mut sw) => {}
                            _ = tokio::io::copy(&mut sr, &mut cw) => {}
                        }
                    };
                    tokio::select! {
                        () = forward => {}
                        changed = async { rx.wait_for(|e| *e != epoch).await.is_ok() } => {
                            let _ = changed;
                            // Stalled: keep both sockets open and silent forever.
                            std::future::pending::<()>().await;
                        }
                    }
                });
            }
        });
        StallingProxy { port, stall, task }
    }

    /// Every connection open now stops forwarding (and stays open); later ones forward.
    fn stall_open_connections(&self) {
        self.stall.send_modify(|e| *e += 1);
    }
}

impl Drop for StallingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn a_connection_that_stops_answering_is_replaced_after_consecutive_timeouts() {
    let srv = Server::start();
    let proxy = StallingProxy::start(srv.port).await;
    let s = fast_store(&format!("redis://127.0.0.1:{}", proxy.port)).await;
    let k = key("half-open");
    let v = s.create(&k, &record("a", 1)).await.unwrap();

    proxy.stall_open_connections();
    // The store's connection is now half-open: every call times out...
    let r = tokio::time::timeout(EVENTUALLY, s.get(&k))
        .await
        .expect("no hang");
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    // ...until the store gives up on it and connects again (through the proxy, which forwards
    // new connections). Without that, the calls would time out until the kernel gave up.
    let deadline = Instant::now() + EVENTUALLY;
    let mut timeouts = 1;
    let got = loop {
        match s.get(&k).await {
            Ok(got) => break got,
            Err(e @ Error::Timeout { .. }) => {
                timeouts += 1;
                assert!(
                    Instant::now() < deadline,
                    "still timing out after {timeouts} calls: {e}"
                );
            }
            Err(e) => panic!("unexpected error {e:?}"),
        }
    };
    println!(
        "recovered after {timeouts} timeouts (rebuild after {})",
        leasehold_redis::REBUILD_AFTER_TIMEOUTS
    );
    assert_eq!(got.unwrap().version, v);
    s.update(&k, &record("a", 2), &v).await.unwrap();
}

#[tokio::test]
async fn connect_works_and_warns_when_the_eviction_policy_can_evict_leases() {
    // The warning itself is a log line (its decision is unit-tested in src/store.rs); the
    // connection must work regardless.
    let srv = Server::start_with(
        &["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"],
        false,
    );
    let s = fast_store(&srv.url()).await;
    let k = key("evictable");
    let v = s.create(&k, &record("a", 1)).await.unwrap();
    assert_eq!(s.get(&k).await.unwrap().unwrap().version, v);
    // Lease keys carry no TTL, which is why the volatile-* policies never evict them.
    let p = s.config().prefix();
    for name in [
        s.record_key(&k),
        format!("{{{p}}}index"),
        format!("{{{p}}}rev"),
    ] {
        let ttl = raw_cmd(&srv.url(), redis::cmd("TTL").arg(&name)).await;
        assert_eq!(ttl, redis::Value::Int(-1), "{name} has a TTL");
    }
}

#[tokio::test]
async fn a_cluster_mode_server_is_refused_at_connect() {
    let srv = Server::start_with(&["--cluster-enabled", "yes"], false);
    let cfg = RedisConfig::new(srv.url()).unwrap();
    match RedisStore::connect(cfg).await {
        Err(e @ leasehold_redis::Error::InvalidConfig(_)) => {
            println!("{e}");
            assert!(e.to_string().contains("with_cluster()"), "{e}");
            let e = Error::from(e);
            assert!(!e.is_retryable());
            assert!(e.to_string().contains("cluster mode"), "{e}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}
