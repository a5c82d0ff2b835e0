//! The host model against a minimal loopback NIC (a test double: the real emulator lives in
//! `ibgda-emu`, which depends on this crate; `ep/tests/protocol_cpu.rs` runs the model against
//! it). The NIC thread reads the doorbell register word, executes NOPs, RDMA writes, inline writes
//! and fetch-adds in host memory, checks that every WQE it reads carries the index it expects (a
//! slot rewritten before completion would not), and writes CQEs, optionally late or as an error.

use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytemuck::Zeroable;

use super::*;
use crate::proxy::{Mlx5UarDoorbell, ProducerSlot, Proxy, ProxyConfig, ProxyQp};
use crate::qp_desc::{ErrorKind, ErrorRecord, NicHandler, QpDesc};
use crate::wire::{
    cqe_owner_bit, opcode, parse_db_word, parse_wqe, syndrome, Cqe64, DoorbellRecord, RemoteAddr,
    WqeBB, WqeOp,
};

/// One QP's memory, all host-resident and 64-byte aligned where the NIC needs it.
struct QpMem {
    desc: Box<QpDesc>,
    ring: Vec<WqeBB>,
    cq: Vec<WqeBB>,
    dbr: Box<DoorbellRecord>,
    uar: Box<AtomicU64>,
    slot: Box<AtomicU64>,
    scratch: Box<AtomicU64>,
}

struct Faults {
    cqe_delay: Duration,
    /// Complete the WQE with this index with a REMOTE_ACCESS_ERR error CQE.
    fail_index: Option<u64>,
}

struct LoopNic {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<u64, String>>>,
}

