//! The pure restart policy: after an incarnation of the engine ended (its [`DeadReason`] and
//! how long it ran), restart it after a backoff or give up with an exit code.
//!
//! Modelled on kubelet's CrashLoopBackOff (pkg/kubelet/kuberuntime, `backOff`): the delay
//! doubles from `--restart-backoff` up to `--restart-backoff-max`, and is reset after an
//! incarnation ran longer than `--restart-reset` (kubelet: 10 min) **or came up** (its engine
//! reached Standby or Active: it initialised, so its end is a failover, not a crash loop).
//! After `--crash-loop-limit` restarts without a reset (engines that never came up) the
//! supervisor gives up with the last incarnation's exit code, so that a truly broken container
//! is still visible to kubelet.
//! A requested stop (SIGTERM/SIGINT) never restarts (exit 0). No clock: the run time is an
//! input.

use std::time::Duration;

use crate::machine::DeadReason;

/// `--restart`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RestartMode {
    /// Start a new incarnation (as a shadow) after every end but a requested stop.
    OnFailure,
    /// Exit right after fencing (the behaviour of the first version).
    Never,
}

impl RestartMode {
    /// The flag's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            RestartMode::OnFailure => "on-failure",
            RestartMode::Never => "never",
        }
    }
}

/// The policy's parameters (from the flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartConfig {
    /// `--restart`.
    pub mode: RestartMode,
    /// `--restart-backoff`: the first delay.
    pub backoff: Duration,
    /// `--restart-backoff-max`: the cap of the doubling.
    pub backoff_max: Duration,
    /// `--restart-reset`: an incarnation that ran at least this long resets the backoff and
    /// the crash-loop count.
    pub reset_after: Duration,
    /// `--crash-loop-limit`: restarts without a reset before giving up.
    pub crash_loop_limit: u32,
}

impl Default for RestartConfig {
    fn default() -> Self {
        RestartConfig {
            mode: RestartMode::OnFailure,
            backoff: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
            reset_after: Duration::from_secs(600),
            crash_loop_limit: 5,
        }
    }
}

/// Why the supervisor gives up instead of restarting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GiveUpWhy {
    /// SIGTERM/SIGINT.
    Stopped,
    /// `--restart never`.
    Never,
    /// `--crash-loop-limit` restarts without a reset.
    CrashLoop,
}

impl GiveUpWhy {
    /// Short name (logs).
    pub fn as_str(self) -> &'static str {
        match self {
            GiveUpWhy::Stopped => "stopped",
            GiveUpWhy::Never => "restart_never",
            GiveUpWhy::CrashLoop => "crash_loop_limit",
        }
    }
}

/// What to do after an incarnation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Start the next incarnation after this delay.
    Restart {
        /// The backoff.
        after: Duration,
    },
    /// Exit with this code.
    GiveUp {
        /// The process exit status.
        exit_code: i32,
        /// Why.
        why: GiveUpWhy,
    },
}

/// How an incarnation ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// From its start (before its lock connection) to its end.
    pub ran: Duration,
    /// Whether its engine came up: reached Standby or Active.
    pub came_up: bool,
}

impl Run {
    /// An incarnation that never came up and ran `ran`.
    pub fn failed_after(ran: Duration) -> Run {
        Run {
            ran,
            came_up: false,
        }
    }
}

/// The policy's memory across incarnations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestartPolicy {
    cfg: RestartConfig,
    /// Restarts since the last reset (the crash-loop count).
    consecutive: u32,
    /// Restarts in this supervisor's life.
    total: u32,
}

impl RestartPolicy {
    /// A fresh policy (nothing restarted yet).
    pub fn new(cfg: RestartConfig) -> RestartPolicy {
        RestartPolicy {
            cfg,
            consecutive: 0,
            total: 0,
        }
    }

    /// Restarts since the last reset.
    pub fn consecutive(&self) -> u32 {
        self.consecutive
    }

