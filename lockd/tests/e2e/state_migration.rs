//! A state file written by lockd before issue 11 (format version 1, the fixture
//! `tests/fixtures/state-v1.json`, made by `tests/fixtures/gen-state-v1.py` with that lockd:
//! `engine` held by `engine-a` at epoch 3, `gpu-pool` free at epoch 1, `weights` held and
//! revoked) is read by today's lockd: epochs, holders and counters are kept, the holder
//! reclaims its lease, and the file is rewritten as version 2 at the next write (not
//! before). A file of a version this lockd does not know is refused and left untouched.
use crate::common::*;
use lockd::proto::LeaseState;

const FIXTURE: &[u8] = include_bytes!("../fixtures/state-v1.json");

fn json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn a_version_1_state_file_is_migrated_keeping_epochs_and_holders() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("state.json"), FIXTURE).unwrap();
    let mut l = start_lockd(d.path(), &["--reconnect-window", "30s"]);
    let st = l.status();
    let e = resource(&st, "engine");
    assert_eq!(
        (e.state, e.holder.as_deref(), e.epoch),
        (LeaseState::Reclaiming, Some("engine-a"), 3)
    );
    let g = resource(&st, "gpu-pool");
    assert_eq!((g.state, g.epoch), (LeaseState::Free, 1));
    let w = resource(&st, "weights");
    assert_eq!((w.state, w.revoked), (LeaseState::Reclaiming, true));
    assert_eq!(
        (
            st.counters.grants,
            st.counters.releases,
            st.counters.revocations
        ),
        (5, 3, 1)
    );
    // Migrated in memory only: nothing was written yet.
    assert_eq!(std::fs::read(l.state_path()).unwrap(), FIXTURE);
    assert!(l.log_text().contains("migrated"), "{}", l.log_text());

    // The holder comes back with the epoch and token of its version-1 grant.
    let v1 = json(l.state_path());
    let token = v1["resources"]["engine"]["holder"]["token"]
        .as_str()
        .unwrap()
        .to_string();
    let mut a = Conn::connect(l.socket()).unwrap();
    a.send(&format!(
        r#"{{"op":"reclaim","resource":"engine","holder":"engine-a","epoch":3,"token":"{token}"}}"#
    ));
    let g = a.recv_until("granted").expect("reclaim answered");
    assert_eq!(
        (g["epoch"].as_u64(), g["reclaimed"].as_bool()),
        (Some(3), Some(true)),
        "{g}"
    );

    // That write stored version 2, epochs and holder kept.
    let v2 = json(l.state_path());
    assert_eq!(v2["version"], 2, "{v2}");
    assert_eq!(v2["resources"]["engine"]["epoch"], 3);
    assert_eq!(v2["resources"]["engine"]["holder"]["name"], "engine-a");
    assert_eq!(
        v2["resources"]["engine"]["holder"]["token"].as_str(),
        Some(&*token)
    );
    assert!(v2["resources"]["engine"]["holder"]["lease_id"].as_u64() > Some(0));
    assert_eq!(v2["resources"]["engine"]["holder"]["kind"], "exclusive");
    assert_eq!(v2["resources"]["gpu-pool"]["epoch"], 1);
    assert_eq!(v2["counters"]["grants"], 5);

    // The next grant of a free resource continues its epochs.
    let mut b = Conn::connect(l.socket()).unwrap();
    b.send(r#"{"op":"acquire","resource":"gpu-pool","holder":"b"}"#);
    assert_eq!(b.granted_epoch("gpu-pool"), 2);

    // A restart reads the version-2 file: the reclaimed lease waits for its holder again.
    // (`a` keeps holding `engine` across the restart.)
    drop(b);
    wait_for(
        std::time::Duration::from_secs(5),
        "gpu-pool released",
        || (resource(&l.status(), "gpu-pool").state == LeaseState::Free).then_some(()),
    );
    l.restart(); // SIGKILL, then start again
    let st = l.status();
    let e = resource(&st, "engine");
    assert_eq!((e.holder.as_deref(), e.epoch), (Some("engine-a"), 3));
    assert_eq!(resource(&st, "gpu-pool").epoch, 2);
    drop(a);
    let mut c = Conn::connect(l.socket()).unwrap();
    c.send(r#"{"op":"acquire","resource":"gpu-pool","holder":"c"}"#);
    assert_eq!(c.granted_epoch("gpu-pool after restart"), 3);
}

#[test]
fn a_state_file_of_a_newer_version_is_refused_untouched() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state.json");
    let newer = br#"{"version":3,"resources":{"engine":{"epoch":9,"holder":null}}}"#;
    std::fs::write(&state, newer).unwrap();
    let out = spec(d.path(), &[])
        .socket(d.path().join("s.sock"))
        .command(std::path::Path::new(BIN))
        .output_within(CMD_LIMIT)
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("version 3")
            && err.contains("newer lockd")
            && err.contains("refusing to start"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&state).unwrap(),
        newer,
        "evidence overwritten"
    );
    assert!(!d.path().join("s.sock").exists(), "must not listen");
}

#[test]
fn hello_announces_protocol_version_2_and_version_1_requests_work_unchanged() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let mut a = Conn::connect(l.socket()).unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut a.r, &mut line).unwrap();
    assert!(
        line.starts_with(r#"{"event":"hello","server":"lockd","version":2,"session":"#),
        "{line}"
    );
    // The extensions served are listed; a version-1 client ignores the field.
    assert!(
        line.ends_with(",\"features\":[\"ttl\",\"shared\",\"quantity\",\"gang\",\"reserve\"]}\n"),
        "{line}"
    );
    a.send(r#"{"op":"acquire","resource":"engine","holder":"a"}"#);
    let mut line = String::new();
    std::io::BufRead::read_line(&mut a.r, &mut line).unwrap();
    let token = typed_event(&serde_json::from_str(&line).unwrap());
    let lockd::proto::Event::Granted { token, .. } = token else {
        panic!("{line}")
    };
    assert_eq!(
        line,
        format!(
            "{{\"event\":\"granted\",\"resource\":\"engine\",\"holder\":\"a\",\"epoch\":1,\"token\":\"{token}\",\"reclaimed\":false}}\n"
        )
    );
}