impl LoopNic {
    fn start(qps: &[Arc<Mutex<QpMem>>], faults: Faults) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        // Raw views of what the NIC touches; the test keeps the memory alive until `finish`.
        struct View {
            desc: QpDesc,
            uar: *const AtomicU64,
        }
        // SAFETY: the pointers stay valid until the NIC thread is joined (`finish`, `Drop`).
        unsafe impl Send for View {}
        let views: Vec<View> = qps
            .iter()
            .map(|q| {
                let q = q.lock().unwrap();
                View {
                    desc: *q.desc,
                    uar: &*q.uar as *const AtomicU64,
                }
            })
            .collect();
        let s = stop.clone();
        let thread = std::thread::spawn(move || -> Result<u64, String> {
            let mut executed = vec![0u64; views.len()];
            let mut cq_pi = vec![0u64; views.len()];
            let mut in_error = vec![false; views.len()];
            let mut total = 0u64;
            loop {
                let stopping = s.load(Ordering::Acquire);
                let mut progressed = false;
                for (k, v) in views.iter().enumerate() {
                    // SAFETY: the UAR word is live (see `View`).
                    let word = unsafe { &*v.uar }.load(Ordering::Acquire);
                    if word == 0 || in_error[k] {
                        continue;
                    }
                    let (qpn, pi16) = parse_db_word(word);
                    if qpn != v.desc.qpn {
                        return Err(format!("doorbell for qpn {qpn:#x} on QP {:#x}", v.desc.qpn));
                    }
                    let pi = executed[k] + u64::from(pi16.wrapping_sub(executed[k] as u16));
                    while executed[k] < pi {
                        let idx = executed[k];
                        let slot = (idx & (u64::from(v.desc.nwqes) - 1)) as usize * 64;
                        // SAFETY: a slot of the live ring; published before the doorbell.
                        let wqe: WqeBB = unsafe {
                            core::ptr::read_volatile(
                                (v.desc.wq_base as *const u8).add(slot) as *const WqeBB
                            )
                        };
                        let p = parse_wqe(wqe.as_bytes()).map_err(|e| e.to_string())?;
                        if p.ctrl.wqe_index != idx as u16 {
                            return Err(format!(
                                "slot of WQE {idx} holds WQE index {}: overwritten",
                                p.ctrl.wqe_index
                            ));
                        }
                        match p.op {
                            WqeOp::Nop => {}
                            WqeOp::RdmaWrite { remote, sges, .. } => {
                                let mut off = 0u64;
                                for sge in sges.iter() {
                                    // SAFETY: host buffers the test registered (live, disjoint).
                                    unsafe {
                                        core::ptr::copy_nonoverlapping(
                                            sge.addr as *const u8,
                                            (remote.addr + off) as *mut u8,
                                            sge.len as usize,
                                        )
                                    };
                                    off += u64::from(sge.len);
                                }
                            }
                            WqeOp::InlineWrite { remote, data, .. } => {
                                // SAFETY: as above.
                                unsafe {
                                    core::ptr::copy_nonoverlapping(
                                        data.as_ptr(),
                                        remote.addr as *mut u8,
                                        data.len(),
                                    )
                                };
                            }
                            WqeOp::FetchAdd64 { remote, fetch, add } => {
                                // SAFETY: 8-byte aligned live words of the test.
                                let old = unsafe { AtomicU64::from_ptr(remote.addr as *mut u64) }
                                    .fetch_add(add, Ordering::AcqRel);
                                // SAFETY: as above.
                                unsafe { AtomicU64::from_ptr(fetch.addr as *mut u64) }
                                    .store(old, Ordering::Relaxed);
                            }
                            other => return Err(format!("unexpected WQE {other:?}")),
                        }
                        let fail = faults.fail_index == Some(idx);
                        if p.cqe_requested() || fail {
                            if !faults.cqe_delay.is_zero() {
                                std::thread::sleep(faults.cqe_delay);
                            }
                            let ci = cq_pi[k];
                            let owner = cqe_owner_bit(ci, v.desc.ncqes);
                            let cqe = if fail {
                                Cqe64::requester_error(
                                    owner,
                                    idx as u16,
                                    qpn,
                                    p.ctrl.opcode,
                                    syndrome::REMOTE_ACCESS_ERR,
                                    0x88,
                                )
                            } else {
                                Cqe64::requester(owner, idx as u16, qpn, p.ctrl.opcode, 0)
                            };
                            let dst = (v.desc.cq_base as *mut Cqe64)
                                .wrapping_add((ci & (u64::from(v.desc.ncqes) - 1)) as usize);
                            let bytes = bytemuck::bytes_of(&cqe);
                            for (i, b) in bytes.iter().enumerate().take(63) {
                                // SAFETY: the live CQ slot; the consumer only reads it once the
                                // owner byte (written last, after a release fence) says so.
                                unsafe { core::ptr::write_volatile((dst as *mut u8).add(i), *b) };
                            }
                            fence(Ordering::Release);
                            // SAFETY: as above.
                            unsafe {
                                core::ptr::write_volatile((dst as *mut u8).add(63), bytes[63])
                            };
                            cq_pi[k] += 1;
                            if fail {
                                // The QP is in error: nothing after it executes.
                                in_error[k] = true;
                                break;
                            }
                        }
                        executed[k] += 1;
                        total += 1;
                        progressed = true;
                    }
                }
                if stopping {
                    return Ok(total);
                }
                if !progressed {
                    std::thread::yield_now();
                }
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Release);
        self.thread
            .take()
            .unwrap()
            .join()
            .unwrap()
            .expect("loopback NIC failed")
    }
}

impl Drop for LoopNic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn qp_mem(
    mode: NicHandler,
    nwqes: u32,
    qp_index: u32,
    err: &ErrorRecord,
    timeout: Duration,
) -> Arc<Mutex<QpMem>> {
    let mut cq = vec![WqeBB::zeroed(); nwqes as usize];
    for b in cq.iter_mut() {
        b.0[63] = crate::wire::cqe_opcode::INVALID << 4;
    }
    let mut m = QpMem {
        desc: Box::new(QpDesc::zeroed()),
        ring: vec![WqeBB::zeroed(); nwqes as usize],
        cq,
        dbr: Box::new(DoorbellRecord::zeroed()),
        uar: Box::new(AtomicU64::new(0)),
        slot: Box::new(AtomicU64::new(0)),
        scratch: Box::new(AtomicU64::new(0)),
    };
    let d = &mut *m.desc;
    d.wq_base = m.ring.as_ptr() as u64;
    d.dbr = &*m.dbr as *const DoorbellRecord as u64;
    d.nwqes = nwqes;
    d.qpn = 0x100 + qp_index;
    d.handler_mode = mode as u32;
    d.lkey = 0x11;
    d.cq_base = m.cq.as_ptr() as u64;
    d.ncqes = nwqes;
    d.rank = 3;
    d.qp_index = qp_index;
    d.timeout_ns = timeout.as_nanos() as u64;
    d.error_record = err as *const ErrorRecord as u64;
    d.scratch = m.scratch.as_ptr() as u64;
    if mode.uses_proxy() {
        d.producer_slot = m.slot.as_ptr() as u64;
    } else {
        d.db_reg = m.uar.as_ptr() as u64;
    }
    Arc::new(Mutex::new(m))
}

/// QPs, their models, the NIC, and in the CPU modes the proxy ringing through the real mlx5
/// doorbell code into the loopback NIC's "UAR" word.
///
/// Fields drop in declaration order: the proxy and the NIC thread stop before the memory they
/// read through raw pointers is freed (a test that panics drops the rig without `finish`).
struct Rig {
    proxy: Option<Proxy>,
    nic: Option<LoopNic>,
    qps: Vec<HostQp>,
    mems: Vec<Arc<Mutex<QpMem>>>,
    err: Box<ErrorRecord>,
}

impl Rig {
    fn new(mode: NicHandler, nqps: u32, nwqes: u32, timeout: Duration, faults: Faults) -> Self {
        let err = Box::new(ErrorRecord::zeroed());
        let mems: Vec<_> = (0..nqps)
            .map(|i| qp_mem(mode, nwqes, i, &err, timeout))
            .collect();
        let qps = mems
            .iter()
            .map(|m| {
                let mut g = m.lock().unwrap();
                // SAFETY: the descriptor and everything it points to live in `mems` and `err`,
                // which the rig keeps until the QPs are dropped.
                unsafe { HostQp::new(&mut *g.desc) }.unwrap()
            })
            .collect();
        let nic = Some(LoopNic::start(&mems, faults));
        let proxy = mode.uses_proxy().then(|| {
            let pqs = mems
                .iter()
                .map(|m| {
                    let mut g = m.lock().unwrap();
                    let qpn = g.desc.qpn;
                    let dbr: *mut DoorbellRecord = &mut *g.dbr;
                    ProxyQp {
                        // SAFETY: the slot lives in `mems` until the proxy is stopped (`finish`).
                        slot: unsafe { ProducerSlot::new(g.slot.as_ptr()) }.unwrap(),
                        // SAFETY: the record and the UAR word live in `mems` as above.
                        doorbell: Box::new(
                            unsafe { Mlx5UarDoorbell::new(dbr, g.uar.as_ptr(), qpn) }.unwrap(),
                        ),
                        rung_from: 0,
                        rank: 3,
                        qp_index: g.desc.qp_index,
                    }
                })
                .collect();
            Proxy::start(
                pqs,
                ProxyConfig {
                    spins_before_yield: 256,
                    ..Default::default()
                },
            )
            .unwrap()
        });
        Self {
            mems,
            qps,
            err,
            nic,
            proxy,
        }
    }

