//! `--publish-key`: while Active, the supervisor publishes its engine's endpoint in etcd with
//! lockd's fenced put (`put_fenced`, etcd backend: applied only while the lock key's create
//! revision is still this lease's epoch, attached to the session's etcd lease). Pure: time and
//! lockd's answers are inputs; the driver sends the puts and feeds the answers back.
//!
//! ```text
//! Off --Active(epoch)--> Putting --Done--> Published
//!                        Putting --Failed(unavailable)--> Backoff --Tick past it--> Putting
//!                        Putting --Failed(fenced|not_holder|other)--> Refused (no retry)
//! any --LeftActive--> Withdrawn (terminal for this incarnation)
//! ```
//!
//! Removal: the value lives on the session's etcd lease, so it goes with the lease: at once
//! when the supervisor's fence closes the lock connection (lockd revokes the session's lease
//! when the connection and its anchors have closed), at the TTL when lockd died or was cut off
//! from etcd. A holder that is no longer the owner cannot write it again: etcd compares the
//! lock key's create revision. [`Action::Withdraw`] deletes it first, with a fenced delete
//! sent before the fence starts (so that it does not name an engine being stopped).

use std::time::{Duration, Instant};

/// First retry delay after lockd answered `unavailable` (etcd did not answer).
pub const RETRY_MIN: Duration = Duration::from_millis(100);
/// Longest retry delay.
pub const RETRY_MAX: Duration = Duration::from_secs(2);

/// Where the publisher is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Not Active (yet): nothing published.
    Off,
    /// A fenced put for `epoch` is in flight.
    Putting {
        /// The lease's epoch (the lock key's create revision).
        epoch: u64,
        /// The delay before the next retry, should this one fail with `unavailable`.
        next_delay: Duration,
    },
    /// etcd applied the put.
    Published {
        /// The lease's epoch.
        epoch: u64,
        /// etcd's revision of the write.
        revision: u64,
    },
    /// etcd did not answer: put again at `until`.
    Backoff {
        /// The lease's epoch.
        epoch: u64,
        /// When to put again.
        until: Instant,
        /// The delay after that one.
        next_delay: Duration,
    },
    /// lockd or etcd refused the put (`fenced`: this holder is no longer the owner); never
    /// retried (the lease is gone or going: the supervisor is told `lost`/`revoked`).
    Refused {
        /// The lease's epoch.
        epoch: u64,
        /// lockd's error code.
        code: String,
    },
    /// Left Active: nothing is put any more in this incarnation.
    Withdrawn,
}

/// What happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// The machine is Active holding the lease with this epoch (fed on entering Active and
    /// on a re-grant while Active).
    Active {
        /// The lease's epoch.
        epoch: u64,
    },
    /// The machine left Active (Dead: fence, shutdown, lost or revoked lease).
    LeftActive,
    /// lockd answered `put_done`.
    Done {
        /// The epoch the put was made under.
        epoch: u64,
        /// etcd's revision of the write.
        revision: u64,
    },
    /// lockd answered an error to the put.
    Failed {
        /// lockd's error code (`fenced`, `unavailable`, `not_holder`, ...).
        code: String,
    },
    /// Time passed (the driver feeds it at [`State::wakeup`]).
    Tick,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `put_fenced(resource, key, value)`.
    Put {
        /// The epoch it is made under (for the log).
        epoch: u64,
    },
    /// Stop vouching for the published value: a fenced delete of it, sent before the fence
    /// (the value also goes with the session's etcd lease when the fence closes the
    /// connection).
    Withdraw {
        /// Whether a value had been published.
        was_published: bool,
    },
}

impl State {
    /// When [`Input::Tick`] is due (None: nothing timed).
    pub fn wakeup(&self) -> Option<Instant> {
        match self {
            State::Backoff { until, .. } => Some(*until),
            _ => None,
        }
    }

    /// Short name (logs, `/metrics` would use it).
    pub fn name(&self) -> &'static str {
        match self {
            State::Off => "off",
            State::Putting { .. } => "putting",
            State::Published { .. } => "published",
            State::Backoff { .. } => "backoff",
            State::Refused { .. } => "refused",
            State::Withdrawn => "withdrawn",
        }
    }
}

