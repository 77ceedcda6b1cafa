//! The lease store contract: [`LeaseStore`], [`LeaseRecord`], [`LeaseKey`] and [`Version`].
//!
//! A store keeps one [`LeaseRecord`] per [`LeaseKey`] and changes it only by compare-and-swap.
//! It has no notion of time: expiry, renewal and step-down are the
//! [`Elector`](crate::Elector)'s business, never a store's.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::stream::BoxStream;

use crate::error::{Error, Result};

/// The longest key accepted: the Kubernetes object-name limit.
pub const MAX_KEY_LEN: usize = 253;

/// A validated lease key.
///
/// One rule set holds on every store, the strictest one (Kubernetes object names, a lower-case
/// RFC 1123 subdomain):
/// - 1 to 253 characters;
/// - only `a`–`z`, `0`–`9`, `-` and `.`;
/// - starts and ends with a letter or digit;
/// - every `.`-separated label is non-empty and starts and ends with a letter or digit.
///
/// ```
/// use leasehold::LeaseKey;
/// assert!(LeaseKey::new("k0s-ctrl-node-1").is_ok());
/// assert!(LeaseKey::new("Upper").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseKey(Arc<str>);

// === impl LeaseKey ===

impl LeaseKey {
    /// Validates `key` against the key rules.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] naming the rule that was broken.
    pub fn new(key: impl AsRef<str>) -> Result<Self> {
        let key = key.as_ref();
        validate_key(key)?;
        Ok(LeaseKey(Arc::from(key)))
    }

    /// The key as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the key starts with `prefix`.
    pub fn has_prefix(&self, prefix: &KeyPrefix) -> bool {
        self.0.starts_with(prefix.as_str())
    }
}

fn invalid(key: &str, rule: &'static str) -> Error {
    Error::InvalidKey {
        key: key.to_owned(),
        rule,
    }
}

fn validate_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(invalid(key, "a key must not be empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(invalid(key, "a key must be at most 253 characters long"));
    }
    validate_chars(key)?;
    for label in key.split('.') {
        let (Some(first), Some(last)) = (label.chars().next(), label.chars().last()) else {
            return Err(invalid(
                key,
                "a key must not start or end with '.' nor contain '..'",
            ));
        };
        if !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() {
            return Err(invalid(
                key,
                "each '.'-separated part of a key must start and end with a lower-case letter or digit",
            ));
        }
    }
    Ok(())
}

fn validate_chars(key: &str) -> Result<()> {
    if key
        .chars()
        .any(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.'))
    {
        return Err(invalid(
            key,
            "a key may only contain lower-case letters a-z, digits 0-9, '-' and '.' (an RFC 1123 subdomain)",
        ));
    }
    Ok(())
}

impl fmt::Debug for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for LeaseKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for LeaseKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl TryFrom<&str> for LeaseKey {
    type Error = Error;
    fn try_from(value: &str) -> Result<Self> {
        LeaseKey::new(value)
    }
}

impl TryFrom<String> for LeaseKey {
    type Error = Error;
    fn try_from(value: String) -> Result<Self> {
        LeaseKey::new(value)
    }
}

/// A validated key prefix for [`LeaseStore::list`]: the start of a valid key (may be empty, may
/// end with `-` or `.`), for example `k0s-ctrl-`.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct KeyPrefix(Arc<str>);

// === impl KeyPrefix ===

impl KeyPrefix {
    /// Validates `prefix`: at most 253 characters from the key alphabet, not starting with `-`
    /// or `.`.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] naming the rule that was broken.
    pub fn new(prefix: impl AsRef<str>) -> Result<Self> {
        let prefix = prefix.as_ref();
        if prefix.len() > MAX_KEY_LEN {
            return Err(invalid(
                prefix,
                "a prefix must be at most 253 characters long",
            ));
        }
        validate_chars(prefix)?;
        if prefix.starts_with(['-', '.']) {
            return Err(invalid(
                prefix,
                "a prefix must start with a lower-case letter or digit",
            ));
        }
        if prefix.contains("..") {
            return Err(invalid(prefix, "a prefix must not contain '..'"));
        }
        Ok(KeyPrefix(Arc::from(prefix)))
    }

    /// The prefix as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for KeyPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The version of a stored record, as the store reports it: opaque, compared only for equality.
///
/// Redis uses a per-key counter, etcd the key's `mod_revision`, Kubernetes the object's
/// `resourceVersion`. The elector never orders versions; it only hands them back to
/// [`LeaseStore::update`] for compare-and-swap.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Version(Arc<str>);

// === impl Version ===

impl Version {
    /// Wraps a store's version string.
    pub fn new(v: impl Into<Arc<str>>) -> Self {
        Version(v.into())
    }

    /// The version as the store wrote it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<u64> for Version {
    fn from(v: u64) -> Self {
        Version(Arc::from(v.to_string()))
    }
}

impl From<i64> for Version {
    fn from(v: i64) -> Self {
        Version(Arc::from(v.to_string()))
    }
}

impl fmt::Debug for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A lease record: client-go's `LeaderElectionRecord`, which maps 1:1 onto the spec of a
/// `coordination.k8s.io/v1` Lease.
///
/// Stores keep every field; times at least to the microsecond, `lease_duration` at least to the
/// whole second (a store may round a fractional duration **up** to whole seconds, which only makes
/// followers wait longer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    /// Who holds the lease; empty means vacant (as client-go's release writes it).
    pub holder_identity: String,
    /// How long the lease lasts after its last change, as seen by each observer's own clock.
    pub lease_duration: Duration,
    /// When the current holder acquired it (informational; wall clock of the writer).
    pub acquire_time: Option<SystemTime>,
    /// When the current holder last renewed it (informational; wall clock of the writer).
    pub renew_time: Option<SystemTime>,
    /// The number of acquisitions since the record was created: the **fencing token**. It grows by
    /// one on every acquisition and never decreases while the store keeps the record.
    pub transitions: u64,
}

// === impl LeaseRecord ===

impl LeaseRecord {
    /// Whether the record names no holder.
    pub fn is_vacant(&self) -> bool {
        self.holder_identity.is_empty()
    }
}

/// A record together with the version it is stored at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versioned {
    /// The record.
    pub record: LeaseRecord,
    /// Its version.
    pub version: Version,
}

