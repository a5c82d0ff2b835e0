//! Arbitrary bytes as the contents of a send ring, executed by a host NIC against guarded memory:
//! the NIC must not crash, must consume every announced WQEBB, and must leave every byte outside
//! the registrations as it was. The harness (and its input layout) is
//! `ibgda_emu::fuzzing::run_ring_bytes`, which CI also runs under proptest.
//!
//! Run: `cargo +nightly fuzz run decode_ring -- -max_total_time=300` in `crates/ibgda-emu/fuzz`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = ibgda_emu::fuzzing::run_ring_bytes(data) {
        panic!("{e}");
    }
});
