//! An etcd follower that stalls (SIGSTOP: what a blocked fsync or a frozen VM looks like to a
//! client: the TCP connection stays open, nothing is answered) while lockd's keepalive streams
//! are on it. Two members are fine, so the lock must stay: lockd moves the stream to another
//! member before the fence's deadline. With the planted bug (the stream stays on the silent
//! member, as lockd did before) the same scenario fences the holder, which this test also
//! shows, so that it could fail.

use std::time::{Duration, Instant};

use harness::etcd::Etcd;

use crate::common::*;
use crate::etcd_backend::{start, Line};

const TTL: Duration = Duration::from_secs(2);

/// The holder on a lockd whose first endpoint is a follower; that follower paused for three
/// TTLs. Returns the `revoked` event the holder was sent in that time (None: it kept the
/// lock) and lockd's log.
fn stall_the_streams_member(planted: bool) -> Option<(Option<serde_json::Value>, String)> {
    let d = tempfile::tempdir().unwrap();
    let Some(members) = Etcd::start_cluster(d.path(), 3) else {
        harness::skip::skip(
            "etcd_member_stall",
            "no etcd binary (apt-get install etcd-server; .ci/run installs it)",
        );
        return None;
    };
    let leader = wait_for(Duration::from_secs(10), "an etcd leader", || {
        Etcd::leader_of(&members)
    });
    let follower = (leader + 1) % members.len();
    // The follower first: lockd's keepalive streams start on the first endpoint.
    let mut order = vec![follower];
    order.extend((0..members.len()).filter(|i| *i != follower));
    let urls: Vec<String> = order
        .iter()
        .map(|i| members[*i].client_url.clone())
        .collect();
    let env: &[(&str, &str)] = if planted {
        &[("LOCKD_PLANTED_BUG_STAY_ON_STALLED_MEMBER", "1")]
    } else {
        &[]
    };
    let a = start(
        d.path(),
        "A",
        &urls.join(","),
        &["--etcd-ttl", &format!("{}s", TTL.as_secs())],
        env,
    );
    let mut holder = Line::connect(&a.sock).unwrap();
    holder.acquire("engine", "ha");
    holder
        .recv_until("granted", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no grant: {}", a.proc.log_text()));
    // A few keepalives answered on the follower first.
    std::thread::sleep(Duration::from_millis(800));
    let log = a.proc.log_text();
    let on_follower = format!(
        "member={:016x}",
        members[follower]
            .member_id()
            .expect("the follower's member id")
    );
    assert!(
        log.contains("keepalive answered") && log.contains(&on_follower),
        "keepalives not answered by the follower {on_follower} first: {log}"
    );
    assert!(members[follower].pause(), "SIGSTOP the follower");
    let paused = Instant::now();
    let revoked = holder.recv_until("revoked", TTL * 3);
    let waited = paused.elapsed();
    assert!(members[follower].resume(), "SIGCONT the follower");
    eprintln!(
        "follower paused (planted bug: {planted}): holder {} after {waited:?}",
        if revoked.is_some() {
            "told revoked"
        } else {
            "kept the lock"
        }
    );
    let log = a.proc.log_text();
    drop(members);
    Some((revoked, log))
}

#[test]
fn a_stalled_follower_costs_no_failover_the_keepalive_stream_moves() {
    let _process = serial();
    let Some((revoked, log)) = stall_the_streams_member(false) else {
        return;
    };
    assert_eq!(revoked, None, "the holder lost its lock: {log}");
    assert!(
        log.contains("keepalive stream silent: moving it to another etcd member"),
        "{log}"
    );
    assert!(
        log.contains("keepalive streams move to another member"),
        "{log}"
    );
}

#[test]
fn planted_bug_staying_on_the_stalled_member_fences_the_holder() {
    let _process = serial();
    let Some((revoked, log)) = stall_the_streams_member(true) else {
        return;
    };
    let r = revoked.unwrap_or_else(|| panic!("the planted bug was not caught: {log}"));
    assert!(
        r["reason"].as_str().unwrap_or_default().starts_with("lost"),
        "{r}"
    );
    assert!(!log.contains("keepalive stream silent"), "{log}");
}
