//! `--log-format json` writes one JSON object per line, one per state transition, with the
//! peer's pid on session lines.
use crate::common::*;

#[test]
fn json_logs_have_one_structured_line_per_transition() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &["--log-format", "json"]);
    let mut a = Conn::connect(l.socket()).unwrap();
    a.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    a.recv_until("granted").unwrap();
    drop(a);
    let lines = wait_for(
        std::time::Duration::from_secs(10),
        "released log line",
        || {
            let log = l.log_text();
            log.contains("lease released").then_some(log)
        },
    );
    let objs: Vec<serde_json::Value> = lines
        .lines()
        .map(|x| serde_json::from_str(x).expect("every log line is JSON"))
        .collect();
    let granted = objs
        .iter()
        .find(|o| o["message"] == "lease granted")
        .expect("grant line");
    assert_eq!(granted["resource"], "engine");
    assert_eq!(granted["holder"], "a");
    assert_eq!(granted["epoch"], 1);
    assert!(
        granted["pid"].is_i64(),
        "peer pid in the grant line: {granted}"
    );
    assert!(objs
        .iter()
        .any(|o| o["message"] == "session connected" && o["uid"].is_u64()));
}
