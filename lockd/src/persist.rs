//! The durable state: a whole snapshot (`STATE`), an append-only journal of what changed
//! since (`STATE.journal`), and the lock file that keeps a second lockd off them.
//!
//! A snapshot goes to `STATE.tmp`, is fsynced, renamed over `STATE`, and the directory is
//! fsynced, so a crash leaves either the old or the new snapshot, never a torn one. It is
//! stamped with the last journal number it covers (`"journal":N`); only then is the journal
//! emptied. Between snapshots each write appends one line to the journal (a
//! [`StateDelta`] with the next journal number) and fdatasyncs it: O(change), not O(state).
//! A snapshot is written at the first write after a start and when the journal outgrows
//! max(1 MiB, twice the snapshot) (or `--compact-after`).
//!
//! Reading: the snapshot, then the journal lines in order; lines numbered at or below the
//! snapshot's stamp are skipped (a crash between the rename and the emptying). A torn last
//! line (no newline, or not JSON) is an append whose fsync never returned, so nothing it
//! covered was ever sent: it is cut off with a warning. Anything else that cannot be read
//! or parsed is an error: lockd never starts empty over it and never overwrites it.

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

use crate::core::{check_state, decode_state, PersistedState, StateDelta, STATE_VERSION};

/// The journal outgrows the snapshot (and a compaction is due) at max(this, twice the
/// snapshot) bytes, unless `--compact-after` says otherwise.
pub const COMPACT_FLOOR: u64 = 1 << 20;

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

/// `v` as one JSON line in `buf`, cleared first (the buffer is reused from write to write).
fn encode_line<T: serde::Serialize>(
    buf: &mut Vec<u8>,
    v: &T,
    what: &'static str,
    path: &Path,
) -> Result<(), PersistError> {
    buf.clear();
    serde_json::to_writer(&mut *buf, v).map_err(|e| PersistError::Io {
        what,
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    buf.push(b'\n');
    Ok(())
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
    /// `STATE.journal`.
    journal_path: PathBuf,
    /// The journal, open for appends once this process wrote its first snapshot (None
    /// until then: the first write is always a whole snapshot).
    journal: Option<File>,
    /// Bytes in the journal (where the next line goes).
    journal_len: u64,
    /// Bytes of the last snapshot written or read.
    snapshot_len: u64,
    /// The last journal number written or covered by the snapshot.
    last_n: u64,
    /// Compact when the journal passes this many bytes (None: max(1 MiB, 2 × snapshot)).
    compact_after: Option<u64>,
}

/// `STATE.journal`, beside the state file.
pub fn journal_path(state: &Path) -> PathBuf {
    let mut s = state.as_os_str().to_owned();
    s.push(".journal");
    PathBuf::from(s)
}

/// A snapshot as written: the state plus the last journal number it covers.
#[derive(serde::Serialize)]
struct Stamped<'a, S> {
    #[serde(flatten)]
    state: &'a S,
    journal: u64,
}

/// Just the stamp of a snapshot (absent in files written before the journal: 0).
#[derive(serde::Deserialize)]
struct StampProbe {
    #[serde(default)]
    journal: u64,
}

/// What reading the snapshot and the journal found.
struct Loaded {
    state: PersistedState,
    /// Bytes of the snapshot file.
    snapshot_len: u64,
    /// The last journal number covered (snapshot stamp or last line applied or skipped).
    last_n: u64,
    /// Journal bytes up to the end of the last whole line.
    good_len: u64,
    /// A torn last line: what is wrong with it.
    torn: Option<String>,
}

/// Read the snapshot and replay the journal (nothing is written).
fn read_state(path: &Path) -> Result<Loaded, PersistError> {
    let corrupt = |p: &Path, reason: String| PersistError::Corrupt {
        path: p.to_path_buf(),
        reason,
    };
    let (mut state, stamp, snapshot_len, have_snapshot) = match std::fs::read(path) {
        Ok(bytes) => {
            let st = parse_state(path, &bytes)?;
            let stamp = serde_json::from_slice::<StampProbe>(&bytes)
                .map_err(|e| corrupt(path, format!("bad journal stamp: {e}")))?
                .journal;
            (st, stamp, bytes.len() as u64, true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            (PersistedState::default(), 0, 0, false)
        }
        Err(e) => return Err(io("read state file", path)(e)),
    };
    let jp = journal_path(path);
    let bytes = match std::fs::read(&jp) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io("read journal", &jp)(e)),
    };
    if !have_snapshot && bytes.iter().any(|b| !b.is_ascii_whitespace()) {
        return Err(corrupt(
            &jp,
            format!(
                "a journal without its state file {} (move the journal away too to start empty)",
                path.display()
            ),
        ));
    }
    let mut last_n = stamp;
    let mut prev: Option<u64> = None;
    let mut pos = 0usize;
    let mut torn = None;
    let mut lineno = 0u64;
    while pos < bytes.len() {
        lineno += 1;
        let rest = &bytes[pos..];
        let (line, next) = match rest.iter().position(|&b| b == b'\n') {
            Some(i) => (&rest[..i], pos + i + 1),
            None => {
                torn = Some(format!("line {lineno}: no newline at its end"));
                break;
            }
        };
        let is_last = next == bytes.len();
        if is_last && serde_json::from_slice::<serde_json::Value>(line).is_err() {
            torn = Some(format!("line {lineno}: not JSON"));
            break;
        }
        let bad = |reason: String| corrupt(&jp, format!("line {lineno}: {reason}"));
        let d: StateDelta =
            serde_json::from_slice(line).map_err(|e| bad(format!("not a journal line: {e}")))?;
        if let Some(p) = prev {
            if d.n != p + 1 {
                return Err(bad(format!("journal number {} after {p}", d.n)));
            }
        } else if d.n == 0 || d.n > stamp + 1 {
            return Err(bad(format!(
                "journal number {} does not follow the snapshot's {stamp}",
                d.n
            )));
        }
        prev = Some(d.n);
        if d.n > stamp {
            d.apply(&mut state).map_err(bad)?;
        }
        last_n = last_n.max(d.n);
        pos = next;
    }
    check_state(&state).map_err(|reason| corrupt(&jp, format!("replayed state: {reason}")))?;
    Ok(Loaded {
        state,
        snapshot_len,
        last_n,
        good_len: pos as u64,
        torn,
    })
}

