//! TTL and shared gangs against real `lockd serve` processes, over raw protocol-2 JSON
//! lines: a TTL gang kept whole, with its deadline, across a SIGKILL restart, renewed and
//! released by its id with the old token; a revoked member named to the holder.
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::*;

fn ttl_gang(label: &str, holder: &str, members: &[&str], ttl_ms: u64) -> Value {
    json!({"op":"acquire","resource":label,"holder":holder,"gang":members,"ttl_ms":ttl_ms})
}

/// (resource, lease id) of each member of a `gang_granted`.
fn members(g: &Value) -> Vec<(String, u64)> {
    g["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| (m["resource"].as_str().unwrap().to_string(), lease_id(m)))
        .collect()
}

#[test]
fn a_ttl_gang_survives_a_restart_whole_with_its_deadline() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let mut l = Lockd2::start(d.path(), &[]);
    let mut a = Raw::connect(l.socket());
    let g = a.rpc(ttl_gang("tp", "eng-a", &["a", "b"], 5000), "gang_granted");
    assert_eq!(g["kind"], "ttl", "{g}");
    let (gid, tok) = (u64_of(&g, "gang_id"), token(&g));
    let exp = u64_of(&g, "expires_at_unix_ms");
    let m = members(&g);
    assert_eq!(m.len(), 2, "{g}");
    assert_eq!(m[0].1, gid, "the gang's id is its first member's lease id");
    drop(a);
    l.restart(); // SIGKILL, then a new lockd on the same socket and state file

    let mut o = Raw::connect(l.socket());
    for (_, id) in &m {
        let rep = o.lease(*id);
        assert_eq!(rep["state"], "held", "{rep}");
        assert_eq!(u64_of(&rep, "expires_at_unix_ms"), exp, "{rep}");
    }
    // Another gang over {b, c} waits (b is held); c stays free, reserved for it.
    let mut b = Raw::connect(l.socket());
    b.rpc(ttl_gang("tp2", "eng-b", &["b", "c"], 5000), "queued");
    // Renewed whole by its id with the old token, from a new connection.
    let r = o.rpc(json!({"op":"renew","lease_id":gid,"token":tok}), "renewed");
    let exp2 = u64_of(&r, "expires_at_unix_ms");
    assert!(exp2 >= exp, "{r}");
    for (_, id) in &m {
        assert_eq!(u64_of(&o.lease(*id), "expires_at_unix_ms"), exp2);
    }
    // Released whole by its id: every member answered, the waiting gang gets both.
    o.send(&json!({"op":"release","lease_id":gid,"token":tok}));
    o.until("released", Duration::from_secs(5));
    o.until("released", Duration::from_secs(5));
    let g2 = b.until("gang_granted", Duration::from_secs(5));
    assert_eq!(members(&g2).len(), 2, "{g2}");
    assert_eq!(o.lease(gid)["state"], "released");
}

#[test]
fn a_revoked_member_of_a_shared_gang_is_named_to_its_holder() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = Lockd2::start(d.path(), &[]);
    let mut a = Raw::connect(l.socket());
    let req = json!({"op":"acquire","resource":"rd","holder":"eng","gang":["w0","w1"],
                     "mode":"shared","ttl_ms":60_000});
    let g = a.rpc(req, "gang_granted");
    assert_eq!(g["kind"], "shared", "{g}");
    assert!(g["members"][0]["version"].is_u64(), "{g}");
    let w1 = members(&g)[1].1;
    let mut admin = Raw::connect(l.socket());
    admin.rpc(
        json!({"op":"revoke","lease_id":w1,"reason":"node failed"}),
        "revoke_sent",
    );
    let lost = a.until("member_lost", Duration::from_secs(5));
    assert_eq!(lost["resource"], "w1", "{lost}");
    assert!(
        lost["reason"].as_str().unwrap().ends_with("node failed"),
        "{lost}"
    );
    // A timed shared gang ends whole right after.
    a.until("lease_ended", Duration::from_secs(5));
    a.until("lease_ended", Duration::from_secs(5));
    assert_eq!(admin.lease(u64_of(&g, "gang_id"))["state"], "revoked");
}
