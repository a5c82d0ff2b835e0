/*
 * Test-only shim: fills buffers with rdma-core's own mlx5dv.h inline setters and structs, the
 * ground truth the golden tests (tests/golden.rs) compare our Rust builders with. Linked into the
 * integration tests of ibgda-device only.
 *
 * Where mlx5dv.h has a setter (control and data segments, plus their SSSE3 variants) it is
 * called; where it only has a struct (remote address, atomic, inline header, CQEs) the struct is
 * filled field by field with htobe*; the masked-atomic operand segments are in no rdma-core header,
 * so they are declared here from the PRM layout and filled the same way.
 */
#include <endian.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <infiniband/mlx5dv.h>

/* ---- single segments ---------------------------------------------------------------------- */

void golden_ctrl_seg(uint8_t *out, uint16_t pi, uint8_t opcode, uint8_t opmod, uint32_t qpn, uint8_t fm_ce_se,
                     uint8_t ds, uint8_t signature, uint32_t imm)
{
	struct mlx5_wqe_ctrl_seg seg;

	memset(&seg, 0, sizeof(seg));
	/* The setter stores imm as given: callers pass it already big-endian. */
	mlx5dv_set_ctrl_seg(&seg, pi, opcode, opmod, qpn, fm_ce_se, ds, signature, htobe32(imm));
	memcpy(out, &seg, sizeof(seg));
}

/* 1 when rdma-core's SSSE3 setter was compiled in and filled `out`, 0 otherwise. */
int golden_ctrl_seg_x86(uint8_t *out, uint16_t pi, uint8_t opcode, uint8_t opmod, uint32_t qpn, uint8_t fm_ce_se,
                        uint8_t ds, uint8_t signature, uint32_t imm)
{
#if defined(__SSE3__) && defined(__SSSE3__)
	struct mlx5_wqe_ctrl_seg seg;

	memset(&seg, 0xa5, sizeof(seg));
	mlx5dv_x86_set_ctrl_seg(&seg, pi, opcode, opmod, qpn, fm_ce_se, ds, signature, htobe32(imm));
	memcpy(out, &seg, sizeof(seg));
	return 1;
#else
	(void)out; (void)pi; (void)opcode; (void)opmod; (void)qpn; (void)fm_ce_se; (void)ds; (void)signature;
	(void)imm;
	return 0;
#endif
}

void golden_data_seg(uint8_t *out, uint32_t len, uint32_t lkey, uint64_t addr)
{
	struct mlx5_wqe_data_seg seg;

	mlx5dv_set_data_seg(&seg, len, lkey, (uintptr_t)addr);
	memcpy(out, &seg, sizeof(seg));
}

int golden_data_seg_x86(uint8_t *out, uint32_t len, uint32_t lkey, uint64_t addr)
{
#if defined(__SSE3__) && defined(__SSSE3__)
	struct mlx5_wqe_data_seg seg;

	mlx5dv_x86_set_data_seg(&seg, len, lkey, (uintptr_t)addr);
	memcpy(out, &seg, sizeof(seg));
	return 1;
#else
	(void)out; (void)len; (void)lkey; (void)addr;
	return 0;
#endif
}

void golden_raddr_seg(uint8_t *out, uint64_t raddr, uint32_t rkey)
{
	struct mlx5_wqe_raddr_seg seg;

	seg.raddr = htobe64(raddr);
	seg.rkey = htobe32(rkey);
	seg.reserved = 0;
	memcpy(out, &seg, sizeof(seg));
}

void golden_atomic_seg(uint8_t *out, uint64_t swap_add, uint64_t compare)
{
	struct mlx5_wqe_atomic_seg seg;

	seg.swap_add = htobe64(swap_add);
	seg.compare = htobe64(compare);
	memcpy(out, &seg, sizeof(seg));
}

void golden_inline_seg(uint8_t *out, uint32_t len)
{
	struct mlx5_wqe_inl_data_seg seg;

	seg.byte_count = htobe32(len | MLX5_INLINE_SEG);
	memcpy(out, &seg, sizeof(seg));
}

