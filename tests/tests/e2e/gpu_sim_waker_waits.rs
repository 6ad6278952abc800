//! Issue 15 (split brain), the waker's pre-wake memory check on a simulated device shared
//! across processes (`supervisor run --gpu-sim DIR`, `gms_client::simdev`).
//!
//! Two real `supervisor run` processes (primary engine 0, shadow engine 1) wrap fake engines
//! and share one simulated device DIR (total 80 GiB); each fake engine allocates 30 GiB there
//! at load, releases it on sleep and allocates it again on wake, as vLLM does. The shadow's
//! supervisor measures what its engine released by sleeping (30 GiB). The test plays the dying
//! engine's lingering GPU memory: a helper process it owns (`sleep 30`, own process group)
//! registered in DIR with 60 GiB. The primary's engine is SIGKILLed; the shadow is granted the
//! lock, and its before-wake check (default `--min-free-memory auto`: the 30 GiB it released)
//! must keep it Waking while the helper lives (20 GiB free) and let it go Active only after the
//! helper died.
//!
//! This is the window the waker alone covers: the lock's socket can close microseconds before
//! the dying process's device files (the kernel closes a process's fds in fd-number order at
//! exit), so the old side's after-reap check cannot see it. To model that, the primary runs
//! with `--min-free-memory off`: its after-reap check then waits only for its own engine's
//! pids and memory (the helper is not one of them) and releases the lock at once; with the
//! default it would itself wait for its own device memory target and hold the lock, which is
//! the ordinary case, not the window.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use gms_client::simdev;
use harness::{holds_for, kill, unix_us, wait_until, Cluster, Proc, Sup, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase};

const T: Duration = Duration::from_secs(20);
const GIB: u64 = 1 << 30;
/// How long the helper keeps its memory after the shadow was granted.
const HOLD: Duration = Duration::from_millis(1500);
/// What each fake engine allocates on the simulated device while awake.
const ENGINE_BYTES: &str = "32212254720"; // 30 GiB

/// A primary (Active) and a shadow (Standby), both on the simulated device `sim`.
fn start_pair(c: &mut Cluster, sim: &Path) -> (Sup, Sup) {
    simdev::set_total(sim, 80 * GIB).expect("write DIR/total");
    let sim = sim.to_str().expect("utf-8 temp path");
    let engine = ["--gpu-sim", sim, "--gpu-sim-bytes", ENGINE_BYTES];
    let primary = c.start(
        &SupOpts::new(0, "primary")
            .sup(&[
                "--gpu-sim",
                sim,
                "--min-free-memory",
                "off",
                "--linger",
                "5s",
            ])
            .engine(&engine),
    );
    assert!(primary.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    // The shadow keeps the default --min-free-memory (auto).
    let shadow = c.start(
        &SupOpts::new(1, "shadow")
            .sup(&["--gpu-sim", sim, "--memory-release-timeout", "20s"])
            .engine(&engine),
    );
    assert!(shadow.wait_phase(Phase::Standby, T), "{}", c.dump_logs());
    assert!(
        wait_until(T, Duration::from_millis(10), || shadow
            .log_text()
            .contains("device memory it released")),
        "the shadow's supervisor did not measure its sleep{}",
        c.dump_logs()
    );
    assert!(
        shadow.log_text().contains("released=32212254720"),
        "{}",
        shadow.log_text()
    );
    (primary, shadow)
}

fn kill_primary_engine(primary: &Sup) {
    let pids = primary.wait_engine_pids(1, T);
    assert!(kill(pids[0], Signal::SIGKILL), "engine {} is gone", pids[0]);
}

#[test]
fn shadow_waits_for_the_dead_engines_memory_before_waking() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let sim = c.dir.path().join("gpu-sim");
    let (primary, shadow) = start_pair(&mut c, &sim);

    // The dying engine's memory that outlives the lock: 60 GiB of 80 held by a live process.
    let mut cmd = Command::new("sleep");
    cmd.arg("30");
    let mut holder = Proc::spawn("gpu-holder", cmd, c.dir.path().join("gpu-holder.log"));
    simdev::register(&sim, holder.pid() as u32, 60 * GIB).expect("register the holder");

    kill_primary_engine(&primary);
    assert!(
        shadow.wait_mark(MarkKind::GpuCheckStarted, T).is_some(),
        "shadow was not granted / did not start its check{}",
        c.dump_logs()
    );
    // While the holder lives the shadow stays Waking, in its check, never woken.
    holds_for(
        HOLD,
        Duration::from_millis(20),
        "shadow stays Waking while 60 GiB of 80 are held",
        || match shadow.phase() {
            Some(Phase::Waking) => Ok(()),
            other => Err(format!("{other:?}{}", c.dump_logs())),
        },
    );
    let st = shadow.state().expect("shadow /state");
    assert!(st.mark(MarkKind::GpuCheckPassed).is_none(), "{st:?}");

    let freed_at = unix_us();
    assert!(holder.signal(Signal::SIGKILL));
    assert!(holder.wait_exit(T).is_some(), "holder did not die");
    let freed_done = unix_us();
    assert!(
        shadow.wait_phase(Phase::Active, T),
        "shadow did not go Active after the memory came back{}",
        c.dump_logs()
    );
    let st = shadow.state().expect("shadow /state");
    let waking = st.entered(Phase::Waking).expect("waking transition");
    let active = st.entered(Phase::Active).expect("active transition");
    let started = st
        .mark(MarkKind::GpuCheckStarted)
        .expect("gpu_check_started");
    let passed = st.mark(MarkKind::GpuCheckPassed).expect("gpu_check_passed");
    // Woken only after the holder's death, and soon after it (poll period 100 ms).
    assert!(
        passed >= freed_at && active >= passed,
        "freed {freed_at} check passed {passed} active {active}"
    );
    assert!(
        active - freed_done < 3_000_000,
        "Active {} ms after the memory came back",
        (active - freed_done) / 1000
    );
    eprintln!(
        "check waited {} ms; Active {} ms after the holder was killed",
        (passed - started) / 1000,
        (active - freed_at) / 1000
    );
    assert!(started >= waking, "waking {waking} check started {started}");
    assert!(
        passed - started >= HOLD.as_micros() as i64,
        "the check waited only {} ms",
        (passed - started) / 1000
    );
    assert!(
        shadow.log_text().contains("waited for free device memory"),
        "{}",
        shadow.log_text()
    );
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
}

#[test]
fn without_lingering_memory_the_wake_does_not_wait() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let sim = c.dir.path().join("gpu-sim");
    let (primary, shadow) = start_pair(&mut c, &sim);
    kill_primary_engine(&primary);
    assert!(
        shadow.wait_phase(Phase::Active, T),
        "shadow did not take over{}",
        c.dump_logs()
    );
    let st = shadow.state().expect("shadow /state");
    let started = st
        .mark(MarkKind::GpuCheckStarted)
        .expect("gpu_check_started");
    let passed = st.mark(MarkKind::GpuCheckPassed).expect("gpu_check_passed");
    let waking = st.entered(Phase::Waking).expect("waking transition");
    let active = st.entered(Phase::Active).expect("active transition");
    eprintln!(
        "check took {} ms, Waking -> Active {} ms",
        (passed - started) / 1000,
        (active - waking) / 1000
    );
    assert!(
        passed - started < 1_000_000,
        "check waited {} ms with the device free",
        (passed - started) / 1000
    );
    assert!(
        active - waking < 1_000_000,
        "wake took {} ms",
        (active - waking) / 1000
    );
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
}
