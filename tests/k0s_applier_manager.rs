//! The applier manager (examples/applier_manager.rs): two managers on one store; only the
//! leader applies; when the leader goes away the other takes over and applies what changed
//! meanwhile. Store-generic ([`applier_takeover`]); run here on the memory store with paused
//! time and on the real clock. Plus k0s's `TestManager` (stacks added, changed and removed while
//! leading, across a loss and re-acquisition) and `TestManager_IgnoresStacks`, on a status the
//! test controls.

#[path = "../examples/applier_manager.rs"]
#[allow(dead_code)]
mod applier_manager;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use applier_manager::{ApplierManager, start_manager};
use leasehold::conformance::{WAIT_LIMIT, test_config, unique_key};
use leasehold::fault::FaultyStore;
use leasehold::k0s::conformance::wait_status;
use leasehold::{
    DynLeaseStore, LeaderStatus, MemoryStore, StatusCell, StatusSource, StopCause, testing,
};
use tokio_util::sync::CancellationToken;

const POLL: Duration = Duration::from_millis(50);

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write(path: &Path, content: &str) {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("create stack dir");
    }
    std::fs::write(path, content).expect("write manifest");
}

/// Waits (polling the directory) until `<output>/<stack>.applied` satisfies `pred` (`None` =
/// the file does not exist).
async fn wait_applied(output: &Path, stack: &str, what: &str, pred: impl Fn(Option<&str>) -> bool) {
    let file = output.join(format!("{stack}.applied"));
    let wait = async {
        loop {
            let content = std::fs::read_to_string(&file).ok();
            if pred(content.as_deref()) {
                return;
            }
            tokio::time::sleep(POLL).await;
        }
    };
    tokio::time::timeout(WAIT_LIMIT, wait)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "stack {stack} not {what} within {WAIT_LIMIT:?}; it is {:?}",
                std::fs::read_to_string(&file).ok()
            )
        });
}

fn applied_by(content: Option<&str>, who: &str, manifest: &str) -> bool {
    content.is_some_and(|c| c.starts_with(&format!("applied-by: {who}\n")) && c.contains(manifest))
}

/// `(identity, fencing token, action)` per line of the apply log.
fn log(output: &Path) -> Vec<(String, u64, String)> {
    std::fs::read_to_string(output.join("apply.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut parts = l.splitn(3, ' ');
            let who = parts.next().unwrap_or_default().to_owned();
            let token = parts
                .next()
                .and_then(|t| t.parse().ok())
                .expect("token in log line");
            (who, token, parts.next().unwrap_or_default().to_owned())
        })
        .collect()
}

