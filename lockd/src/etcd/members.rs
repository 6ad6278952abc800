//! Which etcd member the sessions' keepalive streams talk to.
//!
//! A keepalive stream is one gRPC stream to one etcd member. A member that stalls (SIGSTOP, a
//! disk that blocks its fsync, a frozen VM) keeps its TCP connection open and answers
//! nothing; the stream stays silent and, if nothing moves it, the session's fence fires at its
//! deadline: a failover although the two other members are fine. A stream that merely ends or
//! errors is reopened, but through the balanced client it may land on the stalled member again
//! (tried, docs/ETCD.md).
//!
//! So keepalive streams (and the fence's confirming reads) go through one client per
//! `--etcd-endpoints` entry, all sessions on the **preferred** member (the first endpoint at
//! start). A session whose stream is silent for [`stall_after`] after a send, or whose stream
//! cannot be opened, asks [`Members::move_from`] for another member: every other endpoint is
//! sent a linearizable count-only read (answered only through a leader with a quorum), the
//! first to answer becomes the preferred member for every session, and the session reopens its
//! stream there. A stalled member's unanswered keepalives are forgotten (`StreamReset`), never
//! credited, so a move cannot extend the fence's deadline beyond what an answer proves.
//!
//! Other etcd calls (acquire, watch, put) keep using the balanced client.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};
use tracing::{info, warn};

use super::mutex::{self, EtcdError};

/// How long a keepalive may go unanswered before its stream counts as stalled: half the time
/// between two sends (`every`). etcd answers in milliseconds; this leaves the move, a round
/// trip to each other member and a new stream's first answer, well inside the fence's margin.
pub fn stall_after(every: Duration) -> Duration {
    (every / 2).max(Duration::from_millis(10))
}

/// One lazily connected client per endpoint, and the preferred one.
pub struct Members {
    endpoints: Vec<String>,
    opts: ConnectOptions,
    limit: Duration,
    probe_key: String,
    clients: tokio::sync::Mutex<Vec<Option<Client>>>,
    preferred: AtomicUsize,
}

impl Members {
    /// Clients for `endpoints` (connected on first use with `opts`, each call bounded by
    /// `limit`); `probe_key` is read (never written) to tell a member with a leader.
    pub fn new(
        endpoints: Vec<String>,
        opts: ConnectOptions,
        limit: Duration,
        probe_key: String,
    ) -> Members {
        let n = endpoints.len();
        Members {
            endpoints,
            opts,
            limit,
            probe_key,
            clients: tokio::sync::Mutex::new(vec![None; n]),
            preferred: AtomicUsize::new(0),
        }
    }

    /// How many endpoints.
    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    /// Whether there are none (never: lockd refuses to start without an endpoint).
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    /// The endpoint `i` (for logs).
    pub fn endpoint(&self, i: usize) -> &str {
        self.endpoints.get(i).map_or("?", String::as_str)
    }

    /// The member new streams open on.
    pub fn preferred(&self) -> usize {
        self.preferred.load(Ordering::Relaxed) % self.len().max(1)
    }

    /// The client of member `i`, connected now if it is not yet.
    pub async fn client(&self, i: usize) -> Result<Client, EtcdError> {
        if let Some(c) = self.clients.lock().await.get(i).cloned().flatten() {
            return Ok(c);
        }
        let ep = self.endpoint(i).to_string();
        let c = mutex::bounded(self.limit, Client::connect([ep], Some(self.opts.clone()))).await?;
        if let Some(slot) = self.clients.lock().await.get_mut(i) {
            if slot.is_none() {
                *slot = Some(c.clone());
            }
        }
        Ok(c)
    }

    /// Member `stalled` did not answer: the first other member that answers a linearizable
    /// read within `limit` becomes the preferred one (unless another session moved the
    /// preference already, to a member other than `stalled`: then that one). None if no
    /// other member answered (the caller keeps trying where it was).
    pub async fn move_from(self: &Arc<Self>, stalled: usize, limit: Duration) -> Option<usize> {
        let current = self.preferred();
        if current != stalled {
            return Some(current);
        }
        let mut probes = tokio::task::JoinSet::new();
        for j in (0..self.len()).filter(|j| *j != stalled) {
            let me = Arc::clone(self);
            probes.spawn(async move {
                let mut c = me.client(j).await.ok()?;
                let opts = GetOptions::new().with_count_only();
                mutex::bounded(me.limit, c.get(me.probe_key.clone(), Some(opts)))
                    .await
                    .ok()
                    .map(|_| j)
            });
        }
        let found = tokio::time::timeout(limit, async {
            while let Some(r) = probes.join_next().await {
                if let Ok(Some(j)) = r {
                    return Some(j);
                }
            }
            None
        })
        .await
        .ok()
        .flatten();
        probes.abort_all();
        match found {
            Some(j) => {
                // Only the first session to see the stall moves everyone.
                let _ = self.preferred.compare_exchange(
                    stalled,
                    j,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
                info!(from = self.endpoint(stalled), to = self.endpoint(j),
                    "etcd member did not answer in time (a keepalive, or a new stream); keepalive streams move to another member");
                Some(self.preferred())
            }
            None => {
                warn!(
                    from = self.endpoint(stalled),
                    "etcd member did not answer in time (a keepalive, or a new stream) and no other member answered"
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_is_half_the_send_period_and_never_zero() {
        assert_eq!(
            stall_after(Duration::from_millis(460)),
            Duration::from_millis(230)
        );
        assert_eq!(
            stall_after(Duration::from_millis(4)),
            Duration::from_millis(10)
        );
    }
}
