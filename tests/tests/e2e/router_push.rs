//! Issue 10, item 3: traffic moves when the lock moves. Real supervisors push their engine's
//! place to a real HAProxy through its runtime API (`--router-socket`): the Active engine's
//! server in, the shadow's backup twin in, everything else out; after a kill the new Active
//! engine is in rotation as soon as it is Active (not at the next health check), the dead one
//! out, and the re-armed one offered as the backup. And a router that does not answer never
//! holds up a failover: the push that takes the Active engine out before fencing is bounded.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::{Duration, Instant};

use harness::haproxy::{Haproxy, ServerState};
use harness::{free_addr, free_port, kill, wait_until, Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase};

const T: Duration = Duration::from_secs(20);

fn opts(id: u32, role: &'static str, socket: &Path, resync: &str) -> SupOpts {
    let sock = socket.to_string_lossy().into_owned();
    SupOpts::new(id, role).restart("on-failure").sup(&[
        "--linger",
        "5s",
        "--restart-backoff",
        "200ms",
        "--router-socket",
        &sock,
        "--router-server",
        &format!("engines/engine-{id}"),
        "--router-resync",
        resync,
        "--router-timeout",
        "300ms",
    ])
}

/// The chart's backend shape (deploy/chart/templates/router-configmap.yaml), for engines given
/// as (id, engine address, probes address).
fn config(socket: &Path, front: u16, engines: &[(u32, SocketAddr, SocketAddr)]) -> String {
    let mut servers = String::new();
    for (id, engine, probes) in engines {
        let (port, probe) = (engine.port(), probes.port());
        servers.push_str(&format!(
            "  server engine-{id} 127.0.0.1:{port} check port {probe} observe layer4 error-limit 1 on-error mark-down\n\
             \x20 server engine-{id}-standby 127.0.0.1:{port} backup disabled\n"
        ));
    }
    format!(
        "global\n  stats socket {} mode 600 level admin\n\
         defaults\n  mode http\n  timeout connect 5ms\n  timeout client 30s\n  timeout server 30s\n  timeout check 1s\n\
         \x20 option http-buffer-request\n  retries 3\n  option redispatch 1\n  retry-on conn-failure empty-response junk-response 502 503\n\
         frontend openai\n  bind 127.0.0.1:{front}\n  default_backend engines\n\
         backend engines\n  option httpchk GET /ready\n  http-check expect status 200\n  default-server inter 1s fall 3 rise 1\n{servers}",
        socket.display()
    )
}

/// Waits until the router shows `active` serving and `standby` offered as the backup (and the
/// two others forced out); returns the last view either way.
fn wait_view(
    h: &Haproxy,
    active: u32,
    standby: u32,
    limit: Duration,
) -> (bool, BTreeMap<String, ServerState>) {
    let mut view = BTreeMap::new();
    let ok = wait_until(limit, Duration::from_millis(5), || {
        view = h.servers("engines");
        let s = |n: String| {
            view.get(&n)
                .copied()
                .unwrap_or(ServerState { op: 0, admin: 0 })
        };
        s(format!("engine-{active}")).in_rotation()
            && s(format!("engine-{standby}-standby")).in_rotation()
            && s(format!("engine-{standby}")).forced_out()
            && s(format!("engine-{active}-standby")).forced_out()
    });
    (ok, view)
}

fn complete(port: u16) -> Option<u64> {
    let r = harness::http::post_json(
        &format!("http://127.0.0.1:{port}/v1/completions"),
        r#"{"prompt":"hi","max_tokens":1}"#,
        Duration::from_secs(5),
    )?;
    (r.status == 200)
        .then(|| serde_json::from_str::<serde_json::Value>(&r.body).ok()?["engine_id"].as_u64())
        .flatten()
}

