//! One test with processes at a time.
//!
//! The end-to-end tests are threads of one test binary on a small (2-core) machine. Every test
//! that starts processes takes [`serial`] first, so that they run one at a time as they did
//! when each file was its own binary: they measure time, and some of them act on every child
//! of the test process (the drill's leftover reaper, the in-process supervisor's fencing).
//! Pure tests need not take it.

use std::cell::Cell;
use std::sync::{Mutex, MutexGuard};

static SERIAL: Mutex<()> = Mutex::new(());

thread_local! {
    /// Whether this thread holds the guard (taking it twice would deadlock).
    static HELD: Cell<bool> = const { Cell::new(false) };
}

/// The guard of [`serial`]; the next process-starting test runs once it is dropped.
#[derive(Debug)]
pub struct Serial {
    /// The process-wide lock.
    _guard: MutexGuard<'static, ()>,
}

impl Drop for Serial {
    fn drop(&mut self) {
        HELD.with(|h| h.set(false));
    }
}

/// Takes the process-wide guard for a test that starts processes. A test that panicked while
/// holding it does not poison the others: the guard survives poisoning. Panics (instead of
/// deadlocking) if this thread already holds it.
pub fn serial() -> Serial {
    assert!(
        !HELD.with(Cell::get),
        "harness::serial() taken twice by one test (it is not re-entrant)"
    );
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    HELD.with(|h| h.set(true));
    Serial { _guard: guard }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survives_a_panic_while_held() {
        let _ = std::thread::spawn(|| {
            let _g = serial();
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
        // The first guard was released by the unwinding: the lock is free again.
        drop(serial());
    }
}
