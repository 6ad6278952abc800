//! The command line of the version-2 lease kinds against a real lockd: `acquire --ttl
//! --save`, `renew --saved`, `lease`, `leases`, `offer`, `acquire --quantity`, `withdraw`,
//! `release --saved`, `acquire --mode`, `status --no-sessions`, with their JSON output and
//! exit codes (0 ok, 1 refused, 2 bad command line, 69 cannot connect, 75 busy/timeout).
use crate::common::*;
use serde_json::Value;
use std::process::{Command, Output};

fn lockd(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("LOCKD_CONNECT")
        .output_within(CMD_LIMIT)
        .unwrap()
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

/// Exit 0 and one JSON object on stdout.
fn ok_json(o: &Output, what: &str) -> Value {
    assert_eq!(
        code(o),
        0,
        "{what}: stderr {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "{what}: not JSON ({e}): {}",
            String::from_utf8_lossy(&o.stdout)
        )
    })
}

fn json_lines(o: &Output) -> Vec<Value> {
    assert_eq!(code(o), 0, "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

#[test]
fn ttl_lease_from_the_command_line() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let ep = l.endpoint();
    let saved = d.path().join("job.lease");
    let saved_s = saved.to_str().unwrap();

    let g = ok_json(
        &lockd(&[
            "acquire",
            "--connect",
            &ep,
            "--resource",
            "job",
            "--holder",
            "w1",
            "--ttl",
            "10s",
            "--save",
            saved_s,
        ]),
        "acquire",
    );
    assert_eq!(
        (g["kind"].as_str(), g["ttl_ms"].as_u64()),
        (Some("ttl"), Some(10_000))
    );
    let id = g["lease_id"].as_u64().expect("lease_id");
    let file: Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    assert_eq!(file["lease_id"].as_u64(), Some(id));
    assert_eq!(file["token"], g["token"]);
    assert_eq!(file.as_object().map(|o| o.len()), Some(2), "{file}");
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&saved).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the token is a secret");
    }

    // Taken: --no-wait and --timeout exit 75.
    let busy = lockd(&[
        "acquire",
        "--connect",
        &ep,
        "--resource",
        "job",
        "--holder",
        "w2",
        "--ttl",
        "10s",
        "--no-wait",
    ]);
    assert_eq!(code(&busy), 75, "{}", String::from_utf8_lossy(&busy.stderr));
    let t = std::time::Instant::now();
    let late = lockd(&[
        "acquire",
        "--connect",
        &ep,
        "--resource",
        "job",
        "--holder",
        "w2",
        "--ttl",
        "10s",
        "--timeout",
        "300ms",
    ]);
    assert_eq!(code(&late), 75, "{}", String::from_utf8_lossy(&late.stderr));
    assert!(t.elapsed() >= std::time::Duration::from_millis(300));

    // renew (file, and the env var), lease, leases.
    let r = ok_json(
        &lockd(&["renew", "--connect", &ep, "--saved", saved_s]),
        "renew",
    );
    assert_eq!(r["lease_id"].as_u64(), Some(id));
    assert!(r["expires_at_unix_ms"].as_u64() >= g["expires_at_unix_ms"].as_u64());
    let o = Command::new(BIN)
        .args(["renew", "--connect", &ep])
        .env("LOCKD_SAVED", saved_s)
        .output_within(CMD_LIMIT)
        .unwrap();
    assert_eq!(ok_json(&o, "renew via env")["lease_id"].as_u64(), Some(id));
    let rep = ok_json(
        &lockd(&["lease", "--connect", &ep, &id.to_string()]),
        "lease",
    );
    assert_eq!(
        (
            rep["state"].as_str(),
            rep["holder"].as_str(),
            rep["kind"].as_str()
        ),
        (Some("held"), Some("w1"), Some("ttl"))
    );
    let all = json_lines(&lockd(&["leases", "--connect", &ep, "--resource", "job"]));
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0]["lease_id"].as_u64(), Some(id));
    assert!(json_lines(&lockd(&["leases", "--connect", &ep, "--holder", "nobody"])).is_empty());
    // A wrong token is refused (1).
    let bad = lockd(&[
        "renew",
        "--connect",
        &ep,
        "--lease-id",
        &id.to_string(),
        "--token",
        "nope",
    ]);
    assert_eq!(code(&bad), 1);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bad_token"));

    // release, then renew is refused (lease_ended) and `lease` remembers the end.
    let rel = ok_json(
        &lockd(&["release", "--connect", &ep, "--saved", saved_s]),
        "release",
    );
    assert_eq!(
        (rel["state"].as_str(), rel["epoch"].as_u64()),
        (Some("released"), g["epoch"].as_u64())
    );
    let again = lockd(&["renew", "--connect", &ep, "--saved", saved_s]);
    assert_eq!(code(&again), 1);
    assert!(String::from_utf8_lossy(&again.stderr).contains("lease_ended"));
    let rep = ok_json(
        &lockd(&["lease", "--connect", &ep, &id.to_string()]),
        "lease",
    );
    assert_eq!(rep["state"].as_str(), Some("released"));
    let unknown = ok_json(&lockd(&["lease", "--connect", &ep, "99999"]), "lease");
    assert_eq!(unknown["state"].as_str(), Some("unknown"));

    // A timed shared lease, and status without sessions.
    let s = ok_json(
        &lockd(&[
            "acquire",
            "--connect",
            &ep,
            "--resource",
            "weights",
            "--holder",
            "r",
            "--mode",
            "shared",
            "--ttl",
            "5s",
        ]),
        "acquire --mode",
    );
    assert_eq!(
        (
            s["kind"].as_str(),
            s["mode"].as_str(),
            s["version"].as_u64()
        ),
        (Some("shared"), Some("shared"), Some(0))
    );
    let st = ok_json(
        &lockd(&["status", "--connect", &ep, "--no-sessions"]),
        "status",
    );
    assert!(st["session_count"].as_u64().is_some(), "{st}");
    assert_eq!(st["sessions"].as_array().map(Vec::len).unwrap_or(0), 0);

    // Bad command lines (2) and an unreachable lockd (69).
    for args in [
        vec![
            "acquire",
            "--connect",
            &ep,
            "--resource",
            "x",
            "--holder",
            "h",
        ],
        vec![
            "acquire",
            "--connect",
            &ep,
            "--resource",
            "x",
            "--holder",
            "h",
            "--mode",
            "shared",
        ],
        vec!["renew", "--connect", &ep],
        vec![
            "acquire",
            "--connect",
            &ep,
            "--resource",
            "x",
            "--holder",
            "h",
            "--ttl",
            "soon",
        ],
    ] {
        assert_eq!(code(&lockd(&args)), 2, "{args:?}");
    }
    let nowhere = format!("unix:{}", d.path().join("none.sock").display());
    assert_eq!(code(&lockd(&["leases", "--connect", &nowhere])), 69);
}

