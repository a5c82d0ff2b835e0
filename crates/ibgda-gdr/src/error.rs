//! Errors of the CPU-view layer.

use std::path::PathBuf;

/// Everything that can go wrong opening GDRCopy or making a CPU view of GPU memory.
#[derive(Debug, thiserror::Error)]
pub enum GdrError {
    /// `libgdrapi` could not be loaded.
    #[error(
        "GDRCopy's library could not be loaded (tried {}): {dlerror}. Install GDRCopy \
         (https://github.com/NVIDIA/gdrcopy, package `gdrcopy`/`libgdrapi`) or use the \
         cpu_host_memory NIC handler, which needs no GDRCopy",
        tried.join(", ")
    )]
    LibraryMissing {
        /// The names tried, in order.
        tried: Vec<String>,
        /// The loader's message for the last one.
        dlerror: String,
    },
    /// The library lacks a function this crate needs (too old a GDRCopy).
    #[error("{library} has no symbol {symbol} ({dlerror}): GDRCopy 2.x is required")]
    SymbolMissing {
        /// The library loaded.
        library: String,
        /// The missing function.
        symbol: &'static str,
        /// The loader's message.
        dlerror: String,
    },
    /// The gdrdrv kernel module is not loaded.
    #[error(
        "{} does not exist: the gdrdrv kernel module is not loaded (install GDRCopy's driver and \
         `modprobe gdrdrv`), or use the cpu_host_memory NIC handler",
        path.display()
    )]
    DriverMissing {
        /// The device node looked for.
        path: PathBuf,
    },
    /// `gdr_open` returned NULL.
    #[error("gdr_open failed: could not open {} (permissions, or a gdrdrv/libgdrapi version mismatch)", path.display())]
    OpenFailed {
        /// The device node.
        path: PathBuf,
    },
    /// A libgdrapi call returned an error code.
    #[error("{call} failed with code {code}")]
    Call {
        /// The function.
        call: &'static str,
        /// Its return value.
        code: i32,
    },
    /// GDRCopy pins whole 64 KiB GPU pages; the address must start one.
    #[error("GPU address {addr:#x} is not 64 KiB aligned: GDRCopy pins whole GPU pages")]
    Misaligned {
        /// The address given.
        addr: u64,
    },
    /// An empty range.
    #[error("cannot pin or map an empty range")]
    Empty,
    /// `libcuda.so` is not installed.
    #[error("the CUDA driver (libcuda.so) is not installed on this machine: {0} needs it")]
    CudaDriverMissing(&'static str),
    /// A CUDA driver call failed.
    #[error("{call} failed: CUDA error {code} ({text})")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The `CUresult`.
        code: u32,
        /// The driver's description.
        text: String,
    },
    /// A GPU ordinal past the visible devices.
    #[error("GPU {ordinal} requested but only {count} visible")]
    NoSuchGpu {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many are visible.
        count: usize,
    },
}

/// Result alias for this crate.
pub type Result<T, E = GdrError> = std::result::Result<T, E>;
