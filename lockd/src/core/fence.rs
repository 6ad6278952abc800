//! Fairness of shared gangs (issue 12: "say how a gang cannot starve, and measure it").
//!
//! A waiting TTL gang reserves its free members (it is first in their TTL queues: nobody
//! else is granted them). A waiting *shared* gang waits outside the shared table's queues;
//! without a rule of its own, a stream of writers on its members would keep at least one
//! of them busy at every step and starve it. **The rule**: the oldest waiting shared gang
//! on a resource *fences* it — no exclusive request that arrived after that gang's member
//! (a higher lease id: ids are handed out in arrival order) is granted there while the
//! gang waits; such a writer stays queued, and blocks the readers behind it as any waiting
//! writer does. Writers that arrived before the gang keep their place, as writer priority
//! wants; readers do not conflict with a gang of readers and are not held back.
//!
//! **Bound.** A waiting shared gang is granted at the latest when every exclusive lease
//! held on its members when it arrived, and every exclusive request queued on them before
//! it, has ended (each is bounded by its TTL, its connection, or its own timeout): with `k`
//! such writers per member, each holding at most `T`, within `k·T` of its arrival. The
//! wait-for graph knows the fence: a writer held back waits for the gang's session (a node
//! of its own per fenced resource, `deadlock::fence_node_name`), so a cycle through a
//! fence is found exactly and can be broken like any other.

use super::{Core, Now};

impl Core {
    /// **Fairness of shared gangs.** The oldest waiting shared gang on `r` (its member with
    /// the lowest lease id, ids being given in arrival order) fences `r`: no exclusive
    /// request that arrived after it is granted on `r` while it waits. Writers that arrived
    /// before it keep their place (writer priority), so a waiting shared gang is granted at
    /// the latest once every writer held or queued on its members when it arrived has ended;
    /// a stream of later writers cannot starve it. Brought in line whenever a member joins
    /// or leaves a gang queue; lifting the fence grants what it held back.
    pub(super) fn shared_fence(&mut self, now: Now, r: &str) {
        let fence = self
            .shared_gang_waits
            .get(r)
            .and_then(|q| q.first().copied());
        #[cfg(test)]
        let fence = fence.filter(|_| !self.planted.shared_gang_unfenced);
        let old = self.shared.fence(r);
        if old == fence {
            return;
        }
        // The graph looks again at who the fence holds back (the writers queued on `r`)
        // and at the gang members it passes between: O(queue), once per change of fence.
        let (queued, _) = self.shared.waiters(r);
        self.graph.shared_touched.extend(queued);
        self.graph
            .shared_touched
            .extend(old.into_iter().chain(fence));
        for g in self.shared.set_fence(r, fence) {
            self.shared_granted(now, g);
        }
    }
}

#[cfg(test)]
mod tests {
    //! A shared gang behind a stream of writers; the fence in the wait-for graph.
    use crate::core::testkit::*;
    use crate::proto::Mode;

    fn shared_gang(label: &str, h: &str, members: &[&str]) -> Request {
        Request::Acquire {
            resource: label.into(),
            holder: h.into(),
            wait: true,
            ext: proto::AcquireExt {
                gang: Some(members.iter().map(|m| m.to_string()).collect()),
                mode: Some(Mode::Shared),
                ..Default::default()
            },
        }
    }

    fn gang_granted(out: &[Output], s: SessionId) -> bool {
        H::to(out, s)
            .iter()
            .any(|e| matches!(e, Event::GangGranted { .. }))
    }

    const M: [&str; 4] = ["g0", "g1", "g2", "g3"];

