//! `failover-bench`: measures engine SIGKILL -> shadow `/ready` 200 over many failovers with
//! real lockd, supervisors and fake engines (`--wake 0ms`), with a breakdown from the `/state`
//! wall-clock marks, and `/live` latency under a 500 req/s probe load during failovers.
//!
//! ```text
//! cargo build --release --workspace --bins
//! ./target/release/failover-bench --iterations 50 --report failover-bench.json
//! ```
//! Each round runs the iterations twice: once without probe load, once with a thread
//! sending `GET /live` (new connection each, like kubelet) to the shadow at `--live-rps`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use harness::stats::percentile_of;
use harness::{kill, unix_us, wait_until, Cluster, Sup, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase as SupPhase};

/// Failover benchmark.
#[derive(Debug, Parser)]
#[command(name = "failover-bench")]
struct Args {
    /// Failovers per phase (two phases: without and with /live load).
    #[arg(long, env = "FAILOVER_BENCH_ITERATIONS", default_value_t = 50)]
    iterations: usize,
    /// /live requests per second during the loaded phase.
    #[arg(long, env = "FAILOVER_BENCH_LIVE_RPS", default_value_t = 500)]
    live_rps: u32,
    /// Write a JSON report here.
    #[arg(long, env = "FAILOVER_BENCH_REPORT")]
    report: Option<std::path::PathBuf>,
}

/// One failover's timings in microseconds after the SIGKILL.
#[derive(Debug, Clone, Default, serde::Serialize)]
struct Sample {
    /// Old supervisor saw the engine exit (pidfd).
    detected: i64,
    /// Old tree killed and reaped.
    reaped: i64,
    /// Old lock connection closed.
    released: i64,
    /// Shadow's lock granted.
    granted: i64,
    /// Shadow entered Active (wake confirmed).
    woken: i64,
    /// `/ready` 200 observed by this benchmark (1 ms polling).
    ready: i64,
}

const T: Duration = Duration::from_secs(30);

/// Nearest-rank percentile of `v` (µs) in milliseconds; NaN for no samples.
fn pct(v: &mut [i64], p: f64) -> f64 {
    percentile_of(v, p).map_or(f64::NAN, |x| x as f64 / 1000.0)
}

fn start(c: &mut Cluster, id: u32, role: &'static str) -> Sup {
    let s = c.start(
        &SupOpts::new(id, role)
            .sup(&["--linger", "1s"])
            .engine(&["--wake", "0ms", "--sleep", "0ms"]),
    );
    let want = if role == "primary" {
        SupPhase::Active
    } else {
        SupPhase::Standby
    };
    assert!(
        s.wait_phase(want, T),
        "engine {id} not {want:?}{}",
        c.dump_logs()
    );
    s
}

/// Runs `GET /live` against `addr` at `rps` until stopped; returns latencies in us and errors.
fn live_load(
    addr: std::net::SocketAddr,
    rps: u32,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(Vec<i64>, usize)> {
    std::thread::spawn(move || {
        let period = Duration::from_secs_f64(1.0 / f64::from(rps.max(1)));
        let mut next = Instant::now();
        let mut lat = Vec::new();
        let mut errors = 0;
        while !stop.load(Ordering::Relaxed) {
            let t = Instant::now();
            match harness::http::get(&format!("http://{addr}/live"), Duration::from_secs(1)) {
                Some(_) => lat.push(t.elapsed().as_micros() as i64),
                None => errors += 1,
            }
            next += period;
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            } else {
                next = now;
            }
        }
        (lat, errors)
    })
}

/// Results of one phase (a series of failovers).
struct Phase {
    /// One breakdown per failover.
    samples: Vec<Sample>,
    /// `/live` latencies (us) while the load thread ran.
    live_lat: Vec<i64>,
    /// `/live` requests that got no answer.
    live_errors: usize,
    /// How long the load thread ran in total (for the achieved rate).
    live_seconds: f64,
}

