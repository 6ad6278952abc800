//! Network namespaces as "nodes" on one machine: a bridge in the root namespace, one namespace
//! per node joined to it by a veth pair, processes started inside a node's namespace, a node
//! partitioned from the bridge (its bridge port set down: its packets are dropped, no reset,
//! no FIN, as a real partition) and healed.
//!
//! Names are unique per run (a random tag checked against the interfaces and namespaces that
//! exist), so parallel tests do not collide; the subnet `10.213.X.0/24` is one no interface of
//! the machine uses. Everything is deleted on drop (also when a test panics): the namespaces
//! (which deletes their veth ends and so the pairs) and the bridge. Every `ip` call is bounded.
//! Needs root and iproute2's `ip`; [`Net::create`] says why it cannot run otherwise, for the
//! caller's skip.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Why the namespaces could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// This machine cannot create network namespaces here (not root, no `ip`, no
    /// permission): the caller skips.
    #[error("cannot create network namespaces: {0}")]
    Unsupported(String),
    /// An `ip` command failed.
    #[error("`ip {args}` failed: {stderr}")]
    Ip {
        /// Its arguments.
        args: String,
        /// What it printed.
        stderr: String,
    },
}

/// The bound on one `ip` command.
const IP_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `ip ARGS` (bounded by [`IP_TIMEOUT`]); its stdout or the error.
pub fn ip(args: &[&str]) -> Result<String, NetnsError> {
    let err = |stderr: String| NetnsError::Ip {
        args: args.join(" "),
        stderr,
    };
    let mut child = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| err(e.to_string()))?;
    let end = Instant::now() + IP_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(2)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(err(format!("no answer within {IP_TIMEOUT:?}")));
            }
            Err(e) => return Err(err(e.to_string())),
        }
    }
    let out = child.wait_with_output().map_err(|e| err(e.to_string()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(err(String::from_utf8_lossy(&out.stderr).trim().to_string()))
    }
}

/// Whether this process can create network namespaces; the reason when it cannot.
pub fn supported() -> Result<(), NetnsError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(NetnsError::Unsupported("not root".into()));
    }
    if !Path::new("/usr/sbin/ip").is_file()
        && !Path::new("/sbin/ip").is_file()
        && !Path::new("/usr/bin/ip").is_file()
    {
        return Err(NetnsError::Unsupported("no `ip` (iproute2)".into()));
    }
    ip(&["netns", "list"]).map_err(|e| NetnsError::Unsupported(e.to_string()))?;
    Ok(())
}

/// One node: a namespace with one veth end (`eth0`-like, its address on the bridge's subnet)
/// and loopback up; the other end is a port of the bridge.
#[derive(Debug, Clone)]
pub struct NetNode {
    /// The namespace's name (`ip netns exec NAME`).
    pub ns: String,
    /// The bridge-side veth end (root namespace): set down to partition the node.
    pub host_if: String,
    /// The node's address on the bridge.
    pub addr: Ipv4Addr,
}

/// A bridge and its nodes; deleted on drop.
#[derive(Debug)]
pub struct Net {
    /// The bridge (root namespace).
    pub bridge: String,
    /// The bridge's address: processes in the root namespace (etcd members) bind it.
    pub host_addr: Ipv4Addr,
    /// The nodes.
    pub nodes: Vec<NetNode>,
    /// Everything created so far, deleted on drop (namespaces, then links).
    created_ns: Vec<String>,
    created_links: Vec<String>,
}

fn random_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as u32
}

impl Net {
    /// A bridge with `n` nodes. Unsupported when this machine cannot create namespaces (the
    /// caller skips); whatever was created before a failure is deleted.
    pub fn create(n: usize) -> Result<Net, NetnsError> {
        supported()?;
        let links = ip(&["-o", "link", "show"])?;
        let nss = ip(&["netns", "list"])?;
        let addrs = ip(&["-o", "-4", "addr", "show"])?;
        // A tag no existing interface or namespace uses; a /24 no interface is on.
        let (tag, third) = (0..64)
            .map(|_| {
                let r = random_u32();
                (format!("{:05x}", r & 0xfffff), ((r >> 20) % 250 + 2) as u8)
            })
            .find(|(tag, third)| {
                !links.contains(&format!("fo{tag}"))
                    && !nss.contains(&format!("fo{tag}"))
                    && !addrs.contains(&format!("10.213.{third}."))
            })
            .ok_or_else(|| NetnsError::Unsupported("no free name or subnet".into()))?;
        let mut net = Net {
            bridge: format!("fo{tag}br"),
            host_addr: Ipv4Addr::new(10, 213, third, 1),
            nodes: Vec::new(),
            created_ns: Vec::new(),
            created_links: Vec::new(),
        };
        net.setup(&tag, third, n)?;
        Ok(net)
    }

