"""PopTorch's extra ops usable inside a model: they trace as single ops and run eagerly on the CPU too."""
from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function_unary

REDUCTIONS = ("sum", "mean", "none")


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark `x` as the model's loss; `reduction` ('sum', 'mean' or 'none') reduces it first."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"identity_loss reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if has_torch_function_unary(x):  # traced (fx proxies, capture modes): one torch function of its own
        return handle_torch_function(identity_loss, (x,), x, reduction)
    if reduction == "sum":
        return x.sum()
    if reduction == "mean":
        return x.mean()
    return x

