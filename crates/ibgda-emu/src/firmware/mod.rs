//! The emulated NIC as firmware: the PRM command images `ibgda-verbs` sends a ConnectX,
//! decoded from the PRM field layout and answered with the firmware's status and syndrome.
//!
//! [`EmuSubnet`] opens [`EmuDevice`]s, each an implementation of `ibgda-verbs`' driver seam:
//! verbs objects built on one (PD, MR, umem, UAR, CQ, QP, RST→INIT→RTR→RTS) become the same
//! engine QPs [`Nic::create_qp`](crate::Nic::create_qp) makes, placed where the commands say:
//! the send ring at the work queue umem's offset (after the receive queue), the doorbell record
//! and CQ from their umems, the UAR page the QP context names. A QP's `rre`/`rwe`/`rae` are
//! checked at every WQE a peer sends it, like a responder's (Remote Invalid Request when off);
//! a command with a field the device does not accept gets [`status`] and [`syndrome`] in its
//! output mailbox.
//!
//! Where the emulator differs from a ConnectX, on purpose or for now:
//! - it is stricter at `INIT2RTR_QP`: a path to a LID or QP number that does not exist is
//!   refused (hardware accepts it and times out later), so a wrong connection record is a clean
//!   error instead of a hang;
//! - a ring CQ serves one QP's send queue (the engine writes each QP's CQEs in its own order);
//!   collapsed CQs may be shared;
//! - QPs sharing a UAR page share one emulated register, so a doorbell overwritten before the
//!   NIC polled it is made good by the doorbell record, which every ringer writes first
//!   (hardware takes every store);
//! - RC only, no receive queue work, no SRQ, 64-byte CQEs, one port, InfiniBand addressing;
//!   `2RST_QP` restarts the QP's completions at CQ entry 0 (the engine keeps a CQ position per
//!   QP); PSNs, MTU, retry counts and timeouts are kept and reported by `QUERY_QP` but do not
//!   change how the engine moves bytes; RDMA read is not executed (the engine's limit), so `rre`
//!   is kept but never consulted.

#[cfg(test)]
mod agreement_tests;
mod bits;
mod caps;
mod cq_command;
mod driver;
mod layout;
mod objects;
mod qp_command;
mod qp_transition;
mod refusal;
mod subnet;

pub use caps::EmuCaps;
pub use driver::EmuDevice;
pub use refusal::{status, syndrome, Refused};
pub use subnet::EmuSubnet;
