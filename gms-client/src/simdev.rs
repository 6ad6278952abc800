//! A simulated GPU shared across processes: [`DirDevice`], backed by a directory.
//!
//! The supervisor's `--gpu-sim DIR` uses it instead of NVML, so that drills and end-to-end
//! tests with separate processes (fake engines, the test itself) can exercise the GPU checks
//! ([`crate::checks`]) without a GPU. The format is shared with other writers (fake-engine,
//! the drill); keep it exactly:
//!
//! * `DIR/total`: the device's total memory, decimal bytes, optional trailing newline.
//!   Missing: 80 GiB ([`DEFAULT_TOTAL`]).
//! * `DIR/<pid>` (name all digits): `<bytes> <starttime>\n`: a compute process using `<bytes>`
//!   of device memory. `<starttime>` is field 22 of `/proc/<pid>/stat` (clock ticks since
//!   boot), which pins the entry to that process against pid reuse; `0` means "do not check".
//! * The device's compute processes are the entries whose process is alive now:
//!   `/proc/<pid>/stat` exists, its state is not `Z`/`X`, and its starttime matches (unless 0).
//!   Entries of dead processes are ignored, as the driver frees a process's memory when it
//!   dies, and removed lazily (best effort). Malformed entries are ignored (one warning per
//!   file name). free = total − Σ bytes of live entries (saturating).
//! * Writers write atomically: `DIR/.<pid>.tmp`, then rename to `DIR/<pid>` ([`register`],
//!   [`unregister`], [`set_total`]).
//!
//! Pids are this machine's pids as `/proc` shows them to the reader, so the checks match
//! them by pid (`PidNamespace::Host`).

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tracing::warn;

use crate::backend::MemInfo;
use crate::checks::{Device, GpuProcess};

/// Total memory of a device whose `DIR/total` is missing: 80 GiB.
pub const DEFAULT_TOTAL: u64 = 80 << 30;

/// `(state letter, starttime)` of `pid` from `/proc/<pid>/stat`; None when the process does not
/// exist or the file cannot be parsed. The command name (field 2) may contain spaces and
/// parentheses, so the fields are read after the LAST `)`.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&s)
}

fn parse_stat(s: &str) -> Option<(char, u64)> {
    let rest = &s[s.rfind(')')? + 1..];
    let mut it = rest.split_whitespace();
    // Field 3 is the state; starttime is field 22, i.e. 19 fields after the state.
    let state = it.next()?.chars().next()?;
    let start = it.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Starttime (field 22 of `/proc/<pid>/stat`, clock ticks since boot) of a live process.
pub fn starttime(pid: u32) -> io::Result<u64> {
    match proc_stat(pid) {
        Some((_, t)) => Ok(t),
        None => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no readable /proc/{pid}/stat"),
        )),
    }
}

fn write_atomic(dir: &Path, name: &str, content: &str) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, content)?;
    std::fs::rename(&tmp, dir.join(name)).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Writer side: `pid` uses `bytes` of the device in `dir` (created if missing). Reads the
/// process's starttime itself (fails if `pid` does not exist) and writes `DIR/<pid>`
/// atomically (`DIR/.<pid>.tmp`, then rename).
pub fn register(dir: &Path, pid: u32, bytes: u64) -> io::Result<()> {
    let start = starttime(pid)?;
    write_atomic(dir, &pid.to_string(), &format!("{bytes} {start}\n"))
}

