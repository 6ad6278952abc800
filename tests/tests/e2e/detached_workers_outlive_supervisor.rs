//! Default mode (no PID namespace), supervisor SIGKILLed while its engine has detached,
//! SIGTERM-ignoring workers: PDEATHSIG kills the engine, but the detached workers survive (no
//! one is left to kill them). They still hold the inherited lock connection, so the lock is
//! NOT released and the shadow does not wake beside them: safe, though stuck until they die.
//! (`--pid-namespace` closes this gap: see pid_namespace.rs.)

use std::time::Duration;

use harness::{holds_for, kill, wait_until, Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::Phase;
use procfs::alive;

const T: Duration = Duration::from_secs(20);

#[test]
fn surviving_detached_workers_keep_the_lock() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let mut primary =
        c.start(&SupOpts::new(0, "primary").engine(&["--workers", "2", "--detach-workers"]));
    assert!(primary.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let shadow = c.start(&SupOpts::new(1, "shadow"));
    assert!(shadow.wait_phase(Phase::Standby, T), "{}", c.dump_logs());
    assert_eq!(primary.completion().unwrap().0, 200);
    let pids = primary.wait_engine_pids(3, T);
    assert_eq!(pids.len(), 3);

    assert!(primary.proc.signal(Signal::SIGKILL));
    assert!(primary.proc.wait_exit(T).is_some());
    assert!(
        wait_until(T, Duration::from_millis(10), || !alive(pids[0])),
        "engine survived its supervisor (PDEATHSIG)"
    );
    // The workers live on and the lock stays with them for as long as they do.
    holds_for(
        Duration::from_secs(2),
        Duration::from_millis(50),
        "detached workers keep the lock",
        || {
            if !(alive(pids[1]) && alive(pids[2])) {
                return Err("detached workers died on their own".to_string());
            }
            match shadow.phase() {
                Some(Phase::Standby) => Ok(()),
                other => Err(format!(
                    "woke beside live workers: {other:?}{}",
                    c.dump_logs()
                )),
            }
        },
    );
    assert_eq!(c.lockd.holder("engine").as_deref(), Some("engine-0"));

    // Once they die, the kernel closes their copies of the connection and the shadow wakes.
    for p in &pids[1..] {
        assert!(kill(*p, Signal::SIGKILL), "worker {p} is gone");
    }
    assert!(shadow.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
}
