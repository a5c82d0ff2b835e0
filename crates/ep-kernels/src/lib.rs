//! CUDA kernels for expert-parallel communication, compiled by `cargo xtask build-kernels` into
//! sm_90a fatbins that this crate embeds, and loaded through cudarc.
//!
//! Owns: the embedded kernel images, loading them into a CUDA context, and the typed
//! launch-parameter structs shared with the `.cu` sources.
//!
//! Must not know about: ranks, bootstrap or buffers' lifetimes (that is `ep`).
