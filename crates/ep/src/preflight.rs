//! What this machine can run, and for what it cannot, why and the fix: [`preflight`].
//!
//! The checks a user of GPU-initiated RDMA needs answered before the first dispatch: rdma-core's
//! libraries, an mlx5 device with DEVX, an active port and (RoCE) a usable GID; on the GPU side
//! the CUDA driver, GPU memory registration (dma-buf export or `nvidia-peermem`), the NIC's
//! doorbell page mappable into the GPU (`PeerMappingOverride`), and GDRCopy. From them, which
//! NIC-handler modes can run on a real NIC and on the emulated one. DeepEP's
//! "init failed for transport: IBGDA" becomes one of these named causes.
//!
//! ```
//! let report = ep::preflight::preflight();
//! // Three handler modes on each NIC kind, each runnable or with its reason and fix.
//! assert_eq!(report.modes.len(), 6);
//! println!("{report}");
//! ```

use std::fmt;
use std::path::Path;

use ibgda_device::protocol::{ModePlan, NicImpl, Requirement};
use ibgda_device::qp_desc::NicHandler;
use ibgda_verbs::{Context, LinkLayer, PortState};

/// Something this machine lacks, and what a user does about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Missing {
    /// What is missing or failed, as the probe saw it.
    pub why: String,
    /// What to do about it.
    pub fix: String,
}

impl Missing {
    fn new(why: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            why: why.into(),
            fix: fix.into(),
        }
    }
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (fix: {})", self.why, self.fix)
    }
}

/// One probed capability: `Ok` with what was found, or what is missing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    /// What was checked.
    pub what: &'static str,
    /// What was found, or what is missing.
    pub result: Result<String, Missing>,
}

/// Which NIC a verdict is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NicSide {
    /// A real mlx5 device (`EP_NIC=real`).
    Real,
    /// The emulated NIC (`EP_NIC=emulated`).
    Emulated,
}

impl fmt::Display for NicSide {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Self::Real => "real mlx5 NIC",
            Self::Emulated => "emulated NIC",
        })
    }
}

/// Whether one handler mode can run on one NIC kind here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModeVerdict {
    /// The NIC.
    pub nic: NicSide,
    /// The mode.
    pub mode: NicHandler,
    /// `Ok` when it can run, else the first thing missing.
    pub result: Result<(), Missing>,
}

/// The preflight report: every check, and per NIC kind and handler mode whether it can run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preflight {
    /// The mlx5 device the real-NIC checks were made on, if any.
    pub device: Option<String>,
    /// Every check, in the order made.
    pub checks: Vec<Check>,
    /// Per NIC kind and handler mode (`gpu`, `cpu`, `cpu_host_memory`).
    pub modes: Vec<ModeVerdict>,
}

impl Preflight {
    /// The check named `what`, if it was made.
    pub fn check(&self, what: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.what == what)
    }

    /// The verdict for `mode` on `nic`.
    pub fn mode(&self, nic: NicSide, mode: NicHandler) -> Option<&ModeVerdict> {
        self.modes.iter().find(|m| m.nic == nic && m.mode == mode)
    }
}

impl fmt::Display for Preflight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "preflight: what this machine can run")?;
        for c in &self.checks {
            match &c.result {
                Ok(found) => writeln!(f, "  {:<28} ok: {found}", c.what)?,
                Err(m) => {
                    writeln!(f, "  {:<28} MISSING: {}", c.what, m.why)?;
                    writeln!(f, "  {:<28}   fix: {}", "", m.fix)?;
                }
            }
        }
        writeln!(f, "handler modes:")?;
        for v in &self.modes {
            match &v.result {
                Ok(()) => writeln!(f, "  {:<16} {:<16} can run", v.nic, v.mode.name())?,
                Err(m) => {
                    writeln!(
                        f,
                        "  {:<16} {:<16} cannot run: {}",
                        v.nic,
                        v.mode.name(),
                        m.why
                    )?;
                    writeln!(f, "  {:<16} {:<16}   fix: {}", "", "", m.fix)?;
                }
            }
        }
        Ok(())
    }
}

