//! `lockd hold` behaves like flock(1): exports LOCKD_EPOCH/LOCKD_RESOURCE to CMD, exits with
//! CMD's status, exits 75 when --timeout passes, 127 when CMD does not exist, 69 when lockd
//! cannot be reached.
use crate::common::*;
use std::process::Command;
use std::time::{Duration, Instant};

fn hold_cmd(l: &Lockd, holder: &str, extra: &[&str], cmd: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args([
        "hold",
        "--connect",
        &l.endpoint(),
        "--resource",
        "engine",
        "--holder",
        holder,
    ])
    .args(extra)
    .arg("--")
    .args(cmd);
    c
}

#[test]
fn hold_exports_env_and_propagates_exit_codes() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let out = hold_cmd(
        &l,
        "a",
        &[],
        &["sh", "-c", "echo $LOCKD_RESOURCE:$LOCKD_EPOCH; exit 7"],
    )
    .output_within(CMD_LIMIT)
    .unwrap();
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "engine:1");
    let out = hold_cmd(&l, "a", &[], &["sh", "-c", "kill -TERM $$"])
        .output_within(CMD_LIMIT)
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(128 + 15),
        "killed by SIGTERM -> 143"
    );
    let out = hold_cmd(&l, "a", &[], &["/nonexistent/cmd"])
        .output_within(CMD_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
    // Epochs keep increasing across holds.
    let out = hold_cmd(&l, "a", &[], &["sh", "-c", "echo $LOCKD_EPOCH"])
        .output_within(CMD_LIMIT)
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "4");
}

#[test]
fn hold_times_out_with_75_while_the_lock_is_taken() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let fa = d.path().join("a.epoch");
    let _a = hold(&l, "engine", "a", &record_epoch_and_sleep(&fa), &[]);
    wait_epoch(&fa, Duration::from_secs(10));
    let t = Instant::now();
    let out = hold_cmd(&l, "b", &["--timeout", "300ms"], &["true"])
        .output_within(CMD_LIMIT)
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(75),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(t.elapsed() >= Duration::from_millis(250));
    assert!(String::from_utf8_lossy(&out.stderr).contains("timed out"));
    // The timed-out waiter left the queue.
    wait_waiters(&l, "engine", 0);
}

#[test]
fn hold_without_lockd_exits_69() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["hold", "--connect"])
        .arg(format!("unix:{}", d.path().join("nothing.sock").display()))
        .args(["--resource", "r", "--holder", "h", "--", "true"])
        .output_within(CMD_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(69));
    let out = Command::new(BIN)
        .args(["status", "--connect", "tcp:127.0.0.1:1"])
        .output_within(CMD_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(69));
}
