//! The `lockd::client` library against a real lockd: grants, Busy, queueing, the
//! inheritable fd keeping the lease alive after the client closes, automatic re-queue after
//! a restart, and `Lost` when lockd does not come back within `reconnect_timeout`.
use crate::common::*;
use lockd::client::{ClientOptions, LockClient, LockEvent};
use lockd::proto::LeaseState;
use lockd::Endpoint;
use std::time::Duration;

async fn next(c: &mut LockClient) -> LockEvent {
    tokio::time::timeout(Duration::from_secs(10), c.next_event())
        .await
        .expect("event in time")
        .expect("open")
}

async fn next_matching(c: &mut LockClient, f: impl Fn(&LockEvent) -> bool) -> LockEvent {
    loop {
        let e = next(c).await;
        if f(&e) {
            return e;
        }
    }
}

fn opts(reconnect: Duration) -> ClientOptions {
    ClientOptions {
        connect_timeout: Duration::from_secs(2),
        reconnect_timeout: reconnect,
        label: None,
        anchor: None,
        watchdog: None,
    }
}

#[tokio::test]
async fn grant_busy_queue_and_inherited_fd() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let ep: Endpoint = l.endpoint().parse().unwrap();
    let mut a = LockClient::connect(&ep, opts(Duration::from_secs(15)))
        .await
        .unwrap();
    let mut b = LockClient::connect(&ep, opts(Duration::from_secs(15)))
        .await
        .unwrap();
    a.acquire("engine", "a", true).await.unwrap();
    assert_eq!(
        next(&mut a).await,
        LockEvent::Granted {
            resource: "engine".into(),
            epoch: 1,
            reclaimed: false
        }
    );
    b.acquire("engine", "b", false).await.unwrap();
    assert_eq!(
        next(&mut b).await,
        LockEvent::Busy {
            resource: "engine".into(),
            holder: Some("a".into())
        }
    );
    b.acquire("engine", "b", true).await.unwrap();
    assert_eq!(
        next(&mut b).await,
        LockEvent::Queued {
            resource: "engine".into(),
            position: 1
        }
    );

    // A dup of a's connection outlives the client: the lease stays until it is closed too.
    let fd = a.inheritable_fd().unwrap();
    let flags = nix::fcntl::fcntl(std::os::fd::AsRawFd::as_raw_fd(&fd), nix::fcntl::F_GETFD)
        .expect("F_GETFD");
    assert!(
        !nix::fcntl::FdFlag::from_bits_truncate(flags).contains(nix::fcntl::FdFlag::FD_CLOEXEC),
        "inheritable fd must not be close-on-exec"
    );
    a.close().await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), b.next_event())
            .await
            .is_err(),
        "no grant while the dup lives"
    );
    assert_eq!(resource(&l.status(), "engine").holder.as_deref(), Some("a"));
    drop(fd);
    assert_eq!(
        next(&mut b).await,
        LockEvent::Granted {
            resource: "engine".into(),
            epoch: 2,
            reclaimed: false
        }
    );
    b.release("engine").await.unwrap();
    wait_for(Duration::from_secs(5), "free", || {
        (resource(&l.status(), "engine").state == LeaseState::Free).then_some(())
    });
}

#[tokio::test]
async fn waiter_requeues_after_restart_and_holder_is_lost_when_lockd_stays_down() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let mut l = start_lockd(d.path(), &["--reconnect-window", "300ms"]);
    let ep: Endpoint = l.endpoint().parse().unwrap();
    let mut a = LockClient::connect(&ep, opts(Duration::from_millis(800)))
        .await
        .unwrap();
    let mut b = LockClient::connect(&ep, opts(Duration::from_secs(30)))
        .await
        .unwrap();
    a.acquire("engine", "a", true).await.unwrap();
    next_matching(&mut a, |e| matches!(e, LockEvent::Granted { .. })).await;
    b.acquire("engine", "b", true).await.unwrap();
    next_matching(&mut b, |e| matches!(e, LockEvent::Queued { .. })).await;

    l.kill();
    assert!(matches!(next(&mut a).await, LockEvent::Disconnected { .. }));
    assert!(
        a.inheritable_fd().is_err(),
        "no current connection while disconnected"
    );
    // lockd stays down longer than a's reconnect_timeout: a must be told its lease is lost.
    let lost = next_matching(&mut a, |e| matches!(e, LockEvent::Lost { .. })).await;
    assert!(
        matches!(lost, LockEvent::Lost { ref resource, epoch: 1, .. } if resource == "engine"),
        "{lost:?}"
    );
    l.restart();
    // b re-queues on its own and gets the lock once the window expires.
    let g = next_matching(&mut b, |e| matches!(e, LockEvent::Granted { .. })).await;
    assert_eq!(
        g,
        LockEvent::Granted {
            resource: "engine".into(),
            epoch: 2,
            reclaimed: false
        }
    );
    assert_eq!(l.status().counters.expirations, 1);
}

