//! gms-client: speaks the GPU Memory Service (GMS) protocol of Dynamo's
//! `gpu_memory_service` sidecar (see `docs/GMS-WIRE.md`), and provides
//!
//! * [`protocol`] / [`wire`]: every message, byte-exact msgpack framing, SCM_RIGHTS fds;
//! * [`lock`] / [`core`]: the server's pure lock state machine and store;
//! * `gmsd` (binary, [`server`]): a GMS server with `host` (memfd) and `cuda` backends;
//! * [`client`]: an async tokio client; [`backend`]: memory import (host mmap, CUDA VMM);
//! * [`verify`]: the checks behind `gmsctl verify`;
//! * [`checks`]: the GPU checks the supervisor runs around wake and reap;
//! * [`simdev`]: a simulated device shared across processes (a directory; `--gpu-sim`).
//!
//! CUDA and NVML are only ever called after a presence check (see README).

pub mod backend;
pub mod checks;
pub mod client;
pub mod core;
pub mod load;
pub mod lock;
pub mod protocol;
pub mod server;
pub mod simdev;
pub mod verify;
pub mod wire;
