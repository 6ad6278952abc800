//! The body of the `core_steps` fuzz target, shared with the CI-run proptest twin
//! (`lockd/tests/e2e/proto_proptest.rs` includes this file with `#[path]`), so that both
//! run exactly the same code path.
//!
//! The input is split into lines; the first byte of each line says what it is, for one of
//! [`SESSIONS`] client slots:
//! * a raw request line (the rest of the line, decoded like the server does: a line that
//!   does not decode is dropped, as the server answers it with an `error` itself);
//! * a structured request of every protocol-2 op, its fields drawn from the next bytes
//!   (small resource names, lease ids and tokens lockd handed out, so that the core's
//!   interesting paths are reached, not only its refusals);
//! * time passing (a `Tick` after up to 6.5 s), a disconnect / reconnect of the slot,
//!   the acknowledgement of the pending durable write, or a crash: the core is rebuilt from
//!   the last *acknowledged* snapshot, which must restore.
//!
//! Asserts that nothing panics, that every durable snapshot decodes (`decode_state`, the
//! server's path) and restores (`Core::new`), and that a version-1 grant is never sent
//! before its epoch is durable.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lockd::core::{Config, Core, Input, Now, Output, PersistedState};
use lockd::proto::{decode_request, AcquireExt, Event, Mode, PeerInfo, Request};

/// Client slots.
pub const SESSIONS: u8 = 3;

const RES: [&str; 3] = ["r0", "r1", "gpus"];
const OFFERS: &str = r#"{"gpus":[{"name":"a","quantity":4,"attributes":{"zone":"a"},"max_lease_time_ms":2000},{"name":"b","quantity":2,"attributes":{"zone":"b"},"requirements":"team in (x)"}]}"#;

struct Driver {
    core: Core,
    base: Instant,
    ms: u64,
    /// Last acknowledged (durable) snapshot.
    durable: PersistedState,
    /// Requested, not yet acknowledged: (seq, snapshot).
    unwritten: Option<(u64, PersistedState)>,
    /// Session id of each slot while connected.
    slots: [Option<u64>; SESSIONS as usize],
    next_session: u64,
    /// (lease id -> token) of every grant seen.
    tokens: BTreeMap<u64, String>,
    /// Lease ids seen (granted or queued), for requests by id.
    ids: Vec<u64>,
    restarts: u32,
}

fn cfg() -> Config {
    Config {
        reconnect_window: Duration::from_millis(800),
        admin_token: Some("t".into()),
        max_lease_time: Duration::from_secs(5),
        max_total_lease_time: Duration::from_secs(20),
        max_tombstones: 16,
        tombstone_max_age: Duration::from_secs(30),
        offers: lockd::offers_file::parse(OFFERS).expect("offers"),
        break_deadlocks: true,
    }
}

impl Driver {
    fn new() -> Driver {
        let base = Instant::now();
        let now = Now {
            mono: base,
            unix_ms: 1_000_000,
        };
        let core = Core::new(cfg(), PersistedState::default(), now, 7).expect("empty state");
        Driver {
            core,
            base,
            ms: 0,
            durable: PersistedState::default(),
            unwritten: None,
            slots: [None; SESSIONS as usize],
            next_session: 1,
            tokens: BTreeMap::new(),
            ids: Vec::new(),
            restarts: 0,
        }
    }

    fn now(&self) -> Now {
        Now {
            mono: self.base + Duration::from_millis(self.ms),
            unix_ms: 1_000_000 + self.ms,
        }
    }

    fn step(&mut self, i: Input) {
        let now = self.now();
        for o in self.core.step(now, i) {
            match o {
                Output::Persist { seq } => self.unwritten = Some((seq, self.core.snapshot())),
                Output::Send { event, .. } => self.seen(event),
                Output::Notice { .. } => {}
            }
        }
    }

