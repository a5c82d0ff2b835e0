"""ep_ibgda: DeepEP's Python API (legacy V1) over the ep-ibgda Rust stack.

``import ep_ibgda as deep_ep`` gives ``Buffer``, ``Config``, ``EventOverlap`` and ``topk_idx_t``;
``ep_ibgda.utils`` has ``EventOverlap`` and ``EventHandle``. torch is imported only when a tensor
operation needs it, so the package imports (and reports argument errors) without torch.
"""

from . import _ep
from .buffer import Buffer
from .config import Config
from .utils import EventHandle, EventOverlap

__version__ = _ep.__version__
__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t"]


def __getattr__(name):
    # `topk_idx_t` is a torch dtype: resolved on first use so that importing needs no torch.
    if name == "topk_idx_t":
        import torch

        return torch.int64
    raise AttributeError(f"module 'ep_ibgda' has no attribute {name!r}")