/// Names of the checks, as [`Preflight::check`] takes them.
pub mod checks {
    /// libibverbs and libmlx5 load.
    pub const RDMA_CORE: &str = "rdma-core libraries";
    /// An mlx5 device is listed.
    pub const MLX5_DEVICE: &str = "mlx5 device";
    /// DEVX objects can be created on it.
    pub const DEVX: &str = "DEVX";
    /// The transport's port (1, or `EP_NIC_PORT`) is ACTIVE.
    pub const PORT: &str = "port state";
    /// That port has the address its link layer needs (a LID, or a RoCE GID: the preferred
    /// RoCE v2 GID or `EP_NIC_GID_INDEX`).
    pub const GID: &str = "port address (LID/GID)";
    /// The CUDA driver and a GPU.
    pub const GPU: &str = "CUDA driver and GPU";
    /// GPU memory can be registered with the NIC (dma-buf or nvidia-peermem).
    pub const GPU_MEMORY: &str = "GPU memory registration";
    /// The NIC's doorbell page maps into the GPU.
    pub const UAR_IN_GPU: &str = "doorbell (UAR) in the GPU";
    /// GDRCopy (library and /dev/gdrdrv).
    pub const GDRCOPY: &str = "GDRCopy";
}

const RDMA_CORE_FIX: &str =
    "install rdma-core's libraries (Debian/Ubuntu: apt-get install libibverbs1 ibverbs-providers)";
const NO_DEVICE_FIX: &str = "a ConnectX NIC with the mlx5_core, mlx5_ib and ib_uverbs kernel \
     modules loaded (MLNX_OFED or the distribution's rdma-core); without one, EP_NIC=auto runs \
     on the emulated NIC";
const PEER_MAPPING_FIX: &str =
    "add `options nvidia NVreg_RegistryDwords=\"PeerMappingOverride=1;\"` \
     to /etc/modprobe.d/nvidia.conf and reload the NVIDIA driver; or run a CPU handler mode \
     (IBGDA_NIC_HANDLER=cpu or cpu_host_memory)";
const GDRCOPY_FIX: &str = "install GDRCopy (libgdrapi.so.2) and load its gdrdrv kernel module so \
     that /dev/gdrdrv exists; or run mode cpu_host_memory";

/// The mlx5 device the real NIC would use (`EP_NIC_DEVICE` when set, else the first mlx5
/// device), or why there is none, with the fix.
pub fn real_nic() -> Result<String, Missing> {
    if let Err(e) = ibgda_verbs::rdma_core::rdma_core_available() {
        return Err(Missing::new(e.to_string(), RDMA_CORE_FIX));
    }
    let list = ibgda_verbs::list_devices().map_err(|e| {
        Missing::new(
            format!("listing RDMA devices: {e}"),
            "check the RDMA kernel modules (ib_uverbs, mlx5_ib) and /dev/infiniband permissions",
        )
    })?;
    let asked = std::env::var(crate::transport::NIC_DEVICE_ENV)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty());
    if let Some(name) = asked {
        let names: Vec<&str> = list.iter().map(|d| d.name.as_str()).collect();
        return match list.iter().find(|d| d.name == name) {
            Some(d) if d.mlx5 => Ok(name),
            Some(_) => Err(Missing::new(
                format!(
                    "{}={name} is not an mlx5 device",
                    crate::transport::NIC_DEVICE_ENV
                ),
                "name a ConnectX (mlx5_*) device, or unset EP_NIC_DEVICE",
            )),
            None => Err(Missing::new(
                format!(
                    "{}={name} is not among the RDMA devices ({names:?})",
                    crate::transport::NIC_DEVICE_ENV
                ),
                "name a listed device (ibv_devices), or unset EP_NIC_DEVICE",
            )),
        };
    }
    list.into_iter()
        .find(|d| d.mlx5)
        .map(|d| d.name)
        .ok_or_else(|| {
            let hint = ibgda_verbs::no_device_hint();
            let why = hint.split("; the emulated NIC").next().unwrap_or(&hint);
            Missing::new(why, NO_DEVICE_FIX)
        })
}

/// Whether the NVIDIA driver was loaded with `PeerMappingOverride=1` (read from its
/// parameters), for when no NIC page is at hand to try the mapping itself.
fn peer_mapping_from_driver_params() -> Result<String, Missing> {
    let params = Path::new("/proc/driver/nvidia/params");
    match std::fs::read_to_string(params) {
        Err(e) => Err(Missing::new(
            format!(
                "cannot read {} ({e}): no NVIDIA driver loaded",
                params.display()
            ),
            "install and load the NVIDIA driver",
        )),
        Ok(text) => {
            let dwords = text
                .lines()
                .find(|l| l.starts_with("RegistryDwords"))
                .unwrap_or("");
            if dwords.replace(' ', "").contains("PeerMappingOverride=1") {
                Ok("PeerMappingOverride=1 in the driver's RegistryDwords".into())
            } else {
                Err(Missing::new(
                    "the NVIDIA driver does not allow mapping NIC doorbells into the GPU \
                     (PeerMappingOverride is not set; cuMemHostRegister(IOMEMORY) would fail \
                     with error 800)",
                    PEER_MAPPING_FIX,
                ))
            }
        }
    }
}