fn run_phase(c: &mut Cluster, next_id: &mut u32, n: usize, load_rps: Option<u32>) -> Phase {
    let mut active = start(c, *next_id, "primary");
    *next_id += 1;
    let mut ph = Phase {
        samples: Vec::new(),
        live_lat: Vec::new(),
        live_errors: 0,
        live_seconds: 0.0,
    };
    for i in 0..n {
        let shadow = start(c, *next_id, "shadow");
        *next_id += 1;
        assert_eq!(
            active.completion().map(|x| x.0),
            Some(200),
            "active engine does not serve"
        );
        let pids = active.wait_engine_pids(1, T);
        let stop = Arc::new(AtomicBool::new(false));
        let load = load_rps.map(|r| live_load(shadow.probes, r, stop.clone()));
        let load_start = Instant::now();
        if load.is_some() {
            std::thread::sleep(Duration::from_millis(100));
        }
        let t_kill = unix_us();
        assert!(kill(pids[0], Signal::SIGKILL), "engine {} is gone", pids[0]);
        let ok = wait_until(T, Duration::from_millis(1), || {
            shadow.probe("/ready") == Some(200)
        });
        let t_ready = unix_us();
        assert!(ok, "iteration {i}: shadow never ready{}", c.dump_logs());
        if let Some(h) = load {
            std::thread::sleep(Duration::from_millis(100));
            stop.store(true, Ordering::Relaxed);
            let (lat, err) = h.join().expect("load thread");
            ph.live_seconds += load_start.elapsed().as_secs_f64();
            ph.live_lat.extend(lat);
            ph.live_errors += err;
        }
        let old = active.state().expect("old supervisor lingers");
        let new = shadow.state().expect("new supervisor /state");
        let m = |d: &probes::StateDoc, k: MarkKind| {
            d.mark(k)
                .unwrap_or_else(|| panic!("iteration {i}: no {k} mark: {d:?}"))
                - t_kill
        };
        let s = Sample {
            detected: m(&old, MarkKind::EngineExitDetected),
            reaped: m(&old, MarkKind::Fenced),
            released: m(&old, MarkKind::LockClosed),
            granted: m(&new, MarkKind::LockGranted),
            woken: new
                .entered(SupPhase::Active)
                .unwrap_or_else(|| panic!("iteration {i}: no Active transition: {new:?}"))
                - t_kill,
            ready: t_ready - t_kill,
        };
        assert!(c.violations().is_empty(), "SPLIT BRAIN: {}", c.violations());
        assert!(
            s.reaped <= s.granted,
            "iteration {i}: granted before the old tree was reaped: {s:?}"
        );
        ph.samples.push(s);
        let st = active.proc.wait_exit(T);
        assert_eq!(
            st.and_then(|s| s.code()),
            Some(10),
            "old supervisor exit status"
        );
        drop(active);
        active = shadow;
    }
    drop(active);
    ph
}

fn summarize(name: &str, ph: &Phase) -> serde_json::Value {
    let col = |f: fn(&Sample) -> i64| -> Vec<i64> { ph.samples.iter().map(f).collect() };
    let cols: [(&str, Vec<i64>); 6] = [
        ("death detected", col(|s| s.detected)),
        ("tree reaped", col(|s| s.reaped)),
        ("lock released", col(|s| s.released)),
        ("lock granted", col(|s| s.granted)),
        ("woken (Active)", col(|s| s.woken)),
        ("/ready 200 seen", col(|s| s.ready)),
    ];
    println!(
        "\n{name}: {} failovers, ms after SIGKILL of the active engine",
        ph.samples.len()
    );
    println!("{:<18} {:>9} {:>9} {:>9}", "step", "median", "p99", "max");
    let mut j = serde_json::Map::new();
    for (label, mut v) in cols {
        let (p50, p99, max) = (pct(&mut v, 50.0), pct(&mut v, 99.0), pct(&mut v, 100.0));
        println!("{label:<18} {p50:>9.2} {p99:>9.2} {max:>9.2}");
        j.insert(
            label.to_string(),
            serde_json::json!({"median_ms": p50, "p99_ms": p99, "max_ms": max}),
        );
    }
    if !ph.live_lat.is_empty() || ph.live_errors > 0 {
        let mut l = ph.live_lat.clone();
        let n = l.len();
        let (p50, p99, max) = (pct(&mut l, 50.0), pct(&mut l, 99.0), pct(&mut l, 100.0));
        let rate = n as f64 / ph.live_seconds.max(1e-9);
        println!(
            "/live under load: {n} requests ({rate:.0} req/s achieved), errors {}, p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms",
            ph.live_errors
        );
        j.insert(
            "live".into(),
            serde_json::json!({"requests": n, "errors": ph.live_errors, "achieved_rps": rate, "p50_ms": p50, "p99_ms": p99, "max_ms": max}),
        );
    }
    j.insert(
        "samples_us".into(),
        serde_json::to_value(&ph.samples).unwrap_or_default(),
    );
    serde_json::Value::Object(j)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut c = Cluster::new(Duration::from_secs(2));
    let mut id = 0u32;
    let quiet = run_phase(&mut c, &mut id, args.iterations, None);
    let loaded = run_phase(&mut c, &mut id, args.iterations, Some(args.live_rps));
    let report = serde_json::json!({
        "iterations_per_phase": args.iterations,
        "no_probe_load": summarize("without probe load", &quiet),
        "with_live_load": summarize(&format!("with /live load at {} req/s on the shadow", args.live_rps), &loaded),
    });
    if let Some(p) = &args.report {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)?;
        println!("\nreport written to {}", p.display());
    }
    Ok(())
}
