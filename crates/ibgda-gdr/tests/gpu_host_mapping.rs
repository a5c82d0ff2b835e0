//! On a GPU machine: pinned host memory mapped into the GPU (the `cpu_host_memory` handler's
//! producer slots). The GPU writes through the device pointer and the CPU sees it through
//! `CpuView`; the CPU writes and the GPU reads it back.

use std::io::Write as _;

use cudarc::driver::sys;
use ibgda_gdr::{gpu_count, CpuView, HostMapping};

#[test]
fn gpu_host_mapping_is_coherent_both_ways() {
    let found = gpu_count().unwrap_or(0);
    if found < 1 {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED (needs 1 GPUs, found {found}): gpu_host_mapping_is_coherent_both_ways"
        );
        return;
    }
    // The device suite's run.sh reads this line: the test ran a case.
    let _ = writeln!(std::io::stderr(), "gpus: 1 of {found} visible");
    let m = HostMapping::for_device(0, 1 << 16).expect("pinned host memory");
    assert_ne!(m.device_ptr(), 0);
    assert_eq!(m.read_u64(0), 0, "zeroed on allocation");
    m.context().bind_to_thread().unwrap();

    // GPU → CPU: a device memset through the mapped pointer, then a CPU atomic read.
    // SAFETY: the device pointer maps 64 KiB of live pinned memory; 16 dwords are written.
    let r = unsafe { sys::cuMemsetD32_v2(m.device_ptr() + 4096, 0x5a5a_1234, 16) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: context bound above.
    let r = unsafe { sys::cuCtxSynchronize() };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert_eq!(m.read_u64(4096), 0x5a5a_1234_5a5a_1234);

    // CPU → GPU: a CPU release store, then a copy the GPU performs from the mapped pointer.
    m.write_u64(8192, 0x0123_4567_89ab_cdef);
    let mut back = 0u64;
    // SAFETY: reads 8 bytes of the mapping through its device pointer into a local.
    let r =
        unsafe { sys::cuMemcpyDtoH_v2((&mut back as *mut u64).cast(), m.device_ptr() + 8192, 8) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert_eq!(back, 0x0123_4567_89ab_cdef);
}
