"""`poptorch._impl`: the two functions of PopTorch's internal module that applications import
(optimum-graphcore's Seq2Seq trainer), to run a model that a compiled model wraps as a plain
module for a while (on the CPU, for generation) and wrap it again afterwards."""
from __future__ import annotations

import torch


def unwrapModelIfNecessary(model: torch.nn.Module) -> None:  # pylint: disable=invalid-name
    """Give `model`, its parameters and buffers back their own classes (the trained weights copied
    to the host first); a model no compiled model wraps is left as it is."""
    from .runtime.executor import unwrap_model
    unwrap_model(model)


def rewrapModelIfNecessary(model: torch.nn.Module) -> None:  # pylint: disable=invalid-name
    """Wrap `model` again for the compiled model that wrapped it before `unwrapModelIfNecessary`."""
    from .runtime.executor import rewrap_model
    rewrap_model(model)
