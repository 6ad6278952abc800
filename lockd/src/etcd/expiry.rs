//! A waiter enforces its predecessor's etcd lease expiry (`--etcd-enforce-expiry`, on by
//! default): it revokes a lease that has *provably* expired on etcd's leader, instead of
//! waiting for etcd to notice.
//!
//! **Why.** etcd 3.4's leader looks for expired leases only every 500 ms (`lease/lessor.go`:
//! `runLoop` → `revokeExpiredLeases` every 500 ms), so after a holder's node is cut off the
//! next waiter is granted up to 500 ms after the lease really expired: failovers of TTL + 0.5 s.
//! The waiter can see the expiry earlier, from the leader's own clock, through
//! `LeaseTimeToLive` — but etcd reports the remaining time **truncated to whole seconds**
//! (`leasehttp`/`v3_server.go`: `TTL: int64(l.Remaining().Seconds())`; the API doc: "the
//! lease will expire in under TTL+1 seconds"), so one answer of 0 only says "less than a
//! second left".
//!
//! **Rule** (pure, [`Watch`]): two answers of 0, `b` then `c`, from the same raft term, with
//! `c` sent at least 1 s (+ slack) after `b` was received and `c` received at most
//! `T − 1 s` (− slack) after `b` was sent (`T`: the lease's granted TTL), prove the lease
//! expired on the leader with no renewal in between:
//!
//! * remaining(b) < 1 s, so without a renewal the lease expired by `b + 1 s ≤ c`;
//! * a renewal processed at `p` between `b` and `c` would have left remaining(c) =
//!   `T − (c − p) > T − (c − b) ≥ 1 s`: `c` would not say 0; a leader change in between
//!   would have given the lease a full TTL (and a new term) as well.
//!
//! Then a linearizable read must still see the same raft term (the answers came from that
//! term's leader, not from a deposed one that still believed it led), and only then the
//! waiter revokes the lease. An expired lease cannot be renewed on etcd's leader any more (its
//! `Renew` waits for the revocation), so the revoke happens no earlier than etcd's own expiry
//! would have: the holder's self-fence argument (docs/ETCD.md: the lease cannot expire before
//! `s + T·(1 − ε)`) is unchanged, only etcd's 0–500 ms detection delay goes. Precision: the
//! first 0 is seen within one fine poll of remaining dropping below 1 s, so the revoke comes
//! about a fine poll (50 ms) plus the slack and three round trips after the real expiry.
//!
//! With `T ≤ 2 s` both bounds cannot hold at once and the rule never fires (etcd's own expiry
//! then decides); an answer without a raft term (0) never confirms. Polling: while the lease
//! reports 2 s or more, next at `b_sent + (ttl − 1) s` (a kept-alive lease with `T ≥ 3 s`
//! reports ≥ 2 s, so about one poll per second); at 1 s, every fine poll; after a 0, once more
//! 1 s later.

use std::time::{Duration, Instant};

use etcd_client::Client;
use tracing::{debug, info, warn};

use super::mutex::bounded;

const SEC: Duration = Duration::from_secs(1);

/// One `LeaseTimeToLive` answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    /// When the request was sent (monotonic).
    pub sent: Instant,
    /// When the answer arrived.
    pub recv: Instant,
    /// Remaining seconds, truncated (−1: no such lease).
    pub ttl: i64,
    /// The lease's granted TTL in seconds.
    pub granted_ttl: i64,
    /// The answering member's raft term (0: not reported).
    pub term: u64,
}

/// What the driver does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Ask again at this time.
    PollAt(Instant),
    /// Do a linearizable read and report its raft term with [`Watch::confirmed`].
    Confirm {
        /// The term the two answers of 0 came from.
        term: u64,
    },
    /// The lease expired on the leader: revoke it.
    Revoke,
    /// The lease is gone (etcd answered −1): nothing to do.
    Gone,
    /// The rule cannot fire for this lease (granted TTL ≤ 2 s): stop watching.
    Off,
}

#[derive(Debug, Clone, Copy)]
struct Zero {
    sent: Instant,
    recv: Instant,
    term: u64,
}

/// The pure rule (module doc), fed with answers; no I/O, time is an input.
#[derive(Debug, Clone)]
pub struct Watch {
    fine: Duration,
    slack: Duration,
    first_zero: Option<Zero>,
    planted_early: bool,
}

impl Watch {
    /// `fine`: the poll period while 1 s is reported; `slack`: added to both bounds (clock
    /// rate differences over the 1 s gap, scheduling).
    pub fn new(fine: Duration, slack: Duration) -> Watch {
        Watch {
            fine,
            slack,
            first_zero: None,
            planted_early: false,
        }
    }

    /// PLANTED BUG (tests only; `LOCKD_PLANTED_BUG_EXPIRY_EARLY=1`): revoke at the first
    /// answer of 0, up to a second before the lease expires.
    pub fn planted_bug_early(mut self) -> Watch {
        self.planted_early = true;
        self
    }

