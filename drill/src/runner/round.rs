//! One round: [`Drill::begin_round`] (victim, taker, what is known before), [`Drill::inject`]
//! (the failure), [`Drill::observe_round`] (until it has played out), [`Drill::judge`] (the
//! invariants) and [`Drill::measure`] (failover phases, marks, the record).

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use lockd::proto::{LeaseState, ResourceReport};
use nix::sys::signal::Signal;
use probes::{MarkKind, Phase};

use super::side::Inc;
use super::{Drill, RESOURCE};
use crate::invariants::{
    self, ClaimViolation, FinalActive, GrantObs, LifeObs, RoundObs, Violation,
};
use crate::observe;
use crate::procs::{self, now_us};
use crate::report::{CompoundRecord, RoundRecord};
use crate::schedule::{self, EngineConfig, FailureKind};

/// What one round knows, from its start to its record.
pub(super) struct Round {
    /// Round index (0-based).
    r: usize,
    /// The failure injected.
    kind: FailureKind,
    /// The Active side (the victim) and the Standby side (the taker).
    a: usize,
    /// See `a`.
    b: usize,
    /// The victim's life.
    victim_key: (u64, u32),
    /// The taker's life.
    taker_key: Option<(u64, u32)>,
    /// The victim engine's flags.
    victim_cfg: EngineConfig,
    /// The victim engine's main pid.
    victim_pid: Option<u32>,
    /// Kill to new Active bound.
    bound: Duration,
    /// lockd-crash rounds: the lease as lockd showed it before the crash.
    holder_before: Option<ResourceReport>,
    /// Lines in the claim violations file before the round.
    claim_before: usize,
    /// Newest epoch before the round.
    epoch_before: Option<u64>,
    /// Notes for the record.
    notes: Vec<String>,
    /// When the (last) failure was injected, wall clock µs.
    t_kill: u64,
    /// The same moment, monotonic.
    kill_at: Instant,
    /// Compound rounds' record.
    comp: Option<CompoundRecord>,
    /// When lockd was killed (compound kinds).
    lockd_killed_us: Option<u64>,
    /// When the restarted lockd accepted connections (compound kinds).
    lockd_back_us: Option<u64>,
    /// The engine expected Active at the end (lockd-crash-during-wake).
    expected_new_engine_id: Option<u64>,
    /// Whether the lease was reclaimed after a lockd restart (`None`: not checked).
    lease_reclaimed: Option<bool>,
    /// lockd crash: kill to lease held again, µs.
    recovery_us: Option<u64>,
    /// The victim's supervisor exited by itself (not torn down at the deadline).
    victim_self_exit: bool,
}

/// What judging a round produced, for its record.
pub(super) struct Judged {
    /// The life Active at the end.
    final_inc: Option<(u64, u32)>,
    /// Its details.
    final_active: Option<FinalActive>,
    /// The broken invariants.
    violations: Vec<Violation>,
    /// (pids checked, alive) at the first new grant.
    fence: Option<(usize, usize)>,
}

impl Drill {
    /// Runs round `r`: inject, observe, judge, measure.
    pub(super) async fn round(&mut self, r: usize) -> Result<RoundRecord> {
        let mut rd = self.begin_round(r).await?;
        self.inject(&mut rd).await?;
        self.observe_round(&mut rd).await;
        let judged = self.judge(&mut rd);
        Ok(self.measure(rd, judged))
    }

