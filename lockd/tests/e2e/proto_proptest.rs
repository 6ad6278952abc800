//! Property tests over the protocol decoder (the CI-run twin of `fuzz/`): arbitrary bytes
//! never panic, every request of protocol 2 (every op, every optional field) round-trips
//! through encode/decode, invalid field values give a clean error of the right code (never
//! a panic), bounded lines hold, and random request lines and events through `Core::step`
//! never panic (the body of the `core_steps` fuzz target).
use std::collections::BTreeMap;

use lockd::line::LineBuf;
use lockd::proto::{
    decode_event, decode_request, encode_request, AcquireExt, ErrorCode, Mode, Request, MAX_TTL_MS,
};
use proptest::prelude::*;
use serde_json::{json, Value};

#[path = "../../fuzz/core_steps_driver.rs"]
mod core_steps_driver;

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
        Just(Request::Anchor),
        v2_request(),
    ]
}

fn ttl() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..100_000, Just(MAX_TTL_MS), 1..=MAX_TTL_MS]
}

/// Label-selector text that parses (kinds/selector.rs).
fn selector() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z]{1,8}".prop_map(|k| k),
        "![a-z]{1,8}".prop_map(|k| k),
        ("[a-z]{1,8}", "[a-z0-9]{1,8}").prop_map(|(k, v)| format!("{k}={v}")),
        ("[a-z]{1,8}", "[a-z0-9]{1,8}").prop_map(|(k, v)| format!("{k}!={v}")),
        (
            "[a-z]{1,8}",
            proptest::collection::vec("[a-z0-9]{1,6}", 1..4)
        )
            .prop_map(|(k, vs)| format!("{k} in ({})", vs.join(","))),
        (
            "[a-z]{1,8}",
            proptest::collection::vec("[a-z0-9]{1,6}", 1..4)
        )
            .prop_map(|(k, vs)| format!("{k} notin ({})", vs.join(","))),
        ("[a-z]{1,8}", 0u32..1000).prop_map(|(k, n)| format!("{k} > {n}")),
        ("[a-z]{1,8}", 0u32..1000, "[a-z]{1,8}").prop_map(|(k, n, e)| format!("{k} < {n},{e}")),
    ]
}

fn attrs() -> impl Strategy<Value = BTreeMap<String, String>> {
    proptest::collection::btree_map("[a-z_]{1,10}", "[a-zA-Z0-9.]{1,10}", 0..4)
}

/// Every version-2 request, with valid field values.
fn v2_request() -> impl Strategy<Value = Request> {
    let id = any::<u64>();
    let tok = "[0-9a-f]{0,32}";
    prop_oneof![
        // acquire: TTL, shared/exclusive (timed or bound, min_version), quantity.
        (name(), name(), any::<bool>(), ttl()).prop_map(|(resource, holder, wait, t)| {
            Request::Acquire {
                resource,
                holder,
                wait,
                ext: AcquireExt {
                    ttl_ms: Some(t),
                    ..AcquireExt::default()
                },
            }
        }),
        (
            name(),
            name(),
            any::<bool>(),
            proptest::option::of(ttl()),
            any::<bool>(),
            proptest::option::of(any::<u64>())
        )
            .prop_map(|(resource, holder, wait, ttl_ms, shared, min)| {
                let mode = if shared {
                    Mode::Shared
                } else {
                    Mode::Exclusive
                };
                Request::Acquire {
                    resource,
                    holder,
                    wait,
                    ext: AcquireExt {
                        ttl_ms,
                        mode: Some(mode),
                        min_version: if shared { min } else { None },
                        ..AcquireExt::default()
                    },
                }
            }),
        (
            name(),
            name(),
            any::<bool>(),
            proptest::option::of(ttl()),
            1u32..,
            proptest::option::of(selector()),
            proptest::option::of(attrs())
        )
            .prop_map(
                |(resource, holder, wait, ttl_ms, q, requirements, attributes)| {
                    Request::Acquire {
                        resource,
                        holder,
                        wait,
                        ext: AcquireExt {
                            ttl_ms,
                            quantity: Some(q),
                            requirements,
                            attributes,
                            ..AcquireExt::default()
                        },
                    }
                }
            ),
        (id, tok, proptest::option::of(ttl())).prop_map(|(lease_id, token, ttl_ms)| {
            Request::Renew {
                lease_id,
                token,
                ttl_ms,
            }
        }),
        (id, tok).prop_map(|(lease_id, token)| Request::Commit { lease_id, token }),
        (id, tok).prop_map(|(lease_id, token)| Request::Resume { lease_id, token }),
        id.prop_map(|lease_id| Request::Lease { lease_id }),
        (proptest::option::of(name()), proptest::option::of(name()))
            .prop_map(|(resource, holder)| Request::Leases { resource, holder }),
        (
            name(),
            name(),
            any::<u32>(),
            attrs(),
            proptest::option::of(ttl()),
            proptest::option::of(selector()),
            proptest::option::of("[a-z]{0,10}")
        )
            .prop_map(
                |(
                    pool,
                    name,
                    quantity,
                    attributes,
                    max_lease_time_ms,
                    requirements,
                    admin_token,
                )| {
                    Request::Offer {
                        pool,
                        name,
                        quantity,
                        attributes,
                        max_lease_time_ms,
                        requirements,
                        admin_token,
                    }
                }
            ),
        (name(), name(), proptest::option::of("[a-z]{0,10}")).prop_map(
            |(pool, name, admin_token)| Request::Withdraw {
                pool,
                name,
                admin_token
            }
        ),
        (id, tok).prop_map(|(lease_id, token)| Request::Release {
            resource: None,
            lease_id: Some(lease_id),
            token: Some(token),
        }),
        (
            id,
            proptest::option::of(".{0,20}"),
            proptest::option::of("[a-z]{0,10}")
        )
            .prop_map(|(lease_id, reason, admin_token)| Request::Revoke {
                resource: None,
                lease_id: Some(lease_id),
                reason,
                admin_token,
            }),
        any::<bool>().prop_map(|b| Request::Status { sessions: Some(b) }),
    ]
}

