//! CUDA kernels for expert-parallel communication, compiled by `cargo xtask build-kernels` into
//! fatbins (sm_90a machine code and compute_90 PTX) that this crate embeds, and loaded through
//! cudarc.
//!
//! Owns: the embedded kernel images ([`MODULES`]), loading them into a CUDA context
//! ([`load_module`]), the typed launch-parameter structs shared with the `.cu` sources, and
//! [`testing`], the GPU test harness every GPU test uses.
//!
//! Must not know about: ranks, bootstrap or buffers' lifetimes (that is `ep`).
//!
//! Sources live in `crates/ep-kernels/cuda/`: one `.cu` per kernel family, shared device helpers in
//! `cuda/include/ep/`, device-test kernels in `cuda/tests/`. A module is named by its path without
//! `.cu` (`smoke`, `tests/wire`).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, DriverError};

pub mod internode;
pub mod intranode;
pub mod low_latency;
pub mod profile_names;
pub mod testing;

include!(concat!(env!("OUT_DIR"), "/modules.rs"));

/// Why a kernel could not be had.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// This build embeds no kernels.
    #[error("kernels not built: run `cargo xtask build-kernels`, then rebuild")]
    NotBuilt,
    /// No module of that name is embedded.
    #[error("no kernel module named {name:?} (embedded: {available})")]
    UnknownModule {
        /// The name asked for.
        name: String,
        /// The names that exist, comma-separated.
        available: String,
    },
    /// The driver refused the image (`cuModuleLoadData`).
    #[error("cuModuleLoadData({name}) failed: {source}")]
    Load {
        /// The module.
        name: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// The module has no function of that name (`cuModuleGetFunction`).
    #[error("cuModuleGetFunction({module}::{function}) failed: {source}")]
    Function {
        /// The module.
        module: String,
        /// The function asked for.
        function: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// The CUDA driver is missing or failed.
    #[error(transparent)]
    Cuda(#[from] ibgda_device::cuda::CudaError),
}

/// The fatbin of module `name`.
pub fn fatbin(name: &str) -> Result<&'static [u8], KernelError> {
    if MODULES.is_empty() {
        return Err(KernelError::NotBuilt);
    }
    MODULES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, b)| *b)
        .ok_or_else(|| KernelError::UnknownModule {
            name: name.to_string(),
            available: MODULES
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Loads module `name` into `ctx`.
pub fn load_module(ctx: &Arc<CudaContext>, name: &str) -> Result<Arc<CudaModule>, KernelError> {
    let image = fatbin(name)?;
    ctx.load_module(cudarc::nvrtc::Ptx::from_binary(image.to_vec()))
        .map_err(|source| KernelError::Load {
            name: name.to_string(),
            source,
        })
}

/// Loads `function` from module `name` into `ctx`.
pub fn load_function(
    ctx: &Arc<CudaContext>,
    module: &str,
    function: &str,
) -> Result<CudaFunction, KernelError> {
    load_module(ctx, module)?
        .load_function(function)
        .map_err(|source| KernelError::Function {
            module: module.to_string(),
            function: function.to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_module_is_a_clear_error() {
        match fatbin("no/such/module") {
            Err(KernelError::NotBuilt) => {
                assert!(KernelError::NotBuilt
                    .to_string()
                    .contains("cargo xtask build-kernels"))
            }
            Err(KernelError::UnknownModule { available, .. }) => assert!(!available.is_empty()),
            other => panic!("unexpected: {other:?}"),
        }
    }

    #[test]
    fn embedded_images_are_fatbins() {
        // A fatbin starts with the magic 0xBA55ED50 (little-endian).
        for (name, bytes) in MODULES {
            assert!(bytes.len() > 16, "{name} is empty");
            assert_eq!(
                &bytes[..4],
                &[0x50, 0xed, 0x55, 0xba],
                "{name} is not a fatbin"
            );
        }
    }
}
