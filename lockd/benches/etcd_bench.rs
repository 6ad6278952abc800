//! Cross-"node" handoff on the etcd backend, side by side with `etcdctl lock`, lock
//! throughput, and failover after a partition: issue 13's three figures in one command (not a
//! test).
//!
//! ```text
//! cargo bench -p lockd --bench etcd_bench -- [--rounds 100] [--etcdctl-rounds 10] [--etcdctl-ttl 2]
//!     [--clients 64] [--seconds 5]
//!     [--partition-trials 20] [--partition-ttl 3s] [--partition-kill-time 800ms]
//!     [--partition-pause 200ms] [--partition-drift-ppm 10000]
//! ```
//!
//! One real etcd (Debian's etcd-server) on free loopback ports, data on tmpfs when /dev/shm
//! exists; two `lockd serve --backend etcd` processes on it stand for two nodes A and B.
//! Each round:
//!
//! * **lockd**: `lockd hold` on A holds `engine` (its child: `sleep`); a waiter on B (a raw
//!   connection, as the supervisor's) is queued; the holder's process group is SIGKILLed;
//!   the figure is the time until the waiter reads `granted`. The waiter then closes.
//! * **etcdctl lock**: `etcdctl lock --ttl T NAME sleep 600` holds; a second `etcdctl lock
//!   --ttl T NAME` waits; the holder's process group is SIGKILLed; the figure is the time
//!   until the waiter prints its key (it has the lock). Nothing revokes the dead holder's
//!   lease: the handoff waits for its TTL.
//!
//! * **throughput**: `--clients` raw connections, half on A and half on B, contend for one
//!   resource for `--seconds`: each, once granted, releases and acquires again; the figure is
//!   grants per second (every grant is a hand-over through etcd).
//!
//! * **partition**: a second pair of lockds with the partition flags (`--etcd-ttl`,
//!   `--etcd-kill-time`, `--etcd-pause`, `--etcd-drift-ppm`; by default the e2e partition
//!   test's `FENCE_FLAGS`): A reaches etcd only through a TCP proxy (`harness::etcd::Proxy`),
//!   B directly. Each trial, on a fresh resource: A's lockd is first shown to reach etcd (a
//!   probe acquire is granted); a holder on A (raw connection, version-1 acquire, as the
//!   supervisor's) is granted after a random 0–500 ms pause (a random phase of etcd's 500 ms
//!   expiry check), a waiter on B is queued (else the bench fails, exit 2); after
//!   700 ms plus a random part of A's keepalive period the proxy black-holes A's traffic (no
//!   reset) at `t_cut`; `t_told`: A's holder reads `revoked` with a `lost:` reason; `t_grant`:
//!   B's waiter reads `granted` with a higher epoch; then the proxy heals. Figures: failover =
//!   `t_grant − t_cut` (target TTL + 200 ms), told after the cut (bound TTL − margin), and
//!   margin = `t_grant − t_told − kill time`: the holder must have had its whole kill budget
//!   before any grant. A negative margin is a violation: printed, and the bench exits 1.
//!
//! Percentiles are nearest rank (`harness::stats`). Prints the tables on stdout, progress on
//! stderr; `SKIP:` lines when etcd (everything) or etcdctl (its side) is missing.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use harness::etcd::{Etcd, Proxy};
use harness::proc::Proc;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

const LOCKD: &str = env!("CARGO_BIN_EXE_lockd");

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn start_lockd(dir: &Path, name: &str, url: &str) -> (Proc, PathBuf) {
    start_lockd_with(dir, name, url, &["--etcd-ttl".into(), "5s".into()])
}

