//! Typed device tensors: a shape over (part of) a peer-mappable device allocation.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use ibgda_device::cuda::{CudaError, DeviceBuffer};

use crate::dtype::Element;
use crate::error::EpError;

/// A byte range of a `cuMemAlloc` allocation: what tensors view. A pool hands these out (its
/// regions are parts of one allocation that peers map) and reuses one once no tensor or handle
/// holds it any more.
#[derive(Debug)]
pub(crate) struct Region {
    buf: Backing,
    offset: usize,
    len: usize,
}

/// The memory a [`Region`] lies in: an allocation of ours, or memory the caller owns.
#[derive(Debug)]
enum Backing {
    Owned(Arc<DeviceBuffer>),
    /// Caller memory ([`Tensor::from_device_ptr`]): never freed here.
    Borrowed {
        ctx: Arc<CudaContext>,
        ptr: u64,
        len: usize,
    },
}

impl Backing {
    fn ptr(&self) -> u64 {
        match self {
            Backing::Owned(b) => b.ptr(),
            Backing::Borrowed { ptr, .. } => *ptr,
        }
    }

    fn context(&self) -> &Arc<CudaContext> {
        match self {
            Backing::Owned(b) => b.context(),
            Backing::Borrowed { ctx, .. } => ctx,
        }
    }

    /// `count` elements from byte `offset` (synchronous), as [`DeviceBuffer::download`].
    fn download<T: bytemuck::Pod>(&self, offset: usize, count: usize) -> Result<Vec<T>, CudaError> {
        let (ctx, ptr, len) = match self {
            Backing::Owned(b) => return b.download(offset, count),
            Backing::Borrowed { ctx, ptr, len } => (ctx, *ptr, *len),
        };
        let mut out = vec![T::zeroed(); count];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        if offset.checked_add(bytes.len()).is_none_or(|end| end > len) {
            return Err(CudaError::OutOfRange {
                offset,
                len: bytes.len(),
                size: len,
            });
        }
        let driver = |call, source| CudaError::Driver { call, source };
        ibgda_device::cuda::bind(ctx)?;
        // SAFETY: `from_device_ptr`'s caller promised `len` readable bytes at `ptr` on this
        // context's device for the tensor's life; the range was checked above and `bytes` is
        // writable host memory of exactly that size.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoH_v2(
                bytes.as_mut_ptr().cast(),
                ptr + offset as u64,
                bytes.len(),
            )
        }
        .result()
        .map_err(|e| driver("cuMemcpyDtoH", e))?;
        Ok(out)
    }
}

impl Region {
    /// `len` bytes at `offset` of `buf`.
    pub(crate) fn part(buf: &Arc<DeviceBuffer>, offset: usize, len: usize) -> Self {
        debug_assert!(offset + len <= buf.len());
        Self {
            buf: Backing::Owned(buf.clone()),
            offset,
            len,
        }
    }

    /// The device address of the first byte.
    pub(crate) fn ptr(&self) -> u64 {
        self.buf.ptr() + self.offset as u64
    }

    /// Where the region starts in its allocation.
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    /// Bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn context(&self) -> &Arc<CudaContext> {
        self.buf.context()
    }
}

/// What a tensor view can be made over: a whole allocation or a pooled [`Region`].
pub(crate) trait IntoStorage {
    fn into_storage(self) -> Arc<Region>;
}

impl IntoStorage for Arc<Region> {
    fn into_storage(self) -> Arc<Region> {
        self
    }
}

impl IntoStorage for Arc<DeviceBuffer> {
    fn into_storage(self) -> Arc<Region> {
        let len = self.len();
        Arc::new(Region {
            buf: Backing::Owned(self),
            offset: 0,
            len,
        })
    }
}

/// A dense row-major tensor of `T` in GPU memory.
///
/// The memory comes from `cuMemAlloc` (peer-mappable), or is the caller's
/// ([`from_device_ptr`](Self::from_device_ptr): inputs from another framework, never freed or
/// mapped by peers here). Cloning shares the storage. Outputs of
/// [`Buffer`](crate::Buffer) operations are views into the buffer's pooled regions, which stay
/// reserved while any view or handle on them is alive.
#[derive(Debug)]
pub struct Tensor<T: Element> {
    storage: Arc<Region>,
    offset: usize,
    shape: Vec<usize>,
    /// Routing a kernel reads (a layout's or handle's tensors): [`Tensor::copy_from_host`]
    /// refuses to write it. Clones keep the flag.
    read_only: bool,
    _t: PhantomData<T>,
}

