//! What every low-latency operation shares: kernel launches (through the launch gate where
//! ranks share a GPU), argument checks and the device error report.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaFunction, CudaStream, DeviceRepr};
use ep_kernels::low_latency as k;
use ibgda_device::cuda::DeviceBuffer;
use ibgda_device::qp_desc::NicHandler;

use super::args::LlRecvInto;
use super::errors::{device_error, DeviceErrorContext};
use super::setup::{LowLatencyBuffer, ERROR_OFFSET};
use crate::dtype::Element;
use crate::error::{invalid, EpError};
use crate::kernel_launch::launch_with_params;
use crate::residency::{gated, LaunchGate, EMULATED_NIC_SMS};
use crate::tensor::Tensor;

/// Where ranks of this process sharing a GPU meet around a launch, and for how long at most.
type Gate<'a> = Option<(&'a LaunchGate, Duration)>;

/// Launches a low-latency kernel (they all wait for other ranks), through `gate` where ranks of
/// this process share the GPU.
pub(super) fn launch<P: DeviceRepr>(
    gate: Gate<'_>,
    stream: &CudaStream,
    f: &CudaFunction,
    grid: u32,
    p: &P,
    rank: usize,
    call: &'static str,
) -> Result<(), EpError> {
    gated(gate, rank, call, || {
        launch_now(stream, f, grid, p, rank, call)
    })
}

fn launch_now<P: DeviceRepr>(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: u32,
    p: &P,
    rank: usize,
    call: &'static str,
) -> Result<(), EpError> {
    // Every address in `P` is a live allocation of this rank (kept alive by the buffer or the
    // hook) or a peer's window, which stays mapped until the group's teardown barrier.
    // SAFETY: every low-latency kernel takes exactly one by-value parameter struct and `P` is the
    // #[repr(C)] mirror of that kernel's struct (the callers pair them); addresses as above.
    unsafe { launch_with_params(stream, f, grid, k::THREADS, 0, p) }
        .map_err(|source| EpError::Cuda { rank, call, source })
}