/* ---- whole WQEs, one WQEBB each ----------------------------------------------------------- */

/* Masked-atomic operand segments (PRM "Atomic Segment", extended atomics). */
struct golden_masked_fa32_seg {
	__be32 add;
	__be32 field_boundary;
	__be32 reserved[2];
};

struct golden_masked_cs32_seg {
	__be32 swap;
	__be32 compare;
	__be32 swap_mask;
	__be32 compare_mask;
};

struct golden_masked_fa64_seg {
	__be64 add;
	__be64 field_boundary;
};

_Static_assert(sizeof(struct golden_masked_fa32_seg) == 16, "masked fa32 segment");
_Static_assert(sizeof(struct golden_masked_cs32_seg) == 16, "masked cs32 segment");
_Static_assert(sizeof(struct golden_masked_fa64_seg) == 16, "masked fa64 segment");

struct golden_rdma_wqe {
	struct mlx5_wqe_ctrl_seg ctrl;
	struct mlx5_wqe_raddr_seg raddr;
	struct mlx5_wqe_data_seg data[2];
};

struct golden_atomic_wqe {
	struct mlx5_wqe_ctrl_seg ctrl;
	struct mlx5_wqe_raddr_seg raddr;
	union {
		struct mlx5_wqe_atomic_seg std;
		struct golden_masked_fa32_seg fa32;
		struct golden_masked_cs32_seg cs32;
		struct golden_masked_fa64_seg fa64;
	} op;
	struct mlx5_wqe_data_seg fetch;
};

_Static_assert(sizeof(struct golden_rdma_wqe) == MLX5_SEND_WQE_BB, "rdma wqe is one WQEBB");
_Static_assert(sizeof(struct golden_atomic_wqe) == MLX5_SEND_WQE_BB, "atomic wqe is one WQEBB");

void golden_wqe_nop(uint8_t *out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se)
{
	struct mlx5_wqe_ctrl_seg ctrl;

	memset(out, 0, MLX5_SEND_WQE_BB);
	memset(&ctrl, 0, sizeof(ctrl));
	mlx5dv_set_ctrl_seg(&ctrl, idx, MLX5_OPCODE_NOP, 0, qpn, fm_ce_se, 1, 0, 0);
	memcpy(out, &ctrl, sizeof(ctrl));
}

/* RDMA write of `nsge` (1 or 2) gather entries; with_imm: RDMA write with immediate `imm`. */
void golden_wqe_rdma_write(uint8_t *out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                           uint32_t nsge, const uint64_t *addrs, const uint32_t *lkeys, const uint32_t *lens,
                           int with_imm, uint32_t imm)
{
	struct golden_rdma_wqe w;
	uint32_t i;

	memset(&w, 0, sizeof(w));
	mlx5dv_set_ctrl_seg(&w.ctrl, idx, with_imm ? MLX5_OPCODE_RDMA_WRITE_IMM : MLX5_OPCODE_RDMA_WRITE, 0, qpn,
			    fm_ce_se, (uint8_t)(2 + nsge), 0, with_imm ? htobe32(imm) : 0);
	w.raddr.raddr = htobe64(raddr);
	w.raddr.rkey = htobe32(rkey);
	for (i = 0; i < nsge && i < 2; i++)
		mlx5dv_set_data_seg(&w.data[i], lens[i], lkeys[i], (uintptr_t)addrs[i]);
	memcpy(out, &w, sizeof(w));
}

