//! Memory backends.
//!
//! * Server side ([`ServerBackend`]): creates shareable memory and exports an fd for it.
//!   `host`: one memfd per allocation. `cuda`: cuMemCreate with POSIX-fd handles and
//!   cuMemExportToShareableHandle (the server never maps memory).
//! * Client side ([`MemoryBackend`]): imports an exported fd and maps it.
//!   `host`: mmap of the memfd. `cuda`: cuMemImportFromShareableHandle, cuMemAddressReserve,
//!   cuMemMap, cuMemSetAccess (read-only for readers); unmapped with cuMemUnmap,
//!   cuMemRelease, cuMemAddressFree on drop.
//!
//! CUDA guard: nothing in [`cuda`] calls the driver before [`cuda::driver_present`] has
//! returned true (cudarc's dynamic loading panics instead of failing when libcuda is
//! missing), and every CUDA entry point goes through [`cuda::CudaRuntime::init`], which
//! checks it.

use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::ptr::NonNull;

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use serde::Serialize;

/// Host backend granularity: 2 MiB, the usual CUDA minimum granularity, so that sizes and
/// the layout hash look the same on both backends.
pub const HOST_GRANULARITY: u64 = 2 << 20;

/// Backend failures.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The system (or device) has no memory for the allocation.
    #[error("out of memory allocating {0} bytes")]
    OutOfMemory(u64),
    /// The imported fd is smaller than the allocation claims.
    #[error("allocation truncated: fd holds {actual} bytes, expected {expected}")]
    Truncated {
        /// aligned_size from the server.
        expected: u64,
        /// What the fd really holds.
        actual: u64,
    },
    /// No CUDA driver on this machine.
    #[error("no CUDA driver (libcuda) on this machine")]
    NoDriver,
    /// A CUDA call failed.
    #[error("{call} failed: {code}")]
    Cuda {
        /// Which call.
        call: &'static str,
        /// The CUresult, as text.
        code: String,
    },
    /// A system call failed.
    #[error("{0}: {1}")]
    Os(&'static str, std::io::Error),
    /// Bad size (zero or beyond the address space).
    #[error("invalid size {0}")]
    BadSize(u64),
}

/// Which backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// memfd + mmap (no GPU needed).
    Host,
    /// CUDA VMM (needs a driver).
    Cuda,
}

/// How a client maps an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Readers map read-only.
    ReadOnly,
    /// Writers map read-write.
    ReadWrite,
}

/// Device memory counters (cuMemGetInfo_v2 / NVML).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemInfo {
    /// Free bytes.
    pub free: u64,
    /// Total bytes.
    pub total: u64,
}

/// Server-side memory creation.
pub trait ServerBackend: Send + 'static {
    /// The backend's handle for one allocation.
    type Handle: Send + 'static;
    /// `host` or `cuda`.
    fn kind(&self) -> BackendKind;
    /// Sizes are rounded up to this.
    fn granularity(&self) -> u64;
    /// Creates `aligned_size` bytes of shareable memory.
    fn create(&mut self, aligned_size: u64) -> Result<Self::Handle, BackendError>;
    /// A fresh fd for the allocation (read-only where the backend can express it).
    fn export(&self, handle: &Self::Handle, read_only: bool) -> Result<OwnedFd, BackendError>;
    /// Releases the server's reference (importers keep theirs).
    fn release(&mut self, handle: Self::Handle);
}

/// One imported, mapped allocation; unmapped on drop.
pub trait Mapping: Send {
    /// Mapped bytes.
    fn len(&self) -> u64;
    /// True when nothing is mapped.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Host-visible bytes (host backend only).
    fn host_bytes(&self) -> Option<&[u8]>;
    /// Writable host bytes (host backend, read-write mappings only).
    fn host_bytes_mut(&mut self) -> Option<&mut [u8]>;
    /// Device virtual address (cuda backend only).
    fn device_ptr(&self) -> Option<u64>;
}