/// Writer side: `pid` no longer uses the device. Missing entry: Ok.
pub fn unregister(dir: &Path, pid: u32) -> io::Result<()> {
    match std::fs::remove_file(dir.join(pid.to_string())) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Writer side: sets the device's total memory (`DIR/total`, written atomically).
pub fn set_total(dir: &Path, bytes: u64) -> io::Result<()> {
    write_atomic(dir, "total", &format!("{bytes}\n"))
}

/// An entry's content: `<bytes> <starttime>` (surrounding whitespace allowed).
fn parse_entry(s: &str) -> Option<(u64, u64)> {
    let mut it = s.split_whitespace();
    let bytes = it.next()?.parse().ok()?;
    let start = it.next()?.parse().ok()?;
    it.next().is_none().then_some((bytes, start))
}

/// A simulated device backed by a directory (format in the module docs).
#[derive(Debug)]
pub struct DirDevice {
    /// The directory.
    dir: PathBuf,
    /// File names already warned about (one warning per malformed file).
    warned: Mutex<HashSet<String>>,
}

impl DirDevice {
    /// A device reading `dir`. The directory need not exist yet (then: no processes, the
    /// default total).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn warn_once(&self, name: &str, what: &str) {
        let first = self
            .warned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string());
        if first {
            warn!(dir = %self.dir.display(), file = name, "simulated device: {what}; ignored");
        }
    }

    fn total(&self) -> Result<u64, String> {
        match std::fs::read_to_string(self.dir.join("total")) {
            Ok(s) => match s.trim().parse::<u64>() {
                Ok(t) => Ok(t),
                Err(_) => {
                    self.warn_once("total", "malformed total (want decimal bytes)");
                    Ok(DEFAULT_TOTAL)
                }
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(DEFAULT_TOTAL),
            Err(e) => Err(format!("{}: {e}", self.dir.join("total").display())),
        }
    }

    /// The live entries (see the module docs); entries of vanished processes are removed.
    fn live(&self) -> Result<Vec<GpuProcess>, String> {
        let rd = match std::fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(format!("{}: {e}", self.dir.display())),
        };
        let mut out = Vec::new();
        for e in rd.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_digit()) {
                continue; // `total`, writers' `.<pid>.tmp`, anything else
            }
            let Ok(pid) = name.parse::<u32>() else {
                self.warn_once(&name, "pid out of range");
                continue;
            };
            let content = match std::fs::read(e.path()) {
                Ok(c) => c,
                Err(_) => continue, // removed meanwhile
            };
            let Some((bytes, start)) = std::str::from_utf8(&content).ok().and_then(parse_entry)
            else {
                self.warn_once(&name, "malformed entry (want `<bytes> <starttime>`)");
                continue;
            };
            match proc_stat(pid) {
                Some((state, _)) if state == 'Z' || state == 'X' => {}
                Some((_, t)) if start != 0 && t != start => {}
                Some(_) => out.push(GpuProcess {
                    pid,
                    used_bytes: Some(bytes),
                }),
                None => {
                    // The process is gone: drop its entry (best effort). Re-read first so
                    // that an entry a new process with the same pid just wrote survives.
                    if std::fs::read(e.path()).is_ok_and(|c| c == content)
                        && proc_stat(pid).is_none()
                    {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
        out.sort_by_key(|p| p.pid);
        Ok(out)
    }
}

impl Device for DirDevice {
    fn describe(&self) -> String {
        format!("sim:{}", self.dir.display())
    }
    fn compute_processes(&self) -> Result<Vec<GpuProcess>, String> {
        self.live()
    }
    fn memory(&self) -> Result<MemInfo, String> {
        let total = self.total()?;
        let used: u64 = self
            .live()?
            .iter()
            .filter_map(|p| p.used_bytes)
            .fold(0u64, u64::saturating_add);
        Ok(MemInfo {
            free: total.saturating_sub(used),
            total,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    const GIB: u64 = 1 << 30;

    fn sleeper() -> Child {
        Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn sleep")
    }

    fn wait_state(pid: u32, want: char) {
        let end = Instant::now() + Duration::from_secs(10);
        while proc_stat(pid).map(|s| s.0) != Some(want) {
            assert!(Instant::now() < end, "pid {pid} never reached state {want}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn stat_parsing_reads_after_the_last_paren() {
        let rest = (4..=52)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(" ");
        let line = format!("42 (a) b) (c) S {rest}\n");
        assert_eq!(parse_stat(&line), Some(('S', 22)));
        assert_eq!(parse_stat("42 (x) S 1 2"), None);
        assert_eq!(parse_stat("garbage"), None);
        let me = std::process::id();
        assert!(starttime(me).unwrap() > 0);
    }

    #[test]
    fn live_processes_are_counted() {
        let d = tempfile::tempdir().unwrap();
        let dev = DirDevice::new(d.path());
        set_total(d.path(), 80 * GIB).unwrap();
        let me = std::process::id();
        register(d.path(), me, 10 * GIB).unwrap();
        let mut child = sleeper();
        register(d.path(), child.id(), 20 * GIB).unwrap();
        let mut want = vec![
            GpuProcess {
                pid: me,
                used_bytes: Some(10 * GIB),
            },
            GpuProcess {
                pid: child.id(),
                used_bytes: Some(20 * GIB),
            },
        ];
        want.sort_by_key(|p| p.pid);
        assert_eq!(dev.compute_processes().unwrap(), want);
        assert_eq!(
            dev.memory().unwrap(),
            MemInfo {
                free: 50 * GIB,
                total: 80 * GIB
            }
        );
        assert_eq!(dev.describe(), format!("sim:{}", d.path().display()));
        // No temporary file left behind by the atomic writes.
        let names: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(!names.is_empty(), "the device wrote its files");
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
        unregister(d.path(), me).unwrap();
        unregister(d.path(), me).unwrap(); // idempotent
        assert_eq!(dev.memory().unwrap().free, 60 * GIB);
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn dead_process_is_ignored_and_its_entry_removed() {
        let d = tempfile::tempdir().unwrap();
        let dev = DirDevice::new(d.path());
        let mut child = sleeper();
        let pid = child.id();
        register(d.path(), pid, 30 * GIB).unwrap();
        assert_eq!(dev.memory().unwrap().free, DEFAULT_TOTAL - 30 * GIB);
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(dev.compute_processes().unwrap().is_empty());
        assert_eq!(dev.memory().unwrap().free, DEFAULT_TOTAL);
        assert!(!d.path().join(pid.to_string()).exists(), "removed lazily");
    }

    #[test]
    fn zombie_is_ignored() {
        let d = tempfile::tempdir().unwrap();
        let dev = DirDevice::new(d.path());
        let mut child = sleeper();
        let pid = child.id();
        register(d.path(), pid, 30 * GIB).unwrap();
        child.kill().unwrap(); // not reaped: a zombie
        wait_state(pid, 'Z');
        assert!(dev.compute_processes().unwrap().is_empty());
        assert_eq!(dev.memory().unwrap().free, DEFAULT_TOTAL);
        child.wait().unwrap();
    }

    #[test]
    fn starttime_mismatch_is_ignored_and_zero_is_not_checked() {
        let d = tempfile::tempdir().unwrap();
        let dev = DirDevice::new(d.path());
        let me = std::process::id();
        let start = starttime(me).unwrap();
        // An entry written by an earlier process that had our pid.
        std::fs::write(
            d.path().join(me.to_string()),
            format!("{} {}\n", GIB, start + 1),
        )
        .unwrap();
        assert!(dev.compute_processes().unwrap().is_empty());
        assert_eq!(dev.memory().unwrap().free, DEFAULT_TOTAL);
        assert!(
            d.path().join(me.to_string()).exists(),
            "a live pid's entry stays"
        );
        std::fs::write(d.path().join(me.to_string()), format!("{GIB} 0")).unwrap();
        assert_eq!(dev.memory().unwrap().free, DEFAULT_TOTAL - GIB);
    }

    #[test]
    fn malformed_content_is_ignored() {
        let d = tempfile::tempdir().unwrap();
        let dev = DirDevice::new(d.path());
        let me = std::process::id();
        let bad: [(&str, &[u8]); 7] = [
            (&me.to_string(), b"lots 0\n"),
            ("1", b""),
            ("2", b"1 2 3\n"),
            ("3", b"-5 0"),
            ("4", &[0xff, 0xfe, b' ', b'0']),
            ("99999999999999999999", b"1 0"),
            ("total", b"eighty gigs\n"),
        ];
        for (name, content) in bad {
            std::fs::write(d.path().join(name), content).unwrap();
        }
        std::fs::write(d.path().join("not-a-pid"), b"1 0").unwrap();
        std::fs::write(d.path().join(format!(".{me}.tmp")), b"1 0").unwrap();
        for _ in 0..2 {
            assert!(dev.compute_processes().unwrap().is_empty());
            assert_eq!(
                dev.memory().unwrap(),
                MemInfo {
                    free: DEFAULT_TOTAL,
                    total: DEFAULT_TOTAL
                }
            );
        }
        // One warning per malformed file, not one per query.
        assert_eq!(dev.warned.lock().unwrap().len(), bad.len());
    }

    #[test]
    fn missing_total_and_missing_dir_mean_an_empty_default_device() {
        let d = tempfile::tempdir().unwrap();
        let dev = DirDevice::new(d.path().join("not-yet"));
        assert_eq!(
            dev.memory().unwrap(),
            MemInfo {
                free: DEFAULT_TOTAL,
                total: DEFAULT_TOTAL
            }
        );
        assert_eq!(DEFAULT_TOTAL, 85_899_345_920);
        set_total(&d.path().join("not-yet"), 1000).unwrap();
        assert_eq!(dev.memory().unwrap().total, 1000);
        register(&d.path().join("not-yet"), std::process::id(), 5000).unwrap();
        assert_eq!(
            dev.memory().unwrap(),
            MemInfo {
                free: 0,
                total: 1000
            }
        );
    }
}
