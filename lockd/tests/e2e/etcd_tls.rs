//! `lockd serve --backend etcd` over TLS: a real etcd serving clients on `https://` only with
//! `--client-cert-auth`, certificates made by `openssl` (harness::etcd::TestPki). Two lockds
//! with the CA and a client certificate hand a lock over as over plain HTTP; a lockd without
//! a client certificate, with the wrong CA, with an `https://` endpoint but no CA, or with a
//! CA but an `http://` endpoint refuses to start with a clear error (exit 1). Prints SKIP
//! without etcd or openssl.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use harness::etcd::{Etcd, TestPki};

use crate::common::*;
use crate::etcd_backend::{start, Line};

/// `--etcd-ca`, `--etcd-cert`, `--etcd-key` with these paths, in that order.
fn tls_flags(tls: &[&Path]) -> Vec<std::ffi::OsString> {
    let flags = ["--etcd-ca", "--etcd-cert", "--etcd-key"];
    flags
        .iter()
        .zip(tls)
        .flat_map(|(f, p)| [f.into(), p.as_os_str().to_owned()])
        .collect()
}

/// A holder on A granted `engine`, a waiter on B queued behind it; the holder's connection
/// closes (a clean death) and B must be granted with a higher epoch within 2 s. B's
/// connection (holding the lock) and the time from the close to B's grant.
pub(crate) fn handoff_a_to_b(a: &Path, b: &Path) -> (Line, Duration) {
    let limit = Duration::from_secs(10);
    let mut holder = Line::connect(a).expect("A");
    holder.acquire("engine", "ha");
    let ea = holder.recv_until("granted", limit).expect("A granted")["epoch"]
        .as_u64()
        .expect("epoch");
    let mut waiter = Line::connect(b).expect("B");
    waiter.acquire("engine", "hb");
    waiter.recv_until("queued", limit).expect("B queued");
    let t = Instant::now();
    drop(holder);
    let g = waiter.recv_until("granted", limit).expect("B granted");
    let handoff = t.elapsed();
    let eb = g["epoch"].as_u64().expect("epoch");
    assert!(eb > ea, "epoch {eb} not above {ea}");
    assert!(handoff < Duration::from_secs(2), "handoff took {handoff:?}");
    (waiter, handoff)
}

/// Runs a lockd that must refuse to start: its exit code and stderr (bounded, 20 s).
pub(crate) fn start_refused(
    dir: &Path,
    name: &str,
    url: &str,
    extra: &[std::ffi::OsString],
) -> (i32, String) {
    let sock: PathBuf = dir.join(format!("{name}.sock"));
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--backend", "etcd", "--etcd-endpoints", url])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .args(["--etcd-node", name, "--etcd-op-timeout", "2s"])
        .args(extra)
        .env("LOCKD_LOG", "info");
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
    assert!(
        !sock.exists() || Line::connect(&sock).is_err(),
        "{name} served"
    );
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
    let tls: Vec<&str> = full
        .iter()
        .map(|p| p.to_str().expect("utf-8 path"))
        .collect();
    let flags = [
        "--etcd-ca",
        tls[0],
        "--etcd-cert",
        tls[1],
        "--etcd-key",
        tls[2],
    ];
    let a = start(d.path(), "A", &url, &flags, &[]);
    let b = start(d.path(), "B", &url, &flags, &[]);
    let (_waiter, handoff) = handoff_a_to_b(&a.sock, &b.sock);
    eprintln!("TLS handoff A -> B: {:.1} ms", handoff.as_secs_f64() * 1e3);

    // Refusals, each with a message that says what is wrong.
    let (code, err) = start_refused(d.path(), "no-client-cert", &url, &tls_flags(&[&pki.ca]));
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
        &tls_flags(&[&pki.other_ca, &pki.client_cert, &pki.client_key]),
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot reach etcd"), "wrong CA: {err}");
    eprintln!("refused with the wrong CA: {}", err.trim());
    let (code, err) = start_refused(d.path(), "no-ca", &url, &tls_flags(&[]));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("needs --etcd-ca"), "https without a CA: {err}");
    let plain = url.replacen("https://", "http://", 1);
    let (code, err) = start_refused(d.path(), "plain", &plain, &tls_flags(&full));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("must be https://"), "http with a CA: {err}");
    let missing = d.path().join("missing.crt");
    let (code, err) = start_refused(d.path(), "missing", &url, &tls_flags(&[&missing]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--etcd-ca") && err.contains("missing.crt"),
        "{err}"
    );
}
