//! The driver's event sources: the lock connection (connect with retries, anchors, lock
//! events mapped to machine events, process anchors for the engine's tree) and the engine's
//! background health polling.

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockd::client::{ClientOptions, LockClient, LockEvent};
use probes::ProbeState;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::adapter::EngineClient;
use crate::config::RunArgs;
use crate::machine::Event;
use crate::process;

/// How often the engine's tree is scanned for new processes to pin as lockd process anchors.
pub(super) const PIN_INTERVAL: Duration = Duration::from_millis(100);

/// Attach a process anchor to the lock session for every new process of the engine's tree.
pub(super) async fn pin_tree(
    pins: &mut process::TreePins,
    lock: &mut LockClient,
    state: &ProbeState,
) {
    let new = pins.scan();
    if new.is_empty() {
        return;
    }
    let pids: Vec<i32> = new.iter().map(|(p, _)| *p).collect();
    for (pid, fd) in new {
        if let Err(e) = lock.add_process_anchor(fd).await {
            tracing::error!(pid, error = %e, "cannot attach a process anchor");
        }
    }
    state.mark(probes::MarkKind::ProcessAnchorsAttached);
    tracing::info!(pids = ?pids, "engine processes pinned as lock anchors");
}

/// The anchor pair for this run: `(keep, inherit)`, or None where anchors cannot be used
/// (a `tcp:` lockd endpoint: file descriptors do not cross TCP; see ARCHITECTURE.md).
///
/// lockd holds `keep` (re-attached on every reconnect) and the engine inherits `inherit`: the
/// lease is then held until every process of the engine's tree that inherited it is dead,
/// whatever happens to the supervisor or to lockd's connection.
pub(super) fn anchor_for(args: &RunArgs) -> Option<(OwnedFd, OwnedFd)> {
    if !matches!(args.lock, lockd::Endpoint::Unix(_)) {
        tracing::warn!(lock = %args.lock, "lockd over TCP: no anchor; after a lockd restart the lease is bound to a lock keeper that covers the engine's main process only");
        return None;
    }
    #[cfg(any(debug_assertions, feature = "planted-bugs"))]
    if crate::fault::planted_bug_no_anchor() {
        tracing::warn!("PLANTED BUG: running without an anchor");
        return None;
    }
    match lockd::client::anchor_pair() {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::error!(error = %e, "cannot create the anchor socket pair; the lease is bound to the lock connection only");
            None
        }
    }
}

