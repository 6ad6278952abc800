//! A model of QURD (seed `003_335a15efe53bf7f2`): independent per-resource agents, each
//! with one resource (available → reserved → running → available, or dead), and jobs that
//! each need `k` of the resources, reserving them one agent at a time with no central
//! component.
//!
//! **Time** follows the seed's time Petri nets: every client and agent step is urgent (fires
//! at once, in any interleaving), and time passes ([`QAction::Tick`]) only when no such step
//! is enabled. A tick ages reservations (an agent cancels a reservation that stayed
//! `reserved` for [`RESERVE_TIMEOUT`] ticks, the seed's `cancel`, and the client learns it),
//! runs jobs (a job finishes [`RUN_TICKS`] ticks after it started) and revives dead agents
//! (after [`REVIVE_TICKS`]).
//!
//! **Strategies** ([`Strategy`]):
//! * `Fail`: one round asks every agent (in any order) until `k` answered OK; with fewer,
//!   release everything and retry at once (the seed's fail semantics, retried);
//! * `WaitNoTimeout`: ask any available agent until `k` are held, waiting while none is
//!   available; reservations never time out (the seed's wait semantics without `cancel`);
//! * `WaitTimeout`: the same, with the agents' reserved-timeout `cancel` (the seed);
//! * `WaitOrdered`: lockd's rule: agents are asked in increasing index order; a job waits
//!   for the next agent in order while it is busy, or skips it if enough agents remain after
//!   it; reservations are connection-bound leases (no timeout: a client crash or a lost
//!   connection releases them at once, and the client then starts over).
//!
//! **Faults** ([`Fault`], at most one per run): a lost answer (the agent reserved, the client
//! never heard; with `WaitOrdered` a lost message breaks the connection instead), a client
//! crash while reserving (it restarts its job from nothing), an agent crash while reserved
//! or running (the job is told; the seed's failure detector gives a running job a
//! replacement agent as soon as one is available).
//!
//! [`analyse`] explores the whole (finite) state graph and answers, for one configuration:
//! do all jobs complete on every path (no deadlock and no livelock), is a deadlock
//! reachable (a state, not all done, where nothing but time can happen and time changes
//! nothing), is a livelock reachable (a cycle of states, not all done: a strongly connected
//! component of two states or more; a job's completion is irreversible, so no job completes
//! on such a cycle), with a trace for each "no".

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fmt;

use stateright::{Model, Property};

/// Ticks an agent keeps a reservation before it cancels it (`WaitTimeout`, `Fail`).
pub const RESERVE_TIMEOUT: u8 = 2;
/// Ticks a job runs.
pub const RUN_TICKS: u8 = 1;
/// Ticks a dead agent takes to come back.
pub const REVIVE_TICKS: u8 = 1;

/// How jobs reserve their resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// All-or-nothing rounds, released and retried on shortfall.
    Fail,
    /// Wait for agents, reservations never cancelled.
    WaitNoTimeout,
    /// Wait for agents, reservations cancelled after [`RESERVE_TIMEOUT`] ticks.
    WaitTimeout,
    /// Wait in increasing agent order (skip a busy agent only if enough remain after it),
    /// connection-bound reservations.
    WaitOrdered,
    /// `WaitOrdered`, but a running job that lost an agent waits for a replacement while it
    /// keeps the others (the seed's failure detector as is).
    WaitOrderedNaiveReplace,
}

impl Strategy {
    /// Every strategy, in table order.
    pub const ALL: [Strategy; 5] = [
        Strategy::Fail,
        Strategy::WaitNoTimeout,
        Strategy::WaitTimeout,
        Strategy::WaitOrdered,
        Strategy::WaitOrderedNaiveReplace,
    ];

    /// Short name for the table.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Fail => "fail (retry)",
            Strategy::WaitNoTimeout => "wait, no timeout",
            Strategy::WaitTimeout => "wait + reserved-timeout cancel",
            Strategy::WaitOrdered => "wait + global order",
            Strategy::WaitOrderedNaiveReplace => "wait + global order, replacement held-and-waited",
        }
    }

    fn ordered(self) -> bool {
        matches!(
            self,
            Strategy::WaitOrdered | Strategy::WaitOrderedNaiveReplace
        )
    }

    fn cancels(self) -> bool {
        matches!(self, Strategy::Fail | Strategy::WaitTimeout)
    }
}

