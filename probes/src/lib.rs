//! probes (placeholder until its issue lands).
