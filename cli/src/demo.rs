//! `leasehold demo`: three candidates on the in-process memory store; a graceful handover and
//! a crash failover, printed as a timeline with the measured latencies.
//!
//! Each candidate runs its elector on its own current-thread runtime in its own thread, as a
//! separate process would. A crash is simulated with the public API only: the candidate's
//! runtime is shut down with `Runtime::shutdown_background()`, which drops its elector's task
//! without letting it run again, so the lease is not released and must expire.

use std::sync::Arc;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use leasehold::{Elector, ElectorConfig, LeaderStatus, LeaseKey, MemoryStore};

use crate::DemoArgs;
use crate::exit::{self, CliError};

pub(crate) const LONG_ABOUT: &str = "\
A live demo of leader election, on an in-process memory store (nothing to install).

Three candidates (alpha, bravo, charlie) campaign for one lease, each on its own thread and
runtime, as separate processes would:
  1. the first leader is elected (a brand-new lease is created only after it was seen absent
     for one lease duration: a missing record is not proof that nobody holds it);
  2. the leader shuts down gracefully: it releases the lease, and a follower takes over at once;
  3. the new leader crashes (its runtime is dropped mid-flight, nothing is released): the last
     candidate takes over once the lease expires, one lease duration after it last changed.
Each step is printed with its time and the measured latency; fencing tokens grow by one per
term. It takes a few seconds.

Example:
  leasehold demo
  leasehold demo --lease-duration 3s";

enum Cmd {
    Shutdown,
    Crash,
}

enum Event {
    Leading { token: u64 },
    Following { leader: Option<String> },
    Released,
}

struct Candidate {
    name: &'static str,
    cmd: mpsc::Sender<Cmd>,
    thread: thread::JoinHandle<()>,
}

fn start(
    name: &'static str,
    store: Arc<MemoryStore>,
    config: ElectorConfig,
    events: mpsc::Sender<(Instant, &'static str, Event)>,
) -> Result<Candidate, CliError> {
    let (cmd_tx, cmd_rx) = mpsc::channel::<Cmd>();
    let thread = thread::Builder::new()
        .name(format!("demo-{name}"))
        .spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            let elector = {
                let _guard = rt.enter();
                match Elector::spawn(store, config) {
                    Ok(e) => e,
                    Err(e) => {
                        eprintln!("demo: cannot start {name}: {e}");
                        return;
                    }
                }
            };
            // Commands arrive on a std channel: forward them into the runtime.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            thread::spawn(move || {
                while let Ok(c) = cmd_rx.recv() {
                    if tx.send(c).is_err() {
                        break;
                    }
                }
            });
            let crashed = rt.block_on(async {
                loop {
                    let (status, changed) = elector.current_status();
                    let ev = match &status {
                        LeaderStatus::Leading(l) => Event::Leading {
                            token: l.fencing_token(),
                        },
                        LeaderStatus::NotLeading { leader } => Event::Following {
                            leader: leader.clone(),
                        },
                        // Reported as `Released` by the shutdown below.
                        _ => return false,
                    };
                    let _ = events.send((Instant::now(), name, ev));
                    drop(status);
                    tokio::select! {
                        () = changed => {}
                        c = rx.recv() => match c {
                            Some(Cmd::Crash) => return true,
                            Some(Cmd::Shutdown) | None => {
                                let _ = elector.shutdown().await;
                                let _ = events.send((Instant::now(), name, Event::Released));
                                return false;
                            }
                        },
                    }
                }
            });
            if crashed {
                // The crash: the elector's task is dropped without running again; the lease
                // stays as it was and must expire.
                rt.shutdown_background();
                std::mem::forget(elector);
            }
        })
        .map_err(|e| CliError::new(exit::OSERR, format!("cannot start a demo thread: {e}")))?;
    Ok(Candidate {
        name,
        cmd: cmd_tx,
        thread,
    })
}

struct Timeline {
    start: Instant,
    events: mpsc::Receiver<(Instant, &'static str, Event)>,
}

impl Timeline {
    fn line(&self, at: Instant, who: &str, what: &str) {
        let ms = at.saturating_duration_since(self.start).as_millis();
        crate::exit::outln!("{:>7} ms  {who:<8} {what}", ms);
    }

    fn print(&self, at: Instant, who: &str, ev: &Event) {
        match ev {
            Event::Leading { token } => {
                self.line(at, who, &format!("LEADS  (fencing token {token})"));
            }
            Event::Following { leader: Some(l) } => self.line(at, who, &format!("follows {l}")),
            Event::Following { leader: None } => {
                self.line(at, who, "campaigning (no live leader known)");
            }
            Event::Released => self.line(at, who, "released the lease and stopped"),
        }
    }