/// Probes this machine (opening the first mlx5 device and GPU 0 when present; nothing is left
/// open) and says which handler modes can run on a real and on the emulated NIC.
pub fn preflight() -> Preflight {
    let mut checks = Vec::new();
    let rdma = ibgda_verbs::rdma_core::rdma_core_available()
        .map(|()| "libibverbs and libmlx5 load".to_string())
        .map_err(|e| Missing::new(e.to_string(), RDMA_CORE_FIX));
    checks.push(Check {
        what: checks::RDMA_CORE,
        result: rdma,
    });
    let device = real_nic();
    checks.push(Check {
        what: checks::MLX5_DEVICE,
        result: device.clone(),
    });
    let ctx = device.as_ref().ok().map(|name| {
        Context::open(name).map_err(|e| {
            Missing::new(
                format!("opening {name}: {e}"),
                "check /dev/infiniband permissions (the rdma group) and the ib_uverbs module",
            )
        })
    });
    let mut nic_ready: Result<(), Missing> = device.clone().map(|_| ());
    if let Some(ctx) = &ctx {
        let devx = ctx
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|c| match c.capabilities() {
                Err(e) => Err(Missing::new(
                    format!("querying the device: {e}"),
                    "update the NIC firmware and rdma-core",
                )),
                Ok(caps) => match caps.devx_unavailable {
                    None => Ok(format!("firmware {}", caps.device.fw_ver)),
                    Some(why) => Err(Missing::new(
                        format!("DEVX unavailable: {why}"),
                        "run with CAP_NET_RAW (or as root), or a kernel and rdma-core with DEVX \
                     (Linux ≥ 5.1, rdma-core ≥ 24)",
                    )),
                },
            });
        // The port and GID index the transport will use (EP_NIC_PORT, EP_NIC_GID_INDEX).
        let spec = device
            .as_ref()
            .ok()
            .and_then(|n| crate::transport::RealNicSpec::from_env(n).ok());
        let (port_num, gid_index) = spec.map_or((1, None), |s| (s.port, s.gid_index));
        let port = ctx.as_ref().map_err(Clone::clone).and_then(|c| {
            c.port(port_num).map_err(|e| {
                Missing::new(
                    format!("querying port {port_num}: {e}"),
                    "check the NIC's firmware, or name another port in EP_NIC_PORT",
                )
            })
        });
        let state = port.clone().and_then(|p| {
            if p.state == PortState::Active {
                Ok(format!("port {port_num} ACTIVE"))
            } else {
                Err(Missing::new(
                    format!("port {port_num} is {:?}, not ACTIVE", p.state),
                    "connect the cable and bring the link up (`ip link set <netdev> up`); on \
                     InfiniBand a subnet manager (opensm) must be running",
                ))
            }
        });
        let gid = port.and_then(|p| {
            let gids = match p.link_layer {
                LinkLayer::Ethernet => {
                    ctx.as_ref()
                        .map_err(Clone::clone)?
                        .gids(port_num)
                        .map_err(|e| {
                            Missing::new(format!("reading the GID table: {e}"), "check rdma-core")
                        })?
                }
                _ => Vec::new(),
            };
            match crate::transport::LocalAddress::choose(&p, &gids, gid_index) {
                Ok(crate::transport::LocalAddress::Roce { gid }) => {
                    Ok(format!("RoCE GID index {} ({:?})", gid.index, gid.kind))
                }
                Ok(crate::transport::LocalAddress::InfiniBand { lid }) => {
                    Ok(format!("InfiniBand LID {lid}"))
                }
                Err(why) => Err(Missing::new(
                    why,
                    "on RoCE configure an IPv4 or IPv6 address on the port's network interface \
                     (or name a GID in EP_NIC_GID_INDEX); on InfiniBand run a subnet manager",
                )),
            }
        });
        nic_ready = devx.clone().and(state.clone()).and(gid.clone()).map(|_| ());
        checks.push(Check {
            what: checks::DEVX,
            result: devx,
        });
        checks.push(Check {
            what: checks::PORT,
            result: state,
        });
        checks.push(Check {
            what: checks::GID,
            result: gid,
        });
    }

    let gpu = gpu_context();
    checks.push(Check {
        what: checks::GPU,
        result: gpu
            .as_ref()
            .map(|(_, n)| format!("{n} GPU(s)"))
            .map_err(Clone::clone),
    });
    let gpu_memory = gpu.as_ref().map_err(Clone::clone).and_then(|(ctx, _)| {
        let dma_buf = ibgda_verbs::cuda::dma_buf_export_supported(ctx);
        let peermem = ["/sys/module/nvidia_peermem", "/sys/module/nv_peer_mem"]
            .iter()
            .any(|m| Path::new(m).exists());
        match (dma_buf, peermem) {
            (Ok(true), _) => Ok("dma-buf export (no nvidia-peermem needed)".to_string()),
            (_, true) => Ok("nvidia-peermem loaded".to_string()),
            (probe, false) => Err(Missing::new(
                format!(
                    "GPU memory cannot be registered with the NIC: dma-buf export {}, \
                     nvidia-peermem not loaded",
                    match probe {
                        Ok(_) => "unsupported".to_string(),
                        Err(e) => format!("failed ({e})"),
                    }
                ),
                "use the NVIDIA open kernel modules (driver ≥ 515, Linux ≥ 5.12) for dma-buf, or \
                 `modprobe nvidia-peermem`",
            )),
        }
    });
    checks.push(Check {
        what: checks::GPU_MEMORY,
        result: gpu_memory.clone(),
    });
    let uar = match (&ctx, &gpu) {
        (Some(Ok(nic)), Ok((cuda, _))) => ibgda_verbs::Uar::alloc(nic)
            .and_then(|u| u.map_into_gpu(cuda).map(|_| ()))
            .map(|()| "a UAR page of the device mapped into GPU 0".to_string())
            .map_err(|e| Missing::new(e.to_string(), PEER_MAPPING_FIX)),
        _ => peer_mapping_from_driver_params(),
    };
    checks.push(Check {
        what: checks::UAR_IN_GPU,
        result: uar.clone(),
    });
    let gdr = ibgda_gdr::Gdr::open()
        .map(|g| format!("{} and /dev/gdrdrv", g.library()))
        .map_err(|e| Missing::new(e.to_string(), GDRCOPY_FIX));
    checks.push(Check {
        what: checks::GDRCOPY,
        result: gdr.clone(),
    });

    let gpu_ok = gpu.as_ref().map(|_| ()).map_err(Clone::clone);
    let first = |needs: &[&Result<(), Missing>]| -> Result<(), Missing> {
        needs.iter().try_for_each(|r| (*r).clone())
    };
    let ok = |r: &Result<String, Missing>| r.as_ref().map(|_| ()).map_err(Clone::clone);
    let (mem, uar, gdr) = (ok(&gpu_memory), ok(&uar), ok(&gdr));
    // What each mode needs comes from its plan (`ModePlan::requires`), on top of what every mode
    // needs from the NIC side: a ready device, a GPU and GPU memory it can reach (real NIC), or
    // a GPU (the emulated NIC, which maps its doorbell page for the GPU itself, reaches GPU
    // memory with copies, and reads mode cpu's slots through GDRCopy or the emulated GDR view).
    let satisfies = |nic: NicImpl, need: Requirement| -> &Result<(), Missing> {
        match (nic, need) {
            (_, Requirement::GpuDoorbellMapping) => &uar,
            (NicImpl::Mlx5, Requirement::GdrCopy) => &gdr,
            (NicImpl::Emulated, Requirement::GdrCopy) => &gpu_ok,
        }
    };
    let mut modes = Vec::new();
    for (side, nic) in [
        (NicSide::Real, NicImpl::Mlx5),
        (NicSide::Emulated, NicImpl::Emulated),
    ] {
        for mode in [NicHandler::Gpu, NicHandler::Cpu, NicHandler::CpuHostMemory] {
            let plan = ModePlan::new(mode, nic);
            let mut needs: Vec<&Result<(), Missing>> = match nic {
                NicImpl::Mlx5 => vec![&nic_ready, &gpu_ok, &mem],
                NicImpl::Emulated => vec![&gpu_ok],
            };
            needs.extend(plan.requires.iter().map(|&r| satisfies(nic, r)));
            modes.push(ModeVerdict {
                nic: side,
                mode,
                result: first(&needs),
            });
        }
    }
    Preflight {
        device: device.ok(),
        checks,
        modes,
    }
}

