//! The driver's telemetry that is not a state transition: the container restart counter file,
//! the persisted Dynamo switch counters (`--failover-counters`) and the GPU checks' counters
//! copied into `/metrics`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc;

use gms_client::checks::GpuChecks;
use probes::dynamo::SwitchCounts;
use probes::ProbeState;

use crate::config::RunArgs;

pub(super) fn bump_restart_counter(args: &RunArgs, state: &ProbeState) {
    let Some(path) = &args.restart_counter else {
        return;
    };
    let prev: u64 = std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    state
        .metrics()
        .engine_restarts
        .store(prev, Ordering::Relaxed);
    let tmp = path.with_extension("tmp");
    let res =
        std::fs::write(&tmp, format!("{}\n", prev + 1)).and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = res {
        tracing::warn!(path = %path.display(), error = %e, "cannot update restart counter");
    }
}

/// Copy the GPU checks' counters into the `/metrics` registry.
pub(super) fn sync_check_metrics(checks: &GpuChecks, state: &ProbeState) {
    let c = checks.counters();
    let m = state.metrics();
    m.gpu_wake_checks.store(c.wake_checks, Ordering::Relaxed);
    m.gpu_wake_check_failures
        .store(c.wake_failures, Ordering::Relaxed);
    m.gpu_reap_checks.store(c.reap_checks, Ordering::Relaxed);
    m.gpu_reap_timeouts
        .store(c.reap_timeouts, Ordering::Relaxed);
    m.gpu_engine_processes_seen
        .store(c.engine_processes_seen, Ordering::Relaxed);
}

/// `--failover-counters`: carry Dynamo's switch counters over from the file (a missing or
/// corrupt file counts from 0: logged, never fatal), then keep the file up to date after every
/// change. The changes come from `ProbeState::enter` (a grant starting a wake, a wake reaching
/// Active), i.e. on the failover path: the write (temp file, fsync, rename) happens on a
/// thread of its own so that it never delays a wake. Several changes in a row are coalesced
/// into one write of the latest counts.
pub(super) fn persist_failover_counters(args: &RunArgs, state: &ProbeState) {
    let Some(path) = args.failover_counters.clone() else {
        return;
    };
    let dynamo = &state.metrics().dynamo;
    let counts = load_switch_counts(&path);
    dynamo.restore(counts);
    tracing::info!(
        path = %path.display(),
        attempts = counts.attempts,
        success = counts.success,
        "failover switch counters carried over"
    );
    let (tx, rx) = mpsc::channel::<SwitchCounts>();
    let writer = std::thread::Builder::new()
        .name("failover-counters".into())
        .spawn(move || {
            while let Ok(mut latest) = rx.recv() {
                while let Ok(newer) = rx.try_recv() {
                    latest = newer;
                }
                if let Err(e) = store_switch_counts(&path, latest) {
                    tracing::warn!(path = %path.display(), error = %e, "cannot persist the failover switch counters");
                }
            }
        });
    match writer {
        Ok(_) => {
            dynamo.on_switch(Box::new(move |c| {
                // The writer lives as long as the process.
                let _ = tx.send(c);
            }));
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot start the failover counters writer; the switch counters will not survive a restart")
        }
    }
}

/// The counts in `path`; 0 when the file is missing (a first start: info) or unreadable or
/// corrupt (warning).
fn load_switch_counts(path: &Path) -> SwitchCounts {
    match std::fs::read_to_string(path) {
        Ok(text) => match SwitchCounts::parse(&text) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "corrupt failover counters file; counting from 0");
                SwitchCounts::default()
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::info!(path = %path.display(), "no failover counters file yet; counting from 0");
            SwitchCounts::default()
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the failover counters file; counting from 0");
            SwitchCounts::default()
        }
    }
}

/// Write `counts` to `path` atomically: a temp file beside it (`PATH.tmp`), fsync, rename.
fn store_switch_counts(path: &Path, counts: SwitchCounts) -> std::io::Result<()> {
    let mut tmp: PathBuf = path.to_path_buf().into_os_string().into();
    tmp.as_mut_os_string().push(".tmp");
    let body = serde_json::to_string(&counts).map_err(std::io::Error::other)?;
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(body.as_bytes())?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(attempts: u64, success: u64) -> SwitchCounts {
        SwitchCounts { attempts, success }
    }

    #[test]
    fn counts_round_trip_through_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("engine-1.failover");
        assert_eq!(load_switch_counts(&path), counts(0, 0), "missing");
        store_switch_counts(&path, counts(4, 3)).unwrap();
        assert_eq!(load_switch_counts(&path), counts(4, 3));
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"attempts\":4,\"success\":3}\n"
        );
        store_switch_counts(&path, counts(5, 3)).unwrap();
        assert_eq!(load_switch_counts(&path), counts(5, 3));
        // No temp file left behind; the restart counter's own temp name is not taken.
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["engine-1.failover"]);
    }

    #[test]
    fn a_corrupt_or_unreadable_file_counts_from_zero() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("engine-0.failover");
        for bad in [
            "",
            "{",
            "garbage",
            "[1,2]",
            "{\"attempts\":-3}",
            "{\"attempts\":\"x\"}",
        ] {
            std::fs::write(&path, bad).unwrap();
            assert_eq!(load_switch_counts(&path), counts(0, 0), "{bad:?}");
        }
        // Dynamo's file with one field: the other is 0.
        std::fs::write(&path, r#"{"attempts": 2}"#).unwrap();
        assert_eq!(load_switch_counts(&path), counts(2, 0));
        // A directory where the file should be: unreadable, and unwritable.
        let d = dir.path().join("a-dir");
        std::fs::create_dir(&d).unwrap();
        assert_eq!(load_switch_counts(&d), counts(0, 0));
        assert!(store_switch_counts(&d, counts(1, 1)).is_err());
    }
}
