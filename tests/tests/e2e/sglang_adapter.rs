//! `--adapter sglang`: the shadow sleeps through `/pause_generation` + `/release_memory_occupation`
//! and wakes through `/resume_memory_occupation` + `/continue_generation` (the fake engine, as
//! SGLang, with `--enable-weights-cpu-backup`), and takes over on failover serving real text.

use std::time::Duration;

use harness::{Cluster, SupOpts};
use nix::sys::signal::Signal;
use probes::Phase;

const T: Duration = Duration::from_secs(20);

/// The fake engine as the chart runs SGLang.
const SGLANG: &[&str] = &[
    "--personality",
    "sglang",
    "--enable-weights-cpu-backup",
    "--health-generation",
    "false",
];

#[test]
fn sglang_shadow_sleeps_and_takes_over() {
    let _g = harness::serial();
    let mut c = Cluster::new(Duration::from_secs(2));
    let (primary, shadow) = c.start_pair(
        &SupOpts::new(0, "primary").adapter("sglang").engine(SGLANG),
        &SupOpts::new(1, "shadow").adapter("sglang").engine(SGLANG),
        T,
    );
    // Asleep (paused): the engine holds completions until it continues.
    assert_eq!(shadow.completion(), None);

    assert!(primary.proc.signal(Signal::SIGTERM));
    assert!(shadow.wait_phase(Phase::Active, T), "{}", c.dump_logs());
    assert_eq!(shadow.probe("/ready"), Some(200));
    let (code, body) = shadow.completion().unwrap();
    assert_eq!((code, body["engine_id"].as_u64()), (200, Some(1)));
    assert_eq!(body["garbage"], false, "{body}");
    assert!(c.violations().is_empty());
}
