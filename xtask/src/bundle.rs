//! `cargo xtask device-bundle`: everything the device machine needs to run the GPU suite with no
//! cargo there: release builds of the GPU tests (integration tests named `gpu_*`) and the example
//! binaries, the shared libraries they load that the device image lacks, and `run.sh`.

use crate::util::{self, root, step};
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The bundle must travel with the working tree, which may be at most 64 MiB.
const MAX_BUNDLE_BYTES: u64 = 60 << 20;

/// The bundle as it travels: `bundle/` in one xz-compressed tar beside it. The binaries embed the
/// same fatbins and runtime, so xz takes 66 MiB to under 9 (measured 2026-12-02).
pub const PACKED: &str = "bundle.tar.xz";

/// The command that unpacks [`PACKED`] on the device machine (tar with xz where present, Python's
/// lzma otherwise).
pub const UNPACK: &str = "(tar -xJf bundle.tar.xz 2>/dev/null || python3 -c \"import tarfile; tarfile.open('bundle.tar.xz').extractall()\")";

/// Packs `dir` into [`PACKED`] beside it and returns the archive's size in bytes.
fn pack(dir: &Path) -> Result<u64> {
    let parent = dir.parent().context("the bundle directory has a parent")?;
    let archive = parent.join(PACKED);
    step(&format!(
        "packing {} into {}",
        dir.display(),
        archive.display()
    ));
    let mut cmd = Command::new("tar");
    cmd.current_dir(parent)
        .env("XZ_OPT", "-6 -T0")
        .args(["-cJf", PACKED])
        .arg(dir.file_name().context("the bundle directory has a name")?);
    util::run(&mut cmd)?;
    Ok(std::fs::metadata(&archive)?.len())
}

/// Example binaries run as smoke tests by `run.sh`, with their arguments.
const SMOKE_EXAMPLES: &[(&str, &str)] = &[
    ("ibgda_info", ""),
    ("dispatch_combine", ""),
    ("dispatch_combine", "--procs"),
    ("dispatch_combine", "--ranks 4"),
    ("dispatch_combine", "--procs --ranks 2"),
    ("low_latency", "--ranks 4"),
    (
        "low_latency",
        "--ranks 2 --no-nvlink --handler cpu_host_memory",
    ),
    ("internode", ""),
    ("internode", "--nodes 2 --ranks-per-node 4 --fp8"),
    (
        "internode",
        "--nodes 4 --ranks-per-node 2 --handler cpu_host_memory",
    ),
    ("internode", "--nodes 2 --ranks-per-node 2 --handler cpu"),
    (
        "internode",
        "--procs --nodes 2 --ranks-per-node 2 --tokens 256 --hidden 2048",
    ),
];

/// Libraries every Linux system has (glibc and the C++ runtime): never bundled.
const SYSTEM_LIBS: &[&str] = &[
    "linux-vdso",
    "ld-linux",
    "libc.so",
    "libm.so",
    "libgcc_s",
    "libpthread",
    "libdl.so",
    "librt.so",
    "libstdc++",
];

