//! No public input makes a kernel write outside its buffers (issue 16, items 1, 2 and 4): the
//! routing tensors of a layout or a handle are read-only through the API, and a value written
//! into them from outside (here with a raw copy to their device address, as any CUDA code could)
//! is caught on the GPU and reported as a named error instead of being used as a write offset;
//! a low-latency combine checks its top-k ids against the range and against the dispatch, and
//! refuses a hook-mode dispatch whose receive never ran. One rank on one GPU.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use ep::low_latency::{
    LlCombineArgs, LlCombineX, LlDispatchArgs, LowLatencyBuffer, LowLatencyOptions,
};
use ep::{Bf16, Buffer, BufferOptions, DispatchArgs, DispatchX, EpError, Tensor};
use ep_kernels::testing::{gpus, seed, Rng};

/// Writes `words` at `addr` behind the API's back (what a stray kernel or a caller holding
/// `device_address` could do).
fn scribble(ctx: &Arc<CudaContext>, addr: u64, words: &[i32]) {
    ctx.bind_to_thread().expect("cuCtxSetCurrent");
    // SAFETY: `addr` is the device address of a live tensor on `ctx`'s GPU holding at least
    // `words.len()` i32 (the callers pass a tensor's own address and a prefix of its length);
    // the context is current and the copy is synchronous.
    unsafe { cudarc::driver::result::memcpy_htod_sync(addr, words) }.expect("cuMemcpyHtoD");
    // A copy from pageable memory may still be in flight when it returns; the low-latency
    // stream does not wait for the legacy stream.
    ibgda_device::cuda::wait_legacy_stream(
        ctx,
        std::time::Duration::from_secs(60),
        "the test's own copies and memsets",
    )
    .expect("the legacy stream");
}

fn bf16_rows(rng: &mut Rng, n: usize) -> Vec<Bf16> {
    (0..n)
        .map(|_| Bf16(0x3c00 | rng.below(0x100) as u16))
        .collect()
}

// ---- Intranode: the layout's counts ----------------------------------------------------------

const TOKENS: usize = 4;
const HIDDEN: usize = 256;

fn intranode(ctx: &Arc<CudaContext>) -> Buffer {
    let mut o = BufferOptions::new(8, HIDDEN, 2, 4);
    o.timeout = Duration::from_millis(500);
    Buffer::create_group(std::slice::from_ref(ctx), &o)
        .expect("create buffer")
        .pop()
        .expect("one rank")
}

/// Dispatches `TOKENS` tokens after `edit` changed the layout's tokens_per_rank on the GPU;
/// the dispatch's error (or its success).
fn dispatch_after_edit(ctx: &Arc<CudaContext>, tokens_per_rank: i32) -> Result<usize, EpError> {
    let mut buf = intranode(ctx);
    let mut rng = Rng::new(seed());
    // Every token goes to the one rank (experts 0..4 all live there).
    let ids: Vec<i32> = (0..TOKENS * 2).map(|i| (i % 4) as i32).collect();
    let ids = Tensor::from_host(ctx, &ids, &[TOKENS, 2]).unwrap();
    let x = Tensor::from_host(
        ctx,
        &bf16_rows(&mut rng, TOKENS * HIDDEN),
        &[TOKENS, HIDDEN],
    )
    .unwrap();
    let layout = buf.get_dispatch_layout(&ids)?;
    assert_eq!(layout.tokens_per_rank().to_host()?, vec![TOKENS as i32]);
    // Through the API the layout cannot be edited at all.
    assert!(layout.tokens_per_rank().is_read_only());
    let refused = layout.tokens_per_rank().copy_from_host(&[tokens_per_rank]);
    assert!(
        matches!(refused, Err(EpError::Tensor { .. })),
        "copy_from_host into a layout tensor: {refused:?}"
    );
    scribble(
        ctx,
        layout.tokens_per_rank().device_address(),
        &[tokens_per_rank],
    );
    let out = buf.dispatch(&DispatchArgs::new(DispatchX::Bf16(&x), &layout, 1));
    let rows = out.map(|o| o.num_recv_tokens.unwrap_or(0));
    let synced = buf.synchronize();
    rows.and_then(|n| synced.map(|()| n))
}

