//! lockd benchmark (not a test). Run with:
//!
//! ```text
//! cargo bench -p lockd --bench lockd_bench -- [--rounds 200] [--clients 64] [--seconds 5]
//!     [--scale-sessions 10000] [--scale-resources 1000] [--scale-only | --kinds-only]
//!     [--json FILE]
//! ```
//!
//! Measures, in one run, with the state file on tmpfs (/dev/shm):
//! 1. handoff latency: the holder's process group is SIGKILLed → the waiter's child is running
//!    (its first action is to print CLOCK_REALTIME in ns via `date +%s%N`), for `lockd hold`
//!    and for util-linux `flock(1)` over the same number of interleaved rounds; median, p99, ratio.
//!    `--anchor-lockd PATH` adds, interleaved in the same rounds, an earlier build of lockd (its
//!    `serve` and its `hold`), and its one-resource throughput: "no worse than before" measured
//!    side by side in one run, not across runs whose spread is larger than the difference.
//! 2. grant/release throughput with N contending clients on one resource (and, for reference,
//!    spread over 8 resources, with one blocking thread per client, and against a second lockd
//!    started with `--busy-poll 0`): each client pipelines `release`+`acquire` as soon as it is
//!    granted; plus the machine's bare Unix-socket round trip between two sleeping threads, the
//!    floor under a one-resource cycle when lockd sleeps between requests.
//! 3. scale (issue 11, point 4): a fresh lockd with `--scale-sessions` raw connections over
//!    `--scale-resources` resources (one holder each, the rest queued): lockd's RSS (VmRSS of
//!    /proc/PID/status), `status` latency over a raw connection (request → whole answer read),
//!    and the time until every resource's next waiter has read its grant after every holder
//!    closed its connection at once (with the number of durable state writes that took).
//!    `--scale-only` runs this part alone. Needs `ulimit -n` above the session count.
//!    Beside the full `status`, the same with `"sessions":false` (no per-session list).
//! 4. the same scale figures per protocol-2 lease kind, each on a fresh lockd (ttl: every
//!    resource held by a TTL lease with waiters, mass release by lease id; shared: readers
//!    holding and one writer waiting per resource, every reader leaves at once; quantity: one
//!    pool of `--scale-resources` offers of 1 and `--scale-sessions` requests of 1), and one
//!    client's acquire+release cycles/s on one resource for each kind (v1 included).
//!    `--kinds-only` runs this part alone; `--no-scale` skips parts 3 and 4 (a quick check of
//!    handoff and throughput).
//!
//! `--json FILE` writes every figure as JSON (also printed last).
//!
//! `--socket PATH --cycles N [--clients 64] [--resources 1]`: no lockd of its own; runs
//! exactly `N` grant/release cycles against the lockd on `PATH` and prints the time taken
//! (for instruction counts of a lockd run under `valgrind --tool=callgrind`, which are
//! stable on a busy machine where wall-clock throughput is not).
//!
//! lockd runs with `LOCKD_LOG=warn` (set `LOCKD_BENCH_LOG=info` to include its per-transition
//! log lines, written to a file in the bench directory). It is started by `harness::lockd`,
//! the workspace's one lockd launcher.
//!
//! Percentiles (median, p99) are **nearest rank** (`harness::stats::percentile`, the
//! workspace's one definition): always one of the measured samples, never an interpolation.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use harness::lockd::{Lockd, LockdSpec};
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

fn realtime_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn spawn_group(cmd: &mut Command) -> Child {
    cmd.process_group(0)
        .stdin(Stdio::null())
        .stderr(Stdio::null());
    cmd.spawn().expect("spawn")
}

fn kill_group(c: &mut Child) {
    let _ = killpg(Pid::from_raw(c.id() as i32), Signal::SIGKILL);
    let _ = c.wait();
}

/// Read one line from a child's stdout, bounded by `limit`.
fn read_line_bounded(r: &mut BufReader<std::process::ChildStdout>, limit: Duration) -> String {
    if r.buffer().is_empty() {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(r.get_ref().as_fd(), PollFlags::POLLIN)];
        let timeout = PollTimeout::try_from(limit).unwrap_or(PollTimeout::MAX);
        let n = poll(&mut fds, timeout).unwrap_or(0);
        assert!(n > 0, "child printed nothing within {limit:?}");
    }
    let mut s = String::new();
    r.read_line(&mut s).expect("read child stdout");
    s
}

fn wait_until(limit: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(500));
    }
}

fn lockd_waiters(sock: &Path) -> usize {
    harness::lockd::status_at(sock, Duration::from_secs(5))
        .ok()
        .and_then(|st| st.resources.into_iter().find(|r| r.name == "bench"))
        .map_or(0, |r| r.waiters.len())
}

fn flock_blocked(pid: u32) -> bool {
    let mut s = String::new();
    if std::fs::File::open("/proc/locks")
        .and_then(|mut f| f.read_to_string(&mut s))
        .is_err()
    {
        return true;
    }
    s.lines()
        .any(|l| l.contains("->") && l.split_whitespace().any(|w| w == pid.to_string()))
}

enum Tool<'a> {
    /// `lockd hold` of binary `bin` against the lockd on `sock`.
    Lockd {
        sock: &'a Path,
        bin: &'a str,
    },
    Flock(&'a Path),
}

/// One round: returns kill → child-running latency in µs.
fn round(tool: &Tool<'_>) -> f64 {
    let holder_cmd = |c: &mut Command| {
        c.args(["sh", "-c", "echo ready; exec sleep 3600"]);
    };
    let (mut holder, mut waiter) = match tool {
        Tool::Lockd { sock, bin } => {
            let ep = format!("unix:{}", sock.display());
            let mut h = Command::new(bin);
            h.args([
                "hold",
                "--connect",
                &ep,
                "--resource",
                "bench",
                "--holder",
                "h",
                "--",
            ]);
            holder_cmd(&mut h);
            let mut holder = spawn_group(h.stdout(Stdio::piped()));
            let mut hr = BufReader::new(holder.stdout.take().unwrap());
            read_line_bounded(&mut hr, Duration::from_secs(10));
            let mut w = Command::new(bin);
            w.args([
                "hold",
                "--connect",
                &ep,
                "--resource",
                "bench",
                "--holder",
                "w",
                "--",
                "date",
                "+%s%N",
            ]);
            let waiter = spawn_group(w.stdout(Stdio::piped()));
            wait_until(Duration::from_secs(10), "lockd waiter queued", || {
                lockd_waiters(sock) == 1
            });
            (holder, waiter)
        }
        Tool::Flock(file) => {
            let mut h = Command::new("flock");
            h.arg(file);
            holder_cmd(&mut h);
            let mut holder = spawn_group(h.stdout(Stdio::piped()));
            let mut hr = BufReader::new(holder.stdout.take().unwrap());
            read_line_bounded(&mut hr, Duration::from_secs(10));
            let mut w = Command::new("flock");
            w.arg(file).args(["date", "+%s%N"]);
            let waiter = spawn_group(w.stdout(Stdio::piped()));
            let pid = waiter.id();
            wait_until(Duration::from_secs(10), "flock waiter blocked", || {
                flock_blocked(pid)
            });
            (holder, waiter)
        }
    };
    std::thread::sleep(Duration::from_millis(5));
    let mut wr = BufReader::new(waiter.stdout.take().unwrap());
    let t_kill = realtime_ns();
    let _ = killpg(Pid::from_raw(holder.id() as i32), Signal::SIGKILL);
    let line = read_line_bounded(&mut wr, Duration::from_secs(10));
    let t_child: u128 = line.trim().parse().expect("date output");
    let _ = holder.wait();
    let _ = waiter.wait();
    kill_group(&mut waiter);
    (t_child.saturating_sub(t_kill)) as f64 / 1000.0
}

