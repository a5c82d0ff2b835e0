//! Rank masks (DeepEP's `enable_shrink`): which ranks this rank leaves out of its operations,
//! in low-latency mode ([`LowLatencyBuffer::update_mask`](crate::low_latency::LowLatencyBuffer::update_mask))
//! and in normal intranode mode ([`Buffer::update_mask`](crate::Buffer::update_mask)). A masked
//! rank gets none of this rank's tokens (dispatch) or expert outputs (combine), and what it would
//! have sent is treated as absent: its rows are not received, its experts' outputs count as
//! missing from each token's sum. Each rank keeps its own mask (a `i32 [MASK_WORDS]` array in
//! device memory that the kernels read), set by the caller or, in low-latency mode with shrink
//! on, by the kernels themselves: a receive wait on a rank that runs out of time masks that rank
//! instead of failing the operation, and [`query`](RankMask::query_into) reports it.
//!
//! Every change is ordered on the buffer's stream (a `cuMemsetD32Async`), as DeepEP's are.
//! What each mode requires of the masks of different ranks (symmetry, and in normal mode
//! transitivity) is said by the buffer's `update_mask`. A rank unmasked again must have made
//! the same calls as the others meanwhile (the kernels count every operation).

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};
use ep_kernels::low_latency::MASK_WORDS;

// One mask type serves both modes: it must have a word for every rank of either.
const _: () = assert!(ep_kernels::intranode::MAX_RANKS <= MASK_WORDS);
use ibgda_device::cuda::DeviceBuffer;

use crate::error::{invalid, EpError};
use crate::tensor::Tensor;

/// One rank's mask: `i32 [MASK_WORDS]`, 1 = masked.
#[derive(Debug)]
pub(crate) struct RankMask {
    words: Arc<DeviceBuffer>,
    rank: usize,
    ranks: usize,
}

impl RankMask {
    /// A mask with nobody masked (zeroed before this returns).
    pub(crate) fn new(ctx: &Arc<CudaContext>, rank: usize, ranks: usize) -> Result<Self, EpError> {
        let dev = |source| EpError::Device { rank, source };
        let words = DeviceBuffer::new(ctx, MASK_WORDS * 4).map_err(dev)?;
        words.fill_bytes(0).map_err(dev)?;
        Ok(Self {
            words: Arc::new(words),
            rank,
            ranks,
        })
    }

    /// What the kernels get as `mask`.
    pub(crate) fn addr(&self) -> u64 {
        self.words.ptr()
    }

    /// Masks (`true`) or unmasks `target`, ordered on `stream`.
    pub(crate) fn update(
        &self,
        stream: &CudaStream,
        target: usize,
        masked: bool,
    ) -> Result<(), EpError> {
        if target >= self.ranks {
            return Err(invalid(
                self.rank,
                format!(
                    "rank_to_mask {target} out of 0..{} (the group's ranks)",
                    self.ranks
                ),
            ));
        }
        self.set(
            stream,
            target,
            1,
            u32::from(masked),
            "cuMemsetD32Async (mask)",
        )
    }

    /// Unmasks every rank, ordered on `stream`.
    pub(crate) fn clean(&self, stream: &CudaStream) -> Result<(), EpError> {
        self.set(stream, 0, MASK_WORDS, 0, "cuMemsetD32Async (clean mask)")
    }

    fn set(
        &self,
        stream: &CudaStream,
        first: usize,
        n: usize,
        value: u32,
        call: &'static str,
    ) -> Result<(), EpError> {
        debug_assert!(first + n <= MASK_WORDS);
        // SAFETY: words first..first + n of the live MASK_WORDS-word allocation (checked above),
        // ordered on the buffer's stream like every kernel that reads them.
        unsafe {
            sys::cuMemsetD32Async(
                self.words.ptr() + 4 * first as u64,
                value,
                n,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(|source| EpError::Cuda {
            rank: self.rank,
            call,
            source,
        })
    }

    /// Copies the mask of every rank (`i32 [ranks]`, 1 = masked) into `out`, ordered on
    /// `stream` (after every operation queued before it, whose timeouts may have masked ranks).
    pub(crate) fn query_into(&self, stream: &CudaStream, out: &Tensor<i32>) -> Result<(), EpError> {
        if out.shape() != [self.ranks] {
            return Err(invalid(
                self.rank,
                format!(
                    "mask_status has shape {:?}, expected [{}] (i32, one per rank)",
                    out.shape(),
                    self.ranks
                ),
            ));
        }
        if out.is_read_only() {
            return Err(invalid(self.rank, "mask_status is read-only"));
        }
        // SAFETY: `out` is a live, writable i32 [ranks] tensor (checked above) and the source is
        // the first `ranks` words of the mask (ranks ≤ MASK_WORDS); ordered on the stream.
        unsafe {
            sys::cuMemcpyDtoDAsync_v2(
                out.device_address(),
                self.words.ptr(),
                4 * self.ranks,
                stream.cu_stream(),
            )
        }
        .result()
        .map_err(|source| EpError::Cuda {
            rank: self.rank,
            call: "cuMemcpyDtoDAsync (query mask)",
            source,
        })
    }

    /// Keeps the mask alive in a hook that launches later.
    pub(crate) fn keep(&self) -> Arc<DeviceBuffer> {
        self.words.clone()
    }
}
