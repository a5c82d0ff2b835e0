//! `CREATE_CQ`, `QUERY_CQ` and the CQ's destruction: the completion queue context decoded from
//! its PRM image and checked against the device and its tables.

use super::bits::{flag, get, put};
use super::caps::EQN_BASE;
use super::layout::{cmd_in, cmd_out, cqc, create_cq, query_cq};
use super::objects::{need_len, CqRec, Firmware, Tables};
use super::refusal::{status, syndrome, Refused};
use crate::cq::{CqConfig, CqMode, CQE_BYTES};

const CMD: &str = "CREATE_CQ";

/// A `CREATE_CQ` image, field by field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CreateCqImage {
    pub cqe_sz: u8,
    pub collapsed: bool,
    pub overrun_ignore: bool,
    pub log_cq_size: u8,
    pub uar_page: u32,
    pub c_eqn: u32,
    pub log_page_size: u8,
    pub page_offset: u8,
    pub dbr_umem_valid: bool,
    pub dbr_umem_id: u32,
    pub dbr_offset: u64,
    pub cq_umem_valid: bool,
    pub cq_umem_id: u32,
    pub cq_umem_offset: u64,
}

impl CreateCqImage {
    /// Reads the fields (the length was checked by the caller).
    pub(crate) fn decode(input: &[u8]) -> Self {
        let c = |f: super::bits::Bits| f.within(create_cq::CQ_CONTEXT);
        Self {
            cqe_sz: get(input, c(cqc::CQE_SZ)) as u8,
            collapsed: flag(input, c(cqc::CC)),
            overrun_ignore: flag(input, c(cqc::OI)),
            log_cq_size: get(input, c(cqc::LOG_CQ_SIZE)) as u8,
            uar_page: get(input, c(cqc::UAR_PAGE)) as u32,
            c_eqn: get(input, c(cqc::C_EQN)) as u32,
            log_page_size: get(input, c(cqc::LOG_PAGE_SIZE)) as u8,
            page_offset: get(input, c(cqc::PAGE_OFFSET)) as u8,
            dbr_umem_valid: flag(input, c(cqc::DBR_UMEM_VALID)),
            dbr_umem_id: get(input, c(cqc::DBR_UMEM_ID)) as u32,
            dbr_offset: get(input, c(cqc::DBR_ADDR)),
            cq_umem_valid: flag(input, create_cq::CQ_UMEM_VALID),
            cq_umem_id: get(input, create_cq::CQ_UMEM_ID) as u32,
            cq_umem_offset: get(input, create_cq::CQ_UMEM_OFFSET),
        }
    }
}

fn bad(status: u8, syndrome: u32, reason: String) -> Refused {
    Refused::new(CMD, status, syndrome, reason)
}

