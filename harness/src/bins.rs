//! Where the workspace's binaries are: next to the running executable.

use std::path::{Path, PathBuf};

/// Harness setup errors (test assertions panic instead).
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A binary is missing from the target dir.
    #[error("binary {0} not found: build the workspace binaries first (`cargo build --workspace --bins`; `cargo test --workspace` builds them too)")]
    MissingBinary(PathBuf),
    /// I/O failure.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Path of a workspace binary, `target/<profile>/<name>`, located from the running test
/// executable (`target/<profile>/deps/<test>-<hash>`) or a binary in `target/<profile>/`.
pub fn bin(name: &str) -> Result<PathBuf, HarnessError> {
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let p = dir.join(name);
    if p.is_file() {
        Ok(p)
    } else {
        Err(HarnessError::MissingBinary(p))
    }
}

/// Like [`bin`] but panics with the helpful message (for tests).
pub fn must_bin(name: &str) -> PathBuf {
    match bin(name) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    }
}
