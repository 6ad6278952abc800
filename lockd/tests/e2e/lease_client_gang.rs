//! `lockd::lease_client`'s gangs of the version-2 kinds against a real lockd: a TTL gang
//! granted whole, renewed, resumed and released whole by its id from other connections; a
//! queued gang's timeout and a queued shared gang's later grant as events (routing intact:
//! the next request gets its own answer); `member_lost` when an admin revokes a member.
use crate::common::*;
use lockd::lease_client::{
    Acquire, Acquired, Ended, Gang, GangAcquire, GangAcquired, LeaseClient, LeaseError, LeaseEvent,
};
use lockd::proto::{LeaseKind, Mode};
use serde_json::json;
use std::time::Duration;

// The helpers shared with the per-kind client tests.
use crate::lease_client::{client, event_matching, within};

async fn gang(c: &LeaseClient, a: &GangAcquire) -> Gang {
    match within("acquire_gang", c.acquire_gang(a)).await {
        Ok(GangAcquired::Granted(g)) => g,
        other => panic!("expected a gang grant for {a:?}, got {other:?}"),
    }
}

async fn gang_queued(c: &LeaseClient, a: &GangAcquire) -> u64 {
    match within("acquire_gang", c.acquire_gang(a)).await {
        Ok(GangAcquired::Queued { gang_id, .. }) => gang_id,
        other => panic!("expected a queued gang for {a:?}, got {other:?}"),
    }
}

/// Revokes lease `id` as an admin over the Unix socket (a failed device, say).
fn revoke(l: &Lockd, id: u64, why: &str) {
    let mut admin = Raw::connect(l.socket());
    admin.rpc(
        json!({"op":"revoke","lease_id":id,"reason":why}),
        "revoke_sent",
    );
}

#[tokio::test]
async fn a_ttl_gang_is_renewed_resumed_and_released_whole_and_a_queued_one_times_out() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let c = client(&l).await;
    let g = gang(
        &c,
        &GangAcquire::ttl("tp", "eng", ["a", "b", "c"], Duration::from_secs(5)),
    )
    .await;
    assert_eq!((g.kind, g.label.as_str()), (LeaseKind::Ttl, "tp"));
    assert_eq!(
        g.members
            .iter()
            .map(|m| m.resource.as_str())
            .collect::<Vec<_>>(),
        ["a", "b", "c"]
    );
    assert_eq!(
        g.members[0].lease_id, g.gang_id,
        "the gang's id is its first member's"
    );
    let exp = g.expires_at_unix_ms.expect("a TTL gang has a deadline");

    // A second gang over {c, d} waits (c is held) and gives up after its timeout: an event,
    // and the next request on that connection still gets its own answer.
    let mut other = client(&l).await;
    let q = gang_queued(
        &other,
        &GangAcquire::ttl("tp2", "eng2", ["c", "d"], Duration::from_secs(5))
            .timeout(Duration::from_millis(300)),
    )
    .await;
    match within("the timeout", other.wait_gang_granted(q)).await {
        Err(LeaseError::Refused { code, .. }) => assert_eq!(code, "cancelled"),
        r => panic!("expected the gang's timeout, got {r:?}"),
    }
    let rep = within("lease", other.lease(q)).await.unwrap();
    assert_ne!(rep.state, "held", "{rep:?}");
    // ... d was never held in part.
    let d_busy = within(
        "d",
        other.acquire(&Acquire::ttl("d", "x", Duration::from_secs(1)).no_wait()),
    )
    .await
    .unwrap();
    assert!(matches!(d_busy, Acquired::Granted(_)), "{d_busy:?}");

    // The holder process goes away; another one renews and resumes the gang whole by its
    // saved id and token, then releases it whole.
    let saved = g.saved();
    drop(c);
    let c2 = client(&l).await;
    let exp2 = within("renew", c2.renew(&saved, None)).await.unwrap();
    assert!(exp2 >= exp, "{exp2} < {exp}");
    let back = within("resume_gang", c2.resume_gang(&saved)).await.unwrap();
    assert_eq!(back.len(), 3, "{back:?}");
    assert!(back.iter().all(|m| m.resumed && m.kind == LeaseKind::Ttl));
    let ended = within("release_gang", c2.release_gang(&saved))
        .await
        .unwrap();
    assert_eq!(ended.len(), 3, "{ended:?}");
    assert!(ended.iter().all(|e| matches!(e, Ended::Released { .. })));
    for m in &g.members {
        assert_eq!(
            within("lease", c2.lease(m.lease_id)).await.unwrap().state,
            "released"
        );
    }
    // Routing intact: a later request is answered as itself.
    c2.ping().await.unwrap();
}

