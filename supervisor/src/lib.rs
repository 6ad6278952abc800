//! supervisor (placeholder until its issue lands).
