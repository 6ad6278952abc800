//! A real etcd (Debian's `etcd-server`): one member or a cluster, on free loopback ports or on
//! another local address (a bridge's, for the network-namespace drill), its data in a temp dir,
//! killed with its process group on drop, restartable on its data (a killed member rejoins),
//! pausable (SIGSTOP / SIGCONT); and a TCP proxy that can black-hole a client's traffic to it
//! (a partition without a network namespace).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::proc::Proc;

/// The etcd binary: `$ETCD_BIN`, else `etcd` on PATH or in /usr/bin (Debian's etcd-server).
pub fn binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ETCD_BIN") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    find_on_path("etcd")
}

/// The etcd binary's version (`etcd --version`: `etcd Version: 3.4.23`), e.g. `3.4.23`.
pub fn version() -> Option<String> {
    let out = Command::new(binary()?)
        .arg("--version")
        .env("ETCD_UNSUPPORTED_ARCH", go_arch())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("etcd Version:"))
        .map(|v| v.trim().to_string())
}

/// `etcdctl` (Debian's etcd-client), for the side-by-side `etcdctl lock` measurements.
pub fn etcdctl() -> Option<PathBuf> {
    find_on_path("etcdctl")
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// This machine's architecture as Go names it (etcd's `ETCD_UNSUPPORTED_ARCH` compares with it).
fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// A running etcd.
pub struct Etcd {
    proc: Proc,
    /// How it was started (restart runs it again on the same data dir).
    cmd: (PathBuf, Vec<std::ffi::OsString>),
    /// Client URL, `http://127.0.0.1:PORT`.
    pub client_url: String,
    /// Client port.
    pub client_port: u16,
    /// Where `/health` answers over plain HTTP (the client URL, or for a TLS etcd its
    /// `--listen-metrics-urls`).
    health_url: String,
}

/// A throw-away PKI made with `openssl` for a TLS etcd on 127.0.0.1: a CA, etcd's serving
/// certificate (IP SAN 127.0.0.1), a client certificate (CN `lockd`) signed by the same CA,
/// and a second CA that signed nothing (for the "wrong CA" case). ECDSA P-256, valid 1 day.
pub struct TestPki {
    /// The CA's certificate.
    pub ca: PathBuf,
    /// etcd's serving certificate and key.
    pub server_cert: PathBuf,
    /// etcd's serving key.
    pub server_key: PathBuf,
    /// The client certificate.
    pub client_cert: PathBuf,
    /// The client key.
    pub client_key: PathBuf,
    /// A CA that did not sign etcd's certificate.
    pub other_ca: PathBuf,
}

impl TestPki {
    /// Makes the files under `dir`. Err (with the reason) when `openssl` is missing or fails.
    pub fn make(dir: &Path) -> Result<TestPki, String> {
        let openssl =
            find_on_path("openssl").ok_or("no openssl binary (apt-get install openssl)")?;
        let run = |args: &[&str]| -> Result<(), String> {
            let out = Command::new(&openssl)
                .args(args)
                .current_dir(dir)
                .output()
                .map_err(|e| format!("openssl: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "openssl {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for ca in ["ca", "other-ca"] {
            let (key, crt, subj) = (
                format!("{ca}.key"),
                format!("{ca}.crt"),
                format!("/CN=test {ca}"),
            );
            let mut a = vec![
                "req", "-x509", "-days", "1", "-subj", &subj, "-keyout", &key, "-out", &crt,
            ];
            a.extend(ec);
            a.extend([
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign",
            ]);
            run(&a)?;
        }
        for (name, cn, ext) in [
            ("server", "etcd", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature"),
            ("client", "lockd", "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature"),
        ] {
            let (key, csr, crt, extf) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.crt"),
                format!("{name}.ext"),
            );
            std::fs::write(dir.join(&extf), ext)
                .map_err(|e| format!("{extf}: {e}"))?;
            let subj = format!("/CN={cn}");
            let mut a = vec!["req", "-subj", &subj, "-keyout", &key, "-out", &csr];
            a.extend(ec);
            run(&a)?;
            run(&[
                "x509", "-req", "-in", &csr, "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "1", "-out", &crt, "-extfile", &extf,
            ])?;
        }
        Ok(TestPki {
            ca: dir.join("ca.crt"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
            other_ca: dir.join("other-ca.crt"),
        })
    }
}

impl Etcd {
    /// Start etcd with its data under `dir` and wait (bounded, 20 s) until it is healthy.
    /// None when there is no etcd binary (the caller records a skip); panics if it does not
    /// come up.
    pub fn start(dir: &Path) -> Option<Etcd> {
        let mut v = Etcd::start_cluster(dir, 1)?;
        v.pop()
    }

    /// Start an etcd cluster of `n` members on loopback (data under `dir/etcd-N`) and wait
    /// (bounded, 30 s) until every member is healthy (has a leader). None without an etcd
    /// binary; panics if it does not come up.
    pub fn start_cluster(dir: &Path, n: usize) -> Option<Vec<Etcd>> {
        Etcd::start_cluster_on(dir, n, std::net::Ipv4Addr::LOCALHOST, &[])
    }

    /// [`start_cluster`](Self::start_cluster) on `host` (a local address: loopback or a
    /// bridge's), with `extra` etcd flags (e.g. `--heartbeat-interval`). Ports are picked free
    /// on loopback, which no process of this machine binds on every address in practice.
    pub fn start_cluster_on(
        dir: &Path,
        n: usize,
        host: std::net::Ipv4Addr,
        extra: &[&str],
    ) -> Option<Vec<Etcd>> {
        let bin = binary()?;
        let ports: Vec<(u16, u16)> = (0..n)
            .map(|_| (crate::net::free_port(), crate::net::free_port()))
            .collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, p))| format!("e{i}=http://{host}:{p}"))
            .collect();
        let initial = initial.join(",");
        let mut members = Vec::new();
        for (i, (client_port, peer_port)) in ports.iter().enumerate() {
            let client_url = format!("http://{host}:{client_port}");
            let peer_url = format!("http://{host}:{peer_port}");
            let mut cmd = Command::new(&bin);
            cmd.args(["--name", &format!("e{i}"), "--data-dir"])
                .arg(dir.join(format!("etcd-{i}")))
                .args([
                    "--listen-client-urls",
                    &client_url,
                    "--advertise-client-urls",
                    &client_url,
                    "--listen-peer-urls",
                    &peer_url,
                    "--initial-advertise-peer-urls",
                    &peer_url,
                    "--initial-cluster",
                    &initial,
                    "--initial-cluster-state",
                    "new",
                    "--log-level",
                    "warn",
                ])
                .args(extra);
            // Debian's etcd 3.4 on arm64 needs this; harmless elsewhere.
            cmd.env("ETCD_UNSUPPORTED_ARCH", go_arch());
            let args = cmd.get_args().map(|a| a.to_os_string()).collect();
            let proc = Proc::spawn(&format!("etcd-{i}"), cmd, dir.join(format!("etcd-{i}.log")));
            members.push(Etcd {
                proc,
                cmd: (bin.clone(), args),
                health_url: client_url.clone(),
                client_url,
                client_port: *client_port,
            });
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for e in members.iter_mut() {
            loop {
                if e.healthy() {
                    break;
                }
                assert!(
                    !e.proc.exited(),
                    "etcd exited at start: {}",
                    e.proc.log_text()
                );
                assert!(
                    Instant::now() < deadline,
                    "etcd not healthy within 30 s: {}",
                    e.proc.log_text()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(members)
    }

    /// One etcd member serving clients over TLS only (`https://127.0.0.1:PORT`, its serving
    /// certificate from `pki`), requiring a client certificate signed by `pki`'s CA
    /// (`--client-cert-auth`); `/health` on a plain-HTTP metrics port. Waits (20 s) until
    /// healthy. None without an etcd binary; panics if it does not come up.
    pub fn start_tls(dir: &Path, pki: &TestPki) -> Option<Etcd> {
        let bin = binary()?;
        let (client_port, peer_port, metrics_port) = (
            crate::net::free_port(),
            crate::net::free_port(),
            crate::net::free_port(),
        );
        let client_url = format!("https://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let health_url = format!("http://127.0.0.1:{metrics_port}");
        let mut cmd = Command::new(&bin);
        cmd.args(["--name", "tls0", "--data-dir"])
            .arg(dir.join("etcd-tls"))
            .args([
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("tls0={peer_url}")])
            .args(["--listen-metrics-urls", &health_url, "--log-level", "warn"])
            .arg("--cert-file")
            .arg(&pki.server_cert)
            .arg("--key-file")
            .arg(&pki.server_key)
            .arg("--trusted-ca-file")
            .arg(&pki.ca)
            .arg("--client-cert-auth");
        cmd.env("ETCD_UNSUPPORTED_ARCH", go_arch());
        let args = cmd.get_args().map(|a| a.to_os_string()).collect();
        let proc = Proc::spawn("etcd-tls", cmd, dir.join("etcd-tls.log"));
        let mut e = Etcd {
            proc,
            cmd: (bin, args),
            client_url,
            client_port,
            health_url,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !e.healthy() {
            assert!(
                !e.proc.exited(),
                "etcd (TLS) exited at start: {}",
                e.proc.log_text()
            );
            assert!(
                Instant::now() < deadline,
                "etcd (TLS) not healthy within 20 s: {}",
                e.proc.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(e)
    }

    /// `/health` answers `"health":"true"` (the member has a leader).
    pub fn healthy(&self) -> bool {
        crate::http::get(
            &format!("{}/health", self.health_url),
            Duration::from_millis(500),
        )
        .is_some_and(|r| r.body.contains("\"health\":\"true\""))
    }

    /// Whether this member is the cluster's leader now (its maintenance status says so);
    /// None when it does not answer.
    pub fn is_leader(&self) -> Option<bool> {
        let v = self.status()?;
        let me = v["header"]["member_id"].as_str()?.to_string();
        let leader = v["leader"].as_str()?.to_string();
        Some(me == leader)
    }

    /// This member's id (as in lockd's `member=…` log fields, there in hex); None when it
    /// does not answer.
    pub fn member_id(&self) -> Option<u64> {
        // The JSON gateway writes 64-bit integers as decimal strings.
        self.status()?["header"]["member_id"].as_str()?.parse().ok()
    }

    /// Its maintenance status (etcd's gRPC gateway).
    fn status(&self) -> Option<serde_json::Value> {
        let r = crate::http::post_json(
            &format!("{}/v3/maintenance/status", self.client_url),
            "{}",
            Duration::from_millis(500),
        )?;
        serde_json::from_str(&r.body).ok()
    }

    /// Kill this member (SIGKILL to its process group) and reap it.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Its process (signals, log).
    pub fn proc(&self) -> &Proc {
        &self.proc
    }

    /// Start it again on its data dir (after [`kill`](Self::kill)): it rejoins its cluster
    /// (etcd ignores the `--initial-cluster` flags once its data dir has a WAL). Its log is
    /// appended to. Does not wait for health (see [`healthy`](Self::healthy)).
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.proc.kill();
        let mut cmd = Command::new(&self.cmd.0);
        cmd.args(&self.cmd.1)
            .env("ETCD_UNSUPPORTED_ARCH", go_arch());
        self.proc = Proc::try_spawn_appending(&self.proc.name, cmd, self.proc.log.clone())?;
        Ok(())
    }

    /// SIGSTOP: the member is frozen (its sockets stay open, nothing answers); false if it is
    /// not running.
    pub fn pause(&self) -> bool {
        self.proc.signal(nix::sys::signal::Signal::SIGSTOP)
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) -> bool {
        self.proc.signal(nix::sys::signal::Signal::SIGCONT)
    }

    /// The index of the cluster's leader among `members`, as the members that answer say
    /// (None while none claims to be leader).
    pub fn leader_of(members: &[Etcd]) -> Option<usize> {
        members.iter().position(|m| m.is_leader() == Some(true))
    }
}

/// A TCP proxy on a free loopback port to `target`. While [`Proxy::blackhole`] is on, it
/// forwards nothing in either direction and lets new connections hang (no reset, no FIN):
/// what a partition looks like to the client. [`Proxy::heal`] forwards again.
pub struct Proxy {
    /// The port clients connect to.
    pub port: u16,
    cut: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    /// Start forwarding `127.0.0.1:port → target`.
    pub fn start(target: std::net::SocketAddr) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = l.local_addr().expect("proxy address").port();
        let cut = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (c2, s2, k2) = (cut.clone(), stop.clone(), conns.clone());
        std::thread::spawn(move || {
            for inbound in l.incoming() {
                if s2.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(inbound) = inbound else { continue };
                let Ok(outbound) = TcpStream::connect_timeout(&target, Duration::from_secs(2))
                else {
                    continue;
                };
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                if let (Ok(a), Ok(b)) = (inbound.try_clone(), outbound.try_clone()) {
                    if let Ok(mut g) = k2.lock() {
                        g.push(a);
                        g.push(b);
                    }
                }
                for (from, to) in [
                    (inbound.try_clone(), outbound.try_clone()),
                    (outbound.try_clone(), inbound.try_clone()),
                ] {
                    let (Ok(mut from), Ok(mut to)) = (from, to) else {
                        continue;
                    };
                    let cut = c2.clone();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 * 1024];
                        loop {
                            let n = match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            // Cut: the bytes are dropped, as a partition drops packets
                            // (both ends keep their connection and hear nothing).
                            while cut.load(Ordering::SeqCst) {
                                std::thread::sleep(Duration::from_millis(5));
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Write);
                    });
                }
            }
        });
        Proxy {
            port,
            cut,
            stop,
            conns,
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stop forwarding (bytes in flight are held back until [`heal`](Self::heal)).
    pub fn blackhole(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }

    /// Forward again.
    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.cut.store(false, Ordering::SeqCst);
        if let Ok(g) = self.conns.lock() {
            for c in g.iter() {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
        // Wake the accept loop so that it sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A paused member does not answer, a resumed one does; a killed one restarts on its data
    /// and rejoins (here: a single member, its data kept). Skips without an etcd binary.
    #[test]
    fn a_member_pauses_resumes_and_restarts_on_its_data() {
        let dir = tempfile::tempdir().unwrap();
        let Some(mut e) = Etcd::start(dir.path()) else {
            crate::skip::skip("etcd::a_member_pauses", "no etcd binary");
            return;
        };
        assert!(e.pause());
        assert!(!e.healthy(), "a paused etcd answered");
        assert!(e.resume());
        assert!(crate::wait_until(
            Duration::from_secs(10),
            Duration::from_millis(50),
            || e.healthy()
        ));
        assert_eq!(Etcd::leader_of(std::slice::from_ref(&e)), Some(0));
        e.kill();
        assert!(!e.healthy());
        e.restart().unwrap();
        assert!(
            crate::wait_until(Duration::from_secs(20), Duration::from_millis(50), || e
                .healthy()),
            "not healthy after the restart: {}",
            e.proc().log_text()
        );
    }
}
