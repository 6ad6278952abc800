//! What a dead engine tree leaves in the pod, removed before the next incarnation.
//!
//! A SIGKILLed vLLM leaves its Python `multiprocessing` shared memory (`/dev/shm/psm_*`, a few
//! hundred MiB apparent each) and semaphores (`/dev/shm/sem.mp-*`) behind: its
//! `resource_tracker`, which would have unlinked them, dies with it. Every incarnation also
//! leaves its IPC sockets and `torch` files in `$TMPDIR`, even after a clean exit. On a pod's
//! memory-backed `/dev/shm` volume that accumulates with each failover.
//!
//! So each incarnation gets a private `TMPDIR` ([`Leftovers::prepare`]), removed whole once its
//! tree is reaped, and the names under `/dev/shm` that the tree's processes map or hold open
//! are recorded while it runs ([`Leftovers::scan`]): after the fence, those that did not exist
//! when the engine was spawned are unlinked ([`Leftovers::remove`]). A name that was there
//! before (another container's, or a file the pod put there on purpose) is never touched. The
//! record is also written into the private `TMPDIR`, so that a supervisor that was itself
//! killed has its last incarnation's leftovers swept at its next start ([`sweep_stale`]).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The file in a private `TMPDIR` listing the `/dev/shm` names to remove (one per line).
const RECORD: &str = ".supervisor-shm-names";
/// First gap between two scans of the tree's mappings; doubles up to [`SCAN_MAX`]. Engines
/// create their shared memory while they start; a scan at the fence catches later ones.
const SCAN_MIN: Duration = Duration::from_millis(200);
const SCAN_MAX: Duration = Duration::from_secs(10);

/// What [`Leftovers::remove`] (or [`sweep_stale`]) removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// `/dev/shm` entries unlinked.
    pub shm_files: usize,
    /// Their apparent size.
    pub shm_bytes: u64,
    /// Private `TMPDIR`s removed.
    pub tmpdirs: usize,
}

/// One incarnation's leftovers: its private `TMPDIR` and what it put in `/dev/shm`.
#[derive(Debug)]
pub struct Leftovers {
    tmpdir: Option<PathBuf>,
    shm: PathBuf,
    before: BTreeSet<OsString>,
    seen: BTreeSet<OsString>,
    next_scan: Instant,
    gap: Duration,
}

/// The longest private `TMPDIR` path used. Engines make Unix sockets in `TMPDIR` and a socket
/// path holds at most 107 bytes (`sun_path`): vLLM's ZMQ IPC sockets are `TMPDIR/<uuid4>`
/// (37 more bytes), and vLLM fails to start with "ipc path … is longer than 107 characters"
/// under a longer directory.
pub const MAX_TMPDIR_LEN: usize = 64;

/// The private `TMPDIR` name of incarnation `inc` of engine `engine_id` in this supervisor
/// process: its pid and start time tell a later supervisor whether its owner is gone. Short:
/// see [`MAX_TMPDIR_LEN`].
fn tmpdir_name(engine_id: u32, pid: i32, start_time: u64, inc: u32) -> String {
    format!("failover-{engine_id}-{pid}-{start_time}-{inc}")
}

/// Parse a name made by [`tmpdir_name`] for `engine_id`: (pid, start time).
fn parse_tmpdir_name(name: &str, engine_id: u32) -> Option<(i32, u64)> {
    let rest = name.strip_prefix(&format!("failover-{engine_id}-"))?;
    let mut it = rest.split('-');
    let pid = it.next()?.parse().ok()?;
    let start = it.next()?.parse().ok()?;
    it.next()?.parse::<u32>().ok()?;
    it.next().is_none().then_some((pid, start))
}

