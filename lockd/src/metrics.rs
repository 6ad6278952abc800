//! Prometheus text-format metrics, kept by the server driver.

use std::fmt::Write;
use std::time::Duration;

use crate::proto::Counters;

/// Upper bounds (seconds) of the handoff-time histogram buckets.
pub const HANDOFF_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0,
];

/// A fixed-bucket histogram.
#[derive(Debug, Clone)]
pub struct Histogram {
    /// Bucket upper bounds, seconds.
    bounds: &'static [f64],
    /// Per-bucket (non-cumulative) counts; one extra for +Inf.
    counts: Vec<u64>,
    /// Sum of observations, seconds.
    sum: f64,
}

impl Histogram {
    /// An empty histogram over `bounds`.
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    /// Record one duration.
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += s;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cum += self.counts[i];
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += self.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {cum}");
    }
}

/// Everything the driver measures beyond the core's counters.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Holder connection close → next grant sent.
    pub handoff: Histogram,
    /// Time to durably write the state file.
    pub persist: Histogram,
    /// Connections accepted.
    pub connections: u64,
    /// Requests refused as malformed/unknown/oversized/rate-limited.
    pub bad_requests: u64,
    /// Wall time spent awake in busy-poll mode after requests instead of sleeping (the
    /// requests served meanwhile included): what `--busy-poll` costs in CPU.
    pub busy_poll: Duration,
    /// Reads that found their bytes while lockd was busy-polling (wakeups saved).
    pub busy_poll_hits: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            handoff: Histogram::new(HANDOFF_BUCKETS),
            persist: Histogram::new(HANDOFF_BUCKETS),
            connections: 0,
            bad_requests: 0,
            busy_poll: Duration::ZERO,
            busy_poll_hits: 0,
        }
    }
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Render the full exposition.
pub fn render(
    m: &Metrics,
    c: &Counters,
    waiters: &[(String, usize, bool)],
    sessions: usize,
) -> String {
    let mut o = String::new();
    for (name, help, v) in [
        (
            "lockd_grants_total",
            "Leases granted with a new epoch.",
            c.grants,
        ),
        (
            "lockd_releases_total",
            "Leases ended by connection close or release.",
            c.releases,
        ),
        (
            "lockd_expirations_total",
            "Persisted leases not reclaimed within the reconnect window.",
            c.expirations,
        ),
        (
            "lockd_revocations_total",
            "Leases revoked by an operator.",
            c.revocations,
        ),
        (
            "lockd_reclaims_total",
            "Leases reclaimed after a reconnect.",
            c.reclaims,
        ),
        (
            "lockd_connections_total",
            "Connections accepted.",
            m.connections,
        ),
        (
            "lockd_bad_requests_total",
            "Malformed, unknown, oversized or rate-limited requests.",
            m.bad_requests,
        ),
        (
            "lockd_busy_poll_hits_total",
            "Reads whose bytes arrived while lockd was busy-polling (a thread wakeup saved).",
            m.busy_poll_hits,
        ),
    ] {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    }
    let _ = writeln!(
        o,
        "# HELP lockd_busy_poll_seconds_total Wall time lockd stayed awake busy-polling after requests instead of sleeping (serving requests meanwhile): the CPU that --busy-poll costs.\n# TYPE lockd_busy_poll_seconds_total counter\nlockd_busy_poll_seconds_total {}",
        m.busy_poll.as_secs_f64()
    );
    let _ = writeln!(o, "# HELP lockd_sessions Connected sessions.\n# TYPE lockd_sessions gauge\nlockd_sessions {sessions}");
    let _ = writeln!(
        o,
        "# HELP lockd_waiters Queued acquires per resource.\n# TYPE lockd_waiters gauge"
    );
    for (r, n, _) in waiters {
        let _ = writeln!(o, "lockd_waiters{{resource=\"{}\"}} {n}", esc(r));
    }
    let _ = writeln!(o, "# HELP lockd_held Whether the resource is held or reclaiming (1) or free (0).\n# TYPE lockd_held gauge");
    for (r, _, held) in waiters {
        let _ = writeln!(
            o,
            "lockd_held{{resource=\"{}\"}} {}",
            esc(r),
            u8::from(*held)
        );
    }
    m.handoff.render(
        "lockd_handoff_seconds",
        "From the holder's connection close (or release) to the next grant being sent.",
        &mut o,
    );
    m.persist.render(
        "lockd_persist_seconds",
        "Durable state write (tmp+fsync+rename+fsync dir).",
        &mut o,
    );
    o
}
