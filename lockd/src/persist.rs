//! The durable state file and the lock file that keeps a second lockd off it.
//!
//! Writes go to `STATE.tmp`, are fsynced, renamed over `STATE`, and the directory is
//! fsynced, so a crash leaves either the old or the new state, never a torn one. A state
//! file that cannot be read or parsed is an error: lockd never starts empty over it and
//! never overwrites it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::core::{PersistedState, STATE_VERSION};

/// Why the state could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// Another lockd holds the lock file beside the state file.
    #[error("state file {path} is locked by another lockd ({holder}); refusing to start")]
    Locked {
        /// The state file.
        path: PathBuf,
        /// What the lock file says about its owner.
        holder: String,
    },
    /// The state file exists but is not a valid state.
    #[error("state file {path} is corrupt ({reason}); refusing to start and leaving it untouched (inspect it, then move it away to start empty)")]
    Corrupt {
        /// The state file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// An I/O error on the state file, its directory, its temp file or its lock file.
    #[error("{what} {path}: {source}")]
    Io {
        /// Which operation.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PersistError + 'a {
    move |source| PersistError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// An open, locked state file.
#[derive(Debug)]
pub struct StateFile {
    /// The state file.
    path: PathBuf,
    /// Where new states are written before the rename.
    tmp: PathBuf,
    /// The containing directory, kept open to fsync it after each rename.
    dir: File,
    /// The flock()ed lock file: held for the life of this value.
    _lock: File,
}

/// `STATE.lock`, beside the state file.
pub fn lock_path(state: &Path) -> PathBuf {
    let mut s = state.as_os_str().to_owned();
    s.push(".lock");
    PathBuf::from(s)
}

impl StateFile {
    /// Lock and read the state file (absent = first boot = empty state).
    pub fn open(path: &Path) -> Result<(StateFile, PersistedState), PersistError> {
        let lp = lock_path(path);
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lp)
            .map_err(io("open lock file", &lp))?;
        // SAFETY: flock on a valid, owned fd.
        let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut owner = String::new();
                let _ = lock.read_to_string(&mut owner);
                let owner = owner.trim();
                return Err(PersistError::Locked {
                    path: path.to_path_buf(),
                    holder: if owner.is_empty() {
                        "pid unknown".into()
                    } else {
                        owner.to_string()
                    },
                });
            }
            return Err(io("flock", &lp)(err));
        }
        lock.set_len(0).map_err(io("truncate lock file", &lp))?;
        lock.write_all(format!("pid {}\n", std::process::id()).as_bytes())
            .map_err(io("write lock file", &lp))?;

        let state = match std::fs::read(path) {
            Ok(bytes) => parse_state(path, &bytes)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => PersistedState::default(),
            Err(e) => return Err(io("read state file", path)(e)),
        };
        let dir_path = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let dir = File::open(&dir_path).map_err(io("open state directory", &dir_path))?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        Ok((
            StateFile {
                path: path.to_path_buf(),
                tmp: PathBuf::from(tmp),
                dir,
                _lock: lock,
            },
            state,
        ))
    }

    /// The state file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Durably replace the state: tmp file, fsync, rename, fsync directory.
    pub fn write(&mut self, state: &PersistedState) -> Result<(), PersistError> {
        let mut bytes = serde_json::to_vec(state).map_err(|e| PersistError::Io {
            what: "serialize state",
            path: self.path.clone(),
            source: std::io::Error::other(e),
        })?;
        bytes.push(b'\n');
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&self.tmp)
            .map_err(io("create", &self.tmp))?;
        f.write_all(&bytes).map_err(io("write", &self.tmp))?;
        f.sync_all().map_err(io("fsync", &self.tmp))?;
        drop(f);
        std::fs::rename(&self.tmp, &self.path).map_err(io("rename over", &self.path))?;
        self.dir
            .sync_all()
            .map_err(io("fsync directory of", &self.path))?;
        Ok(())
    }
}

/// Parse and validate state file bytes.
pub fn parse_state(path: &Path, bytes: &[u8]) -> Result<PersistedState, PersistError> {
    let corrupt = |reason: String| PersistError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(corrupt("empty file".into()));
    }
    let st: PersistedState =
        serde_json::from_slice(bytes).map_err(|e| corrupt(format!("not a lockd state: {e}")))?;
    if st.version != STATE_VERSION {
        return Err(corrupt(format!(
            "version {} (this lockd reads {STATE_VERSION})",
            st.version
        )));
    }
    for (name, r) in &st.resources {
        if let Some(h) = &r.holder {
            if h.epoch > r.epoch || h.epoch == 0 {
                return Err(corrupt(format!(
                    "resource {name:?}: holder epoch {} inconsistent with epoch {}",
                    h.epoch, r.epoch
                )));
            }
        }
    }
    Ok(st)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::{PersistedLease, PersistedResource};

    #[test]
    fn write_then_reopen_round_trips_and_lock_excludes() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state.json");
        let (mut sf, st) = StateFile::open(&p).unwrap();
        assert_eq!(st, PersistedState::default());
        let mut st2 = PersistedState::default();
        st2.resources.insert(
            "engine".into(),
            PersistedResource {
                epoch: 3,
                holder: Some(PersistedLease {
                    name: "a".into(),
                    epoch: 3,
                    token: "t".into(),
                    granted_at_unix_ms: 1,
                    peer: None,
                    revoked: false,
                }),
            },
        );
        sf.write(&st2).unwrap();
        assert!(!d.path().join("state.json.tmp").exists());
        match StateFile::open(&p) {
            Err(PersistError::Locked { .. }) => {}
            other => panic!("expected Locked, got {other:?}"),
        }
        drop(sf);
        let (_sf, back) = StateFile::open(&p).unwrap();
        assert_eq!(back, st2);
    }

    #[test]
    fn corrupt_files_are_refused_untouched() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state.json");
        for bad in [&b""[..], b"{", b"[]", br#"{"version":99,"resources":{}}"#,
            br#"{"version":1,"resources":{"r":{"epoch":1,"holder":{"name":"a","epoch":5,"token":"t","granted_at_unix_ms":0}}}}"#] {
            std::fs::write(&p, bad).unwrap();
            match StateFile::open(&p) {
                Err(PersistError::Corrupt { .. }) => {}
                other => panic!("{:?}: expected Corrupt, got {other:?}", String::from_utf8_lossy(bad)),
            }
            assert_eq!(std::fs::read(&p).unwrap(), bad);
        }
    }
}
