//! Issue 10 item 7, re-arming needs memory (`supervisor run --init-min-free-memory`), on a
//! simulated device shared across processes (`--gpu-sim DIR`, `gms_client::simdev`; 80 GiB).
//!
//! * A re-arming incarnation waits, in Init with `/state.waiting = "init_memory"` and `/live`
//!   200, while the device is full (the new Active engine holds 30 GiB and a helper process the
//!   test owns 20 GiB, so 30 GiB are free and 40 GiB are needed), and spawns its engine once the
//!   helper died (its memory freed), then reaches Standby.
//! * A device that never frees: every incarnation's wait times out (`init_memory_timeout`),
//!   counts for the restart policy, and the supervisor gives up at the crash-loop limit with
//!   exit code 20, its engine never spawned.
//! * SIGTERM during the wait: exit 0 at once, no engine spawned.
//! * Without a device the flag is a no-op (one warning line).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use gms_client::simdev;
use harness::{holds_for, kill, wait_until, Cluster, Proc, Sup, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase, StateDoc, WaitReason};

const T: Duration = Duration::from_secs(20);
const GIB: u64 = 1 << 30;
/// What each fake engine allocates on the simulated device while awake.
const ENGINE_BYTES: &str = "32212254720"; // 30 GiB

/// A live process the test owns that holds `bytes` of the simulated device until killed.
fn gpu_holder(c: &Cluster, sim: &Path, bytes: u64) -> Proc {
    let mut cmd = Command::new("sleep");
    cmd.arg("60");
    let holder = Proc::spawn("gpu-holder", cmd, c.dir.path().join("gpu-holder.log"));
    simdev::register(sim, holder.pid() as u32, bytes).expect("register the holder");
    holder
}

/// Waits until `sup`'s `/state` satisfies `f`; returns that document.
fn wait_state(sup: &Sup, limit: Duration, f: impl Fn(&StateDoc) -> bool) -> Option<StateDoc> {
    let mut found = None;
    wait_until(limit, Duration::from_millis(5), || {
        found = sup.state().filter(&f);
        found.is_some()
    });
    found
}

fn waiting(s: &StateDoc) -> bool {
    s.state == Phase::Init && s.waiting == Some(WaitReason::InitMemory)
}

