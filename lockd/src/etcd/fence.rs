//! Self-fencing before an etcd lease can expire: a pure state machine (time is an input).
//!
//! lockd keeps one etcd lease per local session alive with keepalives. etcd restarts a
//! lease's TTL when its leader *processes* a keepalive, which is after lockd *sent* it; so
//! after the keepalive sent at `s` is acknowledged with TTL `T`, etcd cannot expire the lease
//! (and so cannot let another node's waiter be granted) before `s + T` on etcd's clock (not
//! so on etcd < 3.4.31 / 3.5.13, whose leader, stalled and resumed, may revoke a lease the next
//! leader keeps alive: etcd-io/etcd#15247, docs/ETCD.md; no deadline computed from the new
//! leader's acknowledgements covers that). On
//! lockd's monotonic clock that is no earlier than `s + T·(1 − ε)` where `ε` bounds the
//! difference of the two clocks' rates. lockd must have its holders dead by then: it tells
//! them `lost` at the **deadline**
//!
//! ```text
//! deadline = s + T − margin,   margin = T·ε + pause + kill
//! ```
//!
//! where `pause` covers lockd's own scheduling delay between the deadline and the `revoked`
//! event reaching the holder, and `kill` is the time the holder's supervisor needs to kill and
//! reap its engine after that event. Every acknowledged keepalive moves the deadline forward;
//! a keepalive that is never acknowledged (etcd unreachable, partition, etcd's leader gone)
//! moves nothing. An acknowledgement with TTL ≤ 0 means etcd no longer has the lease: lost at
//! once.
//!
//! Acknowledgements are matched to sends in order (one keepalive stream: etcd answers the
//! requests of a stream one by one, in order); a new stream forgets the sends of the old one
//! (`StreamReset`), so an answer can never be credited to a later send than its own.
//!
//! Opt-in ([`Fence::freeze_on_term_change`]): once an answer of a newer etcd raft term arrives
//! (`Term`, fed before the answer), nothing more is credited, against etcd < 3.4.31's stale
//! leader revoking the lease when it resumes. With it, an answer is credited only once a
//! linearizable read issued after it comes back in the same term (`Confirmed`): the term in a
//! keepalive answer's header was read *before* the renewal (and is the member's last
//! *applied* entry's term), so a renewal forwarded to a newly elected leader can come back
//! labelled with the old term; crediting it would put the deadline past the stalled old
//! leader's view of the lease (seen in the drill: margin 7 ms of a 500 ms kill budget). A
//! linearizable read is served only by a leader that has committed an entry of its own term
//! and confirmed its leadership with a quorum, and its header is filled after the member has
//! applied that entry: a read issued after the answer and answered in the old term proves no
//! newer leader existed when the renewal was processed, so the old leader processed it.
//!
//! [`Fence::step`] returns what changed; the driver logs one line per transition, sleeps
//! until [`Fence::deadline`], and on [`FenceOutput::Lost`] sends every local holder of the
//! session a `revoked` event whose reason starts with `lost:`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What the margin is made of (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Margin {
    /// Bound on the rate difference between lockd's monotonic clock and etcd's leader's, in
    /// parts per million of the TTL.
    pub drift_ppm: u32,
    /// lockd's own scheduling delay (timer lateness, a GC-free but still preemptible
    /// process) between the deadline and the holder reading `revoked`.
    pub pause: Duration,
    /// The holder's supervisor's kill-and-reap time after `revoked` (measured, see
    /// docs/ETCD.md).
    pub kill: Duration,
}

impl Margin {
    /// The margin for a lease of `ttl`.
    pub fn of(&self, ttl: Duration) -> Duration {
        let drift = ttl.as_micros() * u128::from(self.drift_ppm) / 1_000_000;
        Duration::from_micros(u64::try_from(drift).unwrap_or(u64::MAX)) + self.pause + self.kill
    }
}

