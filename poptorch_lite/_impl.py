"""``poptorch._impl``: the helpers of PopTorch's internal module that applications and PopTorch's
own test helpers call.

- ``isDispatchTracing()``: whether a model's forward is being captured for the IPU right now
  (PopTorch's dispatcher trace, its "IPUScope"; here PyTorch 2's capture,
  ``poptorch_lite.compiler.export``). Code uses it to make tensors on the ``"ipu"`` device while
  it is captured; the capture takes that device as its own (``BlockAnnotator``).
- ``unwrapModelIfNecessary`` / ``rewrapModelIfNecessary``: run a model that a compiled model
  wraps as a plain module for a while (on the CPU, for generation: optimum-graphcore's Seq2Seq
  trainer) and wrap it again afterwards.
"""
from __future__ import annotations

import torch

from .api.blocks import active_trace

__all__ = ["isDispatchTracing", "rewrapModelIfNecessary", "unwrapModelIfNecessary"]


def isDispatchTracing() -> bool:  # pylint: disable=invalid-name
    """True while a model's forward is being captured in this thread."""
    return active_trace() is not None


def unwrapModelIfNecessary(model: torch.nn.Module) -> None:  # pylint: disable=invalid-name
    """Give `model`, its parameters and buffers back their own classes (the trained weights copied
    to the host first); a model no compiled model wraps is left as it is."""
    from .runtime.executor import unwrap_model  # pylint: disable=import-outside-toplevel
    unwrap_model(model)


def rewrapModelIfNecessary(model: torch.nn.Module) -> None:  # pylint: disable=invalid-name
    """Wrap `model` again for the compiled model that wrapped it before `unwrapModelIfNecessary`."""
    from .runtime.executor import rewrap_model  # pylint: disable=import-outside-toplevel
    rewrap_model(model)
