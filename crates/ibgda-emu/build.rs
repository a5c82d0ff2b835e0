//! Embeds the GPU agent's fatbin that `cargo xtask build-kernels` wrote (listed in
//! `target/kernels/emu/manifest.txt`). With none built, the crate still compiles and the CUDA
//! backend runs without the agent (and says so).

#[path = "../../build-support/embed_fatbins.rs"]
mod embed_fatbins;

fn main() {
    embed_fatbins::Embed {
        dir_env: "IBGDA_EMU_KERNELS_DIR",
        target_subdir: "kernels/emu",
        doc: "The embedded agent modules: (name, fatbin).",
        visibility: "pub(crate)",
        what: "agent module",
        out_file: "agent_modules.rs",
    }
    .run();
}
