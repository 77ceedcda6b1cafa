//! The elector's decisions as a sans-IO state machine.
//!
//! [`Machine`] holds every decision of an [`Elector`](crate::Elector) — when to read, acquire,
//! renew, step down and release — and does no I/O: it never touches a store, a timer, a task or
//! a clock. The caller feeds it inputs stamped with the current time ([`Now`]) and drains its
//! outputs ([`Output`]): store requests to send, a watch to open or close, status changes to
//! publish. Every input goes through one method, [`Machine::handle_input`]
//! ([`Input::Timeout`], a [`Command`], a [`Reply`], a watch's outcome and items, drained tasks),
//! and [`Machine::poll_timeout`] says when it next needs an [`Input::Timeout`].
//!
//! The tokio driver behind [`Elector`](crate::Elector) is one such caller; the deterministic
//! simulator in the test suite and the scripted tests (`tests/machine_scripts.rs`) are others.
//! This is the shape of quinn-proto and str0m.
//!
//! **Unstable:** this module is a separate surface for drivers and simulators; its types may
//! change in any release (it is outside the crate's semver promise). Applications use
//! [`Elector`](crate::Elector).
//!
//! # Contract for a driver
//!
//! - Send every [`Output::Request`] to the store and report its result with [`Input::Reply`] —
//!   by the request's `deadline` at the latest: a request still unanswered then is reported as
//!   an error (for example [`Error::Timeout`]). At most one request is outstanding at a time.
//! - Open a watch on [`Output::OpenWatch`] and report the outcome with [`Input::WatchOpened`];
//!   feed its items with [`Input::WatchItem`] (`None` when the stream ended). Drop the stream on
//!   [`Output::CloseWatch`]. Items of a watch id that is not current are ignored.
//! - Feed [`Input::Timeout`] no later than [`Machine::poll_timeout`]; early or often is harmless.
//!   Every input also processes whatever timers are due, so a busy input source can never starve
//!   a deadline.
//! - Publish the status outputs in order. After [`Output::TermEnded`], report
//!   [`Input::TasksDrained`] once nothing works on the ended term any more.
//! - `Now::instant` must come from a monotonic clock; `Now::wall` is only written into records.

use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tracing::{debug, info, warn};

use crate::elector::ElectorConfig;
use crate::error::Error;
use crate::status::StopCause;
use crate::store::{Acquired, Capabilities, LeaseRecord, Version, Versioned, WatchEvent};

/// The lease duration written on release (client-go writes 1 s).
pub const RELEASE_LEASE_DURATION: Duration = Duration::from_secs(1);

/// The longest lease duration honoured from a record: a longer one (for example
/// `leaseDurationSeconds: 18446744073709551615` written by someone with access) is treated as
/// this long, with a warning.
pub const MAX_RECORD_LEASE_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// The current time, as the driver reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Now {
    /// A monotonic instant: every decision is made on it.
    pub instant: Instant,
    /// The wall clock: only written into records (informational, as in client-go).
    pub wall: SystemTime,
}

/// Identifies one store request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Identifies one watch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WatchId(pub u64);

/// A store operation the machine asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Op {
    /// [`LeaseStore::get`](crate::LeaseStore::get); answer with [`Reply::Record`].
    Get,
    /// [`LeaseStore::create`](crate::LeaseStore::create); answer with [`Reply::Written`].
    Create(LeaseRecord),
    /// [`LeaseStore::update`](crate::LeaseStore::update); answer with [`Reply::Written`].
    Update {
        /// The record to write.
        record: LeaseRecord,
        /// The version to compare against.
        expected: Version,
    },
    /// [`LeaseStore::fencing_seed`](crate::LeaseStore::fencing_seed); answer with
    /// [`Reply::Seed`].
    FencingSeed,
    /// [`LeaseStore::acquire`](crate::LeaseStore::acquire) (the store assigns the fencing token
    /// at commit); answer with [`Reply::Acquired`]. Only sent to a store that declares
    /// [`Capabilities::commit_tokens`].
    Acquire {
        /// The record to write (its `transitions` is replaced by the store).
        record: LeaseRecord,
        /// The version to compare against; `None` to create.
        expected: Option<Version>,
    },
}

/// A store request to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Pass it back with the reply.
    pub id: RequestId,
    /// What to do.
    pub op: Op,
    /// When to give up: report an error (such as [`Error::Timeout`]) if no answer came by then.
    pub deadline: Instant,
}

/// A store's successful answer to a [`Request`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reply {
    /// The answer to [`Op::Get`].
    Record(Option<Versioned>),
    /// The answer to [`Op::Create`] and [`Op::Update`]: the new version.
    Written(Version),
    /// The answer to [`Op::FencingSeed`].
    Seed(u64),
    /// The answer to [`Op::Acquire`].
    Acquired(Acquired),
}

/// A request from the elector's owner.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Command {
    /// Step down in order (tasks drain, then the release), then stop.
    Shutdown,
    /// Step down in order and do not campaign for `duration`; answered with
    /// [`Output::YieldDone`] carrying `id`.
    Yield {
        /// Echoed in [`Output::YieldDone`].
        id: u64,
        /// How long not to campaign, counted from when the lease is released (or from now when
        /// it is not held).
        duration: Duration,
    },
}

/// One input to [`Machine::handle_input`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Input {
    /// Nothing happened but time: process the timers that are due (call it no later than
    /// [`Machine::poll_timeout`]; earlier or more often is harmless).
    Timeout,
    /// A request from the elector's owner.
    Command(Command),
    /// The answer to request `id`: by the request's deadline at the latest (a request still
    /// unanswered then is answered with an error such as [`Error::Timeout`]).
    Reply {
        /// The request's id.
        id: RequestId,
        /// The store's answer.
        result: Result<Reply, Error>,
    },
    /// The outcome of opening watch `id`.
    WatchOpened {
        /// The watch's id.
        id: WatchId,
        /// Whether it opened.
        result: Result<(), Error>,
    },
    /// An item of watch `id`; `None` when the stream ended.
    WatchItem {
        /// The watch's id.
        id: WatchId,
        /// The item.
        item: Option<Result<WatchEvent, Error>>,
    },
    /// Every task of the ended term has finished (its leadership guards are dropped); report it
    /// once after [`Output::TermEnded`].
    TasksDrained,
}

/// What the machine asks its driver to do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Output {
    /// Send a store request.
    Request(Request),
    /// Open a watch of the key after `after` (replacing any open one); give up at `deadline`.
    OpenWatch {
        /// Tag the outcome and the items with it.
        id: WatchId,
        /// Watch changes after this version (`None`: from the current state).
        after: Option<Version>,
        /// Report a failure if the watch is not open by then.
        deadline: Instant,
    },
    /// Drop the open watch, if any.
    CloseWatch,
    /// A new term began: this elector leads, with this fencing token, and may act on it until
    /// `valid_until` unless a later [`Output::Renewed`] moves that.
    Leading {
        /// The term's fencing token.
        fencing_token: u64,
        /// The term is valid until then (monotonic).
        valid_until: Instant,
    },
    /// A renewal was confirmed: the current term (even a draining one) is valid until then.
    Renewed {
        /// The new end of validity.
        valid_until: Instant,
    },
    /// The current term's validity was cut short: it is valid only until then (earlier than
    /// announced before). Sent when another writer shortened the lease duration in the record:
    /// followers that saw that write may take over sooner.
    Shortened {
        /// The new, earlier end of validity.
        valid_until: Instant,
    },
    /// No fencing token above `last` can be issued for the key, so this elector cannot start a
    /// term on it (see [`Error::TokenExhausted`]); it keeps following and tries again later.
    TokensExhausted {
        /// The highest token seen.
        last: u64,
    },
    /// The current term ended for `cause`: cancel its tasks. While the tasks drain after a
    /// graceful step-down the lease is still renewed, and the term stays valid until
    /// [`Output::Revoked`].
    TermEnded {
        /// Why.
        cause: StopCause,
    },
    /// The term's validity ends now: anything still holding it must not act on it any more.
    Revoked,
    /// Not leading; `leader` is the holder this elector sees, if any and not expired.
    Following {
        /// The current holder, if known.
        leader: Option<String>,
    },
    /// A [`Command::Yield`] has been carried out.
    YieldDone {
        /// The command's id.
        id: u64,
    },
    /// The machine has stopped; nothing more will come out of it.
    Stopped,
}

// --- internal state ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Seen {
    Absent,
    Record(Versioned),
    Corrupt(Option<Version>),
}