/// Connect to lockd, retrying until `args.lock_wait` has passed (lockd may start after us).
pub(super) async fn connect_lock(
    args: &RunArgs,
    anchor: Option<Arc<OwnedFd>>,
) -> Result<LockClient, String> {
    let deadline = Instant::now() + args.lock_wait;
    // `..default()` keeps this compiling if lockd adds options.
    #[allow(clippy::needless_update)]
    let opts = ClientOptions {
        connect_timeout: args.lock_connect_timeout,
        reconnect_timeout: args.lock_reconnect_timeout,
        label: Some(args.holder_name()),
        anchor,
        watchdog: args.lock_watchdog,
        ..ClientOptions::default()
    };
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        match LockClient::connect(&args.lock, opts.clone()).await {
            Ok(c) => return Ok(c),
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(format!("cannot connect to lockd at {}: {e}", args.lock));
                }
                if attempt == 1 || attempt % 10 == 0 {
                    tracing::warn!(lock = %args.lock, error = %e, attempt, "lockd not reachable yet; retrying");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// What the health polling last saw: healthy, or how many checks in a row failed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Health {
    /// The last check passed.
    pub healthy: bool,
    /// Failed checks in a row since the engine was last healthy (0 before it ever was: an
    /// engine that is still loading is not failing).
    pub failures: u32,
}

/// Background health polling: writes the result into the probe state (probes never call the
/// engine) and publishes it on a watch channel for the driver. After a failure the next check
/// comes after `--startup-poll` rather than `--health-interval`: a dead engine is confirmed
/// quickly, a passing blip costs a few extra checks.
pub(super) fn spawn_health(
    client: EngineClient,
    state: ProbeState,
    args: &RunArgs,
) -> (JoinHandle<()>, watch::Receiver<Health>) {
    let (tx, rx) = watch::channel(Health::default());
    let (startup_poll, interval, timeout) =
        (args.startup_poll, args.health_interval, args.health_timeout);
    let h = tokio::spawn(async move {
        let mut ever = false;
        let mut failures = 0u32;
        loop {
            let ok = client.healthy(timeout).await;
            let was = {
                let mut s = state.write();
                std::mem::replace(&mut s.engine_healthy, ok)
            };
            if !ok && ever {
                failures = failures.saturating_add(1);
                state
                    .metrics()
                    .health_check_failures
                    .fetch_add(1, Ordering::Relaxed);
            } else if ok {
                failures = 0;
            }
            if was != ok && ever {
                tracing::info!(healthy = ok, "engine health changed");
            }
            ever |= ok;
            let now = Health {
                healthy: ok,
                failures,
            };
            tx.send_if_modified(|v| std::mem::replace(v, now) != now);
            let fast = !ever || failures > 0;
            tokio::time::sleep(if fast { startup_poll } else { interval }).await;
        }
    });
    (h, rx)
}

/// Map a lock client event to a machine event (None: informational only).
pub(super) fn lock_event(ev: LockEvent, state: &ProbeState) -> Option<Event> {
    match ev {
        LockEvent::Queued { resource, position } => {
            tracing::info!(%resource, position, "queued for the lock");
            // Another engine holds it: the grant that ends this wait is a switch (Dynamo's
            // "contended" acquire, probes::dynamo).
            state.metrics().dynamo.lock_queued();
            None
        }
        LockEvent::Busy { resource, holder } => {
            tracing::info!(%resource, holder = holder.as_deref().unwrap_or("?"), "lock busy");
            Some(Event::LockBusy)
        }
        LockEvent::Granted {
            resource,
            epoch,
            reclaimed,
        } => {
            tracing::info!(%resource, epoch, reclaimed, "lock granted");
            state.mark(if reclaimed {
                probes::MarkKind::LockReclaimed
            } else {
                probes::MarkKind::LockGranted
            });
            Some(Event::LockGranted { epoch, reclaimed })
        }
        LockEvent::Revoked {
            resource,
            epoch,
            reason,
        } => {
            tracing::warn!(%resource, epoch, %reason, "lock revoked");
            Some(Event::Revoked(reason))
        }
        LockEvent::Disconnected { cause } => {
            tracing::warn!(%cause, "lock connection broken; reconnecting");
            state.write().lock_connected = false;
            state
                .metrics()
                .lock_disconnects
                .fetch_add(1, Ordering::Relaxed);
            state.mark(probes::MarkKind::LockDisconnected);
            Some(Event::LockDisconnected)
        }
        LockEvent::Reconnected => {
            tracing::info!("lock connection re-established");
            state.write().lock_connected = true;
            state.mark(probes::MarkKind::LockReconnected);
            Some(Event::LockReconnected)
        }
        LockEvent::Lost {
            resource,
            epoch,
            cause,
        } => {
            tracing::error!(%resource, epoch, %cause, "lock lost");
            Some(Event::LockLost(cause))
        }
        // Answers to `--publish-key`'s fenced puts: the driver takes them before this.
        LockEvent::PutDone { .. } | LockEvent::PutRefused { .. } => None,
        LockEvent::Error { code, message } if code == "unavailable" => {
            tracing::warn!(%code, %message, "lockd cannot serve the lock request for now (etcd unreachable?); asking again after a backoff");
            Some(Event::LockUnavailable(message))
        }
        LockEvent::Error { code, message } => {
            tracing::error!(%code, %message, "lockd error");
            Some(Event::LockError(format!("lockd error {code}: {message}")))
        }
    }
}
