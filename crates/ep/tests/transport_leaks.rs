//! Create / use / destroy loops of the transport the low-latency buffer builds, in CI (issue 16,
//! item 12, the CPU-visible part of the transport mode; the GPU loops are in `gpu_leaks.rs`):
//! two ranks' emulated NICs (host backend, progress threads), registered arenas, QP groups both
//! ways in modes `gpu` and `cpu_host_memory` (the latter with its proxy thread), a put and a
//! fenced remote add each way checked, then everything shut down and dropped. Every tenth cycle
//! instead fails one WQE by the fault plan first (an error CQE, the QPs in error), so teardown
//! after a failure is in the loop too. 300 cycles (each starts and stops four threads: progress
//! threads and proxies; the NIC-only loops of `ibgda-emu/tests/host_leaks.rs` run 1000); host RSS
//! must come back to where it was after a warm-up, within the slack below (printed either way).

use std::time::{Duration, Instant};

use ep::transport::{EmuRank, QpGroupConfig};
use ibgda_device::qp_desc::{ErrorKind, NicHandler};
use ibgda_device::wire::{syndrome, RemoteAddr};
use ibgda_emu::{Fabric, FaultPlan};

const CYCLES: usize = 300;
const WARMUP: usize = 30;
/// RSS growth allowed over the loop: allocator caches the C runtime keeps. One cycle's rings,
/// CQs, arenas and descriptors are about 50 KiB, so leaking them all over 300 cycles is about
/// twice the slack.
const SLACK_KIB: u64 = 8 * 1024;
const BYTES: usize = 4096;

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("resident pages in statm");
    pages * 4 // x86-64 Linux pages
}

/// One cycle: build both ranks, move a row and a count each way (or fail one WQE), tear down.
fn cycle(i: usize) {
    let mode = if i % 2 == 0 {
        NicHandler::Gpu
    } else {
        NicHandler::CpuHostMemory
    };
    let faulted = i % 10 == 9;
    let fabric = Fabric::new();
    let ranks: Vec<EmuRank> = (0..2)
        .map(|r| EmuRank::host(&fabric, r).expect("host NIC"))
        .collect();
    let arenas: Vec<_> = ranks
        .iter()
        .map(|r| r.arena(BYTES).expect("arena"))
        .collect();
    // The error CQE of a faulted cycle arrives in microseconds; the bound only has to outlast a
    // NIC thread starved of the CPU (one such cycle timed out at 200 ms on a loaded 2-core
    // machine instead of reporting its CQE).
    let bound = if faulted {
        Duration::from_secs(3)
    } else {
        Duration::from_secs(10)
    };
    let groups: Vec<_> = (0..2)
        .map(|r| {
            let cfg = QpGroupConfig {
                handler: mode,
                nqps: 2,
                nwqes: 64,
                timeout: bound,
                peer_rank: 1 - r as u32,
                ..Default::default()
            };
            ranks[r]
                .connect(&ranks[1 - r], &arenas[r], &cfg)
                .expect("QP group")
        })
        .collect();
    if faulted {
        let q = groups[0].qpn(1);
        groups[0]
            .nic()
            .set_fault_plan(FaultPlan::default().fail_wqe(q, 1, syndrome::REMOTE_ACCESS_ERR));
    }
    for r in 0..2 {
        let (me, peer) = (&arenas[r], &arenas[1 - r]);
        let row: Vec<u8> = (0..256).map(|k| (k + i + r) as u8).collect();
        me.host().unwrap().write(0, &row);
        let qp = &groups[r].host_qps()[1];
        let at = |off: u64| RemoteAddr {
            addr: peer.addr() + off,
            rkey: peer.mr().rkey,
        };
        let sent = qp
            .put(at(1024), me.addr(), 256, false)
            .and_then(|_| qp.signal_add(at(2048), i as u64 + 1, true, true))
            .and_then(|_| qp.quiet());
        match (faulted && r == 0, sent) {
            (false, Ok(_)) => {
                let dst = peer.host().unwrap();
                assert_eq!(dst.read_vec(1024, 256), row, "cycle {i} rank {r}: row");
                assert_eq!(
                    dst.load_u64(2048),
                    i as u64 + 1,
                    "cycle {i} rank {r}: count"
                );
            }
            (true, Err(e)) => {
                assert_eq!(e.kind(), Some(ErrorKind::Cqe), "cycle {i}: {e}");
                let msg = groups[0].check().unwrap_err().to_string();
                assert!(
                    msg.contains("REMOTE_ACCESS_ERR") && msg.contains("QP 1"),
                    "cycle {i}: {msg}"
                );
            }
            (f, r) => panic!("cycle {i} mode {mode:?} faulted={f}: {r:?}"),
        }
    }
    for (r, g) in groups.into_iter().enumerate() {
        let shut = g.shutdown();
        if !(faulted && r == 0) {
            shut.unwrap_or_else(|e| panic!("cycle {i} rank {r}: shutdown: {e}"));
        }
    }
}

#[test]
fn transport_groups_do_not_leak_over_300_cycles_in_both_modes_with_faults() {
    for i in 0..WARMUP {
        cycle(i);
    }
    let before = rss_kib();
    let t0 = Instant::now();
    for i in WARMUP..WARMUP + CYCLES {
        cycle(i);
    }
    let after = rss_kib();
    eprintln!(
        "{CYCLES} cycles (modes gpu / cpu_host_memory alternating, every tenth with an error \
         CQE) in {:.1} s: RSS {before} KiB -> {after} KiB (slack {SLACK_KIB} KiB)",
        t0.elapsed().as_secs_f64()
    );
    assert!(
        after <= before + SLACK_KIB,
        "RSS grew by {} KiB over {CYCLES} cycles (slack {SLACK_KIB} KiB)",
        after.saturating_sub(before)
    );
}