/// The fault a run may suffer once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// No fault.
    None,
    /// One message lost.
    Loss,
    /// One client crash while reserving.
    ClientCrash,
    /// One agent crash while reserved or running.
    AgentCrash,
}

impl Fault {
    /// Every fault, in table order.
    pub const ALL: [Fault; 4] = [
        Fault::None,
        Fault::Loss,
        Fault::ClientCrash,
        Fault::AgentCrash,
    ];

    /// Short name for the table.
    pub fn name(self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::Loss => "1 message lost",
            Fault::ClientCrash => "1 client crash",
            Fault::AgentCrash => "1 agent crash",
        }
    }
}

/// One agent's resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Agent {
    /// Free.
    Available,
    /// Reserved for a job for `age` ticks.
    Reserved {
        /// The job.
        job: u8,
        /// Ticks so far.
        age: u8,
    },
    /// Running a job's process.
    Running {
        /// The job.
        job: u8,
    },
    /// Crashed, back after [`REVIVE_TICKS`].
    Dead {
        /// Ticks so far.
        age: u8,
    },
}

/// One job's client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Reserving: agents it knows it holds, agents asked this round (`Fail`), next agent in
    /// order (`WaitOrdered`).
    Reserving {
        /// Bit set of agents it holds (as far as it knows).
        held: u16,
        /// Bit set of agents asked this round (`Fail`).
        asked: u16,
        /// Next agent to ask (`WaitOrdered`).
        next: u8,
    },
    /// Running on its agents (bit set), `left` ticks to go; `missing` processes wait for a
    /// replacement agent.
    Running {
        /// Agents running it.
        on: u16,
        /// Ticks to go.
        left: u8,
        /// Processes to restart elsewhere (an agent died).
        missing: u8,
    },
    /// `Fail`: gave up this round; asks again after the next tick (a client that retried
    /// at once would keep time from passing).
    Backoff,
    /// Finished.
    Done,
}

/// A state of the QURD model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct QState {
    /// The agents.
    pub agents: Vec<Agent>,
    /// The jobs.
    pub jobs: Vec<Phase>,
    /// Faults left to inject.
    pub faults_left: u8,
}

impl QState {
    /// Every job finished.
    pub fn all_done(&self) -> bool {
        self.jobs.iter().all(|j| *j == Phase::Done)
    }
}

/// A step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QAction {
    /// Job `j` asks agent `r` (OK if available, KO otherwise).
    Ask(u8, u8),
    /// Job `j` asks agent `r`, which reserves, and the answer is lost.
    AskLost(u8, u8),
    /// `WaitOrdered`: job `j` skips the busy agent next in order.
    Skip(u8),
    /// Job `j` starts on the agents it holds.
    Launch(u8),
    /// `Fail`: job `j` got too few OKs this round: releases them and starts over.
    GiveUp(u8),
    /// `WaitOrdered`: the connection of job `j` to agent `r` breaks (a lost message).
    ConnectionLost(u8, u8),
    /// Job `j`'s client crashes while reserving and restarts.
    ClientCrash(u8),
    /// Agent `r` crashes.
    AgentCrash(u8),
    /// The failure detector restarts a process of job `j` on agent `r`.
    Replace(u8, u8),
    /// `WaitOrdered`: job `j` lost an agent and none is free: it releases the others and
    /// reserves again in order (waiting for a replacement while holding them could close a
    /// cycle with a job that reserves in order).
    Requeue(u8),
    /// Time passes.
    Tick,
}

/// One configuration: agents, the jobs' needs, the strategy, the fault.
#[derive(Debug, Clone)]
pub struct QurdModel {
    /// Number of agents (resources).
    pub agents: u8,
    /// What each job needs.
    pub needs: Vec<u8>,
    /// How jobs reserve.
    pub strategy: Strategy,
    /// The fault allowed once.
    pub fault: Fault,
}

fn bit(r: u8) -> u16 {
    1u16 << r
}

fn count(b: u16) -> u8 {
    u8::try_from(b.count_ones()).unwrap_or(u8::MAX)
}

const START: Phase = Phase::Reserving {
    held: 0,
    asked: 0,
    next: 0,
};

impl QurdModel {
    /// A configuration.
    pub fn new(agents: u8, needs: Vec<u8>, strategy: Strategy, fault: Fault) -> QurdModel {
        QurdModel {
            agents: agents.min(16),
            needs,
            strategy,
            fault,
        }
    }

