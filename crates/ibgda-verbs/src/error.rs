//! Errors: each names the C call or firmware command that failed and carries its code and text.

use crate::prm::{CommandFailed, PrmError};

/// The message given when the driver refuses to map NIC doorbells into the GPU.
pub const PEER_MAPPING_HINT: &str = "the driver does not allow mapping NIC doorbells into the GPU \
     (PeerMappingOverride): use a CPU NIC-handler mode";

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// A libibverbs / libmlx5 call failed with `errno`.
    #[error("{call} failed: {text} (errno {errno})")]
    Call {
        /// The C function.
        call: &'static str,
        /// `errno` after the call (or the negative return code, negated).
        errno: i32,
        /// `strerror(errno)`.
        text: String,
    },
    /// A DEVX firmware command was refused; firmware's status and syndrome say why.
    #[error("{source} (errno {errno}: {text})")]
    Firmware {
        /// The command's status and syndrome.
        #[source]
        source: CommandFailed,
        /// `errno` from the DEVX call.
        errno: i32,
        /// `strerror(errno)`.
        text: String,
    },
    /// A command image could not be built from the arguments given.
    #[error("bad argument for a firmware command: {0}")]
    Command(#[from] PrmError),
    /// No RDMA device of that name.
    #[error("no RDMA device named {name:?} (found: {})", if found.is_empty() { "none".to_string() } else { found.join(", ") })]
    NoSuchDevice {
        /// The name asked for.
        name: String,
        /// The devices that do exist.
        found: Vec<String>,
    },
    /// The device is not driven by mlx5, so DEVX and mlx5dv are unavailable.
    #[error("{device} is not an mlx5 (ConnectX) device: GPU-initiated RDMA needs mlx5 DEVX")]
    NotMlx5 {
        /// The device name.
        device: String,
    },
    /// The device was opened without DEVX (the kernel or the user's permissions refused it).
    #[error("{device} was opened without DEVX ({reason}); DEVX objects cannot be created")]
    DevxUnavailable {
        /// The device name.
        device: String,
        /// Why DEVX could not be enabled.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("{call} failed: CUDA error {code} ({text})")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The `CUresult` code.
        code: u32,
        /// The driver's description.
        text: String,
    },
    /// `libcuda.so` is not installed, so GPU memory cannot be registered or mapped.
    #[error("the CUDA driver (libcuda.so) is not installed on this machine: {0} needs it")]
    CudaDriverMissing(&'static str),
    /// `cuMemHostRegister(IOMEMORY)` on the UAR returned `CUDA_ERROR_NOT_PERMITTED` (800).
    #[error(
        "{PEER_MAPPING_HINT} (cuMemHostRegister returned CUDA error 800, CUDA_ERROR_NOT_PERMITTED)"
    )]
    GpuDoorbellMappingNotPermitted,
    /// GPU memory could be registered neither through dma-buf nor through peer memory.
    #[error(
        "cannot register GPU memory {addr:#x}+{len:#x} with the NIC: dma-buf: {dma_buf}; \
         peer memory (nvidia-peermem): {peer_mem}"
    )]
    GpuRegistration {
        /// The device address.
        addr: u64,
        /// The length.
        len: usize,
        /// Why the dma-buf path failed.
        dma_buf: String,
        /// Why the `ibv_reg_mr` / `mlx5dv_devx_umem_reg` path failed.
        peer_mem: String,
    },
    /// An argument breaks a rule of the API (alignment, size, power of two...).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// rdma-core (libibverbs, libmlx5) could not be loaded at run time.
    #[error(transparent)]
    RdmaCoreMissing(#[from] RdmaCoreMissing),
}

/// Why rdma-core's libraries could not be loaded (they are loaded at run time, never linked).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RdmaCoreMissing {
    /// No name of the library could be opened.
    #[error("rdma-core is not installed: could not load {} ({dlerror}); install {package}", tried.join(" or "))]
    Library {
        /// The names tried, in order.
        tried: Vec<String>,
        /// The loader's message for the last one.
        dlerror: String,
        /// The package that provides it.
        package: &'static str,
    },
    /// The library is too old or not rdma-core's: a symbol this crate calls is missing.
    #[error("{library} has no {symbol} ({dlerror}): rdma-core is too old (32 or newer needed)")]
    Symbol {
        /// The library.
        library: &'static str,
        /// The missing symbol.
        symbol: &'static str,
        /// The loader's message.
        dlerror: String,
    },
}

