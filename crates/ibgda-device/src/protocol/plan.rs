//! A handler mode's consequences, decided once: where a QP's rings, doorbell record and
//! producer slot live, whether the UAR is mapped into the GPU, whether a proxy runs, and what
//! the machine must provide. Callers that build QPs read a [`ModePlan`] instead of testing the
//! mode themselves.
//!
//! | | `gpu` | `cpu` | `cpu_host_memory` |
//! |---|---|---|---|
//! | send ring, CQ | GPU memory (emulated NIC: GPU or pinned host) | same | same |
//! | doorbell record | GPU memory (emulated NIC: pinned host) | pinned host | pinned host |
//! | producer slot | none | GPU memory, read through GDRCopy (emulated NIC without GDRCopy: the emulated GDR view) | pinned host |
//! | UAR in the GPU | yes | no | no |
//! | proxy | no | yes | yes |
//! | needs | the UAR mappable into the GPU (real NIC) | GDRCopy (emulated NIC: GPU memory) | nothing |
//!
//! ```
//! use ibgda_device::protocol::{ModePlan, NicImpl, Placement, Requirement, SlotPlacement};
//! use ibgda_device::qp_desc::NicHandler;
//!
//! let plan = ModePlan::new(NicHandler::Cpu, NicImpl::Mlx5);
//! assert_eq!(plan.producer_slot, Some(SlotPlacement::GpuViaGdrCopy));
//! assert_eq!(plan.doorbell_record, Placement::PinnedHost);
//! assert!(plan.proxy && !plan.uar_in_gpu);
//! assert_eq!(plan.requires, &[Requirement::GdrCopy]);
//! ```

use crate::protocol::handler::{HandlerChoice, HandlerProbe, HandlerUnavailable};
use crate::qp_desc::NicHandler;

/// Which implementation of the NIC executes the QPs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NicImpl {
    /// A ConnectX through `ibgda-verbs`.
    Mlx5,
    /// The software NIC (`ibgda-emu`): it reads rings and doorbell words wherever they are, and
    /// its UAR page is pinned host memory already mapped into the GPU.
    Emulated,
}

/// Where a piece of a QP lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// GPU memory.
    Gpu,
    /// Pinned host memory (mapped into the GPU where device code writes it).
    PinnedHost,
}

/// Where the producer slot a proxy polls lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SlotPlacement {
    /// GPU memory, read by the proxy through a GDRCopy mapping (mode `cpu`).
    GpuViaGdrCopy,
    /// Pinned host memory (mode `cpu_host_memory`).
    PinnedHost,
}

/// What a mode needs from the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Requirement {
    /// The NIC's doorbell page mappable into the GPU (`cudaHostRegister(IoMemory)`, which needs
    /// `PeerMappingOverride=1`).
    GpuDoorbellMapping,
    /// A CPU view of GPU memory for the producer slots: GDRCopy (`libgdrapi` and
    /// `/dev/gdrdrv`); on the emulated NIC, GDRCopy or the emulated GDR view, which needs only
    /// GPU memory ([`ModePlan::emulated_gdr_view_allowed`]). The probe answers for the NIC.
    GdrCopy,
}

/// What running `mode` on `nic` means for every QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModePlan {
    /// The mode.
    pub mode: NicHandler,
    /// The NIC.
    pub nic: NicImpl,
    /// Where the send ring and the CQ live by default (the emulated NIC also reads them from
    /// pinned host memory: [`ModePlan::host_rings_allowed`]).
    pub rings: Placement,
    /// Where the QP doorbell record lives: written by whoever rings.
    pub doorbell_record: Placement,
    /// Where the producer slot the proxy polls lives; `None` when no proxy runs.
    pub producer_slot: Option<SlotPlacement>,
    /// Whether the UAR's doorbell register must be mapped into the GPU (the descriptor's
    /// `db_reg`).
    pub uar_in_gpu: bool,
    /// Whether a CPU proxy rings the doorbells.
    pub proxy: bool,
    /// What the machine must provide; [`ModePlan::check`] probes it.
    pub requires: &'static [Requirement],
}

impl ModePlan {
    /// The plan of `mode` on `nic`.
    pub const fn new(mode: NicHandler, nic: NicImpl) -> Self {
        let emulated = matches!(nic, NicImpl::Emulated);
        let (producer_slot, requires): (_, &'static [Requirement]) = match mode {
            NicHandler::Gpu if emulated => (None, &[]),
            NicHandler::Gpu => (None, &[Requirement::GpuDoorbellMapping]),
            NicHandler::Cpu => (Some(SlotPlacement::GpuViaGdrCopy), &[Requirement::GdrCopy]),
            NicHandler::CpuHostMemory => (Some(SlotPlacement::PinnedHost), &[]),
        };
        let doorbell_record = match mode {
            // The GPU writes it right before its UAR store; a real NIC reads it by DMA, so it
            // stays next to the rings.
            NicHandler::Gpu if !emulated => Placement::Gpu,
            // The proxy writes it, and the emulator polls host memory without a copy.
            _ => Placement::PinnedHost,
        };
        Self {
            mode,
            nic,
            rings: Placement::Gpu,
            doorbell_record,
            producer_slot,
            uar_in_gpu: matches!(mode, NicHandler::Gpu),
            proxy: mode.uses_proxy(),
            requires,
        }
    }

