//! Choosing who rings the doorbells: [`HandlerChoice`] (what was asked for, `auto` by default)
//! and [`select`], which turns it into a [`NicHandler`] from what this machine can do.
//!
//! `auto` prefers `gpu` (no proxy thread, lowest latency) when the NIC's doorbell register can be
//! mapped into the GPU, then `cpu` when GDRCopy works, else `cpu_host_memory`, which needs nothing
//! but pinned host memory. Asking for a mode the machine cannot do is an error that names what is
//! missing, never a silent fallback.
//!
//! ```
//! use ibgda_device::protocol::{select, HandlerChoice, HandlerProbe};
//! use ibgda_device::qp_desc::NicHandler;
//!
//! let probe = HandlerProbe {
//!     gpu_doorbell: Err("cudaHostRegister(IoMemory) of the UAR failed (error 800)".into()),
//!     gdrcopy: Err("libgdrapi.so.2 not found".into()),
//! };
//! assert_eq!(select("auto".parse().unwrap(), &probe).unwrap(), NicHandler::CpuHostMemory);
//! let err = select(HandlerChoice::Cpu, &probe).unwrap_err().to_string();
//! assert!(err.contains("libgdrapi.so.2"));
//! ```

use core::fmt;
use core::str::FromStr;

use crate::qp_desc::NicHandler;

/// Environment variable that overrides the configured choice (`auto`, `gpu`, `cpu`,
/// `cpu_host_memory`).
pub const HANDLER_ENV: &str = "IBGDA_NIC_HANDLER";

/// The handler mode asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HandlerChoice {
    /// The best mode this machine supports (see the module doc).
    #[default]
    Auto,
    /// [`NicHandler::Gpu`]: the GPU rings the NIC itself.
    Gpu,
    /// [`NicHandler::Cpu`]: a CPU proxy polls producer slots in GPU memory through GDRCopy.
    Cpu,
    /// [`NicHandler::CpuHostMemory`]: a CPU proxy polls producer slots in pinned host memory.
    CpuHostMemory,
}

impl HandlerChoice {
    /// The choice's name as configuration spells it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Gpu => "gpu",
            Self::Cpu => "cpu",
            Self::CpuHostMemory => "cpu_host_memory",
        }
    }

    /// The choice in [`HANDLER_ENV`] if set, else `default`. A value that names no mode is an
    /// error, not ignored.
    pub fn from_env_or(default: Self) -> Result<Self, UnknownHandler> {
        match std::env::var(HANDLER_ENV) {
            Ok(v) if !v.trim().is_empty() => v.parse(),
            _ => Ok(default),
        }
    }
}

impl fmt::Display for HandlerChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<NicHandler> for HandlerChoice {
    fn from(h: NicHandler) -> Self {
        match h {
            NicHandler::Gpu => Self::Gpu,
            NicHandler::Cpu => Self::Cpu,
            NicHandler::CpuHostMemory => Self::CpuHostMemory,
        }
    }
}

/// A handler name that is not one of `auto`, `gpu`, `cpu`, `cpu_host_memory`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown NIC handler {0:?}: expected auto, gpu, cpu or cpu_host_memory")]
pub struct UnknownHandler(pub String);

impl FromStr for HandlerChoice {
    type Err = UnknownHandler;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "gpu" => Ok(Self::Gpu),
            "cpu" => Ok(Self::Cpu),
            "cpu_host_memory" | "cpu-host-memory" => Ok(Self::CpuHostMemory),
            _ => Err(UnknownHandler(s.to_string())),
        }
    }
}

/// What this machine can do, as probed by whoever builds the QPs: `Ok` when the capability works,
/// else what is missing, in words a user can act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandlerProbe {
    /// Whether the NIC's doorbell register (UAR) can be mapped into the GPU: mode `gpu`.
    pub gpu_doorbell: Result<(), String>,
    /// Whether the CPU can read producer slots in GPU memory: mode `cpu`. GDRCopy on a real NIC;
    /// on the emulated NIC, GDRCopy or the emulated GDR view (a GPU is all it needs).
    /// [`ModePlan`](crate::protocol::ModePlan)'s `Requirement::GdrCopy` is checked against it.
    pub gdrcopy: Result<(), String>,
}

