//! Completion queues whose CQE ring and doorbell record live in caller-provided memory.

use std::fmt;
use std::sync::Arc;

use crate::device::Context;
use crate::devx::DevxObj;
use crate::error::{Result, VerbsError};
use crate::prm::{parse_create_cq_out, CreateCq};
use crate::uar::Uar;
use crate::umem::UmemAt;

/// Bytes per CQE (this crate always creates 64-byte CQEs).
pub const CQE_SIZE: u64 = ibgda_device::wire::CQE_BYTES as u64;

/// Bytes of a CQ doorbell record (consumer index, then arm word; both big-endian u32).
pub const CQ_DBR_SIZE: u64 = 8;

/// How to build a [`Cq`].
///
/// The ring must be initialised before creation so that every CQE is owned by hardware and
/// invalid: `op_own` (byte 63) = `0xf1` (opcode 0xF "invalid", owner bit 1), the record zeroed.
#[derive(Clone, Debug)]
pub struct CqBuilder {
    uar: Arc<Uar>,
    ring: UmemAt,
    dbr: UmemAt,
    log_cq_size: u8,
    eq_vector: u32,
    log_page_size: u8,
    collapsed: bool,
    overrun_ignore: bool,
}

impl CqBuilder {
    /// A ring of 2^`log_cq_size` 64-byte CQEs at `ring` (4 KiB aligned) with its 8-byte doorbell
    /// record at `dbr`, armed through `uar`, ignoring overrun.
    ///
    /// A ring by default: the n-th completion lands in entry `n mod 2^log_cq_size` with the
    /// owner bit of its pass, which is what the submit/quiet protocol polls (`ibgda_poll_cq`
    /// reads the entry at its own consumer index). [`collapsed`](Self::collapsed) asks for the
    /// other layout, every CQE in entry 0, for a poller that only ever reads that entry.
    pub fn new(uar: &Arc<Uar>, ring: UmemAt, dbr: UmemAt, log_cq_size: u8) -> Self {
        Self {
            uar: uar.clone(),
            ring,
            dbr,
            log_cq_size,
            eq_vector: 0,
            log_page_size: 0,
            collapsed: false,
            overrun_ignore: true,
        }
    }

    /// Every CQE to entry 0 (`cqc.cc`): a collapsed CQ, for pollers that read entry 0's
    /// `wqe_counter` only (NVSHMEM's style). Off by default; the protocol of this project cannot
    /// poll a collapsed CQ (its consumer index walks the ring).
    pub fn collapsed(mut self, on: bool) -> Self {
        self.collapsed = on;
        self
    }

    /// Never enter error on overrun (`cqc.oi`).
    pub fn overrun_ignore(mut self, on: bool) -> Self {
        self.overrun_ignore = on;
        self
    }

    /// Completion vector whose EQ receives events (default 0; events are never armed here).
    pub fn eq_vector(mut self, v: u32) -> Self {
        self.eq_vector = v;
        self
    }

    /// log2 of the ring's page size in 4 KiB units (default 0).
    pub fn log_page_size(mut self, log: u8) -> Self {
        self.log_page_size = log;
        self
    }

    /// Bytes of ring the CQ needs.
    pub fn ring_bytes(&self) -> u64 {
        CQE_SIZE << self.log_cq_size
    }

    fn validate(&self, ctx: &Context) -> Result<()> {
        if self.log_cq_size > 24 {
            return Err(VerbsError::Invalid(format!(
                "log_cq_size {} is too large",
                self.log_cq_size
            )));
        }
        if let Some(g) = ctx.general_caps() {
            if self.log_cq_size > g.log_max_cq_sz {
                return Err(VerbsError::Invalid(format!(
                    "log_cq_size {} exceeds the device's log_max_cq_sz {}",
                    self.log_cq_size, g.log_max_cq_sz
                )));
            }
            if self.overrun_ignore && !g.cq_oi {
                return Err(VerbsError::Invalid(
                    "the device cannot ignore CQ overrun (cmd_hca_cap.cq_oi = 0)".into(),
                ));
            }
        }
        let page = 4096u64 << self.log_page_size;
        self.ring.check("CQ ring", self.ring_bytes(), page)?;
        self.dbr
            .check("CQ doorbell record", CQ_DBR_SIZE, CQ_DBR_SIZE)?;
        Ok(())
    }

    /// Creates the CQ (`CREATE_CQ` through DEVX).
    pub fn create(self) -> Result<Arc<Cq>> {
        let ctx = self.uar.context().clone();
        self.validate(&ctx)?;
        let eqn = ctx.eqn(self.eq_vector)?;
        let cmd = CreateCq::new(
            self.log_cq_size,
            self.uar.page_id(),
            eqn,
            self.ring.prm(),
            self.dbr.prm(),
        )
        .collapsed(self.collapsed)
        .overrun_ignore(self.overrun_ignore)
        .log_page_size(self.log_page_size)
        .build()?;
        let (obj, out) = DevxObj::create(&ctx, "CREATE_CQ", &cmd, CreateCq::OUT_LEN)?;
        let cqn = parse_create_cq_out(&out).map_err(|f| VerbsError::firmware(f, 0))?;
        tracing::debug!(device = %ctx.name(), cqn, "created CQ");
        Ok(Arc::new(Cq {
            obj,
            cqn,
            log_cq_size: self.log_cq_size,
            collapsed: self.collapsed,
            uar: self.uar,
            ring: self.ring,
            dbr: self.dbr,
        }))
    }
}

/// A DEVX completion queue. QPs completing to it hold an `Arc`.
pub struct Cq {
    // Declared first: destroyed before the UAR and umems it uses.
    obj: DevxObj,
    cqn: u32,
    log_cq_size: u8,
    collapsed: bool,
    uar: Arc<Uar>,
    ring: UmemAt,
    dbr: UmemAt,
}

impl fmt::Debug for Cq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cq")
            .field("cqn", &self.cqn)
            .field("log_cq_size", &self.log_cq_size)
            .finish()
    }
}

impl Cq {
    /// The CQ number.
    pub fn cqn(&self) -> u32 {
        self.cqn
    }

    /// log2 of the number of CQEs.
    pub fn log_cq_size(&self) -> u8 {
        self.log_cq_size
    }

    /// Whether every CQE goes to entry 0.
    pub fn is_collapsed(&self) -> bool {
        self.collapsed
    }

    /// Where the CQE ring is.
    pub fn ring(&self) -> &UmemAt {
        &self.ring
    }

    /// Where the doorbell record is.
    pub fn doorbell_record(&self) -> &UmemAt {
        &self.dbr
    }

    /// The UAR the CQ is armed through.
    pub fn uar(&self) -> &Arc<Uar> {
        &self.uar
    }

    #[allow(dead_code)]
    pub(crate) fn obj(&self) -> &DevxObj {
        &self.obj
    }
}