/// The scenario, over any store.
pub async fn applier_takeover(store: DynLeaseStore) {
    let root = TempDir(
        std::env::temp_dir().join(format!("leasehold-applier-{:016x}", rand::random::<u64>())),
    );
    let manifests = root.0.join("manifests");
    let output = root.0.join("applied");
    std::fs::create_dir_all(&manifests).expect("manifests dir");
    write(&manifests.join("a/app.yaml"), "v1");

    let key = unique_key("applier");
    let manager = |id: &str| ApplierManager {
        identity: id.to_owned(),
        manifests: manifests.clone(),
        output: output.clone(),
        poll: POLL,
        ignored_stacks: Vec::new(),
    };
    let shutdown = CancellationToken::new();
    let m1_store = FaultyStore::new(store.clone());
    let faults = m1_store.faults().clone();
    let (e1, t1) = start_manager(
        Arc::new(m1_store),
        test_config(&key, "m1"),
        manager("m1"),
        shutdown.child_token(),
    )
    .expect("start m1");
    wait_status(&*e1, "m1 leading", |s| s.is_leading()).await;
    let (e2, t2) = start_manager(
        store.clone(),
        test_config(&key, "m2"),
        manager("m2"),
        shutdown.child_token(),
    )
    .expect("start m2");
    wait_status(&*e2, "m2 following m1", |s| s.leader() == Some("m1")).await;

    // Only the leader applies, also later changes.
    wait_applied(&output, "a", "applied by m1", |c| applied_by(c, "m1", "v1")).await;
    write(&manifests.join("a/app.yaml"), "v2");
    wait_applied(&output, "a", "re-applied by m1", |c| {
        applied_by(c, "m1", "v2")
    })
    .await;
    assert!(
        log(&output).iter().all(|(who, _, _)| who == "m1"),
        "only the leader applies: {:?}",
        log(&output)
    );

    // m1 is cut off: it steps down at its renew deadline, before m2 may take over.
    faults.set_partitioned(true);
    wait_status(&*e1, "m1 stepped down", |s| !s.is_leading()).await;
    assert!(
        !e2.current_status().0.is_leading(),
        "m2 leads only after m1's lease expired"
    );
    let before = log(&output).len();
    // Changes made meanwhile.
    write(&manifests.join("a/app.yaml"), "v3");
    write(&manifests.join("b/app.yaml"), "b1");
    wait_status(&*e2, "m2 leading", |s| s.is_leading()).await;
    wait_applied(&output, "a", "applied by m2 after take-over", |c| {
        applied_by(c, "m2", "v3")
    })
    .await;
    wait_applied(&output, "b", "applied by m2 after take-over", |c| {
        applied_by(c, "m2", "b1")
    })
    .await;
    let after: Vec<_> = log(&output).split_off(before);
    assert!(
        after.iter().all(|(who, _, _)| who == "m2"),
        "m1 applied after stepping down: {after:?}"
    );

    // m1 comes back as a follower; m2 stops gracefully; m1 takes over and applies what changed
    // meanwhile, including a removed stack.
    faults.heal();
    wait_status(&*e1, "m1 following m2", |s| s.leader() == Some("m2")).await;
    e2.shutdown().await.expect("the elector shuts down cleanly");
    write(&manifests.join("a/app.yaml"), "v4");
    std::fs::remove_dir_all(manifests.join("b")).expect("remove stack b");
    wait_applied(&output, "a", "applied by m1 again", |c| {
        applied_by(c, "m1", "v4")
    })
    .await;
    wait_applied(&output, "b", "deleted", |c| c.is_none()).await;

    // Across all terms, applies happen in fencing-token order: no two terms overlapped.
    let entries = log(&output);
    assert!(
        entries.windows(2).all(|w| w[0].1 <= w[1].1),
        "applies from an older term after a newer one: {entries:?}"
    );
    assert!(
        entries
            .iter()
            .any(|(who, _, what)| who == "m1" && what == "delete b")
    );

    shutdown.cancel();
    e1.shutdown().await.expect("the elector shuts down cleanly");
    t1.await.expect("m1 task");
    t2.await.expect("m2 task");
}

