//! The emulated firmware of one device ([`Firmware`]): its object tables (PDs, umems, UAR pages, CQs, QPs)
//! and the dispatch of command images to the decoders.
//!
//! A command either completes (status 0 and its outputs in the mailbox) or is refused with a
//! PRM status and an emulator syndrome ([`Refused`]); nothing is half-applied: every check of a
//! command runs before any table or engine state changes.

use std::collections::HashMap;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex, MutexGuard};

use super::bits::{get, put};
use super::caps::EmuCaps;
use super::layout::{cmd_in, cmd_out, opcode, query_hca_cap};
use super::refusal::{status, syndrome, Refused};
use super::subnet::SubnetInner;
use crate::backend::Loc;
use crate::cq::CqConfig;
use crate::host::HostBuffer;
use crate::nic::Nic;

/// A registered umem: where its bytes are, as the engine reaches them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct UmemRec {
    pub loc: Loc,
    pub len: u64,
}

/// A CQ as `CREATE_CQ` described it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CqRec {
    pub cfg: CqConfig,
    pub log_cq_size: u8,
    pub uar_page: u32,
    pub c_eqn: u32,
    pub overrun_ignore: bool,
    pub dbr_umem_id: u32,
    pub dbr_offset: u64,
    /// QPs whose send queue completes here.
    pub send_users: u32,
    /// QPs whose receive queue completes here.
    pub recv_users: u32,
}

/// The firmware state of a QP (`enum mlx5_qp_state`, the states the emulator reaches).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FwQpState {
    Rst,
    Init,
    Rtr,
    Rts,
    Err,
}

/// A QP as its commands described it.
#[derive(Debug)]
pub(crate) struct QpRec {
    pub state: FwQpState,
    pub pd: u32,
    pub uar_page: u32,
    pub cqn_snd: u32,
    pub cqn_rcv: u32,
    pub log_sq_size: u8,
    pub rq_type: u8,
    pub log_rq_size: u8,
    pub log_rq_stride: u8,
    pub ts_format: u8,
    pub user_index: u32,
    pub dbr_umem_id: u32,
    pub dbr_offset: u64,
    /// What peers may do here (`mr::Access` bits, from `rre`/`rwe`/`rae`), read by the engine
    /// of every QP connected to this one at each WQE.
    pub access: Arc<AtomicU32>,
    pub atomic_mode: u8,
    pub port: u8,
    pub pkey_index: u16,
    pub mtu: u8,
    pub log_msg_max: u8,
    pub remote_qpn: u32,
    pub remote_lid: u16,
    pub next_rcv_psn: u32,
    pub next_send_psn: u32,
    pub min_rnr_nak: u8,
    pub log_rra_max: u8,
    pub log_sra_max: u8,
    pub retry_count: u8,
    pub rnr_retry: u8,
    pub ack_timeout: u8,
}

/// Every object the device's firmware knows.
#[derive(Debug, Default)]
pub(crate) struct Tables {
    pub pds: HashMap<u32, ()>,
    pub umems: HashMap<u32, UmemRec>,
    pub uars: HashMap<u32, Arc<HostBuffer>>,
    pub cqs: HashMap<u32, CqRec>,
    pub qps: HashMap<u32, QpRec>,
    next_pdn: u32,
    next_umem: u32,
    next_uar: u32,
    next_cqn: u32,
}

impl Tables {
    pub fn new_pdn(&mut self) -> u32 {
        self.next_pdn += 1;
        let pdn = self.next_pdn;
        self.pds.insert(pdn, ());
        pdn
    }

    pub fn new_umem(&mut self, rec: UmemRec) -> u32 {
        self.next_umem += 1;
        let id = self.next_umem;
        self.umems.insert(id, rec);
        id
    }

    pub fn new_uar(&mut self, page: Arc<HostBuffer>) -> u32 {
        // Page 0 is the device's reserved page on mlx5; user pages start after it.
        self.next_uar += 1;
        let id = self.next_uar;
        self.uars.insert(id, page);
        id
    }

    pub fn new_cqn(&mut self) -> u32 {
        self.next_cqn += 1;
        0x400 + self.next_cqn
    }
}

/// One device's firmware.
pub(crate) struct Firmware {
    pub name: String,
    pub nic: Nic,
    pub caps: EmuCaps,
    pub lid: u16,
    pub guid: u64,
    pub subnet: Arc<SubnetInner>,
    tables: Mutex<Tables>,
}

impl std::fmt::Debug for Firmware {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Firmware")
            .field("name", &self.name)
            .field("lid", &self.lid)
            .finish()
    }
}

/// The kind of object a create command made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ObjKind {
    Cq(u32),
    Qp(u32),
}

/// A refused command's length check.
pub(crate) fn need_len(
    command: &'static str,
    input: &[u8],
    min_in: usize,
    out: &[u8],
    min_out: usize,
) -> Result<(), Refused> {
    if input.len() < min_in {
        return Err(Refused::new(
            command,
            status::BAD_INPUT_LEN,
            syndrome::SHORT_INPUT,
            format!("{} input bytes, the command needs {min_in}", input.len()),
        ));
    }
    if out.len() < min_out {
        return Err(Refused::new(
            command,
            status::BAD_OUTPUT_LEN,
            syndrome::SHORT_OUTPUT,
            format!("{} output bytes, the command needs {min_out}", out.len()),
        ));
    }
    Ok(())
}

