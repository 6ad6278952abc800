//! The test harness of the core's transition-by-transition tests: a driver that completes
//! every persist, and helpers to read what was sent.
#![allow(dead_code)]

pub(super) use std::time::{Duration, Instant};

pub(super) use super::{
    Config, Core, Input, Now, Output, PersistedResource, PersistedState, SessionId,
};
pub(super) use crate::proto::{
    self, Event, NoticeKind, PeerInfo, Request, ResourceReport, SessionReport,
};

pub(super) const W: u64 = 1000; // reconnect window in ms

pub(super) struct H {
    pub(super) core: Core,
    pub(super) base: Instant,
    pub(super) ms: u64,
    /// Last state the driver was asked to persist.
    pub(super) persisted: Option<PersistedState>,
    /// Number of persists requested.
    pub(super) persists: usize,
}

pub(super) fn peer(t: &str) -> PeerInfo {
    PeerInfo {
        transport: t.into(),
        pid: Some(7),
        uid: Some(0),
        gid: Some(0),
        addr: None,
    }
}

pub(super) fn acq(r: &str, h: &str, wait: bool) -> Request {
    Request::acquire(r, h, wait)
}

/// A version-2 grant as its holder saw it.
#[derive(Debug, Clone)]
pub(super) struct G {
    pub(super) id: u64,
    pub(super) epoch: u64,
    pub(super) token: String,
    pub(super) reclaimed: bool,
    pub(super) lease: proto::LeaseFields,
}

pub(super) fn acq_ttl(r: &str, h: &str, ttl_ms: u64, wait: bool) -> Request {
    Request::Acquire {
        resource: r.into(),
        holder: h.into(),
        wait,
        ext: proto::AcquireExt {
            ttl_ms: Some(ttl_ms),
            ..Default::default()
        },
    }
}

pub(super) fn acq_shared(r: &str, h: &str, shared: bool, min_version: Option<u64>) -> Request {
    Request::Acquire {
        resource: r.into(),
        holder: h.into(),
        wait: true,
        ext: proto::AcquireExt {
            mode: Some(if shared {
                proto::Mode::Shared
            } else {
                proto::Mode::Exclusive
            }),
            min_version,
            ..Default::default()
        },
    }
}

pub(super) fn acq_q(pool: &str, h: &str, q: u32, ttl_ms: Option<u64>, wait: bool) -> Request {
    Request::Acquire {
        resource: pool.into(),
        holder: h.into(),
        wait,
        ext: proto::AcquireExt {
            quantity: Some(q),
            ttl_ms,
            ..Default::default()
        },
    }
}

pub(super) fn offer(pool: &str, name: &str, q: u32, max_ms: Option<u64>) -> Request {
    Request::Offer {
        pool: pool.into(),
        name: name.into(),
        quantity: q,
        attributes: Default::default(),
        max_lease_time_ms: max_ms,
        requirements: None,
        admin_token: None,
    }
}

impl H {
    /// A core restarted from `st` at wall-clock `ms` (a lockd that was down until then).
    pub(super) fn restart_at(st: PersistedState, ms: u64) -> H {
        H::with_cfg(st, None, ms, |_| {})
    }

    /// A core with a modified configuration.
    pub(super) fn with_cfg(
        st: PersistedState,
        admin: Option<&str>,
        ms: u64,
        f: impl FnOnce(&mut Config),
    ) -> H {
        let base = Instant::now();
        let mut cfg = Config {
            reconnect_window: Duration::from_millis(W),
            admin_token: admin.map(str::to_string),
            ..Config::default()
        };
        f(&mut cfg);
        let core = Core::new(
            cfg,
            st,
            Now {
                mono: base + Duration::from_millis(ms),
                unix_ms: ms,
            },
            42,
        )
        .expect("restore");
        H {
            core,
            base,
            ms,
            persisted: None,
            persists: 0,
        }
    }

    /// The version-2 grant sent to `s` among outputs.
    pub(super) fn g(out: &[Output], s: SessionId) -> Option<G> {
        H::to(out, s).into_iter().find_map(|e| match e {
            Event::Granted {
                epoch,
                token,
                reclaimed,
                lease,
                ..
            } => Some(G {
                id: lease.lease_id?,
                epoch,
                token,
                reclaimed,
                lease,
            }),
            _ => None,
        })
    }