/// The transition function (pure).
pub fn step(state: &State, input: &Input, now: Instant) -> (State, Vec<Action>) {
    use Input as I;
    use State as S;
    let same = || (state.clone(), Vec::new());
    let put = |epoch: u64, next_delay: Duration| {
        (
            S::Putting { epoch, next_delay },
            vec![Action::Put { epoch }],
        )
    };
    match (state, input) {
        (S::Withdrawn, _) => same(),
        (_, I::LeftActive) => (
            S::Withdrawn,
            vec![Action::Withdraw {
                was_published: matches!(state, S::Published { .. }),
            }],
        ),
        (S::Off, I::Active { epoch }) => put(*epoch, RETRY_MIN),
        // A re-grant with a new epoch while Active: publish under it.
        (
            S::Putting { epoch: e, .. }
            | S::Published { epoch: e, .. }
            | S::Backoff { epoch: e, .. }
            | S::Refused { epoch: e, .. },
            I::Active { epoch },
        ) if e != epoch => put(*epoch, RETRY_MIN),
        (S::Putting { epoch, .. }, I::Done { epoch: e, revision }) if e == epoch => (
            S::Published {
                epoch: *epoch,
                revision: *revision,
            },
            Vec::new(),
        ),
        (S::Putting { epoch, next_delay }, I::Failed { code }) if code == "unavailable" => (
            S::Backoff {
                epoch: *epoch,
                until: now + *next_delay,
                next_delay: (*next_delay * 2).min(RETRY_MAX),
            },
            Vec::new(),
        ),
        (S::Putting { epoch, .. }, I::Failed { code }) => (
            S::Refused {
                epoch: *epoch,
                code: code.clone(),
            },
            Vec::new(),
        ),
        (
            S::Backoff {
                epoch,
                until,
                next_delay,
            },
            I::Tick,
        ) if now >= *until => put(*epoch, *next_delay),
        _ => same(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn active_puts_and_done_publishes() {
        let t0 = Instant::now();
        let (s, a) = step(&State::Off, &Input::Active { epoch: 41 }, t0);
        assert_eq!(a, vec![Action::Put { epoch: 41 }]);
        assert_eq!(
            s,
            State::Putting {
                epoch: 41,
                next_delay: RETRY_MIN
            }
        );
        let (s, a) = step(
            &s,
            &Input::Done {
                epoch: 41,
                revision: 57,
            },
            t0,
        );
        assert!(a.is_empty());
        assert_eq!(
            s,
            State::Published {
                epoch: 41,
                revision: 57
            }
        );
        assert_eq!(s.wakeup(), None);
    }

    #[test]
    fn nothing_is_put_before_active() {
        let t0 = Instant::now();
        for i in [
            Input::Tick,
            Input::Done {
                epoch: 1,
                revision: 2,
            },
            Input::Failed {
                code: "unavailable".into(),
            },
        ] {
            assert_eq!(step(&State::Off, &i, t0), (State::Off, Vec::new()), "{i:?}");
        }
    }

    #[test]
    fn unavailable_retries_with_a_bounded_backoff() {
        let t0 = Instant::now();
        let (mut s, _) = step(&State::Off, &Input::Active { epoch: 7 }, t0);
        let mut now = t0;
        let mut delays = Vec::new();
        for _ in 0..8 {
            let unavailable = Input::Failed {
                code: "unavailable".into(),
            };
            let (b, a) = step(&s, &unavailable, now);
            assert!(a.is_empty());
            let until = b.wakeup().expect("a retry is timed");
            delays.push(until - now);
            // Early tick: nothing.
            assert_eq!(step(&b, &Input::Tick, until - MS), (b.clone(), Vec::new()));
            now = until;
            let (p, a) = step(&b, &Input::Tick, now);
            assert_eq!(a, vec![Action::Put { epoch: 7 }]);
            s = p;
        }
        assert_eq!(
            delays,
            [100, 200, 400, 800, 1600, 2000, 2000, 2000].map(|m| m * MS)
        );
    }

    #[test]
    fn fenced_is_never_retried() {
        let t0 = Instant::now();
        let (s, _) = step(&State::Off, &Input::Active { epoch: 7 }, t0);
        let (s, a) = step(
            &s,
            &Input::Failed {
                code: "fenced".into(),
            },
            t0,
        );
        assert!(a.is_empty());
        assert_eq!(
            s,
            State::Refused {
                epoch: 7,
                code: "fenced".into()
            }
        );
        assert_eq!(s.wakeup(), None);
        assert_eq!(step(&s, &Input::Tick, t0 + 10 * RETRY_MAX).1, Vec::new());
    }

    #[test]
    fn leaving_active_withdraws_from_every_state_once() {
        let t0 = Instant::now();
        let states = [
            (State::Off, false),
            (
                State::Putting {
                    epoch: 1,
                    next_delay: RETRY_MIN,
                },
                false,
            ),
            (
                State::Published {
                    epoch: 1,
                    revision: 9,
                },
                true,
            ),
            (
                State::Backoff {
                    epoch: 1,
                    until: t0,
                    next_delay: RETRY_MIN,
                },
                false,
            ),
            (
                State::Refused {
                    epoch: 1,
                    code: "fenced".into(),
                },
                false,
            ),
        ];
        for (s, was_published) in states {
            let (w, a) = step(&s, &Input::LeftActive, t0);
            assert_eq!(w, State::Withdrawn, "{s:?}");
            assert_eq!(a, vec![Action::Withdraw { was_published }], "{s:?}");
            // Terminal: a late answer or a re-entry puts nothing.
            for i in [
                Input::LeftActive,
                Input::Active { epoch: 2 },
                Input::Tick,
                Input::Done {
                    epoch: 1,
                    revision: 10,
                },
            ] {
                assert_eq!(step(&w, &i, t0), (State::Withdrawn, Vec::new()), "{i:?}");
            }
        }
    }

    #[test]
    fn a_new_epoch_while_active_publishes_again_and_a_stale_answer_is_ignored() {
        let t0 = Instant::now();
        let published = State::Published {
            epoch: 1,
            revision: 9,
        };
        assert_eq!(
            step(&published, &Input::Active { epoch: 1 }, t0),
            (published.clone(), Vec::new())
        );
        let (s, a) = step(&published, &Input::Active { epoch: 5 }, t0);
        assert_eq!(a, vec![Action::Put { epoch: 5 }]);
        // The answer to a put under the old epoch does not publish the new one.
        let (s2, _) = step(
            &s,
            &Input::Done {
                epoch: 1,
                revision: 10,
            },
            t0,
        );
        assert_eq!(s2, s);
    }
}
