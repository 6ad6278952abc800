//! `lockd hold`'s own process killed while its child runs → the lock stays held until
//! the child dies.
use crate::common::*;
use std::time::Duration;

#[test]
fn killing_hold_alone_keeps_the_lock_until_the_child_dies() {
    let _process = shared();
    let Contest {
        d: _d,
        l,
        mut a,
        b: _b,
        ea,
        fa,
        fb,
    } = contest(&[]);
    let child_pid = wait_child_pid(&fa, Duration::from_secs(5));
    lock_follows_the_child(&l, &mut a, child_pid, ea, &fb);
}
