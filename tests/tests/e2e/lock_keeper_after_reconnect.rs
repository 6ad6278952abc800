//! After lockd restarts, the supervisor's new lock connection is not held by the (already
//! running) engine. The anchor (a socket pair whose one end lockd holds and whose other end
//! every process of the engine's tree inherited; the client re-attaches it on the new
//! connection before reclaiming) keeps a supervisor crash from releasing the lock while ANY
//! process of the engine's tree lives — the engine itself and its workers, detached or not,
//! in whatever order they die (issue 15). The engine here clears its PDEATHSIG
//! (`--survive-supervisor`) and runs detached workers, so that both outlive the supervisor:
//! without the anchor, the shadow would be granted once the supervisor (or, with the old lock
//! keeper, the engine's main process) died, and its wake would find the GPU claim held.

use std::time::Duration;

use harness::{kill, wait_until, Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase};
use procfs::alive;

use crate::waits::{stays_standby, wait_reclaimed};

const T: Duration = Duration::from_secs(20);

#[test]
fn the_anchor_holds_the_reconnected_lock_until_the_whole_tree_is_dead() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (mut primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary")
            .sup(&["--lock-reconnect-timeout", "8s"])
            .engine(&["--survive-supervisor", "--workers", "2", "--detach-workers"]),
        &SupOpts::new(1, "shadow").sup(&["--lock-reconnect-timeout", "8s"]),
        T,
    );
    assert_eq!(primary.completion().unwrap().0, 200);
    let pids = primary.wait_engine_pids(3, T);
    assert_eq!(pids.len(), 3, "engine + 2 workers: {pids:?}");
    let (engine, workers) = (pids[0], pids[1..].to_vec());

    c.lockd.kill();
    c.lockd.restart();
    // Its marks are checked after the safety assertions below, so that a build without the
    // anchor fails on what matters (the lock moving), not on a mark.
    let reclaimed = wait_reclaimed(&c, &primary, "engine-0", T);
    assert_eq!(primary.phase(), Some(Phase::Active));

    assert!(primary.proc.signal(Signal::SIGKILL));
    assert!(primary.proc.wait_exit(T).is_some());
    assert!(
        alive(engine),
        "the engine was meant to outlive its supervisor"
    );
    stays_standby(&c, &shadow, "engine-0", "the engine lives");

    // The engine dies; its detached workers live on (and hold the GPU claim).
    assert!(kill(engine, Signal::SIGKILL), "engine {engine} is gone");
    assert!(wait_until(T, Duration::from_millis(10), || !alive(engine)));
    assert!(workers.iter().all(|w| alive(*w)), "workers died too early");
    stays_standby(&c, &shadow, "engine-0", "the engine's workers live");

    for w in &workers {
        assert!(kill(*w, Signal::SIGKILL), "worker {w} is gone");
    }
    assert!(shadow.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
    assert!(
        reclaimed.mark(MarkKind::LockAnchorReattached).is_some(),
        "anchor not re-attached: {:?}",
        reclaimed.marks
    );
}
