//! Anchors (issue 15): a lease whose session has an anchor attached is held until the
//! connection AND every holder of the anchor's peer end are gone — across the holder's
//! connection closing and across a lockd restart (the client re-attaches the anchor before it
//! reclaims). Real lockd processes, a real child process holding the anchor.
use crate::common::*;

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockd::client::{anchor_pair, ClientError, ClientOptions, LockClient, LockEvent};
use lockd::proto::{Event, LeaseState, SessionReport, StatusReport};
use lockd::Endpoint;

/// A `sleep` in its own process group that inherits `fd` (the anchor's peer end).
fn child_holding(fd: &OwnedFd) -> Group {
    let raw = fd.as_raw_fd();
    let mut cmd = Command::new("sleep");
    cmd.arg("60").stdin(Stdio::null());
    // SAFETY: only fcntl (async-signal-safe) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let flags = libc::fcntl(raw, libc::F_GETFD);
            if flags < 0 || libc::fcntl(raw, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Group::spawn(&mut cmd)
}

/// Next lock event within `limit` (None on timeout).
async fn next(c: &mut LockClient, limit: Duration) -> Option<LockEvent> {
    tokio::time::timeout(limit, c.next_event())
        .await
        .ok()
        .flatten()
}

/// Wait for a Granted event (skipping others); panics after `limit`.
async fn granted(c: &mut LockClient, limit: Duration, what: &str) -> (u64, bool) {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match next(c, left).await {
            Some(LockEvent::Granted {
                epoch, reclaimed, ..
            }) => return (epoch, reclaimed),
            Some(_) => {}
            None => panic!("no grant for {what} within {limit:?}"),
        }
    }
}

/// The session of `st` that holds `holds`, if any.
fn session_of<'a>(st: &'a StatusReport, holds: &str) -> Option<&'a SessionReport> {
    st.sessions
        .iter()
        .find(|s| s.holds.iter().any(|h| h == holds))
}

/// [`session_of`], panicking (showing the status) when no session holds `holds`.
fn session<'a>(st: &'a StatusReport, holds: &str) -> &'a SessionReport {
    session_of(st, holds).unwrap_or_else(|| panic!("no session holds {holds:?}: {st:?}"))
}

#[tokio::test(flavor = "current_thread")]
async fn an_anchored_lease_outlives_its_connection_and_a_lockd_restart() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let mut l = start_lockd(d.path(), &["--reconnect-window", "3s"]);
    let ep: Endpoint = l.endpoint().parse().unwrap();
    let (keep, inherit) = anchor_pair().unwrap();
    let mut engine = child_holding(&inherit);
    drop(inherit);
    let opts = ClientOptions {
        anchor: Some(Arc::new(keep)),
        label: Some("a".into()),
        ..ClientOptions::default()
    };
    let mut a = LockClient::connect(&ep, opts).await.unwrap();
    a.acquire("engine", "a", true).await.unwrap();
    let (epoch, _) = granted(&mut a, Duration::from_secs(5), "a").await;
    let mut b = LockClient::connect(&ep, ClientOptions::default())
        .await
        .unwrap();
    b.acquire("engine", "b", true).await.unwrap();
    assert!(matches!(
        next(&mut b, Duration::from_secs(5)).await,
        Some(LockEvent::Queued { .. })
    ));

    // lockd restarts: a reconnects, re-attaches its anchor, reclaims.
    l.kill();
    l.restart();
    let (e2, reclaimed) = granted(&mut a, Duration::from_secs(5), "a's reclaim").await;
    assert_eq!((e2, reclaimed), (epoch, true));
    let st = l.status();
    let s = session(&st, "engine");
    assert_eq!(s.anchors, 1, "the anchor was re-attached: {st:?}");
    assert!(s.connected, "{st:?}");

    // The holder's connection closes (its supervisor died); the engine lives on.
    a.close().await;
    let st = wait_for(Duration::from_secs(5), "a's connection gone", || {
        let st = l.status();
        session_of(&st, "engine")
            .is_some_and(|s| !s.connected)
            .then_some(st)
    });
    assert_eq!(resource(&st, "engine").state, LeaseState::Held);
    assert_eq!(resource(&st, "engine").holder.as_deref(), Some("a"));
    // Not granted while the engine lives (500 ms is ~100 grants' time).
    loop {
        match next(&mut b, Duration::from_millis(500)).await {
            Some(LockEvent::Granted { .. }) => panic!("granted while the anchor's holder lives"),
            Some(_) => continue,
            None => break,
        }
    }
    assert!(engine.alive());

    // The engine's last process dies: the lease moves at once.
    let killed = Instant::now();
    engine.kill_group();
    let (eb, _) = granted(&mut b, Duration::from_secs(5), "b").await;
    assert!(eb > epoch);
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(2), "handoff took {took:?}");
    let st = l.status();
    assert!(session(&st, "engine").connected, "{st:?}");
    assert!(l.log_text().contains("anchor closed"), "{}", l.log_text());
}

