//! `lockd revoke` of the active engine's lease: it fences itself (exit 16) and the shadow
//! takes over.

use std::time::Duration;

use harness::{Cluster, SupOpts};
use probes::Phase;
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn revoke_fences_the_holder_and_the_shadow_takes_over() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (mut primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary")
            .sup(&["--linger", "3s"])
            .engine(&["--workers", "1"]),
        &SupOpts::new(1, "shadow"),
        T,
    );
    assert_eq!(primary.completion().unwrap().0, 200);
    let pids = primary.wait_engine_pids(2, T);

    assert!(
        c.lockd.revoke("engine", "test revoke"),
        "lockd revoke failed{}",
        c.dump_logs()
    );

    assert!(
        shadow.wait_phase(Phase::Active, T),
        "shadow did not take over{}",
        c.dump_logs()
    );
    let old = primary.state().expect("lingering /state");
    assert_eq!(old.state, Phase::Dead);
    assert!(
        old.dead_reason
            .as_deref()
            .is_some_and(|r| r.contains("revoked")),
        "{old:?}"
    );
    let st = primary
        .proc
        .wait_exit(T)
        .expect("old supervisor did not exit");
    assert_eq!(st.code(), Some(16), "{st:?}");
    assert!(pids.iter().all(|p| !alive(*p)));
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
    assert_eq!(shadow.completion().unwrap().1["engine_id"], 1);
}
