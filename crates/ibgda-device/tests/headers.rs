//! Our CUDA headers (`include/ibgda/*.cuh`) compiled as host C++ against our Rust code: the same
//! builders must write the same bytes, the same CQE parsing must reach the same verdicts. (The GPU
//! test in `ep-kernels/tests/gpu_wire.rs` repeats the comparison with the headers compiled by nvcc
//! for the device.)

mod common;

use common::*;
use ibgda_device::wire::*;
use proptest::prelude::*;

fn hdr_poll(cqe: &Cqe64, cons_idx: u64, ncqes: u32) -> CqeStatus {
    let mut out = CqeStatus::default();
    // SAFETY: reads the 64 bytes of `cqe`, writes one `ibgda_cqe_status` (same layout as
    // `CqeStatus`, checked by layout.def).
    unsafe { hdr_cqe_poll(bytemuck::bytes_of(cqe).as_ptr(), cons_idx, ncqes, &mut out) };
    out
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn header_builders_match_rust(i in input()) {
        for kind in KINDS {
            let ours = rust_wqe(kind, &i);
            let theirs = header_wqe(kind, &i);
            prop_assert!(ours.0 == theirs, "{}", diff(kind, &i, &ours, &theirs));
        }
        // SAFETY: a pure function of its arguments.
        prop_assert_eq!(unsafe { hdr_fm_ce_se(i.fence as u32, i.cqe) }, i.flags());
    }

    #[test]
    fn header_cqe_parsing_matches_rust(
        bytes in proptest::collection::vec(any::<u8>(), 64),
        cons_idx in any::<u64>(),
        log_ncqes in 0u32..16,
    ) {
        let cqe: Cqe64 = bytemuck::pod_read_unaligned(&bytes);
        let n = 1u32 << log_ncqes;
        prop_assert_eq!(hdr_poll(&cqe, cons_idx, n), cqe.status(cons_idx, n));
    }

    #[test]
    fn header_crafted_cqes_match_rust(
        owner in 0u8..2,
        counter in any::<u16>(),
        qpn in 0u32..1 << 24,
        syn in any::<u8>(),
        vendor in any::<u8>(),
        cons_idx in any::<u64>(),
        log_ncqes in 0u32..16,
        err in any::<bool>(),
    ) {
        let n = 1u32 << log_ncqes;
        let cqe = if err {
            Cqe64::requester_error(owner, counter, qpn, opcode::RDMA_WRITE, syn, vendor)
        } else {
            Cqe64::requester(owner, counter, qpn, opcode::NOP, 0)
        };
        let st = cqe.status(cons_idx, n);
        prop_assert_eq!(hdr_poll(&cqe, cons_idx, n), st);
        let owned = owner == cqe_owner_bit(cons_idx, n);
        let want = match (owned, err) {
            (false, _) => CqeState::Empty,
            (true, true) => CqeState::Error,
            (true, false) => CqeState::Ok,
        };
        prop_assert_eq!(st.state(), Some(want));
        prop_assert_eq!((st.wqe_counter, st.qpn), (counter, qpn));
        if err {
            prop_assert_eq!((st.syndrome, st.vendor_syndrome, st.wqe_opcode), (syn, vendor, opcode::RDMA_WRITE));
        }
    }

    #[test]
    fn header_counter_wrap_matches_rust(index in any::<u64>(), ahead in 1u64..65536) {
        let frontier = index.wrapping_add(ahead);
        prop_assume!(frontier > index);
        let got = wqe_index_from_counter(index as u16, frontier);
        prop_assert_eq!(got, index);
        // SAFETY: a pure function of its arguments.
        prop_assert_eq!(unsafe { hdr_wqe_index_from_counter(index as u16, frontier) }, got);
    }

    #[test]
    fn header_wait_bound_matches_rust(timeout_ns in any::<u64>()) {
        // SAFETY: a pure function of its argument.
        let got = unsafe { hdr_wait_bound_ns(timeout_ns) };
        prop_assert_eq!(got, ibgda_device::timeout::wait_bound_ns(timeout_ns));
        // SAFETY: as above.
        prop_assert_eq!(unsafe { hdr_wait_bound_ns(0) }, ibgda_device::protocol::DEFAULT_TIMEOUT_NS);
    }

    #[test]
    fn header_doorbell_matches_rust(qpn in 0u32..1 << 24, pi in any::<u64>()) {
        // SAFETY: pure functions of their arguments.
        let (word, send) = unsafe { (hdr_db_word(qpn, pi), hdr_dbr_send_word(pi)) };
        prop_assert_eq!(word, db_word(qpn, pi));
        prop_assert_eq!(parse_db_word(word), (qpn, pi as u16));
        prop_assert_eq!(send.to_ne_bytes(), dbr_send_word(pi).to_bytes());
        // The doorbell is the first 8 bytes of a control segment, minus opcode, opmod and DS.
        let ctrl = Nop::new(qpn, pi as u16).build();
        let mut first8 = [0u8; 8];
        first8.copy_from_slice(&ctrl.0[..8]);
        first8[3] = 0;
        first8[7] = 0;
        prop_assert_eq!(db_bytes(qpn, pi), first8);
    }
}
