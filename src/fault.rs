//! Fault injection for tests: [`FaultyStore`] wraps any store and adds latency, errors,
//! partitions, pauses, ambiguous writes, and request counting. **Not API-stable.**
//!
//! Several `FaultyStore`s over one inner store behave like several clients of one server: a
//! partition of one handle makes that handle fail while the others keep working.
//!
//! ```
//! # async fn demo() {
//! use std::sync::Arc;
//! use leasehold::{MemoryStore, fault::FaultyStore};
//! let shared = Arc::new(MemoryStore::new());
//! let a = FaultyStore::new(shared.clone());
//! let b = FaultyStore::new(shared);
//! a.faults().set_partitioned(true); // a's operations now fail; b's work
//! # }
//! ```
//!
//! # The life of one operation
//!
//! 1. It is counted ([`Faults::requests`], [`Faults::calls`], the [call log](Faults::set_call_log)),
//!    and panics if [`Faults::panic_after`] says so.
//! 2. It waits the [latency](Faults::set_latency), then its own [delay](Faults::set_delay).
//! 3. While the "server" is [paused](Faults::pause_for) it waits for the pause to end; a write
//!    then runs even if its caller gave up meanwhile (the request was already sent).
//! 4. It fails without reaching the store when the handle is partitioned, an injected failure
//!    is due ([`Faults::fail_next`], [`Faults::fail_for`]) or the operation is set failing
//!    ([`Faults::set_failing`]); an operation the reported capabilities lack answers
//!    [`Error::Unsupported`] (see [`FaultyStore::with_capabilities`]).
//! 5. It runs on the wrapped store. A write that committed may then answer an error
//!    ([`Faults::error_after_commit`]) or be sent again as a client retry would after a lost
//!    reply, answering with the retry's result ([`Faults::replay_after_commit`]).
//! 6. Its answer waits the operation's [reply delay](Faults::set_reply_delay).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::{Error, Result};
use crate::store::{
    Acquired, Capabilities, DynLeaseStore, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, Version,
    Versioned, WatchStream,
};

/// A store operation, to aim a fault at or to count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// [`LeaseStore::get`].
    Get,
    /// [`LeaseStore::create`].
    Create,
    /// [`LeaseStore::update`].
    Update,
    /// [`LeaseStore::delete`].
    Delete,
    /// [`LeaseStore::watch`] (opening the stream).
    Watch,
    /// [`LeaseStore::list`].
    List,
    /// [`LeaseStore::acquire`].
    Acquire,
    /// [`LeaseStore::fencing_seed`].
    FencingSeed,
}

const OPS: usize = 8;

// === impl Op ===

impl Op {
    /// Whether the operation writes: `create`, `update`, `delete` or `acquire`.
    pub fn is_write(self) -> bool {
        matches!(self, Op::Create | Op::Update | Op::Delete | Op::Acquire)
    }

    fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        match self {
            Op::Get => "get",
            Op::Create => "create",
            Op::Update => "update",
            Op::Delete => "delete",
            Op::Watch => "watch",
            Op::List => "list",
            Op::Acquire => "acquire",
            Op::FencingSeed => "fencing_seed",
        }
    }
}

#[derive(Debug, Default)]
struct FaultState {
    latency: Duration,
    fail_next: u64,
    fail_until: Option<Instant>,
    failing: [bool; OPS],
    delay: [Duration; OPS],
    reply_delay: [Duration; OPS],
    paused_until: Option<Instant>,
    error_after_commit: u64,
    replay_after_commit: u64,
    watch_streams_fail: bool,
    panic_after: [Option<u64>; OPS],
    call_log: Option<Vec<(Op, Instant)>>,
}

/// What a committed write answers (step 5 of the [module docs](self)).
enum AfterCommit {
    Answer,
    Error,
    Replay,
}

/// The fault controls of one [`FaultyStore`] handle. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Faults {
    state: Arc<Mutex<FaultState>>,
    partitioned: Arc<watch::Sender<bool>>,
    requests: Arc<AtomicU64>,
    calls: Arc<[AtomicU64; OPS]>,
}

// === impl Faults ===

