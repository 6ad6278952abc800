//! Sessions: connections, their anchors, and what happens to their leases and queued
//! acquires when a connection (or its last anchor) closes.

use std::collections::BTreeSet;

use super::{Core, Now, SessionId};
use crate::proto::{Event, PeerInfo};

/// One connection.
#[derive(Debug, Clone)]
pub(super) struct Session {
    /// Who is connected (SO_PEERCRED / address).
    pub peer: PeerInfo,
    /// Resources it holds.
    pub holds: BTreeSet<String>,
    /// Resources it waits for.
    pub waits: BTreeSet<String>,
    /// Receives notices.
    pub watching: bool,
    /// Its connection is open (false: kept alive by anchors only).
    pub connected: bool,
    /// Open anchors.
    pub anchors: u32,
    /// Version-2 leases and waiting requests whose events go to this session.
    pub leases: BTreeSet<u64>,
    /// Gangs it holds or waits for.
    pub gangs: BTreeSet<u64>,
}

impl Core {
    /// A connection was accepted: a new session, greeted with `hello`.
    pub(super) fn connect(&mut self, session: SessionId, peer: PeerInfo) {
        self.watchers.remove(&session);
        self.sessions.insert(
            session,
            Session {
                peer,
                holds: BTreeSet::new(),
                waits: BTreeSet::new(),
                watching: false,
                connected: true,
                anchors: 0,
                leases: BTreeSet::new(),
                gangs: BTreeSet::new(),
            },
        );
        self.send(
            session,
            Event::Hello {
                server: "lockd".into(),
                version: crate::proto::PROTOCOL_VERSION,
                session,
                features: crate::proto::FEATURES
                    .iter()
                    .map(|f| f.to_string())
                    .collect(),
            },
        );
    }

    /// `anchor` (the driver feeds it only with a valid descriptor attached and watched).
    pub(super) fn anchor(&mut self, s: SessionId) {
        let anchors = match self.sessions.get_mut(&s) {
            Some(sess) => {
                sess.anchors += 1;
                sess.anchors
            }
            None => return,
        };
        self.send(s, Event::Anchored { anchors });
    }

    /// `watch`: the session gets every notice from now on.
    pub(super) fn watch(&mut self, s: SessionId) {
        if let Some(sess) = self.sessions.get_mut(&s) {
            sess.watching = true;
            self.watchers.insert(s);
        }
        self.send(s, Event::Watching {});
    }

    /// The connection closed: an anchored session lives on without it; others end.
    pub(super) fn disconnect(&mut self, now: Now, s: SessionId) {
        let Some(sess) = self.sessions.get_mut(&s) else {
            return;
        };
        if sess.anchors > 0 {
            // Anchored: the holder's processes live on. Keep its leases; withdraw what it
            // waits for (nobody could be told of a grant) and stop its notices.
            sess.connected = false;
            sess.watching = false;
            self.watchers.remove(&s);
            let waits = std::mem::take(&mut sess.waits);
            let leases = sess.leases.clone();
            let gangs = sess.gangs.clone();
            for r in &waits {
                if let Some(res) = self.table.get_noted(r) {
                    res.waiters.remove_session(s);
                }
                self.table.touch(r);
            }
            self.withdraw_waiting(now, &leases);
            let waiting: Vec<u64> = gangs
                .iter()
                .copied()
                .filter(|g| self.gangs.get(g).is_some_and(|g| !g.granted))
                .collect();
            for g in waiting {
                self.gang_end(now, g, None);
            }
            return;
        }
        self.end_session(now, s);
    }

    /// An anchor reached end-of-file: the session ends when it was its last one and the
    /// connection is closed.
    pub(super) fn anchor_closed(&mut self, now: Now, s: SessionId) {
        let Some(sess) = self.sessions.get_mut(&s) else {
            return;
        };
        sess.anchors = sess.anchors.saturating_sub(1);
        if sess.anchors == 0 && !sess.connected {
            self.end_session(now, s);
        }
    }

    /// The session is gone for good: withdraw its acquires, end its leases, grant the next.
    pub(super) fn end_session(&mut self, now: Now, s: SessionId) {
        let Some(sess) = self.sessions.remove(&s) else {
            return;
        };
        self.watchers.remove(&s);
        for g in &sess.gangs {
            self.gang_end(now, *g, None);
        }
        for r in &sess.waits {
            if let Some(res) = self.table.get_noted(r) {
                res.waiters.remove_session(s);
            }
            self.table.touch(r);
        }
        for r in &sess.holds {
            // Only what is still this session's (a gang's end above may have handed its
            // members on already).
            if self.holder_session(r) == Some(s) {
                self.end_lease(now, r);
                self.grant_next(now, r, Some(now.mono));
            }
        }
        self.end_session_leases(now, &sess.leases);
    }
}

#[cfg(test)]
mod tests {
    //! Transition-by-transition tests of sessions and anchors.
    use crate::core::testkit::*;