/// Nearest-rank percentile `p` (0..=100) of ascending `sorted` (non-empty: rounds >= 1).
fn pct(sorted: &[f64], p: f64) -> f64 {
    harness::stats::percentile(sorted, p).expect("at least one round")
}

/// The same cycle with one blocking OS thread per client (no async runtime in the client).
fn throughput_threads(sock: &Path, clients: usize, resources: usize, secs: u64) -> (u64, f64) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let stop = Arc::new(AtomicBool::new(false));
    let total = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for i in 0..clients {
        let (sock, stop, total) = (sock.to_path_buf(), stop.clone(), total.clone());
        threads.push(std::thread::spawn(move || {
            let mut s = UnixStream::connect(&sock).expect("connect");
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            let res = format!("tt{}", i % resources);
            let acq =
                format!("{{\"op\":\"acquire\",\"resource\":\"{res}\",\"holder\":\"t{i}\"}}\n");
            let rel_acq = format!("{{\"op\":\"release\",\"resource\":\"{res}\"}}\n{acq}");
            let _ = s.write_all(acq.as_bytes());
            let mut buf = vec![0u8; 64 * 1024];
            let mut pending = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let n = match s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(_) => continue,
                };
                pending.extend_from_slice(&buf[..n]);
                while let Some(p) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=p).collect();
                    if line.windows(17).any(|w| w == b"\"event\":\"granted\"") {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        total.fetch_add(1, Ordering::Relaxed);
                        let _ = s.write_all(rel_acq.as_bytes());
                    }
                }
            }
        }));
    }
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let n = total.load(Ordering::Relaxed);
    let elapsed = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for th in threads {
        let _ = th.join();
    }
    (n, n as f64 / elapsed)
}

async fn throughput(sock: &Path, clients: usize, resources: usize, secs: u64) -> (u64, f64) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..clients {
        let sock = sock.to_path_buf();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = tokio::net::UnixStream::connect(&sock)
                .await
                .expect("connect");
            let res = format!("tp{}", i % resources);
            let acq =
                format!("{{\"op\":\"acquire\",\"resource\":\"{res}\",\"holder\":\"c{i}\"}}\n");
            let rel_acq = format!("{{\"op\":\"release\",\"resource\":\"{res}\"}}\n{acq}");
            s.write_all(acq.as_bytes()).await.unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            let mut pending = Vec::new();
            let mut cycles = 0u64;
            loop {
                let n = s.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                pending.extend_from_slice(&buf[..n]);
                while let Some(p) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=p).collect();
                    if line.windows(17).any(|w| w == b"\"event\":\"granted\"") {
                        cycles += 1;
                        if stop.load(std::sync::atomic::Ordering::Relaxed) {
                            return cycles;
                        }
                        s.write_all(rel_acq.as_bytes()).await.unwrap();
                    }
                }
            }
            cycles
        }));
    }
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let elapsed = t.elapsed().as_secs_f64();
    // Whoever holds when we stop returns at its next grant; the rest are queued: abort them.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut total = 0;
    for t in tasks {
        if t.is_finished() {
            total += t.await.unwrap_or(0);
        } else {
            t.abort();
        }
    }
    (total, total as f64 / elapsed)
}

/// user+system CPU seconds of a process, from the kernel's per-process CPU clock
/// (`clock_getcpuclockid` + `clock_gettime`; 0 if the process is gone).
fn cpu_secs(pid: u32) -> f64 {
    use nix::time::{clock_getcpuclockid, clock_gettime};
    clock_getcpuclockid(Pid::from_raw(pid as i32))
        .and_then(clock_gettime)
        .map_or(0.0, |t| t.tv_sec() as f64 + t.tv_nsec() as f64 / 1e9)
}

/// lockd's `/metrics` body, through the workspace's HTTP client (empty if it cannot be read).
fn scrape(metrics: u16) -> String {
    harness::http::get(
        &format!("http://127.0.0.1:{metrics}/metrics"),
        Duration::from_secs(5),
    )
    .filter(|r| r.status == 200)
    .map(|r| r.body)
    .unwrap_or_default()
}

/// The value of an unlabelled metric in a scrape (0 if absent). Reads the sample's first
/// token after the name, so the Prometheus text format and OpenMetrics (timestamps,
/// exemplars, `# EOF`) both work.
fn metric(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|v| v.strip_prefix(' '))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
}

/// lockd's handoff and persist histograms: (handoffs, mean handoff s, mean persist s).
fn server_handoff(metrics: u16) -> (f64, f64, f64) {
    let out = scrape(metrics);
    let (sum, count) = (
        metric(&out, "lockd_handoff_seconds_sum"),
        metric(&out, "lockd_handoff_seconds_count"),
    );
    let (psum, pcount) = (
        metric(&out, "lockd_persist_seconds_sum"),
        metric(&out, "lockd_persist_seconds_count"),
    );
    (
        count,
        if count > 0.0 { sum / count } else { 0.0 },
        if pcount > 0.0 { psum / pcount } else { 0.0 },
    )
}

/// The floor under a one-resource cycle: a bare 1-byte ping-pong between two threads over
/// a Unix socket pair, each sleeping in a blocking read (no lockd, no JSON, no fsync).
/// Returns round trips per second over `secs`.
fn bare_round_trip(secs: f64) -> f64 {
    let (mut a, mut b) = UnixStream::pair().expect("socketpair");
    let echo = std::thread::spawn(move || {
        let mut x = [0u8; 1];
        while matches!(b.read(&mut x), Ok(1)) {
            if b.write_all(&x).is_err() {
                break;
            }
        }
    });
    let mut x = [0u8; 1];
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        for _ in 0..100 {
            a.write_all(b"x").expect("ping");
            a.read_exact(&mut x).expect("pong");
        }
        n += 100;
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    drop(a);
    let _ = echo.join();
    rate
}

