//! A real vLLM (its CPU build, prepared by `tests/real-vllm/setup`) behind two real
//! supervisors and a real lockd. One pod, one cold start, then every kill kind in turn:
//!
//! * cold start: primary Active, shadow asleep (`/is_sleeping` true);
//! * SIGKILL of the Active API server alone, of its EngineCore, of its Worker: the shadow is
//!   Active, every process of the old tree (pidfds opened before the kill) exited before the
//!   grant, a temperature-0 completion through the new engine equals the reference taken
//!   before, the old side comes back as a sleeping shadow; a request sent to the sleeping
//!   shadow before the first kill is answered after its wake;
//! * SIGTERM of the Active supervisor with a stream open: the shadow Active within
//!   [`STOP_BOUND`], the stream ended (closed by vLLM, or cut when vLLM leaves it open), the
//!   supervisor exits 0;
//! * the adapter's level-1 and level-2 sleep/wake sequences against the real server;
//! * nothing left behind: no process, no `/dev/shm` entry, no private `TMPDIR`.
//!
//! Its own test binary, so that nothing else runs beside two engines on two cores. Without
//! the prepared vLLM it records a SKIP (FAILOVER_SKIP_LOG) instead of passing.

mod stream;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use harness::vllm::{list_dir, ExitWatch, RealVllm, VllmTree, MODEL_NAME};
use harness::{kill, unix_us, wait_until, Cluster, Sup, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase};

/// Cold start of two engines at once on two cores (measured 60–130 s), and each re-arm.
const START: Duration = Duration::from_secs(420);
/// A failover after a kill.
const FAILOVER: Duration = Duration::from_secs(60);
/// SIGTERM of the Active supervisor with a stream open → the shadow Active (the target is
/// 2 s; the bound leaves room for a loaded CI machine).
const STOP_BOUND: Duration = Duration::from_secs(6);
const PROMPT: &str = "Hello, world! How are you";

#[derive(Clone, Copy, Debug)]
enum Kill {
    ApiServer,
    EngineCore,
    Worker,
}

struct Pod {
    c: Cluster,
    sups: Vec<Sup>,
}

impl Drop for Pod {
    fn drop(&mut self) {
        // Orphans of a killed API server are reparented to init: take the trees first.
        let pids: Vec<i32> = self
            .sups
            .iter()
            .flat_map(|s| VllmTree::of(s.proc.pid()).pids())
            .collect();
        for s in &mut self.sups {
            s.proc.kill();
        }
        for p in pids {
            kill(p, Signal::SIGKILL);
        }
    }
}

impl Pod {
    fn by_phase(&self, phase: Phase) -> Option<usize> {
        self.sups.iter().position(|s| s.phase() == Some(phase))
    }

    fn logs(&self) -> String {
        self.c.dump_logs()
    }
}

fn completion(engine: std::net::SocketAddr, timeout: Duration) -> Result<String, String> {
    let body = serde_json::json!({
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
    });
    let r = harness::http::post_json(
        &format!("http://{engine}/v1/completions"),
        &body.to_string(),
        timeout,
    )
    .ok_or("no answer")?;
    if r.status != 200 {
        return Err(format!("HTTP {}: {}", r.status, r.body));
    }
    let v: serde_json::Value = serde_json::from_str(&r.body).map_err(|e| e.to_string())?;
    v["choices"][0]["text"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("no text in {v}"))
}

fn is_sleeping(engine: std::net::SocketAddr) -> Option<bool> {
    let r = harness::http::get(
        &format!("http://{engine}/is_sleeping"),
        Duration::from_secs(5),
    )?;
    let v: serde_json::Value = serde_json::from_str(&r.body).ok()?;
    v["is_sleeping"].as_bool()
}

fn vllm_entries(dir: &Path) -> BTreeSet<String> {
    list_dir(dir)
        .into_iter()
        .filter(|n| n.starts_with("psm_") || n.starts_with("sem."))
        .collect()
}

