//! Real or emulated NIC: [`NicChoice`] and [`choose_nic`], which decides once and says so in one
//! log line; [`RealNic::open`], the real-hardware entry (the device, port and GID index from
//! [`RealNicSpec::from_env`], and the preflight's verdict); and [`open_transport`], which opens a
//! rank's transport on the NIC chosen: on a real mlx5 device the [`VerbsTransport`] over
//! rdma-core, the same code that runs on the emulated firmware here.

use core::fmt;
use core::str::FromStr;

use std::sync::Arc;

use cudarc::driver::CudaContext;
use ibgda_emu::firmware::EmuSubnet;

use super::backend::RankTransport;
use super::emulated_transport::EmulatedTransport;
use super::error::TransportError;
use super::verbs::{RealNicSpec, VerbsTransport};

/// Environment variable that overrides the NIC choice (`auto`, `emulated`, `real`).
pub const NIC_ENV: &str = "EP_NIC";

/// Which NIC to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NicChoice {
    /// A real mlx5 NIC when a usable one is present, the emulated NIC otherwise.
    #[default]
    Auto,
    /// The software mlx5 NIC (`ibgda-emu`), whatever hardware there is.
    Emulated,
    /// The real-NIC code path (`ibgda-verbs` objects and PRM firmware commands) on the emulated
    /// NIC's firmware: everything a ConnectX run does except the final ioctl. Ranks as threads
    /// of one process only (the emulated firmware's devices share one subnet).
    EmulatedVerbs,
    /// A real mlx5 NIC, or an error.
    Real,
}

impl NicChoice {
    /// The choice in [`NIC_ENV`] if set, else `default`.
    pub fn from_env_or(default: Self) -> Result<Self, TransportError> {
        match std::env::var(NIC_ENV) {
            Ok(v) if !v.trim().is_empty() => v.parse(),
            _ => Ok(default),
        }
    }
}

impl fmt::Display for NicChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Emulated => "emulated",
            Self::EmulatedVerbs => "emulated-verbs",
            Self::Real => "real",
        })
    }
}

impl FromStr for NicChoice {
    type Err = TransportError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "emulated" | "emu" => Ok(Self::Emulated),
            "emulated-verbs" | "emulated_verbs" => Ok(Self::EmulatedVerbs),
            "real" | "mlx5" => Ok(Self::Real),
            other => Err(TransportError::Config(format!(
                "{NIC_ENV}={other:?}: expected auto, emulated, emulated-verbs or real"
            ))),
        }
    }
}

/// The NIC that was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NicKind {
    /// The emulated NIC.
    Emulated,
    /// The verbs path on the emulated NIC's firmware.
    EmulatedVerbs,
    /// A real mlx5 device, by name.
    Real(String),
}

impl fmt::Display for NicKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Emulated => f.write_str("emulated mlx5"),
            Self::EmulatedVerbs => f.write_str("emulated mlx5 through the verbs path"),
            Self::Real(name) => write!(f, "mlx5 device {name}"),
        }
    }
}

/// The NIC chosen and why, in words for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicDecision {
    /// The NIC.
    pub kind: NicKind,
    /// Why it was chosen.
    pub why: String,
}

/// The first mlx5 device, or why there is none usable and the fix (the preflight's words:
/// [`crate::preflight::real_nic`]).
pub fn find_real_nic() -> Result<String, String> {
    crate::preflight::real_nic().map_err(|m| m.to_string())
}

/// Decides real or emulated NIC for `choice`, without logging: the caller says it, with the
/// handler mode, in one line. `real` with no usable mlx5 device is
/// [`TransportError::NoRealNic`] with the reason.
pub fn decide_nic(choice: NicChoice) -> Result<NicDecision, TransportError> {
    Ok(match choice {
        NicChoice::Emulated => NicDecision {
            kind: NicKind::Emulated,
            why: format!("{NIC_ENV}=emulated or asked for"),
        },
        NicChoice::EmulatedVerbs => NicDecision {
            kind: NicKind::EmulatedVerbs,
            why: format!("{NIC_ENV}=emulated-verbs or asked for"),
        },
        NicChoice::Real => {
            let name = crate::preflight::real_nic().map_err(|m| TransportError::NoRealNic {
                hint: m.to_string(),
            })?;
            NicDecision {
                kind: NicKind::Real(name),
                why: format!("{NIC_ENV}=real or asked for"),
            }
        }
        NicChoice::Auto => match crate::preflight::real_nic() {
            // A device is present: real when the preflight says a handler mode can run on it.
            Ok(name) => match RealNic::open(Some(&name)) {
                Ok(nic) => NicDecision {
                    kind: NicKind::Real(nic.device),
                    why: "auto: a usable mlx5 device is present".into(),
                },
                Err(e) => NicDecision {
                    kind: NicKind::Emulated,
                    why: format!("auto: {e}"),
                },
            },
            Err(m) => NicDecision {
                kind: NicKind::Emulated,
                why: format!("auto: no usable mlx5 device ({})", m.why),
            },
        },
    })
}

/// Decides real or emulated NIC and logs the decision in one line.
pub fn choose_nic(choice: NicChoice) -> Result<NicKind, TransportError> {
    let d = decide_nic(choice)?;
    tracing::info!(target: "ep", "NIC: {} ({})", d.kind, d.why);
    Ok(d.kind)
}

