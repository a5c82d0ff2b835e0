//! rdma-core's libraries, loaded at run time: `libibverbs.so.1` and `libmlx5.so.1`.
//!
//! Nothing in this workspace links rdma-core. A binary or Python wheel built here runs on a
//! machine without it (the emulated NIC needs none of it), and on a machine with a ConnectX the
//! first device call loads both libraries and resolves every symbol this crate calls, once. A
//! library or symbol that is missing is [`VerbsError::RdmaCoreMissing`], naming it, the
//! loader's message and the package to install.
//!
//! The signatures below are those of `infiniband/verbs.h` and `infiniband/mlx5dv.h` (rdma-core
//! ≥ 32 for `_ibv_query_gid_ex`, ≥ 34 for `ibv_reg_dmabuf_mr`); the types come from the
//! generated bindings in [`ffi`](crate::ffi).

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use crate::error::{RdmaCoreMissing, Result};
use crate::ffi;

/// libibverbs' names, tried in order (`$IBGDA_IBVERBS_LIB` first when set).
const IBVERBS: &[&str] = &["libibverbs.so.1", "libibverbs.so"];
/// libmlx5's names, tried in order (`$IBGDA_MLX5_LIB` first when set).
const MLX5: &[&str] = &["libmlx5.so.1", "libmlx5.so"];
/// Overrides the libibverbs path.
pub const IBVERBS_ENV: &str = "IBGDA_IBVERBS_LIB";
/// Overrides the libmlx5 path.
pub const MLX5_ENV: &str = "IBGDA_MLX5_LIB";

