//! The CUDA driver, loaded at run time and checked before first use.
//!
//! cudarc loads `libcuda` lazily and panics when it is absent; every GPU entry point in this
//! project goes through [`context`] or [`device_count`], which look for the library first and
//! turn its absence into [`CudaError::DriverMissing`].

use std::sync::Arc;

pub use cudarc::driver::{CudaContext, CudaStream, DriverError};

/// Why the GPU could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda.so` could not be loaded: no NVIDIA driver on this machine.
    #[error("the CUDA driver (libcuda.so) is not installed on this machine: no GPU work is possible here")]
    DriverMissing,
    /// A driver call failed.
    #[error("{call} failed: {source}")]
    Driver {
        /// The driver call (or cudarc function) that failed.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// A device ordinal past the number of visible GPUs.
    #[error("GPU {ordinal} requested but only {count} visible")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many GPUs are visible.
        count: usize,
    },
}

/// Whether `libcuda` can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names and drops the handles.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of visible CUDA devices, or an error when there is no driver.
pub fn device_count() -> Result<usize, CudaError> {
    if !driver_present() {
        return Err(CudaError::DriverMissing);
    }
    cudarc::driver::result::init().map_err(|source| CudaError::Driver { call: "cuInit", source })?;
    let n = CudaContext::device_count()
        .map_err(|source| CudaError::Driver { call: "cuDeviceGetCount", source })?;
    Ok(n.max(0) as usize)
}

/// Retains the primary context of GPU `ordinal`.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    CudaContext::new(ordinal).map_err(|source| CudaError::Driver { call: "cuDevicePrimaryCtxRetain", source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        match device_count() {
            Ok(n) => eprintln!("driver present, {n} GPU(s)"),
            Err(CudaError::DriverMissing) => assert!(!driver_present()),
            Err(e) => eprintln!("driver present but unusable: {e}"),
        }
    }
}
