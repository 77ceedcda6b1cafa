//! Scripted tests of the elector state machine ([`leasehold::elector::machine`]), input by
//! input, as quinn-proto's tests drive its connection: a tiny register store, a virtual clock,
//! and every request committed, held or lost exactly where the script says. One test per
//! schedule of the second safety review (issue "Safety, round two") and of the fencing-token
//! review (issue "Fencing tokens that never repeat"); each was seen failing before its fix.
//!
//! The simulator (`tests/simulator.rs`) explores the same fault classes at random; these tests
//! pin the schedules a reviewer found, so that they keep failing loudly if a fix regresses even
//! after the simulator's fault model (and so what a seed means) changes.

use std::time::{Duration, Instant, UNIX_EPOCH};

use leasehold::elector::machine::{Command, Input, Machine, Now, Op, Output, Reply, Request};
use leasehold::{
    Acquired, Capabilities, ElectorConfig, Error, LeaseKey, LeaseRecord, Version, Versioned,
};

const LEASE: Duration = Duration::from_secs(15);
const RENEW: Duration = Duration::from_secs(10);
const RETRY: Duration = Duration::from_secs(2);
const STEP: Duration = Duration::from_millis(10);

fn key() -> LeaseKey {
    LeaseKey::new("scripted").expect("valid key")
}

/// A linearizable register: the memory store's rules, with tokens assigned at commit when
/// `commit_tokens` is set (above the revision and every token written) and fencing seeds
/// otherwise.
#[derive(Debug, Default)]
struct Register {
    rev: u64,
    high: u64,
    cur: Option<(LeaseRecord, u64)>,
}

impl Register {
    fn write(&mut self, r: Option<LeaseRecord>) -> u64 {
        self.rev += 1;
        if let Some(r) = &r {
            self.high = self.high.max(r.transitions);
        }
        self.cur = r.map(|r| (r, self.rev));
        self.rev
    }

    fn check(&self, expected: &Option<Version>) -> Result<(), Error> {
        match (&self.cur, expected) {
            (Some(_), None) => Err(Error::AlreadyExists { key: "k".into() }),
            (None, Some(_)) => Err(Error::NotFound { key: "k".into() }),
            (Some((_, v)), Some(e)) if Version::from(*v) != *e => Err(Error::Conflict {
                key: "k".into(),
                expected: e.clone(),
            }),
            _ => Ok(()),
        }
    }

    fn apply(&mut self, op: &Op) -> Result<Reply, Error> {
        match op {
            Op::Get => Ok(Reply::Record(self.cur.as_ref().map(|(r, v)| Versioned {
                record: r.clone(),
                version: Version::from(*v),
            }))),
            Op::FencingSeed => {
                let last = self.rev.max(self.high);
                last.checked_add(1)
                    .map(Reply::Seed)
                    .ok_or(Error::TokenExhausted {
                        key: "k".into(),
                        last,
                    })
            }
            Op::Create(r) => {
                self.check(&None)?;
                Ok(Reply::Written(Version::from(self.write(Some(r.clone())))))
            }
            Op::Update { record, expected } => {
                self.check(&Some(expected.clone()))?;
                Ok(Reply::Written(Version::from(
                    self.write(Some(record.clone())),
                )))
            }
            Op::Acquire { record, expected } => {
                self.check(expected)?;
                let replaced = self.cur.as_ref().map_or(0, |(r, _)| r.transitions);
                let last = self.rev.max(self.high).max(replaced);
                let token = last
                    .checked_add(1)
                    .ok_or(Error::TokenExhausted {
                        key: "k".into(),
                        last,
                    })?
                    .max(record.transitions);
                let v = self.write(Some(LeaseRecord {
                    transitions: token,
                    ..record.clone()
                }));
                Ok(Reply::Acquired(Acquired {
                    version: Version::from(v),
                    fencing_token: token,
                }))
            }
            other => panic!("the script's store does not know {other:?}"),
        }
    }
}

/// One term as the script saw it, on the script's clock.
#[derive(Clone, Debug)]
struct Term {
    #[allow(dead_code)] // shown in assertion messages
    who: String,
    token: u64,
    start: Duration,
    /// The end of validity as last announced (moved by renewals and cuts).
    valid_until: Duration,
    /// When the term was revoked or its elector went away.
    ended: Option<Duration>,
    /// Every cut of its validity (`Output::Shortened`), in order.
    cuts: Vec<Duration>,
}

