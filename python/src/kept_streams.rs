//! Streams handed to torch live as long as the process.
//!
//! The Python layer wraps a buffer's stream in `torch.cuda.ExternalStream` and calls
//! `tensor.record_stream` on it for the outputs the stream writes. torch's caching allocator
//! records an event on that stream when such a tensor is freed, which may be long after the
//! buffer is destroyed (training keeps outputs for backward). A destroyed stream there aborts
//! the process ("context is destroyed", seen on an H200 on 2026-12-02), so every stream that
//! crosses to Python is kept here and never destroyed: one stream per buffer ever created.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;

static KEPT: Mutex<Option<HashMap<u64, Arc<CudaStream>>>> = Mutex::new(None);

/// The raw handle of `stream`, after making sure it is never destroyed.
pub fn keep(stream: &Arc<CudaStream>) -> u64 {
    let handle = stream.cu_stream() as u64;
    let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
    kept.get_or_insert_with(HashMap::new)
        .entry(handle)
        .or_insert_with(|| stream.clone());
    handle
}