/// Builds the bundle in `bundle/`: the Rust GPU suite, and the Python package's wheel and GPU
/// tests in `bundle/python/` when they fit under the size limit too (else said loudly);
/// `--python`: the Python part alone (no Rust builds; a bundle of a few MiB).
pub fn run(args: &[String]) -> Result<()> {
    let kernels = crate::kernels::build_kernels(false)?;
    let dir = root().join("bundle");
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let _ = std::fs::remove_file(root().join(PACKED));
    if args.iter().any(|a| a == "--python") {
        crate::python::bundle(&dir.join("python"))?;
        let size = dir_size(&dir)?;
        let packed = pack(&dir)?;
        step(&format!(
            "bundle ready: {} (the Python package only, {:.1} MiB; packed {:.1} MiB)\n    run it there with (carry: [\"{PACKED}\"]): {UNPACK} && bash bundle/python/run.sh",
            dir.display(),
            size as f64 / (1 << 20) as f64,
            packed as f64 / (1 << 20) as f64
        ));
        return Ok(());
    }
    for sub in ["tests", "bin", "lib"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }

    step("building GPU tests (release)");
    let tests = cargo_executables(
        &["test", "--workspace", "--release", "--no-run"],
        |kind, name| kind == "test" && name.starts_with("gpu_"),
    )?;
    step("building examples (release)");
    let bins = cargo_executables(
        &["build", "--release", "-p", "ep-examples", "--bins"],
        |kind, _| kind == "bin",
    )?;

    let mut copied = Vec::new();
    for (name, exe) in &tests {
        copied.push(copy(exe, &dir.join("tests").join(name))?);
    }
    for (name, exe) in &bins {
        copied.push(copy(exe, &dir.join("bin").join(name))?);
    }
    step("collecting shared libraries");
    for (soname, path) in shared_libs(&copied)? {
        std::fs::copy(&path, dir.join("lib").join(&soname))
            .with_context(|| format!("copying {}", path.display()))?;
        eprintln!("   {soname} ({})", path.display());
    }
    let smoke: String = SMOKE_EXAMPLES
        .iter()
        .filter(|(n, _)| bins.iter().any(|(b, _)| b == n))
        .map(|(n, a)| format!("{n}|{a}\n"))
        .collect();
    std::fs::write(dir.join("examples.txt"), smoke)?;
    std::fs::write(dir.join("run.sh"), include_str!("run.sh"))?;
    // The fatbins are embedded in the binaries; a copy beside them documents what was built.
    std::fs::write(
        dir.join("kernels.txt"),
        std::fs::read_to_string(kernels.join("manifest.txt")).unwrap_or_default(),
    )?;

    crate::python::bundle(&dir.join("python"))?;
    let size = dir_size(&dir)?;
    let packed = pack(&dir)?;
    if packed > MAX_BUNDLE_BYTES {
        bail!(
            "the packed bundle is {:.1} MiB ({:.1} MiB unpacked), over the {} MiB the device call can carry",
            packed as f64 / (1 << 20) as f64,
            size as f64 / (1 << 20) as f64,
            MAX_BUNDLE_BYTES >> 20
        );
    }
    step(&format!(
        "bundle ready: {} ({} test binaries, {} programs, {:.1} MiB; packed into {PACKED} at {:.1} MiB)\n    \
         run it there with (carry: [\"{PACKED}\"]): {UNPACK} && bash bundle/run.sh; the Python package: bash bundle/python/run.sh",
        dir.display(),
        tests.len(),
        bins.len(),
        size as f64 / (1 << 20) as f64,
        packed as f64 / (1 << 20) as f64,
    ));
    Ok(())
}

/// Runs a cargo build with JSON messages and returns (name, executable) of the artifacts that
/// `keep(kind, name)` selects. Debug info is stripped to keep the bundle small.
fn cargo_executables(
    args: &[&str],
    keep: impl Fn(&str, &str) -> bool,
) -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = Command::new("cargo");
    cmd.args(args)
        .arg("--message-format=json-render-diagnostics")
        .env("CARGO_PROFILE_RELEASE_STRIP", "debuginfo");
    eprintln!("$ {}", util::show(&cmd));
    let out = cmd
        .current_dir(root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("could not start {}", util::show(&cmd)))?;
    if !out.status.success() {
        bail!("`{}` failed", util::show(&cmd));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let name = msg["target"]["name"].as_str().unwrap_or_default();
        let kinds = msg["target"]["kind"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if kinds
            .iter()
            .any(|k| keep(k.as_str().unwrap_or_default(), name))
        {
            found.push((name.to_string(), PathBuf::from(exe)));
        }
    }
    found.sort();
    found.dedup_by(|a, b| a.0 == b.0);
    Ok(found)
}

fn copy(from: &Path, to: &Path) -> Result<PathBuf> {
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(to.to_path_buf())
}

/// The non-system shared libraries (from `ldd`) that the executables load, as (soname, path).
/// They are copied under their soname, which is what the loader looks up.
fn shared_libs(exes: &[PathBuf]) -> Result<BTreeSet<(String, PathBuf)>> {
    let mut libs = BTreeSet::new();
    for exe in exes {
        let text = util::output(Command::new("ldd").arg(exe))?;
        for line in text.lines() {
            // "libibverbs.so.1 => /lib/x86_64-linux-gnu/libibverbs.so.1 (0x...)"
            let Some((name, rest)) = line.trim().split_once(" => ") else {
                continue;
            };
            if SYSTEM_LIBS.iter().any(|s| name.starts_with(s)) {
                continue;
            }
            if rest.contains("not found") {
                bail!(
                    "{} needs {name}, which is not installed here",
                    exe.display()
                );
            }
            if let Some(path) = rest
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/'))
            {
                libs.insert((name.to_string(), PathBuf::from(path)));
            }
        }
    }
    Ok(libs)
}

fn dir_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for f in util::files_with_suffix(dir, "")? {
        total += std::fs::metadata(&f)?.len();
    }
    Ok(total)
}
