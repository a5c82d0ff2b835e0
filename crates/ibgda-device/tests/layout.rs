//! The layout table (`include/ibgda/layout.def`) as two compilers measured it: the C++ compiler on
//! the CUDA headers (`golden/host_headers.cpp`) and rustc on our types. Both are also asserted
//! against the table's numbers at compile time; this test catches a check that went missing on
//! either side.

// The table casts every constant to u64, the u64 ones (the default timeout) to their own type.
#![allow(clippy::unnecessary_cast)]

mod common;

use std::collections::BTreeMap;
use std::ffi::CStr;

use common::*;

include!(concat!(env!("OUT_DIR"), "/layout_table.rs"));

type Key = (String, String, String);

#[test]
fn cuda_headers_and_rust_types_agree() {
    // SAFETY: `ibgda_layout_table` is a C array of `ibgda_layout_table_len` entries whose strings
    // are static and NUL-terminated; the shim never writes to it.
    let c_table =
        unsafe { std::slice::from_raw_parts(ibgda_layout_table.as_ptr(), ibgda_layout_table_len) };
    let s = |p: *const std::ffi::c_char| {
        // SAFETY: see above.
        unsafe { CStr::from_ptr(p) }
            .to_str()
            .expect("ASCII")
            .to_string()
    };
    let c: BTreeMap<Key, (u64, u64)> = c_table
        .iter()
        .map(|e| ((s(e.kind), s(e.c_name), s(e.field)), (e.a, e.b)))
        .collect();
    let rust: BTreeMap<Key, (u64, u64)> = rust_layout_table()
        .into_iter()
        .map(|(k, n, f, a, b)| ((k.to_string(), n.to_string(), f.to_string()), (a, b)))
        .collect();
    assert!(
        c.len() > 100,
        "suspiciously small layout table: {} entries",
        c.len()
    );
    assert_eq!(c.len(), c_table.len(), "duplicate entries in layout.def");
    assert_eq!(
        c.keys().collect::<Vec<_>>(),
        rust.keys().collect::<Vec<_>>()
    );
    let mismatches: Vec<String> = c
        .iter()
        .filter(|(k, v)| rust[*k] != **v)
        .map(|(k, v)| format!("{k:?}: C++ {v:?}, Rust {:?}", rust[k]))
        .collect();
    assert!(
        mismatches.is_empty(),
        "layout mismatches:\n{}",
        mismatches.join("\n")
    );
}
