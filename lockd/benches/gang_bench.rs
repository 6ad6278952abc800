//! Gang benchmark (issue 12): all-or-nothing acquisition of 2, 4 and 8 resources.
//!
//! 1. **One lockd, gangs**: one client acquiring a gang of k resources and releasing it
//!    (`acquire {gang:[…]}` → `gang_granted`, `release` → `released` × k), cycle latency
//!    (median, p99) and cycles/s, for each kind of gang: connection-bound exclusive, TTL
//!    (`ttl_ms`) and shared (`mode: "shared"`); then `--clients` clients doing the same over
//!    overlapping gangs of a pool of 16 resources (contended throughput, every grant
//!    all-or-nothing), connection-bound and TTL.
//! 2. **Across 3 independent lockd instances** (`lockd::reserve`, QURD): reserve 2 and 3 of
//!    them with wait semantics (connect, reserve on each in the global order, `start` all,
//!    release by closing), cycle latency and cycles/s.
//!
//! 3. **Fairness of a waiting shared gang**: two writers per member hand each of k members
//!    (2, 4, 8) to each other in a stream (hold `--hold-ms`, release, ask again at once), so
//!    that no member is ever free; a shared gang over the k members is acquired
//!    `--samples` times, and its wait from `acquire` to `gang_granted` is reported (median,
//!    p99, max) against the bound of the rule (PROTOCOL.md, "Gang fairness"): the writers
//!    ahead of it — one holding and one queued per member — end, 2 × hold. Without the
//!    rule such a gang is never granted (the e2e test
//!    `a_shared_gang_behind_a_stream_of_writers_is_granted_within_the_bound` shows it).
//!
//! State files on /dev/shm (tmpfs) when it exists, like `lockd_bench`. One command:
//!
//!     cargo bench -p lockd --bench gang_bench -- [--seconds 3] [--clients 8] \
//!         [--hold-ms 5] [--samples 30] [--only-fairness]
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::lockd::{Lockd, LockdSpec};
use harness::stats::percentile_of;
use lockd::reserve::{reserve, ReserveOptions, Semantics};
use lockd::Endpoint;

const LOCKD: &str = env!("CARGO_BIN_EXE_lockd");

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn base_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm).expect("tempdir in /dev/shm")
    } else {
        tempfile::tempdir().expect("tempdir")
    }
}

fn start(dir: &Path) -> Lockd {
    std::fs::create_dir_all(dir).expect("dir");
    Lockd::start(
        LockdSpec::new(dir)
            .state(dir.join("state.json"))
            .args(["--rate-limit", "1000000"])
            .log_filter("warn")
            .bin(LOCKD),
    )
}

struct Client {
    w: UnixStream,
    r: BufReader<UnixStream>,
}

impl Client {
    fn connect(sock: &Path) -> Client {
        let s = UnixStream::connect(sock).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let mut c = Client {
            r: BufReader::new(s.try_clone().expect("clone")),
            w: s,
        };
        let hello = c.line();
        assert!(hello.contains("\"gang\""), "lockd without gangs: {hello}");
        c.send(r#"{"op":"ping"}"#);
        assert!(c.line().contains("pong"));
        c
    }
    fn send(&mut self, l: &str) {
        self.w.write_all(l.as_bytes()).expect("send");
        self.w.write_all(b"\n").expect("send");
    }
    fn line(&mut self) -> String {
        let mut s = String::new();
        let n = self.r.read_line(&mut s).expect("read");
        assert!(n > 0, "lockd closed the connection");
        s
    }
    /// Lines until one containing `"event":"<event>"`; panics on an error line.
    fn until(&mut self, event: &str) -> String {
        let want = format!("\"{event}\"");
        loop {
            let l = self.line();
            if l.contains(&want) {
                return l;
            }
            assert!(!l.contains("\"error\""), "unexpected: {l}");
        }
    }
    /// Acquire the gang (of `kind`) and release it; panics on anything unexpected.
    fn cycle(&mut self, members: &[String], kind: Kind) {
        let mut g =
            serde_json::json!({"op":"acquire","resource":"g","holder":"bench","gang":members});
        match kind {
            Kind::Bound => {}
            Kind::Ttl => g["ttl_ms"] = 30_000.into(),
            Kind::Shared => g["mode"] = "shared".into(),
        }
        self.send(&g.to_string());
        loop {
            let l = self.line();
            if l.contains("\"gang_granted\"") {
                break;
            }
            assert!(l.contains("\"queued\""), "unexpected: {l}");
        }
        self.send(&format!(
            r#"{{"op":"release","resource":"{}"}}"#,
            members[0]
        ));
        for _ in 0..members.len() {
            let l = self.line();
            assert!(l.contains("\"released\""), "unexpected: {l}");
        }
    }
}

/// The kinds of gang measured.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// Exclusive, bound to the connection (version-1 leases).
    Bound,
    /// TTL leases (`ttl_ms`).
    Ttl,
    /// Shared leases, bound to the connection (`mode: "shared"`).
    Shared,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Bound => "bound",
            Kind::Ttl => "TTL",
            Kind::Shared => "shared",
        }
    }
}