    /// Round `r` begins: who is the victim and the taker, what is known before the failure.
    async fn begin_round(&mut self, r: usize) -> Result<Round> {
        self.reap_finished();
        let kind = self.sched[r];
        let (a, b) = self
            .steady()
            .ok_or_else(|| anyhow!("not steady at round start"))?;
        let mut notes = Vec::new();
        let victim_key = self.sides[a]
            .as_ref()
            .map(Inc::key)
            .ok_or_else(|| anyhow!("no active"))?;
        let taker_key = self.sides[b].as_ref().map(Inc::key);
        let victim_cfg = self.sides[a].as_ref().map(|i| i.config).unwrap_or_default();
        if kind == FailureKind::DetachedWorker && !victim_cfg.detach_workers {
            notes.push("setup: the Active engine runs without --detach-workers".to_string());
        }
        // Refresh the victim's pids (and the fence) right before the kill.
        if let Some(i) = self.sides[a].as_mut() {
            let before = i.engine_pids.len();
            i.refresh_pids();
            self.all_pids
                .extend(i.engine_pids[before..].iter().copied());
        }
        self.identify_holder();
        let epoch_before = self
            .lease
            .last_epoch
            .or_else(|| self.sides[a].as_ref().and_then(|i| i.state.as_ref()?.epoch));
        let claim_before = self.claim_lines().len();
        self.lease.grants.clear();
        self.round_notes.clear();
        self.retired.retain(|i| !i.finished() || i.exited.is_none());
        let victim_pid = self.sides[a].as_ref().and_then(|i| {
            i.state
                .as_ref()
                .and_then(|s| s.engine_pid)
                .or_else(|| procs::read_pid_file(&i.pid_file).first().copied())
        });
        let mut bound = self.args.failover_bound;
        if kind == FailureKind::HungWake {
            bound += self.args.hung_waking_timeout;
        }
        let holder_before = if kind == FailureKind::LockdCrash {
            self.lockd
                .status()
                .await
                .ok()
                .and_then(|s| observe::resource(&s, RESOURCE).cloned())
        } else {
            None
        };
        Ok(Round {
            r,
            kind,
            a,
            b,
            victim_key,
            taker_key,
            victim_cfg,
            victim_pid,
            bound,
            holder_before,
            claim_before,
            epoch_before,
            notes,
            t_kill: now_us(),
            kill_at: Instant::now(),
            comp: None,
            lockd_killed_us: None,
            lockd_back_us: None,
            expected_new_engine_id: None,
            lease_reclaimed: None,
            recovery_us: None,
            victim_self_exit: true,
        })
    }