impl<T: Element> Clone for Tensor<T> {
    fn clone(&self) -> Self {
        Self {
            storage: self.storage.clone(),
            offset: self.offset,
            shape: self.shape.clone(),
            read_only: self.read_only,
            _t: PhantomData,
        }
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Why `data.len()` elements cannot fill `shape`, if they cannot (checked before any CUDA call).
fn shape_mismatch(shape: &[usize], len: usize) -> Option<String> {
    let n = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    match n {
        Some(n) if n == len => None,
        Some(n) => Some(format!(
            "shape {shape:?} holds {n} elements, data has {len}"
        )),
        None => Some(format!(
            "shape {shape:?} holds more than usize::MAX elements"
        )),
    }
}

fn tensor_err(gpu: usize, what: &str, source: ibgda_device::cuda::CudaError) -> EpError {
    EpError::Tensor {
        gpu,
        what: what.to_string(),
        source: Some(source),
    }
}

impl<T: Element> Tensor<T> {
    /// A tensor of `shape` holding a copy of `data` (row-major) on `ctx`'s GPU.
    pub fn from_host(ctx: &Arc<CudaContext>, data: &[T], shape: &[usize]) -> Result<Self, EpError> {
        let gpu = ctx.ordinal();
        if let Some(what) = shape_mismatch(shape, data.len()) {
            return Err(EpError::Tensor {
                gpu,
                what,
                source: None,
            });
        }
        let bytes = std::mem::size_of_val(data).max(16);
        let storage = DeviceBuffer::new(ctx, bytes)
            .map_err(|e| tensor_err(gpu, &format!("allocating {bytes} bytes"), e))?;
        if !data.is_empty() {
            storage
                .upload(0, data)
                .map_err(|e| tensor_err(gpu, &format!("uploading {bytes} bytes"), e))?;
        }
        Ok(Self::view(Arc::new(storage), 0, shape.to_vec()))
    }

    /// A tensor of `shape` with every element equal to `value`.
    pub fn filled(ctx: &Arc<CudaContext>, value: T, shape: &[usize]) -> Result<Self, EpError> {
        let n = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| EpError::Tensor {
                gpu: ctx.ordinal(),
                what: format!("shape {shape:?} holds more than usize::MAX elements"),
                source: None,
            })?;
        Self::from_host(ctx, &vec![value; n], shape)
    }

    /// A view of `shape` at byte `offset` of `storage` (an allocation or a pooled region).
    pub(crate) fn view(storage: impl IntoStorage, offset: usize, shape: Vec<usize>) -> Self {
        let storage = storage.into_storage();
        debug_assert!(
            offset + numel(&shape) * std::mem::size_of::<T>() <= storage.len().max(offset)
        );
        Self {
            storage,
            offset,
            shape,
            read_only: false,
            _t: PhantomData,
        }
    }

    /// Rows `start .. start + n` of a tensor of two or more dimensions (the same storage).
    ///
    /// # Panics
    ///
    /// When the rows are not inside the tensor.
    pub(crate) fn rows(&self, start: usize, n: usize) -> Self {
        assert!(
            !self.shape.is_empty() && start + n <= self.shape[0],
            "rows out of range"
        );
        let row: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = n;
        Self {
            storage: self.storage.clone(),
            offset: self.offset + start * row * std::mem::size_of::<T>(),
            shape,
            read_only: self.read_only,
            _t: PhantomData,
        }
    }

    /// The same view, refusing [`copy_from_host`](Self::copy_from_host): routing that kernels
    /// read and must not be edited out of agreement with what the buffer keeps privately.
    pub(crate) fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// Whether [`copy_from_host`](Self::copy_from_host) refuses to write this tensor (the
    /// tensors of a [`DispatchLayout`](crate::DispatchLayout) or a
    /// [`LlHandle`](crate::low_latency::LlHandle)).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// A tensor of `shape` over device memory the caller owns (another library's allocation, a
    /// framework's tensor), without copying: inputs of [`Buffer`](crate::Buffer) and
    /// [`LowLatencyBuffer`](crate::low_latency::LowLatencyBuffer) operations can be given this
    /// way. The memory is never freed here. [`copy_from_host`](Self::copy_from_host) is refused
    /// on such a tensor; [`to_host`](Self::to_host) works.
    ///
    /// # Safety
    ///
    /// `ptr` must address at least `shape.iter().product::<usize>() * size_of::<T>()` bytes of
    /// device memory on `ctx`'s GPU (in its primary context or one that shares its address
    /// space), aligned for `T`, that stays allocated for as long as this tensor, its clones, or
    /// any GPU work given it may use it. Peers of a [`Buffer`](crate::Buffer) never map it: only
    /// this rank's kernels and copies read it.
    pub unsafe fn from_device_ptr(ctx: &Arc<CudaContext>, ptr: u64, shape: &[usize]) -> Self {
        let len = numel(shape) * std::mem::size_of::<T>();
        let storage = Arc::new(Region {
            buf: Backing::Borrowed {
                ctx: ctx.clone(),
                ptr,
                len,
            },
            offset: 0,
            len,
        });
        Self::view(storage, 0, shape.to_vec())
    }

    /// Whether the tensor views caller memory ([`from_device_ptr`](Self::from_device_ptr)).
    pub fn is_borrowed(&self) -> bool {
        matches!(self.storage.buf, Backing::Borrowed { .. })
    }

    /// Copies the tensor to the host (synchronous, bounded: after the legacy default stream's
    /// earlier work, waited for at most
    /// [`LEGACY_STREAM_BOUND`](ibgda_device::cuda::LEGACY_STREAM_BOUND), then a copy that waits for
    /// nothing else). Work queued on non-default streams is not waited for: synchronize first
    /// (e.g. [`Buffer::synchronize`](crate::Buffer::synchronize)).
    pub fn to_host(&self) -> Result<Vec<T>, EpError> {
        if self.numel() == 0 {
            return Ok(Vec::new());
        }
        self.storage
            .buf
            .download(self.storage.offset + self.offset, self.numel())
            .map_err(|e| {
                tensor_err(
                    self.device_ordinal(),
                    &format!("downloading {:?} {}", self.shape, T::NAME),
                    e,
                )
            })
    }

    /// Overwrites the tensor with `data` (row-major, exactly [`numel`](Self::numel) elements),
    /// keeping its storage: e.g. fresh inputs for a replay of a captured CUDA graph, which reads
    /// the tensors it was captured with. The copy runs on the legacy default stream and may still
    /// be in flight when this returns (pageable source): synchronize the context before work on
    /// another stream reads the tensor.
    ///
    /// Refused for [read-only](Self::is_read_only) tensors.
    pub fn copy_from_host(&self, data: &[T]) -> Result<(), EpError> {
        let gpu = self.device_ordinal();
        if self.read_only {
            return Err(EpError::Tensor {
                gpu,
                what: format!(
                    "tensor of shape {:?} is read-only (routing of a layout or handle)",
                    self.shape
                ),
                source: None,
            });
        }
        if let Some(what) = shape_mismatch(&self.shape, data.len()) {
            return Err(EpError::Tensor {
                gpu,
                what,
                source: None,
            });
        }
        if data.is_empty() {
            return Ok(());
        }
        let Backing::Owned(buf) = &self.storage.buf else {
            return Err(EpError::Tensor {
                gpu,
                what: format!(
                    "tensor of shape {:?} views caller memory (from_device_ptr): write it \
                     through its owner",
                    self.shape
                ),
                source: None,
            });
        };
        buf.upload(self.storage.offset + self.offset, data)
            .map_err(|e| tensor_err(gpu, &format!("uploading {:?} {}", self.shape, T::NAME), e))
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// Size of dimension `i` (0 past the last).
    pub fn dim(&self, i: usize) -> usize {
        self.shape.get(i).copied().unwrap_or(0)
    }

    /// The device address of the first element, for handing to other CUDA code. Reading or
    /// writing through it is the caller's responsibility.
    pub fn device_address(&self) -> u64 {
        self.storage.ptr() + self.offset as u64
    }

    /// The GPU ordinal holding the tensor.
    pub fn device_ordinal(&self) -> usize {
        self.storage.context().ordinal()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_mismatch_names_both_counts_and_never_overflows() {
        assert_eq!(shape_mismatch(&[2, 3], 6), None);
        assert_eq!(shape_mismatch(&[], 1), None);
        let e = shape_mismatch(&[2, 3], 5).unwrap();
        assert!(e.contains("6 elements") && e.contains("data has 5"), "{e}");
        let e = shape_mismatch(&[usize::MAX, 2], 0).unwrap();
        assert!(e.contains("more than usize::MAX"), "{e}");
    }

    #[test]
    fn tensor_errors_name_the_gpu_not_a_rank() {
        let e = EpError::Tensor {
            gpu: 3,
            what: "shape [2] holds 2 elements, data has 1".into(),
            source: None,
        };
        let text = e.to_string();
        assert!(text.starts_with("tensor on GPU 3: "), "{text}");
        assert!(!text.contains(&usize::MAX.to_string()), "{text}");
    }
}