/// The entry points this crate calls, resolved from the loaded libraries.
pub(crate) struct Api {
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ffi::ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ffi::ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ffi::ibv_device) -> *const c_char,
    pub get_device_guid: unsafe extern "C" fn(*mut ffi::ibv_device) -> u64,
    pub open_device: unsafe extern "C" fn(*mut ffi::ibv_device) -> *mut ffi::ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ffi::ibv_context) -> c_int,
    pub query_device:
        unsafe extern "C" fn(*mut ffi::ibv_context, *mut ffi::ibv_device_attr) -> c_int,
    /// The exported `ibv_query_port` (the header's inline wrapper passes it the full
    /// `ibv_port_attr`, as this crate does).
    pub query_port:
        unsafe extern "C" fn(*mut ffi::ibv_context, u8, *mut ffi::ibv_port_attr) -> c_int,
    pub query_gid:
        unsafe extern "C" fn(*mut ffi::ibv_context, u8, c_int, *mut ffi::ibv_gid) -> c_int,
    /// `_ibv_query_gid_ex`: absent before rdma-core 32 (the untyped query is used then).
    pub query_gid_ex: Option<
        unsafe extern "C" fn(
            *mut ffi::ibv_context,
            u32,
            u32,
            *mut ffi::ibv_gid_entry,
            u32,
            usize,
        ) -> c_int,
    >,
    pub alloc_pd: unsafe extern "C" fn(*mut ffi::ibv_context) -> *mut ffi::ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ffi::ibv_pd) -> c_int,
    pub reg_mr:
        unsafe extern "C" fn(*mut ffi::ibv_pd, *mut c_void, usize, c_int) -> *mut ffi::ibv_mr,
    /// `ibv_reg_dmabuf_mr`: absent before rdma-core 34.
    pub reg_dmabuf_mr: Option<
        unsafe extern "C" fn(*mut ffi::ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ffi::ibv_mr,
    >,
    pub dereg_mr: unsafe extern "C" fn(*mut ffi::ibv_mr) -> c_int,
    pub create_ah:
        unsafe extern "C" fn(*mut ffi::ibv_pd, *mut ffi::ibv_ah_attr) -> *mut ffi::ibv_ah,
    pub destroy_ah: unsafe extern "C" fn(*mut ffi::ibv_ah) -> c_int,
    pub mlx5_is_supported: unsafe extern "C" fn(*mut ffi::ibv_device) -> bool,
    pub mlx5_open_device: unsafe extern "C" fn(
        *mut ffi::ibv_device,
        *mut ffi::mlx5dv_context_attr,
    ) -> *mut ffi::ibv_context,
    pub mlx5_query_device:
        unsafe extern "C" fn(*mut ffi::ibv_context, *mut ffi::mlx5dv_context) -> c_int,
    pub mlx5_init_obj: unsafe extern "C" fn(*mut ffi::mlx5dv_obj, u64) -> c_int,
    pub devx_general_cmd: unsafe extern "C" fn(
        *mut ffi::ibv_context,
        *const c_void,
        usize,
        *mut c_void,
        usize,
    ) -> c_int,
    pub devx_obj_create: unsafe extern "C" fn(
        *mut ffi::ibv_context,
        *const c_void,
        usize,
        *mut c_void,
        usize,
    ) -> *mut ffi::mlx5dv_devx_obj,
    pub devx_obj_query: unsafe extern "C" fn(
        *mut ffi::mlx5dv_devx_obj,
        *const c_void,
        usize,
        *mut c_void,
        usize,
    ) -> c_int,
    pub devx_obj_modify: unsafe extern "C" fn(
        *mut ffi::mlx5dv_devx_obj,
        *const c_void,
        usize,
        *mut c_void,
        usize,
    ) -> c_int,
    pub devx_obj_destroy: unsafe extern "C" fn(*mut ffi::mlx5dv_devx_obj) -> c_int,
    pub devx_umem_reg: unsafe extern "C" fn(
        *mut ffi::ibv_context,
        *mut c_void,
        usize,
        u32,
    ) -> *mut ffi::mlx5dv_devx_umem,
    /// `mlx5dv_devx_umem_reg_ex`: absent before rdma-core 33.
    pub devx_umem_reg_ex: Option<
        unsafe extern "C" fn(
            *mut ffi::ibv_context,
            *mut ffi::mlx5dv_devx_umem_in,
        ) -> *mut ffi::mlx5dv_devx_umem,
    >,
    pub devx_umem_dereg: unsafe extern "C" fn(*mut ffi::mlx5dv_devx_umem) -> c_int,
    pub devx_alloc_uar:
        unsafe extern "C" fn(*mut ffi::ibv_context, u32) -> *mut ffi::mlx5dv_devx_uar,
    pub devx_free_uar: unsafe extern "C" fn(*mut ffi::mlx5dv_devx_uar),
    pub devx_query_eqn: unsafe extern "C" fn(*mut ffi::ibv_context, u32, *mut u32) -> c_int,
    /// Keeps the libraries mapped for as long as the pointers above are used (the process).
    _libs: [libloading::Library; 2],
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("rdma-core (libibverbs, libmlx5)")
    }
}

/// The libraries, loaded on first use; the same answer (or the same error) afterwards.
pub(crate) fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, RdmaCoreMissing>> = OnceLock::new();
    Ok(API.get_or_init(Api::load).as_ref().map_err(Clone::clone)?)
}

/// Whether libibverbs and libmlx5 can be loaded here, or why not.
pub fn rdma_core_available() -> Result<()> {
    api().map(|_| ())
}

fn names(env: &str, defaults: &[&str]) -> Vec<String> {
    std::env::var(env)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .into_iter()
        .chain(defaults.iter().map(|s| s.to_string()))
        .collect()
}

fn open(
    env: &str,
    defaults: &[&str],
    package: &'static str,
) -> std::result::Result<libloading::Library, RdmaCoreMissing> {
    let tried = names(env, defaults);
    let mut dlerror = String::from("no name to try");
    for name in &tried {
        // SAFETY: loading runs the library's initialisers; rdma-core's only register their
        // providers and read their configuration directory.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return Ok(lib),
            Err(e) => dlerror = e.to_string(),
        }
    }
    Err(RdmaCoreMissing::Library {
        tried,
        dlerror,
        package,
    })
}

fn sym<T: Copy>(
    lib: &libloading::Library,
    library: &'static str,
    name: &'static str,
) -> std::result::Result<T, RdmaCoreMissing> {
    // SAFETY: every `T` this is called with is the C prototype of `name` in verbs.h / mlx5dv.h
    // (see the fields of `Api`).
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| RdmaCoreMissing::Symbol {
            library,
            symbol: name,
            dlerror: e.to_string(),
        })
}