    /// Injects the round's failure (compound kinds: both of them, at the planned moments).
    async fn inject(&mut self, rd: &mut Round) -> Result<()> {
        let Round {
            r,
            kind,
            a,
            b,
            victim_key,
            taker_key,
            victim_cfg,
            victim_pid,
            bound,
            ..
        } = *rd;
        let mut notes = std::mem::take(&mut rd.notes);
        let mut t_kill = now_us();
        let mut kill_at = Instant::now();
        let mut comp: Option<CompoundRecord> = kind.is_compound().then(|| CompoundRecord {
            victim_workers_linger: victim_cfg.linger_workers && !self.args.worker_linger.is_zero(),
            ..CompoundRecord::default()
        });
        let mut lockd_killed_us: Option<u64> = None;
        let mut lockd_back_us: Option<u64> = None;
        let mut expected_new_engine_id = None;
        let mut compound_reclaimed: Option<bool> = None;
        let kill_engine = |notes: &mut Vec<String>| -> Result<()> {
            match victim_pid {
                Some(p) => {
                    procs::signal_pid(p, Signal::SIGKILL);
                    Ok(())
                }
                None => {
                    notes.push("the Active engine's pid is unknown".into());
                    bail!("round {}: the Active engine's pid is unknown", r + 1)
                }
            }
        };
        match kind {
            FailureKind::EngineKill | FailureKind::DetachedWorker | FailureKind::HungWake => {
                kill_engine(&mut notes)?;
            }
            FailureKind::EngineChildKill | FailureKind::WorkerKill => {
                let find = if kind == FailureKind::EngineChildKill {
                    procs::engine_child
                } else {
                    procs::engine_leaf
                };
                match victim_pid.and_then(find) {
                    Some(p) => procs::signal_pid(p, Signal::SIGKILL),
                    None => {
                        notes.push(format!(
                            "{kind}: the Active engine has no such process (run it with workers)"
                        ));
                        bail!(
                            "round {}: {kind}: no process to kill in the Active engine's tree",
                            r + 1
                        )
                    }
                }
            }
            FailureKind::SupervisorKill => self.sigkill_supervisor(a),
            FailureKind::Stop => {
                if let Some(i) = self.sides[a].as_ref() {
                    procs::signal_pid(i.sup_pid, Signal::SIGTERM);
                }
            }
            FailureKind::Revoke => {
                if let Err(e) = self.lockd.revoke(Duration::from_secs(5), false).await {
                    notes.push(e);
                }
            }
            FailureKind::LockdCrash => {
                self.lockd.crash().await?;
            }
            FailureKind::LockdCrashThenSupervisorKill => {
                // 1. lockd crash and restart; 2. the Active side reclaims its lease (its
                //    supervisor's `lock_reclaimed` mark); 3. 0-50 ms later its supervisor dies.
                lockd_killed_us = Some(now_us());
                self.lockd.crash().await?;
                lockd_back_us = Some(now_us());
                let since = lockd_killed_us.unwrap_or(0);
                let deadline =
                    Instant::now() + self.args.reconnect_window + self.args.failover_bound;
                let reclaimed = self
                    .poll_side_until(a, deadline, |d| {
                        d.mark(MarkKind::LockReclaimed)
                            .is_some_and(|m| u64::try_from(m).is_ok_and(|m| m >= since))
                    })
                    .await;
                compound_reclaimed = Some(reclaimed);
                if !reclaimed {
                    notes.push("the Active side did not reclaim its lease; its supervisor was killed anyway".into());
                }
                let delay = schedule::compound_delay_us(kind, self.seed, r);
                std::thread::sleep(Duration::from_micros(delay));
                t_kill = now_us();
                kill_at = Instant::now();
                self.sigkill_supervisor(a);
                if let Some(c) = comp.as_mut() {
                    c.delay_us = Some(delay);
                    c.reclaimer_engine_id = Some(victim_key.0);
                    c.reclaimed = Some(reclaimed);
                }
            }
            FailureKind::RevokeDuringReconnect => {
                // lockd crash; the revoke goes out as soon as the restarted lockd's socket is
                // there, while the Active side's lease still waits to be reclaimed (its
                // client reconnects with a 10 ms, 20 ms, ... backoff).
                lockd_killed_us = Some(now_us());
                self.lockd.kill().await;
                self.lockd.spawn()?;
                self.lockd.wait_socket_accepts(Duration::from_secs(10));
                lockd_back_us = Some(now_us());
                self.lockd.start_watch()?;
                t_kill = now_us();
                kill_at = Instant::now();
                let res = self.lockd.revoke(Duration::from_secs(2), true).await;
                if let Err(e) = &res {
                    notes.push(e.clone());
                }
                self.lockd
                    .wait_ready()
                    .await
                    .context("restarting lockd after the crash")?;
                if let Some(c) = comp.as_mut() {
                    c.revoke_ok = Some(res.is_ok());
                    c.reclaimer_engine_id = Some(victim_key.0);
                }
            }
            FailureKind::LockdCrashDuringWake => {
                // The engine dies; as soon as the standby is granted (Waking; its engine
                // wakes slowly) lockd crashes. The waker must reclaim and become Active.
                if !self.sides[b].as_ref().is_some_and(|i| i.config.slow_wake) {
                    notes.push("setup: the standby runs without a slow wake".to_string());
                }
                kill_engine(&mut notes)?;
                let waking = self
                    .poll_side_until(b, kill_at + bound, |d| {
                        matches!(d.state, Phase::Waking | Phase::Active | Phase::Dead)
                    })
                    .await;
                let is_waking = self.sides[b].as_ref().is_some_and(|i| i.is(Phase::Waking));
                let st = self.sides[b].as_ref().map_or("gone", |i| i.state_label());
                if !waking || !is_waking {
                    notes.push(format!(
                        "the standby was {st}, not Waking, when lockd was crashed"
                    ));
                }
                lockd_killed_us = Some(now_us());
                self.lockd.crash().await?;
                lockd_back_us = Some(now_us());
                expected_new_engine_id = taker_key.map(|k| k.0);
                if let Some(c) = comp.as_mut() {
                    c.reclaimer_engine_id = expected_new_engine_id;
                }
            }
            FailureKind::DoubleKill => {
                kill_engine(&mut notes)?;
                let delay = schedule::compound_delay_us(kind, self.seed, r);
                std::thread::sleep(Duration::from_micros(delay));
                self.sigkill_supervisor(a);
                if let Some(c) = comp.as_mut() {
                    c.delay_us = Some(delay);
                }
            }
        }
        if let Some(c) = comp.as_mut() {
            let rel = |t: Option<u64>| t.map(|t| t as i64 - t_kill as i64);
            c.lockd_killed_rel_us = rel(lockd_killed_us);
            c.lockd_back_rel_us = rel(lockd_back_us);
        }
        rd.notes = notes;
        rd.t_kill = t_kill;
        rd.kill_at = kill_at;
        rd.comp = comp;
        rd.lockd_killed_us = lockd_killed_us;
        rd.lockd_back_us = lockd_back_us;
        rd.expected_new_engine_id = expected_new_engine_id;
        rd.lease_reclaimed = compound_reclaimed;
        Ok(())
    }

