//! QURD across independent lockd instances (`lockd reserve`), as real processes: the seed's
//! scenario (3 resources, jobs needing 3 and 2) under wait semantics completes both jobs;
//! under fail semantics nobody holds a partial set; a client killed or hung while holding
//! part of a set frees it (at once / within the reserved timeout); a resource lost while the
//! job runs is reported and replaced.
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use harness::lockd::Lockd;
use nix::sys::signal::Signal;

use crate::common::*;

fn lockds(d: &Path, n: usize) -> Vec<Lockd> {
    (0..n)
        .map(|i| {
            let dir = d.join(format!("node{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            start_lockd(&dir, &[])
        })
        .collect()
}

fn endpoints(ls: &[Lockd]) -> String {
    ls.iter()
        .map(|l| format!("unix:{}", l.socket().display()))
        .collect::<Vec<_>>()
        .join(",")
}

/// `lockd reserve` running `script` (sh -c), stderr to `log`.
fn reserve(
    eps: &str,
    count: usize,
    semantics: &str,
    holder: &str,
    extra: &[&str],
    script: &str,
    log: &Path,
) -> Group {
    let mut c = Command::new(BIN);
    c.args(["reserve", "--endpoints", eps, "--count"])
        .arg(count.to_string())
        .args(["--semantics", semantics, "--holder", holder])
        .args(extra)
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(log).unwrap()));
    Group::spawn(&mut c)
}

/// Holder names of every resource `node` held on these lockd instances.
fn holders(ls: &[Lockd]) -> Vec<Option<String>> {
    ls.iter()
        .map(|l| {
            l.status()
                .resources
                .iter()
                .find(|r| r.name == "node")
                .and_then(|r| r.holder.clone())
        })
        .collect()
}

#[test]
fn the_seeds_scenario_completes_both_jobs_under_wait_and_never_runs_them_together() {
    let _p = shared();
    let d = tempfile::tempdir().unwrap();
    let ls = lockds(d.path(), 3);
    let eps = endpoints(&ls);
    let log = d.path().join("jobs.log");
    let job = |name: &str| {
        format!(
            "echo start {name} $LOCKD_RESERVED >> {l}; sleep 0.3; echo end {name} >> {l}",
            l = log.display()
        )
    };
    // Launched together, many times: the seed's deadlock (one gets 2, the other 1, nobody
    // starts) must never happen.
    for round in 0..5 {
        let mut a = reserve(
            &eps,
            3,
            "wait",
            "A",
            &["--timeout", "20s"],
            &job("A"),
            &d.path().join(format!("a{round}.err")),
        );
        let mut b = reserve(
            &eps,
            2,
            "wait",
            "B",
            &["--timeout", "20s"],
            &job("B"),
            &d.path().join(format!("b{round}.err")),
        );
        assert!(
            a.wait_exit(Duration::from_secs(25)).success(),
            "A round {round}"
        );
        assert!(
            b.wait_exit(Duration::from_secs(25)).success(),
            "B round {round}"
        );
    }
    // A needs all three: the two jobs never overlap.
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 20, "{text}");
    for pair in lines.chunks(2) {
        let who = pair[0].split_whitespace().nth(1).unwrap();
        assert!(
            pair[0].starts_with("start") && pair[1] == format!("end {who}"),
            "overlap: {text}"
        );
    }
    assert!(holders(&ls).iter().all(Option::is_none));
}

#[test]
fn fail_semantics_never_leave_a_partial_set() {
    let _p = shared();
    let d = tempfile::tempdir().unwrap();
    let ls = lockds(d.path(), 3);
    let eps = endpoints(&ls);
    let flag = d.path().join("a-running");
    let mut a = reserve(
        &eps,
        2,
        "fail",
        "A",
        &[],
        &format!("touch {}; sleep 3", flag.display()),
        &d.path().join("a.err"),
    );
    wait_for(Duration::from_secs(10), "A runs", || {
        flag.exists().then_some(())
    });
    // B needs 2, one is left: it fails at once (exit 75) and holds nothing afterwards.
    let t = Instant::now();
    let mut b = reserve(&eps, 2, "fail", "B", &[], "exit 0", &d.path().join("b.err"));
    assert_eq!(b.wait_exit(Duration::from_secs(10)).code(), Some(75));
    assert!(t.elapsed() < Duration::from_secs(5));
    let h = holders(&ls);
    assert_eq!(
        h.iter().filter(|x| x.as_deref() == Some("A")).count(),
        2,
        "{h:?}"
    );
    assert!(!h.iter().any(|x| x.as_deref() == Some("B")), "{h:?}");
    a.kill_group();
    wait_for(Duration::from_secs(5), "all free", || {
        holders(&ls).iter().all(Option::is_none).then_some(())
    });
}