    /// Restarts so far.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// The delay before restart number `n` (0-based) since the last reset:
    /// `backoff * 2^n`, capped at `backoff_max`.
    pub fn backoff(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n.min(31)).unwrap_or(u32::MAX);
        self.cfg
            .backoff
            .checked_mul(factor)
            .unwrap_or(Duration::MAX)
            .min(self.cfg.backoff_max)
    }

    /// Whether the next end of an incarnation gives up: what `/live` answers in Dead before
    /// the decision is taken (a pure look-ahead, no change).
    pub fn would_give_up(&self, reason: &DeadReason, run: Run) -> bool {
        matches!(self.clone().decide(reason, run), Decision::GiveUp { .. })
    }

    /// An incarnation ended with `reason` after `run`: restart or give up.
    pub fn decide(&mut self, reason: &DeadReason, run: Run) -> Decision {
        if matches!(reason, DeadReason::Stopped) {
            return Decision::GiveUp {
                exit_code: reason.exit_code(),
                why: GiveUpWhy::Stopped,
            };
        }
        if self.cfg.mode == RestartMode::Never {
            return Decision::GiveUp {
                exit_code: reason.exit_code(),
                why: GiveUpWhy::Never,
            };
        }
        if run.ran >= self.cfg.reset_after || run.came_up {
            self.consecutive = 0;
        }
        if self.consecutive >= self.cfg.crash_loop_limit {
            return Decision::GiveUp {
                exit_code: reason.exit_code(),
                why: GiveUpWhy::CrashLoop,
            };
        }
        let after = self.backoff(self.consecutive);
        self.consecutive += 1;
        self.total += 1;
        Decision::Restart { after }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::ProcessEnd;

    const S: Duration = Duration::from_secs(1);

    fn cfg() -> RestartConfig {
        RestartConfig {
            mode: RestartMode::OnFailure,
            backoff: S,
            backoff_max: 30 * S,
            reset_after: 600 * S,
            crash_loop_limit: 10,
        }
    }

    fn crash() -> DeadReason {
        DeadReason::EngineExited(ProcessEnd::Exited(1))
    }

    fn restart(d: Decision) -> Duration {
        match d {
            Decision::Restart { after } => after,
            other => panic!("expected a restart, got {other:?}"),
        }
    }

    #[test]
    fn backoff_doubles_then_caps() {
        let mut p = RestartPolicy::new(cfg());
        let got: Vec<u64> = (0..8)
            .map(|_| restart(p.decide(&crash(), Run::failed_after(S))).as_secs())
            .collect();
        assert_eq!(got, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(p.consecutive(), 8);
        assert_eq!(p.total(), 8);
    }

    #[test]
    fn backoff_never_overflows() {
        let p = RestartPolicy::new(RestartConfig {
            backoff_max: Duration::MAX,
            ..cfg()
        });
        assert_eq!(p.backoff(0), S);
        assert_eq!(p.backoff(3), 8 * S);
        assert!(p.backoff(40) >= p.backoff(31));
        assert!(p.backoff(u32::MAX) > Duration::ZERO);
    }

    #[test]
    fn a_long_run_resets_backoff_and_the_crash_loop_count() {
        let mut p = RestartPolicy::new(cfg());
        for _ in 0..4 {
            restart(p.decide(&crash(), Run::failed_after(S)));
        }
        assert_eq!(p.consecutive(), 4);
        // Just under the reset interval: no reset, the doubling goes on.
        assert_eq!(
            restart(p.decide(
                &crash(),
                Run::failed_after(600 * S - Duration::from_millis(1))
            )),
            16 * S
        );
        // At the interval: back to the first delay.
        assert_eq!(restart(p.decide(&crash(), Run::failed_after(600 * S))), S);
        assert_eq!(p.consecutive(), 1);
        assert_eq!(p.total(), 6);
        assert_eq!(restart(p.decide(&crash(), Run::failed_after(S))), 2 * S);
    }

    #[test]
    fn the_crash_loop_limit_gives_up_with_the_last_exit_code() {
        let mut p = RestartPolicy::new(RestartConfig {
            crash_loop_limit: 3,
            ..cfg()
        });
        for _ in 0..3 {
            restart(p.decide(&crash(), Run::failed_after(S)));
        }
        assert!(p.would_give_up(&DeadReason::StartupTimeout, Run::failed_after(S)));
        assert!(!p.would_give_up(&DeadReason::StartupTimeout, Run::failed_after(600 * S)));
        assert_eq!(
            p.decide(&DeadReason::StartupTimeout, Run::failed_after(S)),
            Decision::GiveUp {
                exit_code: 11,
                why: GiveUpWhy::CrashLoop
            }
        );
        // Giving up changes nothing: asked again, the same answer.
        assert_eq!(p.total(), 3);
        assert_eq!(
            p.decide(&crash(), Run::failed_after(S)),
            Decision::GiveUp {
                exit_code: 10,
                why: GiveUpWhy::CrashLoop
            }
        );
        // A long run resets even at the limit.
        assert_eq!(restart(p.decide(&crash(), Run::failed_after(600 * S))), S);
    }

    #[test]
    fn an_incarnation_that_came_up_resets_the_crash_loop_count() {
        let mut p = RestartPolicy::new(RestartConfig {
            crash_loop_limit: 2,
            ..cfg()
        });
        restart(p.decide(&crash(), Run::failed_after(S)));
        restart(p.decide(&crash(), Run::failed_after(S)));
        // At the limit, an engine that never came up gives up...
        assert!(p.would_give_up(&crash(), Run::failed_after(S)));
        // ...but one that came up (a failover of a serving engine) is restarted after the
        // first delay, however often it happens.
        let up = Run {
            ran: S,
            came_up: true,
        };
        assert!(!p.would_give_up(&crash(), up));
        for _ in 0..10 {
            assert_eq!(restart(p.decide(&crash(), up)), S);
        }
        assert_eq!(p.consecutive(), 1);
        assert_eq!(p.total(), 12);
    }

    #[test]
    fn limit_zero_never_restarts_a_failure() {
        let mut p = RestartPolicy::new(RestartConfig {
            crash_loop_limit: 0,
            ..cfg()
        });
        assert!(matches!(
            p.decide(&crash(), Run::failed_after(S)),
            Decision::GiveUp {
                exit_code: 10,
                why: GiveUpWhy::CrashLoop
            }
        ));
    }

    #[test]
    fn a_requested_stop_never_restarts() {
        for mode in [RestartMode::OnFailure, RestartMode::Never] {
            let mut p = RestartPolicy::new(RestartConfig { mode, ..cfg() });
            assert!(p.would_give_up(&DeadReason::Stopped, Run::failed_after(S)));
            assert_eq!(
                p.decide(&DeadReason::Stopped, Run::failed_after(S)),
                Decision::GiveUp {
                    exit_code: 0,
                    why: GiveUpWhy::Stopped
                }
            );
            assert_eq!(p.total(), 0);
        }
    }

    #[test]
    fn never_exits_after_every_failure_with_its_code() {
        let reasons = [
            crash(),
            DeadReason::StartupTimeout,
            DeadReason::SleepFailed("x".into()),
            DeadReason::WakeFailed("x".into()),
            DeadReason::WakingTimeout,
            DeadReason::LockLost("x".into()),
            DeadReason::Revoked("x".into()),
            DeadReason::LockUnavailable("x".into()),
            DeadReason::Protocol("x".into()),
            DeadReason::GpuCheckFailed("x".into()),
            DeadReason::InitMemoryTimeout("x".into()),
        ];
        for r in &reasons {
            let mut p = RestartPolicy::new(RestartConfig {
                mode: RestartMode::Never,
                ..cfg()
            });
            assert_eq!(
                p.decide(r, Run::failed_after(600 * S)),
                Decision::GiveUp {
                    exit_code: r.exit_code(),
                    why: GiveUpWhy::Never
                },
                "{r}"
            );
        }
        // on-failure restarts every one of them.
        let mut p = RestartPolicy::new(cfg());
        for r in &reasons {
            restart(p.decide(r, Run::failed_after(600 * S)));
        }
    }
}
