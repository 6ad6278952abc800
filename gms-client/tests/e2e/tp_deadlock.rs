//! Decision 5: the tensor-parallel weight-loading deadlock, reproduced with two gmsd
//! processes (two "devices") and two two-rank "engines" (A and B; rank r talks to the
//! gmsd of device r), and shown not to occur with deterministic roles.
//!
//! Each rank does what vLLM's worker does: connect to its device's GMS in `init_device()`
//! (handshake, with a finite timeout as Decision 5's safety net), then wait for the other
//! rank of its engine at the executor barrier, then `load_model()` (write + commit when it
//! holds rw, import when it holds ro). The interleaving is forced to the one Decision 5
//! describes: A0 and B1 connect first, then A1 and B0.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use gms_client::backend::{Access, HostBackend, MemoryBackend};
use gms_client::checks::weight_loading_lock;
use gms_client::load::{pattern_byte, write_one, LoadSpec};
use gms_client::protocol::{GrantedLockType, RequestedLockType};
use tokio::sync::Barrier;

/// The fail-fast GMS timeout of Decision 5's safety net.
const HANDSHAKE: Duration = Duration::from_secs(2);
/// The executor barrier gives up later than the handshakes, so that the ranks waiting for
/// a lock are the first to report (the engines' other ranks hold rw until they give up).
const BARRIER: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq, Eq)]
enum RankOutcome {
    /// Held rw, wrote and committed.
    Loaded,
    /// Held ro, imported and read the committed bytes.
    Imported,
    /// init_device never got its GMS lock (handshake timed out).
    HandshakeTimedOut,
    /// Got its lock but the other rank never reached the executor barrier.
    BarrierTimedOut(GrantedLockType),
}

async fn rank(
    socket: PathBuf,
    lock: RequestedLockType,
    barrier: Arc<Barrier>,
    granted_tx: tokio::sync::oneshot::Sender<()>,
) -> RankOutcome {
    let mut c = client(&socket).await;
    // init_device(): the GMS connection. The orchestrator is told once the handshake is
    // answered, or 50 ms after it was sent if it waits (a grant on an idle local gmsd takes
    // well under a millisecond).
    let mut ready = Some(granted_tx);
    let hs = {
        let hs_fut = c.handshake(lock, Some(HANDSHAKE));
        tokio::pin!(hs_fut);
        tokio::select! {
            r = &mut hs_fut => r,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                if let Some(tx) = ready.take() {
                    let _ = tx.send(());
                }
                hs_fut.await
            }
        }
        .unwrap()
    };
    drop(ready); // answered within 50 ms: the orchestrator sees the channel close
    if !hs.success {
        return RankOutcome::HandshakeTimedOut;
    }
    let granted = hs.granted.unwrap();
    // The executor waits for every worker's init_device() before load_model().
    if tokio::time::timeout(BARRIER, barrier.wait()).await.is_err() {
        return RankOutcome::BarrierTimedOut(granted);
    }
    // load_model()
    match granted {
        GrantedLockType::Rw | GrantedLockType::RwData => {
            let spec = LoadSpec {
                count: 1,
                size: 1 << 20,
                tag: "weights".into(),
                fill: true,
            };
            write_one(&mut c, 0, &spec).await.unwrap();
            assert!(c.commit().await.unwrap());
            RankOutcome::Loaded
        }
        GrantedLockType::Ro => {
            let a = c.list_allocations(None).await.unwrap();
            let (info, fd) = c.export(&a[0].allocation_id).await.unwrap();
            let m = HostBackend
                .import(fd, info.aligned_size, Access::ReadOnly)
                .unwrap();
            assert_eq!(
                m.host_bytes().unwrap()[12345],
                pattern_byte(info.layout_slot, 12345)
            );
            RankOutcome::Imported
        }
    }
}

