//! The client's watchdog on lockd itself (pure: time is an input).
//!
//! A lease is only as safe as the lockd that holds it. When lockd runs on etcd
//! (`--backend etcd`), a lockd that is stopped, frozen or killed stops renewing its etcd
//! leases, and another node is granted once they expire, whether or not this node's holder
//! is still running. lockd's own self-fence cannot help then (it is the one that stopped),
//! so the holder's side watches lockd: with [`crate::client::ClientOptions::watchdog`] set,
//! the client pings lockd every quarter of the limit and, when nothing at all has come from
//! lockd for the limit while it holds leases, reports them lost (the supervisor fences its
//! engine on that). The limit must leave the fence time before the etcd lease can expire:
//! `docs/ETCD.md` ("The supervisor's watchdog") has the arithmetic.
//!
//! Connecting is not a sign of life (the kernel accepts a connection for a stopped lockd);
//! only a line from lockd is. On the etcd backend each `pong` also says for how long lockd
//! vouches for the lease (`valid_ms`: its self-fence deadline minus now); the watchdog then
//! gives up at that time after the pong arrived if it comes first, so that a lockd frozen
//! just before its own fence deadline is covered as well.

use std::time::{Duration, Instant};

/// What the watchdog asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// Send a ping (something lockd must answer).
    Ping,
    /// Nothing came from lockd for the limit: the leases held must be given up as lost.
    Silent,
}

/// Silence detector over lockd's lines.
#[derive(Debug, Clone)]
pub struct Watchdog {
    limit: Duration,
    ping_every: Duration,
    heard: Instant,
    next_ping: Instant,
    /// Until when lockd vouched for the lease in its last `pong` (etcd backend).
    vouched: Option<Instant>,
}

impl Watchdog {
    /// Silence longer than `limit` is reported; started at `now` (counts as heard).
    pub fn new(limit: Duration, now: Instant) -> Watchdog {
        let ping_every = (limit / 4).max(Duration::from_millis(1));
        Watchdog {
            limit,
            ping_every,
            heard: now,
            next_ping: now + ping_every,
            vouched: None,
        }
    }

    /// The limit.
    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// A line came from lockd at `now`.
    pub fn heard(&mut self, now: Instant) {
        self.heard = self.heard.max(now);
    }

    /// A `pong` arrived at `now` saying lockd vouches for the lease for `valid` more.
    pub fn vouch(&mut self, now: Instant, valid: Duration) {
        self.heard(now);
        self.vouched = Some(now + valid);
        // Ask again well before the vouch runs out, so that a healthy lockd never trips a
        // watchdog whose own limit is long.
        self.next_ping = self
            .next_ping
            .min(now + (valid / 2).max(Duration::from_millis(1)));
    }

    /// When lockd will have been silent for the limit, or its last vouch runs out.
    pub fn silent_at(&self) -> Instant {
        let silent = self.heard + self.limit;
        self.vouched.map_or(silent, |v| v.min(silent))
    }

    /// When [`Watchdog::poll`] has something to say next.
    pub fn next_wakeup(&self) -> Instant {
        self.next_ping.min(self.silent_at())
    }

    /// What is due at `now`: silence first (a ping cannot help any more), then a ping.
    pub fn poll(&mut self, now: Instant) -> Option<Due> {
        if now >= self.silent_at() {
            return Some(Due::Silent);
        }
        if now >= self.next_ping {
            self.next_ping = now + self.ping_every;
            return Some(Due::Ping);
        }
        None
    }

    /// After a [`Due::Silent`] was acted on: count from `now` again.
    pub fn rearm(&mut self, now: Instant) {
        self.heard = now;
        self.next_ping = now + self.ping_every;
        self.vouched = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn pings_every_quarter_and_stays_quiet_while_lockd_answers() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(400 * MS, t0);
        assert_eq!(w.next_wakeup(), t0 + 100 * MS);
        assert_eq!(w.poll(t0 + 99 * MS), None);
        assert_eq!(w.poll(t0 + 100 * MS), Some(Due::Ping));
        assert_eq!(w.poll(t0 + 100 * MS), None, "one ping per period");
        w.heard(t0 + 101 * MS); // pong
        for k in 2..40u32 {
            let now = t0 + 100 * k * MS;
            assert_eq!(w.poll(now), Some(Due::Ping), "period {k}");
            w.heard(now + MS);
        }
    }

    #[test]
    fn silence_for_the_limit_is_reported_once_then_counted_again() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(400 * MS, t0);
        w.heard(t0 + 50 * MS);
        assert_eq!(w.silent_at(), t0 + 450 * MS);
        assert_eq!(w.poll(t0 + 100 * MS), Some(Due::Ping));
        assert_eq!(w.poll(t0 + 200 * MS), Some(Due::Ping));
        assert_eq!(w.poll(t0 + 449 * MS), Some(Due::Ping));
        assert_eq!(w.poll(t0 + 450 * MS), Some(Due::Silent));
        assert_eq!(w.poll(t0 + 460 * MS), Some(Due::Silent), "until acted on");
        w.rearm(t0 + 460 * MS);
        assert_eq!(w.poll(t0 + 461 * MS), None);
        assert_eq!(w.silent_at(), t0 + 860 * MS);
    }

    #[test]
    fn a_late_line_never_moves_the_clock_back() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(400 * MS, t0);
        w.heard(t0 + 300 * MS);
        w.heard(t0 + 200 * MS);
        assert_eq!(w.silent_at(), t0 + 700 * MS);
    }

    #[test]
    fn a_vouch_shorter_than_the_limit_comes_first_and_the_latest_vouch_counts() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(2900 * MS, t0);
        // lockd answers, vouching for its lease: its fence deadline is 4,350 ms away.
        w.vouch(t0 + 10 * MS, 4350 * MS);
        assert_eq!(w.silent_at(), t0 + 2910 * MS, "the limit comes first");
        // Partitioned from etcd, lockd's deadline stops moving: its vouches shrink.
        w.vouch(t0 + 1500 * MS, 1000 * MS);
        assert_eq!(w.silent_at(), t0 + 2500 * MS, "the vouch comes first");
        // Then lockd freezes: nothing more arrives, the vouch runs out before the limit.
        assert_eq!(w.poll(t0 + 2499 * MS), Some(Due::Ping));
        assert_eq!(w.poll(t0 + 2500 * MS), Some(Due::Silent));
        // Other lines are signs of life but vouch for nothing more.
        w.rearm(t0 + 2600 * MS);
        w.vouch(t0 + 2600 * MS, 100 * MS);
        w.heard(t0 + 2650 * MS);
        assert_eq!(w.silent_at(), t0 + 2700 * MS);
    }

    #[test]
    fn a_healthy_lockd_is_asked_again_before_its_vouch_runs_out() {
        let t0 = Instant::now();
        let mut w = Watchdog::new(10_000 * MS, t0);
        let mut now = t0;
        for _ in 0..50 {
            // Each pong vouches for 1.3 s (a short TTL); pings come every 650 ms, not 2.5 s.
            w.vouch(now, 1300 * MS);
            let next = w.next_wakeup();
            assert!(next <= now + 650 * MS, "next wakeup {:?} after", next - now);
            now = next;
            assert_eq!(w.poll(now), Some(Due::Ping));
        }
    }

    #[test]
    fn a_tiny_limit_still_pings_at_a_bounded_rate() {
        let t0 = Instant::now();
        let w = Watchdog::new(Duration::from_micros(1), t0);
        assert_eq!(w.next_wakeup(), t0 + Duration::from_micros(1));
        assert_eq!(w.ping_every, MS);
    }
}