impl Term {
    fn end(&self) -> Duration {
        self.ended.unwrap_or(Duration::MAX).min(self.valid_until)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    None,
    /// Every request (a partition).
    All,
    /// Writes only (a write delayed in the network; reads pass).
    Writes,
}

impl Hold {
    fn holds(self, op: &Op) -> bool {
        match self {
            Hold::None => false,
            Hold::All => true,
            Hold::Writes => matches!(op, Op::Create(_) | Op::Update { .. } | Op::Acquire { .. }),
        }
    }
}

struct Node {
    id: String,
    m: Option<Machine>,
    inflight: Option<Request>,
    /// Which requests are held (not answered): a partition, or a slow store.
    hold: Hold,
    term: Option<usize>,
    exhausted: Vec<u64>,
}

struct World {
    origin: Instant,
    now: Duration,
    store: Register,
    caps: Capabilities,
    nodes: Vec<Node>,
    terms: Vec<Term>,
    /// Written records, in order (for assertions on what renewals wrote).
    writes: Vec<LeaseRecord>,
}

impl World {
    fn new(commit_tokens: bool) -> Self {
        let caps = if commit_tokens {
            Capabilities::POLL.with_commit_tokens()
        } else {
            Capabilities::POLL
        };
        World {
            origin: Instant::now(),
            now: Duration::ZERO,
            store: Register::default(),
            caps,
            nodes: Vec::new(),
            terms: Vec::new(),
            writes: Vec::new(),
        }
    }

    fn clock(&self) -> Now {
        Now {
            instant: self.origin + self.now,
            wall: UNIX_EPOCH + Duration::from_secs(1_800_000_000) + self.now,
        }
    }

    fn at(&self, i: Instant) -> Duration {
        i.saturating_duration_since(self.origin)
    }

    /// Starts an elector; returns its index.
    fn start(&mut self, id: &str) -> usize {
        let cfg = ElectorConfig::new(key(), id).with_timings(LEASE, RENEW, RETRY);
        let m = Machine::new(cfg, self.caps, 7, self.clock()).expect("valid config");
        self.nodes.push(Node {
            id: id.into(),
            m: Some(m),
            inflight: None,
            hold: Hold::None,
            term: None,
            exhausted: Vec::new(),
        });
        let n = self.nodes.len() - 1;
        self.drain(n);
        n
    }

    /// The elector of node `n` goes away (a crash): its term ends now; a held request stays
    /// held (it may still commit, see [`World::commit_held`]).
    fn crash(&mut self, n: usize) {
        self.nodes[n].m = None;
        if let Some(t) = self.nodes[n].term.take() {
            self.terms[t].ended = Some(self.now);
        }
    }

    fn drain(&mut self, n: usize) {
        loop {
            let Some(m) = self.nodes[n].m.as_mut() else {
                return;
            };
            let Some(out) = m.poll_output() else { return };
            match out {
                Output::Request(r) => self.nodes[n].inflight = Some(r),
                Output::Leading {
                    fencing_token,
                    valid_until,
                } => {
                    let valid_until = self.at(valid_until);
                    self.terms.push(Term {
                        who: self.nodes[n].id.clone(),
                        token: fencing_token,
                        start: self.now,
                        valid_until,
                        ended: None,
                        cuts: Vec::new(),
                    });
                    self.nodes[n].term = Some(self.terms.len() - 1);
                }
                Output::Renewed { valid_until } => {
                    if let Some(t) = self.nodes[n].term {
                        self.terms[t].valid_until = self.at(valid_until);
                    }
                }
                Output::Shortened { valid_until } => {
                    if let Some(t) = self.nodes[n].term {
                        let v = self.at(valid_until);
                        self.terms[t].valid_until = v;
                        self.terms[t].cuts.push(v);
                    }
                }
                Output::Revoked => {
                    if let Some(t) = self.nodes[n].term.take() {
                        self.terms[t].ended = Some(self.now);
                    }
                }
                Output::TermEnded { .. } => {
                    // Tasks drain at once.
                    let now = self.clock();
                    if let Some(m) = self.nodes[n].m.as_mut() {
                        m.handle_input(now, Input::TasksDrained);
                    }
                }
                Output::TokensExhausted { last } => self.nodes[n].exhausted.push(last),
                _ => {}
            }
        }
    }

    /// Commits node `n`'s request in the store and answers it.
    fn answer(&mut self, n: usize) {
        let Some(req) = self.nodes[n].inflight.take() else {
            return;
        };
        let result = self.store.apply(&req.op);
        if let Some((r, _)) = &self.store.cur
            && result.is_ok()
            && matches!(
                req.op,
                Op::Create(_) | Op::Update { .. } | Op::Acquire { .. }
            )
        {
            self.writes.push(r.clone());
        }
        let now = self.clock();
        if let Some(m) = self.nodes[n].m.as_mut() {
            m.handle_input(now, Input::Reply { id: req.id, result });
        }
        self.drain(n);
    }

