//! `--init-min-free-memory`: before the engine of an incarnation is spawned, wait (bounded by
//! `--init-memory-timeout`) until the device has the free memory the engine needs to
//! initialise (issue 10, item 7).
//!
//! Why: an engine started next to an Active one finds the device partly taken, and
//! * vLLM refuses to start when the free memory is below total × `--gpu-memory-utilization`
//!   (`vllm/v1/worker/utils.py`, `request_memory`, called by `Worker.init_device` in
//!   `vllm/v1/worker/gpu_worker.py`: "Free memory on device … on startup is less than desired
//!   GPU memory utilization"); the check uses the utilization even with
//!   `--kv-cache-memory-bytes`;
//! * SGLang sizes its KV pool as the memory free after the weights loaded minus
//!   total × (1 − `--mem-fraction-static`)
//!   (`python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py`,
//!   `profile_max_num_token`), and fails when that is not positive;
//! * and any engine OOMs when the memory is simply not there.
//!
//! So a re-arming incarnation spawned while the dying engine's memory is still being released,
//! or next to an Active engine that took more than the sizing allows, would crash-loop on the
//! engine's own refusal. The wait turns that into a visible, bounded, counted state: `/state`
//! shows Init with `waiting: "init_memory"` and the need and free bytes, `/live` stays 200
//! (Init, bounded by the wait's own timeout), SIGTERM ends it (exit 0), and a device that never
//! frees ends the incarnation with `DeadReason::InitMemoryTimeout` (exit code 20), which the
//! restart policy counts towards `--crash-loop-limit`.
//!
//! The first incarnation waits too when the flag is set: a container restarted next to an
//! Active engine meets the same refusal. Sizing: deploy/README.md, "Sizing two engines on one
//! GPU".
//!
//! [`InitMemoryWait`] is the pure decision (time and device samples are inputs, unit-tested
//! here); [`wait_for_init_memory`] is the driver's polling loop around it.

use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use gms_client::backend::MemInfo;
use gms_client::checks::{GpuChecks, MinFree};
use probes::{ProbeState, WaitReason, Waiting};

use super::Signals;
use crate::config::RunArgs;
use crate::machine::DeadReason;

/// Device polling period while waiting.
pub const POLL: Duration = Duration::from_millis(100);

/// `/live` stays 200 this long past the wait's bound, so that the supervisor has time to end
/// the incarnation (Dead, 200 unless giving up) before Init's deadline would read as hung.
pub const LIVE_GRACE: Duration = Duration::from_secs(1);

/// `--init-min-free-memory`: bytes (`60GiB`, `60G`), a percentage of the device's total
/// (`85%`), or `0`/`off`. `auto` (a form of `--min-free-memory`) is refused: it means "what
/// the engine released when it went to sleep", and nothing has slept before an engine starts.
pub fn parse_init_min_free(s: &str) -> Result<MinFree, String> {
    if s.trim().eq_ignore_ascii_case("auto") {
        return Err(
            "\"auto\" has no meaning before the engine starts (nothing has slept yet): give \
             bytes (60GiB, 60G), a percentage of the device (85%), or off"
                .into(),
        );
    }
    crate::config::parse_min_free(s)
}

/// One step of the wait, decided from a device sample and the time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Enough free memory: spawn the engine.
    Go {
        /// Bytes needed.
        need: u64,
        /// Bytes free.
        free: u64,
        /// Time waited (zero-ish when the memory was free at once).
        waited: Duration,
        /// Whether it had to wait (an earlier sample was short or failed).
        waited_for_it: bool,
    },
    /// Not (known to be) enough yet: sample again at `next`.
    Wait {
        /// Bytes needed (None while the device could not say yet).
        need: Option<u64>,
        /// Bytes free at the last good sample.
        free: Option<u64>,
        /// Device total at the last good sample.
        total: Option<u64>,
        /// This is the first short sample: the wait begins (log it once).
        first: bool,
        /// The device query failed, for the first time (log it once).
        error: Option<String>,
        /// When to sample again (never past the deadline).
        next: Instant,
    },
    /// The bound passed without enough free memory: the incarnation ends.
    TimedOut {
        /// Bytes needed (None if the device never answered).
        need: Option<u64>,
        /// Bytes free at the last good sample.
        free: Option<u64>,
        /// Time waited.
        waited: Duration,
        /// The last device error, if the last sample failed.
        error: Option<String>,
    },
}