impl Api {
    fn load() -> std::result::Result<Self, RdmaCoreMissing> {
        let verbs = open(IBVERBS_ENV, IBVERBS, "libibverbs1 (rdma-core)")?;
        let mlx5 = open(MLX5_ENV, MLX5, "libmlx5-1 / ibverbs-providers (rdma-core)")?;
        let (v, m) = ("libibverbs", "libmlx5");
        Ok(Self {
            get_device_list: sym(&verbs, v, "ibv_get_device_list")?,
            free_device_list: sym(&verbs, v, "ibv_free_device_list")?,
            get_device_name: sym(&verbs, v, "ibv_get_device_name")?,
            get_device_guid: sym(&verbs, v, "ibv_get_device_guid")?,
            open_device: sym(&verbs, v, "ibv_open_device")?,
            close_device: sym(&verbs, v, "ibv_close_device")?,
            query_device: sym(&verbs, v, "ibv_query_device")?,
            query_port: sym(&verbs, v, "ibv_query_port")?,
            query_gid: sym(&verbs, v, "ibv_query_gid")?,
            query_gid_ex: sym(&verbs, v, "_ibv_query_gid_ex").ok(),
            alloc_pd: sym(&verbs, v, "ibv_alloc_pd")?,
            dealloc_pd: sym(&verbs, v, "ibv_dealloc_pd")?,
            reg_mr: sym(&verbs, v, "ibv_reg_mr")?,
            reg_dmabuf_mr: sym(&verbs, v, "ibv_reg_dmabuf_mr").ok(),
            dereg_mr: sym(&verbs, v, "ibv_dereg_mr")?,
            create_ah: sym(&verbs, v, "ibv_create_ah")?,
            destroy_ah: sym(&verbs, v, "ibv_destroy_ah")?,
            mlx5_is_supported: sym(&mlx5, m, "mlx5dv_is_supported")?,
            mlx5_open_device: sym(&mlx5, m, "mlx5dv_open_device")?,
            mlx5_query_device: sym(&mlx5, m, "mlx5dv_query_device")?,
            mlx5_init_obj: sym(&mlx5, m, "mlx5dv_init_obj")?,
            devx_general_cmd: sym(&mlx5, m, "mlx5dv_devx_general_cmd")?,
            devx_obj_create: sym(&mlx5, m, "mlx5dv_devx_obj_create")?,
            devx_obj_query: sym(&mlx5, m, "mlx5dv_devx_obj_query")?,
            devx_obj_modify: sym(&mlx5, m, "mlx5dv_devx_obj_modify")?,
            devx_obj_destroy: sym(&mlx5, m, "mlx5dv_devx_obj_destroy")?,
            devx_umem_reg: sym(&mlx5, m, "mlx5dv_devx_umem_reg")?,
            devx_umem_reg_ex: sym(&mlx5, m, "mlx5dv_devx_umem_reg_ex").ok(),
            devx_umem_dereg: sym(&mlx5, m, "mlx5dv_devx_umem_dereg")?,
            devx_alloc_uar: sym(&mlx5, m, "mlx5dv_devx_alloc_uar")?,
            devx_free_uar: sym(&mlx5, m, "mlx5dv_devx_free_uar")?,
            devx_query_eqn: sym(&mlx5, m, "mlx5dv_devx_query_eqn")?,
            _libs: [verbs, mlx5],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_named_with_the_package_to_install() {
        let e = open(
            "IBGDA_TEST_NEVER_SET",
            &["libibgda-no-such-library.so.9"],
            "the-package",
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("libibgda-no-such-library.so.9") && text.contains("install the-package"),
            "{text}"
        );
    }

    #[test]
    fn rdma_core_loads_here_or_says_why() {
        // CI installs libibverbs-dev (so the libraries are there); elsewhere the error names
        // the library.
        match rdma_core_available() {
            Ok(()) => assert!(crate::list_devices().is_ok()),
            Err(e) => assert!(e.to_string().contains("rdma-core"), "{e}"),
        }
    }
}
