//! The QURD model (issue 12, point 4b): the seed's example answered, the global order never
//! deadlocks nor livelocks, stateright agrees with the graph analysis, the committed table
//! is current.

use lockd_model::check_bfs;
use lockd_model::qurd_model::{
    analyse, document, reserved_in, table_configs, Agent, Fault, Phase, QurdModel, Strategy,
};

fn seed(strategy: Strategy, fault: Fault) -> QurdModel {
    QurdModel::new(3, vec![3, 2], strategy, fault)
}

#[test]
fn the_seed_example_deadlocks_with_wait_and_no_timeout() {
    let v = analyse(&seed(Strategy::WaitNoTimeout, Fault::None));
    let t = v.deadlock.expect("a deadlock");
    let last = &t.prefix.last().expect("a path").1;
    // One job got 2 agents, the other 1, nobody starts.
    assert_eq!(reserved_in(last).len(), 3, "{t}");
    let mut held: Vec<u32> = last
        .jobs
        .iter()
        .map(|p| match p {
            Phase::Reserving { held, .. } => held.count_ones(),
            _ => 99,
        })
        .collect();
    held.sort_unstable();
    assert_eq!(held, vec![1, 2], "{t}");
    assert!(!v.all_complete && !v.can_always_complete);
}

#[test]
fn the_seeds_cancel_turns_the_deadlock_into_a_livelock() {
    let v = analyse(&seed(Strategy::WaitTimeout, Fault::None));
    assert!(v.deadlock.is_none());
    assert!(v.can_always_complete, "some path still completes");
    let t = v.livelock.expect("a livelock");
    assert!(!t.cycle.is_empty(), "the cycle is shown");
    assert!(t.cycle.iter().all(|(_, s)| !s.all_done()));
    // Fail semantics (retried) livelock too.
    assert!(analyse(&seed(Strategy::Fail, Fault::None))
        .livelock
        .is_some());
}

#[test]
fn the_global_order_completes_every_job_under_every_fault() {
    for (agents, needs) in table_configs() {
        for fault in Fault::ALL {
            let m = QurdModel::new(agents, needs.clone(), Strategy::WaitOrdered, fault);
            let v = analyse(&m);
            assert!(
                v.all_complete && v.can_always_complete,
                "{agents} agents {needs:?} {fault:?}: deadlock {:?} livelock {:?}",
                v.deadlock.map(|t| t.to_string()),
                v.livelock.map(|t| t.to_string())
            );
            assert!(v.states > 10, "{} states", v.states);
        }
    }
}

#[test]
fn a_replacement_held_and_waited_breaks_the_order() {
    let v = analyse(&seed(Strategy::WaitOrderedNaiveReplace, Fault::AgentCrash));
    let t = v.deadlock.expect("a deadlock");
    let last = &t.prefix.last().expect("a path").1;
    assert!(last
        .jobs
        .iter()
        .any(|p| matches!(p, Phase::Running { missing: 1, .. })));
    assert!(last
        .agents
        .iter()
        .any(|a| matches!(a, Agent::Reserved { .. })));
}

#[test]
fn stateright_agrees_with_the_graph_analysis() {
    for strategy in Strategy::ALL {
        for fault in [Fault::None, Fault::AgentCrash] {
            let m = seed(strategy, fault);
            let v = analyse(&m);
            let r = check_bfs(m, 1000, 1, None);
            println!(
                "{strategy:?} {fault:?}: {} states ({} by stateright), deadlock {}",
                v.states,
                r.unique,
                v.deadlock.is_some()
            );
            assert_eq!(r.unique, v.states, "{strategy:?} {fault:?}");
            assert_eq!(
                r.discovery("no deadlock").is_some(),
                v.deadlock.is_some(),
                "{strategy:?} {fault:?}"
            );
            // Some interleaving completes every job in each of these configurations.
            assert!(
                r.discovery("all jobs complete").is_some(),
                "{strategy:?} {fault:?}"
            );
        }
    }
}

#[test]
fn qurd_doc_is_up_to_date() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/qurd-model.md");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == document(),
        "docs/qurd-model.md is stale: run `cargo run -p lockd-model --example qurd_table`"
    );
}
