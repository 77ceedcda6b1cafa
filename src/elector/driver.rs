//! The driver: a thin tokio task that turns the machine's outputs into store calls, a watch and
//! timers, and their results back into inputs; and publishes the status. Every decision is the
//! machine's ([`super::machine`]).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::handle::{Command, Shared, now};
use super::machine::{self, Machine, Op, Output, Reply, RequestId, WatchId};
use crate::error::{Error, Result};
use crate::status::{LeaderStatus, Leadership, Validity, set_validity};
use crate::store::{DynLeaseStore, LeaseKey, WatchStream};

/// Ends an elector, however its task ends (returned, panicked, or dropped with its runtime):
/// revokes any term still valid, publishes the terminal [`LeaderStatus::Stopped`], closes the
/// command queue and wakes every waiter of [`Elector::stopped`].
pub(super) struct StopGuard(Arc<Shared>);

impl Drop for StopGuard {
    fn drop(&mut self) {
        let shared = &self.0;
        if let Some(v) = shared
            .validity
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            set_validity(&v, Validity::Revoked);
        }
        shared.status.set(LeaderStatus::Stopped);
        shared.metrics.leading(false);
        shared.commands.close();
        shared.stopped.cancel();
    }
}

pub(super) type Pending<T> = Option<BoxFuture<'static, T>>;

pub(super) struct Driver {
    pub(super) machine: Machine,
    pub(super) store: DynLeaseStore,
    pub(super) shared: Arc<Shared>,
}

async fn call(store: DynLeaseStore, key: LeaseKey, op: Op) -> Result<Reply> {
    match op {
        Op::Get => store.get(&key).await.map(Reply::Record),
        Op::Create(r) => store.create(&key, &r).await.map(Reply::Written),
        Op::Update { record, expected } => store
            .update(&key, &record, &expected)
            .await
            .map(Reply::Written),
        Op::FencingSeed => store.fencing_seed(&key).await.map(Reply::Seed),
        Op::Acquire { record, expected } => store
            .acquire(&key, &record, expected.as_ref())
            .await
            .map(Reply::Acquired),
    }
}

pub(super) fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Get => "get",
        Op::Create(_) => "create",
        Op::Update { .. } => "update",
        Op::FencingSeed => "fencing_seed",
        Op::Acquire { .. } => "acquire",
    }
}

