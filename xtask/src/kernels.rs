//! `cargo xtask build-kernels`: every `.cu` under `crates/ep-kernels/cuda/` becomes one fatbin
//! in `target/kernels/`, named by its path without `.cu` (`intranode`, `tests/wire`), plus a
//! `manifest.txt` that `ep-kernels`' build script reads to embed them. The emulated NIC's GPU
//! agent (`crates/ibgda-emu/cuda/`) is built the same way into `target/kernels/emu/`, with a
//! manifest of its own that `ibgda-emu`'s build script reads (`ibgda-emu` sits below
//! `ep-kernels` and cannot embed through it).

use crate::util::{self, root, step, target_dir};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyPI packages that make a working nvcc 13.0 (matching the device machine's driver and
/// toolkit). `nvidia-nvvm` must be pinned too: left free it resolves to a newer cicc whose PTX
/// the 13.0 ptxas rejects ("Unsupported .version"). cccl has no 13.0.88; 13.0.85 is its 13.0.
pub const NVCC_PINS: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-cuda-runtime==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-cccl==13.0.85",
];

/// Target architectures: sm_90a machine code for H100/H200, compute_90 PTX for anything newer.
const GENCODE: &[&str] = &[
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
];

/// Where the kernel sources live.
pub fn source_dir() -> PathBuf {
    root().join("crates/ep-kernels/cuda")
}

/// Where the fatbins go (the `ep-kernels` build script looks here too).
pub fn out_dir() -> PathBuf {
    target_dir().join("kernels")
}

/// Header folders every kernel may include from.
fn include_dirs() -> Vec<PathBuf> {
    vec![
        root().join("crates/ibgda-device/include"),
        source_dir().join("include"),
    ]
}

/// Where the emulated NIC's agent kernel sources live.
pub fn emu_source_dir() -> PathBuf {
    root().join("crates/ibgda-emu/cuda")
}

/// Where its fatbins and manifest go (`ibgda-emu`'s build script looks here).
pub fn emu_out_dir() -> PathBuf {
    out_dir().join("emu")
}

/// One folder of `.cu` files built into one folder of fatbins with one manifest.
struct KernelSet {
    src: PathBuf,
    out: PathBuf,
    includes: Vec<PathBuf>,
}

/// Finds nvcc: `$NVCC`, then PATH, then `/usr/local/cuda/bin`, then the pinned PyPI toolchain
/// under `target/cuda-toolchain` (installed on first use).
pub fn nvcc() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("NVCC") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = util::on_path("nvcc") {
        return Ok(p);
    }
    let system = PathBuf::from("/usr/local/cuda/bin/nvcc");
    if system.is_file() {
        return Ok(system);
    }
    install_pinned_nvcc()
}

fn install_pinned_nvcc() -> Result<PathBuf> {
    let dir = target_dir().join("cuda-toolchain");
    let nvcc = dir.join("py/nvidia/cu13/bin/nvcc");
    let stamp = dir.join("pins.txt");
    let want = NVCC_PINS.join("\n");
    if nvcc.is_file() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(want.as_str()) {
        return Ok(nvcc);
    }
    step(&format!(
        "installing nvcc 13.0 from PyPI into {}",
        dir.display()
    ));
    let py = dir.join("py");
    if py.exists() {
        std::fs::remove_dir_all(&py).with_context(|| format!("removing {}", py.display()))?;
    }
    std::fs::create_dir_all(&dir)?;
    let python = util::on_path("python3")
        .context("python3 is needed to install nvcc from PyPI; install python3 and pip")?;
    util::run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-warn-script-location",
                "--target",
            ])
            .arg(&py)
            .args(NVCC_PINS)
            // Debian's python marks its environment externally managed; --target is our own folder.
            .env("PIP_BREAK_SYSTEM_PACKAGES", "1"),
    )
    .context("installing the pinned nvcc from PyPI failed (is `python3 -m pip` available?)")?;
    if !nvcc.is_file() {
        bail!(
            "pip installed the CUDA packages but {} is missing",
            nvcc.display()
        );
    }
    std::fs::write(&stamp, want)?;
    Ok(nvcc)
}

/// FNV-1a over the bytes of the files, in order: the rebuild key of one kernel module.
fn fingerprint(files: &[PathBuf], flags: &[String]) -> Result<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for f in flags {
        eat(f.as_bytes());
    }
    for f in files {
        eat(f.to_string_lossy().as_bytes());
        eat(&std::fs::read(f).with_context(|| format!("reading {}", f.display()))?);
    }
    Ok(h)
}

