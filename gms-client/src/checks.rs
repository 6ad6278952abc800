//! GPU checks the supervisor runs around wake and reap (issue 6 §5, Decisions 5–7).
//!
//! * [`GpuChecks::at_standby`]: remember the committed layout hash of the GMS.
//! * [`GpuChecks::before_wake`]: after the lock is granted, before `/wake_up`: the GMS still
//!   holds committed weights with that hash (Decision 6: a GMS that restarted empty while
//!   the shadow slept must fail fast, not hang the engine in a read-lock wait), and the
//!   device has the free memory the engine needs.
//! * [`GpuChecks::after_reap`]: after the dead engine was reaped, before the lock goes:
//!   the device no longer shows the engine's processes and its memory came back
//!   (Decision 7: memory is freed only when the last process holding it dies).
//!
//! Every wait is bounded. Without a GPU driver (NVML init fails) device checks are off;
//! that is logged once and the checks step aside. CUDA is never called here. With
//! `gpu_sim` (`--gpu-sim DIR`) the device is a [`DirDevice`] shared across processes
//! (testing/drills; format in [`crate::simdev`]) instead of NVML.
//!
//! Free memory before the wake ([`MinFree`], `--min-free-memory`) defaults to [`MinFree::Auto`]:
//! as much as the engine itself released when it went to sleep, measured on the device around
//! the sleep call ([`GpuChecks::note_sleep`]). Waking re-allocates exactly that (weights and KV
//! cache without GMS; the KV cache with GMS, whose weights stay in the GMS process), so it is
//! the memory that must be back before `/wake_up`, whatever the model size. This wait covers
//! the window in which the lock is already released but the dying engine's device memory is
//! not (the last process's descriptors are released one by one as it exits; a worker that
//! closed its inherited descriptors is invisible to the lock).
//!
//! PID namespaces: NVML reports pids as the host's PID namespace sees them. We match by pid
//! only when our own PID namespace is the host's (the initial namespace has the fixed inode
//! 0xEFFFFFFC, i.e. `/proc/self/ns/pid` reads `pid:[4026531836]`); otherwise we match by the
//! number of compute processes (against the count seen at `before_wake`) and by free memory
//! returning. Comparing with `/proc/1/ns/pid` is not enough: inside a container, pid 1 is
//! the container's init, in the same (non-host) namespace.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::backend::MemInfo;
use crate::client::{ClientError, ConnectOptions, GmsClient};
use crate::protocol::RequestedLockType;
use crate::simdev::DirDevice;

/// Inode of the initial (host) PID namespace in Linux (PROC_PID_INIT_INO).
pub const HOST_PID_NS_INODE: u64 = 0xEFFF_FFFC;

/// How pids of the engine are matched against the device's process list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PidNamespace {
    /// Detect from `/proc/self/ns/pid`.
    Auto,
    /// Our pids are the host's: match by pid.
    Host,
    /// Our pids differ from NVML's: match by count and memory.
    Foreign,
}

/// Free device memory the engine needs before it is woken (`--min-free-memory`), resolved
/// against the device's total at check time. Also a lower bound of `after_reap`'s target.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum MinFree {
    /// What the engine released when it last went to sleep (`auto`, the default); no wait if
    /// it never slept under this supervisor (a primary that went straight to Active).
    Auto,
    /// No wait (`0`, `off`).
    Off,
    /// This many bytes.
    Bytes(u64),
    /// This fraction of the device's total memory, in (0, 1] (`50%` is 0.5).
    Fraction(f64),
}

impl MinFree {
    /// The default wherever a device is configured (see the module docs).
    pub const DEFAULT: MinFree = MinFree::Auto;

    /// Bytes needed on a device with `total` bytes (0: no wait); `released_at_sleep` is what
    /// the engine released at its last sleep, if measured ([`MinFree::Auto`]).
    pub fn resolve(self, total: u64, released_at_sleep: Option<u64>) -> u64 {
        match self {
            MinFree::Auto => released_at_sleep.unwrap_or(0).min(total),
            MinFree::Off => 0,
            MinFree::Bytes(b) => b,
            MinFree::Fraction(f) if f.is_finite() => (total as f64 * f.clamp(0.0, 1.0)) as u64,
            MinFree::Fraction(_) => 0,
        }
    }
}

impl Default for MinFree {
    fn default() -> Self {
        MinFree::DEFAULT
    }
}

impl std::fmt::Display for MinFree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MinFree::Auto => write!(f, "auto"),
            MinFree::Off => write!(f, "off"),
            MinFree::Bytes(b) => write!(f, "{b} bytes"),
            MinFree::Fraction(x) => write!(f, "{}% of total", x * 100.0),
        }
    }
}

