"""``poptorch._impl``: the helpers of PopTorch's internal module that applications and PopTorch's
own test helpers call.

- ``isDispatchTracing()``: whether a model's forward is being captured for the IPU right now
  (PopTorch's dispatcher trace, its "IPUScope"; here PyTorch 2's capture,
  ``poptorch_lite.compiler.export``). Code uses it to make tensors on the ``"ipu"`` device while
  it is captured; the capture takes that device as its own (``BlockAnnotator``).
- ``unwrapModelIfNecessary`` / ``rewrapModelIfNecessary``: run a model that a compiled model
  wraps as a plain module for a while (on the CPU, for generation: optimum-graphcore's Seq2Seq
  trainer) and wrap it again afterwards.
- ``_restoreWrapperIfNecessary``: what a model a training model wraps is rebuilt with when it is
  loaded (``torch.load``) or copied: the user's own class with the trained weights, since the
  wrapper class belongs to the compiled model of the process that saved it (PopTorch's rule: a
  loaded model is wrapped again when it is passed to ``trainingModel``). Only wrapped models are
  saved through it; a state dict holds plain tensors and is loaded without it.
"""
from __future__ import annotations

import torch

from .api.blocks import active_trace

__all__ = ["isDispatchTracing", "rewrapModelIfNecessary", "unwrapModelIfNecessary", "_restoreWrapperIfNecessary"]


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


def _restoreWrapperIfNecessary(cls: type, state: dict) -> torch.nn.Module:  # pylint: disable=invalid-name
    """A saved or copied wrapped model, rebuilt as the user's class `cls` from its `state`."""
    module = cls.__new__(cls)
    module.__setstate__(state)
    return module