impl Seen {
    fn version(&self) -> Option<&Version> {
        match self {
            Seen::Absent => None,
            Seen::Record(v) => Some(&v.version),
            Seen::Corrupt(v) => v.as_ref(),
        }
    }
}

#[derive(Clone, Debug)]
struct Observed {
    seen: Seen,
    /// When this version was first observed (monotonic). Re-reading an unchanged version keeps
    /// it, so polling and re-established watches never postpone expiry.
    at: Instant,
}

/// A term this instance began: how its own records are recognised.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Mine {
    token: u64,
    acquire_time: Option<SystemTime>,
}

impl Mine {
    fn owns(&self, identity: &str, r: &LeaseRecord) -> bool {
        r.holder_identity == identity
            && r.transitions == self.token
            && r.acquire_time == self.acquire_time
    }
}

#[derive(Clone, Debug)]
struct Attempt {
    sent: Instant,
    renew_time: Option<SystemTime>,
}

#[derive(Debug)]
struct Term {
    mine: Mine,
    record: LeaseRecord,
    version: Version,
    /// When the last confirmed write of this term was sent.
    sent: Instant,
    /// Renewals sent since the last confirmed one (a landed one is recognised by its renew time).
    attempts: Vec<Attempt>,
    failures: u32,
    /// A bound on validity from a foreign write that shortened the record's lease duration:
    /// `(when it was observed, valid at most until)`. A renewal sent after the observation
    /// writes this elector's own duration again and lifts it.
    cut: Option<(Instant, Instant)>,
    /// Versions of this term's record that later ones replaced: a watch that delivers one of them
    /// late is stale.
    past: VecDeque<Version>,
}

/// How many replaced versions of a term's record are remembered.
const PAST_VERSIONS: usize = 16;

/// How many records' first observation times are remembered.
const FIRST_SEEN: usize = 8;

/// Where an observation came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// A direct read: the current state.
    Read,
    /// A watch item: may lag behind what this elector already knows from its own writes.
    Watch,
}

/// An acquire whose outcome is unknown (it failed or timed out): recognised if a read shows it
/// (holder and acquire time; and the fencing token when the elector chose it).
#[derive(Debug)]
struct PendingAcquire {
    record: LeaseRecord,
    sent: Instant,
    /// The token came from a fencing seed: checked against a second seed before leading.
    fresh: bool,
    /// The store assigns the token at commit: the record's token is not known in advance.
    commit: bool,
    /// The token of the record the acquire replaces (`None`: it creates).
    replaced_token: Option<u64>,
    /// The version the acquire compared against (`None`: it creates).
    expected: Option<Version>,
}

#[derive(Debug)]
enum Then {
    Stop { yields: Vec<u64> },
    Yield { ids: Vec<u64>, duration: Duration },
}

impl Then {
    fn stop(&mut self) {
        let ids = match self {
            Then::Stop { .. } => return,
            Then::Yield { ids, .. } => std::mem::take(ids),
        };
        *self = Then::Stop { yields: ids };
    }

    fn add_yield(&mut self, id: u64, d: Duration) {
        match self {
            Then::Stop { yields } => yields.push(id),
            Then::Yield { ids, duration } => {
                ids.push(id);
                *duration = d;
            }
        }
    }
}

#[derive(Debug)]
enum Mode {
    Following,
    Leading(Box<Term>),
    /// Stepped down on purpose; still renewing while the term's tasks drain.
    /// Until [`Timer::DrainEnd`].
    Draining {
        term: Box<Term>,
        then: Then,
    },
    /// Tasks drained: writing the release.
    Releasing {
        term: Box<Term>,
        then: Then,
        tries: u32,
    },
    Stopped,
}

#[derive(Debug)]
enum Purpose {
    Read,
    Seed {
        replace: Option<Version>,
    },
    Acquire {
        record: LeaseRecord,
        expected: Option<Version>,
        /// Its token came from a fencing seed: verified against a second seed before leading.
        fresh: bool,
        /// Sent as [`Op::Acquire`]: the store assigns the token at commit.
        commit: bool,
        /// The token of the record it replaces (`None`: it creates).
        replaced_token: Option<u64>,
    },
    /// A second seed after a fresh record landed at `version`.
    Verify {
        record: LeaseRecord,
        version: Version,
        sent: Instant,
        /// The lease duration stored at `version` (another writer may have shortened it).
        stored: Duration,
    },
    Renew {
        record: LeaseRecord,
    },
    Release {
        record: LeaseRecord,
    },
}

#[derive(Debug)]
struct InFlight {
    id: RequestId,
    sent: Instant,
    purpose: Box<Purpose>,
}

#[derive(Debug)]
enum WatchState {
    /// Not watching; opened again at [`Timer::WatchRetry`] (at once when unset).
    Closed,
    Opening(WatchId),
    Open(WatchId),
}

/// Every deadline of the machine, one slot each (quinn-proto's timer table):
/// [`Machine::poll_timeout`] is the earliest slot that matters in the current mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timer {
    /// A polling follower reads again (no watch open).
    Poll,
    /// A failed read may be retried.
    ReadRetry,
    /// A failed or lost acquire may be retried.
    AcquireRetry,
    /// A yield ends and campaigning resumes.
    YieldEnd,
    /// A broken watch is opened again.
    WatchRetry,
    /// The leader sends its next renewal.
    Renew,
    /// A graceful step-down gives up on tasks that have not finished.
    DrainEnd,
    /// The current term's validity ends (derived: last confirmed renewal + renew deadline, or a
    /// cut; refreshed after every step).
    TermEnd,
    /// The observed record expires for this follower (derived from the observation; refreshed
    /// after every step).
    Expiry,
}

impl Timer {
    const COUNT: usize = 9;
}

/// The deadlines, indexed by [`Timer`].
#[derive(Debug, Default)]
struct TimerTable([Option<Instant>; Timer::COUNT]);

impl std::ops::Index<Timer> for TimerTable {
    type Output = Option<Instant>;
    fn index(&self, t: Timer) -> &Option<Instant> {
        &self.0[t as usize]
    }
}

impl std::ops::IndexMut<Timer> for TimerTable {
    fn index_mut(&mut self, t: Timer) -> &mut Option<Instant> {
        &mut self.0[t as usize]
    }
}

/// The elector state machine. See the [module docs](self).
pub struct Machine {
    cfg: std::sync::Arc<ElectorConfig>,
    can_watch: bool,
    /// The store assigns fencing tokens at commit ([`Capabilities::commit_tokens`]).
    commit_tokens: bool,
    rng: u64,
    mode: Mode,
    observed: Option<Observed>,
    /// When recent records (version and content) were first observed.
    first_seen: VecDeque<(Versioned, Instant)>,
    known_max: Option<u64>,
    mine: Option<Mine>,
    /// An acquire whose outcome is unknown (it failed or timed out): recognised if a read shows it.
    pending_acquire: Option<Box<PendingAcquire>>,
    /// States (versions; `None` for absent) first observed while an acquire was in flight.
    seen_during_acquire: Vec<Option<Version>>,
    inflight: Option<InFlight>,
    next_id: u64,
    watch: WatchState,
    watch_failures: u32,
    need_read: bool,
    /// Every deadline (see [`Timer`]).
    timers: TimerTable,
    /// Not campaigning (a yield); until [`Timer::YieldEnd`], or for ever when that is unset.
    yielding: bool,
    deferred_yields: Vec<(u64, Duration)>,
    stop_requested: bool,
    out: VecDeque<Output>,
    published_leader: Option<Option<String>>,
    last_wall: Option<SystemTime>,
    last_now: Option<Instant>,
    seed_warned: bool,
}

impl fmt::Debug for Machine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Machine")
            .field("key", &self.cfg.key)
            .field("identity", &self.cfg.identity)
            .field("mode", &self.mode_name())
            .finish_non_exhaustive()
    }
}

fn micros(t: SystemTime) -> SystemTime {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => UNIX_EPOCH + Duration::from_micros(u64::try_from(d.as_micros()).unwrap_or(0)),
        Err(_) => UNIX_EPOCH,
    }
}

/// `t + d`, or `None` when that is not representable (treated as "never").
fn later(t: Instant, d: Duration) -> Option<Instant> {
    t.checked_add(d)
}

// === impl Machine ===