    /// Watches the round until it has played out (a new Active, the victim gone; a lockd
    /// crash: past the reconnect window), then tears down what is left of the victim.
    async fn observe_round(&mut self, rd: &mut Round) {
        let Round {
            kind,
            victim_key,
            taker_key,
            bound,
            t_kill,
            kill_at,
            lockd_killed_us,
            ..
        } = *rd;
        let holder_before = rd.holder_before.clone();
        let mut notes = std::mem::take(&mut rd.notes);
        let mut recovery_us = None;
        let mut lease_reclaimed = rd.lease_reclaimed;
        let mut victim_self_exit = true;
        if kind == FailureKind::LockdCrash {
            // Nothing may change until the reconnect window is over (a lease not reclaimed by
            // then goes to a waiter): watch until just past it.
            let settle = self.args.reconnect_window + Duration::from_millis(250);
            let deadline = kill_at + self.args.reconnect_window + self.args.failover_bound;
            let want = holder_before.as_ref().and_then(|h| h.holder.clone());
            loop {
                self.tick().await;
                if recovery_us.is_none() {
                    if let Ok(s) = self.lockd.status().await {
                        if let Some(res) = observe::resource(&s, RESOURCE) {
                            if res.state == LeaseState::Held && res.holder == want && want.is_some()
                            {
                                recovery_us = Some(now_us() - t_kill);
                                lease_reclaimed = Some(true);
                            }
                        }
                    }
                }
                if recovery_us.is_some() && kill_at.elapsed() >= settle {
                    break;
                }
                if Instant::now() > deadline {
                    lease_reclaimed = Some(recovery_us.is_some());
                    break;
                }
                tokio::time::sleep(self.args.poll_interval).await;
            }
        } else {
            let mut deadline = kill_at + bound + Duration::from_secs(2);
            if lockd_killed_us.is_some() {
                deadline += self.args.reconnect_window;
            }
            loop {
                self.tick().await;
                let done_active = self.final_active(victim_key, t_kill).is_some();
                let victim_done = self.find_inc(victim_key).is_none_or(|i| i.finished());
                let hung_done = kind != FailureKind::HungWake
                    || taker_key
                        .and_then(|k| self.find_inc(k))
                        .is_none_or(|i| i.finished());
                // The waker of a lockd-crash-during-wake round may become Active before its
                // client reconnects (backoff up to 250 ms): wait for its reclaim too.
                let reclaim_done = kind != FailureKind::LockdCrashDuringWake
                    || self.lease.grants.iter().any(|g| g.reclaimed)
                    || taker_key.and_then(|k| self.find_inc(k)).is_some_and(|i| {
                        i.mark(MarkKind::LockReclaimed)
                            .is_some_and(|m| m >= lockd_killed_us.unwrap_or(u64::MAX))
                    });
                if done_active && victim_done && hung_done && reclaim_done {
                    break;
                }
                if Instant::now() > deadline {
                    if !victim_done {
                        victim_self_exit = false;
                        notes.push("the victim's supervisor had not exited by the deadline; killed (container teardown)".into());
                    }
                    break;
                }
                tokio::time::sleep(self.args.poll_interval).await;
            }
            // Whatever is left of the victim (and of a hung waker) is torn down so the drill
            // can go on; the invariants below were judged on what happened before.
            for key in [
                Some(victim_key),
                if kind == FailureKind::HungWake {
                    taker_key
                } else {
                    None
                },
            ]
            .into_iter()
            .flatten()
            {
                if let Some(side) =
                    (0..2).find(|s| self.sides[*s].as_ref().is_some_and(|i| i.key() == key))
                {
                    if let Some(i) = self.sides[side].as_mut() {
                        if i.exited.is_none() {
                            i.teardown();
                        }
                    }
                }
            }
        }
        self.tick().await;
        rd.notes = notes;
        rd.recovery_us = recovery_us;
        rd.lease_reclaimed = lease_reclaimed;
        rd.victim_self_exit = victim_self_exit;
    }

