//! The GPU claim (docs/CONTRACTS.md): an exclusive `flock` on one open file description that
//! every worker inherits, so that the claim lives until the last process of the engine has
//! died. Failing to take it is a split brain, recorded in `PATH.violations`.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::fcntl::{fcntl, FcntlArg, FdFlag, Flock, FlockArg};

/// The claim file, locked or not.
enum Held {
    /// Open, not locked by this engine.
    Open(File),
    /// Locked (`LOCK_EX`).
    Locked(Flock<File>),
}

/// The engine's GPU claim.
pub struct Claim {
    /// The claim file.
    path: PathBuf,
    /// For the violation record and logs.
    engine_id: u32,
    /// The file (None only transiently while switching state).
    held: Mutex<Option<Held>>,
}

fn unix_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

impl Claim {
    /// Opens (creates) the claim file, inheritable by exec'd workers; does not lock it.
    pub fn open(path: &Path, engine_id: u32) -> std::io::Result<Claim> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        // Let exec'd workers inherit it.
        let fl = FdFlag::from_bits_retain(fcntl(f.as_raw_fd(), FcntlArg::F_GETFD)?);
        fcntl(f.as_raw_fd(), FcntlArg::F_SETFD(fl - FdFlag::FD_CLOEXEC))?;
        Ok(Claim {
            path: path.to_path_buf(),
            engine_id,
            held: Mutex::new(Some(Held::Open(f))),
        })
    }

    /// Takes the claim (`flock(LOCK_EX|LOCK_NB)`). Err(message) on split brain, after
    /// recording it in `PATH.violations` and the log.
    pub fn take(&self) -> Result<(), String> {
        let mut g = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let (next, result) = match g.take() {
            Some(Held::Open(f)) => match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
                Ok(l) => (Held::Locked(l), Ok(())),
                Err((f, errno)) => (Held::Open(f), Err(errno)),
            },
            Some(Held::Locked(l)) => (Held::Locked(l), Ok(())),
            None => return Err("gpu claim file lost".into()),
        };
        *g = Some(next);
        drop(g);
        match result {
            Ok(()) => {
                tracing::info!(target: "fake_engine", engine_id = self.engine_id, "gpu claim taken");
                Ok(())
            }
            Err(errno) => {
                let err = std::io::Error::from(errno);
                self.record_violation();
                tracing::error!(target: "fake_engine",
                    engine_id = self.engine_id,
                    claim = %self.path.display(),
                    error = %err,
                    "SPLIT BRAIN: gpu claim already held by another engine"
                );
                Err(format!("gpu claim held by another engine: {err}"))
            }
        }
    }

    /// Releases the claim (`LOCK_UN`), if held.
    pub fn release(&self) {
        let mut g = self.held.lock().unwrap_or_else(|e| e.into_inner());
        *g = match g.take() {
            Some(Held::Locked(l)) => match l.unlock() {
                Ok(f) => Some(Held::Open(f)),
                Err((l, errno)) => {
                    tracing::warn!(target: "fake_engine", error = %errno, "gpu claim: unlock failed");
                    Some(Held::Locked(l))
                }
            },
            other => other,
        };
    }

    fn record_violation(&self) {
        let line = serde_json::json!({
            "violation": "gpu-claim-held",
            "engine_id": self.engine_id,
            "pid": std::process::id(),
            "at_unix_us": unix_us(),
        });
        let mut vpath = self.path.clone().into_os_string();
        vpath.push(".violations");
        if let Ok(mut vf) = OpenOptions::new().create(true).append(true).open(&vpath) {
            let _ = writeln!(vf, "{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_engine_cannot_take_a_held_claim_and_records_it() {
        let dir = std::env::temp_dir().join(format!("fake-engine-claim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gpu.claim");
        let a = Claim::open(&path, 0).unwrap();
        let b = Claim::open(&path, 1).unwrap();
        a.take().unwrap();
        a.take().expect("taking a claim it holds is a no-op");
        let err = b.take().unwrap_err();
        assert!(err.contains("held by another engine"), "{err}");
        let v = std::fs::read_to_string(dir.join("gpu.claim.violations")).unwrap();
        let line: serde_json::Value = serde_json::from_str(v.lines().next().unwrap()).unwrap();
        assert_eq!(line["violation"], "gpu-claim-held");
        assert_eq!(line["engine_id"], 1);
        a.release();
        b.take().expect("free after release");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
