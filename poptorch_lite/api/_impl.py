"""``poptorch._impl``: the one helper of PopTorch's internals that its tests' helpers (and some
programs) call.

- ``isDispatchTracing()``: whether a model's forward is being captured for the IPU right now
  (PopTorch's dispatcher trace, its "IPUScope"; here PyTorch 2's capture,
  ``poptorch_lite.compiler.export``). Code uses it to make tensors on the ``"ipu"`` device while
  it is captured; the capture takes that device as its own (``BlockAnnotator``).
"""
from __future__ import annotations

from .blocks import active_trace

__all__ = ["isDispatchTracing"]


def isDispatchTracing() -> bool:  # pylint: disable=invalid-name
    """True while a model's forward is being captured in this thread."""
    return active_trace() is not None
