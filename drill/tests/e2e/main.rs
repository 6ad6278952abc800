//! `supervisor drill` as users run it: the supervisor execs `supervisor-drill` found next to
//! itself or on `$PATH`, and says where it looked (exit 127) when it is nowhere. (This test
//! binary is also what makes `cargo test --workspace` build `supervisor-drill`, which the
//! end-to-end drill tests run.) The drill's rounds themselves are exercised by
//! `tests/tests/e2e/drill_ci.rs` and `drill_compound.rs`; the drill across nodes (network
//! namespaces, etcd) by `across_nodes`.

use std::process::Command;

mod across_nodes;

#[test]
fn supervisor_drill_execs_the_drill_binary() {
    let out = Command::new(harness::must_bin("supervisor"))
        .args(["drill", "--help"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--iterations", "--kinds", "--order", "--report", "--load"] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    // The drill's own exit codes pass through the exec: a bad flag is its usage error.
    let out = Command::new(harness::must_bin("supervisor"))
        .args(["drill", "--no-such-flag"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[test]
fn without_supervisor_drill_it_exits_127_naming_where_it_looked() {
    let dir = tempfile::tempdir().unwrap();
    let alone = dir.path().join("supervisor");
    std::fs::copy(harness::must_bin("supervisor"), &alone).unwrap();
    let empty = dir.path().join("empty-path");
    std::fs::create_dir(&empty).unwrap();
    let out = Command::new(&alone)
        .args(["drill", "--iterations", "1"])
        .env("PATH", &empty)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&dir.path().join("supervisor-drill").display().to_string())
            && err.contains(&empty.join("supervisor-drill").display().to_string()),
        "the error names every place looked in: {err}"
    );
}