/// The pure wait: what to do after each device sample. No clock, no device: both are inputs.
#[derive(Clone, Debug)]
pub struct InitMemoryWait {
    need: MinFree,
    started: Instant,
    deadline: Instant,
    poll: Duration,
    /// Last good sample: (need, free, total).
    last: Option<(u64, u64, u64)>,
    /// A short sample was seen (the wait has begun).
    announced: bool,
    /// A device error was seen.
    errored: bool,
}

impl InitMemoryWait {
    /// A wait for `need` that began at `now` and is bounded by `timeout`, sampling every `poll`.
    pub fn new(need: MinFree, now: Instant, timeout: Duration, poll: Duration) -> InitMemoryWait {
        InitMemoryWait {
            need,
            started: now,
            deadline: now + timeout,
            poll,
            last: None,
            announced: false,
            errored: false,
        }
    }

    /// When the wait gives up.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The device answered `sample` at `now`: go, wait, or give up.
    pub fn observe(&mut self, now: Instant, sample: Result<MemInfo, String>) -> Step {
        let waited = now.saturating_duration_since(self.started);
        let error = match sample {
            Ok(m) => {
                // `MinFree::Auto` never reaches here (refused by the parser); it would resolve
                // to 0: no wait.
                let need = self.need.resolve(m.total, None);
                self.last = Some((need, m.free, m.total));
                if m.free >= need {
                    return Step::Go {
                        need,
                        free: m.free,
                        waited,
                        waited_for_it: self.announced || self.errored,
                    };
                }
                None
            }
            Err(e) => Some(e),
        };
        let (need, free, total) = match self.last {
            Some((n, f, t)) => (Some(n), Some(f), Some(t)),
            None => (None, None, None),
        };
        if now >= self.deadline {
            return Step::TimedOut {
                need,
                free,
                waited,
                error,
            };
        }
        let first = error.is_none() && !std::mem::replace(&mut self.announced, true);
        let error = match error {
            Some(e) if !std::mem::replace(&mut self.errored, true) => Some(e),
            _ => None,
        };
        Step::Wait {
            need,
            free,
            total,
            first,
            error,
            next: (now + self.poll).min(self.deadline),
        }
    }
}

/// How the wait ended, for the incarnation.
#[derive(Debug)]
pub(super) enum Gate {
    /// Spawn the engine (enough memory, or no wait configured / possible).
    Spawn,
    /// SIGTERM/SIGINT during the wait.
    Stopped,
    /// The bound passed: end the incarnation with this reason.
    TimedOut(DeadReason),
}

static NO_DEVICE_WARNED: Once = Once::new();

/// Whether the flag can act: it needs device checks (`--gpu` with a driver, or `--gpu-sim`).
/// Without them it is a no-op, with one warning line per process.
fn device<'a>(args: &RunArgs, checks: Option<&'a Arc<GpuChecks>>) -> Option<&'a Arc<GpuChecks>> {
    if args.init_min_free_memory == MinFree::Off {
        return None;
    }
    match checks {
        Some(c) if c.device_checks_enabled() => Some(c),
        _ => {
            NO_DEVICE_WARNED.call_once(|| {
                tracing::warn!(
                    init_min_free_memory = %args.init_min_free_memory,
                    gpu = ?args.gpu,
                    "--init-min-free-memory has no effect: no device checks (needs --gpu with a GPU driver, or --gpu-sim); engines are spawned without waiting"
                );
            });
            None
        }
    }
}