    /// Whether the rings may live in pinned host memory instead of GPU memory.
    pub const fn host_rings_allowed(&self) -> bool {
        matches!(self.nic, NicImpl::Emulated)
    }

    /// Mode `cpu` on the emulated NIC: when GDRCopy is absent, the proxy may read the producer
    /// slots (still in GPU memory) through the emulated GDR view (copy-engine reads into a host
    /// mirror, `ibgda_gdr::CopyMirror`). Never on a real NIC, where the mode requires GDRCopy.
    pub const fn emulated_gdr_view_allowed(&self) -> bool {
        matches!(self.nic, NicImpl::Emulated)
            && matches!(self.producer_slot, Some(SlotPlacement::GpuViaGdrCopy))
    }

    /// `Ok` when `probe` says the machine provides everything the mode requires, else the first
    /// thing missing, in the words the probe gave.
    pub fn check(&self, probe: &HandlerProbe) -> Result<(), HandlerUnavailable> {
        for need in self.requires {
            let have = match need {
                Requirement::GpuDoorbellMapping => &probe.gpu_doorbell,
                Requirement::GdrCopy => &probe.gdrcopy,
            };
            if let Err(missing) = have {
                return Err(HandlerUnavailable {
                    mode: HandlerChoice::from(self.mode),
                    missing: missing.clone(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODES: [NicHandler; 3] = [NicHandler::Gpu, NicHandler::Cpu, NicHandler::CpuHostMemory];
    const NICS: [NicImpl; 2] = [NicImpl::Mlx5, NicImpl::Emulated];

    #[test]
    fn plans_agree_with_what_a_valid_descriptor_holds() {
        for nic in NICS {
            for mode in MODES {
                let p = ModePlan::new(mode, nic);
                // A descriptor has a producer slot exactly in the CPU modes, and a doorbell
                // register exactly in mode gpu (QpDesc::validate).
                assert_eq!(p.producer_slot.is_some(), mode.uses_proxy(), "{p:?}");
                assert_eq!(p.uar_in_gpu, !mode.uses_proxy(), "{p:?}");
                assert_eq!(p.proxy, mode.uses_proxy(), "{p:?}");
                assert_eq!(p.rings, Placement::Gpu);
                assert_eq!(p.host_rings_allowed(), nic == NicImpl::Emulated);
                if p.proxy {
                    assert_eq!(
                        p.doorbell_record,
                        Placement::PinnedHost,
                        "the proxy writes it"
                    );
                }
            }
        }
        assert_eq!(
            ModePlan::new(NicHandler::Gpu, NicImpl::Mlx5).doorbell_record,
            Placement::Gpu
        );
    }

    #[test]
    fn only_mode_cpu_on_the_emulated_nic_may_use_the_emulated_gdr_view() {
        for nic in NICS {
            for mode in MODES {
                let p = ModePlan::new(mode, nic);
                assert_eq!(
                    p.emulated_gdr_view_allowed(),
                    mode == NicHandler::Cpu && nic == NicImpl::Emulated,
                    "{p:?}"
                );
            }
        }
    }

    #[test]
    fn requirements_are_probed() {
        let nothing = HandlerProbe {
            gpu_doorbell: Err("error 800".into()),
            gdrcopy: Err("no /dev/gdrdrv".into()),
        };
        let e = ModePlan::new(NicHandler::Gpu, NicImpl::Mlx5)
            .check(&nothing)
            .unwrap_err();
        assert_eq!(e.mode, HandlerChoice::Gpu);
        assert_eq!(e.missing, "error 800");
        // The emulated UAR page is mapped already: gpu needs nothing there.
        assert!(ModePlan::new(NicHandler::Gpu, NicImpl::Emulated)
            .check(&nothing)
            .is_ok());
        for nic in NICS {
            let e = ModePlan::new(NicHandler::Cpu, nic)
                .check(&nothing)
                .unwrap_err();
            assert_eq!(e.missing, "no /dev/gdrdrv");
            assert!(ModePlan::new(NicHandler::CpuHostMemory, nic)
                .check(&nothing)
                .is_ok());
        }
    }
}
