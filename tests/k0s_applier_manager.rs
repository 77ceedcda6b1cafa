//! The applier manager (examples/applier_manager.rs): two managers on one store; only the
//! leader applies; when the leader goes away the other takes over and applies what changed
//! meanwhile. Store-generic ([`applier_takeover`]); run here on the memory store with paused
//! time and on the real clock.

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
use leasehold::{DynLeaseStore, MemoryStore, StatusSource};
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