/// The `/dev/shm` entry a `/proc/PID/maps` line maps, if any (its file name).
fn shm_name_in_maps_line<'a>(line: &'a str, shm: &str) -> Option<&'a str> {
    // address perms offset dev inode pathname: the path is the sixth field and may hold
    // spaces; a deleted file reads "PATH (deleted)" and is gone already.
    let path = line.splitn(6, ' ').nth(5)?.trim_start();
    if path.ends_with(" (deleted)") {
        return None;
    }
    let name = path.strip_prefix(shm)?.strip_prefix('/')?;
    (!name.is_empty() && !name.contains('/')).then_some(name)
}

fn list_names(dir: &Path) -> BTreeSet<OsString> {
    std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.file_name())).collect())
        .unwrap_or_default()
}

impl Leftovers {
    /// Before spawning incarnation `inc`: create its private `TMPDIR` under `base` (None: no
    /// private `TMPDIR`, only `/dev/shm` is tracked) and list what `shm` holds now.
    pub fn prepare(base: Option<&Path>, shm: &Path, engine_id: u32, inc: u32) -> Leftovers {
        let tmpdir = base.and_then(|b| {
            let me = std::process::id() as i32;
            let start = procfs::stat(me).map_or(0, |s| s.start_time);
            let dir = b.join(tmpdir_name(engine_id, me, start, inc));
            if dir.as_os_str().len() > MAX_TMPDIR_LEN {
                tracing::warn!(dir = %dir.display(), max = MAX_TMPDIR_LEN, "the engine's private TMPDIR would be too long for the Unix sockets engines make in it (107 bytes with vLLM's names); the engine keeps the supervisor's TMPDIR: set --engine-tmpdir to a shorter directory");
                return None;
            }
            match std::fs::create_dir_all(&dir) {
                Ok(()) => Some(dir),
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot create the engine's private TMPDIR; the engine keeps the supervisor's");
                    None
                }
            }
        });
        Leftovers {
            tmpdir,
            shm: shm.to_path_buf(),
            before: list_names(shm),
            seen: BTreeSet::new(),
            next_scan: Instant::now(),
            gap: SCAN_MIN,
        }
    }

    /// The engine's `TMPDIR`, if it has a private one.
    pub fn tmpdir(&self) -> Option<&Path> {
        self.tmpdir.as_deref()
    }

    /// Whether the periodic scan is due at `now`.
    pub fn scan_due(&self, now: Instant) -> bool {
        now >= self.next_scan
    }

    /// Record the `/dev/shm` names that the processes `pids` map or hold open now; schedule
    /// the next periodic scan.
    pub fn scan(&mut self, pids: &[i32], now: Instant) {
        self.next_scan = now + self.gap;
        self.gap = (self.gap * 2).min(SCAN_MAX);
        let shm = self.shm.to_string_lossy().into_owned();
        let mut new = false;
        for pid in pids {
            if let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
                for name in maps.lines().filter_map(|l| shm_name_in_maps_line(l, &shm)) {
                    new |= self.note(OsString::from(name));
                }
            }
            let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
                continue;
            };
            for fd in fds.flatten() {
                let Ok(target) = std::fs::read_link(fd.path()) else {
                    continue;
                };
                if target.parent() == Some(self.shm.as_path()) {
                    if let Some(name) = target.file_name() {
                        new |= self.note(name.to_os_string());
                    }
                }
            }
        }
        if new {
            self.write_record();
        }
    }

    /// Remember `name` unless it existed before the spawn; true if it is new.
    fn note(&mut self, name: OsString) -> bool {
        !self.before.contains(&name) && self.seen.insert(name)
    }

    fn write_record(&self) {
        let Some(dir) = &self.tmpdir else { return };
        let text: String = self
            .seen
            .iter()
            .map(|n| format!("{}\n", n.to_string_lossy()))
            .collect();
        let _ = std::fs::write(dir.join(RECORD), text);
    }

    /// After the tree is reaped: unlink the recorded `/dev/shm` names and remove the private
    /// `TMPDIR`.
    pub fn remove(self) -> Removed {
        let mut out = Removed::default();
        for name in &self.seen {
            unlink_counted(&self.shm.join(name), &mut out);
        }
        if let Some(dir) = &self.tmpdir {
            if remove_dir(dir) {
                out.tmpdirs += 1;
            }
        }
        out
    }
}