/// `lockd serve --backend etcd` on `DIR/NAME.sock` with `extra` flags (the TTL and fence).
fn start_lockd_with(dir: &Path, name: &str, url: &str, extra: &[String]) -> (Proc, PathBuf) {
    let sock = dir.join(format!("{name}.sock"));
    let mut cmd = Command::new(LOCKD);
    cmd.args(["serve", "--backend", "etcd", "--etcd-endpoints", url])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .args(["--etcd-node", name])
        .args(extra)
        .env("LOCKD_LOG", "warn");
    let p = Proc::spawn(name, cmd, dir.join(format!("{name}.log")));
    let end = Instant::now() + Duration::from_secs(15);
    while UnixStream::connect(&sock).is_err() {
        assert!(
            Instant::now() < end,
            "lockd {name} not up: {}",
            p.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (p, sock)
}

struct Conn {
    w: UnixStream,
    r: BufReader<UnixStream>,
}

impl Conn {
    fn new(sock: &Path) -> Conn {
        let s = UnixStream::connect(sock).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Conn {
            r: BufReader::new(s.try_clone().unwrap()),
            w: s,
        }
    }
    fn until(&mut self, event: &str) -> serde_json::Value {
        loop {
            let mut l = String::new();
            let n = self.r.read_line(&mut l).expect("read from lockd");
            assert!(n > 0, "lockd closed the connection");
            let v: serde_json::Value = serde_json::from_str(&l).expect("event");
            if v["event"] == event {
                return v;
            }
            assert!(v["event"] != "error", "lockd error: {v}");
        }
    }
}

fn group(cmd: &mut Command) -> Child {
    cmd.process_group(0).spawn().expect("spawn")
}

fn kill_group(c: &mut Child) {
    let _ = killpg(Pid::from_raw(c.id() as i32), Signal::SIGKILL);
    let _ = c.wait();
}

fn lockd_round(a: &Path, b: &Path, dir: &Path) -> Duration {
    let epoch_file = dir.join("epoch");
    let _ = std::fs::remove_file(&epoch_file);
    let mut holder = group(
        Command::new(LOCKD)
            .args(["hold", "--connect"])
            .arg(format!("unix:{}", a.display()))
            .args(["--resource", "engine", "--holder", "a", "--", "sh", "-c"])
            .arg(format!(
                "echo $LOCKD_EPOCH > {}.tmp && mv {0}.tmp {0}; exec sleep 600",
                epoch_file.display()
            ))
            .stdin(Stdio::null()),
    );
    let end = Instant::now() + Duration::from_secs(20);
    while !epoch_file.exists() {
        assert!(Instant::now() < end, "lockd hold on A never granted");
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut w = Conn::new(b);
    w.w.write_all(b"{\"op\":\"acquire\",\"resource\":\"engine\",\"holder\":\"b\"}\n")
        .unwrap();
    w.until("queued");
    let t0 = Instant::now();
    kill_group(&mut holder);
    w.until("granted");
    let took = t0.elapsed();
    drop(w);
    took
}

fn etcdctl_round(ctl: &Path, url: &str, ttl: u64, name: &str) -> Duration {
    let mut holder = group(
        Command::new(ctl)
            .args([
                "--endpoints",
                url,
                "lock",
                &format!("--ttl={ttl}"),
                name,
                "sleep",
                "600",
            ])
            .env("ETCDCTL_API", "3")
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    // The holder has the lock once its key exists.
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let out = Command::new(ctl)
            .args(["--endpoints", url, "get", "--prefix", "--keys-only", name])
            .env("ETCDCTL_API", "3")
            .output()
            .expect("etcdctl get");
        if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
            break;
        }
        assert!(
            Instant::now() < end,
            "etcdctl lock holder never got the lock"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut waiter = group(
        Command::new(ctl)
            .args(["--endpoints", url, "lock", &format!("--ttl={ttl}"), name])
            .env("ETCDCTL_API", "3")
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    // Let the waiter put its key and start watching.
    std::thread::sleep(Duration::from_millis(300));
    let mut out = BufReader::new(waiter.stdout.take().expect("stdout"));
    let t0 = Instant::now();
    kill_group(&mut holder);
    let mut line = String::new();
    let n = out.read_line(&mut line).unwrap_or(0);
    let took = t0.elapsed();
    assert!(n > 0, "etcdctl lock waiter exited without the lock");
    kill_group(&mut waiter);
    took
}

fn row(name: &str, mut v: Vec<Duration>) -> String {
    let ms =
        |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.1} ms", d.as_secs_f64() * 1e3));
    let n = v.len();
    let med = harness::stats::percentile_of(&mut v, 50.0);
    let p90 = harness::stats::percentile_of(&mut v, 90.0);
    let p99 = harness::stats::percentile_of(&mut v, 99.0);
    format!(
        "| {name} | {n} | {} | {} | {} | {} |",
        ms(med),
        ms(p90),
        ms(p99),
        ms(v.last().copied())
    )
}

/// `clients` connections (alternating A and B) cycling acquire → granted → release on one
/// resource for `secs`: grants per second.
fn throughput(a: &Path, b: &Path, clients: usize, secs: u64) -> f64 {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for i in 0..clients {
        let sock = if i % 2 == 0 {
            a.to_path_buf()
        } else {
            b.to_path_buf()
        };
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            let mut c = Conn::new(&sock);
            let acquire =
                format!("{{\"op\":\"acquire\",\"resource\":\"tp\",\"holder\":\"c{i}\"}}\n");
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                c.w.write_all(acquire.as_bytes()).unwrap();
                c.until("granted");
                n += 1;
                c.w.write_all(b"{\"op\":\"release\",\"resource\":\"tp\"}\n")
                    .unwrap();
                c.until("released");
            }
            n
        }));
    }
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::Relaxed);
    let total: u64 = threads.into_iter().map(|t| t.join().unwrap_or(0)).sum();
    total as f64 / t0.elapsed().as_secs_f64()
}

