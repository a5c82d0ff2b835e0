"""Shared helpers: fake tensors and a one-process object group, so the argument checks run
without torch or a GPU."""

import pytest


class dtype:  # noqa: N801 (named as torch's class, which the dtype checks look for)
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
        self.dtype = globals()["dtype"](dtype)
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

    def __init__(self, size=1, hosts=None, ranks_per_node=None):
        self._size = size
        self._hosts = hosts
        # Every rank's EP_IBGDA_RANKS_PER_NODE, when the test makes them differ.
        self._ranks_per_node = ranks_per_node

    def rank(self):
        return 0

    def size(self):
        return self._size

    def all_gather_object(self, obj):
        if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], str):
            # Buffer's set-up gather: (host, device, EP_IBGDA_RANKS_PER_NODE).
            hosts = self._hosts or [obj[0]] * self._size
            per_node = self._ranks_per_node or [obj[2]] * self._size
            return [(h, obj[1], n) for h, n in zip(hosts, per_node)]
        return [obj] * self._size

    def barrier(self):
        pass


@pytest.fixture
def fake():
    return FakeTensor


@pytest.fixture
def fake_dtype():
    """A stand-in for ``torch.<name>``: ``fake_dtype("int8")``."""
    return dtype


@pytest.fixture
def group():
    return OneRankGroup


# ----- On the GPU machine (EP_IBGDA_REQUIRE_GPU=1): a GPU test that ran no case fails the run.

_GPU_FILE_PREFIX = "test_gpu_"
_gpu_tests = {}  # test function -> cases passed


def _gpu_test_name(nodeid):
    path, _, rest = nodeid.partition("::")
    if not path.rsplit("/", 1)[-1].startswith(_GPU_FILE_PREFIX):
        return None
    return f"{path}::{rest.split('[', 1)[0]}"


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        name = _gpu_test_name(item.nodeid)
        if name is not None:
            _gpu_tests.setdefault(name, 0)


def pytest_runtest_logreport(report):
    name = _gpu_test_name(report.nodeid)
    if name is not None and report.when == "call" and report.passed:
        _gpu_tests[name] = _gpu_tests.get(name, 0) + 1


def pytest_sessionfinish(session, exitstatus):
    import os
    import sys

    if os.environ.get("EP_IBGDA_REQUIRE_GPU") != "1":
        return
    none_ran = sorted(n for n, passed in _gpu_tests.items() if passed == 0)
    if not _gpu_tests:
        sys.stderr.write("NOCASE: no GPU test was collected (EP_IBGDA_REQUIRE_GPU=1)\n")
    for n in none_ran:
        sys.stderr.write(f"NOCASE: {n} passed no case (EP_IBGDA_REQUIRE_GPU=1)\n")
    if (none_ran or not _gpu_tests) and session.exitstatus == 0:
        session.exitstatus = 1
