//! One trial: the failure injected on the holder's node (or on etcd), what happened, the
//! repair (heal, restart what was killed, the fenced side back as a shadow).

use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use nix::sys::signal::Signal;
use probes::Phase;

use super::chaos::Chaos;
use super::judge::{judge, Limits, Observed, Trial};
use super::watch::{DeathWatch, KeyWatch};
use super::world::{World, KEY_PREFIX};
use crate::procs::now_us;

/// Runs trial `round` of `kind` with `holder` Active; the judged trial.
pub fn run(w: &mut World, round: usize, kind: Chaos, holder: usize) -> Result<Trial> {
    let ttl = w.cfg.ttl;
    let side = w.nodes[holder]
        .side
        .as_ref()
        .ok_or_else(|| anyhow!("holder {holder} has no side"))?;
    if !side.serve_one() {
        return Err(anyhow!("the holder's engine (node {holder}) did not serve"));
    }
    let pids = side.engine_pids();
    if pids.is_empty() {
        return Err(anyhow!("holder {holder}'s engine has no live process"));
    }
    let key = w
        .owner_key()
        .ok_or_else(|| anyhow!("no owner key under {KEY_PREFIX} (etcdctl?)"))?;
    // One watch per member (each pinned to its endpoint), the earliest deletion counts: a
    // watch on a paused or killed member would report it late (a later deletion time only
    // makes the margin look larger; with three, one is always on a live member).
    let mut keys = Vec::new();
    for (m, url) in w.etcd_url_list().into_iter().enumerate() {
        let marker = format!("/lockd.drill/marker-{round}-{m}");
        let put = w.etcdctl().map(|mut c| {
            c.args(["put", &marker, "x"]);
            c
        });
        let watch = w.etcdctl_at(&url).and_then(|c| {
            KeyWatch::start(c, "/lockd", &marker, move || {
                put.and_then(|mut c| c.output().ok())
                    .is_some_and(|o| o.status.success())
            })
        });
        keys.push(watch.ok_or_else(|| anyhow!("etcd watch on {url} not established"))?);
    }
    let bound = ttl * 3 + Duration::from_secs(10);
    let death = DeathWatch::start(pids.clone(), bound + Duration::from_secs(10));
    let leader = super::leader(w)?;
    // The etcd member the kind acts on: the leader, or for a follower pause the holder's
    // lockd's first endpoint (its keepalive streams' member) unless that one leads.
    let (target, target_note) = match kind {
        Chaos::FollowerPause => {
            let first = w.first_endpoint_of(holder);
            let (f, why) = if first == leader {
                ((leader + 1) % w.etcd.len(), "leads")
            } else {
                (first, "paused")
            };
            // The listed first endpoint; its streams may have moved off it in an earlier trial.
            let note = format!(
                "paused etcd member {f}; n{holder}'s first endpoint (member {first}) {why}"
            );
            (f, Some(note))
        }
        _ => (leader, None),
    };

    let injected_us = now_us();
    let mut o = Observed {
        injected_us,
        ..Observed::default()
    };
    match kind {
        Chaos::EngineKill => {
            // The engine's main process is the first line of its pid file.
            if let Some(p) = pids.first() {
                p.signal(Signal::SIGKILL);
            }
        }
        Chaos::SupervisorKill => {
            if let Some(s) = w.nodes[holder].side.as_ref() {
                s.proc.signal(Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(100));
            for p in &pids {
                p.signal(Signal::SIGKILL);
            }
        }
        Chaos::LockdKill => {
            if let Some(p) = w.nodes[holder].lockd.as_mut() {
                p.kill();
            }
        }
        Chaos::LockdStop => {
            if let Some(p) = w.nodes[holder].lockd.as_ref() {
                p.signal(Signal::SIGSTOP);
            }
        }
        Chaos::Partition => w.net.partition(holder)?,
        Chaos::LeaderKill => w.etcd[target].kill(),
        Chaos::MemberPause | Chaos::FollowerPause => {
            w.etcd[target].pause();
        }
    }

    if kind.fails_over() {
        // Another node's grant: its supervisor leaves Standby (polled; the time is its own
        // `/state` transition). The partitioned or frozen holder is not asked.
        let end = Instant::now() + bound;
        while o.granted_us.is_none() && Instant::now() < end {
            for i in (0..w.nodes.len()).filter(|i| *i != holder) {
                let Some(side) = w.nodes[i].side.as_ref() else {
                    continue;
                };
                // From `/state`, or, for a supervisor that was granted and exited between two
                // polls (its wake failed), from its log.
                let at = match side.state() {
                    Some(st) => st
                        .transitions
                        .iter()
                        .filter(|t| matches!(t.to, Phase::Waking | Phase::Active))
                        .filter_map(|t| u64::try_from(t.at_unix_us).ok())
                        .find(|at| *at >= injected_us),
                    None => logged_waking(&side.proc.log_text(), injected_us),
                };
                if let Some(at) = at {
                    o.granted_us = Some(at);
                    o.new_holder = Some(i);
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        harness::wait_until(Duration::from_secs(10), Duration::from_millis(5), || {
            death.dead_us().is_some()
        });
    } else {
        // The lease must survive the failure and the recovery: 1.5 TTL with the member
        // down or frozen, then the repair, then 1.5 TTL more (a resumed leader's stale view
        // of the leases is the dangerous moment). The holder must stay Active, nobody else
        // leave Standby, its key stay.
        let half = ttl + ttl / 2;
        watch_quiet(w, holder, half, &mut o);
        restore_etcd(w, kind, target)?;
        watch_quiet(w, holder, half, &mut o);
        if !w.wait_etcd_healthy(Duration::from_secs(30)) {
            return Err(anyhow!("etcd not healthy 30 s after the repair"));
        }
    }
    // A deletion seen up to here counts (the watch's own delay is milliseconds).
    std::thread::sleep(Duration::from_millis(100));
    o.engine_dead_us = death.dead_us();
    o.holder_left = w.nodes[holder]
        .side
        .as_ref()
        .and_then(|s| logged_leaving_active(&s.proc.log_text(), injected_us));
    o.key_deleted_us = keys.iter().filter_map(|k| k.deleted_us(&key)).min();
    // The holder's lock key is named after its session's etcd lease (`PREFIX/RESOURCE/LEASE`).
    o.holder_released_us = key.rsplit('/').next().and_then(|lease| {
        let log = std::fs::read_to_string(w.nodes[holder].dir.join("lockd.log")).ok()?;
        logged_release(&log, lease, injected_us)
    });
    let mut claims = w.claim_violations();
    let now = claims.len();
    o.claim_violations = claims.split_off(w.claims_seen.min(now));
    w.claims_seen = now;
    drop(keys);
    let lost = o.new_holder.is_some() || o.holder_left_active || o.engine_dead_us.is_some();
    repair(w, kind, holder, kind.fails_over() || lost)?;
    let mut t = judge(
        round,
        kind,
        holder,
        o,
        &Limits::new(
            w.cfg.ttl.as_secs_f64() * 1e3,
            w.cfg.drift_ppm,
            w.cfg.kill_time.as_secs_f64() * 1e3,
            w.leader_change_fences,
        ),
    );
    t.notes.extend(target_note);
    Ok(t)
}

/// Undo the failure: etcd member back, node healed, lockd running, the fenced side (if it
/// left) replaced by a shadow (not waited for: the next trial's steady state waits).
fn repair(w: &mut World, kind: Chaos, holder: usize, holder_fenced: bool) -> Result<()> {
    match kind {
        Chaos::Partition => w.net.heal(holder)?,
        Chaos::LockdKill => w.start_lockd(holder)?,
        Chaos::LockdStop => {
            if let Some(p) = w.nodes[holder].lockd.as_ref() {
                p.signal(Signal::SIGCONT);
            }
        }
        // Restored inside the trial's window.
        Chaos::LeaderKill | Chaos::MemberPause | Chaos::FollowerPause => {}
        Chaos::EngineKill | Chaos::SupervisorKill => {}
    }
    if holder_fenced {
        // The fenced supervisor exits (`--restart never`); one still running 10 s on is torn
        // down (its trial already says whether it fenced in time).
        if let Some(s) = w.nodes[holder].side.as_mut() {
            s.proc.wait_exit(Duration::from_secs(10));
        }
        w.start_side(holder, "shadow")?;
    }
    Ok(())
}

/// The etcd member of a no-failover kind back: restarted on its data, or SIGCONT.
fn restore_etcd(w: &mut World, kind: Chaos, member: usize) -> Result<()> {
    match kind {
        Chaos::LeaderKill => w.etcd[member].restart()?,
        Chaos::MemberPause | Chaos::FollowerPause => {
            w.etcd[member].resume();
        }
        _ => {}
    }
    Ok(())
}

/// For `limit`: the holder must stay Active and every other node out of Waking/Active;
/// what is seen otherwise goes into `o`.
fn watch_quiet(w: &World, holder: usize, limit: Duration, o: &mut Observed) {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        let ph = w.nodes[holder].side.as_ref().and_then(|s| s.phase());
        if ph.is_some_and(|p| p != Phase::Active) {
            o.holder_left_active = true;
        }
        for i in (0..w.nodes.len()).filter(|i| *i != holder) {
            if o.granted_us.is_some() {
                break;
            }
            // The time of its own transition out of Standby, as in a failover (a poll's time
            // would be up to 50 ms late).
            let at = w.nodes[i].side.as_ref().and_then(|s| {
                s.state()?
                    .transitions
                    .iter()
                    .filter(|t| matches!(t.to, Phase::Waking | Phase::Active))
                    .filter_map(|t| u64::try_from(t.at_unix_us).ok())
                    .find(|at| *at >= o.injected_us)
            });
            if let Some(at) = at {
                o.granted_us = Some(at);
                o.new_holder = Some(i);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The first `to="waking"` transition at or after `since_us` in a supervisor's log.
fn logged_waking(log: &str, since_us: u64) -> Option<u64> {
    log.lines()
        .filter(|l| l.contains("to=\"waking\""))
        .filter_map(|l| {
            let rest = &l[l.find("at_unix_us=")? + "at_unix_us=".len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .find(|at| *at >= since_us)
}

/// The first transition out of Active at or after `since_us` in a supervisor's log: its
/// time and its event (`transition … from="active" to="dead" event=Revoked("…") at_unix_us=…`).
fn logged_leaving_active(log: &str, since_us: u64) -> Option<(u64, String)> {
    log.lines()
        .filter(|l| l.contains(" transition ") && l.contains("from=\"active\""))
        .filter_map(|l| {
            let at_from = l.find(" at_unix_us=")?;
            let digits: String = l[at_from + " at_unix_us=".len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            let event = l[..at_from]
                .find("event=")
                .map(|e| l[e + "event=".len()..at_from].to_string())
                .unwrap_or_default();
            Some((digits.parse().ok()?, event))
        })
        .find(|(at, _)| *at >= since_us)
}

/// When lockd began the successful revoke of etcd lease `lease` (hex) at its session's end,
/// at or after `since_us`: its line `… session's etcd lease revoked session=… lease=LEASE
/// revoked=true took_us=T` is logged when the revoke returns, so the start is the line's
/// timestamp (RFC 3339, UTC, µs) less T.
fn logged_release(log: &str, lease: &str, since_us: u64) -> Option<u64> {
    let field = format!(" lease={lease} ");
    log.lines()
        .filter(|l| {
            l.contains("session's etcd lease revoked")
                && l.contains(&field)
                && l.contains(" revoked=true ")
        })
        .filter_map(|l| {
            let at = rfc3339_us(l.split_whitespace().next()?)?;
            let rest = &l[l.find(" took_us=")? + " took_us=".len()..];
            let took: u64 = rest
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .ok()?;
            at.checked_sub(took)
        })
        .find(|at| *at >= since_us)
}

/// `YYYY-MM-DDTHH:MM:SS.ffffffZ` (tracing's timestamps, UTC) → µs since the Unix epoch.
fn rfc3339_us(t: &str) -> Option<u64> {
    let t = t.strip_suffix('Z')?;
    let (date, time) = t.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut h = hms.splitn(3, ':').map(|x| x.parse::<i64>().ok());
    let (hh, mm, ss) = (h.next()??, h.next()??, h.next()??);
    // Days from the civil date (Howard Hinnant's algorithm).
    let yy = if m <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let digits: String = frac.chars().take(6).collect();
    let micros = digits.parse::<i64>().ok()? * 10_i64.pow(6 - digits.len() as u32);
    let secs = days * 86_400 + hh * 3_600 + mm * 60 + ss;
    u64::try_from(secs * 1_000_000 + micros).ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn lockds_release_of_the_holders_lease_is_found_with_its_start() {
        let log = "2026-11-26T17:41:34.723084Z  INFO lockd::etcd::server: session's etcd lease revoked session=2 lease=1290a218f2c18d08 revoked=true took_us=4157\n\
                   2026-11-26T17:41:35.000000Z  INFO lockd::etcd::server: session's etcd lease revoked session=3 lease=aaaa revoked=false took_us=3000000\n";
        // 2026-11-26T17:41:34.723084Z is 1_795_714_894.723084 s after the epoch.
        assert_eq!(
            super::rfc3339_us("2026-11-26T17:41:34.723084Z"),
            Some(1_795_714_894_723_084)
        );
        assert_eq!(super::rfc3339_us("1970-01-01T00:00:01.5Z"), Some(1_500_000));
        assert_eq!(super::rfc3339_us("not a time"), None);
        assert_eq!(
            super::logged_release(log, "1290a218f2c18d08", 0),
            Some(1_795_714_894_723_084 - 4157)
        );
        // A failed revoke (a partition) is no release; nor is one before the injection.
        assert_eq!(super::logged_release(log, "aaaa", 0), None);
        assert_eq!(
            super::logged_release(log, "1290a218f2c18d08", 1_795_714_895_000_000),
            None
        );
    }

    #[test]
    fn the_holders_move_out_of_active_is_found_with_its_event() {
        let log = "a transition engine_id=0 from=\"standby\" to=\"waking\" event=LockGranted at_unix_us=90\n\
                   b transition engine_id=0 from=\"active\" to=\"dead\" event=Revoked(\"lost: x\") at_unix_us=100\n\
                   c transition engine_id=0 from=\"active\" to=\"dead\" event=Revoked(\"lost: y\") at_unix_us=300\n";
        assert_eq!(
            super::logged_leaving_active(log, 200),
            Some((300, "Revoked(\"lost: y\")".to_string()))
        );
        assert_eq!(super::logged_leaving_active(log, 301), None);
    }

    #[test]
    fn a_logged_waking_transition_is_found_after_the_injection() {
        let log = "x transition from=\"standby\" to=\"waking\" event=LockGranted at_unix_us=100\n\
                   y transition from=\"standby\" to=\"waking\" event=LockGranted at_unix_us=250\n";
        assert_eq!(super::logged_waking(log, 200), Some(250));
        assert_eq!(super::logged_waking(log, 300), None);
    }
}
