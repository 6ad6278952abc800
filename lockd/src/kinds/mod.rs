//! Lease kinds beyond the connection-bound exclusive lease, each a pure state machine (time
//! is an input, ids and tokens come in from the caller, every call returns what happened),
//! ready to be wired into the core's `step` and the wire protocol.
//!
//! * [`selector`]: Kubernetes-style label selectors (`In`, `NotIn`, `Exists`,
//!   `DoesNotExist`, `Gt`, `Lt`) over string attributes, with a compact text form.
//! * [`quantity`]: quantity leases over offers (HTCondor's lease manager): all-or-nothing
//!   grants from one or several offers matched both ways, lease time = min(offer, request,
//!   manager), a maximum total lease time, non-renewal after shrinking offers, resume by
//!   `(lease id, token)`, persisted records with wall-clock expiries.

pub mod quantity;
pub mod selector;
