//! lockd (placeholder until its issue lands).