impl Machine {
    /// A machine for `config` (validated), campaigning from `now`. `caps` are the store's
    /// [`Capabilities`] (whether it can watch, whether it assigns fencing tokens at commit);
    /// `seed` seeds the jitter (use a random one; a simulator passes its own to replay a
    /// schedule exactly).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the configuration is invalid.
    pub fn new(
        config: ElectorConfig,
        caps: Capabilities,
        seed: u64,
        now: Now,
    ) -> Result<Self, Error> {
        config.validate()?;
        let mut m = Machine {
            cfg: std::sync::Arc::new(config),
            can_watch: caps.watch,
            commit_tokens: caps.commit_tokens,
            rng: seed ^ 0x9E37_79B9_7F4A_7C15,
            mode: Mode::Following,
            observed: None,
            first_seen: VecDeque::new(),
            known_max: None,
            mine: None,
            pending_acquire: None,
            seen_during_acquire: Vec::new(),
            inflight: None,
            next_id: 0,
            watch: WatchState::Closed,
            watch_failures: 0,
            need_read: true,
            timers: TimerTable::default(),
            yielding: false,
            deferred_yields: Vec::new(),
            stop_requested: false,
            out: VecDeque::new(),
            published_leader: None,
            last_wall: None,
            last_now: None,
            seed_warned: false,
        };
        m.step(now);
        Ok(m)
    }

    /// The configuration.
    pub fn config(&self) -> &ElectorConfig {
        &self.cfg
    }

    /// The configuration, shared (for a driver that keeps it too).
    pub fn shared_config(&self) -> std::sync::Arc<ElectorConfig> {
        self.cfg.clone()
    }

