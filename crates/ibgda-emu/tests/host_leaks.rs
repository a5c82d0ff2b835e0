//! Create / use / destroy loops on the host backend (issue 16, item 12, the CPU-visible part):
//! emulated NICs with a connected QP pair, an RDMA write and a fetch-add through them, then
//! everything dropped, 1000 times with manual progress and 200 times with the NICs' own progress
//! threads; host RSS must come back to where it was after a warm-up, within a stated slack.

mod common;

use common::{Pair, ARENA};
use ibgda_device::wire::{cqe_opcode, FetchAdd64, LocalAddr, RdmaWrite, RemoteAddr, Sge};
use ibgda_emu::{Access, CqMode, Mr};

/// RSS growth allowed over a loop: allocator caches and thread stacks the C runtime keeps,
/// far below what a leak of one pair per cycle would cost (two NICs, rings, two 8 KiB arenas).
const SLACK_KIB: u64 = 8 * 1024;

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("resident pages in statm");
    pages * 4 // 4 KiB pages on the machines this runs on (x86-64 Linux)
}

fn ra(m: &Mr, off: u64) -> RemoteAddr {
    RemoteAddr {
        addr: m.addr + off,
        rkey: m.rkey,
    }
}

/// One cycle: two NICs, a QP pair, a 4 KiB write and a fetch-add, checked; then all dropped.
fn cycle(manual: bool, i: u64) {
    let mut p = Pair::new(manual, 64, CqMode::Ring, 64);
    let q = p.qpn();
    let lm = p.local(0, ARENA, Access::LOCAL_WRITE);
    let rm = p.remote(0, ARENA, Access::REMOTE_WRITE | Access::REMOTE_ATOMIC);
    p.la.write(0, &vec![(i % 251) as u8; 4096]);
    p.ra.store_u64(4096, 5);
    let sge = Sge {
        addr: lm.addr,
        len: 4096,
        lkey: lm.lkey,
    };
    p.post(RdmaWrite::new(q, 0, ra(&rm, 0), sge).build());
    let fetched = LocalAddr {
        addr: lm.addr + 4096,
        lkey: lm.lkey,
    };
    p.post(
        FetchAdd64::new(q, 1, ra(&rm, 4096), fetched, i + 1)
            .cqe(true)
            .build(),
    );
    p.run();
    let cqes = p.cqes();
    assert_eq!(cqes.len(), 1, "cycle {i}: {cqes:?}");
    assert_eq!(cqes[0].opcode(), cqe_opcode::REQ, "cycle {i}: {}", cqes[0]);
    let got = p.ra.read_vec(0, 4096);
    assert!(
        got.iter().all(|&b| b == (i % 251) as u8),
        "cycle {i}: write"
    );
    assert_eq!(p.ra.load_u64(4096), 5 + i + 1, "cycle {i}: fetch-add");
    assert_eq!(p.la.load_u64(4096), 5, "cycle {i}: fetched value");
}

/// RSS is the process's: the loops run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn no_growth(manual: bool, cycles: u64) {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for i in 0..20 {
        cycle(manual, i);
    }
    let before = rss_kib();
    for i in 0..cycles {
        cycle(manual, i);
    }
    let after = rss_kib();
    eprintln!(
        "{cycles} cycles ({}): RSS {before} KiB -> {after} KiB",
        if manual {
            "manual progress"
        } else {
            "progress threads"
        }
    );
    assert!(
        after <= before + SLACK_KIB,
        "RSS grew by {} KiB over {cycles} cycles (slack {SLACK_KIB} KiB)",
        after.saturating_sub(before)
    );
}

#[test]
fn nics_with_manual_progress_do_not_leak_over_1000_cycles() {
    no_growth(true, 1000);
}

#[test]
fn nics_with_progress_threads_do_not_leak_over_200_cycles() {
    no_growth(false, 200);
}
