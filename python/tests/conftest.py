"""Shared helpers: fake tensors and a one-process object group, so the argument checks run
without torch or a GPU."""

import pytest


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


class _Device:
    def __init__(self, type_, index=None):
        self.type = type_
        self.index = index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


class FakeTensor:
    """Has what the checks read (dtype, shape, stride(), device, data_ptr()); nothing else."""

    def __init__(self, shape, dtype="bfloat16", device="cuda", index=0, strides=None):
        self.shape = tuple(shape)
        self.dtype = _Dtype(dtype)
        self.device = _Device(device, index if device == "cuda" else None)
        if strides is None:
            strides, acc = [], 1
            for d in reversed(self.shape):
                strides.insert(0, acc)
                acc *= d
        self._strides = tuple(strides)

    def stride(self):
        return self._strides

    def data_ptr(self):
        return 0x1000


class OneRankGroup:
    """The object-group protocol Buffer accepts: rank(), size(), all_gather_object, barrier."""

    def __init__(self, size=1, hosts=None):
        self._size = size
        self._hosts = hosts

    def rank(self):
        return 0

    def size(self):
        return self._size

    def all_gather_object(self, obj):
        if self._hosts is not None and isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], str):
            return [(h, obj[1]) for h in self._hosts]
        return [obj] * self._size

    def barrier(self):
        pass


@pytest.fixture
def fake():
    return FakeTensor


@pytest.fixture
def group():
    return OneRankGroup
