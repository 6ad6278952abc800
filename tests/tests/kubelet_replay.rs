//! Kubelet-probe replay: the probe settings of the rendered chart (deploy/rendered/vllm.yaml)
//! against real `supervisor run` + `fake-engine` + `lockd` processes.
//!
//! The prober below does what kubelet's prober worker does (pkg/kubelet/prober/worker.go):
//! one worker per probe kind and container, each on its own ticker of `periodSeconds`, no
//! probe before `initialDelaySeconds`, liveness and readiness only after the startup probe
//! succeeded, the startup probe no more after that; an HTTP probe is a fresh connection,
//! `GET path`, success iff 200 <= status < 400 within `timeoutSeconds`; a result only counts
//! after `failureThreshold` (resp. `successThreshold`) consecutive equal results; a startup or
//! liveness failure verdict kills the container (SIGTERM, `terminationGracePeriodSeconds`,
//! SIGKILL of everything). kubelet's random first-probe jitter is left out: it only delays the
//! first probe, so leaving it out makes every kill happen at its earliest.
//!
//! Per-engine readiness is not a kubelet readinessProbe in this chart (pod readiness is the AND
//! of its containers and a standing-by shadow is never ready); the pod's router checks each
//! supervisor's `/ready` with the readiness numbers (inter/fall/rise of the router ConfigMap,
//! equal to the router's readinessProbe). The replay probes `/ready` with those numbers, which
//! are the same counting rules.
//!
//! TIME SCALING. The real numbers (2 h model load, 2 min waking timeout, 5 s liveness period,
//! ...) are replayed with EVERY duration of a scenario (probe periods, timeouts, initial delays,
//! the supervisor's --waking-timeout and --startup-timeout, the grace period, the fake engine's
//! load and wake times) multiplied by one factor: 1/20 for the behaviour scenarios and 1/1000
//! for the 2-hour load, so that the suite runs in well under a minute. Thresholds are counts
//! and are not scaled. Scaled probe timeouts are floored at min(period, 25 ms) so that a busy
//! CI machine does not turn a 2 ms loopback round trip into a failure; the 2-hour claim is also
//! proved exactly, on a virtual clock, over the unscaled settings. NOT scaled: the
//! supervisor's own health-check interval and timeout (1 s defaults; the chart does not set
//! them), which is why detection of a hung Active engine is measured separately from the
//! liveness window (kill within period x threshold of /live turning 503).
//!
//! Scenarios: a slow but healthy load and wake (not killed); a 2-hour load (not killed by the
//! startup probe; exact arithmetic + a 1/1000 run); a Standby shadow next to an Active primary
//! (never killed, never ready), then the primary's engine hangs (SIGSTOP: killed by liveness
//! within the window, the shadow takes over, only the Active engine is ever ready, readiness
//! within a period of Active); a hung wake (dead within waking timeout + period x threshold,
//! not before the waking timeout); a crashed engine (container dead within the window).
//! `KUBELET_REPLAY_MANIFEST=FILE` replays another rendering (e.g. a broken one, to watch the
//! replay fail).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

// ---------------------------------------------------------------------------------------------
// Settings from the rendered manifest
// ---------------------------------------------------------------------------------------------

/// One probe's settings, with Kubernetes' defaults for absent fields.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ProbeSpec {
    /// periodSeconds: the ticker of the prober worker.
    period: Duration,
    /// timeoutSeconds: how long one HTTP probe may take before it counts as a failure.
    timeout: Duration,
    /// failureThreshold: consecutive failures before the verdict flips to failure.
    failure_threshold: u32,
    /// successThreshold: consecutive successes before the verdict flips to success.
    success_threshold: u32,
    /// initialDelaySeconds: no probe before this much time since the container started.
    initial_delay: Duration,
}

impl ProbeSpec {
    fn from_yaml(v: &serde_yaml::Value) -> ProbeSpec {
        let secs =
            |k: &str, d: u64| Duration::from_secs(v.get(k).and_then(|x| x.as_u64()).unwrap_or(d));
        let n = |k: &str, d: u64| v.get(k).and_then(|x| x.as_u64()).unwrap_or(d) as u32;
        ProbeSpec {
            period: secs("periodSeconds", 10),
            timeout: secs("timeoutSeconds", 1),
            failure_threshold: n("failureThreshold", 3),
            success_threshold: n("successThreshold", 1),
            initial_delay: secs("initialDelaySeconds", 0),
        }
    }

    /// Every duration times `k`; thresholds are counts and stay. Timeouts are floored at
    /// min(period, 25 ms) (see the module doc).
    fn scaled(&self, k: f64) -> ProbeSpec {
        let period = self.period.mul_f64(k);
        let floor = period.min(Duration::from_millis(25));
        ProbeSpec {
            period,
            timeout: self.timeout.mul_f64(k).max(floor),
            failure_threshold: self.failure_threshold,
            success_threshold: self.success_threshold,
            initial_delay: self.initial_delay.mul_f64(k),
        }
    }
}

/// What the replay needs of one engine container.
#[derive(Clone, Debug)]
struct EngineSpec {
    /// Container name (engine-0, engine-1).
    name: String,
    /// --role of its supervisor.
    role: String,
    /// The startup probe (/startup).
    startup: ProbeSpec,
    /// The liveness probe (/live).
    liveness: ProbeSpec,
    /// Supervisor --waking-timeout.
    waking_timeout: Duration,
    /// Supervisor --startup-timeout.
    startup_timeout: Duration,
    /// Supervisor --stop-grace (its own SIGTERM -> SIGKILL when fencing the engine).
    stop_grace: Duration,
}

