"""A shape-only stand-in for the parts of ``torch`` that ``ep_ibgda.Buffer``'s normal mode uses,
so the routing between the Python layer and the native classes runs on a machine without torch
or a GPU. Tensors carry shape, dtype and device, never data; every operation checks what torch
would (broadcast shapes, equal shapes on ``copy_``, sizes on ``view``) and returns a new one.

``install(monkeypatch)`` puts it in ``sys.modules`` for one test (``ep_ibgda`` imports torch
lazily, inside the calls), and takes it out again after."""

import sys
import types


class dtype:  # noqa: N801 (named as torch's class, which the dtype checks look for)
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"

    __str__ = __repr__


class device:  # noqa: N801
    def __init__(self, type_, index=None):
        self.type, self.index = type_, index

    def __eq__(self, other):
        return (self.type, self.index) == (other.type, other.index)

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


def _broadcast(a, b):
    a, b = tuple(a), tuple(b)
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    for x, y in zip(a, b):
        if not (x == y or x == 1 or y == 1):
            raise RuntimeError(f"shapes {a} and {b} do not broadcast")
    return tuple(max(x, y) for x, y in zip(a, b))


class Tensor:
    _next_ptr = 0x10000

    def __init__(self, shape, dt, dev=None):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dt
        self.device = dev or device("cuda", 0)
        Tensor._next_ptr += 0x100
        self._ptr = Tensor._next_ptr

    def stride(self):
        st, acc = [], 1
        for d in reversed(self.shape):
            st.insert(0, acc)
            acc *= d
        return tuple(st)

    def data_ptr(self):
        return self._ptr

    def dim(self):
        return len(self.shape)

    @property
    def is_cuda(self):
        return self.device.type == "cuda"

    def get_device(self):
        return self.device.index if self.is_cuda else -1

    def is_contiguous(self):
        return True

    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    def _like(self, shape=None, dt=None):
        return Tensor(self.shape if shape is None else shape, dt or self.dtype, self.device)

    def to(self, x):
        return self._like(dt=x if isinstance(x, dtype) else None)

    def long(self):
        return self._like(dt=MODULE.int64)

    def contiguous(self):
        return self

    def record_stream(self, s):
        assert isinstance(s, Stream), f"record_stream({s!r})"

    def copy_(self, src, non_blocking=False):
        if src.shape != self.shape:
            raise RuntimeError(f"copy_ of shape {src.shape} into {self.shape}")
        return self

    def view(self, *a):
        if len(a) == 1 and isinstance(a[0], dtype):
            return self._like(dt=a[0])
        shape = tuple(a[0]) if len(a) == 1 and isinstance(a[0], (tuple, list)) else a
        t = self._like(shape)
        if -1 in shape or t.numel() != self.numel():
            raise RuntimeError(f"view of {self.shape} as {shape}")
        return t

    def transpose(self, a, b):
        s = list(self.shape)
        s[a], s[b] = s[b], s[a]
        return self._like(s)

    def add_(self, other):
        return self

    def unsqueeze(self, d):
        s = list(self.shape)
        s.insert(d if d >= 0 else len(s) + 1 + d, 1)
        return self._like(s)

    def expand(self, *s):
        return self._like(_broadcast(self.shape, s))

    def _reduce(self, dim, dt):
        dim %= len(self.shape)
        return self._like(self.shape[:dim] + self.shape[dim + 1 :], dt)

    def any(self, dim):
        return self._reduce(dim, MODULE.bool)

    def sum(self, dim, dtype=None):
        return self._reduce(dim, dtype)

    def flatten(self):
        return self._like((self.numel(),))

    def scatter_add_(self, dim, index, src):
        return self

    def __getitem__(self, k):
        if not isinstance(k, slice):
            raise NotImplementedError("fake tensors index by row slices only")
        return self._like((len(range(*k.indices(self.shape[0]))),) + self.shape[1:])

    def _op(self, other, dt=None):
        shape = _broadcast(self.shape, other.shape) if isinstance(other, Tensor) else self.shape
        return self._like(shape, dt)

    def _cmp(self, other):
        return self._op(other, MODULE.bool)

    __ge__ = __gt__ = __le__ = __lt__ = __eq__ = _cmp
    __hash__ = object.__hash__

    def __and__(self, other):
        return self._op(other, MODULE.bool)

    def __floordiv__(self, other):
        return self._op(other)

    __mul__ = __sub__ = __add__ = __floordiv__


