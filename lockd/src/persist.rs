//! The durable state file and the lock file that keeps a second lockd off it.
//!
//! Writes go to `STATE.tmp`, are fsynced, renamed over `STATE`, and the directory is
//! fsynced, so a crash leaves either the old or the new state, never a torn one. A state
//! file that cannot be read or parsed is an error: lockd never starts empty over it and
//! never overwrites it.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{renameat2, AtFlags, Flock, FlockArg, RenameFlags};
use nix::sys::stat::fstatat;

use crate::core::{decode_state, PersistedState, STATE_VERSION};

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

/// One of our two state inodes (at `STATE` or at `STATE.tmp`).
#[derive(Debug)]
struct Spare {
    /// Open for writing; overwritten in place (it is not the published state).
    file: File,
    /// Device of the inode, to check that `STATE.tmp` still names it before publishing it.
    dev: u64,
    /// Inode number, same purpose.
    ino: u64,
}

/// An open, locked state file.
#[derive(Debug)]
pub struct StateFile {
    /// The state file.
    path: PathBuf,
    /// Where new states are written before the rename.
    tmp: PathBuf,
    /// The containing directory, kept open to fsync it after each rename (and as the base
    /// of the `*at` calls, so that no write walks the path again).
    dir: File,
    /// File name of the state file inside `dir`.
    name: CString,
    /// File name of the temp file inside `dir`.
    tmp_name: CString,
    /// The flock()ed lock file: held for the life of this value.
    _lock: Flock<File>,
    /// The inode we last published as `STATE` (None until our first write).
    cur: Option<Spare>,
    /// Our inode at `STATE.tmp` (steady state: the previous state). A write overwrites it,
    /// fsyncs it and swaps the two names with one atomic `renameat2(RENAME_EXCHANGE)`, so
    /// no inode is created or freed per write (creating and freeing one cost more than the
    /// rest of the write on tmpfs). None: the next write creates the temp file.
    spare: Option<Spare>,
    /// Cleared when the file system refuses `RENAME_EXCHANGE`: plain create + rename then.
    exchange_ok: bool,
    /// Files unlinked by a rename, freed by [`StateFile::prepare`] (off the grant path).
    retired: Vec<File>,
    /// Serialization buffer, reused so that a write allocates nothing once warm.
    buf: Vec<u8>,
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
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&lp)
            .map_err(io("open lock file", &lp))?;
        let mut lock = match Flock::lock(lock, FlockArg::LockExclusiveNonblock) {
            Ok(l) => l,
            Err((mut lock, Errno::EWOULDBLOCK)) => {
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
            Err((_, e)) => return Err(io("flock", &lp)(e.into())),
        };
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
        let file_name = |p: &Path| {
            p.file_name()
                .and_then(|n| CString::new(n.as_bytes()).ok())
                .ok_or_else(|| PersistError::Io {
                    what: "use as state file",
                    path: p.to_path_buf(),
                    source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
                })
        };
        let name = file_name(path)?;
        let tmp_name = file_name(Path::new(&tmp))?;
        Ok((
            StateFile {
                path: path.to_path_buf(),
                tmp: PathBuf::from(tmp),
                dir,
                name,
                tmp_name,
                _lock: lock,
                cur: None,
                spare: None,
                exchange_ok: true,
                retired: Vec::new(),
                buf: Vec::new(),
            },
            state,
        ))
    }

    /// The state file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Create (or truncate) `STATE.tmp`.
    fn create_tmp(&self) -> Result<File, PersistError> {
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&self.tmp)
            .map_err(io("create", &self.tmp))
    }

    /// (device, inode, size) of what `STATE.tmp` names now, if anything.
    fn tmp_identity(&self) -> Option<(u64, u64, u64)> {
        let st = fstatat(
            Some(self.dir.as_raw_fd()),
            self.tmp_name.as_c_str(),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .ok()?;
        Some((st.st_dev, st.st_ino, st.st_size as u64))
    }

    /// Housekeeping kept off the grant path; call it once the grants of the last write have
    /// been handed to the sockets. Frees files that a rename unlinked and, after a plain
    /// rename, creates the temp file that the next write will exchange. Never fails: if
    /// that fails, the next [`StateFile::write`] creates the temp file itself and reports
    /// any error.
    pub fn prepare(&mut self) {
        self.retired.clear();
        if !self.exchange_ok || self.spare.is_some() || self.cur.is_none() {
            return;
        }
        let Ok(file) = self.create_tmp() else {
            return;
        };
        let Ok(md) = file.metadata() else {
            return;
        };
        self.spare = Some(Spare {
            file,
            dev: md.dev(),
            ino: md.ino(),
        });
    }

    /// Durably replace the state: the new state is written to `STATE.tmp` and fsynced, then
    /// atomically renamed over `STATE` and the directory is fsynced. The state is durable
    /// when this returns Ok; a crash at any point leaves `STATE` holding the old or the new
    /// state, whole.
    pub fn write(&mut self, state: &PersistedState) -> Result<(), PersistError> {
        let mut bytes = std::mem::take(&mut self.buf);
        bytes.clear();
        let r = serde_json::to_writer(&mut bytes, state)
            .map_err(|e| PersistError::Io {
                what: "serialize state",
                path: self.path.clone(),
                source: std::io::Error::other(e),
            })
            .and_then(|()| {
                bytes.push(b'\n');
                self.write_bytes(&bytes)
            });
        self.buf = bytes;
        r
    }

    fn write_bytes(&mut self, bytes: &[u8]) -> Result<(), PersistError> {
        #[cfg(debug_assertions)]
        if let Some(d) = test_write_delay() {
            // A slow disk, for the tests of group commit (debug builds only).
            std::thread::sleep(d);
        }
        if self.exchange_ok && self.cur.is_some() {
            if let Some(sp) = self.spare.take() {
                // Publish only the inode we are about to write: if someone replaced
                // `STATE.tmp`, fall back to creating it afresh.
                let id = self.tmp_identity();
                if let Some((_, _, size)) = id.filter(|&(d, i, _)| (d, i) == (sp.dev, sp.ino)) {
                    let len = bytes.len() as u64;
                    sp.file
                        .write_all_at(bytes, 0)
                        .map_err(io("write", &self.tmp))?;
                    // Its old content was longer: cut what is left of it.
                    if size > len {
                        sp.file.set_len(len).map_err(io("truncate", &self.tmp))?;
                    }
                    sp.file.sync_all().map_err(io("fsync", &self.tmp))?;
                    match renameat2(
                        Some(self.dir.as_raw_fd()),
                        self.tmp_name.as_c_str(),
                        Some(self.dir.as_raw_fd()),
                        self.name.as_c_str(),
                        RenameFlags::RENAME_EXCHANGE,
                    ) {
                        Ok(()) => {
                            self.dir
                                .sync_all()
                                .map_err(io("fsync directory of", &self.path))?;
                            // `STATE` is now `sp`; `STATE.tmp` the inode that was `STATE`.
                            self.spare = self.cur.replace(sp);
                            return Ok(());
                        }
                        Err(Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => {
                            self.exchange_ok = false;
                        }
                        // Otherwise (e.g. `STATE` was moved away): the plain path below.
                        Err(_) => {}
                    }
                }
            }
        }
        let mut f = self.create_tmp()?;
        f.write_all(bytes).map_err(io("write", &self.tmp))?;
        f.sync_all().map_err(io("fsync", &self.tmp))?;
        std::fs::rename(&self.tmp, &self.path).map_err(io("rename over", &self.path))?;
        self.dir
            .sync_all()
            .map_err(io("fsync directory of", &self.path))?;
        let new = match f.metadata() {
            Ok(md) => Some(Spare {
                dev: md.dev(),
                ino: md.ino(),
                file: f,
            }),
            // Without its identity it cannot be exchanged later: the next write creates.
            Err(_) => {
                self.retired.push(f);
                None
            }
        };
        if let Some(old) = std::mem::replace(&mut self.cur, new) {
            self.retired.push(old.file);
        }
        Ok(())
    }
}

/// Debug builds only: `LOCKD_TEST_WRITE_DELAY_MS` makes every state write wait this long
/// before it starts (the new state is published only after it), so that tests can check
/// group commit and durable-before-visible against a slow fsync.
#[cfg(debug_assertions)]
fn test_write_delay() -> Option<std::time::Duration> {
    static DELAY: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        std::env::var("LOCKD_TEST_WRITE_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(std::time::Duration::from_millis)
    })
}