impl Driver {
    /// The task: `drive`, plus failure handling. Built so that the task's future holds the driver
    /// once (inside `drive`'s future), not twice.
    pub(super) fn run(self) -> impl Future<Output = ()> + Send + 'static {
        let shared = self.shared.clone();
        // Marks the elector stopped when this task ends, also if it panics or is aborted (its
        // runtime shut down).
        let stopped = StopGuard(shared.clone());
        std::panic::AssertUnwindSafe(self.drive())
            .catch_unwind()
            .map(move |result| {
                if let Err(panic) = result {
                    let message = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic with a non-string payload".to_owned());
                    tracing::error!(message, "the elector's task panicked; it has stopped");
                    *shared.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
                    if let Some(v) = shared
                        .validity
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .take()
                    {
                        set_validity(&v, Validity::Revoked);
                    }
                }
                drop(stopped);
            })
    }

    /// Moves the current term's validity to `valid_until` (a renewal, or a cut).
    fn move_validity(&self, valid_until: std::time::Instant) {
        if let Some(v) = &*self
            .shared
            .validity
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            set_validity(v, Validity::Until(Instant::from_std(valid_until)));
        }
    }

    /// Carries out the machine's outputs.
    fn apply(&mut self, io: &mut Io) {
        while let Some(out) = self.machine.poll_output() {
            match out {
                Output::Request(req) => {
                    let store = self.store.clone();
                    let key = self.shared.config.key.clone();
                    let operation = op_name(&req.op);
                    let deadline = Instant::from_std(req.deadline);
                    let after = deadline.saturating_duration_since(Instant::now());
                    let id = req.id;
                    let op = req.op;
                    let store_name = self.shared.store_name;
                    io.request_sent = Some(Instant::now());
                    io.request = Some(Box::pin(async move {
                        let r = tokio::time::timeout_at(deadline, call(store, key, op))
                            .await
                            .unwrap_or(Err(Error::Timeout {
                                store: store_name,
                                operation,
                                after,
                            }));
                        (id, r)
                    }));
                }
                Output::OpenWatch {
                    id,
                    after,
                    deadline,
                } => {
                    io.watch = None;
                    let store = self.store.clone();
                    let key = self.shared.config.key.clone();
                    let deadline = Instant::from_std(deadline);
                    let limit = deadline.saturating_duration_since(Instant::now());
                    let store_name = self.shared.store_name;
                    io.opening = Some(Box::pin(async move {
                        let r =
                            tokio::time::timeout_at(deadline, store.watch(&key, after.as_ref()))
                                .await
                                .unwrap_or(Err(Error::Timeout {
                                    store: store_name,
                                    operation: "watch",
                                    after: limit,
                                }));
                        (id, r)
                    }));
                }
                Output::CloseWatch => {
                    io.watch = None;
                    io.opening = None;
                }
                Output::Leading {
                    fencing_token,
                    valid_until,
                } => {
                    let (l, rx) = Leadership::new_term(
                        fencing_token,
                        Validity::Until(Instant::from_std(valid_until)),
                    );
                    *self
                        .shared
                        .validity
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = Some(l.validity_cell());
                    let shared = Arc::downgrade(&self.shared);
                    l.set_panic_hook(Box::new(move |message| {
                        if let Some(shared) = shared.upgrade() {
                            shared.leader_task_panicked(message);
                        }
                    }));
                    self.shared.status.set(LeaderStatus::Leading(l.clone()));
                    *self
                        .shared
                        .tokens_exhausted
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = None;
                    self.shared.metrics.leading(true);
                    self.shared
                        .metrics
                        .acquired(io.campaign_since.take().map(|t| t.elapsed()));
                    io.term = Some(l);
                    io.drained = Some(Box::pin(async move {
                        let _ = rx.await;
                    }));
                }
                Output::Renewed { valid_until } => {
                    if let Some(sent) = io.request_sent {
                        self.shared.metrics.renewed(sent.elapsed());
                    }
                    self.move_validity(valid_until);
                }
                Output::Shortened { valid_until } => self.move_validity(valid_until),
                Output::TokensExhausted { last } => {
                    *self
                        .shared
                        .tokens_exhausted
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = Some(last);
                }
                Output::TermEnded { cause } => {
                    self.shared.metrics.leading(false);
                    io.campaign_since = Some(Instant::now());
                    if let Some(l) = io.term.take() {
                        l.mark_ended(cause);
                    }
                    self.shared
                        .status
                        .set(LeaderStatus::NotLeading { leader: None });
                }
                Output::Revoked => {
                    if let Some(v) = self
                        .shared
                        .validity
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .take()
                    {
                        set_validity(&v, Validity::Revoked);
                    }
                }
                Output::Following { leader } => {
                    self.shared.status.set(LeaderStatus::NotLeading { leader });
                }
                Output::YieldDone { id } => {
                    if let Some(tx) = io.yields.remove(&id) {
                        let _ = tx.send(());
                    }
                }
                Output::Stopped => {}
            }
        }
    }

    /// Feeds one event back into the machine.
    fn handle(&mut self, io: &mut Io, ev: Ev) {
        match ev {
            Ev::Timer => {
                io.armed = None;
                self.machine.handle_input(now(), machine::Input::Timeout);
            }
            Ev::Shutdown => {
                io.shutdown_sent = true;
                self.machine
                    .handle_input(now(), machine::Input::Command(machine::Command::Shutdown));
            }
            Ev::Command(Command::Yield(duration, tx)) => {
                io.next_yield += 1;
                io.yields.insert(io.next_yield, tx);
                self.machine.handle_input(
                    now(),
                    machine::Input::Command(machine::Command::Yield {
                        id: io.next_yield,
                        duration,
                    }),
                );
            }
            Ev::Reply(id, r) => {
                io.request = None;
                self.shared.store_outcome(r.as_ref().err());
                self.machine
                    .handle_input(now(), machine::Input::Reply { id, result: r });
            }
            Ev::Opened(id, r) => {
                io.opening = None;
                self.shared.store_outcome(r.as_ref().err());
                match r {
                    Ok(s) => {
                        io.watch = Some((id, s));
                        self.machine.handle_input(
                            now(),
                            machine::Input::WatchOpened { id, result: Ok(()) },
                        );
                    }
                    Err(e) => self
                        .machine
                        .handle_input(now(), machine::Input::WatchOpened { id, result: Err(e) }),
                }
            }
            Ev::Item(id, item) => {
                if !matches!(item, Some(Ok(_))) {
                    io.watch = None;
                }
                self.machine
                    .handle_input(now(), machine::Input::WatchItem { id, item });
            }
            Ev::Drained => {
                io.drained = None;
                self.machine
                    .handle_input(now(), machine::Input::TasksDrained);
            }
        }
    }

    /// The driver loop. (An `async move` block rather than an `async fn`: an `async fn` keeps a
    /// second copy of its by-value arguments in its future, rust-lang/rust#62958.)
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    fn drive(mut self) -> impl Future<Output = ()> + Send + 'static {
        async move {
            let mut io = Io {
                campaign_since: Some(Instant::now()),
                ..Io::default()
            };
            let mut sleep = Box::pin(tokio::time::sleep_until(Instant::now()));
            loop {
                self.apply(&mut io);
                if self.machine.is_stopped() {
                    return;
                }
                let wake = self.machine.poll_timeout().map(Instant::from_std);
                if wake != io.armed {
                    if let Some(t) = wake {
                        sleep.as_mut().reset(t);
                    }
                    io.armed = wake;
                }
                // One poll over every source, timers first: no ready input can starve a deadline
                // (the machine also processes due timers on every input). Polling persistent
                // sources keeps the task small (no per-branch futures held across the wait).
                let shared = &self.shared;
                let ev = std::future::poll_fn(|cx| io.poll(cx, shared, sleep.as_mut())).await;
                self.handle(&mut io, ev);
            }
        }
    }
}