#[test]
fn quantity_lease_from_the_command_line() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let ep = l.endpoint();
    for (name, q) in [("node-a", "3"), ("node-b", "2")] {
        let o = ok_json(
            &lockd(&[
                "offer",
                "--connect",
                &ep,
                "--pool",
                "gpus",
                "--name",
                name,
                "--quantity",
                q,
                "--attr",
                "model=h100",
                "--max-lease-time",
                "30s",
            ]),
            "offer",
        );
        assert_eq!(o["offer"]["name"].as_str(), Some(name));
        assert_eq!(o["offer"]["attributes"]["model"].as_str(), Some("h100"));
        assert_eq!(o["offer"]["max_lease_time_ms"].as_u64(), Some(30_000));
    }
    let saved = d.path().join("q.lease");
    let saved_s = saved.to_str().unwrap();
    let g = ok_json(
        &lockd(&[
            "acquire",
            "--connect",
            &ep,
            "--resource",
            "gpus",
            "--holder",
            "engine",
            "--quantity",
            "4",
            "--requirements",
            "model in (h100)",
            "--attr",
            "team=infer",
            "--ttl",
            "1m",
            "--save",
            saved_s,
        ]),
        "acquire --quantity",
    );
    let id = g["lease_id"].as_u64().unwrap();
    let total: u64 = g["allocations"]
        .as_array()
        .expect("allocations")
        .iter()
        .map(|a| a["quantity"].as_u64().unwrap())
        .sum();
    assert_eq!(
        (total, g["allocations"].as_array().unwrap().len()),
        (4, 2),
        "{g}"
    );

    // Not enough left now: 75; never enough: refused (1).
    let o = lockd(&[
        "acquire",
        "--connect",
        &ep,
        "--resource",
        "gpus",
        "--holder",
        "e2",
        "--quantity",
        "2",
        "--no-wait",
    ]);
    assert_eq!(code(&o), 75, "{}", String::from_utf8_lossy(&o.stderr));
    let o = lockd(&[
        "acquire",
        "--connect",
        &ep,
        "--resource",
        "gpus",
        "--holder",
        "e2",
        "--quantity",
        "9",
    ]);
    assert_eq!(code(&o), 1, "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unsatisfiable"));

    // Withdrawing an offer it uses refuses the lease's renewals.
    let w = ok_json(
        &lockd(&[
            "withdraw",
            "--connect",
            &ep,
            "--pool",
            "gpus",
            "--name",
            "node-b",
        ]),
        "withdraw",
    );
    assert_eq!(w["renewal_refused"], serde_json::json!([id]));
    let o = lockd(&["renew", "--connect", &ep, "--saved", saved_s]);
    assert_eq!(code(&o), 1);
    assert!(String::from_utf8_lossy(&o.stderr).contains("renewal_refused"));
    let rep = ok_json(
        &lockd(&["lease", "--connect", &ep, &id.to_string()]),
        "lease",
    );
    assert_eq!(
        (rep["state"].as_str(), rep["renewal_refused"].as_str()),
        (Some("held"), Some("node-b"))
    );
    // Withdrawing an unknown offer is refused.
    let o = lockd(&[
        "withdraw",
        "--connect",
        &ep,
        "--pool",
        "gpus",
        "--name",
        "nope",
    ]);
    assert_eq!(code(&o), 1, "{}", String::from_utf8_lossy(&o.stderr));
    let rel = ok_json(
        &lockd(&["release", "--connect", &ep, "--saved", saved_s]),
        "release",
    );
    assert_eq!(rel["state"].as_str(), Some("released"));
    assert!(json_lines(&lockd(&["leases", "--connect", &ep, "--resource", "gpus"])).is_empty());
}