#[test]
fn real_vllm_pod_survives_every_kill_kind() {
    const NAME: &str = "real_vllm_pod_survives_every_kill_kind";
    let vllm = match RealVllm::find() {
        Ok(v) => v,
        Err(why) => return harness::skip(NAME, &why),
    };
    let shm = Path::new("/dev/shm");
    let shm_before = vllm_entries(shm);
    let c = Cluster::new(Duration::from_secs(2));
    let tmp_base = c.dir.path().join("t");
    std::fs::create_dir_all(&tmp_base).unwrap();
    let tmp_arg = tmp_base.to_string_lossy().into_owned();
    let opts = |id, role| {
        SupOpts::new(id, role)
            .real_vllm(&vllm)
            .restart("on-failure")
            .sup(&[
                "--restart-backoff",
                "100ms",
                "--waking-timeout",
                "60s",
                "--sleep-timeout",
                "60s",
                "--stop-grace",
                "10s",
                "--engine-tmpdir",
                &tmp_arg,
                // The stopped supervisor's /state stays readable a moment after it fenced.
                "--linger",
                "2s",
            ])
    };
    let mut pod = Pod {
        c,
        sups: Vec::new(),
    };
    let t0 = Instant::now();
    pod.sups.push(pod.c.start(&opts(0, "primary")));
    pod.sups.push(pod.c.start(&opts(1, "shadow")));
    // Whichever engine is healthy first may take the lock: the shadow sleeps, then waits on
    // a free lock and is granted it at once; the primary then finds it held and sleeps.
    let up = wait_until(START, Duration::from_millis(100), || {
        pod.by_phase(Phase::Active).is_some() && pod.by_phase(Phase::Standby).is_some()
    });
    assert!(up, "cold start{}", pod.logs());
    eprintln!("cold start: {:.1} s", t0.elapsed().as_secs_f64());
    let a = pod.by_phase(Phase::Active).unwrap();
    assert_eq!(is_sleeping(pod.sups[1 - a].engine), Some(true));
    assert_eq!(is_sleeping(pod.sups[a].engine), Some(false));
    let reference = completion(pod.sups[a].engine, Duration::from_secs(30)).expect("reference");

    for (round, kind) in [Kill::ApiServer, Kill::EngineCore, Kill::Worker]
        .into_iter()
        .enumerate()
    {
        let a = pod.by_phase(Phase::Active).expect("an Active side");
        let s = 1 - a;
        assert_eq!(pod.sups[s].phase(), Some(Phase::Standby), "{}", pod.logs());
        let tree = VllmTree::of(pod.sups[a].proc.pid());
        assert!(tree.complete(), "vLLM tree incomplete: {tree:?}");
        // A request to the sleeping shadow: vLLM queues it and answers after the wake.
        let queued = (round == 0).then(|| {
            let e = pod.sups[s].engine;
            std::thread::spawn(move || completion(e, FAILOVER + START))
        });
        let watch = ExitWatch::start(&tree.pids());
        let victim = match kind {
            Kill::ApiServer => tree.api_server.unwrap(),
            Kill::EngineCore => tree.engine_core.unwrap(),
            Kill::Worker => tree.workers[0],
        };
        let killed_at = unix_us();
        assert!(
            kill(victim, Signal::SIGKILL),
            "{kind:?} {victim} already gone"
        );
        assert!(
            pod.sups[s].wait_phase(Phase::Active, FAILOVER),
            "{kind:?}: the shadow did not take over{}",
            pod.logs()
        );
        let new = pod.sups[s].state().unwrap();
        let granted = new.mark(MarkKind::LockGranted).expect("granted");
        let active = new.entered(Phase::Active).expect("active");
        let last_exit = watch.wait_all(Duration::from_secs(5)).unwrap_or_else(|| {
            panic!(
                "{kind:?}: old tree alive after the failover: {:?}",
                watch.exits()
            )
        });
        assert!(
            last_exit <= granted,
            "{kind:?}: an old process exited {} µs after the grant: {:?}",
            last_exit - granted,
            watch.exits()
        );
        eprintln!(
            "{kind:?}: kill→last old exit {:.0} ms, →grant {:.0} ms, →Active {:.0} ms (grant→Active {:.1} ms)",
            (last_exit - killed_at) as f64 / 1e3,
            (granted - killed_at) as f64 / 1e3,
            (active - killed_at) as f64 / 1e3,
            (active - granted) as f64 / 1e3,
        );
        let after = completion(pod.sups[s].engine, Duration::from_secs(30)).expect("after");
        assert_eq!(
            after, reference,
            "{kind:?}: another answer after the failover"
        );
        if let Some(q) = queued {
            let answer = q
                .join()
                .unwrap()
                .expect("the request sent to the sleeping shadow");
            assert_eq!(answer, reference);
        }
        // The old side re-armed as a sleeping shadow, its dead tree's TMPDIR gone.
        assert!(
            pod.sups[a].wait_phase(Phase::Standby, START),
            "{kind:?}: not re-armed{}",
            pod.logs()
        );
        assert_eq!(is_sleeping(pod.sups[a].engine), Some(true));
        assert_eq!(
            list_dir(&tmp_base).len(),
            2,
            "one private TMPDIR per live engine: {:?}",
            list_dir(&tmp_base)
        );
    }

    // A stop with a stream open: the engine's main process is signalled first, aborts the
    // stream cleanly and takes its tree down; the shadow is Active within STOP_BOUND.
    let a = pod.by_phase(Phase::Active).expect("an Active side");
    let s = 1 - a;
    let open = stream::open(pod.sups[a].engine, PROMPT, 400).expect("stream");
    let t_stop = Instant::now();
    let stop_us = unix_us();
    assert!(pod.sups[a].proc.signal(Signal::SIGTERM));
    assert!(
        pod.sups[s].wait_phase(Phase::Active, STOP_BOUND),
        "stop did not hand over within {STOP_BOUND:?}{}",
        pod.logs()
    );
    let took = t_stop.elapsed();
    let old = pod.sups[a].state().expect("the stopped supervisor lingers");
    let new = pod.sups[s].state().unwrap();
    let ms = |t: Option<i64>| t.map_or(f64::NAN, |t| (t - stop_us) as f64 / 1e3);
    eprintln!(
        "stop with a stream open: SIGTERM→tree reaped {:.0} ms, →lock closed {:.0} ms, →grant {:.0} ms, →shadow Active {:.0} ms",
        ms(old.mark(MarkKind::Fenced)),
        ms(old.mark(MarkKind::LockClosed)),
        ms(new.mark(MarkKind::LockGranted)),
        took.as_secs_f64() * 1e3
    );
    // vLLM 0.32 closes an open stream with `[DONE]` (finish_reason "abort") on SIGTERM, but
    // not always: when its output handler dies with the EngineCore first, the stream stays
    // open and the API server waits for the client; the supervisor SIGKILLs it half a second
    // after the rest of its tree is gone (MAIN_ALONE_GRACE) and the stream is cut. Either
    // way it must have ended, long before the stop grace (10 s).
    let end = open.finish(Duration::from_secs(5));
    assert!(
        end.ended && end.events >= 1,
        "the stream is still open: {end:?}"
    );
    eprintln!(
        "the stream at the stop: {}",
        if end.done {
            "closed by vLLM with [DONE]"
        } else {
            "cut (vLLM did not close it)"
        }
    );
    eprintln!(
        "stream at the stop: {} events, last: {}",
        end.events, end.last
    );
    assert_eq!(
        pod.sups[a].proc.wait_exit(START).and_then(|x| x.code()),
        Some(0)
    );

    // The adapter's sequences against the real server (level 1, then level 2 with the weights
    // reloaded): the same answer after each wake.
    let rt = tokio::runtime::Runtime::new().unwrap();
    for level in [1u8, 2] {
        let client = supervisor::adapter::EngineClient::new(
            &format!("http://{}", pod.sups[s].engine),
            supervisor::adapter::AdapterKind::Vllm.build(level),
        )
        .unwrap();
        rt.block_on(client.sleep(Duration::from_secs(60)))
            .unwrap_or_else(|e| panic!("level {level} sleep: {e}"));
        assert_eq!(is_sleeping(pod.sups[s].engine), Some(true));
        rt.block_on(client.wake(Duration::from_secs(60)))
            .unwrap_or_else(|e| panic!("level {level} wake: {e}"));
        let again = completion(pod.sups[s].engine, Duration::from_secs(30)).unwrap();
        assert_eq!(
            again, reference,
            "level {level}: another answer after the wake"
        );
    }

    // A clean end: nothing of any engine left.
    let last = VllmTree::of(pod.sups[s].proc.pid());
    assert!(pod.sups[s].proc.signal(Signal::SIGTERM));
    assert_eq!(
        pod.sups[s].proc.wait_exit(FAILOVER).and_then(|x| x.code()),
        Some(0)
    );
    assert!(
        wait_until(Duration::from_secs(5), Duration::from_millis(20), || last
            .pids()
            .iter()
            .all(|p| !procfs::alive(*p))),
        "engine processes left: {last:?}"
    );
    let left: Vec<String> = vllm_entries(shm).difference(&shm_before).cloned().collect();
    assert!(left.is_empty(), "/dev/shm leftovers: {left:?}");
    assert!(
        list_dir(&tmp_base).is_empty(),
        "TMPDIRs left: {:?}",
        list_dir(&tmp_base)
    );
}