/// The driver's I/O in flight.
#[derive(Default)]
pub(super) struct Io {
    pub(super) request: Pending<(RequestId, Result<Reply>)>,
    /// When the request in flight was sent.
    pub(super) request_sent: Option<Instant>,
    /// When campaigning for the next term started (start-up or the end of a term).
    pub(super) campaign_since: Option<Instant>,
    pub(super) opening: Pending<(WatchId, Result<WatchStream>)>,
    pub(super) watch: Option<(WatchId, WatchStream)>,
    pub(super) term: Option<Leadership>,
    pub(super) drained: Pending<()>,
    pub(super) yields: HashMap<u64, oneshot::Sender<()>>,
    pub(super) next_yield: u64,
    pub(super) shutdown_sent: bool,
    pub(super) armed: Option<Instant>,
}

impl Io {
    fn poll(
        &mut self,
        cx: &mut std::task::Context<'_>,
        shared: &Shared,
        sleep: std::pin::Pin<&mut tokio::time::Sleep>,
    ) -> std::task::Poll<Ev> {
        use std::task::Poll;
        if self.armed.is_some() && sleep.poll(cx).is_ready() {
            return Poll::Ready(Ev::Timer);
        }
        if let Poll::Ready(c) = shared.commands.poll_recv(cx) {
            match c {
                Some(c) => return Poll::Ready(Ev::Command(c)),
                None if !self.shutdown_sent => return Poll::Ready(Ev::Shutdown),
                None => {}
            }
        }
        if let Some(f) = self.request.as_mut()
            && let Poll::Ready((id, r)) = f.as_mut().poll(cx)
        {
            return Poll::Ready(Ev::Reply(id, r));
        }
        if let Some(f) = self.opening.as_mut()
            && let Poll::Ready((id, r)) = f.as_mut().poll(cx)
        {
            return Poll::Ready(Ev::Opened(id, r));
        }
        if let Some((id, s)) = self.watch.as_mut()
            && let Poll::Ready(item) = s.poll_next_unpin(cx)
        {
            return Poll::Ready(Ev::Item(*id, item));
        }
        if let Some(f) = self.drained.as_mut()
            && f.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Ev::Drained);
        }
        Poll::Pending
    }
}

/// What woke the driver.
pub(super) enum Ev {
    Timer,
    Shutdown,
    Command(Command),
    Reply(RequestId, Result<Reply>),
    Opened(WatchId, Result<WatchStream>),
    Item(WatchId, Option<Result<crate::WatchEvent>>),
    Drained,
}
