//! `lockd revoke` of the active engine's lease: it fences itself (exit 16) and the shadow
//! takes over.

use std::time::Duration;

use failover_tests::{alive, Cluster, SupOpts};

const T: Duration = Duration::from_secs(20);

#[test]
fn revoke_fences_the_holder_and_the_shadow_takes_over() {
    let mut c = Cluster::new("2s");
    let mut primary = c.start(
        &SupOpts::new(0, "primary")
            .sup(&["--linger", "3s"])
            .engine(&["--workers", "1"]),
    );
    assert!(primary.wait_phase("active", T), "{}", c.dump_logs());
    let shadow = c.start(&SupOpts::new(1, "shadow"));
    assert!(shadow.wait_phase("standby", T), "{}", c.dump_logs());
    assert_eq!(primary.completion().unwrap().0, 200);
    let pids = primary.wait_engine_pids(2, T);

    assert!(
        c.lockd.revoke("engine", "test revoke"),
        "lockd revoke failed{}",
        c.dump_logs()
    );

    assert!(
        shadow.wait_phase("active", T),
        "shadow did not take over{}",
        c.dump_logs()
    );
    let old = primary.state().expect("lingering /state");
    assert_eq!(old["state"], "dead");
    assert!(
        old["dead_reason"].as_str().unwrap().contains("revoked"),
        "{old}"
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
