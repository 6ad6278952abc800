//! Issue 10, item 5: the kubelet replay learns POD readiness.
//!
//! `harness::kubelet::pod` models kubelet's rules for the whole pod (every container, native
//! sidecars included; startup pending = not ready; no readinessProbe = ready once started;
//! restarts with CrashLoopBackOff; pod Ready = all ready). Here it is driven by real
//! `supervisor run` + `fake-engine` + `lockd` processes under the rendered chart's probes
//! (deploy/rendered/vllm.yaml, read as kubelet_replay.rs reads it, scaled by its K = 1/20), and
//! it decides kubelet's container restarts (the test starts the new container when the model
//! says so). The router container is modelled, not run: its readinessProbe (`/healthz`: "an
//! engine is routable") is replayed over the replayed router checks of each engine's `/ready`;
//! the gms sidecar is modelled as started (no GMS in this replay).
//!
//! Scenarios and what they assert:
//! (a) failover by an engine kill, then the killed engine's full re-init (the supervisor
//!     re-arms in-process): no container restarts, the engine containers and sidecars never
//!     take the pod NotReady; the pod's NotReady time (the router's readiness between the two
//!     engines) is reported and bounded by the router's own gap;
//! (b) a container kill (supervisor + engine SIGKILLed; kubelet restarts it at once): the pod
//!     is NotReady while the restarted container's startup probe is pending: a period after
//!     its supervisor is up. The first version's design (a startup probe carrying the
//!     model-load budget, /startup 200 only after the load) is replayed over the same run:
//!     NotReady for the whole load (d);
//! (c) a crash-looping engine (its supervisor gives up and exits non-zero, every time): kubelet
//!     restarts it after 0, 10, 20, 40 s (scaled), the container is in back-off, the pod
//!     NotReady for each back-off;
//! (d) also on a virtual clock with the unscaled rendered numbers (no process), with the
//!     crash loop's NotReady share of an hour under the supervisor's default restart policy.
//! The failover of (a) with `--restart never` (the first version: the supervisor exits after
//! fencing, kubelet restarts the container) shows as NotReady: the assertion of (a) can fail.
//! The router's readinessProbe over a failover gap is computed on a virtual clock with the
//! chart's numbers (how often and how long a gap takes the pod NotReady, and the
//! failureThreshold that rides it out).
//!
//! The router here is HAProxy's health checks of `/ready` (inter/fall/rise = the readiness
//! numbers); a router told of Active changes at once (issue 10 item 3) only shortens the gap.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use harness::kubelet::pod::{
    startup_passes, Action, ContainerSpec, CrashLoopBackOff, Event, Pod, State,
};
use harness::kubelet::{ProbeKind, ProbeSpec, ResultRun, Verdict};
use harness::{Lockd, LockdSpec};
use probes::Phase;

use crate::kubelet_replay::{
    dump_logs, load_rendered, probe_from_yaml, repo_root, scaled, temp_dir, Container,
    ContainerEvent, EngineBehaviour, Record, Rendered, Scaled, Sink, K, SLACK,
};

// ---------------------------------------------------------------------------------------------
// The pod's containers, from the rendered manifest
// ---------------------------------------------------------------------------------------------

/// Indices of the containers in the pod model.
const LOCKD: usize = 0;
const GMS: usize = 1;
const ENGINE: [usize; 2] = [2, 3];
const ROUTER: usize = 4;

/// Every container of the rendered pod with its probes (scaled by `k`; the engines' startup
/// probe at most to K, as kubelet_replay.rs does), in the order of the indices above.
fn pod_containers(k: f64) -> Vec<ContainerSpec> {
    let path = std::env::var_os("KUBELET_REPLAY_MANIFEST")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("deploy/rendered/vllm.yaml"));
    let text = std::fs::read_to_string(&path).expect("rendered manifest");
    let dep: serde_norway::Value = serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("YAML"))
        .find(|v: &serde_norway::Value| {
            v.get("kind").and_then(|x| x.as_str()) == Some("Deployment")
        })
        .expect("a Deployment");
    let pod = &dep["spec"]["template"]["spec"];
    let mut out = Vec::new();
    let probe = |c: &serde_norway::Value, key: &str, k: f64| {
        c.get(key).map(|p| probe_from_yaml(p).scaled(k))
    };
    for (list, sidecar) in [("initContainers", true), ("containers", false)] {
        for c in pod[list].as_sequence().expect(list) {
            let name = c["name"].as_str().expect("name");
            if sidecar {
                assert_eq!(
                    c["restartPolicy"].as_str(),
                    Some("Always"),
                    "{name}: a plain init container (not modelled)"
                );
            }
            let mut spec = if sidecar {
                ContainerSpec::sidecar(name)
            } else {
                ContainerSpec::regular(name)
            };
            let ks = if name.starts_with("engine-") {
                k.max(K)
            } else {
                k
            };
            spec.startup = probe(c, "startupProbe", ks);
            spec.readiness = probe(c, "readinessProbe", k);
            spec.liveness = probe(c, "livenessProbe", k);
            out.push(spec);
        }
    }
    let names: Vec<&str> = out.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        ["lockd", "gms", "engine-0", "engine-1", "router"],
        "the pod's containers changed: update the model's indices"
    );
    out
}

// ---------------------------------------------------------------------------------------------
// The live driver: real engine containers, the model deciding restarts
// ---------------------------------------------------------------------------------------------

/// The model and every event fed to it (for replays of the same run under other specs).
struct Live {
    epoch: Instant,
    pod: Pod,
    events: Vec<(Duration, Event)>,
    /// Actions not yet carried out.
    pending: Vec<Action>,
}

