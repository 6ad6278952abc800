//! `lockd serve --backend etcd` over TLS: a real etcd serving clients on `https://` only with
//! `--client-cert-auth`, certificates made by `openssl` (harness::etcd::TestPki). Two lockds
//! with the CA and a client certificate hand a lock over as over plain HTTP; a lockd without
//! a client certificate, with the wrong CA, with an `https://` endpoint but no CA, or with a
//! CA but an `http://` endpoint refuses to start with a clear error (exit 1). Prints SKIP
//! without etcd or openssl.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use harness::etcd::{Etcd, TestPki};
use harness::proc::Proc;
use serde_json::{json, Value};

use crate::common::*;

fn lockd_cmd(dir: &Path, name: &str, url: &str, tls: &[&Path]) -> (Command, PathBuf) {
    let sock = dir.join(format!("{name}.sock"));
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--backend", "etcd", "--etcd-endpoints", url])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .args(["--etcd-node", name, "--etcd-op-timeout", "2s"])
        .env("LOCKD_LOG", "info");
    let flags = ["--etcd-ca", "--etcd-cert", "--etcd-key"];
    for (f, p) in flags.iter().zip(tls) {
        cmd.arg(f).arg(p);
    }
    (cmd, sock)
}

/// Connects and reads `hello` (bounded).
fn connect(sock: &Path) -> Option<(UnixStream, BufReader<UnixStream>)> {
    let s = UnixStream::connect(sock).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut r = BufReader::new(s.try_clone().ok()?);
    (next(&mut r)?["event"] == "hello").then_some((s, r))
}

fn next(r: &mut BufReader<UnixStream>) -> Option<Value> {
    let mut l = String::new();
    match r.read_line(&mut l) {
        Ok(0) | Err(_) => None,
        Ok(_) => serde_json::from_str(&l).ok(),
    }
}

fn until(r: &mut BufReader<UnixStream>, event: &str) -> Value {
    loop {
        let v = next(r).unwrap_or_else(|| panic!("no {event} (timeout or EOF)"));
        if v["event"] == event {
            return v;
        }
    }
}

fn acquire(w: &mut UnixStream, holder: &str) {
    let l = json!({"op":"acquire","resource":"engine","holder":holder}).to_string() + "\n";
    w.write_all(l.as_bytes()).expect("send");
}

/// Starts a lockd that must come up (15 s).
fn start_ok(dir: &Path, name: &str, url: &str, tls: &[&Path]) -> (Proc, PathBuf) {
    let (cmd, sock) = lockd_cmd(dir, name, url, tls);
    let mut p = Proc::spawn(name, cmd, dir.join(format!("{name}.log")));
    let end = Instant::now() + Duration::from_secs(15);
    while connect(&sock).is_none() {
        assert!(!p.exited(), "lockd {name} exited: {}", p.log_text());
        assert!(
            Instant::now() < end,
            "lockd {name} not up: {}",
            p.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (p, sock)
}

/// Runs a lockd that must refuse to start: its exit code and stderr (bounded, 20 s).
fn start_refused(dir: &Path, name: &str, url: &str, tls: &[&Path]) -> (i32, String) {
    let (mut cmd, sock) = lockd_cmd(dir, name, url, tls);
    let mut child = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn lockd");
    let end = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("lockd {name} still running 20 s on; it should have refused to start");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err);
    assert!(!sock.exists() || connect(&sock).is_none(), "{name} served");
    (status.code().unwrap_or(-1), err)
}

#[test]
fn lock_over_tls_with_client_certificates_and_clear_refusals() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let pki = match TestPki::make(d.path()) {
        Ok(p) => p,
        Err(why) => {
            harness::skip::skip("etcd_tls::lock_over_tls", &why);
            return;
        }
    };
    let Some(etcd) = Etcd::start_tls(d.path(), &pki) else {
        harness::skip::skip(
            "etcd_tls::lock_over_tls",
            "no etcd binary (apt-get install etcd-server; .ci/run installs it)",
        );
        return;
    };
    let url = etcd.client_url.clone();
    assert!(url.starts_with("https://"), "{url}");
    let full = [&*pki.ca, &*pki.client_cert, &*pki.client_key];

    // Two nodes over TLS: a clean death on A hands over to B with a higher epoch.
    let (_a, sa) = start_ok(d.path(), "A", &url, &full);
    let (_b, sb) = start_ok(d.path(), "B", &url, &full);
    let (mut wa, mut ra) = connect(&sa).expect("A");
    acquire(&mut wa, "ha");
    let ea = until(&mut ra, "granted")["epoch"].as_u64().expect("epoch");
    let (mut wb, mut rb) = connect(&sb).expect("B");
    acquire(&mut wb, "hb");
    until(&mut rb, "queued");
    let t = Instant::now();
    drop((wa, ra));
    let g = until(&mut rb, "granted");
    let handoff = t.elapsed();
    let eb = g["epoch"].as_u64().expect("epoch");
    assert!(eb > ea, "epoch {eb} not above {ea}");
    assert!(
        handoff < Duration::from_secs(2),
        "handoff over TLS took {handoff:?}"
    );
    eprintln!(
        "TLS handoff A -> B: {:.1} ms (epoch {ea} -> {eb})",
        handoff.as_secs_f64() * 1e3
    );

    // Refusals, each with a message that says what is wrong.
    let (code, err) = start_refused(d.path(), "no-client-cert", &url, &[&pki.ca]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("cannot reach etcd") && err.contains("--etcd-cert and --etcd-key"),
        "no client certificate: {err}"
    );
    eprintln!("refused without a client certificate: {}", err.trim());
    let (code, err) = start_refused(
        d.path(),
        "wrong-ca",
        &url,
        &[&pki.other_ca, &pki.client_cert, &pki.client_key],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot reach etcd"), "wrong CA: {err}");
    eprintln!("refused with the wrong CA: {}", err.trim());
    let (code, err) = start_refused(d.path(), "no-ca", &url, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("needs --etcd-ca"), "https without a CA: {err}");
    let plain = url.replacen("https://", "http://", 1);
    let (code, err) = start_refused(d.path(), "plain", &plain, &full);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("must be https://"), "http with a CA: {err}");
    let missing = d.path().join("missing.crt");
    let (code, err) = start_refused(d.path(), "missing", &url, &[&missing]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--etcd-ca") && err.contains("missing.crt"),
        "{err}"
    );
}