    /// The next output, if any.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// When [`Input::Timeout`] must be fed next (`None`: only inputs
    /// can change anything).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let now = self.last_now?;
        let mut due: Vec<Timer> = Vec::with_capacity(Timer::COUNT);
        if matches!(self.watch, WatchState::Closed)
            && self.can_watch
            && !matches!(self.mode, Mode::Stopped)
        {
            due.push(Timer::WatchRetry);
        }
        match &self.mode {
            Mode::Stopped => return None,
            Mode::Leading(_) => {
                due.push(Timer::TermEnd);
                if self.inflight.is_none() {
                    due.push(Timer::Renew);
                }
            }
            Mode::Draining { .. } => {
                due.extend([Timer::TermEnd, Timer::DrainEnd]);
                if self.inflight.is_none() {
                    due.push(Timer::Renew);
                }
            }
            Mode::Releasing { .. } => {}
            Mode::Following => {
                due.extend([Timer::ReadRetry, Timer::AcquireRetry]);
                if !matches!(self.watch, WatchState::Open(_)) {
                    due.push(Timer::Poll);
                }
                if self.yielding {
                    due.push(Timer::YieldEnd);
                }
                // The published leader turns to "none" at expiry.
                due.push(Timer::Expiry);
            }
        }
        due.into_iter()
            .filter_map(|t| self.timers[t])
            .filter(|t| *t > now)
            .min()
    }

    /// Whether the machine has stopped.
    pub fn is_stopped(&self) -> bool {
        matches!(self.mode, Mode::Stopped)
    }

    /// Feeds one input to the machine, stamped with the current time. Timers due at `now` are
    /// processed first (an input never lands before a deadline that is already due), and again
    /// after the input.
    pub fn handle_input(&mut self, now: Now, input: Input) {
        if let Input::Timeout = input {
            self.step(now);
            return;
        }
        self.step(now);
        match input {
            Input::Timeout => {}
            Input::Command(cmd) => self.on_command(now, cmd),
            Input::TasksDrained => self.on_tasks_drained(),
            Input::Reply { id, result } => self.on_reply(now, id, result),
            Input::WatchOpened { id, result } => self.on_watch_opened(now, id, result),
            Input::WatchItem { id, item } => self.on_watch_item(now, id, item),
        }
        self.step(now);
    }

    /// A command from the elector's owner.
    fn on_command(&mut self, now: Now, cmd: Command) {
        match cmd {
            Command::Shutdown => {
                info!("shutdown requested");
                self.stop_requested = true;
                match &mut self.mode {
                    Mode::Leading(_) => {
                        self.step_down_gracefully(now, Then::Stop { yields: Vec::new() })
                    }
                    Mode::Draining { then, .. } | Mode::Releasing { then, .. } => then.stop(),
                    Mode::Following | Mode::Stopped => {}
                }
            }
            Command::Yield { id, duration } => match &mut self.mode {
                Mode::Leading(_) => {
                    info!(?duration, "yielding the lease");
                    self.step_down_gracefully(
                        now,
                        Then::Yield {
                            ids: vec![id],
                            duration,
                        },
                    );
                }
                Mode::Draining { then, .. } | Mode::Releasing { then, .. } => {
                    then.add_yield(id, duration)
                }
                Mode::Following => self.deferred_yields.push((id, duration)),
                Mode::Stopped => self.out.push_back(Output::YieldDone { id }),
            },
        }
    }

    /// Every task of the ended term has finished (its leadership guards are dropped).
    fn on_tasks_drained(&mut self) {
        if let Mode::Draining { .. } = self.mode {
            info!("leader tasks finished; releasing the lease");
            self.begin_release();
        }
    }

    /// The answer to request `id`.
    fn on_reply(&mut self, now: Now, id: RequestId, result: Result<Reply, Error>) {
        let Some(inflight) = self.inflight.take_if(|f| f.id == id) else {
            debug!(
                ?id,
                "ignoring the reply to a request that is no longer current"
            );
            return;
        };
        let InFlight { sent, purpose, .. } = inflight;
        match *purpose {
            Purpose::Read => self.on_read(now, result),
            Purpose::Seed { replace } => self.on_seed(now, replace, result),
            Purpose::Acquire {
                record,
                expected,
                fresh,
                commit,
                replaced_token,
            } => {
                let pending = PendingAcquire {
                    record,
                    sent,
                    fresh,
                    commit,
                    replaced_token,
                    expected: expected.clone(),
                };
                self.on_acquire(now, expected, pending, result)
            }
            Purpose::Verify {
                record,
                version,
                sent,
                stored,
            } => self.on_verify(now, sent, record, version, stored, result),
            Purpose::Renew { record } => self.on_renew(now, record, result),
            Purpose::Release { record } => self.on_release(now, record, result),
        }
    }

    /// The outcome of opening watch `id`.
    fn on_watch_opened(&mut self, now: Now, id: WatchId, result: Result<(), Error>) {
        match (&self.watch, result) {
            (WatchState::Opening(cur), Ok(())) if *cur == id => {
                debug!("watching the lease");
                self.watch = WatchState::Open(id);
            }
            (WatchState::Opening(cur), Err(e)) if *cur == id => {
                warn!(error = %e, "cannot watch the lease; polling meanwhile");
                self.watch_broke(now);
            }
            (_, Ok(())) => self.out.push_back(Output::CloseWatch),
            (_, Err(_)) => {}
        }
    }

    /// An item of watch `id`; `None` when the stream ended.
    fn on_watch_item(&mut self, now: Now, id: WatchId, item: Option<Result<WatchEvent, Error>>) {
        if !matches!(self.watch, WatchState::Open(cur) if cur == id) {
            return;
        }
        match item {
            Some(Ok(ev)) => {
                self.watch_failures = 0;
                let seen = match ev {
                    WatchEvent::Put(v) => Seen::Record(v),
                    WatchEvent::Deleted => Seen::Absent,
                    WatchEvent::Corrupt { reason, version } => {
                        warn!(
                            reason,
                            "the lease key now holds data that is not a lease record"
                        );
                        Seen::Corrupt(version)
                    }
                };
                self.on_seen(now, seen, Source::Watch);
            }
            Some(Err(e)) => {
                warn!(error = %e, "lease watch failed; watching again after a backoff");
                self.out.push_back(Output::CloseWatch);
                self.watch_broke(now);
            }
            None => {
                debug!("lease watch ended; watching again after a backoff");
                self.out.push_back(Output::CloseWatch);
                self.watch_broke(now);
            }
        }
    }

    // --- helpers ------------------------------------------------------------------------------

    fn mode_name(&self) -> &'static str {
        match self.mode {
            Mode::Following => "following",
            Mode::Leading(_) => "leading",
            Mode::Draining { .. } => "draining",
            Mode::Releasing { .. } => "releasing",
            Mode::Stopped => "stopped",
        }
    }

    fn tick(&mut self, now: Now) {
        self.last_now = Some(self.last_now.map_or(now.instant, |t| t.max(now.instant)));
    }

    fn rand(&mut self) -> f64 {
        // splitmix64: deterministic for a seed, good enough for jitter.
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `d` jittered by client-go's factor 1.2: uniformly in `[d, 2.2 × d)`.
    fn jittered(&mut self, d: Duration) -> Duration {
        let r = self.rand();
        d + d.mul_f64(1.2 * r)
    }

    fn next_id(&mut self) -> RequestId {
        self.next_id += 1;
        RequestId(self.next_id)
    }

    fn send(&mut self, now: Now, op: Op, purpose: Purpose, deadline: Instant) {
        let id = self.next_id();
        self.inflight = Some(InFlight {
            id,
            sent: now.instant,
            purpose: Box::new(purpose),
        });
        self.out
            .push_back(Output::Request(Request { id, op, deadline }));
    }

    fn request_deadline(&self, now: Now) -> Instant {
        later(now.instant, self.cfg.renew_deadline).unwrap_or(now.instant)
    }

    fn valid_until(&self, term: &Term) -> Option<Instant> {
        let v = later(term.sent, self.cfg.renew_deadline);
        match term.cut {
            Some((_, cut)) => v.map(|v| v.min(cut)),
            None => v,
        }
    }

    /// A wall time for a record: microsecond precision (what every store keeps), strictly after
    /// the previous one this machine wrote, so a landed write is recognised by its renew time.
    fn stamp(&mut self, wall: SystemTime) -> SystemTime {
        let mut t = micros(wall);
        if let Some(last) = self.last_wall
            && t <= last
        {
            t = last + Duration::from_micros(1);
        }
        self.last_wall = Some(t);
        t
    }

    /// The next fencing token above `from` and every token seen; `Err(last)` when none can be
    /// represented (a term must never start with a token that is not above the last one).
    fn next_token(&self, from: Option<u64>) -> Result<u64, u64> {
        match from.max(self.known_max) {
            Some(t) => t.checked_add(1).ok_or(t),
            None => Ok(0),
        }
    }

    /// No token above `last` can be issued: report it and try again after a retry period (an
    /// operator may delete the key).
    fn tokens_exhausted(&mut self, now: Now, last: u64) {
        tracing::error!(
            last,
            "no fencing token above {last} can be issued for this lease (another writer probably set it); not leading; delete the key to start over"
        );
        self.out.push_back(Output::TokensExhausted { last });
        self.acquire_failed(now);
    }

    fn record_lease(&self, r: &LeaseRecord) -> Duration {
        if r.lease_duration > MAX_RECORD_LEASE_DURATION {
            warn!(
                lease_duration = ?r.lease_duration,
                "the lease record's duration is absurd; treating it as {MAX_RECORD_LEASE_DURATION:?}"
            );
            MAX_RECORD_LEASE_DURATION
        } else {
            r.lease_duration
        }
    }

    /// When the observed state can be taken over: `None` = now.
    fn expiry(&self, obs: &Observed) -> Option<Instant> {
        match &obs.seen {
            Seen::Absent if self.cfg.trust_absence => None,
            // Deleted or lost, or never created: the store cannot tell. A term may have been
            // valid when the record vanished; it has ended a lease duration later.
            Seen::Absent => later(obs.at, self.cfg.lease_duration),
            Seen::Record(v) if v.record.is_vacant() => None,
            Seen::Record(v)
                if self
                    .mine
                    .as_ref()
                    .is_some_and(|m| m.owns(&self.cfg.identity, &v.record)) =>
            {
                None
            }
            Seen::Record(v) => later(obs.at, self.record_lease(&v.record)),
            Seen::Corrupt(_) => later(obs.at, self.cfg.lease_duration),
        }
    }

    fn observe(&mut self, now: Now, seen: Seen) {
        if let Seen::Record(v) = &seen {
            self.known_max = self.known_max.max(Some(v.record.transitions));
        }
        let same = match (&self.observed, &seen) {
            (Some(o), s) => match (&o.seen, s) {
                (Seen::Absent, Seen::Absent) => true,
                (Seen::Record(a), Seen::Record(b)) => a.version == b.version,
                (Seen::Corrupt(Some(a)), Seen::Corrupt(Some(b))) => a == b,
                _ => false,
            },
            (None, _) => false,
        };
        if !same {
            // While an acquire's outcome is open (in flight, being verified, or being read back
            // after an error), remember every other state seen: leading on the acquire after
            // the key moved on would lead on a stale state.
            let acquiring = self.pending_acquire.is_some()
                || self.inflight.as_ref().is_some_and(|f| {
                    matches!(*f.purpose, Purpose::Acquire { .. } | Purpose::Verify { .. })
                });
            if acquiring && self.seen_during_acquire.len() < 64 {
                self.seen_during_acquire.push(match &seen {
                    Seen::Absent => None,
                    Seen::Record(v) => Some(v.version.clone()),
                    Seen::Corrupt(v) => Some(v.clone().unwrap_or_else(|| Version::new(""))),
                });
            }
            // A record seen before (a watch that delivered an older state in between, breaking
            // the store contract) keeps its first observation time: expiry is never postponed by
            // seeing the same record again.
            let mut at = now.instant;
            if let Seen::Record(v) = &seen {
                debug!(holder = %v.record.holder_identity, version = %v.version, "observed a change");
                match self.first_seen.iter().find(|(r, _)| r == v) {
                    Some((_, first)) => at = *first,
                    None => {
                        if self.first_seen.len() >= FIRST_SEEN {
                            self.first_seen.pop_front();
                        }
                        self.first_seen.push_back((v.clone(), at));
                    }
                }
            }
            self.observed = Some(Observed { seen, at });
        } else if let (Some(o), Seen::Record(v)) = (&mut self.observed, seen) {
            // Same version: keep the first observation time, take the (identical) content.
            o.seen = Seen::Record(v);
        }
    }

    fn watch_broke(&mut self, now: Now) {
        let base = self.cfg.retry_period / 4;
        let exp = base.saturating_mul(1u32 << self.watch_failures.min(5));
        let cap = self.cfg.retry_period.saturating_mul(4);
        let d = self.jittered(exp.min(cap));
        self.watch_failures = self.watch_failures.saturating_add(1);
        self.watch = WatchState::Closed;
        self.timers[Timer::WatchRetry] = later(now.instant, d);
        if matches!(self.mode, Mode::Following) {
            // Changes may have been missed: read (polling continues until the watch is back).
            self.need_read = true;
        }
    }

    // --- the step function ----------------------------------------------------------------------

    fn step(&mut self, now: Now) {
        self.tick(now);
        // Bounded: each pass either changes mode or stops.
        for _ in 0..8 {
            let before = self.mode_name();
            match self.mode {
                Mode::Stopped => return,
                Mode::Leading(_) | Mode::Draining { .. } => self.lead_step(now),
                Mode::Releasing { .. } => self.release_step(now),
                Mode::Following => self.follow_step(now),
            }
            if self.mode_name() == before {
                break;
            }
        }
        self.manage_watch(now);
        self.refresh_derived_timers();
    }

    /// The deadlines that follow from the state (the term's validity, the observed record's
    /// expiry), written into the table after every step.
    fn refresh_derived_timers(&mut self) {
        self.timers[Timer::TermEnd] = match &self.mode {
            Mode::Leading(t) | Mode::Draining { term: t, .. } => self.valid_until(t),
            _ => None,
        };
        self.timers[Timer::Expiry] = self.observed.as_ref().and_then(|o| self.expiry(o));
    }

    fn manage_watch(&mut self, now: Now) {
        if !self.can_watch {
            return;
        }
        let WatchState::Closed = self.watch else {
            return;
        };
        if self.timers[Timer::WatchRetry].is_some_and(|t| now.instant < t) {
            return;
        }
        let after = match &self.mode {
            Mode::Stopped => return,
            Mode::Leading(t) | Mode::Draining { term: t, .. } | Mode::Releasing { term: t, .. } => {
                Some(t.version.clone())
            }
            Mode::Following => match &self.observed {
                None => return,
                Some(o) => o.seen.version().cloned(),
            },
        };
        self.next_id += 1;
        let id = WatchId(self.next_id);
        self.watch = WatchState::Opening(id);
        let deadline = self.request_deadline(now);
        self.out.push_back(Output::OpenWatch {
            id,
            after,
            deadline,
        });
    }

    fn follow_step(&mut self, now: Now) {
        if self.inflight.is_some() {
            self.publish_follower(now);
            return;
        }
        for (id, d) in std::mem::take(&mut self.deferred_yields) {
            self.yielding = true;
            self.timers[Timer::YieldEnd] = later(now.instant, d);
            info!(duration = ?d, "yielding: not campaigning");
            self.out.push_back(Output::YieldDone { id });
        }
        if self.stop_requested {
            self.stop();
            return;
        }
        if self.yielding && self.timers[Timer::YieldEnd].is_some_and(|t| now.instant >= t) {
            self.yielding = false;
            self.timers[Timer::YieldEnd] = None;
        }
        // Polling (no watch open): re-read every jittered retry period.
        if !matches!(self.watch, WatchState::Open(_)) {
            match self.timers[Timer::Poll] {
                Some(t) if now.instant >= t => self.need_read = true,
                Some(_) => {}
                None => {
                    let d = self.jittered(self.cfg.retry_period);
                    self.timers[Timer::Poll] = later(now.instant, d);
                }
            }
        }
        if self.need_read || self.observed.is_none() {
            if self.timers[Timer::ReadRetry].is_none_or(|t| now.instant >= t) {
                self.timers[Timer::ReadRetry] = None;
                let deadline = self.request_deadline(now);
                self.send(now, Op::Get, Purpose::Read, deadline);
            }
            self.publish_follower(now);
            return;
        }
        self.publish_follower(now);
        if self.yielding {
            return;
        }
        if self.timers[Timer::AcquireRetry].is_some_and(|t| now.instant < t) {
            return;
        }
        let Some(obs) = self.observed.clone() else {
            return;
        };
        if self.expiry(&obs).is_some_and(|t| now.instant < t) {
            return;
        }
        self.timers[Timer::AcquireRetry] = None;
        if self.commit_tokens {
            // The store assigns the token at commit: no seed to read first.
            let (expected, replaced) = match &obs.seen {
                Seen::Absent => (None, None),
                Seen::Corrupt(Some(v)) => {
                    warn!(
                        "replacing data that is not a lease record and stayed unchanged for a lease duration"
                    );
                    (Some(v.clone()), Some(0))
                }
                Seen::Corrupt(None) => {
                    warn!(
                        "the lease key holds unreadable data and the store gives no version to replace it by compare-and-swap; delete it by hand"
                    );
                    let d = self.jittered(self.cfg.retry_period);
                    self.timers[Timer::AcquireRetry] = later(now.instant, d);
                    return;
                }
                Seen::Record(v) => {
                    if !v.record.is_vacant() {
                        info!(holder = %v.record.holder_identity, "the lease expired; trying to acquire it");
                    }
                    (Some(v.version.clone()), Some(v.record.transitions))
                }
            };
            if let Some(last) = replaced.filter(|t| *t == u64::MAX) {
                self.tokens_exhausted(now, last);
                return;
            }
            self.acquire_at_commit(now, expected, replaced);
            return;
        }
        match obs.seen {
            Seen::Absent => {
                let deadline = self.request_deadline(now);
                self.send(
                    now,
                    Op::FencingSeed,
                    Purpose::Seed { replace: None },
                    deadline,
                );
            }
            Seen::Corrupt(Some(v)) => {
                warn!(
                    "replacing data that is not a lease record and stayed unchanged for a lease duration"
                );
                let deadline = self.request_deadline(now);
                self.send(
                    now,
                    Op::FencingSeed,
                    Purpose::Seed { replace: Some(v) },
                    deadline,
                );
            }
            Seen::Corrupt(None) => {
                warn!(
                    "the lease key holds unreadable data and the store gives no version to replace it by compare-and-swap; delete it by hand"
                );
                let d = self.jittered(self.cfg.retry_period);
                self.timers[Timer::AcquireRetry] = later(now.instant, d);
            }
            Seen::Record(v) => {
                if !v.record.is_vacant() {
                    info!(holder = %v.record.holder_identity, "the lease expired; trying to acquire it");
                }
                match self.next_token(Some(v.record.transitions)) {
                    Ok(token) => self.acquire(now, token, Some(v.version), false),
                    Err(last) => self.tokens_exhausted(now, last),
                }
            }
        }
    }

    /// The record this elector writes to acquire (its token: `token`).
    fn acquisition_record(&mut self, now: Now, token: u64) -> LeaseRecord {
        let t = self.stamp(now.wall);
        LeaseRecord {
            holder_identity: self.cfg.identity.clone(),
            lease_duration: self.cfg.lease_duration,
            acquire_time: Some(t),
            renew_time: Some(t),
            transitions: token,
        }
    }

    /// Acquires with a token the store assigns at commit, replacing the state at `expected`
    /// (whose token is `replaced`).
    fn acquire_at_commit(&mut self, now: Now, expected: Option<Version>, replaced: Option<u64>) {
        // The token written here is a placeholder: the store replaces it.
        let proposal = replaced.map_or(0, |t| t.saturating_add(1));
        let record = self.acquisition_record(now, proposal);
        let deadline = self.request_deadline(now);
        self.seen_during_acquire.clear();
        self.send(
            now,
            Op::Acquire {
                record: record.clone(),
                expected: expected.clone(),
            },
            Purpose::Acquire {
                record,
                expected,
                fresh: false,
                commit: true,
                replaced_token: replaced,
            },
            deadline,
        );
    }

    fn acquire(&mut self, now: Now, token: u64, expected: Option<Version>, fresh: bool) {
        let record = self.acquisition_record(now, token);
        let op = match expected {
            None => Op::Create(record.clone()),
            Some(expected) => Op::Update {
                record: record.clone(),
                expected,
            },
        };
        // The write is worth something only while the term it starts would be valid.
        let deadline = self.request_deadline(now);
        let expected = match &op {
            Op::Update { expected, .. } => Some(expected.clone()),
            _ => None,
        };
        self.seen_during_acquire.clear();
        self.send(
            now,
            op,
            Purpose::Acquire {
                record,
                expected,
                fresh,
                commit: false,
                replaced_token: None,
            },
            deadline,
        );
    }

    fn publish_follower(&mut self, now: Now) {
        let leader = match &self.observed {
            Some(obs) => match (&obs.seen, self.expiry(obs)) {
                (Seen::Record(v), Some(t))
                    if now.instant < t && v.record.holder_identity != self.cfg.identity =>
                {
                    Some(v.record.holder_identity.clone())
                }
                _ => None,
            },
            None => None,
        };
        if self.published_leader.as_ref() != Some(&leader) {
            info!(leader = ?leader, "following");
            self.published_leader = Some(leader.clone());
            self.out.push_back(Output::Following { leader });
        }
    }

    fn stop(&mut self) {
        if !matches!(self.watch, WatchState::Closed) {
            self.out.push_back(Output::CloseWatch);
        }
        self.watch = WatchState::Closed;
        self.timers[Timer::WatchRetry] = None;
        if self.published_leader != Some(None) {
            self.published_leader = Some(None);
            self.out.push_back(Output::Following { leader: None });
        }
        self.mode = Mode::Stopped;
        info!("elector stopped");
        self.out.push_back(Output::Stopped);
    }

    // --- leading ------------------------------------------------------------------------------

    fn term_mut(&mut self) -> Option<&mut Term> {
        match &mut self.mode {
            Mode::Leading(t) | Mode::Draining { term: t, .. } | Mode::Releasing { term: t, .. } => {
                Some(t)
            }
            _ => None,
        }
    }

    fn lead_step(&mut self, now: Now) {
        let rd = self.cfg.renew_deadline;
        let retry = self.cfg.retry_period;
        let identity = self.cfg.identity.clone();
        let (valid_until, draining_until) = match &self.mode {
            Mode::Leading(t) => (self.valid_until(t), None),
            Mode::Draining { term, .. } => (self.valid_until(term), self.timers[Timer::DrainEnd]),
            _ => return,
        };
        if valid_until.is_none_or(|v| now.instant >= v) {
            warn!(renew_deadline = ?rd, "lease lost: no successful renewal within the renew deadline; stepping down");
            self.lose(now, None);
            return;
        }
        if draining_until.is_some_and(|u| now.instant >= u) {
            warn!(
                drain_timeout = ?self.cfg.drain_timeout,
                "leader tasks still run after the drain timeout: the term is revoked and the lease is left to expire instead of being released"
            );
            self.out.push_back(Output::Revoked);
            let Mode::Draining { then, .. } = std::mem::replace(&mut self.mode, Mode::Following)
            else {
                return;
            };
            self.finish(now, then);
            return;
        }
        if self.inflight.is_some() {
            return;
        }
        if self.timers[Timer::Renew].is_some_and(|r| now.instant < r) {
            return;
        }
        let Some(term) = self.term_mut() else { return };
        let record = term.record.clone();
        let expected = term.version.clone();
        let t = self.stamp(now.wall);
        // Always this elector's own duration: followers must wait for exactly what the term's
        // validity assumes, whatever another writer put into the record.
        let record = LeaseRecord {
            renew_time: Some(t),
            holder_identity: identity,
            lease_duration: self.cfg.lease_duration,
            ..record
        };
        let attempt = Attempt {
            sent: now.instant,
            renew_time: record.renew_time,
        };
        let Some(term) = self.term_mut() else { return };
        term.attempts.push(attempt.clone());
        // Retry soon if this fails; a success moves it to sent + retry_period.
        let backoff = (retry / 8)
            .saturating_mul(1u32 << term.failures.min(3))
            .min(retry);
        self.timers[Timer::Renew] = Some(later(now.instant, backoff).unwrap_or(now.instant));
        let deadline = valid_until.unwrap_or(now.instant);
        self.send(
            now,
            Op::Update {
                record: record.clone(),
                expected,
            },
            Purpose::Renew { record },
            deadline,
        );
    }

    /// Whether `r` is a record of the current term.
    fn is_current_term(&self, r: &LeaseRecord) -> bool {
        match &self.mode {
            Mode::Leading(t) | Mode::Draining { term: t, .. } | Mode::Releasing { term: t, .. } => {
                t.mine.owns(&self.cfg.identity, r)
            }
            _ => false,
        }
    }

    /// A record of the current term at version `v` was seen: adopt the version, and if it is one
    /// of our renewals, confirm it (validity counts from when that renewal was sent). A change by
    /// another writer that keeps the term (a label edit, a restored older copy of the record) is
    /// adopted too; if it shortened the lease duration, the term's validity is cut to what
    /// followers who saw that write will wait for.
    fn adopt(&mut self, now: Now, v: Versioned, source: Source) {
        let rd = self.cfg.renew_deadline;
        let ld = self.cfg.lease_duration;
        let retry = self.cfg.retry_period;
        let written = self.record_lease(&v.record);
        let Some(term) = self.term_mut() else { return };
        if v.version == term.version {
            return;
        }
        if source == Source::Watch && term.past.contains(&v.version) {
            // An older write of this term delivered late (a lagging watch): stale. A direct read
            // is the current state and is always adopted (a restored older copy, say).
            return;
        }
        let replaced = std::mem::replace(&mut term.version, v.version.clone());
        if term.past.len() >= PAST_VERSIONS {
            term.past.pop_front();
        }
        term.past.push_back(replaced);
        let matched = term
            .attempts
            .iter()
            .position(|a| a.renew_time == v.record.renew_time);
        let mut renew_at = None;
        let renewed = match matched {
            Some(i) => {
                let sent = term.attempts[i].sent;
                term.attempts.drain(..=i);
                term.sent = term.sent.max(sent);
                term.failures = 0;
                renew_at = Some(later(term.sent, retry).unwrap_or(term.sent));
                // The renewal wrote this elector's own duration: a cut observed before it was
                // sent no longer binds.
                if term.cut.is_some_and(|(seen, _)| sent >= seen) {
                    term.cut = None;
                }
                debug!("a renewal was confirmed by reading it back");
                true
            }
            None => {
                // A change that is not one of our renewals but keeps our term: adopt the version.
                debug!(version = %v.version, "adopting a change of our lease by another writer");
                false
            }
        };
        term.record = v.record;
        // Another writer shortened the duration (of a renewal of ours, too: it landed, then was
        // edited): followers that saw that write take over `written` after they saw it, and it
        // landed after this term's last confirmed write was sent. Bound validity by that, scaled
        // by renew_deadline / lease_duration for the clock-rate margin.
        let shortened = written < ld;
        if shortened {
            let bound = later(
                term.sent,
                written.mul_f64(rd.as_secs_f64() / ld.as_secs_f64()),
            )
            .unwrap_or(term.sent);
            let bound = term.cut.map_or(bound, |(_, c)| c.min(bound));
            term.cut = Some((now.instant, bound));
            warn!(
                lease_duration = ?written,
                own = ?ld,
                "another writer shortened the lease duration of our record; the term is valid only as long as followers will wait, and the next renewal writes our own duration again"
            );
        }
        if renew_at.is_some() {
            self.timers[Timer::Renew] = renew_at;
        }
        let valid_until = match self.term_ref() {
            Some(t) => self.valid_until(t),
            None => None,
        };
        if let Some(valid_until) = valid_until {
            if renewed {
                self.out.push_back(Output::Renewed { valid_until });
            } else if shortened {
                self.out.push_back(Output::Shortened { valid_until });
            }
        }
    }

    fn term_ref(&self) -> Option<&Term> {
        match &self.mode {
            Mode::Leading(t) | Mode::Draining { term: t, .. } | Mode::Releasing { term: t, .. } => {
                Some(t)
            }
            _ => None,
        }
    }

    fn lose(&mut self, now: Now, seen: Option<Seen>) {
        let mode = std::mem::replace(&mut self.mode, Mode::Following);
        let then = match mode {
            Mode::Leading(_) => None,
            Mode::Draining { then, .. } | Mode::Releasing { then, .. } => Some(then),
            other => {
                self.mode = other;
                return;
            }
        };
        if then.is_none() {
            self.out.push_back(Output::TermEnded {
                cause: StopCause::LeaseLost,
            });
        }
        self.out.push_back(Output::Revoked);
        if let Some(seen) = seen {
            self.observe(now, seen);
        }
        if let Some(then) = then {
            self.finish(now, then);
        }
    }

    fn step_down_gracefully(&mut self, now: Now, then: Then) {
        let Mode::Leading(term) = std::mem::replace(&mut self.mode, Mode::Following) else {
            return;
        };
        info!(
            "stepping down; leader tasks are cancelled and the lease is renewed until they finish"
        );
        self.out.push_back(Output::TermEnded {
            cause: StopCause::SteppedDown,
        });
        self.published_leader = Some(None);
        self.out.push_back(Output::Following { leader: None });
        self.timers[Timer::DrainEnd] =
            Some(later(now.instant, self.cfg.drain_timeout).unwrap_or(now.instant));
        self.mode = Mode::Draining { term, then };
    }

    fn begin_release(&mut self) {
        let Mode::Draining { term, then, .. } = std::mem::replace(&mut self.mode, Mode::Following)
        else {
            return;
        };
        // The term's validity ends before the release can land.
        self.out.push_back(Output::Revoked);
        self.mode = Mode::Releasing {
            term,
            then,
            tries: 0,
        };
    }

    fn release_step(&mut self, now: Now) {
        if self.inflight.is_some() {
            return;
        }
        let Mode::Releasing { term, tries, .. } = &mut self.mode else {
            return;
        };
        if *tries >= 3 {
            warn!("could not release the lease; it will expire");
            let Mode::Releasing { then, .. } = std::mem::replace(&mut self.mode, Mode::Following)
            else {
                return;
            };
            self.finish(now, then);
            return;
        }
        *tries += 1;
        let transitions = term.record.transitions;
        let expected = term.version.clone();
        let t = self.stamp(now.wall);
        let record = LeaseRecord {
            holder_identity: String::new(),
            lease_duration: RELEASE_LEASE_DURATION,
            acquire_time: Some(t),
            renew_time: Some(t),
            transitions,
        };
        let deadline = self.request_deadline(now);
        self.send(
            now,
            Op::Update {
                record: record.clone(),
                expected,
            },
            Purpose::Release { record },
            deadline,
        );
    }

    fn finish(&mut self, now: Now, then: Then) {
        self.mode = Mode::Following;
        match then {
            Then::Stop { yields } => {
                self.stop_requested = true;
                for id in yields {
                    self.out.push_back(Output::YieldDone { id });
                }
            }
            Then::Yield { ids, duration } => {
                self.yielding = true;
                self.timers[Timer::YieldEnd] = later(now.instant, duration);
                info!(?duration, "yielded the lease");
                for id in ids {
                    self.out.push_back(Output::YieldDone { id });
                }
            }
        }
    }

    // --- replies ------------------------------------------------------------------------------

    fn on_seen(&mut self, now: Now, seen: Seen, source: Source) {
        match &self.mode {
            Mode::Leading(_) | Mode::Draining { .. } => match seen {
                Seen::Record(v) if self.is_current_term(&v.record) => self.adopt(now, v, source),
                Seen::Record(v) if v.record.is_vacant() => {
                    warn!("lease lost: someone else released it (the record is vacant)");
                    self.lose(now, Some(Seen::Record(v)));
                }
                Seen::Record(v) => {
                    warn!(holder = %v.record.holder_identity, "lease lost: the record changed under us");
                    self.lose(now, Some(Seen::Record(v)));
                }
                Seen::Absent => {
                    warn!("lease lost: the record was deleted");
                    self.lose(now, Some(Seen::Absent));
                }
                Seen::Corrupt(v) => {
                    warn!(
                        "lease lost: the record was overwritten with data that is not a lease record"
                    );
                    self.lose(now, Some(Seen::Corrupt(v)));
                }
            },
            Mode::Releasing { .. } => match seen {
                Seen::Record(v) if self.is_current_term(&v.record) => {
                    if let Some(t) = self.term_mut() {
                        t.version = v.version;
                    }
                }
                other => self.observe(now, other),
            },
            Mode::Following => {
                if let (Seen::Record(v), Some(pending), None) =
                    (&seen, &self.pending_acquire, &self.inflight)
                {
                    let r = &v.record;
                    let landed = r.holder_identity == self.cfg.identity
                        && r.acquire_time == pending.record.acquire_time
                        && (pending.commit || r.transitions == pending.record.transitions);
                    let token = pending.commit.then_some(r.transitions);
                    let expected = pending.expected.clone();
                    let version = v.version.clone();
                    let stored = self.record_lease(r);
                    if landed {
                        let pending = self.pending_acquire.take();
                        if self.superseded(&expected, &version) {
                            // The read answers with our acquire, but a later state was seen
                            // since it was sent (a watch ran ahead of the read): the key moved
                            // on. Never lead on it.
                            warn!(
                                "an acquire that reported an error did land, but the lease changed since; not leading on it"
                            );
                            self.acquire_failed(now);
                            return;
                        }
                        info!("an acquire that reported an error did land");
                        if token.is_some() {
                            // The store assigned the token, but its answer was lost: the record
                            // may show another writer's edit of it since. Take the record over
                            // again at once, to lead on a token the store's answer names.
                            let replaced = r.transitions;
                            self.observe(now, seen);
                            if replaced == u64::MAX {
                                self.tokens_exhausted(now, replaced);
                            } else {
                                self.acquire_at_commit(now, Some(version), Some(replaced));
                            }
                            return;
                        }
                        if let Some(pending) = pending {
                            self.acquired(now, *pending, version, token, stored);
                        }
                        return;
                    }
                }
                self.observe(now, seen);
            }
            Mode::Stopped => {}
        }
    }

    fn on_read(&mut self, now: Now, result: Result<Reply, Error>) {
        let seen = match result {
            Ok(Reply::Record(Some(v))) => Seen::Record(v),
            Ok(Reply::Record(None)) => Seen::Absent,
            Err(Error::Corrupt {
                version, reason, ..
            }) => {
                warn!(
                    reason,
                    "the lease key holds data that is not a lease record"
                );
                Seen::Corrupt(version)
            }
            Ok(other) => {
                warn!(
                    ?other,
                    "the store answered a read with something else; retrying"
                );
                self.read_failed(now);
                return;
            }
            Err(e) => {
                warn!(error = %e, retryable = e.is_retryable(), "cannot read the lease; retrying");
                self.read_failed(now);
                return;
            }
        };
        if matches!(self.mode, Mode::Following) {
            self.need_read = false;
            let d = self.jittered(self.cfg.retry_period);
            self.timers[Timer::Poll] = later(now.instant, d);
        }
        if let Mode::Releasing { .. } = self.mode {
            // Reading after an ambiguous release or renewal: release again at the version that
            // is ours, or finish when the lease is not ours any more.
            if let Seen::Record(v) = &seen
                && self.is_current_term(&v.record)
            {
                if let Some(t) = self.term_mut() {
                    t.version = v.version.clone();
                }
                return;
            }
            self.observe(now, seen);
            let Mode::Releasing { then, .. } = std::mem::replace(&mut self.mode, Mode::Following)
            else {
                return;
            };
            self.finish(now, then);
            return;
        }
        self.on_seen(now, seen, Source::Read);
        self.pending_acquire = None;
    }

    fn read_failed(&mut self, now: Now) {
        match self.mode {
            Mode::Following => {
                let d = self.jittered(self.cfg.retry_period);
                self.timers[Timer::ReadRetry] = later(now.instant, d);
                self.need_read = true;
            }
            Mode::Releasing { .. } => {} // release_step retries (bounded)
            _ => {}                      // lead_step retries renewals until the deadline
        }
    }

    fn on_seed(&mut self, now: Now, replace: Option<Version>, result: Result<Reply, Error>) {
        if self.stop_requested || !self.deferred_yields.is_empty() {
            return;
        }
        let fallback = match self.next_token(None) {
            Ok(t) => t,
            Err(last) => {
                self.tokens_exhausted(now, last);
                return;
            }
        };
        let token = match result {
            Ok(Reply::Seed(s)) => s.max(fallback),
            Err(Error::Unsupported { store, .. }) => {
                if !self.seed_warned {
                    self.seed_warned = true;
                    warn!(
                        store,
                        "the store offers no fencing seed: a fresh record starts one above the highest token this elector has seen, so tokens can repeat after the record is lost"
                    );
                }
                fallback
            }
            Ok(other) => {
                warn!(
                    ?other,
                    "the store answered a fencing-seed request with something else"
                );
                self.acquire_failed(now);
                return;
            }
            Err(Error::TokenExhausted { last, .. }) => {
                self.tokens_exhausted(now, last);
                return;
            }
            Err(e) => {
                warn!(error = %e, "cannot get a fencing seed; retrying");
                self.acquire_failed(now);
                return;
            }
        };
        self.acquire(now, token, replace, true);
    }

    fn acquire_failed(&mut self, now: Now) {
        self.need_read = true;
        let d = self.jittered(self.cfg.retry_period);
        self.timers[Timer::AcquireRetry] = later(now.instant, d);
    }

    fn on_acquire(
        &mut self,
        now: Now,
        expected: Option<Version>,
        pending: PendingAcquire,
        result: Result<Reply, Error>,
    ) {
        let written = match result {
            Ok(Reply::Written(version)) if !pending.commit => Ok((version, None)),
            Ok(Reply::Acquired(a)) if pending.commit => Ok((a.version, Some(a.fencing_token))),
            Ok(other) => {
                warn!(?other, "the store answered a write with something else");
                self.acquire_failed(now);
                return;
            }
            Err(e) => Err(e),
        };
        match written {
            Ok((version, _)) if self.superseded(&expected, &version) => {
                // The acknowledgement came after a later state of the key was seen: the write
                // landed, but something replaced it since. Never lead on it.
                warn!(
                    "an acquire was acknowledged only after the lease changed again; not leading on it"
                );
                self.acquire_failed(now);
            }
            Ok((version, token)) => {
                let stored = self.cfg.lease_duration;
                self.acquired(now, pending, version, token, stored)
            }
            Err(Error::Unsupported { .. }) if pending.commit => {
                // A store (or a wrapper around one) that declares commit tokens but does not
                // implement them: fall back to fencing seeds.
                warn!(
                    "the store declares fencing tokens assigned at commit but does not support acquire; using fencing seeds instead"
                );
                self.commit_tokens = false;
                self.acquire_failed(now);
            }
            Err(e @ Error::TokenExhausted { .. }) => {
                let last = match &e {
                    Error::TokenExhausted { last, .. } => *last,
                    _ => u64::MAX,
                };
                self.tokens_exhausted(now, last);
            }
            Err(e) => {
                match &e {
                    Error::Conflict { .. }
                    | Error::AlreadyExists { .. }
                    | Error::NotFound { .. } => {
                        debug!(error = %e, "lost the race to acquire (or a retried write of ours landed)")
                    }
                    e => warn!(error = %e, "acquire failed; reading back to see whether it landed"),
                }
                // The write may have landed (a timeout, or a client retry that found our own
                // write): a read tells, by holder, acquire time (and token, when we chose it).
                self.pending_acquire = Some(Box::new(pending));
                self.need_read = true;
                if !matches!(
                    e,
                    Error::Conflict { .. } | Error::AlreadyExists { .. } | Error::NotFound { .. }
                ) {
                    let d = self.jittered(self.cfg.retry_period);
                    self.timers[Timer::AcquireRetry] = later(now.instant, d);
                }
            }
        }
    }

    /// An acquire landed at `version` (with `token` when the store assigned it at commit): lead
    /// on it, after the checks its token needs.
    fn acquired(
        &mut self,
        now: Now,
        pending: PendingAcquire,
        version: Version,
        token: Option<u64>,
        stored: Duration,
    ) {
        let PendingAcquire {
            mut record,
            sent,
            fresh,
            replaced_token,
            ..
        } = pending;
        if let Some(token) = token {
            record.transitions = token;
            // A store that cannot compare at commit (etcd's revision) may assign a token below a
            // record's that another writer set: never start a term on a token that is not above
            // the one it replaces.
            if let Some(last) = replaced_token.filter(|last| token <= *last) {
                self.tokens_exhausted(now, last);
                return;
            }
        }
        if fresh && !self.stop_requested {
            // Writes may have landed between the seed and this create (a record created and
            // lost meanwhile): check the seed again before leading on the token.
            let deadline = later(sent, self.cfg.renew_deadline).unwrap_or(now.instant);
            self.send(
                now,
                Op::FencingSeed,
                Purpose::Verify {
                    record,
                    version,
                    sent,
                    stored,
                },
                deadline,
            );
        } else {
            self.begin_term(now, sent, record, version, stored);
        }
    }

    fn on_verify(
        &mut self,
        now: Now,
        sent: Instant,
        record: LeaseRecord,
        version: Version,
        stored: Duration,
        result: Result<Reply, Error>,
    ) {
        if result.is_ok() && self.superseded(&Some(version.clone()), &version) {
            // The record changed while the seed was checked: never lead on the old state.
            warn!("the lease changed while its fencing token was being checked; not leading on it");
            self.acquire_failed(now);
            return;
        }
        match result {
            // No write landed between the seed and the create: the token is above every token
            // issued before it.
            Ok(Reply::Seed(after)) if after <= record.transitions.saturating_add(1) => {
                self.begin_term(now, sent, record, version, stored)
            }
            Ok(Reply::Seed(after)) => {
                debug!(
                    token = record.transitions,
                    seed = after,
                    "other writes landed since the fencing seed; raising the token before leading"
                );
                self.known_max = self.known_max.max(Some(after.saturating_sub(1)));
                match self.next_token(Some(record.transitions)) {
                    Ok(token) => self.acquire(now, token, Some(version), false),
                    Err(last) => self.tokens_exhausted(now, last),
                }
            }
            Err(Error::Unsupported { .. }) => self.begin_term(now, sent, record, version, stored),
            Ok(other) => {
                warn!(
                    ?other,
                    "the store answered a fencing-seed request with something else"
                );
                self.acquire_failed(now);
            }
            Err(e) => {
                warn!(error = %e, "cannot check the fencing seed after creating the lease; not leading on it");
                self.acquire_failed(now);
            }
        }
    }

    /// Whether a state other than the one a write expected, or the one it wrote, was observed
    /// while the write was in flight: then the write, if it landed, has been replaced since (or
    /// the key was deleted and re-created meanwhile, so its fencing seed may be stale).
    fn superseded(&mut self, expected: &Option<Version>, written: &Version) -> bool {
        let seen = std::mem::take(&mut self.seen_during_acquire);
        seen.iter().any(|v| match v {
            Some(v) => v != written && Some(v) != expected.as_ref(),
            None => expected.is_some(),
        })
    }

    /// Starts a term on `record`, written at `sent` and now stored at `version` with lease
    /// duration `stored` (shorter than ours when another writer shortened it meanwhile: the
    /// term's validity is then cut, as in [`Machine::adopt`]).
    fn begin_term(
        &mut self,
        now: Now,
        sent: Instant,
        record: LeaseRecord,
        version: Version,
        stored: Duration,
    ) {
        let mine = Mine {
            token: record.transitions,
            acquire_time: record.acquire_time,
        };
        self.mine = Some(mine.clone());
        self.known_max = self.known_max.max(Some(record.transitions));
        self.observe(
            now,
            Seen::Record(Versioned {
                record: record.clone(),
                version: version.clone(),
            }),
        );
        let retry = self.cfg.retry_period;
        self.timers[Timer::Renew] = Some(later(sent, retry).unwrap_or(sent));
        let term = Box::new(Term {
            mine,
            record,
            version,
            sent,
            attempts: Vec::new(),
            failures: 0,
            cut: None,
            past: VecDeque::new(),
        });
        let mut term = term;
        let valid_until = later(sent, self.cfg.renew_deadline);
        let valid_until = if stored < self.cfg.lease_duration {
            let rd = self.cfg.renew_deadline.as_secs_f64();
            let ld = self.cfg.lease_duration.as_secs_f64();
            let bound = later(sent, stored.mul_f64(rd / ld)).unwrap_or(sent);
            term.cut = Some((now.instant, bound));
            valid_until.map(|v| v.min(bound))
        } else {
            valid_until
        };
        let still_valid = valid_until.is_some_and(|v| now.instant < v);
        if self.stop_requested || !self.deferred_yields.is_empty() {
            // Acquired while a shutdown or yield was pending: never publish it, release at once.
            let then = if self.stop_requested {
                Then::Stop { yields: Vec::new() }
            } else {
                let (ids, ds): (Vec<u64>, Vec<Duration>) =
                    std::mem::take(&mut self.deferred_yields)
                        .into_iter()
                        .unzip();
                Then::Yield {
                    ids,
                    duration: ds.last().copied().unwrap_or_default(),
                }
            };
            self.mode = Mode::Releasing {
                term,
                then,
                tries: 0,
            };
            return;
        }
        let Some(valid_until) = valid_until.filter(|_| still_valid) else {
            warn!(
                "the acquire landed only after its term's renew deadline; not leading on it (trying again)"
            );
            self.acquire_failed(now);
            return;
        };
        info!(
            fencing_token = term.record.transitions,
            "acquired the lease; leading"
        );
        // Watch from the term's own version: a watch opened while following may still deliver
        // changes from before the acquisition, which must not read as a loss.
        if !matches!(self.watch, WatchState::Closed) {
            self.out.push_back(Output::CloseWatch);
        }
        self.watch = WatchState::Closed;
        self.timers[Timer::WatchRetry] = None;
        self.published_leader = None;
        self.out.push_back(Output::Leading {
            fencing_token: term.record.transitions,
            valid_until,
        });
        self.mode = Mode::Leading(term);
    }

    fn on_renew(&mut self, now: Now, record: LeaseRecord, result: Result<Reply, Error>) {
        let holding = matches!(
            self.mode,
            Mode::Leading(_) | Mode::Draining { .. } | Mode::Releasing { .. }
        );
        match result {
            Ok(Reply::Written(version)) if holding => {
                self.adopt(now, Versioned { record, version }, Source::Read);
                if let Some(t) = self.term_mut() {
                    t.failures = 0;
                }
            }
            Ok(Reply::Written(version)) => {
                // The renewal landed after this elector stepped down: the record is ours again.
                self.observe(now, Seen::Record(Versioned { record, version }));
            }
            Ok(other) => {
                warn!(?other, "the store answered a write with something else");
                self.renew_failed(now);
            }
            Err(e) => {
                warn!(error = %e, retryable = e.is_retryable(), "renewal failed; reading back and retrying until the renew deadline");
                self.renew_failed(now);
            }
        }
    }

    fn renew_failed(&mut self, now: Now) {
        if let Some(t) = self.term_mut() {
            t.failures = t.failures.saturating_add(1);
        }
        if matches!(self.mode, Mode::Following) {
            self.need_read = true;
            return;
        }
        // Either someone else wrote, or a write of ours landed (replayed, or reported as failed):
        // read back before the next attempt.
        let deadline = match &self.mode {
            Mode::Leading(t) | Mode::Draining { term: t, .. } => {
                self.valid_until(t).unwrap_or(now.instant)
            }
            _ => self.request_deadline(now),
        };
        self.send(now, Op::Get, Purpose::Read, deadline);
    }

    fn on_release(&mut self, now: Now, record: LeaseRecord, result: Result<Reply, Error>) {
        match result {
            Ok(Reply::Written(version)) => {
                info!("released the lease");
                self.observe(now, Seen::Record(Versioned { record, version }));
                let Mode::Releasing { then, .. } =
                    std::mem::replace(&mut self.mode, Mode::Following)
                else {
                    return;
                };
                self.finish(now, then);
            }
            Ok(other) => {
                warn!(?other, "the store answered a write with something else");
            }
            Err(e) => {
                warn!(error = %e, "releasing the lease failed; reading back");
                let deadline = self.request_deadline(now);
                self.send(now, Op::Get, Purpose::Read, deadline);
            }
        }
    }
}
