"""PopTorch's extra ops usable inside a model: they trace as single ops and run eagerly on the CPU too
(where `ipu_print_tensor` and `set_available_memory` are identities: they act on the device)."""
from __future__ import annotations

import dataclasses
import numbers

import torch
from torch.overrides import handle_torch_function, has_torch_function_unary

from .errors import Error
from .printing import PrintFormat

REDUCTIONS = ("sum", "mean", "none")


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark `x` as the model's loss; `reduction` ('sum', 'mean' or 'none') reduces it first."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"identity_loss reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if has_torch_function_unary(x):  # captured: one torch function of its own
        return handle_torch_function(identity_loss, (x,), x, reduction)
    if reduction == "sum":
        return x.sum()
    if reduction == "mean":
        return x.mean()
    return x


def ipu_print_tensor(tensor: torch.Tensor, title: str = "", print_gradient: bool = True,
                     summarise_threshold: int = 1000, edge_items: int = 3, max_line_width: int = 80,
                     digits: int = 4, float_format: str = "auto", separator: str = ", ",
                     open_bracket: str = "(", close_bracket: str = ")") -> torch.Tensor:
    """Print `tensor` (to stderr, after `title`) each time the device computes it, and in training
    its gradient each time the backward pass computes that (titled `title` + "_gradient") unless
    `print_gradient` is False. Returns the same tensor: use the result in place of `tensor`, so
    that the print is part of the graph. The format arguments are described in
    `poptorch_lite.api.printing`."""
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"ipu_print_tensor prints a torch.Tensor, got {type(tensor).__name__}")
    fmt = PrintFormat(summarise_threshold, edge_items, max_line_width, digits, float_format, separator,
                      open_bracket, close_bracket)  # checks the format now, in the user's call
    if has_torch_function_unary(tensor):  # traced: one torch function of its own, arguments normalised
        return handle_torch_function(ipu_print_tensor, (tensor,), tensor, str(title), bool(print_gradient),
                                     *dataclasses.astuple(fmt))
    return tensor


def set_available_memory(tensor: torch.Tensor, available_memory_proportion: float) -> torch.Tensor:
    """Let the matrix multiplication or convolution that produced `tensor` use this proportion
    (0 < p <= 1) of tile memory for temporary data: its planner picks the fastest plan within it
    (PopLibs' `availableMemoryProportion`, 0.6 by default). Returns the same tensor; for a tensor
    made by another op the hint has no effect (a warning says so at compile time)."""
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"set_available_memory applies to torch.Tensor values, got {type(tensor).__name__}")
    if isinstance(available_memory_proportion, bool) or not isinstance(available_memory_proportion, numbers.Real) \
            or not 0 < available_memory_proportion <= 1:
        raise ValueError(f"set_available_memory: available_memory_proportion must be a number in (0, 1], "
                         f"got {available_memory_proportion!r}")
    if has_torch_function_unary(tensor):  # traced: one torch function of its own
        return handle_torch_function(set_available_memory, (tensor,), tensor, float(available_memory_proportion))
    return tensor
