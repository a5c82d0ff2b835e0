//! `ibgda_info`: lists RDMA devices, their ports and GIDs, and the capabilities GPU-initiated
//! RDMA depends on (DEVX, CQE version, BlueFlame register size, extended atomics, ...), plus the
//! GPU side (CUDA driver, GDRCopy), then the preflight (`ep::preflight`): which NIC-handler modes
//! can run here on a real and on the emulated NIC, and for each that cannot, why and the fix.
//! With no RDMA device it says so, with a hint, and exits 0.
//!
//! Usage: `ibgda_info [DEVICE]` (all devices when no name is given).

use std::process::ExitCode;

use ibgda_verbs::prm::{AtomicCaps, GeneralCaps};
use ibgda_verbs::{
    format_gid, list_devices, no_device_hint, preferred_roce_gid, Capabilities, Context,
    DeviceInfo, GidType, LinkLayer, PortState,
};

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let only = std::env::args().nth(1);
    if matches!(only.as_deref(), Some("-h" | "--help")) {
        println!("usage: ibgda_info [DEVICE]\nLists RDMA devices and the capabilities GPU-initiated RDMA needs.");
        return ExitCode::SUCCESS;
    }
    println!("ibgda_info: RDMA devices and what GPU-initiated RDMA needs from them\n");
    let devices = match list_devices() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: listing RDMA devices: {e}");
            return ExitCode::FAILURE;
        }
    };
    let shown: Vec<&DeviceInfo> = devices
        .iter()
        .filter(|d| only.as_deref().is_none_or(|n| n == d.name))
        .collect();
    if devices.is_empty() {
        println!("RDMA devices: none");
        println!("  {}", no_device_hint());
    } else if shown.is_empty() {
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        println!(
            "no device named {:?}; present: {}",
            only.unwrap_or_default(),
            names.join(", ")
        );
    } else {
        println!("RDMA devices: {}", devices.len());
        for d in shown {
            println!();
            show_device(d);
        }
    }
    println!();
    show_gpu_side();
    println!();
    print!("{}", ep::preflight());
    ExitCode::SUCCESS
}