/// Configuration (the supervisor maps its flags onto it).
#[derive(Debug, Clone)]
pub struct ChecksConfig {
    /// `--gms SOCKET`: the weights GMS; None disables the GMS checks.
    pub gms_socket: Option<PathBuf>,
    /// `--gpu N`: NVML device index; None (and no `gpu_sim`) disables the device checks.
    pub gpu: Option<u32>,
    /// `--gpu-sim DIR`: a simulated device shared across processes ([`DirDevice`]) instead of
    /// NVML (testing/drills); wins over `gpu`. Its pids are this machine's: `Auto` matches by pid.
    pub gpu_sim: Option<PathBuf>,
    /// `--memory-release-timeout`: bound of `after_reap` and of the free-memory wait.
    pub memory_release_timeout: Duration,
    /// `--min-free-memory`: free memory the engine needs before it wakes (default
    /// [`MinFree::Auto`]: what the engine released at its last sleep); also a lower bound of
    /// the after-reap target.
    pub min_free_memory: MinFree,
    /// Bound of every GMS interaction in `at_standby` / `before_wake`.
    pub handshake_timeout: Duration,
    /// Device polling period.
    pub poll_interval: Duration,
    /// Slack when comparing free memory (drivers move a few MiB around).
    pub memory_tolerance: u64,
    /// PID namespace handling (tests force Host/Foreign).
    pub pid_namespace: PidNamespace,
}

impl Default for ChecksConfig {
    fn default() -> Self {
        Self {
            gms_socket: None,
            gpu: None,
            gpu_sim: None,
            memory_release_timeout: Duration::from_secs(30),
            min_free_memory: MinFree::DEFAULT,
            handshake_timeout: Duration::from_secs(30),
            poll_interval: Duration::from_millis(100),
            memory_tolerance: 64 << 20,
            pid_namespace: PidNamespace::Auto,
        }
    }
}

/// One compute process on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GpuProcess {
    /// Pid as NVML reports it (host namespace).
    pub pid: u32,
    /// Device memory it uses, when the driver says.
    pub used_bytes: Option<u64>,
}

/// A GPU as the checks see it.
pub trait Device: Send + Sync {
    /// For logs.
    fn describe(&self) -> String;
    /// Compute processes on the device.
    fn compute_processes(&self) -> Result<Vec<GpuProcess>, String>;
    /// Free/total memory.
    fn memory(&self) -> Result<MemInfo, String>;
}

/// NVML-backed device.
pub struct NvmlDevice {
    /// The loaded library.
    nvml: nvml_wrapper::Nvml,
    /// Device index.
    index: u32,
}

impl NvmlDevice {
    /// `Nvml::init()` + the device by index. Errors when there is no driver.
    pub fn open(index: u32) -> Result<Self, String> {
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| format!("NVML init: {e}"))?;
        nvml.device_by_index(index)
            .map_err(|e| format!("NVML device {index}: {e}"))?;
        Ok(Self { nvml, index })
    }
}

impl Device for NvmlDevice {
    fn describe(&self) -> String {
        format!("nvml:{}", self.index)
    }
    fn compute_processes(&self) -> Result<Vec<GpuProcess>, String> {
        let d = self
            .nvml
            .device_by_index(self.index)
            .map_err(|e| e.to_string())?;
        let procs = d.running_compute_processes().map_err(|e| e.to_string())?;
        Ok(procs
            .into_iter()
            .map(|p| GpuProcess {
                pid: p.pid,
                used_bytes: match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                },
            })
            .collect())
    }
    fn memory(&self) -> Result<MemInfo, String> {
        let d = self
            .nvml
            .device_by_index(self.index)
            .map_err(|e| e.to_string())?;
        let m = d.memory_info().map_err(|e| e.to_string())?;
        Ok(MemInfo {
            free: m.free,
            total: m.total,
        })
    }
}

/// A device whose process list and free memory tests control.
#[derive(Debug)]
pub struct SimulatedDevice {
    /// (processes, memory).
    state: Mutex<(Vec<GpuProcess>, MemInfo)>,
}

impl SimulatedDevice {
    /// A device with `total` bytes, all free, no processes.
    pub fn new(total: u64) -> Self {
        Self {
            state: Mutex::new((Vec::new(), MemInfo { free: total, total })),
        }
    }
    fn with<R>(&self, f: impl FnOnce(&mut (Vec<GpuProcess>, MemInfo)) -> R) -> R {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }
    /// A process starts using `bytes`.
    pub fn add_process(&self, pid: u32, bytes: u64) {
        self.with(|(p, m)| {
            p.push(GpuProcess {
                pid,
                used_bytes: Some(bytes),
            });
            m.free = m.free.saturating_sub(bytes);
        });
    }
    /// A process leaves; its memory returns.
    pub fn remove_process(&self, pid: u32) {
        self.with(|(p, m)| {
            let freed: u64 = p
                .iter()
                .filter(|x| x.pid == pid)
                .filter_map(|x| x.used_bytes)
                .sum();
            p.retain(|x| x.pid != pid);
            m.free = (m.free + freed).min(m.total);
        });
    }
    /// A process leaves the list but its memory stays pinned (another handle holds it).
    pub fn remove_process_keep_memory(&self, pid: u32) {
        self.with(|(p, _)| p.retain(|x| x.pid != pid));
    }
    /// Sets free memory directly.
    pub fn set_free(&self, free: u64) {
        self.with(|(_, m)| m.free = free.min(m.total));
    }
}