/// An input to the fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceInput {
    /// The lease was granted with this TTL (seconds) in answer to a request sent at
    /// `sent_at` (the grant is the first "acknowledged keepalive").
    Granted {
        /// When the grant request was sent.
        sent_at: Instant,
        /// The TTL etcd granted, in seconds.
        ttl_secs: i64,
    },
    /// A keepalive was sent on the current stream (at `now`).
    Sent,
    /// The oldest unanswered keepalive of the current stream was answered with this TTL
    /// (seconds; ≤ 0: etcd does not know the lease any more).
    Acked {
        /// TTL in the answer.
        ttl_secs: i64,
    },
    /// The answer fed next (an `Acked`, or the grant just fed) was given in this etcd raft
    /// term (its header's `raft_term`, filled by the answering member before the renewal).
    Term {
        /// The raft term.
        term: u64,
    },
    /// A linearizable read, issued when [`Fence::acks_seen`] was `acks_before`, was answered
    /// in this raft term (its header's `raft_term`, filled after the read). With
    /// [`Fence::freeze_on_term_change`], the answers held before it are credited if this is
    /// still the term the fence started in.
    Confirmed {
        /// The read's raft term.
        term: u64,
        /// [`Fence::acks_seen`] when the read was issued.
        acks_before: u64,
    },
    /// The keepalive stream was replaced: its unanswered sends can never be credited.
    StreamReset,
    /// Time passes (the driver's timer at the deadline, or any wakeup).
    Tick,
}

/// What the driver must do or log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceOutput {
    /// The deadline moved (to this instant): log at debug.
    Renewed {
        /// The new deadline.
        deadline: Instant,
    },
    /// Tell every local holder of the session `revoked` (reason `lost:…`) now, and treat the
    /// lease as gone. Emitted once.
    Lost {
        /// Why: the deadline passed, or etcd answered TTL ≤ 0.
        cause: LostCause,
    },
}

/// Why the lease is treated as lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostCause {
    /// No keepalive sent after `last_acked_send` was acknowledged before the deadline.
    DeadlinePassed {
        /// How long before `now` the last acknowledged keepalive was sent.
        since_last_ack: Duration,
        /// The deadline that passed.
        deadline: Instant,
    },
    /// etcd answered a keepalive with TTL ≤ 0: it has expired or revoked the lease.
    EtcdExpired,
}

/// The state of one session's lease, as far as fencing is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// No lease yet.
    Idle,
    /// Renewed in time; lost at `deadline` unless renewed.
    Live {
        /// Send time of the last acknowledged keepalive (or of the grant request).
        last_acked_send: Instant,
        /// The TTL etcd gave with that acknowledgement.
        ttl: Duration,
    },
    /// Holders were told; nothing more happens.
    Lost,
}

/// The fence of one session's etcd lease.
#[derive(Debug, Clone)]
pub struct Fence {
    margin: Margin,
    /// PLANTED BUG switch (tests only): ignore the margin, fence at the lease's expiry.
    no_margin: bool,
    /// Opt-in: after a raft term change the deadline no longer moves (see
    /// [`Fence::freeze_on_term_change`]).
    freeze_on_term_change: bool,
    /// The highest raft term an answer was given in.
    term: Option<u64>,
    /// A term change was seen with `freeze_on_term_change`: nothing is credited any more.
    frozen: bool,
    /// With `freeze_on_term_change`: answers wait for a `Confirmed` read before they are
    /// credited (off only with the planted bug).
    confirm: bool,
    /// Positive answers held so far (the sequence number of the next one).
    acks: u64,
    /// Answers held for confirmation: (sequence number, send time, TTL), oldest first.
    held: VecDeque<(u64, Instant, i64)>,
    phase: Phase,
    /// Send times of the keepalives of the current stream not answered yet, oldest first.
    pending: VecDeque<Instant>,
}

/// At most this many unanswered keepalives are remembered (older ones cannot matter: they
/// would only move the deadline less than the newer ones).
const MAX_PENDING: usize = 64;