    /// Collects what the round left (claims, grants, transitions, Active intervals) and judges
    /// it ([`invariants::check_round`]).
    fn judge(&mut self, rd: &mut Round) -> Judged {
        let Round {
            kind,
            victim_key,
            taker_key,
            bound,
            t_kill,
            claim_before,
            epoch_before,
            lockd_killed_us,
            expected_new_engine_id,
            victim_self_exit,
            ..
        } = *rd;
        let mut notes = std::mem::take(&mut rd.notes);
        let mut comp = rd.comp.take();
        let mut lease_reclaimed = rd.lease_reclaimed;
        notes.append(&mut self.round_notes);
        let claims: Vec<ClaimViolation> = self
            .claim_lines()
            .iter()
            .skip(claim_before)
            .map(|l| ClaimViolation::parse(l))
            .collect();
        let final_inc = if kind == FailureKind::LockdCrash {
            self.find_inc(victim_key)
                .filter(|i| i.is(Phase::Active))
                .map(Inc::key)
        } else {
            self.final_active(victim_key, t_kill)
        };
        let final_active = final_inc.and_then(|k| self.find_inc(k)).and_then(|i| {
            let at = invariants::first_after(
                i.transitions(),
                Phase::Active,
                if i.key() == victim_key { 0 } else { t_kill },
            )?
            .at_unix_us;
            Some(FinalActive {
                engine_id: i.engine_id,
                incarnation: i.n,
                epoch: i.state.as_ref().and_then(|s| s.epoch),
                active_at_us: at,
            })
        });
        let mut grants = self.lease.grants.clone();
        grants.sort_by_key(|g| g.seen_at_unix_us);
        // Fallback when lockd watch saw no grant: the new Active's Waking transition.
        if kind.expects_failover() && !grants.iter().any(|g| !g.reclaimed) {
            if let Some(fa) = &final_active {
                notes.push("lockd watch reported no grant; fencing checked at the new Active's /state instead".into());
                let alive = self.find_inc(victim_key).map_or_else(Vec::new, |i| {
                    i.engine_pids
                        .iter()
                        .filter(|p| p.is_alive())
                        .map(|p| p.pid as u32)
                        .collect()
                });
                // Placed at the grant's time (the new life's Waking, or its Active), so that a
                // later reclaim of the same lease (lockd crashed during the wake) comes after
                // it in the epoch check.
                let granted_at = final_inc
                    .and_then(|k| self.find_inc(k))
                    .and_then(|i| invariants::first_after(i.transitions(), Phase::Waking, t_kill))
                    .map_or(fa.active_at_us, |t| t.at_unix_us);
                grants.push(GrantObs {
                    seen_at_unix_us: granted_at,
                    epoch: fa.epoch,
                    holder: None,
                    reclaimed: false,
                    previous_engine_id: Some(victim_key.0),
                    previous_alive_pids: alive,
                    previous_checked: self.find_inc(victim_key).map_or(0, |i| i.engine_pids.len()),
                });
                grants.sort_by_key(|g| g.seen_at_unix_us);
            }
        }
        let all_lives: Vec<&Inc> = self
            .sides
            .iter()
            .flatten()
            .chain(self.retired.iter())
            .collect();
        let seen: Vec<LifeObs<'_>> = all_lives
            .iter()
            .map(|i| LifeObs {
                engine_id: i.engine_id,
                incarnation: i.n,
                transitions: i.transitions(),
                exited_us: i.exited.as_ref().map(|x| x.0),
                sigkilled_us: i.sigkilled_us,
            })
            .collect();
        let transitions_after_kill = invariants::transitions_after(&seen, t_kill);
        let lives = invariants::life_ends(&seen, t_kill);
        let intervals = invariants::active_intervals(&lives, t_kill);
        // Compound rounds: what the lockd crash had to leave in place, and whether the
        // revoked side fenced itself.
        let victim = self.find_inc(victim_key);
        let reclaim_mark = |inc: Option<&Inc>| -> Option<u64> {
            let since = lockd_killed_us?;
            inc?.mark(MarkKind::LockReclaimed).filter(|m| *m >= since)
        };
        if kind == FailureKind::LockdCrashDuringWake {
            let waker = taker_key.and_then(|k| self.find_inc(k));
            let by_watch = grants.iter().any(|g| g.reclaimed);
            let ok = reclaim_mark(waker).is_some() || by_watch;
            lease_reclaimed = Some(ok);
            if let Some(c) = comp.as_mut() {
                c.reclaimed = Some(ok);
            }
        }
        let mut victim_fenced = None;
        if kind == FailureKind::RevokeDuringReconnect {
            let dead = victim.is_some_and(|v| {
                invariants::first_after(v.transitions(), Phase::Dead, t_kill).is_some()
            });
            victim_fenced =
                Some(dead || victim_self_exit && victim.is_some_and(|v| v.exited.is_some()));
            let mark = reclaim_mark(victim);
            if let Some(c) = comp.as_mut() {
                c.reclaimed = Some(mark.is_some());
                c.revoked_before_reclaim = Some(mark.is_none_or(|m| m >= t_kill));
            }
        }
        let fence = invariants::fence_check(&grants);
        let obs = RoundObs {
            kind: Some(kind),
            bound_us: bound.as_micros() as u64,
            t_kill_us: t_kill,
            epoch_before,
            victim_engine_id: Some(victim_key.0),
            grants,
            claim_violations: claims,
            final_is_victim: final_inc == Some(victim_key),
            final_active: final_active.clone(),
            transitions_after_kill,
            lease_reclaimed,
            active_intervals: intervals,
            expected_new_engine_id,
            victim_fenced,
        };
        let violations = invariants::check_round(&obs);
        rd.notes = notes;
        rd.comp = comp;
        rd.lease_reclaimed = lease_reclaimed;
        Judged {
            final_inc,
            final_active,
            violations,
            fence,
        }
    }

