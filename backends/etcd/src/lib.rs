//! leasehold-etcd: a [`LeaseStore`](leasehold::LeaseStore) on etcd v3, for etcd-only clusters
//! and anyone who wants the strongest guarantees.
//!
//! ```no_run
//! # async fn demo() -> leasehold::Result<()> {
//! use std::sync::Arc;
//! use leasehold::{DynLeaseStore, LeaseKey, LeaseStore};
//! use leasehold_etcd::{EtcdConfig, EtcdStore};
//!
//! let config = EtcdConfig::new(["http://127.0.0.1:2379"]).with_prefix("/my-app/leases/");
//! let store: DynLeaseStore = Arc::new(EtcdStore::connect(config).await?);
//! let current = store.get(&LeaseKey::new("controller")?).await?;
//! # let _ = current; Ok(()) }
//! ```
//!
//! A complete program with two candidates and a leader task is the `etcd` example
//! (`cargo run -p leasehold-etcd --example etcd`, against `http://127.0.0.1:2379` or the
//! comma-separated `LEASEHOLD_ETCD_ENDPOINTS`).
//!
//! # How records are kept
//!
//! - A lease `key` is the etcd key `<prefix><key>` (default prefix `/leasehold/`; a prefix
//!   always ends with `/`, see [`EtcdConfig::with_prefix`]); the value is the JSON record of
//!   [`leasehold::codec`] (client-go's `LeaderElectionRecord`).
//! - The [`Version`](leasehold::Version) is the key's `mod_revision`.
//! - `create` is a transaction comparing `create_revision == 0`; `update` and `delete` compare
//!   `mod_revision == expected` and, when the compare fails, read the key in the same
//!   transaction to tell `Conflict` from `NotFound` in one round trip.
//! - `watch` uses etcd's watch from the revision after the one the caller saw, and resumes
//!   after compaction, member restarts and broken streams (see [Watch](#watch)).
//! - `acquire` is the `create` or `update` transaction with the record of
//!   [`codec::encode_acquisition`](leasehold::codec::encode_acquisition); its fencing token is
//!   resolved from the write's `mod_revision` (see [Fencing](#fencing)).
//! - `list` is one range read over `<prefix><key prefix>`; keys with data that is not a record
//!   are left out and logged.
//! - Data under a key that is not a record is [`leasehold::Error::Corrupt`] with the data's
//!   `mod_revision`, so the elector can replace it by compare-and-swap.
//!
//! # Watch
//!
//! `watch(key, Some(v))` watches from revision `v + 1`; `watch(key, None)` reads the key at
//! revision `R` (delivering it as the first event) and watches from `R + 1`; so a `get` followed
//! by a watch loses nothing. A background task forwards etcd's events and ends when the stream
//! is dropped. When etcd reports that the next revision was compacted, the task re-reads the
//! key and delivers its latest state if it differs from the last one delivered (coalescing the
//! compacted changes), then watches from the re-read's revision. When the stream breaks (member
//! restart, lost leader, connection reset) it resumes from the next undelivered revision on any
//! reachable member. Nothing at or below the last delivered revision is delivered again, so an
//! older state never follows a newer one. A failed resumption is delivered as a retryable `Err`
//! item (and retried with backoff); a permission or certificate error ends the stream. Reopening
//! backs off with jitter (50 ms doubling to 2 s) while new streams keep failing or ending at
//! once without delivering anything; events pass through a bounded buffer.
//!
//! # Fencing
//!
//! The fencing token leasehold hands to leader tasks (the record's `transitions`) is assigned
//! by etcd **at commit** ([`LeaseStore::acquire`](leasehold::LeaseStore::acquire)): it is the
//! `mod_revision` of the acquiring write, or the caller's floor (one above the token of the
//! record it replaces) when that is higher. The revision only grows, also across deletes, so
//! tokens strictly increase across terms, after a delete and re-create, and for a write that
//! commits late. The record keeps the floor with the marker of
//! [`codec::encode_acquisition`](leasehold::codec::encode_acquisition), and every read resolves
//! the token against the key's `mod_revision`. A floor above the revision is not remembered
//! once the record is deleted; a cluster restored from an older backup goes back in revision.
//!
//! etcd's revision is also a second, global token, as `etcdctl lock` does with
//! `ETCD_LOCK_REV`: the version returned by `create`/`update` is the write's `mod_revision`
//! ([`revision`] parses it), and [`EtcdStore::acquisition_revision`] gives the revision of the
//! write that acquired a term (the fencing token itself, unless a floor raised it).
//!
//! [`LeaseStore::fencing_seed`](leasehold::LeaseStore::fencing_seed) (for an elector that
//! cannot use `acquire`) is the cluster revision plus one, read from a linearizable read's
//! response header: it never goes backwards and exceeds every revision written before.
//!
//! # Failures and timeouts
//!
//! [`EtcdStore::connect`] reads the key prefix once (a bounded, count-only range read), so an
//! unreachable endpoint, wrong credentials or a missing permission fail there, naming the
//! endpoints, instead of leaving an elector without a leader.
//!
//! Every operation is bounded by the operation timeout ([`leasehold::Error::Timeout`]), which
//! the store reports in its [`Capabilities`](leasehold::Capabilities).
//! Connection failures, "no leader" and "leader changed" are
//! [`leasehold::Error::Unavailable`] (retryable), and their messages name the endpoints. Wrong credentials are
//! [`leasehold::Error::Unauthenticated`], missing permissions
//! [`leasehold::Error::PermissionDenied`], each with a hint on what to fix. A server
//! certificate that does not verify is a non-retryable [`leasehold::Error::Store`] naming the
//! setting to fix (retrying cannot help). The client uses
//! etcd's "require leader" mode, so a member that lost quorum fails requests and watches
//! instead of serving stale data, and HTTP/2 keep-alive pings, so a hung member is noticed.
//!
//! # Security
//!
//! TLS with a custom CA and client certificates ([`EtcdConfig::with_tls_ca_pem`],
//! [`EtcdConfig::with_tls_client_identity_pem`], or a [`TlsConfig`]) and etcd's user/password
//! authentication ([`EtcdConfig::with_user`]). Passwords and private keys never appear in
//! `Debug` output, errors or logs.
//!
//! # Building
//!
//! `etcd-client` compiles etcd's protobuf definitions at build time and needs `protoc`
//! (Debian/Ubuntu: `apt-get install protobuf-compiler`).
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod error;
mod store;
mod watch;

pub use config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEEP_ALIVE, DEFAULT_OPERATION_TIMEOUT, DEFAULT_PREFIX,
    EtcdConfig, TlsConfig,
};
pub use error::Error;
pub use etcd_client;
pub use store::{EtcdStore, revision};

/// The store's name in errors and logs.
pub(crate) const STORE: &str = "etcd";

/// The README's code blocks, compiled as doctests (not part of the API).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
