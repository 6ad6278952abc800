//! A real HAProxy (Debian's `haproxy`) for router tests: started with a given config in a test
//! dir, its runtime API read back to see where each server is. When no `haproxy` binary is
//! installed, [`Haproxy::start`] records a skip and returns None (CI installs it).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::proc::Proc;

/// A running HAProxy; killed on drop.
#[derive(Debug)]
pub struct Haproxy {
    /// The process.
    pub proc: Proc,
    /// Its runtime API socket (`stats socket ... level admin` in the config).
    pub socket: PathBuf,
}

/// One server as the runtime API shows it (`show servers state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerState {
    /// Operational state: 0 stopped, 1 starting, 2 running, 3 stopping.
    pub op: u32,
    /// Administrative state bits (0x01 forced maintenance from the CLI, 0x04 `disabled` in the
    /// config, kept as a record once the CLI made it ready; others: inherited/drain states).
    pub admin: u32,
}

impl ServerState {
    /// Takes traffic: running and in no maintenance or drain state.
    pub fn in_rotation(self) -> bool {
        self.op == 2 && self.admin & !0x04 == 0
    }

    /// Forced into maintenance through the runtime API.
    pub fn forced_out(self) -> bool {
        self.admin & 0x01 != 0
    }
}

/// The `haproxy` binary, if installed.
pub fn binary() -> Option<PathBuf> {
    [
        "/usr/sbin/haproxy",
        "/usr/local/sbin/haproxy",
        "/usr/bin/haproxy",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
}

impl Haproxy {
    /// Check `cfg` with `haproxy -c`, start it (config and log in `dir`), wait (bounded) until
    /// its runtime socket answers. None (with a recorded skip for `test`) without a `haproxy`
    /// binary; panics when the config is refused or it does not come up.
    pub fn start(test: &str, dir: &Path, cfg: &str, socket: &Path) -> Option<Haproxy> {
        let Some(bin) = binary() else {
            crate::skip(test, "no haproxy binary (apt-get install haproxy)");
            return None;
        };
        let path = dir.join("haproxy.cfg");
        std::fs::write(&path, cfg).expect("write haproxy.cfg");
        let check = Command::new(&bin)
            .args(["-c", "-q", "-f"])
            .arg(&path)
            .output()
            .expect("run haproxy -c");
        assert!(
            check.status.success(),
            "haproxy refused the config: {}\n{cfg}",
            String::from_utf8_lossy(&check.stderr)
        );
        let mut cmd = Command::new(&bin);
        cmd.args(["-db", "-f"]).arg(&path);
        let proc = Proc::spawn("haproxy", cmd, dir.join("haproxy.log"));
        let h = Haproxy {
            proc,
            socket: socket.to_path_buf(),
        };
        let up = crate::wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            h.try_admin("show info").is_ok()
        });
        assert!(
            up,
            "haproxy runtime socket never answered:\n{}",
            h.proc.log_text()
        );
        Some(h)
    }

    /// One runtime API command, its answer (bounded by 2 s).
    pub fn try_admin(&self, cmd: &str) -> std::io::Result<String> {
        let mut s = UnixStream::connect(&self.socket)?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.write_all(format!("{cmd}\n").as_bytes())?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    }

    /// Every server of `backend`: name -> state. Panics if the runtime API does not answer.
    pub fn servers(&self, backend: &str) -> BTreeMap<String, ServerState> {
        let text = self
            .try_admin(&format!("show servers state {backend}"))
            .unwrap_or_else(|e| panic!("haproxy runtime API: {e}"));
        let mut out = BTreeMap::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 6 && f[0].parse::<u32>().is_ok() && f[1] == backend {
                if let (Ok(op), Ok(admin)) = (f[5].parse(), f[6].parse()) {
                    out.insert(f[3].to_string(), ServerState { op, admin });
                }
            }
        }
        assert!(!out.is_empty(), "no servers of {backend} in:\n{text}");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_bits() {
        let s = |op, admin| ServerState { op, admin };
        assert!(s(2, 0).in_rotation());
        assert!(
            s(2, 4).in_rotation(),
            "`disabled` in the config, made ready by the CLI"
        );
        assert!(!s(2, 1).in_rotation());
        assert!(!s(0, 0).in_rotation());
        assert!(!s(2, 8).in_rotation(), "draining");
        assert!(s(0, 5).forced_out());
        assert!(!s(2, 4).forced_out());
    }
}