impl Faults {
    fn new() -> Self {
        Faults {
            state: Arc::default(),
            partitioned: Arc::new(watch::Sender::new(false)),
            requests: Arc::default(),
            calls: Arc::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FaultState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `latency` before every operation (and before each watch event is delivered).
    pub fn set_latency(&self, latency: Duration) {
        self.lock().latency = latency;
    }

    /// Makes every `op` wait `delay` (after the latency) before anything else happens to it:
    /// before it fails, waits for a pause or reaches the store.
    pub fn set_delay(&self, op: Op, delay: Duration) {
        self.lock().delay[op.index()] = delay;
    }

    /// Makes every `op` wait `delay` after it ran on the store (a write has committed), before
    /// it answers.
    pub fn set_reply_delay(&self, op: Op, delay: Duration) {
        self.lock().reply_delay[op.index()] = delay;
    }

    /// Makes the next `n` operations fail with [`Error::Unavailable`].
    pub fn fail_next(&self, n: u64) {
        self.lock().fail_next = n;
    }

    /// Makes every operation fail with [`Error::Unavailable`] for `window` from now (any
    /// duration; one too large to represent means "until healed").
    pub fn fail_for(&self, window: Duration) {
        self.lock().fail_until = Some(crate::status::instant_after(Instant::now(), window));
    }

    /// Makes every `op` in `ops` fail with [`Error::Unavailable`] without reaching the store
    /// (`failing: true`), or stops that (`false`).
    pub fn set_failing(&self, ops: &[Op], failing: bool) {
        let mut st = self.lock();
        for op in ops {
            st.failing[op.index()] = failing;
        }
    }

    /// Pauses the "server" for `window` from now (any duration; one too large to represent
    /// means "until healed"): every operation waits until the pause ends, and a write sent
    /// meanwhile runs then even if its caller gave up.
    pub fn pause_for(&self, window: Duration) {
        self.lock().paused_until = Some(crate::status::instant_after(Instant::now(), window));
    }

    /// Makes the next `n` writes commit, then answer [`Error::Unavailable`], as a write whose
    /// reply was lost does.
    pub fn error_after_commit(&self, n: u64) {
        self.lock().error_after_commit = n;
    }

    /// Makes the next `n` writes (after any [`error_after_commit`](Self::error_after_commit)
    /// ones) commit, then run again as a client retry after a lost reply would, answering with
    /// the retry's result (a retried `create` answers [`Error::AlreadyExists`], a retried
    /// `update` [`Error::Conflict`]).
    pub fn replay_after_commit(&self, n: u64) {
        self.lock().replay_after_commit = n;
    }

    /// Makes every watch open, then fail at once: its stream yields one
    /// [`Error::Unavailable`] and ends.
    pub fn set_watch_streams_fail(&self, fail: bool) {
        self.lock().watch_streams_fail = fail;
    }

    /// Lets `n` more calls of `op` through, then makes every later call panic (a buggy store).
    pub fn panic_after(&self, op: Op, n: u64) {
        self.lock().panic_after[op.index()] = Some(n);
    }

    /// Starts (`true`, from an empty log) or stops (`false`) recording the instant of every
    /// operation, for [`call_times`](Self::call_times).
    pub fn set_call_log(&self, on: bool) {
        self.lock().call_log = on.then(Vec::new);
    }

    /// The instants at which `op` was called since the [call log](Self::set_call_log) started.
    pub fn call_times(&self, op: Op) -> Vec<Instant> {
        self.lock()
            .call_log
            .iter()
            .flatten()
            .filter(|(o, _)| *o == op)
            .map(|(_, t)| *t)
            .collect()
    }

    /// Cuts this handle off (or reconnects it): while partitioned every operation fails with
    /// [`Error::Unavailable`] and open watch streams end with an error.
    pub fn set_partitioned(&self, partitioned: bool) {
        self.partitioned.send_replace(partitioned);
    }

    /// Clears every fault (the counters and the call log stay).
    pub fn heal(&self) {
        let mut st = self.lock();
        let log = st.call_log.take();
        *st = FaultState {
            call_log: log,
            ..FaultState::default()
        };
        drop(st);
        self.set_partitioned(false);
    }

    /// How many operations (of any kind, failed or not) this handle has been asked to do.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// How many calls of `op` (failed or not) this handle has been asked to do.
    pub fn calls(&self, op: Op) -> u64 {
        self.calls[op.index()].load(Ordering::Relaxed)
    }

    /// How many writes (`create`, `update`, `delete`) this handle has been asked to do.
    pub fn writes(&self) -> u64 {
        [Op::Create, Op::Update, Op::Delete]
            .into_iter()
            .map(|op| self.calls(op))
            .sum()
    }

    /// Steps 1 and 2 of the module docs; returns the end of a pause, if one is on.
    async fn enter(&self, op: Op) -> Option<Instant> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.calls[op.index()].fetch_add(1, Ordering::Relaxed);
        let (wait, panic) = {
            let mut st = self.lock();
            if let Some(log) = st.call_log.as_mut() {
                log.push((op, Instant::now()));
            }
            let panic = match st.panic_after[op.index()].as_mut() {
                Some(0) => true,
                Some(n) => {
                    *n -= 1;
                    false
                }
                None => false,
            };
            (st.latency.saturating_add(st.delay[op.index()]), panic)
        };
        if panic {
            panic!("{}: an injected panic in a store call", op.name());
        }
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        self.lock().paused_until.filter(|t| Instant::now() < *t)
    }

    /// Step 4 of the module docs.
    fn check(&self, store: &'static str, op: Op) -> Result<()> {
        let injected = {
            let mut st = self.lock();
            if st.fail_next > 0 {
                st.fail_next -= 1;
                Some("an injected failure")
            } else if st.fail_until.is_some_and(|t| Instant::now() < t) {
                Some("an injected failure window")
            } else if st.failing[op.index()] {
                Some("an injected failure of this operation")
            } else {
                None
            }
        };
        let op = op.name();
        if *self.partitioned.borrow() {
            return Err(Error::Unavailable {
                store,
                message: format!("{op}: this handle is partitioned from the store (injected)"),
                source: None,
            });
        }
        if let Some(what) = injected {
            return Err(Error::Unavailable {
                store,
                message: format!("{op}: {what}"),
                source: None,
            });
        }
        Ok(())
    }

    fn after_commit(&self) -> AfterCommit {
        let mut st = self.lock();
        if st.error_after_commit > 0 {
            st.error_after_commit -= 1;
            AfterCommit::Error
        } else if st.replay_after_commit > 0 {
            st.replay_after_commit -= 1;
            AfterCommit::Replay
        } else {
            AfterCommit::Answer
        }
    }

    async fn reply_delay(&self, op: Op) {
        let delay = self.lock().reply_delay[op.index()];
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
    }
}

/// A store wrapper that injects faults and counts requests. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct FaultyStore {
    inner: DynLeaseStore,
    faults: Faults,
    capabilities: Option<Capabilities>,
    micros: bool,
}

