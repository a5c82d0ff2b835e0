"""Events that order the caller's streams against communication (DeepEP's ``deep_ep.utils``)."""

from typing import Any, Optional, Tuple


class EventHandle:
    """A CUDA event recorded on the current stream when created (``EventHandle()``), as DeepEP's.

    ``current_stream_wait()`` makes the caller's current stream wait for it (on the GPU).
    """

    def __init__(self) -> None:
        import torch

        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream())

    @classmethod
    def _recorded_on(cls, stream: Any) -> "EventHandle":
        """An event recorded at the current end of ``stream`` (a ``torch.cuda.Stream``)."""
        import torch

        handle = cls.__new__(cls)
        handle.event = torch.cuda.Event()
        handle.event.record(stream)
        return handle

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event."""
        import torch

        torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """An event plus the tensors that must stay alive until it has passed (DeepEP's class).

    Used as a context manager, the current stream waits for the event on exit.
    """

    def __init__(
        self,
        event: Optional[EventHandle] = None,
        extra_tensors: Optional[Tuple[Any, ...]] = None,
    ) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the event (which must exist)."""
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: this EventOverlap has no event")
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
