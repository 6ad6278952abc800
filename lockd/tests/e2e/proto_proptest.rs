//! Property tests over the protocol decoder (the CI-run twin of `fuzz/`): arbitrary bytes
//! never panic, every request round-trips through encode/decode, and bounded lines hold.
use lockd::line::LineBuf;
use lockd::proto::{decode_event, decode_request, encode_request, Request};
use proptest::prelude::*;

fn name() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_.:/ -]{1,40}".prop_map(|s| s)
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        (name(), name(), any::<bool>())
            .prop_map(|(resource, holder, wait)| Request::acquire(resource, holder, wait)),
        (name(), name(), any::<u64>(), "[0-9a-f]{0,32}").prop_map(
            |(resource, holder, epoch, token)| Request::Reclaim {
                resource,
                holder,
                epoch,
                token
            }
        ),
        name().prop_map(Request::release),
        (
            name(),
            proptest::option::of(".{0,20}"),
            proptest::option::of("[a-z]{0,10}")
        )
            .prop_map(|(resource, reason, admin_token)| Request::revoke(
                resource,
                reason,
                admin_token
            )),
        Just(Request::Status { sessions: None }),
        Just(Request::Watch),
        Just(Request::Ping),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_request(&bytes, 256);
        let _ = decode_event(&bytes);
    }

    #[test]
    fn json_like_garbage_never_panics(s in r#"\{("op":)?"?[a-z_]{0,10}"?(,"[a-z]{1,8}":("[^"]{0,8}"|[0-9]{1,20}|true|null|\[\]|\{\}))*\}?"#) {
        let _ = decode_request(s.as_bytes(), 1024);
    }

    #[test]
    fn requests_round_trip(req in request()) {
        let line = encode_request(&req);
        prop_assert!(line.ends_with('\n'));
        prop_assert!(!line[..line.len() - 1].contains('\n'), "one request, one line");
        let back = decode_request(line.trim_end().as_bytes(), 64 * 1024).unwrap();
        prop_assert_eq!(back, req);
    }

    #[test]
    fn lines_are_split_exactly_and_bounded(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..32), max in 1usize..80) {
        let mut lb = LineBuf::new(max);
        let all: Vec<u8> = chunks.concat();
        let mut got = Vec::new();
        let mut too_long = false;
        for c in &chunks {
            lb.push(c);
            while let Some(item) = lb.next_line() {
                match item {
                    Ok(l) => { prop_assert!(l.len() <= max); got.push(l) }
                    Err(_) => too_long = true,
                }
            }
            prop_assert!(lb.buffered() <= max + 64, "buffer stays bounded");
        }
        if !too_long {
            let expect: Vec<Vec<u8>> = all.split(|b| *b == b'\n').map(|l| l.strip_suffix(b"\r").unwrap_or(l).to_vec()).collect();
            let complete = &expect[..expect.len() - 1];
            prop_assert_eq!(&got[..], complete);
        }
    }
}