/// Everything read from deploy/rendered/vllm.yaml.
#[derive(Clone, Debug)]
struct Rendered {
    /// engine-0 and engine-1, in that order.
    engines: Vec<EngineSpec>,
    /// Per-engine readiness numbers (router health checks == router readinessProbe).
    readiness: ProbeSpec,
    /// terminationGracePeriodSeconds of the pod.
    grace: Duration,
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let end = args.iter().position(|a| a == "--").unwrap_or(args.len());
    args[..end]
        .windows(2)
        .find(|w| w[0] == name)
        .map(|w| w[1].as_str())
}

fn load_rendered() -> Rendered {
    // KUBELET_REPLAY_MANIFEST: replay another rendering (e.g. a deliberately broken one, to
    // see the replay fail).
    let path = std::env::var_os("KUBELET_REPLAY_MANIFEST")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("deploy/rendered/vllm.yaml"));
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("rendered manifest is YAML"))
        .filter(|v: &serde_yaml::Value| !v.is_null())
        .collect();
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d.get("kind").and_then(|x| x.as_str()) == Some(k))
            .unwrap_or_else(|| panic!("no {k} in {}", path.display()))
    };
    let pod = &kind("Deployment")["spec"]["template"]["spec"];
    let containers = pod["containers"].as_sequence().expect("containers");
    let mut engines = Vec::new();
    for c in containers {
        let name = c["name"].as_str().unwrap_or_default().to_string();
        if !name.starts_with("engine-") {
            continue;
        }
        let args: Vec<String> = c["command"]
            .as_sequence()
            .expect("engine command")
            .iter()
            .map(|a| a.as_str().expect("string arg").to_string())
            .collect();
        let dur = |f: &str| {
            let s = flag(&args, f).unwrap_or_else(|| panic!("{name}: no {f}"));
            humantime::parse_duration(s).unwrap_or_else(|e| panic!("{name}: {f} {s}: {e}"))
        };
        engines.push(EngineSpec {
            role: flag(&args, "--role").expect("--role").to_string(),
            startup: ProbeSpec::from_yaml(&c["startupProbe"]),
            liveness: ProbeSpec::from_yaml(&c["livenessProbe"]),
            waking_timeout: dur("--waking-timeout"),
            startup_timeout: dur("--startup-timeout"),
            stop_grace: dur("--stop-grace"),
            name,
        });
        assert_eq!(
            c["startupProbe"]["httpGet"]["path"].as_str(),
            Some("/startup")
        );
        assert_eq!(
            c["livenessProbe"]["httpGet"]["path"].as_str(),
            Some("/live")
        );
    }
    engines.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(engines.len(), 2, "two engine containers");
    let router = containers
        .iter()
        .find(|c| c["name"].as_str() == Some("router"))
        .expect("router container");
    let readiness = ProbeSpec::from_yaml(&router["readinessProbe"]);
    let cfg = kind("ConfigMap")["data"]["haproxy.cfg"]
        .as_str()
        .expect("haproxy.cfg");
    let line = cfg
        .lines()
        .find(|l| l.trim_start().starts_with("default-server inter"))
        .expect("router default-server line");
    let words: Vec<&str> = line.split_whitespace().collect();
    let word_after = |w: &str| {
        words
            .iter()
            .position(|x| *x == w)
            .map(|i| words[i + 1])
            .expect(w)
    };
    let check_timeout = cfg
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("timeout check "))
        .expect("router timeout check");
    // The router's checks ARE the per-engine readiness: same numbers as its readinessProbe.
    assert_eq!(
        humantime::parse_duration(word_after("inter")).unwrap(),
        readiness.period
    );
    assert_eq!(
        word_after("fall").parse::<u32>().unwrap(),
        readiness.failure_threshold
    );
    assert_eq!(
        word_after("rise").parse::<u32>().unwrap(),
        readiness.success_threshold
    );
    assert_eq!(
        humantime::parse_duration(check_timeout.trim()).unwrap(),
        readiness.timeout
    );
    let grace = Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30));
    Rendered {
        engines,
        readiness,
        grace,
    }
}

// ---------------------------------------------------------------------------------------------
// kubelet's result counting (pure)
// ---------------------------------------------------------------------------------------------

/// kubelet's per-worker result run: the cached result only changes after `threshold`
/// consecutive equal results.
#[derive(Clone, Debug)]
struct ResultRun {
    /// The settings (thresholds).
    spec: ProbeSpec,
    /// Last raw result.
    last: Option<bool>,
    /// How many times in a row `last` came.
    run: u32,
}

impl ResultRun {
    fn new(spec: ProbeSpec) -> ResultRun {
        ResultRun {
            spec,
            last: None,
            run: 0,
        }
    }

    /// Feed one raw result; Some(verdict) when it changes the cached result (kubelet's
    /// resultsManager.Set), None while below threshold.
    fn observe(&mut self, ok: bool) -> Option<bool> {
        if self.last == Some(ok) {
            self.run += 1;
        } else {
            self.last = Some(ok);
            self.run = 1;
        }
        let need = if ok {
            self.spec.success_threshold
        } else {
            self.spec.failure_threshold
        };
        if self.run < need {
            return None;
        }
        if !ok {
            // liveness/startup failure: the container is restarted and the run starts over.
            self.run = 0;
        }
        Some(ok)
    }

    /// Consecutive failures so far.
    fn failures_in_a_row(&self) -> u32 {
        if self.last == Some(false) {
            self.run
        } else {
            0
        }
    }
}

