//! lockd SIGKILLed (and restarted on the same state file) at random points during a run of a
//! few hundred grants: from the clients' own observations, no epoch is ever granted twice and
//! no two clients ever hold the resource at once. lockd runs with a tiny `--compact-after`, so
//! the kills land on journal appends, snapshots and compactions alike.
use crate::common::*;
use lockd::client::{ClientOptions, LockClient, LockEvent};
use lockd::Endpoint;
use rand::Rng;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One lease as a client saw it: [start, end) on this process's monotonic clock.
#[derive(Debug, Clone)]
struct Seen {
    worker: usize,
    epoch: u64,
    start: Instant,
    end: Option<Instant>,
}

const WORKERS: usize = 4;
const TARGET_GRANTS: usize = 250;
const KILLS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_sigkills_never_double_grant_an_epoch_or_overlap_holders() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let lockd = Arc::new(Mutex::new(start_lockd(
        d.path(),
        &["--reconnect-window", "1s", "--compact-after", "1500"],
    )));
    let ep: Endpoint = lockd.lock().unwrap().endpoint().parse().unwrap();
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let grants = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(120);
    // Set while a worker is in a long hold: half of the kills aim at such a moment, so that
    // the holder is still holding when it reconnects and reclaims.
    let long_hold = Arc::new(AtomicBool::new(false));

    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (ep, seen, grants, stop) = (ep.clone(), seen.clone(), grants.clone(), stop.clone());
        let long_hold = long_hold.clone();
        tasks.push(tokio::spawn(async move {
            let opts = ClientOptions {
                connect_timeout: Duration::from_secs(2),
                reconnect_timeout: Duration::from_secs(10),
                label: Some(format!("w{w}")),
                anchor: None,
                watchdog: None,
            };
            let mut c = LockClient::connect(&ep, opts).await.expect("connect");
            let mut mine: Option<usize> = None; // index into `seen` of the lease held
            let mut requested = false; // an acquire is queued
            let mut last_released: Option<u64> = None;
            while !stop.load(Ordering::SeqCst) {
                if mine.is_none() && !requested {
                    c.acquire("r", &format!("w{w}"), true).await.unwrap();
                    requested = true;
                }
                // Wait for our grant (or handle events while holding).
                let ev = match tokio::time::timeout(Duration::from_millis(5), c.next_event()).await
                {
                    Ok(Some(ev)) => Some(ev),
                    Ok(None) => panic!("client closed"),
                    Err(_) => None,
                };
                match ev {
                    Some(LockEvent::Granted {
                        epoch,
                        reclaimed: false,
                        ..
                    }) => {
                        assert!(mine.is_none(), "w{w}: new grant while holding");
                        let mut s = seen.lock().unwrap();
                        s.push(Seen {
                            worker: w,
                            epoch,
                            start: Instant::now(),
                            end: None,
                        });
                        mine = Some(s.len() - 1);
                        requested = false;
                        grants.fetch_add(1, Ordering::SeqCst);
                    }
                    Some(LockEvent::Granted {
                        epoch,
                        reclaimed: true,
                        ..
                    }) => {
                        let s = seen.lock().unwrap();
                        match mine {
                            Some(i) => {
                                assert_eq!(s[i].epoch, epoch, "reclaim must return the same epoch")
                            }
                            // In flight while we released it: must be the lease we just gave up.
                            None => assert_eq!(
                                last_released,
                                Some(epoch),
                                "w{w}: reclaim of a lease never held"
                            ),
                        }
                    }
                    Some(LockEvent::Lost { epoch, .. }) => {
                        let mut s = seen.lock().unwrap();
                        let i = mine.take().expect("lost a lease we do not hold");
                        assert_eq!(s[i].epoch, epoch);
                        s[i].end = Some(Instant::now());
                    }
                    Some(LockEvent::Error { code, message }) => {
                        panic!("w{w}: error {code}: {message}")
                    }
                    _ => {}
                }
                if let Some(i) = mine {
                    // Hold a little, then release; we stop holding the moment we decide to.
                    // Mostly short holds; some long ones, so that kills hit held leases.
                    let long = rand::thread_rng().gen_bool(0.1);
                    let us = if long {
                        rand::thread_rng().gen_range(150_000..300_000)
                    } else {
                        rand::thread_rng().gen_range(0..1500)
                    };
                    if long {
                        long_hold.store(true, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_micros(us)).await;
                    long_hold.store(false, Ordering::SeqCst);
                    {
                        let mut s = seen.lock().unwrap();
                        s[i].end = Some(Instant::now());
                        last_released = Some(s[i].epoch);
                    }
                    mine = None;
                    c.release("r").await.unwrap();
                }
            }
            c.close().await;
        }));
    }

    // The killer: SIGKILL lockd at random points, restart it on the same state file.
    let killer = {
        let (lockd, grants, stop, long_hold) = (
            lockd.clone(),
            grants.clone(),
            stop.clone(),
            long_hold.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let mut kills = 0;
            let mut rng = rand::thread_rng();
            while (grants.load(Ordering::SeqCst) < TARGET_GRANTS || kills < KILLS)
                && Instant::now() < deadline
            {
                if kills == KILLS {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                // Let a random number of grants happen, then kill at a random moment.
                let at = grants.load(Ordering::SeqCst) + rng.gen_range(3..15);
                while grants.load(Ordering::SeqCst) < at && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                if kills % 2 == 0 {
                    while !long_hold.load(Ordering::SeqCst) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                std::thread::sleep(Duration::from_micros(rng.gen_range(0..20_000)));
                let mut l = lockd.lock().unwrap();
                l.kill();
                std::thread::sleep(Duration::from_millis(rng.gen_range(0..30)));
                l.restart();
                kills += 1;
            }
            stop.store(true, Ordering::SeqCst);
            kills
        })
    };
    let kills = killer.await.unwrap();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("worker stuck")
            .unwrap();
    }

    let mut s = seen.lock().unwrap().clone();
    assert!(s.len() >= TARGET_GRANTS, "only {} grants in time", s.len());
    assert_eq!(kills, KILLS);
    // No epoch granted twice.
    let mut epochs: Vec<u64> = s.iter().map(|x| x.epoch).collect();
    epochs.sort_unstable();
    let n = epochs.len();
    epochs.dedup();
    assert_eq!(epochs.len(), n, "an epoch was granted twice");
    // Never two holders at once, and epochs increase in grant order.
    s.sort_by_key(|x| x.start);
    for pair in s.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        let a_end = a.end.expect("lease never ended");
        assert!(
            a_end <= b.start,
            "overlap: w{} epoch {} still held when w{} got epoch {}",
            a.worker,
            a.epoch,
            b.worker,
            b.epoch
        );
        assert!(
            b.epoch > a.epoch,
            "epoch went backwards: {} then {}",
            a.epoch,
            b.epoch
        );
    }
    let st = lockd.lock().unwrap().status();
    assert!(st.counters.reclaims > 0, "no kill hit a held lease: {st:?}");
    let log = lockd.lock().unwrap().log_text();
    let compactions = log.matches("journal compacted").count();
    assert!(compactions >= KILLS, "only {compactions} compactions");
    eprintln!(
        "grants observed: {}, kills: {kills}, counters: {:?}, compactions: {compactions}, \
         torn journal lines cut: {}",
        s.len(),
        st.counters,
        log.matches("cutting a torn last journal line").count()
    );
    if std::env::var("CHAOS_KEEP").is_ok() {
        let p = d.keep();
        eprintln!("kept {}", p.display());
    }
}