/// The real-hardware path: an mlx5 device that the preflight says can run at least one
/// NIC-handler mode, and where its QPs go (device, port, GID index).
#[derive(Debug)]
pub struct RealNic {
    /// The device's name.
    pub device: String,
    /// Device, port and GID index, with the `EP_NIC_*` overrides applied.
    pub spec: RealNicSpec,
    /// The handler modes the preflight says can run on it here.
    pub modes: Vec<ibgda_device::qp_desc::NicHandler>,
}

impl RealNic {
    /// Checks `device` (or `EP_NIC_DEVICE`, or the first mlx5 device) for IBGDA QPs: without an
    /// mlx5 device [`TransportError::NoRealNic`] with the reason; with one that can run no
    /// handler mode here (DEVX, port, GPU memory registration, doorbell mapping, GDRCopy),
    /// [`TransportError::RealNicNotReady`] with the preflight's first reason and its fix. Opens
    /// nothing that outlives the call.
    pub fn open(device: Option<&str>) -> Result<Self, TransportError> {
        let found = match device {
            Some(d) => d.to_string(),
            None => find_real_nic().map_err(|hint| TransportError::NoRealNic { hint })?,
        };
        let spec = RealNicSpec::from_env(&found)?;
        let report = crate::preflight::preflight();
        let verdicts: Vec<_> = report
            .modes
            .iter()
            .filter(|v| v.nic == crate::preflight::NicSide::Real)
            .collect();
        let modes: Vec<_> = verdicts
            .iter()
            .filter(|v| v.result.is_ok())
            .map(|v| v.mode)
            .collect();
        if modes.is_empty() {
            let reason = verdicts
                .iter()
                .find_map(|v| v.result.as_ref().err())
                .map_or_else(|| "no verdict".to_string(), ToString::to_string);
            return Err(match &report.device {
                None => TransportError::NoRealNic { hint: reason },
                Some(_) => TransportError::RealNicNotReady {
                    device: spec.device,
                    reason,
                },
            });
        }
        Ok(Self {
            device: spec.device.clone(),
            spec,
            modes,
        })
    }
}

/// Opens rank `rank`'s transport on the NIC `kind`, on `ctx`'s GPU. Ranks that are threads of
/// this process pass the subnet every rank's emulated NIC shares (`threads`); ranks as
/// processes pass `None`. A real device is opened through rdma-core ([`VerbsTransport::real`])
/// once [`RealNic::open`] (the preflight) says a handler mode can run on it; ranks as threads
/// and as processes alike, as each rank's connection info travels through the bootstrap.
pub fn open_transport(
    kind: &NicKind,
    ctx: &Arc<CudaContext>,
    rank: u32,
    threads: Option<&EmuSubnet>,
) -> Result<Arc<dyn RankTransport>, TransportError> {
    match kind {
        NicKind::Emulated => Ok(Arc::new(match threads {
            Some(subnet) => EmulatedTransport::threads(subnet.fabric(), ctx, rank)?,
            None => EmulatedTransport::process(ctx, rank)?,
        })),
        NicKind::EmulatedVerbs => match threads {
            Some(subnet) => Ok(Arc::new(VerbsTransport::emulated_cuda(subnet, ctx, rank)?)),
            None => Err(TransportError::Config(format!(
                "{NIC_ENV}=emulated-verbs reaches peers of this process only (the emulated \
                 firmware's devices share one subnet): build the ranks as threads \
                 (LowLatencyBuffer::create_group), or use {NIC_ENV}=emulated for processes"
            ))),
        },
        NicKind::Real(name) => {
            let nic = RealNic::open(Some(name))?;
            tracing::debug!(
                target: "ep",
                "rank {rank}: opening {} port {} (modes that can run: {:?})",
                nic.spec.device,
                nic.spec.port,
                nic.modes.iter().map(|m| m.name()).collect::<Vec<_>>()
            );
            Ok(Arc::new(VerbsTransport::real(&nic.spec, ctx, rank)?))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse_and_real_nic_fails_clearly_here() {
        assert_eq!(
            "emulated".parse::<NicChoice>().unwrap(),
            NicChoice::Emulated
        );
        assert_eq!("AUTO".parse::<NicChoice>().unwrap(), NicChoice::Auto);
        assert_eq!(
            "emulated-verbs".parse::<NicChoice>().unwrap(),
            NicChoice::EmulatedVerbs
        );
        for c in [
            NicChoice::Auto,
            NicChoice::Emulated,
            NicChoice::EmulatedVerbs,
            NicChoice::Real,
        ] {
            assert_eq!(c.to_string().parse::<NicChoice>().unwrap(), c);
        }
        assert!("fast".parse::<NicChoice>().is_err());
        assert_eq!(choose_nic(NicChoice::Emulated).unwrap(), NicKind::Emulated);
        if let Err(missing) = find_real_nic() {
            let e = RealNic::open(None).unwrap_err().to_string();
            assert!(e.contains("mlx5"), "{e}");
            // A device named but not present: the preflight's reason, no transport.
            match RealNic::open(Some("mlx5_0")) {
                Err(TransportError::NoRealNic { hint }) => {
                    assert!(hint.contains(&missing), "{hint} / {missing}")
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(choose_nic(NicChoice::Auto).unwrap(), NicKind::Emulated);
            assert!(matches!(
                choose_nic(NicChoice::Real),
                Err(TransportError::NoRealNic { .. })
            ));
        }
    }
}
