//! The lease kinds beyond today's connection-bound exclusive lease, each a pure state machine
//! that the core drives (issue 11): time is an input, ids and tokens come in from the caller,
//! every call returns what happened. See `README.md` in this directory for how the core wires
//! them in.
//!
//! * [`ttl`]: TTL leases (Held / Expired / Revoked, tombstones, wall-clock expiries).
//! * [`shared`]: shared/exclusive admission per resource with versions and `min_version`.
//! * [`selector`]: Kubernetes-style label selectors (`In`, `NotIn`, `Exists`,
//!   `DoesNotExist`, `Gt`, `Lt`) over string attributes, with a compact text form.
//! * [`quantity`]: quantity leases over offers (HTCondor's lease manager): all-or-nothing
//!   grants from one or several offers matched both ways, lease time = min(offer, request,
//!   manager), a maximum total lease time, non-renewal after shrinking offers, resume by
//!   `(lease id, token)`, persisted records with wall-clock expiries.
//! * [`waitfor`]: the wait-for graph of sessions (issue 12): exact, incremental deadlock
//!   detection (cycles of any length) with Pearce–Kelly's dynamic topological order over the
//!   strongly connected components, and the victim choice that breaks a cycle.

pub mod quantity;
pub mod selector;
pub mod shared;
pub mod ttl;
pub mod waitfor;