/// Client-side import: the one small trait both backends implement.
pub trait MemoryBackend: Send + Sync {
    /// `host` or `cuda`.
    fn kind(&self) -> BackendKind;
    /// Imports an exported fd (consumed) and maps `aligned_size` bytes.
    fn import(
        &self,
        fd: OwnedFd,
        aligned_size: u64,
        access: Access,
    ) -> Result<Box<dyn Mapping>, BackendError>;
    /// Device free/total memory; None for host memory.
    fn mem_info(&self) -> Result<Option<MemInfo>, BackendError>;
}

/// Opens the client backend of this kind (cuda fails cleanly without a driver).
pub fn open_client_backend(
    kind: BackendKind,
    device: u32,
) -> Result<Box<dyn MemoryBackend>, BackendError> {
    match kind {
        BackendKind::Host => Ok(Box::new(HostBackend)),
        BackendKind::Cuda => Ok(Box::new(cuda::CudaImporter::new(device)?)),
    }
}

// ---------------------------------------------------------------------------------------
// host

/// memfd + mmap backend (both sides).
#[derive(Debug, Default, Clone, Copy)]
pub struct HostBackend;

impl ServerBackend for HostBackend {
    type Handle = OwnedFd;

    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn granularity(&self) -> u64 {
        HOST_GRANULARITY
    }

    fn create(&mut self, aligned_size: u64) -> Result<OwnedFd, BackendError> {
        let len = i64::try_from(aligned_size).map_err(|_| BackendError::BadSize(aligned_size))?;
        let fd = nix::sys::memfd::memfd_create(
            c"gms-allocation",
            nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
        )
        .map_err(|e| BackendError::Os("memfd_create", e.into()))?;
        match nix::unistd::ftruncate(&fd, len) {
            Ok(()) => Ok(fd),
            Err(
                nix::errno::Errno::ENOMEM | nix::errno::Errno::ENOSPC | nix::errno::Errno::EFBIG,
            ) => Err(BackendError::OutOfMemory(aligned_size)),
            Err(e) => Err(BackendError::Os("ftruncate", e.into())),
        }
    }

    fn export(&self, handle: &OwnedFd, read_only: bool) -> Result<OwnedFd, BackendError> {
        if read_only {
            // A new open file description, read-only: a reader cannot write or truncate
            // the shared memory through it.
            let path = format!("/proc/self/fd/{}", handle.as_raw_fd());
            let f = std::fs::OpenOptions::new()
                .read(true)
                .open(path)
                .map_err(|e| BackendError::Os("reopen memfd read-only", e))?;
            Ok(OwnedFd::from(f))
        } else {
            handle
                .try_clone()
                .map_err(|e| BackendError::Os("dup memfd", e))
        }
    }

    fn release(&mut self, handle: OwnedFd) {
        drop(handle);
    }
}

/// A host mapping of a memfd.
#[derive(Debug)]
pub struct HostMapping {
    /// Start of the mapping.
    ptr: NonNull<c_void>,
    /// Its length.
    len: usize,
    /// Mapped writable.
    writable: bool,
}

// SAFETY: the mapping is plain shared memory owned by this value; moving it between
// threads is fine (access goes through &/&mut self).
unsafe impl Send for HostMapping {}

impl Drop for HostMapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len come from a successful mmap and are unmapped exactly once.
        let _ = unsafe { munmap(self.ptr, self.len) };
    }
}

impl Mapping for HostMapping {
    fn len(&self) -> u64 {
        self.len as u64
    }
    fn host_bytes(&self) -> Option<&[u8]> {
        // SAFETY: the mapping is valid for len bytes while self lives.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr() as *const u8, self.len) })
    }
    fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
        if !self.writable {
            return None;
        }
        // SAFETY: writable shared mapping valid for len bytes; &mut self makes it unique
        // within this process.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr() as *mut u8, self.len) })
    }
    fn device_ptr(&self) -> Option<u64> {
        None
    }
}

