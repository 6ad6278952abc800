//! Holder's whole process group SIGKILLed → the next waiter is granted with a higher epoch.
use crate::common::*;
use lockd::proto::LeaseState;
use std::time::Duration;

#[test]
fn holder_group_sigkill_hands_over_to_waiter_with_higher_epoch() {
    let _process = shared();
    let Contest {
        d: _d,
        l,
        mut a,
        b: _b,
        ea,
        fa: _,
        fb,
    } = contest(&[]);
    assert_eq!(
        read_epoch(&fb),
        None,
        "waiter must not run while the holder lives"
    );
    a.kill_group();
    let eb = wait_epoch(&fb, Duration::from_secs(10));
    assert!(eb > ea, "epoch {eb} not above {ea}");
    let st = l.status();
    let r = resource(&st, "engine");
    assert_eq!(r.holder.as_deref(), Some("b"));
    assert_eq!(r.state, LeaseState::Held);
    assert_eq!(st.counters.releases, 1);
    assert_eq!(st.counters.grants, 2);
}
