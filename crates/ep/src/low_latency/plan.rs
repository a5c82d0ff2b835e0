//! Where everything lies in a low-latency buffer's memory, for given options. Equal on every
//! rank (the kernels address peers' regions with this rank's offsets).

use ep_kernels::low_latency::{combine_slot_bytes, FP8_BLOCK, MAX_TOPK};

const ALIGN: usize = 256;

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Bytes of one dispatch message: a 16-byte header, the row, the FP8 scales; a multiple of 16.
pub(crate) fn msg_bytes(hidden: usize, fp8: bool) -> usize {
    let body = if fp8 {
        hidden + hidden / FP8_BLOCK * 4
    } else {
        hidden * 2
    };
    (16 + body).div_ceil(16) * 16
}

/// Offsets into the net buffer (the memory peers write), per half where indexed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NetPlan {
    /// `u64 [local][ranks]` dispatch count signals.
    pub(crate) signal: [usize; 2],
    /// `u64 [experts]` combine flags.
    pub(crate) flag: [usize; 2],
    /// Dispatch messages `[local][ranks][max tokens][msg]`.
    pub(crate) recv: [usize; 2],
    /// Combine rows `[experts][max tokens][slot]`: BF16 rows, or LogFMT-encoded ones (slots of
    /// `combine_slot_bytes(hidden, true)`, sized for the largest hidden).
    pub(crate) comb_recv: [usize; 2],
    /// Zero-copy combine input `[local][ranks × max tokens][hidden]` BF16 (also where the
    /// transport sends combine rows from, and where LogFMT rows are encoded: sized for
    /// LogFMT slots, which zero-copy never uses).
    pub(crate) comb_send: usize,
    /// Dispatch send staging `[max tokens][msg]` (transport: the NIC reads messages here).
    pub(crate) stage: usize,
    /// Total bytes.
    pub(crate) bytes: usize,
}

/// Offsets into one half's output region (the dispatch results).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OutPlan {
    pub(crate) x: usize,
    pub(crate) scales: usize,
    pub(crate) src_info: usize,
    pub(crate) layout: usize,
    pub(crate) count: usize,
    /// The dispatch's top-k ids `i32 [max tokens][topk]` (combine checks its own against them).
    pub(crate) topk: usize,
    pub(crate) bytes: usize,
}

/// The sizes a plan is made for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) ranks: usize,
    pub(crate) max_tokens: usize,
    pub(crate) max_hidden: usize,
    pub(crate) num_experts: usize,
}

impl Dims {
    pub(crate) fn local(&self) -> usize {
        self.num_experts / self.ranks
    }
    /// Rows per local expert in the packed outputs.
    pub(crate) fn cap(&self) -> usize {
        self.ranks * self.max_tokens
    }
}

impl NetPlan {
    pub(crate) fn new(d: &Dims) -> Self {
        let (l, r, t, h, e) = (
            d.local(),
            d.ranks,
            d.max_tokens,
            d.max_hidden,
            d.num_experts,
        );
        let mut at = 0;
        let mut take = |n: usize| {
            let here = at;
            at = align(at + n);
            here
        };
        let signal = [take(l * r * 8), take(l * r * 8)];
        let flag = [take(e * 8), take(e * 8)];
        let msg = msg_bytes(h, false);
        let recv = [take(l * r * t * msg), take(l * r * t * msg)];
        let slot = combine_slot_bytes(h, true);
        let comb_recv = [take(e * t * slot), take(e * t * slot)];
        let comb_send = take(l * r * t * slot);
        let stage = take(t * msg);
        Self {
            signal,
            flag,
            recv,
            comb_recv,
            comb_send,
            stage,
            bytes: at,
        }
    }
}

impl OutPlan {
    pub(crate) fn new(d: &Dims) -> Self {
        let (l, r, h) = (d.local(), d.ranks, d.max_hidden);
        let rows = l * d.cap();
        let mut at = 0;
        let mut take = |n: usize| {
            let here = at;
            at = align(at + n);
            here
        };
        let x = take(rows * h * 2);
        let scales = take(rows * h.div_ceil(FP8_BLOCK) * 4);
        let src_info = take(rows * 4);
        let layout = take(l * r * 2 * 4);
        let count = take(l * 4);
        let topk = take(d.max_tokens * MAX_TOPK * 4);
        Self {
            x,
            scales,
            src_info,
            layout,
            count,
            topk,
            bytes: at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_16_byte_multiples_and_regions_disjoint() {
        for h in [128, 2048, 2560, 7168, 8192] {
            assert_eq!(msg_bytes(h, true) % 16, 0);
            assert_eq!(msg_bytes(h, false), 16 + 2 * h);
            assert!(msg_bytes(h, true) <= msg_bytes(h, false));
        }
        let d = Dims {
            ranks: 4,
            max_tokens: 128,
            max_hidden: 7168,
            num_experts: 288,
        };
        let p = NetPlan::new(&d);
        assert!(p.signal[1] >= p.signal[0] + 72 * 4 * 8);
        assert!(p.recv[0] >= p.flag[1] + 288 * 8);
        assert!(p.recv[1] - p.recv[0] >= 72 * 4 * 128 * msg_bytes(7168, false));
        assert!(p.comb_send >= p.comb_recv[1] + 288 * 128 * 7168 * 2);
        assert!(p.stage >= p.comb_send + 72 * 512 * 7168 * 2);
        assert!(p.bytes >= p.stage + 128 * msg_bytes(7168, false));
        let o = OutPlan::new(&d);
        assert!(o.scales >= 72 * 512 * 7168 * 2);
        assert!(o.topk >= o.count + 72 * 4);
        assert!(o.bytes >= o.topk + 128 * MAX_TOPK * 4);
    }
}
