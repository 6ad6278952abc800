//! `gms_client::checks`: GMS checks against real gmsd processes; device checks on a
//! simulated device whose process list and free memory the tests control.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use gms_client::checks::*;
use gms_client::protocol::RequestedLockType;

const GIB: u64 = 1 << 30;
const LIMIT: Duration = Duration::from_secs(60);

fn load(sock: &str, count: &str) -> String {
    let (code, out, err) = gmsctl(&[
        "load", "--socket", sock, "--count", count, "--size", "100000",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    v["memory_layout_hash"].as_str().unwrap().to_string()
}

fn gms_cfg(socket: &std::path::Path, handshake: Duration) -> ChecksConfig {
    ChecksConfig {
        gms_socket: Some(socket.to_path_buf()),
        handshake_timeout: handshake,
        ..ChecksConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_wake_fails_fast_when_gms_restarted_empty() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let mut g = Gmsd::start(dir.path(), "gms.sock");
    let sock = g.socket.clone();
    let s = sock.to_str().unwrap().to_string();
    let hash = tokio::task::spawn_blocking(move || load(&s, "3"))
        .await
        .unwrap();
    let handshake = Duration::from_secs(5);
    let checks = GpuChecks::with_device(gms_cfg(&sock, handshake), None);
    let run = async {
        let snap = checks.at_standby().await.unwrap().unwrap();
        assert_eq!(snap.memory_layout_hash, hash);
        assert_eq!(snap.allocation_count, 3);
        // Healthy: before_wake passes and releases its read lock.
        let rep = checks.before_wake().await.unwrap();
        assert_eq!(rep.layout, Some(snap.clone()));
        let rs = client(&sock).await.runtime_state().await.unwrap();
        assert_eq!((rs.state.as_str(), rs.ro_session_count), ("COMMITTED", 0));
        // The GMS dies and comes back empty while we "sleep".
        g.kill9();
        let _g2 = Gmsd::start_at(&sock);
        let t0 = Instant::now();
        let err = checks.before_wake().await.unwrap_err();
        let took = t0.elapsed();
        assert_eq!(
            err,
            CheckError::GmsNotCommitted {
                state: "EMPTY".into()
            }
        );
        assert!(err.to_string().contains("no committed weights"), "{err}");
        assert!(took < handshake, "failed fast: {took:?}");
        assert_eq!(checks.counters().wake_failures, 1);
        assert_eq!(checks.counters().wake_checks, 2);
    };
    tokio::time::timeout(LIMIT, run).await.expect("timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_wake_detects_a_stale_layout_and_a_vanished_gms() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let mut g = Gmsd::start(dir.path(), "gms.sock");
    let sock = g.socket.clone();
    let checks = GpuChecks::with_device(gms_cfg(&sock, Duration::from_secs(3)), None);
    let run = async {
        let s = sock.to_str().unwrap().to_string();
        tokio::task::spawn_blocking(move || load(&s, "2"))
            .await
            .unwrap();
        checks.at_standby().await.unwrap();
        // Another engine loads different weights into the (same) GMS.
        let s = sock.to_str().unwrap().to_string();
        tokio::task::spawn_blocking(move || load(&s, "5"))
            .await
            .unwrap();
        let err = checks.before_wake().await.unwrap_err();
        assert!(matches!(err, CheckError::StaleLayout { .. }), "{err}");
        assert!(err.to_string().contains("5 allocations"), "{err}");
        // GMS gone for good: unreachable, still bounded by the handshake timeout.
        g.kill9();
        let t0 = Instant::now();
        let err = checks.before_wake().await.unwrap_err();
        assert!(matches!(err, CheckError::GmsUnreachable { .. }), "{err}");
        assert!(err.to_string().contains("unreachable"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    };
    tokio::time::timeout(LIMIT, run).await.expect("timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_wake_read_lock_is_bounded_by_the_handshake_timeout() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let sock = g.socket.clone();
    let checks = GpuChecks::with_device(gms_cfg(&sock, Duration::from_millis(400)), None);
    let run = async {
        let s = sock.to_str().unwrap().to_string();
        tokio::task::spawn_blocking(move || load(&s, "1"))
            .await
            .unwrap();
        checks.at_standby().await.unwrap();
        // A reader holds it and a writer waits: new readers are not admitted.
        let (_r, _w) = reader_and_waiting_writer(&sock).await;
        let t0 = Instant::now();
        let err = checks.before_wake().await.unwrap_err();
        assert!(matches!(err, CheckError::GmsLockTimeout { .. }), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    };
    tokio::time::timeout(LIMIT, run).await.expect("timed out");
}

fn sim_checks(dev: &Arc<SimulatedDevice>, ns: PidNamespace, release: Duration) -> GpuChecks {
    let cfg = ChecksConfig {
        memory_release_timeout: release,
        poll_interval: Duration::from_millis(10),
        memory_tolerance: 0,
        pid_namespace: ns,
        ..ChecksConfig::default()
    };
    GpuChecks::with_device(cfg, Some(dev.clone() as Arc<dyn Device>))
}

#[tokio::test]
async fn after_reap_waits_until_the_engine_processes_leave_and_memory_returns() {
    let dev = Arc::new(SimulatedDevice::new(80 * GIB));
    dev.add_process(10, 5 * GIB); // the sleeping shadow: not ours
    dev.add_process(100, 20 * GIB); // engine
    dev.add_process(101, 20 * GIB); // its TP worker
    let checks = sim_checks(&dev, PidNamespace::Host, Duration::from_secs(5));
    let d = dev.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        d.remove_process(100);
        tokio::time::sleep(Duration::from_millis(200)).await;
        d.remove_process(101);
    });
    let t0 = Instant::now();
    let rep = checks.after_reap(&[100, 101, 102]).await.unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(390),
        "held until both left"
    );
    assert_eq!(rep.matched_by, MatchMode::Pid);
    assert_eq!(rep.engine_processes_seen, 2);
    assert_eq!(rep.free_before, Some(35 * GIB));
    assert_eq!(rep.free_after, Some(75 * GIB));
    assert!(rep.samples >= 3);
    assert_eq!(checks.counters().engine_processes_seen, 2);
    assert_eq!(checks.counters().reap_checks, 1);
}

#[tokio::test]
async fn after_reap_is_bounded_when_the_processes_never_leave() {
    let dev = Arc::new(SimulatedDevice::new(80 * GIB));
    dev.add_process(100, 20 * GIB);
    let checks = sim_checks(&dev, PidNamespace::Host, Duration::from_millis(300));
    let t0 = Instant::now();
    let err = checks.after_reap(&[100]).await.unwrap_err();
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    match err {
        CheckError::MemoryNotReleased {
            pids_still_present, ..
        } => assert_eq!(pids_still_present, vec![100]),
        other => panic!("{other}"),
    }
    assert_eq!(checks.counters().reap_timeouts, 1);
}

#[tokio::test]
async fn after_reap_waits_for_memory_still_pinned_after_the_process_left() {
    // Decision 7: a surviving handle keeps the memory although the process is gone.
    let dev = Arc::new(SimulatedDevice::new(80 * GIB));
    dev.add_process(100, 20 * GIB);
    let checks = sim_checks(&dev, PidNamespace::Host, Duration::from_millis(300));
    // The process leaves the list but its 20 GiB stay pinned: bounded failure naming
    // free vs target.
    let d = dev.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        d.remove_process_keep_memory(100);
    });
    let err = checks.after_reap(&[100]).await.unwrap_err();
    match err {
        CheckError::MemoryNotReleased {
            pids_still_present,
            free,
            target,
            ..
        } => {
            assert!(pids_still_present.is_empty(), "the process itself is gone");
            assert_eq!((free, target), (60 * GIB, 80 * GIB));
        }
        other => panic!("{other}"),
    }
    // With a baseline from before_wake, the memory coming back ends the wait.
    let dev2 = Arc::new(SimulatedDevice::new(80 * GIB));
    let checks2 = sim_checks(&dev2, PidNamespace::Host, Duration::from_secs(5));
    checks2.before_wake().await.unwrap(); // baseline: 80 GiB free
    dev2.add_process(100, 20 * GIB);
    dev2.remove_process_keep_memory(100);
    let d2 = dev2.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        d2.set_free(80 * GIB);
    });
    let t0 = Instant::now();
    let rep = checks2.after_reap(&[100]).await.unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(190));
    assert_eq!(rep.free_after, Some(80 * GIB));
}

