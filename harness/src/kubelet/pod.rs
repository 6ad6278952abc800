//! A pure model of kubelet's POD readiness across container restarts, time as an input.
//!
//! The prober worker ([`super::ResultRun`]) says what one probe concludes; this says what the
//! pod looks like to a Service, for every container of the pod at once:
//!
//! * **Containers.** Regular containers and native sidecars (initContainers with
//!   `restartPolicy: Always`) both count: kubelet's `status.GenerateContainersReadyCondition`
//!   (pkg/kubelet/status/generate.go) lists an unready restartable init container among the
//!   unready ones, exactly as a regular container.
//! * **Started.** A running container is *started* once its startupProbe succeeded, or at once
//!   when it has none (`prober_manager.isContainerStarted`, pkg/kubelet/prober/prober_manager.go:
//!   "if there is a startup probe which hasn't run yet, the container is not started"). A new
//!   container (a restart) starts over: the startup result is keyed by container ID and the
//!   worker resets it for the new ID (pkg/kubelet/prober/worker.go, `doProbe`).
//! * **Ready.** A started, running container is ready when its readinessProbe's cached result
//!   is Success, or at once when it has none (`prober_manager.UpdatePodStatus`: "no
//!   readinessProbe -> always ready"; the readiness worker's initial value is Failure). Not
//!   running (waiting, back-off, terminated) or not started: not ready.
//! * **Pod Ready** = every container ready (`status.GeneratePodReadyCondition`; this chart has
//!   no readiness gates).
//! * **Restarts** (`restartPolicy: Always`): kubelet restarts an exited container after its
//!   CrashLoopBackOff (pkg/kubelet/kuberuntime/kuberuntime_manager.go `doBackOff`, over
//!   client-go's `flowcontrol.Backoff` (staging/src/k8s.io/client-go/util/flowcontrol/backoff.go)
//!   with `backOffPeriod` 10 s and `MaxContainerBackOff` 300 s, pkg/kubelet/kubelet.go). See
//!   [`RestartBackoff`]: the first restart is immediate, then 10 s, 20 s, 40 s ... 300 s after
//!   the exit; the back-off starts over when the container ran more than 2 x 300 s = 10 min.
//!   (The `KubeletCrashLoopBackOffMax` / `ReduceDefaultCrashLoopBackOffDecay` feature gates
//!   change these numbers; [`CrashLoopBackOff`] takes them as settings.)
//! * **Kills.** A startup or liveness failure verdict kills the container ([`Action::Kill`]);
//!   it exits later ([`Event::Exited`]) and is restarted as above.
//!
//! Not modelled: PLEG's detection delay of an exit (relist every second, or evented), the
//! runtime's container creation time (the driver reports [`Event::Started`] when it has
//! started the process), status-manager propagation to the API server and the endpoints
//! controller. All of them only add NotReady time to a container restart.
//!
//! ```
//! use std::time::Duration;
//! use harness::kubelet::pod::{Action, ContainerSpec, CrashLoopBackOff, Event, Pod};
//! use harness::kubelet::{ProbeKind, ProbeSpec, Verdict};
//!
//! let s = Duration::from_secs;
//! let engine = ContainerSpec::regular("engine-0").startup(ProbeSpec::default());
//! let mut pod = Pod::new(vec![engine], CrashLoopBackOff::default());
//! pod.step(s(0), Event::Started(0));
//! assert!(!pod.ready(), "startup pending = not ready");
//! pod.step(s(1), Event::Probe(0, ProbeKind::Startup, Verdict::Success));
//! assert!(pod.ready());
//! // The container exits: restarted at once the first time, 10 s after the next exit.
//! assert_eq!(pod.step(s(5), Event::Exited(0)), vec![Action::Start(0)]);
//! pod.step(s(5), Event::Started(0));
//! assert!(pod.step(s(6), Event::Exited(0)).is_empty());
//! assert_eq!(pod.step(s(16), Event::Tick), vec![Action::Start(0)]);
//! ```

use std::time::Duration;

use super::{ProbeKind, ProbeSpec, Verdict};

/// kubelet's container restart back-off settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrashLoopBackOff {
    /// First delay (`backOffPeriod`, 10 s).
    pub initial: Duration,
    /// Cap (`MaxContainerBackOff`, 300 s). The back-off starts over after `2 x max` (10 min)
    /// between the last restart and the next exit (`flowcontrol.hasExpired`).
    pub max: Duration,
}