impl Device for SimulatedDevice {
    fn describe(&self) -> String {
        "simulated".into()
    }
    fn compute_processes(&self) -> Result<Vec<GpuProcess>, String> {
        Ok(self.with(|(p, _)| p.clone()))
    }
    fn memory(&self) -> Result<MemInfo, String> {
        Ok(self.with(|(_, m)| *m))
    }
}

/// The committed layout as seen at Standby.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayoutSnapshot {
    /// Hash of the committed layout.
    pub memory_layout_hash: String,
    /// Allocations in it.
    pub allocation_count: u64,
}

/// What `before_wake` saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WakeReport {
    /// The layout checked (None without --gms).
    pub layout: Option<LayoutSnapshot>,
    /// Free device memory at the end (None without a device).
    pub free_memory: Option<u64>,
    /// Time spent.
    pub waited: Duration,
}

/// How `after_reap` identified the engine on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum MatchMode {
    /// By pid (namespaces agree).
    Pid,
    /// By compute-process count against the before_wake baseline, and memory.
    Count,
    /// Only by free memory (no baseline to count against).
    MemoryOnly,
    /// No device: nothing checked.
    NoDevice,
}

/// What `after_reap` saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReapReport {
    /// How the engine was matched.
    pub matched_by: MatchMode,
    /// Time spent.
    pub waited: Duration,
    /// Device samples taken.
    pub samples: u32,
    /// Engine processes seen on the device (pid mode: matching pids at the first sample;
    /// count mode: processes above the expected count at the first sample).
    pub engine_processes_seen: usize,
    /// Free memory at the first sample.
    pub free_before: Option<u64>,
    /// Free memory at the last sample.
    pub free_after: Option<u64>,
}

/// Counters for /metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CheckCounters {
    /// before_wake calls.
    pub wake_checks: u64,
    /// before_wake failures.
    pub wake_failures: u64,
    /// after_reap calls.
    pub reap_checks: u64,
    /// after_reap timeouts.
    pub reap_timeouts: u64,
    /// Engine processes seen on the device across reaps.
    pub engine_processes_seen: u64,
}

/// Why a check failed; each variant names the cause.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    /// No GMS answers (or it closed the connection).
    #[error("GMS at {socket} unreachable: {cause}")]
    GmsUnreachable {
        /// The socket.
        socket: PathBuf,
        /// The failure.
        cause: String,
    },
    /// The GMS holds no committed weights (e.g. it restarted empty while we slept).
    #[error("GMS holds no committed weights (state {state}); it restarted or the writer died")]
    GmsNotCommitted {
        /// Its state.
        state: String,
    },
    /// The read lock was not granted in time.
    #[error("GMS read lock not granted within {after:?}")]
    GmsLockTimeout {
        /// The wait.
        after: Duration,
    },
    /// The committed layout differs from the one seen at Standby (stale weights).
    #[error("GMS layout changed since standby: expected hash {expected}, found {found}")]
    StaleLayout {
        /// Hash (and count) remembered at Standby.
        expected: String,
        /// Hash (and count) now.
        found: String,
    },
    /// Not enough free device memory in time.
    #[error("device has {free} bytes free, engine needs {need}, waited {after:?}")]
    InsufficientFreeMemory {
        /// Bytes needed.
        need: u64,
        /// Bytes free at the end.
        free: u64,
        /// The wait.
        after: Duration,
    },
    /// The dead engine's processes or memory did not leave the device in time.
    #[error(
        "engine memory not released within {after:?}: pids still on device {pids_still_present:?}, \
         {compute_processes} compute processes, {free} bytes free (target {target})"
    )]
    MemoryNotReleased {
        /// Engine pids still listed (pid mode).
        pids_still_present: Vec<u32>,
        /// Compute processes listed at the end.
        compute_processes: usize,
        /// Free bytes at the end.
        free: u64,
        /// Free bytes we waited for.
        target: u64,
        /// The wait.
        after: Duration,
    },
    /// A device query failed.
    #[error("device query failed: {0}")]
    Device(String),
}

/// Device state remembered at before_wake, the reference for after_reap.
#[derive(Debug, Clone, Copy)]
struct Baseline {
    /// Compute processes listed just before the wake (the engine's included).
    processes: usize,
    /// Free memory just before the wake.
    free: u64,
}

