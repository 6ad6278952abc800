//! placeholder (moved here from tests/src/bin/fake-engine.rs)
