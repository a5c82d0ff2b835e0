//! `cargo xtask test`: the whole CPU test job, from a fresh Debian/Ubuntu machine (the Python
//! package's torch-free tests included).
//! `.ci/run` calls exactly this.

use crate::util::{self, step};
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// Debian packages the build needs, each with a file that proves it is installed.
const APT_PACKAGES: &[(&str, &str)] = &[
    ("libibverbs-dev", "/usr/include/infiniband/mlx5dv.h"),
    ("librdmacm-dev", "/usr/include/rdma/rdma_cma.h"),
    ("libclang-dev", "/usr/lib/llvm-14/lib/libclang.so"),
    ("clang", "/usr/bin/clang"),
    ("pkg-config", "/usr/bin/pkg-config"),
    ("python3-pip", "/usr/bin/pip3"),
    ("python3-venv", "/usr/lib/python3/dist-packages"),
];

/// Runs set-up, kernels, fmt, clippy and every CPU test.
pub fn run() -> Result<()> {
    let started = std::time::Instant::now();
    step("checking Debian packages");
    ensure_apt_packages()?;
    step("checking rustfmt and clippy");
    ensure_rust_components()?;
    step("building CUDA kernels (installs the pinned nvcc if needed)");
    crate::kernels::build_kernels(false)?;
    step("cargo fmt --check");
    util::run(Command::new("cargo").args(["fmt", "--all", "--", "--check"]))
        .context("formatting differs: run `cargo fmt --all`")?;
    step("cargo clippy (warnings are errors)");
    util::run(Command::new("cargo").args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--locked",
        "--",
        "-D",
        "warnings",
    ]))?;
    step("cargo test (CPU; GPU tests report SKIPPED here)");
    util::run(Command::new("cargo").args(["test", "--workspace", "--locked"]))?;
    step("python package: wheel (maturin), torch-free pytest suite in a venv");
    crate::python::test()?;
    step(&format!(
        "all checks passed in {:.0} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// The set-up every build needs: Debian packages, nvcc, the kernels.
pub fn setup() -> Result<()> {
    step("checking Debian packages");
    ensure_apt_packages()?;
    step("building CUDA kernels (installs the pinned nvcc if needed)");
    crate::kernels::build_kernels(false)?;
    Ok(())
}

/// `cargo xtask example <name> [args..]`: set-up, kernels, then the example in release mode.
pub fn example(args: &[String]) -> Result<()> {
    let Some((name, rest)) = args.split_first() else {
        bail!("usage: cargo xtask example <name> [args..]   (e.g. dispatch_combine)");
    };
    step("checking Debian packages");
    ensure_apt_packages()?;
    step("building CUDA kernels (installs the pinned nvcc if needed)");
    crate::kernels::build_kernels(false)?;
    step(&format!("running example {name}"));
    let mut cmd = Command::new("cargo");
    cmd.args([
        "run",
        "--release",
        "--locked",
        "-p",
        "ep-examples",
        "--bin",
        name,
        "--",
    ])
    .args(rest);
    eprintln!("$ {}", util::show(&cmd));
    let status = cmd
        .current_dir(util::root())
        .status()
        .context("could not start cargo")?;
    // The example's own message says what went wrong; pass its exit status through unchanged.
    std::process::exit(status.code().unwrap_or(1));
}

fn ensure_apt_packages() -> Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .filter(|(pkg, probe)| {
            // libclang's path varies between releases; accept any libclang on the loader path.
            if *pkg == "libclang-dev" {
                return !(Path::new(probe).exists() || has_libclang());
            }
            // pip may come from the Python install rather than Debian's package.
            if *pkg == "python3-pip" {
                return !pip_works();
            }
            // So may venv (with ensurepip), which the Python package's tests use.
            if *pkg == "python3-venv" {
                return !venv_works();
            }
            !Path::new(probe).exists()
        })
        .map(|(pkg, _)| *pkg)
        .collect();
    if missing.is_empty() {
        eprintln!("   all present");
        return Ok(());
    }
    let cmd = format!("apt-get update && apt-get install -y {}", missing.join(" "));
    if !util::is_root() {
        bail!(
            "missing Debian packages: {}\nrun as root:\n  {cmd}",
            missing.join(" ")
        );
    }
    eprintln!("   installing: {}", missing.join(" "));
    util::run(Command::new("apt-get").arg("update"))?;
    util::run(
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn has_libclang() -> bool {
    Command::new("sh")
        .args(["-c", "ldconfig -p | grep -q 'libclang.*\\.so'"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn venv_works() -> bool {
    Command::new("python3")
        .args(["-c", "import ensurepip, venv"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn pip_works() -> bool {
    Command::new("python3")
        .args(["-m", "pip", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn ensure_rust_components() -> Result<()> {
    for (tool, component) in [("fmt", "rustfmt"), ("clippy", "clippy")] {
        let ok = Command::new("cargo")
            .args([tool, "--version"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !ok {
            eprintln!("   installing {component}");
            util::run(Command::new("rustup").args(["component", "add", component]))?;
        }
    }
    Ok(())
}