fn main() {
    std::process::exit(run());
}

/// The whole bench; its exit code (returned, so that every child process is dropped, hence
/// killed, before the exit).
fn run() -> i32 {
    let rounds = arg("--rounds", 100) as usize;
    let clients = arg("--clients", 64) as usize;
    let seconds = arg("--seconds", 5);
    let ctl_rounds = arg("--etcdctl-rounds", 10) as usize;
    let ttl = arg("--etcdctl-ttl", 2);
    let part_trials = arg("--partition-trials", 20) as usize;
    let fence = Fence {
        ttl: dur_arg(
            "--partition-ttl",
            Duration::from_secs(3),
            Duration::from_secs(1),
        ),
        kill: dur_arg(
            "--partition-kill-time",
            Duration::from_millis(800),
            Duration::from_millis(1),
        ),
        pause: dur_arg(
            "--partition-pause",
            Duration::from_millis(200),
            Duration::from_millis(1),
        ),
        drift_ppm: arg("--partition-drift-ppm", 10_000) as u32,
    };
    if fence.ttl.subsec_nanos() != 0 || fence.ttl.is_zero() || fence.margin() >= fence.ttl {
        eprintln!(
            "etcd_bench: --partition-ttl must be whole seconds above the margin ({})",
            fence.describe()
        );
        return 2;
    }
    let base = if Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm")
    } else {
        tempfile::tempdir()
    }
    .expect("temp dir");
    let Some(etcd) = Etcd::start(base.path()) else {
        eprintln!("SKIP: etcd_bench: no etcd binary (apt-get install etcd-server)");
        return 0;
    };
    let (_a, sock_a) = start_lockd(base.path(), "A", &etcd.client_url);
    let (_b, sock_b) = start_lockd(base.path(), "B", &etcd.client_url);
    let mut lockd = Vec::with_capacity(rounds);
    for i in 0..rounds {
        lockd.push(lockd_round(&sock_a, &sock_b, base.path()));
        if (i + 1) % 20 == 0 {
            eprintln!("lockd rounds: {}/{rounds}", i + 1);
        }
    }
    eprintln!("throughput: {clients} clients for {seconds} s");
    let tput = throughput(&sock_a, &sock_b, clients, seconds);
    let mut ctl = Vec::new();
    match harness::etcd::etcdctl() {
        Some(c) => {
            for i in 0..ctl_rounds {
                ctl.push(etcdctl_round(
                    &c,
                    &etcd.client_url,
                    ttl,
                    &format!("bench-lock-{i}"),
                ));
                eprintln!("etcdctl lock rounds: {}/{ctl_rounds}", i + 1);
            }
        }
        None => eprintln!("SKIP: etcdctl lock side: no etcdctl (apt-get install etcd-client)"),
    }
    eprintln!(
        "partition: {part_trials} trials, lockd {}",
        fence.describe()
    );
    let part = if part_trials == 0 {
        eprintln!("SKIP: partition phase: --partition-trials 0");
        Ok(Vec::new())
    } else {
        partition_phase(base.path(), &etcd, &fence, part_trials)
    };
    println!();
    println!(
        "cross-node handoff on the holder's SIGKILL (one etcd {}, two lockds on loopback)",
        etcd_version()
    );
    println!("| handoff | rounds | median | p90 | p99 | max |");
    println!("|---|---|---|---|---|---|");
    println!(
        "{}",
        row(
            "lockd --backend etcd (A's holder killed -> B's waiter granted)",
            lockd
        )
    );
    println!(
        "{}",
        row(
            &format!("etcdctl lock --ttl={ttl} (holder killed -> waiter has the lock)"),
            ctl
        )
    );
    println!();
    println!("| throughput, one resource, {clients} clients over A and B | {tput:.0} grants/s |");
    match part {
        Ok(t) if t.is_empty() => 0,
        Ok(t) => {
            let violations = print_partition(&fence, &t);
            if violations > 0 {
                eprintln!(
                    "etcd_bench: VIOLATION: in {violations} of {} partition trials B was granted \
                     before A's holder had its {} ms kill budget",
                    t.len(),
                    fence.kill.as_millis()
                );
                1
            } else {
                0
            }
        }
        Err(e) => {
            println!();
            println!("partition failover: FAILED (see stderr)");
            eprintln!("etcd_bench: {e}");
            2
        }
    }
}