/// The checks; share it in an `Arc`.
pub struct GpuChecks {
    /// Configuration.
    cfg: ChecksConfig,
    /// The device, when device checks are on.
    device: Option<Arc<dyn Device>>,
    /// Layout remembered at Standby.
    remembered: Mutex<Option<LayoutSnapshot>>,
    /// Device state at the last before_wake.
    baseline: Mutex<Option<Baseline>>,
    /// before_wake calls (for /metrics: how often a wake was gated).
    wake_checks: AtomicU64,
    /// before_wake failures (each one kept an engine from waking into a hang/OOM).
    wake_failures: AtomicU64,
    /// after_reap calls.
    reap_checks: AtomicU64,
    /// after_reap timeouts (memory still pinned: Decision 7's hazard, seen in the field).
    reap_timeouts: AtomicU64,
    /// Engine processes seen on the device when reaping (orphans that kept the GPU).
    engine_processes_seen: AtomicU64,
    /// Bytes the engine released at its last sleep (for [`MinFree::Auto`]).
    released_at_sleep: Mutex<Option<u64>>,
}

impl std::fmt::Debug for GpuChecks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuChecks")
            .field("cfg", &self.cfg)
            .field("device", &self.device.as_ref().map(|d| d.describe()))
            .field("remembered", &self.remembered_layout())
            .field("counters", &self.counters())
            .finish()
    }
}

impl std::fmt::Debug for NvmlDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NvmlDevice({})", self.index)
    }
}

static NO_DEVICE_LOGGED: Once = Once::new();
static SIM_DEVICE_LOGGED: Once = Once::new();

/// True when this process runs in the host's PID namespace.
pub fn in_host_pid_namespace() -> bool {
    std::fs::read_link("/proc/self/ns/pid").is_ok_and(|p| is_host_pid_ns_link(&p.to_string_lossy()))
}

/// Whether a `/proc/PID/ns/pid` link text (`pid:[INODE]`) names the host's (initial) PID
/// namespace, whose inode is fixed ([`HOST_PID_NS_INODE`]).
pub fn is_host_pid_ns_link(link: &str) -> bool {
    link.strip_prefix("pid:[")
        .and_then(|r| r.strip_suffix(']'))
        .and_then(|n| n.parse::<u64>().ok())
        == Some(HOST_PID_NS_INODE)
}

impl GpuChecks {
    /// Opens NVML when `cfg.gpu` is set; without a driver device checks are off (logged once).
    /// With `cfg.gpu_sim` the device is a [`DirDevice`] on that directory instead (logged
    /// once; it wins over `cfg.gpu`), and `PidNamespace::Auto` matches by pid.
    pub fn new(mut cfg: ChecksConfig) -> Self {
        if let Some(dir) = cfg.gpu_sim.clone() {
            SIM_DEVICE_LOGGED.call_once(|| {
                info!(dir = %dir.display(), ignored_gpu = ?cfg.gpu, min_free_memory = %cfg.min_free_memory,
                      "GPU device checks on a SIMULATED device (--gpu-sim), not NVML");
            });
            if cfg.pid_namespace == PidNamespace::Auto {
                // The pids in DIR are this machine's pids, as /proc shows them to us.
                cfg.pid_namespace = PidNamespace::Host;
            }
            let dev: Arc<dyn Device> = Arc::new(DirDevice::new(dir));
            return Self::with_device(cfg, Some(dev));
        }
        let device: Option<Arc<dyn Device>> = match cfg.gpu {
            None => None,
            Some(i) => match NvmlDevice::open(i) {
                Ok(d) => Some(Arc::new(d)),
                Err(e) => {
                    NO_DEVICE_LOGGED.call_once(|| {
                        warn!(gpu = i, error = %e, "no GPU driver/NVML: GPU device checks are off");
                    });
                    None
                }
            },
        };
        Self::with_device(cfg, device)
    }

    /// With a given device (tests pass a [`SimulatedDevice`]).
    pub fn with_device(cfg: ChecksConfig, device: Option<Arc<dyn Device>>) -> Self {
        Self {
            cfg,
            device,
            remembered: Mutex::new(None),
            baseline: Mutex::new(None),
            wake_checks: AtomicU64::new(0),
            wake_failures: AtomicU64::new(0),
            reap_checks: AtomicU64::new(0),
            reap_timeouts: AtomicU64::new(0),
            engine_processes_seen: AtomicU64::new(0),
            released_at_sleep: Mutex::new(None),
        }
    }

    /// Free device memory now (None without a device, or if the device cannot say).
    pub fn free_memory_now(&self) -> Option<u64> {
        self.device.as_ref()?.memory().ok().map(|m| m.free)
    }

    /// Free and total device memory now: None without a device, `Err` when the device cannot
    /// say (the supervisor's `--init-min-free-memory` wait samples this).
    pub fn device_memory(&self) -> Option<Result<MemInfo, String>> {
        self.device.as_ref().map(|d| d.memory())
    }

    /// Record the free device memory sampled right before and right after the engine went to
    /// sleep: the difference is what it released, and what [`MinFree::Auto`] waits for before
    /// the next wake. Another engine allocating meanwhile makes it smaller (the wait is then
    /// less strict), never larger than what came free.
    pub fn note_sleep(&self, before: Option<u64>, after: Option<u64>) {
        let (Some(b), Some(a)) = (before, after) else {
            return;
        };
        let released = a.saturating_sub(b);
        info!(
            free_before = b,
            free_after = a,
            released,
            "engine asleep: device memory it released (needed back before it wakes)"
        );
        *self
            .released_at_sleep
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(released);
    }

