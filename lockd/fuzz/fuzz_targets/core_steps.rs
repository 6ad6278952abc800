//! Fuzz the pure core: random byte lines become requests (raw, and structured ones of every
//! protocol-2 op) of a few sessions, time steps, disconnects, durable-write acknowledgements
//! and crash-restarts, fed through `Core::step`. Nothing may panic, and every durable
//! snapshot must restore. The body is `../core_steps_driver.rs`, which the proptest
//! `core_steps_never_panic` in `lockd/tests/e2e/proto_proptest.rs` runs in CI.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../core_steps_driver.rs"]
mod core_steps_driver;

fuzz_target!(|data: &[u8]| {
    core_steps_driver::run(data);
});