fn summary(mut lat: Vec<Duration>, secs: f64) -> (f64, f64, f64) {
    let n = lat.len();
    let med = percentile_of(&mut lat, 50.0).unwrap_or_default();
    let p99 = percentile_of(&mut lat, 99.0).unwrap_or_default();
    (
        med.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        n as f64 / secs,
    )
}

/// One writer of the fairness stream: asks for `m` exclusively, holds it `hold`,
/// releases, asks again at once, until `stop`.
fn writer(sock: PathBuf, m: String, hold: Duration, stop: Arc<AtomicBool>) {
    let mut c = Client::connect(&sock);
    let acquire = serde_json::json!({"op":"acquire","resource":m,"holder":"w","mode":"exclusive"})
        .to_string();
    let release = serde_json::json!({"op":"release","resource":m}).to_string();
    loop {
        c.send(&acquire);
        c.until("granted");
        std::thread::sleep(hold);
        c.send(&release);
        c.until("released");
        if stop.load(Ordering::Relaxed) {
            return;
        }
    }
}

/// Section 3: the wait of a shared gang behind a stream of writers on its members.
fn fairness(dir: &Path, hold: Duration, samples: usize) {
    let l = start(&dir.join("fair"));
    println!(
        "shared gang behind a stream of writers (2 per member, each holding {} ms): wait to \
         gang_granted",
        hold.as_millis()
    );
    println!(
        "  {:<34} {:>11} {:>11} {:>11} {:>11}",
        "", "median ms", "p99 ms", "max ms", "bound ms"
    );
    for k in [2usize, 4, 8] {
        let members: Vec<String> = (0..k).map(|i| format!("fair-{k}-{i}")).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = members
            .iter()
            .flat_map(|m| [m.clone(), m.clone()])
            .map(|m| {
                let (sock, stop) = (l.socket().to_path_buf(), stop.clone());
                std::thread::spawn(move || writer(sock, m, hold, stop))
            })
            .collect();
        std::thread::sleep(hold * 10);
        let mut c = Client::connect(l.socket());
        let gang = serde_json::json!({"op":"acquire","resource":"g","holder":"bench",
            "gang":members,"mode":"shared","timeout_ms":60_000})
        .to_string();
        let release = format!(r#"{{"op":"release","resource":"{}"}}"#, members[0]);
        let mut waits = Vec::new();
        for _ in 0..samples {
            let t = Instant::now();
            c.send(&gang);
            c.until("gang_granted");
            waits.push(t.elapsed());
            c.send(&release);
            for _ in 0..k {
                c.until("released");
            }
            // Let the stream take the members again before the next sample.
            std::thread::sleep(hold * 3);
        }
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.join().expect("writer");
        }
        let max = waits.iter().max().copied().unwrap_or_default();
        let med = percentile_of(&mut waits, 50.0).unwrap_or_default();
        let p99 = percentile_of(&mut waits, 99.0).unwrap_or_default();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "  {:<34} {:>11.1} {:>11.1} {:>11.1} {:>11.1}",
            format!("gang of {k}, {samples} samples"),
            ms(med),
            ms(p99),
            ms(max),
            ms(hold * 2)
        );
    }
}

