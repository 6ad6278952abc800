//! The `supervisor` binary's command line and its early exits (real process).

use std::process::Command;
use std::time::{Duration, Instant};

use crate::shared;
use harness::free_port;

fn sup() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_supervisor"));
    for (k, _) in std::env::vars() {
        if k.starts_with("SUPERVISOR_") {
            c.env_remove(k);
        }
    }
    c
}

#[test]
fn missing_flags_is_a_usage_error() {
    let _process = shared();
    let out = sup().args(["run", "--engine-id", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--role"));
}

#[test]
fn unreachable_lockd_exits_17_without_spawning_the_engine() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("engine-ran");
    let t = Instant::now();
    let out = sup()
        .args(["run", "--engine-id", "1", "--role", "shadow"])
        .arg("--lock")
        .arg(format!("unix:{}", dir.path().join("no.sock").display()))
        .args(["--probes", &format!("127.0.0.1:{}", free_port())])
        .args(["--adapter", "vllm", "--engine-url", "http://127.0.0.1:1"])
        // Exit right after the first incarnation (the default re-arms: issue 10).
        .args(["--lock-wait", "300ms", "--restart", "never", "--", "touch"])
        .arg(&marker)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(17), "{out:?}");
    assert!(t.elapsed() < Duration::from_secs(10));
    assert!(String::from_utf8_lossy(&out.stderr).contains("lockd unreachable"));
    assert!(
        !marker.exists(),
        "the engine must not start without the lock connection"
    );
}

#[test]
fn flags_read_from_env_and_bad_durations_are_rejected() {
    let _process = shared();
    let out = sup()
        .args([
            "run",
            "--role",
            "shadow",
            "--lock",
            "unix:/x",
            "--probes",
            "127.0.0.1:1",
        ])
        .args(["--adapter", "vllm", "--engine-url", "http://127.0.0.1:1"])
        .args(["--waking-timeout", "soon", "--", "true"])
        .env("SUPERVISOR_ENGINE_ID", "3")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--waking-timeout"), "{err}");
    assert!(
        !err.contains("--engine-id"),
        "engine id came from the env: {err}"
    );
}

#[test]
fn gpu_flags_parse_and_step_aside_without_a_driver() {
    let _process = shared();
    let bad = sup()
        .args(["run", "--engine-id", "1", "--role", "shadow"])
        .args(["--lock", "unix:/nonexistent", "--probes", "127.0.0.1:1"])
        .args(["--adapter", "vllm", "--engine-url", "http://127.0.0.1:1"])
        .args(["--min-free-memory", "lots", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("byte count"));

    // Valid GPU flags (env and command line); no GPU driver on CI machines: the checks say so
    // once and step aside, the run proceeds (here: to the lockd-unreachable exit).
    let dir = tempfile::tempdir().unwrap();
    let out = sup()
        .env("SUPERVISOR_MIN_FREE_MEMORY", "40GiB")
        .env("SUPERVISOR_MEMORY_RELEASE_TIMEOUT", "2s")
        .args(["run", "--engine-id", "1", "--role", "shadow", "--gpu", "0"])
        .args(["--gms-handshake-timeout", "500ms"])
        .arg("--lock")
        .arg(format!("unix:{}", dir.path().join("no.sock").display()))
        .args(["--probes", &format!("127.0.0.1:{}", free_port())])
        .args(["--adapter", "vllm", "--engine-url", "http://127.0.0.1:1"])
        .args(["--lock-wait", "300ms", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(17), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    let has_driver = std::path::Path::new("/dev/nvidiactl").exists();
    let said = err.matches("GPU device checks are off").count();
    if has_driver {
        // A driver may still fail to load (no NVML library): then it is said once, never more.
        assert!(said <= 1, "{err}");
    } else {
        assert_eq!(said, 1, "{err}");
    }
}