/// A lockd on `DIR/lockd.sock` and `DIR/state.json` with metrics on `metrics`, logging to
/// `DIR/lockd.log`. The launcher removes every `LOCKD_*` variable of this environment (so the
/// shipped `--busy-poll` default is measured unless `extra` says otherwise).
fn start_lockd(dir: &Path, metrics: u16, extra: &[&str]) -> Lockd {
    start_lockd_bin(LOCKD, dir, metrics, extra)
}

/// [`start_lockd`] with another lockd binary (`--anchor-lockd`).
fn start_lockd_bin(bin: &str, dir: &Path, metrics: u16, extra: &[&str]) -> Lockd {
    Lockd::start(
        LockdSpec::new(dir)
            .state(dir.join("state.json"))
            .metrics(format!("127.0.0.1:{metrics}"))
            .args(["--rate-limit", "1000000"])
            .args(extra.iter().copied())
            .log_filter(std::env::var("LOCKD_BENCH_LOG").unwrap_or_else(|_| "warn".into()))
            .bin(bin),
    )
}

/// Resident set size of a process in KiB (`VmRSS` of /proc/PID/status; 0 if unreadable).
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// Read lines from a raw client socket until one contains `needle` (bounded by `limit`).
fn read_until(
    s: &mut UnixStream,
    pending: &mut Vec<u8>,
    needle: &[u8],
    limit: Duration,
) -> Vec<u8> {
    let end = Instant::now() + limit;
    let mut buf = vec![0u8; 64 * 1024];
    // Bytes of `pending` already searched for a newline (a long answer arrives in many reads).
    let mut scanned = 0;
    loop {
        while let Some(p) = pending[scanned..].iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=scanned + p).collect();
            scanned = 0;
            // Events start with their name: look for it in the line's head only.
            let head = &line[..line.len().min(64)];
            if head.windows(needle.len()).any(|w| w == needle) {
                return line;
            }
        }
        scanned = pending.len();
        let left = end.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "no {:?} within {limit:?}",
            String::from_utf8_lossy(needle)
        );
        s.set_read_timeout(Some(left)).expect("set_read_timeout");
        let n = s.read(&mut buf).expect("read from lockd");
        assert!(n > 0, "lockd closed a bench connection");
        pending.extend_from_slice(&buf[..n]);
    }
}

/// Scale figures: what lockd costs with many sessions waiting.
struct Scale {
    /// Sessions connected.
    sessions: usize,
    /// Resources (one holder each, the other sessions queued evenly).
    resources: usize,
    /// lockd's RSS before any session (KiB).
    rss_idle_kib: u64,
    /// lockd's RSS with every session connected and waiting (KiB).
    rss_kib: u64,
    /// `status` round trips over a raw connection (µs, sorted).
    status_us: Vec<f64>,
    /// Bytes of one `status` answer.
    status_bytes: usize,
    /// `status` with `"sessions":false` round trips (µs, sorted).
    status_nosess_us: Vec<f64>,
    /// Bytes of one `status` answer with `"sessions":false`.
    status_nosess_bytes: usize,
    /// Every holder closes its connection at once → every resource granted to its next waiter (ms).
    mass_handover_ms: f64,
    /// Durable state writes during the mass hand-over.
    mass_writes: f64,
}

/// The scale scenario: `sessions` raw connections over `resources` resources (one holder
/// each, the rest queued), then every holder leaves at once.
fn scale(dir: &Path, sessions: usize, resources: usize) -> Scale {
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut lockd = start_lockd(dir, metrics, &["--idle-timeout", "60s"]);
    let sock = lockd.socket().to_path_buf();
    let pid = lockd.pid().expect("lockd runs") as u32;
    let rss_idle_kib = rss_kib(pid);
    let connect = |i: usize| {
        let r = i % resources;
        let mut s = UnixStream::connect(&sock).expect("connect (raise ulimit -n?)");
        let req = format!("{{\"op\":\"acquire\",\"resource\":\"s{r}\",\"holder\":\"h{i}\"}}\n");
        s.write_all(req.as_bytes()).expect("acquire");
        s
    };
    // Holders first (granted at once), then the waiters, in rounds over the resources.
    let mut holders = Vec::with_capacity(resources);
    for i in 0..resources {
        let mut s = connect(i);
        let mut p = Vec::new();
        read_until(
            &mut s,
            &mut p,
            b"\"event\":\"granted\"",
            Duration::from_secs(30),
        );
        holders.push(s);
    }
    let mut waiters = Vec::with_capacity(sessions.saturating_sub(resources));
    for i in resources..sessions {
        waiters.push(connect(i));
    }
    // Every waiter is queued once the status lists them all.
    wait_until(Duration::from_secs(120), "every waiter queued", || {
        harness::lockd::status_at(&sock, Duration::from_secs(10))
            .map(|st| st.resources.iter().map(|r| r.waiters.len()).sum::<usize>())
            .unwrap_or(0)
            == sessions - resources
    });
    std::thread::sleep(Duration::from_millis(300));
    let rss = rss_kib(pid);
    // `status` over one raw connection, as a client sees it (request → whole answer read).
    let mut st = UnixStream::connect(&sock).expect("connect");
    let mut p = Vec::new();
    read_until(
        &mut st,
        &mut p,
        b"\"event\":\"hello\"",
        Duration::from_secs(10),
    );
    let mut status_us = Vec::new();
    let mut status_bytes = 0;
    for _ in 0..30 {
        let t = Instant::now();
        st.write_all(b"{\"op\":\"status\"}\n").expect("status");
        let line = read_until(
            &mut st,
            &mut p,
            b"\"event\":\"status\"",
            Duration::from_secs(10),
        );
        status_us.push(t.elapsed().as_secs_f64() * 1e6);
        status_bytes = line.len();
    }
    status_us.sort_by(f64::total_cmp);
    let (status_nosess_us, status_nosess_bytes) = status_times(&mut st, &mut p, false, 30);
    drop(st);
    // The next waiter of resource r is the session that connected at `resources + r`.
    let w0 = scrape(metrics);
    let t = Instant::now();
    drop(holders);
    for w in waiters.iter_mut().take(resources) {
        let mut p = Vec::new();
        read_until(w, &mut p, b"\"event\":\"granted\"", Duration::from_secs(60));
    }
    let mass_handover_ms = t.elapsed().as_secs_f64() * 1e3;
    let w1 = scrape(metrics);
    let mass_writes =
        metric(&w1, "lockd_persist_seconds_count") - metric(&w0, "lockd_persist_seconds_count");
    drop(waiters);
    lockd.signal(Signal::SIGTERM);
    let _ = lockd.wait_exit(Duration::from_secs(30));
    Scale {
        sessions,
        resources,
        rss_idle_kib,
        rss_kib: rss,
        status_us,
        status_bytes,
        status_nosess_us,
        status_nosess_bytes,
        mass_handover_ms,
        mass_writes,
    }
}