    fn seen(&mut self, ev: Event) {
        match ev {
            Event::Granted {
                resource,
                epoch,
                token,
                lease,
                ..
            } => {
                let durable = self.durable.resources.get(&resource).map_or(0, |r| r.epoch);
                // Version-1 leases live in `resources`; the other kinds' epochs are checked
                // through the same table when they have an entry there.
                if lease.lease_id.is_none() {
                    assert!(
                        durable >= epoch,
                        "grant of {resource}@{epoch} before it was durable ({durable})"
                    );
                }
                if let Some(id) = lease.lease_id {
                    self.tokens.insert(id, token);
                    self.ids.push(id);
                }
            }
            Event::Queued {
                lease_id: Some(id), ..
            } => self.ids.push(id),
            _ => {}
        }
    }

    fn ack(&mut self) {
        if let Some((seq, snap)) = self.unwritten.take() {
            self.durable = snap;
            self.step(Input::Persisted { seq });
        }
    }

    fn restart(&mut self) {
        self.restarts += 1;
        self.unwritten = None;
        self.slots = [None; SESSIONS as usize];
        let now = self.now();
        let snap = self.durable.clone();
        let json = serde_json::to_string(&snap).expect("snapshot serializes");
        let (back, _) = lockd::core::decode_state(json.as_bytes())
            .unwrap_or_else(|e| panic!("a snapshot does not decode: {e}: {json}"));
        let seed = 7 + u64::from(self.restarts);
        self.core = Core::new(cfg(), back, now, seed)
            .unwrap_or_else(|e| panic!("a durable snapshot does not restore: {e}: {json}"));
    }

    fn session(&mut self, slot: u8) -> u64 {
        let k = usize::from(slot % SESSIONS);
        if let Some(s) = self.slots[k] {
            return s;
        }
        let s = self.next_session;
        self.next_session += 1;
        self.slots[k] = Some(s);
        self.step(Input::Connect {
            session: s,
            peer: PeerInfo {
                transport: "unix".into(),
                pid: Some(1),
                ..PeerInfo::default()
            },
        });
        s
    }

    fn disconnect(&mut self, slot: u8) {
        if let Some(s) = self.slots[usize::from(slot % SESSIONS)].take() {
            self.step(Input::Disconnect { session: s });
        }
    }

    /// A lease id: one seen (most of the time), or any.
    fn id(&self, b: u8) -> u64 {
        if self.ids.is_empty() || b >= 240 {
            u64::from(b)
        } else {
            self.ids[usize::from(b) % self.ids.len()]
        }
    }

    /// Its token (or a wrong one, for odd `b` high bits).
    fn token(&self, id: u64, b: u8) -> String {
        match self.tokens.get(&id) {
            Some(t) if b & 0x80 == 0 => t.clone(),
            _ => "00".into(),
        }
    }
}

fn at(bytes: &[u8], i: usize) -> u8 {
    bytes.get(i).copied().unwrap_or(0)
}

