//! Shared/exclusive leases with versions against real `lockd serve` processes, over raw
//! protocol-2 JSON lines: many readers, a writer waits for them, writer priority, commit
//! bumps the version, a writer SIGKILLed before its commit leaves it, `min_version` waits,
//! and versions and epochs continue across a lockd SIGKILL.
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::*;

fn acq(res: &str, holder: &str, mode: &str) -> Value {
    json!({"op":"acquire","resource":res,"holder":holder,"mode":mode})
}

const QUIET: Duration = Duration::from_millis(300);

/// Readers share; a writer waits for them; a reader arriving after the waiting writer waits
/// too; the writer's commit is the version the later reader is granted.
#[test]
fn shared_readers_writer_priority_and_commit() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = Lockd2::start(d.path(), &[]);
    let mut readers: Vec<Raw> = (0..5).map(|_| l.raw()).collect();
    let mut last_epoch = 0;
    for (i, r) in readers.iter_mut().enumerate() {
        let g = r.rpc(acq("w", &format!("r{i}"), "shared"), "granted");
        assert_eq!(g["kind"], "shared", "{g}");
        assert_eq!(g["mode"], "shared", "{g}");
        assert_eq!(g["version"], 0, "{g}");
        let e = u64_of(&g, "epoch");
        assert!(e > last_epoch, "epochs increase: {last_epoch} then {e}");
        last_epoch = e;
    }
    let all = readers[0].rpc(json!({"op":"leases","resource":"w"}), "leases");
    let held = all["leases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["state"] == "held")
        .count();
    assert_eq!(held, 5, "five readers at once: {all}");

    let mut w = l.raw();
    let q = w.rpc(acq("w", "writer", "exclusive"), "queued");
    let wid = lease_id(&q);
    // Writer priority: a reader arriving after the waiting writer is not admitted.
    let mut late = l.raw();
    late.rpc(acq("w", "late", "shared"), "queued");
    // wait:false readers are refused too while the writer waits.
    let mut nowait = l.raw();
    nowait.rpc(
        json!({"op":"acquire","resource":"w","holder":"nw","mode":"shared","wait":false}),
        "busy",
    );
    // The writer waits for every reader.
    readers.truncate(1);
    w.quiet(QUIET, "writer granted while a reader holds");
    readers.clear();
    let g = w.until("granted", REPLY);
    assert_eq!(lease_id(&g), wid);
    assert_eq!(g["mode"], "exclusive", "{g}");
    assert!(u64_of(&g, "epoch") > last_epoch, "{g}");
    late.quiet(QUIET, "reader granted while the writer holds");
    let c = w.rpc(
        json!({"op":"commit","lease_id":wid,"token":token(&g)}),
        "committed",
    );
    assert_eq!(c["version"], 1, "{c}");
    let mut r2 = l.raw();
    w.rpc(json!({"op":"release","resource":"w"}), "released");
    let g = late.until("granted", REPLY);
    assert_eq!(g["version"], 1, "the reader after the commit sees it: {g}");
    let gr = r2.rpc(acq("w", "r2", "shared"), "granted");
    assert_eq!(gr["version"], 1, "{gr}");
    // A reader may not commit; a wrong token may not either.
    r2.rpc_err(
        json!({"op":"commit","lease_id":lease_id(&gr),"token":token(&gr)}),
        "wrong_lease",
    );
    r2.rpc_err(
        json!({"op":"commit","lease_id":lease_id(&gr),"token":"00"}),
        "bad_token",
    );
    let st = r2.status(false);
    assert_eq!(st["counters_by_kind"]["shared"]["commits"], 1, "{st}");
}