/// Run [`scale`] in its own directory, print its figures and return them as JSON.
fn scale_phase(base: &Path, sessions: usize, resources: usize) -> serde_json::Value {
    let dir = base.join("scale");
    std::fs::create_dir_all(&dir).unwrap();
    eprintln!("  scale: {sessions} sessions over {resources} resources ...");
    let sc = scale(&dir, sessions, resources);
    let med = pct(&sc.status_us, 50.0);
    let p99 = pct(&sc.status_us, 99.0);
    let per_session =
        (sc.rss_kib.saturating_sub(sc.rss_idle_kib)) as f64 / sc.sessions.max(1) as f64;
    let mib = sc.rss_kib as f64 / 1024.0;
    println!("\nscale: {} sessions (one holder per resource, the rest queued) over {} resources, raw client", sc.sessions, sc.resources);
    println!(
        "  lockd RSS: {mib:.1} MiB ({:.1} MiB idle, {per_session:.2} KiB per session) (target <= 40 MiB: {})",
        sc.rss_idle_kib as f64 / 1024.0,
        if mib <= 40.0 { "MET" } else { "MISSED" }
    );
    println!(
        "  status ({} bytes): median {:.2} ms, p99 {:.2} ms over {} requests (target <= 5 ms: {})",
        sc.status_bytes,
        med / 1e3,
        p99 / 1e3,
        sc.status_us.len(),
        if med <= 5000.0 { "MET" } else { "MISSED" }
    );
    let (nmed, np99) = (
        pct(&sc.status_nosess_us, 50.0),
        pct(&sc.status_nosess_us, 99.0),
    );
    println!(
        "  status with \"sessions\":false ({} bytes): median {:.2} ms, p99 {:.2} ms",
        sc.status_nosess_bytes,
        nmed / 1e3,
        np99 / 1e3,
    );
    println!(
        "  every holder leaves at once -> all {} hand-overs seen by the next waiters: {:.1} ms, {} durable state writes (target <= 100 ms: {})",
        sc.resources,
        sc.mass_handover_ms,
        sc.mass_writes,
        if sc.mass_handover_ms <= 100.0 { "MET" } else { "MISSED" }
    );
    serde_json::json!({
        "sessions": sc.sessions, "resources": sc.resources,
        "rss_mib": mib, "rss_idle_mib": sc.rss_idle_kib as f64 / 1024.0, "rss_kib_per_session": per_session,
        "status_ms": {"median": med / 1e3, "p99": p99 / 1e3, "bytes": sc.status_bytes},
        "status_sessions_false_ms": {"median": nmed / 1e3, "p99": np99 / 1e3, "bytes": sc.status_nosess_bytes},
        "mass_handover_ms": sc.mass_handover_ms, "mass_handover_state_writes": sc.mass_writes,
    })
}

/// `n` `status` round trips over `st` (full, or `"sessions":false`): (µs sorted, bytes).
fn status_times(
    st: &mut UnixStream,
    p: &mut Vec<u8>,
    sessions: bool,
    n: usize,
) -> (Vec<f64>, usize) {
    let req: &[u8] = if sessions {
        b"{\"op\":\"status\"}\n"
    } else {
        b"{\"op\":\"status\",\"sessions\":false}\n"
    };
    let mut us = Vec::with_capacity(n);
    let mut bytes = 0;
    for _ in 0..n {
        let t = Instant::now();
        st.write_all(req).expect("status");
        let line = read_until(st, p, b"\"event\":\"status\"", Duration::from_secs(30));
        us.push(t.elapsed().as_secs_f64() * 1e6);
        bytes = line.len();
    }
    us.sort_by(f64::total_cmp);
    (us, bytes)
}

/// A lease kind of protocol 2, for the per-kind figures.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// Version 1's connection-bound lease.
    Exclusive,
    /// `ttl_ms`.
    Ttl,
    /// `mode` (readers and writers).
    Shared,
    /// `quantity` from a pool's offers.
    Quantity,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Exclusive => "exclusive (v1)",
            Kind::Ttl => "ttl",
            Kind::Shared => "shared",
            Kind::Quantity => "quantity",
        }
    }
}

/// A connection that sent one acquire and reads its answers (bytes not yet consumed kept).
struct Client {
    s: UnixStream,
    p: Vec<u8>,
}

impl Client {
    fn connect(sock: &Path, line: &str) -> Client {
        let mut s = UnixStream::connect(sock).expect("connect (raise ulimit -n?)");
        s.write_all(line.as_bytes()).expect("acquire");
        Client { s, p: Vec::new() }
    }
    /// The next line whose head contains `needle`, as JSON.
    fn until(&mut self, needle: &[u8], limit: Duration) -> serde_json::Value {
        let line = read_until(&mut self.s, &mut self.p, needle, limit);
        serde_json::from_slice(&line).expect("JSON event")
    }
}

/// The offers file of the quantity figures: pool `gpus` with `n` offers of quantity 1.
fn offers_file(dir: &Path, n: usize) -> PathBuf {
    let offers: Vec<serde_json::Value> = (0..n)
        .map(|i| serde_json::json!({"name": format!("o{i}"), "quantity": 1, "attributes": {"rack": format!("r{}", i % 10)}}))
        .collect();
    let f = dir.join("offers.json");
    std::fs::write(&f, serde_json::json!({ "gpus": offers }).to_string()).expect("offers file");
    f
}

/// Scale figures of one lease kind (see [`scale_kind`]).
struct KindScale {
    kind: Kind,
    sessions: usize,
    resources: usize,
    rss_idle_kib: u64,
    rss_kib: u64,
    setup_s: f64,
    status_us: Vec<f64>,
    status_bytes: usize,
    status_nosess_us: Vec<f64>,
    status_nosess_bytes: usize,
    mass_handover_ms: f64,
    mass_writes: f64,
    /// The bench's own part: closing the connections / sending the releases.
    mass_client_ms: f64,
    /// CPU time lockd spent during the mass hand-over.
    mass_lockd_cpu_ms: f64,
    /// Time in lockd's durable state writes during the mass hand-over.
    mass_persist_ms: f64,
}

