//! A deterministic simulator for the elector state machine ([`leasehold::elector::machine`]).
//!
//! Several machines run against one simulated lease store (a linearizable register with a
//! revision counter, as etcd or the memory store) on a virtual clock. One seed decides every
//! latency, fault and interleaving, so a seed replays a schedule exactly (for the fault model of
//! the commit it runs on: a seed names another schedule once the model grows).
//!
//! # Fault classes modelled (during the first phase of a run)
//!
//! - **Stores**: fencing tokens assigned at commit (as memory, etcd and Redis; the token is
//!   above the revision and every token ever written) or fencing seeds (as Kubernetes; the
//!   seed source knows every token written, an ideal seed), chosen per run.
//! - **Requests**: latency before **and after** commit, with long tails past the request
//!   deadline; requests lost before commit, replies lost after commit, writes that land but
//!   report an error, replayed writes (a client retry whose second attempt reports a conflict).
//! - **Watches**: failing to open (for windows: on every open), breaking, lagging, delivering an
//!   event twice, delivering an older state after a newer one (a store breaking its contract),
//!   coalescing an event into the state at delivery time.
//! - **Foreign writers**: version-only rewrites; edits of the holder (to another candidate, a
//!   stranger, or vacant), of the lease duration (shorter and longer than the electors'), of
//!   the acquire and renew times, of the token (to other values, and near `u64::MAX`); restores
//!   of an older copy of a record; deletions and corrupt data (data loss).
//! - **Processes**: pauses (SIGSTOP) longer than the lease, crashes (a request in flight may
//!   still commit later), graceful restarts, identity reuse by a restarted process, **two
//!   processes with one identity at once**, yields, leader tasks that drain slowly (past the
//!   drain timeout), per-elector clock **rate** drift within ±`DRIFT`, and arbitrary wall-clock
//!   skew.
//! - **Leader tasks as actors**: each term's task acts now and then if `ensure_leading` passes
//!   (the term's validity against its own clock, as `Leadership::ensure_leading`); it is paused
//!   with its process; it may yield (or panic, which steps down the same way) from inside.
//! - **Configurations**: `trust_absence = true` for all electors of some runs.
//!
//! # Not modelled
//!
//! - Several keys, or stores whose operations on one key are not linearizable (Redis failover
//!   with asynchronous replication loses acknowledged writes: a loss the model has, but not
//!   the stale reads a lagging replica would serve).
//! - Clocks that jump or stop (`CLOCK_MONOTONIC` suspended with the system); rates beyond
//!   ±`DRIFT`.
//! - With fencing seeds, writers that **lower** the token (including restores of copies with a
//!   lower token): outside the seed scheme's guarantee (see the README); with commit tokens
//!   they are modelled.
//! - The tokio driver, the status cell and `run_leader_tasks` themselves (the task actor models
//!   their contract; `tests/safety_regressions.rs`, `tests/leader_tasks.rs` and
//!   `tests/lifecycle.rs` test them), and the store backends' code (the conformance suite does).
//!
//! # Invariants, checked on the simulator's true clock
//!
//! 1. validity intervals of terms never overlap (a term is valid from `Leading` until the
//!    earlier of `Revoked`, its `valid_until` as last announced, or a crash), except terms
//!    **void** by the docs' definition (their record was lost while valid: deleted, corrupted,
//!    vacated or replaced by an older term's copy by a foreign writer; also when the term starts
//!    only later), and except the window from a foreign write that shortened a term's lease
//!    duration until its elector observed that write (also when the term begins only after
//!    that write);
//! 2. fencing tokens strictly increase in term order among terms that are not void (nor begun
//!    inside such a window: their record was shortened and taken over before they could know,
//!    so they start late with a lower token, which fencing rejects), and with commit tokens no
//!    token is ever repeated, void terms included; with fencing seeds, not after a create whose
//!    seed was read before the record was lost commits a token below one written before (the
//!    seed scheme's documented limit);
//! 3. no leader task acts on a term after a later term's first action (outside the exceptions
//!    of 1);
//! 4. after the faults stop, some elector leads within
//!    `lease_duration + renew_deadline + 2.2 × retry_period` (scaled by the drift bound, plus the
//!    healthy store's latency), with the longest lease duration a foreign writer set in place of
//!    `lease_duration`; not after a foreign writer set a token no higher one can follow (by design, no term
//!    then starts).

#![allow(dead_code)]

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::fmt::Write as _;
use std::time::{Duration, Instant, UNIX_EPOCH};

use leasehold::elector::machine::{
    Command, Input, Machine, Now, Op, Output, Reply, RequestId, WatchId,
};
use leasehold::{
    Acquired, Capabilities, ElectorConfig, Error, LeaseKey, LeaseRecord, Version, Versioned,
    WatchEvent,
};

pub const LEASE: Duration = Duration::from_secs(6);
pub const RENEW: Duration = Duration::from_secs(4);
pub const RETRY: Duration = Duration::from_secs(1);
pub const DRAIN: Duration = Duration::from_secs(3);
/// The clock-rate drift bound: `(1 + DRIFT) × RENEW < (1 − DRIFT) × LEASE` holds with room.
pub const DRIFT: f64 = 0.05;

/// splitmix64.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn chance(&mut self, p: f64) -> bool {
        self.f64() < p
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
    pub fn dur(&mut self, lo: Duration, hi: Duration) -> Duration {
        if hi <= lo {
            return lo;
        }
        lo + (hi - lo).mul_f64(self.f64())
    }
}

/// True (simulated) time since the start of the run.
type T = Duration;

#[derive(Clone, Debug)]
enum Stored {
    Record(LeaseRecord),
    Corrupt,
}

#[derive(Default, Debug)]
struct Store {
    rev: u64,
    /// The last fencing token assigned at commit (never below `rev`'s tokens).
    token: u64,
    /// The highest token ever written into a record (by anyone): the fencing seed's source
    /// knows it, an ideal seed. (Kubernetes' clock-based seed does not; its README says what
    /// that costs.)
    high_water: u64,
    cur: Option<(Stored, u64)>,
    /// Records written before the current one (newest last), for restores of older copies.
    history: VecDeque<LeaseRecord>,
    /// The term (identity, token) whose elector last wrote the stored record: foreign edits of
    /// fields keep it, so losing the edited record still loses that term's record.
    owner: Option<(String, u64)>,
    /// Foreign writes that shortened the lease duration of a term's record: (term, version).
    /// Kept after the record is replaced: the term may only begin later (a slow reply).
    shortened: Vec<((String, u64), u64)>,
}

/// How many older records the store remembers for restores.
const HISTORY: usize = 16;

fn key() -> LeaseKey {
    LeaseKey::new("sim").expect("valid key")
}

fn unavailable(msg: &str) -> Error {
    Error::Unavailable {
        store: "sim",
        message: msg.to_owned(),
        source: None,
    }
}

impl Store {
    fn version(&self) -> Option<u64> {
        self.cur.as_ref().map(|(_, v)| *v)
    }

    fn read(&self) -> Result<Reply, Error> {
        match &self.cur {
            None => Ok(Reply::Record(None)),
            Some((Stored::Record(r), v)) => Ok(Reply::Record(Some(Versioned {
                record: r.clone(),
                version: Version::from(*v),
            }))),
            Some((Stored::Corrupt, v)) => Err(Error::Corrupt {
                key: "sim".into(),
                reason: "foreign bytes".into(),
                version: Some(Version::from(*v)),
            }),
        }
    }

