"""Argument checks on torch tensors that need no torch import (they read ``dtype``, ``shape``,
``stride()`` and ``device``), so they run, and are tested, where torch is absent. Each raises
``TypeError``/``ValueError`` naming the argument and the value, before any launch."""

from typing import Any, Optional, Sequence, Tuple


def dtype_name(t: Any) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(getattr(t, "dtype", type(t).__name__)).replace("torch.", "")


def is_tensor(t: Any) -> bool:
    return all(hasattr(t, a) for a in ("dtype", "shape", "stride", "device", "data_ptr"))


def is_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    expect = 1
    for size, st in zip(reversed(list(shape)), reversed(list(stride))):
        if size != 1 and st != expect:
            return False
        expect *= size
    return True


# dtype object -> its name, for the dtypes seen (torch's are a few singletons; the bound keeps
# stand-ins made per tensor, as the tests' are, from growing it).
_DTYPE_NAMES: dict = {}
_DTYPE_NAMES_MAX = 64


def _fast_dtype_name(d: Any) -> str:
    n = _DTYPE_NAMES.get(d)
    if n is None:
        n = str(d).replace("torch.", "")
        if len(_DTYPE_NAMES) < _DTYPE_NAMES_MAX:
            _DTYPE_NAMES[d] = n
    return n


def tensor(
    name: str,
    t: Any,
    dtypes: Tuple[str, ...],
    ndim: int,
    device: Optional[int],
    shape: Optional[Sequence[Optional[int]]] = None,
) -> Tuple[int, ...]:
    """Checks ``t`` is a contiguous CUDA tensor of one of ``dtypes`` with ``ndim`` dims on GPU
    ``device`` (None: any), matching ``shape`` where it gives a size; returns its shape.

    Every operation checks several tensors, so the common case (all good) is one expression of
    torch's cheapest reads (``is_cuda`` and ``get_device()``, not a ``device`` object; the
    shape as torch's own tuple), no message built; anything off, or an object without those
    reads, goes to the full check, which says what is wrong."""
    try:
        s = t.shape
        if (
            t.is_cuda
            and len(s) == ndim
            and _fast_dtype_name(t.dtype) in dtypes
            and (device is None or t.get_device() == device)
            and (shape is None or _dims_match(s, shape))
            and t.is_contiguous()
        ):
            return s if isinstance(s, tuple) else tuple(s)
    except (AttributeError, TypeError):
        pass
    return _tensor_slow(name, t, dtypes, ndim, device, shape)


def _dims_match(s: Sequence[int], want: Sequence[Optional[int]]) -> bool:
    """Whether shape ``s`` has every size ``want`` gives (None: any)."""
    for have, w in zip(s, want):
        if w is not None and w != have:
            return False
    return True


def _contiguous(t: Any, s: Tuple[int, ...]) -> bool:
    f = getattr(t, "is_contiguous", None)
    if f is not None:
        return bool(f())
    return is_contiguous(s, t.stride())


def _tensor_slow(
    name: str,
    t: Any,
    dtypes: Tuple[str, ...],
    ndim: int,
    device: Optional[int],
    shape: Optional[Sequence[Optional[int]]],
) -> Tuple[int, ...]:
    """[`tensor`]'s full check: raises naming ``name`` and what is wrong."""
    if not is_tensor(t):
        raise TypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
    got = dtype_name(t)
    if got not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(dtypes)}, got {got}")
    s = tuple(int(d) for d in t.shape)
    if len(s) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {list(s)}")
    if shape is not None:
        for i, (have, want) in enumerate(zip(s, shape)):
            if want is not None and have != want:
                raise ValueError(
                    f"{name} has shape {list(s)}, expected "
                    f"{['*' if w is None else w for w in shape]} (dimension {i} is {have}, "
                    f"expected {want})"
                )
    dev = t.device
    if getattr(dev, "type", str(dev)) != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {dev}")
    if device is not None and dev.index is not None and int(dev.index) != device:
        raise ValueError(f"{name} is on cuda:{dev.index}, this buffer uses cuda:{device}")
    if not _contiguous(t, s):
        raise ValueError(
            f"{name} must be contiguous (row-major), got shape {list(s)} with strides "
            f"{list(t.stride())}: call .contiguous()"
        )
    return s


def positive_int(name: str, v: Any, minimum: int = 1) -> int:
    """``v`` when it is an int (not a bool) >= ``minimum``, else ``ValueError`` naming ``name``."""
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


def flag(name: str, v: Any) -> bool:
    """``v`` when it is a bool, else ``TypeError`` naming ``name``."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r}")
    return v


# Bytes per element of the torch dtypes a buffer view may take (by name, so the check needs no
# torch import).
_DTYPE_BYTES = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4,
    "int64": 8, "uint64": 8, "float64": 8,
}


def dtype_name_of(dtype: Any) -> str:
    """``torch.int8`` -> ``int8``."""
    return str(dtype).replace("torch.", "")


def dtype_bytes(name: str, dtype: Any) -> int:
    """Bytes per element of the torch dtype ``dtype`` (``TypeError`` naming ``name`` otherwise)."""
    if type(dtype).__name__ != "dtype" or dtype_name_of(dtype) not in _DTYPE_BYTES:
        raise TypeError(
            f"{name} must be a torch dtype ({', '.join('torch.' + n for n in _DTYPE_BYTES)}), got {dtype!r}"
        )
    return _DTYPE_BYTES[dtype_name_of(dtype)]


def shape(name: str, size: Any) -> Tuple[int, ...]:
    """``size`` (an int, or a ``torch.Size`` / tuple / list of ints >= 0) as a tuple."""
    dims = (size,) if isinstance(size, int) and not isinstance(size, bool) else size
    try:
        out = tuple(dims)
    except TypeError:
        raise TypeError(f"{name} must be a torch.Size, a tuple of ints or an int, got {size!r}") from None
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in out):
        raise ValueError(f"{name} must have ints >= 0 as dimensions, got {size!r}")
    return out