    /// Two writer sessions per member (10+2i holds, 11+2i waits), then the gang (session 1)
    /// arrives; then `rounds` rounds in which every holding writer releases and at once asks
    /// again (a stream of 1-resource exclusive acquires). Returns the round in which the
    /// gang was granted, and whether any writer that arrived after the gang was granted
    /// before it.
    fn writer_stream(planted: bool, rounds: usize) -> (Option<usize>, bool) {
        let mut h = H::new();
        h.core.planted.shared_gang_unfenced = planted;
        h.connect(1, "unix");
        let mut holder = Vec::new();
        for (i, m) in M.iter().enumerate() {
            let (a, b) = (10 + 2 * i as u64, 11 + 2 * i as u64);
            h.connect(a, "unix");
            h.connect(b, "unix");
            assert!(H::g(&h.req(a, acq_shared(m, "w", false, None)), a).is_some());
            h.req(b, acq_shared(m, "w", false, None));
            holder.push((a, b));
        }
        let out = h.req(1, shared_gang("tp", "eng", &M));
        assert!(matches!(&H::to(&out, 1)[..], [Event::Queued { .. }]));
        let mut late_first = false;
        for round in 1..=rounds {
            for (i, m) in M.iter().enumerate() {
                let (a, b) = holder[i];
                let mut out = h.req(a, Request::release(*m));
                out.extend(h.req(a, acq_shared(m, "w", false, None)));
                if gang_granted(&out, 1) {
                    return (Some(round), late_first);
                }
                // After round 1 every writer asked after the gang.
                late_first |= round > 1 && H::g(&out, b).is_some();
                if H::g(&out, b).is_some() {
                    holder[i] = (b, a);
                }
            }
        }
        (None, late_first)
    }

    #[test]
    fn a_shared_gang_behind_a_stream_of_writers_is_granted_once_the_writers_ahead_end() {
        // Ahead of the gang on each member: the holder and one queued writer. Round 1 ends
        // the holders (the queued writers go on: they arrived first); round 2 ends those,
        // and the gang gets all four in the step that frees the last member.
        assert_eq!(writer_stream(false, 50), (Some(2), false));
        // Planted away (no fence): a writer is always granted next, the gang never.
        let (round, late_first) = writer_stream(true, 50);
        assert_eq!(round, None);
        assert!(late_first);
    }

    #[test]
    fn readers_pass_a_fence_writers_that_arrived_first_keep_their_place() {
        let mut h = H::new();
        for s in 1..=5 {
            h.connect(s, "unix");
        }
        // b is written by 2; the gang over {a, b} waits and fences both.
        assert!(H::g(&h.req(2, acq_shared("b", "w", false, None)), 2).is_some());
        h.req(1, shared_gang("tp", "eng", &["a", "b"]));
        // A writer on the free member `a` arrives after the gang: held back.
        let out = h.req(3, acq_shared("a", "late", false, None));
        assert!(matches!(&H::to(&out, 3)[..], [Event::Queued { .. }]));
        assert!(
            h.core.shared.holders("a").is_empty(),
            "a is kept for the gang"
        );
        // A reader of `a` behind that writer waits (writer priority), one of `c` does not.
        let out = h.req(4, acq_shared("a", "r", true, None));
        assert!(H::g(&out, 4).is_none());
        assert!(H::g(&h.req(5, acq_shared("c", "r", true, None)), 5).is_some());
        // 2 lets go of b: the gang is granted, ahead of the writer; the writer waits for
        // the gang, then the reader follows it.
        let out = h.req(2, Request::release("b"));
        assert!(gang_granted(&out, 1), "{out:?}");
        assert!(
            H::g(&out, 3).is_none(),
            "no writer beside the gang's readers"
        );
        let out = h.step(Input::Disconnect { session: 1 });
        let w = H::g(&out, 3).expect("the writer after the gang");
        assert_eq!(w.lease.mode, Some(Mode::Exclusive));
        assert!(H::g(&out, 4).is_none());
        let out = h.req(3, Request::release("a"));
        assert!(H::g(&out, 4).is_some());
    }

    #[test]
    fn a_gang_that_gives_up_lifts_its_fence_and_the_writer_goes_on() {
        let mut h = H::new();
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        h.req(2, acq_shared("b", "w", false, None));
        let mut g = shared_gang("tp", "eng", &["a", "b"]);
        if let Request::Acquire { ext, .. } = &mut g {
            ext.timeout_ms = Some(100);
        }
        h.req(1, g);
        let out = h.req(3, acq_shared("a", "late", false, None));
        assert!(H::g(&out, 3).is_none());
        h.ms = 100;
        let out = h.step(Input::Tick);
        assert!(H::to(&out, 1).contains(&Event::Cancelled {
            resource: "tp".into()
        }));
        assert!(H::g(&out, 3).is_some(), "the fence went with the gang");
    }

