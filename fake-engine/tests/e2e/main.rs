//! fake-engine as the supervisor's end-to-end tests, the drill and the pod e2e run it: a real
//! process on a loopback port. (This test binary is also what makes `cargo test --workspace`
//! build the `fake-engine` binary the other crates' tests need.)

use std::process::Command;
use std::time::Duration;

use harness::http::{get, post_json, Response};

fn url(port: u16, path: &str) -> String {
    format!("http://127.0.0.1:{port}{path}")
}

fn sleeping(port: u16) -> bool {
    let r = get(&url(port, "/is_sleeping"), Duration::from_secs(5)).expect("/is_sleeping answers");
    assert_eq!(r.status, 200, "{r:?}");
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
    v["is_sleeping"]
        .as_bool()
        .expect("is_sleeping is a boolean")
}

fn completion(port: u16) -> Response {
    post_json(
        &url(port, "/v1/completions"),
        r#"{"prompt":"hi","max_tokens":1}"#,
        Duration::from_secs(5),
    )
    .expect("/v1/completions answers")
}

#[test]
fn sleeps_refuses_completions_wakes_and_serves() {
    let _g = harness::serial();
    let dir = tempfile::tempdir().unwrap();
    let port = harness::free_port();
    let mut cmd = Command::new(harness::must_bin("fake-engine"));
    cmd.args(["--port", &port.to_string(), "--engine-id", "7"]);
    let _engine = harness::Proc::spawn("fake-engine", cmd, dir.path().join("engine.log"));
    assert!(
        harness::wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            get(&url(port, "/health"), Duration::from_secs(1)).is_some_and(|r| r.status == 200)
        }),
        "fake-engine never answered /health"
    );
    assert!(!sleeping(port));
    let served = completion(port);
    assert_eq!(served.status, 200, "{served:?}");
    let v: serde_json::Value = serde_json::from_str(&served.body).unwrap();
    assert_eq!(v["engine_id"], 7, "{v}");

    let r = post_json(&url(port, "/sleep?level=1"), "", Duration::from_secs(5)).unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert!(sleeping(port));
    assert_eq!(completion(port).status, 503, "asleep: no completions");

    let r = post_json(&url(port, "/wake_up"), "", Duration::from_secs(5)).unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert!(!sleeping(port));
    assert_eq!(completion(port).status, 200);
}

#[test]
fn a_bad_flag_is_a_usage_error() {
    let out = Command::new(harness::must_bin("fake-engine"))
        .arg("--no-such-flag")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--no-such-flag"),
        "{out:?}"
    );
}
