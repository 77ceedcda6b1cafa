//! A [`LeaseStore`](leasehold::LeaseStore) on Redis for leasehold.
//!
//! ```no_run
//! # async fn demo() -> Result<(), leasehold_redis::Error> {
//! use leasehold_redis::{RedisConfig, RedisStore};
//! let config = RedisConfig::new("rediss://app:secret@redis.example:6380/0")?
//!     .with_prefix("myapp:");
//! let store = RedisStore::connect(config).await?;
//! # let _ = store; Ok(()) }
//! ```
//!
//! A complete program with two candidates and a leader task is the `redis` example
//! (`cargo run -p leasehold-redis --example redis`, against `redis://127.0.0.1:6379` or
//! `LEASEHOLD_REDIS_URL`).
//!
//! # Correctness class: read this before you use it
//!
//! **On a single Redis primary** every write is a compare-and-swap executed atomically by a Lua
//! script, so the elector's guarantees hold: at most one leader at a time (given the elector's
//! clock assumptions) and a fencing token that only grows.
//!
//! **With replication and failover, or a restart without persistence, they do not.** Redis
//! acknowledges a write before it reaches a replica (replication is asynchronous) and, by
//! default, before it reaches the disk. If the primary fails and a replica that had not yet
//! received the last acquisition is promoted (Cluster, a managed service's failover, or a
//! replica promoted by hand or by Sentinel in front of a proxy),
//! or the server restarts from an older snapshot or from nothing, an acknowledged write is
//! lost: a second candidate can acquire a lease the first still believes it holds, so **two
//! leaders are possible**. Fencing tokens still grow across such a loss only because they are
//! never below the server clock in microseconds (see [Data layout](#data-layout)): they go
//! backwards when the clock went back or a token had been raised above the clock. This is the
//! core of Martin
//! Kleppmann's critique of Redlock ("How to do distributed locking", 2016), and it applies to
//! every Redis lock or lease, this one included.
//!
//! Settings that make the window smaller, without closing it:
//! - `appendonly yes` with `appendfsync always`: every write is on disk before the reply, so a
//!   restart of the same server loses nothing (at a cost in write latency);
//! - `min-replicas-to-write 1` with `min-replicas-max-lag`: the primary refuses writes when no
//!   replica is close behind, so fewer acknowledged writes exist only on the primary (the
//!   replication is still asynchronous: a failover can still lose the last writes);
//! - `WAIT` is not used by this store and would not make failover safe either.
//!
//! For correctness-critical work (where two leaders would corrupt data even briefly), use a
//! consensus store: etcd (`leasehold-etcd`) or Kubernetes Leases (`leasehold-kube`). Redis is a
//! good fit for development setups and for services that already run Redis and can tolerate a
//! rare double leader after a failover, or that fence their side effects with the token.
//!
//! # Data layout
//!
//! Every key of a namespace (prefix `P`, default `leasehold:`) starts with the Redis Cluster hash
//! tag `{P}`, so all of them live in one slot and every script touches keys of one slot only:
//! the record of lease key `k` is the hash `{P}rec:k` with fields `v` (the version) and `d` (the
//! record as client-go `LeaderElectionRecord` JSON, see [`leasehold::codec`]); the sorted set
//! `{P}index` names every lease key; the string `{P}rev` is the namespace revision counter; the
//! string `{P}tok:k` is the last fencing token assigned for `k`. See the [`scripts`] module.
//!
//! **Versions** are the namespace counter at the time of the write (like etcd's revisions): they
//! never repeat, also not across a delete and re-create, which lets a watch drop stale messages by
//! comparing numbers. Every write sets the counter to at least the server clock in microseconds
//! and above its previous value, so versions keep growing after the counter went back (a restore
//! from an older snapshot, a failover to a lagging replica, a restart without persistence). The
//! scripts count with exact decimal strings (Lua numbers are doubles, which stop counting at
//! 2^53); a counter that is not a decimal integer up to `u64::MAX`, or a version that would
//! exceed it, is refused with a non-retryable [`leasehold::Error::Store`] that names the key and
//! what to do, and nothing is written.
//!
//! **Fencing tokens** are assigned at commit
//! ([`LeaseStore::acquire`](leasehold::LeaseStore::acquire)) by one script: the largest of the
//! write's new version, one above the last token assigned for the key (kept in
//! `{P}tok:<lease key>`, which a delete of the record leaves in place) and the caller's floor.
//! The record is stored with that token as `leaderTransitions`. So tokens strictly increase
//! across terms and across delete and re-create, and are never below the server clock in
//! microseconds; after `FLUSHALL` or a restart without persistence they still start above the
//! earlier tokens that came from versions (not above a token a floor had raised beyond the
//! clock, and not when the clock went back). When no higher token fits in a u64, the script
//! writes nothing and the store answers [`leasehold::Error::TokenExhausted`]. The
//! [fencing seed](leasehold::LeaseStore::fencing_seed), for an elector that cannot use
//! `acquire`, is one above the largest of the counter, the key's last token and the server
//! clock.
//!
//! **Compare-and-swap** runs as Lua scripts, invoked by SHA (`EVALSHA`) and loaded again when the
//! server answers `NOSCRIPT` (after a restart or `SCRIPT FLUSH`). A script compares the stored
//! version with the expected one and writes, indexes and publishes in one atomic step.
//!
//! **List** reads the index with `ZRANGEBYLEX` (only the names under the prefix: cost grows with
//! the matching keys, not with the size of the database) and then the records by script. It
//! never uses `KEYS` (which blocks the server while it walks every key) nor `SCAN` (whose cost
//! grows with every unrelated key in the database). The index is kept by the same scripts that
//! write, so it is exact.
//!
//! **Watch** needs no server configuration (no keyspace notifications, which
//! `notify-keyspace-events` must enable and many managed services forbid): the write scripts
//! `PUBLISH` the new version and record on `{P}chan:k`. See the [`watch`] module for how it
//! re-reads after subscribing and after reconnecting, and how it drops stale messages.
//!
//! **Corrupt data.** Data under a record key that is not ours (another Redis type, a hash without
//! our fields, a truncated or invalid JSON record) is reported as
//! [`leasehold::Error::Corrupt`] naming the key, and never panics. Its version is our counter
//! when the hash carries a valid one, otherwise `x` + the SHA-1 of the key's `DUMP`
//! serialisation: it stays equal while the data is unchanged and changes when the data changes.
//! [`update`](leasehold::LeaseStore::update) with that version replaces the data by
//! compare-and-swap (what the elector does once it stayed unchanged for a lease duration); data
//! that changed in between fails with `Conflict`.
//!
//! # Failures and timeouts
//!
//! Every operation is bounded by the operation timeout (default 2 s, reported in the store's
//! [`Capabilities`](leasehold::Capabilities)) and fails with
//! [`leasehold::Error::Timeout`] after it; connection failures are
//! [`leasehold::Error::Unavailable`]. Both are retryable. A connection that reports an error is
//! repaired in the background by redis-rs's `ConnectionManager`; one on which
//! [`REBUILD_AFTER_TIMEOUTS`] operations in a row time out (a peer that stopped answering without
//! closing) is replaced by a new one. Every connection sets `TCP_NODELAY`, TCP keepalive and
//! `TCP_USER_TIMEOUT`. Rejected credentials are
//! [`leasehold::Error::Unauthenticated`], missing ACL permissions
//! [`leasehold::Error::PermissionDenied`], a certificate that does not verify (or a client
//! certificate the server rejects) a non-retryable [`leasehold::Error::Store`] that says it is a
//! TLS problem and what to fix.
//!
//! # Topologies
//!
//! - **One standalone primary** (optionally with replicas, see above for failover).
//! - **Redis Cluster**, with [`RedisConfig::with_cluster`] (and more seed nodes with
//!   [`RedisConfig::with_cluster_seed`]): redis-rs's async cluster client routes every script to the
//!   node owning the namespace's slot and follows `MOVED`/`ASK` (slot migrations, failovers).
//!   Watches subscribe on any seed node (cluster pub/sub reaches every node) and move to the next
//!   seed when theirs fails. A cluster failover is asynchronous: the caveats above apply. Without
//!   `with_cluster()`, `connect` refuses a server in cluster mode with an error saying what to set.
//! - **Sentinel is not supported** (the store does not ask Sentinel for the current primary); a
//!   proxy or DNS name that follows the primary works, with the failover caveats above.
//!
//! # Security
//!
//! `rediss://` URLs use TLS (rustls with the ring provider; the system roots or a CA given with
//! [`RedisConfig::with_tls_ca_pem`], optionally a client certificate); a `#insecure` URL
//! fragment is refused ([`Error::InsecureTls`]). A user name in the URL selects an ACL user;
//! [`RedisConfig::acl_rules`] gives the least-privilege rules ([`ACL_COMMANDS`] and the prefix's
//! key and channel patterns). At connect the store warns when `maxmemory-policy` is an
//! `allkeys-*` policy, which can evict lease keys. Passwords are redacted in every `Debug` output, error and log line.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod error;
pub mod scripts;
mod store;
pub mod watch;

pub use config::{
    ACL_COMMANDS, DEFAULT_CONNECT_TIMEOUT, DEFAULT_OPERATION_TIMEOUT, DEFAULT_PREFIX,
    DEFAULT_WATCH_PING_INTERVAL, RedisConfig,
};
pub use error::Error;
pub use store::{REBUILD_AFTER_TIMEOUTS, RedisStore};

/// The store's name in errors and logs.
pub const STORE: &str = "redis";

/// The README's code blocks, compiled as doctests (not part of the API).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