    /// What the engine released at its last sleep, if measured.
    pub fn released_at_sleep(&self) -> Option<u64> {
        *self
            .released_at_sleep
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes that must be free before waking (`--min-free-memory`; `auto` less the tolerance).
    fn min_free_need(&self, total: u64) -> u64 {
        let need = self
            .cfg
            .min_free_memory
            .resolve(total, self.released_at_sleep());
        if self.cfg.min_free_memory == MinFree::Auto {
            need.saturating_sub(self.cfg.memory_tolerance)
        } else {
            need
        }
    }

    /// Device checks are on.
    pub fn device_checks_enabled(&self) -> bool {
        self.device.is_some()
    }

    /// The layout remembered at Standby.
    pub fn remembered_layout(&self) -> Option<LayoutSnapshot> {
        self.remembered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Counter snapshot.
    pub fn counters(&self) -> CheckCounters {
        CheckCounters {
            wake_checks: self.wake_checks.load(Ordering::Relaxed),
            wake_failures: self.wake_failures.load(Ordering::Relaxed),
            reap_checks: self.reap_checks.load(Ordering::Relaxed),
            reap_timeouts: self.reap_timeouts.load(Ordering::Relaxed),
            engine_processes_seen: self.engine_processes_seen.load(Ordering::Relaxed),
        }
    }

    fn unreachable(&self, e: ClientError) -> CheckError {
        CheckError::GmsUnreachable {
            socket: self.cfg.gms_socket.clone().unwrap_or_default(),
            cause: e.to_string(),
        }
    }

    async fn connect(
        &self,
        socket: &std::path::Path,
        budget: Duration,
    ) -> Result<GmsClient, CheckError> {
        let opts = ConnectOptions {
            connect_timeout: budget,
            retry_interval: Duration::from_millis(50),
            rpc_timeout: budget,
        };
        GmsClient::connect(socket, opts)
            .await
            .map_err(|e| self.unreachable(e))
    }

    /// Standby: remembers the committed layout. Ok(None) without `--gms`.
    pub async fn at_standby(&self) -> Result<Option<LayoutSnapshot>, CheckError> {
        let Some(socket) = self.cfg.gms_socket.clone() else {
            return Ok(None);
        };
        let limit = self.cfg.handshake_timeout;
        let fut = async {
            // Half the budget for connecting, so that a vanished GMS is reported as
            // unreachable rather than as a timeout.
            let mut c = self.connect(&socket, limit / 2).await?;
            let rs = c.runtime_state().await.map_err(|e| self.unreachable(e))?;
            if !rs.committed {
                return Err(CheckError::GmsNotCommitted { state: rs.state });
            }
            Ok(LayoutSnapshot {
                memory_layout_hash: rs.memory_layout_hash,
                allocation_count: rs.allocation_count,
            })
        };
        let snap = tokio::time::timeout(limit, fut)
            .await
            .map_err(|_| CheckError::GmsLockTimeout { after: limit })??;
        info!(hash = %snap.memory_layout_hash, allocations = snap.allocation_count,
              "gms check: remembered committed layout at standby");
        *self.remembered.lock().unwrap_or_else(|p| p.into_inner()) = Some(snap.clone());
        Ok(Some(snap))
    }

    async fn check_gms(&self, socket: PathBuf) -> Result<LayoutSnapshot, CheckError> {
        let limit = self.cfg.handshake_timeout;
        let start = Instant::now();
        // Half the budget for connecting (see at_standby).
        let mut c = self.connect(&socket, limit / 2).await?;
        // Fast path: a restarted-empty GMS is visible without any lock.
        let rs = c.runtime_state().await.map_err(|e| self.unreachable(e))?;
        if !rs.committed {
            return Err(CheckError::GmsNotCommitted { state: rs.state });
        }
        let left = limit.saturating_sub(start.elapsed());
        let hs = c
            .handshake(RequestedLockType::Ro, Some(left))
            .await
            .map_err(|e| match e {
                ClientError::Timeout { .. } => CheckError::GmsLockTimeout { after: limit },
                e => self.unreachable(e),
            })?;
        if !hs.success {
            return Err(if hs.committed {
                CheckError::GmsLockTimeout { after: limit }
            } else {
                CheckError::GmsNotCommitted {
                    state: "not committed".into(),
                }
            });
        }
        let hash = c
            .memory_layout_hash()
            .await
            .map_err(|e| self.unreachable(e))?;
        let count = c
            .allocation_count()
            .await
            .map_err(|e| self.unreachable(e))?;
        // Dropping the client closes the connection: the read lock is released at once.
        drop(c);
        Ok(LayoutSnapshot {
            memory_layout_hash: hash,
            allocation_count: count,
        })
    }

    /// Before `/wake_up` (see the module docs and CONTRACTS.md).
    pub async fn before_wake(&self) -> Result<WakeReport, CheckError> {
        self.wake_checks.fetch_add(1, Ordering::Relaxed);
        let r = self.before_wake_inner().await;
        match &r {
            Ok(rep) => info!(?rep, "gpu check before wake: ok"),
            Err(e) => {
                self.wake_failures.fetch_add(1, Ordering::Relaxed);
                warn!(cause = %e, "gpu check before wake failed");
            }
        }
        r
    }

    async fn before_wake_inner(&self) -> Result<WakeReport, CheckError> {
        let start = Instant::now();
        let mut layout = None;
        if let Some(socket) = self.cfg.gms_socket.clone() {
            let limit = self.cfg.handshake_timeout;
            let now = tokio::time::timeout(limit, self.check_gms(socket))
                .await
                .map_err(|_| CheckError::GmsLockTimeout { after: limit })??;
            if let Some(expected) = self.remembered_layout() {
                if expected != now {
                    return Err(CheckError::StaleLayout {
                        expected: format!(
                            "{} ({} allocations)",
                            expected.memory_layout_hash, expected.allocation_count
                        ),
                        found: format!(
                            "{} ({} allocations)",
                            now.memory_layout_hash, now.allocation_count
                        ),
                    });
                }
            } else {
                info!("gms check: no layout remembered at standby; checked committed only");
            }
            layout = Some(now);
        }
        let mut free_memory = None;
        if let Some(dev) = &self.device {
            let wait_start = Instant::now();
            let deadline = wait_start + self.cfg.memory_release_timeout;
            let mut free_before = None;
            let mut samples = 0u32;
            let mem = loop {
                let mem = dev.memory().map_err(CheckError::Device)?;
                samples += 1;
                let free_before = *free_before.get_or_insert(mem.free);
                let need = self.min_free_need(mem.total);
                if mem.free >= need {
                    if samples > 1 {
                        info!(waited_ms = wait_start.elapsed().as_millis() as u64, free_before,
                              free_after = mem.free, need, total = mem.total,
                              min_free_memory = %self.cfg.min_free_memory,
                              "gpu check before wake: waited for free device memory");
                    }
                    break mem;
                }
                if samples == 1 {
                    info!(free = mem.free, need, total = mem.total,
                          min_free_memory = %self.cfg.min_free_memory,
                          bound_ms = self.cfg.memory_release_timeout.as_millis() as u64,
                          "gpu check before wake: not enough free device memory yet; waiting");
                }
                if Instant::now() >= deadline {
                    return Err(CheckError::InsufficientFreeMemory {
                        need,
                        free: mem.free,
                        after: self.cfg.memory_release_timeout,
                    });
                }
                tokio::time::sleep(self.cfg.poll_interval).await;
            };
            let procs = dev.compute_processes().map_err(CheckError::Device)?;
            *self.baseline.lock().unwrap_or_else(|p| p.into_inner()) = Some(Baseline {
                processes: procs.len(),
                free: mem.free,
            });
            free_memory = Some(mem.free);
        }
        Ok(WakeReport {
            layout,
            free_memory,
            waited: start.elapsed(),
        })
    }

    fn pid_mode(&self) -> bool {
        match self.cfg.pid_namespace {
            PidNamespace::Host => true,
            PidNamespace::Foreign => false,
            PidNamespace::Auto => in_host_pid_namespace(),
        }
    }

    /// After the engine was reaped, before the lock goes (see the module docs).
    pub async fn after_reap(&self, engine_pids: &[u32]) -> Result<ReapReport, CheckError> {
        self.reap_checks.fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        let Some(dev) = self.device.clone() else {
            return Ok(ReapReport {
                matched_by: MatchMode::NoDevice,
                waited: Duration::ZERO,
                samples: 0,
                engine_processes_seen: 0,
                free_before: None,
                free_after: None,
            });
        };
        let baseline = *self.baseline.lock().unwrap_or_else(|p| p.into_inner());
        let mode = if self.pid_mode() {
            MatchMode::Pid
        } else if baseline.is_some() {
            MatchMode::Count
        } else {
            MatchMode::MemoryOnly
        };
        let tol = self.cfg.memory_tolerance;
        let deadline = start + self.cfg.memory_release_timeout;
        let mut samples = 0u32;
        let mut first: Option<(usize, u64)> = None;
        let mut target = 0u64;
        loop {
            let procs = dev.compute_processes().map_err(CheckError::Device)?;
            let mem = dev.memory().map_err(CheckError::Device)?;
            samples += 1;
            let present: Vec<&GpuProcess> = procs
                .iter()
                .filter(|p| engine_pids.contains(&p.pid))
                .collect();
            if first.is_none() {
                // Fix the memory target once, from what is known at the first sample.
                let seen = match mode {
                    MatchMode::Pid => present.len(),
                    MatchMode::Count => baseline
                        .map(|b| (procs.len() + 1).saturating_sub(b.processes))
                        .unwrap_or(0),
                    _ => 0,
                };
                let engine_used: u64 = if mode == MatchMode::Pid {
                    present.iter().filter_map(|p| p.used_bytes).sum()
                } else {
                    0
                };
                target = [
                    baseline.map(|b| b.free.saturating_sub(tol)).unwrap_or(0),
                    (mem.free + engine_used).saturating_sub(tol),
                    self.min_free_need(mem.total),
                ]
                .into_iter()
                .max()
                .unwrap_or(0)
                .min(mem.total);
                first = Some((seen, mem.free));
                self.engine_processes_seen
                    .fetch_add(seen as u64, Ordering::Relaxed);
                info!(mode = ?mode, engine_processes = seen, compute_processes = procs.len(),
                      free = mem.free, target, "memory-release check started");
            }
            let gone = match mode {
                MatchMode::Pid => present.is_empty(),
                MatchMode::Count => baseline.is_none_or(|b| procs.len() < b.processes),
                _ => true,
            };
            if gone && mem.free >= target {
                let (seen, free_before) = first.unwrap_or((0, mem.free));
                let rep = ReapReport {
                    matched_by: mode,
                    waited: start.elapsed(),
                    samples,
                    engine_processes_seen: seen,
                    free_before: Some(free_before),
                    free_after: Some(mem.free),
                };
                info!(?rep, "engine memory released");
                return Ok(rep);
            }
            if Instant::now() >= deadline {
                self.reap_timeouts.fetch_add(1, Ordering::Relaxed);
                let e = CheckError::MemoryNotReleased {
                    pids_still_present: present.iter().map(|p| p.pid).collect(),
                    compute_processes: procs.len(),
                    free: mem.free,
                    target,
                    after: self.cfg.memory_release_timeout,
                };
                warn!(cause = %e, "memory-release check timed out");
                return Err(e);
            }
            tokio::time::sleep(self.cfg.poll_interval).await;
        }
    }
}

/// Decision 5 roles for the engine's environment: engine 0 loads with `rw_or_ro`, every
/// other engine imports with `ro`, so no engine but one can ever hold a write lock and the
/// tensor-parallel cross-device deadlock cannot form.
pub fn weight_loading_env(engine_id: u32) -> Vec<(String, String)> {
    let (role, lock) = if engine_id == 0 {
        ("primary", RequestedLockType::RwOrRo)
    } else {
        ("shadow", RequestedLockType::Ro)
    };
    vec![
        ("ENGINE_ID".into(), engine_id.to_string()),
        ("ENGINE_ROLE".into(), role.into()),
        ("GMS_LOCK_TYPE".into(), lock.as_str().into()),
        ("DYN_GMS_FAILOVER_PRIMARY_ENGINE_ID".into(), "0".into()),
    ]
}

/// The lock type an engine with this id must request (the helper above, as a value).
pub fn weight_loading_lock(engine_id: u32) -> RequestedLockType {
    if engine_id == 0 {
        RequestedLockType::RwOrRo
    } else {
        RequestedLockType::Ro
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn min_free_resolves_against_the_total() {
        assert_eq!(MinFree::default(), MinFree::Auto);
        assert_eq!(ChecksConfig::default().min_free_memory, MinFree::DEFAULT);
        assert_eq!(MinFree::Auto.resolve(80 * GIB, None), 0);
        assert_eq!(MinFree::Auto.resolve(80 * GIB, Some(30 * GIB)), 30 * GIB);
        assert_eq!(MinFree::Auto.resolve(80 * GIB, Some(90 * GIB)), 80 * GIB);
        assert_eq!(MinFree::Off.resolve(80 * GIB, Some(GIB)), 0);
        assert_eq!(MinFree::Bytes(7).resolve(80 * GIB, Some(GIB)), 7);
        assert_eq!(MinFree::Fraction(0.5).resolve(80 * GIB, None), 40 * GIB);
        assert_eq!(MinFree::Fraction(2.0).resolve(80 * GIB, None), 80 * GIB);
        assert_eq!(MinFree::Fraction(f64::NAN).resolve(80 * GIB, None), 0);
        assert_eq!(MinFree::DEFAULT.to_string(), "auto");
    }

    fn sim(total: u64) -> (Arc<SimulatedDevice>, Option<Arc<dyn Device>>) {
        let d = Arc::new(SimulatedDevice::new(total));
        let dyn_d: Arc<dyn Device> = d.clone();
        (d, Some(dyn_d))
    }

    #[tokio::test]
    async fn before_wake_waits_by_default_for_what_the_engine_released_at_sleep() {
        let (dev, d) = sim(80 * GIB);
        dev.add_process(100, 60 * GIB); // the dead engine's memory, not yet freed
        let cfg = ChecksConfig {
            memory_release_timeout: Duration::from_millis(200),
            poll_interval: Duration::from_millis(10),
            memory_tolerance: 0,
            ..ChecksConfig::default()
        };
        // Never slept (nothing measured): no wait.
        let fresh = GpuChecks::with_device(cfg.clone(), d.clone());
        assert_eq!(fresh.released_at_sleep(), None);
        assert_eq!(
            fresh.before_wake().await.unwrap().free_memory,
            Some(20 * GIB)
        );
        // Slept, releasing 70 GiB: that much must be back before the wake.
        let checks = GpuChecks::with_device(cfg.clone(), d.clone());
        checks.note_sleep(Some(5 * GIB), Some(75 * GIB));
        assert_eq!(checks.released_at_sleep(), Some(70 * GIB));
        let err = checks.before_wake().await.unwrap_err();
        assert_eq!(
            err,
            CheckError::InsufficientFreeMemory {
                need: 70 * GIB,
                free: 20 * GIB,
                after: Duration::from_millis(200)
            }
        );
        // Free memory that dropped during the sleep (another engine allocating) counts as 0.
        checks.note_sleep(Some(30 * GIB), Some(10 * GIB));
        assert_eq!(checks.released_at_sleep(), Some(0));
        checks.note_sleep(None, Some(10 * GIB)); // a failed sample changes nothing
        assert_eq!(checks.released_at_sleep(), Some(0));
        checks.note_sleep(Some(5 * GIB), Some(75 * GIB));
        // Off: no wait at all.
        let off = GpuChecks::with_device(
            ChecksConfig {
                min_free_memory: MinFree::Off,
                ..cfg.clone()
            },
            d.clone(),
        );
        assert_eq!(off.before_wake().await.unwrap().free_memory, Some(20 * GIB));
        // The memory comes back while we wait.
        let checks = GpuChecks::with_device(
            ChecksConfig {
                memory_release_timeout: Duration::from_secs(5),
                ..cfg
            },
            d,
        );
        checks.note_sleep(Some(5 * GIB), Some(75 * GIB));
        let d2 = dev.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            d2.remove_process(100);
        });
        let rep = checks.before_wake().await.unwrap();
        assert_eq!(rep.free_memory, Some(80 * GIB));
        assert!(rep.waited >= Duration::from_millis(90), "{:?}", rep.waited);
    }

    #[tokio::test]
    async fn after_reap_target_includes_the_resolved_fraction() {
        let (dev, d) = sim(80 * GIB);
        dev.add_process(100, 60 * GIB); // not the engine's pid: pinned elsewhere
        let cfg = ChecksConfig {
            memory_release_timeout: Duration::from_millis(150),
            poll_interval: Duration::from_millis(10),
            memory_tolerance: 0,
            pid_namespace: PidNamespace::Host,
            min_free_memory: MinFree::Fraction(0.5),
            ..ChecksConfig::default()
        };
        let checks = GpuChecks::with_device(cfg.clone(), d.clone());
        match checks.after_reap(&[7]).await.unwrap_err() {
            CheckError::MemoryNotReleased { free, target, .. } => {
                assert_eq!((free, target), (20 * GIB, 40 * GIB))
            }
            other => panic!("{other}"),
        }
        let off = GpuChecks::with_device(
            ChecksConfig {
                min_free_memory: MinFree::Off,
                ..cfg
            },
            d,
        );
        off.after_reap(&[7]).await.unwrap();
    }

    #[tokio::test]
    async fn gpu_sim_is_a_dir_device_matched_by_pid() {
        let dir = tempfile::tempdir().unwrap();
        let checks = GpuChecks::new(ChecksConfig {
            gpu: Some(3),
            gpu_sim: Some(dir.path().to_path_buf()),
            memory_release_timeout: Duration::from_millis(200),
            poll_interval: Duration::from_millis(10),
            ..ChecksConfig::default()
        });
        assert!(checks.device_checks_enabled());
        assert!(
            checks.pid_mode(),
            "Auto matches by pid on a simulated device"
        );
        assert_eq!(
            checks.device.as_ref().unwrap().describe(),
            format!("sim:{}", dir.path().display())
        );
        let rep = checks.before_wake().await.unwrap();
        assert_eq!(rep.free_memory, Some(crate::simdev::DEFAULT_TOTAL));
        // A live process of this machine (this one) holds memory: after_reap sees it by pid.
        crate::simdev::register(dir.path(), std::process::id(), GIB).unwrap();
        match checks.after_reap(&[std::process::id()]).await.unwrap_err() {
            CheckError::MemoryNotReleased {
                pids_still_present, ..
            } => assert_eq!(pids_still_present, vec![std::process::id()]),
            other => panic!("{other}"),
        }
        crate::simdev::unregister(dir.path(), std::process::id()).unwrap();
        let rep = checks.after_reap(&[std::process::id()]).await.unwrap();
        assert_eq!(rep.matched_by, MatchMode::Pid);
        assert_eq!(rep.engine_processes_seen, 0);
    }
}