impl Fence {
    /// A fence with this margin.
    pub fn new(margin: Margin) -> Fence {
        Fence {
            margin,
            no_margin: false,
            freeze_on_term_change: false,
            term: None,
            frozen: false,
            confirm: false,
            acks: 0,
            held: VecDeque::new(),
            phase: Phase::Idle,
            pending: VecDeque::new(),
        }
    }

    /// The planted bug of the fence test: the deadline ignores the margin (holders are told
    /// only when etcd may already have expired the lease).
    pub fn planted_bug_no_margin(mut self) -> Fence {
        self.no_margin = true;
        self
    }

    /// Opt-in safety against etcd < 3.4.31 / 3.5.13 (etcd-io/etcd#15247): a leader that was
    /// stalled revokes, when it resumes, the leases it saw no renewal of, however well the new
    /// leader kept them alive. Its view of this lease ends no earlier than the last send it
    /// acknowledged + TTL, and every answer it gave carries the old term; so once an answer of
    /// a newer term arrives, the deadline stays where the old term's answers put it (answers
    /// of the new term are not credited; TTL ≤ 0 is still lost at once). The cost: every etcd
    /// leader change — a kill or a restart as well as a stall — ends in this session's fence.
    ///
    /// An answer's own term does not show which leader renewed (see the module docs), so with
    /// this an answer is held until a linearizable read issued after it is answered in the
    /// same term ([`FenceInput::Confirmed`]).
    pub fn freeze_on_term_change(mut self) -> Fence {
        self.freeze_on_term_change = true;
        self.confirm = true;
        self
    }

    /// The planted bug of the paused-leader test: with [`Fence::freeze_on_term_change`],
    /// credit an answer of the old term at once, without a confirming read (a renewal that a
    /// new leader processed, labelled with the old term, moves the deadline past the old
    /// leader's view of the lease).
    pub fn planted_bug_credit_unconfirmed(mut self) -> Fence {
        self.confirm = false;
        self
    }

    /// A term change was seen with [`Fence::freeze_on_term_change`]: nothing is credited any
    /// more, the deadline stands where the old term put it.
    pub fn frozen(&self) -> bool {
        self.frozen
    }

    /// Positive answers held so far: a read issued now confirms those before this number.
    pub fn acks_seen(&self) -> u64 {
        self.acks
    }

    /// Answers are waiting for a confirming read: the driver should issue one (a
    /// linearizable read) and feed its term as [`FenceInput::Confirmed`].
    pub fn needs_confirmation(&self) -> bool {
        !self.held.is_empty()
    }

    /// The current phase.
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// When holders are told `lost` unless renewed (None: idle or lost already).
    pub fn deadline(&self) -> Option<Instant> {
        match self.phase {
            Phase::Live {
                last_acked_send,
                ttl,
            } => Some(last_acked_send + ttl.saturating_sub(self.margin_for(ttl))),
            _ => None,
        }
    }

    fn margin_for(&self, ttl: Duration) -> Duration {
        if self.no_margin {
            Duration::ZERO
        } else {
            self.margin.of(ttl)
        }
    }