/// Truncates a time to whole microseconds.
fn micros(t: Option<SystemTime>) -> Option<SystemTime> {
    t.map(|t| match t.duration_since(UNIX_EPOCH) {
        Ok(d) => UNIX_EPOCH + Duration::from_micros(d.as_micros().try_into().unwrap_or(u64::MAX)),
        Err(_) => t,
    })
}

// === impl FaultyStore ===

impl FaultyStore {
    /// Wraps `inner` with no faults active.
    pub fn new(inner: DynLeaseStore) -> Self {
        FaultyStore {
            inner,
            faults: Faults::new(),
            capabilities: None,
            micros: false,
        }
    }

    /// Reports `capabilities` instead of the wrapped store's (to test how the elector reacts
    /// to them), and behaves as a store with them: without `watch`, [`LeaseStore::watch`]
    /// answers [`Error::Unsupported`] (a store that cannot watch); without `commit_tokens`,
    /// [`LeaseStore::acquire`] does. Operations the capabilities allow are forwarded.
    pub fn with_capabilities(mut self, capabilities: Capabilities) -> Self {
        self.capabilities = Some(capabilities);
        self
    }

    /// Stores the records' times truncated to whole microseconds, as the Redis and etcd codecs
    /// and Kubernetes' `MicroTime` keep them.
    pub fn with_microsecond_times(mut self) -> Self {
        self.micros = true;
        self
    }

    /// This handle's fault controls.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// The wrapped store.
    pub fn inner(&self) -> &DynLeaseStore {
        &self.inner
    }

