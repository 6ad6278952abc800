//! The two clocks a trial reads besides the supervisors' `/state`: when the holder's engine
//! died ([`DeathWatch`], every process polled each millisecond) and when etcd deleted a lock
//! key ([`KeyWatch`], an `etcdctl watch` on the lock prefix, each line stamped as it is read).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use procfs::Pinned;

use crate::procs::now_us;

/// Watches pinned processes until all are dead; the time they were first all seen dead.
pub struct DeathWatch {
    dead_us: Arc<Mutex<Option<u64>>>,
    stop: Arc<AtomicBool>,
}

impl DeathWatch {
    /// Starts polling `pids` every millisecond, for at most `limit`.
    pub fn start(pids: Vec<Pinned>, limit: Duration) -> DeathWatch {
        let dead_us = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s) = (dead_us.clone(), stop.clone());
        std::thread::spawn(move || {
            let end = Instant::now() + limit;
            while !s.load(Ordering::Relaxed) && Instant::now() < end {
                if pids.iter().all(|p| !p.is_alive()) {
                    if let Ok(mut g) = d.lock() {
                        *g = Some(now_us());
                    }
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        DeathWatch { dead_us, stop }
    }

    /// When all were first seen dead (None: not yet).
    pub fn dead_us(&self) -> Option<u64> {
        self.dead_us.lock().ok().and_then(|g| *g)
    }
}

impl Drop for DeathWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// `etcdctl watch --prefix PREFIX`: every DELETE event's key with the time it was read.
pub struct KeyWatch {
    child: Child,
    deletes: Arc<Mutex<Vec<(String, u64)>>>,
    puts: Arc<Mutex<Vec<String>>>,
}

impl KeyWatch {
    /// Starts the watch (`etcdctl` command with endpoints set) and waits until it sees the
    /// marker key `marker` that `put` writes (so that no later event can be missed); None if
    /// it does not within 10 s.
    pub fn start(
        mut etcdctl: Command,
        prefix: &str,
        marker: &str,
        put: impl FnOnce() -> bool,
    ) -> Option<KeyWatch> {
        let mut child = etcdctl
            .args(["watch", "--prefix", prefix])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let out = child.stdout.take()?;
        let deletes: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
        let puts: Arc<Mutex<Vec<String>>> = Arc::default();
        let (d, p) = (deletes.clone(), puts.clone());
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            // Text output: `PUT` / `DELETE`, then the key, then the value (empty for DELETE).
            while let Some(Ok(l)) = lines.next() {
                let at = now_us();
                let kind = l.trim().to_string();
                if kind != "PUT" && kind != "DELETE" {
                    continue;
                }
                let Some(Ok(key)) = lines.next() else { return };
                if kind == "DELETE" {
                    if let Ok(mut g) = d.lock() {
                        g.push((key, at));
                    }
                } else if let Ok(mut g) = p.lock() {
                    g.push(key);
                }
            }
        });
        let mut w = KeyWatch {
            child,
            deletes,
            puts,
        };
        // The watch is established once it reports our own marker.
        std::thread::sleep(Duration::from_millis(50));
        if !put() {
            return None;
        }
        let seen = harness::wait_until(Duration::from_secs(10), Duration::from_millis(5), || {
            w.puts.lock().is_ok_and(|g| g.iter().any(|k| k == marker))
        });
        if !seen {
            let _ = w.child.kill();
            return None;
        }
        Some(w)
    }

    /// When `key` was first seen deleted.
    pub fn deleted_us(&self, key: &str) -> Option<u64> {
        self.deletes
            .lock()
            .ok()?
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, t)| *t)
    }
}

impl Drop for KeyWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
