//! On a GPU machine: the dma-buf export that GPU memory registration tries first. Needs no NIC.

use std::io::Write as _;

use cudarc::driver::CudaContext;
use ibgda_verbs::cuda::dma_buf_export_supported;

#[test]
fn gpu_dma_buf_export_probe_answers() {
    let found = ibgda_device::cuda::device_count().unwrap_or(0);
    if found < 1 {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED (needs 1 GPUs, found {found}): gpu_dma_buf_export_probe_answers"
        );
        return;
    }
    // The device suite's run.sh reads this line: the test ran a case.
    let _ = writeln!(std::io::stderr(), "gpus: 1 of {found} visible");
    let ctx = CudaContext::new(0).expect("GPU 0");
    let supported = dma_buf_export_supported(&ctx).expect("the probe itself must not fail");
    println!(
        "GPU 0 dma-buf export: {}",
        if supported {
            "supported"
        } else {
            "not supported (peer memory only)"
        }
    );
}
