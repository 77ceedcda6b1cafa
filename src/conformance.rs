//! The shared conformance suite every [`LeaseStore`] passes. **Not API-stable.**
//!
//! Each case is a plain `pub async fn case(store: DynLeaseStore)` that panics on failure, in
//! object_store's style. [`conformance_suite!`](crate::conformance_suite) expands to one
//! `#[tokio::test]` per case for a store constructor, so every store's test output lists every
//! case by name:
//!
//! ```text
//! async fn make_store() -> leasehold::DynLeaseStore { /* connect to the test server */ }
//! leasehold::conformance_suite!(make_store);
//! ```
//!
//! Two layers:
//! - **store cases** (`store_*`) check the [`LeaseStore`] contract directly;
//! - **elector cases** (`elector_*`) run [`Elector`]s over the store (wrapped in
//!   [`FaultyStore`] handles to inject faults), with short timings (lease 2 s, renew deadline
//!   1 s, retry period 250 ms).
//!
//! The cases are written in one list (a private `conformance_cases!` invocation) that also
//! defines [`conformance_suite!`](crate::conformance_suite) and
//! [`for_each_conformance_case!`](crate::for_each_conformance_case), so a new case runs in
//! every suite. A case about a capability the store lacks does not pass by skipping: it checks
//! that the store answers [`Error::Unsupported`] (`watch` on a store without watch, `acquire`
//! on one without commit tokens).
//!
//! Cases are not meant to be cancelled (cancel safety: dropping one mid-way may leave its keys
//! behind, under its random prefix).
//!
//! Every case uses a random key prefix, so runs never collide on a shared server. Cases never
//! assert an upper bound on time (a slow machine only makes them slower); they wait for
//! behaviour with a generous limit ([`WAIT_LIMIT`]) and assert orderings and lower bounds.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use tokio::sync::watch;
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;

use crate::elector::{Elector, ElectorConfig, MAX_IDENTITY_LEN};
use crate::error::Error;
use crate::fault::FaultyStore;
use crate::status::{LeaderStatus, StatusSource, StopCause};
use crate::store::{
    DynLeaseStore, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, MAX_KEY_LEN, Version, WatchEvent,
    WatchStream,
};
use crate::tasks::run_leader_tasks;

/// How long a case waits for an expected behaviour before it fails.
pub const WAIT_LIMIT: Duration = Duration::from_secs(30);

/// The lease duration elector cases use.
pub const LEASE: Duration = Duration::from_secs(2);
/// The renew deadline elector cases use.
pub const RENEW: Duration = Duration::from_secs(1);
/// The retry period elector cases use.
pub const RETRY: Duration = Duration::from_millis(250);

/// A random key prefix (`lh-<16 hex digits>-`) for one case run.
pub fn unique_prefix() -> String {
    format!("lh-{:016x}-", rand::random::<u64>())
}

/// A random key under a fresh prefix.
pub fn unique_key(name: &str) -> LeaseKey {
    let key = format!("{}{name}", unique_prefix());
    LeaseKey::new(&key).unwrap_or_else(|e| panic!("test key {key:?} is invalid: {e}"))
}

/// A record with whole-second duration and microsecond times, held by `holder`.
pub fn sample_record(holder: &str, transitions: u64) -> LeaseRecord {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let micros = Duration::from_micros(now.as_micros() as u64);
    let t = SystemTime::UNIX_EPOCH + micros;
    LeaseRecord {
        holder_identity: holder.to_owned(),
        lease_duration: Duration::from_secs(15),
        acquire_time: Some(t),
        renew_time: Some(t + Duration::from_micros(7)),
        transitions,
    }
}

/// The elector configuration elector cases use.
pub fn test_config(key: &LeaseKey, identity: &str) -> ElectorConfig {
    ElectorConfig::new(key.clone(), identity).with_timings(LEASE, RENEW, RETRY)
}

fn fail<T>(what: &str, r: Result<T, Error>) -> T {
    r.unwrap_or_else(|e| panic!("{what} failed: {e} ({e:?})"))
}

async fn next_event(stream: &mut WatchStream, what: &str) -> WatchEvent {
    match timeout(WAIT_LIMIT, stream.next()).await {
        Err(_) => panic!("{what}: no watch event within {WAIT_LIMIT:?}"),
        Ok(None) => panic!("{what}: the watch stream ended"),
        Ok(Some(Err(e))) => panic!("{what}: the watch stream failed: {e}"),
        Ok(Some(Ok(ev))) => ev,
    }
}

async fn assert_no_event(stream: &mut WatchStream, within: Duration, what: &str) {
    if let Ok(Some(ev)) = timeout(within, stream.next()).await {
        panic!("{what}: unexpected watch item {ev:?}");
    }
}

fn put_version(ev: WatchEvent, what: &str) -> (LeaseRecord, Version) {
    match ev {
        WatchEvent::Put(v) => (v.record, v.version),
        other => panic!("{what}: expected a Put event, got {other:?}"),
    }
}

/// A store without watch should answer `watch` with `Unsupported`, from a version and without
/// one, and not fail in another way or open a stream.
async fn assert_watch_unsupported(store: &DynLeaseStore) {
    let key = unique_key("no-watch");
    let v = fail("create", store.create(&key, &sample_record("a", 0)).await);
    for after in [None, Some(&v)] {
        match store.watch(&key, after).await {
            Err(Error::Unsupported {
                operation: "watch", ..
            }) => {}
            Err(e) => panic!(
                "a store without watch answers watch(after = {after:?}) with {e}; want Unsupported"
            ),
            Ok(_) => {
                panic!("a store without watch opened a watch (after = {after:?}); want Unsupported")
            }
        }
    }
    fail("cleanup", store.delete(&key, &v).await);
}

/// A store without commit tokens should answer `acquire` with `Unsupported` and write nothing.
async fn assert_acquire_unsupported(store: &DynLeaseStore) {
    let key = unique_key("no-acquire");
    match store.acquire(&key, &sample_record("a", 0), None).await {
        Err(Error::Unsupported {
            operation: "acquire",
            ..
        }) => {}
        other => panic!("a store without commit tokens answers acquire with {other:?}"),
    }
    assert!(
        fail("get", store.get(&key).await).is_none(),
        "an unsupported acquire writes nothing"
    );
}