impl Drop for StateFile {
    fn drop(&mut self) {
        // The temp file only ever holds an older state (or nothing): do not leave it behind.
        if self.spare.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Parse and validate state file bytes of any version this lockd reads; an older version
/// is migrated in memory (the next write stores the current version) and logged.
pub fn parse_state(path: &Path, bytes: &[u8]) -> Result<PersistedState, PersistError> {
    let (st, from) = decode_state(bytes).map_err(|reason| PersistError::Corrupt {
        path: path.to_path_buf(),
        reason,
    })?;
    if from != STATE_VERSION {
        tracing::info!(
            path = %path.display(),
            from,
            to = STATE_VERSION,
            "state file migrated in memory; the next write stores the new version"
        );
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
        let mut st2 = PersistedState {
            last_lease_id: 1,
            ..PersistedState::default()
        };
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
                    lease_id: 1,
                    kind: Default::default(),
                    mode: Default::default(),
                    expires_at_unix_ms: None,
                    gang: None,
                }),
                ..Default::default()
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

    fn state_with_epoch(epoch: u64) -> PersistedState {
        let mut st = PersistedState::default();
        st.resources.insert(
            "engine".into(),
            PersistedResource {
                epoch,
                holder: None,
                ..Default::default()
            },
        );
        st
    }

    fn ino(p: &Path) -> u64 {
        std::fs::metadata(p).unwrap().ino()
    }

    #[test]
    fn steady_state_writes_exchange_two_inodes_and_always_publish_the_latest() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state.json");
        let tmp = d.path().join("state.json.tmp");
        let (mut sf, _) = StateFile::open(&p).unwrap();
        sf.write(&state_with_epoch(1)).unwrap();
        sf.prepare();
        let mut inodes = std::collections::BTreeSet::new();
        // Epochs grow by one per write; longer and shorter contents alternate.
        for e in [2u64, 100_000, 3, 4, 1_000_000_000, 5] {
            sf.write(&state_with_epoch(e)).unwrap();
            sf.prepare();
            inodes.insert(ino(&p));
            let on_disk = parse_state(&p, &std::fs::read(&p).unwrap()).unwrap();
            assert_eq!(on_disk, state_with_epoch(e));
        }
        assert_eq!(inodes.len(), 2, "the two inodes are reused: {inodes:?}");
        // The temp file holds the previous (whole) state, never a torn one.
        let prev = parse_state(&tmp, &std::fs::read(&tmp).unwrap()).unwrap();
        assert_eq!(prev, state_with_epoch(1_000_000_000));
        drop(sf);
        assert!(!tmp.exists(), "temp file removed on drop");
        let (_sf, back) = StateFile::open(&p).unwrap();
        assert_eq!(back, state_with_epoch(5));
    }