    /// Feed one input at `now`.
    pub fn step(&mut self, now: Instant, input: FenceInput) -> Option<FenceOutput> {
        if self.phase == Phase::Lost {
            return None;
        }
        // Time first: a deadline that passed before this input is lost whatever it is (an
        // acknowledgement arriving after the deadline cannot undo the telling).
        if let Some(out) = self.check_deadline(now) {
            return Some(out);
        }
        match input {
            FenceInput::Granted { sent_at, ttl_secs } => {
                self.pending.clear();
                self.credit(sent_at, ttl_secs)
            }
            FenceInput::Sent => {
                if self.pending.len() == MAX_PENDING {
                    self.pending.pop_front();
                }
                self.pending.push_back(now);
                None
            }
            FenceInput::Acked { ttl_secs } => match self.pending.pop_front() {
                Some(sent_at) if ttl_secs > 0 && self.confirm => {
                    if !self.frozen {
                        if self.held.len() == MAX_PENDING {
                            self.held.pop_front();
                        }
                        self.held.push_back((self.acks, sent_at, ttl_secs));
                        self.acks += 1;
                    }
                    None
                }
                Some(sent_at) => self.credit(sent_at, ttl_secs),
                // An answer to nothing we sent on this stream: credit nothing.
                None => None,
            },
            FenceInput::Term { term } => {
                self.see_term(term);
                None
            }
            FenceInput::Confirmed { term, acks_before } => {
                self.see_term(term);
                let mut out = None;
                while let Some(&(seq, sent_at, ttl_secs)) = self.held.front() {
                    if seq >= acks_before {
                        break;
                    }
                    self.held.pop_front();
                    // Only a read of the fence's own term proves the old leader renewed.
                    if !self.frozen && self.term == Some(term) {
                        out = self.credit(sent_at, ttl_secs).or(out);
                    }
                }
                out
            }
            FenceInput::StreamReset => {
                self.pending.clear();
                None
            }
            FenceInput::Tick => None,
        }
    }

    fn see_term(&mut self, term: u64) {
        if self.term.is_some_and(|t| term > t) && self.freeze_on_term_change {
            self.frozen = true;
            // Held answers may have been renewed by the new leader: never credited.
            self.held.clear();
        }
        self.term = Some(self.term.map_or(term, |t| t.max(term)));
    }

    fn check_deadline(&mut self, now: Instant) -> Option<FenceOutput> {
        let (deadline, last) = match (&self.phase, self.deadline()) {
            (
                Phase::Live {
                    last_acked_send, ..
                },
                Some(d),
            ) => (d, *last_acked_send),
            _ => return None,
        };
        if now < deadline {
            return None;
        }
        self.phase = Phase::Lost;
        self.pending.clear();
        self.held.clear();
        Some(FenceOutput::Lost {
            cause: LostCause::DeadlinePassed {
                since_last_ack: now.saturating_duration_since(last),
                deadline,
            },
        })
    }