/// Runs both engines with the given lock per engine; returns outcomes [A0, A1, B0, B1].
async fn run_engines(
    devs: &[PathBuf; 2],
    lock_a: RequestedLockType,
    lock_b: RequestedLockType,
) -> Vec<RankOutcome> {
    let barrier_a = Arc::new(Barrier::new(2));
    let barrier_b = Arc::new(Barrier::new(2));
    let start = |dev: usize, lock, barrier: &Arc<Barrier>| {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let h = tokio::spawn(rank(devs[dev].clone(), lock, barrier.clone(), tx));
        (h, rx)
    };
    // A0 then B1 connect first (the cross-acquire of Decision 5)...
    let (a0, a0_ready) = start(0, lock_a, &barrier_a);
    let _ = a0_ready.await;
    let (b1, b1_ready) = start(1, lock_b, &barrier_b);
    let _ = b1_ready.await;
    // ...then A1 and B0.
    let (a1, _) = start(1, lock_a, &barrier_a);
    let (b0, _) = start(0, lock_b, &barrier_b);
    let mut out = Vec::new();
    for h in [a0, a1, b0, b1] {
        out.push(h.await.unwrap());
    }
    out
}

fn dump_logs_if_unexpected(dir: &std::path::Path, got: &[RankOutcome], want: &[RankOutcome]) {
    if got != want {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "log") {
                eprintln!(
                    "== {:?}\n{}",
                    e.path(),
                    std::fs::read_to_string(e.path()).unwrap_or_default()
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rw_or_ro_everywhere_deadlocks_and_deterministic_roles_do_not() {
    let _process = serial();
    let dir = tempfile::tempdir().unwrap();
    if let Ok(keep) = std::env::var("GMS_TEST_KEEP_LOGS") {
        eprintln!("logs in {:?} (copied to {keep} on exit)", dir.path());
    }
    let run = async {
        // Scenario 1: everyone rw_or_ro → cross-acquired rw locks, circular wait.
        let g0 = Gmsd::start(dir.path(), "dev0.sock");
        let g1 = Gmsd::start(dir.path(), "dev1.sock");
        let devs = [g0.socket.clone(), g1.socket.clone()];
        let t0 = Instant::now();
        let out = run_engines(&devs, RequestedLockType::RwOrRo, RequestedLockType::RwOrRo).await;
        dump_logs_if_unexpected(
            dir.path(),
            &out,
            &[
                RankOutcome::BarrierTimedOut(GrantedLockType::Rw),
                RankOutcome::HandshakeTimedOut,
                RankOutcome::HandshakeTimedOut,
                RankOutcome::BarrierTimedOut(GrantedLockType::Rw),
            ],
        );
        assert_eq!(
            out,
            vec![
                RankOutcome::BarrierTimedOut(GrantedLockType::Rw), // A0: rw on dev0, waits for A1
                RankOutcome::HandshakeTimedOut,                    // A1: waits for B1's commit
                RankOutcome::HandshakeTimedOut,                    // B0: waits for A0's commit
                RankOutcome::BarrierTimedOut(GrantedLockType::Rw), // B1: rw on dev1, waits for B0
            ],
            "deadlock detected by timeouts"
        );
        assert!(t0.elapsed() < BARRIER + Duration::from_secs(5));
        // Nothing was committed anywhere: the writers aborted when they gave up.
        for d in &devs {
            let rs = client(d).await.runtime_state().await.unwrap();
            assert_eq!(rs.state, "EMPTY", "{d:?}");
        }
        drop((g0, g1));

        // Scenario 2: Decision 5's roles (engine 0 rw_or_ro, engine 1 ro), same interleaving.
        let g0 = Gmsd::start(dir.path(), "dev0b.sock");
        let g1 = Gmsd::start(dir.path(), "dev1b.sock");
        let devs = [g0.socket.clone(), g1.socket.clone()];
        let out = run_engines(&devs, weight_loading_lock(0), weight_loading_lock(1)).await;
        assert_eq!(
            out,
            vec![
                RankOutcome::Loaded,   // A0
                RankOutcome::Loaded,   // A1
                RankOutcome::Imported, // B0
                RankOutcome::Imported, // B1
            ],
            "no deadlock with deterministic roles"
        );
        for d in &devs {
            let rs = client(d).await.runtime_state().await.unwrap();
            assert_eq!((rs.state.as_str(), rs.allocation_count), ("COMMITTED", 1));
        }
    };
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("timed out");
}