/// A mode was asked for that this machine cannot run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("NIC handler {mode} is not available here: {missing}")]
pub struct HandlerUnavailable {
    /// The mode asked for.
    pub mode: HandlerChoice,
    /// What is missing.
    pub missing: String,
}

/// The mode to run: `choice` itself if the machine supports it, or for `auto` the best supported
/// one. Logs the decision (and for `auto`, why the better modes were passed over) in one line.
pub fn select(
    choice: HandlerChoice,
    probe: &HandlerProbe,
) -> Result<NicHandler, HandlerUnavailable> {
    let (mode, why) = select_why(choice, probe)?;
    tracing::info!(target: "ibgda", "NIC handler mode {} ({why})", mode.name());
    Ok(mode)
}

/// [`select`] without the log line: the mode and why it was chosen, for a caller that says it
/// together with other decisions (the NIC) in one line.
pub fn select_why(
    choice: HandlerChoice,
    probe: &HandlerProbe,
) -> Result<(NicHandler, String), HandlerUnavailable> {
    let need = |mode: HandlerChoice, cap: &Result<(), String>| {
        cap.clone()
            .map_err(|missing| HandlerUnavailable { mode, missing })
    };
    let (mode, why) = match choice {
        HandlerChoice::Gpu => {
            need(choice, &probe.gpu_doorbell)?;
            (NicHandler::Gpu, "asked for".to_string())
        }
        HandlerChoice::Cpu => {
            need(choice, &probe.gdrcopy)?;
            (NicHandler::Cpu, "asked for".to_string())
        }
        HandlerChoice::CpuHostMemory => (NicHandler::CpuHostMemory, "asked for".to_string()),
        HandlerChoice::Auto => match (&probe.gpu_doorbell, &probe.gdrcopy) {
            (Ok(()), _) => (
                NicHandler::Gpu,
                "auto: the doorbell maps into the GPU".to_string(),
            ),
            (Err(no_gpu), Ok(())) => (
                NicHandler::Cpu,
                format!("auto: gpu unavailable ({no_gpu}); GDRCopy works"),
            ),
            (Err(no_gpu), Err(no_gdr)) => (
                NicHandler::CpuHostMemory,
                format!("auto: gpu unavailable ({no_gpu}); cpu unavailable ({no_gdr})"),
            ),
        },
    };
    Ok((mode, why))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(gpu: bool, gdr: bool) -> HandlerProbe {
        HandlerProbe {
            gpu_doorbell: if gpu {
                Ok(())
            } else {
                Err("no UAR mapping".into())
            },
            gdrcopy: if gdr {
                Ok(())
            } else {
                Err("GDRCopy: /dev/gdrdrv missing".into())
            },
        }
    }

    #[test]
    fn auto_prefers_gpu_then_cpu_then_host_memory() {
        use HandlerChoice::Auto;
        assert_eq!(select(Auto, &probe(true, true)), Ok(NicHandler::Gpu));
        assert_eq!(select(Auto, &probe(true, false)), Ok(NicHandler::Gpu));
        assert_eq!(select(Auto, &probe(false, true)), Ok(NicHandler::Cpu));
        assert_eq!(
            select(Auto, &probe(false, false)),
            Ok(NicHandler::CpuHostMemory)
        );
    }

    #[test]
    fn explicit_modes_fail_with_what_is_missing() {
        let e = select(HandlerChoice::Cpu, &probe(true, false)).unwrap_err();
        assert!(e.to_string().contains("/dev/gdrdrv"), "{e}");
        assert!(e.to_string().contains("cpu"), "{e}");
        let e = select(HandlerChoice::Gpu, &probe(false, true)).unwrap_err();
        assert!(e.to_string().contains("no UAR mapping"), "{e}");
        assert_eq!(
            select(HandlerChoice::CpuHostMemory, &probe(false, false)),
            Ok(NicHandler::CpuHostMemory)
        );
    }

    #[test]
    fn names_parse_back() {
        for c in [
            HandlerChoice::Auto,
            HandlerChoice::Gpu,
            HandlerChoice::Cpu,
            HandlerChoice::CpuHostMemory,
        ] {
            assert_eq!(c.name().parse::<HandlerChoice>(), Ok(c));
        }
        assert!("fast".parse::<HandlerChoice>().is_err());
    }
}
