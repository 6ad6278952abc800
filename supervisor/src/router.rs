//! What the pod's router should do with this engine, and how that is said to HAProxy's runtime
//! API. Pure: the phase goes in, command lines come out; the driver (`driver/router.rs`) owns
//! the socket.
//!
//! Every engine appears twice in the router's backend (deploy/chart router-configmap.yaml):
//!
//! * `engine-N`: a normal server. In rotation only while this engine is **Active**.
//! * `engine-N-standby`: a `backup` server on the same port. In rotation while this engine is a
//!   shadow that can take over (**Standby**, **Waking**). HAProxy uses a backup server only
//!   when no normal server is usable, i.e. exactly in the window between the old Active being
//!   taken out and the new one being put in. A request sent there waits at the sleeping engine
//!   (vLLM and SGLang hold requests while asleep/paused; fake-engine models it) until it has
//!   woken, instead of failing with "no server available".
//!
//! In Init and Dead both are out (`maint`). The supervisor re-sends its state periodically, so a
//! restarted router converges within one resync interval; the router's own health checks on
//! `engine-N` (`/ready`) stay as the backstop for a supervisor that died without a word.
//!
//! Commands (HAProxy management guide, "set server"; the same in 2.6 and 3.2):
//! `set server <backend>/<server> state ready|maint` (administrative state) and
//! `set server <backend>/<server> health up` (forces the check result, so that a server that
//! just became Active is used now, not after `rise` successful checks).

use std::fmt;

use probes::Phase;

/// Where this engine belongs in the router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Active: the normal server in, the backup server out.
    Serving,
    /// A shadow that can take over (Standby, Waking): the normal server out, the backup in.
    Standing,
    /// Init, Dead: both out.
    Out,
}

impl Target {
    /// The target for a phase.
    pub fn for_phase(phase: Phase) -> Target {
        match phase {
            Phase::Active => Target::Serving,
            Phase::Standby | Phase::Waking => Target::Standing,
            Phase::Init | Phase::Dead => Target::Out,
        }
    }

    /// Label for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Target::Serving => "serving",
            Target::Standing => "standing",
            Target::Out => "out",
        }
    }
}

/// `BACKEND/SERVER` as HAProxy names a server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerName {
    /// The backend (`engines` in the chart).
    pub backend: String,
    /// The server within it.
    pub server: String,
}

impl ServerName {
    /// Parse `BACKEND/SERVER` (HAProxy identifiers: letters, digits, `-_.:`).
    pub fn parse(s: &str) -> Result<ServerName, String> {
        let ok = |p: &str| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
        };
        match s.split_once('/') {
            Some((b, srv)) if ok(b) && ok(srv) => Ok(ServerName {
                backend: b.to_string(),
                server: srv.to_string(),
            }),
            _ => Err(format!(
                "{s:?} is not BACKEND/SERVER (e.g. engines/engine-0; letters, digits, -_.:)"
            )),
        }
    }

    /// The backup twin's name: `SERVER-standby` in the same backend.
    pub fn standby_twin(&self) -> ServerName {
        ServerName {
            backend: self.backend.clone(),
            server: format!("{}-standby", self.server),
        }
    }
}

impl fmt::Display for ServerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.backend, self.server)
    }
}

/// This engine's two servers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Servers {
    /// In rotation while Active.
    pub serving: ServerName,
    /// In rotation (as a backup) while a shadow that can take over.
    pub standby: ServerName,
}

impl Servers {
    /// The runtime-API line that puts the router in line with `target`. `edge` is true when
    /// the target just changed (as opposed to a periodic resync): only then is the serving
    /// server's health forced up, so that a resync never overrides a health check that has
    /// since marked a serving engine down.
    pub fn commands(&self, target: Target, edge: bool) -> String {
        let (s, b) = (&self.serving, &self.standby);
        match target {
            // The new server in first, then the backup out: never a moment with neither.
            Target::Serving if edge => format!(
                "set server {s} state ready; set server {s} health up; set server {b} state maint"
            ),
            Target::Serving => format!("set server {s} state ready; set server {b} state maint"),
            Target::Standing => format!("set server {b} state ready; set server {s} state maint"),
            Target::Out => format!("set server {s} state maint; set server {b} state maint"),
        }
    }
}

/// Check HAProxy's answer to a line of `set server` commands: each successful command prints
/// nothing (blank lines only); anything else is an error message ("No such server.",
/// "Permission denied", "Unknown command", ...), returned as one line.
pub fn check_response(response: &str) -> Result<(), String> {
    let text: Vec<&str> = response
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    if text.is_empty() {
        Ok(())
    } else {
        Err(text.join(" | "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn servers() -> Servers {
        let s = ServerName::parse("engines/engine-0").unwrap();
        Servers {
            standby: s.standby_twin(),
            serving: s,
        }
    }

    #[test]
    fn every_phase_has_one_target() {
        use Phase::*;
        let got: Vec<_> = [Init, Standby, Waking, Active, Dead]
            .into_iter()
            .map(Target::for_phase)
            .collect();
        assert_eq!(
            got,
            [
                Target::Out,
                Target::Standing,
                Target::Standing,
                Target::Serving,
                Target::Out
            ]
        );
    }

    #[test]
    fn commands_per_target() {
        let s = servers();
        assert_eq!(
            s.commands(Target::Serving, true),
            "set server engines/engine-0 state ready; set server engines/engine-0 health up; \
             set server engines/engine-0-standby state maint"
        );
        // A resync does not force the health: the router's check stays the backstop.
        assert!(!s.commands(Target::Serving, false).contains("health"));
        assert_eq!(
            s.commands(Target::Standing, true),
            "set server engines/engine-0-standby state ready; set server engines/engine-0 state maint"
        );
        assert_eq!(
            s.commands(Target::Standing, true),
            s.commands(Target::Standing, false)
        );
        assert_eq!(
            s.commands(Target::Out, false),
            "set server engines/engine-0 state maint; set server engines/engine-0-standby state maint"
        );
    }

    #[test]
    fn names_are_checked() {
        assert!(ServerName::parse("engines/engine-0").is_ok());
        for bad in [
            "engine-0",
            "/x",
            "x/",
            "a/b c",
            "a/b;c",
            "a/b\nshutdown",
            "",
        ] {
            assert!(ServerName::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            ServerName::parse("b/s").unwrap().standby_twin().to_string(),
            "b/s-standby"
        );
    }

    #[test]
    fn responses() {
        assert_eq!(check_response(""), Ok(()));
        assert_eq!(check_response("\n\n\n"), Ok(()));
        assert_eq!(
            check_response("No such server.\n\n"),
            Err("No such server.".into())
        );
        assert_eq!(
            check_response("\nPermission denied\nUnknown command\n"),
            Err("Permission denied | Unknown command".into())
        );
    }
}