fn etcd_version() -> String {
    harness::etcd::binary()
        .and_then(|b| Command::new(b).arg("--version").output().ok())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_default()
}

// ---- partition failover ------------------------------------------------------------------

/// A duration flag: `3s`, `800ms` (humantime), or a bare number of `bare_unit`s. Exits
/// with a message on a bad value.
fn dur_arg(name: &str, default: Duration, bare_unit: Duration) -> Duration {
    let args: Vec<String> = std::env::args().collect();
    let Some(v) = args
        .iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
    else {
        return default;
    };
    if let Ok(n) = v.parse::<u32>() {
        return bare_unit * n;
    }
    humantime::parse_duration(v).unwrap_or_else(|e| {
        eprintln!("etcd_bench: {name} {v}: {e}");
        std::process::exit(2)
    })
}

/// The partition phase's settings: lockd's fence flags (the e2e partition test's by
/// default), given to both lockds.
struct Fence {
    ttl: Duration,
    kill: Duration,
    pause: Duration,
    drift_ppm: u32,
}

impl Fence {
    fn margin(&self) -> Duration {
        lockd::etcd::fence::Margin {
            drift_ppm: self.drift_ppm,
            pause: self.pause,
            kill: self.kill,
        }
        .of(self.ttl)
    }
    /// lockd's keepalive period: (TTL − margin) / 3.
    fn keepalive(&self) -> Duration {
        (self.ttl.saturating_sub(self.margin()) / 3).max(Duration::from_millis(20))
    }
    fn flags(&self) -> Vec<String> {
        vec![
            "--etcd-ttl".into(),
            format!("{}s", self.ttl.as_secs()),
            "--etcd-kill-time".into(),
            format!("{}ms", self.kill.as_millis()),
            "--etcd-pause".into(),
            format!("{}ms", self.pause.as_millis()),
            "--etcd-drift-ppm".into(),
            self.drift_ppm.to_string(),
        ]
    }
    fn describe(&self) -> String {
        format!(
            "--etcd-ttl {}s --etcd-kill-time {}ms --etcd-pause {}ms --etcd-drift-ppm {} \
             (margin {} ms, keepalive every {} ms)",
            self.ttl.as_secs(),
            self.kill.as_millis(),
            self.pause.as_millis(),
            self.drift_ppm,
            self.margin().as_millis(),
            self.keepalive().as_millis()
        )
    }
}