    fn record(&self, r: &LeaseRecord) -> LeaseRecord {
        if !self.micros {
            return r.clone();
        }
        LeaseRecord {
            acquire_time: micros(r.acquire_time),
            renew_time: micros(r.renew_time),
            ..r.clone()
        }
    }

    fn unsupported(&self, op: Op) -> Result<()> {
        let caps = self.capabilities();
        let supported = match op {
            Op::Watch => caps.watch,
            Op::Acquire => caps.commit_tokens,
            _ => true,
        };
        if supported {
            Ok(())
        } else {
            Err(Error::Unsupported {
                store: self.name(),
                operation: op.name(),
            })
        }
    }

    /// A read through steps 1–4 and 6 of the module docs.
    async fn read<T>(&self, op: Op, run: impl Future<Output = Result<T>>) -> Result<T> {
        if let Some(until) = self.faults.enter(op).await {
            tokio::time::sleep_until(until).await;
        }
        self.faults.check(self.name(), op)?;
        self.unsupported(op)?;
        let answer = run.await;
        self.faults.reply_delay(op).await;
        answer
    }

    /// A write through every step of the module docs. `run` sends it to the store (again,
    /// for a replay); it is owned, so that the write can run after its caller gave up.
    async fn write<T, F, Fut>(&self, op: Op, key: &LeaseKey, run: F) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(DynLeaseStore, LeaseKey) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T>> + Send,
    {
        let paused = self.faults.enter(op).await;
        let this = self.clone();
        let key = key.clone();
        let rest = async move {
            if let Some(until) = paused {
                tokio::time::sleep_until(until).await;
            }
            this.faults.check(this.name(), op)?;
            this.unsupported(op)?;
            let mut answer = run(this.inner.clone(), key.clone()).await;
            if answer.is_ok() {
                match this.faults.after_commit() {
                    AfterCommit::Answer => {}
                    AfterCommit::Error => {
                        answer = Err(Error::Unavailable {
                            store: this.name(),
                            message: format!(
                                "{}: committed, then the reply was lost (injected)",
                                op.name()
                            ),
                            source: None,
                        });
                    }
                    AfterCommit::Replay => answer = run(this.inner.clone(), key).await,
                }
            }
            this.faults.reply_delay(op).await;
            answer
        };
        if paused.is_some() {
            // Sent into the paused server: it runs when the pause ends, whoever still waits.
            tokio::spawn(rest).await.unwrap_or_else(|e| {
                Err(Error::Unavailable {
                    store: self.name(),
                    message: format!("{}: the queued write failed: {e}", op.name()),
                    source: None,
                })
            })
        } else {
            rest.await
        }
    }
}

