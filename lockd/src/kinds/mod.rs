//! The lease kinds beyond today's connection-bound exclusive lease, each a pure state machine
//! that the core drives (issue 11). See `README.md` in this directory for how the core wires
//! them in.
//!
//! * [`ttl`]: TTL leases (Held / Expired / Revoked, tombstones, wall-clock expiries).
//! * [`shared`]: shared/exclusive admission per resource with versions and `min_version`.

pub mod shared;
pub mod ttl;
