//! Generates Rust bindings for the types of `infiniband/mlx5dv.h` this crate uses. Nothing is
//! linked: libibverbs and libmlx5 are loaded at run time (`src/rdma_core/loader.rs`), so a binary
//! or wheel built here runs where rdma-core is not installed.
//!
//! The verbs types (`ibv_context`, `ibv_pd`, ...) are not regenerated: they are blocklisted here
//! and taken from rdma-sys, so a pointer from one crate is the same type in the other.

use std::env;
use std::path::PathBuf;

/// Types the crate reads or fills (their dependencies come along).
const TYPES: &[&str] = &[
    "mlx5dv_context",
    "mlx5dv_context_attr",
    "mlx5dv_obj",
    "mlx5dv_pd",
    "mlx5dv_ah",
    "mlx5_wqe_av",
    "mlx5dv_devx_uar",
    "mlx5dv_devx_umem",
    "mlx5dv_devx_umem_in",
    "mlx5dv_devx_obj",
    // Enums whose constants the crate uses.
    "mlx5dv_context_attr_flags",
    "mlx5dv_context_flags",
    "mlx5dv_obj_type",
    "mlx5dv_devx_umem_in_mask",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/mlx5dv_wrapper.h");
    println!("cargo:rerun-if-env-changed=IBGDA_RDMA_INCLUDE");

    // Where rdma-core's headers are: an explicit override, else the system include directory.
    let include = env::var_os("IBGDA_RDMA_INCLUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/include"));
    let header = include.join("infiniband").join("mlx5dv.h");
    if !header.is_file() {
        panic!(
            "ibgda-verbs: {} not found.\n\
             The mlx5 direct-verbs headers come with rdma-core's development package:\n    \
             sudo apt-get install libibverbs-dev\n\
             (or set IBGDA_RDMA_INCLUDE to the directory that holds infiniband/mlx5dv.h)",
            header.display()
        );
    }

    let mut builder = bindgen::Builder::default()
        .header("src/mlx5dv_wrapper.h")
        .clang_arg(format!("-I{}", include.display()))
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        // Verbs types come from rdma-sys (`use rdma_sys::*` where the bindings are included).
        .blocklist_type("ibv_.*")
        .blocklist_type("verbs_.*")
        .blocklist_type("_compat_ibv_.*")
        .blocklist_type("pthread_.*")
        .blocklist_type("__be(16|32|64)")
        .prepend_enum_name(false)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .derive_default(true)
        .derive_debug(false)
        .generate_comments(false)
        .layout_tests(true)
        .size_t_is_usize(true);
    for t in TYPES {
        builder = builder.allowlist_type(t);
    }
    let bindings = builder
        .generate()
        .expect("ibgda-verbs: bindgen failed on infiniband/mlx5dv.h");

    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings
        .write_to_file(out.join("mlx5dv.rs"))
        .expect("ibgda-verbs: could not write the mlx5dv bindings");
}
