//! A pure model of kubelet's prober worker (kubernetes `pkg/kubelet/prober/worker.go`), for
//! replays of a chart's probe settings against real processes (the kubelet replay test) and
//! for the drill.
//!
//! What kubelet does, per probe kind (startup, liveness, readiness) and container:
//!
//! * one worker on its own ticker of `periodSeconds` (a slow probe loses ticks, it does not
//!   queue them);
//! * no probe before `initialDelaySeconds` since the container started;
//! * liveness and readiness only after the startup probe succeeded; the startup probe no more
//!   after that;
//! * an HTTP probe is a fresh connection, `GET path`, success iff `200 <= status < 400` within
//!   `timeoutSeconds` ([`http_probe`]);
//! * the cached result only changes after `failureThreshold` (resp. `successThreshold`)
//!   consecutive equal results ([`ResultRun`]); a startup or liveness failure verdict kills the
//!   container, and its run starts over.
//!
//! [`pod`] models what those verdicts make of the whole pod's readiness (every container,
//! restarts with CrashLoopBackOff).
//!
//! kubelet's random jitter of the first probe is left out: it only delays the first probe, so
//! leaving it out makes every kill happen at its earliest.
//!
//! ```
//! use std::time::Duration;
//! use harness::kubelet::{ProbeSpec, ResultRun, Verdict};
//!
//! let spec = ProbeSpec { failure_threshold: 2, ..ProbeSpec::default() };
//! let mut run = ResultRun::new(spec);
//! assert_eq!(run.observe(false), None); // one failure: below the threshold
//! assert_eq!(run.observe(false), Some(Verdict::Failure)); // the second flips it
//! assert_eq!(spec.kill_budget(), Duration::from_secs(10)); // first probe at 0 s, kill at 10 s
//! ```

use std::time::Duration;

pub mod pod;

/// The three kinds of probe of a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeKind {
    /// startupProbe: liveness and readiness wait for it; a failure verdict kills.
    Startup,
    /// livenessProbe: a failure verdict kills.
    Liveness,
    /// readinessProbe: the container's Ready condition.
    Readiness,
}

/// One probe's settings (`Probe` in the Kubernetes API), with Kubernetes' defaults
/// ([`ProbeSpec::default`]) for absent fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeSpec {
    /// `periodSeconds`: the ticker of the prober worker (default 10 s).
    pub period: Duration,
    /// `timeoutSeconds`: how long one probe may take before it counts as a failure (1 s).
    pub timeout: Duration,
    /// `failureThreshold`: consecutive failures before the verdict flips to failure (3).
    pub failure_threshold: u32,
    /// `successThreshold`: consecutive successes before the verdict flips to success (1).
    pub success_threshold: u32,
    /// `initialDelaySeconds`: no probe before this much time since the container started (0).
    pub initial_delay: Duration,
}

impl Default for ProbeSpec {
    /// Kubernetes' defaults: period 10 s, timeout 1 s, failure threshold 3, success threshold
    /// 1, no initial delay.
    fn default() -> ProbeSpec {
        ProbeSpec {
            period: Duration::from_secs(10),
            timeout: Duration::from_secs(1),
            failure_threshold: 3,
            success_threshold: 1,
            initial_delay: Duration::ZERO,
        }
    }
}

impl ProbeSpec {
    /// Every duration times `k`; thresholds are counts and stay. Timeouts are floored at
    /// `min(period, 25 ms)`, so that a busy machine does not turn a 2 ms loopback round trip
    /// into a failure of a scaled-down probe.
    pub fn scaled(&self, k: f64) -> ProbeSpec {
        let period = self.period.mul_f64(k);
        let floor = period.min(Duration::from_millis(25));
        ProbeSpec {
            period,
            timeout: self.timeout.mul_f64(k).max(floor),
            failure_threshold: self.failure_threshold,
            success_threshold: self.success_threshold,
            initial_delay: self.initial_delay.mul_f64(k),
        }
    }