#[test]
fn gpu_intranode_a_count_edited_out_of_range_is_reported_not_used() {
    let Some(ctxs) = gpus(1) else { return };
    // Far past the region: before the check, the received count (and the output's shape) was
    // a million rows in a region of 8.
    match dispatch_after_edit(&ctxs[0], 1_000_000) {
        Err(EpError::CorruptRouting {
            what: "tokens_per_rank",
            index: 0,
            value: 1_000_000,
            limit,
            ..
        }) => assert_eq!(limit, TOKENS as u64),
        other => panic!("expected CorruptRouting(tokens_per_rank), got {other:?}"),
    }
    match dispatch_after_edit(&ctxs[0], -3) {
        Err(EpError::CorruptRouting {
            what: "tokens_per_rank",
            value: -3,
            ..
        }) => {}
        other => panic!("expected CorruptRouting(tokens_per_rank), got {other:?}"),
    }
}

#[test]
fn gpu_intranode_a_count_out_of_agreement_with_the_send_order_is_reported() {
    let Some(ctxs) = gpus(1) else { return };
    // In range, but fewer than the tokens the send order places: the rows past it would land
    // in the next source's rows (or past the region, for the last source).
    match dispatch_after_edit(&ctxs[0], 1) {
        Err(EpError::CorruptRouting {
            what,
            value,
            limit: 0,
            ..
        }) => {
            assert!(what.starts_with("send position"), "{what}");
            assert!((1..TOKENS as i64).contains(&value), "{value}");
        }
        other => panic!("expected CorruptRouting(send position), got {other:?}"),
    }
}

// ---- Low latency: the handle and the combine's top-k ids -------------------------------------

const LL_TOKENS: usize = 8;
const LL_HIDDEN: usize = 128;
const LL_EXPERTS: usize = 8;
const LL_TOPK: usize = 2;

fn low_latency(ctx: &Arc<CudaContext>) -> LowLatencyBuffer {
    let mut o = LowLatencyOptions::new(LL_TOKENS, LL_HIDDEN, LL_TOPK, LL_EXPERTS);
    o.timeout = Duration::from_millis(500);
    LowLatencyBuffer::create_group(std::slice::from_ref(ctx), &o)
        .expect("create low-latency buffer")
        .pop()
        .expect("one rank")
}

/// Blocks per low-latency kernel: a few, so that the tests of this binary, which run at once on
/// one GPU, all fit on it together (a low-latency kernel's blocks wait on each other, so each
/// kernel's grid must be resident as a whole).
const LL_SMS: u32 = 4;

fn ll_dispatch_args<'a>(x: &'a Tensor<Bf16>, ids: &'a Tensor<i32>) -> LlDispatchArgs<'a> {
    let mut a = LlDispatchArgs::new(x, ids);
    a.num_sms = Some(LL_SMS);
    a
}

fn ll_combine_args<'a>(
    x: LlCombineX<'a>,
    ids: &'a Tensor<i32>,
    weights: &'a Tensor<f32>,
    handle: &'a ep::low_latency::LlHandle,
) -> LlCombineArgs<'a> {
    let mut a = LlCombineArgs::new(x, ids, weights, handle);
    a.num_sms = Some(LL_SMS);
    a
}

/// Token t goes to experts t % 8 and (t + 3) % 8.
fn ll_ids() -> Vec<i32> {
    (0..LL_TOKENS)
        .flat_map(|t| [(t % LL_EXPERTS) as i32, ((t + 3) % LL_EXPERTS) as i32])
        .collect()
}

struct LlInputs {
    x: Tensor<Bf16>,
    ids: Tensor<i32>,
    weights: Tensor<f32>,
}

fn ll_inputs(ctx: &Arc<CudaContext>) -> LlInputs {
    let mut rng = Rng::new(seed());
    let inputs = LlInputs {
        x: Tensor::from_host(
            ctx,
            &bf16_rows(&mut rng, LL_TOKENS * LL_HIDDEN),
            &[LL_TOKENS, LL_HIDDEN],
        )
        .unwrap(),
        ids: Tensor::from_host(ctx, &ll_ids(), &[LL_TOKENS, LL_TOPK]).unwrap(),
        weights: Tensor::from_host(ctx, &[0.5f32; LL_TOKENS * LL_TOPK], &[LL_TOKENS, LL_TOPK])
            .unwrap(),
    };
    // The uploads ran on the legacy stream, which the low-latency stream does not wait for.
    ibgda_device::cuda::wait_legacy_stream(
        ctx,
        std::time::Duration::from_secs(60),
        "the test's own copies and memsets",
    )
    .expect("the legacy stream");
    inputs
}