    /// The next step after an answer.
    pub fn answer(&mut self, a: Answer) -> Step {
        if a.ttl < 0 {
            return Step::Gone;
        }
        if a.granted_ttl <= 2 && !self.planted_early {
            return Step::Off;
        }
        if a.ttl >= 1 {
            self.first_zero = None;
            let next = if a.ttl >= 2 {
                a.sent + SEC * u32::try_from(a.ttl - 1).unwrap_or(u32::MAX / 2)
            } else {
                a.recv + self.fine
            };
            return Step::PollAt(next.max(a.recv + self.fine));
        }
        if self.planted_early {
            return Step::Revoke;
        }
        let granted = SEC * u32::try_from(a.granted_ttl).unwrap_or(u32::MAX / 2);
        match self.first_zero {
            Some(z)
                if a.term != 0
                    && a.term == z.term
                    && a.sent >= z.recv + SEC + self.slack
                    && a.recv + SEC + self.slack <= z.sent + granted =>
            {
                Step::Confirm { term: a.term }
            }
            _ => {
                self.first_zero = Some(Zero {
                    sent: a.sent,
                    recv: a.recv,
                    term: a.term,
                });
                Step::PollAt(a.recv + SEC + self.slack)
            }
        }
    }

    /// The linearizable read's raft term after [`Step::Confirm`].
    pub fn confirmed(&mut self, now: Instant, asked: u64, term_now: u64) -> Step {
        if term_now == asked {
            Step::Revoke
        } else {
            self.first_zero = None;
            Step::PollAt(now)
        }
    }

    /// An etcd call failed: ask again after the fine period (the pairing rule compares the
    /// answers' own times, so a gap loses nothing).
    pub fn failed(&mut self, now: Instant) -> Step {
        Step::PollAt(now + self.fine)
    }
}

/// Settings of the driver.
#[derive(Debug, Clone, Copy)]
pub struct EnforceCfg {
    /// Bound on one etcd call.
    pub limit: Duration,
    /// [`Watch::new`]'s fine period.
    pub fine: Duration,
    /// [`Watch::new`]'s slack.
    pub slack: Duration,
    /// The planted bug (see [`Watch::planted_bug_early`]).
    pub planted_early: bool,
}

