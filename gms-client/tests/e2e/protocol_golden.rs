//! Golden byte vectors for every message of gms-wire.md, checked in both directions:
//! our encoder must produce exactly these bytes, and our decoder must read them (and the
//! same map with keys shuffled and unknown keys added).
//!
//! The expected bytes are built here from the spec's rules (tag first, fields in listed
//! order, nil for absent optionals, bin for bytes, smallest msgpack int/str forms), with a
//! tiny msgpack writer independent of the crate's encoder; the three reference encodings
//! printed in gms-wire.md are checked verbatim.

use gms_client::protocol::*;

// --- an independent minimal msgpack writer -------------------------------------------
#[derive(Clone)]
enum V {
    Nil,
    B(bool),
    U(u64),
    I(i64),
    S(&'static str),
    Own(String),
    Bin(Vec<u8>),
    A(Vec<V>),
    M(Vec<(&'static str, V)>),
}

fn w(v: &V, out: &mut Vec<u8>) {
    match v {
        V::Nil => out.push(0xc0),
        V::B(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        V::U(u) => {
            let u = *u;
            if u < 128 {
                out.push(u as u8)
            } else if u < 256 {
                out.extend([0xcc, u as u8])
            } else if u < 65536 {
                out.push(0xcd);
                out.extend((u as u16).to_be_bytes())
            } else if u < (1 << 32) {
                out.push(0xce);
                out.extend((u as u32).to_be_bytes())
            } else {
                out.push(0xcf);
                out.extend(u.to_be_bytes())
            }
        }
        V::I(i) => {
            let i = *i;
            if i >= 0 {
                w(&V::U(i as u64), out)
            } else if i >= -32 {
                out.push(i as i8 as u8)
            } else if i >= -128 {
                out.extend([0xd0, i as i8 as u8])
            } else {
                out.push(0xd3);
                out.extend(i.to_be_bytes())
            }
        }
        V::S(s) => wstr(s, out),
        V::Own(s) => wstr(s, out),
        V::Bin(b) => {
            assert!(b.len() < 256);
            out.extend([0xc4, b.len() as u8]);
            out.extend(b)
        }
        V::A(a) => {
            assert!(a.len() < 16);
            out.push(0x90 | a.len() as u8);
            for x in a {
                w(x, out)
            }
        }
        V::M(m) => {
            assert!(m.len() < 16);
            out.push(0x80 | m.len() as u8);
            for (k, x) in m {
                wstr(k, out);
                w(x, out)
            }
        }
    }
}

fn wstr(s: &str, out: &mut Vec<u8>) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8)
    } else {
        assert!(n < 256);
        out.extend([0xd9, n as u8])
    }
    out.extend(s.as_bytes())
}

fn bytes(v: &V) -> Vec<u8> {
    let mut o = Vec::new();
    w(v, &mut o);
    o
}

fn msg(tag: &'static str, fields: Vec<(&'static str, V)>) -> V {
    let mut m = vec![("type", V::S(tag))];
    m.extend(fields);
    V::M(m)
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn alloc_info() -> AllocationInfo {
    AllocationInfo {
        allocation_id: "6f1c2a9e-0000-4000-8000-000000000001".into(),
        size: 1000,
        aligned_size: 2097152,
        tag: "weights".into(),
        layout_slot: 3,
    }
}

fn alloc_fields() -> Vec<(&'static str, V)> {
    vec![
        (
            "allocation_id",
            V::S("6f1c2a9e-0000-4000-8000-000000000001"),
        ),
        ("size", V::U(1000)),
        ("aligned_size", V::U(2097152)),
        ("tag", V::S("weights")),
        ("layout_slot", V::U(3)),
    ]
}

const HASH: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// (message, expected map) for every message type.
fn cases() -> Vec<(Message, V)> {
    use Message::*;
    vec![
        (
            HandshakeRequest {
                lock_type: RequestedLockType::Ro,
                timeout_ms: Some(30000),
            },
            msg(
                "handshake_request",
                vec![("lock_type", V::S("ro")), ("timeout_ms", V::U(30000))],
            ),
        ),
        (
            HandshakeRequest {
                lock_type: RequestedLockType::RwDataOrRw,
                timeout_ms: None,
            },
            msg(
                "handshake_request",
                vec![("lock_type", V::S("rw_data_or_rw")), ("timeout_ms", V::Nil)],
            ),
        ),
        (
            HandshakeResponse {
                success: true,
                committed: false,
                granted_lock_type: Some(GrantedLockType::Rw),
            },
            msg(
                "handshake_response",
                vec![
                    ("success", V::B(true)),
                    ("committed", V::B(false)),
                    ("granted_lock_type", V::S("rw")),
                ],
            ),
        ),
        (
            HandshakeResponse {
                success: false,
                committed: false,
                granted_lock_type: None,
            },
            msg(
                "handshake_response",
                vec![
                    ("success", V::B(false)),
                    ("committed", V::B(false)),
                    ("granted_lock_type", V::Nil),
                ],
            ),
        ),
        (CommitRequest, msg("commit_request", vec![])),
        (
            CommitResponse { success: true },
            msg("commit_response", vec![("success", V::B(true))]),
        ),
        (CommitLayoutRequest, msg("commit_layout_request", vec![])),
        (
            CommitLayoutResponse {
                success: true,
                memory_layout_hash: HASH.into(),
                granted_lock_type: Some(GrantedLockType::RwData),
            },
            msg(
                "commit_layout_response",
                vec![
                    ("success", V::B(true)),
                    ("memory_layout_hash", V::S(HASH)),
                    ("granted_lock_type", V::S("rw_data")),
                ],
            ),
        ),
        (GetLockStateRequest, msg("get_lock_state_request", vec![])),
        (
            GetLockStateResponse(LockStateInfo {
                state: "RO".into(),
                has_rw_session: false,
                ro_session_count: 2,
                waiting_writers: 1,
                committed: true,
                is_ready: true,
                layout_committed: true,
            }),
            msg(
                "get_lock_state_response",
                vec![
                    ("state", V::S("RO")),
                    ("has_rw_session", V::B(false)),
                    ("ro_session_count", V::U(2)),
                    ("waiting_writers", V::U(1)),
                    ("committed", V::B(true)),
                    ("is_ready", V::B(true)),
                    ("layout_committed", V::B(true)),
                ],
            ),
        ),
        (
            GetMemoryLayoutHashRequest,
            msg("get_memory_layout_hash_request", vec![]),
        ),
        (
            GetMemoryLayoutHashResponse {
                memory_layout_hash: String::new(),
            },
            msg(
                "get_memory_layout_hash_response",
                vec![("memory_layout_hash", V::S(""))],
            ),
        ),
        (
            GetAllocationStateRequest,
            msg("get_allocation_state_request", vec![]),
        ),
        (
            GetAllocationStateResponse {
                allocation_count: 1000,
            },
            msg(
                "get_allocation_state_response",
                vec![("allocation_count", V::U(1000))],
            ),
        ),
        (
            AllocateRequest {
                size: 5_000_000_000,
                tag: "default".into(),
            },
            msg(
                "allocate_request",
                vec![("size", V::U(5_000_000_000)), ("tag", V::S("default"))],
            ),
        ),
        (
            AllocateResponse {
                allocation_id: "id-1".into(),
                size: 200,
                aligned_size: 2097152,
                layout_slot: 0,
            },
            msg(
                "allocate_response",
                vec![
                    ("allocation_id", V::S("id-1")),
                    ("size", V::U(200)),
                    ("aligned_size", V::U(2097152)),
                    ("layout_slot", V::U(0)),
                ],
            ),
        ),
        (
            ExportAllocationRequest {
                allocation_id: "id-1".into(),
            },
            msg(
                "export_allocation_request",
                vec![("allocation_id", V::S("id-1"))],
            ),
        ),
        (
            ExportAllocationResponse(alloc_info()),
            msg("export_allocation_response", alloc_fields()),
        ),
        (
            GetAllocationRequest {
                allocation_id: "id-1".into(),
            },
            msg(
                "get_allocation_request",
                vec![("allocation_id", V::S("id-1"))],
            ),
        ),
        (
            GetAllocationResponse(alloc_info()),
            msg("get_allocation_response", alloc_fields()),
        ),
        (
            ListAllocationsRequest { tag: None },
            msg("list_allocations_request", vec![("tag", V::Nil)]),
        ),
        (
            ListAllocationsRequest {
                tag: Some("weights".into()),
            },
            msg("list_allocations_request", vec![("tag", V::S("weights"))]),
        ),
        (
            ListAllocationsResponse {
                allocations: vec![alloc_info()],
            },
            msg(
                "list_allocations_response",
                vec![(
                    "allocations",
                    V::A(vec![msg("get_allocation_response", alloc_fields())]),
                )],
            ),
        ),
        (
            FreeAllocationRequest {
                allocation_id: "id-1".into(),
            },
            msg(
                "free_allocation_request",
                vec![("allocation_id", V::S("id-1"))],
            ),
        ),
        (
            FreeAllocationResponse { success: false },
            msg("free_allocation_response", vec![("success", V::B(false))]),
        ),
        (
            MetadataPutRequest {
                key: "model.layers.0.weight".into(),
                allocation_id: "id-1".into(),
                offset_bytes: 4096,
                value: b"{\"shape\":[2]}".to_vec(),
            },
            msg(
                "metadata_put_request",
                vec![
                    ("key", V::S("model.layers.0.weight")),
                    ("allocation_id", V::S("id-1")),
                    ("offset_bytes", V::U(4096)),
                    ("value", V::Bin(b"{\"shape\":[2]}".to_vec())),
                ],
            ),
        ),
        (
            MetadataPutResponse { success: true },
            msg("metadata_put_response", vec![("success", V::B(true))]),
        ),
        (
            MetadataGetRequest { key: "k".into() },
            msg("metadata_get_request", vec![("key", V::S("k"))]),
        ),
        (
            MetadataGetResponse {
                found: true,
                allocation_id: Some("id-1".into()),
                offset_bytes: Some(0),
                value: Some(vec![]),
            },
            msg(
                "metadata_get_response",
                vec![
                    ("found", V::B(true)),
                    ("allocation_id", V::S("id-1")),
                    ("offset_bytes", V::U(0)),
                    ("value", V::Bin(vec![])),
                ],
            ),
        ),
        (
            MetadataGetResponse {
                found: false,
                allocation_id: None,
                offset_bytes: None,
                value: None,
            },
            msg(
                "metadata_get_response",
                vec![
                    ("found", V::B(false)),
                    ("allocation_id", V::Nil),
                    ("offset_bytes", V::Nil),
                    ("value", V::Nil),
                ],
            ),
        ),
        (
            MetadataDeleteRequest { key: "k".into() },
            msg("metadata_delete_request", vec![("key", V::S("k"))]),
        ),
        (
            MetadataDeleteResponse { deleted: true },
            msg("metadata_delete_response", vec![("deleted", V::B(true))]),
        ),
        (
            MetadataListRequest {
                prefix: "model.".into(),
            },
            msg("metadata_list_request", vec![("prefix", V::S("model."))]),
        ),
        (
            MetadataListResponse {
                keys: vec!["a".into(), "b".into()],
            },
            msg(
                "metadata_list_response",
                vec![("keys", V::A(vec![V::S("a"), V::S("b")]))],
            ),
        ),
        (
            GetRuntimeStateRequest,
            msg("get_runtime_state_request", vec![]),
        ),
        (
            GetRuntimeStateResponse(RuntimeState {
                state: "COMMITTED".into(),
                has_rw_session: false,
                ro_session_count: 0,
                waiting_writers: 0,
                committed: true,
                is_ready: true,
                allocation_count: 3,
                memory_layout_hash: HASH.into(),
                layout_committed: true,
            }),
            msg(
                "get_runtime_state_response",
                vec![
                    ("state", V::S("COMMITTED")),
                    ("has_rw_session", V::B(false)),
                    ("ro_session_count", V::U(0)),
                    ("waiting_writers", V::U(0)),
                    ("committed", V::B(true)),
                    ("is_ready", V::B(true)),
                    ("allocation_count", V::U(3)),
                    ("memory_layout_hash", V::S(HASH)),
                    ("layout_committed", V::B(true)),
                ],
            ),
        ),
        (
            GetEventHistoryRequest,
            msg("get_event_history_request", vec![]),
        ),
        (
            GetEventHistoryResponse {
                events: vec![
                    RuntimeEvent {
                        kind: "rw_connected".into(),
                        allocation_count: 0,
                    },
                    RuntimeEvent {
                        kind: "allocations_cleared".into(),
                        allocation_count: 300,
                    },
                ],
            },
            msg(
                "get_event_history_response",
                vec![(
                    "events",
                    V::A(vec![
                        V::M(vec![
                            ("kind", V::S("rw_connected")),
                            ("allocation_count", V::U(0)),
                        ]),
                        V::M(vec![
                            ("kind", V::S("allocations_cleared")),
                            ("allocation_count", V::U(300)),
                        ]),
                    ]),
                )],
            ),
        ),
        (
            ErrorResponse {
                error: "no lock held by this session".into(),
                code: 403,
            },
            msg(
                "error_response",
                vec![
                    ("error", V::S("no lock held by this session")),
                    ("code", V::U(403)),
                ],
            ),
        ),
        (
            ErrorResponse {
                error: "x".into(),
                code: -1,
            },
            msg(
                "error_response",
                vec![("error", V::S("x")), ("code", V::I(-1))],
            ),
        ),
    ]
}

#[test]
fn spec_reference_encodings_verbatim() {
    let hs = Message::HandshakeRequest {
        lock_type: RequestedLockType::RwOrRo,
        timeout_ms: None,
    };
    let hs_hex = "83a474797065b168616e647368616b655f72657175657374a96c6f636b5f74797065a872775f6f725f726faa74696d656f75745f6d73c0";
    assert_eq!(hs.encode(), unhex(hs_hex));
    assert_eq!(Message::decode(&unhex(hs_hex)).unwrap(), hs);

    let mp = Message::MetadataPutRequest {
        key: "k".into(),
        allocation_id: "id".into(),
        offset_bytes: 3,
        value: vec![1, 2],
    };
    let mp_hex = "85a474797065b46d657461646174615f7075745f72657175657374a36b6579a16bad616c6c6f636174696f6e5f6964a26964ac6f66667365745f627974657303a576616c7565c4020102";
    assert_eq!(mp.encode(), unhex(mp_hex));
    assert_eq!(Message::decode(&unhex(mp_hex)).unwrap(), mp);

    let c_hex = "81a474797065ae636f6d6d69745f72657175657374";
    assert_eq!(Message::CommitRequest.encode(), unhex(c_hex));
    assert_eq!(
        Message::decode(&unhex(c_hex)).unwrap(),
        Message::CommitRequest
    );
}

#[test]
fn every_message_type_has_a_golden_vector() {
    let mut tags: Vec<&str> = cases().iter().map(|(m, _)| m.tag()).collect();
    tags.sort();
    tags.dedup();
    let mut all: Vec<&str> = ALL_TAGS.to_vec();
    all.sort();
    assert_eq!(tags, all);
}

#[test]
fn encoder_produces_golden_bytes() {
    for (m, v) in cases() {
        let want = bytes(&v);
        assert_eq!(m.encode(), want, "encoding of {}", m.tag());
        // Framing: 4-byte big-endian length, then the body.
        let frame = m.encode_frame();
        assert_eq!(&frame[..4], &(want.len() as u32).to_be_bytes());
        assert_eq!(&frame[4..], &want[..]);
    }
}

#[test]
fn decoder_reads_golden_bytes() {
    for (m, v) in cases() {
        assert_eq!(
            Message::decode(&bytes(&v)).unwrap(),
            m,
            "decoding {}",
            m.tag()
        );
    }
}

#[test]
fn decoder_accepts_any_key_order_and_ignores_unknown_keys() {
    for (m, v) in cases() {
        let V::M(mut fields) = v else { unreachable!() };
        fields.reverse();
        fields.insert(1, ("x_unknown_future_field", V::A(vec![V::U(1), V::Nil])));
        fields.push(("another_unknown", V::M(vec![("deep", V::B(true))])));
        assert_eq!(
            Message::decode(&bytes(&V::M(fields))).unwrap(),
            m,
            "shuffled {}",
            m.tag()
        );
    }
}

#[test]
fn absent_optionals_and_defaults_decode() {
    // timeout_ms absent = wait forever; tag absent = "default"; prefix absent = "".
    let v = msg("handshake_request", vec![("lock_type", V::S("ro"))]);
    assert_eq!(
        Message::decode(&bytes(&v)).unwrap(),
        Message::HandshakeRequest {
            lock_type: RequestedLockType::Ro,
            timeout_ms: None
        }
    );
    let v = msg("allocate_request", vec![("size", V::U(1))]);
    assert_eq!(
        Message::decode(&bytes(&v)).unwrap(),
        Message::AllocateRequest {
            size: 1,
            tag: "default".into()
        }
    );
    let v = msg("metadata_list_request", vec![]);
    assert_eq!(
        Message::decode(&bytes(&v)).unwrap(),
        Message::MetadataListRequest { prefix: "".into() }
    );
    // Dynamo's list bodies may also come without their "type" tag.
    let v = msg(
        "list_allocations_response",
        vec![("allocations", V::A(vec![V::M(alloc_fields())]))],
    );
    assert_eq!(
        Message::decode(&bytes(&v)).unwrap(),
        Message::ListAllocationsResponse {
            allocations: vec![alloc_info()]
        }
    );
}

#[test]
fn decoder_refuses_bad_input_with_a_reason() {
    let cases: Vec<(Vec<u8>, DecodeError)> = vec![
        (vec![], DecodeError::Truncated),
        (vec![0xc1], DecodeError::BadMarker(0xc1)),
        (bytes(&V::A(vec![])), DecodeError::NotAMap),
        (
            bytes(&V::M(vec![("lock_type", V::S("ro"))])),
            DecodeError::MissingField("type"),
        ),
        (
            bytes(&msg("nope_request", vec![])),
            DecodeError::UnknownType("nope_request".into()),
        ),
        (
            bytes(&msg("handshake_request", vec![("lock_type", V::S("xx"))])),
            DecodeError::BadValue("lock_type", "xx".into()),
        ),
        (
            bytes(&msg("allocate_request", vec![("size", V::I(-5))])),
            DecodeError::BadValue("size", "-5".into()),
        ),
        (
            bytes(&msg("allocate_request", vec![("size", V::S("5"))])),
            DecodeError::WrongType("size"),
        ),
        // A str32 claiming 4 GiB in a 10-byte body.
        (
            vec![0x81, 0xdb, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00],
            DecodeError::Truncated,
        ),
        // A map32 claiming 4 billion entries.
        (vec![0xdf, 0xff, 0xff, 0xff, 0xff], DecodeError::Truncated),
        // Trailing garbage after the map.
        (
            {
                let mut b = Message::CommitRequest.encode();
                b.push(0);
                b
            },
            DecodeError::TrailingBytes(1),
        ),
        (bytes(&V::Own("x".repeat(3)).clone()), DecodeError::NotAMap),
    ];
    for (input, want) in cases {
        assert_eq!(Message::decode(&input), Err(want), "input {input:02x?}");
    }
    // Deep nesting is refused, not followed.
    let mut deep = vec![0x91; 10_000];
    deep.push(0xc0);
    assert_eq!(Message::decode(&deep), Err(DecodeError::TooDeep));
    // Frame lengths over the limit are refused from the header alone.
    assert!(frame_len((MAX_FRAME_LEN as u32 + 1).to_be_bytes()).is_err());
    assert_eq!(frame_len(7u32.to_be_bytes()), Ok(7));
}

#[test]
fn frames_split_and_concatenated() {
    let a = Message::CommitRequest.encode_frame();
    let b = Message::GetRuntimeStateRequest.encode_frame();
    let mut both = a.clone();
    both.extend(&b);
    let (msgs, used) = decode_frames(&both);
    assert_eq!(used, both.len());
    assert_eq!(
        msgs,
        vec![
            Ok(Message::CommitRequest),
            Ok(Message::GetRuntimeStateRequest)
        ]
    );
    let (msgs, used) = decode_frames(&both[..a.len() + 3]);
    assert_eq!((msgs.len(), used), (1, a.len()));
}