/// The scale scenario of one protocol-2 kind on a fresh lockd, `sessions` raw connections:
/// * ttl: `resources` resources, each held by a TTL lease (10 min), the other sessions
///   queued evenly; mass release = every holder releases by lease id at once;
/// * shared: `resources` resources, each read by `sessions / resources - 1` readers with
///   one writer waiting; mass release = every reader's connection closes at once;
/// * quantity: one pool of `resources` offers of quantity 1, `sessions` requests of 1
///   (`resources` granted, the rest queued); mass release = every holder releases at once.
///
/// The mass hand-over time runs until each of the `resources` next waiters has read its
/// grant.
fn scale_kind(dir: &Path, kind: Kind, sessions: usize, resources: usize) -> KindScale {
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let offers = offers_file(dir, resources);
    let offers = offers.display().to_string();
    let mut extra = vec!["--idle-timeout", "120s"];
    if matches!(kind, Kind::Quantity) {
        extra.extend(["--offers", offers.as_str()]);
    }
    let mut lockd = start_lockd(dir, metrics, &extra);
    let sock = lockd.socket().to_path_buf();
    let pid = lockd.pid().expect("lockd runs") as u32;
    let rss_idle_kib = rss_kib(pid);
    let t_setup = Instant::now();
    let line = |i: usize, exclusive: bool| -> String {
        let r = i % resources;
        let v = match kind {
            Kind::Exclusive => {
                serde_json::json!({"op":"acquire","resource":format!("s{r}"),"holder":format!("h{i}")})
            }
            Kind::Ttl => {
                serde_json::json!({"op":"acquire","resource":format!("s{r}"),"holder":format!("h{i}"),"ttl_ms":600_000})
            }
            Kind::Shared => {
                serde_json::json!({"op":"acquire","resource":format!("s{r}"),"holder":format!("h{i}"),
                "mode": if exclusive { "exclusive" } else { "shared" }})
            }
            Kind::Quantity => {
                serde_json::json!({"op":"acquire","resource":"gpus","holder":format!("h{i}"),"quantity":1,"ttl_ms":600_000})
            }
        };
        format!("{v}\n")
    };
    // Holders (granted at once), then waiters (queued), in rounds over the resources.
    let holders_n = match kind {
        Kind::Shared => sessions - resources,
        _ => resources,
    };
    let mut holders: Vec<(Client, u64, String)> = Vec::with_capacity(holders_n);
    for i in 0..holders_n {
        let mut c = Client::connect(&sock, &line(i, false));
        let g = c.until(b"\"event\":\"granted\"", Duration::from_secs(60));
        let id = g["lease_id"].as_u64().unwrap_or(0);
        let tok = g["token"].as_str().unwrap_or_default().to_string();
        holders.push((c, id, tok));
    }
    let mut waiters: Vec<Client> = (holders_n..sessions)
        .map(|i| Client::connect(&sock, &line(i, true)))
        .collect();
    for w in &mut waiters {
        w.until(b"\"event\":\"queued\"", Duration::from_secs(120));
    }
    let setup_s = t_setup.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(300));
    let rss = rss_kib(pid);
    let mut st = UnixStream::connect(&sock).expect("connect");
    let mut p = Vec::new();
    read_until(
        &mut st,
        &mut p,
        b"\"event\":\"hello\"",
        Duration::from_secs(10),
    );
    let (status_us, status_bytes) = status_times(&mut st, &mut p, true, 10);
    let (status_nosess_us, status_nosess_bytes) = status_times(&mut st, &mut p, false, 10);
    drop(st);
    if let Some(ms) = std::env::var("LOCKD_BENCH_PAUSE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        // For attaching a profiler to lockd (pid on stderr) just before the mass hand-over.
        eprintln!("  mass hand-over of lockd pid {pid} in {ms} ms");
        std::thread::sleep(Duration::from_millis(ms));
    }
    let w0 = scrape(metrics);
    let cpu0 = cpu_secs(pid);
    let t = Instant::now();
    match kind {
        Kind::Exclusive | Kind::Shared => drop(holders),
        Kind::Ttl | Kind::Quantity => {
            for (c, id, tok) in &mut holders {
                let req = format!("{{\"op\":\"release\",\"lease_id\":{id},\"token\":\"{tok}\"}}\n");
                c.s.write_all(req.as_bytes()).expect("release");
            }
        }
    }
    let mass_client_ms = t.elapsed().as_secs_f64() * 1e3;
    // The next waiter of each resource (quantity: the first `resources` waiters, FIFO).
    let next = match kind {
        Kind::Shared => waiters.len(),
        _ => resources,
    };
    for w in waiters.iter_mut().take(next) {
        w.until(b"\"event\":\"granted\"", Duration::from_secs(120));
    }
    let mass_handover_ms = t.elapsed().as_secs_f64() * 1e3;
    let mass_lockd_cpu_ms = (cpu_secs(pid) - cpu0) * 1e3;
    let w1 = scrape(metrics);
    let mass_writes =
        metric(&w1, "lockd_persist_seconds_count") - metric(&w0, "lockd_persist_seconds_count");
    let mass_persist_ms =
        (metric(&w1, "lockd_persist_seconds_sum") - metric(&w0, "lockd_persist_seconds_sum")) * 1e3;
    drop(waiters);
    lockd.signal(Signal::SIGTERM);
    let _ = lockd.wait_exit(Duration::from_secs(30));
    KindScale {
        kind,
        sessions,
        resources,
        rss_idle_kib,
        rss_kib: rss,
        setup_s,
        status_us,
        status_bytes,
        status_nosess_us,
        status_nosess_bytes,
        mass_handover_ms,
        mass_writes,
        mass_client_ms,
        mass_lockd_cpu_ms,
        mass_persist_ms,
    }
}