impl Firmware {
    /// Checks a `CREATE_CQ` against the device and the tables; the CQ it describes.
    fn check_create_cq(&self, t: &Tables, img: &CreateCqImage) -> Result<CqRec, Refused> {
        if img.cqe_sz != 0 {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::CQE_SIZE,
                format!(
                    "cqe_sz {} (the emulator writes 64-byte CQEs only)",
                    img.cqe_sz
                ),
            ));
        }
        if img.log_cq_size > self.caps.log_max_cq_sz {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::CQ_TOO_LARGE,
                format!(
                    "log_cq_size {} above log_max_cq_sz {}",
                    img.log_cq_size, self.caps.log_max_cq_sz
                ),
            ));
        }
        if img.c_eqn < EQN_BASE || img.c_eqn >= EQN_BASE + self.caps.comp_vectors {
            return Err(bad(
                status::BAD_RESOURCE,
                syndrome::NO_SUCH_EQ,
                format!("c_eqn {:#x} names no EQ", img.c_eqn),
            ));
        }
        if !t.uars.contains_key(&img.uar_page) {
            return Err(bad(
                status::BAD_RESOURCE,
                syndrome::NO_SUCH_UAR,
                format!("uar_page {:#x} is not allocated", img.uar_page),
            ));
        }
        if !img.cq_umem_valid || !img.dbr_umem_valid {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::NOT_UMEM,
                "the ring and the doorbell record must be in umems (cq_umem_valid, \
                 dbr_umem_valid)"
                    .into(),
            ));
        }
        if img.page_offset != 0 {
            return Err(bad(
                status::BAD_PARAM,
                syndrome::PAGE_OFFSET,
                format!("page_offset {}", img.page_offset),
            ));
        }
        let ncqes = 1u64 << img.log_cq_size;
        let ring = umem_range(
            t,
            CMD,
            "CQ ring",
            img.cq_umem_id,
            img.cq_umem_offset,
            ncqes * CQE_BYTES,
            4096 << img.log_page_size,
        )?;
        umem_range(
            t,
            CMD,
            "CQ doorbell record",
            img.dbr_umem_id,
            img.dbr_offset,
            8,
            8,
        )?;
        let cfg = if img.collapsed {
            CqConfig::collapsed(ring)
        } else {
            CqConfig {
                loc: ring,
                ncqes: ncqes as u32,
                mode: CqMode::Ring,
            }
        };
        Ok(CqRec {
            cfg,
            log_cq_size: img.log_cq_size,
            uar_page: img.uar_page,
            c_eqn: img.c_eqn,
            overrun_ignore: img.overrun_ignore,
            dbr_umem_id: img.dbr_umem_id,
            dbr_offset: img.dbr_offset,
            send_users: 0,
            recv_users: 0,
        })
    }

    pub(super) fn create_cq(&self, input: &[u8], out: &mut [u8]) -> Result<u32, Refused> {
        need_len(CMD, input, create_cq::IN_MIN_BYTES, out, cmd_out::BYTES)?;
        let img = CreateCqImage::decode(input);
        let mut t = self.tables();
        let rec = self.check_create_cq(&t, &img)?;
        let cqn = t.new_cqn();
        t.cqs.insert(cqn, rec);
        out.fill(0);
        put(out, cmd_out::OBJ_NUM, u64::from(cqn));
        tracing::debug!(nic = %self.name, cqn, ?rec.cfg, "firmware: CREATE_CQ");
        Ok(cqn)
    }

    pub(super) fn query_cq(&self, cqn: u32, input: &[u8], out: &mut [u8]) -> Result<(), Refused> {
        const Q: &str = "QUERY_CQ";
        need_len(Q, input, cmd_in::SHORT_BYTES, out, query_cq::OUT_BYTES)?;
        Firmware::check_object(Q, input, cqn)?;
        let t = self.tables();
        let rec = t.cqs.get(&cqn).ok_or_else(|| {
            Refused::new(
                Q,
                status::BAD_RESOURCE,
                syndrome::WRONG_OBJECT,
                "no such CQ",
            )
        })?;
        out.fill(0);
        let c = |f: super::bits::Bits| f.within(query_cq::CQ_CONTEXT);
        put(out, c(cqc::DBR_UMEM_VALID), 1);
        put(
            out,
            c(cqc::CC),
            u64::from(rec.cfg.mode == CqMode::Collapsed),
        );
        put(out, c(cqc::OI), u64::from(rec.overrun_ignore));
        put(out, c(cqc::DBR_UMEM_ID), u64::from(rec.dbr_umem_id));
        put(out, c(cqc::LOG_CQ_SIZE), u64::from(rec.log_cq_size));
        put(out, c(cqc::UAR_PAGE), u64::from(rec.uar_page));
        put(out, c(cqc::C_EQN), u64::from(rec.c_eqn));
        put(out, c(cqc::DBR_ADDR), rec.dbr_offset);
        Ok(())
    }

    pub(super) fn destroy_cq(&self, cqn: u32) -> Result<(), Refused> {
        let mut t = self.tables();
        match t.cqs.get(&cqn) {
            None => Err(Refused::new(
                "DESTROY_CQ",
                status::BAD_RESOURCE,
                syndrome::WRONG_OBJECT,
                format!("no CQ {cqn:#x}"),
            )),
            Some(rec) if rec.send_users + rec.recv_users > 0 => Err(Refused::new(
                "DESTROY_CQ",
                status::RESOURCE_BUSY,
                syndrome::CQ_SHARED,
                format!("CQ {cqn:#x} still serves QPs"),
            )),
            Some(_) => {
                t.cqs.remove(&cqn);
                Ok(())
            }
        }
    }
}

/// Where `len` bytes at `offset` of umem `id` are, if they fit and `offset` is `align`-aligned.
pub(crate) fn umem_range(
    t: &Tables,
    command: &'static str,
    what: &str,
    id: u32,
    offset: u64,
    len: u64,
    align: u64,
) -> Result<crate::backend::Loc, Refused> {
    let u = t.umems.get(&id).ok_or_else(|| {
        Refused::new(
            command,
            status::BAD_RESOURCE,
            syndrome::NO_SUCH_UMEM,
            format!("{what}: umem {id:#x} is not registered"),
        )
    })?;
    let fits = offset.checked_add(len).is_some_and(|end| end <= u.len);
    if !fits || offset % align != 0 {
        return Err(Refused::new(
            command,
            status::BAD_PARAM,
            syndrome::UMEM_RANGE,
            format!(
                "{what}: {len} bytes at offset {offset:#x} of a {}-byte umem, {align}-byte aligned",
                u.len
            ),
        ));
    }
    Ok(u.loc.offset(offset))
}