    /// Time since container start at which a probe that never succeeds gets its failure
    /// verdict: `initialDelay + period × (failureThreshold − 1)` (the first probe runs at the
    /// initial delay). For a startup probe, the longest load it tolerates.
    pub fn kill_budget(&self) -> Duration {
        self.initial_delay + self.period * self.failure_threshold.saturating_sub(1)
    }

    /// The probe times (since container start) of a worker that is never late: the initial
    /// delay, then one every period.
    pub fn ticks(&self) -> impl Iterator<Item = Duration> + '_ {
        (0u32..).map(move |i| self.initial_delay + self.period * i)
    }
}

/// A verdict: the cached result of a probe after its threshold was reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// `successThreshold` successes in a row (started / live / ready).
    Success,
    /// `failureThreshold` failures in a row (startup and liveness: the container is killed;
    /// readiness: not ready).
    Failure,
}

impl Verdict {
    /// `Success` for `true`.
    pub fn from_ok(ok: bool) -> Verdict {
        if ok {
            Verdict::Success
        } else {
            Verdict::Failure
        }
    }

    /// Whether it is [`Verdict::Success`].
    pub fn is_success(self) -> bool {
        self == Verdict::Success
    }
}

/// kubelet's per-worker result run (`lastResult`, `resultRun` in worker.go): the cached result
/// only changes after `threshold` consecutive equal results.
#[derive(Clone, Debug)]
pub struct ResultRun {
    /// The settings (thresholds).
    spec: ProbeSpec,
    /// Last raw result.
    last: Option<bool>,
    /// How many times in a row `last` came.
    run: u32,
}

impl ResultRun {
    /// A worker that has not probed yet.
    pub fn new(spec: ProbeSpec) -> ResultRun {
        ResultRun {
            spec,
            last: None,
            run: 0,
        }
    }

    /// Feeds one raw result; `Some(verdict)` when the run reaches its threshold (kubelet's
    /// `resultsManager.Set`), `None` while below it. After a failure verdict the run starts
    /// over (kubelet holds a killed container's worker and resets `resultRun`).
    pub fn observe(&mut self, ok: bool) -> Option<Verdict> {
        if self.last == Some(ok) {
            self.run += 1;
        } else {
            self.last = Some(ok);
            self.run = 1;
        }
        let need = if ok {
            self.spec.success_threshold
        } else {
            self.spec.failure_threshold
        };
        if self.run < need {
            return None;
        }
        if !ok {
            self.run = 0;
        }
        Some(Verdict::from_ok(ok))
    }

    /// Consecutive failures so far (0 after a failure verdict).
    pub fn failures_in_a_row(&self) -> u32 {
        if self.last == Some(false) {
            self.run
        } else {
            0
        }
    }
}

/// Replays one worker on a virtual clock: probes at [`ProbeSpec::ticks`], `ok(t)` the raw
/// result of the probe at `t` since container start, until the first verdict. Returns the
/// time and the verdict. Never returns if no verdict is ever reached (`ok` flapping faster
/// than both thresholds), so keep thresholds and `ok` finite.
pub fn first_verdict(spec: ProbeSpec, mut ok: impl FnMut(Duration) -> bool) -> (Duration, Verdict) {
    let mut run = ResultRun::new(spec);
    for t in spec.ticks() {
        if let Some(v) = run.observe(ok(t)) {
            return (t, v);
        }
    }
    unreachable!("ticks never end")
}

/// The startup prober against an engine that leaves Init at `leaves_init` (since container
/// start): `Ok(time of the success verdict)` or `Err(time of the kill)`.
pub fn simulate_startup(spec: ProbeSpec, leaves_init: Duration) -> Result<Duration, Duration> {
    match first_verdict(spec, |t| t >= leaves_init) {
        (t, Verdict::Success) => Ok(t),
        (t, Verdict::Failure) => Err(t),
    }
}