#[tokio::test(flavor = "current_thread")]
async fn without_an_anchor_the_connection_alone_is_the_lock() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let ep: Endpoint = l.endpoint().parse().unwrap();
    let mut a = LockClient::connect(&ep, ClientOptions::default())
        .await
        .unwrap();
    a.acquire("engine", "a", true).await.unwrap();
    granted(&mut a, Duration::from_secs(5), "a").await;
    let mut b = LockClient::connect(&ep, ClientOptions::default())
        .await
        .unwrap();
    b.acquire("engine", "b", true).await.unwrap();
    a.close().await;
    granted(&mut b, Duration::from_secs(5), "b").await;
}

/// Send `line` with `fd` attached (SCM_RIGHTS) on a raw connection.
fn send_with_fd(c: &Conn, line: &str, fd: i32) {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let fds = [fd];
    let iov = [std::io::IoSlice::new(line.as_bytes())];
    let n = sendmsg::<()>(
        c.w.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .expect("sendmsg");
    assert_eq!(n, line.len());
}

#[tokio::test(flavor = "current_thread")]
async fn bad_anchors_are_refused_and_the_connection_stays() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &["--listen", "tcp:127.0.0.1:0"]);
    // No descriptor.
    let mut c = Conn::connect(l.socket()).unwrap();
    c.send(r#"{"op":"anchor"}"#);
    let e = c.recv_until("error").unwrap();
    assert_eq!(e["code"], "anchor_refused", "{e}");
    assert!(e["message"]
        .as_str()
        .unwrap()
        .contains("no file descriptor"));
    // A pipe is not a socket.
    let (rd, _wr) = nix::unistd::pipe().unwrap();
    send_with_fd(&c, "{\"op\":\"anchor\"}\n", rd.as_raw_fd());
    let e = c.recv_until("error").unwrap();
    assert_eq!(e["code"], "anchor_refused", "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("not a socket"),
        "{e}"
    );
    // A datagram socket cannot signal end-of-file.
    let (dg, _dg2) = nix::sys::socket::socketpair(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::Datagram,
        None,
        nix::sys::socket::SockFlag::empty(),
    )
    .unwrap();
    send_with_fd(&c, "{\"op\":\"anchor\"}\n", dg.as_raw_fd());
    let e = c.recv_until("error").unwrap();
    assert_eq!(e["code"], "anchor_refused", "{e}");
    // The connection is still usable, and a good anchor is then accepted.
    let (good, _peer) = anchor_pair().unwrap();
    send_with_fd(&c, "{\"op\":\"anchor\"}\n", good.as_raw_fd());
    let ok = c.event_until("anchored");
    assert!(matches!(ok, Some(Event::Anchored { anchors: 1 })), "{ok:?}");
    c.send(r#"{"op":"ping"}"#);
    assert!(c.recv_until("pong").is_some());
    // Over TCP: refused.
    let port = tcp_port(&l);
    let mut t = TcpConn::connect(port);
    t.send(r#"{"op":"anchor"}"#);
    let e = t.recv_until("error").unwrap();
    assert_eq!(e["code"], "anchor_refused", "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("unix socket"),
        "{e}"
    );
    // The client library refuses an anchor for a tcp: endpoint up front.
    let (k, _i) = anchor_pair().unwrap();
    let ep: Endpoint = format!("tcp:127.0.0.1:{port}").parse().unwrap();
    let opts = ClientOptions {
        anchor: Some(Arc::new(k)),
        ..ClientOptions::default()
    };
    assert!(matches!(
        LockClient::connect(&ep, opts).await,
        Err(ClientError::AnchorTransport(_))
    ));
}

fn pidfd_open(pid: i32) -> OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: raw syscall with integer arguments; returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    assert!(fd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
    // SAFETY: the kernel just gave us this fd.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

/// A process that inherited nothing (as a worker started with Python's `spawn`, which closes
/// every inherited descriptor) is covered by a process anchor: its pidfd.
#[tokio::test(flavor = "current_thread")]
async fn a_process_anchor_holds_the_lease_until_that_process_exits_across_a_restart() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let mut l = start_lockd(d.path(), &["--reconnect-window", "3s"]);
    let ep: Endpoint = l.endpoint().parse().unwrap();
    let mut worker = Group::spawn(Command::new("sleep").arg("60").stdin(Stdio::null()));
    let mut a = LockClient::connect(&ep, ClientOptions::default())
        .await
        .unwrap();
    a.add_process_anchor(pidfd_open(worker.pid()))
        .await
        .unwrap();
    a.acquire("engine", "a", true).await.unwrap();
    let (epoch, _) = granted(&mut a, Duration::from_secs(5), "a").await;
    // A second process anchor whose process has already exited is attached and closes at once.
    let mut gone = Group::spawn(Command::new("true").stdin(Stdio::null()));
    let gone_fd = pidfd_open(gone.pid()); // unreaped until wait_exit: the pid is still ours
    gone.wait_exit(Duration::from_secs(5));
    a.add_process_anchor(gone_fd).await.unwrap();
    wait_for(
        Duration::from_secs(5),
        "the dead process's anchor to close",
        || l.log_text().contains("process exited").then_some(()),
    );
    assert_eq!(session(&l.status(), "engine").anchors, 1);
    let mut b = LockClient::connect(&ep, ClientOptions::default())
        .await
        .unwrap();
    b.acquire("engine", "b", true).await.unwrap();

    l.kill();
    l.restart();
    let (e2, reclaimed) = granted(&mut a, Duration::from_secs(5), "a's reclaim").await;
    assert_eq!((e2, reclaimed), (epoch, true));
    assert_eq!(session(&l.status(), "engine").anchors, 1);

    a.close().await;
    loop {
        match next(&mut b, Duration::from_millis(500)).await {
            Some(LockEvent::Granted { .. }) => panic!("granted while the anchored process lives"),
            Some(_) => continue,
            None => break,
        }
    }
    assert_eq!(resource(&l.status(), "engine").holder.as_deref(), Some("a"));
    worker.kill_group();
    let (eb, _) = granted(&mut b, Duration::from_secs(5), "b").await;
    assert!(eb > epoch);
}

#[tokio::test(flavor = "current_thread")]
async fn process_anchors_need_a_unix_endpoint() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &["--listen", "tcp:127.0.0.1:0"]);
    let port = tcp_port(&l);
    let ep: Endpoint = format!("tcp:127.0.0.1:{port}").parse().unwrap();
    let mut c = LockClient::connect(&ep, ClientOptions::default())
        .await
        .unwrap();
    let me = pidfd_open(std::process::id() as i32);
    assert!(matches!(
        c.add_process_anchor(me).await,
        Err(ClientError::AnchorTransport(_))
    ));
}
