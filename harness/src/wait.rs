//! Bounded polling.

use std::time::{Duration, Instant};

/// Poll `f` every `every` until it returns true or `timeout` passes; `f` runs at least once,
/// and once more at the deadline. Returns whether it held.
pub fn wait_until(timeout: Duration, every: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// Checks `f` every `every` for the whole of `period`; panics with `what` and the offending
/// value at the first sample where `f` returns `Err`. For "stays so" assertions (a shadow that
/// must stay in Standby, a holder that must not change): at least one sample is always taken.
pub fn holds_for<E: std::fmt::Display>(
    period: Duration,
    every: Duration,
    what: &str,
    mut f: impl FnMut() -> Result<(), E>,
) {
    let end = Instant::now() + period;
    let mut samples = 0u32;
    loop {
        if let Err(e) = f() {
            panic!("{what}: broken after {samples} good samples: {e}");
        }
        samples += 1;
        if Instant::now() >= end {
            return;
        }
        std::thread::sleep(every);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_until_is_bounded_and_reports() {
        let t0 = Instant::now();
        assert!(!wait_until(
            Duration::from_millis(50),
            Duration::from_millis(5),
            || false
        ));
        assert!(t0.elapsed() >= Duration::from_millis(50));
        let mut n = 0;
        assert!(wait_until(
            Duration::from_secs(5),
            Duration::from_millis(1),
            || {
                n += 1;
                n == 3
            }
        ));
    }

    #[test]
    fn holds_for_samples_at_least_once_and_panics_on_a_break() {
        let mut n = 0;
        holds_for(Duration::ZERO, Duration::from_millis(1), "x", || {
            n += 1;
            Ok::<(), String>(())
        });
        assert_eq!(n, 1);
        let r = std::panic::catch_unwind(|| {
            let mut k = 0;
            holds_for(
                Duration::from_secs(5),
                Duration::from_millis(1),
                "k < 3",
                || {
                    k += 1;
                    if k < 3 {
                        Ok(())
                    } else {
                        Err(k)
                    }
                },
            )
        });
        assert!(r.is_err());
    }
}
