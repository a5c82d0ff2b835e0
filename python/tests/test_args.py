"""Bad arguments raise a Python exception naming the argument, before any launch; missing
features raise NotImplementedError naming the feature. Runs without torch and without a GPU: the
tensors are fakes with the attributes the checks read, the group a one-process object group."""

import pytest

from ep_ibgda import Buffer, Config, EventOverlap

T, H, K, E = 8, 256, 2, 4


def make(group, **kw):
    return Buffer(group(), int(1e8), 0, **kw)


def test_constructor_checks(group):
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        Buffer(group(), -1)
    with pytest.raises(TypeError, match="low_latency_mode"):
        Buffer(group(), 0, 0, low_latency_mode=1)
    assert Buffer(group(), 0, 0, enable_shrink=True).enable_shrink
    with pytest.raises(NotImplementedError, match="use_fabric"):
        Buffer(group(), 0, 0, use_fabric=True)
    with pytest.raises(ValueError, match="group"):
        Buffer(None, 0, 0)
    b = make(group, allow_mnnvl=True, num_qps_per_rank=8)
    assert (b.rank, b.group_size, b.num_nvl_bytes, b.num_rdma_bytes, b.low_latency_mode) == (0, 1, int(1e8), 0, False)


def test_mpi_style_comm():
    class Comm:
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 1

        def allgather(self, obj):
            return [obj]

        def Barrier(self):
            pass

    b = Buffer(None, 0, 0, comm=Comm())
    assert b.group_size == 1 and b.group is None


def test_layout_argument_errors(group, fake):
    b = make(group)
    with pytest.raises(TypeError, match="topk_idx must have dtype int64"):
        b.get_dispatch_layout(fake((T, K), "float32"), E)
    with pytest.raises(ValueError, match="topk_idx must have 2 dimensions"):
        b.get_dispatch_layout(fake((T,), "int64"), E)
    with pytest.raises(ValueError, match="topk_idx must be on a CUDA device"):
        b.get_dispatch_layout(fake((T, K), "int64", device="cpu"), E)
    with pytest.raises(ValueError, match="topk_idx must be contiguous"):
        b.get_dispatch_layout(fake((T, K), "int64", strides=(1, T)), E)
    with pytest.raises(ValueError, match="num_experts"):
        b.get_dispatch_layout(fake((T, K), "int64"), 0)
    with pytest.raises(TypeError, match="topk_idx must be a torch tensor"):
        b.get_dispatch_layout([[0, 1]], E)
    with pytest.raises(ValueError, match="allocate_on_comm_stream"):
        b.get_dispatch_layout(fake((T, K), "int64"), E, allocate_on_comm_stream=True)
    with pytest.raises(TypeError, match="previous_event"):
        b.get_dispatch_layout(fake((T, K), "int64"), E, previous_event=object())


def layout(fake, ranks=1):
    return dict(
        num_tokens_per_rank=fake((ranks,), "int32"),
        is_token_in_rank=fake((T, ranks), "bool"),
        num_tokens_per_expert=fake((E,), "int32"),
        topk_idx=fake((T, K), "int64"),
        topk_weights=fake((T, K), "float32"),
    )


