//! Cross-"node" handoff on the etcd backend, side by side with `etcdctl lock` (not a test).
//!
//! ```text
//! cargo bench -p lockd --bench etcd_bench -- [--rounds 100] [--etcdctl-rounds 10] [--etcdctl-ttl 2]
//!     [--clients 64] [--seconds 5]
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
//! Percentiles are nearest rank (`harness::stats`). Prints one table.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use harness::etcd::Etcd;
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
    let sock = dir.join(format!("{name}.sock"));
    let mut cmd = Command::new(LOCKD);
    cmd.args(["serve", "--backend", "etcd", "--etcd-endpoints", url])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .args(["--etcd-node", name, "--etcd-ttl", "5s"])
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
    let rounds = arg("--rounds", 100) as usize;
    let clients = arg("--clients", 64) as usize;
    let seconds = arg("--seconds", 5);
    let ctl_rounds = arg("--etcdctl-rounds", 10) as usize;
    let ttl = arg("--etcdctl-ttl", 2);
    let base = if Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm")
    } else {
        tempfile::tempdir()
    }
    .expect("temp dir");
    let Some(etcd) = Etcd::start(base.path()) else {
        eprintln!("SKIP: etcd_bench: no etcd binary (apt-get install etcd-server)");
        return;
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