    fn credit(&mut self, sent_at: Instant, ttl_secs: i64) -> Option<FenceOutput> {
        if ttl_secs <= 0 {
            self.phase = Phase::Lost;
            self.pending.clear();
            self.held.clear();
            return Some(FenceOutput::Lost {
                cause: LostCause::EtcdExpired,
            });
        }
        if self.frozen {
            return None;
        }
        let ttl = Duration::from_secs(u64::try_from(ttl_secs).unwrap_or(0));
        // Never move the deadline backwards (an answer to an older send, or a smaller TTL,
        // must not shorten what a newer answer proved... nor lengthen past what it proves).
        let new_deadline = sent_at + ttl.saturating_sub(self.margin_for(ttl));
        if let Some(d) = self.deadline() {
            if new_deadline <= d {
                return None;
            }
        }
        self.phase = Phase::Live {
            last_acked_send: sent_at,
            ttl,
        };
        Some(FenceOutput::Renewed {
            deadline: new_deadline,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// TTL 2 s, drift 1 % (20 ms), pause 100 ms, kill 500 ms: margin 620 ms.
    const MARGIN: Margin = Margin {
        drift_ppm: 10_000,
        pause: Duration::from_millis(100),
        kill: Duration::from_millis(500),
    };

    /// The margin a 2 s lease leaves: a keepalive sent at `s` moves the deadline to `s + 1380`.
    const WINDOW: u64 = 1380;

    fn fence() -> Fence {
        Fence::new(MARGIN)
    }

    /// `f` after a 2 s lease granted at `t0` (the request sent at `t0`), the etcd term at the
    /// grant fed first when given.
    fn granted(mut f: Fence, term: Option<u64>, t0: Instant) -> Fence {
        if let Some(term) = term {
            f.step(t0, FenceInput::Term { term });
        }
        f.step(
            t0,
            FenceInput::Granted {
                sent_at: t0,
                ttl_secs: 2,
            },
        );
        f
    }

    /// A freezing fence granted at `t0` in `term`.
    fn granted_in_term(term: u64, t0: Instant) -> Fence {
        granted(fence().freeze_on_term_change(), Some(term), t0)
    }

    /// A keepalive answer at `at` (its header's term fed first, as the driver does).
    fn answer(f: &mut Fence, at: Instant, term: Option<u64>, ttl_secs: i64) -> Option<FenceOutput> {
        if let Some(term) = term {
            f.step(at, FenceInput::Term { term });
        }
        f.step(at, FenceInput::Acked { ttl_secs })
    }

    /// A confirming read issued now (after every answer seen so far), answered at `at` in `term`.
    fn confirm(f: &mut Fence, at: Instant, term: u64) -> Option<FenceOutput> {
        let acks_before = f.acks_seen();
        f.step(at, FenceInput::Confirmed { term, acks_before })
    }

    /// What crediting the keepalive sent at `t0 + sent` returns.
    fn renewed_from(t0: Instant, sent: u64) -> Option<FenceOutput> {
        Some(FenceOutput::Renewed {
            deadline: t0 + ms(sent + WINDOW),
        })
    }

    const EXPIRED: Option<FenceOutput> = Some(FenceOutput::Lost {
        cause: LostCause::EtcdExpired,
    });

    #[test]
    fn margin_adds_drift_pause_and_kill() {
        assert_eq!(MARGIN.of(Duration::from_secs(2)), ms(620));
        assert_eq!(MARGIN.of(Duration::from_secs(5)), ms(650));
    }

    #[test]
    fn idle_fence_has_no_deadline_and_never_fires() {
        let t0 = Instant::now();
        let mut f = fence();
        assert_eq!(f.deadline(), None);
        assert_eq!(f.step(t0 + ms(100_000), FenceInput::Tick), None);
        assert_eq!(f.phase(), &Phase::Idle);
    }

    #[test]
    fn grant_sets_the_deadline_from_the_request_send_time() {
        let t0 = Instant::now();
        let mut f = fence();
        let out = f.step(
            t0 + ms(5),
            FenceInput::Granted {
                sent_at: t0,
                ttl_secs: 2,
            },
        );
        assert_eq!(out, renewed_from(t0, 0));
        assert_eq!(f.deadline(), Some(t0 + ms(WINDOW)));
    }

    #[test]
    fn ack_credits_the_send_time_not_the_ack_time() {
        let t0 = Instant::now();
        let mut f = granted(fence(), None, t0);
        assert_eq!(f.step(t0 + ms(500), FenceInput::Sent), None);
        // Answered 300 ms later: the deadline counts from the send (500), not the answer.
        assert_eq!(answer(&mut f, t0 + ms(800), None, 2), renewed_from(t0, 500));
    }

    #[test]
    fn acks_are_matched_to_sends_in_order() {
        let t0 = Instant::now();
        let mut f = granted(fence(), None, t0);
        f.step(t0 + ms(100), FenceInput::Sent);
        f.step(t0 + ms(200), FenceInput::Sent);
        assert_eq!(answer(&mut f, t0 + ms(250), None, 2), renewed_from(t0, 100));
        assert_eq!(answer(&mut f, t0 + ms(260), None, 2), renewed_from(t0, 200));
        // A third answer without a send credits nothing.
        assert_eq!(answer(&mut f, t0 + ms(270), None, 2), None);
        assert_eq!(f.deadline(), Some(t0 + ms(200 + WINDOW)));
    }

    #[test]
    fn unanswered_keepalives_do_not_move_the_deadline_and_it_fires_once() {
        let t0 = Instant::now();
        let mut f = granted(fence(), None, t0);
        for i in 1..=4 {
            assert_eq!(f.step(t0 + ms(300 * i), FenceInput::Sent), None);
        }
        assert_eq!(f.step(t0 + ms(WINDOW - 1), FenceInput::Tick), None);
        let out = f.step(t0 + ms(WINDOW), FenceInput::Tick);
        assert_eq!(
            out,
            Some(FenceOutput::Lost {
                cause: LostCause::DeadlinePassed {
                    since_last_ack: ms(WINDOW),
                    deadline: t0 + ms(WINDOW)
                }
            })
        );
        assert_eq!(f.phase(), &Phase::Lost);
        assert_eq!(f.deadline(), None);
        // Once only, and nothing revives it.
        assert_eq!(f.step(t0 + ms(1400), FenceInput::Tick), None);
        assert_eq!(answer(&mut f, t0 + ms(1400), None, 2), None);
    }

    #[test]
    fn an_ack_arriving_after_the_deadline_does_not_undo_it() {
        let t0 = Instant::now();
        let mut f = granted(fence(), None, t0);
        f.step(t0 + ms(1000), FenceInput::Sent);
        // The answer comes late (after the deadline at 1380): lost, not renewed.
        let out = answer(&mut f, t0 + ms(1500), None, 2);
        assert!(matches!(out, Some(FenceOutput::Lost { .. })), "{out:?}");
    }

    #[test]
    fn etcd_answering_ttl_zero_is_lost_at_once() {
        let t0 = Instant::now();
        let mut f = granted(fence(), None, t0);
        f.step(t0 + ms(100), FenceInput::Sent);
        assert_eq!(answer(&mut f, t0 + ms(110), None, 0), EXPIRED);
    }

    #[test]
    fn stream_reset_forgets_unanswered_sends() {
        let t0 = Instant::now();
        let mut f = granted(fence(), None, t0);
        f.step(t0 + ms(100), FenceInput::Sent);
        assert_eq!(f.step(t0 + ms(200), FenceInput::StreamReset), None);
        // The new stream's first answer belongs to its first send (at 300), never to 100.
        f.step(t0 + ms(300), FenceInput::Sent);
        assert_eq!(answer(&mut f, t0 + ms(310), None, 2), renewed_from(t0, 300));
    }

    #[test]
    fn the_deadline_never_moves_backwards() {
        let t0 = Instant::now();
        let mut f = fence();
        f.step(
            t0 + ms(1000),
            FenceInput::Granted {
                sent_at: t0 + ms(1000),
                ttl_secs: 5,
            },
        );
        let d = f.deadline().unwrap();
        f.step(t0 + ms(1100), FenceInput::Sent);
        // A smaller TTL in the answer would shorten it: ignored (the longer proof stands).
        assert_eq!(answer(&mut f, t0 + ms(1200), None, 2), None);
        assert_eq!(f.deadline(), Some(d));
    }

    #[test]
    fn a_term_change_moves_nothing_by_default() {
        let t0 = Instant::now();
        let mut f = granted(fence(), Some(3), t0);
        f.step(t0 + ms(500), FenceInput::Sent);
        assert_eq!(f.step(t0 + ms(510), FenceInput::Term { term: 4 }), None);
        assert_eq!(answer(&mut f, t0 + ms(510), None, 2), renewed_from(t0, 500));
    }

    #[test]
    fn with_freeze_an_answer_of_a_newer_term_is_not_credited() {
        let t0 = Instant::now();
        let mut f = granted_in_term(3, t0);
        // Same term, confirmed by a read of the same term: credited.
        f.step(t0 + ms(500), FenceInput::Sent);
        assert_eq!(answer(&mut f, t0 + ms(505), Some(3), 2), None);
        assert_eq!(confirm(&mut f, t0 + ms(507), 3), renewed_from(t0, 500));
        // A new leader answers (term 4): the deadline stays at the old term's.
        f.step(t0 + ms(1000), FenceInput::Sent);
        assert_eq!(f.step(t0 + ms(1005), FenceInput::Term { term: 4 }), None);
        assert_eq!(answer(&mut f, t0 + ms(1005), None, 2), None);
        assert_eq!(f.deadline(), Some(t0 + ms(500 + WINDOW)));
        // An answer of the old term again (a lagging member) does not revive it either.
        f.step(t0 + ms(1200), FenceInput::Sent);
        assert_eq!(answer(&mut f, t0 + ms(1205), Some(3), 2), None);
        // TTL 0 is still lost at once.
        f.step(t0 + ms(1300), FenceInput::Sent);
        assert_eq!(answer(&mut f, t0 + ms(1305), None, 0), EXPIRED);
    }

    #[test]
    fn with_freeze_the_fence_fires_at_the_old_terms_deadline() {
        let t0 = Instant::now();
        let mut f = granted_in_term(7, t0);
        // The leader changed before any keepalive answer: the grant's deadline stands.
        f.step(t0 + ms(300), FenceInput::Sent);
        assert_eq!(answer(&mut f, t0 + ms(900), Some(8), 2), None);
        assert_eq!(f.step(t0 + ms(WINDOW - 1), FenceInput::Tick), None);
        assert!(matches!(
            f.step(t0 + ms(WINDOW), FenceInput::Tick),
            Some(FenceOutput::Lost {
                cause: LostCause::DeadlinePassed { .. }
            })
        ));
    }

    #[test]
    fn with_freeze_an_answer_waits_for_a_read_issued_after_it() {
        let t0 = Instant::now();
        let mut f = granted_in_term(3, t0);
        assert!(!f.needs_confirmation());
        f.step(t0 + ms(500), FenceInput::Sent);
        // A read issued before the answer arrived proves nothing about it.
        let before = f.acks_seen();
        assert_eq!(answer(&mut f, t0 + ms(505), Some(3), 2), None);
        assert!(f.needs_confirmation());
        assert_eq!(
            f.step(
                t0 + ms(506),
                FenceInput::Confirmed {
                    term: 3,
                    acks_before: before
                }
            ),
            None
        );
        assert_eq!(f.deadline(), Some(t0 + ms(WINDOW)));
        // The next read, issued after it, credits it with its send time.
        assert_eq!(confirm(&mut f, t0 + ms(520), 3), renewed_from(t0, 500));
        assert!(!f.needs_confirmation());
    }

    /// The drill's finding (margin 7 ms of a 500 ms kill budget): etcd's leader is paused; a
    /// follower fills a keepalive answer's header with the old term, then forwards the renewal
    /// to the newly elected leader. The old leader never saw that renewal and, resumed,
    /// revokes the lease at its own view's end. The read after the answer is in the new term:
    /// the answer is never credited, the deadline stays at the old leader's view.
    #[test]
    fn a_renewal_the_new_leader_processed_under_the_old_terms_label_is_not_credited() {
        let t0 = Instant::now();
        for bug in [false, true] {
            let mut f = granted_in_term(3, t0);
            if bug {
                f = f.planted_bug_credit_unconfirmed();
            }
            // t0 + 400: the leader stops. The keepalive sent at 900 reaches a follower still
            // at term 3, which forwards it to the new leader (term 4).
            f.step(t0 + ms(900), FenceInput::Sent);
            let credited = answer(&mut f, t0 + ms(902), Some(3), 2);
            let read = confirm(&mut f, t0 + ms(904), 4);
            // The old leader's view ends at 0 + 2000: holders must be dead by then.
            if bug {
                assert!(credited.is_some(), "the planted bug credits at once");
                assert_eq!(f.deadline(), Some(t0 + ms(900 + WINDOW)));
            } else {
                assert_eq!((credited, read), (None, None));
                assert_eq!(f.deadline(), Some(t0 + ms(WINDOW)));
                // Nothing later revives it, not even a read of the old term.
                f.step(t0 + ms(1000), FenceInput::Sent);
                answer(&mut f, t0 + ms(1001), Some(3), 2);
                assert!(!f.needs_confirmation());
                confirm(&mut f, t0 + ms(1002), 3);
                assert_eq!(f.deadline(), Some(t0 + ms(WINDOW)));
                assert!(matches!(
                    f.step(t0 + ms(WINDOW), FenceInput::Tick),
                    Some(FenceOutput::Lost { .. })
                ));
            }
        }
    }

    #[test]
    fn with_freeze_a_confirmed_batch_credits_its_latest_send_and_ttl_zero_is_still_at_once() {
        let t0 = Instant::now();
        let mut f = granted_in_term(5, t0);
        for at in [300u64, 600, 900] {
            f.step(t0 + ms(at), FenceInput::Sent);
        }
        for at in [301u64, 601, 901] {
            assert_eq!(answer(&mut f, t0 + ms(at), Some(5), 2), None);
        }
        assert_eq!(confirm(&mut f, t0 + ms(905), 5), renewed_from(t0, 900));
        f.step(t0 + ms(1000), FenceInput::Sent);
        assert_eq!(answer(&mut f, t0 + ms(1001), None, 0), EXPIRED);
    }

    #[test]
    fn without_freeze_answers_are_credited_at_once_and_reads_change_nothing() {
        let t0 = Instant::now();
        let mut f = granted(fence(), Some(3), t0);
        f.step(t0 + ms(500), FenceInput::Sent);
        assert!(answer(&mut f, t0 + ms(501), Some(4), 2).is_some());
        assert!(!f.needs_confirmation());
        assert_eq!(
            f.step(
                t0 + ms(502),
                FenceInput::Confirmed {
                    term: 5,
                    acks_before: 9
                }
            ),
            None
        );
        assert_eq!(f.deadline(), Some(t0 + ms(500 + WINDOW)));
    }

    #[test]
    fn planted_bug_fences_only_at_expiry() {
        let t0 = Instant::now();
        let mut f = granted(fence().planted_bug_no_margin(), None, t0);
        assert_eq!(f.deadline(), Some(t0 + ms(2000)));
        assert_eq!(f.step(t0 + ms(1999), FenceInput::Tick), None);
        assert!(f.step(t0 + ms(2000), FenceInput::Tick).is_some());
    }

    /// The safety property the margin buys, over a sweep of keepalive schedules: whenever the
    /// fence fires, the holder (told at the deadline, dead `pause + kill` later at worst) is
    /// dead before etcd's earliest possible expiry of the lease `s + T·(1 − ε)`; and with the
    /// planted bug it is not.
    #[test]
    fn holders_are_dead_before_the_earliest_expiry() {
        let m = MARGIN;
        let t0 = Instant::now();
        for ttl_secs in [2i64, 3, 5, 10] {
            let ttl = Duration::from_secs(ttl_secs as u64);
            for last_ack_at in [0u64, 250, 700, 1200] {
                for bug in [false, true] {
                    let mut f = Fence::new(m);
                    if bug {
                        f = f.planted_bug_no_margin();
                    }
                    f.step(
                        t0,
                        FenceInput::Granted {
                            sent_at: t0,
                            ttl_secs,
                        },
                    );
                    f.step(t0 + ms(last_ack_at), FenceInput::Sent);
                    f.step(t0 + ms(last_ack_at + 1), FenceInput::Acked { ttl_secs });
                    // Then silence: step every ms until it fires.
                    let mut now = t0 + ms(last_ack_at + 1);
                    let told = loop {
                        if let Some(FenceOutput::Lost { .. }) = f.step(now, FenceInput::Tick) {
                            break now;
                        }
                        now += ms(1);
                    };
                    let dead_by = told + m.pause + m.kill;
                    let drift = ttl.as_micros() as u64 * u64::from(m.drift_ppm) / 1_000_000;
                    let earliest_expiry = t0 + ms(last_ack_at) + ttl - Duration::from_micros(drift);
                    if bug {
                        assert!(
                            dead_by > earliest_expiry,
                            "the planted bug must be caught (ttl {ttl_secs})"
                        );
                    } else {
                        assert!(
                            dead_by <= earliest_expiry,
                            "ttl {ttl_secs}, last ack {last_ack_at}: dead by {:?} after the \
                             earliest expiry",
                            dead_by - earliest_expiry
                        );
                    }
                }
            }
        }
    }
}
