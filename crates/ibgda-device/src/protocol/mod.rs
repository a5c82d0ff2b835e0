//! The submit/quiet protocol, host side: the status codes and failure reports of the device
//! code in `include/ibgda/protocol.cuh`, the choice of NIC-handler mode and what it means for
//! every QP ([`ModePlan`]), and [`HostQp`], the same
//! protocol in Rust over host memory (the CPU model CI runs, and the reference the device code
//! follows).
//!
//! The protocol, per QP (all counters 64-bit, monotonic, in WQEBB units):
//!
//! 1. reserve `n` with a fetch-add on `resv_head`; wait (bounded) until the ring has room;
//! 2. write the WQEs; the last asks for a CQE;
//! 3. publish in order through `ready_head` (every submitter on the QP goes through it);
//! 4. doorbell: mode `gpu` rings under the QP's doorbell lock; the CPU modes raise the QP's
//!    producer slot with a release max, and the [`proxy`](crate::proxy) rings;
//! 5. quiet waits until completions cover `ready_head`, in every mode.
//!
//! Every wait is bounded by the descriptor's `timeout_ns`; the first failure fills the error
//! record, which [`check_record`] turns into a [`DeviceFailure`].

mod handler;
mod host;
mod plan;
mod status;

#[cfg(test)]
mod model_tests;

pub use handler::{
    select, select_why, HandlerChoice, HandlerProbe, HandlerUnavailable, UnknownHandler,
    HANDLER_ENV,
};
pub use host::{HostQp, Step, Ticket};
pub use plan::{ModePlan, NicImpl, Placement, Requirement, SlotPlacement};
pub use status::{
    check_record, describe_kind, DeviceFailure, Stopped, DEFAULT_TIMEOUT_NS, ERROR_INVALID_DESC,
    MAX_NWQES, PUT_CHUNK_BYTES, STATUS_ABORTED, STATUS_OK,
};