/// A raw connection to lockd with bounded reads that never panic.
struct Line {
    w: UnixStream,
    r: BufReader<UnixStream>,
}

impl Line {
    fn connect(sock: &Path) -> Result<Line, String> {
        let s =
            UnixStream::connect(sock).map_err(|e| format!("connect {}: {e}", sock.display()))?;
        let r = s
            .try_clone()
            .map_err(|e| format!("clone {}: {e}", sock.display()))?;
        Ok(Line {
            w: s,
            r: BufReader::new(r),
        })
    }
    fn send(&mut self, line: &str) -> Result<(), String> {
        self.w
            .write_all(format!("{line}\n").as_bytes())
            .map_err(|e| format!("send {line}: {e}"))
    }
    /// The next event with `"event": event` within `limit`, skipping others; an `error`
    /// event, EOF, a timeout or a line that is not JSON is an error.
    fn until(&mut self, event: &str, limit: Duration) -> Result<serde_json::Value, String> {
        let end = Instant::now() + limit;
        loop {
            let left = end
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .ok_or_else(|| format!("no `{event}` within {limit:?}"))?;
            self.r
                .get_ref()
                .set_read_timeout(Some(left))
                .map_err(|e| format!("set_read_timeout: {e}"))?;
            let mut l = String::new();
            match self.r.read_line(&mut l) {
                Ok(0) => return Err(format!("lockd closed the connection before `{event}`")),
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(format!("no `{event}` within {limit:?}"))
                }
                Err(e) => return Err(format!("read while waiting for `{event}`: {e}")),
            }
            let v: serde_json::Value = serde_json::from_str(&l)
                .map_err(|e| format!("unexpected line from lockd ({e}): {}", l.trim_end()))?;
            if v["event"] == event {
                return Ok(v);
            }
            if v["event"] == "error" {
                return Err(format!("lockd error while waiting for `{event}`: {v}"));
            }
        }
    }
}

fn acquire_line(resource: &str, holder: &str) -> String {
    format!("{{\"op\":\"acquire\",\"resource\":\"{resource}\",\"holder\":\"{holder}\"}}")
}

/// Read `conn` on a thread until `event`: its arrival time and value (or the error).
fn arrival(
    mut conn: Line,
    event: &'static str,
    limit: Duration,
) -> std::sync::mpsc::Receiver<Result<(Instant, serde_json::Value), String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = conn.until(event, limit).map(|v| (Instant::now(), v));
        let _ = tx.send(r);
        drop(conn);
    });
    rx
}

/// One partition trial's times, from the cut (ms; `told` and `granted` are measured on the
/// bench's clock when each connection's reader thread read the line).
struct PartitionTrial {
    told_ms: f64,
    granted_ms: f64,
    epochs: (u64, u64),
}

/// A's lockd reaches etcd again: a fresh acquire on it is granted and released (bounded).
fn a_recovered(sock: &Path, probe: &str, limit: Duration) -> Result<(), String> {
    let mut c = Line::connect(sock)?;
    c.send(&acquire_line(probe, "probe"))?;
    c.until("granted", limit)?;
    c.send(&format!("{{\"op\":\"release\",\"resource\":\"{probe}\"}}"))?;
    c.until("released", limit)?;
    Ok(())
}