#[test]
fn a_client_killed_or_hung_with_part_of_a_set_frees_it() {
    let _p = shared();
    let d = tempfile::tempdir().unwrap();
    let ls = lockds(d.path(), 3);
    let eps = endpoints(&ls);
    // The last endpoint in the global order is held by someone else: the reserving client
    // holds the first two (reserved) and waits for the third.
    let mut sorted: Vec<&Lockd> = ls.iter().collect();
    sorted.sort_by_key(|l| format!("unix:{}", l.socket().display()));
    let _other = hold(sorted[2], "node", "other", "sleep 60", &[]);
    wait_for(Duration::from_secs(5), "other holds", || {
        holders(&ls)
            .iter()
            .any(|h| h.as_deref() == Some("other"))
            .then_some(())
    });
    let partial = |ls: &[Lockd]| {
        holders(ls)
            .iter()
            .filter(|h| h.as_deref() == Some("C"))
            .count()
    };
    // Killed: its connections close, both are free at once.
    let c = reserve(
        &eps,
        3,
        "wait",
        "C",
        &["--timeout", "30s"],
        "exit 0",
        &d.path().join("c.err"),
    );
    wait_for(Duration::from_secs(10), "C holds two", || {
        (partial(&ls) == 2).then_some(())
    });
    c.signal(Signal::SIGKILL);
    let t = Instant::now();
    wait_for(Duration::from_secs(2), "freed after the kill", || {
        (partial(&ls) == 0).then_some(())
    });
    eprintln!("freed {:?} after SIGKILL", t.elapsed());
    // Hung (SIGSTOP): each lockd cancels the reservation it was never told to start.
    let mut c = reserve(
        &eps,
        3,
        "wait",
        "C",
        &["--timeout", "30s", "--reserved-timeout", "1s"],
        "exit 0",
        &d.path().join("c2.err"),
    );
    wait_for(Duration::from_secs(10), "C holds two", || {
        (partial(&ls) == 2).then_some(())
    });
    c.signal(Signal::SIGSTOP);
    let t = Instant::now();
    wait_for(
        Duration::from_secs(3),
        "cancelled within the reserved timeout",
        || (partial(&ls) == 0).then_some(()),
    );
    let waited = t.elapsed();
    assert!(waited <= Duration::from_millis(1500), "{waited:?}");
    c.signal(Signal::SIGCONT);
    c.kill_group();
}

#[test]
fn a_resource_lost_while_the_job_runs_is_reported_and_replaced() {
    let _p = shared();
    let d = tempfile::tempdir().unwrap();
    let mut ls = lockds(d.path(), 3);
    let eps = endpoints(&ls);
    let file: PathBuf = d.path().join("reservation.json");
    let usr1 = d.path().join("usr1");
    let script = format!(
        "trap 'cp {f} {u}' USR1; while true; do sleep 0.05; done",
        f = file.display(),
        u = usr1.display()
    );
    let err = d.path().join("r.err");
    let mut r = reserve(
        &eps,
        2,
        "wait",
        "R",
        &[
            "--on-loss",
            "replace",
            "--reservation-file",
            file.to_str().unwrap(),
        ],
        &script,
        &err,
    );
    wait_for(Duration::from_secs(10), "reserved and started", || {
        (holders(&ls)
            .iter()
            .filter(|h| h.as_deref() == Some("R"))
            .count()
            == 2
            && file.exists())
        .then_some(())
    });
    let before: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    // Kill the lockd of one held endpoint.
    let victim = ls
        .iter()
        .position(|l| {
            before["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e.as_str() == Some(&format!("unix:{}", l.socket().display())))
        })
        .unwrap();
    let lost = format!("unix:{}", ls[victim].socket().display());
    ls[victim].kill();
    // The trap's `cp` creates the file before it has written it: wait for whole JSON.
    let after: serde_json::Value = wait_for(Duration::from_secs(10), "CMD told (SIGUSR1)", || {
        std::fs::read_to_string(&usr1)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
    });
    let now: Vec<&str> = after["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e.as_str())
        .collect();
    assert_eq!(now.len(), 2, "{after}");
    assert!(!now.contains(&lost.as_str()), "{after}");
    let stderr = std::fs::read_to_string(&err).unwrap();
    assert!(
        stderr.contains("\"event\":\"lost\"") && stderr.contains("\"event\":\"replaced\""),
        "{stderr}"
    );
    assert!(r.alive(), "the job keeps running on its replacement");
    r.kill_group();
}