#[test]
fn the_router_follows_the_lock() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let socket = c.dir.path().join("router.sock");
    // The router first, with every address fixed up front, and no periodic resync: whatever
    // the router learns, it learns from the pushes at the transitions.
    let addrs: Vec<(u32, SocketAddr, SocketAddr)> =
        (0..2).map(|id| (id, free_addr(), free_addr())).collect();
    let front = free_port();
    let Some(h) = Haproxy::start(
        "router_push::the_router_follows_the_lock",
        c.dir.path(),
        &config(&socket, front, &addrs),
        &socket,
    ) else {
        return;
    };
    let o = |id: u32, role| {
        opts(id, role, &socket, "0s").addrs(addrs[id as usize].2, addrs[id as usize].1)
    };
    let (a, b) = c.start_pair(&o(0, "primary"), &o(1, "shadow"), T);
    let (ok, view) = wait_view(&h, 0, 1, Duration::from_secs(2));
    assert!(
        ok,
        "router not in line with engine 0 active / 1 standby: {view:?}{}",
        c.dump_logs()
    );
    assert_eq!(complete(front), Some(0), "served by the Active engine");

    // The Active engine dies: engine 1 is in rotation as soon as it is Active. The router's
    // own check (inter 1 s, rise 1) would take up to a second: the push must beat it.
    let pids = a.wait_engine_pids(1, T);
    let t0 = Instant::now();
    assert!(kill(pids[0], Signal::SIGKILL));
    assert!(
        b.wait_phase(Phase::Active, T),
        "shadow not Active{}",
        c.dump_logs()
    );
    let in_rotation = wait_until(T, Duration::from_millis(2), || {
        h.servers("engines")["engine-1"].in_rotation()
    });
    let took = t0.elapsed();
    assert!(in_rotation, "engine 1 never in rotation{}", c.dump_logs());
    assert!(
        took < Duration::from_millis(500),
        "engine 1 in rotation {took:?} after the kill: not pushed"
    );
    let view = h.servers("engines");
    assert!(
        view["engine-0"].forced_out(),
        "dead engine 0 still in rotation: {view:?}"
    );
    assert!(
        !view["engine-1-standby"].in_rotation(),
        "the Active engine offered as a backup: {view:?}"
    );
    assert_eq!(complete(front), Some(1), "served by the new Active engine");

    // Engine 0 re-arms as a shadow: offered as the backup again.
    let (ok, view) = wait_view(&h, 1, 0, T);
    assert!(
        ok,
        "re-armed engine 0 not offered as the backup: {view:?}{}",
        c.dump_logs()
    );
    let m = b.metrics();
    assert!(
        m.value("supervisor_router_pushes_total", &[]) >= 2.0,
        "{m:?}"
    );
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
}

#[test]
fn a_router_that_does_not_answer_does_not_hold_up_the_failover() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    // Accepts connections and never answers: every push times out (300 ms).
    let socket = c.dir.path().join("mute.sock");
    let listener = UnixListener::bind(&socket).expect("bind mute socket");
    let held = std::thread::spawn(move || {
        let mut conns = Vec::new();
        listener.set_nonblocking(true).expect("nonblocking");
        let until = Instant::now() + Duration::from_secs(60);
        while Instant::now() < until && conns.len() < 1000 {
            match listener.accept() {
                Ok((s, _)) => conns.push(s),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    // `--restart never` (+ linger): the Dead incarnation's marks stay readable.
    let (a, b) = c.start_pair(
        &opts(0, "primary", &socket, "1s").restart("never"),
        &opts(1, "shadow", &socket, "1s").restart("never"),
        T,
    );
    let pids = a.wait_engine_pids(1, T);
    assert!(kill(pids[0], Signal::SIGKILL));
    assert!(
        b.wait_phase(Phase::Active, T),
        "shadow not Active{}",
        c.dump_logs()
    );
    let st = a.state().expect("state");
    let (exit, fence) = (
        st.mark(MarkKind::EngineExitDetected).expect("exit mark"),
        st.mark(MarkKind::FenceStarted).expect("fence mark"),
    );
    // The bounded wait: fencing starts about --router-timeout after the exit, not never.
    let waited_ms = (fence - exit) / 1000;
    assert!(
        (250..3000).contains(&waited_ms),
        "fence started {waited_ms} ms after the exit"
    );
    let failures = b
        .metrics()
        .value("supervisor_router_push_failures_total", &[]);
    assert!(failures >= 1.0, "push failures not counted: {failures}");
    assert!(c.violations().is_empty(), "split brain: {}", c.violations());
    drop(a);
    drop(b);
    drop(held);
}