#[test]
fn a_rearming_incarnation_waits_for_init_memory_then_spawns_its_engine() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let sim = c.dir.path().join("gpu-sim");
    simdev::set_total(&sim, 80 * GIB).expect("write DIR/total");
    let sim_s = sim.to_str().expect("utf-8 temp path").to_string();
    let engine = ["--gpu-sim", &sim_s, "--gpu-sim-bytes", ENGINE_BYTES];
    let primary = c.start(
        &SupOpts::new(0, "primary")
            .restart("on-failure")
            .sup(&[
                "--gpu-sim",
                &sim_s,
                "--init-min-free-memory",
                "40GiB",
                "--init-memory-timeout",
                "20s",
                "--restart-backoff",
                "100ms",
            ])
            .engine(&engine),
    );
    assert!(primary.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let shadow = c.start(
        &SupOpts::new(1, "shadow")
            .sup(&["--gpu-sim", &sim_s])
            .engine(&engine),
    );
    assert!(shadow.wait_phase(Phase::Standby, T), "{}", c.dump_logs());
    // The first incarnation's wait found 80 GiB free: counted as "ready", no waiting line.
    let m = primary.metrics();
    let waits = |m: &harness::metrics::Metrics, o: &str| {
        m.get("supervisor_init_memory_waits_total", &[("outcome", o)])
    };
    assert_eq!(waits(&m, "ready"), Some(1.0), "{m:?}");
    assert_eq!(waits(&m, "freed"), Some(0.0), "{m:?}");

    // 20 GiB held elsewhere; engine 0 (Active, 30 GiB) killed; engine 1 takes over (30 GiB).
    let mut holder = gpu_holder(&c, &sim, 20 * GIB);
    let old = primary.wait_engine_pids(1, T);
    assert!(kill(old[0], Signal::SIGKILL), "engine {} is gone", old[0]);
    assert!(
        shadow.wait_phase(Phase::Active, T),
        "shadow did not take over{}",
        c.dump_logs()
    );

    // Engine 0 re-arms: incarnation 1 waits in Init (30 GiB free of the 40 it needs).
    let st = wait_state(&primary, T, |s| s.incarnation == 1 && waiting(s))
        .unwrap_or_else(|| panic!("incarnation 1 did not wait{}", c.dump_logs()));
    assert_eq!(st.waiting_need_bytes, Some(40 * GIB), "{st:?}");
    let free = st.waiting_free_bytes.expect("free bytes while waiting");
    assert!(free < 40 * GIB, "{st:?}");
    assert_eq!(st.waiting_timeout_ms, Some(20_000));
    holds_for(
        Duration::from_millis(1000),
        Duration::from_millis(20),
        "incarnation 1 waits, its engine not spawned, alive and started",
        || {
            let s = primary.state().ok_or("no /state")?;
            if !(s.incarnation == 1 && waiting(&s)) {
                return Err(format!("{s:?}"));
            }
            if s.engine_pid.is_some() || s.mark(MarkKind::EngineSpawned).is_some() {
                return Err(format!("engine spawned while waiting: {s:?}"));
            }
            match (primary.probe("/live"), primary.probe("/startup")) {
                (Some(200), Some(200)) => Ok(()),
                other => Err(format!("/live, /startup = {other:?}")),
            }
        },
    );
    let before_free = wait_state(&primary, T, waiting).expect("still waiting");
    assert!(
        before_free.waiting_ms.unwrap_or(0) >= 1000,
        "{before_free:?}"
    );

    // The helper dies: 50 GiB free; the engine is spawned and reaches Standby.
    assert!(holder.signal(Signal::SIGKILL));
    assert!(holder.wait_exit(T).is_some(), "holder did not die");
    let re = wait_state(&primary, T, |s| {
        s.incarnation == 1 && s.state == Phase::Standby
    })
    .unwrap_or_else(|| panic!("incarnation 1 did not reach Standby{}", c.dump_logs()));
    assert_eq!(re.waiting, None, "{re:?}");
    assert!(re.engine_pid.is_some());
    assert_eq!(
        re.phases().filter(|p| *p == Phase::Init).count(),
        2,
        "one Init per incarnation: {re:?}"
    );
    let m = primary.metrics();
    assert_eq!(waits(&m, "freed"), Some(1.0), "{m:?}");
    assert_eq!(waits(&m, "timeout"), Some(0.0), "{m:?}");
    assert_eq!(
        m.get("supervisor_init_memory_wait_seconds_count", &[]),
        Some(2.0)
    );
    let log = primary.log_text();
    assert_eq!(
        log.matches("init memory wait: not enough free device memory")
            .count(),
        1,
        "{log}"
    );
    assert!(
        log.contains("outcome=\"freed\"") || log.contains("outcome=freed"),
        "{log}"
    );
    assert_eq!(c.lockd.holder("engine").as_deref(), Some("engine-1"));
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
}