#[tokio::test]
async fn after_reap_matches_by_count_when_pid_namespaces_differ() {
    let dev = Arc::new(SimulatedDevice::new(80 * GIB));
    dev.add_process(5010, 5 * GIB); // shadow, host pid
    dev.add_process(5100, GIB); // our engine before wake, host pid
    let checks = sim_checks(&dev, PidNamespace::Foreign, Duration::from_secs(5));
    checks.before_wake().await.unwrap(); // baseline: 2 processes, 74 GiB free
                                         // The engine wakes and takes KV cache; then dies.
    dev.remove_process(5100);
    dev.add_process(5100, 30 * GIB);
    let d = dev.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        d.remove_process(5100);
    });
    // The supervisor knows the engine as pid 7 in its own namespace: no pid matches.
    let t0 = Instant::now();
    let rep = checks.after_reap(&[7]).await.unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(190));
    assert_eq!(rep.matched_by, MatchMode::Count);
    assert_eq!(rep.free_after, Some(75 * GIB));
}

#[tokio::test]
async fn before_wake_waits_bounded_for_min_free_memory() {
    let dev = Arc::new(SimulatedDevice::new(80 * GIB));
    dev.add_process(100, 70 * GIB);
    let mut cfg = ChecksConfig {
        memory_release_timeout: Duration::from_millis(300),
        poll_interval: Duration::from_millis(10),
        min_free_memory: MinFree::Bytes(40 * GIB),
        ..ChecksConfig::default()
    };
    let checks = GpuChecks::with_device(cfg.clone(), Some(dev.clone() as Arc<dyn Device>));
    let err = checks.before_wake().await.unwrap_err();
    assert_eq!(
        err,
        CheckError::InsufficientFreeMemory {
            need: 40 * GIB,
            free: 10 * GIB,
            after: Duration::from_millis(300)
        }
    );
    cfg.memory_release_timeout = Duration::from_secs(5);
    let checks = GpuChecks::with_device(cfg, Some(dev.clone() as Arc<dyn Device>));
    let d = dev.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(150)).await;
        d.remove_process(100);
    });
    let rep = checks.before_wake().await.unwrap();
    assert_eq!(rep.free_memory, Some(80 * GIB));
    assert!(rep.waited >= Duration::from_millis(140));
}