    /// The next events, in the order they happened: the threads report concurrently, so what
    /// arrives within a few milliseconds of the first is sorted by its time stamp.
    fn batch(&self, deadline: Instant) -> Option<Vec<(Instant, &'static str, Event)>> {
        let first = self
            .events
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .ok()?;
        thread::sleep(Duration::from_millis(5));
        let mut batch = vec![first];
        batch.extend(self.events.try_iter());
        batch.sort_by_key(|(at, _, _)| *at);
        Some(batch)
    }

    /// Prints events until one candidate other than those in `except` leads; returns it.
    fn until_leader(
        &self,
        except: &[&str],
        limit: Duration,
    ) -> Result<(Instant, &'static str, u64), CliError> {
        let deadline = later(limit);
        loop {
            let batch = self.batch(deadline).ok_or_else(|| {
                CliError::new(exit::SOFTWARE, "demo: no new leader in time (a bug?)")
            })?;
            let mut found = None;
            for (at, who, ev) in &batch {
                self.print(*at, who, ev);
                if let Event::Leading { token } = ev
                    && !except.contains(who)
                    && found.is_none()
                {
                    found = Some((*at, *who, *token));
                }
            }
            if let Some(f) = found {
                return Ok(f);
            }
        }
    }

    /// Prints whatever arrives for `for_`.
    fn drain(&self, for_: Duration) {
        let deadline = later(for_);
        while let Some(batch) = self.batch(deadline) {
            for (at, who, ev) in &batch {
                self.print(*at, who, ev);
            }
        }
    }
}

/// `now + d`, or a day from now when that does not fit (never a panic).
fn later(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

pub(crate) fn demo(args: DemoArgs) -> Result<u8, CliError> {
    let lease = args.lease_duration.value;
    if lease < Duration::from_millis(300) || lease > Duration::from_secs(60) {
        return Err(CliError::usage(format!(
            "--lease-duration {} is out of range: the demo's lease duration must be between \
             300ms and 60s (default 1s)",
            args.lease_duration.text
        )));
    }
    let renew = lease.mul_f64(0.7);
    let retry = lease / 5;
    let key = LeaseKey::new("demo-lease").map_err(|e| CliError::usage(e.to_string()))?;
    let store = Arc::new(MemoryStore::new());
    let (tx, rx) = mpsc::channel();
    crate::exit::outln!(
        "leasehold demo: three candidates, one lease {key:?} on the in-process memory store\n\
         timings: lease {}, renew deadline {}, retry period {}\n",
        ms(lease),
        ms(renew),
        ms(retry)
    );
    let tl = Timeline {
        start: Instant::now(),
        events: rx,
    };
    let mut candidates = Vec::new();
    for name in ["alpha", "bravo", "charlie"] {
        let config = ElectorConfig::new(key.clone(), name)
            .with_timings(lease, renew, retry)
            .with_drain_timeout(lease);
        candidates.push(start(name, store.clone(), config, tx.clone())?);
    }
    drop(tx);
    let limit = lease
        .saturating_mul(10)
        .saturating_add(Duration::from_secs(5));

    crate::exit::outln!("-- 1. election");
    let (t1, first, _) = tl.until_leader(&[], limit)?;
    crate::exit::outln!(
        "         first leader after {} (a new lease waits one lease duration of absence)\n",
        ms(t1.saturating_duration_since(tl.start))
    );
    tl.drain(lease / 2);

    crate::exit::outln!("-- 2. graceful handover: {first} shuts down");
    let asked = Instant::now();
    tl.line(asked, first, "shutting down (ordered release)");
    send(&candidates, first, Cmd::Shutdown);
    let (t2, second, _) = tl.until_leader(&[first], limit)?;
    let handover = t2.saturating_duration_since(asked);
    crate::exit::outln!("         handover latency: {}\n", ms(handover));
    tl.drain(lease / 2);

    crate::exit::outln!("-- 3. crash failover: {second} crashes (nothing released)");
    let crashed = Instant::now();
    tl.line(crashed, second, "CRASHED");
    send(&candidates, second, Cmd::Crash);
    let (t3, third, _) = tl.until_leader(&[first, second], limit)?;
    let failover = t3.saturating_duration_since(crashed);
    crate::exit::outln!(
        "         failover latency: {} (bounded by the lease duration, {}, after the last renewal)\n",
        ms(failover),
        ms(lease)
    );

    crate::exit::outln!("-- 4. {third} shuts down");
    send(&candidates, third, Cmd::Shutdown);
    tl.drain(Duration::from_millis(200));
    for c in candidates {
        drop(c.cmd);
        let _ = c.thread.join();
    }
    tl.drain(Duration::from_millis(10));
    crate::exit::outln!(
        "\nsummary: graceful handover {}, crash failover {} (lease {})",
        ms(handover),
        ms(failover),
        ms(lease)
    );
    Ok(0)
}

fn send(candidates: &[Candidate], name: &str, cmd: Cmd) {
    if let Some(c) = candidates.iter().find(|c| c.name == name) {
        let _ = c.cmd.send(cmd);
    }
}
