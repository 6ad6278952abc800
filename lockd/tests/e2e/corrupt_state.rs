//! A corrupt or unreadable state file stops lockd with a clear message; lockd never starts
//! empty over it and never overwrites it.
use crate::common::*;

fn try_start(dir: &std::path::Path, state: &std::path::Path) -> std::process::Output {
    spec(dir, &[])
        .socket(dir.join("s.sock"))
        .state(state)
        .command(std::path::Path::new(BIN))
        .output_within(CMD_LIMIT)
        .unwrap()
}

#[test]
fn corrupt_state_files_stop_lockd_and_are_left_untouched() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state.json");
    let cases: [&[u8]; 5] = [
        b"",
        b"{\"version\":1,\"resources\":{\"engine\":{\"epoch\":3,",
        b"\x00\x01\x02 garbage",
        b"{\"version\":7,\"resources\":{}}",
        b"{\"version\":1,\"resources\":{\"engine\":{\"epoch\":2,\"holder\":{\"name\":\"a\",\"epoch\":9,\"token\":\"t\",\"granted_at_unix_ms\":0}}}}",
    ];
    for bad in cases {
        std::fs::write(&state, bad).unwrap();
        let out = try_start(d.path(), &state);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("corrupt") && err.contains("refusing to start"),
            "{err}"
        );
        assert_eq!(std::fs::read(&state).unwrap(), bad, "evidence overwritten");
        assert!(!d.path().join("s.sock").exists(), "must not listen");
    }
}

#[test]
fn unreadable_state_file_stops_lockd() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    // A directory where the state file should be: reading it fails.
    let state = d.path().join("state.json");
    std::fs::create_dir(&state).unwrap();
    let out = try_start(d.path(), &state);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("state"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(state.is_dir());
}