    /// The round's numbers (failover phases, marks after the kill) and its record.
    fn measure(&mut self, rd: Round, j: Judged) -> RoundRecord {
        let Round {
            r,
            kind,
            victim_key,
            t_kill,
            epoch_before,
            mut notes,
            comp,
            lease_reclaimed,
            mut recovery_us,
            ..
        } = rd;
        let Judged {
            final_inc,
            final_active,
            violations,
            fence,
        } = j;
        let victim = self.find_inc(victim_key);
        let t_old_dead = victim.and_then(|v| {
            // Its Dead transition; a SIGKILLed supervisor has none: then the moment its exit
            // was seen (the container is gone: the runtime kills the rest), which the drill
            // sees at once, unlike the engine's death, which it polls.
            invariants::first_after(v.transitions(), Phase::Dead, t_kill)
                .map(|t| t.at_unix_us)
                .or(v.exited.as_ref().map(|x| x.0))
                .or(v.engine_gone_us)
        });
        let (t_grant, t_active) = match (&final_active, final_inc.and_then(|k| self.find_inc(k))) {
            (Some(fa), Some(i)) if kind.expects_failover() => (
                invariants::waking_before(i.transitions(), fa.active_at_us),
                Some(fa.active_at_us),
            ),
            _ => (None, None),
        };
        let phases = if kind.expects_failover() {
            invariants::phases(t_kill, t_old_dead, t_grant, t_active)
        } else {
            invariants::Phases::default()
        };
        if let Some(v) = victim {
            if kind == FailureKind::SupervisorKill {
                if let (Some(g), Some(x)) = (v.engine_gone_us, v.exited.as_ref()) {
                    if g > x.0 + 50_000 {
                        notes.push(format!(
                            "engine outlived its supervisor by {} ms",
                            (g - x.0) / 1000
                        ));
                    }
                }
            }
        }
        let mut marks_after_kill_us = std::collections::BTreeMap::new();
        let mut add_marks = |prefix: &str, inc: Option<&Inc>| {
            for (k, v) in inc
                .and_then(|i| i.state.as_ref())
                .map(|s| &s.marks)
                .into_iter()
                .flatten()
            {
                if let Ok(v) = u64::try_from(*v) {
                    if v >= t_kill {
                        marks_after_kill_us.insert(format!("{prefix}.{}", k.as_str()), v - t_kill);
                    }
                }
            }
        };
        add_marks("old", victim);
        if final_inc != Some(victim_key) {
            add_marks("new", final_inc.and_then(|k| self.find_inc(k)));
        }
        // When the drill read each grant from `lockd watch` (lockd's side of the hand-over,
        // to tell a slow grant from a slow client): `watch.granted.1`, `watch.granted.2`, ...
        for (i, g) in self
            .lease
            .grants
            .iter()
            .filter(|g| g.seen_at_unix_us >= t_kill)
            .enumerate()
        {
            let what = if g.reclaimed { "reclaimed" } else { "granted" };
            marks_after_kill_us.insert(
                format!("watch.{what}.{}", i + 1),
                g.seen_at_unix_us - t_kill,
            );
        }
        if kind == FailureKind::LockdCrash && lease_reclaimed == Some(true) {
            // The supervisor's own reclaim time beats polling `lockd status`.
            if let Some(t) = marks_after_kill_us.get("old.lock_reclaimed") {
                recovery_us = Some(*t);
            }
        }
        if let Some(g) = victim.and_then(|v| v.engine_gone_us) {
            // When the drill (polling) first saw every process of the old engine dead.
            if g >= t_kill {
                marks_after_kill_us.insert("drill.old_engine_gone".into(), g - t_kill);
            }
        }
        if kind.expects_failover() && fence.is_none_or(|(n, _)| n == 0) {
            notes.push("no process of the old engine was checked at the grant".into());
        }
        let epoch_after = final_active
            .as_ref()
            .and_then(|f| f.epoch)
            .or(self.lease.last_epoch);
        if let Some(e) = epoch_after {
            self.lease.last_epoch = Some(self.lease.last_epoch.map_or(e, |l| l.max(e)));
        }
        RoundRecord {
            round: r as u32 + 1,
            kind,
            victim_engine_id: Some(victim_key.0),
            victim_incarnation: Some(victim_key.1),
            new_active_engine_id: final_active.as_ref().map(|f| f.engine_id),
            new_active_incarnation: final_active.as_ref().map(|f| f.incarnation),
            t_kill_unix_us: t_kill,
            phases,
            recovery_us,
            epoch_before,
            epoch_after,
            violations,
            marks_after_kill_us,
            notes,
            fence_pids_checked: fence.map(|f| f.0),
            fence_pids_alive: fence.map(|f| f.1),
            compound: comp,
            round_wall_us: None,
        }
    }

    /// SIGKILL of a side's supervisor (its container is torn down `--teardown-delay` after it
    /// died).
    pub(super) fn sigkill_supervisor(&mut self, side: usize) {
        if let Some(i) = self.sides[side].as_mut() {
            i.sigkilled_at = Some(Instant::now());
            i.sigkilled_us = Some(now_us());
            procs::signal_pid(i.sup_pid, Signal::SIGKILL);
        }
    }

    /// The first incarnation other than the victim that entered Active after the kill.
    fn final_active(&self, victim: (u64, u32), t_kill: u64) -> Option<(u64, u32)> {
        self.sides
            .iter()
            .flatten()
            .filter(|i| i.key() != victim && i.is(Phase::Active))
            .filter_map(|i| {
                invariants::first_after(i.transitions(), Phase::Active, t_kill)
                    .map(|t| (t.at_unix_us, i.key()))
            })
            .min()
            .map(|(_, k)| k)
    }
}