/// kubelet's HTTP probe: a fresh connection, `GET url`, success iff `200 <= status < 400`
/// within `timeout`.
pub fn http_probe(url: &str, timeout: Duration) -> bool {
    crate::http::get(url, timeout).is_some_and(|r| (200..400).contains(&r.status))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(failure: u32, success: u32) -> ProbeSpec {
        ProbeSpec {
            period: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            failure_threshold: failure,
            success_threshold: success,
            initial_delay: Duration::ZERO,
        }
    }

    #[test]
    fn result_run_counts_like_kubelet() {
        let mut r = ResultRun::new(spec(3, 2));
        assert_eq!(r.observe(false), None);
        assert_eq!(r.observe(false), None);
        assert_eq!(r.observe(true), None, "a success breaks the failure run");
        assert_eq!(r.observe(false), None);
        assert_eq!(r.observe(false), None);
        assert_eq!(r.failures_in_a_row(), 2);
        assert_eq!(
            r.observe(false),
            Some(Verdict::Failure),
            "third failure in a row"
        );
        assert_eq!(
            r.failures_in_a_row(),
            0,
            "run restarts after a kill verdict"
        );
        assert_eq!(r.observe(true), None);
        assert_eq!(
            r.observe(true),
            Some(Verdict::Success),
            "successThreshold 2"
        );
        assert_eq!(
            r.observe(true),
            Some(Verdict::Success),
            "stays at the threshold"
        );
    }

    #[test]
    fn kill_budget_is_the_time_of_the_last_failing_probe() {
        let s = ProbeSpec {
            initial_delay: Duration::from_secs(5),
            ..spec(4, 1)
        };
        assert_eq!(s.kill_budget(), Duration::from_secs(8));
        assert_eq!(simulate_startup(s, Duration::MAX), Err(s.kill_budget()));
        // A load ending at the last probe is in time; one just after is not.
        assert_eq!(
            simulate_startup(s, Duration::from_secs(8)),
            Ok(Duration::from_secs(8))
        );
        assert_eq!(
            simulate_startup(s, Duration::from_millis(8001)),
            Err(Duration::from_secs(8))
        );
        // Done before the first probe: started at the initial delay.
        assert_eq!(
            simulate_startup(s, Duration::ZERO),
            Ok(Duration::from_secs(5))
        );
    }

    #[test]
    fn defaults_and_scaling() {
        let d = ProbeSpec::default();
        assert_eq!(d.period, Duration::from_secs(10));
        assert_eq!((d.failure_threshold, d.success_threshold), (3, 1));
        let s = ProbeSpec {
            initial_delay: Duration::from_secs(20),
            ..d
        }
        .scaled(1.0 / 1000.0);
        assert_eq!(s.period, Duration::from_millis(10));
        assert_eq!(s.initial_delay, Duration::from_millis(20));
        // 1 ms scaled timeout floored at min(period, 25 ms) = 10 ms.
        assert_eq!(s.timeout, Duration::from_millis(10));
        assert_eq!((s.failure_threshold, s.success_threshold), (3, 1));
        let ticks: Vec<Duration> = s.ticks().take(3).collect();
        assert_eq!(ticks, [20, 30, 40].map(Duration::from_millis).to_vec());
    }

    #[test]
    fn first_verdict_of_a_flapping_probe_waits_for_a_run() {
        // ok, fail, fail, ok, ok: success threshold 2 reached at the fifth probe.
        let pattern = [true, false, false, true, true];
        let mut i = 0;
        let (t, v) = first_verdict(spec(3, 2), |_| {
            i += 1;
            pattern[i - 1]
        });
        assert_eq!((t, v), (Duration::from_secs(4), Verdict::Success));
    }

    #[test]
    fn http_probe_counts_2xx_and_3xx_as_success() {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t = std::thread::spawn(move || {
            for status in ["204 No Content", "302 Found", "503 Service Unavailable"] {
                let (mut s, _) = l.accept().unwrap();
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).unwrap();
                let resp = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
                s.write_all(resp.as_bytes()).unwrap();
            }
        });
        let url = format!("http://127.0.0.1:{port}/live");
        assert!(http_probe(&url, Duration::from_secs(5)));
        assert!(http_probe(&url, Duration::from_secs(5)));
        assert!(!http_probe(&url, Duration::from_secs(5)));
        t.join().unwrap();
        // Nothing listening: a failure, not an error.
        assert!(!http_probe(&url, Duration::from_millis(200)));
    }
}
