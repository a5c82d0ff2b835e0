//! GDRCopy: `libgdrapi.so.2` loaded at run time, and RAII over its handle, pinned buffers and
//! mappings.

use std::ffi::{c_int, c_ulong, c_void};
use std::fmt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{GdrError, Result};
use crate::view::CpuView;

/// Environment variable naming the GDRCopy library to load instead of the default names.
pub const LIBRARY_ENV: &str = "IBGDA_GDRAPI_LIB";

/// Library names tried by default, in order.
pub const DEFAULT_LIBRARIES: &[&str] = &["libgdrapi.so.2", "libgdrapi.so"];

/// The gdrdrv device node.
pub const GDRDRV_PATH: &str = "/dev/gdrdrv";

/// GDRCopy's unit of pinning: one GPU page (`GPU_PAGE_SIZE` in gdrapi.h).
pub const GPU_PAGE_SIZE: u64 = 1 << 16;

/// `gdr_mh_t`: a memory handle, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MemHandle {
    h: c_ulong,
}

/// `gdr_info_v2_t` (gdrapi.h). The older `gdr_info_t` is a prefix of it (without
/// `mapping_type`), so one buffer serves both `gdr_get_info_v2` and `gdr_get_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RawInfo {
    va: u64,
    mapped_size: u64,
    page_size: u32,
    tm_cycles: u64,
    cycles_per_ms: u32,
    /// Bit fields `mapped:1, wc_mapping:1` (allocated from the least significant bit).
    flags: u32,
    mapping_type: c_int,
}

type OpenFn = unsafe extern "C" fn() -> *mut c_void;
type CloseFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type PinFn = unsafe extern "C" fn(*mut c_void, c_ulong, usize, u64, u32, *mut MemHandle) -> c_int;
type UnpinFn = unsafe extern "C" fn(*mut c_void, MemHandle) -> c_int;
type MapFn = unsafe extern "C" fn(*mut c_void, MemHandle, *mut *mut c_void, usize) -> c_int;
type UnmapFn = unsafe extern "C" fn(*mut c_void, MemHandle, *mut c_void, usize) -> c_int;
type InfoFn = unsafe extern "C" fn(*mut c_void, MemHandle, *mut RawInfo) -> c_int;
type CopyToFn = unsafe extern "C" fn(MemHandle, *mut c_void, *const c_void, usize) -> c_int;
type CopyFromFn = unsafe extern "C" fn(MemHandle, *mut c_void, *const c_void, usize) -> c_int;
type RuntimeVersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int);
type DriverVersionFn = unsafe extern "C" fn(*mut c_void, *mut c_int, *mut c_int) -> c_int;

/// The resolved functions. The library stays loaded as long as this lives.
struct Api {
    open: OpenFn,
    close: CloseFn,
    pin: PinFn,
    unpin: UnpinFn,
    map: MapFn,
    unmap: UnmapFn,
    info: InfoFn,
    copy_to: CopyToFn,
    copy_from: CopyFromFn,
    runtime_version: Option<RuntimeVersionFn>,
    driver_version: Option<DriverVersionFn>,
    name: String,
    _lib: libloading::Library,
}

impl Api {
    fn load(names: &[String]) -> Result<Self> {
        let mut dlerror = String::from("no library name to try");
        for name in names {
            // SAFETY: loading runs the library's initialisers; libgdrapi's only open a log.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => return Self::resolve(lib, name.clone()),
                Err(e) => dlerror = e.to_string(),
            }
        }
        Err(GdrError::LibraryMissing {
            tried: names.to_vec(),
            dlerror,
        })
    }

    fn resolve(lib: libloading::Library, name: String) -> Result<Self> {
        fn sym<T: Copy>(
            lib: &libloading::Library,
            library: &str,
            symbol: &'static str,
        ) -> Result<T> {
            // SAFETY: every `T` used below is the C prototype of `symbol` in gdrapi.h.
            unsafe { lib.get::<T>(symbol.as_bytes()) }
                .map(|s| *s)
                .map_err(|e| GdrError::SymbolMissing {
                    library: library.to_string(),
                    symbol,
                    dlerror: e.to_string(),
                })
        }
        let info = sym::<InfoFn>(&lib, &name, "gdr_get_info_v2")
            .or_else(|_| sym::<InfoFn>(&lib, &name, "gdr_get_info"))?;
        Ok(Self {
            open: sym(&lib, &name, "gdr_open")?,
            close: sym(&lib, &name, "gdr_close")?,
            pin: sym(&lib, &name, "gdr_pin_buffer")?,
            unpin: sym(&lib, &name, "gdr_unpin_buffer")?,
            map: sym(&lib, &name, "gdr_map")?,
            unmap: sym(&lib, &name, "gdr_unmap")?,
            info,
            copy_to: sym(&lib, &name, "gdr_copy_to_mapping")?,
            copy_from: sym(&lib, &name, "gdr_copy_from_mapping")?,
            runtime_version: sym(&lib, &name, "gdr_runtime_get_version").ok(),
            driver_version: sym(&lib, &name, "gdr_driver_get_version").ok(),
            name,
            _lib: lib,
        })
    }
}

