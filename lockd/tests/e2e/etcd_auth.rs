//! `lockd serve --backend etcd` against an etcd with authentication enabled (`etcdctl auth
//! enable`, simple tokens expiring after 2 s of disuse): two lockds logged in as a user whose
//! role has readwrite on the prefix hand a lock over; a lockd idle past the token's expiry
//! still acquires (etcd-client renews the token); a wrong password, no credentials, a user
//! without the permission and an unreadable password file each refuse to start with a clear
//! error (exit 1). Prints SKIP without etcd or etcdctl.

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use harness::etcd::Etcd;

use crate::common::*;
use crate::etcd_backend::{start, Line};
use crate::etcd_tls::{handoff_a_to_b, start_refused};

/// Runs `etcdctl --endpoints url ARGS` (as root once auth is on); panics with its output if
/// it fails.
fn etcdctl(ctl: &Path, url: &str, root: bool, args: &[&str]) {
    let mut cmd = Command::new(ctl);
    cmd.env("ETCDCTL_API", "3")
        .args(["--endpoints", url, "--command-timeout", "5s"]);
    if root {
        cmd.args(["--user", "root:rootpw"]);
    }
    let out = cmd.args(args).output().expect("run etcdctl");
    assert!(
        out.status.success(),
        "etcdctl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn flags(user: &str, password_file: &Path) -> Vec<OsString> {
    vec![
        "--etcd-user".into(),
        user.into(),
        "--etcd-password-file".into(),
        password_file.as_os_str().to_owned(),
    ]
}

#[test]
fn lock_with_etcd_authentication_and_clear_refusals() {
    let _process = serial();
    let test = "etcd_auth::lock_with_etcd_authentication";
    let Some(ctl) = harness::etcd::etcdctl() else {
        harness::skip::skip(test, "no etcdctl (apt-get install etcd-client)");
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let Some(mut members) = Etcd::start_cluster_on(
        d.path(),
        1,
        std::net::Ipv4Addr::LOCALHOST,
        &["--auth-token-ttl", "2"],
    ) else {
        harness::skip::skip(test, "no etcd binary (apt-get install etcd-server)");
        return;
    };
    let etcd = members.pop().expect("one member");
    let url = etcd.client_url.clone();
    // root (needed to enable auth), a lockd user with readwrite on lockd's default prefix
    // `/lockd` (a prefix without the slash: it covers `/lockd/` and `/lockd.data/`), and a
    // user without any permission.
    for args in [
        &["user", "add", "root", "--new-user-password=rootpw"][..],
        &["role", "add", "root"],
        &["user", "grant-role", "root", "root"],
        &["role", "add", "locker"],
        &[
            "role",
            "grant-permission",
            "locker",
            "--prefix=true",
            "readwrite",
            "/lockd",
        ],
        &["user", "add", "lockd", "--new-user-password=lockdpw"],
        &["user", "grant-role", "lockd", "locker"],
        &["user", "add", "nobody", "--new-user-password=nobodypw"],
        &["auth", "enable"],
    ] {
        etcdctl(&ctl, &url, false, args);
    }
    let good = d.path().join("lockd.password");
    std::fs::write(&good, "lockdpw\n").unwrap();
    let wrong = d.path().join("wrong.password");
    std::fs::write(&wrong, "not-it\n").unwrap();
    let nobody = d.path().join("nobody.password");
    std::fs::write(&nobody, "nobodypw").unwrap();

    // Two nodes logged in: a clean death on A hands over to B with a higher epoch.
    let f = flags("lockd", &good);
    let f: Vec<&str> = f.iter().map(|s| s.to_str().expect("utf-8")).collect();
    let a = start(d.path(), "A", &url, &f, &[]);
    let b = start(d.path(), "B", &url, &f, &[]);
    let (mut waiter, handoff) = handoff_a_to_b(&a.sock, &b.sock);
    eprintln!(
        "handoff A -> B as etcd user lockd: {:.1} ms",
        handoff.as_secs_f64() * 1e3
    );

    // A has had no session for longer than the token's 2 s: its token expired on etcd, and
    // the next acquire still works (etcd-client authenticates again).
    std::thread::sleep(Duration::from_millis(3500));
    let limit = Duration::from_secs(10);
    let mut again = Line::connect(&a.sock).expect("A again");
    again.acquire("other", "ha2");
    again
        .recv_until("granted", limit)
        .expect("A granted after its token expired");
    // B held its lock through it all (its keepalives and confirming reads kept going).
    assert!(
        waiter
            .recv_until("revoked", Duration::from_millis(300))
            .is_none(),
        "B lost its lock while tokens expired"
    );

    // Refusals, each saying what is wrong.
    let (code, err) = start_refused(d.path(), "wrong-password", &url, &flags("lockd", &wrong));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("cannot reach etcd") && err.contains("refused the user or password"),
        "wrong password: {err}"
    );
    eprintln!("refused with a wrong password: {}", err.trim());
    let (code, err) = start_refused(d.path(), "anonymous", &url, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("give lockd --etcd-user and --etcd-password-file"),
        "no credentials: {err}"
    );
    eprintln!("refused without credentials: {}", err.trim());
    let (code, err) = start_refused(d.path(), "no-permission", &url, &flags("nobody", &nobody));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("readwrite on the key prefix"),
        "user without permission: {err}"
    );
    eprintln!("refused without permission: {}", err.trim());
    let missing = d.path().join("missing.password");
    let (code, err) = start_refused(d.path(), "missing", &url, &flags("lockd", &missing));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("--etcd-password-file") && err.contains("missing.password"),
        "{err}"
    );
    let (code, err) = start_refused(
        d.path(),
        "user-only",
        &url,
        &["--etcd-user".into(), "lockd".into()],
    );
    assert_eq!(code, 2, "a flag without its pair is a usage error: {err}");
    drop((a, b));
}
