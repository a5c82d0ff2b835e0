//! Nothing in `ep` links rdma-core: libibverbs and libmlx5 are loaded at run time by
//! `ibgda-verbs`, so a binary (or the Python wheel) built here runs on a machine without them
//! and needs no wheel repair. This test binary reaches the device discovery (`find_real_nic`),
//! then checks its own ELF dynamic section for rdma-core's libraries.

use std::process::Command;

#[test]
fn this_binary_needs_no_rdma_core_library() {
    // Reach the real-NIC discovery, so a linked rdma-core would be kept by the linker.
    let _ = ep::transport::find_real_nic();
    let exe = std::env::current_exe().expect("the test binary's path");
    // readelf comes with binutils, which the linker that built this binary belongs to.
    let out = Command::new("readelf")
        .arg("-d")
        .arg(&exe)
        .output()
        .expect("running readelf -d (binutils)");
    assert!(out.status.success(), "readelf -d {} failed", exe.display());
    let dynamic = String::from_utf8_lossy(&out.stdout);
    let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(!needed.is_empty(), "no NEEDED entries parsed:\n{dynamic}");
    for lib in ["libibverbs", "libmlx5", "librdmacm"] {
        assert!(
            needed.iter().all(|l| !l.contains(lib)),
            "{} links {lib}:\n{}",
            exe.display(),
            needed.join("\n")
        );
    }
}
