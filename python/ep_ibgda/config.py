"""DeepEP's ``Config``: chunk sizes of the normal kernels and the buffer-size hints.

Our intranode kernels do not chunk: they use ``num_sms`` (thread blocks) and take the chunk
fields as given (validated as DeepEP validates them). The size hints are DeepEP's formulas, so
callers that size ``num_nvl_bytes`` / ``num_rdma_bytes`` from them get the same numbers;
``Buffer`` turns those bytes into its own shape limits (see ``Buffer``).
"""

NUM_MAX_NVL_PEERS = 8
_MAX_TOPK = 128
_MAX_SCALES = 128
# DeepEP's internode SourceMeta: two int32.
_SOURCE_META_BYTES = 8


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class Config:
    """Kernel tuning for normal-mode dispatch/combine (DeepEP's ``deep_ep.Config``)."""

    def __init__(
        self,
        num_sms: int = 20,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        values = {
            "num_sms": num_sms,
            "num_max_nvl_chunked_send_tokens": num_max_nvl_chunked_send_tokens,
            "num_max_nvl_chunked_recv_tokens": num_max_nvl_chunked_recv_tokens,
            "num_max_rdma_chunked_send_tokens": num_max_rdma_chunked_send_tokens,
            "num_max_rdma_chunked_recv_tokens": num_max_rdma_chunked_recv_tokens,
        }
        for name, v in values.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"Config: {name} must be an int, got {v!r}")
        if num_sms < 0:
            raise ValueError(f"Config: num_sms must be >= 0, got {num_sms}")
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "Config: need 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "
                f"got {num_max_nvl_chunked_send_tokens} and {num_max_nvl_chunked_recv_tokens}"
            )
        if num_max_rdma_chunked_send_tokens <= 0 or num_max_rdma_chunked_recv_tokens <= 0:
            raise ValueError(
                "Config: num_max_rdma_chunked_send_tokens and num_max_rdma_chunked_recv_tokens "
                f"must be positive, got {num_max_rdma_chunked_send_tokens} and "
                f"{num_max_rdma_chunked_recv_tokens}"
            )
        # As DeepEP: the RDMA receive ring is rounded up to whole send chunks, and a sender
        # must always find room for a chunk.
        recv = _align(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        if num_max_rdma_chunked_send_tokens > recv // 2:
            raise ValueError(
                "Config: num_max_rdma_chunked_send_tokens "
                f"{num_max_rdma_chunked_send_tokens} must be at most half of "
                f"num_max_rdma_chunked_recv_tokens ({recv})"
            )
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer size for rows of ``hidden_bytes`` among ``num_ranks`` ranks."""
        if not (num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0):
            raise ValueError(
                f"get_nvl_buffer_size_hint: num_ranks {num_ranks} must be below "
                f"{NUM_MAX_NVL_PEERS} or a multiple of it"
            )
        if num_ranks > NUM_MAX_NVL_PEERS and self.num_sms % 2 != 0:
            raise ValueError(f"get_nvl_buffer_size_hint: num_sms {self.num_sms} must be even")
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        channels = self.num_sms // 2
        slots = channels * nvl_ranks * self.num_max_nvl_chunked_recv_tokens
        n = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        n += slots * hidden_bytes
        n += slots * _SOURCE_META_BYTES
        n += slots * _MAX_TOPK * 8
        n += slots * _MAX_TOPK * 4
        n += slots * _MAX_SCALES * 4
        return _align(n, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer size; 0 within one node (``num_ranks <= 8``)."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        if num_ranks % NUM_MAX_NVL_PEERS != 0:
            raise ValueError(
                f"get_rdma_buffer_size_hint: num_ranks {num_ranks} must be a multiple of "
                f"{NUM_MAX_NVL_PEERS}"
            )
        if self.num_sms % 2 != 0:
            raise ValueError(f"get_rdma_buffer_size_hint: num_sms {self.num_sms} must be even")
        rdma_ranks = num_ranks // NUM_MAX_NVL_PEERS
        channels = self.num_sms // 2
        slots = channels * rdma_ranks * self.num_max_rdma_chunked_recv_tokens
        n = channels * rdma_ranks * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        n += slots * hidden_bytes * 2
        n += slots * _SOURCE_META_BYTES * 2
        n += slots * _MAX_TOPK * 8 * 2
        n += slots * _MAX_TOPK * 4 * 2
        n += slots * _MAX_SCALES * 4 * 2
        n += slots * 16 * 2
        n += 1 << 20
        return _align(n, 128)

    def __repr__(self) -> str:
        return (
            f"Config(num_sms={self.num_sms}, "
            f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
            f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
            f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
            f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})"
        )


# DeepEP's tuned tables: ranks -> (nvl send, nvl recv, rdma send, rdma recv).
_DISPATCH = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}


def _table_config(table: dict, what: str, num_ranks: int, num_sms: int) -> Config:
    if num_ranks not in table:
        raise ValueError(
            f"{what}: unsupported number of EP ranks: {num_ranks} (DeepEP's table has "
            f"{sorted(table)})"
        )
    return Config(num_sms, *table[num_ranks])
