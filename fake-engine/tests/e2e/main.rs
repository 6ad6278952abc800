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

/// A fake engine on a loopback port, answering `/health` (bounded wait).
struct Fake {
    proc: harness::Proc,
    port: u16,
    _dir: tempfile::TempDir,
}

fn start(args: &[&str]) -> Fake {
    let dir = tempfile::tempdir().unwrap();
    let port = harness::free_port();
    let mut cmd = Command::new(harness::must_bin("fake-engine"));
    cmd.args(["--port", &port.to_string()]).args(args);
    // The test runner's environment must not configure the engine.
    for k in [
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION",
        "SGLANG_HEALTH_CHECK_TIMEOUT",
    ] {
        cmd.env_remove(k);
    }
    let proc = harness::Proc::spawn("fake-engine", cmd, dir.path().join("engine.log"));
    assert!(
        harness::wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            get(&url(port, "/health"), Duration::from_secs(3)).is_some_and(|r| r.status == 200)
        }),
        "fake-engine never answered /health"
    );
    Fake {
        proc,
        port,
        _dir: dir,
    }
}

fn post(port: u16, path: &str, body: &str) -> Response {
    post_json(&url(port, path), body, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("POST {path} did not answer"))
}

fn json(r: &Response) -> serde_json::Value {
    serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("not JSON ({e}): {r:?}"))
}

/// A completion sent from another thread with a generous timeout.
fn completion_in_background(port: u16) -> std::thread::JoinHandle<Option<Response>> {
    std::thread::spawn(move || {
        post_json(
            &url(port, "/v1/completions"),
            r#"{"prompt":"hi","max_tokens":1}"#,
            Duration::from_secs(15),
        )
    })
}

fn assert_serves_text(port: u16) {
    let r = completion(port);
    assert_eq!(r.status, 200, "{r:?}");
    let v = json(&r);
    assert_eq!(v["garbage"], false, "{v}");
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("served by engine")),
        "{v}"
    );
}

/// vLLM pauses scheduling while asleep (docs/features/sleep_mode.md): a completion waits for
/// the wake instead of failing; the client's own timeout bounds it.
#[test]
fn sleeps_holds_completions_until_wake_and_serves() {
    let _g = harness::serial();
    let f = start(&["--engine-id", "7"]);
    let port = f.port;
    assert!(!sleeping(port));
    let served = completion(port);
    assert_eq!(served.status, 200, "{served:?}");
    let v: serde_json::Value = serde_json::from_str(&served.body).unwrap();
    assert_eq!(v["engine_id"], 7, "{v}");

    let r = post_json(&url(port, "/sleep?level=1"), "", Duration::from_secs(5)).unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert!(sleeping(port));
    // Asleep: no answer within the client's timeout (the engine is up: /is_sleeping answers).
    let held = post_json(
        &url(port, "/v1/completions"),
        r#"{"prompt":"hi","max_tokens":1}"#,
        Duration::from_millis(700),
    );
    assert_eq!(held, None, "asleep: a completion waits for the wake");
    assert!(sleeping(port));
    // One that waits long enough is served once the engine wakes.
    let waiting = completion_in_background(port);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiting.is_finished(), "served while asleep");

    let r = post_json(&url(port, "/wake_up"), "", Duration::from_secs(5)).unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert!(!sleeping(port));
    let r = waiting
        .join()
        .unwrap()
        .expect("the held completion is served after the wake");
    assert_eq!(r.status, 200, "{r:?}");
    assert_serves_text(port);
}

/// vLLM level 2 discards the weights: a plain `/wake_up` serves garbage; the documented
/// sequence (wake weights, reload them, wake the KV cache) serves text.
#[test]
fn level2_needs_the_reload_sequence() {
    let _g = harness::serial();
    let f = start(&[]);
    let port = f.port;
    assert_eq!(post(port, "/sleep?level=2", "").status, 200);
    assert!(sleeping(port));
    assert_eq!(post(port, "/wake_up", "").status, 200);
    assert!(!sleeping(port));
    let v = json(&completion(port));
    assert_eq!(v["garbage"], true, "plain wake after level 2: {v}");
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| t.contains("GARBAGE")),
        "{v}"
    );

    assert_eq!(post(port, "/sleep?level=2&mode=abort", "").status, 200);
    assert_eq!(post(port, "/wake_up?tags=weights", "").status, 200);
    assert!(sleeping(port), "KV cache still asleep");
    let r = post(port, "/collective_rpc", r#"{"method":"reload_weights"}"#);
    assert_eq!(r.status, 200, "{r:?}");
    assert!(sleeping(port));
    assert_eq!(post(port, "/wake_up?tags=kv_cache", "").status, 200);
    assert!(!sleeping(port));
    assert_serves_text(port);
}

