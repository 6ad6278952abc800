//! Real processes for the workspace's tests, benchmarks and the drill.
//!
//! * [`stats`]: the one percentile definition (nearest rank) every report uses,
//! * [`http`]: the one HTTP client (ureq; loopback, plain HTTP, bounded by a timeout).

pub mod gmsd;
pub mod http;
pub mod lockd;
pub mod stats;