#[test]
fn gpu_ll_combine_refuses_a_dispatch_whose_receive_never_ran() {
    let Some(ctxs) = gpus(1) else { return };
    let ctx = &ctxs[0];
    let mut buf = low_latency(ctx);
    let inp = ll_inputs(ctx);
    let mut args = ll_dispatch_args(&inp.x, &inp.ids);
    args.return_recv_hook = true;
    let mut out = buf.dispatch(&args).expect("dispatch");
    let hook = out.hook.take().expect("hook mode returns a hook");
    assert!(!out.handle.is_received());
    let cargs = ll_combine_args(LlCombineX::ZeroCopy, &inp.ids, &inp.weights, &out.handle);
    match buf.combine(&cargs) {
        Err(EpError::InvalidArgument { what, .. }) => assert!(what.contains("hook"), "{what}"),
        other => panic!("combine before the receive hook: {other:?}"),
    }
    // Once received, the same handle combines.
    hook.call().expect("receive");
    assert!(out.handle.is_received());
    let cargs = ll_combine_args(LlCombineX::ZeroCopy, &inp.ids, &inp.weights, &out.handle);
    buf.combine(&cargs).expect("combine after the receive");
    buf.synchronize().expect("synchronize");
    buf.shutdown().expect("shutdown");
}

/// Dispatches, lets `corrupt` write into the handle's tensors, combines with `combine_ids`
/// (the dispatch's when `None`); the combine's error (or success).
fn ll_combine_after(
    ctx: &Arc<CudaContext>,
    corrupt: impl Fn(&ep::low_latency::LlHandle),
    combine_ids: Option<&[i32]>,
) -> Result<(), EpError> {
    let mut buf = low_latency(ctx);
    let inp = ll_inputs(ctx);
    let out = buf.dispatch(&ll_dispatch_args(&inp.x, &inp.ids))?;
    buf.synchronize()?;
    assert!(out.handle.src_info().is_read_only() && out.handle.layout_range().is_read_only());
    assert!(matches!(
        out.handle
            .src_info()
            .copy_from_host(&vec![0; out.handle.src_info().numel()]),
        Err(EpError::Tensor { .. })
    ));
    corrupt(&out.handle);
    let ids = match combine_ids {
        Some(v) => Tensor::from_host(ctx, v, &[LL_TOKENS, LL_TOPK]).unwrap(),
        None => inp.ids.clone(),
    };
    ibgda_device::cuda::wait_legacy_stream(
        ctx,
        std::time::Duration::from_secs(60),
        "the test's own copies and memsets",
    )
    .expect("the legacy stream");
    let cargs = ll_combine_args(LlCombineX::ZeroCopy, &ids, &inp.weights, &out.handle);
    buf.combine(&cargs)?;
    buf.synchronize()
}

#[test]
fn gpu_ll_combine_checks_the_handle_before_writing_by_it() {
    let Some(ctxs) = gpus(1) else { return };
    let ctx = &ctxs[0];
    // Unchanged, the combine runs.
    ll_combine_after(ctx, |_| {}, None).expect("combine over an intact handle");
    // src_info is a remote write offset: a source token far past max_tokens.
    let e = ll_combine_after(
        ctx,
        |h| scribble(ctx, h.src_info().device_address(), &[1_000_000]),
        None,
    );
    match e {
        Err(EpError::CorruptRouting {
            what: "src_info",
            index: 0,
            value: 1_000_000,
            limit,
            ..
        }) => assert_eq!(limit, LL_TOKENS as u64 - 1),
        other => panic!("expected CorruptRouting(src_info), got {other:?}"),
    }
    // layout_range: a first row before the expert's rows, and a count past them.
    let e = ll_combine_after(
        ctx,
        |h| scribble(ctx, h.layout_range().device_address(), &[-5]),
        None,
    );
    assert!(
        matches!(
            e,
            Err(EpError::CorruptRouting {
                what: "layout_range offset",
                value: -5,
                ..
            })
        ),
        "{e:?}"
    );
    let e = ll_combine_after(
        ctx,
        |h| scribble(ctx, h.layout_range().device_address(), &[0, 1 << 20]),
        None,
    );
    assert!(
        matches!(
            e,
            Err(EpError::CorruptRouting {
                what: "layout_range count",
                index: 1,
                value: 1_048_576,
                ..
            })
        ),
        "{e:?}"
    );
}