#[tokio::test(start_paused = true)]
async fn k0s_applier_manager_takeover_paused() {
    applier_takeover(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn k0s_applier_manager_takeover_real_clock() {
    applier_takeover(Arc::new(MemoryStore::new())).await;
}

/// A manager over fresh directories, led by a status the test controls (k0s's
/// `mockLeaderElector`).
struct Fixture {
    _root: TempDir,
    manifests: PathBuf,
    output: PathBuf,
    cell: StatusCell,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Fixture {
    fn start(ignored: &[&str], before: impl FnOnce(&Path, &Path)) -> Fixture {
        let root = TempDir(
            std::env::temp_dir().join(format!("leasehold-manager-{:016x}", rand::random::<u64>())),
        );
        let manifests = root.0.join("manifests");
        let output = root.0.join("applied");
        std::fs::create_dir_all(&manifests).expect("manifests dir");
        std::fs::create_dir_all(&output).expect("output dir");
        before(&manifests, &output);
        let manager = ApplierManager {
            identity: "mgr".to_owned(),
            manifests: manifests.clone(),
            output: output.clone(),
            poll: POLL,
            ignored_stacks: ignored.iter().map(|s| (*s).to_owned()).collect(),
        };
        let cell = StatusCell::new(LeaderStatus::NotLeading { leader: None });
        let shutdown = CancellationToken::new();
        let task = tokio::spawn({
            let (cell, shutdown) = (cell.clone(), shutdown.clone());
            async move { manager.run(shutdown, cell).await }
        });
        Fixture {
            _root: root,
            manifests,
            output,
            cell,
            shutdown,
            task,
        }
    }

    fn activate(&self, token: u64) -> leasehold::Leadership {
        let (term, _drained) = testing::new_term(token);
        testing::set_status(&self.cell, LeaderStatus::Leading(term.clone()));
        term
    }

    fn deactivate(&self, term: &leasehold::Leadership) {
        testing::end_term(term, StopCause::LeaseLost);
        testing::set_status(&self.cell, LeaderStatus::NotLeading { leader: None });
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.expect("manager task");
    }
}

fn applied_with(content: Option<&str>, token: u64, manifest: &str) -> bool {
    content.is_some_and(|c| {
        c.starts_with(&format!("applied-by: mgr\nfencing-token: {token}\n")) && c.contains(manifest)
    })
}

/// k0s `TestManager`: a stack that exists before the start is applied once leading; a change is
/// applied; after losing and re-acquiring the lead, a stack *added while leading* is applied, a
/// change is applied in the new term, and a stack *removed while leading* is deleted.
#[tokio::test(start_paused = true)]
async fn k0s_manager_stacks_added_and_removed_while_leading() {
    let f = Fixture::start(&[], |manifests, _| {
        write(&manifests.join("stack1/pod.yaml"), "pod v1");
    });
    tokio::time::sleep(POLL * 4).await;
    assert!(log(&f.output).is_empty(), "applied without leading");

    let term1 = f.activate(1);
    wait_applied(&f.output, "stack1", "applied", |c| {
        applied_with(c, 1, "pod v1")
    })
    .await;
    write(&f.manifests.join("stack1/pod.yaml"), "pod v2");
    wait_applied(&f.output, "stack1", "updated", |c| {
        applied_with(c, 1, "pod v2")
    })
    .await;

    // Lose and re-acquire the lead.
    f.deactivate(&term1);
    drop(term1);
    let term2 = f.activate(2);

    // A stack added while leading is applied.
    tokio::time::sleep(POLL * 2).await;
    write(&f.manifests.join("stack2/deploy.yaml"), "deploy v1");
    wait_applied(&f.output, "stack2", "applied", |c| {
        applied_with(c, 2, "deploy v1")
    })
    .await;
    // A change after the re-acquisition is applied in the new term.
    write(&f.manifests.join("stack1/pod.yaml"), "pod v3");
    wait_applied(&f.output, "stack1", "updated", |c| {
        applied_with(c, 2, "pod v3")
    })
    .await;

    // A stack removed while leading is deleted, by this term.
    std::fs::remove_dir_all(f.manifests.join("stack1")).expect("remove stack1");
    wait_applied(&f.output, "stack1", "deleted", |c| c.is_none()).await;
    let entries = log(&f.output);
    assert!(
        entries.contains(&("mgr".to_owned(), 2, "delete stack1".to_owned())),
        "the removal was not done by the current term: {entries:?}"
    );
    assert!(
        entries.windows(2).all(|w| w[0].1 <= w[1].1),
        "applies from an older term after a newer one: {entries:?}"
    );
    drop(term2);
    f.stop().await;
}

/// k0s `TestManager_IgnoresStacks`: stacks named in `ignored_stacks` are never applied (also
/// when added while leading) and never deleted, while the others are.
#[tokio::test(start_paused = true)]
async fn k0s_manager_ignores_stacks() {
    let f = Fixture::start(&["ignored", "late-ignored"], |manifests, output| {
        write(&manifests.join("ignored/a.yaml"), "ignored");
        write(&manifests.join("kept/a.yaml"), "kept");
        // Applied by someone else (its own component): must survive the start-up sweep.
        write(&output.join("late-ignored.applied"), "by another component");
    });
    let term = f.activate(1);
    wait_applied(&f.output, "kept", "applied", |c| applied_with(c, 1, "kept")).await;
    write(&f.manifests.join("late-ignored/a.yaml"), "late");
    write(&f.manifests.join("later/a.yaml"), "later");
    wait_applied(&f.output, "later", "applied", |c| {
        applied_with(c, 1, "later")
    })
    .await;
    tokio::time::sleep(POLL * 4).await;
    assert!(
        !f.output.join("ignored.applied").exists(),
        "an ignored stack was applied"
    );
    assert_eq!(
        std::fs::read_to_string(f.output.join("late-ignored.applied"))
            .ok()
            .as_deref(),
        Some("by another component"),
        "an ignored stack was applied or deleted"
    );
    let entries = log(&f.output);
    assert!(
        entries.iter().all(|(_, _, what)| !what.contains("ignored")),
        "an ignored stack was touched: {entries:?}"
    );
    f.deactivate(&term);
    drop(term);
    f.stop().await;
}