/// Where to find GDRCopy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GdrConfig {
    /// Library names to try, in order.
    pub libraries: Vec<String>,
    /// The gdrdrv device node.
    pub device: PathBuf,
}

impl GdrConfig {
    /// The defaults, with the library replaced by `$IBGDA_GDRAPI_LIB` when it is set.
    pub fn from_env() -> Self {
        Self::with_library_override(std::env::var(LIBRARY_ENV).ok())
    }

    /// The defaults, with the library replaced by `library` when given.
    pub fn with_library_override(library: Option<String>) -> Self {
        let libraries = match library {
            Some(l) if !l.is_empty() => vec![l],
            _ => DEFAULT_LIBRARIES.iter().map(|s| s.to_string()).collect(),
        };
        Self {
            libraries,
            device: PathBuf::from(GDRDRV_PATH),
        }
    }
}

impl Default for GdrConfig {
    fn default() -> Self {
        Self::from_env()
    }
}

struct Inner {
    api: Api,
    /// `gdr_t`. libgdrapi keeps a list of handles per `gdr_t` without locking, so pin, unpin,
    /// map, unmap and info go through `lock`.
    handle: NonNull<c_void>,
    lock: Mutex<()>,
    device: PathBuf,
}

// SAFETY: the handle is owned here and closed in Drop; every libgdrapi call that touches its
// state is serialised by `lock`, and the copy functions take only a memory handle.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl Inner {
    fn locked<T>(&self, f: impl FnOnce() -> T) -> T {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        f()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: every pinned buffer holds an Arc<Inner>, so none is left; closed once.
        let rc = unsafe { (self.api.close)(self.handle.as_ptr()) };
        if rc != 0 {
            tracing::error!("gdr_close failed with code {rc}");
        }
    }
}

/// An open GDRCopy handle (`gdr_t`). Cheap to clone; pinned buffers hold a clone.
#[derive(Clone)]
pub struct Gdr {
    inner: Arc<Inner>,
}

impl fmt::Debug for Gdr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gdr")
            .field("library", &self.inner.api.name)
            .field("device", &self.inner.device)
            .finish()
    }
}

/// Rounds `len` up to whole GPU pages.
pub fn pinned_size(len: usize) -> usize {
    let page = GPU_PAGE_SIZE as usize;
    len.div_ceil(page) * page
}

impl Gdr {
    /// Opens GDRCopy with [`GdrConfig::from_env`].
    pub fn open() -> Result<Self> {
        Self::open_with(&GdrConfig::from_env())
    }

    /// Opens GDRCopy: checks the gdrdrv device node, loads the library, calls `gdr_open`.
    pub fn open_with(config: &GdrConfig) -> Result<Self> {
        // The kernel module first: without it the library would only log and return NULL.
        if !config.device.exists() {
            return Err(GdrError::DriverMissing {
                path: config.device.clone(),
            });
        }
        let api = Api::load(&config.libraries)?;
        // SAFETY: resolved from the library; takes no arguments.
        let handle = unsafe { (api.open)() };
        let handle = NonNull::new(handle).ok_or_else(|| GdrError::OpenFailed {
            path: config.device.clone(),
        })?;
        tracing::debug!(library = %api.name, "GDRCopy opened");
        Ok(Self {
            inner: Arc::new(Inner {
                api,
                handle,
                lock: Mutex::new(()),
                device: config.device.clone(),
            }),
        })
    }

    /// The library that was loaded.
    pub fn library(&self) -> &str {
        &self.inner.api.name
    }

    /// libgdrapi's version, if it reports one.
    pub fn runtime_version(&self) -> Option<(i32, i32)> {
        let f = self.inner.api.runtime_version?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: resolved from the library; valid out-pointers.
        unsafe { f(&mut major, &mut minor) };
        Some((major, minor))
    }