/// `reload_weights` into weight memory that is not mapped again kills the engine.
#[test]
fn reload_before_the_weights_wake_kills_the_engine() {
    let _g = harness::serial();
    let f = start(&[]);
    let port = f.port;
    assert_eq!(post(port, "/sleep?level=2", "").status, 200);
    let r = post(port, "/collective_rpc", r#"{"method":"reload_weights"}"#);
    assert_eq!(r.status, 500, "{r:?}");
    let h = get(&url(port, "/health"), Duration::from_secs(5)).unwrap();
    assert_eq!(h.status, 503, "engine dead after the failed reload: {h:?}");
}

/// `/sleep?mode=abort` aborts a request in flight (partial result, finish_reason abort);
/// `mode=wait` lets it finish first.
#[test]
fn sleep_modes_abort_or_wait_for_requests_in_flight() {
    let _g = harness::serial();
    let f = start(&["--completion-time", "2s"]);
    let port = f.port;
    let inflight = completion_in_background(port);
    std::thread::sleep(Duration::from_millis(300));
    let t = std::time::Instant::now();
    assert_eq!(post(port, "/sleep?level=1&mode=abort", "").status, 200);
    assert!(t.elapsed() < Duration::from_secs(1), "abort waited");
    let r = inflight.join().unwrap().expect("aborted request answered");
    assert_eq!(json(&r)["choices"][0]["finish_reason"], "abort", "{r:?}");
    assert_eq!(post(port, "/wake_up", "").status, 200);

    let inflight = completion_in_background(port);
    std::thread::sleep(Duration::from_millis(300));
    let t = std::time::Instant::now();
    assert_eq!(post(port, "/sleep?level=1&mode=wait", "").status, 200);
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "wait did not wait: {:?}",
        t.elapsed()
    );
    let r = inflight.join().unwrap().expect("finished request answered");
    assert_eq!(json(&r)["choices"][0]["finish_reason"], "stop", "{r:?}");
}

/// SGLang asserts the scheduler is idle on release: a request in flight crashes the server.
#[test]
fn sglang_release_with_a_request_in_flight_crashes() {
    let _g = harness::serial();
    let mut f = start(&[
        "--personality",
        "sglang",
        "--health-generation",
        "false",
        "--completion-time",
        "5s",
    ]);
    let port = f.port;
    let _inflight = completion_in_background(port);
    std::thread::sleep(Duration::from_millis(300));
    let r = post_json(
        &url(port, "/release_memory_occupation"),
        "{}",
        Duration::from_secs(5),
    );
    if let Some(r) = &r {
        assert_eq!(r.status, 500, "{r:?}");
        assert!(r.body.contains("AssertionError"), "{r:?}");
    }
    let st = f.proc.wait_exit(Duration::from_secs(5));
    assert!(
        st.is_some_and(|s| !s.success()),
        "engine did not exit after the failed assertion: {st:?}"
    );
}

/// The documented SGLang order: pause (aborting what is in flight), release, resume, continue.
/// Paused, `/is_sleeping` is true and completions wait; without a CPU backup the resumed
/// weights are garbage.
#[test]
fn sglang_pause_release_resume_continue() {
    let _g = harness::serial();
    for backup in [true, false] {
        let mut args = vec![
            "--personality",
            "sglang",
            "--health-generation",
            "false",
            "--completion-time",
            "3s",
        ];
        if backup {
            args.push("--enable-weights-cpu-backup");
        }
        let f = start(&args);
        let port = f.port;
        let inflight = completion_in_background(port);
        std::thread::sleep(Duration::from_millis(300));
        let r = post(port, "/pause_generation", r#"{"mode":"abort"}"#);
        assert_eq!(r.status, 200, "{r:?}");
        let r = inflight.join().unwrap().expect("aborted request answered");
        assert_eq!(json(&r)["choices"][0]["finish_reason"], "abort", "{r:?}");
        assert!(sleeping(port), "/is_sleeping reads true while paused");
        let r = post(
            port,
            "/release_memory_occupation",
            r#"{"tags":["kv_cache","weights"]}"#,
        );
        assert_eq!(r.status, 200, "{r:?}");
        let held = completion_in_background(port);
        std::thread::sleep(Duration::from_millis(300));
        let r = post(
            port,
            "/resume_memory_occupation",
            r#"{"tags":["weights","kv_cache"]}"#,
        );
        assert_eq!(r.status, 200, "{r:?}");
        std::thread::sleep(Duration::from_millis(200));
        assert!(!held.is_finished(), "served before continue_generation");
        assert!(sleeping(port), "still paused");
        assert_eq!(post(port, "/continue_generation", "{}").status, 200);
        assert!(!sleeping(port));
        let r = held
            .join()
            .unwrap()
            .expect("held request served after continue");
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(json(&r)["garbage"], !backup, "backup={backup}: {r:?}");
    }
}

/// SGLang's generating `/health` answers after 1 s at the earliest; with
/// SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false at once.
#[test]
fn sglang_health_generates_a_token_unless_disabled() {
    let _g = harness::serial();
    let f = start(&["--personality", "sglang"]);
    let t = std::time::Instant::now();
    let r = get(&url(f.port, "/health"), Duration::from_secs(5)).unwrap();
    assert_eq!(r.status, 200);
    assert!(t.elapsed() >= Duration::from_secs(1), "{:?}", t.elapsed());
    let quick = get(&url(f.port, "/health"), Duration::from_millis(900));
    assert_eq!(
        quick, None,
        "a 900 ms health timeout fails a generating /health"
    );
    drop(f);

    let f = start(&["--personality", "sglang", "--health-generation", "false"]);
    let t = std::time::Instant::now();
    let r = get(&url(f.port, "/health"), Duration::from_secs(5)).unwrap();
    assert_eq!(r.status, 200);
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
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
