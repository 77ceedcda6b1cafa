//! An applier manager in the style of k0s's, converted to `run_leader_tasks`.
//!
//! It watches a directory of manifest *stacks* (each subdirectory is one stack; its files are
//! the stack's manifests) and "applies" each stack only while leading. Applying writes the
//! stack's manifests, together with the applier's identity and fencing token, to
//! `<output>/<stack>.applied`, and appends a line to `<output>/apply.log`, so the effect is
//! visible. Every stack watcher is a child of the leader context: losing the lead stops all of
//! them, regaining it starts them again (and re-applies whatever changed meanwhile).
//!
//! The directory is polled with a Tokio timer (no file-notification dependency).
//!
//! ```text
//! cargo run --example applier_manager
//! ```
//!
//! The demo runs two managers on one in-memory store: the first leads and applies, then stops;
//! the second takes over and applies a change made in between.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use leasehold::{
    DynLeaseStore, Elector, ElectorConfig, LeaderContext, LeaseKey, MemoryStore, StatusSource,
    run_leader_tasks,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Applies the manifest stacks of one directory, only while leading.
#[derive(Clone, Debug)]
pub struct ApplierManager {
    /// Who applies (written into the applied state).
    pub identity: String,
    /// The directory of stacks (one subdirectory per stack).
    pub manifests: PathBuf,
    /// Where applied stacks are written.
    pub output: PathBuf,
    /// How often directories are re-read.
    pub poll: Duration,
    /// Stacks this manager leaves alone (k0s's `IgnoredStacks`: stacks applied by other
    /// components): never applied, and never deleted.
    pub ignored_stacks: Vec<String>,
}

impl ApplierManager {
    /// Runs until `shutdown` is cancelled: applies the stacks whenever `source` reports leading.
    pub async fn run(&self, shutdown: CancellationToken, source: impl StatusSource) {
        run_leader_tasks(shutdown, source, |leader| self.clone().lead(leader)).await;
    }

    /// One term of leadership: one watcher per stack, all children of the leader context.
    async fn lead(self, leader: LeaderContext) {
        let token = leader.fencing_token();
        info!(identity = %self.identity, fencing_token = token, "leading: applying stacks");
        let mut watchers: HashMap<String, (CancellationToken, JoinHandle<()>)> = HashMap::new();
        let mut first = true;
        loop {
            let stacks: Vec<String> = list_stacks(&self.manifests)
                .into_iter()
                .filter(|n| !self.ignored_stacks.contains(n))
                .collect();
            if first {
                // Stacks removed while nobody (or another manager) led: delete them now.
                first = false;
                for applied in list_applied(&self.output) {
                    if !stacks.contains(&applied) && !self.ignored_stacks.contains(&applied) {
                        self.delete(&applied, token);
                    }
                }
            }
            for name in &stacks {
                if !watchers.contains_key(name) {
                    let stop = leader.cancellation_token().child_token();
                    let task =
                        tokio::spawn(self.clone().watch_stack(name.clone(), stop.clone(), token));
                    watchers.insert(name.clone(), (stop, task));
                }
            }
            let removed: Vec<String> = watchers
                .keys()
                .filter(|n| !stacks.contains(*n))
                .cloned()
                .collect();
            for name in removed {
                if let Some((stop, task)) = watchers.remove(&name) {
                    stop.cancel();
                    let _ = task.await;
                    if !leader.is_cancelled() {
                        self.delete(&name, token);
                    }
                }
            }
            tokio::select! {
                () = leader.cancelled() => break,
                () = tokio::time::sleep(self.poll) => {}
            }
        }
        // Every watcher's token is a child of the leader's: they are all stopping. Wait for
        // them, so that no stack is applied after this term (the lease is released only then).
        for (_, (_, task)) in watchers {
            let _ = task.await;
        }
        info!(identity = %self.identity, cause = ?leader.cause(), "stopped applying stacks");
    }