    /// The steps that fire at once (everything but [`QAction::Tick`]).
    fn urgent(&self, s: &QState, out: &mut Vec<QAction>) {
        let n = self.agents;
        for (j, ph) in (0u8..).zip(&s.jobs) {
            let need = self.needs[usize::from(j)];
            match *ph {
                Phase::Reserving { held, asked, next } => {
                    if count(held) == need {
                        out.push(QAction::Launch(j));
                        continue;
                    }
                    match self.strategy {
                        Strategy::Fail => {
                            let unasked: Vec<u8> =
                                (0..n).filter(|r| (held | asked) & bit(*r) == 0).collect();
                            if unasked.is_empty() {
                                out.push(QAction::GiveUp(j));
                            }
                            for r in unasked {
                                out.push(QAction::Ask(j, r));
                                if s.faults_left > 0
                                    && self.fault == Fault::Loss
                                    && s.agents[usize::from(r)] == Agent::Available
                                {
                                    out.push(QAction::AskLost(j, r));
                                }
                            }
                        }
                        Strategy::WaitNoTimeout | Strategy::WaitTimeout => {
                            for r in 0..n {
                                if held & bit(r) == 0
                                    && s.agents[usize::from(r)] == Agent::Available
                                {
                                    out.push(QAction::Ask(j, r));
                                    if s.faults_left > 0 && self.fault == Fault::Loss {
                                        out.push(QAction::AskLost(j, r));
                                    }
                                }
                            }
                        }
                        Strategy::WaitOrdered | Strategy::WaitOrderedNaiveReplace => {
                            if next < n {
                                if s.agents[usize::from(next)] == Agent::Available {
                                    out.push(QAction::Ask(j, next));
                                } else if n - next > need - count(held) {
                                    out.push(QAction::Skip(j));
                                }
                            }
                            if s.faults_left > 0 && self.fault == Fault::Loss {
                                for r in 0..n {
                                    if held & bit(r) != 0 {
                                        out.push(QAction::ConnectionLost(j, r));
                                    }
                                }
                            }
                        }
                    }
                    if s.faults_left > 0 && self.fault == Fault::ClientCrash {
                        out.push(QAction::ClientCrash(j));
                    }
                }
                Phase::Running { missing, .. } if missing > 0 => {
                    let mut free = false;
                    for r in 0..n {
                        if s.agents[usize::from(r)] == Agent::Available {
                            out.push(QAction::Replace(j, r));
                            free = true;
                        }
                    }
                    if !free && self.strategy == Strategy::WaitOrdered {
                        out.push(QAction::Requeue(j));
                    }
                }
                _ => {}
            }
        }
        if s.faults_left > 0 && self.fault == Fault::AgentCrash {
            for r in 0..n {
                if matches!(
                    s.agents[usize::from(r)],
                    Agent::Reserved { .. } | Agent::Running { .. }
                ) {
                    out.push(QAction::AgentCrash(r));
                }
            }
        }
    }

    /// Free every agent reserved for job `j`.
    fn release_reserved(s: &mut QState, j: u8) {
        for a in &mut s.agents {
            if matches!(*a, Agent::Reserved { job, .. } if job == j) {
                *a = Agent::Available;
            }
        }
    }

