//! Issue 10, engine incarnations: the Active engine SIGKILLed -> the shadow becomes Active; the
//! old supervisor fences, stays up and re-arms a new incarnation of its engine as a shadow that
//! reaches Standby (incarnation 1, no epoch until granted); `/live` never answers anything but
//! 200 on either supervisor during all of it (sampled every ~20 ms). Then the new Active engine
//! is killed: the re-armed shadow takes over (a second failover through a re-armed shadow),
//! with a strictly larger epoch.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{kill, wait_until, Cluster, Sup, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase, StateDoc};
use procfs::alive;

const T: Duration = Duration::from_secs(20);

/// The samples that were not a 200, and how many samples were taken.
type LiveSamples = (Vec<(SocketAddr, Option<u16>)>, usize);

/// Samples `/live` on every address every ~20 ms until stopped: (address, answer) of every
/// sample that was not a 200 (`None`: no answer), and the number of samples.
struct LiveSampler {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<LiveSamples>,
}

impl LiveSampler {
    fn start(addrs: Vec<SocketAddr>) -> LiveSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let (mut bad, mut n) = (Vec::new(), 0usize);
            while !s.load(Ordering::Relaxed) {
                for a in &addrs {
                    let code = harness::supervisor::get(*a, "/live").map(|x| x.0);
                    n += 1;
                    if code != Some(200) {
                        bad.push((*a, code));
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            (bad, n)
        });
        LiveSampler { stop, handle }
    }

    fn finish(self) -> LiveSamples {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().expect("sampler thread")
    }
}

/// Waits until `sup`'s `/state` satisfies `f`; returns that document.
fn wait_state(sup: &Sup, limit: Duration, f: impl Fn(&StateDoc) -> bool) -> Option<StateDoc> {
    let mut found = None;
    wait_until(limit, Duration::from_millis(10), || {
        found = sup.state().filter(&f);
        found.is_some()
    });
    found
}

/// Pids of `sup`'s engine once they differ from `old` (the re-armed engine's).
fn new_engine_pids(sup: &Sup, old: &[i32], n: usize) -> Vec<i32> {
    let mut pids = Vec::new();
    let ok = wait_until(T, Duration::from_millis(10), || {
        pids = sup.engine_pids();
        pids.len() >= n && pids.iter().all(|p| !old.contains(p))
    });
    assert!(ok, "no new engine pids (old {old:?}, now {pids:?})");
    pids
}

#[test]
fn killed_engine_rearms_as_shadow_and_takes_over_the_next_failover() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let rearming = |id, role| {
        SupOpts::new(id, role)
            .restart("on-failure")
            .sup(&["--restart-backoff", "200ms", "--stop-grace", "1s"])
            .engine(&["--workers", "1"])
    };
    let t0 = Instant::now();
    let (mut a, mut b) = c.start_pair(&rearming(0, "primary"), &rearming(1, "shadow"), T);
    assert_eq!(a.probe("/startup"), Some(200));
    assert_eq!(b.probe("/startup"), Some(200));
    let sampler = LiveSampler::start(vec![a.probes, b.probes]);
    assert!(t0.elapsed() < T, "pair up in {:?}", t0.elapsed());

    // Failover 1: engine 0 (Active) SIGKILLed.
    assert_eq!(a.completion().unwrap().0, 200);
    let a0 = a.wait_engine_pids(2, T);
    let a_epoch0 = a.state().unwrap().epoch.expect("primary epoch");
    assert!(kill(a0[0], Signal::SIGKILL), "engine {} is gone", a0[0]);
    assert!(
        b.wait_phase(Phase::Active, T),
        "shadow did not take over{}",
        c.dump_logs()
    );
    let b_epoch = b.state().unwrap().epoch.expect("shadow epoch");
    assert!(b_epoch > a_epoch0, "epoch {b_epoch} after {a_epoch0}");
    let (code, body) = b.completion().unwrap();
    assert_eq!((code, body["engine_id"].as_u64()), (200, Some(1)), "{body}");

    // The old supervisor stays up and re-arms: incarnation 1, a shadow in Standby, no epoch.
    let re = wait_state(&a, T, |s| s.incarnation == 1 && s.state == Phase::Standby)
        .unwrap_or_else(|| panic!("engine 0 did not re-arm to Standby{}", c.dump_logs()));
    assert!(!a.proc.exited(), "supervisor 0 exited");
    assert_eq!(re.restarts, 1);
    assert_eq!(re.role, "shadow");
    assert_eq!(re.epoch, None, "a fresh epoch wait");
    assert!(re.lock_connected);
    let phases: Vec<Phase> = re.phases().collect();
    let dead_at = phases
        .iter()
        .position(|p| *p == Phase::Dead)
        .expect("dead in the history");
    assert_eq!(
        &phases[dead_at..],
        [Phase::Dead, Phase::Init, Phase::Standby],
        "{phases:?}"
    );
    // The new incarnation's marks only: a fresh lock connection and engine, no grant yet.
    assert!(re.mark(MarkKind::LockConnected).is_some());
    assert!(re.mark(MarkKind::EngineSpawned).is_some());
    assert!(re.mark(MarkKind::LockGranted).is_none(), "{re:?}");
    assert!(
        re.entered(Phase::Init).unwrap() - re.entered(Phase::Dead).unwrap() >= 200_000,
        "re-armed before the 200 ms backoff"
    );
    let a1 = new_engine_pids(&a, &a0, 2);
    assert!(a0.iter().all(|p| !alive(*p)), "old engine processes alive");
    assert!(a1.iter().all(|p| alive(*p)));
    let m = a.metrics();
    assert_eq!(
        m.get("supervisor_restarts_total", &[("reason", "engine_exited")]),
        Some(1.0),
        "{m:?}"
    );
    assert_eq!(c.lockd.holder("engine").as_deref(), Some("engine-1"));

    // Failover 2: engine 1 (Active) SIGKILLed; the re-armed engine 0 takes over.
    let b0 = b.wait_engine_pids(2, T);
    assert!(kill(b0[0], Signal::SIGKILL), "engine {} is gone", b0[0]);
    let act = wait_state(&a, T, |s| s.state == Phase::Active)
        .unwrap_or_else(|| panic!("re-armed engine 0 did not take over{}", c.dump_logs()));
    assert_eq!(act.incarnation, 1);
    assert!(act.epoch.expect("epoch") > b_epoch);
    assert_eq!(a.probe("/ready"), Some(200));
    let (code, body) = a.completion().unwrap();
    assert_eq!((code, body["engine_id"].as_u64()), (200, Some(0)), "{body}");
    // ... and engine 1 re-arms in turn.
    assert!(
        wait_state(&b, T, |s| s.incarnation == 1 && s.state == Phase::Standby).is_some(),
        "engine 1 did not re-arm{}",
        c.dump_logs()
    );
    assert!(
        b0.iter().all(|p| !alive(*p)),
        "old engine 1 processes alive"
    );

    let (bad, n) = sampler.finish();
    assert!(n >= 20, "only {n} /live samples");
    assert!(
        bad.is_empty(),
        "/live not 200 during re-arming: {bad:?}{}",
        c.dump_logs()
    );
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());

    // A requested stop ends the supervisor (exit 0), no re-arm.
    assert!(b.proc.signal(Signal::SIGTERM));
    let st = b.proc.wait_exit(T).expect("supervisor 1 did not stop");
    assert_eq!(st.code(), Some(0), "{st:?}");
    let _ = a.proc.signal(Signal::SIGTERM);
    let st = a.proc.wait_exit(T).expect("supervisor 0 did not stop");
    assert_eq!(st.code(), Some(0), "{st:?}");
}