    /// Applies one stack whenever its content changes, until `stop`.
    async fn watch_stack(self, name: String, stop: CancellationToken, token: u64) {
        let dir = self.manifests.join(&name);
        let mut applied: Option<String> = None;
        loop {
            if stop.is_cancelled() {
                return;
            }
            match read_stack(&dir) {
                Ok(content) if applied.as_ref() != Some(&content) => {
                    match self.apply(&name, &content, token) {
                        Ok(()) => applied = Some(content),
                        Err(e) => warn!(stack = %name, error = %e, "cannot apply; retrying"),
                    }
                }
                Ok(_) => {}
                Err(e) => warn!(stack = %name, error = %e, "cannot read the stack"),
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.poll) => {}
            }
        }
    }

    fn apply(&self, name: &str, content: &str, token: u64) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.output)?;
        let target = self.output.join(format!("{name}.applied"));
        let tmp = self.output.join(format!(".{name}.{}.tmp", self.identity));
        std::fs::write(
            &tmp,
            format!(
                "applied-by: {}\nfencing-token: {token}\n{content}",
                self.identity
            ),
        )?;
        std::fs::rename(&tmp, &target)?;
        self.log(&format!("apply {name}"), token)?;
        info!(stack = %name, identity = %self.identity, fencing_token = token, "applied");
        Ok(())
    }

    fn delete(&self, name: &str, token: u64) {
        let target = self.output.join(format!("{name}.applied"));
        match std::fs::remove_file(&target) {
            Ok(()) => {
                let _ = self.log(&format!("delete {name}"), token);
                info!(stack = %name, identity = %self.identity, "deleted a removed stack");
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => warn!(stack = %name, error = %e, "cannot delete"),
        }
    }

    fn log(&self, what: &str, token: u64) -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.output.join("apply.log"))?;
        writeln!(f, "{} {token} {what}", self.identity)
    }
}

/// The stack names: the subdirectories of `dir`, sorted.
fn list_stacks(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    names
}

/// The names of the stacks applied in `output`.
fn list_applied(output: &Path) -> Vec<String> {
    std::fs::read_dir(output)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".applied").map(str::to_owned))
        .collect()
}

/// A stack's content: its files, sorted by name, each as `--- <name>\n<content>`.
fn read_stack(dir: &Path) -> std::io::Result<String> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_file()
            && let Ok(name) = entry.file_name().into_string()
            && !name.starts_with('.')
        {
            files.insert(name, std::fs::read_to_string(entry.path())?);
        }
    }
    Ok(files
        .into_iter()
        .map(|(n, c)| format!("--- {n}\n{c}\n"))
        .collect())
}

/// Starts a manager with its own elector on `store`; returns the elector and the running task.
pub fn start_manager(
    store: DynLeaseStore,
    config: ElectorConfig,
    manager: ApplierManager,
    shutdown: CancellationToken,
) -> leasehold::Result<(Arc<Elector>, JoinHandle<()>)> {
    let elector = Arc::new(Elector::spawn(store, config)?);
    let source = elector.clone();
    let task = tokio::spawn(async move { manager.run(shutdown, source).await });
    Ok((elector, task))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "applier_manager=info,leasehold=warn".into()),
        )
        .init();
    let root = std::env::temp_dir().join(format!("applier-demo-{:08x}", rand::random::<u32>()));
    let manifests = root.join("manifests");
    let output = root.join("applied");
    std::fs::create_dir_all(manifests.join("coredns"))?;
    std::fs::write(manifests.join("coredns/deployment.yaml"), "replicas: 1\n")?;

    let store: DynLeaseStore = Arc::new(MemoryStore::new());
    let key = LeaseKey::new("k0s-applier-manager")?;
    let timings = |id: &str| {
        ElectorConfig::new(key.clone(), id).with_timings(
            Duration::from_secs(3),
            Duration::from_secs(2),
            Duration::from_millis(500),
        )
    };
    let manager = |id: &str| ApplierManager {
        identity: id.to_owned(),
        manifests: manifests.clone(),
        output: output.clone(),
        poll: Duration::from_millis(100),
        ignored_stacks: Vec::new(),
    };
    let shutdown = CancellationToken::new();
    let (e1, t1) = start_manager(
        store.clone(),
        timings("ctrl-1"),
        manager("ctrl-1"),
        shutdown.child_token(),
    )?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (e2, t2) = start_manager(
        store.clone(),
        timings("ctrl-2"),
        manager("ctrl-2"),
        shutdown.child_token(),
    )?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    println!(
        "after start:\n{}",
        std::fs::read_to_string(output.join("coredns.applied"))?
    );

    println!("stopping ctrl-1 and changing the stack ...");
    e1.shutdown().await.expect("the elector shuts down cleanly");
    std::fs::write(manifests.join("coredns/deployment.yaml"), "replicas: 2\n")?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    println!(
        "after take-over:\n{}",
        std::fs::read_to_string(output.join("coredns.applied"))?
    );
    println!(
        "apply log:\n{}",
        std::fs::read_to_string(output.join("apply.log"))?
    );

    shutdown.cancel();
    e2.shutdown().await.expect("the elector shuts down cleanly");
    let _ = tokio::join!(t1, t2);
    std::fs::remove_dir_all(&root)?;
    Ok(())
}
