//! The adapters follow the engines' documents against the fake engine's strict model (issue 10,
//! item 6), where skipping a documented step fails visibly (fake-engine's own tests show each
//! misuse: a plain wake after level 2 serves `"garbage": true`, a release with a request in
//! flight crashes SGLang, a generating `/health` outlasts a 1 s timeout):
//!
//! * vLLM `--sleep-level 2`: the shadow wakes through `/wake_up?tags=weights`,
//!   `/collective_rpc reload_weights`, `/wake_up?tags=kv_cache` and serves real text;
//! * SGLang: pause before release, resume before continue, under a steady load of completions
//!   sent straight to the shadow's engine (so some are in flight when it is put to sleep);
//! * SGLang health: the supervisor's sglang default timeout (25 s) passes a generating
//!   `/health`; an explicit 1 s does not; SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false makes
//!   1 s enough.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::{Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::Phase;

const T: Duration = Duration::from_secs(20);

fn assert_real_text(body: &serde_json::Value, engine_id: u64) {
    assert_eq!(body["engine_id"].as_u64(), Some(engine_id), "{body}");
    assert_eq!(body["garbage"], false, "{body}");
    assert!(
        body["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("served by engine")),
        "{body}"
    );
}

#[test]
fn vllm_level2_wake_reloads_weights_and_serves_text() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary").sup(&["--sleep-level", "2"]),
        &SupOpts::new(1, "shadow").sup(&["--sleep-level", "2"]),
        T,
    );
    assert!(primary.proc.signal(Signal::SIGTERM));
    assert!(shadow.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let (code, body) = shadow.completion().unwrap();
    assert_eq!(code, 200, "{body}");
    assert_real_text(&body, 1);
    let log = shadow.log_text();
    let at = |needle: &str| {
        log.find(needle)
            .unwrap_or_else(|| panic!("{needle:?} not in the shadow's log:\n{log}"))
    };
    assert!(
        at("fake_engine: weights reloaded") > at("fake_engine: sleeping"),
        "{log}"
    );
}

#[test]
fn sglang_pause_release_resume_continue_under_load() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    // SGLang's generating /health (the default) keeps the shadow's engine serving for a second
    // before the supervisor sees it up and puts it to sleep: the load below is in flight then.
    let engine = [
        "--personality",
        "sglang",
        "--enable-weights-cpu-backup",
        "--completion-time",
        "300ms",
    ];
    let primary = c.start(&SupOpts::new(0, "primary").adapter("sglang").engine(&engine));
    assert!(primary.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let shadow = c.start(&SupOpts::new(1, "shadow").adapter("sglang").engine(&engine));
    // Load straight at the shadow's engine from its first moment: requests are in flight when
    // the supervisor puts it to sleep, which SGLang's release asserts against.
    let stop = Arc::new(AtomicBool::new(false));
    let aborted = Arc::new(AtomicU32::new(0));
    let url = format!("http://{}/v1/completions", shadow.engine);
    let load: Vec<_> = (0..4)
        .map(|_| {
            let (stop, aborted, url) = (stop.clone(), aborted.clone(), url.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match harness::http::post_json(
                        &url,
                        r#"{"prompt":"x"}"#,
                        Duration::from_secs(1),
                    ) {
                        Some(r) if r.body.contains(r#""finish_reason":"abort""#) => {
                            aborted.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(_) => {}
                        None => std::thread::sleep(Duration::from_millis(10)),
                    }
                }
            })
        })
        .collect();
    let standby = shadow.wait_phase(Phase::Standby, T);
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.join().unwrap();
    }
    assert!(standby, "shadow not Standby{}", c.dump_logs());
    // The pause aborted what was in flight, so the release found the scheduler idle (else the
    // engine would have crashed and the shadow died).
    assert!(
        aborted.load(Ordering::Relaxed) > 0,
        "no request was in flight when the engine was paused{}",
        c.dump_logs()
    );
    let log = shadow.log_text();
    let at = |needle: &str, from: usize| {
        log[from..]
            .find(needle)
            .map(|i| i + from)
            .unwrap_or_else(|| panic!("{needle:?} not in the shadow's log:\n{log}"))
    };
    let paused = at("fake_engine: generation paused", 0);
    assert!(
        at("fake_engine: sleeping", 0) > paused,
        "released before pausing:\n{log}"
    );

    assert!(primary.proc.signal(Signal::SIGTERM));
    assert!(shadow.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let (code, body) = shadow.completion().unwrap();
    assert_eq!(code, 200, "{body}");
    assert_real_text(&body, 1);
    let log = shadow.log_text();
    let woken = log.find("fake_engine: woken").expect("resumed");
    let continued = log
        .find("fake_engine: generation continued")
        .expect("continued");
    assert!(continued > woken, "continued before resuming:\n{log}");
    assert!(c.violations().is_empty());
}

#[test]
fn sglang_health_needs_more_than_one_second_unless_generation_is_off() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    // SGLang's /health generates a token by default: 1 s is too short, the engine never
    // counts as up and the primary stays in Init.
    let short = c.start(
        &SupOpts::new(0, "primary")
            .adapter("sglang")
            .sup(&["--health-timeout", "1s"])
            .engine(&["--personality", "sglang"]),
    );
    assert!(
        harness::wait_until(T, Duration::from_millis(20), || short.phase().is_some()),
        "{}",
        c.dump_logs()
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(short.phase(), Some(Phase::Init), "{}", c.dump_logs());
    drop(short);

    // The sglang default (25 s) passes it, and Active stays ready.
    let default = c.start(
        &SupOpts::new(1, "primary")
            .adapter("sglang")
            .engine(&["--personality", "sglang"]),
    );
    assert!(default.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    assert!(
        harness::wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
            default.probe("/ready") == Some(200)
        }),
        "{}",
        c.dump_logs()
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(default.probe("/ready"), Some(200), "{}", c.dump_logs());
    assert_eq!(default.probe("/live"), Some(200));
    drop(default);

    // The chart's setting: generation off, 1 s is plenty.
    let off = c.start(
        &SupOpts::new(2, "primary")
            .adapter("sglang")
            .sup(&["--health-timeout", "1s"])
            .engine(&["--personality", "sglang", "--health-generation", "false"]),
    );
    assert!(off.wait_phase(Phase::Active, T), "{}", c.dump_logs());
}
