//! Writes the QURD table to `docs/qurd-model.md` (or prints it with `--stdout`):
//! `cargo run -p lockd-model --example qurd_table`.

use std::time::Instant;

fn main() -> std::io::Result<()> {
    let start = Instant::now();
    let doc = lockd_model::qurd_model::document();
    if std::env::args().any(|a| a == "--stdout") {
        print!("{doc}");
    } else {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/qurd-model.md");
        std::fs::write(path, &doc)?;
        eprintln!("wrote {path} in {:.1?}", start.elapsed());
    }
    Ok(())
}