#[test]
fn gpu_ll_combine_checks_its_topk_ids() {
    let Some(ctxs) = gpus(1) else { return };
    let ctx = &ctxs[0];
    // An id past the experts: before the check its flag and rows were read out of bounds.
    let mut ids = ll_ids();
    ids[2 * LL_TOPK + 1] = LL_EXPERTS as i32;
    match ll_combine_after(ctx, |_| {}, Some(&ids)) {
        Err(EpError::ExpertIdOutOfRange {
            op: "low-latency combine",
            id,
            token: 2,
            slot: Some(1),
            ..
        }) => assert_eq!(id, LL_EXPERTS as i64),
        other => panic!("expected ExpertIdOutOfRange, got {other:?}"),
    }
    // A valid id the dispatch did not send that token to: before the check, a stale row was
    // summed in silently.
    let mut ids = ll_ids();
    let was = ids[3 * LL_TOPK];
    ids[3 * LL_TOPK] = (was + 1) % LL_EXPERTS as i32;
    match ll_combine_after(ctx, |_| {}, Some(&ids)) {
        Err(EpError::TopkMismatch {
            token: 3,
            slot: 0,
            dispatched,
            combined,
            ..
        }) => {
            assert_eq!(dispatched, i64::from(was));
            assert_eq!(combined, i64::from((was + 1) % LL_EXPERTS as i32));
        }
        other => panic!("expected TopkMismatch, got {other:?}"),
    }
    // Masking a copy with -1 is allowed.
    let mut ids = ll_ids();
    ids[0] = -1;
    ll_combine_after(ctx, |_| {}, Some(&ids)).expect("a masked copy is skipped");
}

// ---- Errors that keep their values (item 9) ---------------------------------------------------

#[test]
fn gpu_intranode_worst_tokens_exceeded_names_both_counts() {
    let Some(ctxs) = gpus(1) else { return };
    let ctx = &ctxs[0];
    let mut buf = intranode(ctx);
    let mut rng = Rng::new(seed());
    let ids: Vec<i32> = (0..TOKENS * 2).map(|i| (i % 4) as i32).collect();
    let ids = Tensor::from_host(ctx, &ids, &[TOKENS, 2]).unwrap();
    let x = Tensor::from_host(
        ctx,
        &bf16_rows(&mut rng, TOKENS * HIDDEN),
        &[TOKENS, HIDDEN],
    )
    .unwrap();
    let layout = buf.get_dispatch_layout(&ids).unwrap();
    let mut args = DispatchArgs::new(DispatchX::Bf16(&x), &layout, 1);
    args.num_worst_tokens = Some(2);
    let out = buf.dispatch(&args);
    let e = out.err().or_else(|| buf.synchronize().err());
    match e {
        Some(EpError::WorstTokensExceeded {
            rank: 0,
            received,
            worst: 2,
        }) => assert_eq!(received, TOKENS),
        other => panic!("expected WorstTokensExceeded {{ received: 4, worst: 2 }}, got {other:?}"),
    }
}

#[test]
fn gpu_intranode_a_bad_expert_id_is_named_with_its_place() {
    let Some(ctxs) = gpus(1) else { return };
    let ctx = &ctxs[0];
    let mut buf = intranode(ctx);
    let mut ids: Vec<i32> = (0..TOKENS * 2).map(|i| (i % 4) as i32).collect();
    ids[3 * 2 + 1] = -5;
    ids[2] = 9;
    let ids = Tensor::from_host(ctx, &ids, &[TOKENS, 2]).unwrap();
    match buf.get_dispatch_layout(&ids) {
        Err(EpError::ExpertIdOutOfRange {
            op: "dispatch layout",
            id: 9,
            token: 1,
            slot: Some(0),
            count: Some(2),
            num_experts: 4,
            ..
        }) => {}
        other => panic!("expected the first bad id (9, token 1, slot 0) of 2, got {other:?}"),
    }
}

#[test]
fn gpu_ll_a_bad_expert_id_is_named_with_its_place() {
    let Some(ctxs) = gpus(1) else { return };
    let ctx = &ctxs[0];
    let mut buf = low_latency(ctx);
    let inp = ll_inputs(ctx);
    let mut ids = ll_ids();
    ids[5 * LL_TOPK + 1] = 99;
    let ids = Tensor::from_host(ctx, &ids, &[LL_TOKENS, LL_TOPK]).unwrap();
    ibgda_device::cuda::wait_legacy_stream(
        ctx,
        std::time::Duration::from_secs(60),
        "the test's own copies and memsets",
    )
    .expect("the legacy stream");
    let out = buf
        .dispatch(&ll_dispatch_args(&inp.x, &ids))
        .expect("dispatch");
    match buf.synchronize() {
        Err(EpError::ExpertIdOutOfRange {
            op: "low-latency dispatch",
            id: 99,
            token: 5,
            slot: Some(1),
            count: None,
            ..
        }) => {}
        other => panic!("expected ExpertIdOutOfRange(99, token 5, slot 1), got {other:?}"),
    }
    drop(out);
}