#[test]
fn a_device_that_never_frees_times_out_counts_and_hits_the_crash_loop_limit() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let sim = c.dir.path().join("gpu-sim");
    simdev::set_total(&sim, 80 * GIB).expect("write DIR/total");
    let _holder = gpu_holder(&c, &sim, 70 * GIB);
    let sim_s = sim.to_str().expect("utf-8 temp path").to_string();
    let t0 = Instant::now();
    let mut s = c.start(
        &SupOpts::new(1, "shadow")
            .restart("on-failure")
            .sup(&[
                "--gpu-sim",
                &sim_s,
                "--init-min-free-memory",
                "50%",
                "--init-memory-timeout",
                "1s",
                "--restart-backoff",
                "100ms",
                "--crash-loop-limit",
                "2",
            ])
            .engine(&["--gpu-sim", &sim_s]),
    );
    // Incarnation 2 waits after two timeouts, each counted and restarted.
    let st = wait_state(&s, T, |d| d.incarnation == 2 && waiting(d))
        .unwrap_or_else(|| panic!("incarnation 2 never waited{}", c.dump_logs()));
    assert_eq!(st.waiting_need_bytes, Some(40 * GIB), "{st:?}");
    assert_eq!(st.waiting_free_bytes, Some(10 * GIB), "{st:?}");
    assert_eq!(st.restarts, 2);
    assert_eq!(s.probe("/live"), Some(200));
    let m = s.metrics();
    assert_eq!(
        m.get(
            "supervisor_init_memory_waits_total",
            &[("outcome", "timeout")]
        ),
        Some(2.0),
        "{m:?}"
    );
    assert_eq!(
        m.get(
            "supervisor_restarts_total",
            &[("reason", "init_memory_timeout")]
        ),
        Some(2.0),
        "{m:?}"
    );
    let status = s.proc.wait_exit(T).expect("supervisor did not give up");
    let took = t0.elapsed();
    let log = s.log_text();
    assert_eq!(status.code(), Some(20), "{status:?}{log}");
    assert!(
        took >= Duration::from_millis(3 * 1000 + 300),
        "three 1 s waits and two backoffs in {took:?}"
    );
    assert_eq!(
        log.matches("did not have the memory the engine needs to initialise in time")
            .count(),
        3,
        "{log}"
    );
    assert!(log.contains("crash_loop_limit"), "{log}");
    assert!(
        s.engine_pids().is_empty(),
        "an engine was spawned: {:?}",
        s.engine_pids()
    );
    eprintln!("never-freeing device: exit 20 after {took:?}");
}

#[test]
fn sigterm_during_the_init_memory_wait_exits_0_without_an_engine() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let sim = c.dir.path().join("gpu-sim");
    simdev::set_total(&sim, 80 * GIB).expect("write DIR/total");
    let _holder = gpu_holder(&c, &sim, 80 * GIB);
    let sim_s = sim.to_str().expect("utf-8 temp path").to_string();
    let mut s = c.start(
        &SupOpts::new(0, "primary")
            .restart("on-failure")
            .sup(&["--gpu-sim", &sim_s, "--init-min-free-memory", "1GiB"])
            .engine(&["--gpu-sim", &sim_s]),
    );
    let st = wait_state(&s, T, waiting)
        .unwrap_or_else(|| panic!("the first incarnation did not wait{}", c.dump_logs()));
    assert_eq!(st.incarnation, 0);
    assert_eq!(st.waiting_free_bytes, Some(0), "{st:?}");
    assert_eq!(st.waiting_timeout_ms, Some(600_000), "default 10m bound");
    assert!(st.lock_connected, "{st:?}");
    assert_eq!(s.probe("/startup"), Some(200));
    assert_eq!(s.probe("/live"), Some(200));
    assert_eq!(s.probe("/ready"), Some(503));
    let sent = Instant::now();
    assert!(s.proc.signal(Signal::SIGTERM));
    let status = s.proc.wait_exit(T).expect("supervisor did not stop");
    let took = sent.elapsed();
    let log = s.log_text();
    assert_eq!(status.code(), Some(0), "{status:?}{log}");
    assert!(took < Duration::from_secs(2), "stopped in {took:?}");
    assert!(
        log.contains("SIGTERM received during the init memory wait"),
        "{log}"
    );
    assert!(s.engine_pids().is_empty(), "an engine was spawned");
    // No lease was ever taken.
    assert_eq!(c.lockd.holder("engine"), None);
}

#[test]
fn without_a_device_the_flag_is_a_no_op_with_one_warning() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    // A primary finding the lock free goes Init -> Active (no wait, no device).
    let s = c.start(&SupOpts::new(0, "primary").sup(&["--init-min-free-memory", "90%"]));
    assert!(s.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let st = s.state().expect("/state");
    assert_eq!(st.waiting, None);
    let log = s.log_text();
    assert_eq!(
        log.matches("--init-min-free-memory has no effect").count(),
        1,
        "{log}"
    );
    let m = s.metrics();
    assert_eq!(
        m.get("supervisor_init_memory_wait_seconds_count", &[]),
        Some(0.0)
    );
}