impl HostBackend {
    /// Maps a memfd after checking that it really holds `aligned_size` bytes.
    pub fn map(
        fd: &OwnedFd,
        aligned_size: u64,
        access: Access,
    ) -> Result<HostMapping, BackendError> {
        let st = nix::sys::stat::fstat(fd.as_raw_fd())
            .map_err(|e| BackendError::Os("fstat", e.into()))?;
        let actual = st.st_size.max(0) as u64;
        if actual < aligned_size {
            return Err(BackendError::Truncated {
                expected: aligned_size,
                actual,
            });
        }
        let len = usize::try_from(aligned_size)
            .ok()
            .and_then(NonZeroUsize::new)
            .ok_or(BackendError::BadSize(aligned_size))?;
        let (prot, writable) = match access {
            Access::ReadOnly => (ProtFlags::PROT_READ, false),
            Access::ReadWrite => (ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, true),
        };
        // SAFETY: a fresh shared mapping of a file we hold; no existing memory is aliased.
        let ptr = unsafe { mmap(None, len, prot, MapFlags::MAP_SHARED, fd.as_fd(), 0) }
            .map_err(|e| BackendError::Os("mmap", e.into()))?;
        Ok(HostMapping {
            ptr,
            len: len.get(),
            writable,
        })
    }
}

impl MemoryBackend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }
    fn import(
        &self,
        fd: OwnedFd,
        aligned_size: u64,
        access: Access,
    ) -> Result<Box<dyn Mapping>, BackendError> {
        // The mapping keeps the memory alive; the fd is closed when it drops here.
        Ok(Box::new(Self::map(&fd, aligned_size, access)?))
    }
    fn mem_info(&self) -> Result<Option<MemInfo>, BackendError> {
        Ok(None)
    }
}

// ---------------------------------------------------------------------------------------
// cuda