    fn apply(&self, s: &mut QState, a: QAction) -> bool {
        match a {
            QAction::Ask(j, r) | QAction::AskLost(j, r) => {
                let lost = matches!(a, QAction::AskLost(..));
                let ok = s.agents[usize::from(r)] == Agent::Available;
                if ok {
                    s.agents[usize::from(r)] = Agent::Reserved { job: j, age: 0 };
                }
                if lost {
                    s.faults_left -= 1;
                }
                let Phase::Reserving { held, asked, next } = &mut s.jobs[usize::from(j)] else {
                    return false;
                };
                if ok && !lost {
                    *held |= bit(r);
                }
                match self.strategy {
                    Strategy::Fail => *asked |= bit(r),
                    Strategy::WaitOrdered | Strategy::WaitOrderedNaiveReplace => *next = r + 1,
                    _ => {}
                }
            }
            QAction::Skip(j) => {
                let Phase::Reserving { next, .. } = &mut s.jobs[usize::from(j)] else {
                    return false;
                };
                *next += 1;
            }
            QAction::Launch(j) => {
                let Phase::Reserving { held, .. } = s.jobs[usize::from(j)] else {
                    return false;
                };
                for r in 0..self.agents {
                    if held & bit(r) != 0 {
                        s.agents[usize::from(r)] = Agent::Running { job: j };
                    }
                }
                s.jobs[usize::from(j)] = Phase::Running {
                    on: held,
                    left: RUN_TICKS,
                    missing: 0,
                };
            }
            QAction::GiveUp(j) => {
                // The client frees the agents it knows it reserved (a reservation whose
                // answer was lost waits for its cancel).
                if let Phase::Reserving { held, .. } = s.jobs[usize::from(j)] {
                    for r in 0..self.agents {
                        if held & bit(r) != 0 {
                            s.agents[usize::from(r)] = Agent::Available;
                        }
                    }
                }
                s.jobs[usize::from(j)] = Phase::Backoff;
            }
            QAction::Requeue(j) => {
                // No replacement free: release every agent and reserve again in order.
                let Phase::Running { on, .. } = s.jobs[usize::from(j)] else {
                    return false;
                };
                for r in 0..self.agents {
                    if on & bit(r) != 0 {
                        s.agents[usize::from(r)] = Agent::Available;
                    }
                }
                s.jobs[usize::from(j)] = START;
            }
            QAction::ConnectionLost(j, _) => {
                // The lease of the broken connection ends; the client starts over in order.
                s.faults_left -= 1;
                Self::release_reserved(s, j);
                s.jobs[usize::from(j)] = START;
            }
            QAction::ClientCrash(j) => {
                s.faults_left -= 1;
                if self.strategy.ordered() {
                    // Connection-bound: the close releases at once.
                    Self::release_reserved(s, j);
                }
                // Otherwise its reservations stay until cancelled (or forever).
                s.jobs[usize::from(j)] = START;
            }
            QAction::AgentCrash(r) => {
                s.faults_left -= 1;
                match s.agents[usize::from(r)] {
                    Agent::Reserved { job, .. } => {
                        if let Phase::Reserving { held, .. } = &mut s.jobs[usize::from(job)] {
                            *held &= !bit(r);
                        }
                        if self.strategy.ordered() {
                            // The lease ends with the lost connection: start over in order.
                            Self::release_reserved(s, job);
                            s.jobs[usize::from(job)] = START;
                        }
                    }
                    Agent::Running { job } => {
                        if let Phase::Running { on, missing, .. } = &mut s.jobs[usize::from(job)] {
                            *on &= !bit(r);
                            *missing += 1;
                        }
                    }
                    _ => return false,
                }
                s.agents[usize::from(r)] = Agent::Dead { age: 0 };
            }
            QAction::Replace(j, r) => {
                let Phase::Running { on, missing, .. } = &mut s.jobs[usize::from(j)] else {
                    return false;
                };
                *on |= bit(r);
                *missing -= 1;
                s.agents[usize::from(r)] = Agent::Running { job: j };
            }
            QAction::Tick => self.tick(s),
        }
        true
    }

    fn tick(&self, s: &mut QState) {
        let cancels = self.strategy.cancels();
        for r in 0..self.agents {
            match &mut s.agents[usize::from(r)] {
                Agent::Reserved { job, age } if cancels => {
                    *age += 1;
                    if *age >= RESERVE_TIMEOUT {
                        let j = *job;
                        s.agents[usize::from(r)] = Agent::Available;
                        // The client learns of the cancel (the seed's `answered` token).
                        if let Phase::Reserving { held, .. } = &mut s.jobs[usize::from(j)] {
                            *held &= !bit(r);
                        }
                    }
                }
                Agent::Dead { age } => {
                    *age += 1;
                    if *age >= REVIVE_TICKS {
                        s.agents[usize::from(r)] = Agent::Available;
                    }
                }
                _ => {}
            }
        }
        for j in 0..s.jobs.len() {
            if s.jobs[j] == Phase::Backoff {
                s.jobs[j] = START;
            }
            if let Phase::Running { on, left, missing } = s.jobs[j] {
                if missing > 0 {
                    continue; // waits for its replacement agents
                }
                if left <= 1 {
                    for r in 0..self.agents {
                        if on & bit(r) != 0 {
                            s.agents[usize::from(r)] = Agent::Available;
                        }
                    }
                    s.jobs[j] = Phase::Done;
                } else {
                    s.jobs[j] = Phase::Running {
                        on,
                        left: left - 1,
                        missing,
                    };
                }
            }
        }
    }

