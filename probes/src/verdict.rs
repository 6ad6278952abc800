//! Pure probe verdicts: phase + last health result + clock -> healthy or not.
//!
//! These follow docs/INTERFACES.md (probe endpoints) and Decision 2 (docs/DECISIONS.md). None
//! of them waits for the model load: `/startup` passes once the supervisor is up, and `/live`
//! bounds Init by the supervisor's own `--startup-timeout`, so that a restarted (or re-arming)
//! engine container never holds its pod NotReady for the length of a model load.

use std::time::Instant;

use crate::Phase;

/// The inputs of the verdicts (a copy of the relevant part of [`crate::Status`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeView {
    /// Current phase.
    pub phase: Phase,
    /// Last background health check result (only consulted in Active).
    pub engine_healthy: bool,
    /// While Waking: when the waking budget runs out (None = no budget).
    pub waking_deadline: Option<Instant>,
    /// The supervisor is up: flags valid, probes bound, lock reachable, first engine spawned.
    /// Never goes back to false.
    pub started: bool,
    /// While Init: when the current incarnation's `--startup-timeout` runs out (None: no
    /// engine spawned yet).
    pub startup_deadline: Option<Instant>,
    /// The supervisor gave up (crash-loop limit, `--restart never`, or a requested stop): it
    /// exits once fencing is done, no new incarnation follows.
    pub gave_up: bool,
}

/// `GET /startup`: 200 once the supervisor is up (its first engine spawned); it does not wait
/// for the model load.
pub fn startup(v: &ProbeView, _now: Instant) -> bool {
    v.started
}

/// `GET /live`: Init 200 until `--startup-timeout` has passed, then 503 (the supervisor sets
/// the deadline from its own start; 503 without one); Standby 200; Waking 200 until the waking deadline has passed, then 503;
/// Active 200 while the engine is healthy; Dead (fencing, backoff, re-arming) 200 unless the
/// supervisor gave up.
pub fn live(v: &ProbeView, now: Instant) -> bool {
    match v.phase {
        Phase::Init => v.startup_deadline.is_some_and(|d| now < d),
        Phase::Standby => true,
        Phase::Waking => match v.waking_deadline {
            Some(deadline) => now < deadline,
            None => true,
        },
        Phase::Active => v.engine_healthy,
        Phase::Dead => !v.gave_up,
    }
}

/// `GET /ready`: 200 only in Active with a healthy engine.
pub fn ready(v: &ProbeView, _now: Instant) -> bool {
    v.phase == Phase::Active && v.engine_healthy
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Every phase x health x started x gave-up combination, against the table in
    /// docs/INTERFACES.md (deadlines in the future; their expiry is tested below).
    #[test]
    fn table() {
        let now = Instant::now();
        let future = Some(now + Duration::from_secs(5));
        for healthy in [false, true] {
            for started in [false, true] {
                for gave_up in [false, true] {
                    for phase in Phase::ALL {
                        let v = ProbeView {
                            phase,
                            engine_healthy: healthy,
                            waking_deadline: if phase == Phase::Waking { future } else { None },
                            started,
                            startup_deadline: if phase == Phase::Init && started {
                                future
                            } else {
                                None
                            },
                            gave_up,
                        };
                        let expect_live = match phase {
                            Phase::Init => started,
                            Phase::Dead => !gave_up,
                            Phase::Standby | Phase::Waking => true,
                            Phase::Active => healthy,
                        };
                        let what = format!(
                            "{phase} healthy={healthy} started={started} gave_up={gave_up}"
                        );
                        assert_eq!(live(&v, now), expect_live, "live {what}");
                        assert_eq!(
                            ready(&v, now),
                            phase == Phase::Active && healthy,
                            "ready {what}"
                        );
                        assert_eq!(startup(&v, now), started, "startup {what}");
                    }
                }
            }
        }
    }

    #[test]
    fn waking_turns_dead_after_deadline() {
        let start = Instant::now();
        let v = ProbeView {
            phase: Phase::Waking,
            engine_healthy: false,
            waking_deadline: Some(start + Duration::from_secs(2)),
            started: true,
            startup_deadline: None,
            gave_up: false,
        };
        assert!(live(&v, start));
        assert!(live(&v, start + Duration::from_millis(1999)));
        assert!(!live(&v, start + Duration::from_secs(2)));
        assert!(!live(&v, start + Duration::from_secs(3600)));
        assert!(!ready(&v, start));
    }

    #[test]
    fn init_is_alive_until_the_startup_timeout() {
        let start = Instant::now();
        let mut v = ProbeView {
            phase: Phase::Init,
            engine_healthy: false,
            waking_deadline: None,
            started: true,
            startup_deadline: Some(start + Duration::from_secs(7200)),
            gave_up: false,
        };
        assert!(live(&v, start));
        assert!(live(&v, start + Duration::from_secs(7199)));
        assert!(!live(&v, start + Duration::from_secs(7200)));
        assert!(startup(&v, start + Duration::from_secs(7200)));
        // Before the first engine was spawned: not alive, not started.
        v.startup_deadline = None;
        v.started = false;
        assert!(!live(&v, start));
        assert!(!startup(&v, start));
    }
}