fn unlink_counted(path: &Path, out: &mut Removed) {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return;
    };
    if meta.is_file() && std::fs::remove_file(path).is_ok() {
        out.shm_files += 1;
        out.shm_bytes += meta.len();
    }
}

fn remove_dir(dir: &Path) -> bool {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the engine's private TMPDIR");
            false
        }
    }
}

/// At the supervisor's start: remove the private `TMPDIR`s of engine `engine_id` under `base`
/// whose supervisor is gone (no process with that pid and start time), and the `/dev/shm`
/// names they recorded.
pub fn sweep_stale(base: &Path, shm: &Path, engine_id: u32) -> Removed {
    let mut out = Removed::default();
    let Ok(rd) = std::fs::read_dir(base) else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some((pid, start)) = parse_tmpdir_name(&name.to_string_lossy(), engine_id) else {
            continue;
        };
        if procfs::stat(pid).is_some_and(|s| s.start_time == start) {
            continue;
        }
        let dir = e.path();
        if let Ok(text) = std::fs::read_to_string(dir.join(RECORD)) {
            for n in text.lines().filter(|n| !n.is_empty() && !n.contains('/')) {
                unlink_counted(&shm.join(n), &mut out);
            }
        }
        if remove_dir(&dir) {
            out.tmpdirs += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_name_shm_entries_only() {
        let shm = "/dev/shm";
        let l = |s| shm_name_in_maps_line(s, shm);
        assert_eq!(
            l("7f1c2a000000-7f1c34000000 rw-s 00000000 00:1a 12 /dev/shm/psm_3f2a9c1e"),
            Some("psm_3f2a9c1e")
        );
        assert_eq!(
            l("7f1c2a000000-7f1c2a001000 rw-s 00000000 00:1a 13                 /dev/shm/sem.mp-x1_y"),
            Some("sem.mp-x1_y")
        );
        assert_eq!(
            l("7f00-7f01 rw-s 0 00:1a 14 /dev/shm/psm_gone (deleted)"),
            None
        );
        assert_eq!(l("7f00-7f01 r-xp 0 08:01 15 /usr/lib/libc.so.6"), None);
        assert_eq!(l("7f00-7f01 rw-p 0 00:00 0 "), None);
        assert_eq!(l("7f00-7f01 rw-s 0 00:1a 16 /dev/shmother/x"), None);
        assert_eq!(l("7f00-7f01 rw-s 0 00:1a 16 /dev/shm/dir/x"), None);
        assert_eq!(l("garbage"), None);
    }

    #[test]
    fn tmpdir_names_round_trip_and_belong_to_one_engine() {
        let n = tmpdir_name(3, 4242, 987654, 7);
        assert_eq!(parse_tmpdir_name(&n, 3), Some((4242, 987654)));
        assert_eq!(parse_tmpdir_name(&n, 30), None);
        assert_eq!(parse_tmpdir_name(&tmpdir_name(30, 1, 2, 3), 3), None);
        assert_eq!(parse_tmpdir_name("failover-3-x-1-2", 3), None);
        assert_eq!(parse_tmpdir_name("failover-3-1-2-3-4", 3), None);
    }

    /// A base directory that would make the engine's socket paths too long gets no private
    /// TMPDIR (vLLM would not start), and nothing is created there.
    #[test]
    fn a_too_long_tmpdir_is_refused() {
        let shm = tempfile::tempdir().unwrap();
        let base = tempfile::tempdir().unwrap();
        let deep = base.path().join("x".repeat(MAX_TMPDIR_LEN));
        let l = Leftovers::prepare(Some(&deep), shm.path(), 0, 1);
        assert!(l.tmpdir().is_none());
        assert!(!deep.exists());
        // The default (/tmp) is well within the limit.
        let d = Path::new("/tmp").join(tmpdir_name(99, i32::MAX, u64::MAX, u32::MAX));
        assert!(d.as_os_str().len() <= MAX_TMPDIR_LEN, "{}", d.display());
    }

    /// A real process maps a file in a stand-in for /dev/shm: it is recorded and removed after
    /// its death; a file that was there before the spawn is left alone, mapped or not.
    #[test]
    fn mapped_files_created_after_the_spawn_are_removed() {
        let shm = tempfile::tempdir().unwrap();
        let base = tempfile::tempdir().unwrap();
        let old = shm.path().join("psm_before");
        std::fs::write(&old, b"x").unwrap();
        let mut l = Leftovers::prepare(Some(base.path()), shm.path(), 9, 1);
        let tmp = l.tmpdir().unwrap().to_path_buf();
        assert!(tmp.is_dir());
        std::fs::write(tmp.join("ipc-socket"), b"").unwrap();
        let new = shm.path().join("psm_new");
        std::fs::write(&new, vec![0u8; 4096]).unwrap();
        // python3 is on every machine this project runs on (vLLM needs it); it maps both files
        // shared and holds them until killed.
        let mut child = std::process::Command::new("python3")
            .args([
                "-c",
                "import mmap,sys,time\nfs=[open(p,'r+b') for p in sys.argv[1:]]\nms=[mmap.mmap(f.fileno(),0) for f in fs]\nprint('ok',flush=True)\ntime.sleep(60)",
            ])
            .arg(&old)
            .arg(&new)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "ok");
        l.scan(&[child.id() as i32], Instant::now());
        child.kill().unwrap();
        child.wait().unwrap();
        let record = std::fs::read_to_string(tmp.join(RECORD)).unwrap();
        assert_eq!(record, "psm_new\n");
        let r = l.remove();
        assert_eq!(
            r,
            Removed {
                shm_files: 1,
                shm_bytes: 4096,
                tmpdirs: 1
            }
        );
        assert!(!new.exists() && old.exists() && !tmp.exists());
    }

    #[test]
    fn a_dead_supervisors_tmpdir_and_its_record_are_swept() {
        let shm = tempfile::tempdir().unwrap();
        let base = tempfile::tempdir().unwrap();
        // pid 1's start time is never u64::MAX: this supervisor is gone.
        let dead = base.path().join(tmpdir_name(4, 1, u64::MAX, 2));
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join(RECORD), "psm_a\n../escape\n").unwrap();
        std::fs::write(shm.path().join("psm_a"), b"12345").unwrap();
        std::fs::write(shm.path().join("psm_b"), b"1").unwrap();
        // A live supervisor's (this process) and another engine's dirs stay.
        let me = std::process::id() as i32;
        let live = base
            .path()
            .join(tmpdir_name(4, me, procfs::stat(me).unwrap().start_time, 1));
        std::fs::create_dir(&live).unwrap();
        let other = base.path().join(tmpdir_name(5, 1, u64::MAX, 2));
        std::fs::create_dir(&other).unwrap();
        let r = sweep_stale(base.path(), shm.path(), 4);
        assert_eq!(
            r,
            Removed {
                shm_files: 1,
                shm_bytes: 5,
                tmpdirs: 1
            }
        );
        assert!(!dead.exists() && live.exists() && other.exists());
        assert!(shm.path().join("psm_b").exists());
    }

    #[test]
    fn scans_back_off() {
        let shm = tempfile::tempdir().unwrap();
        let mut l = Leftovers::prepare(None, shm.path(), 0, 1);
        let t0 = Instant::now();
        assert!(l.scan_due(t0));
        l.scan(&[], t0);
        assert!(!l.scan_due(t0 + SCAN_MIN - Duration::from_millis(1)));
        assert!(l.scan_due(t0 + SCAN_MIN));
        for _ in 0..10 {
            l.scan(&[], t0);
        }
        assert!(l.scan_due(t0 + SCAN_MAX) && !l.scan_due(t0 + SCAN_MAX / 2));
    }
}
