//! `supervisor run --publish-key KEY` over lockd on a real etcd (issue 13, point 3): the
//! Active supervisor's engine endpoint is in etcd (lockd's fenced put, on the session's etcd
//! lease); after a failover the key names the new Active engine; once the last Active
//! supervisor stops, the key is gone (its fenced delete, sent as it leaves Active). On the file backend the flag is refused at startup
//! (exit 1, naming the reason). The stale holder's refused write is tested at lockd's level
//! (`lockd` e2e `etcd_backend::stale_holders_fenced_write_is_refused`) and the publisher's
//! decisions transition by transition (`supervisor::publish`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use harness::etcd::Etcd;
use harness::{kill, Cluster, Lockd, LockdSpec, SupOpts};
use nix::sys::signal::Signal;
use probes::Phase;

const T: Duration = Duration::from_secs(30);
const KEY: &str = "svc/engine/active";

fn etcd_lockd(dir: &Path, name: &str, etcd: &Etcd) -> Lockd {
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub).expect("lockd dir");
    Lockd::start(LockdSpec::new(&sub).args([
        "--backend",
        "etcd",
        "--etcd-endpoints",
        &etcd.client_url,
        "--etcd-node",
        name,
        "--etcd-ttl",
        "3s",
    ]))
}

/// The published value (None: no such key), read with etcdctl.
fn published(ctl: &Path, etcd: &Etcd) -> Option<String> {
    let out = Command::new(ctl)
        .args([
            "--endpoints",
            &etcd.client_url,
            "--command-timeout",
            "2s",
            "get",
            "--print-value-only",
            &format!("/lockd.data/{KEY}"),
        ])
        .env("ETCDCTL_API", "3")
        .output()
        .expect("etcdctl runs");
    assert!(out.status.success(), "etcdctl: {out:?}");
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!v.is_empty()).then_some(v)
}

fn wait_published(ctl: &Path, etcd: &Etcd, want: Option<&str>) -> Option<String> {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let got = published(ctl, etcd);
        if got.as_deref() == want || Instant::now() > end {
            return got;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn active_endpoint_is_published_follows_the_failover_and_goes_with_the_lease() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let Some(etcd) = Etcd::start(c.dir.path()) else {
        harness::skip(
            "etcd_publish_key",
            "no etcd binary (apt-get install etcd-server; .ci/run installs it)",
        );
        return;
    };
    let Some(ctl) = harness::etcd::etcdctl() else {
        harness::skip(
            "etcd_publish_key",
            "no etcdctl (apt-get install etcd-client)",
        );
        return;
    };
    let a = etcd_lockd(c.dir.path(), "A", &etcd);
    let b = etcd_lockd(c.dir.path(), "B", &etcd);
    let publish = ["--publish-key", KEY];
    let (mut primary, mut shadow) = c.start_pair(
        &SupOpts::new(0, "primary").lock(a.endpoint()).sup(&publish),
        &SupOpts::new(1, "shadow").lock(b.endpoint()).sup(&publish),
        T,
    );
    let url_a = format!("http://{}", primary.engine);
    let url_b = format!("http://{}", shadow.engine);
    let got = wait_published(&ctl, &etcd, Some(&url_a));
    assert_eq!(got.as_deref(), Some(url_a.as_str()), "{}", c.dump_logs());

    // Failover: A's engine SIGKILLed; A fences (its session's etcd lease is revoked, the key
    // with it), B is granted and publishes its own endpoint.
    let pids = primary.wait_engine_pids(1, T);
    assert!(kill(pids[0], Signal::SIGKILL));
    assert!(shadow.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    let got = wait_published(&ctl, &etcd, Some(&url_b));
    assert_eq!(got.as_deref(), Some(url_b.as_str()), "{}", c.dump_logs());
    assert!(primary.proc.wait_exit(T).is_some(), "{}", c.dump_logs());
    let log_a = primary.log_text();
    assert!(
        log_a.contains("publish transition") && log_a.contains("withdrawn"),
        "{log_a}"
    );

    // B stops (SIGTERM): it leaves Active, its fence closes the lock connection, the session's
    // etcd lease is revoked and the key goes with it (no TTL wait).
    assert!(shadow.proc.signal(Signal::SIGTERM));
    let stopped = Instant::now();
    let st = shadow.proc.wait_exit(T);
    assert_eq!(st.and_then(|s| s.code()), Some(0), "{}", c.dump_logs());
    let got = wait_published(&ctl, &etcd, None);
    assert_eq!(
        got,
        None,
        "key still there after B stopped{}",
        c.dump_logs()
    );
    // Deleted by B's fenced delete as it left Active (before its fence), not only with its
    // session's etcd lease.
    let log_b = std::fs::read_to_string(b.spec().dir().join("lockd.log")).unwrap_or_default();
    assert!(
        log_b.contains("fenced delete applied"),
        "no fenced delete in lockd B's log: {log_b}"
    );
    eprintln!(
        "published {url_a}, then {url_b} after the failover; gone {:?} after B's SIGTERM",
        stopped.elapsed()
    );
    drop(a);
    drop(b);
    drop(etcd);
}

#[test]
fn publish_key_is_refused_at_startup_on_the_file_backend() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let mut s = c.start(&SupOpts::new(0, "primary").sup(&["--publish-key", KEY]));
    let st = s.proc.wait_exit(T);
    assert_eq!(st.and_then(|s| s.code()), Some(1), "{}", c.dump_logs());
    let log = s.log_text();
    assert!(
        log.contains("--publish-key") && log.contains("--backend etcd"),
        "{log}"
    );
    assert!(s.engine_pids().is_empty() || s.engine_pids().iter().all(|p| !procfs::alive(*p)));
}
