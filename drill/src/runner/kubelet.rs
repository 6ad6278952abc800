//! Kubelet emulation: a liveness prober per side (consecutive failures against a threshold,
//! a probe every period, SIGTERM then SIGKILL after the grace period), container teardown,
//! and the restart of a dead side as a shadow.
//!
//! [`Prober`] is pure (the counting kubelet's prober worker does); [`Drill::kubelet`] does the
//! I/O. Kept apart so that the counting can move to a shared kubelet prober
//! (`harness::kubelet`) later.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use probes::Phase;

use super::{Drill, Stage, HTTP_TIMEOUT};
use crate::observe;
use crate::procs;

/// The liveness prober of one container life.
#[derive(Debug, Clone)]
pub(super) struct Prober {
    /// Consecutive failures.
    failures: u32,
    /// Next probe.
    next: Instant,
    /// When the threshold was reached (SIGTERM sent); no more probes after it.
    term_sent: Option<Instant>,
}

impl Prober {
    /// A prober whose first probe is one `period` after `now`.
    pub(super) fn new(now: Instant, period: Duration) -> Prober {
        Prober {
            failures: 0,
            next: now + period,
            term_sent: None,
        }
    }

    /// A probe is due at `now`.
    pub(super) fn due(&self, now: Instant) -> bool {
        self.term_sent.is_none() && now >= self.next
    }

    /// Records one probe result at `now`; true when this one reached `threshold` consecutive
    /// failures (the container is to be stopped: SIGTERM).
    pub(super) fn record(
        &mut self,
        ok: bool,
        now: Instant,
        period: Duration,
        threshold: u32,
    ) -> bool {
        self.next = now + period;
        self.failures = if ok { 0 } else { self.failures + 1 };
        if self.failures >= threshold && self.term_sent.is_none() {
            self.term_sent = Some(now);
            return true;
        }
        false
    }

    /// SIGTERM was sent more than `grace` before `now` (SIGKILL time).
    pub(super) fn grace_over(&self, now: Instant, grace: Duration) -> bool {
        self.term_sent
            .is_some_and(|t| now.saturating_duration_since(t) > grace)
    }
}

impl Drill {
    /// One kubelet step for both sides: liveness probes, SIGTERM then SIGKILL after the
    /// grace period, container teardown and restart as a shadow.
    pub(super) async fn kubelet(&mut self) {
        for side in 0..2 {
            // Liveness probe.
            let (due, addr, started) = match self.sides[side].as_ref() {
                Some(i) if i.exited.is_none() => (
                    i.live.due(Instant::now()),
                    i.probes,
                    i.phase().is_some_and(|p| p != Phase::Init),
                ),
                _ => (false, ([127, 0, 0, 1], 0).into(), false),
            };
            if due && started {
                let ok = observe::http_get(addr, "/live", HTTP_TIMEOUT)
                    .await
                    .is_ok_and(|r| r.status == 200);
                if let Some(i) = self.sides[side].as_mut() {
                    let (period, threshold) =
                        (self.args.liveness_period, self.args.liveness_failures);
                    if i.live.record(ok, Instant::now(), period, threshold) {
                        tracing::info!(
                            engine_id = i.engine_id,
                            incarnation = i.n,
                            "drill: liveness failed, SIGTERM (kubelet)"
                        );
                        procs::signal_pid(i.sup_pid, Signal::SIGTERM);
                    }
                }
            }
            // Grace period over: SIGKILL the container.
            if let Some(i) = self.sides[side].as_mut() {
                if i.exited.is_none()
                    && i.live
                        .grace_over(Instant::now(), self.args.termination_grace)
                {
                    i.teardown();
                }
            }
            // Exited: tear down what is left (the container is gone), restart as shadow. A
            // supervisor the drill SIGKILLed leaves its container to the runtime, which takes
            // `--teardown-delay` to kill the rest.
            let delay = self.args.teardown_delay;
            let exited = self.sides[side].as_ref().is_some_and(|i| {
                i.exited.is_some() && i.sigkilled_at.is_none_or(|t| t.elapsed() >= delay)
            });
            if exited {
                let Some(mut inc) = self.sides[side].take() else {
                    continue;
                };
                let left = inc.teardown();
                if left > 0 {
                    tracing::info!(engine_id = inc.engine_id, incarnation = inc.n, left, "drill: engine processes outlived the supervisor; killed (container teardown)");
                }
                self.retired.push(inc);
                if self.stage != Stage::Stopping {
                    let cfg = self.restart_config(side);
                    if let Err(e) = self.start_side(side, "shadow", cfg) {
                        self.say(&format!("drill: cannot restart engine {side}: {e:#}"));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_consecutive_failures_stop_the_container_once() {
        let t0 = Instant::now();
        let period = Duration::from_millis(250);
        let mut p = Prober::new(t0, period);
        assert!(!p.due(t0));
        assert!(p.due(t0 + period));
        let mut t = t0 + period;
        assert!(!p.record(false, t, period, 3));
        assert!(!p.record(false, t, period, 3));
        // A success resets the count.
        assert!(!p.record(true, t, period, 3));
        assert!(!p.due(t));
        for _ in 0..2 {
            t += period;
            assert!(!p.record(false, t, period, 3));
        }
        t += period;
        assert!(p.record(false, t, period, 3), "third failure in a row");
        assert!(!p.due(t + period * 10), "no probes after SIGTERM");
        assert!(!p.grace_over(t + Duration::from_secs(5), Duration::from_secs(5)));
        assert!(p.grace_over(t + Duration::from_millis(5001), Duration::from_secs(5)));
    }
}