impl Default for CrashLoopBackOff {
    /// kubelet's defaults: 10 s doubling to 300 s.
    fn default() -> CrashLoopBackOff {
        CrashLoopBackOff {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(300),
        }
    }
}

impl CrashLoopBackOff {
    /// Both durations times `k` (for scaled replays).
    pub fn scaled(&self, k: f64) -> CrashLoopBackOff {
        CrashLoopBackOff {
            initial: self.initial.mul_f64(k),
            max: self.max.mul_f64(k),
        }
    }
}

/// One container's `flowcontrol.Backoff` entry (kubelet keys it by pod and container name, so
/// it survives the container's restarts).
#[derive(Clone, Debug)]
pub struct RestartBackoff {
    /// Settings.
    cfg: CrashLoopBackOff,
    /// (current back-off, last update = time of the last restart), once there was a restart.
    entry: Option<(Duration, Duration)>,
}

impl RestartBackoff {
    /// No restart yet.
    pub fn new(cfg: CrashLoopBackOff) -> RestartBackoff {
        RestartBackoff { cfg, entry: None }
    }

    /// When kubelet restarts a container that exited at `finished`, and the entry's update.
    ///
    /// `doBackOff` asks `IsInBackOffSince(key, finishedAt)`: no entry, or an entry older than
    /// `2 x max` at the exit (`hasExpired`), is not in back-off: restart now, and `Next` sets
    /// the back-off to `initial`. Otherwise the container waits until `finished + backoff`;
    /// at that restart `Next` doubles the back-off (capped) and records the restart time.
    pub fn restart_at(&mut self, finished: Duration) -> Duration {
        match self.entry {
            Some((backoff, last)) if finished.saturating_sub(last) <= self.cfg.max * 2 => {
                let at = finished + backoff;
                self.entry = Some(((backoff * 2).min(self.cfg.max), at));
                at
            }
            _ => {
                self.entry = Some((self.cfg.initial, finished));
                finished
            }
        }
    }
}

/// What kubelet knows of one container of the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerSpec {
    /// Its name.
    pub name: String,
    /// A native sidecar (initContainer with `restartPolicy: Always`): counts for readiness.
    pub sidecar: bool,
    /// Its startupProbe, if any.
    pub startup: Option<ProbeSpec>,
    /// Its readinessProbe, if any.
    pub readiness: Option<ProbeSpec>,
    /// Its livenessProbe, if any.
    pub liveness: Option<ProbeSpec>,
}

impl ContainerSpec {
    /// A regular container without probes.
    pub fn regular(name: &str) -> ContainerSpec {
        ContainerSpec {
            name: name.to_string(),
            sidecar: false,
            startup: None,
            readiness: None,
            liveness: None,
        }
    }

    /// A native sidecar without probes.
    pub fn sidecar(name: &str) -> ContainerSpec {
        ContainerSpec {
            sidecar: true,
            ..ContainerSpec::regular(name)
        }
    }

    /// With a startupProbe.
    pub fn startup(mut self, p: ProbeSpec) -> ContainerSpec {
        self.startup = Some(p);
        self
    }

    /// With a readinessProbe.
    pub fn readiness(mut self, p: ProbeSpec) -> ContainerSpec {
        self.readiness = Some(p);
        self
    }

    /// With a livenessProbe.
    pub fn liveness(mut self, p: ProbeSpec) -> ContainerSpec {
        self.liveness = Some(p);
        self
    }
}

/// A container's state, as in `ContainerStatus.State`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Waiting to be created (never started, or kubelet decided to start it: `ContainerCreating`).
    Creating,
    /// Running since `since`. `started`: startup probe passed (or none); `ready`: readiness
    /// result Success (or none), meaningful once started.
    Running {
        /// When the driver reported it started.
        since: Duration,
        /// Startup passed (or no startup probe).
        started: bool,
        /// Readiness cached result (true when there is no readiness probe).
        ready: bool,
    },
    /// Exited; kubelet restarts it at `until` (`CrashLoopBackOff` while `until` is ahead).
    BackOff {
        /// When it exited.
        exited: Duration,
        /// When kubelet restarts it.
        until: Duration,
    },
}