#[async_trait]
impl LeaseStore for FaultyStore {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.capabilities
            .unwrap_or_else(|| self.inner.capabilities())
    }
    async fn get(&self, key: &LeaseKey) -> Result<Option<Versioned>> {
        self.read(Op::Get, self.inner.get(key)).await
    }
    async fn create(&self, key: &LeaseKey, record: &LeaseRecord) -> Result<Version> {
        let record = self.record(record);
        self.write(Op::Create, key, move |store, key| {
            let record = record.clone();
            async move { store.create(&key, &record).await }
        })
        .await
    }
    async fn update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> Result<Version> {
        let (record, expected) = (self.record(record), expected.clone());
        self.write(Op::Update, key, move |store, key| {
            let (record, expected) = (record.clone(), expected.clone());
            async move { store.update(&key, &record, &expected).await }
        })
        .await
    }
    async fn delete(&self, key: &LeaseKey, expected: &Version) -> Result<()> {
        let expected = expected.clone();
        self.write(Op::Delete, key, move |store, key| {
            let expected = expected.clone();
            async move { store.delete(&key, &expected).await }
        })
        .await
    }
    async fn watch(&self, key: &LeaseKey, after: Option<&Version>) -> Result<WatchStream> {
        let store = self.name();
        let mut inner = self.read(Op::Watch, self.inner.watch(key, after)).await?;
        if self.faults.lock().watch_streams_fail {
            // Opens, then fails at once.
            return Ok(futures::stream::once(async move {
                Err(Error::Unavailable {
                    store,
                    message: "watch: the stream failed at once (injected)".into(),
                    source: None,
                })
            })
            .boxed());
        }
        let mut partitioned = self.faults.partitioned.subscribe();
        let faults = self.faults.clone();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    cut = async { partitioned.wait_for(|p| *p).await.is_ok() } => {
                        if cut {
                            let _ = tx
                                .send(Err(Error::Unavailable {
                                    store,
                                    message: "watch: this handle is partitioned from the store (injected)".into(),
                                    source: None,
                                }))
                                .await;
                        }
                        return;
                    }
                    item = inner.next() => {
                        let Some(item) = item else { return };
                        let latency = faults.lock().latency;
                        if !latency.is_zero() {
                            tokio::time::sleep(latency).await;
                        }
                        if tx.send(item).await.is_err() {
                            return;
                        }
                    }
                    () = tx.closed() => return,
                }
            }
        });
        Ok(ReceiverStream::new(rx).boxed())
    }
    async fn list(&self, prefix: &KeyPrefix) -> Result<Vec<(LeaseKey, Versioned)>> {
        self.read(Op::List, self.inner.list(prefix)).await
    }

    async fn acquire(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: Option<&Version>,
    ) -> Result<Acquired> {
        let (record, expected) = (self.record(record), expected.cloned());
        self.write(Op::Acquire, key, move |store, key| {
            let (record, expected) = (record.clone(), expected.clone());
            async move { store.acquire(&key, &record, expected.as_ref()).await }
        })
        .await
    }

    async fn fencing_seed(&self, key: &LeaseKey) -> Result<u64> {
        self.read(Op::FencingSeed, self.inner.fencing_seed(key))
            .await
    }
}

#[cfg(test)]
mod tests {
    use std::panic::AssertUnwindSafe;

    use futures::FutureExt;

    use super::*;
    use crate::MemoryStore;

    fn key() -> LeaseKey {
        LeaseKey::new("fault").expect("valid key")
    }

    fn record(holder: &str) -> LeaseRecord {
        LeaseRecord {
            holder_identity: holder.to_owned(),
            lease_duration: Duration::from_secs(15),
            acquire_time: Some(UNIX_EPOCH + Duration::from_nanos(1_764_446_659_123_456_789)),
            renew_time: None,
            transitions: 1,
        }
    }

    fn over(mem: &MemoryStore) -> FaultyStore {
        FaultyStore::new(Arc::new(mem.clone()))
    }

    async fn stored(mem: &MemoryStore) -> Option<Versioned> {
        mem.get(&key()).await.expect("get")
    }

    /// A write that committed and then answered an error is in the store.
    #[tokio::test]
    async fn an_error_after_commit_leaves_the_write_committed() {
        let mem = MemoryStore::new();
        let s = over(&mem);
        s.faults().error_after_commit(1);
        let e = s.create(&key(), &record("a")).await.expect_err("injected");
        assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
        assert_eq!(stored(&mem).await.expect("committed").record, record("a"));
        let v = stored(&mem).await.expect("present").version;
        assert!(s.update(&key(), &record("b"), &v).await.is_ok(), "only one");
    }

    /// A replayed write answers as a client retry does: AlreadyExists, Conflict.
    #[tokio::test]
    async fn a_replayed_write_answers_like_a_retry() {
        let mem = MemoryStore::new();
        let s = over(&mem);
        s.faults().replay_after_commit(2);
        let e = s.create(&key(), &record("a")).await.expect_err("replayed");
        assert!(matches!(e, Error::AlreadyExists { .. }), "{e:?}");
        let v = stored(&mem).await.expect("committed").version;
        let e = s
            .update(&key(), &record("b"), &v)
            .await
            .expect_err("replayed");
        assert!(matches!(e, Error::Conflict { .. }), "{e:?}");
        assert_eq!(stored(&mem).await.expect("present").record, record("b"));
    }

    /// A failing operation does not reach the store; the others do.
    #[tokio::test]
    async fn a_failing_operation_does_not_reach_the_store() {
        let mem = MemoryStore::new();
        let s = over(&mem);
        s.faults().set_failing(&[Op::Create], true);
        assert!(s.create(&key(), &record("a")).await.is_err());
        assert!(stored(&mem).await.is_none());
        assert!(s.get(&key()).await.is_ok());
        s.faults().heal();
        assert!(s.create(&key(), &record("a")).await.is_ok());
    }

