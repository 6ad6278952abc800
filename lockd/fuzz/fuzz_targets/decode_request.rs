//! Fuzz the protocol decoders and the line splitter: no input may panic, and every decoded
//! request must survive an encode/decode round trip.
#![no_main]
use libfuzzer_sys::fuzz_target;
use lockd::line::LineBuf;
use lockd::proto::{decode_event, decode_request, encode_request};

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = decode_request(data, 64 * 1024) {
        let line = encode_request(&req);
        let back = decode_request(line.trim_end().as_bytes(), 64 * 1024).expect("re-decode");
        assert_eq!(back, req);
    }
    let _ = decode_event(data);
    let mut lb = LineBuf::new(128);
    for chunk in data.chunks(7) {
        lb.push(chunk);
        while let Some(item) = lb.next_line() {
            if let Ok(l) = item {
                assert!(l.len() <= 128);
                let _ = decode_request(&l, 128);
            }
        }
    }
});