/// CUDA VMM backend through cudarc's driver API (compiled everywhere, run only where a
/// driver is present).
pub mod cuda {
    use std::ffi::c_void;
    use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};

    use cudarc::driver::sys;

    use super::{
        Access, BackendError, BackendKind, Mapping, MemInfo, MemoryBackend, ServerBackend,
    };

    /// True when libcuda can be loaded. MUST be true before any other call in this module:
    /// cudarc panics on a missing library instead of returning an error.
    pub fn driver_present() -> bool {
        // SAFETY: only tries to dlopen the library by name; calls nothing in it.
        unsafe { sys::is_culib_present() }
    }

    fn check(call: &'static str, r: sys::CUresult) -> Result<(), BackendError> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(BackendError::Cuda {
                call,
                code: format!("{r:?}"),
            })
        }
    }

    /// An initialised driver with the device's primary context.
    #[derive(Debug)]
    pub struct CudaRuntime {
        /// Device ordinal.
        ordinal: i32,
        /// The device's primary context (made current before every call, since tokio
        /// moves work between threads).
        ctx: sys::CUcontext,
    }

    // SAFETY: a CUcontext handle may be used from any thread once made current there.
    unsafe impl Send for CudaRuntime {}
    // SAFETY: as above; the driver API is thread-safe.
    unsafe impl Sync for CudaRuntime {}

    impl CudaRuntime {
        /// Checks for the driver, then cuInit, cuDeviceGet, cuDevicePrimaryCtxRetain.
        pub fn init(device: u32) -> Result<Self, BackendError> {
            if !driver_present() {
                return Err(BackendError::NoDriver);
            }
            let ordinal =
                i32::try_from(device).map_err(|_| BackendError::BadSize(device.into()))?;
            let mut dev: sys::CUdevice = 0;
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: driver present (checked above); out-pointers are valid locals.
            unsafe {
                check("cuInit", sys::cuInit(0))?;
                check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal))?;
                check(
                    "cuDevicePrimaryCtxRetain",
                    sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                )?;
            }
            let rt = Self { ordinal, ctx };
            rt.make_current()?;
            Ok(rt)
        }

        /// Makes the primary context current on this thread.
        pub fn make_current(&self) -> Result<(), BackendError> {
            // SAFETY: ctx was retained in init (driver present).
            check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
        }

        fn location(&self) -> sys::CUmemLocation {
            // SAFETY: plain C struct; zero is a valid bit pattern for every field.
            let mut loc: sys::CUmemLocation = unsafe { std::mem::zeroed() };
            loc.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            loc.id = self.ordinal;
            loc
        }

        fn prop(&self) -> sys::CUmemAllocationProp {
            // SAFETY: plain C struct; zero is valid (null win32 metadata, no flags).
            let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
            p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            p.requestedHandleTypes =
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            p.location = self.location();
            p
        }

        /// cuMemGetAllocationGranularity (minimum).
        pub fn granularity(&self) -> Result<u64, BackendError> {
            self.make_current()?;
            let prop = self.prop();
            let mut g: usize = 0;
            // SAFETY: valid prop and out-pointer; driver initialised.
            check("cuMemGetAllocationGranularity", unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut g,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            })?;
            Ok(g as u64)
        }

        /// cuMemGetInfo_v2.
        pub fn mem_info(&self) -> Result<MemInfo, BackendError> {
            self.make_current()?;
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: out-pointers valid; driver initialised.
            check("cuMemGetInfo_v2", unsafe {
                sys::cuMemGetInfo_v2(&mut free, &mut total)
            })?;
            Ok(MemInfo {
                free: free as u64,
                total: total as u64,
            })
        }
    }

    /// Server side: cuMemCreate + cuMemExportToShareableHandle.
    #[derive(Debug)]
    pub struct CudaServer {
        /// Driver and context.
        rt: CudaRuntime,
        /// Minimum granularity, queried once.
        granularity: u64,
    }

    impl CudaServer {
        /// Initialises the device (fails cleanly without a driver).
        pub fn new(device: u32) -> Result<Self, BackendError> {
            let rt = CudaRuntime::init(device)?;
            let granularity = rt.granularity()?.max(1);
            Ok(Self { rt, granularity })
        }
    }

    impl ServerBackend for CudaServer {
        type Handle = sys::CUmemGenericAllocationHandle;

        fn kind(&self) -> BackendKind {
            BackendKind::Cuda
        }

        fn granularity(&self) -> u64 {
            self.granularity
        }

        fn create(&mut self, aligned_size: u64) -> Result<Self::Handle, BackendError> {
            self.rt.make_current()?;
            let prop = self.rt.prop();
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            let size =
                usize::try_from(aligned_size).map_err(|_| BackendError::BadSize(aligned_size))?;
            // SAFETY: valid prop/out-pointer; size is a multiple of the granularity.
            let r = unsafe { sys::cuMemCreate(&mut h, size, &prop, 0) };
            if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(BackendError::OutOfMemory(aligned_size));
            }
            check("cuMemCreate", r)?;
            Ok(h)
        }

        fn export(&self, handle: &Self::Handle, _read_only: bool) -> Result<OwnedFd, BackendError> {
            self.rt.make_current()?;
            let mut fd: std::ffi::c_int = -1;
            // SAFETY: for POSIX fd handles the out-parameter is an int.
            check("cuMemExportToShareableHandle", unsafe {
                sys::cuMemExportToShareableHandle(
                    &mut fd as *mut std::ffi::c_int as *mut c_void,
                    *handle,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    0,
                )
            })?;
            if fd < 0 {
                return Err(BackendError::Cuda {
                    call: "cuMemExportToShareableHandle",
                    code: format!("returned fd {fd}"),
                });
            }
            // SAFETY: the driver just created this fd for us; we own it.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }

        fn release(&mut self, handle: Self::Handle) {
            if self.rt.make_current().is_ok() {
                // SAFETY: handle came from cuMemCreate and is released once.
                let r = unsafe { sys::cuMemRelease(handle) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    tracing::warn!(?r, "cuMemRelease failed");
                }
            }
        }
    }

    /// Client side importer.
    #[derive(Debug)]
    pub struct CudaImporter {
        /// Driver and context.
        rt: std::sync::Arc<CudaRuntime>,
    }

    impl CudaImporter {
        /// Initialises the device (fails cleanly without a driver).
        pub fn new(device: u32) -> Result<Self, BackendError> {
            Ok(Self {
                rt: std::sync::Arc::new(CudaRuntime::init(device)?),
            })
        }
    }

    /// An imported, mapped CUDA allocation.
    #[derive(Debug)]
    pub struct CudaMapping {
        /// Keeps the context alive.
        rt: std::sync::Arc<CudaRuntime>,
        /// Imported handle (our reference to the physical memory).
        handle: sys::CUmemGenericAllocationHandle,
        /// Reserved virtual address.
        ptr: sys::CUdeviceptr,
        /// Mapped bytes.
        len: usize,
    }

    impl Drop for CudaMapping {
        fn drop(&mut self) {
            if self.rt.make_current().is_err() {
                return;
            }
            // SAFETY: ptr/len/handle come from a successful import+map, released once.
            unsafe {
                let _ = sys::cuMemUnmap(self.ptr, self.len);
                let _ = sys::cuMemRelease(self.handle);
                let _ = sys::cuMemAddressFree(self.ptr, self.len);
            }
        }
    }

    impl Mapping for CudaMapping {
        fn len(&self) -> u64 {
            self.len as u64
        }
        fn host_bytes(&self) -> Option<&[u8]> {
            None
        }
        fn host_bytes_mut(&mut self) -> Option<&mut [u8]> {
            None
        }
        fn device_ptr(&self) -> Option<u64> {
            Some(self.ptr)
        }
    }

    impl MemoryBackend for CudaImporter {
        fn kind(&self) -> BackendKind {
            BackendKind::Cuda
        }

        fn import(
            &self,
            fd: OwnedFd,
            aligned_size: u64,
            access: Access,
        ) -> Result<Box<dyn Mapping>, BackendError> {
            self.rt.make_current()?;
            let len =
                usize::try_from(aligned_size).map_err(|_| BackendError::BadSize(aligned_size))?;
            let raw = fd.into_raw_fd();
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: for POSIX fds the os handle is the fd value cast to a pointer.
            let r = unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    raw as isize as *mut c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            };
            // The driver holds its own reference now; close our fd either way.
            // SAFETY: raw came from into_raw_fd above and is closed once.
            drop(unsafe { OwnedFd::from_raw_fd(raw) });
            check("cuMemImportFromShareableHandle", r)?;
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: out-pointer valid; alignment 0 = default.
            let r = unsafe { sys::cuMemAddressReserve(&mut ptr, len, 0, 0, 0) };
            if let Err(e) = check("cuMemAddressReserve", r) {
                // SAFETY: imported above, released once.
                unsafe { sys::cuMemRelease(handle) };
                return Err(e);
            }
            // SAFETY: reserved range of len bytes, handle of at least len bytes.
            let r = unsafe { sys::cuMemMap(ptr, len, 0, handle, 0) };
            if let Err(e) = check("cuMemMap", r) {
                // SAFETY: undo in reverse order, each once.
                unsafe {
                    sys::cuMemRelease(handle);
                    sys::cuMemAddressFree(ptr, len);
                }
                return Err(e);
            }
            let mapping = CudaMapping {
                rt: self.rt.clone(),
                handle,
                ptr,
                len,
            };
            // SAFETY: zero is a valid bit pattern for the descriptor.
            let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            desc.location = self.rt.location();
            desc.flags = match access {
                Access::ReadOnly => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
                Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the range is mapped; on failure the mapping's Drop unmaps it.
            check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(ptr, len, &desc, 1)
            })?;
            Ok(Box::new(mapping))
        }

        fn mem_info(&self) -> Result<Option<MemInfo>, BackendError> {
            self.rt.mem_info().map(Some)
        }
    }
}