    /// gdrdrv's version, if the library can ask.
    pub fn driver_version(&self) -> Option<(i32, i32)> {
        let f = self.inner.api.driver_version?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: open handle, under the lock; valid out-pointers.
        let rc = self
            .inner
            .locked(|| unsafe { f(self.inner.handle.as_ptr(), &mut major, &mut minor) });
        (rc == 0).then_some((major, minor))
    }

    /// Pins `[dptr, dptr + len)` of GPU memory (`gdr_pin_buffer`). `dptr` must be 64 KiB
    /// aligned; whole GPU pages are pinned, so the allocation should cover
    /// [`pinned_size`]`(len)` bytes from `dptr`.
    pub fn pin(&self, dptr: u64, len: usize) -> Result<PinnedBuffer> {
        if len == 0 {
            return Err(GdrError::Empty);
        }
        if dptr % GPU_PAGE_SIZE != 0 {
            return Err(GdrError::Misaligned { addr: dptr });
        }
        let size = pinned_size(len);
        let mut mh = MemHandle::default();
        // SAFETY: open handle, under the lock; the driver validates the GPU range; `mh` is a
        // valid out-pointer.
        let rc = self.inner.locked(|| unsafe {
            (self.inner.api.pin)(
                self.inner.handle.as_ptr(),
                dptr as c_ulong,
                size,
                0,
                0,
                &mut mh,
            )
        });
        if rc != 0 {
            return Err(GdrError::Call {
                call: "gdr_pin_buffer",
                code: rc,
            });
        }
        Ok(PinnedBuffer {
            gdr: self.clone(),
            mh,
            dptr,
            len,
            size,
        })
    }
}

/// What `gdr_get_info` reports about a pinned buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdrInfo {
    /// GPU virtual address where the pinned range starts (may be below the address given).
    pub va: u64,
    /// Bytes pinned.
    pub mapped_size: u64,
    /// GPU page size.
    pub page_size: u32,
    /// Whether a CPU mapping exists.
    pub mapped: bool,
    /// Whether the CPU mapping is write-combining.
    pub wc_mapping: bool,
}

/// A pinned range of GPU memory (`gdr_pin_buffer`); unpinned on drop.
pub struct PinnedBuffer {
    gdr: Gdr,
    mh: MemHandle,
    dptr: u64,
    len: usize,
    size: usize,
}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("dptr", &format_args!("{:#x}", self.dptr))
            .field("len", &self.len)
            .field("pinned", &self.size)
            .finish()
    }
}

impl PinnedBuffer {
    /// `gdr_get_info_v2` (or `gdr_get_info` on older libraries).
    pub fn info(&self) -> Result<GdrInfo> {
        let inner = &self.gdr.inner;
        let mut raw = RawInfo::default();
        // SAFETY: open handle and live memory handle, under the lock; `raw` is large enough for
        // both info layouts.
        let rc =
            inner.locked(|| unsafe { (inner.api.info)(inner.handle.as_ptr(), self.mh, &mut raw) });
        if rc != 0 {
            return Err(GdrError::Call {
                call: "gdr_get_info",
                code: rc,
            });
        }
        Ok(GdrInfo {
            va: raw.va,
            mapped_size: raw.mapped_size,
            page_size: raw.page_size,
            mapped: raw.flags & 1 != 0,
            wc_mapping: raw.flags & 2 != 0,
        })
    }

    /// The GPU address given to [`Gdr::pin`].
    pub fn device_ptr(&self) -> u64 {
        self.dptr
    }

    /// The length given to [`Gdr::pin`].
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: pinning refuses empty ranges).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maps the pinned pages into this process (`gdr_map`).
    pub fn map(self) -> Result<Mapping> {
        let inner = self.gdr.inner.clone();
        let mut va: *mut c_void = std::ptr::null_mut();
        // SAFETY: open handle and live memory handle, under the lock; `va` is a valid out-pointer.
        let rc = inner.locked(|| unsafe {
            (inner.api.map)(inner.handle.as_ptr(), self.mh, &mut va, self.size)
        });
        if rc != 0 {
            return Err(GdrError::Call {
                call: "gdr_map",
                code: rc,
            });
        }
        let Some(base) = NonNull::new(va.cast::<u8>()) else {
            return Err(GdrError::Call {
                call: "gdr_map (returned NULL)",
                code: 0,
            });
        };
        // From here on, dropping `mapping` unmaps and unpins.
        let mut mapping = Mapping {
            base,
            offset: 0,
            pinned: Some(self),
        };
        // The mapping starts at the pinned range's first page, which may lie below `dptr`.
        let info = mapping.pinned().info()?;
        let offset = mapping
            .pinned()
            .dptr
            .checked_sub(info.va)
            .ok_or(GdrError::Call {
                call: "gdr_get_info (va above the pinned address)",
                code: 0,
            })?;
        mapping.offset = offset as usize;
        Ok(mapping)
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let inner = &self.gdr.inner;
        // SAFETY: open handle and live memory handle (any mapping of it was unmapped first, as
        // Mapping owns this value and unmaps in its own Drop), under the lock.
        let rc = inner.locked(|| unsafe { (inner.api.unpin)(inner.handle.as_ptr(), self.mh) });
        if rc != 0 {
            tracing::error!("gdr_unpin_buffer failed with code {rc}");
        }
    }
}