/// Result alias for this crate.
pub type Result<T, E = VerbsError> = std::result::Result<T, E>;

impl VerbsError {
    /// The error for C call `call` from the current `errno`.
    pub(crate) fn last_os(call: &'static str) -> Self {
        Self::from_errno(
            call,
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        )
    }

    /// The error for C call `call` from an explicit error number (positive or negative): what a
    /// [`Driver`](crate::Driver) returns when the call it stands for fails.
    pub fn from_errno(call: &'static str, errno: i32) -> Self {
        let errno = errno.abs();
        let text = if errno == 0 {
            "failed without setting errno".to_string()
        } else {
            strip_os_suffix(std::io::Error::from_raw_os_error(errno).to_string())
        };
        VerbsError::Call { call, errno, text }
    }

    /// A firmware refusal, with the `errno` the DEVX call returned alongside it (0 if none).
    pub(crate) fn firmware(source: CommandFailed, errno: i32) -> Self {
        let errno = errno.abs();
        let text = strip_os_suffix(std::io::Error::from_raw_os_error(errno).to_string());
        VerbsError::Firmware {
            source,
            errno,
            text,
        }
    }

    /// The `errno` of a failed C call, if this is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            VerbsError::Call { errno, .. } | VerbsError::Firmware { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

/// The error for a C call that returned `rc` (`-1` with `errno`, `-errno`, or `errno`).
pub(crate) fn rc_error(call: &'static str, rc: i32) -> VerbsError {
    if rc == -1 {
        VerbsError::last_os(call)
    } else {
        VerbsError::from_errno(call, rc)
    }
}

/// `io::Error` renders "No such device (os error 19)"; the errno is reported separately.
fn strip_os_suffix(s: String) -> String {
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_errors_name_the_call_and_errno() {
        let e = VerbsError::from_errno("ibv_open_device", 19);
        assert_eq!(
            e.to_string(),
            "ibv_open_device failed: No such device (errno 19)"
        );
        assert_eq!(e.errno(), Some(19));
        let e = VerbsError::from_errno("ibv_dereg_mr", -22);
        assert_eq!(
            e.to_string(),
            "ibv_dereg_mr failed: Invalid argument (errno 22)"
        );
        let e = VerbsError::from_errno("x", 0);
        assert!(e.to_string().contains("without setting errno"));
    }

    #[test]
    fn peer_mapping_message_is_the_documented_one() {
        let text = VerbsError::GpuDoorbellMappingNotPermitted.to_string();
        assert!(text.starts_with(
            "the driver does not allow mapping NIC doorbells into the GPU (PeerMappingOverride): \
             use a CPU NIC-handler mode"
        ));
        assert!(text.contains("800"));
    }

    #[test]
    fn no_such_device_lists_what_exists() {
        let e = VerbsError::NoSuchDevice {
            name: "mlx5_9".into(),
            found: vec![],
        };
        assert_eq!(
            e.to_string(),
            "no RDMA device named \"mlx5_9\" (found: none)"
        );
        let e = VerbsError::NoSuchDevice {
            name: "mlx5_9".into(),
            found: vec!["mlx5_0".into(), "mlx5_1".into()],
        };
        assert!(e.to_string().ends_with("(found: mlx5_0, mlx5_1)"));
    }

    #[test]
    fn firmware_errors_keep_status_and_syndrome() {
        let e = VerbsError::Firmware {
            source: CommandFailed {
                command: "CREATE_CQ",
                status: 3,
                syndrome: 0xdead,
            },
            errno: 121,
            text: "Remote I/O error".into(),
        };
        let s = e.to_string();
        assert!(
            s.contains("CREATE_CQ")
                && s.contains("bad parameter")
                && s.contains("0x0000dead")
                && s.contains("121"),
            "{s}"
        );
    }
}