type Shared = Arc<Mutex<Live>>;

fn feed(sh: &Shared, at: Instant, ev: Event) {
    let mut g = sh.lock().unwrap();
    let t = at.saturating_duration_since(g.epoch);
    g.events.push((t, ev));
    let acts = g.pod.step(t, ev);
    g.pending.extend(acts);
}

/// How one engine container is started (the same command at every restart, as kubelet does).
#[derive(Clone)]
struct EngineRecipe {
    role: &'static str,
    scaled: Scaled,
    behaviour: EngineBehaviour,
    sup_args: Vec<&'static str>,
    engine_args: Vec<&'static str>,
}

type Routable = Box<dyn Fn() -> bool + Send>;

/// A pod under the model: the lockd sidecar, two engine containers, the modelled router.
struct PodRun {
    dir: tempfile::TempDir,
    _lockd: Lockd,
    ep: String,
    sh: Shared,
    recipes: [EngineRecipe; 2],
    /// The current container of each engine.
    engines: [Option<Container>; 2],
    /// Dead containers, stopped at the end (stopping joins probe threads that may sleep a
    /// period: not on the restart path).
    retired: Vec<(usize, Container)>,
    /// (engine, record, start time since epoch) of every container generation, once stopped.
    done: Vec<(usize, Record)>,
    /// (engine, start time since epoch) of every container start.
    starts: Vec<(usize, Duration)>,
    routable: Arc<Mutex<[Option<Routable>; 2]>>,
    stop: Arc<AtomicBool>,
    router: Option<JoinHandle<()>>,
}

impl PodRun {
    fn start(tag: &str, k: f64, backoff: CrashLoopBackOff, recipes: [EngineRecipe; 2]) -> PodRun {
        let r: Rendered = load_rendered();
        let dir = temp_dir(tag);
        let epoch = Instant::now();
        let sh: Shared = Arc::new(Mutex::new(Live {
            epoch,
            pod: Pod::new(pod_containers(k), backoff),
            events: Vec::new(),
            pending: Vec::new(),
        }));
        // The lockd sidecar: started, and its startup probe (`lockd status`) passes once it
        // answers (Lockd::start returns then).
        feed(&sh, epoch, Event::Started(LOCKD));
        let lockd = Lockd::start(LockdSpec::new(dir.path()));
        feed(
            &sh,
            Instant::now(),
            Event::Probe(LOCKD, ProbeKind::Startup, Verdict::Success),
        );
        let ep = lockd.endpoint();
        // gms: not run here (the engines do not use GMS in this replay): started at once.
        feed(&sh, epoch, Event::Started(GMS));
        feed(
            &sh,
            epoch,
            Event::Probe(GMS, ProbeKind::Startup, Verdict::Success),
        );
        // The router: started; its readinessProbe replayed below.
        feed(&sh, epoch, Event::Started(ROUTER));
        let routable: Arc<Mutex<[Option<Routable>; 2]>> = Arc::new(Mutex::new([None, None]));
        let stop = Arc::new(AtomicBool::new(false));
        let router = {
            let (sh, routable, stop) = (sh.clone(), routable.clone(), stop.clone());
            // The router's readinessProbe: /healthz = at least one engine up in the router's
            // checks of /ready (`nbsrv(engines) ge 1`), probed every period like kubelet.
            let spec = r.readiness.scaled(k);
            std::thread::spawn(move || {
                let mut run = ResultRun::new(spec);
                let mut next = Instant::now();
                while !stop.load(Ordering::SeqCst) {
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    }
                    while next <= Instant::now() {
                        next += spec.period;
                    }
                    let up = routable.lock().unwrap().iter().flatten().any(|f| f());
                    if let Some(v) = run.observe(up) {
                        feed(
                            &sh,
                            Instant::now(),
                            Event::Probe(ROUTER, ProbeKind::Readiness, v),
                        );
                    }
                }
            })
        };
        let mut run = PodRun {
            dir,
            _lockd: lockd,
            ep,
            sh,
            recipes,
            engines: [None, None],
            retired: Vec::new(),
            done: Vec::new(),
            starts: Vec::new(),
            routable,
            stop,
            router: Some(router),
        };
        run.start_engine(0);
        run.start_engine(1);
        run
    }

    fn now(&self) -> Duration {
        self.sh.lock().unwrap().epoch.elapsed()
    }

    fn start_engine(&mut self, i: usize) {
        if let Some(old) = self.engines[i].take() {
            self.retired.push((i, old));
        }
        let c = ENGINE[i];
        let sh = self.sh.clone();
        let sink: Sink = Arc::new(move |at, ev| {
            let ev = match ev {
                ContainerEvent::StartupOk => Event::Probe(c, ProbeKind::Startup, Verdict::Success),
                ContainerEvent::KillVerdict => {
                    Event::Probe(c, ProbeKind::Liveness, Verdict::Failure)
                }
                ContainerEvent::Exited => Event::Exited(c),
            };
            feed(&sh, at, ev);
        });
        let rc = &self.recipes[i];
        let cont = Container::start_opts(
            self.dir.path(),
            &self.ep,
            i as u32,
            rc.role,
            &rc.scaled,
            &rc.behaviour,
            &rc.sup_args,
            &rc.engine_args,
            Some(sink),
        );
        let started = cont.rec.lock().unwrap().started_at.expect("started");
        feed(&self.sh, started, Event::Started(c));
        let since = started.saturating_duration_since(self.sh.lock().unwrap().epoch);
        self.starts.push((i, since));
        self.routable.lock().unwrap()[i] = Some(Box::new(cont.routable()));
        self.engines[i] = Some(cont);
    }

    /// One step of kubelet: time passes, due restarts happen.
    fn pump(&mut self) {
        feed(&self.sh, Instant::now(), Event::Tick);
        let acts = std::mem::take(&mut self.sh.lock().unwrap().pending);
        for a in acts {
            match a {
                Action::Start(c) if ENGINE.contains(&c) => {
                    self.start_engine(ENGINE.iter().position(|x| *x == c).unwrap())
                }
                // Other containers are not killed in these scenarios; a kill is carried out by
                // the container's own workers (kubelet_replay.rs).
                Action::Start(c) => feed(&self.sh, Instant::now(), Event::Started(c)),
                Action::Kill(_) => {}
            }
        }
    }

    /// Pumps every 5 ms until `f` or `limit`.
    fn run_until(&mut self, limit: Duration, mut f: impl FnMut(&PodRun) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            self.pump();
            if f(self) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn run_for(&mut self, d: Duration) {
        self.run_until(d, |_| false);
    }

    fn engine(&self, i: usize) -> &Container {
        self.engines[i].as_ref().expect("engine container")
    }

    fn pod_ready(&self) -> bool {
        self.sh.lock().unwrap().pod.ready()
    }

    fn logs(&self) -> String {
        dump_logs(self.dir.path())
    }

    /// Stop everything; the model, its events, every container generation's record (with the
    /// engine index), in start order per engine.
    fn finish(mut self) -> Finished {
        self.pump();
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.router.take() {
            let _ = t.join();
        }
        let end = self.now();
        for (i, c) in std::mem::take(&mut self.retired) {
            self.done.push((i, c.stop()));
        }
        for i in 0..2 {
            if let Some(c) = self.engines[i].take() {
                self.done.push((i, c.stop()));
            }
        }
        let logs = dump_logs(self.dir.path());
        let live = self.sh.lock().unwrap();
        Finished {
            pod: live.pod.clone(),
            events: live.events.clone(),
            epoch: live.epoch,
            end,
            records: std::mem::take(&mut self.done),
            starts: std::mem::take(&mut self.starts),
            logs,
        }
    }
}