/// One trial: A's holder (version-1 acquire on a raw connection, as the supervisor's) holds
/// `resource`, B's waiter is queued; the proxy black-holes A's etcd traffic; when is the
/// holder told `revoked` (`lost:…`), when is the waiter granted. Heals before returning.
fn partition_trial(
    a: &Path,
    b: &Path,
    proxy: &Proxy,
    resource: &str,
    fence: &Fence,
) -> Result<PartitionTrial, String> {
    use rand::Rng;
    let setup = Duration::from_secs(10);
    // The trial's start follows the previous trial's grant, which came at a tick of etcd's
    // lessor (it looks for expired leases every 500 ms): without this pause A's new lease, and
    // so its expiry, would stand at nearly the same phase of that tick in every trial, and the
    // failover figures would sample one expiry-check delay instead of all of them.
    std::thread::sleep(Duration::from_millis(rand::thread_rng().gen_range(0..500)));
    let mut holder = Line::connect(a)?;
    holder.send(&acquire_line(resource, "engine-a"))?;
    let g = holder
        .until("granted", setup)
        .map_err(|e| format!("setup: A's holder: {e}"))?;
    let ea = g["epoch"]
        .as_u64()
        .ok_or_else(|| format!("setup: A's grant without an epoch: {g}"))?;
    let mut waiter = Line::connect(b)?;
    waiter.send(&acquire_line(resource, "engine-b"))?;
    waiter
        .until("queued", setup)
        .map_err(|e| format!("setup: B's waiter (expected `queued` behind A): {e}"))?;
    // A keepalive or two go through; the cut falls at a random phase of A's keepalive period.
    let period = fence.keepalive().as_millis().max(1) as u64;
    std::thread::sleep(Duration::from_millis(
        700 + rand::thread_rng().gen_range(0..period),
    ));
    let limit = fence.ttl + Duration::from_secs(15);
    let told = arrival(holder, "revoked", limit);
    let granted = arrival(waiter, "granted", limit);
    let cut = Instant::now();
    proxy.blackhole();
    let told = told
        .recv_timeout(limit + Duration::from_secs(1))
        .unwrap_or_else(|_| Err("reader thread gone".into()));
    let granted = granted
        .recv_timeout(limit + Duration::from_secs(1))
        .unwrap_or_else(|_| Err("reader thread gone".into()));
    proxy.heal();
    let (t_told, rv) = told.map_err(|e| format!("A's holder was never told: {e}"))?;
    let (t_granted, gv) = granted.map_err(|e| format!("B's waiter was never granted: {e}"))?;
    let reason = rv["reason"].as_str().unwrap_or_default();
    if !reason.starts_with("lost:") {
        return Err(format!(
            "A's holder told `revoked` without a `lost:` reason: {rv}"
        ));
    }
    let eb = gv["epoch"]
        .as_u64()
        .ok_or_else(|| format!("B's grant without an epoch: {gv}"))?;
    if eb <= ea {
        return Err(format!("B granted epoch {eb}, not above A's {ea}"));
    }
    let ms = |t: Instant| {
        if t >= cut {
            t.duration_since(cut).as_secs_f64() * 1e3
        } else {
            -(cut.duration_since(t).as_secs_f64() * 1e3)
        }
    };
    Ok(PartitionTrial {
        told_ms: ms(t_told),
        granted_ms: ms(t_granted),
        epochs: (ea, eb),
    })
}

/// The partition phase: its own pair of lockds (A through a black-holing proxy, B direct)
/// on `etcd`, `trials` trials. Err: a trial could not be set up or measured.
fn partition_phase(
    dir: &Path,
    etcd: &Etcd,
    fence: &Fence,
    trials: usize,
) -> Result<Vec<PartitionTrial>, String> {
    let proxy = Proxy::start(([127, 0, 0, 1], etcd.client_port).into());
    let flags = fence.flags();
    let (a, sock_a) = start_lockd_with(dir, "pA", &proxy.url(), &flags);
    let (b, sock_b) = start_lockd_with(dir, "pB", &etcd.client_url, &flags);
    let logs = || {
        format!(
            "\n--- lockd pA log ---\n{}\n--- lockd pB log ---\n{}",
            a.log_text(),
            b.log_text()
        )
    };
    let mut out = Vec::with_capacity(trials);
    for i in 0..trials {
        // Each trial starts from "A holds, B queued" on a fresh resource, with A's lockd
        // reaching etcd again (its sessions of the last trial stay lost).
        a_recovered(&sock_a, &format!("probe-{i}"), Duration::from_secs(15)).map_err(|e| {
            format!(
                "partition trial {}: A's lockd did not recover after the heal: {e}{}",
                i + 1,
                logs()
            )
        })?;
        let t = partition_trial(&sock_a, &sock_b, &proxy, &format!("part-{i}"), fence)
            .map_err(|e| format!("partition trial {}: {e}{}", i + 1, logs()))?;
        let margin = t.granted_ms - t.told_ms - fence.kill.as_secs_f64() * 1e3;
        eprintln!(
            "partition trial {}/{trials}: told {:.0} ms after the cut, B granted {:.0} ms after \
             the cut (epoch {} -> {}), margin {:.0} ms{}",
            i + 1,
            t.told_ms,
            t.granted_ms,
            t.epochs.0,
            t.epochs.1,
            margin,
            if margin < 0.0 { "  VIOLATION" } else { "" }
        );
        out.push(t);
    }
    Ok(out)
}