void golden_wqe_inline_write(uint8_t *out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                             uint32_t rkey, const uint8_t *data, uint32_t len, int with_imm, uint32_t imm)
{
	struct mlx5_wqe_ctrl_seg ctrl;
	struct mlx5_wqe_raddr_seg rseg;
	struct mlx5_wqe_inl_data_seg inl;
	uint8_t ds = (uint8_t)(2 + (sizeof(inl) + len + 15) / 16);

	memset(out, 0, MLX5_SEND_WQE_BB);
	memset(&ctrl, 0, sizeof(ctrl));
	mlx5dv_set_ctrl_seg(&ctrl, idx, with_imm ? MLX5_OPCODE_RDMA_WRITE_IMM : MLX5_OPCODE_RDMA_WRITE, 0, qpn,
			    fm_ce_se, ds, 0, with_imm ? htobe32(imm) : 0);
	rseg.raddr = htobe64(raddr);
	rseg.rkey = htobe32(rkey);
	rseg.reserved = 0;
	inl.byte_count = htobe32(len | MLX5_INLINE_SEG);
	memcpy(out, &ctrl, sizeof(ctrl));
	memcpy(out + sizeof(ctrl), &rseg, sizeof(rseg));
	memcpy(out + sizeof(ctrl) + sizeof(rseg), &inl, sizeof(inl));
	memcpy(out + sizeof(ctrl) + sizeof(rseg) + sizeof(inl), data, len);
}

static void golden_atomic_frame(struct golden_atomic_wqe *w, uint8_t opcode, uint8_t opmod, uint32_t qpn,
				uint16_t idx, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey, uint64_t laddr,
				uint32_t lkey, uint32_t fetch_len)
{
	memset(w, 0, sizeof(*w));
	mlx5dv_set_ctrl_seg(&w->ctrl, idx, opcode, opmod, qpn, fm_ce_se, 4, 0, 0);
	w->raddr.raddr = htobe64(raddr);
	w->raddr.rkey = htobe32(rkey);
	mlx5dv_set_data_seg(&w->fetch, fetch_len, lkey, (uintptr_t)laddr);
}

void golden_wqe_fetch_add64(uint8_t *out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                            uint64_t laddr, uint32_t lkey, uint64_t add)
{
	struct golden_atomic_wqe w;

	golden_atomic_frame(&w, MLX5_OPCODE_ATOMIC_FA, 0, qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, 8);
	w.op.std.swap_add = htobe64(add);
	w.op.std.compare = 0;
	memcpy(out, &w, sizeof(w));
}

void golden_wqe_compare_swap64(uint8_t *out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                               uint32_t rkey, uint64_t laddr, uint32_t lkey, uint64_t swap, uint64_t compare)
{
	struct golden_atomic_wqe w;

	golden_atomic_frame(&w, MLX5_OPCODE_ATOMIC_CS, 0, qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, 8);
	w.op.std.swap_add = htobe64(swap);
	w.op.std.compare = htobe64(compare);
	memcpy(out, &w, sizeof(w));
}

void golden_wqe_masked_fetch_add32(uint8_t *out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                   uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t add, uint32_t boundary)
{
	struct golden_atomic_wqe w;

	golden_atomic_frame(&w, MLX5_OPCODE_ATOMIC_MASKED_FA, 0x08, qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, 4);
	w.op.fa32.add = htobe32(add);
	w.op.fa32.field_boundary = htobe32(boundary);
	memcpy(out, &w, sizeof(w));
}

void golden_wqe_masked_compare_swap32(uint8_t *out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                      uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t swap, uint32_t compare,
                                      uint32_t swap_mask, uint32_t compare_mask)
{
	struct golden_atomic_wqe w;

	golden_atomic_frame(&w, MLX5_OPCODE_ATOMIC_MASKED_CS, 0x08, qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, 4);
	w.op.cs32.swap = htobe32(swap);
	w.op.cs32.compare = htobe32(compare);
	w.op.cs32.swap_mask = htobe32(swap_mask);
	w.op.cs32.compare_mask = htobe32(compare_mask);
	memcpy(out, &w, sizeof(w));
}