    fn failure(&self) -> Result<(), DeviceFailure> {
        let r = self.err.as_ref() as *const ErrorRecord;
        fence(Ordering::Acquire);
        // SAFETY: the live record; read after the writers' release of `kind` (or not at all).
        check_record(&unsafe { core::ptr::read_volatile(r) }, None)
    }

    fn finish(mut self) -> u64 {
        if let Some(p) = self.proxy.take() {
            p.stop().unwrap();
        }
        let n = self.nic.take().unwrap().finish();
        drop(self.mems);
        n
    }
}

fn buf(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

const MODES: [NicHandler; 2] = [NicHandler::Gpu, NicHandler::CpuHostMemory];

#[test]
fn first_submission_is_seen_and_completes() {
    for mode in MODES {
        let rig = Rig::new(
            mode,
            1,
            64,
            Duration::from_secs(10),
            Faults {
                cqe_delay: Duration::ZERO,
                fail_index: None,
            },
        );
        let src = buf(256, 1);
        let mut dst = vec![0u8; 256];
        let remote = RemoteAddr {
            addr: dst.as_mut_ptr() as u64,
            rkey: 0x22,
        };
        rig.qps[0]
            .put(remote, src.as_ptr() as u64, 256, true)
            .unwrap();
        rig.qps[0].quiet().unwrap();
        assert_eq!(dst, src, "{mode:?}");
        let c = rig.qps[0].counters();
        assert_eq!(
            (c.resv_head, c.ready_head, c.cons_idx),
            (1, 1, 1),
            "{mode:?}"
        );
        rig.failure().unwrap();
        assert_eq!(rig.finish(), 1);
    }
}

#[test]
fn barrier_after_heavy_workload_completes() {
    for mode in MODES {
        let (nqps, threads, iters, len) = (4u32, 6usize, 200u64, 96u64);
        // A small ring, so reservations wait for completions all the time.
        let rig = Rig::new(
            mode,
            nqps,
            16,
            Duration::from_secs(20),
            Faults {
                cqe_delay: Duration::ZERO,
                fail_index: None,
            },
        );
        let src = buf(threads * iters as usize * len as usize, 7);
        let mut dst = vec![0u8; src.len()];
        let dst_addr = dst.as_mut_ptr() as u64;
        std::thread::scope(|s| {
            for t in 0..threads as u64 {
                let (qps, src) = (&rig.qps, &src);
                s.spawn(move || {
                    for i in 0..iters {
                        let q = &qps[((t + i) % u64::from(nqps)) as usize];
                        let off = (t * iters + i) * len;
                        let remote = RemoteAddr {
                            addr: dst_addr + off,
                            rkey: 0x22,
                        };
                        // Batched doorbells: only every 4th put rings.
                        q.put_chunked(remote, src.as_ptr() as u64 + off, len, 40, i % 4 == 3)
                            .unwrap();
                    }
                    for q in qps {
                        q.quiet().unwrap();
                    }
                });
            }
        });
        // The other submitter on the same QPs: a barrier of fenced signal adds.
        let counters: Vec<AtomicU64> = (0..nqps).map(|_| AtomicU64::new(0)).collect();
        for (k, q) in rig.qps.iter().enumerate() {
            let remote = RemoteAddr {
                addr: counters[k].as_ptr() as u64,
                rkey: 0x22,
            };
            q.signal_add(remote, 1, true, true).unwrap();
            q.quiet().unwrap();
        }
        for (k, q) in rig.qps.iter().enumerate() {
            let c = q.counters();
            assert_eq!(c.ready_head, c.resv_head, "{mode:?} QP {k}: {c:?}");
            assert_eq!(c.cons_idx, c.ready_head, "{mode:?} QP {k}: {c:?}");
            assert_eq!(counters[k].load(Ordering::Acquire), 1);
        }
        assert!(dst == src, "{mode:?}: data differs");
        rig.failure().unwrap();
        rig.finish();
    }
}

#[test]
fn lost_reservation_ends_in_a_bounded_ready_timeout() {
    for mode in MODES {
        let bound = Duration::from_millis(200);
        let rig = Rig::new(
            mode,
            1,
            64,
            bound,
            Faults {
                cqe_delay: Duration::ZERO,
                fail_index: None,
            },
        );
        rig.qps[0].nop(true).unwrap();
        // A submitter that reserves and never publishes.
        let lost = rig.qps[0].reserve(2).unwrap();
        assert_eq!(lost.base, 1);
        let t0 = Instant::now();
        let e = rig.qps[0].nop(true).unwrap_err();
        assert!(
            t0.elapsed() < bound * 10,
            "{mode:?}: took {:?}",
            t0.elapsed()
        );
        assert_eq!(e.kind(), Some(ErrorKind::TimeoutReady), "{mode:?}");
        let f = rig.failure().unwrap_err();
        let s = f.to_string();
        for want in ["rank 3", "QP 0", "resv_head=4", "ready_head=1", mode.name()] {
            assert!(s.contains(want), "{want:?} missing from {s}");
        }
        // A later wait cannot succeed (the lost reservation never publishes): it stops on the
        // recorded failure or runs out itself, within the bound, never hangs.
        let t0 = Instant::now();
        let later = rig.qps[0].quiet();
        assert!(
            t0.elapsed() < bound * 10,
            "{mode:?}: a later quiet took {:?}",
            t0.elapsed()
        );
        assert!(later.is_err(), "{mode:?}: a later quiet succeeded");
        rig.finish();
    }
}

#[test]
fn quiet_waits_for_delayed_completions() {
    for mode in MODES {
        let delay = Duration::from_millis(150);
        let rig = Rig::new(
            mode,
            1,
            64,
            Duration::from_secs(10),
            Faults {
                cqe_delay: delay,
                fail_index: None,
            },
        );
        let src = buf(64, 3);
        let mut dst = vec![0u8; 64];
        let remote = RemoteAddr {
            addr: dst.as_mut_ptr() as u64,
            rkey: 0x22,
        };
        let t0 = Instant::now();
        rig.qps[0]
            .put(remote, src.as_ptr() as u64, 64, false)
            .unwrap();
        rig.qps[0].quiet().unwrap();
        assert!(
            t0.elapsed() >= delay,
            "{mode:?}: quiet returned after {:?}",
            t0.elapsed()
        );
        assert_eq!(rig.qps[0].counters().cons_idx, 1);
        assert_eq!(dst, src);
        rig.finish();
    }
}

#[test]
fn error_cqe_is_reported_with_its_syndrome() {
    for mode in MODES {
        let rig = Rig::new(
            mode,
            1,
            64,
            Duration::from_secs(10),
            Faults {
                cqe_delay: Duration::ZERO,
                fail_index: Some(2),
            },
        );
        for _ in 0..3 {
            rig.qps[0].nop(false).unwrap();
        }
        let e = rig.qps[0].quiet().unwrap_err();
        assert_eq!(e.kind(), Some(ErrorKind::Cqe), "{mode:?}");
        let f = rig.failure().unwrap_err();
        assert_eq!(f.record.wqe_counter, 2);
        assert!(f.to_string().contains("REMOTE_ACCESS_ERR"), "{f}");
        assert_eq!(f.record.wqe_opcode, opcode::NOP);
        // Sticky: every later wait on the QP fails too.
        assert!(rig.qps[0].quiet().is_err());
        rig.finish();
    }
}

#[test]
fn bad_descriptors_are_refused() {
    let err = ErrorRecord::zeroed();
    let m = qp_mem(
        NicHandler::CpuHostMemory,
        64,
        0,
        &err,
        Duration::from_secs(1),
    );
    let mut g = m.lock().unwrap();
    g.desc.producer_slot += 4;
    // SAFETY: never driven: construction fails on the misaligned slot.
    assert!(unsafe { HostQp::new(&mut *g.desc) }.is_err());
    g.desc.producer_slot -= 4;
    g.desc.nwqes = 48;
    // SAFETY: as above.
    assert!(unsafe { HostQp::new(&mut *g.desc) }.is_err());
}

/// The CPU modes raise the producer slot with a plain store while holding the publish turn, and
/// flushes (quiet, batched publishes) raise it with a max. Many submitters mixing ringing and
/// batched publishes with quiets on one QP, while a watcher samples the slot: it must never go
/// backwards (a publish the proxy could miss), and in the end it equals `ready_head`.
#[test]
fn producer_slot_never_goes_backwards() {
    let (threads, iters) = (6u64, 2000u64);
    let rig = Rig::new(
        NicHandler::CpuHostMemory,
        1,
        64,
        Duration::from_secs(20),
        Faults {
            cqe_delay: Duration::ZERO,
            fail_index: None,
        },
    );
    let slot: *const AtomicU64 = {
        let g = rig.mems[0].lock().unwrap();
        &*g.slot
    };
    struct SlotView(*const AtomicU64);
    // SAFETY: the slot lives in `rig.mems` until `rig.finish()`, after the scope joins the watcher.
    unsafe impl Send for SlotView {}
    let view = SlotView(slot);
    let done = AtomicBool::new(false);
    let (samples, backwards) = std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let view = view;
            // SAFETY: see SlotView; only loaded atomically.
            let slot = unsafe { &*view.0 };
            let (mut last, mut n, mut back) = (0u64, 0u64, Vec::new());
            while !done.load(Ordering::Acquire) {
                let v = slot.load(Ordering::Acquire);
                if v < last && back.len() < 8 {
                    back.push((last, v));
                }
                last = last.max(v);
                n += 1;
            }
            (n, back)
        });
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let q = &rig.qps[0];
                s.spawn(move || -> Step {
                    for i in 0..iters {
                        // Every third publish is batched; every 97th iteration quiets.
                        q.nop((t + i) % 3 != 0)?;
                        if i % 97 == t {
                            q.quiet()?;
                        }
                    }
                    q.quiet()
                })
            })
            .collect();
        // Every worker ends (a failed wait is bounded) before the watcher is stopped.
        let results: Vec<Step> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        done.store(true, Ordering::Release);
        let watched = watcher.join().unwrap();
        for r in results {
            r.unwrap_or_else(|e| panic!("submitter stopped ({e:?}): {:?}", rig.failure()));
        }
        watched
    });
    assert!(
        backwards.is_empty(),
        "the slot went backwards (seen max, then read): {backwards:?}"
    );
    assert!(samples > 0);
    let c = rig.qps[0].counters();
    assert_eq!(c.ready_head, threads * iters);
    // SAFETY: as for the watcher; every submitter has finished.
    assert_eq!(unsafe { &*slot }.load(Ordering::Acquire), c.ready_head);
    rig.failure().unwrap();
    rig.finish();
}