struct Finished {
    pod: Pod,
    events: Vec<(Duration, Event)>,
    epoch: Instant,
    end: Duration,
    records: Vec<(usize, Record)>,
    starts: Vec<(usize, Duration)>,
    logs: String,
}

impl Finished {
    fn at(&self, i: Instant) -> Duration {
        i.saturating_duration_since(self.epoch)
    }

    /// The same run replayed into a pod whose containers are `specs`, with `map` rewriting
    /// (or dropping) events.
    fn replay(
        &self,
        specs: Vec<ContainerSpec>,
        backoff: CrashLoopBackOff,
        mut map: impl FnMut(Duration, Event) -> Vec<(Duration, Event)>,
    ) -> Pod {
        let mut evs: Vec<(Duration, Event)> =
            self.events.iter().flat_map(|(t, e)| map(*t, *e)).collect();
        evs.sort_by_key(|x| x.0);
        let mut pod = Pod::new(specs, backoff);
        for (t, e) in evs {
            pod.step(t, e);
        }
        pod.step(self.end, Event::Tick);
        pod
    }
}

/// The intervals within `[from, to]` in which the router had no engine to route to: no live
/// engine container whose replayed router check said up (sampled every millisecond).
fn no_engine_routable(f: &Finished, from: Duration, to: Duration) -> Vec<(Duration, Duration)> {
    let up_at = |rec: &Record, t: Duration| {
        let alive = rec.started_at.is_some_and(|s| f.at(s) <= t)
            && rec
                .killed
                .map(|k| k.0)
                .or(rec.exited_at)
                .is_none_or(|d| f.at(d) > t);
        alive
            && rec
                .ready_changes
                .iter()
                .rev()
                .find(|(at, _)| f.at(*at) <= t)
                .is_some_and(|x| x.1)
    };
    let mut out: Vec<(Duration, Duration)> = Vec::new();
    let mut t = from;
    let mut open: Option<Duration> = None;
    while t <= to {
        let up = f.records.iter().any(|(_, rec)| up_at(rec, t));
        match (up, open) {
            (false, None) => open = Some(t),
            (true, Some(a)) => {
                out.push((a, t));
                open = None;
            }
            _ => {}
        }
        t += Duration::from_millis(1);
    }
    if let Some(a) = open {
        out.push((a, to));
    }
    out
}

/// The pod without the router's readiness: what the engine containers and the sidecars alone
/// make of the pod's readiness.
fn without_router(f: &Finished, k: f64, backoff: CrashLoopBackOff) -> Pod {
    let mut specs = pod_containers(k);
    specs[ROUTER].readiness = None;
    f.replay(specs, backoff, |t, e| match e {
        Event::Probe(ROUTER, ProbeKind::Readiness, _) => vec![],
        e => vec![(t, e)],
    })
}

