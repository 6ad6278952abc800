//! Issue 13, required CI test: lockd on "node A" SIGKILLed while its holder lives → the
//! holder's engine is fenced by its own supervisor before lockd on "node B" grants the lock.
//!
//! Real processes over one real etcd (Debian's etcd-server on free loopback ports): two
//! `lockd serve --backend etcd` (A and B, standing for two nodes), a primary supervisor with a
//! fake engine on A (`--lock-watchdog`), a shadow supervisor with a fake engine on B. A
//! SIGKILLed lockd cannot revoke its etcd lease: B is granted only once it expires (A's TTL
//! after A's last keepalive), and A's engine must be dead by then. The supervisor fences as
//! soon as it knows the lease cannot be kept: the connection to an etcd-backed lockd broke
//! (such a lockd cannot reclaim a lease after a disconnect), or its watchdog (silence, capped
//! by the last `pong`'s vouch) ran out, whichever comes first.
//!
//! The margin (B's grant, its shadow's Waking entry, minus the moment A's engine tree was seen
//! dead) is printed for every trial; `ETCD_LOCKD_KILLED_TRIALS=N` runs N trials (default 1).
//! The fake engines' GPU claim file is the ground truth for split brain.

use std::path::Path;
use std::time::{Duration, Instant};

use harness::etcd::Etcd;
use harness::{unix_us, Cluster, Lockd, LockdSpec, SupOpts};
use probes::Phase;
use procfs::alive;

const T: Duration = Duration::from_secs(30);
/// A's and B's etcd lease TTL.
const TTL: &str = "3s";
/// The supervisor's watchdog on lockd: at most 2/3 of (TTL − margin) (docs/ETCD.md).
const WATCHDOG: &str = "1s";

fn etcd_lockd(dir: &Path, name: &str, etcd: &Etcd, env: &[(&str, &str)]) -> Lockd {
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub).expect("lockd dir");
    let mut spec = LockdSpec::new(&sub);
    for (k, v) in env {
        spec = spec.env(k, v);
    }
    Lockd::start(spec.log_filter("info,lockd::etcd=debug").args([
        "--backend",
        "etcd",
        "--etcd-endpoints",
        &etcd.client_url,
        "--etcd-node",
        name,
        "--etcd-ttl",
        TTL,
        "--etcd-kill-time",
        "800ms",
        "--etcd-pause",
        "200ms",
    ]))
}

fn logs(c: &Cluster, a: &Lockd, b: &Lockd) -> String {
    let mut s = c.dump_logs();
    for l in [a, b] {
        let p = l.spec().dir().join("lockd.log");
        s.push_str(&format!(
            "\n===== {} =====\n{}",
            p.display(),
            std::fs::read_to_string(&p).unwrap_or_default()
        ));
    }
    s
}