/// A request of any op, fields from `b`.
fn structured(d: &Driver, b: &[u8]) -> Request {
    let res = RES[usize::from(at(b, 1)) % RES.len()].to_string();
    let holder = format!("h{}", at(b, 2) % 4);
    let id = d.id(at(b, 3));
    let token = d.token(id, at(b, 4));
    let ttl = |x: u8| (x > 0).then(|| u64::from(x) * 20);
    match at(b, 0) % 14 {
        0 => Request::acquire(res, holder, at(b, 5) & 1 == 0),
        1 => Request::Acquire {
            resource: res,
            holder,
            wait: at(b, 5) & 1 == 0,
            ext: AcquireExt {
                ttl_ms: Some(u64::from(at(b, 6)) * 20 + 1),
                ..AcquireExt::default()
            },
        },
        2 => Request::Acquire {
            resource: res,
            holder,
            wait: at(b, 5) & 1 == 0,
            ext: AcquireExt {
                ttl_ms: ttl(at(b, 6) & 0x3f),
                mode: Some(if at(b, 7) & 1 == 0 {
                    Mode::Shared
                } else {
                    Mode::Exclusive
                }),
                min_version: (at(b, 7) & 6 == 6 && at(b, 7) & 1 == 0)
                    .then(|| u64::from(at(b, 8) % 4)),
                ..AcquireExt::default()
            },
        },
        3 => Request::Acquire {
            resource: "gpus".into(),
            holder,
            wait: at(b, 5) & 1 == 0,
            ext: AcquireExt {
                ttl_ms: ttl(at(b, 6)),
                quantity: Some(u32::from(at(b, 7) % 8) + 1),
                requirements: (at(b, 8) & 1 == 1).then(|| "zone in (a,b)".to_string()),
                attributes: (at(b, 8) & 2 == 2)
                    .then(|| [("team".to_string(), "x".to_string())].into()),
                ..AcquireExt::default()
            },
        },
        4 => Request::Renew {
            lease_id: id,
            token,
            ttl_ms: ttl(at(b, 6) & 0x1f),
        },
        5 => Request::Commit {
            lease_id: id,
            token,
        },
        6 => Request::Resume {
            lease_id: id,
            token,
        },
        7 => Request::Lease { lease_id: id },
        8 => Request::Leases {
            resource: (at(b, 5) & 1 == 1).then_some(res),
            holder: (at(b, 5) & 2 == 2).then_some(holder),
        },
        9 => Request::Release {
            resource: None,
            lease_id: Some(id),
            token: Some(token),
        },
        10 => Request::release(res),
        11 => Request::Revoke {
            resource: (at(b, 5) & 1 == 1).then(|| res.clone()),
            lease_id: (at(b, 5) & 1 == 0).then_some(id),
            reason: Some("fuzz".into()),
            admin_token: Some("t".into()),
        },
        12 => Request::Offer {
            pool: "gpus".into(),
            name: ["a", "b", "c"][usize::from(at(b, 5)) % 3].into(),
            quantity: u32::from(at(b, 6) % 6),
            attributes: [("zone".to_string(), "a".to_string())].into(),
            max_lease_time_ms: ttl(at(b, 7)),
            requirements: None,
            admin_token: Some("t".into()),
        },
        _ => {
            if at(b, 5) & 1 == 0 {
                Request::Withdraw {
                    pool: "gpus".into(),
                    name: ["a", "b", "c"][usize::from(at(b, 6)) % 3].into(),
                    admin_token: Some("t".into()),
                }
            } else {
                Request::Status {
                    sessions: Some(at(b, 6) & 1 == 0),
                }
            }
        }
    }
}

/// Feed `data` (see the module docs) through a fresh core.
pub fn run(data: &[u8]) {
    let mut d = Driver::new();
    for line in data.split(|b| *b == b'\n').take(400) {
        let Some((&head, rest)) = line.split_first() else {
            d.ack();
            continue;
        };
        let slot = head / 16;
        match head % 16 {
            0..=3 => {
                if let Ok(req) = decode_request(rest, 4096) {
                    let s = d.session(slot);
                    d.step(Input::Request { session: s, req });
                }
            }
            4..=10 => {
                let req = structured(&d, rest);
                // What the server would send: it goes through the encoder and decoder.
                let line = lockd::proto::encode_request(&req);
                if let Ok(req) = decode_request(line.trim_end().as_bytes(), 4096) {
                    let s = d.session(slot);
                    d.step(Input::Request { session: s, req });
                }
            }
            11 => {
                d.ms += u64::from(u16::from_le_bytes([at(rest, 0), at(rest, 1) % 26]));
                d.step(Input::Tick);
            }
            12 => d.disconnect(slot),
            13 | 14 => d.ack(),
            _ => {
                if at(rest, 0) & 1 == 1 {
                    d.restart();
                } else {
                    d.ack();
                }
            }
        }
        if let Some(deadline) = d.core.next_deadline() {
            // Time never runs backwards; a deadline already due is served at once.
            if deadline <= d.now().mono {
                d.step(Input::Tick);
            }
        }
    }
    d.ack();
    d.ms += 60_000;
    d.step(Input::Tick);
    d.ack();
    d.restart();
}
