#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod codec;
pub mod error;
pub mod memory;
pub mod metrics;
pub mod store;

#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod fault;

#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;

pub use error::{BoxError, Error, Result};
pub use memory::MemoryStore;
pub use store::{
    Acquired, Capabilities, DynLeaseStore, KeyPrefix, LeaseKey, LeaseRecord, LeaseStore, Version,
    Versioned, WatchEvent, WatchStream,
};

pub mod elector;
pub mod status;

pub use elector::{Elector, ElectorConfig, default_identity};
pub use status::{LeaderStatus, Leadership, StatusCell, StatusChanged, StatusSource, StopCause};
pub mod tasks;
pub use tasks::{LeaderContext, run_leader_tasks};
/// The cancellation token [`run_leader_tasks`] takes, re-exported from `tokio-util` so a first
/// program needs no extra dependency.
pub use tokio_util::sync::CancellationToken;
pub mod k0s;