/// A writer *process* SIGKILLed before its commit leaves the version unchanged; the next
/// reader sees the old version. `min_version` waits until a commit reaches it.
#[test]
fn shared_writer_killed_before_commit_and_min_version() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = Lockd2::start(d.path(), &[]);
    // Version 1 first.
    let mut w = l.raw();
    let g = w.rpc(acq("v", "w1", "exclusive"), "granted");
    w.rpc(
        json!({"op":"commit","lease_id":lease_id(&g),"token":token(&g)}),
        "committed",
    );
    w.rpc(json!({"op":"release","resource":"v"}), "released");

    // A reader parked for version 2.
    let mut parked = l.raw();
    let q = parked.rpc(
        json!({"op":"acquire","resource":"v","holder":"p","mode":"shared","min_version":2}),
        "queued",
    );
    assert!(q["lease_id"].is_u64(), "{q}");

    // The writer process: granted, then SIGKILLed without committing.
    let mut child = ChildClient::spawn(l.socket(), &[acq("v", "doomed", "exclusive")]);
    let cg = child.until("granted", REPLY);
    let cid = lease_id(&cg);
    parked.quiet(QUIET, "parked reader granted below its min_version");
    child.kill();
    // The next reader sees version 1 (no commit happened).
    let mut r = l.raw();
    let g = r.rpc(acq("v", "r", "shared"), "granted");
    assert_eq!(
        g["version"], 1,
        "a writer killed before commit changed the version: {g}"
    );
    let rep = r.lease(cid);
    assert_eq!(rep["state"], "released", "{rep}");
    parked.quiet(QUIET, "parked reader granted below its min_version");

    // A commit to version 2 releases the parked reader.
    drop(r);
    let mut w = l.raw();
    let g = w.rpc(acq("v", "w2", "exclusive"), "granted");
    let c = w.rpc(
        json!({"op":"commit","lease_id":lease_id(&g),"token":token(&g)}),
        "committed",
    );
    assert_eq!(c["version"], 2, "{c}");
    parked.quiet(QUIET, "parked reader granted while the writer holds");
    w.rpc(json!({"op":"release","resource":"v"}), "released");
    let g = parked.until("granted", REPLY);
    assert_eq!(g["version"], 2, "{g}");
    assert_eq!(lease_id(&g), lease_id(&q));
}

/// lockd SIGKILLed and restarted: the version committed before is kept, epochs go on
/// strictly increasing, and a new commit continues from the kept version.
#[test]
fn shared_versions_and_epochs_survive_a_lockd_sigkill() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let mut l = Lockd2::start(d.path(), &["--reconnect-window", "500ms"]);
    let mut w = l.raw();
    let mut epochs = Vec::new();
    for _ in 0..3 {
        let g = w.rpc(acq("x", "w", "exclusive"), "granted");
        epochs.push(u64_of(&g, "epoch"));
        w.rpc(
            json!({"op":"commit","lease_id":lease_id(&g),"token":token(&g)}),
            "committed",
        );
        w.rpc(json!({"op":"release","resource":"x"}), "released");
    }
    // A reader holds across the kill (its connection dies with lockd).
    let mut r = l.raw();
    let g = r.rpc(acq("x", "r", "shared"), "granted");
    assert_eq!(g["version"], 3, "{g}");
    epochs.push(u64_of(&g, "epoch"));
    drop((w, r));
    l.restart();

    let mut r = l.raw();
    let g = r.rpc(acq("x", "r2", "shared"), "granted");
    assert_eq!(g["version"], 3, "the version survives the restart: {g}");
    epochs.push(u64_of(&g, "epoch"));
    drop(r);
    // A writer waits for the old reader's reconnect window, then commits version 4.
    let mut w = l.raw();
    w.send(&acq("x", "w", "exclusive"));
    let g = w.until("granted", Duration::from_secs(5));
    epochs.push(u64_of(&g, "epoch"));
    let c = w.rpc(
        json!({"op":"commit","lease_id":lease_id(&g),"token":token(&g)}),
        "committed",
    );
    assert_eq!(c["version"], 4, "{c}");
    assert!(
        epochs.windows(2).all(|p| p[0] < p[1]),
        "epochs not strictly increasing across the restart: {epochs:?}"
    );
}