    /// Commits node `n`'s request in the store, then answers it with an error (a reply lost
    /// after the write landed).
    fn commit_and_fail(&mut self, n: usize) {
        let Some(req) = self.nodes[n].inflight.take() else {
            return;
        };
        let _ = self.store.apply(&req.op);
        let now = self.clock();
        let reset = Error::Unavailable {
            store: "script",
            message: "connection reset after the write".into(),
            source: None,
        };
        if let Some(m) = self.nodes[n].m.as_mut() {
            m.handle_input(
                now,
                Input::Reply {
                    id: req.id,
                    result: Err(reset),
                },
            );
        }
        self.drain(n);
    }

    /// Commits a request that node `n` sent and that was held, after its elector went away (a
    /// write delayed in the network or the store). Returns the store's answer.
    fn commit_held(&mut self, req: Request) -> Result<Reply, Error> {
        self.store.apply(&req.op)
    }

    /// Runs the world for `d`: requests of nodes that are not held are answered at once, a
    /// held request past its deadline times out, timers fire.
    fn run(&mut self, d: Duration) {
        let until = self.now + d;
        while self.now < until {
            for n in 0..self.nodes.len() {
                for _ in 0..16 {
                    if self.nodes[n].m.is_none() {
                        break;
                    }
                    let Some(req) = self.nodes[n].inflight.as_ref() else {
                        break;
                    };
                    let due = self.origin + self.now >= req.deadline;
                    let held = self.nodes[n].hold.holds(&req.op);
                    if !held {
                        self.answer(n);
                    } else if due {
                        let req = self.nodes[n].inflight.take().expect("checked");
                        let now = self.clock();
                        let timeout = Error::Timeout {
                            store: "script",
                            operation: "request",
                            after: RENEW,
                        };
                        if let Some(m) = self.nodes[n].m.as_mut() {
                            m.handle_input(
                                now,
                                Input::Reply {
                                    id: req.id,
                                    result: Err(timeout),
                                },
                            );
                        }
                        self.drain(n);
                    } else {
                        break;
                    }
                }
                let now = self.clock();
                if let Some(m) = self.nodes[n].m.as_mut()
                    && m.poll_timeout().is_some_and(|t| t <= now.instant)
                {
                    m.handle_input(now, Input::Timeout);
                    self.drain(n);
                }
            }
            self.now += STEP;
        }
    }

    fn leading(&self, n: usize) -> Option<&Term> {
        self.nodes[n].term.map(|t| &self.terms[t])
    }

    /// Mutual exclusion and strictly increasing tokens over every term so far.
    fn assert_safe(&self) {
        let mut terms = self.terms.clone();
        terms.sort_by_key(|t| t.start);
        for (i, a) in terms.iter().enumerate() {
            for b in &terms[i + 1..] {
                assert!(
                    b.start >= a.end(),
                    "two valid terms overlap: {a:?} and {b:?}"
                );
                assert!(
                    b.token > a.token,
                    "fencing token did not increase: {a:?} then {b:?}"
                );
            }
        }
    }

    /// Writes `r` as another client would (a kubectl edit, a script, a restore).
    fn foreign_write(&mut self, r: LeaseRecord) {
        self.store.write(Some(r));
    }