void golden_wqe_masked_fetch_add64(uint8_t *out, uint32_t qpn, uint16_t idx, uint8_t fm_ce_se, uint64_t raddr,
                                   uint32_t rkey, uint64_t laddr, uint32_t lkey, uint64_t add, uint64_t boundary)
{
	struct golden_atomic_wqe w;

	golden_atomic_frame(&w, MLX5_OPCODE_ATOMIC_MASKED_FA, 0x09, qpn, idx, fm_ce_se, raddr, rkey, laddr, lkey, 8);
	w.op.fa64.add = htobe64(add);
	w.op.fa64.field_boundary = htobe64(boundary);
	memcpy(out, &w, sizeof(w));
}

/* ---- CQEs --------------------------------------------------------------------------------- */

void golden_cqe_requester(uint8_t *out, uint8_t owner, uint16_t wqe_counter, uint32_t qpn, uint8_t wqe_opcode,
                          uint32_t byte_cnt)
{
	struct mlx5_cqe64 c;

	memset(&c, 0, sizeof(c));
	c.byte_cnt = htobe32(byte_cnt);
	c.sop_drop_qpn = htobe32(((uint32_t)wqe_opcode << 24) | (qpn & 0xffffff));
	c.wqe_counter = htobe16(wqe_counter);
	c.op_own = (uint8_t)(MLX5_CQE_REQ << 4);
	mlx5dv_set_cqe_owner(&c, owner);
	memcpy(out, &c, sizeof(c));
}

void golden_cqe_requester_error(uint8_t *out, uint8_t owner, uint16_t wqe_counter, uint32_t qpn, uint8_t wqe_opcode,
                                uint8_t syndrome, uint8_t vendor_syndrome)
{
	struct mlx5_err_cqe e;

	memset(&e, 0, sizeof(e));
	e.vendor_err_synd = vendor_syndrome;
	e.syndrome = syndrome;
	e.s_wqe_opcode_qpn = htobe32(((uint32_t)wqe_opcode << 24) | (qpn & 0xffffff));
	e.wqe_counter = htobe16(wqe_counter);
	e.op_own = (uint8_t)((MLX5_CQE_REQ_ERR << 4) | (owner & 1));
	memcpy(out, &e, sizeof(e));
}

/* rdma-core's reading of a CQE: owner, opcode, wqe_counter, syndrome, vendor syndrome. */
void golden_cqe_read(const uint8_t *cqe, uint8_t *owner, uint8_t *opcode, uint16_t *wqe_counter, uint8_t *syndrome,
                     uint8_t *vendor_syndrome, uint32_t *qpn)
{
	struct mlx5_cqe64 c;
	struct mlx5_err_cqe e;

	memcpy(&c, cqe, sizeof(c));
	memcpy(&e, cqe, sizeof(e));
	*owner = mlx5dv_get_cqe_owner(&c);
	*opcode = mlx5dv_get_cqe_opcode(&c);
	*wqe_counter = be16toh(c.wqe_counter);
	*syndrome = e.syndrome;
	*vendor_syndrome = e.vendor_err_synd;
	*qpn = be32toh(c.sop_drop_qpn) & 0xffffff;
}

/* ---- layouts and constants of mlx5dv.h ---------------------------------------------------- */

struct golden_entry {
	const char *name;
	uint64_t value;
};

#define OFF(s, f) { "offsetof(" #s "." #f ")", offsetof(struct s, f) }
#define SIZE(s) { "sizeof(" #s ")", sizeof(struct s) }
#define VAL(c) { #c, (uint64_t)(c) }