/// Builds every kernel module (`ep-kernels`' and the emulated NIC's agent); returns
/// `ep-kernels`' output folder. Unchanged modules are not rebuilt (the key covers the source,
/// every header in the include folders, and the flags).
pub fn build_kernels(force: bool) -> Result<PathBuf> {
    let ep = KernelSet {
        src: source_dir(),
        out: out_dir(),
        includes: include_dirs(),
    };
    let emu = KernelSet {
        src: emu_source_dir(),
        out: emu_out_dir(),
        includes: vec![emu_source_dir()],
    };
    build_set(&emu, force)?;
    build_set(&ep, force)?;
    Ok(ep.out)
}

fn build_set(set: &KernelSet, force: bool) -> Result<()> {
    let src = set.src.clone();
    let sources = util::files_with_suffix(&src, ".cu")?;
    let out = set.out.clone();
    std::fs::create_dir_all(&out)?;
    let mut headers = Vec::new();
    for d in &set.includes {
        headers.extend(util::files_with_suffix(d, ".cuh")?);
        headers.extend(util::files_with_suffix(d, ".h")?);
    }
    let nvcc = nvcc()?;
    step(&format!(
        "building {} kernel module(s) with {}",
        sources.len(),
        nvcc.display()
    ));
    let mut flags: Vec<String> = vec![
        "-fatbin".into(),
        "-std=c++17".into(),
        "-O3".into(),
        "-lineinfo".into(),
        "--expt-relaxed-constexpr".into(),
        "-Werror=all-warnings".into(),
    ];
    flags.extend(GENCODE.iter().map(|s| s.to_string()));
    for d in &set.includes {
        flags.push(format!("-I{}", d.display()));
    }
    if std::env::var_os("EP_PTXAS_VERBOSE").is_some() {
        flags.push("-Xptxas=-v".into());
    }

    let mut jobs = Vec::new();
    let mut manifest = String::new();
    for cu in &sources {
        let name = module_name(&src, cu)?;
        let fatbin = out.join(format!("{name}.fatbin"));
        let key_file = out.join(format!("{name}.key"));
        let mut inputs = vec![cu.clone()];
        inputs.extend(headers.iter().cloned());
        let key = format!("{:016x}", fingerprint(&inputs, &flags)?);
        manifest.push_str(&format!("{name}\t{}\n", fatbin.display()));
        let fresh = fatbin.is_file()
            && std::fs::read_to_string(&key_file).ok().as_deref() == Some(key.as_str());
        if fresh && !force {
            eprintln!("   {name}: up to date");
            continue;
        }
        if let Some(parent) = fatbin.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let mut cmd = Command::new(&nvcc);
        cmd.args(&flags).arg("-o").arg(&fatbin).arg(cu);
        jobs.push((name, cmd, key_file, key));
    }

    // Compile in parallel, a few at a time; nvcc is single-threaded per file.
    let width = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .min(8);
    let mut failures = Vec::new();
    for chunk in jobs.chunks_mut(width) {
        let mut running = Vec::new();
        for (name, cmd, _, _) in chunk.iter_mut() {
            eprintln!("   {name}: compiling");
            let child = cmd
                .current_dir(root())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .with_context(|| format!("could not start {}", util::show(cmd)))?;
            running.push((std::time::Instant::now(), child));
        }
        for ((started, child), (name, cmd, key_file, key)) in running.into_iter().zip(chunk.iter())
        {
            let out = child.wait_with_output()?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            if out.status.success() {
                if !stderr.trim().is_empty() {
                    eprintln!("{stderr}");
                }
                std::fs::write(key_file, key)?;
                eprintln!(
                    "   {name}: built in {:.1} s",
                    started.elapsed().as_secs_f64()
                );
            } else {
                eprintln!("nvcc failed on {name}:\n$ {}\n{stderr}", util::show(cmd));
                failures.push(name.clone());
            }
        }
    }
    if !failures.is_empty() {
        bail!("kernel compilation failed: {}", failures.join(", "));
    }
    write_if_changed(&out.join("manifest.txt"), &manifest)?;
    Ok(())
}

/// `crates/ep-kernels/cuda/tests/wire.cu` → `tests/wire`.
fn module_name(src: &Path, cu: &Path) -> Result<String> {
    let rel = cu
        .strip_prefix(src)
        .with_context(|| format!("{} is not under {}", cu.display(), src.display()))?;
    let s = rel.with_extension("").to_string_lossy().replace('\\', "/");
    if !s
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '/')
    {
        bail!("kernel file name {s:?}: use letters, digits, '_' and '/' only");
    }
    Ok(s)
}

/// Writes only when the content differs, so the embedding crate is not rebuilt for nothing.
fn write_if_changed(path: &Path, content: &str) -> Result<()> {
    if std::fs::read_to_string(path).ok().as_deref() != Some(content) {
        std::fs::write(path, content)?;
    }
    Ok(())
}