# What the streams did, in order, for tests of the ordering: ("record", event, stream),
# ("wait", stream, event), ("set", stream). Cleared by `install`.
LOG = []


class Stream:
    def __init__(self, ptr=0):
        self.ptr = ptr
        # torch's stream triple (the raw setter and getter take and return it): the id is the
        # handle here.
        self.stream_id, self.device_index, self.device_type = ptr, 0, 1

    def __repr__(self):
        return f"Stream({self.ptr})"

    def wait_stream(self, s):
        assert isinstance(s, Stream)

    def wait_event(self, e):
        assert isinstance(e, Event)
        LOG.append(("wait", self, e))

    def synchronize(self):
        pass


def handoff(from_ptr, to_ptr):
    """What a fake native buffer's ``comm_after`` / ``caller_after`` log: ``to`` waits for
    ``from`` (raw stream handles), as a recorded event and a wait would."""
    LOG.append(("handoff", from_ptr, to_ptr))


def _get_current_stream(device_index):
    s = MODULE.cuda._current
    return (s.stream_id, s.device_index, s.device_type)


def _set_stream_by_id(stream_id, device_index, device_type):
    _set_stream(Stream(stream_id))


class Event:
    def record(self, s=None):
        assert s is None or isinstance(s, Stream)
        LOG.append(("record", self, s if s is not None else MODULE.cuda.current_stream()))


def _set_stream(s):
    assert isinstance(s, Stream), f"torch.cuda.set_stream({s!r})"
    LOG.append(("set", s))
    MODULE.cuda._current = s


class _StreamContext:
    def __init__(self, s):
        assert isinstance(s, Stream), f"torch.cuda.stream({s!r})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_TYPESTR = {"<i2": "int16", "<f4": "float32", "<i4": "int32", "<i8": "int64", "|u1": "uint8"}


def _build():
    m = types.ModuleType("torch")
    for name in ("int16", "int32", "int64", "float32", "bfloat16", "float8_e4m3fn", "bool", "uint8", "int8"):
        setattr(m, name, dtype(name))
    m.device = device
    m.Tensor = Tensor
    m.where = lambda c, a, b: Tensor(_broadcast(_broadcast(c.shape, a.shape), getattr(b, "shape", ())), a.dtype,
                                     a.device)
    m.full_like = lambda x, v: x._like()
    m.zeros_like = lambda x: x._like()
    m.ones_like = lambda x, dtype=None: x._like(dt=dtype)
    m.arange = lambda n, device=None, dtype=None: Tensor((n,), dtype or m.int64, device)
    m.zeros = lambda shape, dtype=None, device=None: Tensor(shape if isinstance(shape, tuple) else (shape,), dtype, device)
    m.empty = lambda shape, dtype=None, device=None: Tensor(shape, dtype, device)
    m.as_tensor = lambda view, device=None: Tensor(view.shape, getattr(m, _TYPESTR[view.typestr]), device)
    cuda = types.ModuleType("torch.cuda")
    cuda.Stream = Stream
    cuda.ExternalStream = lambda ptr, device=None: Stream(ptr)
    cuda._current = Stream(7)
    cuda.current_stream = lambda device=None: cuda._current
    cuda.stream = _StreamContext
    cuda.set_stream = _set_stream
    cuda.Event = Event
    cuda.current_device = lambda: 0
    cuda.is_available = lambda: True
    m.cuda = cuda
    # The raw stream calls of torch 2.x that ep_ibgda's hot paths use.
    c = types.ModuleType("torch._C")
    c._cuda_getCurrentRawStream = lambda device_index: cuda._current.ptr
    c._cuda_getCurrentStream = _get_current_stream
    c._cuda_setStream = _set_stream_by_id
    m._C = c
    return m


MODULE = _build()


def install(monkeypatch):
    """``torch`` is this fake for the calling test; returns the module."""
    LOG.clear()
    monkeypatch.setattr(MODULE.cuda, "_current", Stream(7))
    monkeypatch.setitem(sys.modules, "torch", MODULE)
    monkeypatch.setitem(sys.modules, "torch.cuda", MODULE.cuda)
    return MODULE
