//! Wall-clock time, as the supervisor's `/state` marks record it.

/// Wall clock in microseconds since the Unix epoch.
pub fn unix_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}