    fn deadlock_notices(out: &[Output]) -> usize {
        H::to(out, 1000)
            .iter()
            .filter(|e| matches!(e, Event::Notice(n) if n.kind == NoticeKind::Deadlock))
            .count()
    }

    #[test]
    fn a_writer_held_back_by_a_fence_waits_for_the_gang_in_the_wait_for_graph() {
        for planted in [false, true] {
            let mut h = H::with_cfg(PersistedState::default(), None, 0, |c| {
                c.break_deadlocks = true
            });
            h.core.planted.shared_gang_unfenced = planted;
            h.connect(1000, "unix");
            h.req(1000, Request::Watch);
            for s in 1..=2 {
                h.connect(s, "unix");
            }
            // 2 writes `s`; the gang of 1 over {r, s} waits for it and fences `r`; then 2
            // asks to write `r`: held back by the gang, which waits for 2: a cycle through
            // the fence (no cycle, and 2 gets `r`, without it).
            let w = H::g(&h.req(2, acq_shared("s", "w", false, None)), 2).unwrap();
            h.req(1, shared_gang("tp", "eng", &["r", "s"]));
            assert!(h.st().deadlocks.is_empty());
            let out = h.req(2, acq_shared("r", "w", false, None));
            if planted {
                assert!(H::g(&out, 2).is_some());
                assert_eq!(deadlock_notices(&out), 0);
                continue;
            }
            assert_eq!(deadlock_notices(&out), 1, "{out:?}");
            let st = h.st();
            assert_eq!(st.deadlocks.len(), 1);
            let mut sessions = st.deadlocks[0].sessions.clone();
            sessions.sort_unstable();
            assert_eq!(sessions, vec![1, 2]);
            assert!(st.deadlocks[0]
                .resources
                .iter()
                .any(|r| r.starts_with("r (reserved")));
            // Broken: the youngest lease the cycle waits for is the writer's on `s`.
            assert!(
                H::to(&out, 2)
                    .iter()
                    .any(|e| matches!(e, Event::Revoked { resource, epoch, reason }
                        if resource == "s" && *epoch == w.epoch && reason == "deadlock")),
                "{out:?}"
            );
            assert_eq!(st.counters.deadlock_breaks, 1);
            // The writer lets go (its connection ends): the gang is granted, no cycle.
            let out = h.step(Input::Disconnect { session: 2 });
            assert!(gang_granted(&out, 1));
            assert!(h.st().deadlocks.is_empty());
        }
    }

    #[test]
    fn a_writer_that_arrived_before_the_gang_does_not_wait_for_it() {
        let mut h = H::new();
        h.connect(1000, "unix");
        h.req(1000, Request::Watch);
        for s in 1..=3 {
            h.connect(s, "unix");
        }
        // 3 reads `r`; 2 writes `s` and queues to write `r` (behind the reader); then the
        // gang of 1 over {r, s} arrives: it waits for 2 (on s) and 2's request on `r` is
        // ahead of it, not behind its fence: a chain 1 -> 2 -> 3, no cycle.
        h.req(3, acq_shared("r", "rd", true, None));
        h.req(2, acq_shared("s", "w", false, None));
        h.req(2, acq_shared("r", "w", false, None));
        let out = h.req(1, shared_gang("tp", "eng", &["r", "s"]));
        assert_eq!(deadlock_notices(&out), 0);
        assert!(h.st().deadlocks.is_empty());
        // The reader leaves: 2 writes r (it arrived first), the gang still waits.
        let out = h.step(Input::Disconnect { session: 3 });
        assert!(H::g(&out, 2).is_some());
        assert!(!gang_granted(&out, 1));
        let out = h.step(Input::Disconnect { session: 2 });
        assert!(gang_granted(&out, 1));
    }
}