// ---------------------------------------------------------------------------------------------
// Helpers of the elector cases

/// A status monitor: records every status an elector publishes, with the instant it saw it.
struct Monitor {
    rx: watch::Receiver<LeaderStatus>,
    name: String,
}

impl Monitor {
    fn new(elector: &Elector, name: &str) -> Self {
        Monitor {
            rx: elector.subscribe(),
            name: name.to_owned(),
        }
    }

    async fn wait_for(
        &mut self,
        what: &str,
        pred: impl FnMut(&LeaderStatus) -> bool,
    ) -> (LeaderStatus, Instant) {
        let res = match timeout(WAIT_LIMIT, self.rx.wait_for(pred)).await {
            Err(_) => None,
            Ok(Err(_)) => panic!("{}: elector went away while waiting for {what}", self.name),
            Ok(Ok(s)) => Some((s.clone(), Instant::now())),
        };
        res.unwrap_or_else(|| {
            panic!(
                "{}: not {what} within {WAIT_LIMIT:?}; status is {:?}",
                self.name,
                *self.rx.borrow()
            )
        })
    }

    async fn leading(&mut self) -> (u64, Instant) {
        let (s, t) = self.wait_for("leading", LeaderStatus::is_leading).await;
        (
            s.leadership()
                .map(|l| l.fencing_token())
                .unwrap_or_default(),
            t,
        )
    }

    async fn not_leading(&mut self) -> Instant {
        self.wait_for("not leading", |s| !s.is_leading()).await.1
    }
}

fn spawn(store: &FaultyStore, key: &LeaseKey, identity: &str) -> Elector {
    spawn_with(store, test_config(key, identity))
}

fn spawn_with(store: &FaultyStore, config: ElectorConfig) -> Elector {
    Elector::spawn(Arc::new(store.clone()), config).expect("valid config")
}

fn handle(store: &DynLeaseStore) -> FaultyStore {
    FaultyStore::new(store.clone())
}

/// Writes a released (vacant) record under `key`, as an earlier leader's release leaves it: a
/// candidate takes such a lease at once, whereas a missing record is created only after it was
/// seen absent for a whole lease duration.
pub async fn create_released(store: &DynLeaseStore, key: &LeaseKey) {
    let now = std::time::SystemTime::now();
    let record = LeaseRecord {
        holder_identity: String::new(),
        lease_duration: Duration::from_secs(1),
        acquire_time: Some(now),
        renew_time: Some(now),
        transitions: 0,
    };
    fail("create", store.create(key, &record).await);
}

/// The random prefix of a key made by [`unique_key`].
fn prefix_of(key: &LeaseKey) -> KeyPrefix {
    let p: String = key
        .as_str()
        .chars()
        .take("lh-0123456789abcdef-".len())
        .collect();
    KeyPrefix::new(&p).unwrap_or_else(|e| panic!("prefix {p:?} is invalid: {e}"))
}

