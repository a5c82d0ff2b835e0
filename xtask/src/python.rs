//! The `ep_ibgda` Python package: `cargo xtask python` builds its wheel with maturin (pinned,
//! from PyPI, in a venv under `target/`) and installs it into `python3`'s environment; `cargo
//! xtask test` builds a wheel and runs the torch-free pytest suite in a venv; `device-bundle`
//! carries a release wheel, pytest's wheels and the GPU tests to the device machine.

use crate::util::{self, root, step, target_dir};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The wheel builder, the same version everywhere (pyproject.toml's build-system pins it too).
const MATURIN: &str = "maturin==1.9.6";
/// The test runner (CI's venv and the device bundle).
const PYTEST: &str = "pytest==8.3.5";
/// Where the GPU machine's Python is from: the wheel must install there (`pip --no-index`).
pub const DEVICE_PYTHON: &str = "3.12";

fn venv_python(dir: &Path) -> PathBuf {
    dir.join("bin").join("python")
}

/// A venv at `dir` (made once) with `pkgs` installed from PyPI; returns its python.
fn venv(dir: &Path, pkgs: &[&str]) -> Result<PathBuf> {
    let py = venv_python(dir);
    if !py.exists() {
        util::run(Command::new("python3").arg("-m").arg("venv").arg(dir))
            .context("creating a Python venv (Debian/Ubuntu: apt-get install python3-venv)")?;
    }
    let missing: Vec<&str> = pkgs
        .iter()
        .copied()
        .filter(|p| {
            let (name, version) = p.split_once("==").unwrap_or((p, ""));
            let shown = Command::new(&py)
                .args(["-m", "pip", "show", name])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
                .unwrap_or_default();
            !shown.lines().any(|l| l == format!("Version: {version}"))
        })
        .collect();
    if !missing.is_empty() {
        util::run(
            Command::new(&py)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .args(&missing),
        )?;
    }
    Ok(py)
}

/// Builds the wheel (`release` or the dev profile) into `target/wheels/<profile>/` and returns
/// its path. The kernels must be built first (ep-kernels embeds them).
pub fn build_wheel(release: bool) -> Result<PathBuf> {
    let tools = venv(&target_dir().join("py-tools"), &[MATURIN])?;
    let out = target_dir()
        .join("wheels")
        .join(if release { "release" } else { "debug" });
    if out.exists() {
        std::fs::remove_dir_all(&out)?;
    }
    let mut cmd = Command::new(tools.with_file_name("maturin"));
    cmd.args(["build", "--locked", "-m"])
        .arg(root().join("python/Cargo.toml"))
        .arg("-o")
        .arg(&out)
        .args(["-i", "python3"]);
    if release {
        cmd.arg("--release");
    }
    util::run(&mut cmd)?;
    let wheels = util::files_with_suffix(&out, ".whl")?;
    match wheels.as_slice() {
        [one] => Ok(one.clone()),
        other => bail!("expected one wheel in {}, found {other:?}", out.display()),
    }
}

/// `cargo xtask python [--no-install]`: kernels, release wheel, then `pip install` into the
/// environment of `$PYTHON` (default `python3`: activate the venv or conda env that has torch
/// first).
pub fn install(args: &[String]) -> Result<()> {
    crate::test::setup()?;
    step("building the ep_ibgda wheel (release, maturin from PyPI)");
    let wheel = build_wheel(true)?;
    if args.iter().any(|a| a == "--no-install") {
        step(&format!("wheel ready: {}", wheel.display()));
        return Ok(());
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
    step(&format!("installing {} with {python}", wheel.display()));
    util::run(
        Command::new(&python)
            .args(["-m", "pip", "install", "--force-reinstall", "--no-deps"])
            .arg(&wheel),
    )
    .with_context(|| {
        format!(
            "pip could not install the wheel into {python}'s environment (a system Python refuses \
             with \"externally-managed-environment\": activate the venv or conda env that has \
             torch, or set PYTHON=/path/to/that/python); the wheel is {}",
            wheel.display()
        )
    })?;
    step(&format!(
        "ep_ibgda installed: `import ep_ibgda as deep_ep` (torch is the caller's; wheel: {})",
        wheel.display()
    ));
    Ok(())
}

/// The Python step of `cargo xtask test`: a dev wheel into a fresh venv with pytest; the
/// torch-free tests (import, API surface, argument errors); the GPU tests report skipped.
pub fn test() -> Result<()> {
    let wheel = build_wheel(false)?;
    let py = venv(&target_dir().join("py-test"), &[PYTEST])?;
    util::run(
        Command::new(&py)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--force-reinstall",
                "--no-deps",
            ])
            .arg(&wheel),
    )?;
    // From the tests' folder, so `import ep_ibgda` is the installed wheel, not the sources.
    let status = Command::new(&py)
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "."])
        .current_dir(root().join("python/tests"))
        .status()
        .context("running pytest")?;
    if !status.success() {
        bail!("python tests failed ({status})");
    }
    eprintln!(
        "   left to the GPU machine (torch is not installed here: PyPI's torch wheel pulls several \
         GB of CUDA libraries): python/tests/test_gpu_*.py and python/examples/dispatch_combine.py, \
         run by `bash bundle/python/run.sh` from `cargo xtask device-bundle --python`"
    );
    Ok(())
}

/// Files of the Python part of the device bundle, under `dir` (`bundle/python`): the release
/// wheel, pytest's wheels for Python 3.12, the GPU tests, the example, the benchmark
/// (`bench/host_overhead.py`, run by `run.sh --bench`) and `run.sh`.
pub fn bundle(dir: &Path) -> Result<()> {
    step("building the ep_ibgda wheel (release) for the bundle");
    let wheel = build_wheel(true)?;
    let wheels = dir.join("wheels");
    let tests = dir.join("tests");
    let examples = dir.join("examples");
    for d in [&wheels, &tests, &examples] {
        std::fs::create_dir_all(d)?;
    }
    let name = wheel.file_name().context("wheel has a name")?;
    std::fs::copy(&wheel, wheels.join(name))?;
    step("fetching pytest's wheels for the device machine's Python");
    let tools = venv(&target_dir().join("py-tools"), &[MATURIN])?;
    util::run(
        Command::new(&tools)
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(["--only-binary=:all:", "--python-version", DEVICE_PYTHON])
            .args(["--platform", "manylinux2014_x86_64", "--platform", "any"])
            .arg("-d")
            .arg(&wheels)
            .arg(PYTEST),
    )?;
    let src = root().join("python");
    for f in util::files_with_suffix(&src.join("tests"), ".py")? {
        let n = f
            .file_name()
            .context("file name")?
            .to_string_lossy()
            .to_string();
        if n.starts_with("test_gpu_") || n == "gpu_ranks.py" || n == "conftest.py" {
            std::fs::copy(&f, tests.join(&n))?;
        }
    }
    std::fs::copy(
        src.join("examples/dispatch_combine.py"),
        examples.join("dispatch_combine.py"),
    )?;
    let bench = dir.join("bench");
    std::fs::create_dir_all(&bench)?;
    std::fs::copy(
        src.join("bench/host_overhead.py"),
        bench.join("host_overhead.py"),
    )?;
    std::fs::write(dir.join("run.sh"), include_str!("run_python.sh"))?;
    eprintln!(
        "   {} (run: bash bundle/python/run.sh)",
        name.to_string_lossy()
    );
    Ok(())
}