    fn stored(&self) -> LeaseRecord {
        self.store.cur.clone().expect("a record is stored").0
    }
}

fn vacant(transitions: u64) -> LeaseRecord {
    LeaseRecord {
        holder_identity: String::new(),
        lease_duration: Duration::from_secs(1),
        acquire_time: None,
        renew_time: None,
        transitions,
    }
}

/// Review round two, schedule 1: another writer shortens the leader's lease duration from 15 s
/// to 5 s. The leader must not copy that into its renewals (followers would take over 5 s after
/// a renewal while the term stays valid 10 s), and until its next renewal its validity is cut
/// to what followers of the foreign write wait for.
#[test]
fn r2_01_a_foreign_write_shortening_the_lease_cannot_make_two_leaders() {
    for commit_tokens in [false, true] {
        let mut w = World::new(commit_tokens);
        w.foreign_write(vacant(0));
        let a = w.start("a");
        w.run(Duration::from_secs(1));
        assert!(w.leading(a).is_some(), "a leads the released lease");
        let b = w.start("b");
        w.run(Duration::from_secs(3));
        // Right after a renewal, someone edits only the duration.
        w.run(RETRY); // a renews
        let renewed_at = w.now;
        let edited = LeaseRecord {
            lease_duration: Duration::from_secs(5),
            ..w.stored()
        };
        w.foreign_write(edited);
        // b polls and sees the edit; a sees it at its next renewal (a conflict, then a read).
        w.run(RETRY + Duration::from_millis(500));
        let term = w.leading(a).expect("a still leads").clone();
        let bound =
            renewed_at + Duration::from_secs(5).mul_f64(RENEW.as_secs_f64() / LEASE.as_secs_f64());
        let first_cut = *term
            .cuts
            .first()
            .expect("a's validity was cut when it saw the edit");
        assert!(
            first_cut <= bound,
            "a's validity was cut to {first_cut:?}, what followers of the edit wait for (at most {bound:?})"
        );
        // a's renewals write its own duration again.
        let last = w.writes.last().expect("a renewed");
        assert_eq!(last.holder_identity, "a");
        assert_eq!(
            last.lease_duration, LEASE,
            "a renewal writes the elector's own duration, not the edited one"
        );
        // Partition a right after a renewal: b takes over only after a's term has ended.
        w.run(RETRY);
        w.nodes[a].hold = Hold::All;
        w.run(LEASE * 2);
        assert!(w.leading(b).is_some(), "b took over");
        w.assert_safe();
    }
}

/// Review round two, schedule 2: a vacant record carrying `transitions = u64::MAX - 1` (the
/// codec accepts any u64). The first term gets `u64::MAX`; no later term may start with a token
/// that is not above it: the elector refuses and reports it (`Output::TokensExhausted`).
#[test]
fn r2_02_no_term_starts_with_a_token_that_is_not_above_the_last() {
    for commit_tokens in [false, true] {
        let mut w = World::new(commit_tokens);
        w.foreign_write(vacant(u64::MAX - 1));
        let a = w.start("a");
        w.run(Duration::from_secs(1));
        let first = w.leading(a).expect("a leads").token;
        assert_eq!(first, u64::MAX);
        let now = w.clock();
        w.nodes[a].m.as_mut().expect("running").handle_input(
            now,
            Input::Command(Command::Yield {
                id: 1,
                duration: LEASE * 10,
            }),
        );
        w.drain(a);
        let b = w.start("b");
        w.run(LEASE * 3);
        assert!(
            w.leading(b).is_none(),
            "b never leads with a repeated token"
        );
        assert!(
            w.nodes[b].exhausted.contains(&u64::MAX),
            "b reports that no higher token can be issued: {:?}",
            w.nodes[b].exhausted
        );
        assert_eq!(w.terms.len(), 1, "one term only: {:?}", w.terms);
        w.assert_safe();
    }
}

/// Review round two, schedule 9: a restore writes back an older copy of the leader's own record
/// (same holder, token and acquire time, an older renew time). The leader reads it back after
/// its renewal conflicts and keeps leading on it, instead of fighting it until its deadline.
#[test]
fn r2_09_a_restored_older_copy_of_the_leaders_record_keeps_it_leading() {
    for commit_tokens in [false, true] {
        let mut w = World::new(commit_tokens);
        w.foreign_write(vacant(0));
        let a = w.start("a");
        w.run(RETRY * 3);
        let term = w.leading(a).expect("a leads").clone();
        let older = w
            .writes
            .iter()
            .rev()
            .nth(1)
            .expect("a renewed at least once")
            .clone();
        assert!(older.renew_time < w.stored().renew_time);
        w.foreign_write(older);
        w.run(RENEW * 3);
        let now = w.leading(a).expect("a still leads after the restore");
        assert_eq!(now.token, term.token, "the same term");
        assert!(
            now.valid_until > w.now,
            "its renewals are confirmed again (valid until {:?} at {:?})",
            now.valid_until,
            w.now
        );
        assert_eq!(w.terms.len(), 1);
    }
}

/// Fencing-token review, seed 20186385 (release hunt of 3,000,000 schedules): n1's create is
/// held in the network; n1 crashes; n2 creates and leads; n2 crashes and, while its term is
/// still valid, the record is deleted; n1's create then commits; n0 waits that record out and
/// acquires. With fencing seeds n0 repeated n2's token; with tokens assigned at commit every
/// token is above every token committed before it.
#[test]
fn t_20186385_a_create_committing_after_a_delete_gets_a_higher_token() {
    let mut w = World::new(true);
    let n1 = w.start("n1");
    w.nodes[n1].hold = Hold::Writes;
    // A brand-new key: n1 waits a lease of absence, then sends its create, which is held.
    w.run(LEASE + RETRY * 3);
    let held = w.nodes[n1]
        .inflight
        .take()
        .expect("n1's acquire is in flight");
    assert!(
        matches!(held.op, Op::Acquire { expected: None, .. }),
        "{held:?}"
    );
    w.crash(n1);
    let n2 = w.start("n2");
    w.run(LEASE + RETRY * 3);
    let t2 = w.leading(n2).expect("n2 leads").token;
    w.crash(n2);
    // Data loss while n2's term is still valid.
    w.store.write(None);
    let late = match w.commit_held(held).expect("the held create commits") {
        Reply::Acquired(a) => a.fencing_token,
        other => panic!("{other:?}"),
    };
    assert!(
        late > t2,
        "the late create's token {late} is above n2's {t2}"
    );
    let n0 = w.start("n0");
    w.run(LEASE + RETRY * 3);
    let t0 = w.leading(n0).expect("n0 leads").token;
    assert!(
        t0 > late && t0 > t2,
        "n0's token {t0} after {late} and {t2}"
    );
}

/// Fencing-token review, seed 50749446 (release hunt of 1,000,000 schedules, the same class):
/// n0's create is delayed in the network; meanwhile n1 creates, leads, releases and leads again;
/// the record is deleted; n0's create then commits, and n0 crashes. A new elector waits that
/// record out and acquires it. With fencing seeds its token (n0's seed + 1) repeated n1's first
/// term's token; with tokens assigned at commit it is above every earlier one.
#[test]
fn t_50749446_a_delayed_create_never_lets_a_later_term_repeat_a_token() {
    let mut w = World::new(true);
    let n0 = w.start("n0");
    w.nodes[n0].hold = Hold::Writes;
    w.run(Duration::from_millis(100));
    let n1 = w.start("n1");
    w.run(LEASE + RETRY * 3);
    let held = w.nodes[n0]
        .inflight
        .take()
        .expect("n0's create is in flight");
    assert!(
        matches!(held.op, Op::Acquire { expected: None, .. }),
        "{held:?}"
    );
    let first = w.leading(n1).expect("n1 leads").token;
    let now = w.clock();
    w.nodes[n1].m.as_mut().expect("running").handle_input(
        now,
        Input::Command(Command::Yield {
            id: 1,
            duration: Duration::ZERO,
        }),
    );
    w.drain(n1);
    w.run(RETRY * 2);
    let second = w.leading(n1).expect("n1 leads again after its yield").token;
    assert!(second > first);
    w.crash(n1);
    w.store.write(None);
    let late = match w.commit_held(held).expect("the delayed create commits") {
        Reply::Acquired(a) => a.fencing_token,
        other => panic!("{other:?}"),
    };
    w.crash(n0);
    assert!(
        late > second,
        "the delayed create's token {late} is above {second}"
    );
    let n2 = w.start("n2");
    w.run(LEASE + RETRY * 3);
    let last = w.leading(n2).expect("n2 leads").token;
    assert!(last > late, "{last} after {late}");
    w.assert_safe();
}

/// Simulator seed 1044207 (found while adding foreign writers): a renewal lands but its reply is
/// lost; before the leader reads it back, another writer shortens the duration of that very
/// record to 0 s. The read-back shows the leader's own renewal (its renew time), edited: the
/// leader must confirm it *and* cut its validity, since followers take over at once.
#[test]
fn s_1044207_a_renewal_edited_to_a_shorter_duration_cuts_the_term() {
    for commit_tokens in [false, true] {
        let mut w = World::new(commit_tokens);
        w.foreign_write(vacant(0));
        let a = w.start("a");
        w.run(Duration::from_secs(1));
        assert!(w.leading(a).is_some());
        let b = w.start("b");
        w.run(Duration::from_secs(1));
        // The next renewal: it lands, the reply is lost.
        w.nodes[a].hold = Hold::All;
        w.run(RETRY);
        w.commit_and_fail(a);
        let edited = LeaseRecord {
            lease_duration: Duration::ZERO,
            ..w.stored()
        };
        w.foreign_write(edited);
        // a reads back (answered), then is partitioned; b polls, sees the edit, takes over.
        let read = w.nodes[a].inflight.as_ref().map(|r| r.op.clone());
        assert!(matches!(read, Some(Op::Get)), "a reads back: {read:?}");
        w.answer(a);
        let term = w.terms.last().expect("a's term").clone();
        assert!(
            term.ended.is_some() && term.end() <= w.now,
            "a's term ends as soon as it reads back the edited renewal: {term:?} at {:?}",
            w.now
        );
        w.run(LEASE * 2);
        assert!(w.leading(b).is_some(), "b took over");
        w.assert_safe();
    }
}
