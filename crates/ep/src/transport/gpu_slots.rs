//! Mode `cpu`'s producer slots: one 8-byte word per QP in GPU memory, which device code raises
//! and the proxy reads through a CPU view of GPU memory. Both transports build them here.
//!
//! The view is GDRCopy's mapping wherever GDRCopy works. On the emulated NIC without GDRCopy it
//! is the emulated GDR view ([`ibgda_gdr::CopyMirror`]: copy-engine reads of the slot page into a
//! host mirror), and the log says so; on a real NIC without GDRCopy mode `cpu` is refused (its
//! plan requires GDRCopy there, and the probe said what is missing before anything was built).

use std::sync::Arc;

use cudarc::driver::CudaContext;
use ibgda_device::cuda::DeviceBuffer;
use ibgda_gdr::{CopyMirror, CpuView, Gdr, MirrorConfig};

use super::error::TransportError;

/// GDRCopy pins whole 64 KiB GPU pages: the slots start on one.
pub(crate) const GPU_PAGE: u64 = 64 << 10;

/// How the proxy's CPU reaches the slots.
enum View {
    Gdr(ibgda_gdr::Mapping),
    Emulated(CopyMirror),
}

/// `n` producer slots in GPU memory and the proxy's view of them.
pub(crate) struct GpuSlots {
    // Declared first: the view goes before the memory it maps or mirrors.
    view: View,
    aligned: u64,
    _buf: Arc<DeviceBuffer>,
}

// SAFETY: the view is only read (8-byte loads by the proxy through `cpu_addr`); GDRCopy's handle
// is internally locked, the mirror is Send + Sync, and the buffer is Send + Sync.
unsafe impl Send for GpuSlots {}
// SAFETY: as for Send.
unsafe impl Sync for GpuSlots {}

impl GpuSlots {
    /// Zeroed slots for `n` QPs on `ctx`'s GPU. With `emulated_nic`, GDRCopy's absence falls
    /// back to the emulated GDR view (logged once per set, naming why GDRCopy is absent).
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        n: usize,
        emulated_nic: bool,
        rank: u32,
    ) -> Result<Self, TransportError> {
        let bytes = (8 * n).max(8);
        let buf = Arc::new(DeviceBuffer::new(ctx, (GPU_PAGE * 2) as usize)?);
        buf.fill_bytes(0)?;
        let aligned = buf.ptr().div_ceil(GPU_PAGE) * GPU_PAGE;
        let gdr = Gdr::open().and_then(|g| g.pin(aligned, bytes)?.map());
        let view = match gdr {
            Ok(m) => View::Gdr(m),
            Err(why) if emulated_nic => {
                tracing::info!(
                    target: "ep",
                    "rank {rank}: mode cpu: GDRCopy unavailable ({why}); the NIC is emulated, so \
                     the proxy reads the producer slots in GPU memory through the emulated GDR \
                     view (copy-engine reads into a host mirror)"
                );
                let stream = ibgda_device::stream_pool::service(ctx)?;
                let cfg = MirrorConfig {
                    name: format!("ibgda-gdr-mirror-r{rank}"),
                    ..Default::default()
                };
                // SAFETY: the range lies in `buf`, which this value keeps until after the
                // mirror (field order).
                View::Emulated(unsafe {
                    CopyMirror::new(ctx, stream, aligned, round8(bytes), cfg)
                }?)
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Self {
            view,
            aligned,
            _buf: buf,
        })
    }

    /// GPU address of slot `i` (the descriptor's `producer_slot`).
    pub(crate) fn device_addr(&self, i: usize) -> u64 {
        self.aligned + 8 * i as u64
    }

    /// CPU address of slot `i` in the proxy's view (8-byte aligned; read with 8-byte loads).
    pub(crate) fn cpu_addr(&self, i: usize) -> u64 {
        let base = match &self.view {
            View::Gdr(m) => m.cpu_ptr() as u64,
            View::Emulated(m) => m.cpu_ptr() as u64,
        };
        base + 8 * i as u64
    }

    /// Why the emulated view stopped following the GPU, if it did.
    pub(crate) fn view_error(&self) -> Option<String> {
        match &self.view {
            View::Gdr(_) => None,
            View::Emulated(m) => m.error(),
        }
    }
}

fn round8(x: usize) -> usize {
    x.div_ceil(8) * 8
}