/// Inputs of the model. Every one comes with the time it happened ([`Pod::step`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The runtime started container `c` (its process runs).
    Started(usize),
    /// Container `c`'s process exited (on its own or killed).
    Exited(usize),
    /// A verdict of container `c`'s prober worker of the given kind (a [`super::ResultRun`]
    /// reaching its threshold).
    Probe(usize, ProbeKind, Verdict),
    /// Time passed: restarts whose back-off ended are due.
    Tick,
}

/// What kubelet does in answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Start container `c` now (a restart after its back-off, or the immediate first one).
    Start(usize),
    /// Kill container `c` (startup or liveness failure verdict).
    Kill(usize),
}

/// One container in the pod.
#[derive(Clone, Debug)]
struct Slot {
    spec: ContainerSpec,
    state: State,
    backoff: RestartBackoff,
    /// Restarts so far (`restartCount`).
    restarts: u32,
    /// (exit time, restart time) of every restart.
    restart_log: Vec<(Duration, Duration)>,
}

impl Slot {
    fn ready(&self) -> bool {
        matches!(
            self.state,
            State::Running {
                started: true,
                ready: true,
                ..
            }
        )
    }
}

/// The pod: its containers and the timeline of its Ready condition.
#[derive(Clone, Debug)]
pub struct Pod {
    slots: Vec<Slot>,
    /// Every change of the pod's Ready condition: (when, ready). Starts NotReady at 0.
    log: Vec<(Duration, bool)>,
    /// Last time seen.
    now: Duration,
}

impl Pod {
    /// A pod whose containers are all still to be created.
    pub fn new(containers: Vec<ContainerSpec>, backoff: CrashLoopBackOff) -> Pod {
        Pod {
            slots: containers
                .into_iter()
                .map(|spec| Slot {
                    spec,
                    state: State::Creating,
                    backoff: RestartBackoff::new(backoff),
                    restarts: 0,
                    restart_log: Vec::new(),
                })
                .collect(),
            log: vec![(Duration::ZERO, false)],
            now: Duration::ZERO,
        }
    }

    /// Index of the container named `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.slots.iter().position(|s| s.spec.name == name)
    }

    /// Feeds one event at `now` (never earlier than the previous one: an earlier time is
    /// taken as the previous one). Returns what kubelet does.
    pub fn step(&mut self, now: Duration, ev: Event) -> Vec<Action> {
        let now = now.max(self.now);
        self.now = now;
        let mut out = Vec::new();
        match ev {
            Event::Started(c) => {
                let s = &mut self.slots[c];
                s.state = State::Running {
                    since: now,
                    started: s.spec.startup.is_none(),
                    ready: s.spec.readiness.is_none(),
                };
            }
            Event::Exited(c) => {
                let s = &mut self.slots[c];
                if matches!(s.state, State::Running { .. }) {
                    let until = s.backoff.restart_at(now);
                    s.state = State::BackOff { exited: now, until };
                }
            }
            Event::Probe(c, kind, v) => {
                let s = &mut self.slots[c];
                if let State::Running {
                    ref mut started,
                    ref mut ready,
                    ..
                } = s.state
                {
                    match (kind, v) {
                        (ProbeKind::Startup, Verdict::Success) => *started = true,
                        (ProbeKind::Readiness, v) => *ready = v.is_success(),
                        (ProbeKind::Startup | ProbeKind::Liveness, Verdict::Failure) => {
                            out.push(Action::Kill(c))
                        }
                        (ProbeKind::Liveness, Verdict::Success) => {}
                    }
                }
            }
            Event::Tick => {}
        }
        // Restarts whose back-off is over (the immediate first one included).
        for (c, s) in self.slots.iter_mut().enumerate() {
            if let State::BackOff { exited, until } = s.state {
                if until <= now {
                    s.state = State::Creating;
                    s.restarts += 1;
                    s.restart_log.push((exited, until));
                    out.push(Action::Start(c));
                }
            }
        }
        let ready = self.ready();
        if self.log.last().map(|x| x.1) != Some(ready) {
            self.log.push((now, ready));
        }
        out
    }

    /// Pod Ready: every container (sidecars included) running, started and ready.
    pub fn ready(&self) -> bool {
        self.slots.iter().all(Slot::ready)
    }

    /// Whether container `c` is ready.
    pub fn container_ready(&self, c: usize) -> bool {
        self.slots[c].ready()
    }

    /// Container `c`'s state.
    pub fn state(&self, c: usize) -> State {
        self.slots[c].state
    }

    /// Container `c`'s restart count.
    pub fn restarts(&self, c: usize) -> u32 {
        self.slots[c].restarts
    }

    /// Container `c`'s restarts: (exit time, restart time) each.
    pub fn restart_log(&self, c: usize) -> &[(Duration, Duration)] {
        &self.slots[c].restart_log
    }

    /// The containers that are not ready (their names).
    pub fn unready(&self) -> Vec<&str> {
        self.slots
            .iter()
            .filter(|s| !s.ready())
            .map(|s| s.spec.name.as_str())
            .collect()
    }

    /// Every change of the pod's Ready condition: (when, ready), starting with NotReady at 0.
    pub fn log(&self) -> &[(Duration, bool)] {
        &self.log
    }

    /// When the pod was first Ready.
    pub fn first_ready(&self) -> Option<Duration> {
        self.log.iter().find(|x| x.1).map(|x| x.0)
    }

    /// The NotReady intervals within `[from, to]` (an interval still open ends at `to`).
    pub fn not_ready_intervals(&self, from: Duration, to: Duration) -> Vec<(Duration, Duration)> {
        let mut out = Vec::new();
        for (i, (at, ready)) in self.log.iter().enumerate() {
            if *ready {
                continue;
            }
            let end = self.log.get(i + 1).map_or(to, |x| x.0);
            let (a, b) = ((*at).max(from), end.min(to));
            if a < b {
                out.push((a, b));
            }
        }
        out
    }

    /// Total NotReady time within `[from, to]`.
    pub fn not_ready_time(&self, from: Duration, to: Duration) -> Duration {
        self.not_ready_intervals(from, to)
            .iter()
            .map(|(a, b)| *b - *a)
            .sum()
    }
}