    /// A state, not all done, where nothing can happen but time, and time changes nothing.
    pub fn is_deadlock(&self, s: &QState) -> bool {
        !s.all_done() && self.next_states(s).iter().all(|n| n == s)
    }
}

impl Model for QurdModel {
    type State = QState;
    type Action = QAction;

    fn init_states(&self) -> Vec<QState> {
        vec![QState {
            agents: vec![Agent::Available; usize::from(self.agents)],
            jobs: vec![START; self.needs.len()],
            faults_left: u8::from(self.fault != Fault::None),
        }]
    }

    fn actions(&self, s: &QState, out: &mut Vec<QAction>) {
        self.urgent(s, out);
        if out.is_empty() {
            out.push(QAction::Tick);
        }
    }

    fn next_state(&self, last: &QState, a: QAction) -> Option<QState> {
        let mut s = last.clone();
        self.apply(&mut s, a).then_some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("no deadlock", |m: &Self, s: &QState| !m.is_deadlock(s)),
            Property::sometimes("all jobs complete", |_: &Self, s: &QState| s.all_done()),
        ]
    }
}

/// A trace: the actions from the initial state, then (livelock) the cycle's actions.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// Actions and the state after each, from the initial state.
    pub prefix: Vec<(QAction, QState)>,
    /// Livelock: the actions of the cycle back to the last state of `prefix`.
    pub cycle: Vec<(QAction, QState)>,
}

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.prefix.is_empty() {
            writeln!(f, "  (the initial state)")?;
        }
        for (a, s) in &self.prefix {
            writeln!(f, "  {:<22} -> {}", format!("{a:?}"), show(s))?;
        }
        if !self.cycle.is_empty() {
            writeln!(f, "  -- cycle (repeats forever, no job completes) --")?;
            for (a, s) in &self.cycle {
                writeln!(f, "  {:<22} -> {}", format!("{a:?}"), show(s))?;
            }
        }
        Ok(())
    }
}

/// One line per state: agents, then jobs.
pub fn show(s: &QState) -> String {
    let agents: Vec<String> = s
        .agents
        .iter()
        .map(|a| match a {
            Agent::Available => "free".to_string(),
            Agent::Reserved { job, age } => format!("res(j{job},{age})"),
            Agent::Running { job } => format!("run(j{job})"),
            Agent::Dead { .. } => "dead".to_string(),
        })
        .collect();
    let jobs: Vec<String> = (0..)
        .zip(&s.jobs)
        .map(|(j, p): (u8, &Phase)| match p {
            Phase::Reserving { held, .. } => format!("j{j}:holds{{{}}}", bits(*held)),
            Phase::Running { missing, .. } if *missing > 0 => format!("j{j}:running-{missing}"),
            Phase::Running { .. } => format!("j{j}:running"),
            Phase::Backoff => format!("j{j}:backoff"),
            Phase::Done => format!("j{j}:done"),
        })
        .collect();
    format!("agents [{}] jobs [{}]", agents.join(" "), jobs.join(" "))
}

