//! Pure probe verdicts: phase + last health result + clock -> healthy or not.
//!
//! These follow docs/INTERFACES.md (probe endpoints) and Decision 2 (docs/DECISIONS.md).

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
}

/// `GET /startup`: 200 once the engine has left Init.
pub fn startup(v: &ProbeView, _now: Instant) -> bool {
    v.phase != Phase::Init
}

/// `GET /live`: Init 503 (the startup probe covers it); Standby 200; Waking 200 until the waking
/// deadline has passed, then 503; Active 200 while the engine is healthy; Dead 503.
pub fn live(v: &ProbeView, now: Instant) -> bool {
    match v.phase {
        Phase::Init => false,
        Phase::Standby => true,
        Phase::Waking => match v.waking_deadline {
            Some(deadline) => now < deadline,
            None => true,
        },
        Phase::Active => v.engine_healthy,
        Phase::Dead => false,
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

    fn view(phase: Phase, healthy: bool, deadline: Option<Instant>) -> ProbeView {
        ProbeView {
            phase,
            engine_healthy: healthy,
            waking_deadline: deadline,
        }
    }

    /// Every phase x health combination, against the table in docs/INTERFACES.md.
    #[test]
    fn table() {
        let now = Instant::now();
        let future = Some(now + Duration::from_secs(5));
        for healthy in [false, true] {
            for phase in Phase::ALL {
                let v = view(
                    phase,
                    healthy,
                    if phase == Phase::Waking { future } else { None },
                );
                let expect_live = match phase {
                    Phase::Init | Phase::Dead => false,
                    Phase::Standby | Phase::Waking => true,
                    Phase::Active => healthy,
                };
                assert_eq!(live(&v, now), expect_live, "live {phase} healthy={healthy}");
                assert_eq!(
                    ready(&v, now),
                    phase == Phase::Active && healthy,
                    "ready {phase} healthy={healthy}"
                );
                assert_eq!(startup(&v, now), phase != Phase::Init, "startup {phase}");
            }
        }
    }

    #[test]
    fn waking_turns_dead_after_deadline() {
        let start = Instant::now();
        let v = view(Phase::Waking, false, Some(start + Duration::from_secs(2)));
        assert!(live(&v, start));
        assert!(live(&v, start + Duration::from_millis(1999)));
        assert!(!live(&v, start + Duration::from_secs(2)));
        assert!(!live(&v, start + Duration::from_secs(3600)));
        assert!(!ready(&v, start));
    }
}