fn recipe(
    s: &Scaled,
    role: &'static str,
    b: &EngineBehaviour,
    sup: &[&'static str],
    eng: &[&'static str],
) -> EngineRecipe {
    EngineRecipe {
        role,
        scaled: s.clone(),
        behaviour: b.clone(),
        sup_args: sup.to_vec(),
        engine_args: eng.to_vec(),
    }
}

/// The chart's restart behaviour (`--restart on-failure`, the default), with the supervisor's
/// own backoff scaled like everything else (1 s x K).
const REARM: [&str; 4] = ["--restart", "on-failure", "--restart-backoff", "50ms"];

/// The rendered pod started under the model with both engines behaving as `b` and their
/// supervisors given `sup`, run until it is Ready with engine-0 Active and engine-1 Standby
/// (panics with every log otherwise).
fn pair_up(name: &str, r: &Rendered, b: &EngineBehaviour, sup: &[&'static str]) -> PodRun {
    let (s0, s1) = (scaled(r, 0, K), scaled(r, 1, K));
    let mut pod = PodRun::start(
        name,
        K,
        CrashLoopBackOff::default().scaled(K),
        [
            recipe(&s0, "primary", b, sup, &[]),
            recipe(&s1, "shadow", b, sup, &[]),
        ],
    );
    let up = pod.run_until(Duration::from_secs(30), |p| {
        p.pod_ready()
            && p.engine(0).state() == Some(Phase::Active)
            && p.engine(1).state() == Some(Phase::Standby)
    });
    assert!(
        up,
        "pod never Ready with engine-0 Active, engine-1 Standby\n{}",
        pod.logs()
    );
    pod
}

fn secs(d: Duration) -> String {
    format!("{:.3}s", d.as_secs_f64())
}

// ---------------------------------------------------------------------------------------------
// (a) failover + the replaced engine's full re-init: the engines never take the pod down
// ---------------------------------------------------------------------------------------------

#[test]
fn pod_stays_ready_through_a_failover_and_the_replaced_engines_reinit() {
    let _g = harness::serial();
    let r = load_rendered();
    // A 1.5 s load (30 s unscaled), a 100 ms wake (2 s unscaled).
    let b = EngineBehaviour {
        init: Duration::from_millis(1500),
        wake: Duration::from_millis(100),
    };
    let mut pod = pair_up("pod-a", &r, &b, &REARM);
    let backoff = CrashLoopBackOff::default().scaled(K);
    let ready_at = pod.now();
    // Stay a few router periods, then kill the Active engine (not its container).
    pod.run_for(r.readiness.scaled(K).period * 4);
    let killed_at = Instant::now();
    pod.engine(0)
        .signal_engine(nix::sys::signal::Signal::SIGKILL);
    // engine-1 takes over; engine-0's supervisor fences, re-arms a new incarnation, which
    // loads its model again (the full re-init) and stands by.
    let over = pod.run_until(Duration::from_secs(30), |p| {
        p.engine(1).state() == Some(Phase::Active)
            && p.engine(0).when_entered(Phase::Dead).is_some()
            && p.engine(0).state() == Some(Phase::Standby)
    });
    assert!(over, "no failover + re-arm to Standby\n{}", pod.logs());
    pod.run_for(r.readiness.scaled(K).period * 6);
    let e0_dead = pod.engine(0).when_entered(Phase::Dead).unwrap();
    let e1_active = pod.engine(1).when_entered(Phase::Active).unwrap();
    let f = pod.finish();
    let logs = &f.logs;
    // No container ever exited or restarted: the re-arm never touched kubelet.
    for (i, rec) in &f.records {
        assert!(
            rec.killed.is_none() && rec.exited_at.is_none(),
            "engine-{i} container died: {rec:?}\n{logs}"
        );
    }
    assert_eq!(
        f.starts.len(),
        2,
        "a container was restarted: {:?}",
        f.starts
    );
    for c in 0..5 {
        assert_eq!(f.pod.restarts(c), 0, "container {c} restarted");
    }
    // engine-0 went through Dead -> Init -> Standby in-process (a new incarnation).
    let states: Vec<Phase> = f
        .records
        .iter()
        .find(|x| x.0 == 0)
        .unwrap()
        .1
        .states
        .iter()
        .map(|x| x.1)
        .collect();
    let dead = states
        .iter()
        .position(|p| *p == Phase::Dead)
        .expect("engine-0 Dead");
    assert!(
        states[dead..].contains(&Phase::Init) && states.last() == Some(&Phase::Standby),
        "engine-0 did not re-init to Standby: {states:?}"
    );
    // The engine containers and the sidecars never took the pod NotReady after its first Ready.
    let engines_only = without_router(&f, K, backoff);
    let first = engines_only.first_ready().expect("Ready");
    assert!(first <= ready_at);
    let nr = engines_only.not_ready_intervals(first, f.end);
    assert!(
        nr.is_empty(),
        "the engines/sidecars took the pod NotReady: {nr:?} ({:?})",
        engines_only.unready()
    );
    // The whole pod: NotReady only because of the router's readiness, i.e. within a gap in
    // which the router's checks had no engine up (between engine-0's death and engine-1's
    // Active, each seen at the router's next check), until the router's next readiness probe.
    let period = r.readiness.scaled(K).period;
    let full = f.pod.not_ready_intervals(ready_at, f.end);
    let gaps = no_engine_routable(&f, ready_at, f.end);
    let (dead_t, active_t) = (f.at(e0_dead), f.at(e1_active));
    for (a, b) in &gaps {
        assert!(
            *a + SLACK >= dead_t && *b <= active_t + period + SLACK,
            "router gap {a:?}..{b:?} outside the failover ({dead_t:?}..{active_t:?})"
        );
    }
    for (a, b) in &full {
        assert!(
            gaps.iter()
                .any(|(ga, gb)| *a >= *ga
                    && *b <= *gb + period * r.readiness.success_threshold + SLACK),
            "pod NotReady {a:?}..{b:?} outside every router gap {gaps:?}"
        );
    }
    let total: Duration = full.iter().map(|(a, b)| *b - *a).sum();
    let gap: Duration = gaps.iter().map(|(a, b)| *b - *a).sum();
    eprintln!(
        "(a) failover + re-init at x{}: kill -> engine-1 Active {}, engine-0 re-armed to Standby \
         in-process; container restarts 0; NotReady caused by engines/sidecars 0 s; router gap \
         (no engine up in its checks) {}; whole pod NotReady {} in {} interval(s) (the router's \
         readinessProbe, period {}, failureThreshold {}, saw the gap)",
        1.0 / K,
        secs(active_t.saturating_sub(f.at(killed_at))),
        secs(gap),
        secs(total),
        full.len(),
        secs(period),
        r.readiness.failure_threshold,
    );
}

/// The same failover with the first version's supervisor (`--restart never`: it exits after
/// fencing, kubelet restarts the container): the model sees the engine container take the pod
/// NotReady, so the assertion above can fail.
#[test]
fn the_same_failover_with_restart_never_takes_the_pod_not_ready() {
    let _g = harness::serial();
    let r = load_rendered();
    let b = EngineBehaviour {
        init: Duration::from_millis(1500),
        wake: Duration::from_millis(100),
    };
    let never: [&str; 2] = ["--restart", "never"];
    let mut pod = pair_up("pod-a-never", &r, &b, &never);
    let backoff = CrashLoopBackOff::default().scaled(K);
    pod.run_for(r.readiness.scaled(K).period * 4);
    let ready_at = pod.now();
    pod.engine(0)
        .signal_engine(nix::sys::signal::Signal::SIGKILL);
    let back = pod.run_until(Duration::from_secs(30), |p| {
        p.starts.len() == 3
            && p.engine(0).state() == Some(Phase::Standby)
            && p.engine(1).state() == Some(Phase::Active)
    });
    assert!(back, "no container restart to Standby\n{}", pod.logs());
    let f = pod.finish();
    assert_eq!(f.pod.restarts(ENGINE[0]), 1, "{}", f.logs);
    let engines_only = without_router(&f, K, backoff);
    let nr = engines_only.not_ready_time(ready_at, f.end);
    eprintln!(
        "(a, --restart never) the same failover restarts engine-0's container: engines/sidecars \
         take the pod NotReady {} at x{} (a startup period after the restarted supervisor is up)",
        secs(nr),
        1.0 / K
    );
    assert!(
        nr > Duration::ZERO,
        "a container restart must show as NotReady"
    );
}

// ---------------------------------------------------------------------------------------------
// (b) + (d) a container kill; the first version's design replayed over the same run
// ---------------------------------------------------------------------------------------------

/// The first version's engine startup probe: period 10 s, failureThreshold 720 (the 2-hour
/// model-load budget), on a /startup that answered 200 only once the engine left Init.
fn old_startup() -> ProbeSpec {
    ProbeSpec {
        period: Duration::from_secs(10),
        failure_threshold: 720,
        ..ProbeSpec::default()
    }
}

#[test]
fn container_kill_costs_a_startup_period_not_the_model_load() {
    let _g = harness::serial();
    let r = load_rendered();
    // A 2 s load (40 s unscaled): long against the startup period (50 ms scaled).
    let b = EngineBehaviour {
        init: Duration::from_millis(2000),
        wake: Duration::from_millis(100),
    };
    let mut pod = pair_up("pod-b", &r, &b, &REARM);
    let backoff = CrashLoopBackOff::default().scaled(K);
    pod.run_for(r.readiness.scaled(K).period * 4);
    let ready_at = pod.now();
    // The Active engine's container is killed: supervisor and engine SIGKILLed.
    let killed_at = Instant::now();
    pod.engine(0).kill_container();
    // kubelet restarts it (at once: its first restart); the restarted supervisor loads its
    // engine again and stands by; engine-1 took over.
    let back = pod.run_until(Duration::from_secs(30), |p| {
        p.starts.len() == 3
            && p.engine(0).state() == Some(Phase::Standby)
            && p.engine(1).state() == Some(Phase::Active)
    });
    assert!(back, "no restart to Standby + takeover\n{}", pod.logs());
    pod.run_for(r.readiness.scaled(K).period * 6);
    let f = pod.finish();
    let logs = &f.logs;
    let kill_t = f.at(killed_at);
    assert_eq!(f.pod.restarts(ENGINE[0]), 1, "{logs}");
    let (exit, restart) = f.pod.restart_log(ENGINE[0])[0];
    assert_eq!(exit, restart, "the first restart is immediate");
    let restarted = f.starts[2].1;
    let second = &f
        .records
        .iter()
        .filter(|x| x.0 == 0)
        .nth(1)
        .expect("2nd engine-0")
        .1;
    let up_t = f.at(second.startup_ok_at.expect("restarted container started"));
    let left_init = second
        .states
        .iter()
        .find(|x| matches!(x.1, Phase::Standby | Phase::Waking | Phase::Active))
        .map(|x| f.at(x.0))
        .expect("restarted engine left Init");

    // The new design: engine containers and sidecars only.
    let new = without_router(&f, K, backoff);
    let new_nr = new.not_ready_time(ready_at, f.end);
    // The first version's design, over the same run: the restarted engine-0's startup
    // probe (old numbers, same scale) passes only at the first probe after the engine left
    // Init. kubelet's worker keeps ticking across the restart: its first probe of the new
    // container comes within a period; counting it at the container's start is the
    // earliest (the NotReady below is a lower bound).
    let old_spec = old_startup().scaled(K);
    let old_ok = restarted
        + startup_passes(old_spec, Duration::ZERO, left_init - restarted)
            .expect("the old budget covers the load");
    let mut specs = pod_containers(K);
    specs[ROUTER].readiness = None;
    for e in ENGINE {
        specs[e].startup = Some(old_spec);
    }
    let old = f.replay(specs, backoff, |t, e| match e {
        Event::Probe(ROUTER, ProbeKind::Readiness, _) => vec![],
        Event::Probe(c, ProbeKind::Startup, Verdict::Success) if c == ENGINE[0] && t > kill_t => {
            vec![(old_ok, e)]
        }
        e => vec![(t, e)],
    });
    let old_nr = old.not_ready_time(ready_at, f.end);
    let whole = f.pod.not_ready_time(ready_at, f.end);
    let up_after = up_t.saturating_sub(restarted);
    // Unscaled: the supervisor's coming up is real time (not scaled), the startup period is
    // the rendered one; the old design waits for the load (unscaled) plus up to its period.
    let e = &r.engines[0];
    let load_unscaled = b.init.div_f64(K);
    eprintln!(
        "(b) container kill at x{}: restart after {} (first restart: immediate), restarted \
         container started {} after its start (startup period {}); pod NotReady from \
         engines/sidecars: new design {} vs old design {} (load {}); whole pod (router \
         included) {}. Unscaled: new ~{} + up to {} (startup period), old {} + up to {} \
         (old startup period); a second container restart within 10 min adds kubelet's \
         back-off: 10 s, then 20 s, 40 s ...",
        1.0 / K,
        secs(restart.saturating_sub(exit)),
        secs(up_after),
        secs(scaled(&r, 0, K).startup.period),
        secs(new_nr),
        secs(old_nr),
        secs(b.init),
        secs(whole),
        secs(up_after),
        secs(e.startup.period),
        secs(load_unscaled),
        secs(old_startup().period),
    );
    // The new design: NotReady only while the restarted supervisor comes up plus one startup
    // period (and the kill's detection), never the load.
    assert!(
        new_nr <= up_after + scaled(&r, 0, K).startup.period + SLACK,
        "new design NotReady {new_nr:?} (up after {up_after:?})"
    );
    assert!(
        new_nr < b.init / 2,
        "new design NotReady {new_nr:?} ~ the load {:?}",
        b.init
    );
    assert!(
        new_nr > Duration::ZERO,
        "a container kill must cost some NotReady (model broken?)"
    );
    // The old design: NotReady for the whole load at least, so this replay can fail.
    assert!(
        old_nr >= b.init,
        "old design NotReady {old_nr:?} < the load {:?}: the replay cannot see the outage",
        b.init
    );
    assert!(old_nr > new_nr * 4, "old {old_nr:?} vs new {new_nr:?}");
}

// ---------------------------------------------------------------------------------------------
// (c) a crash-looping engine: kubelet's back-off, pod NotReady
// ---------------------------------------------------------------------------------------------

#[test]
fn crash_looping_engine_ends_in_back_off_and_takes_the_pod_not_ready() {
    let _g = harness::serial();
    let r = load_rendered();
    let (s0, s1) = (scaled(&r, 0, K), scaled(&r, 1, K));
    let backoff = CrashLoopBackOff::default().scaled(K);
    let b = EngineBehaviour {
        init: Duration::from_millis(300),
        wake: Duration::from_millis(100),
    };
    // engine-0 always fails at init; its supervisor restarts it once, then gives up and exits
    // non-zero (the crash-loop limit), every time kubelet restarts the container.
    let crash: [&str; 8] = [
        "--restart",
        "on-failure",
        "--restart-backoff",
        "10ms",
        "--restart-backoff-max",
        "10ms",
        "--crash-loop-limit",
        "1",
    ];
    let mut pod = PodRun::start(
        "pod-c",
        K,
        backoff,
        [
            recipe(&s0, "primary", &b, &crash, &["--fail-at", "init"]),
            recipe(&s1, "shadow", &b, &REARM, &[]),
        ],
    );
    // engine-1 serves (it gets the free lock); engine-0's container is restarted: at once,
    // then after 10, 20, 40 s of back-off (scaled): 5 starts in all.
    let five = pod.run_until(Duration::from_secs(30), |p| {
        p.starts.iter().filter(|x| x.0 == 0).count() == 5
    });
    assert!(
        five,
        "engine-0 not restarted 4 times: {:?}\n{}",
        pod.starts,
        pod.logs()
    );
    // Until its fifth container gives up too: back-off of 80 s (scaled) ahead.
    let in_backoff = pod.run_until(Duration::from_secs(10), |p| {
        matches!(
            p.sh.lock().unwrap().pod.state(ENGINE[0]),
            State::BackOff { .. }
        )
    });
    assert!(
        in_backoff,
        "engine-0 never back in back-off\n{}",
        pod.logs()
    );
    let active = pod.engine(1).state() == Some(Phase::Active);
    let ready_now = pod.pod_ready();
    let state = pod.sh.lock().unwrap().pod.state(ENGINE[0]);
    let f = pod.finish();
    let logs = &f.logs;
    assert!(active, "engine-1 never Active\n{logs}");
    assert!(!ready_now, "pod Ready while engine-0 is in back-off");
    let State::BackOff { exited, until } = state else {
        panic!("{state:?}")
    };
    assert_eq!(
        until - exited,
        backoff.initial * 8,
        "fifth exit: 80 s (scaled) of back-off"
    );
    // Every container exited non-zero on its own (the supervisor's crash-loop limit).
    let gens: Vec<&Record> = f
        .records
        .iter()
        .filter(|x| x.0 == 0)
        .map(|x| &x.1)
        .collect();
    assert_eq!(gens.len(), 5);
    for g in &gens {
        assert!(g.exited_at.is_some() && g.killed.is_none(), "{g:?}\n{logs}");
    }
    // The back-offs the model imposed: 0, 10, 20, 40 s (scaled), observed as container starts.
    let log = f.pod.restart_log(ENGINE[0]);
    let waits: Vec<Duration> = log.iter().map(|(e, r)| *r - *e).collect();
    assert_eq!(
        waits,
        [0, 1, 2, 4].map(|m| backoff.initial * m).to_vec(),
        "restart delays"
    );
    let starts: Vec<Duration> = f.starts.iter().filter(|x| x.0 == 0).map(|x| x.1).collect();
    for (n, (_, restart)) in log.iter().enumerate() {
        let started = starts[n + 1];
        assert!(
            started >= *restart && started <= *restart + SLACK,
            "restart {n}: model {restart:?}, started {started:?}"
        );
    }
    // The pod is NotReady during each back-off (the container is waiting, not ready).
    for (e, r) in log.iter().skip(1) {
        let nr = f.pod.not_ready_time(*e, *r);
        assert_eq!(nr, *r - *e, "pod Ready during the back-off {e:?}..{r:?}");
    }
    let first = f.pod.first_ready().unwrap_or(Duration::ZERO);
    let total = f.end.saturating_sub(first);
    let nr = f.pod.not_ready_time(first, f.end);
    eprintln!(
        "(c) crash loop at x{}: kubelet restart delays {:?} (= 0/10/20/40 s unscaled), then 80 s; \
         pod NotReady {} of {} since its first Ready ({:.0}%), Ready only while a fresh \
         container's supervisor ran its own incarnations",
        1.0 / K,
        waits.iter().map(|d| secs(*d)).collect::<Vec<_>>(),
        secs(nr),
        secs(total),
        100.0 * nr.as_secs_f64() / total.as_secs_f64().max(1e-9)
    );
}

// ---------------------------------------------------------------------------------------------
// (d) the same on a virtual clock, unscaled rendered numbers: old design vs new
// ---------------------------------------------------------------------------------------------

/// NotReady time of a pod (engine containers and sidecars; the router Ready throughout) whose
/// `engine-0` container is restarted once at 0 s, its startup probe `startup` passing once
/// `/startup` answers, `ok_from` after the restart.
fn restart_outage(startup: ProbeSpec, phase: Duration, ok_from: Duration) -> Duration {
    let mut specs = pod_containers(1.0);
    specs[ROUTER].readiness = None;
    for e in ENGINE {
        specs[e].startup = Some(startup);
    }
    let mut pod = Pod::new(specs, CrashLoopBackOff::default());
    let t0 = Duration::from_secs(1000);
    for c in 0..5 {
        pod.step(Duration::ZERO, Event::Started(c));
        pod.step(
            Duration::ZERO,
            Event::Probe(c, ProbeKind::Startup, Verdict::Success),
        );
    }
    assert!(pod.ready());
    assert_eq!(
        pod.step(t0, Event::Exited(ENGINE[0])),
        [Action::Start(ENGINE[0])]
    );
    pod.step(t0, Event::Started(ENGINE[0]));
    let ok = startup_passes(startup, phase, ok_from).expect("startup passes");
    pod.step(
        t0 + ok,
        Event::Probe(ENGINE[0], ProbeKind::Startup, Verdict::Success),
    );
    assert!(pod.ready());
    pod.not_ready_time(Duration::ZERO, t0 + ok + Duration::from_secs(1))
}

#[test]
fn container_restart_outage_old_design_vs_new_on_a_virtual_clock() {
    let r = load_rendered();
    let new = r.engines[0].startup;
    let old = old_startup();
    let up = Duration::from_secs(2); // supervisor up (probes bound, lockd, spawn): seconds
    let load = Duration::from_secs(600); // a 10-minute model load
                                         // Worst and best kubelet ticker phase.
    for phase in [
        Duration::ZERO,
        new.period.saturating_sub(Duration::from_millis(1)),
    ] {
        let n = restart_outage(new, phase, up);
        assert!(n >= up && n <= up + new.period, "new design: {n:?}");
    }
    for phase in [Duration::ZERO, old.period - Duration::from_millis(1)] {
        let o = restart_outage(old, phase, load);
        assert!(o >= load && o <= load + old.period, "old design: {o:?}");
    }
    let n = restart_outage(new, Duration::ZERO, up);
    let o = restart_outage(old, Duration::ZERO, load);
    eprintln!(
        "(d) one container restart, unscaled: new design NotReady {} (supervisor up {} + <= \
         {} startup period), old design {} (the {} load + <= {} period)",
        secs(n),
        secs(up),
        secs(new.period),
        secs(o),
        secs(load),
        secs(old.period)
    );
    // A crash-looping engine, unscaled, over its first hour: each container runs its
    // supervisor's own crash loop (defaults: 1 s doubling, 5 restarts: 1+2+4+8+16 = 31 s, plus
    // 6 failing inits of `init_fail` each) and is Ready meanwhile (started; no readiness
    // probe), then exits non-zero; kubelet holds it in back-off 0, 10, 20, 40, 80, 160, 300,
    // 300 ... s (the runs are far shorter than the 10 min that would reset it).
    let init_fail = Duration::from_secs(1);
    let run = Duration::from_secs(31) + init_fail * 6;
    let mut specs = pod_containers(1.0);
    specs[ROUTER].readiness = None;
    let mut pod = Pod::new(specs, CrashLoopBackOff::default());
    for c in 0..5 {
        pod.step(Duration::ZERO, Event::Started(c));
        pod.step(
            Duration::ZERO,
            Event::Probe(c, ProbeKind::Startup, Verdict::Success),
        );
    }
    let hour = Duration::from_secs(3600);
    let mut t = Duration::ZERO;
    let mut waits = Vec::new();
    while t < hour {
        let exit = t + run;
        let until = if pod.step(exit, Event::Exited(ENGINE[0])).is_empty() {
            let State::BackOff { until, .. } = pod.state(ENGINE[0]) else {
                panic!("{:?}", pod.state(ENGINE[0]))
            };
            assert_eq!(pod.step(until, Event::Tick), [Action::Start(ENGINE[0])]);
            until
        } else {
            exit // the first restart: at once
        };
        waits.push((until - exit).as_secs());
        pod.step(until, Event::Started(ENGINE[0]));
        let ok = startup_passes(new, Duration::ZERO, up).expect("starts");
        pod.step(
            until + ok,
            Event::Probe(ENGINE[0], ProbeKind::Startup, Verdict::Success),
        );
        t = until + ok;
    }
    assert_eq!(waits[..8], [0, 10, 20, 40, 80, 160, 300, 300]);
    let nr = pod.not_ready_time(Duration::ZERO, hour);
    eprintln!(
        "(c) crash loop, unscaled: a broken engine's container runs {} per attempt (supervisor's \
         own crash loop), kubelet back-off {:?} s: the pod is NotReady {} of its first hour \
         ({:.0}%), though the other engine may be Active and serving",
        secs(run),
        &waits[..8],
        secs(nr),
        100.0 * nr.as_secs_f64() / hour.as_secs_f64()
    );
    assert!(
        nr > hour / 2,
        "a crash loop should hold the pod NotReady most of the time"
    );
}

// ---------------------------------------------------------------------------------------------
// The router's readinessProbe over a failover gap, unscaled, on a virtual clock
// ---------------------------------------------------------------------------------------------

/// NotReady time caused by the router's readinessProbe `spec` (ticks at `phase + n x period`)
/// when `/healthz` is 503 for `gap` from 10 s on (no engine routable between the old engine's
/// removal and the new one's addition).
fn router_outage(spec: ProbeSpec, gap: Duration, phase: Duration) -> Duration {
    let (from, to) = (Duration::from_secs(10), Duration::from_secs(10) + gap);
    let mut run = ResultRun::new(spec);
    let mut ready = true;
    let mut down_at = None;
    let mut t = phase;
    while t < to + spec.period * (spec.success_threshold + 2) {
        match run.observe(!(from <= t && t < to)) {
            Some(Verdict::Failure) if ready => {
                ready = false;
                down_at = Some(t);
            }
            Some(Verdict::Success) if !ready => {
                return t - down_at.expect("went down");
            }
            _ => {}
        }
        t += spec.period;
    }
    Duration::ZERO
}

#[test]
fn router_readiness_over_a_failover_gap_on_a_virtual_clock() {
    let r = load_rendered();
    let rp = r.readiness;
    // Every ticker phase in 1 ms steps.
    let phases: Vec<Duration> = (0..rp.period.as_millis() as u64)
        .map(Duration::from_millis)
        .collect();
    let stats = |spec: ProbeSpec, gap: Duration| {
        let o: Vec<Duration> = phases
            .iter()
            .map(|p| router_outage(spec, gap, *p))
            .collect();
        let hit = o.iter().filter(|d| !d.is_zero()).count();
        (hit as f64 / o.len() as f64, o.into_iter().max().unwrap())
    };
    // failureThreshold 1 (the chart before the router push): a gap is seen with probability
    // ~ gap / period, and then costs at least a whole period.
    let one = ProbeSpec {
        failure_threshold: 1,
        ..rp
    };
    let mut lines = Vec::new();
    for gap_ms in [20u64, 500, 2000, 3000] {
        let gap = Duration::from_millis(gap_ms);
        let (p1, max1) = stats(one, gap);
        let expect = (gap.as_secs_f64() / rp.period.as_secs_f64()).min(1.0);
        assert!(
            (p1 - expect).abs() < 0.01,
            "gap {gap:?}: P(NotReady) {p1} vs {expect}"
        );
        if p1 > 0.0 {
            assert!(max1 >= rp.period, "gap {gap:?}: NotReady {max1:?}");
        }
        // The chart's failureThreshold rides out every gap shorter than (F - 1) periods: the
        // router push makes the failover gap milliseconds (deploy/pod_drill.py measures it).
        let (pc, _) = stats(rp, gap);
        if gap < rp.period * (rp.failure_threshold - 1) {
            assert_eq!(pc, 0.0, "gap {gap:?} with the chart's {rp:?}");
        }
        // A failureThreshold covering the gap keeps the pod Ready through it.
        let n = (gap.as_secs_f64() / rp.period.as_secs_f64()).ceil() as u32 + 1;
        let tolerant = ProbeSpec {
            failure_threshold: n,
            ..rp
        };
        assert_eq!(
            stats(tolerant, gap).0,
            0.0,
            "gap {gap:?}, failureThreshold {n}"
        );
        lines.push(format!(
            "gap {}: NotReady in {:.0}% of failovers with failureThreshold 1, {:.0}% with the chart's {} \
             (failureThreshold {} would ride it out)",
            secs(gap),
            100.0 * p1,
            100.0 * pc,
            rp.failure_threshold,
            n
        ));
    }
    assert!(
        rp.failure_threshold >= 2,
        "the chart's router readiness {rp:?}"
    );
    eprintln!(
        "router readinessProbe (period {}) over a failover gap: {}",
        secs(rp.period),
        lines.join("; ")
    );
}