async fn cleanup(store: &DynLeaseStore, key: &LeaseKey) {
    if let Ok(Some(v)) = store.get(key).await {
        let _ = store.delete(key, &v.version).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The case list

/// Defines the conformance cases, and from the same list the macros that run them
/// ([`for_each_conformance_case!`](crate::for_each_conformance_case) and
/// [`conformance_suite!`](crate::conformance_suite)): a case written inside runs in every
/// store's suite, and there is no second list to forget it in. Every case is written
/// `pub async fn name(store: DynLeaseStore) { … }` with its doc comment. The leading `$` is
/// passed in so that the macros it defines can have metavariables of their own.
macro_rules! conformance_cases {
    ($d:tt $($(#[$attr:meta])* pub async fn $case:ident($store:ident: DynLeaseStore) $body:block)+) => {
        $(
            $(#[$attr])*
            pub async fn $case($store: DynLeaseStore) $body
        )+

        /// Calls the macro `$callback` with the name of every conformance case, comma-separated,
        /// after any extra tokens given (`$callback!(extra tokens; case, case, …)`), for suites
        /// that run the cases their own way (one shared server, a container):
        ///
        /// ```text
        /// macro_rules! run_all { ($($case:ident),*) => { $( leasehold::conformance::$case(store.clone()).await; )* } }
        /// leasehold::for_each_conformance_case!(run_all);
        /// ```
        #[macro_export]
        macro_rules! for_each_conformance_case {
            ($d callback:path) => {
                $d callback!($($case),+);
            };
            ($d callback:path, $d ($d args:tt)+) => {
                $d callback!($d ($d args)+ ; $($case),+);
            };
        }

        /// Expands to one `#[tokio::test]` per conformance case, each calling `$make().await`
        /// for a fresh [`DynLeaseStore`](crate::DynLeaseStore). Needs the `conformance` feature
        /// and Tokio's `macros` and `rt-multi-thread` features in the calling crate.
        ///
        /// ```text
        /// async fn make_store() -> leasehold::DynLeaseStore { std::sync::Arc::new(leasehold::MemoryStore::new()) }
        /// leasehold::conformance_suite!(make_store);
        /// ```
        #[macro_export]
        macro_rules! conformance_suite {
            ($d make:path) => {
                $(
                    #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $case() {
                        $d crate::conformance::$case($d make().await).await;
                    }
                )+
            };
        }
    };
}

conformance_cases! { $

    // ---------------------------------------------------------------------------------------------
    // Store cases

    /// `acquire` should assign each acquisition a fencing token at commit, above every token
    /// assigned before for the key, also after the record was deleted and created again (a create
    /// that commits after a delete, however late it was sent); readers should see the token as the
    /// record's `transitions`; it should fail like `create` and `update` do. A store without commit
    /// tokens should answer `Unsupported`.
    pub async fn store_acquire_assigns_tokens_at_commit(store: DynLeaseStore) {
        if !store.capabilities().commit_tokens {
            assert_acquire_unsupported(&store).await;
            return;
        }
        let key = unique_key("acquire");
        let rec = sample_record("a", 0);
        let first = fail("acquire (create)", store.acquire(&key, &rec, None).await);
        let got = fail("get", store.get(&key).await).expect("the acquired record exists");
        assert_eq!(
            got.version, first.version,
            "get returns the acquire's version"
        );
        assert_eq!(
            got.record.transitions, first.fencing_token,
            "the stored record carries the assigned token"
        );
        assert_eq!(got.record.holder_identity, "a");
        assert!(matches!(
            store.acquire(&key, &rec, None).await,
            Err(Error::AlreadyExists { .. })
        ));
        // A renewal writes the token explicitly; the next acquisition gets a higher one.
        let renewed = LeaseRecord {
            transitions: first.fencing_token,
            ..sample_record("a", 0)
        };
        let v = fail("update", store.update(&key, &renewed, &first.version).await);
        assert!(matches!(
            store.acquire(&key, &rec, Some(&first.version)).await,
            Err(Error::Conflict { .. })
        ));
        let second = fail(
            "acquire (update)",
            store.acquire(&key, &sample_record("b", 0), Some(&v)).await,
        );
        assert!(
            second.fencing_token > first.fencing_token,
            "token {} after {}",
            second.fencing_token,
            first.fencing_token
        );
        let mut watch = fail("watch", store.watch(&key, Some(&second.version)).await);
        fail("delete", store.delete(&key, &second.version).await);
        assert!(matches!(
            next_event(&mut watch, "delete").await,
            WatchEvent::Deleted
        ));
        assert!(matches!(
            store.acquire(&key, &rec, Some(&second.version)).await,
            Err(Error::NotFound { .. })
        ));
        let third = fail(
            "acquire (create after delete)",
            store.acquire(&key, &sample_record("c", 0), None).await,
        );
        assert!(
            third.fencing_token > second.fencing_token,
            "a create after a delete gets token {} after {}",
            third.fencing_token,
            second.fencing_token
        );
        let (seen, version) = put_version(next_event(&mut watch, "re-create").await, "re-create");
        assert_eq!(version, third.version);
        assert_eq!(
            seen.transitions, third.fencing_token,
            "watchers see the token"
        );
        let listed = fail("list", store.list(&prefix_of(&key)).await);
        assert_eq!(listed.len(), 1);
        assert_eq!(
            listed[0].1.record.transitions, third.fencing_token,
            "list sees the token"
        );
        cleanup(&store, &key).await;
    }

    /// `acquire` should assign at least the record's `transitions` (the caller's floor), even when
    /// that is far above the store's own source (another writer raised the token it replaces).
    pub async fn store_acquire_honours_the_floor(store: DynLeaseStore) {
        if !store.capabilities().commit_tokens {
            assert_acquire_unsupported(&store).await;
            return;
        }
        let key = unique_key("acquire-high");
        let high = 1u64 << 60;
        let v = fail(
            "create",
            store.create(&key, &sample_record("x", high)).await,
        );
        let a = fail(
            "acquire",
            store
                .acquire(&key, &sample_record("a", high + 1), Some(&v))
                .await,
        );
        assert!(
            a.fencing_token > high,
            "token {} replaces a record with token {high}",
            a.fencing_token
        );
        let got = fail("get", store.get(&key).await).expect("the acquired record exists");
        assert_eq!(
            got.record.transitions, a.fencing_token,
            "get sees the token"
        );
        cleanup(&store, &key).await;
    }

    /// Create, get, update and delete should round-trip a record and move its version.
    pub async fn store_create_get_update_delete(store: DynLeaseStore) {
        let key = unique_key("crud");
        assert!(fail("get of a missing key", store.get(&key).await).is_none());
        let rec = sample_record("alpha", 0);
        let v1 = fail("create", store.create(&key, &rec).await);
        let got = fail("get", store.get(&key).await).expect("the created record is there");
        assert_eq!(got.record, rec, "get returns the created record unchanged");
        assert_eq!(got.version, v1, "get returns the version create returned");

        let rec2 = sample_record("beta", 1);
        let v2 = fail("update", store.update(&key, &rec2, &v1).await);
        assert_ne!(v1, v2, "an update must produce a new version");
        let got = fail("get", store.get(&key).await).expect("record present");
        assert_eq!(got.record, rec2);
        assert_eq!(got.version, v2);

        fail("delete", store.delete(&key, &v2).await);
        assert!(fail("get after delete", store.get(&key).await).is_none());
    }

    /// Create on an existing key should fail with `AlreadyExists` and leave the record alone.
    pub async fn store_create_existing_fails(store: DynLeaseStore) {
        let key = unique_key("exists");
        let rec = sample_record("alpha", 0);
        let v = fail("create", store.create(&key, &rec).await);
        match store.create(&key, &sample_record("beta", 0)).await {
            Err(Error::AlreadyExists { key: k }) => assert_eq!(k, key.as_str()),
            other => panic!("second create: expected AlreadyExists, got {other:?}"),
        }
        let got = fail("get", store.get(&key).await).expect("record present");
        assert_eq!(got.record, rec);
        assert_eq!(got.version, v);
        fail("cleanup", store.delete(&key, &v).await);
    }

    /// Update and delete with a stale version should fail with `Conflict`; on a missing key with
    /// `NotFound`; neither changes anything.
    pub async fn store_stale_versions_conflict(store: DynLeaseStore) {
        let key = unique_key("stale");
        let v1 = fail("create", store.create(&key, &sample_record("a", 0)).await);
        let v2 = fail(
            "update",
            store.update(&key, &sample_record("b", 1), &v1).await,
        );
        match store.update(&key, &sample_record("c", 2), &v1).await {
            Err(Error::Conflict { key: k, expected }) => {
                assert_eq!(k, key.as_str());
                assert_eq!(expected, v1);
            }
            other => panic!("update with a stale version: expected Conflict, got {other:?}"),
        }
        match store.delete(&key, &v1).await {
            Err(Error::Conflict { .. }) => {}
            other => panic!("delete with a stale version: expected Conflict, got {other:?}"),
        }
        let got = fail("get", store.get(&key).await).expect("record present");
        assert_eq!(
            got.record.holder_identity, "b",
            "failed writes changed nothing"
        );
        assert_eq!(got.version, v2);
        fail("delete", store.delete(&key, &v2).await);
        match store.update(&key, &sample_record("d", 3), &v2).await {
            Err(Error::NotFound { .. }) => {}
            other => panic!("update of a deleted key: expected NotFound, got {other:?}"),
        }
        match store.delete(&key, &v2).await {
            Err(Error::NotFound { .. }) => {}
            other => panic!("delete of a deleted key: expected NotFound, got {other:?}"),
        }
    }

    /// Of N concurrent updates from the same version exactly one should win; the rest conflict.
    pub async fn store_concurrent_updates_one_wins(store: DynLeaseStore) {
        const N: usize = 8;
        let key = unique_key("race-update");
        let v = fail(
            "create",
            store.create(&key, &sample_record("start", 0)).await,
        );
        let mut tasks = Vec::new();
        for i in 0..N {
            let (store, key, v) = (store.clone(), key.clone(), v.clone());
            tasks.push(tokio::spawn(async move {
                store
                    .update(&key, &sample_record(&format!("writer-{i}"), 1), &v)
                    .await
            }));
        }
        let mut winners = Vec::new();
        for (i, t) in tasks.into_iter().enumerate() {
            match t.await.expect("update task panicked") {
                Ok(version) => winners.push((i, version)),
                Err(Error::Conflict { .. }) => {}
                Err(e) => panic!("racing update {i}: expected success or Conflict, got {e:?}"),
            }
        }
        assert_eq!(
            winners.len(),
            1,
            "exactly one racing update wins: {winners:?}"
        );
        let got = fail("get", store.get(&key).await).expect("record present");
        assert_eq!(
            got.record.holder_identity,
            format!("writer-{}", winners[0].0)
        );
        assert_eq!(got.version, winners[0].1);
        fail("cleanup", store.delete(&key, &got.version).await);
    }

    /// Of N concurrent creates of one key exactly one should win; the rest get `AlreadyExists`.
    pub async fn store_concurrent_creates_one_wins(store: DynLeaseStore) {
        const N: usize = 8;
        let key = unique_key("race-create");
        let mut tasks = Vec::new();
        for i in 0..N {
            let (store, key) = (store.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                store
                    .create(&key, &sample_record(&format!("creator-{i}"), 0))
                    .await
            }));
        }
        let mut winners = Vec::new();
        for (i, t) in tasks.into_iter().enumerate() {
            match t.await.expect("create task panicked") {
                Ok(version) => winners.push((i, version)),
                Err(Error::AlreadyExists { .. }) => {}
                Err(e) => panic!("racing create {i}: expected success or AlreadyExists, got {e:?}"),
            }
        }
        assert_eq!(
            winners.len(),
            1,
            "exactly one racing create wins: {winners:?}"
        );
        let got = fail("get", store.get(&key).await).expect("record present");
        assert_eq!(
            got.record.holder_identity,
            format!("creator-{}", winners[0].0)
        );
        fail("cleanup", store.delete(&key, &got.version).await);
    }

    /// A watch from the version the caller saw should deliver every later change, in order, and
    /// nothing the caller already saw.
    pub async fn store_watch_delivers_changes_in_order(store: DynLeaseStore) {
        if !store.capabilities().watch {
            assert_watch_unsupported(&store).await;
            return;
        }
        let key = unique_key("watch-order");
        let mut version = fail("create", store.create(&key, &sample_record("w0", 0)).await);
        let seen = fail("get", store.get(&key).await).expect("record present");
        assert_eq!(seen.version, version);
        let mut stream = fail("watch", store.watch(&key, Some(&seen.version)).await);
        assert_no_event(&mut stream, Duration::from_millis(300), "before any change").await;
        let mut expected = Vec::new();
        for i in 1..=5u64 {
            let rec = sample_record(&format!("w{i}"), i);
            version = fail("update", store.update(&key, &rec, &version).await);
            expected.push((rec, version.clone()));
        }
        for (i, (rec, v)) in expected.into_iter().enumerate() {
            let (got, got_v) = put_version(next_event(&mut stream, "watch").await, "watch");
            assert_eq!(got, rec, "change {i} delivered in order");
            assert_eq!(got_v, v, "change {i} carries its version");
        }
        fail("delete", store.delete(&key, &version).await);
        match next_event(&mut stream, "watch delete").await {
            WatchEvent::Deleted => {}
            other => panic!("expected Deleted, got {other:?}"),
        }
    }

    /// A change made between `get` and `watch` should still be delivered.
    pub async fn store_watch_loses_nothing_after_get(store: DynLeaseStore) {
        if !store.capabilities().watch {
            assert_watch_unsupported(&store).await;
            return;
        }
        let key = unique_key("watch-gap");
        let v1 = fail("create", store.create(&key, &sample_record("a", 0)).await);
        let seen = fail("get", store.get(&key).await).expect("record present");
        // A change lands before the watch starts.
        let rec2 = sample_record("b", 1);
        let v2 = fail("update", store.update(&key, &rec2, &v1).await);
        let mut stream = fail("watch", store.watch(&key, Some(&seen.version)).await);
        let (got, got_v) = put_version(next_event(&mut stream, "watch").await, "watch");
        assert_eq!(
            got, rec2,
            "the change made between get and watch is delivered"
        );
        assert_eq!(got_v, v2);
        let rec3 = sample_record("c", 2);
        let v3 = fail("update", store.update(&key, &rec3, &v2).await);
        let (got, got_v) = put_version(next_event(&mut stream, "watch").await, "watch");
        assert_eq!((got, got_v), (rec3, v3.clone()));
        fail("cleanup", store.delete(&key, &v3).await);
    }

    /// A watch without a version should start with the current state, then deliver changes; on a
    /// missing key it should start quiet and deliver the creation.
    pub async fn store_watch_from_current_state(store: DynLeaseStore) {
        if !store.capabilities().watch {
            assert_watch_unsupported(&store).await;
            return;
        }
        let key = unique_key("watch-now");
        let mut stream = fail("watch", store.watch(&key, None).await);
        assert_no_event(
            &mut stream,
            Duration::from_millis(300),
            "watch of a missing key",
        )
        .await;
        let rec = sample_record("a", 0);
        let v1 = fail("create", store.create(&key, &rec).await);
        let (got, got_v) = put_version(next_event(&mut stream, "creation").await, "creation");
        assert_eq!((got, got_v), (rec.clone(), v1.clone()));
        drop(stream);
        let mut stream = fail("watch", store.watch(&key, None).await);
        let (got, got_v) = put_version(next_event(&mut stream, "current state").await, "current");
        assert_eq!((got, got_v), (rec, v1.clone()));
        fail("cleanup", store.delete(&key, &v1).await);
        assert!(matches!(
            next_event(&mut stream, "delete").await,
            WatchEvent::Deleted
        ));
    }

    /// List should return exactly the keys under the prefix, sorted, with their records and
    /// versions.
    pub async fn store_list_by_prefix(store: DynLeaseStore) {
        let base = unique_prefix();
        let prefix = KeyPrefix::new(format!("{base}ctrl-")).expect("valid prefix");
        let mut expected = Vec::new();
        for name in ["ctrl-b", "ctrl-a", "ctrl-c"] {
            let key = LeaseKey::new(format!("{base}{name}")).expect("valid key");
            let rec = sample_record(name, 0);
            let v = fail("create", store.create(&key, &rec).await);
            expected.push((key, rec, v));
        }
        let mut others = Vec::new();
        for name in ["ctrl", "ctrlx-a", "other-ctrl-a"] {
            let key = LeaseKey::new(format!("{base}{name}")).expect("valid key");
            let v = fail("create", store.create(&key, &sample_record(name, 0)).await);
            others.push((key, v));
        }
        expected.sort_by(|a, b| a.0.cmp(&b.0));
        let listed = fail("list", store.list(&prefix).await);
        let got: Vec<_> = listed
            .iter()
            .map(|(k, v)| (k.clone(), v.record.clone(), v.version.clone()))
            .collect();
        assert_eq!(
            got, expected,
            "list returns exactly the keys under the prefix"
        );
        let empty = KeyPrefix::new(format!("{base}none-")).expect("valid prefix");
        assert!(fail("list", store.list(&empty).await).is_empty());
        for (k, _, v) in expected {
            fail("cleanup", store.delete(&k, &v).await);
        }
        for (k, v) in others {
            fail("cleanup", store.delete(&k, &v).await);
        }
        assert!(
            fail("list", store.list(&prefix).await).is_empty(),
            "deleted keys are gone from list"
        );
    }

    /// Invalid keys and prefixes should be rejected before they reach a store (typed
    /// `InvalidKey` naming the rule), and every shape of valid key at the edges of the rules should
    /// reach the store unchanged: created, read back and listed under its own name, distinct from
    /// keys that differ only in `.` versus `-`.
    pub async fn store_invalid_keys_rejected(store: DynLeaseStore) {
        let too_long = "a".repeat(MAX_KEY_LEN + 1);
        for bad in [
            "",
            "Upper",
            "under_score",
            "-start",
            "end-",
            ".dot",
            "a..b",
            "sp ace",
            "ünï",
            "a/b",
            too_long.as_str(),
        ] {
            match LeaseKey::new(bad) {
                Err(Error::InvalidKey { key, rule }) => {
                    assert_eq!(key, bad);
                    assert!(!rule.is_empty());
                }
                other => panic!("key {bad:?}: expected InvalidKey, got {other:?}"),
            }
        }
        for bad in ["-x", "A", "a..", "x/"] {
            assert!(KeyPrefix::new(bad).is_err(), "prefix {bad:?} is invalid");
        }
        // Valid keys at the edges of the rules, under a fresh prefix.
        let prefix = unique_prefix();
        let longest = format!("{prefix}{}", "a".repeat(MAX_KEY_LEN - prefix.len()));
        let dotted = format!("{prefix}{}", ["x"; 40].join("."));
        let shapes = [
            format!("{prefix}a.b"),
            format!("{prefix}a-b"),
            format!("{prefix}0"),
            format!("{prefix}9.z-0"),
            dotted,
            longest,
        ];
        let mut created = Vec::new();
        for (i, name) in shapes.iter().enumerate() {
            let key = LeaseKey::new(name).unwrap_or_else(|e| panic!("{name:?} is valid: {e}"));
            let rec = sample_record(&format!("holder-{i}"), i as u64);
            let version = fail("create", store.create(&key, &rec).await);
            let got =
                fail("get", store.get(&key).await).unwrap_or_else(|| panic!("{name:?} reads back"));
            assert_eq!(got.record, rec, "{name:?} round-trips");
            assert_eq!(got.version, version);
            created.push((key, version));
        }
        let listed = fail(
            "list",
            store
                .list(&KeyPrefix::new(&prefix).expect("valid prefix"))
                .await,
        );
        let mut names: Vec<&str> = listed.iter().map(|(k, _)| k.as_str()).collect();
        names.sort_unstable();
        let mut want: Vec<&str> = shapes.iter().map(String::as_str).collect();
        want.sort_unstable();
        assert_eq!(
            names, want,
            "every key listed under its own name, none merged"
        );
        for (key, version) in created {
            fail("delete", store.delete(&key, &version).await);
        }
    }

    /// Unicode identities, the longest identity and the longest key should round-trip unchanged.
    pub async fn store_unicode_and_max_length_round_trip(store: DynLeaseStore) {
        let base = unique_prefix();
        let long_key = format!("{base}{}", "k".repeat(MAX_KEY_LEN - base.len()));
        let key = LeaseKey::new(&long_key).expect("a 253-character key is valid");
        assert_eq!(key.as_str().len(), MAX_KEY_LEN);
        let mut ident = String::from("ノード-ß-🦀-");
        while ident.len() < MAX_IDENTITY_LEN {
            ident.push('x');
        }
        let rec = sample_record(&ident, 42);
        let v = fail("create", store.create(&key, &rec).await);
        let got = fail("get", store.get(&key).await).expect("record present");
        assert_eq!(
            got.record, rec,
            "unicode, maximum-length identity round-trips"
        );
        let unicode = sample_record("контроллер-1", 43);
        let v2 = fail("update", store.update(&key, &unicode, &v).await);
        assert_eq!(
            fail("get", store.get(&key).await).expect("present").record,
            unicode
        );
        fail("cleanup", store.delete(&key, &v2).await);
    }

    /// Records should round-trip every field: empty holder, microsecond times, no times, large
    /// transition counts.
    pub async fn store_record_fields_round_trip(store: DynLeaseStore) {
        let key = unique_key("fields");
        let mut rec = sample_record("", 0);
        rec.acquire_time = None;
        rec.renew_time = None;
        rec.lease_duration = Duration::from_secs(1);
        let mut v = fail("create", store.create(&key, &rec).await);
        assert_eq!(
            fail("get", store.get(&key).await).expect("present").record,
            rec
        );
        for transitions in [1u64, 1_000, i32::MAX as u64] {
            let mut r = sample_record("holder", transitions);
            r.lease_duration = Duration::from_secs(60);
            v = fail("update", store.update(&key, &r, &v).await);
            assert_eq!(
                fail("get", store.get(&key).await).expect("present").record,
                r
            );
        }
        fail("cleanup", store.delete(&key, &v).await);
    }

    /// Writes to one key should neither change nor wake watchers of another key.
    pub async fn store_independent_keys_do_not_interfere(store: DynLeaseStore) {
        let base = unique_prefix();
        let a = LeaseKey::new(format!("{base}a")).expect("valid");
        let b = LeaseKey::new(format!("{base}b")).expect("valid");
        let va = fail("create a", store.create(&a, &sample_record("a", 0)).await);
        let vb = fail("create b", store.create(&b, &sample_record("b", 0)).await);
        let mut watch_b = if store.capabilities().watch {
            Some(fail("watch b", store.watch(&b, Some(&vb)).await))
        } else {
            assert_watch_unsupported(&store).await;
            None
        };
        let mut tasks = Vec::new();
        for (key, mut v) in [(a.clone(), va), (b.clone(), vb)] {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                for i in 1..=10u64 {
                    v = store
                        .update(&key, &sample_record(key.as_str(), i), &v)
                        .await
                        .unwrap_or_else(|e| panic!("update {key}: {e}"));
                }
                v
            }));
        }
        let mut finals = Vec::new();
        for t in tasks {
            finals.push(t.await.expect("writer panicked"));
        }
        for (key, v) in [(&a, &finals[0]), (&b, &finals[1])] {
            let got = fail("get", store.get(key).await).expect("present");
            assert_eq!(got.record.holder_identity, key.as_str());
            assert_eq!(got.record.transitions, 10);
            assert_eq!(&got.version, v);
        }
        if let Some(stream) = watch_b.as_mut() {
            for i in 1..=10u64 {
                let (rec, _) = put_version(next_event(stream, "watch b").await, "watch b");
                assert_eq!(rec.holder_identity, b.as_str(), "watch of b sees only b");
                assert_eq!(rec.transitions, i);
            }
        }
        fail("cleanup", store.delete(&a, &finals[0]).await);
        fail("cleanup", store.delete(&b, &finals[1]).await);
    }

    // ---------------------------------------------------------------------------------------------
    // Elector cases

    /// A single candidate should acquire the lease, write itself as holder with its fencing token
    /// as the record's transitions, and release it on shutdown.
    pub async fn elector_single_candidate_acquires(store: DynLeaseStore) {
        let key = unique_key("single");
        let a = spawn(&handle(&store), &key, "cand-a");
        let (token, _) = Monitor::new(&a, "a").leading().await;
        let rec = fail("get", store.get(&key).await).expect("the elector created the record");
        assert_eq!(rec.record.holder_identity, "cand-a");
        assert_eq!(
            rec.record.transitions, token,
            "the record's transitions is the leader's fencing token"
        );
        assert!(rec.record.acquire_time.is_some() && rec.record.renew_time.is_some());
        assert!(a.check_health().is_ok());
        a.shutdown().await.expect("the elector shuts down cleanly");
        assert!(!a.is_leading());
        let rec = fail("get", store.get(&key).await).expect("record kept");
        assert_eq!(
            rec.record.holder_identity, "",
            "shutdown releases the lease"
        );
        assert_eq!(
            rec.record.lease_duration,
            Duration::from_secs(1),
            "release writes 1 s"
        );
        cleanup(&store, &key).await;
    }

    /// Among N candidates exactly one should lead, and it should keep leading without flapping.
    pub async fn elector_exactly_one_leader(store: DynLeaseStore) {
        const N: usize = 4;
        let key = unique_key("one-of-n");
        let electors: Vec<Elector> = (0..N)
            .map(|i| spawn(&handle(&store), &key, &format!("cand-{i}")))
            .collect();
        // Wait until someone leads.
        let deadline = Instant::now() + WAIT_LIMIT;
        let leader = loop {
            let leading: Vec<usize> = (0..N).filter(|i| electors[*i].is_leading()).collect();
            assert!(leading.len() <= 1, "two electors lead at once: {leading:?}");
            if let [i] = leading[..] {
                break i;
            }
            assert!(Instant::now() < deadline, "no leader within {WAIT_LIMIT:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        // Over several renewals, still exactly that one, and everyone knows who it is.
        let mut monitors: Vec<_> = electors.iter().map(|e| e.subscribe()).collect();
        for m in &mut monitors {
            m.borrow_and_update();
        }
        let until = Instant::now() + LEASE + RETRY * 2;
        while Instant::now() < until {
            let leading: Vec<usize> = (0..N).filter(|i| electors[*i].is_leading()).collect();
            assert_eq!(leading, vec![leader], "exactly one leader at any time");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for (i, e) in electors.iter().enumerate() {
            if i != leader {
                let want = format!("cand-{leader}");
                let mut m = Monitor::new(e, &format!("cand-{i}"));
                m.wait_for("aware of the leader", |s| s.leader() == Some(want.as_str()))
                    .await;
            }
        }
        assert!(
            !monitors[leader].has_changed().unwrap_or(true),
            "the leader's status did not change while it renewed"
        );
        for e in &electors {
            e.shutdown().await.expect("the elector shuts down cleanly");
        }
        cleanup(&store, &key).await;
    }

    /// When the leader shuts down, a waiting follower should take over through the release, long
    /// before the lease could have expired, with a larger fencing token.
    pub async fn elector_graceful_handover(store: DynLeaseStore) {
        let key = unique_key("handover");
        // A lease far longer than WAIT_LIMIT: taking over by expiry would fail this case.
        let cfg = |id: &str| {
            ElectorConfig::new(key.clone(), id).with_timings(
                WAIT_LIMIT * 4,
                Duration::from_secs(2),
                Duration::from_millis(250),
            )
        };
        create_released(&store, &key).await;
        let a = spawn_with(&handle(&store), cfg("cand-a"));
        let (ta, _) = Monitor::new(&a, "a").leading().await;
        let b = spawn_with(&handle(&store), cfg("cand-b"));
        Monitor::new(&b, "b")
            .wait_for("following a", |s| s.leader() == Some("cand-a"))
            .await;
        let shut = Instant::now();
        a.shutdown().await.expect("the elector shuts down cleanly");
        let (tb, at) = Monitor::new(&b, "b").leading().await;
        assert!(tb > ta, "fencing token grows on handover: {ta} then {tb}");
        assert!(at >= shut);
        let rec = fail("get", store.get(&key).await).expect("present");
        assert_eq!(rec.record.holder_identity, "cand-b");
        assert_eq!(rec.record.transitions, tb);
        b.shutdown().await.expect("the elector shuts down cleanly");
        cleanup(&store, &key).await;
    }

    /// When the leader crashes (is cut off and never releases), a follower should take over only
    /// after the lease expired, and only after the old leader stepped down.
    pub async fn elector_crash_takeover_after_expiry(store: DynLeaseStore) {
        let key = unique_key("crash");
        let ha = handle(&store);
        let a = spawn(&ha, &key, "cand-a");
        let mut ma = Monitor::new(&a, "a");
        let (ta, _) = ma.leading().await;
        let b = spawn(&handle(&store), &key, "cand-b");
        let mut mb = Monitor::new(&b, "b");
        mb.wait_for("following a", |s| s.leader() == Some("cand-a"))
            .await;
        let crash = Instant::now();
        ha.faults().set_partitioned(true);
        // Both waits run at once, so each instant is taken when its change happens.
        let ((tb, b_at), a_down) = tokio::join!(mb.leading(), ma.not_leading());
        assert!(tb > ta, "fencing token grows: {ta} then {tb}");
        // A's last renewal was sent at most one retry period before the crash; B observed it after
        // that and waited a whole lease duration.
        assert!(
            b_at.duration_since(crash) >= LEASE - RETRY,
            "b took over {:?} after the crash, before the lease ({LEASE:?}) could expire",
            b_at.duration_since(crash)
        );
        assert!(
            a_down <= b_at,
            "the old leader stepped down before the new one led"
        );
        assert_eq!(
            ma.rx.borrow().leader(),
            None,
            "a cut-off elector does not claim to know the leader"
        );
        a.shutdown().await.expect("the elector shuts down cleanly");
        b.shutdown().await.expect("the elector shuts down cleanly");
        cleanup(&store, &key).await;
    }

    /// A leader whose renewals fail should step down (at its renew deadline) before any follower can
    /// acquire the lease.
    pub async fn elector_renew_failure_steps_down_first(store: DynLeaseStore) {
        let key = unique_key("renew-fail");
        let ha = handle(&store);
        let a = spawn(&ha, &key, "cand-a");
        let mut ma = Monitor::new(&a, "a");
        ma.leading().await;
        let b = spawn(&handle(&store), &key, "cand-b");
        let mut mb = Monitor::new(&b, "b");
        mb.wait_for("following a", |s| s.leader() == Some("cand-a"))
            .await;
        let broken = Instant::now();
        ha.faults().fail_for(WAIT_LIMIT);
        let (a_down, (_, b_at)) = tokio::join!(ma.not_leading(), mb.leading());
        assert!(
            a_down < b_at,
            "the failing leader stepped down before the follower led"
        );
        assert!(
            a_down.duration_since(broken) + RETRY >= RENEW,
            "a stepped down only once its renew deadline passed"
        );
        ha.faults().heal();
        a.shutdown().await.expect("the elector shuts down cleanly");
        b.shutdown().await.expect("the elector shuts down cleanly");
        cleanup(&store, &key).await;
    }

    /// The fencing token should grow with every acquisition of an existing record, also for a new
    /// elector instance with a previous holder's identity: by exactly one on a store without commit
    /// tokens (client-go's `leaseTransitions`), strictly on one that assigns them at commit.
    pub async fn elector_fencing_token_increases(store: DynLeaseStore) {
        let commit = store.capabilities().commit_tokens;
        let key = unique_key("fencing");
        let h = handle(&store);
        let mut last: Option<u64> = None;
        for round in 0..3u64 {
            let e = spawn(&h, &key, "same-identity");
            let (t, _) = Monitor::new(&e, "e").leading().await;
            if let Some(prev) = last {
                if commit {
                    assert!(t > prev, "acquisition {round}: token {t} after {prev}");
                } else {
                    assert_eq!(
                        t,
                        prev + 1,
                        "acquisition {round} has the previous token + 1"
                    );
                }
            }
            last = Some(t);
            e.shutdown().await.expect("the elector shuts down cleanly");
        }
        cleanup(&store, &key).await;
    }

    /// On shutdown the release should be written only after the leader task has finished, so the
    /// next leader never overlaps it; a guard held outside the task delays it too.
    pub async fn elector_release_after_leader_tasks(store: DynLeaseStore) {
        let key = unique_key("ordered");
        let a = Arc::new(spawn(&handle(&store), &key, "cand-a"));
        Monitor::new(&a, "a").leading().await;
        let stop = CancellationToken::new();
        let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
        let tasks = {
            let (a, store, key) = (a.clone(), store.clone(), key.clone());
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut seen_tx = Some(seen_tx);
                let mut started_tx = Some(started_tx);
                run_leader_tasks(stop, a.clone(), move |leader| {
                    let store = store.clone();
                    let key = key.clone();
                    let seen_tx = seen_tx.take();
                    let started_tx = started_tx.take();
                    async move {
                        if let Some(tx) = started_tx {
                            let _ = tx.send(());
                        }
                        leader.cancelled().await;
                        let cause = leader.cause();
                        // Slow cleanup: the lease must still be ours meanwhile.
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        let rec = store.get(&key).await.ok().flatten();
                        if let Some(tx) = seen_tx {
                            let _ = tx.send((cause, rec));
                        }
                    }
                })
                .await;
            })
        };
        // The leader task runs before shutdown starts.
        timeout(WAIT_LIMIT, started_rx)
            .await
            .unwrap_or_else(|_| panic!("the leader task did not start within {WAIT_LIMIT:?}"))
            .expect("the leader task started");
        // An outside guard, dropped later still.
        let guard = a.current_status().0;
        assert!(guard.is_leading());
        let dropper = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            drop(guard);
            Instant::now()
        });
        a.shutdown().await.expect("the elector shuts down cleanly");
        let released = Instant::now();
        let (cause, rec) = timeout(WAIT_LIMIT, seen_rx)
            .await
            .unwrap_or_else(|_| panic!("the leader task did not finish within {WAIT_LIMIT:?}"))
            .expect("the leader task ran");
        assert_eq!(cause, Some(StopCause::SteppedDown));
        let rec = rec.expect("record present while the task cleaned up");
        assert_eq!(
            rec.record.holder_identity, "cand-a",
            "the lease was still held while the leader task finished"
        );
        let guard_dropped = dropper.await.expect("dropper");
        assert!(
            guard_dropped <= released,
            "release waited for the outside guard"
        );
        let rec = fail("get", store.get(&key).await).expect("present");
        assert_eq!(rec.record.holder_identity, "", "released after the tasks");
        stop.cancel();
        tasks.await.expect("run_leader_tasks");
        cleanup(&store, &key).await;
    }

    /// Yielding should release the lease and keep the elector from campaigning for the given time.
    pub async fn elector_yield(store: DynLeaseStore) {
        let key = unique_key("yield");
        let a = spawn(&handle(&store), &key, "cand-a");
        let mut ma = Monitor::new(&a, "a");
        let (t0, _) = ma.leading().await;
        let hold = Duration::from_secs(1);
        let start = Instant::now();
        fail("yield", a.yield_for(hold).await);
        assert!(!a.is_leading());
        let rec = fail("get", store.get(&key).await).expect("present");
        assert_eq!(rec.record.holder_identity, "", "yield released the lease");
        // With no one else around, a takes the lease back only after the yield.
        let (t1, at) = ma.leading().await;
        assert!(
            at.duration_since(start) >= hold,
            "no campaign during the yield"
        );
        assert!(t1 > t0);
        // A follower takes over during another yield.
        let b = spawn(&handle(&store), &key, "cand-b");
        Monitor::new(&b, "b")
            .wait_for("following a", |s| s.leader() == Some("cand-a"))
            .await;
        fail("yield", a.yield_for(WAIT_LIMIT * 2).await);
        let (t2, _) = Monitor::new(&b, "b").leading().await;
        assert!(t2 > t1);
        a.shutdown().await.expect("the elector shuts down cleanly");
        b.shutdown().await.expect("the elector shuts down cleanly");
        cleanup(&store, &key).await;
    }

    /// Followers should know the leader's identity from the status, and learn the new one after a
    /// handover.
    pub async fn elector_followers_see_leader(store: DynLeaseStore) {
        let key = unique_key("identity");
        let a = spawn(&handle(&store), &key, "leader-ä");
        Monitor::new(&a, "a").leading().await;
        let b = spawn(&handle(&store), &key, "follower-b");
        let c = spawn(&handle(&store), &key, "follower-c");
        for (e, n) in [(&b, "b"), (&c, "c")] {
            Monitor::new(e, n)
                .wait_for("seeing leader-ä", |s| s.leader() == Some("leader-ä"))
                .await;
            assert_eq!(e.leader().as_deref(), Some("leader-ä"));
        }
        a.shutdown().await.expect("the elector shuts down cleanly");
        // One of b/c leads; the other sees it.
        let deadline = Instant::now() + WAIT_LIMIT;
        let (leader, follower) = loop {
            if b.is_leading() {
                break (&b, &c);
            }
            if c.is_leading() {
                break (&c, &b);
            }
            assert!(Instant::now() < deadline, "no new leader");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let id = leader.config().identity.clone();
        Monitor::new(follower, "follower")
            .wait_for("seeing the new leader", |s| s.leader() == Some(id.as_str()))
            .await;
        b.shutdown().await.expect("the elector shuts down cleanly");
        c.shutdown().await.expect("the elector shuts down cleanly");
        cleanup(&store, &key).await;
    }

    /// On a store that can watch, a follower should send no requests at all in steady state, and the
    /// leader about one write per retry period.
    pub async fn elector_watching_follower_is_quiet(store: DynLeaseStore) {
        if !store.capabilities().watch {
            assert_watch_unsupported(&store).await;
            return;
        }
        let key = unique_key("quiet");
        let ha = handle(&store);
        let hb = handle(&store);
        let a = spawn(&ha, &key, "cand-a");
        Monitor::new(&a, "a").leading().await;
        let b = spawn(&hb, &key, "cand-b");
        Monitor::new(&b, "b")
            .wait_for("following a", |s| s.leader() == Some("cand-a"))
            .await;
        // Let b settle (its initial read and watch), then count.
        tokio::time::sleep(RETRY).await;
        let (b0, a0) = (hb.faults().requests(), ha.faults().writes());
        let window = RETRY * 6;
        let start = Instant::now();
        tokio::time::sleep(window).await;
        let elapsed = start.elapsed();
        let (b1, a1) = (hb.faults().requests(), ha.faults().writes());
        assert!(b.leader().as_deref() == Some("cand-a"));
        assert_eq!(
            b1 - b0,
            0,
            "a watching follower sent {} requests in {elapsed:?}",
            b1 - b0
        );
        let renewals = a1 - a0;
        let max = elapsed.as_millis() / RETRY.as_millis() + 1;
        assert!(renewals >= 1, "the leader renewed during {elapsed:?}");
        assert!(
            renewals as u128 <= max,
            "the leader wrote {renewals} times in {elapsed:?}; at most one write per retry period expected"
        );
        a.shutdown().await.expect("the elector shuts down cleanly");
        b.shutdown().await.expect("the elector shuts down cleanly");
        cleanup(&store, &key).await;
    }
}
