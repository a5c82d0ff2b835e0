//! A CPU view of GPU memory: GDRCopy (`libgdrapi.so.2`, loaded at run time) and a host-pinned
//! fallback with the same interface.
//!
//! Owns: opening GDRCopy, pinning and mapping GPU buffers, copies through the mapping, and the
//! clear errors when the library or `/dev/gdrdrv` is missing.
//!
//! Must not know about: NICs, queue pairs or the protocol that uses the mapping.
//!
//! # Two backings, one interface
//!
//! | NIC handler | producer slots live in | type |
//! |---|---|---|
//! | `cpu` | GPU memory, mapped to the CPU by GDRCopy | [`Mapping`] |
//! | `cpu_host_memory` | pinned host memory mapped into the GPU | [`HostMapping`] |
//! | `cpu` on the emulated NIC without GDRCopy | GPU memory, mirrored for the CPU by copy-engine reads | [`CopyMirror`] |
//!
//! Both implement [`CpuView`]: a CPU pointer, a GPU pointer, a length, and atomic 64-bit reads
//! and writes (what a proxy polling GPU-raised producer slots needs).
//!
//! GDRCopy is RAII all the way down: [`Gdr`] (the `gdr_t` handle) ← [`PinnedBuffer`]
//! (`gdr_pin_buffer`) ← [`Mapping`] (`gdr_map`). Dropping a mapping unmaps, then unpins; the
//! handle closes when the last buffer is gone.
//!
//! ```no_run
//! use ibgda_gdr::{CpuView, Gdr, GdrError};
//! # fn device_buffer() -> u64 { 0 }
//! match Gdr::open() {
//!     Ok(gdr) => {
//!         let dptr = device_buffer(); // 64 KiB aligned GPU memory
//!         let map = gdr.pin(dptr, 4096)?.map()?;
//!         map.write_u64(0, 1);
//!     }
//!     Err(e @ (GdrError::LibraryMissing { .. } | GdrError::DriverMissing { .. })) => {
//!         eprintln!("{e}"); // says to install GDRCopy or use cpu_host_memory
//!     }
//!     Err(e) => return Err(e),
//! }
//! # Ok::<(), GdrError>(())
//! ```
//!
//! Nothing that needs `libgdrapi`, `/dev/gdrdrv` or a GPU has run in this project's CI; the
//! GDRCopy RAII is exercised against a stub library (tests/), see README.md.

mod error;
mod gdr;
mod host;
mod mirror;
mod mirror_hub;
mod view;

pub use error::{GdrError, Result};
pub use gdr::{
    driver_loaded, pinned_size, Gdr, GdrConfig, GdrInfo, Mapping, PinnedBuffer, DEFAULT_LIBRARIES,
    GDRDRV_PATH, GPU_PAGE_SIZE, LIBRARY_ENV,
};
pub use host::{cuda_driver_present, gpu_count, HostMapping};
pub use mirror::{CopyMirror, MirrorConfig};
pub use view::CpuView;