/// The startup worker of a (re)started container on a virtual clock: the time of its success
/// verdict, when `/startup` (or whatever it probes) answers 200 from `ok_from` on (since the
/// container start), or `None` when it is killed first. The worker's ticker keeps the phase
/// `phase` (since the container start) of the pod's worker: kubelet keeps one worker per
/// container name across restarts (pkg/kubelet/prober/worker.go), ticking every period.
pub fn startup_passes(spec: ProbeSpec, phase: Duration, ok_from: Duration) -> Option<Duration> {
    let mut run = super::ResultRun::new(spec);
    let first = phase.max(spec.initial_delay);
    let mut t = first;
    loop {
        match run.observe(t >= ok_from) {
            Some(Verdict::Success) => return Some(t),
            Some(Verdict::Failure) => return None,
            None => t += spec.period,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: u64) -> Duration {
        Duration::from_secs(x)
    }

    fn probe(period: u64, failure: u32) -> ProbeSpec {
        ProbeSpec {
            period: s(period),
            failure_threshold: failure,
            ..ProbeSpec::default()
        }
    }

    /// lockd (sidecar, startup), engine (startup + liveness), router (readiness).
    fn pod() -> Pod {
        Pod::new(
            vec![
                ContainerSpec::sidecar("lockd").startup(probe(1, 60)),
                ContainerSpec::regular("engine-0")
                    .startup(probe(1, 31))
                    .liveness(probe(5, 3)),
                ContainerSpec::regular("router").readiness(probe(1, 1)),
            ],
            CrashLoopBackOff::default(),
        )
    }

    fn start_all(p: &mut Pod) {
        for c in 0..3 {
            p.step(s(0), Event::Started(c));
        }
    }

    #[test]
    fn backoff_is_immediate_then_10_s_doubling_to_300_s() {
        let mut b = RestartBackoff::new(CrashLoopBackOff::default());
        // Each container runs 1 s after each restart, then exits.
        let mut exit = s(100);
        let mut delays = Vec::new();
        for _ in 0..9 {
            let at = b.restart_at(exit);
            delays.push((at - exit).as_secs());
            exit = at + s(1);
        }
        assert_eq!(delays, [0, 10, 20, 40, 80, 160, 300, 300, 300]);
    }

    #[test]
    fn backoff_starts_over_after_ten_minutes_of_running() {
        let mut b = RestartBackoff::new(CrashLoopBackOff::default());
        assert_eq!(b.restart_at(s(0)), s(0));
        assert_eq!(b.restart_at(s(5)), s(15), "second exit: 10 s");
        assert_eq!(b.restart_at(s(20)), s(40), "third exit: 20 s");
        // Ran exactly 600 s since the last restart: not expired (strictly more is needed).
        assert_eq!(
            b.restart_at(s(640)),
            s(680),
            "40 s: 600 s is not > 2 x 300 s"
        );
        // Ran 601 s: the back-off starts over, restart at once.
        assert_eq!(b.restart_at(s(680 + 601)), s(1281));
        assert_eq!(b.restart_at(s(1282)), s(1292), "then 10 s again");
    }

    #[test]
    fn backoff_scales() {
        let c = CrashLoopBackOff::default().scaled(0.05);
        assert_eq!(c.initial, Duration::from_millis(500));
        assert_eq!(c.max, s(15));
    }

    #[test]
    fn pod_ready_needs_every_container_started_and_ready() {
        let mut p = pod();
        assert!(!p.ready());
        start_all(&mut p);
        assert!(
            !p.ready(),
            "startup probes pending, router readiness initially Failure"
        );
        assert_eq!(p.unready(), ["lockd", "engine-0", "router"]);
        p.step(s(1), Event::Probe(0, ProbeKind::Startup, Verdict::Success));
        assert_eq!(p.unready(), ["engine-0", "router"]);
        p.step(s(1), Event::Probe(1, ProbeKind::Startup, Verdict::Success));
        assert!(
            p.container_ready(1),
            "no readinessProbe: ready once started"
        );
        assert_eq!(p.unready(), ["router"]);
        // The router has no startup probe: started at once, ready on its first Success.
        p.step(
            s(2),
            Event::Probe(2, ProbeKind::Readiness, Verdict::Success),
        );
        assert!(p.ready());
        assert_eq!(p.first_ready(), Some(s(2)));
        p.step(
            s(3),
            Event::Probe(2, ProbeKind::Readiness, Verdict::Failure),
        );
        assert!(!p.ready(), "a readiness failure takes the pod out");
        p.step(
            s(4),
            Event::Probe(2, ProbeKind::Readiness, Verdict::Success),
        );
        assert!(p.ready());
        assert_eq!(p.not_ready_time(s(2), s(10)), s(1));
        assert_eq!(
            p.not_ready_intervals(s(0), s(10)),
            [(s(0), s(2)), (s(3), s(4))]
        );
    }

    #[test]
    fn a_sidecar_counts() {
        let mut p = pod();
        start_all(&mut p);
        for c in 0..2 {
            p.step(s(1), Event::Probe(c, ProbeKind::Startup, Verdict::Success));
        }
        p.step(
            s(1),
            Event::Probe(2, ProbeKind::Readiness, Verdict::Success),
        );
        assert!(p.ready());
        // lockd exits: restarted at once, startup pending again.
        assert_eq!(p.step(s(10), Event::Exited(0)), [Action::Start(0)]);
        assert!(!p.ready());
        assert_eq!(p.state(0), State::Creating);
        p.step(s(10), Event::Started(0));
        assert!(
            !p.ready(),
            "the restarted sidecar's startup probe has not passed"
        );
        p.step(s(11), Event::Probe(0, ProbeKind::Startup, Verdict::Success));
        assert!(p.ready());
        assert_eq!(p.restarts(0), 1);
        assert_eq!(p.not_ready_time(s(1), s(20)), s(1));
    }

    #[test]
    fn a_restarted_container_is_not_ready_until_its_startup_probe_passes_again() {
        let mut p = pod();
        start_all(&mut p);
        for c in 0..2 {
            p.step(s(1), Event::Probe(c, ProbeKind::Startup, Verdict::Success));
        }
        p.step(
            s(1),
            Event::Probe(2, ProbeKind::Readiness, Verdict::Success),
        );
        // Liveness failure: kubelet kills; the exit comes later; restart immediate.
        assert_eq!(
            p.step(
                s(20),
                Event::Probe(1, ProbeKind::Liveness, Verdict::Failure)
            ),
            [Action::Kill(1)]
        );
        assert!(p.ready(), "still running until it exits");
        assert_eq!(p.step(s(21), Event::Exited(1)), [Action::Start(1)]);
        p.step(s(21), Event::Started(1));
        assert!(!p.ready());
        assert!(matches!(p.state(1), State::Running { started: false, .. }));
        // (The driver feeds the new container's verdicts only: kubelet keys results by
        // container ID.)
        p.step(s(22), Event::Probe(1, ProbeKind::Startup, Verdict::Success));
        assert!(p.ready());
        assert_eq!(p.not_ready_time(s(1), s(30)), s(1));
    }

    #[test]
    fn a_crash_loop_waits_10_20_40_s_in_back_off_not_ready() {
        let mut p = pod();
        start_all(&mut p);
        for c in 0..2 {
            p.step(s(1), Event::Probe(c, ProbeKind::Startup, Verdict::Success));
        }
        p.step(
            s(1),
            Event::Probe(2, ProbeKind::Readiness, Verdict::Success),
        );
        let mut t = s(5);
        let mut waits = Vec::new();
        for _ in 0..4 {
            let acts = p.step(t, Event::Exited(1));
            let restart = if acts.is_empty() {
                let State::BackOff { until, .. } = p.state(1) else {
                    panic!("not in back-off: {:?}", p.state(1))
                };
                // Nothing before the back-off ends ...
                assert!(p
                    .step(until - Duration::from_millis(1), Event::Tick)
                    .is_empty());
                assert!(!p.ready());
                // ... then the restart.
                assert_eq!(p.step(until, Event::Tick), [Action::Start(1)]);
                until
            } else {
                assert_eq!(acts, [Action::Start(1)]);
                t
            };
            waits.push((restart - t).as_secs());
            p.step(restart, Event::Started(1));
            p.step(
                restart + s(1),
                Event::Probe(1, ProbeKind::Startup, Verdict::Success),
            );
            t = restart + s(3);
        }
        assert_eq!(waits, [0, 10, 20, 40]);
        assert_eq!(p.restarts(1), 4);
        assert_eq!(
            p.restart_log(1)
                .iter()
                .map(|(e, r)| (*r - *e).as_secs())
                .collect::<Vec<_>>(),
            [0, 10, 20, 40]
        );
        // NotReady: the back-offs plus one second of startup each time.
        assert_eq!(p.not_ready_time(s(1), t), s(10 + 20 + 40 + 4));
    }

    #[test]
    fn events_of_a_container_that_is_not_running_change_nothing() {
        let mut p = pod();
        // Not started yet: a verdict is ignored, an exit too.
        assert!(p
            .step(s(0), Event::Probe(1, ProbeKind::Liveness, Verdict::Failure))
            .is_empty());
        assert!(p.step(s(0), Event::Exited(1)).is_empty());
        assert_eq!(p.state(1), State::Creating);
        // Time never goes back.
        p.step(s(5), Event::Tick);
        p.step(s(1), Event::Started(1));
        assert_eq!(
            p.state(1),
            State::Running {
                since: s(5),
                started: false,
                ready: true
            }
        );
    }

    #[test]
    fn startup_worker_on_a_virtual_clock() {
        // Period 1 s, phase 0.3 s: passes at the first tick at or after ok_from.
        let p = ProbeSpec {
            period: s(1),
            failure_threshold: 31,
            ..ProbeSpec::default()
        };
        let ms = Duration::from_millis;
        assert_eq!(startup_passes(p, ms(300), ms(50)), Some(ms(300)));
        assert_eq!(startup_passes(p, ms(300), ms(400)), Some(ms(1300)));
        assert_eq!(startup_passes(p, ms(0), s(30)), Some(s(30)));
        assert_eq!(startup_passes(p, ms(0), ms(30_001)), None, "killed at 30 s");
        // The first version: period 10 s x 720, /startup 200 only after a 10-minute load.
        let old = ProbeSpec {
            period: s(10),
            failure_threshold: 720,
            ..ProbeSpec::default()
        };
        assert_eq!(startup_passes(old, ms(0), s(600)), Some(s(600)));
        assert_eq!(startup_passes(old, ms(2500), s(600)), Some(ms(602_500)));
    }
}