fn bits(b: u16) -> String {
    (0..16)
        .filter(|r| b & (1 << r) != 0)
        .map(|r| format!("r{r}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The answers for one configuration.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// Reachable states.
    pub states: usize,
    /// Transitions.
    pub edges: usize,
    /// All jobs complete on every path (no deadlock, no livelock).
    pub all_complete: bool,
    /// From every reachable state, a path still leads to all jobs done.
    pub can_always_complete: bool,
    /// A path to a deadlock, if one is reachable.
    pub deadlock: Option<Trace>,
    /// A path into a cycle and the cycle, if a livelock is reachable.
    pub livelock: Option<Trace>,
    /// A path to a state from which all jobs can no longer complete, if any.
    pub stuck: Option<Trace>,
}

/// Explore the whole state graph of `m` and answer its questions.
pub fn analyse(m: &QurdModel) -> Verdict {
    let mut index: HashMap<QState, usize> = HashMap::new();
    let mut states: Vec<QState> = Vec::new();
    let mut succ: Vec<Vec<(QAction, usize)>> = Vec::new();
    let mut parent: Vec<Option<(usize, QAction)>> = Vec::new();
    let mut queue = VecDeque::new();
    for s in m.init_states() {
        index.insert(s.clone(), states.len());
        states.push(s);
        parent.push(None);
        queue.push_back(states.len() - 1);
    }
    let mut edges = 0;
    while let Some(i) = queue.pop_front() {
        let mut acts = Vec::new();
        m.actions(&states[i], &mut acts);
        let mut out = Vec::new();
        for a in acts {
            let Some(n) = m.next_state(&states[i], a) else {
                continue;
            };
            let k = match index.get(&n) {
                Some(k) => *k,
                None => {
                    let k = states.len();
                    index.insert(n.clone(), k);
                    states.push(n);
                    parent.push(Some((i, a)));
                    succ.push(Vec::new());
                    queue.push_back(k);
                    k
                }
            };
            out.push((a, k));
            edges += 1;
        }
        while succ.len() < states.len() {
            succ.push(Vec::new());
        }
        succ[i] = out;
    }
    let path_to = |mut k: usize| {
        let mut p = Vec::new();
        while let Some((from, a)) = parent[k] {
            p.push((a, states[k].clone()));
            k = from;
        }
        p.reverse();
        p
    };
    let done: Vec<bool> = states.iter().map(QState::all_done).collect();
    // Deadlocks: not done, no successor but itself.
    let deadlock = (0..states.len())
        .find(|&i| !done[i] && succ[i].iter().all(|(_, k)| *k == i))
        .map(|i| Trace {
            prefix: path_to(i),
            cycle: Vec::new(),
        });
    // Backward reachability of "all done".
    let mut pred: Vec<Vec<usize>> = vec![Vec::new(); states.len()];
    for (i, out) in succ.iter().enumerate() {
        for (_, k) in out {
            pred[*k].push(i);
        }
    }
    let mut can = done.clone();
    let mut stack: Vec<usize> = (0..states.len()).filter(|i| done[*i]).collect();
    while let Some(k) = stack.pop() {
        for &p in &pred[k] {
            if !can[p] {
                can[p] = true;
                stack.push(p);
            }
        }
    }
    let stuck = (0..states.len()).find(|i| !can[*i]).map(|i| Trace {
        prefix: path_to(i),
        cycle: Vec::new(),
    });
    // Livelock: a strongly connected component of two states or more, none done.
    let comp = tarjan(&succ);
    let mut size: HashMap<usize, usize> = HashMap::new();
    for c in &comp {
        *size.entry(*c).or_default() += 1;
    }
    let livelock = (0..states.len())
        .find(|&i| !done[i] && size[&comp[i]] >= 2)
        .map(|i| Trace {
            prefix: path_to(i),
            cycle: cycle_through(i, &succ, &comp, &states),
        });
    Verdict {
        states: states.len(),
        edges,
        all_complete: deadlock.is_none() && livelock.is_none(),
        can_always_complete: stuck.is_none(),
        deadlock,
        livelock,
        stuck,
    }
}

/// A shortest cycle from `start` back to itself inside its component.
fn cycle_through(
    start: usize,
    succ: &[Vec<(QAction, usize)>],
    comp: &[usize],
    states: &[QState],
) -> Vec<(QAction, QState)> {
    let mut prev: HashMap<usize, (usize, QAction)> = HashMap::new();
    let mut q = VecDeque::from([start]);
    while let Some(i) = q.pop_front() {
        for (a, k) in &succ[i] {
            if comp[*k] != comp[start] || prev.contains_key(k) {
                continue;
            }
            prev.insert(*k, (i, *a));
            if *k == start {
                let mut p = Vec::new();
                let mut at = start;
                loop {
                    let (from, a) = prev[&at];
                    p.push((a, states[at].clone()));
                    at = from;
                    if at == start {
                        break;
                    }
                }
                p.reverse();
                return p;
            }
            q.push_back(*k);
        }
    }
    Vec::new()
}

/// Tarjan's strongly connected components (iterative): the component of each node.
fn tarjan(succ: &[Vec<(QAction, usize)>]) -> Vec<usize> {
    let n = succ.len();
    let mut index = vec![usize::MAX; n];
    let mut low = vec![0; n];
    let mut on = vec![false; n];
    let mut comp = vec![usize::MAX; n];
    let mut stack = Vec::new();
    let mut next = 0;
    let mut ncomp = 0;
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        let mut call: Vec<(usize, usize)> = vec![(root, 0)];
        index[root] = next;
        low[root] = next;
        next += 1;
        stack.push(root);
        on[root] = true;
        while let Some(&mut (v, ref mut ei)) = call.last_mut() {
            if let Some(&(_, w)) = succ[v].get(*ei) {
                *ei += 1;
                if index[w] == usize::MAX {
                    index[w] = next;
                    low[w] = next;
                    next += 1;
                    stack.push(w);
                    on[w] = true;
                    call.push((w, 0));
                } else if on[w] {
                    low[v] = low[v].min(index[w]);
                }
            } else {
                call.pop();
                if let Some(&(u, _)) = call.last() {
                    low[u] = low[u].min(low[v]);
                }
                if low[v] == index[v] {
                    while let Some(w) = stack.pop() {
                        on[w] = false;
                        comp[w] = ncomp;
                        if w == v {
                            break;
                        }
                    }
                    ncomp += 1;
                }
            }
        }
    }
    comp
}

/// The configurations of the table: (agents, needs).
pub fn table_configs() -> Vec<(u8, Vec<u8>)> {
    vec![
        (3, vec![3, 2]),
        (2, vec![2, 2]),
        (3, vec![2, 2]),
        (4, vec![3, 2, 2]),
    ]
}

/// The table (markdown) and the traces of every "no", for [`table_configs`] × strategies
/// × faults.
pub fn table_markdown() -> String {
    let mut rows = String::new();
    let mut traces = String::new();
    let yn = |b: bool| if b { "yes" } else { "**no**" };
    let found = |b: bool| if b { "**yes**" } else { "no" };
    let mut n = 0;
    for (agents, needs) in table_configs() {
        for fault in Fault::ALL {
            for strategy in Strategy::ALL {
                if strategy == Strategy::WaitOrderedNaiveReplace && fault != Fault::AgentCrash {
                    continue; // the same as WaitOrdered without agent crashes
                }
                let m = QurdModel::new(agents, needs.clone(), strategy, fault);
                let v = analyse(&m);
                n += 1;
                let id = format!("T{n}");
                let has_trace = !v.all_complete || !v.can_always_complete;
                rows.push_str(&format!(
                    "| {} | {:?} | {} | {} | {} | {} | {} | {} | {} |\n",
                    agents,
                    needs,
                    fault.name(),
                    strategy.name(),
                    yn(v.all_complete),
                    yn(v.can_always_complete),
                    found(v.deadlock.is_some()),
                    found(v.livelock.is_some()),
                    if has_trace {
                        format!("[{id}](#{})", id.to_lowercase())
                    } else {
                        format!("{} states", v.states)
                    },
                ));
                if has_trace {
                    traces.push_str(&format!(
                        "### {id}\n\n{agents} agents, needs {needs:?}, {}, {} ({} states, {} transitions)\n\n",
                        fault.name(),
                        strategy.name(),
                        v.states,
                        v.edges
                    ));
                    if let Some(t) = &v.deadlock {
                        traces.push_str(&format!("Deadlock:\n\n```\n{t}```\n\n"));
                    }
                    if let Some(t) = &v.livelock {
                        traces.push_str(&format!("Livelock:\n\n```\n{t}```\n\n"));
                    }
                    if let (Some(t), None) = (&v.stuck, &v.deadlock) {
                        traces.push_str(&format!(
                            "All jobs can no longer complete from here:\n\n```\n{t}```\n\n"
                        ));
                    }
                }
            }
        }
    }
    format!(
        "| agents | needs | fault | strategy | all jobs complete (every path) | can still complete (from every state) | deadlock | livelock | trace |\n|---|---|---|---|---|---|---|---|---|\n{rows}\n## Traces\n\nStates: `free`, `res(jJ,AGE)` reserved for job J for AGE ticks, `run(jJ)`, `dead`; a job `holds{{..}}` what it knows it reserved.\n\n{traces}"
    )
}

/// Used by tests: the set of agents a deadlocked state has reserved.
pub fn reserved_in(s: &QState) -> BTreeSet<u8> {
    (0u8..)
        .zip(&s.agents)
        .filter(|(_, a)| matches!(a, Agent::Reserved { .. }))
        .map(|(r, _)| r)
        .collect()
}

/// The whole `docs/qurd-model.md`: what is modelled and checked, then the table and traces.
pub fn document() -> String {
    format!("{}{}", DOC_HEADER, table_markdown())
}

const DOC_HEADER: &str = r#"# QURD model: do all jobs complete?

Generated by `cargo run -p lockd-model --example qurd_table` from
`lockd-model/src/qurd_model.rs`; the test `qurd_doc_is_up_to_date` fails when this file and
the model disagree. It answers the question the QURD seed (`003_335a15efe53bf7f2`, Coti,
Evangelista, Klai) leaves open after its time Petri nets: *under which conditions can all the
submitted jobs complete?*

## What is modelled

* **Agents**: one per resource, no central component. An agent is `free`, `reserved` for a
  job (with the ticks it has been so), `running` a job's process, or `dead` (back after 1
  tick). A request is answered OK (the agent becomes reserved for the asker) when it is free,
  KO otherwise.
