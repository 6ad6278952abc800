//! Kubelet emulation: a liveness prober per side (consecutive failures against a threshold,
//! a probe every period, SIGTERM then SIGKILL after the grace period), container teardown,
//! and the restart of a dead side as a shadow.
//!
//! [`Prober`] is pure: the counting is the workspace's one model of kubelet's prober worker,
//! [`harness::kubelet::ResultRun`]; [`Prober`] adds the drill's clock (next probe, SIGTERM
//! time). [`Drill::kubelet`] does the I/O.

use std::time::{Duration, Instant};

use harness::kubelet::{ProbeSpec, ResultRun, Verdict};
use nix::sys::signal::Signal;
use probes::Phase;

use super::{Drill, Stage, HTTP_TIMEOUT};
use crate::observe;
use crate::procs;
use crate::DrillArgs;

/// The liveness prober of one container life.
#[derive(Debug, Clone)]
pub(super) struct Prober {
    /// Probe period and failure threshold.
    spec: ProbeSpec,
    /// kubelet's result run (consecutive equal results against the thresholds).
    run: ResultRun,
    /// Next probe.
    next: Instant,
    /// When the threshold was reached (SIGTERM sent); no more probes after it.
    term_sent: Option<Instant>,
}

impl Prober {
    /// A prober whose first probe is one `spec.period` after `now`.
    pub(super) fn new(now: Instant, spec: ProbeSpec) -> Prober {
        Prober {
            spec,
            run: ResultRun::new(spec),
            next: now + spec.period,
            term_sent: None,
        }
    }

    /// A probe is due at `now`.
    pub(super) fn due(&self, now: Instant) -> bool {
        self.term_sent.is_none() && now >= self.next
    }

    /// Records one probe result at `now`; true when this one reached the failure threshold
    /// (the container is to be stopped: SIGTERM).
    pub(super) fn record(&mut self, ok: bool, now: Instant) -> bool {
        self.next = now + self.spec.period;
        if self.run.observe(ok) == Some(Verdict::Failure) && self.term_sent.is_none() {
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

/// The liveness probe of every side: a probe every `--liveness-period`,
/// `--liveness-failures` consecutive failures stop the container (0 counts as kubelet's
/// minimum, 1), one success resets the run.
pub(super) fn liveness_spec(args: &DrillArgs) -> ProbeSpec {
    ProbeSpec {
        period: args.liveness_period,
        failure_threshold: args.liveness_failures.max(1),
        success_threshold: 1,
        ..ProbeSpec::default()
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
                    if i.live.record(ok, Instant::now()) {
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
        let spec = ProbeSpec {
            period,
            failure_threshold: 3,
            ..ProbeSpec::default()
        };
        let mut p = Prober::new(t0, spec);
        assert!(!p.due(t0));
        assert!(p.due(t0 + period));
        let mut t = t0 + period;
        assert!(!p.record(false, t));
        assert!(!p.record(false, t));
        // A success resets the count.
        assert!(!p.record(true, t));
        assert!(!p.due(t));
        for _ in 0..2 {
            t += period;
            assert!(!p.record(false, t));
        }
        t += period;
        assert!(p.record(false, t), "third failure in a row");
        assert!(!p.due(t + period * 10), "no probes after SIGTERM");
        // Even if probed again, SIGTERM is sent once.
        for _ in 0..3 {
            assert!(!p.record(false, t));
        }
        assert!(!p.grace_over(t + Duration::from_secs(5), Duration::from_secs(5)));
        assert!(p.grace_over(t + Duration::from_millis(5001), Duration::from_secs(5)));
    }
}
