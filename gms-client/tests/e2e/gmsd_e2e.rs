//! Real `gmsd` processes, real sockets, real fds (host backend).

use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use gms_client::backend::{Access, HostBackend, MemoryBackend};
use gms_client::load::{pattern_byte, tensor_key, write_one, LoadSpec};
use gms_client::protocol::{GrantedLockType, Message, RequestedLockType};

const LIMIT: Duration = Duration::from_secs(60);

fn spec(count: u64, size: u64) -> LoadSpec {
    LoadSpec {
        count,
        size,
        tag: "weights".into(),
        fill: true,
    }
}

#[derive(Debug)]
enum Raced {
    Loaded {
        committed_at: Instant,
        ids: Vec<String>,
    },
    Imported {
        granted_at: Instant,
        ids: Vec<String>,
        verified_bytes: usize,
    },
}

async fn race_participant(socket: std::path::PathBuf) -> Raced {
    let mut c = client(&socket).await;
    let hs = c
        .handshake(RequestedLockType::RwOrRo, Some(Duration::from_secs(20)))
        .await
        .unwrap();
    assert!(hs.success);
    match hs.granted {
        Some(GrantedLockType::Rw) => {
            let mut ids = Vec::new();
            for i in 0..3 {
                ids.push(
                    write_one(&mut c, i, &spec(3, 3 << 20))
                        .await
                        .unwrap()
                        .allocation_id,
                );
            }
            // Give the other participant time to queue behind us.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let committed_at = Instant::now();
            assert!(c.commit().await.unwrap());
            Raced::Loaded { committed_at, ids }
        }
        Some(GrantedLockType::Ro) => {
            let granted_at = Instant::now();
            assert!(hs.committed);
            let allocs = c.list_allocations(None).await.unwrap();
            let mut verified = 0;
            for l in &allocs {
                let (info, fd) = c.export(&l.allocation_id).await.unwrap();
                let m = HostBackend
                    .import(fd, info.aligned_size, Access::ReadOnly)
                    .unwrap();
                let bytes = m.host_bytes().unwrap();
                for off in 0..(3u64 << 20) {
                    assert_eq!(bytes[off as usize], pattern_byte(info.layout_slot, off));
                }
                verified += 3 << 20;
                // A reader's fd is read-only: it cannot be mapped for writing.
                let (info, fd) = c.export(&l.allocation_id).await.unwrap();
                assert!(HostBackend::map(&fd, info.aligned_size, Access::ReadWrite).is_err());
            }
            let meta = c.metadata_get(&tensor_key(1)).await.unwrap().unwrap();
            assert_eq!(meta.allocation_id, allocs[1].allocation_id);
            Raced::Imported {
                granted_at,
                ids: allocs.into_iter().map(|a| a.allocation_id).collect(),
                verified_bytes: verified,
            }
        }
        other => panic!("unexpected grant {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_rw_or_ro_clients_race_one_loads_other_imports_same_bytes() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let run = async {
        let a = tokio::spawn(race_participant(g.socket.clone()));
        let b = tokio::spawn(race_participant(g.socket.clone()));
        let (a, b) = (a.await.unwrap(), b.await.unwrap());
        let (loaded, imported) = match (a, b) {
            (l @ Raced::Loaded { .. }, i @ Raced::Imported { .. }) => (l, i),
            (i @ Raced::Imported { .. }, l @ Raced::Loaded { .. }) => (l, i),
            other => panic!("expected one loader and one importer, got {other:?}"),
        };
        let (
            Raced::Loaded {
                committed_at,
                ids: wids,
            },
            Raced::Imported {
                granted_at,
                ids: rids,
                verified_bytes,
            },
        ) = (loaded, imported)
        else {
            unreachable!()
        };
        assert!(
            granted_at >= committed_at,
            "reader admitted only after the commit"
        );
        assert_eq!(wids, rids, "reader imported the writer's allocations");
        assert_eq!(verified_bytes, 3 * (3 << 20));
    };
    tokio::time::timeout(LIMIT, run)
        .await
        .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_sigkilled_before_commit_aborts_and_next_rw_or_ro_gets_rw() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let sock = g.socket.to_str().unwrap().to_string();
    // A writer process that allocates and then hangs before commit.
    let mut writer = Proc::spawn(
        Command::new(GMSCTL)
            .args([
                "load", "--socket", &sock, "--count", "3", "--size", "1000000",
            ])
            .args(["--lock", "rw_or_ro", "--hold", "1h"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let mut out = std::io::BufReader::new(writer.child.stdout.take().unwrap());
    let line = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let mut l = String::new();
        out.read_line(&mut l).map(|_| l)
    });
    let line = tokio::time::timeout(LIMIT, line)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(line.contains("allocated"), "writer said {line:?}");
    let run = async {
        let mut c = client(&g.socket).await;
        let rs = c.runtime_state().await.unwrap();
        assert_eq!((rs.state.as_str(), rs.allocation_count), ("RW", 3));
        writer.kill9();
        // Bounded wait for the abort.
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let rs = c.runtime_state().await.unwrap();
            if rs.state == "EMPTY" {
                assert_eq!(rs.allocation_count, 0, "allocations gone");
                assert!(!rs.committed);
                break;
            }
            assert!(Instant::now() < end, "state still {}", rs.state);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let kinds: Vec<String> = c
            .event_history()
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect();
        assert_eq!(
            kinds,
            vec!["rw_connected", "rw_aborted", "allocations_cleared"]
        );
        // The next rw_or_ro client gets rw.
        let mut n = client(&g.socket).await;
        let hs = n
            .handshake(RequestedLockType::RwOrRo, Some(Duration::from_secs(5)))
            .await
            .unwrap();
        assert_eq!(hs.granted, Some(GrantedLockType::Rw));
    };
    tokio::time::timeout(LIMIT, run)
        .await
        .expect("test timed out");
}

async fn committed_store(g: &Gmsd, count: u64) -> String {
    let mut w = client(&g.socket).await;
    let hs = w
        .handshake(RequestedLockType::Rw, Some(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(hs.success);
    for i in 0..count {
        write_one(&mut w, i, &spec(count, 1 << 20)).await.unwrap();
    }
    assert!(w.commit().await.unwrap());
    assert!(
        w.wait_closed(Duration::from_secs(5)).await,
        "commit ends the session"
    );
    client(&g.socket)
        .await
        .runtime_state()
        .await
        .unwrap()
        .memory_layout_hash
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_writer_blocks_new_readers() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let run = async {
        committed_store(&g, 2).await;
        let mut r1 = reader(&g.socket).await;
        let mut w = client(&g.socket).await;
        let writer = tokio::spawn(async move {
            let hs = w
                .handshake(RequestedLockType::Rw, Some(Duration::from_secs(20)))
                .await
                .unwrap();
            (w, hs, Instant::now())
        });
        // Wait (bounded) until the server counts the waiting writer.
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let ls = r1.lock_state().await.unwrap();
            if ls.waiting_writers == 1 {
                assert_eq!(ls.state, "RO");
                break;
            }
            assert!(Instant::now() < end);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A new reader is refused although contents are committed.
        let mut r2 = client(&g.socket).await;
        let t0 = Instant::now();
        let hs = r2
            .handshake(RequestedLockType::Ro, Some(Duration::from_millis(300)))
            .await
            .unwrap();
        assert!(!hs.success, "writer priority: new reader must wait");
        assert!(hs.committed);
        assert!(t0.elapsed() >= Duration::from_millis(290));
        assert!(
            r2.wait_closed(Duration::from_secs(5)).await,
            "denied session is closed"
        );
        // The first reader leaves: the writer gets in.
        let released = Instant::now();
        drop(r1);
        let (_w, hs, at) = writer.await.unwrap();
        assert!(hs.success);
        assert_eq!(hs.granted, Some(GrantedLockType::Rw));
        assert!(at >= released);
    };
    tokio::time::timeout(LIMIT, run)
        .await
        .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_timeout_answers_success_false() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let run = async {
        let mut c = client(&g.socket).await;
        let t0 = Instant::now();
        let hs = c
            .handshake(RequestedLockType::Ro, Some(Duration::from_millis(250)))
            .await
            .unwrap();
        let took = t0.elapsed();
        assert!(!hs.success);
        assert!(!hs.committed);
        assert_eq!(hs.granted, None);
        assert!(
            took >= Duration::from_millis(240) && took < Duration::from_secs(3),
            "{took:?}"
        );
        // Diagnostics still work on a fresh connection, and nothing is left waiting.
        let ls = client(&g.socket).await.runtime_state().await.unwrap();
        assert_eq!(ls.waiting_writers, 0);
        assert_eq!(ls.state, "EMPTY");
    };
    tokio::time::timeout(LIMIT, run)
        .await
        .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rpcs_need_the_right_lock_and_hostile_bytes_do_not_hurt_the_server() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let run = async {
        // Before a handshake: diagnostics answered, anything else refused and closed.
        let mut c = client(&g.socket).await;
        assert_eq!(c.runtime_state().await.unwrap().state, "EMPTY");
        assert!(c.event_history().await.unwrap().is_empty());
        let e = c.list_allocations(None).await.unwrap_err();
        assert!(e.to_string().contains("expected handshake_request"), "{e}");
        // Readers cannot write.
        committed_store(&g, 1).await;
        let mut r = reader(&g.socket).await;
        let e = r.allocate(10, "x").await.unwrap_err();
        assert!(
            matches!(e, gms_client::client::ClientError::Server { code: 403, .. }),
            "{e}"
        );
        let e = r.export("no-such-id").await.unwrap_err();
        assert!(
            matches!(e, gms_client::client::ClientError::Server { code: 404, .. }),
            "{e}"
        );
        drop(r);
        // Garbage body: error_response 400, connection closed, server alive.
        let mut h = client(&g.socket).await;
        let mut frame = 3u32.to_be_bytes().to_vec();
        frame.extend([0xc1, 0x00, 0x00]);
        h.send_raw(&frame).await.unwrap();
        let e = h.recv_raw(Duration::from_secs(5)).await.unwrap_err();
        assert!(
            matches!(e, gms_client::client::ClientError::Server { code: 400, .. }),
            "{e}"
        );
        assert!(h.wait_closed(Duration::from_secs(5)).await);
        // Oversized length header: refused from the header alone, then the connection closes.
        let mut h = client(&g.socket).await;
        h.send_raw(&u32::MAX.to_be_bytes()).await.unwrap();
        let e = h.recv_raw(Duration::from_secs(5)).await.unwrap_err();
        assert!(e.to_string().contains("exceeds the limit"), "{e}");
        assert!(h.wait_closed(Duration::from_secs(5)).await);
        // Still serving.
        let rs = client(&g.socket).await.runtime_state().await.unwrap();
        assert_eq!(rs.state, "COMMITTED");
        // A raw encoded message with unknown extra keys is accepted by the server.
        let mut h = client(&g.socket).await;
        let body = Message::GetRuntimeStateRequest.encode();
        let mut patched = vec![0x82];
        patched.extend(&body[1..]);
        patched.extend([0xa1, b'z', 0x01]);
        let mut frame = (patched.len() as u32).to_be_bytes().to_vec();
        frame.extend(patched);
        h.send_raw(&frame).await.unwrap();
        assert!(matches!(
            h.recv_raw(Duration::from_secs(5)).await.unwrap(),
            Message::GetRuntimeStateResponse(_)
        ));
    };
    tokio::time::timeout(LIMIT, run)
        .await
        .expect("test timed out");
}

#[test]
fn gmsd_refuses_live_socket_and_replaces_stale_one() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("gms.sock");
    // A stale socket file: bound once, nobody listening now.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let g = Gmsd::start_at(&sock);
    // A second server on the live socket refuses to start.
    let mut second = Proc::spawn(
        Command::new(GMSD)
            .arg("--socket")
            .arg(&sock)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let status = second
        .wait_timeout(Duration::from_secs(10))
        .expect("second gmsd exits");
    assert_eq!(status.code(), Some(1));
    let mut err = String::new();
    use std::io::Read;
    second
        .child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(err.contains("already running"), "{err}");
    // The first still serves; SIGTERM stops it cleanly and removes the socket.
    assert!(std::os::unix::net::UnixStream::connect(&sock).is_ok());
    let mut g = g;
    assert!(g.signal(nix::sys::signal::Signal::SIGTERM), "gmsd runs");
    let st = g
        .wait_exit(Duration::from_secs(10))
        .expect("gmsd stops on SIGTERM");
    assert_eq!(st.code(), Some(0));
    assert!(!sock.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_gives_a_fresh_fd_each_time_and_memory_outlives_the_session() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let run = async {
        committed_store(&g, 1).await;
        let mut r = reader(&g.socket).await;
        let id = r.list_allocations(None).await.unwrap()[0]
            .allocation_id
            .clone();
        let (info, fd1) = r.export(&id).await.unwrap();
        let (_, fd2) = r.export(&id).await.unwrap();
        assert_ne!(fd1.as_raw_fd(), fd2.as_raw_fd());
        let m = HostBackend
            .import(fd1, info.aligned_size, Access::ReadOnly)
            .unwrap();
        drop(fd2);
        // Close the session: the mapping still reads the same bytes.
        drop(r);
        assert_eq!(
            m.host_bytes().unwrap()[7],
            pattern_byte(info.layout_slot, 7)
        );
    };
    tokio::time::timeout(LIMIT, run)
        .await
        .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_that_disconnects_stops_blocking_readers() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let run = async {
        committed_store(&g, 1).await;
        let mut r1 = reader(&g.socket).await;
        let mut w = client(&g.socket).await;
        let writer = tokio::spawn(async move {
            let _ = w.handshake(RequestedLockType::Rw, None).await;
        });
        let end = Instant::now() + Duration::from_secs(10);
        while r1.lock_state().await.unwrap().waiting_writers != 1 {
            assert!(Instant::now() < end);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The waiting writer goes away (its task, and so its connection, is dropped).
        writer.abort();
        let _ = writer.await;
        let end = Instant::now() + Duration::from_secs(10);
        while r1.lock_state().await.unwrap().waiting_writers != 0 {
            assert!(Instant::now() < end, "server still counts the gone writer");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut r2 = client(&g.socket).await;
        let hs = r2
            .handshake(RequestedLockType::Ro, Some(Duration::from_secs(2)))
            .await
            .unwrap();
        assert!(hs.success);
        assert_eq!(r1.lock_state().await.unwrap().ro_session_count, 2);
    };
    tokio::time::timeout(LIMIT, run)
        .await
        .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_paths_are_guarded_where_no_driver_is_present() {
    let _process = shared();
    let present = gms_client::backend::cuda::driver_present();
    let dir = tempfile::tempdir().unwrap();
    if present {
        // A GPU machine: the cuda backend must at least initialise.
        assert!(gms_client::backend::cuda::CudaRuntime::init(0).is_ok());
        return;
    }
    // gmsd --backend cuda refuses to start, names the cause, leaves no socket behind.
    let sock = dir.path().join("cuda.sock");
    let mut p = Proc::spawn(
        Command::new(GMSD)
            .args(["--backend", "cuda", "--socket"])
            .arg(&sock)
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let st = p.wait_timeout(Duration::from_secs(10)).expect("gmsd exits");
    assert_eq!(st.code(), Some(1));
    let mut err = String::new();
    use std::io::Read;
    p.child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(err.contains("no CUDA driver"), "{err}");
    assert!(!sock.exists());
    // gmsctl verify --backend cuda on a good store: "backend unavailable", exit 11.
    let g = Gmsd::start(dir.path(), "gms.sock");
    committed_store(&g, 1).await;
    let s = g.socket.to_str().unwrap().to_string();
    let (code, out, _) = tokio::task::spawn_blocking(move || {
        gmsctl(&["verify", "--socket", &s, "--backend", "cuda"])
    })
    .await
    .unwrap();
    assert_eq!(code, 11, "{out}");
    assert!(out.contains("backend_unavailable"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_handshake_timeouts_do_not_break_the_server() {
    let _process = shared();
    let dir = tempfile::tempdir().unwrap();
    let g = Gmsd::start(dir.path(), "gms.sock");
    let run = async {
        // timeout_ms = u64::MAX on an empty store: the waiter just waits; then it leaves.
        let mut c = client(&g.socket).await;
        let frame = Message::HandshakeRequest {
            lock_type: RequestedLockType::Ro,
            timeout_ms: Some(u64::MAX),
        }
        .encode_frame();
        c.send_raw(&frame).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(c);
        // The server is alive and nobody is left waiting: a writer gets in at once.
        let mut w = client(&g.socket).await;
        let hs = w
            .handshake(RequestedLockType::Rw, Some(Duration::from_secs(2)))
            .await
            .unwrap();
        assert!(hs.success);
    };
    tokio::time::timeout(LIMIT, run)
        .await
        .expect("test timed out");
}