/// Acquire+release cycles per second of one client on one resource, per kind (one
/// connection, each request waits for its answer), for `secs` seconds.
fn kind_cycles(sock: &Path, kind: Kind, secs: f64) -> (u64, f64) {
    let (acq, rel) = match kind {
        Kind::Exclusive => (
            "{\"op\":\"acquire\",\"resource\":\"cyc-x\",\"holder\":\"c\"}\n",
            "{\"op\":\"release\",\"resource\":\"cyc-x\"}\n",
        ),
        Kind::Ttl => (
            "{\"op\":\"acquire\",\"resource\":\"cyc-t\",\"holder\":\"c\",\"ttl_ms\":60000}\n",
            "{\"op\":\"release\",\"resource\":\"cyc-t\"}\n",
        ),
        Kind::Shared => (
            "{\"op\":\"acquire\",\"resource\":\"cyc-s\",\"holder\":\"c\",\"mode\":\"shared\"}\n",
            "{\"op\":\"release\",\"resource\":\"cyc-s\"}\n",
        ),
        Kind::Quantity => (
            "{\"op\":\"acquire\",\"resource\":\"gpus\",\"holder\":\"c\",\"quantity\":1,\"ttl_ms\":60000}\n",
            "{\"op\":\"release\",\"resource\":\"gpus\"}\n",
        ),
    };
    let mut s = UnixStream::connect(sock).expect("connect");
    let mut p = Vec::new();
    read_until(
        &mut s,
        &mut p,
        b"\"event\":\"hello\"",
        Duration::from_secs(10),
    );
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        s.write_all(acq.as_bytes()).expect("acquire");
        read_until(
            &mut s,
            &mut p,
            b"\"event\":\"granted\"",
            Duration::from_secs(10),
        );
        s.write_all(rel.as_bytes()).expect("release");
        read_until(
            &mut s,
            &mut p,
            b"\"event\":\"released\"",
            Duration::from_secs(10),
        );
        n += 1;
    }
    (n, n as f64 / t.elapsed().as_secs_f64())
}

/// The per-kind figures: scale of each kind and one-resource cycles; prints a table and
/// returns them as JSON.
fn kinds_phase(base: &Path, sessions: usize, resources: usize, secs: f64) -> serde_json::Value {
    let mut rows = Vec::new();
    // `--kind ttl|shared|quantity`: that kind's scale scenario alone (and no cycles).
    let only = arg_str("--kind");
    for kind in [Kind::Ttl, Kind::Shared, Kind::Quantity] {
        if only.as_deref().is_some_and(|k| !kind.name().starts_with(k)) {
            continue;
        }
        let dir = base.join(format!(
            "scale-{}",
            kind.name().split(' ').next().unwrap_or("k")
        ));
        std::fs::create_dir_all(&dir).unwrap();
        eprintln!(
            "  scale, {}: {sessions} sessions over {resources} resources ...",
            kind.name()
        );
        rows.push(scale_kind(&dir, kind, sessions, resources));
    }
    let dir = base.join("cycles");
    std::fs::create_dir_all(&dir).unwrap();
    let offers = offers_file(&dir, 1).display().to_string();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut lockd = start_lockd(&dir, metrics, &["--offers", &offers]);
    let sock = lockd.socket().to_path_buf();
    let cycles: Vec<(Kind, u64, f64)> = [Kind::Exclusive, Kind::Ttl, Kind::Shared, Kind::Quantity]
        .into_iter()
        .map(|k| {
            let (n, r) = kind_cycles(&sock, k, secs);
            (k, n, r)
        })
        .collect();
    lockd.signal(Signal::SIGTERM);
    let _ = lockd.wait_exit(Duration::from_secs(10));

    println!("\nscale per lease kind ({sessions} sessions, raw clients; ttl: {resources} resources held by TTL leases, the rest queued; shared: {resources} resources, readers holding + one writer waiting each; quantity: one pool of {resources} offers of 1, {sessions} requests of 1)");
    println!(
        "  {:<9} {:>8} {:>10} {:>12} {:>13} {:>13} {:>14} {:>8} {:>8}",
        "kind",
        "RSS MiB",
        "KiB/sess",
        "setup s",
        "status ms",
        "status ms",
        "mass hand-",
        "hand-",
        "state"
    );
    println!(
        "  {:<9} {:>8} {:>10} {:>12} {:>13} {:>13} {:>14} {:>8} {:>8}",
        "", "", "", "", "(median)", "(sess:false)", "over ms", "overs", "writes"
    );
    let mut json_rows = Vec::new();
    for k in &rows {
        let mib = k.rss_kib as f64 / 1024.0;
        let per = k.rss_kib.saturating_sub(k.rss_idle_kib) as f64 / k.sessions.max(1) as f64;
        let (med, nmed) = (pct(&k.status_us, 50.0), pct(&k.status_nosess_us, 50.0));
        let overs = match k.kind {
            Kind::Shared => k.resources,
            _ => k.resources,
        };
        println!(
            "  {:<9} {:>8.1} {:>10.2} {:>12.1} {:>13.2} {:>13.2} {:>14.1} {:>8} {:>8}",
            k.kind.name(),
            mib,
            per,
            k.setup_s,
            med / 1e3,
            nmed / 1e3,
            k.mass_handover_ms,
            overs,
            k.mass_writes
        );
        json_rows.push(serde_json::json!({
            "kind": k.kind.name(), "sessions": k.sessions, "resources": k.resources,
            "rss_mib": mib, "rss_idle_mib": k.rss_idle_kib as f64 / 1024.0, "rss_kib_per_session": per,
            "setup_s": k.setup_s,
            "status_ms": {"median": med / 1e3, "p99": pct(&k.status_us, 99.0) / 1e3, "bytes": k.status_bytes},
            "status_sessions_false_ms": {"median": nmed / 1e3, "p99": pct(&k.status_nosess_us, 99.0) / 1e3, "bytes": k.status_nosess_bytes},
            "mass_handover_ms": k.mass_handover_ms, "mass_handovers": overs, "mass_handover_state_writes": k.mass_writes,
            "mass_handover_client_ms": k.mass_client_ms, "mass_handover_lockd_cpu_ms": k.mass_lockd_cpu_ms,
            "mass_handover_persist_ms": k.mass_persist_ms,
        }));
    }
    println!("  mass hand-over, where the time goes (client: the bench closing / releasing; lockd: its CPU time; persist: its state writes):");
    for k in &rows {
        println!(
            "  {:<9} client {:.1} ms, lockd CPU {:.1} ms, persist {:.1} ms",
            k.kind.name(),
            k.mass_client_ms,
            k.mass_lockd_cpu_ms,
            k.mass_persist_ms
        );
    }
    println!("\none client, one resource: acquire+release cycles (each request waits for its answer; state fsynced per change)");
    let mut json_cycles = serde_json::Map::new();
    for (k, n, r) in &cycles {
        println!("  {:<15} {:>9.0} cycles/s ({n} cycles)", k.name(), r);
        json_cycles.insert(k.name().into(), serde_json::json!(r));
    }
    serde_json::json!({ "scale_per_kind": json_rows, "one_client_cycles_per_s": json_cycles })
}

