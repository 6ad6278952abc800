//! The reclaim token works over TCP too: a `LockClient` connected over TCP gets its lease
//! back (same epoch) after lockd is SIGKILLed and restarted on the same port and state file.
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

#[tokio::test]
async fn tcp_client_reclaims_after_restart() {
    let _process = shared();
    let d = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tcp = format!("tcp:127.0.0.1:{port}");
    let mut l = start_lockd(d.path(), &["--listen", &tcp, "--reconnect-window", "5s"]);
    let ep: Endpoint = tcp.parse().unwrap();
    let opts = ClientOptions {
        connect_timeout: Duration::from_secs(2),
        reconnect_timeout: Duration::from_secs(15),
        label: Some("tcp".into()),
        anchor: None,
        watchdog: None,
    };
    let mut c = LockClient::connect(&ep, opts).await.unwrap();
    c.acquire("engine", "tcp-holder", true).await.unwrap();
    loop {
        if let LockEvent::Granted {
            epoch, reclaimed, ..
        } = next(&mut c).await
        {
            assert_eq!((epoch, reclaimed), (1, false));
            break;
        }
    }
    let st = l.status();
    assert_eq!(
        resource(&st, "engine")
            .holder_peer
            .as_ref()
            .map(|p| p.transport.as_str()),
        Some("tcp"),
        "{st:?}"
    );
    l.kill();
    l.restart();
    loop {
        match next(&mut c).await {
            LockEvent::Granted {
                epoch, reclaimed, ..
            } => {
                assert_eq!((epoch, reclaimed), (1, true), "same lease back over TCP");
                break;
            }
            LockEvent::Lost { cause, .. } => panic!("lost: {cause}"),
            _ => {}
        }
    }
    let st = l.status();
    assert_eq!(resource(&st, "engine").state, LeaseState::Held);
    assert_eq!(st.counters.reclaims, 1);
}