/// One change to a watched key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WatchEvent {
    /// The key was created or updated and now holds this record at this version.
    Put(Versioned),
    /// The key was deleted.
    Deleted,
    /// The key holds data that is not a lease record (see [`Error::Corrupt`]); carries the
    /// version of that data when the store knows it.
    Corrupt {
        /// Why it is not a record.
        reason: String,
        /// The data's version, if known.
        version: Option<Version>,
    },
}

/// The stream returned by [`LeaseStore::watch`].
pub type WatchStream = BoxStream<'static, Result<WatchEvent>>;

/// The answer to [`LeaseStore::acquire`]: the new version, and the fencing token the store
/// assigned at commit (the stored record's `transitions`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acquired {
    /// The version of the write.
    pub version: Version,
    /// The fencing token the store wrote into the record at commit.
    pub fencing_token: u64,
}

/// What a store can do beyond the required operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// [`LeaseStore::watch`] is supported. Without it the elector polls every retry period.
    pub watch: bool,
    /// [`LeaseStore::acquire`] is supported: the store assigns fencing tokens at commit. Without
    /// it the elector computes a token from [`LeaseStore::fencing_seed`] before the write (see
    /// there for what that cannot cover).
    pub commit_tokens: bool,
    /// The longest one operation of this store may take before it fails with
    /// [`Error::Timeout`], when the store bounds its operations. [`Elector::spawn`] rejects a
    /// configuration whose `renew_deadline` is not longer than this: a leader could then never
    /// learn the outcome of a renewal in time.
    ///
    /// [`Elector::spawn`]: crate::Elector::spawn
    pub operation_timeout: Option<Duration>,
}

// === impl Capabilities ===

impl Capabilities {
    /// A store that can watch.
    pub const WATCH: Capabilities = Capabilities {
        watch: true,
        commit_tokens: false,
        operation_timeout: None,
    };
    /// A store that cannot watch (the elector polls).
    pub const POLL: Capabilities = Capabilities {
        watch: false,
        commit_tokens: false,
        operation_timeout: None,
    };

    /// These capabilities with [`LeaseStore::acquire`] (fencing tokens assigned at commit).
    pub const fn with_commit_tokens(mut self) -> Self {
        self.commit_tokens = true;
        self
    }

    /// These capabilities with operations bounded by `timeout`.
    pub const fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = Some(timeout);
        self
    }
}

