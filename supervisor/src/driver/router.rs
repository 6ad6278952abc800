//! The router push (`--router-socket`): a background task that tells the pod's HAProxy, through
//! its runtime API on a Unix socket, where this engine belongs ([`crate::router`]) at every
//! phase change, and again every `--router-resync` so that a restarted router converges.
//!
//! A push never holds up a failover: each is bounded by `--router-timeout`, a failure is logged
//! and counted (`supervisor_router_push_failures_total`) and the router's own health checks stay
//! as the backstop. The one push the driver waits for (bounded) is the one that takes an Active
//! engine out of rotation before it is fenced.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use probes::ProbeState;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

use crate::router::{check_response, Servers, Target};

/// Where and how to push.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// HAProxy's `stats socket` (level admin).
    pub socket: PathBuf,
    /// This engine's serving and standby servers.
    pub servers: Servers,
    /// Bound of one push (connect, write, read the answer).
    pub timeout: Duration,
    /// Re-send the current state this often (0: never).
    pub resync: Duration,
}

struct Msg {
    target: Target,
    done: Option<oneshot::Sender<bool>>,
}

/// Handle on the push task. Dropping it ends the task.
pub struct RouterLink {
    tx: mpsc::UnboundedSender<Msg>,
}

impl RouterLink {
    /// Start the push task.
    pub fn spawn(cfg: RouterConfig, state: ProbeState) -> RouterLink {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(cfg, state, rx));
        RouterLink { tx }
    }

    /// Move to `target` (in the background).
    pub fn set(&self, target: Target) {
        let _ = self.tx.send(Msg { target, done: None });
    }

    /// Move to `target` and wait until the router confirmed it, at most `bound`. True when it
    /// did.
    pub async fn set_and_wait(&self, target: Target, bound: Duration) -> bool {
        let (done, rx) = oneshot::channel();
        if self
            .tx
            .send(Msg {
                target,
                done: Some(done),
            })
            .is_err()
        {
            return false;
        }
        matches!(tokio::time::timeout(bound, rx).await, Ok(Ok(true)))
    }
}

async fn run(cfg: RouterConfig, state: ProbeState, mut rx: mpsc::UnboundedReceiver<Msg>) {
    let mut current: Option<Target> = None;
    // Last push outcome, so that a resync failing every second logs once, not every second.
    let mut last_ok = true;
    let mut tick = tokio::time::interval(if cfg.resync.is_zero() {
        Duration::from_secs(3600)
    } else {
        cfg.resync
    });
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        let (target, edge, done) = tokio::select! {
            msg = rx.recv() => match msg {
                Some(Msg { target, done }) => {
                    let edge = current != Some(target);
                    (target, edge, done)
                }
                None => return,
            },
            _ = tick.tick(), if current.is_some() && !cfg.resync.is_zero() => {
                (current.expect("guarded"), false, None)
            }
        };
        current = Some(target);
        let line = cfg.servers.commands(target, edge);
        let t0 = Instant::now();
        let r = push(&cfg, &line).await;
        let m = state.metrics();
        m.router_pushes.fetch_add(1, Ordering::Relaxed);
        let ok = r.is_ok();
        if let Err(e) = &r {
            m.router_push_failures.fetch_add(1, Ordering::Relaxed);
            if edge || last_ok {
                tracing::warn!(
                    socket = %cfg.socket.display(),
                    server = %cfg.servers.serving,
                    target = target.as_str(),
                    error = %e,
                    "router push failed (the router's health checks remain the backstop)"
                );
            }
        } else if edge || !last_ok {
            tracing::info!(
                server = %cfg.servers.serving,
                target = target.as_str(),
                took_us = t0.elapsed().as_micros() as u64,
                "router updated"
            );
        }
        last_ok = ok;
        if let Some(d) = done {
            let _ = d.send(ok);
        }
    }
}

/// One push: connect, send the line, read the answer to EOF (HAProxy closes a non-interactive
/// CLI connection after answering), check it.
async fn push(cfg: &RouterConfig, line: &str) -> Result<(), String> {
    let work = async {
        let mut s = UnixStream::connect(&cfg.socket)
            .await
            .map_err(|e| format!("connect {}: {e}", cfg.socket.display()))?;
        s.write_all(format!("{line}\n").as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut answer = Vec::new();
        // An answer is a few bytes; more than 64 KiB is not a runtime API talking.
        (&mut s)
            .take(64 * 1024)
            .read_to_end(&mut answer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        check_response(&String::from_utf8_lossy(&answer))
    };
    match tokio::time::timeout(cfg.timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {:?}", cfg.timeout)),
    }
}
