//! `gmsctl verify` against real gmsd processes: passes on a committed store, fails with a
//! reason and its exit code otherwise.

use std::time::{Duration, Instant};

use crate::common::*;
use gms_client::protocol::RequestedLockType;

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {s:?}"))
}

fn load(sock: &str, count: &str, lock: &str) -> serde_json::Value {
    let (code, out, err) = gmsctl(&[
        "load", "--socket", sock, "--count", count, "--size", "3000000", "--lock", lock,
    ]);
    assert_eq!(code, 0, "load failed: {err}");
    json(out.lines().last().unwrap())
}

#[test]
fn verify_passes_on_a_committed_store() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let sock = g.socket.to_str().unwrap();
    let loaded = load(sock, "4", "rw_or_ro");
    let hash = loaded["memory_layout_hash"].as_str().unwrap().to_string();
    assert_eq!(hash.len(), 64);
    let (code, out, err) = gmsctl(&["verify", "--socket", sock, "--timeout", "5s"]);
    assert_eq!(code, 0, "verify failed: {out} {err}");
    let v = json(&out);
    assert_eq!(v["ok"], true);
    assert_eq!(v["allocations"], 4);
    assert_eq!(v["metadata_entries"], 4);
    assert_eq!(v["total_bytes"], 4 * 4 * 1024 * 1024);
    assert_eq!(v["server_hash"], hash.as_str());
    assert_eq!(v["computed_hash"], hash.as_str());
    // With the right expected hash too; and gmsctl state agrees.
    let (code, _, _) = gmsctl(&["verify", "--socket", sock, "--expect-hash", &hash]);
    assert_eq!(code, 0);
    let (code, out, _) = gmsctl(&["state", "--socket", sock]);
    assert_eq!(code, 0);
    let s = json(&out);
    assert_eq!(s["state"], "COMMITTED");
    assert_eq!(s["memory_layout_hash"], hash.as_str());
    assert_eq!(s["ro_session_count"], 0, "verify released its read lock");
}

#[test]
fn verify_fails_when_nothing_is_committed() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let sock = g.socket.to_str().unwrap();
    let t0 = Instant::now();
    let (code, out, err) = gmsctl(&["verify", "--socket", sock, "--timeout", "30s"]);
    assert_eq!(code, 4, "{out} {err}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "fails fast, not after the timeout"
    );
    let v = json(&out);
    assert_eq!(v["ok"], false);
    assert_eq!(v["failure"], "not_committed");
    assert!(v["reason"].as_str().unwrap().contains("nothing committed"));
    assert!(err.contains("nothing committed"));
    // Also after an aborted writer.
    let (code, _, _) = gmsctl(&[
        "load",
        "--socket",
        sock,
        "--count",
        "2",
        "--size",
        "1000",
        "--no-commit",
    ]);
    assert_eq!(code, 0);
    let (code, _, _) = gmsctl(&["verify", "--socket", sock, "--timeout", "2s"]);
    assert_eq!(code, 4);
}

#[test]
fn verify_fails_on_a_changed_layout() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let sock = g.socket.to_str().unwrap();
    let old = load(sock, "2", "rw")["memory_layout_hash"]
        .as_str()
        .unwrap()
        .to_string();
    // Someone replaces the store with a different layout.
    let new = load(sock, "3", "rw")["memory_layout_hash"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(old, new);
    let (code, out, err) = gmsctl(&["verify", "--socket", sock, "--expect-hash", &old]);
    assert_eq!(code, 6, "{out} {err}");
    let v = json(&out);
    assert_eq!(v["failure"], "hash_mismatch");
    let reason = v["reason"].as_str().unwrap();
    assert!(
        reason.contains("layout changed") && reason.contains(&old),
        "{reason}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_fails_on_a_truncated_allocation() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let sock = g.socket.to_str().unwrap().to_string();
    let run = async {
        let mut w = client(&g.socket).await;
        assert!(
            w.handshake(RequestedLockType::Rw, Some(Duration::from_secs(5)))
                .await
                .unwrap()
                .success
        );
        let good = w.allocate(1 << 20, "weights").await.unwrap();
        let bad = w.allocate(1 << 20, "weights").await.unwrap();
        w.metadata_put("a", &good.allocation_id, 0, b"{}")
            .await
            .unwrap();
        w.metadata_put("b", &bad.allocation_id, 0, b"{}")
            .await
            .unwrap();
        // The writer's fd shares the memfd: truncating it shrinks the allocation.
        let (_, fd) = w.export(&bad.allocation_id).await.unwrap();
        nix::unistd::ftruncate(&fd, 4096).unwrap();
        assert!(w.commit().await.unwrap());
        let (code, out, err) =
            tokio::task::spawn_blocking(move || gmsctl(&["verify", "--socket", &sock]))
                .await
                .unwrap();
        assert_eq!(code, 8, "{out} {err}");
        let v = json(&out);
        assert_eq!(v["failure"], "import_failed");
        let reason = v["reason"].as_str().unwrap();
        assert!(
            reason.contains("truncated") && reason.contains(&bad.allocation_id),
            "{reason}"
        );
    };
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_times_out_when_the_read_lock_is_not_granted() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let sock = g.socket.to_str().unwrap().to_string();
    let run = async {
        let s2 = sock.clone();
        tokio::task::spawn_blocking(move || load(&s2, "1", "rw"))
            .await
            .unwrap();
        // A reader holds the store and a writer waits: writer priority keeps verify out.
        let (_r, _writer) = reader_and_waiting_writer(&g.socket).await;
        let t0 = Instant::now();
        let (code, out, err) = tokio::task::spawn_blocking(move || {
            gmsctl(&["verify", "--socket", &sock, "--timeout", "300ms"])
        })
        .await
        .unwrap();
        assert_eq!(code, 5, "{out} {err}");
        assert!(t0.elapsed() < Duration::from_secs(10));
        assert_eq!(json(&out)["failure"], "lock_timeout");
    };
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("timed out");
}

#[test]
fn verify_and_state_fail_when_no_gms_answers() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nobody.sock");
    let sock = sock.to_str().unwrap();
    let (code, out, _) = gmsctl(&["verify", "--socket", sock, "--timeout", "200ms"]);
    assert_eq!(code, 3);
    assert_eq!(json(&out)["failure"], "unreachable");
    let (code, _, err) = gmsctl(&["state", "--socket", sock, "--timeout", "200ms"]);
    assert_eq!(code, 3);
    assert!(err.contains("cannot connect"), "{err}");
    // Bad flags: clap's usage error.
    let (code, _, _) = gmsctl(&["verify", "--socket", sock, "--timeout", "soon"]);
    assert_eq!(code, 2);
}