#[tokio::test]
async fn a_queued_shared_gang_is_granted_as_an_event_and_a_revoked_member_is_named() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    // A writer holds s1; the shared gang over {s0, s1} waits for it, whole.
    let w = client(&l).await;
    let wl = match within(
        "writer",
        w.acquire(&Acquire::shared("s1", "w", Mode::Exclusive)),
    )
    .await
    .unwrap()
    {
        Acquired::Granted(l) => l,
        other => panic!("{other:?}"),
    };
    let mut c = client(&l).await;
    let gid = gang_queued(&c, &GangAcquire::shared("rd", "eng", ["s0", "s1"])).await;
    let rep = within("lease", c.lease(gid)).await.unwrap();
    assert_ne!(rep.state, "held", "s0 is not held in part: {rep:?}");
    // A request on the gang's connection meanwhile is answered as itself.
    within("status", c.status(false)).await.unwrap();
    within("release", w.release(&wl)).await.unwrap();
    let g = within("the gang's grant", c.wait_gang_granted(gid))
        .await
        .unwrap();
    assert_eq!((g.gang_id, g.kind), (gid, LeaseKind::Shared));
    assert!(g.members.iter().all(|m| m.version.is_some()), "{g:?}");
    assert_eq!(g.expires_at_unix_ms, None, "bound to the connection");

    // An admin takes s1 away (its GPU failed): the holder is told which member.
    let s1 = g.members[1].lease_id;
    revoke(&l, s1, "gpu failed");
    let lost = event_matching(&mut c, |e| matches!(e, LeaseEvent::MemberLost { .. })).await;
    match lost {
        LeaseEvent::MemberLost {
            gang_id,
            resource,
            epoch,
            reason,
        } => {
            assert_eq!((gang_id, resource.as_str()), (gid, "s1"));
            assert_eq!(epoch, g.members[1].epoch);
            assert!(reason.ends_with("gpu failed"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // A connection-bound member is revoked as any bound shared lease: `revoked` follows.
    let rv = event_matching(&mut c, |e| matches!(e, LeaseEvent::Revoked { .. })).await;
    assert!(matches!(rv, LeaseEvent::Revoked { ref resource, .. } if resource == "s1"));
}

#[tokio::test]
async fn a_revoked_member_of_a_ttl_gang_is_named_then_the_gang_ends_whole() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let mut c = client(&l).await;
    let g = gang(
        &c,
        &GangAcquire::ttl("tp", "eng", ["g0", "g1"], Duration::from_secs(30)),
    )
    .await;
    revoke(&l, g.members[1].lease_id, "node drained");
    let lost = event_matching(&mut c, |e| matches!(e, LeaseEvent::MemberLost { .. })).await;
    assert!(
        matches!(&lost, LeaseEvent::MemberLost { gang_id, resource, .. }
            if *gang_id == g.gang_id && resource == "g1"),
        "{lost:?}"
    );
    // Then every member ends, with the revoke's reason.
    for _ in 0..2 {
        let e = event_matching(&mut c, |e| matches!(e, LeaseEvent::Ended { .. })).await;
        assert!(
            matches!(&e, LeaseEvent::Ended { reason, .. } if reason.starts_with("revoked:")),
            "{e:?}"
        );
    }
    assert_eq!(
        within("lease", c.lease(g.gang_id)).await.unwrap().state,
        "revoked"
    );
}
