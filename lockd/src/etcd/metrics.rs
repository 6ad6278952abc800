//! Metrics of `lockd serve --backend etcd` (`--metrics HOST:PORT`, served by
//! [`crate::metrics::serve`] at `GET /metrics`, OpenMetrics text). What an SRE watches on this
//! backend: the self-fences (each one a failover that etcd, not the engine, caused), the
//! keepalive round trip against the fence's margin, etcd leader changes, the waiters'
//! expiry enforcement, and etcd errors.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::time::Duration;
use tracing::warn;

/// Upper bounds (seconds) of the keepalive round-trip buckets: a healthy etcd answers in
/// milliseconds; anything near the margin (hundreds of ms) is a fence waiting to happen.
pub const KEEPALIVE_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// The etcd backend's metrics; cheap to update from any task (atomics).
#[derive(Debug)]
pub struct EtcdMetrics {
    registry: Registry,
    /// Local connections open.
    pub sessions: Gauge,
    /// Grants counted in `status` (`counters.grants`): connection-bound exclusive leases and
    /// gangs (one per gang) granted to this lockd's clients.
    pub grants: Counter,
    /// Sessions whose holders were told `lost` by the self-fence (etcd unreachable or slow,
    /// the lease gone, a leader change under `fence`).
    pub self_fences: Counter,
    /// Keepalive send → etcd's answer.
    pub keepalive_rtt: Histogram,
    /// Raft term changes seen in keepalive answers (etcd leader elections).
    pub term_changes: Counter,
    /// Predecessors' etcd leases this lockd's waiters revoked once provably expired.
    pub expiry_revokes: Counter,
    /// etcd calls of the acquire path that failed (retried).
    pub etcd_errors: Counter,
    /// Keepalive streams moved off an etcd member that stopped answering
    /// ([`super::members`]).
    pub member_moves: Counter,
}

impl Default for EtcdMetrics {
    fn default() -> Self {
        EtcdMetrics::new()
    }
}

impl EtcdMetrics {
    /// Every metric registered, at zero.
    pub fn new() -> EtcdMetrics {
        let mut registry = Registry::default();
        let m = EtcdMetrics {
            sessions: Gauge::default(),
            grants: Counter::default(),
            self_fences: Counter::default(),
            keepalive_rtt: Histogram::new(KEEPALIVE_BUCKETS.iter().copied()),
            term_changes: Counter::default(),
            expiry_revokes: Counter::default(),
            etcd_errors: Counter::default(),
            member_moves: Counter::default(),
            registry: Registry::default(),
        };
        // prometheus-client appends `_total` to counters and adds the final full stop.
        registry.register(
            "lockd_etcd_sessions",
            "Local connections open",
            m.sessions.clone(),
        );
        registry.register(
            "lockd_etcd_grants",
            "Leases granted to this lockd's clients",
            m.grants.clone(),
        );
        registry.register(
            "lockd_etcd_self_fences",
            "Sessions whose holders the self-fence told lost before their etcd lease could expire",
            m.self_fences.clone(),
        );
        registry.register(
            "lockd_etcd_keepalive_rtt_seconds",
            "Keepalive sent to etcd's answer",
            m.keepalive_rtt.clone(),
        );
        registry.register(
            "lockd_etcd_term_changes",
            "etcd raft term changes seen in keepalive answers",
            m.term_changes.clone(),
        );
        registry.register(
            "lockd_etcd_expiry_revokes",
            "Predecessors' etcd leases revoked by this lockd's waiters once provably expired",
            m.expiry_revokes.clone(),
        );
        registry.register(
            "lockd_etcd_errors",
            "etcd calls of the acquire path that failed and were retried",
            m.etcd_errors.clone(),
        );
        registry.register(
            "lockd_etcd_keepalive_member_moves",
            "Keepalive streams moved off an etcd member that stopped answering",
            m.member_moves.clone(),
        );
        EtcdMetrics { registry, ..m }
    }

    /// One keepalive round trip.
    pub fn observe_rtt(&self, d: Duration) {
        self.keepalive_rtt.observe(d.as_secs_f64());
    }

    /// The exposition ([`crate::metrics::CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(2048);
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            warn!(error = %e, "metrics encoding failed part-way");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_exposed_with_its_value() {
        let m = EtcdMetrics::new();
        m.sessions.inc();
        m.grants.inc();
        m.self_fences.inc();
        m.self_fences.inc();
        m.term_changes.inc();
        m.expiry_revokes.inc();
        m.etcd_errors.inc();
        m.member_moves.inc();
        m.observe_rtt(Duration::from_millis(3));
        let text = m.render();
        for line in [
            "lockd_etcd_sessions 1",
            "lockd_etcd_grants_total 1",
            "lockd_etcd_self_fences_total 2",
            "lockd_etcd_term_changes_total 1",
            "lockd_etcd_expiry_revokes_total 1",
            "lockd_etcd_errors_total 1",
            "lockd_etcd_keepalive_member_moves_total 1",
            "lockd_etcd_keepalive_rtt_seconds_count 1",
            "lockd_etcd_keepalive_rtt_seconds_bucket{le=\"0.005\"} 1",
            "lockd_etcd_keepalive_rtt_seconds_bucket{le=\"0.0025\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