/// A lease store: the contract between store implementations and the elector.
///
/// It is the minimum an elector needs: read, create, compare-and-swap, delete, watch, list.
/// All timing lives in the elector; a store never expires anything.
///
/// # Contract
///
/// - **Keys** arrive validated ([`LeaseKey`]). A store may map them to its own namespace (a key
///   prefix, a Kubernetes namespace) but must keep distinct keys distinct.
/// - **`get`** returns the record and its version, or `None` when the key does not exist.
///   Data under the key that is not a record is [`Error::Corrupt`], never a panic.
/// - **`create`** stores a record under a new key and returns its version;
///   [`Error::AlreadyExists`] when the key exists (also when it holds corrupt data).
/// - **`update`** replaces the record only if the stored version equals `expected` (atomic
///   compare-and-swap) and returns the new version; otherwise [`Error::Conflict`], or
///   [`Error::NotFound`] when the key does not exist. This is the only way the elector changes a
///   record. A store may replace corrupt data this way when `expected` is its version.
/// - **`delete`** removes the key only if its version equals `expected` (same errors as
///   `update`). Used for administration and test cleanup.
/// - **`watch`** returns a stream of changes to one key, in the order they happened. With
///   `after = Some(v)` the stream delivers every change made after version `v` and nothing at or
///   before `v`, so that `get` followed by `watch(key, Some(version))` loses nothing. With
///   `after = None` it starts with the current state (a `Put`, or nothing if the key does not
///   exist) followed by every later change. A store that cannot see every intermediate change may
///   coalesce changes it missed into the latest state, but must never deliver an older state
///   after a newer one. A transient failure is delivered as an `Err` item; the stream may end
///   after it, and the caller then re-reads and watches again. Stores that cannot watch declare
///   `watch: false` in [`capabilities`](LeaseStore::capabilities) and return
///   [`Error::Unsupported`].
/// - **`acquire`** (optional, [`Capabilities::commit_tokens`]) writes an acquisition: like
///   `create` when `expected` is `None` and like `update` otherwise (same errors), except that
///   the store replaces the record's `transitions` **at commit** by a fencing token from its own
///   source that only grows: strictly greater than every token it assigned for the key before,
///   also across deletion or loss of the record as far as the source survives (see the README's
///   store table), and at least the record's `transitions` (the caller's floor: the elector
///   passes one above the token of the record it replaces, which the compare-and-swap pins).
///   Readers see the assigned token as the record's `transitions`.
///   A write that commits late therefore still commits with a token above every token committed
///   before it. When no higher token can be represented it fails with
///   [`Error::TokenExhausted`] and writes nothing.
/// - **`list`** returns every key under a prefix with its record and version, sorted by key.
///   Keys holding corrupt data are left out (and logged).
/// - Every operation is bounded in time: a store must return [`Error::Timeout`] or
///   [`Error::Unavailable`] rather than hang. Transient failures are `is_retryable()`.
/// - Credentials never appear in `Debug` output, errors or logs.
///
/// The shared conformance suite (feature `conformance`) checks all of this; every store passes it.
///
/// # Examples
///
/// Using a store directly (an elector does this for you), here the memory store:
///
/// ```
/// use std::time::Duration;
/// use leasehold::{Error, LeaseKey, LeaseRecord, LeaseStore, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> leasehold::Result<()> {
/// let store = MemoryStore::new();
/// let key = LeaseKey::new("direct")?;
/// let record = LeaseRecord {
///     holder_identity: "a".into(),
///     lease_duration: Duration::from_secs(15),
///     acquire_time: None,
///     renew_time: None,
///     transitions: 0,
/// };
/// let v1 = store.create(&key, &record).await?;
/// let v2 = store.update(&key, &record, &v1).await?; // compare-and-swap on v1
/// // A stale version is refused: someone else wrote first.
/// assert!(matches!(store.update(&key, &record, &v1).await, Err(Error::Conflict { .. })));
/// // With commit tokens, an acquisition gets its fencing token from the store at commit.
/// if store.capabilities().commit_tokens {
///     let acquired = store.acquire(&key, &record, Some(&v2)).await?;
///     assert!(acquired.fencing_token > 0);
/// }
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// Every method is cancel safe in the sense that dropping its future never leaves a partial
/// write: a write either happened atomically or not at all (the caller cannot tell which, exactly
/// as with a timeout, and resolves it by reading again).
#[async_trait]
pub trait LeaseStore: fmt::Debug + Send + Sync + 'static {
    /// A short name for errors and logs, such as `"memory"` or `"redis"`.
    fn name(&self) -> &'static str;

    /// What this store supports.
    fn capabilities(&self) -> Capabilities;

    /// Reads the record under `key`; `None` when the key does not exist.
    async fn get(&self, key: &LeaseKey) -> Result<Option<Versioned>>;

    /// Creates `key` with `record`; [`Error::AlreadyExists`] when the key exists.
    async fn create(&self, key: &LeaseKey, record: &LeaseRecord) -> Result<Version>;

    /// Replaces the record under `key` if its version is `expected` (compare-and-swap).
    async fn update(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: &Version,
    ) -> Result<Version>;

    /// Deletes `key` if its version is `expected`.
    async fn delete(&self, key: &LeaseKey, expected: &Version) -> Result<()>;

    /// Watches `key` for changes after version `after` (see the contract above).
    async fn watch(&self, key: &LeaseKey, after: Option<&Version>) -> Result<WatchStream>;

    /// Lists every key under `prefix` with its record and version, sorted by key.
    async fn list(&self, prefix: &KeyPrefix) -> Result<Vec<(LeaseKey, Versioned)>>;

    /// Writes an acquisition with a fencing token assigned at commit (see the contract above):
    /// a create when `expected` is `None`, a compare-and-swap on `expected` otherwise. The
    /// record's `transitions` is the lowest token acceptable; the stored record carries the
    /// assigned token. Stores that keep opaque values can use
    /// [`codec::encode_acquisition`](crate::codec::encode_acquisition), which takes the token
    /// from the write's version.
    ///
    /// The default returns [`Error::Unsupported`]; a store that implements it declares
    /// [`Capabilities::commit_tokens`].
    async fn acquire(
        &self,
        key: &LeaseKey,
        record: &LeaseRecord,
        expected: Option<&Version>,
    ) -> Result<Acquired> {
        let _ = (key, record, expected);
        Err(Error::Unsupported {
            store: self.name(),
            operation: "acquire",
        })
    }

    /// A fencing-token seed for a record about to be **created** under `key` (a fresh key, or
    /// corrupt data about to be replaced): a value from a store-side source that never goes
    /// backwards and grows by at least one with every write the store accepts for `key`.
    ///
    /// The elector starts a fresh record's `transitions` (the fencing token) at this value, and
    /// adds one per acquisition after that, so a token is never issued twice for a key even when
    /// its record is deleted, evicted or lost (see the per-store table in the README for what each
    /// store's source survives). Sources: the memory store's revision counter, etcd's cluster
    /// revision, Redis's version counter (never below the server clock in µs), and for
    /// Kubernetes a wall-clock value (the API offers no monotonic source).
    ///
    /// The default returns [`Error::Unsupported`]; the elector then starts a fresh record one
    /// above the highest token it has seen itself (0 when it has seen none), and logs a warning
    /// once: tokens can then repeat after the record is lost.
    async fn fencing_seed(&self, key: &LeaseKey) -> Result<u64> {
        let _ = key;
        Err(Error::Unsupported {
            store: self.name(),
            operation: "fencing_seed",
        })
    }
}

