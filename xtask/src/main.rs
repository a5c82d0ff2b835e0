//! Project automation, run as `cargo xtask <command>`.
//!
//! - `build-kernels`: compile every `.cu` under `crates/ep-kernels/cuda/` into fatbins
//!   (sm_90a SASS + compute_90 PTX) that `ep-kernels` embeds; installs the pinned nvcc from PyPI
//!   under `target/` when none is on PATH.
//! - `example <name>`: the same set-up, then `cargo run --release` of an example (the main job
//!   is `cargo xtask example dispatch_combine`).
//! - `test`: everything CI runs: Debian packages, nvcc, kernels, fmt, clippy, every CPU test.
//! - `device-bundle`: release builds of the GPU tests and examples, the kernels, the shared
//!   libraries they need and `run.sh`, in `bundle/`, to carry to the device machine; with the
//!   Python package's wheel and GPU tests in `bundle/python/`.
//! - `python`: build the `ep_ibgda` wheel (maturin from PyPI) and install it into `python3`'s
//!   environment.

mod bundle;
mod kernels;
mod python;
mod test;
mod util;

use anyhow::{bail, Result};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  build-kernels [--force]   compile crates/ep-kernels/cuda/**/*.cu into target/kernels/*.fatbin
  example <name> [args..]   set up (apt packages, nvcc, kernels), then run an example in release mode
  test                      set up (apt packages, nvcc), build kernels, fmt check, clippy -D warnings, CPU tests
  device-bundle [--python]  build GPU tests + examples (release) into bundle/ for the device machine
                            (--python: only the Python package's wheel, GPU tests and example)
  python [--no-install]     build the ep_ibgda wheel (maturin) and pip-install it into $PYTHON's (python3's) environment
";

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The chain of causes, without a backtrace: these are user-facing errors.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first() else {
        eprint!("{USAGE}");
        bail!("no command given");
    };
    let rest = &args[1..];
    match cmd.as_str() {
        "build-kernels" => kernels::build_kernels(rest.iter().any(|a| a == "--force")).map(|_| ()),
        "test" => test::run(),
        "example" => test::example(rest),
        "device-bundle" => bundle::run(rest),
        "python" => python::install(rest),
        "-h" | "--help" | "help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            eprint!("{USAGE}");
            bail!("unknown command `{other}`")
        }
    }
}