    /// Applies `op`; returns the result and whether it changed the key.
    fn apply(&mut self, op: &Op) -> (Result<Reply, Error>, bool) {
        match op {
            Op::Get => (self.read(), false),
            Op::FencingSeed => {
                let last = self.rev.max(self.high_water);
                let seed = last
                    .checked_add(1)
                    .map(Reply::Seed)
                    .ok_or(Error::TokenExhausted {
                        key: "sim".into(),
                        last,
                    });
                (seed, false)
            }
            Op::Create(r) => {
                if self.cur.is_some() {
                    return (Err(Error::AlreadyExists { key: "sim".into() }), false);
                }
                let v = self.write(Some(Stored::Record(r.clone())));
                (Ok(Reply::Written(Version::from(v))), true)
            }
            Op::Acquire { record, expected } => {
                // Like the memory and Redis stores: the token is assigned at commit, above the
                // revision and above the replaced record's token.
                let replaced = match (&self.cur, expected) {
                    (Some(_), None) => {
                        return (Err(Error::AlreadyExists { key: "sim".into() }), false);
                    }
                    (None, Some(_)) => return (Err(Error::NotFound { key: "sim".into() }), false),
                    (None, None) => 0,
                    (Some((cur, v)), Some(expected)) => {
                        if Version::from(*v) != *expected {
                            return (
                                Err(Error::Conflict {
                                    key: "sim".into(),
                                    expected: expected.clone(),
                                }),
                                false,
                            );
                        }
                        match cur {
                            Stored::Record(r) => r.transitions,
                            Stored::Corrupt => 0,
                        }
                    }
                };
                // Above every token ever written into a record, as the memory and Redis
                // stores do (a foreign writer may have raised one).
                let floor = self.rev.max(self.token).max(replaced).max(self.high_water);
                let Some(token) = floor.checked_add(1) else {
                    return (
                        Err(Error::TokenExhausted {
                            key: "sim".into(),
                            last: floor,
                        }),
                        false,
                    );
                };
                self.token = token;
                let v = self.write(Some(Stored::Record(LeaseRecord {
                    transitions: token,
                    ..record.clone()
                })));
                (
                    Ok(Reply::Acquired(Acquired {
                        version: Version::from(v),
                        fencing_token: token,
                    })),
                    true,
                )
            }
            Op::Update { record, expected } => {
                let Some(cur) = self.version() else {
                    return (Err(Error::NotFound { key: "sim".into() }), false);
                };
                if Version::from(cur) != *expected {
                    return (
                        Err(Error::Conflict {
                            key: "sim".into(),
                            expected: expected.clone(),
                        }),
                        false,
                    );
                }
                let v = self.write(Some(Stored::Record(record.clone())));
                (Ok(Reply::Written(Version::from(v))), true)
            }
            _ => (Err(unavailable("unknown op")), false),
        }
    }

    fn write(&mut self, v: Option<Stored>) -> u64 {
        if let Some(Stored::Record(r)) = &v {
            self.high_water = self.high_water.max(r.transitions);
        }
        if let Some((Stored::Record(r), _)) = &self.cur {
            if self.history.len() >= HISTORY {
                self.history.pop_front();
            }
            self.history.push_back(r.clone());
        }
        self.rev += 1;
        self.cur = v.map(|s| (s, self.rev));
        self.rev
    }

