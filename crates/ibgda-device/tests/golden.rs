//! Golden tests: our Rust builders and types against rdma-core's own `mlx5dv.h` (its inline
//! setters where it has them, its structs filled field by field where it has only those).

mod common;

use std::collections::HashMap;
use std::ffi::CStr;

use common::*;
use ibgda_device::wire::*;
use proptest::prelude::*;

proptest! {
    #![proptest_config(config())]

    /// The control segment equals `mlx5dv_set_ctrl_seg` (and its SSSE3 twin) for any field values.
    #[test]
    fn ctrl_seg_matches_rdma_core(
        counter in any::<u64>(),
        opcode in any::<u8>(),
        opmod in any::<u8>(),
        qpn in 0u32..1 << 24,
        fm in any::<u8>(),
        ds in 0u8..64,
        signature in any::<u8>(),
        imm in any::<u32>(),
    ) {
        let pi = counter as u16;
        let ours = CtrlSeg::new(CtrlFields { opcode, opmod, wqe_index: pi, qpn, ds, fm_ce_se: fm, signature, imm });
        let mut theirs = [0u8; 16];
        // SAFETY: the shim writes exactly 16 bytes to the buffer.
        unsafe { golden_ctrl_seg(theirs.as_mut_ptr(), pi, opcode, opmod, qpn, fm, ds, signature, imm) };
        prop_assert_eq!(bytemuck::bytes_of(&ours), &theirs[..]);
        let mut x86 = [0u8; 16];
        // SAFETY: as above.
        let have_x86 = unsafe { golden_ctrl_seg_x86(x86.as_mut_ptr(), pi, opcode, opmod, qpn, fm, ds, signature, imm) };
        // build.rs compiles the shim with SSSE3 on x86_64, so rdma-core's x86 setter is compared there.
        prop_assert!(have_x86 == 1 || !cfg!(target_arch = "x86_64"), "rdma-core's SSSE3 setter was not compiled in");
        if have_x86 == 1 {
            prop_assert_eq!(bytemuck::bytes_of(&ours), &x86[..]);
        }
        prop_assert_eq!(ours.fields(), CtrlFields { opcode, opmod, wqe_index: pi, qpn, ds, fm_ce_se: fm, signature, imm });
    }

    /// Data, remote-address, atomic and inline segments equal rdma-core's.
    #[test]
    fn segments_match_rdma_core(len in any::<u32>(), key in any::<u32>(), addr in any::<u64>(), other in any::<u64>()) {
        let mut theirs = [0u8; 16];
        // SAFETY: each shim call writes at most 16 bytes to the buffer.
        unsafe { golden_data_seg(theirs.as_mut_ptr(), len, key, addr) };
        let data = DataSeg::new(len, key, addr);
        prop_assert_eq!(bytemuck::bytes_of(&data), &theirs[..]);
        // SAFETY: as above.
        if unsafe { golden_data_seg_x86(theirs.as_mut_ptr(), len, key, addr) } == 1 {
            prop_assert_eq!(bytemuck::bytes_of(&data), &theirs[..]);
        }
        // SAFETY: as above.
        unsafe { golden_raddr_seg(theirs.as_mut_ptr(), addr, key) };
        let raddr = RaddrSeg::new(addr, key);
        prop_assert_eq!(bytemuck::bytes_of(&raddr), &theirs[..]);
        // SAFETY: as above.
        unsafe { golden_atomic_seg(theirs.as_mut_ptr(), addr, other) };
        let atomic = AtomicSeg { swap_add: addr.into(), compare: other.into() };
        prop_assert_eq!(bytemuck::bytes_of(&atomic), &theirs[..]);
        let inline_len = len & !INLINE_SEG;
        // SAFETY: as above (4 bytes).
        unsafe { golden_inline_seg(theirs.as_mut_ptr(), inline_len) };
        let inline = InlineSeg::new(inline_len);
        prop_assert_eq!(bytemuck::bytes_of(&inline), &theirs[..4]);
    }

    /// Every builder's WQE equals the one composed with rdma-core's setters, and decodes back to
    /// its inputs' opcode, index, QPN and flags.
    #[test]
    fn wqes_match_rdma_core(i in input()) {
        for kind in KINDS {
            let ours = rust_wqe(kind, &i);
            let theirs = golden_wqe(kind, &i);
            prop_assert!(ours.0 == theirs, "{}", diff(kind, &i, &ours, &theirs));
            let p = ours.parse().map_err(|e| TestCaseError::fail(format!("{kind:?}: {e}")))?;
            prop_assert_eq!((p.ctrl.wqe_index, p.ctrl.qpn, p.ctrl.fm_ce_se), (i.index(), i.qpn, i.flags()));
            prop_assert_eq!(p.wqebbs(), 1);
        }
    }

    /// CQEs: our constructors write what rdma-core's structs hold, and our parsing reads what
    /// rdma-core's getters read.
    #[test]
    fn cqes_match_rdma_core(
        owner in 0u8..2,
        counter in any::<u16>(),
        qpn in 0u32..1 << 24,
        wqe_opcode in any::<u8>(),
        byte_cnt in any::<u32>(),
        syn in any::<u8>(),
        vendor in any::<u8>(),
    ) {
        let mut theirs = [0u8; 64];
        // SAFETY: the shim writes exactly 64 bytes.
        unsafe { golden_cqe_requester(theirs.as_mut_ptr(), owner, counter, qpn, wqe_opcode, byte_cnt) };
        let ours = Cqe64::requester(owner, counter, qpn, wqe_opcode, byte_cnt);
        prop_assert_eq!(bytemuck::bytes_of(&ours), &theirs[..]);
        // SAFETY: as above.
        unsafe { golden_cqe_requester_error(theirs.as_mut_ptr(), owner, counter, qpn, wqe_opcode, syn, vendor) };
        let ours = Cqe64::requester_error(owner, counter, qpn, wqe_opcode, syn, vendor);
        prop_assert_eq!(bytemuck::bytes_of(&ours), &theirs[..]);

        let (mut o, mut op, mut wc, mut s, mut v, mut q) = (0u8, 0u8, 0u16, 0u8, 0u8, 0u32);
        // SAFETY: reads 64 bytes of `theirs`, writes the six out-parameters.
        unsafe { golden_cqe_read(theirs.as_ptr(), &mut o, &mut op, &mut wc, &mut s, &mut v, &mut q) };
        let st = ours.status(0, 1);
        prop_assert_eq!((st.owner, st.opcode, st.wqe_counter, st.syndrome, st.vendor_syndrome, st.qpn), (o, op, wc, s, v, q));
    }
}

