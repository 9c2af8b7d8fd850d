"""Overlapped host I/O: `set_overlap_for_input` and `set_overlap_for_output`, as in PopTorch.

Marking a model input (as the first and only op applied to it) or a returned tensor with an
`OverlapMode` other than `NoOverlap` makes its host transfer go through the IPU's IO tiles
(`Options.TensorLocations.numIOTiles`, which must be set) and overlap the computation of the
neighbouring micro-batch (see `OverlapMode`). It needs an execution strategy other than
PipelinedExecution (ShardedExecution on one IPU). The marks are identities on the CPU.
"""
from __future__ import annotations

import torch
from torch.overrides import handle_torch_function, has_torch_function_unary
from torch.utils._pytree import tree_map

from .enums import OverlapMode
from .errors import Error


def _mark(tensors, mode, what: str, marker):
    if not isinstance(mode, OverlapMode):
        raise Error(f"set_overlap_for_{what}: mode must be a poptorch.OverlapMode, got {mode!r}")

    def one(t):
        if not isinstance(t, torch.Tensor):
            raise Error(f"You may only set overlap for torch.tensor {what}s. {type(t)} is not supported.")
        if has_torch_function_unary(t):  # captured: an op of its own (compiler/library.py)
            return handle_torch_function(marker, (t,), t, mode.value)
        return t

    return tree_map(one, tensors)


def overlap_input(tensor: torch.Tensor, mode: str) -> torch.Tensor:
    """A captured set_overlap_for_input mark (the capture maps it to the library op)."""
    raise Error("overlap_input runs only while a model is captured")


def overlap_output(tensor: torch.Tensor, mode: str) -> torch.Tensor:
    """A captured set_overlap_for_output mark (the capture maps it to the library op)."""
    raise Error("overlap_output runs only while a model is captured")


def set_overlap_for_input(input_tensors, mode: OverlapMode):
    """Overlap the host-to-IPU copies of these model inputs (a tensor, or tuples, lists and dicts
    of them) with computation, as `mode` says. Apply it first to the input and use the result."""
    return _mark(input_tensors, mode, "input", overlap_input)


def set_overlap_for_output(output_tensors, mode: OverlapMode):
    """Overlap the IPU-to-host copies of these returned tensors with computation, as `mode` says.
    Apply it last, to the tensors the model returns."""
    return _mark(output_tensors, mode, "output", overlap_output)
