//! A standby supervisor whose lockd (on etcd) answers `unavailable`: lockd B is cut off from
//! etcd (a proxy black-holes its traffic) while B's shadow waits for the lock. B's self-fence
//! drops the waiting session (`unavailable`: "the session's etcd lease was lost while
//! waiting"), and every new acquire is `unavailable` while etcd cannot be reached. The shadow
//! must neither die nor wake: it stays Standby with its engine asleep, shows
//! `/state.waiting = lock_unavailable`, repeats the request with a bounded backoff, and once
//! the partition heals it queues again and takes over when the primary's engine dies.

use std::time::{Duration, Instant};

use harness::etcd::{Etcd, Proxy};
use harness::{kill, Cluster, Lockd, LockdSpec, SupOpts};
use nix::sys::signal::Signal;
use probes::{Phase, WaitReason};

const T: Duration = Duration::from_secs(30);

#[test]
fn standby_keeps_waiting_while_its_lockd_cannot_reach_etcd() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let Some(etcd) = Etcd::start(c.dir.path()) else {
        harness::skip(
            "etcd_standby_unavailable",
            "no etcd binary (apt-get install etcd-server; .ci/run installs it)",
        );
        return;
    };
    let proxy = Proxy::start(([127, 0, 0, 1], etcd.client_port).into());
    let lockd = |name: &str, url: &str| {
        let sub = c.dir.path().join(name);
        std::fs::create_dir_all(&sub).expect("lockd dir");
        Lockd::start(LockdSpec::new(&sub).args([
            "--backend",
            "etcd",
            "--etcd-endpoints",
            url,
            "--etcd-node",
            name,
            "--etcd-ttl",
            "3s",
            "--etcd-op-timeout",
            "500ms",
        ]))
    };
    let a = lockd("A", &etcd.client_url);
    let b = lockd("B", &proxy.url());
    let (primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary").lock(a.endpoint()),
        &SupOpts::new(1, "shadow").lock(b.endpoint()),
        T,
    );
    let shadow_pid = shadow.engine_pids();

    proxy.blackhole();
    let cut = Instant::now();
    // B's fence drops the waiting session; the shadow is told `unavailable` and retries.
    let end = Instant::now() + T;
    let told = loop {
        let st = shadow.state();
        if st
            .as_ref()
            .is_some_and(|s| s.waiting == Some(WaitReason::LockUnavailable))
        {
            break cut.elapsed();
        }
        assert!(
            Instant::now() < end,
            "shadow never reported lock_unavailable{}",
            c.dump_logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // Partitioned for a while: several retries, still Standby, engine asleep and alive.
    std::thread::sleep(Duration::from_secs(4));
    let st = shadow.state().expect("shadow /state");
    assert_eq!(st.state, Phase::Standby, "{}", c.dump_logs());
    assert_eq!(st.waiting, Some(WaitReason::LockUnavailable));
    assert_eq!(shadow.probe("/live"), Some(200));
    assert!(shadow.engine_pids().iter().all(|p| procfs::alive(*p)));
    assert_eq!(shadow.engine_pids(), shadow_pid);
    let retries = shadow
        .log_text()
        .matches("the lock request is repeated after a backoff")
        .count();
    assert!(retries >= 2, "retries: {retries}{}", shadow.log_text());
    assert_eq!(primary.phase(), Some(Phase::Active));

    // Healed: the next retry queues again; the primary's death hands over to B.
    proxy.heal();
    let end = Instant::now() + T;
    while shadow.state().is_some_and(|s| s.waiting.is_some()) {
        assert!(
            Instant::now() < end,
            "shadow never queued again{}",
            c.dump_logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let pids = primary.wait_engine_pids(1, T);
    assert!(kill(pids[0], Signal::SIGKILL));
    assert!(
        shadow.wait_phase(Phase::Active, T),
        "shadow did not take over after the heal{}",
        c.dump_logs()
    );
    eprintln!(
        "shadow told lock_unavailable {told:?} after the cut, {retries} retries in the next 4 s, took over after the heal"
    );
    assert_eq!(c.violations(), "");
    drop(etcd);
}