/// Drives [`Watch`] for `lease` (the predecessor's), the key `key` read for the
/// linearizable confirmation. Returns when it revoked the lease, when the lease is gone, or
/// when the rule cannot apply; the caller keeps waiting for the key's deletion either way.
pub async fn enforce(
    mut client: Client,
    cfg: EnforceCfg,
    lease: i64,
    key: String,
    revoked: prometheus_client::metrics::counter::Counter,
) {
    let mut w = Watch::new(cfg.fine, cfg.slack);
    if cfg.planted_early {
        w = w.planted_bug_early();
    }
    let lease_hex = format!("{lease:016x}");
    let mut step = Step::PollAt(Instant::now());
    loop {
        step = match step {
            Step::PollAt(at) => {
                tokio::time::sleep_until(at.into()).await;
                let sent = Instant::now();
                match bounded(cfg.limit, client.lease_time_to_live(lease, None)).await {
                    Ok(r) => w.answer(Answer {
                        sent,
                        recv: Instant::now(),
                        ttl: r.ttl(),
                        granted_ttl: r.granted_ttl(),
                        term: r.header().map_or(0, |h| h.raft_term()),
                    }),
                    Err(e) => {
                        debug!(lease = %lease_hex, error = %e, "expiry watch: TimeToLive failed");
                        w.failed(Instant::now())
                    }
                }
            }
            Step::Confirm { term } => {
                match bounded(cfg.limit, client.get(key.as_str(), None)).await {
                    Ok(r) => {
                        let now_term = r.header().map_or(0, |h| h.raft_term());
                        w.confirmed(Instant::now(), term, now_term)
                    }
                    Err(e) => {
                        debug!(lease = %lease_hex, error = %e, "expiry watch: confirming read failed");
                        w.failed(Instant::now())
                    }
                }
            }
            Step::Revoke => {
                match bounded(cfg.limit, client.lease_revoke(lease)).await {
                    Ok(_) => {
                        revoked.inc();
                        info!(lease = %lease_hex, key = %key,
                            planted_bug_early = cfg.planted_early,
                            "expiry watch: the predecessor's etcd lease expired on the leader; revoked it")
                    }
                    Err(e) => {
                        warn!(lease = %lease_hex, error = %e, "expiry watch: revoke failed (etcd expires the lease itself)")
                    }
                }
                return;
            }
            Step::Gone | Step::Off => return,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn watch() -> Watch {
        Watch::new(ms(50), ms(20))
    }

    /// An answer sent at `t0 + at` ms, received 2 ms later.
    fn ans(t0: Instant, at: u64, ttl: i64, term: u64) -> Answer {
        Answer {
            sent: t0 + ms(at),
            recv: t0 + ms(at + 2),
            ttl,
            granted_ttl: 3,
            term,
        }
    }

    #[test]
    fn a_kept_alive_lease_is_polled_about_once_a_second() {
        let t0 = Instant::now();
        let mut w = watch();
        assert_eq!(w.answer(ans(t0, 0, 2, 5)), Step::PollAt(t0 + ms(1000)));
        // Just after a renewal: 3 s reported (remaining in [3, 4) cannot be, but 2 s more
        // than 1 is what matters): next at sent + 2 s.
        assert_eq!(w.answer(ans(t0, 1000, 3, 5)), Step::PollAt(t0 + ms(3000)));
    }

    #[test]
    fn at_one_second_left_it_polls_finely_and_after_a_zero_once_more_a_second_later() {
        let t0 = Instant::now();
        let mut w = watch();
        assert_eq!(w.answer(ans(t0, 0, 1, 5)), Step::PollAt(t0 + ms(52)));
        assert_eq!(
            w.answer(ans(t0, 52, 0, 5)),
            Step::PollAt(t0 + ms(54 + 1020))
        );
        // The second zero, 1,020 ms after the first's arrival, the same term: confirm.
        assert_eq!(w.answer(ans(t0, 1074, 0, 5)), Step::Confirm { term: 5 });
        assert_eq!(w.confirmed(t0 + ms(1080), 5, 5), Step::Revoke);
    }

    #[test]
    fn a_second_zero_too_soon_does_not_prove_the_expiry() {
        let t0 = Instant::now();
        let mut w = watch();
        w.answer(ans(t0, 0, 0, 5));
        // 900 ms later: the lease may still have 100 ms left.
        assert_eq!(
            w.answer(ans(t0, 900, 0, 5)),
            Step::PollAt(t0 + ms(902 + 1020))
        );
        // That zero is the new first one: the next proves it.
        assert_eq!(w.answer(ans(t0, 1922, 0, 5)), Step::Confirm { term: 5 });
    }

    #[test]
    fn a_second_zero_too_late_could_hide_a_renewal() {
        let t0 = Instant::now();
        let mut w = watch();
        w.answer(ans(t0, 0, 0, 5));
        // Received 2,100 ms after the first was sent, T = 3 s: a renewal at 50 ms would have
        // run down to 0.95 s by then and also read 0. Not proof.
        let step = w.answer(ans(t0, 2098, 0, 5));
        assert_eq!(step, Step::PollAt(t0 + ms(2100 + 1020)));
    }

    #[test]
    fn a_renewal_in_between_resets_the_rule() {
        let t0 = Instant::now();
        let mut w = watch();
        w.answer(ans(t0, 0, 0, 5));
        assert_eq!(w.answer(ans(t0, 500, 2, 5)), Step::PollAt(t0 + ms(1500)));
        assert_eq!(
            w.answer(ans(t0, 1500, 0, 5)),
            Step::PollAt(t0 + ms(1502 + 1020))
        );
    }

    #[test]
    fn answers_of_different_terms_or_without_a_term_never_confirm() {
        let t0 = Instant::now();
        let mut w = watch();
        w.answer(ans(t0, 0, 0, 5));
        assert!(matches!(w.answer(ans(t0, 1100, 0, 6)), Step::PollAt(_)));
        let mut w = watch();
        w.answer(ans(t0, 0, 0, 0));
        assert!(matches!(w.answer(ans(t0, 1100, 0, 0)), Step::PollAt(_)));
    }

    #[test]
    fn a_new_term_at_the_confirming_read_means_a_deposed_leader_may_have_answered() {
        let t0 = Instant::now();
        let mut w = watch();
        w.answer(ans(t0, 0, 0, 5));
        assert_eq!(w.answer(ans(t0, 1100, 0, 5)), Step::Confirm { term: 5 });
        assert_eq!(
            w.confirmed(t0 + ms(1110), 5, 6),
            Step::PollAt(t0 + ms(1110))
        );
        // The pairing starts over: one zero is not enough.
        assert!(matches!(w.answer(ans(t0, 1110, 0, 6)), Step::PollAt(_)));
    }

    #[test]
    fn short_leases_and_gone_leases_end_the_watch() {
        let t0 = Instant::now();
        let mut w = watch();
        let mut a = ans(t0, 0, 1, 5);
        a.granted_ttl = 2;
        assert_eq!(w.answer(a), Step::Off);
        assert_eq!(watch().answer(ans(t0, 0, -1, 5)), Step::Gone);
    }

    #[test]
    fn the_planted_bug_revokes_at_the_first_zero() {
        let t0 = Instant::now();
        let mut w = watch().planted_bug_early();
        assert_eq!(w.answer(ans(t0, 0, 0, 5)), Step::Revoke);
    }

    #[test]
    fn a_failed_call_retries_after_the_fine_period() {
        let t0 = Instant::now();
        assert_eq!(watch().failed(t0), Step::PollAt(t0 + ms(50)));
    }
}