fn part_name(vendor: u32, part: u32) -> &'static str {
    if vendor != 0x02c9 {
        return "";
    }
    match part {
        0x1017 => " (ConnectX-5)",
        0x1019 => " (ConnectX-5 Ex)",
        0x101b => " (ConnectX-6)",
        0x101d => " (ConnectX-6 Dx)",
        0x101f => " (ConnectX-6 Lx)",
        0x1021 => " (ConnectX-7)",
        0x1023 => " (ConnectX-8)",
        _ => "",
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn show_device(d: &DeviceInfo) {
    println!("{}  guid {:#018x}  mlx5 {}", d.name, d.guid, yes(d.mlx5));
    let ctx = match Context::open(&d.name) {
        Ok(c) => c,
        Err(e) => {
            println!("  cannot open: {e}");
            return;
        }
    };
    let caps = match ctx.capabilities() {
        Ok(c) => c,
        Err(e) => {
            println!("  cannot query: {e}");
            return;
        }
    };
    show_caps(&caps);
    let mut missing = readiness(d, &caps);
    let mut active_port = false;
    for port in 1..=caps.device.phys_port_cnt {
        match ctx.port(port) {
            Ok(p) => {
                active_port |= p.state == PortState::Active;
                let layer = match p.link_layer {
                    LinkLayer::Ethernet => "Ethernet (RoCE, GID addressing)",
                    LinkLayer::InfiniBand => "InfiniBand (LID addressing)",
                    LinkLayer::Unspecified => "unspecified link layer",
                };
                let mtu = |code: u32| {
                    ibgda_verbs::prm::Mtu::from_code(code)
                        .map(|m| m.bytes())
                        .unwrap_or(0)
                };
                println!(
                    "  port {port}: {:?}, {layer}, lid {}, mtu {} (max {}), {} GID slots",
                    p.state,
                    p.lid,
                    mtu(p.active_mtu),
                    mtu(p.max_mtu),
                    p.gid_tbl_len
                );
                match ctx.gids(port) {
                    Ok(gids) => {
                        let pick = if p.link_layer.is_roce() {
                            preferred_roce_gid(&gids).map(|g| g.index)
                        } else {
                            None
                        };
                        for g in &gids {
                            let kind = match g.kind {
                                GidType::Ib => "IB",
                                GidType::RoceV1 => "RoCE v1",
                                GidType::RoceV2 => "RoCE v2",
                                GidType::Unknown => "type unknown",
                            };
                            let mark = if Some(g.index) == pick {
                                "  <- used for RoCE"
                            } else {
                                ""
                            };
                            println!("    gid[{}] {} {kind}{mark}", g.index, format_gid(&g.gid));
                        }
                    }
                    Err(e) => println!("    GIDs: {e}"),
                }
            }
            Err(e) => println!("  port {port}: {e}"),
        }
    }
    if !active_port {
        missing.push("an ACTIVE port".into());
    }
    if missing.is_empty() {
        println!("  IBGDA: ready (GPU doorbells additionally need PeerMappingOverride=1 in the NVIDIA driver)");
    } else {
        println!("  IBGDA: not usable, missing {}", missing.join("; "));
    }
}

fn show_caps(c: &Capabilities) {
    let a = &c.device;
    println!(
        "  firmware {}, vendor {:#06x} part {:#06x}{}, hw rev {}",
        a.fw_ver,
        a.vendor_id,
        a.vendor_part_id,
        part_name(a.vendor_id, a.vendor_part_id),
        a.hw_ver
    );
    println!(
        "  verbs limits: {} ports, max_qp {}, max_qp_wr {}, max_cq {}, max_cqe {}, max_mr_size {:#x}, rd_atom {}/{}, atomic_cap {:?}",
        a.phys_port_cnt, a.max_qp, a.max_qp_wr, a.max_cq, a.max_cqe, a.max_mr_size, a.max_qp_rd_atom, a.max_qp_init_rd_atom, a.atomic_cap
    );
    match c.dv {
        Some(dv) => println!(
            "  mlx5dv: cqe_version {} (flags {:#x})",
            dv.cqe_version, dv.flags
        ),
        None => println!("  mlx5dv: not available"),
    }
    match &c.devx_unavailable {
        None => println!("  DEVX: yes"),
        Some(why) => println!("  DEVX: no ({why})"),
    }
    if let Some(g) = &c.general {
        show_general(g);
    }
    match &c.atomic {
        Some(at) => show_atomic(at),
        None if c.devx => println!("  atomics (HCA caps): not reported"),
        None => {}
    }
}

fn show_general(g: &GeneralCaps) {
    println!(
        "  HCA caps: cqe_version {}, log_bf_reg_size {} (BlueFlame {}), uar_4k {}, port_type {}, RC {}, RoCE {}",
        g.cqe_version,
        g.log_bf_reg_size,
        yes(g.bf),
        yes(g.uar_4k),
        if g.port_type == 1 { "Ethernet" } else { "InfiniBand" },
        yes(g.rc),
        yes(g.roce)
    );
    println!(
        "            log_max_qp_sz {}, log_max_cq_sz {}, log_max_msg {}, CQ overrun-ignore {}, ts_format sq {} -> {:?}, umem {} (log max {})",
        g.log_max_qp_sz,
        g.log_max_cq_sz,
        g.log_max_msg,
        yes(g.cq_oi),
        g.sq_ts_format,
        g.qp_ts_format(),
        yes(g.log_max_umem > 0),
        g.log_max_umem
    );
}

fn show_atomic(a: &AtomicCaps) {
    println!(
        "  atomics: standard {}, extended/masked {}, operations {:#06x}, sizes(QP) {:#06x}, 8-byte replies {}, QP atomic_mode {:?}",
        yes(a.standard()),
        yes(a.extended()),
        a.operations,
        a.size_qp,
        if a.req_8b_endianness_mode == 1 { "host order" } else { "big-endian" },
        a.qp_atomic_mode()
    );
}

/// What this device lacks for the IBGDA path.
fn readiness(d: &DeviceInfo, c: &Capabilities) -> Vec<String> {
    let mut missing = Vec::new();
    if !d.mlx5 {
        missing.push("an mlx5 (ConnectX) device".into());
        return missing;
    }
    if let Some(why) = &c.devx_unavailable {
        missing.push(format!("DEVX ({why})"));
        return missing;
    }
    match &c.general {
        None => missing.push("readable HCA capabilities".into()),
        Some(g) => {
            if !g.rc {
                missing.push("RC transport".into());
            }
            if !g.cq_oi {
                missing.push("CQ overrun-ignore".into());
            }
        }
    }
    if !c.atomic.is_some_and(|a| a.extended()) {
        missing.push("extended (masked) 8-byte atomics".into());
    }
    missing
}

fn show_gpu_side() {
    println!("GPU side:");
    if ibgda_device::cuda::driver_present() {
        match ibgda_gdr::gpu_count() {
            Ok(n) => {
                println!("  CUDA driver: present, {n} GPU(s)");
                for i in 0..n {
                    let probe = ibgda_device::cuda::context(i)
                        .map_err(|e| e.to_string())
                        .and_then(|ctx| {
                            ibgda_verbs::cuda::dma_buf_export_supported(&ctx)
                                .map_err(|e| e.to_string())
                        });
                    match probe {
                        Ok(true) => println!("  GPU {i}: dma-buf export yes (GPU memory registers without nvidia-peermem)"),
                        Ok(false) => println!("  GPU {i}: dma-buf export no (GPU memory registration needs nvidia-peermem)"),
                        Err(e) => println!("  GPU {i}: dma-buf probe failed: {e}"),
                    }
                }
            }
            Err(e) => println!("  CUDA driver: present but unusable: {e}"),
        }
    } else {
        println!("  CUDA driver: not installed (libcuda.so not found)");
    }
    match ibgda_gdr::Gdr::open() {
        Ok(g) => {
            let v = |v: Option<(i32, i32)>| {
                v.map(|(a, b)| format!("{a}.{b}"))
                    .unwrap_or_else(|| "?".into())
            };
            println!(
                "  GDRCopy: {} {}, gdrdrv {} (NIC handler `cpu` available)",
                g.library(),
                v(g.runtime_version()),
                v(g.driver_version())
            );
        }
        Err(e) => println!("  GDRCopy: unavailable: {e}"),
    }
}
