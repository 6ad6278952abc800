//! Fuzz target: the GMS decoder (bodies and framed streams) must never panic, and every
//! message it accepts must re-encode to bytes that decode to the same message.
#![no_main]

use gms_client::protocol::{decode_frames, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Message::decode(data) {
        let again = Message::decode(&m.encode()).expect("re-encoded message must decode");
        assert_eq!(again, m);
    }
    let (msgs, used) = decode_frames(data);
    assert!(used <= data.len());
    for m in msgs.into_iter().flatten() {
        let _ = m.encode_frame();
    }
});