/// Writes a refusal into the output mailbox (as much of the header as fits).
pub(crate) fn write_refusal(out: &mut [u8], r: &Refused) {
    let n = out.len().min(cmd_out::BYTES);
    out[..n].fill(0);
    if out.len() >= cmd_out::BYTES {
        put(out, cmd_out::STATUS, u64::from(r.status));
        put(out, cmd_out::SYNDROME, u64::from(r.syndrome));
    }
}

/// The opcode of a command image (0 for an image too short to have one).
pub(crate) fn opcode_of(input: &[u8]) -> u16 {
    if input.len() < 2 {
        return 0;
    }
    get(input, cmd_in::OPCODE) as u16
}

impl Firmware {
    pub(crate) fn new(
        name: String,
        nic: Nic,
        caps: EmuCaps,
        lid: u16,
        guid: u64,
        subnet: Arc<SubnetInner>,
    ) -> Self {
        Self {
            name,
            nic,
            caps,
            lid,
            guid,
            subnet,
            tables: Mutex::new(Tables::default()),
        }
    }

    pub(crate) fn tables(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().expect("firmware tables lock")
    }

    /// `mlx5dv_devx_general_cmd`.
    pub(crate) fn general(&self, input: &[u8], out: &mut [u8]) -> Result<(), Refused> {
        let op = opcode_of(input);
        match op {
            opcode::QUERY_HCA_CAP => self.query_hca_cap(input, out),
            _ => Err(Refused::new(
                opcode::name(op),
                status::BAD_OP,
                syndrome::UNKNOWN_OPCODE,
                format!("opcode {op:#x} is not a general command the emulated firmware runs"),
            )),
        }
    }

    /// `mlx5dv_devx_obj_create`.
    pub(crate) fn create(&self, input: &[u8], out: &mut [u8]) -> Result<ObjKind, Refused> {
        let op = opcode_of(input);
        match op {
            opcode::CREATE_CQ => self.create_cq(input, out).map(ObjKind::Cq),
            opcode::CREATE_QP => self.create_qp(input, out).map(ObjKind::Qp),
            _ => Err(Refused::new(
                opcode::name(op),
                status::BAD_OP,
                syndrome::UNKNOWN_OPCODE,
                format!("opcode {op:#x} creates no object the emulated firmware knows"),
            )),
        }
    }

    /// `mlx5dv_devx_obj_modify` on `obj`.
    pub(crate) fn modify(&self, obj: ObjKind, input: &[u8], out: &mut [u8]) -> Result<(), Refused> {
        let op = opcode_of(input);
        match (obj, op) {
            (
                ObjKind::Qp(qpn),
                opcode::RST2INIT_QP
                | opcode::INIT2RTR_QP
                | opcode::RTR2RTS_QP
                | opcode::QP_2ERR
                | opcode::QP_2RST,
            ) => self.transition(qpn, op, input, out),
            _ => Err(Refused::new(
                opcode::name(op),
                status::BAD_OP,
                syndrome::UNKNOWN_OPCODE,
                format!("opcode {op:#x} does not modify a {obj:?}"),
            )),
        }
    }

    /// `mlx5dv_devx_obj_query` on `obj`.
    pub(crate) fn query(&self, obj: ObjKind, input: &[u8], out: &mut [u8]) -> Result<(), Refused> {
        let op = opcode_of(input);
        match (obj, op) {
            (ObjKind::Qp(qpn), opcode::QUERY_QP) => self.query_qp(qpn, input, out),
            (ObjKind::Cq(cqn), opcode::QUERY_CQ) => self.query_cq(cqn, input, out),
            _ => Err(Refused::new(
                opcode::name(op),
                status::BAD_OP,
                syndrome::UNKNOWN_OPCODE,
                format!("opcode {op:#x} does not query a {obj:?}"),
            )),
        }
    }

    /// The destroy command the kernel would build for `obj` (`DESTROY_CQ`, `DESTROY_QP`).
    pub(crate) fn destroy(&self, obj: ObjKind) -> Result<(), Refused> {
        match obj {
            ObjKind::Qp(qpn) => self.destroy_qp(qpn),
            ObjKind::Cq(cqn) => self.destroy_cq(cqn),
        }
    }

    /// Checks that an object command names the object it was sent to.
    pub(crate) fn check_object(
        command: &'static str,
        input: &[u8],
        number: u32,
    ) -> Result<(), Refused> {
        let named = get(input, cmd_in::OBJ_NUM) as u32;
        if named != number {
            return Err(Refused::new(
                command,
                status::BAD_PARAM,
                syndrome::WRONG_OBJECT,
                format!("the command names object {named:#x}, it was sent to {number:#x}"),
            ));
        }
        Ok(())
    }

    fn query_hca_cap(&self, input: &[u8], out: &mut [u8]) -> Result<(), Refused> {
        const CMD: &str = "QUERY_HCA_CAP";
        need_len(
            CMD,
            input,
            cmd_in::SHORT_BYTES,
            out,
            query_hca_cap::OUT_BYTES,
        )?;
        let op_mod = get(input, cmd_in::OP_MOD) as u16;
        // Current and maximum values are the same on the emulated device.
        let page = match op_mod >> 1 {
            query_hca_cap::TYPE_GENERAL => self.caps.general_page(),
            query_hca_cap::TYPE_ATOMIC => self.caps.atomic_page(),
            other => {
                return Err(Refused::new(
                    CMD,
                    status::BAD_PARAM,
                    syndrome::UNKNOWN_CAP_TYPE,
                    format!("capability type {other:#x} is not emulated"),
                ))
            }
        };
        out.fill(0);
        let at = query_hca_cap::CAPABILITY as usize / 8;
        out[at..at + page.len()].copy_from_slice(&page);
        Ok(())
    }
}