/// One trial: the margin in microseconds (B's grant minus A's engine death; > 0 required).
fn trial(n: u32, watchdog: Option<&str>, a_env: &[(&str, &str)]) -> Option<i64> {
    let mut c = Cluster::new(Duration::from_secs(2));
    let Some(etcd) = Etcd::start(c.dir.path()) else {
        harness::skip(
            "etcd_lockd_killed",
            "no etcd binary (apt-get install etcd-server; .ci/run installs it)",
        );
        return None;
    };
    let mut a = etcd_lockd(c.dir.path(), "A", &etcd, a_env);
    let b = etcd_lockd(c.dir.path(), "B", &etcd, &[]);
    let mut sup = vec!["--lock-reconnect-timeout", "30s"];
    if let Some(w) = watchdog {
        sup.extend(["--lock-watchdog", w]);
    }
    let (mut primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary")
            .lock(a.endpoint())
            .sup(&sup)
            .engine(&["--workers", "1"]),
        &SupOpts::new(1, "shadow").lock(b.endpoint()).sup(&sup),
        T,
    );
    // The Active engine takes the GPU claim on its first request.
    assert_eq!(
        primary.completion().map(|r| r.0),
        Some(200),
        "{}",
        logs(&c, &a, &b)
    );
    let pids = primary.wait_engine_pids(2, T);
    // A healthy pinged session stays Active for several watchdog limits.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(primary.phase(), Some(Phase::Active), "{}", logs(&c, &a, &b));

    let killed_us = unix_us();
    a.kill();
    // A's engine tree dead: polled every 2 ms (the time seen is an upper bound on the death).
    let start = Instant::now();
    let mut dead_us = None;
    while start.elapsed() < T {
        if pids.iter().all(|p| !alive(*p)) {
            dead_us = Some(unix_us());
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        shadow.wait_phase(Phase::Active, T),
        "B's shadow not Active{}",
        logs(&c, &a, &b)
    );
    // B serves: with A's engine still alive this is a split brain on the claim file.
    assert_eq!(shadow.completion().map(|r| r.0), Some(200));
    let st = shadow.state().expect("B's /state");
    let granted_us = st
        .transitions
        .iter()
        .rev()
        .find(|t| t.to == Phase::Waking)
        .map(|t| t.at_unix_us)
        .expect("B entered Waking");
    let dead_us = dead_us.unwrap_or_else(|| {
        panic!(
            "A's engine {pids:?} still alive {T:?} after lockd A was killed{}",
            logs(&c, &a, &b)
        )
    });
    let exit = primary.proc.wait_exit(T);
    let margin = granted_us - dead_us;
    eprintln!(
        "trial {n}: A's engine dead {:.0} ms after lockd A was SIGKILLed, B granted {:.0} ms after that (margin), {:.0} ms after the kill; A's supervisor exit {:?}",
        (dead_us - killed_us) as f64 / 1e3,
        margin as f64 / 1e3,
        (granted_us - killed_us) as f64 / 1e3,
        exit.and_then(|e| e.code()),
    );
    assert_eq!(c.violations(), "", "split brain{}", logs(&c, &a, &b));
    assert!(
        margin > 0,
        "B granted {:.0} ms BEFORE A's engine was dead{}",
        -margin as f64 / 1e3,
        logs(&c, &a, &b)
    );
    assert_eq!(
        exit.and_then(|e| e.code()),
        Some(15),
        "A's supervisor: lock lost{}",
        logs(&c, &a, &b)
    );
    drop(shadow);
    drop(b);
    drop(etcd);
    Some(margin)
}

fn trials() -> u32 {
    std::env::var("ETCD_LOCKD_KILLED_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

fn run(watchdog: Option<&str>, a_env: &[(&str, &str)]) {
    let mut margins = Vec::new();
    for n in 0..trials() {
        match trial(n, watchdog, a_env) {
            Some(m) => margins.push(m),
            None => return,
        }
    }
    margins.sort();
    eprintln!(
        "margins (ms): {:?}",
        margins.iter().map(|m| m / 1000).collect::<Vec<_>>()
    );
}

/// As deployed: A's hello says `no_reclaim`, so the broken connection alone fences (at once);
/// the watchdog is on as well.
#[test]
fn lockd_sigkilled_holder_fenced_before_the_other_node_is_granted() {
    let _g = harness::serial();
    run(Some(WATCHDOG), &[]);
}

/// The watchdog alone: lockd A does not announce `no_reclaim` (its test-only switch), so the
/// supervisor's client enters its 30 s reconnect window after A's death, and only
/// `--lock-watchdog` (silence for 1 s, capped by the last pong's vouch) fences the engine
/// before A's etcd lease expires and B is granted. `ETCD_LOCKD_KILLED_PLANT_NO_WATCHDOG=1`
/// plants the watchdog away (no `--lock-watchdog`): then this test must fail (B is granted
/// while A's engine lives through the reconnect window).
#[test]
fn lockd_sigkilled_holder_fenced_by_the_watchdog_alone() {
    let _g = harness::serial();
    let planted = std::env::var("ETCD_LOCKD_KILLED_PLANT_NO_WATCHDOG").is_ok_and(|v| v == "1");
    if planted {
        eprintln!("PLANTED: the primary runs without --lock-watchdog");
    }
    run(
        (!planted).then_some(WATCHDOG),
        &[("LOCKD_PLANTED_BUG_ANNOUNCE_RECLAIM", "1")],
    );
}