    fn event(&self) -> Option<WatchEvent> {
        match &self.cur {
            None => Some(WatchEvent::Deleted),
            Some((Stored::Record(r), v)) => Some(WatchEvent::Put(Versioned {
                record: r.clone(),
                version: Version::from(*v),
            })),
            Some((Stored::Corrupt, v)) => Some(WatchEvent::Corrupt {
                reason: "foreign bytes".into(),
                version: Some(Version::from(*v)),
            }),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fate {
    Normal,
    LostBeforeCommit,
    LostReply,
    ErrorAfterCommit,
    Replay,
}

#[derive(Debug)]
enum Ev {
    Timer {
        generation: u64,
    },
    Commit {
        req: RequestId,
        op: Op,
        fate: Fate,
        inc: u64,
    },
    Reply {
        req: RequestId,
        result: Result<Reply, Error>,
    },
    WatchOpen {
        id: WatchId,
        after: Option<Version>,
        ok: bool,
    },
    WatchTimeout {
        id: WatchId,
    },
    WatchItem {
        id: WatchId,
        item: Option<Result<WatchEvent, Error>>,
    },
    Drained {
        term: u64,
    },
    Resume,
    Pause {
        dur: Duration,
    },
    Crash,
    Shutdown,
    Yield {
        dur: Duration,
    },
    BreakWatch,
    Start,
    VersionOnly,
    Delete,
    Corrupt,
    /// A foreign client edits a field of the stored record (or restores an older copy).
    Foreign(Edit),
    /// The node's leader task acts if `ensure_leading` passes (term `term` of the node).
    Act {
        term: u64,
    },
    /// The node's leader task panics or calls `yield_for` from inside: the term steps down.
    TaskYields {
        term: u64,
        dur: Duration,
    },
    /// A coalescing watch buffer: the state at delivery time, not at the write.
    WatchLatest {
        id: WatchId,
    },
}

/// What a foreign writer changes in the stored record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edit {
    /// The holder is cleared (as a release would): followers take over at once.
    Vacate,
    /// The holder is set to another identity.
    Holder,
    /// The lease duration is made shorter than the electors' own.
    Shorter,
    /// The lease duration is made longer.
    Longer,
    /// The acquire time is changed.
    AcquireTime,
    /// The renew time is moved (earlier or later).
    RenewTime,
    /// The token (`transitions`) is changed to another small value.
    Transitions,
    /// The token is set near `u64::MAX`.
    TransitionsNearMax,
    /// An older copy of a record is written back (a snapshot restore, a stale re-apply).
    Restore,
}

struct Queued {
    at: T,
    seq: u64,
    node: usize,
    /// The incarnation the event belongs to (0: whichever runs when it fires).
    inc: u64,
    ev: Ev,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

#[derive(Debug)]
struct SimWatch {
    id: WatchId,
    open: bool,
    last: T,
}

struct Node {
    machine: Option<Machine>,
    identity: String,
    incarnation: u64,
    rate: f64,
    /// Local clock at `t0` (true).
    local0: Duration,
    t0: T,
    wall_skew: Duration,
    timer_gen: u64,
    paused_until: T,
    deferred: VecDeque<Ev>,
    watch: Option<SimWatch>,
    interval: Option<usize>,
    term_seq: u64,
    /// The request the machine waits for (the driver delivers one answer per request).
    waiting: Option<RequestId>,
    /// Opens fail until then (a watch that errors on every open).
    watch_broken_until: T,
    /// The driver's view of the current term's validity (local clock): what
    /// `Leadership::ensure_leading` checks. `None`: no term, or revoked.
    validity: Option<Instant>,
    /// The highest store version this incarnation has observed.
    seen_max: u64,
}

/// One term's validity interval on the true clock.
#[derive(Clone, Debug)]
pub struct Interval {
    pub node: usize,
    pub incarnation: u64,
    pub identity: String,
    pub token: u64,
    pub start: T,
    pub valid_until: T,
    pub end: Option<T>,
    /// Its record was lost (deleted, corrupted, replaced by a foreign writer with a vacant or
    /// an older term's record): data loss, outside the guarantee of mutual exclusion and token
    /// order (its token is still never repeated on a store that assigns tokens at commit).
    pub voided: bool,
    /// Windows in which overlap with this term is not a violation: from a foreign write that
    /// shortened the lease duration until this term's elector observed it (followers may take
    /// over sooner than the elector could know). `None` end: not observed yet.
    pub exempt: Vec<(T, Option<T>)>,
    /// The store version of that foreign write.
    pub exempt_version: Option<u64>,
}

impl Interval {
    fn effective_end(&self, run_end: T) -> T {
        self.end.unwrap_or(run_end).min(self.valid_until)
    }

    /// The instants this term counts as valid for the overlap check: its validity minus the
    /// exempt windows.
    fn segments(&self, run_end: T) -> Vec<(T, T)> {
        let end = self.effective_end(run_end);
        let mut out = vec![(self.start, end)];
        for (from, to) in &self.exempt {
            let to = to.unwrap_or(end);
            out = out
                .into_iter()
                .flat_map(|(a, b)| {
                    let mut parts = Vec::new();
                    if a < (*from).min(b) {
                        parts.push((a, (*from).min(b)));
                    }
                    if to.max(a) < b {
                        parts.push((to.max(a), b));
                    }
                    parts
                })
                .collect();
        }
        out
    }

    /// Whether `t` lies in an exempt window (its end included: an act at the instant of the
    /// observation came before it).
    fn exempt_at(&self, t: T) -> bool {
        self.exempt
            .iter()
            .any(|(from, to)| *from <= t && to.is_none_or(|to| t <= to))
    }
}

fn overlap(a: &[(T, T)], b: &[(T, T)]) -> Option<(T, T)> {
    for (a0, a1) in a {
        for (b0, b1) in b {
            let (lo, hi) = ((*a0).max(*b0), (*a1).min(*b1));
            if lo < hi {
                return Some((lo, hi));
            }
        }
    }
    None
}

/// Per-run fault settings.
#[derive(Clone, Debug)]
pub struct Profile {
    pub nodes: usize,
    pub can_watch: bool,
    pub faults_for: Duration,
    pub p_lost_before: f64,
    pub p_lost_reply: f64,
    pub p_error_after: f64,
    pub p_replay: f64,
    pub p_watch_fail: f64,
    pub slow: f64,
    pub chaos_events: u64,
    /// The store assigns fencing tokens at commit (memory, Redis, etcd); otherwise the electors
    /// use fencing seeds (Kubernetes).
    pub commit_tokens: bool,
    /// Every elector trusts a missing record ([`ElectorConfig::trust_absence`]).
    pub trust_absence: bool,
    /// A watch delivers an event twice.
    pub p_watch_dup: f64,
    /// A watch delivers an older state after a newer one (breaks the store contract).
    pub p_watch_stale: f64,
    /// A watch coalesces an event into the state at delivery time.
    pub p_watch_coalesce: f64,
    /// A started node takes the identity of another running node (two processes, one identity).
    pub p_same_identity: f64,
}

impl Profile {
    pub fn random(rng: &mut Rng) -> Self {
        let heavy = rng.chance(0.3);
        let p = |rng: &mut Rng, max: f64| {
            if rng.chance(0.5) {
                rng.f64() * max
            } else {
                0.0
            }
        };
        Profile {
            nodes: 2 + rng.below(3) as usize,
            can_watch: rng.chance(0.8),
            faults_for: rng.dur(Duration::from_secs(10), Duration::from_secs(40)),
            p_lost_before: p(rng, if heavy { 0.2 } else { 0.05 }),
            p_lost_reply: p(rng, if heavy { 0.2 } else { 0.05 }),
            p_error_after: p(rng, if heavy { 0.2 } else { 0.05 }),
            p_replay: p(rng, 0.1),
            p_watch_fail: p(rng, 0.5),
            slow: p(rng, if heavy { 0.3 } else { 0.1 }),
            chaos_events: rng.below(if heavy { 25 } else { 10 }),
            commit_tokens: rng.chance(0.6),
            trust_absence: rng.chance(0.15),
            p_watch_dup: p(rng, 0.2),
            p_watch_stale: p(rng, 0.1),
            p_watch_coalesce: p(rng, 0.2),
            p_same_identity: p(rng, 0.3),
        }
    }
}

/// The outcome of one run.
#[derive(Debug)]
pub struct Outcome {
    pub seed: u64,
    pub violation: Option<String>,
    pub trace: Vec<String>,
    pub terms: usize,
    pub events: u64,
}

pub struct Sim {
    seed: u64,
    rng: Rng,
    now: T,
    seq: u64,
    origin: Instant,
    queue: BinaryHeap<Reverse<Queued>>,
    store: Store,
    nodes: Vec<Node>,
    intervals: Vec<Interval>,
    profile: Profile,
    faults_until: T,
    trace: Option<VecDeque<String>>,
    violation: Option<String>,
    events: u64,
    healthy: bool,
    /// (identity, token) of terms whose record was lost to data loss (also for terms that start
    /// later: an acquire acknowledged after its record was lost).
    lost: Vec<(String, u64)>,
    /// A foreign writer set a token no higher one can follow: liveness is not expected after it.
    exhausted: bool,
    /// Actions of leader tasks: (true time, interval).
    actions: Vec<(T, usize)>,
    /// The longest lease duration a foreign writer put into a record (at least `LEASE`).
    longest: Duration,
    /// With fencing seeds: when a create committed a token below one written before (see
    /// `commit`); token order is not checked for terms that start after it.
    seed_regressed: Option<T>,
}

const TRACE_LINES: usize = 400;
/// A run has a few thousand events; far more means a busy loop.
const MAX_EVENTS: u64 = 200_000;

impl Sim {
    pub fn new(seed: u64, profile: Option<Profile>, trace: bool) -> Self {
        let mut rng = Rng::new(seed);
        let profile = profile.unwrap_or_else(|| Profile::random(&mut rng));
        let mut sim = Sim {
            seed,
            rng,
            now: Duration::ZERO,
            seq: 0,
            origin: Instant::now(),
            queue: BinaryHeap::new(),
            store: Store::default(),
            nodes: Vec::new(),
            intervals: Vec::new(),
            faults_until: profile.faults_for,
            profile,
            trace: trace.then(VecDeque::new),
            violation: None,
            events: 0,
            healthy: false,
            lost: Vec::new(),
            exhausted: false,
            actions: Vec::new(),
            longest: LEASE,
            seed_regressed: None,
        };
        for i in 0..sim.profile.nodes {
            sim.nodes.push(Node {
                machine: None,
                identity: String::new(),
                incarnation: 0,
                rate: 1.0,
                local0: Duration::ZERO,
                t0: Duration::ZERO,
                wall_skew: Duration::ZERO,
                timer_gen: 0,
                paused_until: Duration::ZERO,
                deferred: VecDeque::new(),
                watch: None,
                interval: None,
                term_seq: 0,
                waiting: None,
                watch_broken_until: Duration::ZERO,
                validity: None,
                seen_max: 0,
            });
            let at = sim.rng.dur(Duration::ZERO, Duration::from_millis(500));
            sim.push(at, i, Ev::Start);
        }
        // The chaos schedule.
        for _ in 0..sim.profile.chaos_events {
            let at = sim
                .rng
                .dur(Duration::from_millis(500), sim.profile.faults_for);
            let node = sim.rng.below(sim.profile.nodes as u64) as usize;
            let ev = match sim.rng.below(13) {
                0 | 1 => Ev::Pause {
                    dur: sim.rng.dur(Duration::from_millis(300), LEASE * 2),
                },
                2 => Ev::Crash,
                3 => Ev::Shutdown,
                4 => Ev::Yield {
                    dur: sim.rng.dur(Duration::ZERO, Duration::from_secs(5)),
                },
                5 => Ev::BreakWatch,
                6 => Ev::VersionOnly,
                7 => Ev::Delete,
                8 => Ev::Corrupt,
                10 | 11 => {
                    let edits = [
                        Edit::Vacate,
                        Edit::Holder,
                        Edit::Shorter,
                        Edit::Shorter,
                        Edit::Longer,
                        Edit::AcquireTime,
                        Edit::RenewTime,
                        Edit::Transitions,
                        Edit::TransitionsNearMax,
                        Edit::Restore,
                        Edit::Restore,
                    ];
                    Ev::Foreign(edits[sim.rng.below(edits.len() as u64) as usize])
                }
                12 => Ev::Pause {
                    dur: sim.rng.dur(Duration::from_millis(300), LEASE * 2),
                },
                _ => {
                    // A watch that fails on every open for a while.
                    let until = at + sim.rng.dur(Duration::from_secs(1), LEASE * 2);
                    sim.faults_until = sim.faults_until.max(until);
                    let n = &mut sim.nodes[node];
                    n.watch_broken_until = n.watch_broken_until.max(until);
                    Ev::BreakWatch
                }
            };
            if let Ev::Pause { dur } = &ev {
                sim.faults_until = sim.faults_until.max(at + *dur);
            }
            if let Ev::Yield { dur } = &ev {
                sim.faults_until = sim.faults_until.max(at + *dur + DRAIN + RENEW);
            }
            sim.push(at, node, ev);
        }
        sim
    }

    /// Queues an event for whatever runs on `node` when it fires (chaos, starts).
    fn push(&mut self, at: T, node: usize, ev: Ev) {
        self.push_inc(at, node, 0, ev);
    }

    /// Queues an event for the node's current incarnation only.
    fn push_own(&mut self, at: T, node: usize, ev: Ev) {
        let inc = self.nodes[node].incarnation;
        self.push_inc(at, node, inc, ev);
    }

    fn push_inc(&mut self, at: T, node: usize, inc: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse(Queued {
            at: at.max(self.now),
            seq: self.seq,
            node,
            inc,
            ev,
        }));
    }

    fn log(&mut self, line: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            let cap = std::env::var("LEASEHOLD_SIM_TRACE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(TRACE_LINES);
            if t.len() >= cap {
                t.pop_front();
            }
            let at = self.now;
            t.push_back(format!("{:>10.6}s {}", at.as_secs_f64(), line()));
        }
    }

    fn fail(&mut self, msg: String) {
        if self.violation.is_none() {
            self.log(|| format!("VIOLATION: {msg}"));
            self.violation = Some(msg);
        }
    }

    // --- clocks -------------------------------------------------------------------------------

    fn local(&self, n: usize, t: T) -> Duration {
        let node = &self.nodes[n];
        node.local0 + (t.saturating_sub(node.t0)).mul_f64(node.rate)
    }

    fn now_of(&self, n: usize) -> Now {
        let l = self.local(n, self.now);
        Now {
            instant: self.origin + l,
            wall: UNIX_EPOCH + Duration::from_secs(1_700_000_000) + self.nodes[n].wall_skew + l,
        }
    }

    /// The first true time at which node `n`'s clock reads `i` or later.
    fn true_of(&self, n: usize, i: Instant) -> T {
        let node = &self.nodes[n];
        let l = i.saturating_duration_since(self.origin);
        let dl = l.saturating_sub(node.local0);
        let mut t = node.t0 + dl.div_f64(node.rate);
        while self.local(n, t) < l {
            t += Duration::from_nanos(1);
        }
        t
    }

    // --- latencies and fates --------------------------------------------------------------------

    fn latency(&mut self) -> Duration {
        if self.healthy {
            return self
                .rng
                .dur(Duration::from_micros(100), Duration::from_millis(20));
        }
        if self.rng.chance(self.profile.slow) {
            // Long tails, past the request deadline.
            self.rng.dur(Duration::from_millis(100), RENEW * 2)
        } else {
            self.rng
                .dur(Duration::from_micros(100), Duration::from_millis(50))
        }
    }

    fn fate(&mut self, write: bool) -> Fate {
        if self.healthy {
            return Fate::Normal;
        }
        let p = &self.profile;
        let (a, b, c, d) = (p.p_lost_before, p.p_lost_reply, p.p_error_after, p.p_replay);
        let r = self.rng.f64();
        if r < a {
            Fate::LostBeforeCommit
        } else if r < a + b {
            Fate::LostReply
        } else if r < a + b + c {
            Fate::ErrorAfterCommit
        } else if write && r < a + b + c + d {
            Fate::Replay
        } else {
            Fate::Normal
        }
    }

    // --- running ------------------------------------------------------------------------------

    pub fn run(mut self) -> Outcome {
        while let Some(Reverse(q)) = self.queue.pop() {
            let run_end = self.faults_until + self.liveness_bound() + Duration::from_secs(2);
            if q.at > run_end || self.violation.is_some() {
                break;
            }
            self.now = q.at;
            if !self.healthy && self.now >= self.faults_until {
                self.healthy = true;
                self.log(|| "faults stop".into());
            }
            self.events += 1;
            if self.events > MAX_EVENTS {
                self.fail(format!(
                    "event storm: more than {MAX_EVENTS} events (a busy loop in the machine or its timers)"
                ));
                break;
            }
            if q.inc != 0 && q.inc != self.nodes[q.node].incarnation {
                continue; // meant for an earlier incarnation of this node
            }
            self.dispatch(q.node, q.ev);
        }
        let check_at = self.faults_until + self.liveness_bound();
        let run_end = check_at + Duration::from_secs(2);
        self.now = run_end;
        if self.violation.is_none() {
            self.check(check_at, run_end);
        }
        Outcome {
            seed: self.seed,
            violation: self.violation.take(),
            trace: self.trace.take().map(Vec::from).unwrap_or_default(),
            terms: self.intervals.len(),
            events: self.events,
        }
    }

    /// How long after the faults stop some elector must lead: the documented bound, scaled for
    /// the worst clock rates, plus the healthy store's latency for a few round trips.
    pub fn liveness_bound(&self) -> Duration {
        (self.longest + RENEW + RETRY.mul_f64(2.2)).mul_f64((1.0 + DRIFT) / (1.0 - DRIFT))
            + Duration::from_millis(200)
    }

    fn check(&mut self, check_at: T, run_end: T) {
        let mut ivs = self.intervals.clone();
        ivs.sort_by_key(|i| i.start);
        let mut max_before: Option<&Interval> = None;
        for iv in &ivs {
            // A term that began inside its own exempt window (its record was shortened and
            // taken over before it could know) may start late with a lower token, which fencing
            // rejects, as a void term may.
            let late = iv.exempt_at(iv.start) || self.seed_regressed.is_some_and(|t| iv.start >= t);
            if let Some(m) = max_before
                && !iv.voided
                && !late
                && iv.token <= m.token
            {
                self.fail(format!(
                    "fencing token did not increase: {} had {} from {:?}, then {} got {} at {:?}",
                    m.identity, m.token, m.start, iv.identity, iv.token, iv.start
                ));
                return;
            }
            if !iv.voided && !late && max_before.is_none_or(|m| iv.token > m.token) {
                max_before = Some(iv);
            }
        }
        let all = ivs.clone();
        ivs.retain(|iv| !iv.voided);
        // Mutual exclusion: no two non-void terms are valid at one instant (outside the exempt
        // windows of a foreign write that shortened the lease).
        for (i, p) in ivs.iter().enumerate() {
            let ps = p.segments(run_end);
            for q in &ivs[i + 1..] {
                if let Some((lo, hi)) = overlap(&ps, &q.segments(run_end)) {
                    self.fail(format!(
                        "two valid terms overlap during {lo:?}..{hi:?}: {} (token {}) valid {:?}..{:?} and {} (token {}) valid {:?}..{:?}",
                        p.identity,
                        p.token,
                        p.start,
                        p.effective_end(run_end),
                        q.identity,
                        q.token,
                        q.start,
                        q.effective_end(run_end)
                    ));
                    return;
                }
            }
        }
        // Leader tasks' actions: none of a term after a later term's first action.
        let original = self.intervals.clone();
        let actions = self.actions.clone();
        let first_action = |i: usize| {
            actions
                .iter()
                .filter(|(t, j)| *j == i && !original[i].exempt_at(*t))
                .map(|(t, _)| *t)
                .min()
        };
        for (t, i) in &actions {
            let a = &original[*i];
            if a.voided || a.exempt_at(*t) {
                continue;
            }
            for (j, b) in original.iter().enumerate() {
                if j == *i || b.voided || b.start <= a.start {
                    continue;
                }
                if let Some(first) = first_action(j)
                    && first < *t
                {
                    let msg = format!(
                        "{} acted on token {} at {t:?}, after {} (token {}) had acted at {first:?}",
                        a.identity, a.token, b.identity, b.token
                    );
                    self.fail(msg);
                    return;
                }
            }
        }
        let leading = all
            .iter()
            .any(|iv| iv.start <= check_at && check_at < iv.effective_end(run_end));
        // A token set near the maximum by a foreign writer ends the key's life by design: no
        // term may start with a token that is not above the last one.
        if !leading && !self.exhausted {
            self.fail(format!(
                "nobody leads at {check_at:?}, {:?} after the faults stopped at {:?}",
                self.liveness_bound(),
                self.faults_until
            ));
        }
    }

    fn dispatch(&mut self, n: usize, ev: Ev) {
        match ev {
            Ev::Start => return self.start(n),
            Ev::VersionOnly => {
                if let Some((Stored::Record(r), _)) = self.store.cur.clone() {
                    self.log(|| "chaos: a foreign write changes only the version".into());
                    self.store_write(Some(Stored::Record(r)));
                }
                return;
            }
            Ev::Foreign(edit) => {
                self.foreign_edit(edit);
                return;
            }
            Ev::Delete => {
                self.log(|| "chaos: the record is deleted (data loss)".into());
                self.void_current_record();
                self.store_write(None);
                return;
            }
            Ev::Corrupt => {
                self.log(|| "chaos: corrupt data is written".into());
                self.void_current_record();
                self.store_write(Some(Stored::Corrupt));
                return;
            }
            Ev::Commit { req, op, fate, inc } => return self.commit(n, inc, req, op, fate),
            _ => {}
        }
        if self.nodes[n].machine.is_none() {
            return; // crashed or stopped: nothing is delivered any more
        }
        if let Ev::Pause { dur } = ev {
            let until = self.now + dur;
            if until > self.nodes[n].paused_until {
                let id = self.nodes[n].identity.clone();
                self.log(|| format!("chaos: {id} paused for {dur:?}"));
                self.nodes[n].paused_until = until;
                self.push_own(until, n, Ev::Resume);
            }
            return;
        }
        if let Ev::Crash = ev {
            self.crash(n);
            return;
        }
        if self.now < self.nodes[n].paused_until {
            if !matches!(ev, Ev::Resume) {
                self.nodes[n].deferred.push_back(ev);
            }
            return;
        }
        if let Ev::Resume = ev {
            let id = self.nodes[n].identity.clone();
            self.log(|| format!("{id} resumes"));
            while let Some(ev) = self.nodes[n].deferred.pop_front() {
                if self.deliver(n, ev) {
                    // Outputs are handled in order, before the next deferred input.
                    self.after(n);
                }
                if self.nodes[n].machine.is_none() {
                    break;
                }
            }
            self.after(n);
            return;
        }
        if self.deliver(n, ev) && self.nodes[n].machine.is_some() {
            self.after(n);
        }
    }

    fn start(&mut self, n: usize) {
        let inc = self.nodes[n].incarnation + 1;
        let reuse = inc > 1 && self.rng.chance(0.3);
        // Two processes with one identity: a restarted pod whose old process still runs.
        let running: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(i, nd)| *i != n && nd.machine.is_some())
            .map(|(_, nd)| nd.identity.clone())
            .collect();
        let identity = if !running.is_empty() && self.rng.chance(self.profile.p_same_identity) {
            running[self.rng.below(running.len() as u64) as usize].clone()
        } else if reuse {
            self.nodes[n].identity.clone()
        } else {
            format!("n{n}-{inc}")
        };
        let rate = 1.0 + DRIFT * (2.0 * self.rng.f64() - 1.0);
        let local0 =
            Duration::from_secs(1000) + self.rng.dur(Duration::ZERO, Duration::from_secs(500));
        let wall_skew = self.rng.dur(Duration::ZERO, Duration::from_secs(7200));
        {
            let node = &mut self.nodes[n];
            node.identity = identity.clone();
            node.incarnation = inc;
            node.rate = rate;
            node.local0 = local0;
            node.t0 = self.now;
            node.wall_skew = wall_skew;
            node.paused_until = Duration::ZERO;
            node.deferred.clear();
            node.watch = None;
            node.interval = None;
            node.waiting = None;
            node.validity = None;
            node.seen_max = 0;
        }
        let cfg = ElectorConfig::new(key(), identity.clone())
            .with_timings(LEASE, RENEW, RETRY)
            .with_drain_timeout(DRAIN)
            .with_trust_absence(self.profile.trust_absence);
        let seed = self.rng.next_u64();
        let now = self.now_of(n);
        let caps = if self.profile.can_watch {
            Capabilities::WATCH
        } else {
            Capabilities::POLL
        };
        let caps = if self.profile.commit_tokens {
            caps.with_commit_tokens()
        } else {
            caps
        };
        let m = Machine::new(cfg, caps, seed, now).expect("valid config");
        self.nodes[n].machine = Some(m);
        self.log(|| format!("{identity} starts (clock rate {rate:.4})"));
        self.after(n);
    }

    fn crash(&mut self, n: usize) {
        let identity = self.nodes[n].identity.clone();
        self.log(|| format!("chaos: {identity} crashes"));
        self.take_down(n, Duration::from_secs(3));
    }

    /// Node `n` is gone (crashed or stopped): its term ends now, and a new incarnation starts
    /// within `restart_within`.
    fn take_down(&mut self, n: usize, restart_within: Duration) {
        if let Some(i) = self.nodes[n].interval.take() {
            let now = self.now;
            let iv = &mut self.intervals[i];
            iv.end = Some(iv.end.unwrap_or(now).min(now));
        }
        self.nodes[n].machine = None;
        self.nodes[n].watch = None;
        self.nodes[n].validity = None;
        let at = self.now + self.rng.dur(Duration::ZERO, restart_within);
        self.faults_until = self.faults_until.max(at);
        self.push(at, n, Ev::Start);
    }

    /// Delivers one input to node `n`'s machine; false when it was not for the machine (stale).
    fn deliver(&mut self, n: usize, ev: Ev) -> bool {
        let now = self.now_of(n);
        let identity = self.nodes[n].identity.clone();
        match ev {
            Ev::Timer { generation } => {
                if generation != self.nodes[n].timer_gen {
                    return false;
                }
                self.log(|| format!("{identity} timer"));
                self.machine(n).handle_input(now, Input::Timeout);
            }
            Ev::Reply { req, result } => {
                if self.nodes[n].waiting != Some(req) {
                    return false; // already answered (or timed out) once
                }
                self.nodes[n].waiting = None;
                self.log(|| format!("{identity} <- {req:?} {}", short(&result)));
                match &result {
                    Ok(Reply::Record(Some(v))) => self.observed_version(n, &v.version),
                    Ok(Reply::Written(v)) => self.observed_version(n, v),
                    Ok(Reply::Acquired(a)) => self.observed_version(n, &a.version),
                    Err(Error::Corrupt {
                        version: Some(v), ..
                    }) => self.observed_version(n, v),
                    _ => {}
                }
                self.machine(n)
                    .handle_input(now, Input::Reply { id: req, result });
            }
            Ev::WatchOpen { id, after, ok } => {
                let current = matches!(&self.nodes[n].watch, Some(w) if w.id == id && !w.open);
                if !current {
                    return false;
                }
                if ok {
                    self.log(|| format!("{identity} watch {id:?} open after {after:?}"));
                    if let Some(w) = &mut self.nodes[n].watch {
                        w.open = true;
                    }
                    self.machine(n)
                        .handle_input(now, Input::WatchOpened { id, result: Ok(()) });
                    // The backlog: what changed after `after` (the register keeps only the
                    // latest state, so missed changes coalesce into it, as the contract allows).
                    let cur = self.store.version();
                    let backlog = match (&after, cur) {
                        (None, Some(_)) => self.store.event(),
                        (Some(a), Some(c)) if Version::from(c) != *a => self.store.event(),
                        (Some(_), None) => Some(WatchEvent::Deleted),
                        _ => None,
                    };
                    if let Some(ev) = backlog {
                        let at = self.now;
                        self.push_own(
                            at,
                            n,
                            Ev::WatchItem {
                                id,
                                item: Some(Ok(ev)),
                            },
                        );
                    }
                } else {
                    self.log(|| format!("{identity} watch {id:?} fails to open"));
                    self.nodes[n].watch = None;
                    self.machine(n).handle_input(
                        now,
                        Input::WatchOpened {
                            id,
                            result: Err(unavailable("watch refused")),
                        },
                    );
                }
            }
            Ev::WatchTimeout { id } => {
                let current = matches!(&self.nodes[n].watch, Some(w) if w.id == id && !w.open);
                if current {
                    self.nodes[n].watch = None;
                    self.machine(n).handle_input(
                        now,
                        Input::WatchOpened {
                            id,
                            result: Err(Error::Timeout {
                                store: "sim",
                                operation: "watch",
                                after: RENEW,
                            }),
                        },
                    );
                }
            }
            Ev::WatchItem { id, item } => {
                let current = matches!(&self.nodes[n].watch, Some(w) if w.id == id && w.open);
                if !current {
                    return false;
                }
                if !matches!(item, Some(Ok(_))) {
                    self.nodes[n].watch = None;
                }
                self.log(|| format!("{identity} watch item {}", short_item(&item)));
                if let Some(Ok(WatchEvent::Put(v))) = &item {
                    self.observed_version(n, &v.version);
                }
                self.machine(n)
                    .handle_input(now, Input::WatchItem { id, item });
            }
            Ev::WatchLatest { id } => {
                let current = matches!(&self.nodes[n].watch, Some(w) if w.id == id && w.open);
                if !current {
                    return false;
                }
                let Some(ev) = self.store.event() else {
                    return false;
                };
                self.log(|| {
                    format!(
                        "{identity} watch item (coalesced) {}",
                        short_item(&Some(Ok(ev.clone())))
                    )
                });
                if let WatchEvent::Put(v) = &ev {
                    self.observed_version(n, &v.version);
                }
                self.machine(n).handle_input(
                    now,
                    Input::WatchItem {
                        id,
                        item: Some(Ok(ev)),
                    },
                );
            }
            Ev::Act { term } => {
                if term != self.nodes[n].term_seq {
                    return false;
                }
                let Some(i) = self.nodes[n].interval else {
                    return false;
                };
                // `ensure_leading`: the term's validity against this node's own clock.
                let valid = self.nodes[n].validity.is_some_and(|v| now.instant < v);
                if valid {
                    let token = self.intervals[i].token;
                    self.log(|| format!("{identity} acts on token {token}"));
                    let t = self.now;
                    self.actions.push((t, i));
                }
                let at = self.now
                    + self
                        .rng
                        .dur(Duration::from_millis(20), Duration::from_millis(800));
                self.push_own(at, n, Ev::Act { term });
                return false;
            }
            Ev::TaskYields { term, dur } => {
                if term != self.nodes[n].term_seq || self.nodes[n].interval.is_none() {
                    return false;
                }
                self.log(|| format!("{identity}'s leader task yields (or panics) for {dur:?}"));
                self.machine(n).handle_input(
                    now,
                    Input::Command(Command::Yield {
                        id: 2,
                        duration: dur,
                    }),
                );
            }
            Ev::Drained { term } => {
                if term == self.nodes[n].term_seq {
                    self.machine(n).handle_input(now, Input::TasksDrained);
                }
            }
            Ev::Shutdown => {
                self.log(|| format!("chaos: {identity} shuts down"));
                self.machine(n)
                    .handle_input(now, Input::Command(Command::Shutdown));
            }
            Ev::Yield { dur } => {
                self.log(|| format!("chaos: {identity} yields for {dur:?}"));
                self.machine(n).handle_input(
                    now,
                    Input::Command(Command::Yield {
                        id: 1,
                        duration: dur,
                    }),
                );
            }
            Ev::BreakWatch => {
                let open = self.nodes[n]
                    .watch
                    .as_ref()
                    .filter(|w| w.open)
                    .map(|w| w.id);
                if let Some(id) = open {
                    self.log(|| format!("chaos: {identity}'s watch breaks"));
                    self.nodes[n].watch = None;
                    self.machine(n).handle_input(
                        now,
                        Input::WatchItem {
                            id,
                            item: Some(Err(unavailable("watch broke"))),
                        },
                    );
                }
            }
            _ => return false,
        }
        true
    }

    fn machine(&mut self, n: usize) -> &mut Machine {
        self.nodes[n].machine.as_mut().expect("a live node")
    }

    /// Drains node `n`'s outputs and re-arms its timer.
    fn after(&mut self, n: usize) {
        loop {
            let Some(m) = self.nodes[n].machine.as_mut() else {
                return;
            };
            let Some(out) = m.poll_output() else { break };
            self.output(n, out);
        }
        let Some(m) = self.nodes[n].machine.as_ref() else {
            return;
        };
        let wake = m.poll_timeout();
        self.nodes[n].timer_gen += 1;
        let generation = self.nodes[n].timer_gen;
        if let Some(i) = wake {
            let at = self.true_of(n, i);
            self.push_own(at, n, Ev::Timer { generation });
        }
    }

    fn output(&mut self, n: usize, out: Output) {
        let identity = self.nodes[n].identity.clone();
        match out {
            Output::Request(req) => {
                self.nodes[n].waiting = Some(req.id);
                let write = matches!(req.op, Op::Create(_) | Op::Update { .. });
                let fate = self.fate(write);
                self.log(|| {
                    format!(
                        "{identity} -> {:?} {} ({fate:?})",
                        req.id,
                        short_op(&req.op)
                    )
                });
                let deadline = self.true_of(n, req.deadline);
                // The driver reports a timeout at the deadline unless a reply came first.
                self.push_own(
                    deadline,
                    n,
                    Ev::Reply {
                        req: req.id,
                        result: Err(Error::Timeout {
                            store: "sim",
                            operation: "request",
                            after: RENEW,
                        }),
                    },
                );
                if fate != Fate::LostBeforeCommit {
                    let at = self.now + self.latency();
                    let inc = self.nodes[n].incarnation;
                    self.push(
                        at,
                        n,
                        Ev::Commit {
                            req: req.id,
                            op: req.op,
                            fate,
                            inc,
                        },
                    );
                }
            }
            Output::OpenWatch {
                id,
                after,
                deadline,
            } => {
                let broken = self.now < self.nodes[n].watch_broken_until;
                let refused = !self.healthy && self.rng.chance(self.profile.p_watch_fail);
                let ok = !broken && !refused;
                self.nodes[n].watch = Some(SimWatch {
                    id,
                    open: false,
                    last: self.now,
                });
                let at = self.now + self.latency();
                let deadline = self.true_of(n, deadline);
                self.push_own(at, n, Ev::WatchOpen { id, after, ok });
                self.push_own(deadline, n, Ev::WatchTimeout { id });
            }
            Output::CloseWatch => {
                self.nodes[n].watch = None;
            }
            Output::Leading {
                fencing_token,
                valid_until,
            } => {
                self.nodes[n].validity = Some(valid_until);
                let valid_until = self.true_of(n, valid_until);
                self.log(|| {
                    format!("{identity} LEADS token {fencing_token} valid until {valid_until:?}")
                });
                let inc = self.nodes[n].incarnation;
                let voided = self.lost.contains(&(identity.clone(), fencing_token));
                let now = self.now;
                // A foreign write shortened this term's record before it began, and this elector
                // has not seen it: followers may take over before it can know.
                let term = (identity.clone(), fencing_token);
                let unseen_cut = self
                    .store
                    .shortened
                    .iter()
                    .filter(|(t, v)| *t == term && self.nodes[n].seen_max < *v)
                    .map(|(_, v)| *v)
                    .max();
                let clash = self
                    .intervals
                    .iter()
                    .find(|iv| {
                        !iv.voided
                            && iv.end.is_none_or(|e| e > now)
                            && iv.valid_until > now
                            && !iv.exempt_at(now)
                    })
                    .cloned();
                if let Some(iv) = clash.filter(|_| !voided && unseen_cut.is_none()) {
                    self.fail(format!(
                        "two valid terms overlap: {} (token {}) is valid until {:?} when {identity} starts a term with token {fencing_token}",
                        iv.identity, iv.token, iv.valid_until.min(iv.end.unwrap_or(iv.valid_until))
                    ));
                }
                // Every term's token exceeds those of all earlier terms that were not voided by
                // data loss (a void term's token may be repeated once, see the module docs).
                if let Some(max) = self
                    .intervals
                    .iter()
                    .filter(|iv| !iv.voided)
                    .map(|iv| iv.token)
                    .max()
                    && fencing_token <= max
                    && !voided
                    && unseen_cut.is_none()
                    && self.seed_regressed.is_none()
                {
                    self.fail(format!(
                        "fencing token did not increase: {identity} starts a term with token {fencing_token}, an earlier term had {max}"
                    ));
                }
                // Tokens assigned at commit are never repeated, void terms included.
                if self.profile.commit_tokens
                    && let Some(iv) = self.intervals.iter().find(|iv| iv.token == fencing_token)
                {
                    let other = iv.identity.clone();
                    self.fail(format!(
                        "fencing token repeated: {identity} starts a term with token {fencing_token}, which {other} already had"
                    ));
                }
                self.intervals.push(Interval {
                    node: n,
                    incarnation: inc,
                    identity: identity.clone(),
                    token: fencing_token,
                    start: self.now,
                    valid_until,
                    end: None,
                    voided,
                    exempt: unseen_cut.map(|_| (now, None)).into_iter().collect(),
                    exempt_version: unseen_cut,
                });
                self.nodes[n].interval = Some(self.intervals.len() - 1);
                // The term's leader task acts now and then, and may yield (or panic) from inside.
                let term = self.nodes[n].term_seq;
                let at = self.now + self.rng.dur(Duration::ZERO, Duration::from_millis(300));
                self.push_own(at, n, Ev::Act { term });
                if !self.healthy && self.rng.chance(0.1) {
                    let at = self.now + self.rng.dur(Duration::ZERO, LEASE);
                    let dur = self.rng.dur(Duration::ZERO, Duration::from_secs(3));
                    self.faults_until = self.faults_until.max(at + dur + DRAIN + RENEW);
                    self.push_own(at, n, Ev::TaskYields { term, dur });
                }
            }
            Output::Shortened { valid_until } => {
                self.nodes[n].validity = Some(valid_until);
                let v = self.true_of(n, valid_until);
                self.log(|| format!("{identity}'s term is cut short: valid until {v:?}"));
                if let Some(i) = self.nodes[n].interval {
                    self.intervals[i].valid_until = self.intervals[i].valid_until.min(v);
                }
            }
            Output::TokensExhausted { last } => {
                self.log(|| format!("{identity}: no token above {last} can be issued"));
            }
            Output::Renewed { valid_until } => {
                if self.nodes[n].validity.is_some() {
                    self.nodes[n].validity = Some(valid_until);
                }
                let v = self.true_of(n, valid_until);
                self.log(|| format!("{identity} renewed: valid until {v:?}"));
                if let Some(i) = self.nodes[n].interval {
                    if self.now >= self.intervals[i].valid_until {
                        self.fail(format!(
                            "{identity}'s term (token {}) was renewed at {:?}, after its validity ended at {:?}",
                            self.intervals[i].token, self.now, self.intervals[i].valid_until
                        ));
                    }
                    self.intervals[i].valid_until = v;
                }
            }
            Output::TermEnded { cause } => {
                self.log(|| format!("{identity} term ended: {cause:?}"));
                self.nodes[n].term_seq += 1;
                let term = self.nodes[n].term_seq;
                let drain = if self.healthy || self.rng.chance(0.8) {
                    self.rng.dur(Duration::ZERO, Duration::from_millis(300))
                } else {
                    self.rng.dur(Duration::ZERO, DRAIN * 2)
                };
                let at = self.now + drain;
                self.push_own(at, n, Ev::Drained { term });
            }
            Output::Revoked => {
                self.nodes[n].validity = None;
                self.log(|| format!("{identity} term revoked"));
                if let Some(i) = self.nodes[n].interval.take() {
                    let now = self.now;
                    let iv = &mut self.intervals[i];
                    iv.end = Some(now);
                }
            }
            Output::Following { leader } => {
                self.log(|| format!("{identity} follows {leader:?}"));
            }
            Output::YieldDone { .. } => {}
            Output::Stopped => {
                self.log(|| format!("{identity} stopped"));
                self.take_down(n, Duration::from_secs(2));
            }
            _ => {}
        }
    }

    fn commit(&mut self, n: usize, inc: u64, req: RequestId, op: Op, fate: Fate) {
        let high_before = self.store.high_water;
        let (result, changed) = self.store.apply(&op);
        // With fencing seeds, a create whose seed was read before the record was lost (a
        // delayed request, a paused process) commits a token below one written before: from
        // then on a later term can repeat an earlier token. That is the seed scheme's documented
        // limit; tokens assigned at commit have no such case.
        if let (Op::Create(r), true) = (&op, changed)
            && !self.profile.commit_tokens
            && r.transitions <= high_before
            && high_before > 0
            && self.seed_regressed.is_none()
        {
            let now = self.now;
            self.log(|| {
                format!(
                    "a create commits token {} below one written before",
                    r.transitions
                )
            });
            self.seed_regressed = Some(now);
        }
        if changed {
            if let Some((Stored::Record(r), _)) = &self.store.cur {
                self.store.owner = Some((r.holder_identity.clone(), r.transitions));
            }
            self.notify();
        }
        let identity = self.nodes[n].identity.clone();
        self.log(|| {
            format!(
                "store: {identity}'s {req:?} {} commits: {}",
                short_op(&op),
                short(&result)
            )
        });
        let result = match fate {
            Fate::Normal => Some(result),
            Fate::LostReply | Fate::LostBeforeCommit => None,
            Fate::ErrorAfterCommit => Some(Err(unavailable("connection reset after the write"))),
            Fate::Replay => {
                if result.is_ok() {
                    // The client retried a write that had landed: the retry reports a conflict.
                    let (again, changed) = self.store.apply(&op);
                    if changed {
                        self.notify();
                    }
                    Some(again)
                } else {
                    Some(result)
                }
            }
        };
        if let Some(result) = result {
            let at = self.now + self.latency();
            self.push_inc(at, n, inc, Ev::Reply { req, result });
        }
    }

    /// The stored record is about to be lost (deleted, corrupted, or replaced by a foreign writer
    /// with a record that lets someone take over at once): the term written in it is void, by the
    /// docs' definition, whether its holder still runs or not, and also if it starts only later
    /// (its acquire is acknowledged after the loss).
    fn void_current_record(&mut self) {
        let mut terms: Vec<(String, u64)> = self.store.owner.take().into_iter().collect();
        if let Some((Stored::Record(r), _)) = &self.store.cur {
            terms.push((r.holder_identity.clone(), r.transitions));
        }
        for (holder, token) in terms {
            if holder.is_empty() {
                continue;
            }
            for iv in &mut self.intervals {
                if iv.token == token && iv.identity == holder {
                    iv.voided = true;
                }
            }
            self.lost.push((holder, token));
        }
    }

    /// A foreign client edits the stored record.
    fn foreign_edit(&mut self, edit: Edit) {
        let Some((Stored::Record(cur), _)) = self.store.cur.clone() else {
            return;
        };
        let mut r = cur.clone();
        match edit {
            Edit::Vacate => r.holder_identity.clear(),
            Edit::Holder => {
                let others: Vec<String> = self
                    .nodes
                    .iter()
                    .map(|n| n.identity.clone())
                    .filter(|i| !i.is_empty() && *i != cur.holder_identity)
                    .collect();
                r.holder_identity = if others.is_empty() || self.rng.chance(0.3) {
                    "a-stranger".into()
                } else {
                    others[self.rng.below(others.len() as u64) as usize].clone()
                };
            }
            Edit::Shorter => {
                r.lease_duration = Duration::from_secs(self.rng.below(LEASE.as_secs()));
            }
            Edit::Longer => {
                r.lease_duration = LEASE + Duration::from_secs(1 + self.rng.below(30));
            }
            Edit::AcquireTime => {
                r.acquire_time = r
                    .acquire_time
                    .map(|t| t - Duration::from_secs(1 + self.rng.below(100)));
            }
            Edit::RenewTime => {
                let d = Duration::from_micros(1 + self.rng.below(100_000_000));
                r.renew_time = r
                    .renew_time
                    .map(|t| if self.rng.chance(0.5) { t - d } else { t + d });
            }
            Edit::Transitions if self.profile.commit_tokens => {
                r.transitions = self.rng.below(r.transitions.saturating_add(20));
            }
            Edit::Transitions => {
                // Fencing seeds derive tokens from the record: a writer that lowers the token is
                // outside their guarantee (the README says so); raising it is modelled.
                r.transitions = r.transitions.saturating_add(1 + self.rng.below(20));
            }
            Edit::TransitionsNearMax => {
                let near = u64::MAX - self.rng.below(3);
                // With fencing seeds only raising the token is modelled (see Transitions).
                r.transitions = if self.profile.commit_tokens {
                    near
                } else {
                    near.max(r.transitions)
                };
                self.exhausted = true;
            }
            Edit::Restore => {
                // With fencing seeds a restore that lowers the token is outside the guarantee
                // (as any writer that lowers it); with commit tokens every restore is modelled.
                let copies: Vec<LeaseRecord> = self
                    .store
                    .history
                    .iter()
                    .filter(|h| self.profile.commit_tokens || h.transitions >= cur.transitions)
                    .cloned()
                    .collect();
                if copies.is_empty() {
                    return;
                }
                r = copies[self.rng.below(copies.len() as u64) as usize].clone();
            }
        }
        let same_term = r.holder_identity == cur.holder_identity
            && r.transitions == cur.transitions
            && r.acquire_time == cur.acquire_time;
        // An older term's record may be taken back at once by the elector that wrote it.
        let older_term = self
            .intervals
            .iter()
            .any(|iv| iv.identity == r.holder_identity && iv.token == r.transitions && !same_term);
        self.log(|| {
            format!(
                "chaos: a foreign client writes {edit:?}: holder={:?} token={} duration={:?}",
                r.holder_identity, r.transitions, r.lease_duration
            )
        });
        // A restore that replaces the current term's record with another record loses the
        // current record (its writer may even take the restored one back at once).
        if r.is_vacant() || older_term || (edit == Edit::Restore && !same_term) {
            self.void_current_record();
        }
        // A longer duration legitimately delays the takeover: followers that first see it as late
        // as the end of the faults wait that long.
        self.longest = self.longest.max(r.lease_duration);
        let shorter = same_term && r.lease_duration < LEASE;
        // The term whose elector wrote the record (earlier edits may have changed its fields).
        let (holder, owner_token) = self
            .store
            .owner
            .clone()
            .unwrap_or((cur.holder_identity.clone(), cur.transitions));
        let v = self.store.write(Some(Stored::Record(r)));
        if shorter {
            self.store
                .shortened
                .push(((holder.clone(), owner_token), v));
            // Followers that see this write may take over before the leader learns of it.
            let now = self.now;
            for iv in &mut self.intervals {
                if iv.identity == holder && iv.token == owner_token && iv.end.is_none() {
                    // An open window waits for the newest such write (observing it implies
                    // having observed the earlier ones).
                    if iv.exempt_version.is_none() {
                        iv.exempt.push((now, None));
                    }
                    iv.exempt_version = Some(v);
                }
            }
        }
        self.notify();
    }

    /// Node `n` observed store version `v`: an exempt window waiting for that closes.
    fn observed_version(&mut self, n: usize, v: &Version) {
        let Ok(v) = v.as_str().parse::<u64>() else {
            return;
        };
        self.nodes[n].seen_max = self.nodes[n].seen_max.max(v);
        let Some(i) = self.nodes[n].interval else {
            return;
        };
        let now = self.now;
        let iv = &mut self.intervals[i];
        if iv.exempt_version.is_some_and(|e| v >= e) {
            iv.exempt_version = None;
            if let Some(last) = iv.exempt.last_mut()
                && last.1.is_none()
            {
                last.1 = Some(now);
            }
        }
    }

    fn store_write(&mut self, v: Option<Stored>) {
        self.store.write(v);
        self.notify();
    }

    /// Schedules the current state for every open watch, in order per watch. While faults last,
    /// a watch may also deliver an event twice, deliver an older state after it (a store that
    /// breaks its contract), or coalesce it into the state at delivery time.
    fn notify(&mut self) {
        let Some(ev) = self.store.event() else { return };
        let older = self.store.history.back().cloned();
        for n in 0..self.nodes.len() {
            let Some(w) = &self.nodes[n].watch else {
                continue;
            };
            if !w.open {
                continue;
            }
            let id = w.id;
            let lat = self.latency();
            let (dup, stale, coalesce) = if self.healthy {
                (false, false, false)
            } else {
                (
                    self.rng.chance(self.profile.p_watch_dup),
                    self.rng.chance(self.profile.p_watch_stale),
                    self.rng.chance(self.profile.p_watch_coalesce),
                )
            };
            let w = self.nodes[n].watch.as_mut().expect("checked");
            let at = (self.now + lat).max(w.last);
            w.last = at;
            let item = if coalesce {
                Ev::WatchLatest { id }
            } else {
                Ev::WatchItem {
                    id,
                    item: Some(Ok(ev.clone())),
                }
            };
            self.push_own(at, n, item);
            if dup {
                self.push_own(
                    at,
                    n,
                    Ev::WatchItem {
                        id,
                        item: Some(Ok(ev.clone())),
                    },
                );
            }
            if stale && let Some(r) = &older {
                // The version is unknown here: an older record at a version below the current.
                let v = self.store.version().unwrap_or(1).saturating_sub(1).max(1);
                self.push_own(
                    at,
                    n,
                    Ev::WatchItem {
                        id,
                        item: Some(Ok(WatchEvent::Put(Versioned {
                            record: r.clone(),
                            version: Version::from(v),
                        }))),
                    },
                );
            }
        }
    }
}

fn short(r: &Result<Reply, Error>) -> String {
    match r {
        Ok(Reply::Record(Some(v))) => format!(
            "record holder={:?} token={} v={}",
            v.record.holder_identity, v.record.transitions, v.version
        ),
        Ok(Reply::Record(None)) => "absent".into(),
        Ok(Reply::Written(v)) => format!("written v={v}"),
        Ok(Reply::Seed(s)) => format!("seed {s}"),
        Ok(other) => format!("{other:?}"),
        Err(e) => format!("error: {e}"),
    }
}

fn short_op(op: &Op) -> String {
    match op {
        Op::Get => "get".into(),
        Op::FencingSeed => "fencing-seed".into(),
        Op::Create(r) => format!(
            "create holder={:?} token={}",
            r.holder_identity, r.transitions
        ),
        Op::Update { record, expected } => format!(
            "update holder={:?} token={} expected={}",
            record.holder_identity, record.transitions, expected
        ),
        other => format!("{other:?}"),
    }
}

fn short_item(i: &Option<Result<WatchEvent, Error>>) -> String {
    match i {
        Some(Ok(WatchEvent::Put(v))) => format!(
            "put holder={:?} token={} v={}",
            v.record.holder_identity, v.record.transitions, v.version
        ),
        Some(Ok(other)) => format!("{other:?}"),
        Some(Err(e)) => format!("error: {e}"),
        None => "end".into(),
    }
}

/// Runs `seed` with tracing and renders a failure report.
pub fn report(seed: u64, profile: Option<Profile>) -> String {
    let out = Sim::new(seed, profile, true).run();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "simulator seed {seed}: {}",
        out.violation.as_deref().unwrap_or("no violation on replay")
    );
    let _ = writeln!(
        s,
        "reproduce with: LEASEHOLD_SIM_SEED={seed} cargo test --test simulator -- --nocapture"
    );
    let _ = writeln!(s, "last events before it:");
    let show = std::env::var("LEASEHOLD_SIM_TRACE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150);
    for line in out.trace.iter().rev().take(show).rev() {
        let _ = writeln!(s, "  {line}");
    }
    s
}