/// Log once at supervisor start whether the flag is a no-op here.
pub(super) fn announce(args: &RunArgs, checks: Option<&Arc<GpuChecks>>) {
    if let Some(c) = device(args, checks) {
        tracing::info!(
            init_min_free_memory = %args.init_min_free_memory,
            timeout_ms = args.init_memory_timeout.as_millis() as u64,
            device = ?c,
            "each engine is spawned only once the device has the free memory it needs to initialise"
        );
    }
}

/// Before spawning incarnation `incarnation`'s engine: wait until the device has
/// `--init-min-free-memory` free, bounded by `--init-memory-timeout`, with `/state` showing
/// the wait. Returns at once ([`Gate::Spawn`]) when the flag is off or there is no device.
pub(super) async fn wait_for_init_memory(
    args: &RunArgs,
    incarnation: u32,
    checks: Option<&Arc<GpuChecks>>,
    state: &ProbeState,
    signals: &mut Signals,
) -> Gate {
    let Some(checks) = device(args, checks) else {
        return Gate::Spawn;
    };
    let timeout = args.init_memory_timeout;
    let start = Instant::now();
    let mut wait = InitMemoryWait::new(args.init_min_free_memory, start, timeout, POLL);
    {
        // The supervisor is up (flags valid, probes bound, lock reachable): `/startup` passes,
        // and `/live` bounds this Init by the wait's own timeout (the machine's startup budget
        // takes over once the engine is spawned).
        let mut s = state.write();
        s.started = true;
        s.startup_deadline = Some(wait.deadline() + LIVE_GRACE);
    }
    let end = loop {
        let sample = checks
            .device_memory()
            .unwrap_or_else(|| Err("device checks turned off".into()));
        let step = wait.observe(Instant::now(), sample);
        match step {
            Step::Go {
                need,
                free,
                waited,
                waited_for_it,
            } => {
                let outcome = if waited_for_it { "freed" } else { "ready" };
                state.metrics().init_memory_wait(outcome, waited);
                tracing::info!(
                    incarnation,
                    outcome,
                    need,
                    free,
                    waited_ms = waited.as_millis() as u64,
                    "init memory wait over: the device has the memory the engine needs to initialise; spawning it"
                );
                break Gate::Spawn;
            }
            Step::TimedOut {
                need,
                free,
                waited,
                error,
            } => {
                state.metrics().init_memory_wait("timeout", waited);
                tracing::error!(
                    incarnation,
                    outcome = "timeout",
                    need = ?need,
                    free = ?free,
                    waited_ms = waited.as_millis() as u64,
                    error = ?error,
                    "init memory wait over: the device did not have the memory the engine needs to initialise in time; ending the incarnation without spawning it"
                );
                let why = format!(
                    "need {} bytes free, {} free after {waited:?}{}",
                    need.map_or("?".into(), |n| n.to_string()),
                    free.map_or("?".into(), |f| f.to_string()),
                    error.map_or(String::new(), |e| format!(" (device: {e})")),
                );
                break Gate::TimedOut(DeadReason::InitMemoryTimeout(why));
            }
            Step::Wait {
                need,
                free,
                total,
                first,
                error,
                next,
            } => {
                // `/state` says "waiting" only once a sample has shown the engine must wait,
                // and always with that sample's figures: a first sample with enough memory
                // spawns at once and never reports a wait.
                state.write().waiting = Some(Waiting {
                    reason: WaitReason::InitMemory,
                    since: start,
                    timeout,
                    need_bytes: need,
                    free_bytes: free,
                });
                if first {
                    tracing::info!(
                        incarnation,
                        need = ?need,
                        free = ?free,
                        total = ?total,
                        init_min_free_memory = %args.init_min_free_memory,
                        timeout_ms = timeout.as_millis() as u64,
                        "init memory wait: not enough free device memory to initialise the engine yet; waiting before spawning it"
                    );
                    if let (Some(n), Some(t)) = (need, total) {
                        if n > t {
                            tracing::warn!(need = n, total = t, "--init-min-free-memory exceeds the device's total: the wait can only time out");
                        }
                    }
                }
                if let Some(e) = error {
                    tracing::warn!(incarnation, error = %e, "init memory wait: the device cannot say its free memory; still waiting");
                }
                let stopped = tokio::select! {
                    _ = tokio::time::sleep_until(next.into()) => false,
                    _ = signals.term.recv() => { tracing::info!("SIGTERM received during the init memory wait"); true }
                    _ = signals.int.recv() => { tracing::info!("SIGINT received during the init memory wait"); true }
                };
                if stopped {
                    let waited = start.elapsed();
                    state.metrics().init_memory_wait("stopped", waited);
                    tracing::info!(
                        incarnation,
                        outcome = "stopped",
                        need = ?need,
                        free = ?free,
                        waited_ms = waited.as_millis() as u64,
                        "init memory wait over: stop requested; the engine is not spawned"
                    );
                    break Gate::Stopped;
                }
            }
        }
    };
    state.write().waiting = None;
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MS: Duration = Duration::from_millis(1);

    fn mem(free: u64) -> Result<MemInfo, String> {
        Ok(MemInfo {
            free,
            total: 80 * GIB,
        })
    }

    fn wait(need: MinFree, t0: Instant) -> InitMemoryWait {
        InitMemoryWait::new(need, t0, 1000 * MS, 100 * MS)
    }

    #[test]
    fn enough_at_once_goes_without_waiting() {
        let t0 = Instant::now();
        let mut w = wait(MinFree::Bytes(40 * GIB), t0);
        assert_eq!(
            w.observe(t0, mem(40 * GIB)),
            Step::Go {
                need: 40 * GIB,
                free: 40 * GIB,
                waited: Duration::ZERO,
                waited_for_it: false
            }
        );
    }

    #[test]
    fn a_percentage_resolves_against_the_devices_total() {
        let t0 = Instant::now();
        let mut w = wait(MinFree::Fraction(0.5), t0);
        match w.observe(t0, mem(40 * GIB - 1)) {
            Step::Wait { need, .. } => assert_eq!(need, Some(40 * GIB)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            w.observe(t0 + 100 * MS, mem(40 * GIB)),
            Step::Go { need, .. } if need == 40 * GIB
        ));
    }

    #[test]
    fn off_never_waits() {
        let t0 = Instant::now();
        let mut w = wait(MinFree::Off, t0);
        assert!(matches!(w.observe(t0, mem(0)), Step::Go { need: 0, .. }));
    }

    #[test]
    fn short_samples_wait_announced_once_then_go_when_freed() {
        let t0 = Instant::now();
        let mut w = wait(MinFree::Bytes(60 * GIB), t0);
        assert_eq!(
            w.observe(t0, mem(20 * GIB)),
            Step::Wait {
                need: Some(60 * GIB),
                free: Some(20 * GIB),
                total: Some(80 * GIB),
                first: true,
                error: None,
                next: t0 + 100 * MS,
            }
        );
        match w.observe(t0 + 100 * MS, mem(50 * GIB)) {
            Step::Wait {
                first, free, next, ..
            } => {
                assert!(!first, "the start is logged once");
                assert_eq!(free, Some(50 * GIB));
                assert_eq!(next, t0 + 200 * MS);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            w.observe(t0 + 250 * MS, mem(60 * GIB)),
            Step::Go {
                need: 60 * GIB,
                free: 60 * GIB,
                waited: 250 * MS,
                waited_for_it: true
            }
        );
    }

    #[test]
    fn the_next_sample_is_never_after_the_deadline() {
        let t0 = Instant::now();
        let mut w = wait(MinFree::Bytes(60 * GIB), t0);
        match w.observe(t0 + 950 * MS, mem(0)) {
            Step::Wait { next, .. } => assert_eq!(next, t0 + 1000 * MS),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_device_that_never_frees_times_out_at_the_deadline_not_before() {
        let t0 = Instant::now();
        let mut w = wait(MinFree::Bytes(60 * GIB), t0);
        assert!(matches!(w.observe(t0, mem(10 * GIB)), Step::Wait { .. }));
        assert!(matches!(
            w.observe(t0 + 999 * MS, mem(10 * GIB)),
            Step::Wait { .. }
        ));
        assert_eq!(
            w.observe(t0 + 1000 * MS, mem(10 * GIB)),
            Step::TimedOut {
                need: Some(60 * GIB),
                free: Some(10 * GIB),
                waited: 1000 * MS,
                error: None
            }
        );
        // Enough memory at the deadline still goes: the sample wins over the clock.
        let mut w = wait(MinFree::Bytes(60 * GIB), t0);
        assert!(matches!(
            w.observe(t0 + 5000 * MS, mem(60 * GIB)),
            Step::Go { .. }
        ));
    }

    #[test]
    fn device_errors_keep_waiting_logged_once_and_time_out_with_the_last_known_numbers() {
        let t0 = Instant::now();
        let mut w = wait(MinFree::Bytes(60 * GIB), t0);
        assert_eq!(
            w.observe(t0, Err("nvml: busy".into())),
            Step::Wait {
                need: None,
                free: None,
                total: None,
                first: false,
                error: Some("nvml: busy".into()),
                next: t0 + 100 * MS,
            }
        );
        match w.observe(t0 + 100 * MS, Err("nvml: busy".into())) {
            Step::Wait { error, .. } => assert_eq!(error, None, "an error is logged once"),
            other => panic!("{other:?}"),
        }
        match w.observe(t0 + 200 * MS, mem(30 * GIB)) {
            Step::Wait { first, need, .. } => {
                assert!(first, "the first short sample still announces the wait");
                assert_eq!(need, Some(60 * GIB));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            w.observe(t0 + 1000 * MS, Err("gone".into())),
            Step::TimedOut {
                need: Some(60 * GIB),
                free: Some(30 * GIB),
                waited: 1000 * MS,
                error: Some("gone".into())
            }
        );
        // A device that failed before it went on to answer enough: waited for it.
        let mut w = wait(MinFree::Bytes(60 * GIB), t0);
        let _ = w.observe(t0, Err("x".into()));
        assert!(matches!(
            w.observe(t0 + 100 * MS, mem(70 * GIB)),
            Step::Go {
                waited_for_it: true,
                ..
            }
        ));
    }

    #[test]
    fn a_need_above_the_total_can_only_time_out() {
        let t0 = Instant::now();
        let mut w = wait(MinFree::Bytes(100 * GIB), t0);
        assert!(matches!(
            w.observe(t0, mem(80 * GIB)),
            Step::Wait { need: Some(n), total: Some(t), .. } if n > t
        ));
        assert!(matches!(
            w.observe(t0 + 1000 * MS, mem(80 * GIB)),
            Step::TimedOut { .. }
        ));
    }

    #[test]
    fn flag_forms() {
        assert_eq!(parse_init_min_free("60GiB"), Ok(MinFree::Bytes(60 * GIB)));
        assert_eq!(parse_init_min_free("85%"), Ok(MinFree::Fraction(0.85)));
        assert_eq!(parse_init_min_free("off"), Ok(MinFree::Off));
        assert_eq!(parse_init_min_free("0"), Ok(MinFree::Off));
        assert!(parse_init_min_free("auto")
            .unwrap_err()
            .contains("nothing has slept"));
        assert!(parse_init_min_free(" AUTO ").is_err());
        assert!(parse_init_min_free("120%").is_err());
        assert!(parse_init_min_free("lots").is_err());
    }
}
