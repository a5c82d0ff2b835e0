//! Embeds the GPU agent's fatbin that `cargo xtask build-kernels` wrote (listed in
//! `target/kernels/emu/manifest.txt`). With none built, the crate still compiles and the CUDA
//! backend runs without the agent (and says so).

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir
        .parent()
        .and_then(|p| p.parent())
        .expect("crates/ibgda-emu is two levels down")
        .to_path_buf();
    let kernels = match std::env::var_os("IBGDA_EMU_KERNELS_DIR") {
        Some(d) => PathBuf::from(d),
        None => match std::env::var_os("CARGO_TARGET_DIR") {
            Some(t) if PathBuf::from(&t).is_absolute() => PathBuf::from(t).join("kernels/emu"),
            Some(t) => root.join(t).join("kernels/emu"),
            None => root.join("target/kernels/emu"),
        },
    };
    println!("cargo:rerun-if-env-changed=IBGDA_EMU_KERNELS_DIR");
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    let manifest = kernels.join("manifest.txt");
    println!("cargo:rerun-if-changed={}", manifest.display());

    let mut code = String::from(
        "/// The embedded agent modules: (name, fatbin).\npub(crate) static MODULES: &[(&str, &[u8])] = &[\n",
    );
    if let Ok(text) = std::fs::read_to_string(&manifest) {
        for line in text.lines() {
            let Some((name, path)) = line.split_once('\t') else {
                continue;
            };
            println!("cargo:rerun-if-changed={path}");
            if std::path::Path::new(path).is_file() {
                writeln!(code, "    ({name:?}, include_bytes!({path:?})),").unwrap();
            } else {
                println!("cargo:warning=agent module {name} listed but {path} is missing: run `cargo xtask build-kernels`");
            }
        }
    }
    code.push_str("];\n");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("agent_modules.rs");
    std::fs::write(out, code).unwrap();
}