/// Offsets and sizes of rdma-core's structs, and its constants, against ours.
#[test]
fn layouts_and_constants_match_mlx5dv_h() {
    use core::mem::{offset_of, size_of};
    let ours: HashMap<&str, u64> = [
        ("sizeof(mlx5_wqe_ctrl_seg)", size_of::<CtrlSeg>()),
        (
            "offsetof(mlx5_wqe_ctrl_seg.opmod_idx_opcode)",
            offset_of!(CtrlSeg, opmod_idx_opcode),
        ),
        (
            "offsetof(mlx5_wqe_ctrl_seg.qpn_ds)",
            offset_of!(CtrlSeg, qpn_ds),
        ),
        (
            "offsetof(mlx5_wqe_ctrl_seg.signature)",
            offset_of!(CtrlSeg, signature),
        ),
        (
            "offsetof(mlx5_wqe_ctrl_seg.dci_stream_channel_id)",
            offset_of!(CtrlSeg, dci_stream_channel_id),
        ),
        (
            "offsetof(mlx5_wqe_ctrl_seg.fm_ce_se)",
            offset_of!(CtrlSeg, fm_ce_se),
        ),
        ("offsetof(mlx5_wqe_ctrl_seg.imm)", offset_of!(CtrlSeg, imm)),
        ("sizeof(mlx5_wqe_raddr_seg)", size_of::<RaddrSeg>()),
        (
            "offsetof(mlx5_wqe_raddr_seg.raddr)",
            offset_of!(RaddrSeg, raddr),
        ),
        (
            "offsetof(mlx5_wqe_raddr_seg.rkey)",
            offset_of!(RaddrSeg, rkey),
        ),
        (
            "offsetof(mlx5_wqe_raddr_seg.reserved)",
            offset_of!(RaddrSeg, reserved),
        ),
        ("sizeof(mlx5_wqe_data_seg)", size_of::<DataSeg>()),
        (
            "offsetof(mlx5_wqe_data_seg.byte_count)",
            offset_of!(DataSeg, byte_count),
        ),
        (
            "offsetof(mlx5_wqe_data_seg.lkey)",
            offset_of!(DataSeg, lkey),
        ),
        (
            "offsetof(mlx5_wqe_data_seg.addr)",
            offset_of!(DataSeg, addr),
        ),
        ("sizeof(mlx5_wqe_inl_data_seg)", size_of::<InlineSeg>()),
        (
            "offsetof(mlx5_wqe_inl_data_seg.byte_count)",
            offset_of!(InlineSeg, byte_count),
        ),
        ("sizeof(mlx5_wqe_atomic_seg)", size_of::<AtomicSeg>()),
        (
            "offsetof(mlx5_wqe_atomic_seg.swap_add)",
            offset_of!(AtomicSeg, swap_add),
        ),
        (
            "offsetof(mlx5_wqe_atomic_seg.compare)",
            offset_of!(AtomicSeg, compare),
        ),
        ("sizeof(mlx5_cqe64)", size_of::<Cqe64>()),
        (
            "offsetof(mlx5_cqe64.srqn_uidx)",
            offset_of!(Cqe64, srqn_uidx),
        ),
        (
            "offsetof(mlx5_cqe64.imm_inval_pkey)",
            offset_of!(Cqe64, imm_inval_pkey),
        ),
        ("offsetof(mlx5_cqe64.app)", offset_of!(Cqe64, app)),
        ("offsetof(mlx5_cqe64.app_op)", offset_of!(Cqe64, app_op)),
        ("offsetof(mlx5_cqe64.app_info)", offset_of!(Cqe64, app_info)),
        ("offsetof(mlx5_cqe64.byte_cnt)", offset_of!(Cqe64, byte_cnt)),
        (
            "offsetof(mlx5_cqe64.timestamp)",
            offset_of!(Cqe64, timestamp),
        ),
        (
            "offsetof(mlx5_cqe64.sop_drop_qpn)",
            offset_of!(Cqe64, sop_drop_qpn),
        ),
        (
            "offsetof(mlx5_cqe64.wqe_counter)",
            offset_of!(Cqe64, wqe_counter),
        ),
        (
            "offsetof(mlx5_cqe64.signature)",
            offset_of!(Cqe64, signature),
        ),
        ("offsetof(mlx5_cqe64.op_own)", offset_of!(Cqe64, op_own)),
        ("sizeof(mlx5_err_cqe)", size_of::<ErrCqe>()),
        ("offsetof(mlx5_err_cqe.srqn)", offset_of!(ErrCqe, srqn)),
        (
            "offsetof(mlx5_err_cqe.vendor_err_synd)",
            offset_of!(ErrCqe, vendor_err_synd),
        ),
        (
            "offsetof(mlx5_err_cqe.syndrome)",
            offset_of!(ErrCqe, syndrome),
        ),
        (
            "offsetof(mlx5_err_cqe.s_wqe_opcode_qpn)",
            offset_of!(ErrCqe, s_wqe_opcode_qpn),
        ),
        (
            "offsetof(mlx5_err_cqe.wqe_counter)",
            offset_of!(ErrCqe, wqe_counter),
        ),
        (
            "offsetof(mlx5_err_cqe.signature)",
            offset_of!(ErrCqe, signature),
        ),
        ("offsetof(mlx5_err_cqe.op_own)", offset_of!(ErrCqe, op_own)),
        ("MLX5_SEND_WQE_BB", WQEBB_BYTES),
    ]
    .into_iter()
    .map(|(k, v)| (k, v as u64))
    .chain([
        ("MLX5_OPCODE_NOP", opcode::NOP as u64),
        ("MLX5_OPCODE_RDMA_WRITE", opcode::RDMA_WRITE as u64),
        ("MLX5_OPCODE_RDMA_WRITE_IMM", opcode::RDMA_WRITE_IMM as u64),
        ("MLX5_OPCODE_RDMA_READ", opcode::RDMA_READ as u64),
        ("MLX5_OPCODE_ATOMIC_CS", opcode::ATOMIC_CS as u64),
        ("MLX5_OPCODE_ATOMIC_FA", opcode::ATOMIC_FA as u64),
        (
            "MLX5_OPCODE_ATOMIC_MASKED_CS",
            opcode::ATOMIC_MASKED_CS as u64,
        ),
        (
            "MLX5_OPCODE_ATOMIC_MASKED_FA",
            opcode::ATOMIC_MASKED_FA as u64,
        ),
        ("MLX5_WQE_CTRL_CQ_UPDATE", CTRL_CQ_UPDATE as u64),
        ("MLX5_WQE_CTRL_SOLICITED", CTRL_SOLICITED as u64),
        (
            "MLX5_WQE_CTRL_FENCE",
            fm_ce_se(FenceMode::SmallAndFence, false) as u64,
        ),
        (
            "MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE",
            fm_ce_se(FenceMode::InitiatorSmall, false) as u64,
        ),
        ("MLX5_INLINE_SEG", INLINE_SEG as u64),
        ("MLX5_CQE_REQ", cqe_opcode::REQ as u64),
        ("MLX5_CQE_RESP_WR_IMM", cqe_opcode::RESP_WR_IMM as u64),
        ("MLX5_CQE_RESP_SEND", cqe_opcode::RESP_SEND as u64),
        ("MLX5_CQE_REQ_ERR", cqe_opcode::REQ_ERR as u64),
        ("MLX5_CQE_RESP_ERR", cqe_opcode::RESP_ERR as u64),
        ("MLX5_CQE_INVALID", cqe_opcode::INVALID as u64),
        ("MLX5_CQE_OWNER_MASK", 1),
        (
            "MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR",
            syndrome::LOCAL_LENGTH_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR",
            syndrome::LOCAL_QP_OP_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_LOCAL_PROT_ERR",
            syndrome::LOCAL_PROT_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_WR_FLUSH_ERR",
            syndrome::WR_FLUSH_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_MW_BIND_ERR",
            syndrome::MW_BIND_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_BAD_RESP_ERR",
            syndrome::BAD_RESP_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR",
            syndrome::LOCAL_ACCESS_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR",
            syndrome::REMOTE_INVAL_REQ_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR",
            syndrome::REMOTE_ACCESS_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_REMOTE_OP_ERR",
            syndrome::REMOTE_OP_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR",
            syndrome::TRANSPORT_RETRY_EXC_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR",
            syndrome::RNR_RETRY_EXC_ERR as u64,
        ),
        (
            "MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR",
            syndrome::REMOTE_ABORTED_ERR as u64,
        ),
    ])
    .collect();

    // SAFETY: `golden_table` is a C array of `golden_table_len` entries whose names are static,
    // NUL-terminated strings; the shim never writes to it.
    let theirs = unsafe { std::slice::from_raw_parts(golden_table.as_ptr(), golden_table_len) };
    assert_eq!(
        theirs.len(),
        ours.len(),
        "the golden table and this test list different entries"
    );
    for e in theirs {
        // SAFETY: see above.
        let name = unsafe { CStr::from_ptr(e.name) }
            .to_str()
            .expect("ASCII name");
        let mine = ours
            .get(name)
            .unwrap_or_else(|| panic!("no Rust counterpart listed for {name}"));
        assert_eq!(
            *mine, e.value,
            "{name}: ours {mine:#x}, mlx5dv.h {:#x}",
            e.value
        );
    }
}
