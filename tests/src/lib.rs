//! End-to-end test harness (placeholder).