    /// A write sent into a paused server runs when the pause ends, though its caller gave up.
    #[tokio::test(start_paused = true)]
    async fn a_write_sent_during_a_pause_lands_after_it() {
        let mem = MemoryStore::new();
        let s = over(&mem);
        s.faults().pause_for(Duration::from_secs(10));
        let started = Instant::now();
        let gave_up =
            tokio::time::timeout(Duration::from_secs(1), s.create(&key(), &record("a"))).await;
        assert!(gave_up.is_err(), "the caller gave up during the pause");
        assert!(stored(&mem).await.is_none(), "not before the pause ends");
        tokio::time::sleep_until(started + Duration::from_secs(10)).await;
        tokio::task::yield_now().await;
        assert!(stored(&mem).await.is_some(), "landed when the pause ended");
        let read = s.get(&key()).await;
        assert!(read.is_ok());
    }

    /// Delays wait before the operation, reply delays after it committed.
    #[tokio::test(start_paused = true)]
    async fn delays_come_before_and_reply_delays_after_the_commit() {
        let mem = MemoryStore::new();
        let s = over(&mem);
        s.faults().set_delay(Op::Create, Duration::from_secs(2));
        s.faults()
            .set_reply_delay(Op::Create, Duration::from_secs(3));
        let started = Instant::now();
        let write = tokio::spawn({
            let s = s.clone();
            async move { s.create(&key(), &record("a")).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(stored(&mem).await.is_none(), "still delayed");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(stored(&mem).await.is_some(), "committed after the delay");
        assert!(!write.is_finished(), "the answer waits");
        write.await.expect("joined").expect("created");
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    /// Capabilities without watch or commit tokens make those operations Unsupported.
    #[tokio::test]
    async fn missing_capabilities_answer_unsupported() {
        let mem = MemoryStore::new();
        let s = over(&mem).with_capabilities(Capabilities::POLL);
        assert!(matches!(
            s.watch(&key(), None).await,
            Err(Error::Unsupported {
                operation: "watch",
                ..
            })
        ));
        assert!(matches!(
            s.acquire(&key(), &record("a"), None).await,
            Err(Error::Unsupported {
                operation: "acquire",
                ..
            })
        ));
        assert!(stored(&mem).await.is_none());
        assert_eq!(s.faults().calls(Op::Watch), 1);
        let full = over(&mem);
        assert!(
            full.acquire(&key(), &record("a"), None).await.is_ok(),
            "forwarded"
        );
    }

    /// A failing watch stream opens, yields one error and ends.
    #[tokio::test]
    async fn a_failing_watch_stream_errors_once_and_ends() {
        let s = over(&MemoryStore::new());
        s.faults().set_watch_streams_fail(true);
        let mut w = s.watch(&key(), None).await.expect("opens");
        assert!(matches!(
            w.next().await,
            Some(Err(Error::Unavailable { .. }))
        ));
        assert!(w.next().await.is_none());
    }

    /// `panic_after` lets n calls through, then panics; the call log records instants.
    #[tokio::test]
    async fn panics_after_n_calls_and_logs_calls() {
        let s = over(&MemoryStore::new());
        s.faults().set_call_log(true);
        s.faults().panic_after(Op::Get, 1);
        assert!(s.get(&key()).await.is_ok());
        let second = AssertUnwindSafe(s.get(&key())).catch_unwind().await;
        assert!(second.is_err(), "the second get panics");
        assert_eq!(s.faults().call_times(Op::Get).len(), 2);
        assert!(s.faults().call_times(Op::List).is_empty());
    }

    /// Microsecond times are stored truncated; otherwise unchanged.
    #[tokio::test]
    async fn microsecond_times_are_truncated() {
        let mem = MemoryStore::new();
        let s = over(&mem).with_microsecond_times();
        s.create(&key(), &record("a")).await.expect("created");
        let got = stored(&mem).await.expect("present").record;
        assert_eq!(
            got.acquire_time,
            Some(UNIX_EPOCH + Duration::from_micros(1_764_446_659_123_456))
        );
        assert_eq!(got.renew_time, None);
    }
}
