//! Low-latency dispatch/combine with NVLink disabled, every byte to another rank through QPs
//! built by the real-NIC code path (`ep::transport::VerbsTransport`: `ibgda-verbs` objects, PRM
//! firmware commands) on the emulated NIC's firmware (`NicChoice::EmulatedVerbs`), ranks as
//! threads, in NIC-handler modes `gpu`, `cpu_host_memory` and `cpu`, against the CPU reference.
//! The rings and CQs are GPU memory registered as umems, the registrations GPU memory, the UAR
//! pages mapped into the GPU in mode `gpu`; mode `cpu`'s producer slots are GPU memory, read by
//! the proxy through GDRCopy or, without it, the emulated GDR view.

mod gpu_low_latency_common;

use std::sync::Arc;

use cudarc::driver::CudaContext;
use ep::low_latency::{Fp8Options, LowLatencyBuffer};
use ep::transport::NicChoice;
use ep_kernels::testing::{rank_gpus, seed, Rng};
use gpu_low_latency_common::{
    check, on_ranks, random_data, run_case, transport_options, Case, RankResult, TRANSPORT_MODES,
};
use ibgda_device::protocol::HandlerChoice;
use ibgda_device::qp_desc::NicHandler;

const RANK_COUNTS: [usize; 2] = [2, 4];

fn cases() -> Vec<Case> {
    vec![
        Case {
            hidden: 2048,
            topk: 1,
            fp8: None,
            hook: false,
            zero_copy: false,
        },
        Case {
            hidden: 7168,
            topk: 8,
            fp8: None,
            hook: true,
            zero_copy: true,
        },
        Case {
            hidden: 7168,
            topk: 8,
            fp8: Some(Fp8Options::default()),
            hook: false,
            zero_copy: false,
        },
    ]
}

fn group(ctxs: &[Arc<CudaContext>], mode: (HandlerChoice, NicHandler)) -> Vec<LowLatencyBuffer> {
    let (asked, runs) = mode;
    let mut o = transport_options(ctxs.len(), asked);
    o.nic = NicChoice::EmulatedVerbs;
    let bufs = LowLatencyBuffer::create_group(ctxs, &o).unwrap_or_else(|e| {
        panic!(
            "creating the buffers over the verbs path, mode {}: {e}",
            runs.name()
        )
    });
    for b in &bufs {
        assert_eq!(b.nic_handler(), Some(runs), "rank {}", b.rank());
    }
    bufs
}

#[test]
fn verbs_path_on_the_emulated_firmware_matches_reference_in_every_mode() {
    let mut rng = Rng::new(seed());
    for ranks in RANK_COUNTS {
        let Some(ctxs) = rank_gpus(ranks) else { return };
        for mode in TRANSPORT_MODES {
            let name = mode.1.name();
            let mut bufs = group(&ctxs, mode);
            for c in cases() {
                let data = random_data(&mut rng, ranks, c.hidden, c.topk, None);
                let res: Vec<RankResult> = on_ranks(&mut bufs, |b| {
                    let r = b.rank();
                    run_case(b, &data[r], &c)
                        .unwrap_or_else(|e| panic!("rank {r}, mode {name}: {e}"))
                });
                check(
                    ranks,
                    &c,
                    &data,
                    &res,
                    &format!("EP{ranks} verbs path mode {name} {c:?}"),
                );
            }
            std::thread::scope(|s| {
                for b in bufs {
                    s.spawn(move || b.shutdown().expect("shutdown"));
                }
            });
            eprintln!(
                "EP{ranks} verbs path mode {name}: {} cases passed",
                cases().len()
            );
        }
    }
}

#[test]
fn nic_real_without_an_mlx5_device_fails_before_any_collective_with_the_preflights_reason() {
    let Some(ctxs) = rank_gpus(2) else { return };
    let missing = match ep::preflight::real_nic() {
        Ok(dev) => {
            eprintln!("an mlx5 device is present ({dev}): nothing to refuse here");
            return;
        }
        Err(m) => m,
    };
    let mut o = transport_options(2, HandlerChoice::Auto);
    o.nic = NicChoice::Real;
    let e = match LowLatencyBuffer::create_group(&ctxs, &o) {
        Ok(_) => panic!("NicChoice::Real built buffers with no mlx5 device"),
        Err(e) => e,
    };
    let text = format!(
        "{e}: {}",
        std::error::Error::source(&e).map_or(String::new(), |s| s.to_string())
    );
    assert!(
        text.contains("no usable mlx5 NIC") && text.contains(&missing.why),
        "{text}"
    );
    eprintln!("refused as expected: {text}");
}
