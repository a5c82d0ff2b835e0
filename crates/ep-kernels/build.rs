//! Embeds the fatbins that `cargo xtask build-kernels` wrote (listed in `target/kernels/manifest.txt`).
//! With none built, the crate still compiles and loading a module says how to build them.

#[path = "../../build-support/embed_fatbins.rs"]
mod embed_fatbins;

fn main() {
    embed_fatbins::Embed {
        dir_env: "EP_KERNELS_DIR",
        target_subdir: "kernels",
        doc: "The embedded kernel modules: (name, fatbin).",
        visibility: "pub",
        what: "kernel module",
        out_file: "modules.rs",
    }
    .run();
}