/// A CPU mapping of pinned GPU memory (`gdr_map`); unmapped, then unpinned, on drop.
pub struct Mapping {
    base: NonNull<u8>,
    offset: usize,
    // Always `Some` until `unmap` or Drop takes it.
    pinned: Option<PinnedBuffer>,
}

// SAFETY: the mapping is device memory reached only through atomics (CpuView) or libgdrapi's
// copy functions; the pointer stays valid until Drop.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared access only performs atomic loads/stores or copies through `&mut`.
unsafe impl Sync for Mapping {}

impl fmt::Debug for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapping")
            .field("pinned", &self.pinned)
            .field("cpu", &self.cpu_ptr())
            .finish()
    }
}

impl Mapping {
    fn pinned(&self) -> &PinnedBuffer {
        self.pinned
            .as_ref()
            .expect("a live mapping owns its pinned buffer")
    }

    fn check(&self, offset: usize, len: usize) -> *mut u8 {
        let end = offset.checked_add(len).expect("offset + length overflows");
        assert!(
            end <= self.pinned().len,
            "bytes {offset}..{end} lie past the end of a {}-byte mapping",
            self.pinned().len
        );
        self.cpu_ptr().wrapping_add(offset)
    }

    /// Copies `src` into the mapping at `offset` with GDRCopy's tuned copy
    /// (`gdr_copy_to_mapping`).
    ///
    /// # Panics
    /// If the bytes lie past the end.
    pub fn copy_to(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let dst = self.check(offset, src.len());
        let inner = &self.pinned().gdr.inner;
        // SAFETY: `dst..dst+len` is inside the live mapping (checked); `&mut self` excludes other
        // Rust accesses during the copy.
        let rc = unsafe {
            (inner.api.copy_to)(self.pinned().mh, dst.cast(), src.as_ptr().cast(), src.len())
        };
        if rc != 0 {
            return Err(GdrError::Call {
                call: "gdr_copy_to_mapping",
                code: rc,
            });
        }
        Ok(())
    }

    /// Copies from the mapping at `offset` into `dst` (`gdr_copy_from_mapping`).
    ///
    /// # Panics
    /// If the bytes lie past the end.
    pub fn copy_from(&mut self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let src = self.check(offset, dst.len());
        let inner = &self.pinned().gdr.inner;
        // SAFETY: as in `copy_to`.
        let rc = unsafe {
            (inner.api.copy_from)(
                self.pinned().mh,
                dst.as_mut_ptr().cast(),
                src.cast(),
                dst.len(),
            )
        };
        if rc != 0 {
            return Err(GdrError::Call {
                call: "gdr_copy_from_mapping",
                code: rc,
            });
        }
        Ok(())
    }

    /// `gdr_get_info` of the underlying pinned buffer.
    pub fn info(&self) -> Result<GdrInfo> {
        self.pinned().info()
    }

    /// Unmaps and returns the still-pinned buffer.
    pub fn unmap(mut self) -> Result<PinnedBuffer> {
        let pinned = self
            .pinned
            .take()
            .expect("a live mapping owns its pinned buffer");
        let rc = Self::unmap_raw(&pinned, self.base);
        if rc != 0 {
            return Err(GdrError::Call {
                call: "gdr_unmap",
                code: rc,
            });
        }
        Ok(pinned)
    }