const struct golden_entry golden_table[] = {
	SIZE(mlx5_wqe_ctrl_seg),
	OFF(mlx5_wqe_ctrl_seg, opmod_idx_opcode),
	OFF(mlx5_wqe_ctrl_seg, qpn_ds),
	OFF(mlx5_wqe_ctrl_seg, signature),
	OFF(mlx5_wqe_ctrl_seg, dci_stream_channel_id),
	OFF(mlx5_wqe_ctrl_seg, fm_ce_se),
	OFF(mlx5_wqe_ctrl_seg, imm),
	SIZE(mlx5_wqe_raddr_seg),
	OFF(mlx5_wqe_raddr_seg, raddr),
	OFF(mlx5_wqe_raddr_seg, rkey),
	OFF(mlx5_wqe_raddr_seg, reserved),
	SIZE(mlx5_wqe_data_seg),
	OFF(mlx5_wqe_data_seg, byte_count),
	OFF(mlx5_wqe_data_seg, lkey),
	OFF(mlx5_wqe_data_seg, addr),
	SIZE(mlx5_wqe_inl_data_seg),
	OFF(mlx5_wqe_inl_data_seg, byte_count),
	SIZE(mlx5_wqe_atomic_seg),
	OFF(mlx5_wqe_atomic_seg, swap_add),
	OFF(mlx5_wqe_atomic_seg, compare),
	SIZE(mlx5_cqe64),
	OFF(mlx5_cqe64, srqn_uidx),
	OFF(mlx5_cqe64, imm_inval_pkey),
	OFF(mlx5_cqe64, app),
	OFF(mlx5_cqe64, app_op),
	OFF(mlx5_cqe64, app_info),
	OFF(mlx5_cqe64, byte_cnt),
	OFF(mlx5_cqe64, timestamp),
	OFF(mlx5_cqe64, sop_drop_qpn),
	OFF(mlx5_cqe64, wqe_counter),
	OFF(mlx5_cqe64, signature),
	OFF(mlx5_cqe64, op_own),
	SIZE(mlx5_err_cqe),
	OFF(mlx5_err_cqe, srqn),
	OFF(mlx5_err_cqe, vendor_err_synd),
	OFF(mlx5_err_cqe, syndrome),
	OFF(mlx5_err_cqe, s_wqe_opcode_qpn),
	OFF(mlx5_err_cqe, wqe_counter),
	OFF(mlx5_err_cqe, signature),
	OFF(mlx5_err_cqe, op_own),
	VAL(MLX5_SEND_WQE_BB),
	VAL(MLX5_OPCODE_NOP),
	VAL(MLX5_OPCODE_RDMA_WRITE),
	VAL(MLX5_OPCODE_RDMA_WRITE_IMM),
	VAL(MLX5_OPCODE_RDMA_READ),
	VAL(MLX5_OPCODE_ATOMIC_CS),
	VAL(MLX5_OPCODE_ATOMIC_FA),
	VAL(MLX5_OPCODE_ATOMIC_MASKED_CS),
	VAL(MLX5_OPCODE_ATOMIC_MASKED_FA),
	VAL(MLX5_WQE_CTRL_CQ_UPDATE),
	VAL(MLX5_WQE_CTRL_SOLICITED),
	VAL(MLX5_WQE_CTRL_FENCE),
	VAL(MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE),
	VAL(MLX5_INLINE_SEG),
	VAL(MLX5_CQE_REQ),
	VAL(MLX5_CQE_RESP_WR_IMM),
	VAL(MLX5_CQE_RESP_SEND),
	VAL(MLX5_CQE_REQ_ERR),
	VAL(MLX5_CQE_RESP_ERR),
	VAL(MLX5_CQE_INVALID),
	VAL(MLX5_CQE_OWNER_MASK),
	VAL(MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR),
	VAL(MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR),
	VAL(MLX5_CQE_SYNDROME_LOCAL_PROT_ERR),
	VAL(MLX5_CQE_SYNDROME_WR_FLUSH_ERR),
	VAL(MLX5_CQE_SYNDROME_MW_BIND_ERR),
	VAL(MLX5_CQE_SYNDROME_BAD_RESP_ERR),
	VAL(MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR),
	VAL(MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR),
	VAL(MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR),
	VAL(MLX5_CQE_SYNDROME_REMOTE_OP_ERR),
	VAL(MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR),
	VAL(MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR),
	VAL(MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR),
};

const size_t golden_table_len = sizeof(golden_table) / sizeof(golden_table[0]);