/// Virtual-clock replay of the startup prober against an engine that leaves Init at
/// `leaves_init` (since container start): Ok(time of success) or Err(time of the kill).
fn simulate_startup(spec: ProbeSpec, leaves_init: Duration) -> Result<Duration, Duration> {
    let mut run = ResultRun::new(spec);
    let mut t = spec.initial_delay;
    loop {
        match run.observe(t >= leaves_init) {
            Some(true) => return Ok(t),
            Some(false) => return Err(t),
            None => t += spec.period,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tests that need no process: the arithmetic over the rendered settings
// ---------------------------------------------------------------------------------------------

#[test]
fn result_run_counts_like_kubelet() {
    let spec = ProbeSpec {
        period: Duration::from_secs(1),
        timeout: Duration::from_secs(1),
        failure_threshold: 3,
        success_threshold: 2,
        initial_delay: Duration::ZERO,
    };
    let mut r = ResultRun::new(spec);
    assert_eq!(r.observe(false), None);
    assert_eq!(r.observe(false), None);
    assert_eq!(r.observe(true), None, "a success breaks the failure run");
    assert_eq!(r.observe(false), None);
    assert_eq!(r.observe(false), None);
    assert_eq!(r.observe(false), Some(false), "third failure in a row");
    assert_eq!(
        r.failures_in_a_row(),
        0,
        "run restarts after a kill verdict"
    );
    assert_eq!(r.observe(true), None);
    assert_eq!(r.observe(true), Some(true), "successThreshold 2");
}

#[test]
fn two_hour_load_fits_the_startup_budget_exactly() {
    let r = load_rendered();
    for e in &r.engines {
        let budget = e.startup.initial_delay + e.startup.period * (e.startup.failure_threshold - 1);
        assert!(
            budget >= Duration::from_secs(2 * 3600),
            "{}: startup budget {budget:?} < 2h",
            e.name
        );
        assert!(
            budget >= e.startup_timeout,
            "{}: budget below --startup-timeout",
            e.name
        );
        // The supervisor's own --startup-timeout is the model-load timeout (2h by default).
        assert!(
            e.startup_timeout >= Duration::from_secs(2 * 3600),
            "{}: modelLoadTimeout < 2h",
            e.name
        );
        // A load that ends exactly at the supervisor's timeout is not killed ...
        let ok = simulate_startup(e.startup, e.startup_timeout);
        assert_eq!(
            ok,
            Ok(e.startup_timeout.max(e.startup.initial_delay)),
            "{}: {ok:?}",
            e.name
        );
        // ... a 2-hour load is not killed ...
        assert!(simulate_startup(e.startup, Duration::from_secs(7200)).is_ok());
        // ... and the budget is tight: a load that never ends is killed at exactly the budget.
        assert_eq!(
            simulate_startup(e.startup, Duration::MAX),
            Err(budget),
            "{}",
            e.name
        );
    }
}

#[test]
fn liveness_and_readiness_arithmetic() {
    let r = load_rendered();
    for e in &r.engines {
        let l = e.liveness;
        assert!(
            l.timeout <= l.period,
            "{}: liveness timeout stretches its period",
            e.name
        );
        assert_eq!(
            l.success_threshold, 1,
            "kubelet requires successThreshold 1 for liveness"
        );
        assert!(
            l.failure_threshold >= 2,
            "{}: one slow health check must not kill",
            e.name
        );
        // Worst-case kill of a hung wake: the first failing probe lands within one period of
        // the waking timeout, the kill failureThreshold-1 periods later.
        let worst = e.waking_timeout + l.period * l.failure_threshold;
        assert!(
            worst <= e.waking_timeout * 2,
            "{}: hung wake held {worst:?}",
            e.name
        );
        // A healthy slow wake is never killed: /live answers 200 until the waking timeout.
        assert!(e.waking_timeout > Duration::ZERO);
    }
    assert_eq!(r.engines[0].role, "primary");
    assert_eq!(r.engines[1].role, "shadow");
    assert_eq!(
        r.readiness.period,
        Duration::from_secs(1),
        "ready within a second of Active"
    );
    assert!(r.readiness.timeout <= r.readiness.period);
    assert_eq!(r.readiness.success_threshold, 1);
}

// ---------------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------------

/// The replays run one at a time: they measure time, and the machine has two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn bin(name: &str) -> PathBuf {
    // target/<profile>/deps/kubelet_replay-HASH -> target/<profile>/NAME
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let p = dir.join(name);
    assert!(
        p.is_file(),
        "{} missing: build the workspace binaries first (cargo test --workspace builds them; \
         or cargo build --workspace --bins)",
        p.display()
    );
    p
}

fn unix_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A temp dir removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "kubelet-replay-{tag}-{}-{}",
            std::process::id(),
            unix_us()
        ));
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A process started in its own process group; the group (and every pid in `pid_file`, the
/// engine and its workers) is SIGKILLed on drop.
struct Proc {
    /// The child (supervisor or lockd).
    child: Child,
    /// Where fake-engine writes its pids (engine + workers), if any.
    pid_file: Option<PathBuf>,
    /// Name for messages.
    name: String,
}

impl Proc {
    fn spawn(name: &str, cmd: &mut Command, pid_file: Option<PathBuf>, log: &Path) -> Proc {
        let out = std::fs::File::create(log).expect("log file");
        let err = out.try_clone().expect("log file");
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Proc {
            child,
            pid_file,
            name: name.to_string(),
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    fn engine_pids(&self) -> Vec<i32> {
        self.pid_file
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    fn signal_all(&self, sig: i32) {
        // SAFETY: kill(2) with a pid/pgid we started; errors (ESRCH) are fine.
        unsafe {
            libc::kill(-self.pid(), sig);
            for p in self.engine_pids() {
                if p > 1 {
                    libc::kill(-p, sig);
                    libc::kill(p, sig);
                }
            }
        }
    }

    /// What kubelet does to a container it kills: SIGTERM to PID 1, `grace`, then SIGKILL of
    /// everything left in the container.
    fn kubelet_kill(&mut self, grace: Duration) {
        // SAFETY: kill(2) on our own child.
        unsafe {
            libc::kill(self.pid(), libc::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && !self.exited() {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.signal_all(libc::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal_all(libc::SIGKILL);
        let _ = self.child.wait();
        let _ = &self.name;
    }
}

/// kubelet's HTTP probe: fresh connection, GET, success iff 200 <= status < 400 in time.
fn http_probe(port: u16, path: &str, timeout: Duration) -> bool {
    http_get(port, path, timeout)
        .map(|(code, _)| (200..400).contains(&code))
        .unwrap_or(false)
}

fn http_get(port: u16, path: &str, timeout: Duration) -> Option<(u16, String)> {
    let deadline = Instant::now() + timeout;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, timeout).ok()?;
    let left = |d: Instant| {
        d.checked_duration_since(Instant::now())
            .filter(|x| !x.is_zero())
    };
    s.set_write_timeout(Some(left(deadline)?)).ok()?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: kube-probe/1.34\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        s.set_read_timeout(Some(left(deadline)?)).ok()?;
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                if buf.len() > 64 * 1024 {
                    break;
                }
            }
            Err(_) => {
                if buf.is_empty() {
                    return None;
                }
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&buf).to_string();
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((code, body))
}

/// One `lockd serve` on a Unix socket in `dir`.
fn start_lockd(dir: &Path) -> (Proc, String) {
    let sock = dir.join("lockd.sock");
    let ep = format!("unix:{}", sock.display());
    let p = Proc::spawn(
        "lockd",
        Command::new(bin("lockd"))
            .args(["serve", "--listen", &ep, "--state"])
            .arg(dir.join("lockd.state")),
        None,
        &dir.join("lockd.log"),
    );
    // The sidecar's startup probe: `lockd status --connect` until it answers.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ok = Command::new(bin("lockd"))
            .args(["status", "--connect", &ep])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "lockd did not come up: {}",
            dir.join("lockd.log").display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (p, ep)
}

/// How a fake engine behaves (already scaled).
#[derive(Clone, Debug)]
struct EngineBehaviour {
    /// fake-engine --init: model load time.
    init: Duration,
    /// fake-engine --wake.
    wake: Duration,
}

/// The verdicts and observations of one replayed container.
#[derive(Debug, Default)]
struct Record {
    /// When the container started.
    started_at: Option<Instant>,
    /// When the startup probe succeeded.
    startup_ok_at: Option<Instant>,
    /// Longest run of consecutive startup failures.
    max_startup_failures: u32,
    /// Kill verdict: (when, by which probe).
    killed: Option<(Instant, &'static str)>,
    /// When the supervisor process was seen exited on its own.
    exited_at: Option<Instant>,
    /// Every per-engine readiness verdict change: (when, ready).
    ready_changes: Vec<(Instant, bool)>,
    /// Every liveness result: (when, ok).
    live_results: Vec<(Instant, bool)>,
    /// Observer: (when, state) for every change of /state's "state".
    states: Vec<(Instant, String)>,
    /// Observer: first time /live answered non-200 after the container had reached Active or
    /// Waking (what kubelet can see at the earliest).
    first_live_503: Option<Instant>,
    /// Readiness samples where the engine was ready: (when, /state right after).
    ready_samples: Vec<(Instant, Option<String>)>,
}

/// One engine container under kubelet's probes.
struct Container {
    /// Shared with the probe threads.
    rec: Arc<Mutex<Record>>,
    /// Set when the container is dead (killed or exited): workers stop.
    dead: Arc<AtomicBool>,
    /// The supervisor process (None once reaped by a kill).
    proc: Arc<Mutex<Option<Proc>>>,
    /// Probe worker + observer threads.
    threads: Vec<JoinHandle<()>>,
    /// The supervisor's probe port.
    probe_port: u16,
    /// The fake engine's pid file.
    pid_file: PathBuf,
}

/// Settings of one scaled scenario.
#[derive(Clone, Debug)]
struct Scaled {
    /// The scale factor applied to every duration.
    k: f64,
    /// Startup probe, scaled.
    startup: ProbeSpec,
    /// Liveness probe, scaled.
    liveness: ProbeSpec,
    /// Readiness (router checks), scaled.
    readiness: ProbeSpec,
    /// --waking-timeout, scaled.
    waking_timeout: Duration,
    /// --startup-timeout, scaled.
    startup_timeout: Duration,
    /// terminationGracePeriodSeconds, scaled.
    grace: Duration,
    /// --stop-grace, scaled.
    stop_grace: Duration,
}

fn scaled(r: &Rendered, engine: usize, k: f64) -> Scaled {
    let e = &r.engines[engine];
    Scaled {
        k,
        startup: e.startup.scaled(k),
        liveness: e.liveness.scaled(k),
        readiness: r.readiness.scaled(k),
        waking_timeout: e.waking_timeout.mul_f64(k),
        startup_timeout: e.startup_timeout.mul_f64(k),
        grace: r.grace.mul_f64(k),
        stop_grace: e.stop_grace.mul_f64(k),
    }
}

fn humantime_ms(d: Duration) -> String {
    format!("{}ms", d.as_millis().max(1))
}

impl Container {
    /// Start `supervisor run ... -- fake-engine ...` as engine `id` and put kubelet's probe
    /// workers on it.
    fn start(
        dir: &Path,
        lock_ep: &str,
        id: u32,
        role: &str,
        s: &Scaled,
        b: &EngineBehaviour,
    ) -> Container {
        let probe_port = free_port();
        let engine_port = free_port();
        let pid_file = dir.join(format!("engine-{id}.pids"));
        let _ = std::fs::remove_file(&pid_file);
        let mut cmd = Command::new(bin("supervisor"));
        cmd.args([
            "run",
            "--engine-id",
            &id.to_string(),
            "--role",
            role,
            "--lock",
            lock_ep,
        ])
        .args([
            "--resource",
            "engine",
            "--probes",
            &format!("127.0.0.1:{probe_port}"),
        ])
        .args([
            "--adapter",
            "vllm",
            "--engine-url",
            &format!("http://127.0.0.1:{engine_port}"),
        ])
        .args(["--waking-timeout", &humantime_ms(s.waking_timeout)])
        .args(["--startup-timeout", &humantime_ms(s.startup_timeout)])
        .args(["--stop-grace", &humantime_ms(s.stop_grace)])
        .arg("--")
        .arg(bin("fake-engine"))
        .args([
            "--port",
            &engine_port.to_string(),
            "--engine-id",
            &id.to_string(),
        ])
        .args([
            "--init",
            &humantime_ms(b.init),
            "--wake",
            &humantime_ms(b.wake),
        ])
        .args(["--sleep", "10ms"])
        .arg("--pid-file")
        .arg(&pid_file)
        .env("RUST_LOG", "info");
        let log = dir.join(format!("engine-{id}.log"));
        let started = Instant::now();
        let proc = Proc::spawn(
            &format!("engine-{id}"),
            &mut cmd,
            Some(pid_file.clone()),
            &log,
        );
        let rec = Arc::new(Mutex::new(Record {
            started_at: Some(started),
            ..Record::default()
        }));
        let dead = Arc::new(AtomicBool::new(false));
        let proc = Arc::new(Mutex::new(Some(proc)));
        let mut c = Container {
            rec,
            dead,
            proc,
            threads: Vec::new(),
            probe_port,
            pid_file,
        };
        c.spawn_workers(started, s.clone());
        c
    }

    fn spawn_workers(&mut self, started: Instant, s: Scaled) {
        let port = self.probe_port;
        for kind in ["startup", "liveness", "readiness"] {
            let (rec, dead, proc) = (self.rec.clone(), self.dead.clone(), self.proc.clone());
            let s = s.clone();
            self.threads.push(std::thread::spawn(move || {
                let spec = match kind {
                    "startup" => s.startup,
                    "liveness" => s.liveness,
                    _ => s.readiness,
                };
                let mut run = ResultRun::new(spec);
                let mut next = started;
                loop {
                    // Go's time.Ticker: ticks every period; a slow receiver loses ticks.
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    }
                    while next <= Instant::now() {
                        next += spec.period;
                    }
                    if dead.load(Ordering::SeqCst) {
                        return;
                    }
                    if started.elapsed() < spec.initial_delay {
                        continue;
                    }
                    let is_started = rec.lock().unwrap().startup_ok_at.is_some();
                    if (kind == "startup") == is_started {
                        continue; // startup stops once started; the others wait for it
                    }
                    let path = match kind {
                        "startup" => "/startup",
                        "liveness" => "/live",
                        _ => "/ready",
                    };
                    let ok = http_probe(port, path, spec.timeout);
                    let at = Instant::now();
                    if dead.load(Ordering::SeqCst) {
                        return;
                    }
                    let verdict = run.observe(ok);
                    let mut r = rec.lock().unwrap();
                    match kind {
                        "startup" => {
                            r.max_startup_failures =
                                r.max_startup_failures.max(run.failures_in_a_row());
                            if verdict == Some(true) {
                                r.startup_ok_at = Some(at);
                            }
                        }
                        "liveness" => r.live_results.push((at, ok)),
                        _ => {
                            if let Some(v) = verdict {
                                if r.ready_changes.last().map(|x| x.1) != Some(v) {
                                    r.ready_changes.push((at, v));
                                }
                            }
                            let ready = r.ready_changes.last().map(|x| x.1).unwrap_or(false);
                            if ready {
                                drop(r);
                                let st = http_get(port, "/state", Duration::from_millis(500))
                                    .and_then(|(_, b)| {
                                        serde_json::from_str::<serde_json::Value>(&b).ok()
                                    })
                                    .and_then(|v| v["state"].as_str().map(str::to_string));
                                rec.lock().unwrap().ready_samples.push((at, st));
                            }
                            continue;
                        }
                    }
                    if verdict == Some(false) {
                        // startup or liveness failure verdict: kubelet kills the container.
                        let by = if kind == "startup" {
                            "startup"
                        } else {
                            "liveness"
                        };
                        r.killed = Some((at, by));
                        drop(r);
                        dead.store(true, Ordering::SeqCst);
                        if let Some(mut p) = proc.lock().unwrap().take() {
                            p.kubelet_kill(s.grace);
                        }
                        return;
                    }
                }
            }));
        }
        // Observer: /state and /live every 10 ms (not kubelet: the test's own eyes), and the
        // container's own exit.
        let (rec, dead, proc) = (self.rec.clone(), self.dead.clone(), self.proc.clone());
        self.threads.push(std::thread::spawn(move || {
            let mut seen_running = false;
            while !dead.load(Ordering::SeqCst) {
                {
                    let mut g = proc.lock().unwrap();
                    if let Some(p) = g.as_mut() {
                        if p.exited() {
                            rec.lock().unwrap().exited_at = Some(Instant::now());
                            dead.store(true, Ordering::SeqCst);
                            drop(g.take());
                            return;
                        }
                    }
                }
                let st = http_get(port, "/state", Duration::from_millis(200))
                    .and_then(|(_, b)| serde_json::from_str::<serde_json::Value>(&b).ok())
                    .and_then(|v| v["state"].as_str().map(str::to_string));
                let now = Instant::now();
                let mut r = rec.lock().unwrap();
                if let Some(st) = st {
                    if r.states.last().map(|x| &x.1) != Some(&st) {
                        r.states.push((now, st.clone()));
                    }
                    seen_running |= st == "active" || st == "waking";
                }
                if seen_running && r.first_live_503.is_none() {
                    drop(r);
                    if http_get(port, "/live", Duration::from_millis(200)).map(|x| x.0) == Some(503)
                    {
                        rec.lock()
                            .unwrap()
                            .first_live_503
                            .get_or_insert(Instant::now());
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }));
    }

    fn state(&self) -> Option<String> {
        self.rec.lock().unwrap().states.last().map(|x| x.1.clone())
    }

    /// Wait until /state says `want` (or the container died, or `limit` passed).
    fn wait_state(&self, want: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.state().as_deref() == Some(want) {
                return true;
            }
            if self.dead.load(Ordering::SeqCst) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    fn when_entered(&self, want: &str) -> Option<Instant> {
        self.rec
            .lock()
            .unwrap()
            .states
            .iter()
            .find(|x| x.1 == want)
            .map(|x| x.0)
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// SIGSTOP the fake engine (and its workers): a hung engine that no longer answers.
    fn freeze_engine(&self) {
        self.signal_engine(libc::SIGSTOP);
    }

    /// Send `sig` to the fake engine and its workers (not to the supervisor).
    fn signal_engine(&self, sig: i32) {
        let pids: Vec<i32> = std::fs::read_to_string(&self.pid_file)
            .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default();
        assert!(
            !pids.is_empty(),
            "fake-engine wrote no pid file {}",
            self.pid_file.display()
        );
        for p in pids {
            // SAFETY: kill(2) on a process we started.
            unsafe {
                libc::kill(p, sig);
            }
        }
    }

    /// Stop everything (end of scenario).
    fn stop(mut self) -> Record {
        self.dead.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        drop(self.proc.lock().unwrap().take());
        std::mem::take(&mut *self.rec.lock().unwrap())
    }
}

fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

fn dump_logs(dir: &Path) -> String {
    let mut out = String::new();
    let mut files: BTreeMap<String, String> = BTreeMap::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.path().extension().and_then(|x| x.to_str()) == Some("log") {
                let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(30).collect();
                files.insert(
                    e.file_name().to_string_lossy().to_string(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
                );
            }
        }
    }
    for (k, v) in files {
        out.push_str(&format!("--- {k}\n{v}\n"));
    }
    out
}

/// The intervals in which the replayed readiness said ready; an open one ends at `end`.
fn ready_intervals(rec: &Record, end: Instant) -> Vec<(Instant, Instant)> {
    let mut out = Vec::new();
    let mut open: Option<Instant> = None;
    for (at, ready) in &rec.ready_changes {
        match (ready, open) {
            (true, None) => open = Some(*at),
            (false, Some(from)) => {
                out.push((from, *at));
                open = None;
            }
            _ => {}
        }
    }
    if let Some(from) = open {
        out.push((from, end.max(from)));
    }
    out
}

/// Slack for scheduling and process start on a busy 2-core machine.
const SLACK: Duration = Duration::from_millis(400);

// ---------------------------------------------------------------------------------------------
// The replays
// ---------------------------------------------------------------------------------------------

/// Scale of the behaviour scenarios (see module doc).
const K: f64 = 1.0 / 20.0;

#[test]
fn replay_slow_healthy_load_and_slow_wake_are_not_killed() {
    let _g = serial();
    let r = load_rendered();
    let s = scaled(&r, 1, K);
    let dir = TempDir::new("slow");
    let (_lockd, ep) = start_lockd(&dir.0);
    // A load 8x the liveness kill window (2 min unscaled: liveness must not run during Init)
    // and a wake of 75% of the waking timeout (90 s of 120 s unscaled). The shadow role: it
    // sleeps after loading, then the (free) lock wakes it, so the wake really happens.
    let b = EngineBehaviour {
        init: s.liveness.period * s.liveness.failure_threshold * 8,
        wake: s.waking_timeout.mul_f64(0.75),
    };
    let c = Container::start(&dir.0, &ep, 1, "shadow", &s, &b);
    let limit = b.init + b.wake + s.waking_timeout + Duration::from_secs(10);
    let active = c.wait_state("active", limit);
    // Stay a few liveness kill windows in Active.
    std::thread::sleep(s.liveness.period * s.liveness.failure_threshold * 3);
    let dead = c.is_dead();
    let rec = c.stop();
    let logs = dump_logs(&dir.0);
    assert!(active, "never Active: {rec:?}\n{logs}");
    assert!(
        !dead && rec.killed.is_none() && rec.exited_at.is_none(),
        "killed: {rec:?}\n{logs}"
    );
    let started = rec.startup_ok_at.expect("startup probe succeeded");
    eprintln!(
        "slow load {:?} + wake {:?} (x{}): started at {:?}, {} liveness probes all 200, ready: {:?}",
        b.init,
        b.wake,
        1.0 / s.k,
        started - rec.started_at.unwrap(),
        rec.live_results.len(),
        rec.ready_changes.last().map(|x| x.1)
    );
    assert!(
        started - rec.started_at.unwrap() >= b.init,
        "startup ok before the load ended"
    );
    assert!(
        rec.live_results.iter().all(|x| x.1),
        "a /live failure: {:?}",
        rec.live_results
    );
    assert!(
        rec.ready_changes.last().map(|x| x.1) == Some(true),
        "Active but not ready: {rec:?}"
    );
}

#[test]
fn replay_two_hour_load_is_not_killed_by_the_startup_probe() {
    let _g = serial();
    let r = load_rendered();
    // 1/1000: the 2 h load becomes 7.2 s, the 10 s startup period 10 ms.
    let s = scaled(&r, 1, 1.0 / 1000.0);
    let load_2h = Duration::from_secs(7200).mul_f64(s.k);
    let dir = TempDir::new("2h");
    let (_lockd, ep) = start_lockd(&dir.0);
    // Hold the lock, so that the engine stays in Standby after its load.
    let _holder = Proc::spawn(
        "holder",
        Command::new(bin("lockd"))
            .args([
                "hold",
                "--connect",
                &ep,
                "--resource",
                "engine",
                "--holder",
                "someone-else",
                "--",
            ])
            .args(["sleep", "60"]),
        None,
        &dir.0.join("holder.log"),
    );
    // The load ends at 90% of 2 h: the supervisor must still see it end (health polling) and
    // put the engine to sleep before its own --startup-timeout (2 h, scaled).
    let b = EngineBehaviour {
        init: load_2h.mul_f64(0.9),
        wake: Duration::from_millis(10),
    };
    let c = Container::start(&dir.0, &ep, 1, "shadow", &s, &b);
    let ok = wait_until(load_2h + Duration::from_secs(5), || {
        c.rec.lock().unwrap().startup_ok_at.is_some() || c.is_dead()
    });
    std::thread::sleep(s.liveness.period * s.liveness.failure_threshold * 2);
    let dead = c.is_dead();
    let state = c.state();
    let rec = c.stop();
    let logs = dump_logs(&dir.0);
    assert!(
        ok && !dead && rec.killed.is_none(),
        "killed or never started: {rec:?}\n{logs}"
    );
    let t = rec.startup_ok_at.unwrap() - rec.started_at.unwrap();
    eprintln!(
        "2h load at x{}: load {:?}, startup probe ok at {t:?}, {} failures in a row of {} allowed",
        1.0 / s.k,
        b.init,
        rec.max_startup_failures,
        s.startup.failure_threshold
    );
    assert!(
        t >= b.init,
        "startup probe passed at {t:?}, before the load ended ({:?})",
        b.init
    );
    assert!(
        rec.max_startup_failures >= s.startup.failure_threshold / 2,
        "the run did not exercise the budget: {} failures in a row",
        rec.max_startup_failures
    );
    assert!(rec.max_startup_failures < s.startup.failure_threshold);
    assert_eq!(state.as_deref(), Some("standby"), "{logs}");
}

#[test]
fn replay_failover_standby_never_killed_only_active_ready_dead_engine_killed() {
    let _g = serial();
    let r = load_rendered();
    let s0 = scaled(&r, 0, K);
    let s1 = scaled(&r, 1, K);
    let dir = TempDir::new("failover");
    let (_lockd, ep) = start_lockd(&dir.0);
    let b = EngineBehaviour {
        init: Duration::from_millis(300),
        wake: Duration::from_millis(200),
    };
    let primary = Container::start(&dir.0, &ep, 0, "primary", &s0, &b);
    assert!(
        primary.wait_state("active", Duration::from_secs(20)),
        "primary never Active\n{}",
        dump_logs(&dir.0)
    );
    let shadow = Container::start(&dir.0, &ep, 1, "shadow", &s1, &b);
    assert!(
        shadow.wait_state("standby", Duration::from_secs(20)),
        "shadow never Standby\n{}",
        dump_logs(&dir.0)
    );
    // The shadow stands by for ten liveness kill windows: never killed, never ready.
    std::thread::sleep(s1.liveness.period * s1.liveness.failure_threshold * 10);
    assert!(
        !shadow.is_dead(),
        "Standby shadow killed\n{}",
        dump_logs(&dir.0)
    );
    assert_eq!(shadow.state().as_deref(), Some("standby"));
    // The active engine hangs (SIGSTOP): no answer to its health check.
    let frozen_at = Instant::now();
    primary.freeze_engine();
    let killed = wait_until(Duration::from_secs(30), || primary.is_dead());
    let took_over = shadow.wait_state("active", Duration::from_secs(30));
    std::thread::sleep(s1.readiness.period * 5 + SLACK);
    let shadow_active_at = shadow.when_entered("active");
    let prec = primary.stop();
    let srec = shadow.stop();
    let logs = dump_logs(&dir.0);
    assert!(killed, "hung Active engine never killed: {prec:?}\n{logs}");
    let death = prec.killed.map(|k| k.0).or(prec.exited_at).unwrap();
    // Killed by liveness within period*threshold of /live turning 503.
    let seen = prec.first_live_503.unwrap_or(death);
    let window = s0.liveness.period * s0.liveness.failure_threshold;
    eprintln!(
        "hung Active engine (x{}): /live 503 {:?} after the freeze, container dead {:?} later by {} \
         (window {window:?})",
        1.0 / s0.k,
        seen.saturating_duration_since(frozen_at),
        death.saturating_duration_since(seen),
        prec.killed.map(|k| k.1).unwrap_or("its own exit")
    );
    assert!(
        death.saturating_duration_since(seen) <= window + s0.liveness.timeout + SLACK,
        "killed {:?} after /live turned 503 (window {window:?}): {prec:?}",
        death - seen
    );
    assert!(
        seen.saturating_duration_since(frozen_at) <= Duration::from_secs(10),
        "the supervisor took {:?} to notice its engine hung",
        seen - frozen_at
    );
    assert!(took_over, "shadow never took over: {srec:?}\n{logs}");
    assert!(
        srec.killed.is_none() && srec.exited_at.is_none(),
        "shadow killed: {srec:?}\n{logs}"
    );
    // Only the Active engine is ever ready.
    for (name, rec) in [("primary", &prec), ("shadow", &srec)] {
        for (at, st) in &rec.ready_samples {
            assert!(
                matches!(st.as_deref(), Some("active") | None),
                "{name} ready at {:?} while {st:?}",
                at.duration_since(rec.started_at.unwrap())
            );
        }
    }
    let shadow_ready: Vec<Instant> = srec
        .ready_changes
        .iter()
        .filter(|x| x.1)
        .map(|x| x.0)
        .collect();
    let first = *shadow_ready.first().expect("shadow became ready");
    assert!(first >= death, "shadow ready before the primary died");
    // Never two ready engines at once.
    let end = Instant::now();
    let p_iv = ready_intervals(&prec, death);
    let s_iv = ready_intervals(&srec, end);
    for a in &p_iv {
        for b in &s_iv {
            assert!(
                a.1 <= b.0 || b.1 <= a.0,
                "both engines ready at once: {a:?} {b:?}"
            );
        }
    }
    assert!(
        !p_iv.is_empty(),
        "the Active primary was never ready: {prec:?}"
    );
    // Readiness flips within one readiness period (+ timeout) of Active.
    let active_at = shadow_active_at.expect("observed Active");
    eprintln!(
        "shadow: Active {:?} after the primary died, replayed readiness ready {:?} after Active",
        active_at.saturating_duration_since(death),
        first.saturating_duration_since(active_at)
    );
    assert!(
        first.saturating_duration_since(active_at)
            <= s1.readiness.period + s1.readiness.timeout + SLACK,
        "ready {:?} after Active",
        first - active_at
    );
}

#[test]
fn replay_hung_wake_is_killed_within_waking_timeout_plus_liveness_window() {
    let _g = serial();
    let r = load_rendered();
    let s = scaled(&r, 1, K);
    let dir = TempDir::new("hungwake");
    let (_lockd, ep) = start_lockd(&dir.0);
    let b = EngineBehaviour {
        init: Duration::from_millis(300),
        wake: Duration::from_secs(3600),
    };
    // The shadow role: it sleeps, the free lock wakes it, and the wake hangs.
    let c = Container::start(&dir.0, &ep, 1, "shadow", &s, &b);
    assert!(
        c.wait_state("waking", Duration::from_secs(20)),
        "never Waking\n{}",
        dump_logs(&dir.0)
    );
    let waking_at = c.when_entered("waking").unwrap();
    let limit = s.waking_timeout + s.liveness.period * s.liveness.failure_threshold;
    let died = wait_until(limit + Duration::from_secs(10), || c.is_dead());
    let rec = c.stop();
    let logs = dump_logs(&dir.0);
    assert!(died, "hung wake never killed: {rec:?}\n{logs}");
    let death = rec.killed.map(|k| k.0).or(rec.exited_at).unwrap();
    let after = death - waking_at;
    eprintln!(
        "hung wake (x{}): dead {after:?} into the wake by {} (waking timeout {:?}, limit {limit:?})",
        1.0 / s.k,
        rec.killed.map(|k| k.1).unwrap_or("its own exit"),
        s.waking_timeout
    );
    // Not before the waking timeout (a slow healthy wake survives it) ...
    assert!(
        after + Duration::from_millis(50) >= s.waking_timeout,
        "killed {after:?} into the wake, before the waking timeout {:?}",
        s.waking_timeout
    );
    // ... and within waking timeout + period * threshold.
    assert!(
        after <= limit + s.liveness.timeout + SLACK,
        "killed {after:?} into the wake (limit {limit:?})"
    );
    assert!(
        rec.ready_changes.iter().all(|x| !x.1),
        "a waking engine was ready: {rec:?}"
    );
}

#[test]
fn replay_crashed_engine_container_dies_within_the_liveness_window() {
    let _g = serial();
    let r = load_rendered();
    let s = scaled(&r, 0, K);
    let dir = TempDir::new("crash");
    let (_lockd, ep) = start_lockd(&dir.0);
    let b = EngineBehaviour {
        init: Duration::from_millis(300),
        wake: Duration::from_millis(100),
    };
    let c = Container::start(&dir.0, &ep, 0, "primary", &s, &b);
    assert!(
        c.wait_state("active", Duration::from_secs(20)),
        "never Active\n{}",
        dump_logs(&dir.0)
    );
    // Let the replayed readiness see it ready first.
    assert!(
        wait_until(Duration::from_secs(5), || c
            .rec
            .lock()
            .unwrap()
            .ready_changes
            .last()
            .is_some_and(|x| x.1)),
        "Active engine never ready"
    );
    // The engine process crashes (the supervisor stays): its container must die, by the
    // supervisor's own exit or by the liveness probe, within one liveness window.
    let crashed_at = Instant::now();
    c.signal_engine(libc::SIGKILL);
    let window = s.liveness.period * s.liveness.failure_threshold;
    let died = wait_until(window + Duration::from_secs(10), || c.is_dead());
    let rec = c.stop();
    let logs = dump_logs(&dir.0);
    assert!(
        died,
        "container with a dead engine never died: {rec:?}\n{logs}"
    );
    let death = rec.killed.map(|k| k.0).or(rec.exited_at).unwrap();
    eprintln!(
        "crashed engine (x{}): container dead {:?} after the crash by {} (window {window:?})",
        1.0 / s.k,
        death - crashed_at,
        rec.killed.map(|k| k.1).unwrap_or("its own exit")
    );
    assert!(
        death - crashed_at <= window + s.liveness.timeout + SLACK,
        "dead {:?} after the crash (window {window:?})",
        death - crashed_at
    );
    let ready_after = rec
        .ready_changes
        .iter()
        .any(|(at, ready)| *ready && *at > crashed_at + s.readiness.period + s.readiness.timeout);
    assert!(!ready_after, "ready with a dead engine: {rec:?}");
}
