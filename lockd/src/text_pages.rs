//! Make a long-lived holder cheap to kill: drop the page-table entries of this process's own
//! executable code once start-up is over.
//!
//! A holder's death is seen by lockd when the kernel closes its connection, and the kernel
//! closes a killed process's descriptors only after it has torn down its address space
//! (`do_exit`: `exit_mm` before `exit_files`). Tearing down costs time per mapped page, and
//! start-up (argument parsing, the runtime, the client) maps far more of lockd's code than a
//! process waiting on its child ever runs again: measured here, ~1,100 pages of text mapped by
//! `lockd hold`, ~0.33 µs each to unmap, so ~0.35 ms added to every hand-over after a holder's
//! SIGKILL (`lockd_bench`'s handoff round).
//!
//! `MADV_DONTNEED` on the read-only, executable, file-backed mapping only removes page-table
//! entries: the pages stay in the page cache and the next instruction fetched from one of them
//! maps it again (a minor fault). Text is never written, so nothing is lost; the writable and
//! relocated read-only segments (`.data`, `.data.rel.ro`, which are private copies) are never
//! touched. The kernel refuses to open a running executable for writing (`ETXTBSY`), so a
//! refault cannot read a different program.

use std::ffi::c_void;
use std::io;
use std::num::NonZeroUsize;
use std::ptr::NonNull;

/// One executable mapping of the file `exe` found in a `/proc/PID/maps` text: `(start, len)`.
/// Lines are `start-end perms offset dev inode [path]`; the path may contain spaces and may
/// end in ` (deleted)`.
pub fn exe_text_ranges(maps: &str, exe: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for line in maps.lines() {
        let mut f = line.splitn(6, ' ');
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let path = f.nth(3).map(str::trim_start).unwrap_or("");
        let path = path.strip_suffix(" (deleted)").unwrap_or(path);
        if perms != "r-xp" || path != exe {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) else {
            continue;
        };
        if b > a {
            out.push((a, b - a));
        }
    }
    out
}

/// Drop the page-table entries of this process's executable code (see the module docs).
/// Returns the bytes of text covered. Safe to call at any time: code runs on as before.
pub fn unmap_own_text() -> io::Result<usize> {
    let exe = std::fs::read_link("/proc/self/exe")?;
    let exe = exe.to_string_lossy();
    let exe = exe.strip_suffix(" (deleted)").unwrap_or(&exe);
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let mut total = 0;
    for (start, len) in exe_text_ranges(&maps, exe) {
        let (Some(addr), Some(len)) = (
            NonNull::new(start as *mut c_void),
            NonZeroUsize::new(len).map(|l| l.get()),
        ) else {
            continue;
        };
        // SAFETY: the range is one of this process's own read-only, executable, file-backed
        // private mappings (never written, so it has no private copies): MADV_DONTNEED only
        // drops page-table entries, and later accesses fault the same file pages back in.
        unsafe { nix::sys::mman::madvise(addr, len, nix::sys::mman::MmapAdvise::MADV_DONTNEED) }
            .map_err(io::Error::from)?;
        total += len;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_only_the_executables_code() {
        let maps = "\
55d0a0000000-55d0a0100000 r--p 00000000 fd:01 42 /usr/bin/lockd
55d0a0100000-55d0a0500000 r-xp 00100000 fd:01 42 /usr/bin/lockd
55d0a0500000-55d0a0600000 r--p 00500000 fd:01 42 /usr/bin/lockd
55d0a0600000-55d0a0610000 rw-p 00600000 fd:01 42 /usr/bin/lockd
7f0000000000-7f0000100000 r-xp 00000000 fd:01 7 /usr/lib/libc.so.6
7f0000200000-7f0000300000 r-xp 00000000 fd:01 9 /opt/my dir/lockd (deleted)
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
garbage line
";
        assert_eq!(
            exe_text_ranges(maps, "/usr/bin/lockd"),
            vec![(0x55d0a0100000, 0x400000)]
        );
        assert_eq!(
            exe_text_ranges(maps, "/opt/my dir/lockd"),
            vec![(0x7f0000200000, 0x100000)]
        );
        assert!(exe_text_ranges(maps, "/nope").is_empty());
    }

    /// The call finds this test binary's code, drops its mappings, and the process runs on.
    #[test]
    fn unmapping_own_text_keeps_running() {
        let before = mapped_text_kib();
        let n = unmap_own_text().expect("madvise own text");
        assert!(n > 0, "no executable mapping of /proc/self/exe found");
        let after = mapped_text_kib();
        assert!(
            after < before,
            "text still mapped: {before} KiB before, {after} KiB after"
        );
        // Still runs: code paths not used since the call work.
        let v: Vec<u64> = (0..1000).map(|i| i * i).collect();
        assert_eq!(v.iter().sum::<u64>(), 332_833_500);
    }

    /// Kib of this binary's executable mapping that are mapped now (smaps `Rss`).
    fn mapped_text_kib() -> u64 {
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let exe = exe.to_string_lossy().to_string();
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut in_text = false;
        let mut kib = 0;
        for l in smaps.lines() {
            if l.split(' ')
                .next()
                .is_some_and(|f| f.contains('-') && !f.ends_with(':'))
            {
                in_text = l.contains(" r-xp ") && l.ends_with(exe.as_str());
            } else if in_text {
                if let Some(v) = l.strip_prefix("Rss:") {
                    kib += v
                        .trim()
                        .trim_end_matches(" kB")
                        .trim()
                        .parse::<u64>()
                        .unwrap();
                }
            }
        }
        kib
    }
}
