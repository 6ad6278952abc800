//! `lockd reserve` (the binary's side of [`crate::reserve`]): reserve N of the given lockd
//! instances, run CMD with all N, watch them while it runs.
//!
//! CMD gets `LOCKD_RESERVED` (the endpoints held, comma-separated, in the global order),
//! `LOCKD_EPOCHS` (their epochs, same order), `LOCKD_RESOURCE`, and
//! `LOCKD_RESERVATION_FILE` (a JSON file `{"endpoints":[…],"epochs":[…]}` kept current).
//! CMD inherits the connections, so the reservations end only when CMD and `reserve` are
//! both gone. When one is lost while CMD runs (its lockd died, its lease ended), `reserve`
//! prints `{"event":"lost","endpoint":…,"reason":…}` on stderr and, with `--on-loss
//! replace`, reserves a replacement among the endpoints not held (at once, fail semantics),
//! rewrites the reservation file and sends CMD `SIGUSR1` (`{"event":"replaced",…}`); when
//! there is none (or with `--on-loss terminate`, the default) it sends CMD `SIGTERM`.

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::proto::Event;
use crate::reserve::{reserve, Link, ReserveError, ReserveOptions, Semantics};
use crate::Endpoint;

/// What to do when a held reservation is lost while CMD runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnLoss {
    /// SIGTERM to CMD.
    Terminate,
    /// Reserve a replacement (fail semantics), tell CMD with SIGUSR1; SIGTERM if none.
    Replace,
}

/// Why `reserve` stopped without CMD's status.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Not all could be reserved (exit 75).
    #[error(transparent)]
    Reserve(#[from] ReserveError),
    /// CMD could not be started (exit 126/127).
    #[error("cannot run {cmd}: {source}")]
    Spawn {
        /// The program.
        cmd: String,
        /// Why.
        source: std::io::Error,
    },
    /// Local trouble (reservation file, descriptors): exit 1.
    #[error("{0}")]
    Local(String),
}

fn write_file(path: &std::path::Path, links: &[Link]) -> Result<(), RunError> {
    let v = serde_json::json!({
        "endpoints": links.iter().map(|l| l.endpoint.to_string()).collect::<Vec<_>>(),
        "epochs": links.iter().map(|l| l.epoch).collect::<Vec<_>>(),
    });
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{v}\n"))
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| RunError::Local(format!("reservation file {}: {e}", path.display())))
}

/// A duplicate of `fd` without FD_CLOEXEC, for CMD to inherit.
fn inheritable(fd: std::os::fd::RawFd) -> Result<OwnedFd, RunError> {
    let raw = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD(3))
        .map_err(|e| RunError::Local(format!("dup: {e}")))?;
    // SAFETY: F_DUPFD just returned this descriptor; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Watch one link on a thread: report (index, reason) when it is lost.
fn watch(i: usize, mut l: Link, tx: mpsc::Sender<(usize, String, Link)>) {
    std::thread::spawn(move || loop {
        let far = Instant::now() + Duration::from_secs(3600);
        let why = match l.next_event(far) {
            None if Instant::now() >= far => continue,
            None => "connection to lockd closed".to_string(),
            Some(Event::LeaseEnded { reason, .. }) => format!("lease ended ({reason})"),
            Some(Event::Revoked { reason, .. }) => format!("lease revoked ({reason})"),
            Some(_) => continue,
        };
        let _ = tx.send((i, why, l));
        return;
    });
}

/// Reserve, run CMD, watch; returns CMD's exit status.
pub fn run(
    o: ReserveOptions,
    on_loss: OnLoss,
    cmd: &[String],
    file: &std::path::Path,
) -> Result<u8, RunError> {
    let links = reserve(&o)?;
    write_file(file, &links)?;
    let mut keep = Vec::new();
    for l in &links {
        keep.push(inheritable(l.raw_fd())?);
    }
    let mut c = Command::new(&cmd[0]);
    c.args(&cmd[1..])
        .env(
            "LOCKD_RESERVED",
            links
                .iter()
                .map(|l| l.endpoint.to_string())
                .collect::<Vec<_>>()
                .join(","),
        )
        .env(
            "LOCKD_EPOCHS",
            links
                .iter()
                .map(|l| l.epoch.to_string())
                .collect::<Vec<_>>()
                .join(","),
        )
        .env("LOCKD_RESOURCE", &o.resource)
        .env("LOCKD_RESERVATION_FILE", file);
    let mut child = c.spawn().map_err(|e| RunError::Spawn {
        cmd: cmd[0].clone(),
        source: e,
    })?;
    drop(keep);
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, rx) = mpsc::channel();
    let mut held: Vec<Option<Endpoint>> = links.iter().map(|l| Some(l.endpoint.clone())).collect();
    let mut epochs: Vec<u64> = links.iter().map(|l| l.epoch).collect();
    for (i, l) in links.into_iter().enumerate() {
        watch(i, l, tx.clone());
    }
    let mut lost_links = Vec::new();
    loop {
        if let Some(st) = child
            .try_wait()
            .map_err(|e| RunError::Local(e.to_string()))?
        {
            use std::os::unix::process::ExitStatusExt;
            return Ok(st
                .code()
                .map(|c| c as u8)
                .or_else(|| st.signal().map(|s| 128u8.wrapping_add(s as u8)))
                .unwrap_or(1));
        }
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok((i, why, l)) => {
                let ep = held[i].take().map(|e| e.to_string()).unwrap_or_default();
                lost_links.push(l);
                eprintln!(
                    "{}",
                    serde_json::json!({"event":"lost","endpoint":ep,"reason":why})
                );
                let spare: Vec<Endpoint> = o
                    .endpoints
                    .iter()
                    .filter(|e| !held.iter().flatten().any(|h| h == *e) && e.to_string() != ep)
                    .cloned()
                    .collect();
                let replaced = if on_loss == OnLoss::Replace && !spare.is_empty() {
                    reserve(&ReserveOptions {
                        endpoints: spare,
                        count: 1,
                        semantics: Semantics::Fail,
                        ..o.clone()
                    })
                    .ok()
                    .and_then(|mut v| v.pop())
                } else {
                    None
                };
                match replaced {
                    Some(r) => {
                        held[i] = Some(r.endpoint.clone());
                        epochs[i] = r.epoch;
                        eprintln!(
                            "{}",
                            serde_json::json!({"event":"replaced","endpoint":r.endpoint.to_string(),"epoch":r.epoch,"instead_of":ep})
                        );
                        let v = serde_json::json!({
                            "endpoints": held.iter().flatten().map(|e| e.to_string()).collect::<Vec<_>>(),
                            "epochs": epochs,
                        });
                        let _ = std::fs::write(file, format!("{v}\n"));
                        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGUSR1);
                        watch(i, r, tx.clone());
                    }
                    None => {
                        let _ = std::io::stderr().flush();
                        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {}
        }
    }
}