/// A shared, type-erased store: what electors and counters hold.
pub type DynLeaseStore = Arc<dyn LeaseStore>;

macro_rules! forward_store {
    ($ty:ty) => {
        #[async_trait]
        impl<T: LeaseStore + ?Sized> LeaseStore for $ty {
            fn name(&self) -> &'static str {
                (**self).name()
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
            async fn get(&self, key: &LeaseKey) -> Result<Option<Versioned>> {
                (**self).get(key).await
            }
            async fn create(&self, key: &LeaseKey, record: &LeaseRecord) -> Result<Version> {
                (**self).create(key, record).await
            }
            async fn update(
                &self,
                key: &LeaseKey,
                record: &LeaseRecord,
                expected: &Version,
            ) -> Result<Version> {
                (**self).update(key, record, expected).await
            }
            async fn delete(&self, key: &LeaseKey, expected: &Version) -> Result<()> {
                (**self).delete(key, expected).await
            }
            async fn watch(&self, key: &LeaseKey, after: Option<&Version>) -> Result<WatchStream> {
                (**self).watch(key, after).await
            }
            async fn list(&self, prefix: &KeyPrefix) -> Result<Vec<(LeaseKey, Versioned)>> {
                (**self).list(prefix).await
            }
            async fn acquire(
                &self,
                key: &LeaseKey,
                record: &LeaseRecord,
                expected: Option<&Version>,
            ) -> Result<Acquired> {
                (**self).acquire(key, record, expected).await
            }
            async fn fencing_seed(&self, key: &LeaseKey) -> Result<u64> {
                (**self).fencing_seed(key).await
            }
        }
    };
}

forward_store!(Arc<T>);
forward_store!(Box<T>);
