//! One process-starting test at a time, or many that do not mind each other.
//!
//! The end-to-end tests are threads of one test binary on a small (2-core) machine. One
//! process-wide `RwLock`:
//!
//! * [`serial`] (exclusive): tests that measure time or CPU, act on every child of the test
//!   process (the drill's leftover reaper, the in-process supervisor's fencing), or hold
//!   descriptors without `FD_CLOEXEC` that a concurrently spawned process must not inherit.
//!   They run alone, as they did when each file was its own binary.
//! * [`shared`]: tests that start processes but do none of the above; they run in parallel
//!   with each other, never with a [`serial`] one.
//!
//! Pure tests need neither. Both guards survive poisoning (a failed test does not fail the
//! others) and panic instead of deadlocking when one thread takes a second guard.

use std::cell::Cell;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static PROCESS: RwLock<()> = RwLock::new(());

thread_local! {
    /// Whether this thread holds a guard (taking a second one could deadlock).
    static HELD: Cell<bool> = const { Cell::new(false) };
}

/// The guard of [`serial`]; the next process-starting test runs once it is dropped.
#[derive(Debug)]
pub struct Serial {
    /// The process-wide lock, exclusively.
    _guard: RwLockWriteGuard<'static, ()>,
}

impl Drop for Serial {
    fn drop(&mut self) {
        HELD.with(|h| h.set(false));
    }
}

/// The guard of [`shared`]; a [`serial`] test waits until every one is dropped.
#[derive(Debug)]
pub struct Shared {
    /// The process-wide lock, shared.
    _guard: RwLockReadGuard<'static, ()>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        HELD.with(|h| h.set(false));
    }
}

fn not_held(what: &str) {
    assert!(
        !HELD.with(Cell::get),
        "harness::{what}() taken while this test already holds a process guard (they are not re-entrant)"
    );
}

/// Takes the process-wide guard exclusively, for a test that must run alone.
pub fn serial() -> Serial {
    not_held("serial");
    let guard = PROCESS.write().unwrap_or_else(|e| e.into_inner());
    HELD.with(|h| h.set(true));
    Serial { _guard: guard }
}

/// Takes the process-wide guard shared, for a test that starts processes and may run in
/// parallel with other [`shared`] ones.
pub fn shared() -> Shared {
    not_held("shared");
    let guard = PROCESS.read().unwrap_or_else(|e| e.into_inner());
    HELD.with(|h| h.set(true));
    Shared { _guard: guard }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn survives_a_panic_while_held() {
        let _ = std::thread::spawn(|| {
            let _g = serial();
            panic!("test failed while holding the guard");
        })
        .join();
        let _ = std::thread::spawn(|| {
            let _g = shared();
            panic!("test failed while holding the guard");
        })
        .join();
        drop(serial());
    }

    #[test]
    fn taking_it_twice_in_one_thread_panics_instead_of_deadlocking() {
        let r = std::thread::spawn(|| {
            let _g = serial();
            let _h = serial();
        })
        .join();
        assert!(r.is_err());
        let r = std::thread::spawn(|| {
            let _g = shared();
            let _h = serial();
        })
        .join();
        assert!(r.is_err());
        // The first guards were released by the unwinding: the lock is free again.
        drop(serial());
    }

    #[test]
    fn serial_waits_for_a_shared_guard() {
        let a = shared();
        let (tx, rx) = mpsc::channel();
        let t = std::thread::spawn(move || {
            let _s = serial();
            tx.send(()).unwrap();
        });
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        drop(a);
        rx.recv_timeout(Duration::from_secs(10))
            .expect("serial once the shared guard is gone");
        t.join().unwrap();
    }
}