fn main() {
    let seconds = arg("--seconds", 3);
    let clients = arg("--clients", 8) as usize;
    let dir = base_dir();
    let hold = Duration::from_millis(arg("--hold-ms", 5));
    let samples = arg("--samples", 30) as usize;
    if std::env::args().any(|a| a == "--only-fairness") {
        fairness(dir.path(), hold, samples);
        return;
    }
    let l = start(&dir.path().join("one"));
    println!(
        "gangs on one lockd ({seconds} s each; state on {})",
        dir.path().display()
    );
    println!(
        "  {:<34} {:>11} {:>11} {:>12}",
        "", "median us", "p99 us", "cycles/s"
    );
    for kind in [Kind::Bound, Kind::Ttl, Kind::Shared] {
        for k in [2usize, 4, 8] {
            // Each kind on its own names (a resource has one kind at a time).
            let members: Vec<String> = (0..k)
                .map(|i| format!("solo-{}-{k}-{i}", kind.name()))
                .collect();
            let mut c = Client::connect(l.socket());
            let mut lat = Vec::new();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(seconds) {
                let t = Instant::now();
                c.cycle(&members, kind);
                lat.push(t.elapsed());
            }
            let (m, p, r) = summary(lat, t0.elapsed().as_secs_f64());
            println!(
                "  {:<34} {m:>11.0} {p:>11.0} {r:>12.0}",
                format!("one client, {} gang of {k}", kind.name())
            );
        }
    }
    for (kind, k) in [Kind::Bound, Kind::Ttl]
        .into_iter()
        .flat_map(|kind| [2usize, 4, 8].map(|k| (kind, k)))
    {
        // Overlapping gangs over a pool of 16: client i takes k consecutive resources from
        // i*3, so neighbours contend.
        let stop = Instant::now() + Duration::from_secs(seconds);
        let sock: PathBuf = l.socket().to_path_buf();
        let handles: Vec<_> = (0..clients)
            .map(|i| {
                let sock = sock.clone();
                std::thread::spawn(move || {
                    let members: Vec<String> = (0..k)
                        .map(|j| format!("pool-{}-{}", kind.name(), (i * 3 + j) % 16))
                        .collect();
                    let mut c = Client::connect(&sock);
                    let mut lat = Vec::new();
                    while Instant::now() < stop {
                        let t = Instant::now();
                        c.cycle(&members, kind);
                        lat.push(t.elapsed());
                    }
                    lat
                })
            })
            .collect();
        let t0 = Instant::now();
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.join().expect("client"));
        }
        let (m, p, r) = summary(all, t0.elapsed().as_secs_f64().max(seconds as f64));
        println!(
            "  {:<34} {m:>11.0} {p:>11.0} {r:>12.0}",
            format!("{clients} clients, {} gangs of {k} of 16", kind.name())
        );
    }
    drop(l);

    let nodes: Vec<Lockd> = (0..3)
        .map(|i| start(&dir.path().join(format!("node{i}"))))
        .collect();
    let eps: Vec<Endpoint> = nodes
        .iter()
        .map(|n| Endpoint::Unix(n.socket().to_path_buf()))
        .collect();
    println!("reservations across 3 independent lockd (lockd::reserve, wait semantics)");
    println!(
        "  {:<34} {:>11} {:>11} {:>12}",
        "", "median us", "p99 us", "cycles/s"
    );
    for count in [2usize, 3] {
        let o = ReserveOptions {
            endpoints: eps.clone(),
            count,
            semantics: Semantics::Wait,
            resource: "node".into(),
            holder: "bench".into(),
            timeout: Duration::from_secs(10),
            reserve_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(2),
        };
        let mut lat = Vec::new();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(seconds) {
            let t = Instant::now();
            let links = reserve(&o).expect("reserve");
            drop(links);
            lat.push(t.elapsed());
            // The next reserve must not find the previous one's leases: each lockd ends them
            // when it reads the close; wait until node 0 is free again.
            wait_free(&nodes[0]);
        }
        let (m, p, r) = summary(lat, t0.elapsed().as_secs_f64());
        println!(
            "  {:<34} {m:>11.0} {p:>11.0} {r:>12.0}",
            format!("reserve {count} of 3 (+ release)")
        );
    }
    drop(nodes);
    fairness(dir.path(), hold, samples);
}

fn wait_free(l: &Lockd) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let st = l.status();
        if st
            .resources
            .iter()
            .all(|r| r.name != "node" || r.holder.is_none())
        {
            return;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    panic!("node still held 5 s after its client closed");
}