impl LowLatencyBuffer {
    pub(super) fn usable(&self) -> Result<(), EpError> {
        match &self.poisoned {
            Some(first) => Err(EpError::Poisoned {
                rank: self.rank,
                first: first.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(super) fn check_hidden(
        &self,
        h: usize,
        multiple: usize,
        what: &str,
    ) -> Result<(), EpError> {
        if h == 0 || h % multiple != 0 || h > self.opts.max_hidden {
            return Err(invalid(
                self.rank,
                format!(
                    "{what} {h}: expected a multiple of {multiple} in {multiple}..={}",
                    self.opts.max_hidden
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn shape_is<T: Element>(
        &self,
        t: &Tensor<T>,
        want: &[usize],
        name: &str,
    ) -> Result<(), EpError> {
        crate::checks::shape_is(self.rank, self.ctx.ordinal(), t, want, name)
    }

    /// A caller's tensor that a kernel writes must not be one of the buffer's read-only views.
    pub(super) fn writable(&self, read_only: bool, name: &str) -> Result<(), EpError> {
        if read_only {
            return Err(invalid(
                self.rank,
                format!(
                    "{name} is a read-only view of the buffer's routing; pass a writable tensor"
                ),
            ));
        }
        Ok(())
    }

    /// The address the dispatch receive writes its rows to when the caller gives a tensor
    /// (checked: the dispatched element type, `shape`, this GPU, writable, 16-byte aligned for
    /// the kernel's vector stores); `None` for the buffer's own output half.
    pub(super) fn check_recv_into(
        &self,
        into: Option<LlRecvInto<'_>>,
        fp8: bool,
        shape: &[usize],
    ) -> Result<Option<u64>, EpError> {
        let (addr, read_only) = match (into, fp8) {
            (None, _) => return Ok(None),
            (Some(LlRecvInto::Bf16(t)), false) => {
                self.shape_is(t, shape, "recv_into")?;
                (t.device_address(), t.is_read_only())
            }
            (Some(LlRecvInto::Fp8(t)), true) => {
                self.shape_is(t, shape, "recv_into")?;
                (t.device_address(), t.is_read_only())
            }
            (Some(_), _) => {
                return Err(invalid(
                    self.rank,
                    format!(
                        "recv_into has the wrong element type: this dispatch receives {}",
                        if fp8 { "FP8" } else { "BF16" }
                    ),
                ))
            }
        };
        self.writable(read_only, "recv_into")?;
        if addr % 16 != 0 {
            return Err(invalid(
                self.rank,
                format!("recv_into at {addr:#x} is not 16-byte aligned"),
            ));
        }
        Ok(Some(addr))
    }

    /// The grid of a waiting kernel: `num_sms`, or the default budget; refused before launch
    /// when it is out of range or the ranks of this process on this GPU would not fit together.
    pub(super) fn grid(&self, what: &str, num_sms: Option<u32>) -> Result<u32, EpError> {
        let n = match num_sms {
            None => return Ok(self.budget),
            Some(n) if n >= 1 && n <= self.sms => n,
            Some(n) => {
                return Err(invalid(
                    self.rank,
                    format!("num_sms {n} out of 1..={} (one block per SM)", self.sms),
                ))
            }
        };
        let reserved = if self.transport.is_some() {
            EMULATED_NIC_SMS
        } else {
            0
        };
        self.share.check(what, n, reserved)?;
        Ok(n)
    }

    pub(super) fn free_half(
        &self,
        region: &Arc<DeviceBuffer>,
        what: &'static str,
    ) -> Result<(), EpError> {
        // The buffer holds one reference; any other is a live output, handle or hook.
        if Arc::strong_count(region) > 1 {
            return Err(EpError::RegionsInUse {
                rank: self.rank,
                what,
                limit: 2,
            });
        }
        Ok(())
    }

    pub(super) fn poison(&self, region: &DeviceBuffer) -> Result<(), EpError> {
        if self.opts.poison_outputs {
            // SAFETY: the whole live allocation is written, ordered on this buffer's stream.
            unsafe {
                sys::cuMemsetD8Async(region.ptr(), 0xAB, region.len(), self.stream.cu_stream())
            }
            .result()
            .map_err(|source| EpError::Cuda {
                rank: self.rank,
                call: "cuMemsetD8Async",
                source,
            })?;
        }
        Ok(())
    }

    pub(super) fn timeout_ns(&self) -> u64 {
        ibgda_device::timeout::device_ns(self.opts.timeout)
    }

    /// The launch gate for a launch now (none while capturing or when the GPU is not shared).
    pub(super) fn gate(&self) -> Gate<'_> {
        match (&self.launch_gate, self.capturing) {
            (Some(g), false) => Some((&**g, self.opts.timeout)),
            _ => None,
        }
    }

    /// The launch gate for a launch later (a hook, a graph replay).
    pub(super) fn gate_for_hook(&self) -> Option<(Arc<LaunchGate>, Duration)> {
        self.launch_gate
            .as_ref()
            .map(|g| (g.clone(), self.opts.timeout))
    }

    /// Marks the buffer unusable when the launch gate ran out (the peers' flags are then in an
    /// unknown state, as after a timeout in a kernel).
    pub(super) fn poison_on_gate_timeout(&mut self, r: Result<(), EpError>) -> Result<(), EpError> {
        if let Err(e @ EpError::SharedGpuTimeout { .. }) = &r {
            self.poisoned = Some(e.to_string());
        }
        r
    }

    /// Queues a kernel that keeps the stream busy for `duration` (benchmarks queue timed work
    /// behind it so the host's launch rate does not show).
    pub fn sleep_on_stream(&self, duration: Duration) -> Result<(), EpError> {
        let p = k::LlSleepParams {
            ns: duration.as_nanos().min(u64::MAX as u128) as u64,
        };
        // SAFETY: ep_ll_sleep takes one by-value LlSleepParams (its #[repr(C)] mirror) and
        // touches no memory.
        unsafe { launch_with_params(&self.stream, &self.sleep_fn, 1, 32, 0, &p) }.map_err(
            |source| EpError::Cuda {
                rank: self.rank,
                call: "cuLaunchKernel(ep_ll_sleep)",
                source,
            },
        )
    }

    /// Turns a recorded device error into an `Err` (and marks the buffer unusable).
    pub(super) fn check_device_error(&mut self) -> Result<(), EpError> {
        let Some(word) = self.mapped.read_error(ERROR_OFFSET) else {
            // Every protocol status is checked in the kernels, so a QP failure comes with a code;
            // the records are read anyway (host memory, cheap).
            if let Some((peer, e)) = self.transport.as_ref().and_then(|t| t.first_failure(None)) {
                let err = EpError::Transport {
                    rank: self.rank,
                    peer: Some(peer),
                    what: format!(
                        "mode {}: the QP group recorded a failure",
                        self.nic_handler().map_or("?", NicHandler::name)
                    ),
                    source: Some(Box::new(e)),
                };
                self.poisoned = Some(err.to_string());
                return Err(err);
            }
            return Ok(());
        };
        let record = (word.code == k::error_code::TRANSPORT)
            .then(|| {
                self.transport
                    .as_ref()
                    .and_then(|t| t.first_failure(Some(word.peer as usize)))
            })
            .flatten();
        let err = device_error(
            &DeviceErrorContext {
                rank: self.rank,
                num_experts: self.opts.num_experts,
                calls: self.calls,
                timeout: self.opts.timeout,
                mode: self.nic_handler().map(NicHandler::name),
            },
            &word,
            record,
        );
        self.poisoned = Some(err.to_string());
        Err(err)
    }
}
