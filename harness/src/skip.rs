//! Skipped tests are recorded, not passed silently.

/// Environment variable naming a file where [`skip`] appends one line per skipped test
/// (`.ci/run` sets it and prints the list and the count at the end).
pub const SKIP_LOG_ENV: &str = "FAILOVER_SKIP_LOG";

/// Record that `test` did not run (all or part of it) for `reason`: prints `SKIP: test:
/// reason` on stderr and appends it to the file named by [`SKIP_LOG_ENV`], if set, so that a
/// skip is counted instead of passing silently.
pub fn skip(test: &str, reason: &str) {
    let line = format!("SKIP: {test}: {reason}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os(SKIP_LOG_ENV) {
        use std::io::Write;
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = appended {
            eprintln!("cannot record the skip in {}: {e}", path.to_string_lossy());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_appended_to_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("skips");
        // Only this test reads or sets the variable in this process (no other harness unit
        // test skips); the runner's value (CI's log) is put back.
        let before = std::env::var_os(SKIP_LOG_ENV);
        std::env::set_var(SKIP_LOG_ENV, &log);
        skip("t1", "no GPU");
        skip("t2", "not root");
        match before {
            Some(v) => std::env::set_var(SKIP_LOG_ENV, v),
            None => std::env::remove_var(SKIP_LOG_ENV),
        }
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(text, "SKIP: t1: no GPU\nSKIP: t2: not root\n");
    }
}