/// The value of a `--NAME VALUE` argument.
fn arg_str(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// Writes `v` to the `--json FILE` given, if any.
fn write_json(v: &serde_json::Value) {
    if let Some(f) = arg_str("--json") {
        std::fs::write(&f, format!("{v:#}\n")).unwrap_or_else(|e| panic!("--json {f}: {e}"));
        eprintln!("  figures written to {f}");
    }
}

/// `--socket PATH --cycles N`: exactly `n` cycles (counted over every client) of
/// `clients` clients over `resources` resources, then every client disconnects.
async fn fixed_cycles(sock: &Path, clients: usize, resources: usize, n: u64) -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let done = std::sync::Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..clients {
        let (sock, done) = (sock.to_path_buf(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut s = tokio::net::UnixStream::connect(&sock)
                .await
                .expect("connect");
            let res = format!("fc{}", i % resources);
            let acq =
                format!("{{\"op\":\"acquire\",\"resource\":\"{res}\",\"holder\":\"c{i}\"}}\n");
            let rel_acq = format!("{{\"op\":\"release\",\"resource\":\"{res}\"}}\n{acq}");
            s.write_all(acq.as_bytes()).await.expect("write");
            let mut buf = vec![0u8; 64 * 1024];
            let mut pending = Vec::new();
            loop {
                let k = s.read(&mut buf).await.unwrap_or(0);
                if k == 0 {
                    return;
                }
                pending.extend_from_slice(&buf[..k]);
                while let Some(p) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=p).collect();
                    if line.windows(17).any(|w| w == b"\"event\":\"granted\"") {
                        if done.fetch_add(1, Ordering::Relaxed) >= n {
                            return;
                        }
                        s.write_all(rel_acq.as_bytes()).await.expect("write");
                    }
                }
            }
        }));
    }
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(3600), t).await;
    }
    t.elapsed().as_secs_f64()
}

