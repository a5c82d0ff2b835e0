//! What every operation shares: argument checks, kernel launches, stream ordering and the
//! device error report.

use cudarc::driver::{CudaFunction, DeviceRepr};
use ep_kernels::intranode as k;

use crate::config::Config;
use crate::dtype::Element;
use crate::error::{invalid, EpError};
use crate::event::Event;
use crate::kernel_launch::launch_with_params;
use crate::residency::gated;
use crate::tensor::{Region, Tensor};

use super::args::StreamOrder;
use super::errors::device_error;
use super::plan::ERROR_OFFSET;
use super::setup::Buffer;

impl Buffer {
    pub(super) fn cuda(
        &self,
        call: &'static str,
    ) -> impl Fn(cudarc::driver::DriverError) -> EpError + '_ {
        move |source| EpError::Cuda {
            rank: self.rank,
            call,
            source,
        }
    }

    pub(super) fn usable(&self) -> Result<(), EpError> {
        match self.poisoned.as_ref().or(self.gate_failure.get()) {
            Some(first) => Err(EpError::Poisoned {
                rank: self.rank,
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(super) fn on_this_gpu<T: Element>(&self, t: &Tensor<T>, name: &str) -> Result<(), EpError> {
        crate::checks::on_gpu(self.rank, self.ctx.ordinal(), t, name)
    }

    pub(super) fn shape_is<T: Element>(
        &self,
        t: &Tensor<T>,
        want: &[usize],
        name: &str,
    ) -> Result<(), EpError> {
        crate::checks::shape_is(self.rank, self.ctx.ordinal(), t, want, name)
    }

    /// Launches a kernel that waits for the other ranks: through the launch gate where ranks of
    /// this process share the GPU ([`crate::residency`]).
    pub(super) fn launch<P: DeviceRepr>(
        &self,
        f: &CudaFunction,
        grid: u32,
        block: u32,
        smem: u32,
        p: &P,
        call: &'static str,
    ) -> Result<(), EpError> {
        let gate = self.gate.as_deref().map(|g| (g, self.opts.timeout));
        let r = gated(gate, self.rank, call, || {
            self.launch_local(f, grid, block, smem, p, call)
        });
        if let Err(e @ EpError::SharedGpuTimeout { .. }) = &r {
            let _ = self.gate_failure.set(e.to_string());
        }
        r
    }

    /// Launches a kernel that waits for no other rank.
    pub(super) fn launch_local<P: DeviceRepr>(
        &self,
        f: &CudaFunction,
        grid: u32,
        block: u32,
        smem: u32,
        p: &P,
        call: &'static str,
    ) -> Result<(), EpError> {
        // SAFETY: every kernel of ep-kernels takes exactly one by-value parameter struct, and `P`
        // is the #[repr(C)] mirror of that kernel's struct (the caller pairs them); every address
        // in it is a live allocation of this rank or a peer-mapped one.
        unsafe { launch_with_params(&self.comm, f, grid, block, smem, p) }.map_err(self.cuda(call))
    }

    /// Whether the communication stream is being captured into a CUDA graph (see
    /// [`dispatch`](Self::dispatch), "CUDA graphs").
    pub fn is_capturing(&self) -> Result<bool, EpError> {
        crate::graph::is_capturing(&self.comm, self.rank)
    }

    /// Refuses an operation that waits on the host while the communication stream is captured.
    pub(super) fn not_capturing(&self, what: &str) -> Result<(), EpError> {
        crate::graph::refuse_host_wait(&self.comm, self.rank, what, "")
    }

    /// Makes the communication stream wait for `order.previous_event`, or for the compute
    /// stream's work so far. Under capture only for `previous_event` (an event recorded in the
    /// same capture): the graph's work is ordered by the stream it is launched on.
    pub(super) fn start(&self, order: &StreamOrder<'_>, capturing: bool) -> Result<(), EpError> {
        match order.previous_event {
            Some(e) => e.wait_on(&self.comm),
            None if capturing => Ok(()),
            None => Event::record(&self.compute, self.rank)?.wait_on(&self.comm),
        }
    }

    /// Records the end of the operation; makes the compute stream wait for it unless
    /// `async_finish` or under capture (the compute stream is not part of the graph).
    pub(super) fn finish(
        &self,
        order: &StreamOrder<'_>,
        capturing: bool,
    ) -> Result<Event, EpError> {
        let e = Event::record(&self.comm, self.rank)?;
        if !order.async_finish && !capturing {
            e.wait_on(&self.compute)?;
        }
        Ok(e)
    }

    /// `t` tokens fit the buffer's `max_tokens_per_rank`.
    pub(super) fn tokens_within_limit(&self, t: usize) -> Result<(), EpError> {
        if t > self.opts.max_tokens_per_rank {
            return Err(invalid(
                self.rank,
                format!(
                    "{t} tokens, more than max_tokens_per_rank {}",
                    self.opts.max_tokens_per_rank
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn check_config(&self, c: &Config) -> Result<(), EpError> {
        if c.num_sms == 0 || c.num_sms > 1024 {
            return Err(invalid(
                self.rank,
                format!("config.num_sms {} out of 1..=1024", c.num_sms),
            ));
        }
        // Blocks past the GPU's SMs would only queue behind the others; ranks of this process
        // sharing the GPU must fit on it together.
        self.share.check("intranode config.num_sms", c.num_sms, 0)?;
        if c.block_threads < 32 || c.block_threads > k::PUSH_THREADS || c.block_threads % 32 != 0 {
            return Err(invalid(
                self.rank,
                format!(
                    "config.block_threads {} is not a multiple of 32 in 32..=1024",
                    c.block_threads
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn poison(&self, region: &Region) -> Result<(), EpError> {
        if self.opts.poison_outputs {
            // SAFETY: the whole region, part of a live allocation of this rank, is written,
            // ordered on the communication stream.
            unsafe {
                cudarc::driver::sys::cuMemsetD8Async(
                    region.ptr(),
                    0xAB,
                    region.len(),
                    self.comm.cu_stream(),
                )
            }
            .result()
            .map_err(self.cuda("cuMemsetD8Async"))?;
        }
        Ok(())
    }

    /// Turns a recorded device error into an `Err` (and marks the buffer unusable). Reads
    /// host-mapped memory only: no wait (the internode buffer checks its NVLink hop's errors
    /// through it, [`InternodeBuffer::check_errors`](crate::internode::InternodeBuffer::check_errors)).
    pub(crate) fn check_device_error(&mut self) -> Result<(), EpError> {
        let Some(word) = self.mapped.read_error(ERROR_OFFSET) else {
            return Ok(());
        };
        let err = device_error(self.rank, &word, self.opts.timeout);
        self.poisoned = Some(err.to_string());
        Err(err)
    }

    /// Reports, without waiting, an error that kernels of earlier operations recorded (a wait
    /// that ran out of time, a routing value out of range): after one, the outputs of that
    /// operation and of those queued after it are incomplete, and the buffer is unusable.
    /// Operations that end without a host wait (combine, dispatch with `num_worst_tokens`,
    /// `async_finish`) leave such errors for the caller; [`synchronize`](Self::synchronize)
    /// waits and reports them, this reads host-mapped memory only and may precede every
    /// operation (errors of work still queued are not seen yet).
    pub fn check_errors(&mut self) -> Result<(), EpError> {
        self.usable()?;
        self.check_device_error()
    }

    /// Waits (bounded) until everything queued on the communication stream has run, then reports
    /// any error the kernels recorded.
    pub fn synchronize(&mut self) -> Result<(), EpError> {
        self.not_capturing("synchronize")?;
        let e = Event::record(&self.comm, self.rank)?;
        let r = e.wait_host(
            self.opts.timeout.saturating_mul(2),
            "the communication stream",
        );
        self.check_device_error()?;
        r
    }
}