* **Jobs**: each needs `k` agents (any `k`). A job reserves agents one request at a time,
  starts (`Launch`) once it holds `k`, runs 1 tick, and frees its agents.
* **Time** as in the seed's time Petri nets: every request, answer, release and restart is
  urgent (fires at once, in every interleaving); a `Tick` happens only when nothing else can.
  A tick ages reservations, runs jobs, revives dead agents.
* **Strategies**:
  * *fail (retry)*: a round asks every agent; with `k` OKs the job starts, with fewer it
    releases what it got and asks again after one tick (the seed's fail semantics; a client
    that retried at once would keep time from passing);
  * *wait, no timeout*: ask any free agent until `k` are held, wait while none is free;
    reservations never expire (the seed's wait semantics without `cancel`);
  * *wait + reserved-timeout cancel*: the same, and an agent cancels a reservation that
    stayed `reserved` for 2 ticks, telling the client (the seed's `cancel`, also used by
    *fail* for reservations whose answer was lost);
  * *wait + global order*: lockd's rule (`lockd reserve --semantics wait`): agents are asked
    in increasing order; a job waits for the next agent while it is busy, or skips it when
    enough agents remain after it; reservations are connection-bound leases (a crashed
    client's or a broken connection's reservations end at once, and the client starts over
    from the first agent); a running job that lost an agent takes a free replacement at once
    or, if none is free, releases its agents and reserves again in order;
  * *wait + global order, replacement held-and-waited*: the same, except that a running job
    that lost an agent keeps its others while it waits for a replacement (the seed's failure
    detector as is). Only in the rows with an agent crash (elsewhere it is the row above).
* **Faults**, at most one per run, at any moment it is possible: *1 message lost* (an OK
  answer lost: the agent reserved, the client never heard; with the global order a lost
  message breaks the connection, which ends that lease), *1 client crash* while reserving
  (it restarts its job from nothing), *1 agent crash* while reserved or running (the client
  is told; the seed's failure detector gives a running job a free agent when there is one).

## What is checked, exactly

Each configuration's state graph is finite and explored whole (every interleaving, no depth
bound; the number of states is in the table or the trace heading). The same model is also
run through stateright (`tests/qurd_model.rs`), which finds the same number of states and the
same deadlocks.

* **all jobs complete (every path)**: no deadlock and no livelock are reachable, so every
  maximal path, however the steps interleave, ends with every job done (*AF all-done*).
* **can still complete (from every state)**: from every reachable state some path still
  leads to all jobs done (*AG EF all-done*): "no" means some interleaving loses a job for
  good.
* **deadlock**: a reachable state, not all done, in which nothing but time can happen and
  time changes nothing.
* **livelock**: a reachable cycle of states, not all done (a strongly connected component
  of two states or more, found with Tarjan's algorithm). A job's completion cannot be undone,
  so no job completes on such a cycle: the interleaving that follows it forever starves
  every job. Randomised backoff makes following it forever improbable, not impossible; the
  global order removes the cycles altogether.

## The seed's example

3 agents, jobs needing 3 and 2 (first rows): with *wait, no timeout* one job gets 2 agents,
the other 1, and nobody starts: a deadlock ([T2](#t2)). The seed's `cancel` turns it into a
livelock ([T3](#t3)): both reservations time out together and the same split can come back
forever. *Fail* livelocks the same way. With the global order both jobs always complete,
with any one fault.

Found on the way: the failure detector's replacement is a hold-and-wait outside the order
(a running job keeps its agents and waits for one more); with the order that closes a cycle
with a job that reserves in order ([T17](#t17)). Releasing and reserving again in order when
no replacement is free removes it.

"#;