fn main() {
    if let Some(sock) = arg_str("--socket") {
        let n = arg("--cycles", 10_000);
        let clients = (arg("--clients", 64) as usize).max(1);
        let resources = (arg("--resources", 1) as usize).max(1);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let secs = rt.block_on(fixed_cycles(Path::new(&sock), clients, resources, n));
        println!(
            "{n} cycles, {clients} clients, {resources} resources: {secs:.2} s ({:.0} cycles/s)",
            n as f64 / secs
        );
        return;
    }
    let rounds = (arg("--rounds", 200) as usize).max(1);
    let clients = arg("--clients", 64) as usize;
    let secs = arg("--seconds", 5);
    let scale_sessions = arg("--scale-sessions", 10_000) as usize;
    let scale_resources = (arg("--scale-resources", 1_000) as usize).max(1);
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = tempfile::Builder::new()
        .prefix("lockd-bench")
        .tempdir_in(&base)
        .expect("tempdir");
    if std::env::args().any(|a| a == "--scale-only") {
        let sc = scale_phase(dir.path(), scale_sessions, scale_resources);
        let v = serde_json::json!({ "scale": sc });
        println!("\n{v}");
        write_json(&v);
        return;
    }
    if std::env::args().any(|a| a == "--kinds-only") {
        let k = kinds_phase(
            dir.path(),
            scale_sessions,
            scale_resources,
            secs as f64 / 2.0,
        );
        let v = serde_json::json!({ "kinds": k });
        println!("\n{v}");
        write_json(&v);
        return;
    }
    let flock_file = dir.path().join("flock.lock");
    std::fs::write(&flock_file, b"").unwrap();
    println!("lockd bench: state on {} ({}), {rounds} handoff rounds per tool, {clients} clients x {secs}s", base.display(), if base.starts_with("/dev/shm") { "tmpfs" } else { "not tmpfs" });
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut lockd = start_lockd(dir.path(), metrics, &[]);
    let sock = lockd.socket().to_path_buf();
    let lockd_pid = lockd.pid().expect("lockd runs") as u32;

    // `--anchor-lockd PATH`: the same rounds, interleaved, with an earlier lockd build
    // (its own `serve` and `hold`), so that "no worse than before" is measured in one run.
    let anchor_bin = arg_str("--anchor-lockd");
    let anchor = anchor_bin.as_deref().map(|bin| {
        let d = dir.path().join("anchor");
        std::fs::create_dir(&d).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        start_lockd_bin(bin, &d, port, &[])
    });
    let anchor_sock = anchor.as_ref().map(|a| a.socket().to_path_buf());
    let (mut l_us, mut f_us, mut a_us) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        // Rotate the order, so that no tool always runs right after the same other one.
        for k in 0..3 {
            match (i + k) % 3 {
                0 => l_us.push(round(&Tool::Lockd {
                    sock: &sock,
                    bin: LOCKD,
                })),
                1 => f_us.push(round(&Tool::Flock(&flock_file))),
                _ => {
                    if let (Some(s), Some(b)) = (&anchor_sock, &anchor_bin) {
                        a_us.push(round(&Tool::Lockd { sock: s, bin: b }));
                    }
                }
            }
        }
        if (i + 1) % 50 == 0 {
            eprintln!("  {} rounds done", i + 1);
        }
    }
    l_us.sort_by(f64::total_cmp);
    f_us.sort_by(f64::total_cmp);
    a_us.sort_by(f64::total_cmp);
    let (lm, lp) = (pct(&l_us, 50.0), pct(&l_us, 99.0));
    let (fm, fp) = (pct(&f_us, 50.0), pct(&f_us, 99.0));
    println!("\nhandoff: holder's process group SIGKILLed -> waiter's child running ({rounds} rounds each; percentiles: nearest rank)");
    println!(
        "  {:<12} {:>10} {:>10} {:>10} {:>10}",
        "tool", "min us", "median us", "p99 us", "max us"
    );
    println!(
        "  {:<12} {:>10.0} {:>10.0} {:>10.0} {:>10.0}",
        "lockd hold",
        l_us[0],
        lm,
        lp,
        l_us[l_us.len() - 1]
    );
    println!(
        "  {:<12} {:>10.0} {:>10.0} {:>10.0} {:>10.0}",
        "flock(1)",
        f_us[0],
        fm,
        fp,
        f_us[f_us.len() - 1]
    );
    let anchor_fig = (!a_us.is_empty()).then(|| (pct(&a_us, 50.0), pct(&a_us, 99.0)));
    if let Some((am, ap)) = anchor_fig {
        println!(
            "  {:<12} {:>10.0} {:>10.0} {:>10.0} {:>10.0}   (--anchor-lockd {})",
            "anchor hold",
            a_us[0],
            am,
            ap,
            a_us[a_us.len() - 1],
            anchor_bin.as_deref().unwrap_or("")
        );
    }
    let (hn, hmean, pmean) = server_handoff(metrics);
    println!(
        "  inside lockd (holder's EOF -> grant written, state fsynced): mean {:.0} us over {hn} handoffs (state write: mean {:.0} us)",
        hmean * 1e6,
        pmean * 1e6
    );
    let ratio = lm / fm;
    println!(
        "  median ratio lockd/flock = {ratio:.2} (target <= 1.5: {})",
        if ratio <= 1.5 { "MET" } else { "MISSED" }
    );
    let anchor_ratio = anchor_fig.map(|(am, _)| am / fm);
    if let Some(ar) = anchor_ratio {
        println!(
            "  median ratio anchor/flock = {ar:.2} (this build no worse: {})",
            if ratio <= ar { "MET" } else { "MISSED" }
        );
    }
    println!(
        "  lockd p99 = {:.2} ms (target < 5 ms: {})",
        lp / 1000.0,
        if lp < 5000.0 { "MET" } else { "MISSED" }
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let bp0 = scrape(metrics);
    let cpu0 = cpu_secs(lockd_pid);
    let me0 = cpu_secs(std::process::id());
    let (n1, tp1) = rt.block_on(throughput(&sock, clients, 1, secs));
    let cpu1 = cpu_secs(lockd_pid);
    let me1 = cpu_secs(std::process::id());
    let bp1 = scrape(metrics);
    let (n8, tp8) = rt.block_on(throughput(&sock, clients, 8, secs));
    let cpu8 = cpu_secs(lockd_pid);
    let (nt, tpt) = throughput_threads(&sock, clients, 1, secs);
    let anchor_tp = anchor_sock
        .as_ref()
        .map(|s| rt.block_on(throughput(s, clients, 1, secs)));

    // The same one-resource run against a second lockd with busy-polling off.
    let off_dir = dir.path().join("busy-poll-off");
    std::fs::create_dir(&off_dir).unwrap();
    let off_metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut off = start_lockd(&off_dir, off_metrics, &["--busy-poll", "0"]);
    let off_sock = off.socket().to_path_buf();
    let off_pid = off.pid().expect("lockd runs") as u32;
    let ocpu0 = cpu_secs(off_pid);
    let (no, tpo) = rt.block_on(throughput(&off_sock, clients, 1, secs));
    let ocpu1 = cpu_secs(off_pid);
    off.signal(Signal::SIGTERM);
    let _ = off.wait_exit(Duration::from_secs(10));
    let bare = bare_round_trip(2.0);

    let per = |cpu: f64, n: u64| cpu * 1e6 / n.max(1) as f64;
    let (c1, c8, co) = (
        per(cpu1 - cpu0, n1),
        per(cpu8 - cpu1, n8),
        per(ocpu1 - ocpu0, no),
    );
    // Growth of a lockd metric over the 1-resource phase.
    let d = |k: &str| metric(&bp1, k) - metric(&bp0, k);
    let (spin_s, hits) = (
        d("lockd_busy_poll_seconds_total"),
        d("lockd_busy_poll_hits_total"),
    );
    let write_us = d("lockd_persist_seconds_sum") * 1e6 / d("lockd_persist_seconds_count").max(1.0);
    let writes_per_cycle = d("lockd_persist_seconds_count") / n1.max(1) as f64;
    println!("\nthroughput: grant/release cycles with {clients} contending clients, state fsynced per grant");
    println!(
        "  1 resource : {tp1:>9.0} cycles/s ({n1} cycles) (target >= 20000: {})",
        if tp1 >= 20000.0 { "MET" } else { "MISSED" }
    );
    println!(
        "    durable state writes: {writes_per_cycle:.2} per cycle, {write_us:.1} us each (mean)"
    );
    if let Some((na, tpa)) = anchor_tp {
        println!(
            "  1 resource, the --anchor-lockd build: {tpa:>9.0} cycles/s ({na} cycles) (this build no worse: {})",
            if tp1 >= tpa { "MET" } else { "MISSED" }
        );
    }
    println!("  8 resources: {tp8:>9.0} cycles/s ({n8} cycles)");
    println!("  1 resource, one blocking thread per client: {tpt:>9.0} cycles/s ({nt} cycles)");
    println!("  1 resource, lockd --busy-poll 0: {tpo:>9.0} cycles/s ({no} cycles)");
    println!(
        "  bare Unix-socket round trip between two sleeping threads (no lockd): {bare:>9.0}/s ({:.1} us); a one-resource cycle is one such round trip plus lockd's and the client's work",
        1e6 / bare.max(1.0)
    );
    println!(
        "  client (this process) CPU per cycle: {:.1} us (1 resource)",
        per(me1 - me0, n1)
    );
    println!("  lockd CPU per cycle: {c1:.1} us (1 resource; busy-poll mode {:.0}% of the run, {:.0}% of reads found while polling), {c8:.1} us (8 resources), {co:.1} us (1 resource, --busy-poll 0)",
        100.0 * spin_s / secs.max(1) as f64,
        100.0 * hits / n1.max(1) as f64,
    );
    // `--no-scale`: handoff and throughput only (a quick regression check).
    let quick = std::env::args().any(|a| a == "--no-scale");
    let sc = if quick {
        serde_json::Value::Null
    } else {
        scale_phase(dir.path(), scale_sessions, scale_resources)
    };
    let kinds = if quick {
        serde_json::Value::Null
    } else {
        kinds_phase(
            dir.path(),
            scale_sessions,
            scale_resources,
            secs as f64 / 2.0,
        )
    };
    let mut load = String::new();
    let _ = std::fs::File::open("/proc/loadavg").and_then(|mut f| f.read_to_string(&mut load));
    println!(
        "  machine: {} CPUs, load average {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let all = serde_json::json!({
            "rounds": rounds,
            "handoff_us": {"percentiles": "nearest rank", "lockd": {"median": lm, "p99": lp}, "flock": {"median": fm, "p99": fp}, "median_ratio": ratio,
                "anchor": anchor_fig.map(|(m, p)| serde_json::json!({"lockd": anchor_bin, "median": m, "p99": p, "median_ratio": anchor_ratio}))},
            "throughput_cycles_per_s": {"clients": clients, "one_resource": tp1, "one_resource_anchor": anchor_tp.map(|t| t.1), "eight_resources": tp8, "one_resource_threads": tpt, "one_resource_busy_poll_off": tpo},
            "bare_round_trips_per_s": bare,
            "lockd_cpu_us_per_cycle": {"one_resource": c1, "eight_resources": c8, "one_resource_busy_poll_off": co},
            "scale": sc,
            "kinds": kinds,
    });
    println!("\n{all}");
    write_json(&all);
    lockd.signal(Signal::SIGTERM);
    let _ = lockd.wait_exit(Duration::from_secs(10));
    if let Some(mut a) = anchor {
        a.signal(Signal::SIGTERM);
        let _ = a.wait_exit(Duration::from_secs(10));
    }
}
