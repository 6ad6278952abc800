//! Property tests (run in CI): every message round-trips through encode/decode, and the
//! decoder never panics on arbitrary or mutated bytes. The cargo-fuzz target in
//! `gms-client/fuzz` drives the same entry points for longer runs.

use gms_client::protocol::*;
use proptest::prelude::*;

fn s() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9._-]{0,40}",
        ".{0,300}", // any unicode, str8/str16 lengths
    ]
}

fn info() -> impl Strategy<Value = AllocationInfo> {
    (s(), any::<u64>(), any::<u64>(), s(), any::<u64>()).prop_map(
        |(allocation_id, size, aligned_size, tag, layout_slot)| AllocationInfo {
            allocation_id,
            size,
            aligned_size,
            tag,
            layout_slot,
        },
    )
}

fn req() -> impl Strategy<Value = RequestedLockType> {
    prop_oneof![
        Just(RequestedLockType::Rw),
        Just(RequestedLockType::Ro),
        Just(RequestedLockType::RwOrRo),
        Just(RequestedLockType::RwDataOrRw)
    ]
}

fn granted() -> impl Strategy<Value = Option<GrantedLockType>> {
    prop_oneof![
        Just(None),
        Just(Some(GrantedLockType::Rw)),
        Just(Some(GrantedLockType::Ro)),
        Just(Some(GrantedLockType::RwData))
    ]
}

fn message() -> impl Strategy<Value = Message> {
    use Message::*;
    let simple = prop_oneof![
        Just(CommitRequest),
        Just(CommitLayoutRequest),
        Just(GetLockStateRequest),
        Just(GetMemoryLayoutHashRequest),
        Just(GetAllocationStateRequest),
        Just(GetRuntimeStateRequest),
        Just(GetEventHistoryRequest),
        (req(), proptest::option::of(any::<u64>())).prop_map(|(lock_type, timeout_ms)| {
            HandshakeRequest {
                lock_type,
                timeout_ms,
            }
        }),
        (any::<bool>(), any::<bool>(), granted()).prop_map(|(success, committed, g)| {
            HandshakeResponse {
                success,
                committed,
                granted_lock_type: g,
            }
        }),
        any::<bool>().prop_map(|success| CommitResponse { success }),
        (any::<bool>(), s(), granted()).prop_map(|(success, h, g)| CommitLayoutResponse {
            success,
            memory_layout_hash: h,
            granted_lock_type: g,
        }),
        (
            s(),
            any::<bool>(),
            any::<u64>(),
            any::<u64>(),
            any::<[bool; 3]>()
        )
            .prop_map(|(state, a, b, c, f)| GetLockStateResponse(LockStateInfo {
                state,
                has_rw_session: a,
                ro_session_count: b,
                waiting_writers: c,
                committed: f[0],
                is_ready: f[1],
                layout_committed: f[2],
            })),
        s().prop_map(|h| GetMemoryLayoutHashResponse {
            memory_layout_hash: h
        }),
        any::<u64>().prop_map(|n| GetAllocationStateResponse {
            allocation_count: n
        }),
    ];
    let more = prop_oneof![
        (any::<u64>(), s()).prop_map(|(size, tag)| AllocateRequest { size, tag }),
        (s(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(id, a, b, c)| {
            AllocateResponse {
                allocation_id: id,
                size: a,
                aligned_size: b,
                layout_slot: c,
            }
        }),
        s().prop_map(|id| ExportAllocationRequest { allocation_id: id }),
        info().prop_map(ExportAllocationResponse),
        s().prop_map(|id| GetAllocationRequest { allocation_id: id }),
        info().prop_map(GetAllocationResponse),
        proptest::option::of(s()).prop_map(|tag| ListAllocationsRequest { tag }),
        proptest::collection::vec(info(), 0..20)
            .prop_map(|allocations| ListAllocationsResponse { allocations }),
        s().prop_map(|id| FreeAllocationRequest { allocation_id: id }),
        any::<bool>().prop_map(|success| FreeAllocationResponse { success }),
        (
            s(),
            s(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(key, id, off, value)| MetadataPutRequest {
                key,
                allocation_id: id,
                offset_bytes: off,
                value
            }),
        any::<bool>().prop_map(|success| MetadataPutResponse { success }),
    ];
    let rest = prop_oneof![
        s().prop_map(|key| MetadataGetRequest { key }),
        (
            any::<bool>(),
            proptest::option::of(s()),
            proptest::option::of(any::<u64>()),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..70000))
        )
            .prop_map(|(found, allocation_id, offset_bytes, value)| {
                MetadataGetResponse {
                    found,
                    allocation_id,
                    offset_bytes,
                    value,
                }
            }),
        s().prop_map(|key| MetadataDeleteRequest { key }),
        any::<bool>().prop_map(|deleted| MetadataDeleteResponse { deleted }),
        s().prop_map(|prefix| MetadataListRequest { prefix }),
        proptest::collection::vec(s(), 0..40).prop_map(|keys| MetadataListResponse { keys }),
        (s(), any::<[bool; 4]>(), any::<[u64; 3]>(), s()).prop_map(|(state, f, n, h)| {
            GetRuntimeStateResponse(RuntimeState {
                state,
                has_rw_session: f[0],
                ro_session_count: n[0],
                waiting_writers: n[1],
                committed: f[1],
                is_ready: f[2],
                allocation_count: n[2],
                memory_layout_hash: h,
                layout_committed: f[3],
            })
        }),
        proptest::collection::vec((s(), any::<u64>()), 0..20).prop_map(|v| {
            GetEventHistoryResponse {
                events: v
                    .into_iter()
                    .map(|(kind, allocation_count)| RuntimeEvent {
                        kind,
                        allocation_count,
                    })
                    .collect(),
            }
        }),
        (s(), any::<i64>()).prop_map(|(error, code)| ErrorResponse { error, code }),
    ];
    prop_oneof![simple, more, rest]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn round_trip(m in message()) {
        let body = m.encode();
        prop_assert_eq!(Message::decode(&body), Ok(m.clone()));
        let frame = m.encode_frame();
        let (msgs, used) = decode_frames(&frame);
        prop_assert_eq!(used, frame.len());
        prop_assert_eq!(msgs, vec![Ok(m)]);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Message::decode(&bytes);
        let _ = decode_frames(&bytes);
    }

    #[test]
    fn mutated_messages_never_panic(
        m in message(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let mut body = m.encode();
        for (i, b) in flips {
            if !body.is_empty() {
                let n = body.len();
                body[i % n] = b;
            }
        }
        let n = body.len();
        let _ = Message::decode(&body);
        let _ = Message::decode(&body[..cut % (n + 1)]);
    }
}