/// `| name | n | min | median | p90 | p99 | max |` of millisecond samples.
fn ms_row(name: &str, mut v: Vec<f64>) -> String {
    let f = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.0} ms"));
    let n = v.len();
    let med = harness::stats::percentile_of(&mut v, 50.0);
    let p90 = harness::stats::percentile_of(&mut v, 90.0);
    let p99 = harness::stats::percentile_of(&mut v, 99.0);
    format!(
        "| {name} | {n} | {} | {} | {} | {} | {} |",
        f(v.first().copied()),
        f(med),
        f(p90),
        f(p99),
        f(v.last().copied())
    )
}

/// Prints the partition table; the number of margin violations.
fn print_partition(fence: &Fence, trials: &[PartitionTrial]) -> usize {
    let kill_ms = fence.kill.as_secs_f64() * 1e3;
    let target_ms = (fence.ttl + Duration::from_millis(200)).as_secs_f64() * 1e3;
    let failover: Vec<f64> = trials.iter().map(|t| t.granted_ms).collect();
    let told: Vec<f64> = trials.iter().map(|t| t.told_ms).collect();
    let after_told: Vec<f64> = trials.iter().map(|t| t.granted_ms - t.told_ms).collect();
    let margin: Vec<f64> = after_told.iter().map(|d| d - kill_ms).collect();
    let meet = failover.iter().filter(|&&f| f <= target_ms).count();
    let violations: Vec<f64> = margin.iter().copied().filter(|&m| m < 0.0).collect();
    println!();
    println!(
        "partition failover: A's etcd traffic black-holed by a proxy (no reset), B direct; \
         lockd {}",
        fence.describe()
    );
    println!("| partition | trials | min | median | p90 | p99 | max |");
    println!("|---|---|---|---|---|---|---|");
    println!(
        "{}",
        ms_row("failover: cut -> B's waiter granted", failover)
    );
    println!(
        "{}",
        ms_row(
            &format!(
                "A's holder told (`lost:`) after the cut (bound TTL - margin = {} ms)",
                fence.ttl.saturating_sub(fence.margin()).as_millis()
            ),
            told
        )
    );
    println!(
        "{}",
        ms_row("B granted after A's holder was told", after_told)
    );
    println!(
        "{}",
        ms_row(
            &format!("margin: granted - told - kill {kill_ms:.0} ms (never negative)"),
            margin
        )
    );
    println!();
    println!(
        "| failover target TTL + 200 ms = {target_ms:.0} ms | {meet} of {} trials meet it |",
        trials.len()
    );
    if violations.is_empty() {
        println!(
            "| margin violations (B granted before A's holder had its {kill_ms:.0} ms kill budget) | none |"
        );
    } else {
        println!(
            "| MARGIN VIOLATIONS (B granted before A's holder had its {kill_ms:.0} ms kill budget) | {} of {}: {} |",
            violations.len(),
            trials.len(),
            violations
                .iter()
                .map(|m| format!("{m:.0} ms"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    violations.len()
}