    #[test]
    fn waiter_disconnect_leaves_the_queue() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(1, acq("e", "a", true));
        h.req(2, acq("e", "b", true));
        h.req(3, acq("e", "c", true));
        h.step(Input::Disconnect { session: 2 });
        assert_eq!(h.res("e").waiters, vec!["c".to_string()]);
        let out = h.step(Input::Disconnect { session: 1 });
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
        assert!(H::to(&out, 2).is_empty());
    }

    #[test]
    fn an_anchored_lease_outlives_its_connection_until_the_anchor_closes() {
        let mut h = H::new();
        h.connect(1, "unix");
        assert_eq!(
            H::to(&h.req(1, Request::Anchor), 1),
            vec![Event::Anchored { anchors: 1 }]
        );
        h.req(1, acq("e", "a", true));
        h.connect(2, "unix");
        h.req(2, acq("e", "b", true));
        // The holder's supervisor dies: its engine's processes still hold the anchor.
        let out = h.step(Input::Disconnect { session: 1 });
        assert_eq!(H::granted(&out, 2), None, "{out:?}");
        assert_eq!(h.res("e").state, proto::LeaseState::Held);
        let s1 = session(&h, 1).unwrap();
        assert!(!s1.connected);
        assert_eq!(s1.anchors, 1);
        assert_eq!(s1.holds, vec!["e".to_string()]);
        // The last process holding the anchor dies.
        let out = h.step(Input::AnchorClosed { session: 1 });
        assert_eq!(H::granted(&out, 2).unwrap().0, 2);
        assert!(session(&h, 1).is_none());
        assert_eq!(h.core.counters().releases, 1);
        // The handoff is measured from the anchor's close.
        assert!(out.iter().any(|o| matches!(o, Output::Notice { handoff_from: Some(_), notice } if notice.kind == NoticeKind::Granted)));
    }

    #[test]
    fn every_anchor_must_close_and_a_closed_anchor_alone_ends_nothing() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.req(1, Request::Anchor);
        assert_eq!(
            H::to(&h.req(1, Request::Anchor), 1),
            vec![Event::Anchored { anchors: 2 }]
        );
        h.req(1, acq("e", "a", true));
        h.connect(2, "unix");
        h.req(2, acq("e", "b", true));
        // An anchor closing while the connection is open changes nothing.
        let out = h.step(Input::AnchorClosed { session: 1 });
        assert_eq!(H::granted(&out, 2), None);
        assert_eq!(session(&h, 1).unwrap().anchors, 1);
        h.step(Input::Disconnect { session: 1 });
        assert_eq!(h.res("e").state, proto::LeaseState::Held);
        let out = h.step(Input::AnchorClosed { session: 1 });
        assert_eq!(H::granted(&out, 2).unwrap().0, 2);
        // Without anchors a disconnect releases at once (the connection is the lock).
        h.connect(3, "unix");
        h.req(3, acq("e", "c", true));
        let out = h.step(Input::Disconnect { session: 2 });
        assert_eq!(H::granted(&out, 3).unwrap().0, 3);
        // A stray AnchorClosed for an unknown session is ignored.
        assert!(h.step(Input::AnchorClosed { session: 99 }).is_empty());
    }

    #[test]
    fn a_disconnected_anchored_session_withdraws_its_waits_and_hears_nothing() {
        let mut h = H::new();
        h.connect(1, "unix");
        h.req(1, Request::Anchor);
        h.req(1, acq("e", "a", true));
        h.connect(2, "unix");
        h.req(2, acq("f", "b", true));
        h.req(1, acq("f", "a", true));
        h.req(1, Request::Watch);
        h.step(Input::Disconnect { session: 1 });
        assert!(session(&h, 1).unwrap().waits.is_empty());
        assert!(h.res("f").waiters.is_empty());
        // A revoke of its lease is sent nowhere, and the lease stays until the anchor closes.
        h.connect(3, "unix");
        let out = h.req(3, Request::revoke("e", Some("ops".into()), None));
        assert!(H::to(&out, 1).is_empty(), "{out:?}");
        assert!(matches!(H::to(&out, 3)[..], [Event::RevokeSent { .. }]));
        // Releasing f frees it: session 1 does not get it.
        let out = h.req(2, Request::release("f"));
        assert!(H::to(&out, 1).is_empty());
        assert_eq!(h.res("f").state, proto::LeaseState::Free);
        // Requests "from" it are ignored (no connection can carry them).
        assert!(h.req(1, Request::Ping).is_empty());
        h.req(3, acq("e", "c", true));
        let out = h.step(Input::AnchorClosed { session: 1 });
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
        let c = h.core.counters();
        assert_eq!((c.revocations, c.releases), (1, 1));
    }

    #[test]
    fn a_reclaim_on_an_anchored_connection_is_anchored() {
        let (mut h, token) = restarted();
        h.connect(2, "unix");
        h.req(2, Request::Anchor);
        let out = h.req(
            2,
            Request::Reclaim {
                resource: "e".into(),
                holder: "a".into(),
                epoch: 1,
                token,
            },
        );
        assert_eq!(
            H::granted(&out, 2),
            Some((1, H::granted(&out, 2).unwrap().1, true))
        );
        h.connect(3, "unix");
        h.req(3, acq("e", "b", true));
        let out = h.step(Input::Disconnect { session: 2 });
        assert_eq!(H::granted(&out, 3), None);
        let out = h.step(Input::AnchorClosed { session: 2 });
        assert_eq!(H::granted(&out, 3).unwrap().0, 2);
    }
}