/// Read the durable state (snapshot plus journal) without locking or changing anything
/// (for tools and tests). A torn last journal line is left out, as at startup.
pub fn load(path: &Path) -> Result<PersistedState, PersistError> {
    let l = read_state(path)?;
    if let Some(why) = &l.torn {
        tracing::warn!(journal = %journal_path(path).display(), why = %why, "torn last journal line left out");
    }
    Ok(l.state)
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

        let loaded = read_state(path)?;
        let jp = journal_path(path);
        if let Some(why) = &loaded.torn {
            // An append whose fsync never returned: nothing it covered was ever sent.
            tracing::warn!(
                journal = %jp.display(),
                why = %why,
                kept_bytes = loaded.good_len,
                "cutting a torn last journal line (a write that never completed)"
            );
            let f = OpenOptions::new()
                .write(true)
                .open(&jp)
                .map_err(io("open journal", &jp))?;
            f.set_len(loaded.good_len)
                .map_err(io("truncate journal", &jp))?;
            f.sync_all().map_err(io("fsync journal", &jp))?;
        }
        let state = loaded.state;
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
                journal_path: jp,
                journal: None,
                journal_len: loaded.good_len,
                snapshot_len: loaded.snapshot_len,
                last_n: loaded.last_n,
                compact_after: None,
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

    /// Compact when the journal passes `bytes` (None: max(1 MiB, twice the snapshot)).
    pub fn set_compact_after(&mut self, bytes: Option<u64>) {
        self.compact_after = bytes;
    }

    /// Whether the next write must be a whole snapshot ([`StateFile::write`]): the first
    /// write of this process, or the journal outgrew the snapshot.
    pub fn wants_snapshot(&self) -> bool {
        self.journal.is_none() || self.journal_len >= self.compact_limit()
    }

    /// The journal size at which the next write is a snapshot.
    fn compact_limit(&self) -> u64 {
        self.compact_after
            .unwrap_or_else(|| COMPACT_FLOOR.max(self.snapshot_len.saturating_mul(2)))
    }

    /// Whether this process has written its first snapshot (appends go to the journal).
    pub fn journal_open(&self) -> bool {
        self.journal.is_some()
    }

    /// Bytes in the journal now.
    pub fn journal_len(&self) -> u64 {
        self.journal_len
    }

    /// Durably append a delta to the journal (numbered next; one line, then fdatasync):
    /// Ok(true) when the state it leads to is durable. Ok(false), nothing written: the line
    /// would bring the journal to its compaction bound, so the caller writes a whole snapshot
    /// instead ([`StateFile::write`]; a change as big as the state, such as a mass hand-over,
    /// then costs one snapshot, not a line and a snapshot). Needs a snapshot written by this
    /// process first ([`StateFile::wants_snapshot`]).
    pub fn append(&mut self, delta: &mut StateDelta) -> Result<bool, PersistError> {
        let Some(j) = &self.journal else {
            return Err(PersistError::Io {
                what: "append before the first snapshot to",
                path: self.journal_path.clone(),
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            });
        };
        #[cfg(debug_assertions)]
        if let Some(d) = test_write_delay() {
            std::thread::sleep(d);
        }
        delta.n = self.last_n + 1;
        let mut bytes = std::mem::take(&mut self.buf);
        let limit = self.compact_limit();
        let r = encode_line(
            &mut bytes,
            &*delta,
            "serialize journal line",
            &self.journal_path,
        )
        .and_then(|()| {
            if self.journal_len + bytes.len() as u64 >= limit {
                return Ok(false);
            }
            j.write_all_at(&bytes, self.journal_len)
                .map_err(io("append to", &self.journal_path))?;
            j.sync_data().map_err(io("fdatasync", &self.journal_path))?;
            Ok(true)
        });
        if matches!(r, Ok(true)) {
            self.journal_len += bytes.len() as u64;
            self.last_n = delta.n;
        }
        self.buf = bytes;
        r
    }

    /// Empty the journal (after a snapshot that covers it is durable), creating it on the
    /// first snapshot of this process.
    fn reset_journal(&mut self) -> Result<(), PersistError> {
        let jp = &self.journal_path;
        match &self.journal {
            Some(j) => {
                j.set_len(0).map_err(io("truncate journal", jp))?;
                j.sync_all().map_err(io("fsync journal", jp))?;
            }
            None => {
                let j = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(jp)
                    .map_err(io("create journal", jp))?;
                j.sync_all().map_err(io("fsync journal", jp))?;
                self.dir
                    .sync_all()
                    .map_err(io("fsync directory of", &self.path))?;
                self.journal = Some(j);
            }
        }
        self.journal_len = 0;
        Ok(())
    }

    /// Durably replace the state with a whole snapshot: written to `STATE.tmp` and fsynced,
    /// then atomically renamed over `STATE` and the directory is fsynced; only then is the
    /// journal emptied (the snapshot is stamped with the last journal number it covers, so
    /// a crash before that point replays nothing twice). The state is durable when this
    /// returns Ok; a crash at any point leaves `STATE` holding the old or the new snapshot,
    /// whole.
    ///
    /// `state` is a [`PersistedState`] or what serializes the same
    /// ([`crate::core::PersistedStateView`]).
    pub fn write<S: serde::Serialize>(&mut self, state: &S) -> Result<(), PersistError> {
        let mut bytes = std::mem::take(&mut self.buf);
        let stamped = Stamped {
            state,
            journal: self.last_n,
        };
        let r = encode_line(&mut bytes, &stamped, "serialize state", &self.path)
            .and_then(|()| self.write_bytes(&bytes));
        let len = bytes.len() as u64;
        self.buf = bytes;
        r?;
        self.snapshot_len = len;
        self.reset_journal()
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

    /// A delta that sets the epoch of `engine` (as the core would hand it over).
    fn delta_epoch(epoch: u64) -> StateDelta {
        let mut names = std::collections::BTreeMap::new();
        names.insert(
            "engine".to_string(),
            crate::core::NameRecords {
                resource: Some(PersistedResource {
                    epoch,
                    holder: None,
                    ..Default::default()
                }),
                ..Default::default()
            },
        );
        StateDelta {
            version: STATE_VERSION,
            n: 0,
            names,
            leases: Default::default(),
            tombs_forgotten: Vec::new(),
            tombs_added: Vec::new(),
            counters: Default::default(),
            last_lease_id: 0,
            counters_by_kind: Default::default(),
            ttl_counters: Default::default(),
            shared_ttl_counters: Default::default(),
        }
    }

    fn journal_lines(p: &Path) -> Vec<StateDelta> {
        std::fs::read_to_string(journal_path(p))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// A snapshot at epoch 1, then deltas to epochs 2..=last, left as a killed lockd leaves them.
    fn journaled(p: &Path, last: u64) {
        let (mut sf, _) = StateFile::open(p).unwrap();
        assert!(
            sf.wants_snapshot(),
            "the first write of a process is a snapshot"
        );
        sf.write(&state_with_epoch(1)).unwrap();
        for e in 2..=last {
            assert!(!sf.wants_snapshot());
            assert!(sf.append(&mut delta_epoch(e)).unwrap());
        }
    }

    #[test]
    fn appends_are_numbered_and_replayed_after_the_snapshot() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state.json");
        journaled(&p, 4);
        let ns: Vec<u64> = journal_lines(&p).iter().map(|l| l.n).collect();
        assert_eq!(ns, vec![1, 2, 3]);
        // The snapshot alone still says epoch 1; snapshot + journal says 4.
        assert_eq!(
            parse_state(&p, &std::fs::read(&p).unwrap()).unwrap(),
            state_with_epoch(1)
        );
        assert_eq!(load(&p).unwrap(), state_with_epoch(4));
        let (mut sf, st) = StateFile::open(&p).unwrap();
        assert_eq!(st, state_with_epoch(4));
        // The first write after a start is a snapshot stamped with the last number, and the
        // journal is emptied; appends go on numbering after it.
        assert!(sf.wants_snapshot());
        sf.write(&st).unwrap();
        assert_eq!(std::fs::read(journal_path(&p)).unwrap().len(), 0);
        let stamp: StampProbe = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(stamp.journal, 3);
        assert!(sf.append(&mut delta_epoch(5)).unwrap());
        assert_eq!(journal_lines(&p)[0].n, 4);
        drop(sf);
        assert_eq!(load(&p).unwrap(), state_with_epoch(5));
    }

    #[test]
    fn a_torn_last_line_is_cut_off_and_the_rest_replayed() {
        for torn in [
            &br#"{"version":2,"n":4,"names":{"engine":{"resource":{"epo"#[..],
            b"{\"version\":2,\"n\":4}\x00\x00\x00\n",
            b"\x00\x00\x00\x00",
        ] {
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join("state.json");
            journaled(&p, 4);
            let jp = journal_path(&p);
            let good = std::fs::read(&jp).unwrap();
            let mut bytes = good.clone();
            bytes.extend_from_slice(torn);
            std::fs::write(&jp, &bytes).unwrap();
            // Read-only: the torn line is left out, and left alone.
            assert_eq!(load(&p).unwrap(), state_with_epoch(4));
            assert_eq!(std::fs::read(&jp).unwrap(), bytes);
            // Startup cuts it off.
            let (mut sf, st) = StateFile::open(&p).unwrap();
            assert_eq!(st, state_with_epoch(4));
            assert_eq!(std::fs::read(&jp).unwrap(), good);
            sf.write(&st).unwrap();
            assert!(sf.append(&mut delta_epoch(6)).unwrap());
            drop(sf);
            assert_eq!(load(&p).unwrap(), state_with_epoch(6));
        }
    }

    #[test]
    fn lines_covered_by_the_snapshot_are_skipped_after_an_interrupted_compaction() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state.json");
        let jp = journal_path(&p);
        let (mut sf, _) = StateFile::open(&p).unwrap();
        sf.write(&state_with_epoch(1)).unwrap();
        assert!(sf.append(&mut delta_epoch(2)).unwrap());
        assert!(sf.append(&mut delta_epoch(3)).unwrap());
        let old_journal = std::fs::read(&jp).unwrap();
        // The compaction renamed its snapshot (stamp 2), then the process died before the
        // journal was emptied: lines 1 and 2 are in the snapshot already.
        sf.write(&state_with_epoch(3)).unwrap();
        drop(sf);
        std::fs::write(&jp, &old_journal).unwrap();
        assert_eq!(load(&p).unwrap(), state_with_epoch(3));
        // A line numbered past the stamp that follows them is applied.
        let mut bytes = old_journal.clone();
        let mut d3 = delta_epoch(7);
        d3.n = 3;
        bytes.extend_from_slice(serde_json::to_string(&d3).unwrap().as_bytes());
        bytes.push(b'\n');
        std::fs::write(&jp, &bytes).unwrap();
        let (_sf, st) = StateFile::open(&p).unwrap();
        assert_eq!(st, state_with_epoch(7));
    }

    #[test]
    fn a_corrupt_journal_is_refused_and_left_untouched() {
        let line = |n: u64, e: u64| {
            let mut d = delta_epoch(e);
            d.n = n;
            format!("{}\n", serde_json::to_string(&d).unwrap())
        };
        let mut v3 = delta_epoch(3);
        v3.n = 2;
        v3.version = 3;
        let v3 = format!("{}\n", serde_json::to_string(&v3).unwrap());
        for (journal, why) in [
            (format!("{}garbage\n{}", line(1, 2), line(2, 3)), "line 2"),
            (
                format!("{}{}", line(1, 2), line(3, 3)),
                "journal number 3 after 1",
            ),
            (line(2, 2), "does not follow"),
            (format!("{}{}", line(1, 2), v3), "version 3"),
            (format!("{}\n{}", line(1, 2), line(2, 3)), "line 2"),
            (format!("{}{{\"n\":2}}\n", line(1, 2)), "not a journal line"),
        ] {
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join("state.json");
            journaled(&p, 1);
            let snap = std::fs::read(&p).unwrap();
            std::fs::write(journal_path(&p), &journal).unwrap();
            for r in [load(&p).map(|_| ()), StateFile::open(&p).map(|_| ())] {
                match r {
                    Err(PersistError::Corrupt { reason, .. }) => {
                        assert!(reason.contains(why), "{journal:?}: {reason}")
                    }
                    other => panic!("{journal:?}: expected Corrupt, got {other:?}"),
                }
            }
            assert_eq!(std::fs::read(&p).unwrap(), snap);
            assert_eq!(std::fs::read_to_string(journal_path(&p)).unwrap(), journal);
        }
        // A journal whose state file was moved away is refused too (not replayed on empty).
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state.json");
        std::fs::write(journal_path(&p), line(1, 2)).unwrap();
        assert!(matches!(
            StateFile::open(&p),
            Err(PersistError::Corrupt { .. })
        ));
    }

    #[test]
    fn the_journal_is_compacted_once_it_outgrows_its_threshold() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state.json");
        let (mut sf, _) = StateFile::open(&p).unwrap();
        sf.write(&state_with_epoch(1)).unwrap();
        // Default: max(1 MiB, twice the snapshot).
        let line_len = {
            let mut d = delta_epoch(2);
            d.n = 1;
            serde_json::to_string(&d).unwrap().len() as u64 + 1
        };
        let mut e = 1;
        // Appends until a line would bring the journal to the bound: that write is refused
        // (nothing written) and the caller writes a snapshot instead.
        loop {
            e += 1;
            let before = sf.journal_len();
            if !sf.append(&mut delta_epoch(e)).unwrap() {
                assert_eq!(sf.journal_len(), before, "a refused line is not written");
                break;
            }
        }
        assert!(sf.journal_len() < COMPACT_FLOOR);
        assert!(sf.journal_len() + 2 * line_len >= COMPACT_FLOOR);
        assert!(!sf.wants_snapshot());
        sf.write(&state_with_epoch(e)).unwrap();
        assert_eq!(sf.journal_len(), 0);
        // --compact-after overrides it (and a journal past it asks for a snapshot at once).
        let mut appends = 0;
        loop {
            e += 1;
            if !sf.append(&mut delta_epoch(e)).unwrap() {
                break;
            }
            appends += 1;
            if appends == 3 {
                sf.set_compact_after(Some(3 * line_len));
                assert!(sf.wants_snapshot());
                break;
            }
        }
        assert_eq!(appends, 3);
        sf.write(&state_with_epoch(e)).unwrap();
        let mut appends = 0;
        loop {
            e += 1;
            if !sf.append(&mut delta_epoch(e)).unwrap() {
                break;
            }
            appends += 1;
        }
        assert_eq!(appends, 2, "the third line would reach 3 lines' bytes");
        sf.write(&state_with_epoch(e)).unwrap();
        drop(sf);
        assert_eq!(load(&p).unwrap(), state_with_epoch(e));
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
