//! The GDRCopy RAII (load, open, pin, map, info, copies, unmap, unpin, close) run against a stub
//! `libgdrapi` compiled here from `tests/stub/gdrapi_stub.c`, whose "GPU memory" is host memory.
//! Needs a C compiler (`$CC` or `cc`); without one the tests fail, saying so.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ffi::{c_char, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use ibgda_gdr::{CpuView, Gdr, GdrConfig, GdrError, GPU_PAGE_SIZE};

/// The stub keeps global state: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn build(name: &str, defines: &[&str]) -> Option<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/stub/gdrapi_stub.c");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&out)
        .arg(&src)
        .args(defines)
        .status();
    match status {
        Ok(s) if s.success() => Some(out),
        // A test that ran no case is a failure, not a pass: the set-up installs a C compiler
        // (`cargo xtask test` checks for clang), so not having one is an error of the machine.
        other => panic!(
            "could not build the libgdrapi stub with {cc} ({other:?}): these tests need a C \
             compiler (set CC, or install gcc/clang)"
        ),
    }
}

fn stub() -> Option<&'static (PathBuf, libloading::Library)> {
    static STUB: OnceLock<Option<(PathBuf, libloading::Library)>> = OnceLock::new();
    STUB.get_or_init(|| {
        let path = build("libgdrapi_stub.so", &[])?;
        // Held for the whole test run so the stub's globals (its call log) survive Gdr drops.
        // SAFETY: the stub has no initialisers.
        let lib = unsafe { libloading::Library::new(&path) }.expect("loading the stub");
        Some((path, lib))
    })
    .as_ref()
}

fn log(lib: &libloading::Library) -> String {
    // SAFETY: `stub_log` is `const char *stub_log(void)` in the stub.
    unsafe {
        let f = lib
            .get::<unsafe extern "C" fn() -> *const c_char>(b"stub_log")
            .unwrap();
        CStr::from_ptr(f()).to_string_lossy().into_owned()
    }
}

fn reset(lib: &libloading::Library) {
    // SAFETY: `void stub_reset(void)`.
    unsafe { lib.get::<unsafe extern "C" fn()>(b"stub_reset").unwrap()() }
}

fn config(path: &Path) -> GdrConfig {
    // /dev/null stands in for /dev/gdrdrv: the node must exist, nothing is opened through it.
    GdrConfig {
        libraries: vec![path.display().to_string()],
        device: PathBuf::from("/dev/null"),
    }
}

/// 2 GPU pages of 64 KiB-aligned host memory standing in for a GPU allocation.
struct FakeGpu {
    ptr: *mut u8,
    layout: Layout,
}

impl FakeGpu {
    fn new() -> Self {
        let layout =
            Layout::from_size_align(2 * GPU_PAGE_SIZE as usize, GPU_PAGE_SIZE as usize).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Self { ptr, layout }
    }
    fn addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for FakeGpu {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

#[test]
fn pin_map_copy_and_teardown_order() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some((path, lib)) = stub() else { return };
    reset(lib);
    let mem = FakeGpu::new();
    let gdr = Gdr::open_with(&config(path)).expect("open through the stub");
    assert_eq!(gdr.runtime_version(), Some((2, 5)));
    assert_eq!(gdr.driver_version(), Some((2, 4)));

    // Refused before reaching the library.
    assert!(matches!(
        gdr.pin(mem.addr() + 8, 64),
        Err(GdrError::Misaligned { .. })
    ));
    assert!(matches!(gdr.pin(mem.addr(), 0), Err(GdrError::Empty)));
    // Refused by the library: the code comes back.
    match gdr.pin(mem.addr(), 2 << 30) {
        Err(GdrError::Call {
            call: "gdr_pin_buffer",
            code: -22,
        }) => {}
        other => panic!("expected gdr_pin_buffer -22, got {other:?}"),
    }

    let pinned = gdr.pin(mem.addr(), 100).expect("pin");
    let info = pinned.info().unwrap();
    assert_eq!(
        (info.va, info.mapped_size, info.page_size, info.mapped),
        (mem.addr(), 65536, 65536, false)
    );
    let mut map = pinned.map().expect("map");
    assert!(map.info().unwrap().mapped && map.info().unwrap().wc_mapping);
    assert_eq!(map.device_ptr(), mem.addr());
    assert_eq!(map.len(), 100);
    assert_eq!(map.cpu_ptr(), mem.ptr);

    map.write_u64(8, 0x1122_3344_5566_7788);
    // SAFETY: in bounds and aligned; nothing else writes the fake GPU memory concurrently.
    let seen = unsafe { (mem.ptr.add(8) as *const u64).read_volatile() };
    assert_eq!(seen, 0x1122_3344_5566_7788);
    assert_eq!(map.read_u64(8), 0x1122_3344_5566_7788);
    map.copy_to(32, b"through gdr_copy_to_mapping").unwrap();
    let mut back = [0u8; 27];
    map.copy_from(32, &mut back).unwrap();
    assert_eq!(&back, b"through gdr_copy_to_mapping");

    drop(gdr); // the handle stays open while a buffer lives
    assert!(!log(lib).contains("close"));
    drop(map);
    let l = log(lib);
    assert!(l.ends_with("unmap unpin close"), "teardown order: {l}");
    assert!(!l.contains("bad"), "{l}");
}

#[test]
fn unmap_returns_the_pinned_buffer() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some((path, lib)) = stub() else { return };
    reset(lib);
    let mem = FakeGpu::new();
    let gdr = Gdr::open_with(&config(path)).unwrap();
    let map = gdr
        .pin(mem.addr(), GPU_PAGE_SIZE as usize + 1)
        .unwrap()
        .map()
        .unwrap();
    let pinned = map.unmap().unwrap();
    assert!(!pinned.info().unwrap().mapped);
    let again = pinned.map().unwrap();
    drop(again);
    drop(gdr);
    let l = log(lib);
    assert_eq!(
        l, "open pin map info unmap info map info unmap unpin close",
        "{l}"
    );
}

#[test]
fn gdr_open_returning_null_is_an_error() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some((path, lib)) = stub() else { return };
    reset(lib);
    // SAFETY: `void stub_fail_open(int)`.
    unsafe {
        lib.get::<unsafe extern "C" fn(i32)>(b"stub_fail_open")
            .unwrap()(1)
    };
    let e = Gdr::open_with(&config(path)).unwrap_err();
    assert!(matches!(e, GdrError::OpenFailed { .. }), "{e}");
    assert!(e.to_string().contains("gdr_open failed"));
    reset(lib);
}

#[test]
fn a_library_without_the_api_is_refused() {
    let Some(path) = build("libgdrapi_only_open.so", &["-DONLY_OPEN"]) else {
        return;
    };
    let e = Gdr::open_with(&config(&path)).unwrap_err();
    match &e {
        // gdr_open is there; the info call (v2, then the old name) is the first one missing.
        GdrError::SymbolMissing { symbol, .. } => assert_eq!(*symbol, "gdr_get_info"),
        other => panic!("expected SymbolMissing, got {other}"),
    }
    assert!(e.to_string().contains("GDRCopy 2.x is required"), "{e}");
}