    #[test]
    fn a_replaced_temp_file_or_moved_state_file_is_never_published() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state.json");
        let tmp = d.path().join("state.json.tmp");
        let (mut sf, _) = StateFile::open(&p).unwrap();
        for e in 1..=3 {
            sf.write(&state_with_epoch(e)).unwrap();
            sf.prepare();
        }
        // Someone puts another file at STATE.tmp: it must not become the state.
        let foreign = d.path().join("foreign");
        std::fs::write(&foreign, b"{\"version\":1,\"resources\":{}}\n").unwrap();
        std::fs::rename(&foreign, &tmp).unwrap();
        sf.write(&state_with_epoch(4)).unwrap();
        sf.prepare();
        assert_eq!(
            parse_state(&p, &std::fs::read(&p).unwrap()).unwrap(),
            state_with_epoch(4)
        );
        sf.write(&state_with_epoch(5)).unwrap();
        sf.prepare();
        // The state file is moved away: the next write recreates it.
        std::fs::rename(&p, d.path().join("moved")).unwrap();
        sf.write(&state_with_epoch(6)).unwrap();
        assert_eq!(
            parse_state(&p, &std::fs::read(&p).unwrap()).unwrap(),
            state_with_epoch(6)
        );
        // Someone replaces STATE itself: our next write still publishes our state.
        std::fs::write(&foreign, b"junk").unwrap();
        std::fs::rename(&foreign, &p).unwrap();
        for e in 7..=9 {
            sf.write(&state_with_epoch(e)).unwrap();
            sf.prepare();
            assert_eq!(
                parse_state(&p, &std::fs::read(&p).unwrap()).unwrap(),
                state_with_epoch(e)
            );
        }
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