/// GPU 0's context and the GPU count, or why there is none.
fn gpu_context() -> Result<(std::sync::Arc<cudarc::driver::CudaContext>, usize), Missing> {
    if !ibgda_device::cuda::driver_present() {
        return Err(Missing::new(
            "the CUDA driver (libcuda.so) is not installed",
            "install the NVIDIA driver",
        ));
    }
    let n = ibgda_gdr::gpu_count().map_err(|e| {
        Missing::new(
            format!("counting GPUs: {e}"),
            "check the NVIDIA driver (nvidia-smi)",
        )
    })?;
    if n == 0 {
        return Err(Missing::new(
            "no GPU is visible",
            "check CUDA_VISIBLE_DEVICES and nvidia-smi",
        ));
    }
    let ctx = ibgda_device::cuda::context(0).map_err(|e| {
        Missing::new(
            format!("opening GPU 0: {e}"),
            "check the NVIDIA driver (nvidia-smi)",
        )
    })?;
    Ok((ctx, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_has_a_verdict_and_every_missing_piece_a_fix() {
        let p = preflight();
        for nic in [NicSide::Real, NicSide::Emulated] {
            for mode in [NicHandler::Gpu, NicHandler::Cpu, NicHandler::CpuHostMemory] {
                let v = p.mode(nic, mode).expect("a verdict per NIC and mode");
                if let Err(m) = &v.result {
                    assert!(
                        !m.why.is_empty() && !m.fix.is_empty(),
                        "{nic} {mode:?}: {m:?}"
                    );
                }
            }
        }
        for c in &p.checks {
            if let Err(m) = &c.result {
                assert!(!m.fix.is_empty(), "{}: no fix given", c.what);
            }
        }
        let text = p.to_string();
        assert!(
            text.contains("handler modes:") && text.contains("cpu_host_memory"),
            "{text}"
        );
    }

    #[test]
    fn verdicts_follow_the_mode_plans() {
        let p = preflight();
        // On the emulated NIC mode cpu's plan requires a CPU view of GPU memory, which the
        // emulated GDR view gives wherever there is a GPU: the same verdict as mode gpu.
        assert_eq!(
            p.mode(NicSide::Emulated, NicHandler::Cpu).unwrap().result,
            p.mode(NicSide::Emulated, NicHandler::Gpu).unwrap().result
        );
        // On a real NIC it requires GDRCopy: when that is what is missing, the verdict says so.
        let gdr = p.check(checks::GDRCOPY).unwrap().result.clone();
        let real_cpu = &p.mode(NicSide::Real, NicHandler::Cpu).unwrap().result;
        let real_chm = &p
            .mode(NicSide::Real, NicHandler::CpuHostMemory)
            .unwrap()
            .result;
        match (real_chm, &gdr) {
            (Ok(()), Err(m)) => assert_eq!(real_cpu.as_ref().unwrap_err(), m),
            (Ok(()), Ok(_)) => assert!(real_cpu.is_ok()),
            (Err(m), _) => assert_eq!(real_cpu.as_ref().unwrap_err(), m),
        }
    }

    #[test]
    fn without_an_mlx5_device_no_real_mode_runs_and_the_reason_is_the_device() {
        // This machine (CI, the device machines) has no RDMA NIC.
        let p = preflight();
        if p.device.is_some() {
            return;
        }
        let dev = p.check(checks::MLX5_DEVICE).expect("device check");
        let missing = dev.result.clone().unwrap_err();
        assert!(missing.fix.contains("ConnectX"), "{missing:?}");
        for mode in [NicHandler::Gpu, NicHandler::Cpu, NicHandler::CpuHostMemory] {
            let v = p.mode(NicSide::Real, mode).unwrap();
            assert_eq!(v.result.as_ref().unwrap_err(), &missing, "{mode:?}");
        }
        assert_eq!(real_nic().unwrap_err(), missing);
        // With no GPU either (CI), the emulated NIC's modes say so.
        if p.check(checks::GPU).unwrap().result.is_err() {
            let v = p.mode(NicSide::Emulated, NicHandler::Gpu).unwrap();
            assert!(
                v.result.as_ref().unwrap_err().fix.contains("NVIDIA"),
                "{v:?}"
            );
        }
    }
}
