//! Measure the bounded core-model runs:
//! `cargo run -p lockd-model --example core_probe -- [NAME-PART] [DEPTH]`.
use lockd_model::core_model::{ci_configs, CoreModel};

fn main() {
    let which = std::env::args().nth(1).unwrap_or_default();
    let depth: Option<usize> = std::env::args().nth(2).and_then(|a| a.parse().ok());
    for (name, cfg, d) in ci_configs() {
        if !which.is_empty() && !name.contains(&which) {
            continue;
        }
        let model = CoreModel::new(cfg.clone());
        let r = lockd_model::check_bfs(CoreModel::new(cfg), depth.unwrap_or(d), 2, None);
        for (n, path) in &r.discoveries {
            if *n != "a grant is told" {
                println!("{n}:\n{}", model.describe_path(path));
            }
        }
        println!(
            "{name}: depth {} states {} unique {} in {:?}; discoveries {:?}",
            r.depth,
            r.states,
            r.unique,
            r.elapsed,
            r.discoveries.iter().map(|d| d.0).collect::<Vec<_>>()
        );
    }
}