    /// The `lease` report of `id`, asked on session `s`.
    pub(super) fn lease(&mut self, s: SessionId, id: u64) -> proto::LeaseReport {
        match H::to(&self.req(s, Request::Lease { lease_id: id }), s).pop() {
            Some(Event::Lease(r)) => *r,
            other => panic!("no lease report: {other:?}"),
        }
    }

    /// The full status.
    pub(super) fn st(&self) -> proto::StatusReport {
        self.core.status(self.now(), true)
    }
}

impl H {
    pub(super) fn with_state(st: PersistedState, admin: Option<&str>) -> H {
        let base = Instant::now();
        let cfg = Config {
            reconnect_window: Duration::from_millis(W),
            admin_token: admin.map(str::to_string),
            ..Config::default()
        };
        let core = Core::new(
            cfg,
            st,
            Now {
                mono: base,
                unix_ms: 0,
            },
            42,
        )
        .expect("restore");
        H {
            core,
            base,
            ms: 0,
            persisted: None,
            persists: 0,
        }
    }
    pub(super) fn new() -> H {
        H::with_state(PersistedState::default(), None)
    }
    pub(super) fn now(&self) -> Now {
        Now {
            mono: self.base + Duration::from_millis(self.ms),
            unix_ms: self.ms,
        }
    }
    /// Step without acknowledging persists.
    pub(super) fn raw(&mut self, i: Input) -> Vec<Output> {
        let n = self.now();
        self.core.step(n, i)
    }
    /// Step like the driver: complete every persist, return everything else in order.
    pub(super) fn step(&mut self, i: Input) -> Vec<Output> {
        let mut out = Vec::new();
        let mut q = vec![i];
        while let Some(i) = q.pop() {
            for o in self.raw(i) {
                match o {
                    Output::Persist { seq } => {
                        self.persisted = Some(self.core.snapshot());
                        self.persists += 1;
                        q.push(Input::Persisted { seq });
                    }
                    o => out.push(o),
                }
            }
        }
        out
    }
    pub(super) fn connect(&mut self, s: SessionId, transport: &str) {
        let out = self.step(Input::Connect {
            session: s,
            peer: peer(transport),
        });
        assert_eq!(
            out,
            vec![Output::Send {
                session: s,
                event: Event::Hello {
                    server: "lockd".into(),
                    version: proto::PROTOCOL_VERSION,
                    session: s,
                    features: proto::FEATURES.iter().map(|f| f.to_string()).collect(),
                }
            }]
        );
    }
    pub(super) fn req(&mut self, s: SessionId, r: Request) -> Vec<Output> {
        self.step(Input::Request { session: s, req: r })
    }
    /// Events sent to `s` among outputs.
    pub(super) fn to(out: &[Output], s: SessionId) -> Vec<Event> {
        out.iter()
            .filter_map(|o| match o {
                Output::Send { session, event } if *session == s => Some(event.clone()),
                _ => None,
            })
            .collect()
    }
    pub(super) fn granted(out: &[Output], s: SessionId) -> Option<(u64, String, bool)> {
        H::to(out, s).into_iter().find_map(|e| match e {
            Event::Granted {
                epoch,
                token,
                reclaimed,
                ..
            } => Some((epoch, token, reclaimed)),
            _ => None,
        })
    }
    pub(super) fn err_code(out: &[Output], s: SessionId) -> Option<String> {
        H::to(out, s).into_iter().find_map(|e| match e {
            Event::Error { code, .. } => Some(code),
            _ => None,
        })
    }
    pub(super) fn res(&self, r: &str) -> ResourceReport {
        let st = self.core.status(self.now(), true);
        st.resources.into_iter().find(|x| x.name == r).unwrap()
    }
}

impl H {
    pub(super) fn connect_raw_queued(&mut self, s: SessionId) {
        let out = self.raw(Input::Connect {
            session: s,
            peer: peer("unix"),
        });
        assert!(
            out.is_empty(),
            "hello must wait behind the outstanding persist: {out:?}"
        );
    }
}

pub(super) fn restarted() -> (H, String) {
    let mut h = H::new();
    h.connect(1, "unix");
    let (_, token, _) = H::granted(&h.req(1, acq("e", "a", true)), 1).unwrap();
    let st = h.persisted.clone().unwrap();
    (H::with_state(st, None), token)
}

pub(super) fn session(h: &H, id: SessionId) -> Option<SessionReport> {
    h.core
        .status(h.now(), true)
        .sessions
        .into_iter()
        .find(|x| x.id == id)
}