/// A JSON value of the wrong type for any field.
fn wrong_type() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(null)),
        Just(json!(-1)),
        Just(json!(1.5)),
        Just(json!("7")),
        Just(json!([1])),
        Just(json!({"a": 1})),
        Just(json!(true)),
        Just(json!(u64::MAX as f64 * 2.0)),
    ]
}

/// A name that the decoder refuses (empty, too long, control characters).
fn bad_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("x".repeat(lockd::proto::MAX_NAME_LEN + 1)),
        "[a-z]{0,4}[\\x00-\\x1f][a-z]{0,4}".prop_map(|s| s),
    ]
}

/// A selector text that does not parse.
fn bad_selector() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("a in".to_string()),
        Just("a in ()".to_string()),
        Just("a >".to_string()),
        Just("a > b".to_string()),
        Just("(".to_string()),
        Just("a in (b".to_string()),
        Just("a,,b".to_string()),
        Just("=b".to_string()),
        "[=!<>(),]{1,6}".prop_map(|s| s),
    ]
}

/// A valid version-1 acquire, as JSON (to be made invalid).
fn base() -> impl Strategy<Value = Value> {
    (name(), name()).prop_map(|(r, h)| json!({"op":"acquire","resource":r,"holder":h}))
}

/// A version-2 request made invalid in one field, and the error code it must get
/// (`None`: any error).
fn invalid_v2() -> impl Strategy<Value = (Value, Option<ErrorCode>)> {
    use ErrorCode::{BadRequest as Bad, InvalidArgument as Inv};
    prop_oneof![
        // Out of range.
        base().prop_map(|mut v| { v["ttl_ms"] = json!(0); (v, Some(Inv)) }),
        (base(), MAX_TTL_MS + 1..).prop_map(|(mut v, t)| { v["ttl_ms"] = json!(t); (v, Some(Inv)) }),
        base().prop_map(|mut v| { v["quantity"] = json!(0); (v, Some(Inv)) }),
        (base(), any::<u64>()).prop_map(|(mut v, m)| { v["min_version"] = json!(m); (v, Some(Inv)) }),
        (base(), any::<u64>()).prop_map(|(mut v, m)| { v["mode"] = json!("exclusive"); v["min_version"] = json!(m); (v, Some(Inv)) }),
        (base(), 1u32..).prop_map(|(mut v, q)| { v["quantity"] = json!(q); v["mode"] = json!("shared"); (v, Some(Inv)) }),
        (base(), selector()).prop_map(|(mut v, s)| { v["requirements"] = json!(s); v["ttl_ms"] = json!(5); (v, Some(Inv)) }),
        (base(), attrs()).prop_map(|(mut v, a)| { v["attributes"] = json!(a); (v, Some(Inv)) }),
        (base(), bad_selector()).prop_map(|(mut v, s)| { v["quantity"] = json!(1); v["requirements"] = json!(s); (v, Some(Inv)) }),
        (base(), bad_name()).prop_map(|(mut v, k)| { v["quantity"] = json!(1); v["attributes"] = json!({k: "v"}); (v, Some(Inv)) }),
        (base(), bad_name()).prop_map(|(mut v, x)| { v["quantity"] = json!(1); v["attributes"] = json!({"k": x}); (v, Some(Inv)) }),
        (bad_name(), 1u64..).prop_map(|(r, t)| (json!({"op":"acquire","resource":r,"holder":"h","ttl_ms":t}), Some(Inv))),
        (1u64.., 0u64..1).prop_map(|(id, t)| (json!({"op":"renew","lease_id":id,"token":"t","ttl_ms":t}), Some(Inv))),
        (name(), bad_name()).prop_map(|(p, n)| (json!({"op":"offer","pool":p,"name":n,"quantity":1}), Some(Inv))),
        (bad_name(), name()).prop_map(|(p, n)| (json!({"op":"withdraw","pool":p,"name":n}), Some(Inv))),
        (name(), name(), bad_selector()).prop_map(|(p, n, s)| (json!({"op":"offer","pool":p,"name":n,"quantity":1,"requirements":s}), Some(Inv))),
        (name(), name()).prop_map(|(p, n)| (json!({"op":"offer","pool":p,"name":n,"quantity":1,"max_lease_time_ms":0}), Some(Inv))),
        bad_name().prop_map(|r| (json!({"op":"leases","resource":r}), Some(Inv))),
        bad_name().prop_map(|h| (json!({"op":"leases","holder":h}), Some(Inv))),
        // Structure: both targets, a lease id without its token, neither.
        (name(), any::<u64>()).prop_map(|(r, id)| (json!({"op":"release","resource":r,"lease_id":id,"token":"t"}), Some(Bad))),
        any::<u64>().prop_map(|id| (json!({"op":"release","lease_id":id}), Some(Bad))),
        Just((json!({"op":"revoke"}), Some(Bad))),
        (name(), any::<u64>()).prop_map(|(r, id)| (json!({"op":"revoke","resource":r,"lease_id":id}), Some(Bad))),
        // Missing required fields.
        Just((json!({"op":"renew","token":"t"}), Some(Bad))),
        Just((json!({"op":"renew","lease_id":1}), Some(Bad))),
        Just((json!({"op":"commit","lease_id":1}), Some(Bad))),
        Just((json!({"op":"resume","token":"t"}), Some(Bad))),
        Just((json!({"op":"lease"}), Some(Bad))),
        Just((json!({"op":"offer","pool":"p","name":"n"}), Some(Bad))),
        Just((json!({"op":"withdraw","pool":"p"}), Some(Bad))),
        // Unknown enum value.
        (base(), "[a-z]{1,10}").prop_filter("not a mode", |(_, m)| m != "shared" && m != "exclusive")
            .prop_map(|(mut v, m)| { v["mode"] = json!(m); (v, Some(Bad)) }),
        // Wrong types, in any field of any v2 op.
        (
            prop_oneof![
                Just(json!({"op":"acquire","resource":"r","holder":"h","quantity":1})),
                Just(json!({"op":"renew","lease_id":1,"token":"t"})),
                Just(json!({"op":"commit","lease_id":1,"token":"t"})),
                Just(json!({"op":"resume","lease_id":1,"token":"t"})),
                Just(json!({"op":"lease","lease_id":1})),
                Just(json!({"op":"leases","resource":"r","holder":"h"})),
                Just(json!({"op":"offer","pool":"p","name":"n","quantity":1,"attributes":{},"max_lease_time_ms":5})),
                Just(json!({"op":"withdraw","pool":"p","name":"n"})),
                Just(json!({"op":"release","lease_id":1,"token":"t"})),
                Just(json!({"op":"status","sessions":true})),
            ],
            any::<prop::sample::Index>(),
            wrong_type()
        )
            .prop_filter_map("a field that takes this value", |(mut v, i, w)| {
                let keys: Vec<String> = v.as_object()?.keys().filter(|k| *k != "op").cloned().collect();
                let k = i.get(&keys).clone();
                // `null` is absent for optional fields: only wrong for required ones; a
                // value of the field's own JSON type may be valid.
                let same = |a: &Value, b: &Value| {
                    (a.is_string() && b.is_string())
                        || (a.is_boolean() && b.is_boolean())
                        || (a.is_object() && b.is_object())
                        || (a.is_u64() && b.is_u64())
                };
                if w.is_null() || same(&v[&k], &w) {
                    return None;
                }
                v[&k] = w;
                Some((v, None))
            }),
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

    /// The hand-parsed compact version-1 lines (`acquire` / `release`) decode exactly as
    /// serde decodes them: the same line with its `op` key spelled with an escape (which
    /// the fast path always leaves to serde) gives the same answer, for any names, any
    /// spacing, with or without `wait`, and for near misses (a value of another type, a
    /// stray byte).
    #[test]
    fn the_fast_path_decodes_as_serde_does(
        op in prop::sample::select(vec!["acquire", "release", "status", "acquire "]),
        resource in prop_oneof![name(), any::<String>(), Just(String::new())],
        holder in prop_oneof![name(), any::<String>()],
        wait in prop::option::of(prop_oneof![Just("true".to_string()), Just("false".to_string()), Just("1".to_string()), Just("\"x\"".to_string())]),
        sp in prop::sample::select(vec!["", " ", "\t", "\r\n "]),
        with_holder in any::<bool>(),
        junk in prop::option::of(prop::sample::select(vec![",", "}", "x", "\u{0}", " "])),
        raw in any::<bool>(),
    ) {
        // `raw`: names as they come, unescaped (mostly not JSON at all when they hold a
        // quote or a control character); else JSON-encoded.
        let enc = |v: &str| if raw { format!("\"{v}\"") } else { Value::String(v.to_string()).to_string() };
        let body = |op_key: &str| {
            let mut kv = vec![format!("{op_key}{sp}:{sp}\"{op}\""), format!("\"resource\":{sp}{}", enc(&resource))];
            if with_holder {
                kv.push(format!("\"holder\":{}", enc(&holder)));
            }
            if let Some(w) = &wait {
                kv.push(format!("\"wait\"{sp}:{w}"));
            }
            format!("{sp}{{{}}}{sp}{}", kv.join(","), junk.unwrap_or(""))
        };
        let fast = decode_request(body("\"op\"").as_bytes(), 64 * 1024);
        let slow = decode_request(body("\"\\u006fp\"").as_bytes(), 64 * 1024);
        match (&fast, &slow) {
            // serde's error messages quote the position: compare the kinds of error only.
            (Err(a), Err(b)) => prop_assert_eq!(a.code(), b.code()),
            _ => prop_assert_eq!(fast, slow),
        }
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
    fn invalid_v2_requests_are_refused_cleanly((v, code) in invalid_v2()) {
        let line = v.to_string();
        match decode_request(line.as_bytes(), 64 * 1024) {
            Ok(r) => prop_assert!(false, "accepted {line} as {r:?}"),
            Err(e) => {
                if let Some(c) = code {
                    prop_assert_eq!(e.code(), c, "{} -> {}", line, e);
                }
            }
        }
    }

    #[test]
    fn truncated_and_mangled_v2_requests_never_panic(req in v2_request(), cut in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let line = encode_request(&req);
        let bytes = line.trim_end().as_bytes();
        let i = cut.index(bytes.len().max(1));
        let _ = decode_request(&bytes[..i.min(bytes.len())], 64 * 1024);
        let mut m = bytes.to_vec();
        if !m.is_empty() {
            m[i.min(bytes.len() - 1)] = byte;
        }
        let _ = decode_request(&m, 64 * 1024);
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Random lines through `Core::step` (the `core_steps` fuzz target's body), raw bytes.
    #[test]
    fn core_steps_never_panic_on_random_bytes(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        core_steps_driver::run(&data);
    }

    /// The same with lines that are mostly structured requests, ticks and restarts.
    #[test]
    fn core_steps_never_panic_on_structured_lines(lines in proptest::collection::vec(
        (0u8..16, 4u8..16, proptest::collection::vec(any::<u8>(), 0..10)), 0..120)) {
        let mut data = Vec::new();
        for (slot, kind, rest) in lines {
            data.push(slot * 16 + kind);
            data.extend(rest.into_iter().filter(|b| *b != b'\n'));
            data.push(b'\n');
        }
        core_steps_driver::run(&data);
    }
}
