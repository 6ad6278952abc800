//! lockd restarted while the primary is Active: the primary keeps serving through the
//! reconnect window and never leaves Active.

use std::time::Duration;

use harness::{holds_for, wait_until, Cluster, SupOpts};
use probes::{MarkKind, Phase};

const T: Duration = Duration::from_secs(20);

#[test]
fn primary_stays_active_across_a_lockd_restart() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(3));
    let (primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary").sup(&["--lock-reconnect-timeout", "8s"]),
        &SupOpts::new(1, "shadow").sup(&["--lock-reconnect-timeout", "8s"]),
        T,
    );
    let epoch = primary.state().unwrap().epoch.expect("epoch of the grant");

    c.lockd.kill();
    std::thread::sleep(Duration::from_millis(500));
    c.lockd.restart();

    // Watch both for 5 s (past the 3 s reconnect window): the primary never leaves Active
    // and stays ready; the shadow stays in Standby.
    holds_for(
        Duration::from_secs(5),
        Duration::from_millis(50),
        "primary Active and ready, shadow Standby, across the restart",
        || {
            let seen = (primary.phase(), primary.probe("/ready"), shadow.phase());
            if seen == (Some(Phase::Active), Some(200), Some(Phase::Standby)) {
                Ok(())
            } else {
                Err(format!("{seen:?}{}", c.dump_logs()))
            }
        },
    );
    let st = primary.state().unwrap();
    assert_eq!(
        st.phases().collect::<Vec<_>>(),
        [Phase::Init, Phase::Active],
        "{st:?}"
    );
    assert!(
        st.mark(MarkKind::LockReclaimed).is_some(),
        "no reclaim recorded: {st:?}"
    );
    assert_eq!(st.epoch, Some(epoch), "reclaim keeps the epoch");
    assert!(wait_until(T, Duration::from_millis(50), || c
        .lockd
        .holder("engine")
        .as_deref()
        == Some("engine-0")));
    assert!(primary
        .log_text()
        .contains("lock connection re-established"));
}