#[tokio::test]
async fn without_a_driver_device_checks_step_aside() {
    let cfg = ChecksConfig {
        gpu: Some(0),
        ..ChecksConfig::default()
    };
    let checks = GpuChecks::new(cfg);
    let nvml_here = NvmlDevice::open(0).is_ok();
    assert_eq!(checks.device_checks_enabled(), nvml_here);
    if !nvml_here {
        let rep = checks.after_reap(&[1, 2]).await.unwrap();
        assert_eq!(rep.matched_by, MatchMode::NoDevice);
        let rep = checks.before_wake().await.unwrap();
        assert_eq!(rep.free_memory, None);
        assert_eq!(rep.layout, None);
    }
    // No --gms: at_standby has nothing to remember.
    assert_eq!(checks.at_standby().await.unwrap(), None);
}

#[test]
fn weight_loading_roles_follow_decision_5() {
    let e0 = weight_loading_env(0);
    let e1 = weight_loading_env(1);
    let get = |e: &Vec<(String, String)>, k: &str| {
        e.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap()
    };
    assert_eq!(get(&e0, "ENGINE_ID"), "0");
    assert_eq!(get(&e0, "GMS_LOCK_TYPE"), "rw_or_ro");
    assert_eq!(get(&e0, "ENGINE_ROLE"), "primary");
    assert_eq!(get(&e1, "ENGINE_ID"), "1");
    assert_eq!(get(&e1, "GMS_LOCK_TYPE"), "ro");
    assert_eq!(get(&e1, "ENGINE_ROLE"), "shadow");
    assert_eq!(weight_loading_lock(0), RequestedLockType::RwOrRo);
    assert_eq!(weight_loading_lock(7), RequestedLockType::Ro);
}

#[test]
fn host_namespace_detection_parses_the_link() {
    // The initial PID namespace has the fixed inode 0xEFFFFFFC = 4026531836.
    assert!(is_host_pid_ns_link("pid:[4026531836]"));
    assert!(!is_host_pid_ns_link("pid:[4026532000]"));
    assert!(!is_host_pid_ns_link("pid:[4026531836"));
    assert!(!is_host_pid_ns_link("net:[4026531836]"));
    assert!(!is_host_pid_ns_link("pid:[]"));
    assert!(!is_host_pid_ns_link(""));
}

#[test]
fn a_child_in_a_new_pid_namespace_is_not_in_the_host_namespace() {
    const TEST: &str = "checks::a_child_in_a_new_pid_namespace_is_not_in_the_host_namespace";
    let _process = shared();
    // This process may or may not run in the host's namespace (a container does not); a
    // child in a namespace of its own certainly does not. Needs CAP_SYS_ADMIN.
    let out = std::process::Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount-proc",
            "readlink",
            "/proc/self/ns/pid",
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => {
            let link = String::from_utf8_lossy(&o.stdout).trim().to_string();
            assert!(link.starts_with("pid:["), "{link}");
            assert!(!is_host_pid_ns_link(&link), "{link}");
            let mine = std::fs::read_link("/proc/self/ns/pid").unwrap();
            assert_ne!(
                link,
                mine.to_string_lossy(),
                "unshare gave no new namespace"
            );
        }
        Ok(o) => harness::skip(
            TEST,
            &format!(
                "unshare --pid failed (needs CAP_SYS_ADMIN): {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ),
        ),
        Err(e) => harness::skip(TEST, &format!("no unshare(1): {e}")),
    }
}