#[tokio::test]
async fn holder_reclaims_after_restart() {
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let mut l = start_lockd(d.path(), &["--reconnect-window", "5s"]);
    let ep: Endpoint = l.endpoint().parse().unwrap();
    let mut a = LockClient::connect(&ep, opts(Duration::from_secs(15)))
        .await
        .unwrap();
    a.acquire("engine", "a", true).await.unwrap();
    next_matching(&mut a, |e| matches!(e, LockEvent::Granted { .. })).await;
    l.kill();
    l.restart();
    let mut saw_reconnected = false;
    loop {
        match next(&mut a).await {
            LockEvent::Reconnected => saw_reconnected = true,
            LockEvent::Granted {
                epoch, reclaimed, ..
            } => {
                assert_eq!((epoch, reclaimed), (1, true));
                break;
            }
            LockEvent::Disconnected { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(saw_reconnected);
    assert!(a.inheritable_fd().is_ok());
    assert_eq!(resource(&l.status(), "engine").state, LeaseState::Held);
}

#[tokio::test]
async fn the_watchdog_gives_up_the_leases_of_a_stopped_lockd() {
    use nix::sys::signal::Signal;
    let _process = serial();
    let d = tempfile::tempdir().unwrap();
    let l = start_lockd(d.path(), &[]);
    let ep: Endpoint = l.endpoint().parse().unwrap();
    let limit = Duration::from_millis(400);
    let mut watched = opts(Duration::from_secs(15));
    watched.watchdog = Some(limit);
    let mut a = LockClient::connect(&ep, watched).await.unwrap();
    let mut b = LockClient::connect(&ep, opts(Duration::from_secs(15)))
        .await
        .unwrap();
    a.acquire("engine", "a", true).await.unwrap();
    next_matching(&mut a, |e| matches!(e, LockEvent::Granted { .. })).await;
    b.acquire("other", "b", true).await.unwrap();
    next_matching(&mut b, |e| matches!(e, LockEvent::Granted { .. })).await;
    // A lockd that answers: three limits without a loss.
    let quiet = tokio::time::timeout(3 * limit, next(&mut a)).await;
    assert!(quiet.is_err(), "an event while lockd answers: {quiet:?}");

    l.signal(Signal::SIGSTOP);
    let t = std::time::Instant::now();
    let lost = next_matching(&mut a, |e| matches!(e, LockEvent::Lost { .. })).await;
    let took = t.elapsed();
    // Without a watchdog, nothing is noticed meanwhile.
    let b_quiet = tokio::time::timeout(Duration::from_millis(300), next(&mut b)).await;
    l.signal(Signal::SIGCONT);
    let LockEvent::Lost {
        resource: res,
        cause,
        ..
    } = lost
    else {
        unreachable!()
    };
    assert_eq!(res, "engine");
    assert!(cause.contains("watchdog"), "{cause}");
    // Last heard at most a ping period (limit/4) before the stop.
    assert!(
        took >= limit * 3 / 4 - Duration::from_millis(50) && took < Duration::from_secs(2),
        "lost {took:?} after lockd stopped (limit {limit:?})"
    );
    assert!(b_quiet.is_err(), "b without a watchdog: {b_quiet:?}");
    // The watched client left that session: once lockd runs again, the lease is free.
    let st = wait_for(Duration::from_secs(5), "engine freed", || {
        let st = l.status();
        resource(&st, "engine").holder.is_none().then_some(st)
    });
    assert_eq!(resource(&st, "other").holder.as_deref(), Some("b"));
}