    fn setup(&mut self, tag: &str, third: u8, n: usize) -> Result<(), NetnsError> {
        let br = self.bridge.clone();
        ip(&["link", "add", &br, "type", "bridge"])?;
        self.created_links.push(br.clone());
        ip(&["addr", "add", &format!("{}/24", self.host_addr), "dev", &br])?;
        ip(&["link", "set", &br, "up"])?;
        for i in 0..n {
            let ns = format!("fo{tag}n{i}");
            let host_if = format!("fo{tag}h{i}");
            let ns_if = format!("fo{tag}v{i}");
            let addr = Ipv4Addr::new(10, 213, third, 10 + i as u8);
            ip(&["netns", "add", &ns])?;
            self.created_ns.push(ns.clone());
            ip(&[
                "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
            ])?;
            self.created_links.push(host_if.clone());
            ip(&["link", "set", &ns_if, "netns", &ns])?;
            ip(&["link", "set", &host_if, "master", &br])?;
            ip(&["link", "set", &host_if, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                &ns_if,
            ])?;
            ip(&["-n", &ns, "link", "set", &ns_if, "up"])?;
            self.nodes.push(NetNode { ns, host_if, addr });
        }
        Ok(())
    }

    /// `ip netns exec NS PROGRAM`: a command that runs `program` inside node `i`'s namespace
    /// (`ip` execs it: the pid is the program's).
    pub fn command_in(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.nodes[i].ns]).arg(program);
        c
    }

    /// Cut node `i` off the bridge: its bridge port goes down, so every packet to or from it
    /// is dropped (its own link loses carrier; its sockets see nothing, no reset).
    pub fn partition(&self, i: usize) -> Result<(), NetnsError> {
        ip(&["link", "set", &self.nodes[i].host_if, "down"]).map(|_| ())
    }

    /// Put node `i` back on the bridge.
    pub fn heal(&self, i: usize) -> Result<(), NetnsError> {
        ip(&["link", "set", &self.nodes[i].host_if, "up"]).map(|_| ())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes its veth end, which deletes the pair; processes still
        // in it keep it alive until they exit (callers kill theirs first).
        for ns in self.created_ns.drain(..).rev() {
            let _ = ip(&["netns", "delete", &ns]);
        }
        for l in self.created_links.drain(..).rev() {
            if ip(&["link", "show", &l]).is_ok() {
                let _ = ip(&["link", "delete", &l]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two nodes reach each other and the bridge; a partitioned node reaches nothing, a healed
    /// one again; everything is gone after drop. Skips when namespaces cannot be created.
    #[test]
    fn nodes_reach_the_bridge_until_partitioned_and_everything_is_deleted() {
        let net = match Net::create(2) {
            Ok(n) => n,
            Err(NetnsError::Unsupported(why)) => {
                crate::skip::skip("netns::nodes_reach_the_bridge", &why);
                return;
            }
            Err(e) => panic!("{e}"),
        };
        // A listener on the bridge's address (root namespace); a node connects with bash's
        // /dev/tcp, bounded by `timeout`.
        let l = std::net::TcpListener::bind((net.host_addr, 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        let reach = |i: usize| {
            net.command_in(i, "timeout")
                .args(["2", "bash", "-c"])
                .arg(format!("exec 3<>/dev/tcp/{}/{port}", net.host_addr))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        assert!(reach(0) && reach(1));
        net.partition(0).unwrap();
        assert!(!reach(0), "a partitioned node reached the bridge");
        assert!(reach(1));
        net.heal(0).unwrap();
        assert!(crate::wait_until(
            Duration::from_secs(10),
            Duration::from_millis(50),
            || reach(0)
        ));
        let (br, ns) = (net.bridge.clone(), net.nodes[0].ns.clone());
        assert!(ip(&["link", "show", &br]).is_ok());
        drop(net);
        assert!(ip(&["link", "show", &br]).is_err(), "bridge left behind");
        assert!(
            !ip(&["netns", "list"]).unwrap().contains(&ns),
            "namespace left behind"
        );
    }
}