    fn unmap_raw(pinned: &PinnedBuffer, base: NonNull<u8>) -> c_int {
        let inner = &pinned.gdr.inner;
        // SAFETY: `base` came from gdr_map of this memory handle with this size, and is unmapped
        // once (the caller took the pinned buffer out of the mapping), under the lock.
        inner.locked(|| unsafe {
            (inner.api.unmap)(
                inner.handle.as_ptr(),
                pinned.mh,
                base.as_ptr().cast(),
                pinned.size,
            )
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Some(pinned) = self.pinned.take() {
            let rc = Self::unmap_raw(&pinned, self.base);
            if rc != 0 {
                tracing::error!("gdr_unmap failed with code {rc}");
            }
            // `pinned` drops here: unpinned after the unmap.
        }
    }
}

// SAFETY: `cpu_ptr()` is inside a live gdr_map mapping of at least `len()` bytes past it (the
// pinned size covers offset + len); the mapping starts on a page and `offset` keeps the 64 KiB
// alignment of `dptr` relative to the page, so the pointer is 8-byte aligned.
unsafe impl CpuView for Mapping {
    fn cpu_ptr(&self) -> *mut u8 {
        self.base.as_ptr().wrapping_add(self.offset)
    }

    fn device_ptr(&self) -> u64 {
        self.pinned.as_ref().map(|p| p.dptr).unwrap_or(0)
    }

    fn len(&self) -> usize {
        self.pinned.as_ref().map(|p| p.len).unwrap_or(0)
    }
}

/// Whether the gdrdrv device node exists (a cheap check for tools).
pub fn driver_loaded() -> bool {
    Path::new(GDRDRV_PATH).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_names_what_was_tried() {
        let cfg = GdrConfig {
            libraries: vec!["libgdrapi-does-not-exist.so.2".into()],
            device: PathBuf::from("/dev/null"),
        };
        let e = Gdr::open_with(&cfg).unwrap_err();
        match &e {
            GdrError::LibraryMissing { tried, dlerror } => {
                assert_eq!(tried, &["libgdrapi-does-not-exist.so.2".to_string()]);
                assert!(!dlerror.is_empty());
            }
            other => panic!("expected LibraryMissing, got {other}"),
        }
        let text = e.to_string();
        assert!(
            text.contains("libgdrapi-does-not-exist.so.2") && text.contains("cpu_host_memory"),
            "{text}"
        );
    }

    #[test]
    fn missing_driver_names_the_device_node() {
        let cfg = GdrConfig {
            libraries: vec!["libgdrapi.so.2".into()],
            device: PathBuf::from("/nonexistent/gdrdrv"),
        };
        let e = Gdr::open_with(&cfg).unwrap_err();
        assert!(matches!(e, GdrError::DriverMissing { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("/nonexistent/gdrdrv") && text.contains("gdrdrv kernel module"),
            "{text}"
        );
    }

    #[test]
    fn default_open_here_reports_what_is_missing() {
        match Gdr::open() {
            Ok(g) => eprintln!("GDRCopy present here: {g:?}"),
            Err(GdrError::DriverMissing { path }) => {
                assert!(!driver_loaded());
                assert_eq!(path, PathBuf::from(GDRDRV_PATH));
            }
            Err(GdrError::LibraryMissing { tried, .. }) => assert!(!tried.is_empty()),
            Err(e) => eprintln!("GDRCopy present but unusable here: {e}"),
        }
    }

    #[test]
    fn library_override() {
        assert_eq!(
            GdrConfig::with_library_override(Some("/opt/libgdrapi.so.2".into())).libraries,
            vec!["/opt/libgdrapi.so.2"]
        );
        assert_eq!(
            GdrConfig::with_library_override(None).libraries,
            DEFAULT_LIBRARIES
        );
        assert_eq!(
            GdrConfig::with_library_override(Some(String::new())).libraries,
            DEFAULT_LIBRARIES
        );
    }

    #[test]
    fn pin_sizes() {
        assert_eq!(pinned_size(1), 65536);
        assert_eq!(pinned_size(65536), 65536);
        assert_eq!(pinned_size(65537), 131072);
    }

    #[test]
    fn info_layout_matches_gdrapi_h() {
        // gdr_info_v2_t on LP64: va 0, mapped_size 8, page_size 16, tm_cycles 24, cycles_per_ms 32,
        // bit fields 36, mapping_type 40; 48 bytes.
        assert_eq!(std::mem::size_of::<RawInfo>(), 48);
        assert_eq!(std::mem::offset_of!(RawInfo, tm_cycles), 24);
        assert_eq!(std::mem::offset_of!(RawInfo, flags), 36);
        assert_eq!(std::mem::offset_of!(RawInfo, mapping_type), 40);
        assert_eq!(
            std::mem::size_of::<MemHandle>(),
            std::mem::size_of::<c_ulong>()
        );
    }
}