def test_dispatch_argument_errors(group, fake):
    b = make(group)
    x = fake((T, H), "bfloat16")
    with pytest.raises(TypeError, match="x must have dtype bfloat16, got float16"):
        b.dispatch(fake((T, H), "float16"), **layout(fake))
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        b.dispatch(fake((T, H, 1)), **layout(fake))
    with pytest.raises(ValueError, match="x must be contiguous"):
        b.dispatch(fake((T, H), strides=(1, T)), **layout(fake))
    with pytest.raises(ValueError, match="x: hidden 4 gives rows of 8 bytes"):
        b.dispatch(fake((T, 4)), **layout(fake))
    with pytest.raises(TypeError, match=r"x\[1\] must have dtype float32"):
        b.dispatch((fake((T, H), "float8_e4m3fn"), fake((T, H // 128), "bfloat16")), **layout(fake))
    with pytest.raises(ValueError, match=r"x\[1\] has shape \[8, 3\], expected \[8, 2\]"):
        b.dispatch((fake((T, H), "float8_e4m3fn"), fake((T, 3), "float32")), **layout(fake))
    with pytest.raises(ValueError, match=r"x\[0\]: FP8 hidden 200"):
        b.dispatch((fake((T, 200), "float8_e4m3fn"), fake((T, 1), "float32")), **layout(fake))
    bad = layout(fake)
    bad["is_token_in_rank"] = fake((T + 1, 1), "bool")
    with pytest.raises(ValueError, match="is_token_in_rank has shape"):
        b.dispatch(x, **bad)
    bad = layout(fake)
    bad["num_tokens_per_rank"] = fake((1,), "int64")
    with pytest.raises(TypeError, match="num_tokens_per_rank must have dtype int32"):
        b.dispatch(x, **bad)
    bad = layout(fake)
    bad["topk_weights"] = fake((T, K + 1), "float32")
    with pytest.raises(ValueError, match="topk_weights has shape"):
        b.dispatch(x, **bad)
    bad = layout(fake)
    del bad["topk_weights"]
    with pytest.raises(ValueError, match="topk_idx and topk_weights go together"):
        b.dispatch(x, **bad)
    bad = layout(fake)
    del bad["is_token_in_rank"]
    with pytest.raises(ValueError, match="needs is_token_in_rank"):
        b.dispatch(x, **bad)
    with pytest.raises(ValueError, match="expert_alignment"):
        b.dispatch(x, expert_alignment=0, **layout(fake))
    with pytest.raises(ValueError, match="num_worst_tokens"):
        b.dispatch(x, num_worst_tokens=-1, **layout(fake))
    bad = layout(fake)
    del bad["topk_weights"], bad["topk_idx"]
    with pytest.raises(ValueError, match="num_worst_tokens > 0 needs topk_idx"):
        b.dispatch(x, num_worst_tokens=16, **bad)
    with pytest.raises(TypeError, match="config must be a Config"):
        b.dispatch(x, config={"num_sms": 20}, **layout(fake))
    with pytest.raises(TypeError, match="handle must be the handle"):
        b.dispatch(x, handle=("not", "ours"))
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank is for a group that spans several nodes"):
        b.dispatch(x, num_tokens_per_rdma_rank=fake((1,), "int32"), **layout(fake))


def test_wrong_gpu_is_named(group, fake):
    b = make(group)
    b._device = 0
    with pytest.raises(ValueError, match="x is on cuda:1, this buffer uses cuda:0"):
        b.dispatch(fake((T, H), index=1), **layout(fake))


def test_combine_argument_errors(group, fake):
    b = make(group)
    with pytest.raises(TypeError, match="handle must be the handle"):
        b.combine(fake((T, H)), None)


def test_low_latency_argument_errors(group, fake):
    normal = make(group)
    x, idx = fake((T, H)), fake((T, K), "int64")
    with pytest.raises(RuntimeError, match="low_latency_mode=True"):
        normal.low_latency_dispatch(x, idx, 128, E)
    b = Buffer(group(), 0, int(1e9), low_latency_mode=True)
    with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank 4"):
        b.low_latency_dispatch(x, idx, 4, E)
    with pytest.raises(TypeError, match="x must have dtype bfloat16"):
        b.low_latency_dispatch(fake((T, H), "float32"), idx, 128, E)
    with pytest.raises(ValueError, match="topk_idx has shape"):
        b.low_latency_dispatch(x, fake((T + 1, K), "int64"), 128, E)
    with pytest.raises(ValueError, match="use_ue8m0=True needs round_scale=True"):
        b.low_latency_dispatch(x, idx, 128, E, use_ue8m0=True)
    with pytest.raises(ValueError, match="exclude each other"):
        b.low_latency_dispatch(x, idx, 128, E, async_finish=True, return_recv_hook=True)
    with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats has shape"):
        b.low_latency_dispatch(x, idx, 128, E, cumulative_local_expert_recv_stats=fake((E + 1,), "int32"))
    with pytest.raises(ValueError, match="dispatch_wait_recv_cost_stats has shape"):
        b.low_latency_dispatch(x, idx, 128, E, dispatch_wait_recv_cost_stats=fake((2,), "int64"))
    with pytest.raises(TypeError, match="dispatch_wait_recv_cost_stats must have dtype int64"):
        b.low_latency_dispatch(x, idx, 128, E, dispatch_wait_recv_cost_stats=fake((1,), "int32"))
    with pytest.raises(ValueError, match="use_logfmt and zero_copy"):
        b.low_latency_combine(x, idx, fake((T, K), "float32"), None, use_logfmt=True, zero_copy=True)
    with pytest.raises(TypeError, match="use_logfmt must be a bool"):
        b.low_latency_combine(x, idx, fake((T, K), "float32"), None, use_logfmt=1)
    with pytest.raises(TypeError, match="handle must be the handle"):
        b.low_latency_combine(x, idx, fake((T, K), "float32"), None)
    with pytest.raises(ValueError, match="num_experts"):
        b.clean_low_latency_buffer(128, H, 0)
    b.clean_low_latency_buffer(128, H, E)


def test_masks_need_enable_shrink_and_a_rank_in_range(group, fake):
    b = make(group)
    for call in (
        lambda: b.low_latency_update_mask_buffer(0, True),
        lambda: b.low_latency_query_mask_buffer(fake((1,), "int32")),
        lambda: b.low_latency_clean_mask_buffer(),
    ):
        with pytest.raises(RuntimeError, match="enable_shrink=True"):
            call()
    s = Buffer(group(), 0, int(1e9), low_latency_mode=True, enable_shrink=True)
    # Before the first low-latency call the masks are kept on the host.
    s.low_latency_update_mask_buffer(0, True)
    assert s._pending_mask == [1]
    s.low_latency_clean_mask_buffer()
    assert s._pending_mask == [0]
    with pytest.raises(ValueError, match="rank_to_mask"):
        s.low_latency_update_mask_buffer(1, True)
    with pytest.raises(TypeError, match="mask must be a bool"):
        s.low_latency_update_mask_buffer(0, 1)
    with pytest.raises(ValueError, match="mask_status has shape"):
        s.low_latency_query_mask_buffer(fake((2,), "int32"))
    with pytest.raises(TypeError, match="mask_status must have dtype int32"):
        s.low_latency_query_mask_buffer(fake((1,), "int64"))


def test_missing_features_are_named(group, fake):
    # The core's internode buffer takes at most 8 ranks; hosts must be blocks of ranks.
    sixteen = Buffer(group(16, hosts=["a"] * 8 + ["b"] * 8), int(1e8), int(1e9))
    with pytest.raises(NotImplementedError, match="internode normal mode over 16 ranks .* at most 8 ranks"):
        sixteen.dispatch(fake((T, H)), **layout(fake, 16))
    interleaved = Buffer(group(4, hosts=["a", "b", "a", "b"]), int(1e8), int(1e9))
    with pytest.raises(NotImplementedError, match="not blocks of consecutive ranks"):
        interleaved.combine(fake((T, H)), None)
    with pytest.raises(NotImplementedError, match=r"not blocks .*\(get_dispatch_layout\)"):
        interleaved.get_dispatch_layout(fake((T, K), "int64"), E)


def test_normal_mode_rank_masks(group, fake):
    # Masks apply to normal mode too: kept on the host until the intranode buffer is built.
    b = Buffer(group(2), int(1e8), enable_shrink=True)
    b.low_latency_update_mask_buffer(1, True)
    assert b._pending_mask == [0, 1]
    with pytest.raises(ValueError, match="cannot mask itself"):
        b.low_latency_update_mask_buffer(0, True)
    b.low_latency_update_mask_buffer(0, False)
    with pytest.raises(ValueError, match="mask_status has shape"):
        b.low_latency_query_mask_buffer(fake((1,), "int32"))
    # Normal-mode calls no longer refuse a masked rank (the intranode kernels honour masks).
    assert b._normal_mode("dispatch") is False
    b.low_latency_clean_mask_buffer()
    assert b._pending_mask == [0, 0]
    # A low-latency Buffer may mask itself (low-latency masks can name any rank).
    s = Buffer(group(), int(1e8), int(1e9), low_latency_mode=True, enable_shrink=True)
    s.low_latency_update_mask_buffer(0, True)
    assert s._pending_mask == [1]
    assert s._normal_mode("dispatch") is False
    s.low_latency_clean_mask_buffer()
    assert s._pending_mask == [0]
    # Internode normal mode has no rank masks: refused while one is set.
    two_hosts = Buffer(group(2, hosts=["a", "b"]), int(1e8), enable_shrink=True)
    two_hosts.low_latency_update_mask_buffer(1, True)
    with pytest.raises(NotImplementedError, match=r"rank masks in internode normal mode \(dispatch while ranks \[1\]"):
        two_hosts.dispatch(fake((T, H)), **layout(fake, 2))


def test_local_buffer_tensor_arguments(group, fake_dtype):
    b = make(group)
    with pytest.raises(TypeError, match="dtype must be a torch dtype"):
        b.get_local_buffer_tensor("int8")
    with pytest.raises(TypeError, match="dtype must be a torch dtype"):
        b.get_local_buffer_tensor(fake_dtype("complex64"))
    with pytest.raises(ValueError, match="offset must be an int >= 0"):
        b.get_local_buffer_tensor(fake_dtype("int8"), offset=-1)
    with pytest.raises(TypeError, match="use_rdma_buffer must be a bool"):
        b.get_local_buffer_tensor(fake_dtype("int8"), use_rdma_buffer=1)
    with pytest.raises(TypeError, match="size must be a torch.Size"):
        b.get_local_buffer_tensor(fake_dtype("int8"), size=2.5)
    with pytest.raises(ValueError, match="size must have ints >= 0"):
        b.get_local_buffer_tensor(fake_dtype("int8"), size=(2, -1))
    with pytest.raises(ValueError, match="offset 2 is not a multiple of float32's 4 bytes"):
        b.get_local_buffer_tensor(fake_dtype("float32"), offset=2)
    # The native buffers are built by the first call that needs them.
    with pytest.raises(RuntimeError, match="NVLink .* built at the first dispatch"):
        b.get_local_buffer_tensor(fake_dtype("int8"), size=(4, 4))
    with pytest.raises(RuntimeError, match="RDMA .* built at the first low_latency_dispatch"):
        b.get_local_buffer_tensor(fake_dtype("int8"), use_rdma_buffer=True)


def test_destroy(group):
    with pytest.raises(RuntimeError, match="explicitly_destroy=True"):
        make(group).destroy()
    b = make(group, explicitly_destroy=True)
    b.destroy()
    with pytest.raises(RuntimeError, match="after destroy"):
        b.clean_low_latency_buffer(128, H, E)


def test_event_overlap_without_event():
    e = EventOverlap(None)
    with e:
        pass
    with pytest.raises(RuntimeError, match="no event"):
        e.current_stream_wait()
    assert EventOverlap(None, extra_tensors=(1, 2)).extra_tensors == (1, 2)


def test_config_type_errors():
    with pytest.raises(TypeError, match="num_sms must be an int"):
        Config(num_sms=2.5)


def test_native_buffers_without_a_driver_fail_cleanly():
    from ep_ibgda import _ep

    if _ep.cuda_driver_present():
        pytest.skip("a CUDA driver is present: this checks the machine without one")
    with pytest.raises(RuntimeError, match="rank 0: GPU 0: the CUDA driver"):
        _ep.Intranode(0, 0, 1, lambda b: [b], lambda: None, 16, 256, 4, 4, 2, 1.0)
    with pytest.raises(RuntimeError, match="rank 0: GPU 0: the CUDA driver"):
        _ep.LowLatency(0, 0, 1, lambda b: [b], lambda: None, 16, 256, 4, 4, True, 1.0)
    with pytest.raises(RuntimeError, match="rank 0: GPU 0: the CUDA driver"):
        _ep.Internode(0, 0, 2, lambda b: [b, b], lambda: None, 2, 1, True, 16, 256, 4, 4, 2, 1.0)


def test_internode_topology_is_checked_before_the_gpu():
    from ep_ibgda import _ep

    with pytest.raises(ValueError, match="ranks_per_node 9 is outside 1..=8"):
        _ep.Internode(0, 0, 18, lambda b: [b], lambda: None, 2, 9, True, 16, 256, 4, 4, 2, 1.0)


# ----- Internode routing (no torch, no GPU: fakes and a one-process object group) -------------

RPN = "EP_IBGDA_RANKS_PER_NODE"


def test_node_split_from_hosts_and_the_environment(group, monkeypatch):
    monkeypatch.delenv(RPN, raising=False)
    one = Buffer(group(4), int(1e8))
    assert (one._nodes, one._ranks_per_node, one._split_refusal) == (1, 4, None)
    hosts = Buffer(group(4, hosts=["a", "a", "b", "b"]), int(1e8), int(1e9))
    assert (hosts._nodes, hosts._ranks_per_node, hosts._virtual_nodes) == (2, 2, False)
    monkeypatch.setenv(RPN, "1")
    v = Buffer(group(2), int(1e8), int(1e9))
    assert (v._nodes, v._ranks_per_node, v._virtual_nodes, v._split_refusal) == (2, 1, True, None)
    monkeypatch.setenv(RPN, "2")
    v = Buffer(group(4), int(1e8), int(1e9))
    assert (v._nodes, v._ranks_per_node, v._virtual_nodes) == (2, 2, True)
    # As many ranks per node as the group: one node, intranode.
    monkeypatch.setenv(RPN, "4")
    assert Buffer(group(4), int(1e8))._nodes == 1


def test_ranks_per_node_errors(group, monkeypatch):
    for value, match in (
        ("two", "EP_IBGDA_RANKS_PER_NODE='two' is not an integer"),
        ("3", "EP_IBGDA_RANKS_PER_NODE=3: virtual nodes need 1..8 ranks each, dividing the group's 4 ranks"),
        ("0", "virtual nodes need 1..8"),
        ("16", "virtual nodes need 1..8"),
    ):
        monkeypatch.setenv(RPN, value)
        with pytest.raises(ValueError, match=match):
            Buffer(group(4), int(1e8))
    monkeypatch.setenv(RPN, "1")
    with pytest.raises(ValueError, match="splits one host into virtual nodes, and the group spans 2 hosts"):
        Buffer(group(2, hosts=["a", "b"]), int(1e8))
    monkeypatch.delenv(RPN)
    with pytest.raises(ValueError, match=r"differs between the ranks \(by rank: \['1', None\]\)"):
        Buffer(group(2, ranks_per_node=["1", None]), int(1e8))


def test_internode_layout_and_dispatch_argument_errors(group, fake, monkeypatch):
    monkeypatch.setenv(RPN, "1")
    b = Buffer(group(2), int(1e8), int(1e9))
    x = fake((T, H))
    lay = layout(fake, 2)
    with pytest.raises(TypeError, match="num_tokens_per_rdma_rank must have dtype int32"):
        b.dispatch(x, num_tokens_per_rdma_rank=fake((2,), "int64"), **lay)
    with pytest.raises(ValueError, match=r"num_tokens_per_rdma_rank has shape \[1\], expected \[2\]"):
        b.dispatch(x, num_tokens_per_rdma_rank=fake((1,), "int32"), **lay)
    with pytest.raises(ValueError, match="is_token_in_rank has shape"):
        b.dispatch(x, **dict(lay, is_token_in_rank=fake((T, 1), "bool")))
    with pytest.raises(ValueError, match="num_worst_tokens > 0 needs topk_idx"):
        b.dispatch(x, num_worst_tokens=4, **{k: v for k, v in lay.items() if not k.startswith("topk")})
    with pytest.raises(ValueError, match=r"x\[0\]: FP8 hidden 200"):
        b.dispatch((fake((T, 200), "float8_e4m3fn"), fake((T, 1), "float32")), **lay)
    with pytest.raises(TypeError, match=r"handle must be .* \(an internode one here\)"):
        b.dispatch(x, handle=("not", "ours"))
    with pytest.raises(TypeError, match=r"handle must be .* \(an internode one here\)"):
        b.combine(x, None)
    # The layout checks run before any torch call.
    with pytest.raises(TypeError, match="topk_idx must have dtype int64"):
        b.get_dispatch_layout(fake((T, K), "float32"), E)
    with pytest.raises(ValueError, match="num_experts 3 is not a multiple of the 2 ranks"):
        b.get_dispatch_layout(fake((T, K), "int64"), 3)


def test_internode_needs_rdma_bytes(group, fake, monkeypatch):
    # Checked before the native buffer is built (no collective, no GPU).
    monkeypatch.setenv(RPN, "1")
    b = Buffer(group(2), int(1e8), 0)
    with pytest.raises(ValueError, match=r"spans 2 nodes \(2 x 1 ranks\).*num_rdma_bytes > 0.*num_rdma_bytes >= \d+"):
        b.dispatch(fake((T, H)), **layout(fake, 2))


def test_a_handle_of_the_other_mode_is_refused(group, fake, monkeypatch):
    from ep_ibgda.buffer import _InternodeHandle, _IntranodeHandle

    class Native:
        num_rows = 3

    monkeypatch.setenv(RPN, "1")
    inter = Buffer(group(2), int(1e8), int(1e9))
    foreign = _IntranodeHandle(Native(), T, H, inter._id)
    with pytest.raises(TypeError, match="an internode one here"):
        inter.combine(fake((3, H)), foreign)
    monkeypatch.delenv(RPN)
    intra = Buffer(group(2), int(1e8))
    h = _InternodeHandle(Native(), "in_rank", T, H, intra._id)
    with pytest.raises(TypeError, match="an intranode one here"):
        intra.dispatch(fake((T, H)), handle=h)


def test_internode_handle_is_a_deepep_sized_tuple():
    from ep_ibgda.buffer import _InternodeHandle

    class Native:
        num_rows = 5

    h = _InternodeHandle(Native(), "in_rank", 7, H, 1)
    assert isinstance(h, tuple) and len(h) == 10
    assert h[0] == "in_rank" and all(v is None for v in h[1:])
    assert (h.num_tokens, h.num_rows, h.hidden) == (7, 5, H)


def test_node_split_refusals():
    from ep_ibgda.buffer import _node_split

    assert _node_split(["a"] * 8, [None] * 8) == (1, 8, False, None)
    assert _node_split(["a", "a", "b", "b"], [None] * 4) == (2, 2, False, None)
    assert _node_split(["a"] * 4, ["2"] * 4) == (2, 2, True, None)
    nodes, rpn, virtual, why = _node_split(["a"] * 16, [None] * 16)
    assert (nodes, rpn) == (2, 8) and "at most 8 ranks" in why
    _, _, _, why = _node_split(["a", "b", "b"], [None] * 3)
    assert "not blocks of consecutive ranks" in why


def test_internode_bytes_are_paid_by_both_budgets():
    from ep_ibgda import _ep

    nvl, rdma = _ep.internode_bytes(2, 2, 128, H, 16, 8, 4)
    assert nvl > 0 and rdma > 0
    nvl2, rdma2 = _ep.internode_bytes(2, 2, 256, H, 16, 8, 4)
    assert nvl2 > nvl and rdma2 > rdma
    # Out-of-range topologies and overflowing sizes give None.
    assert _ep.internode_bytes(2, 9, 128, H, 16, 8, 4) is None
    assert _ep.internode_bytes(2, 2, 1 << 62, H, 16, 8, 4) is None
