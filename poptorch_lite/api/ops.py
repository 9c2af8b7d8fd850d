"""PopTorch's extra ops usable inside a model: they trace as single ops and run eagerly on the CPU too
(where `ipu_print_tensor`, `set_available_memory`, `nop` and `recomputationCheckpoint` are
identities and `serializedMatMul` a plain product: they act on the device). `for_loop` and `cond`
are device control flow: captured, their bodies become one loop or branch program
(compiler/control_flow.py); on the CPU they run in Python."""
from __future__ import annotations

import dataclasses
import numbers

import torch
from torch.overrides import handle_torch_function, has_torch_function, has_torch_function_unary

from .enums import MatMulSerializationMode
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


# ---- device control flow and dynamic slices -----------------------------------------------------------
def _as_list(outputs) -> list:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def for_loop(count: int, body, inputs: list) -> list:
    """Run `body` `count` times on the device, each iteration given the previous one's outputs
    (the first given `inputs`): `body` takes as many tensors as it returns, of the same shapes
    and types. Returns the last iteration's outputs as a list. The loop is one device program
    over one copy of the body, however many iterations it runs; inputs are passed by value (the
    body may update them in place without changing the caller's tensors). Inference only, as in
    PopTorch. On the CPU, outside a model, the body runs `count` times in Python."""
    if not isinstance(inputs, list):
        raise ValueError("poptorch.for_loop expects input tensors (inputs) to be a list of tensors. "
                         "(Object is not list)")
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise ValueError("poptorch.for_loop expects input tensors (inputs) to be a list of tensors. "
                             f"(Object contained in list at index {i} is not torch.tensor)")
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
        raise ValueError(f"poptorch.for_loop expects a non-negative integer count, got {count!r}")
    if has_torch_function(tuple(inputs)):  # captured: one loop over the body traced once
        return handle_torch_function(for_loop, tuple(inputs), int(count), body, inputs)
    values = [t.clone() for t in inputs]
    for _ in range(int(count)):
        values = _as_list(body(*values))
        if len(values) != len(inputs):
            raise Error(f"the body of poptorch.for_loop returned {len(values)} tensors for {len(inputs)} inputs; "
                        "it must return one tensor per input")
    return values


def cond(condition: torch.Tensor, then_body, then_inps: list, else_body, else_inps: list) -> list:
    """Run `then_body(*then_inps)` when the one-element tensor `condition` is true, else
    `else_body(*else_inps)`, deciding on the device; both return the same number of tensors, of
    the same shapes and types, and the chosen one's are returned as a list. The bodies may use
    the caller's tensors directly; their inputs are passed by value. Inference only, as in
    PopTorch."""
    if not isinstance(then_inps, list) or not isinstance(else_inps, list):
        raise ValueError("poptorch.cond expects then_inps and else_inps tensors to be a list of tensors. "
                         "(Object is not list)")
    if not isinstance(condition, torch.Tensor):
        raise ValueError(f"poptorch.cond expects the condition to be a torch.Tensor, got {type(condition).__name__}")
    if has_torch_function((condition, *then_inps, *else_inps)):   # captured: both bodies, one branch runs
        return handle_torch_function(cond, (condition, *then_inps, *else_inps), condition, then_body, then_inps,
                                     else_body, else_inps)
    return _as_list(then_body(*then_inps) if condition else else_body(*else_inps))


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """A no-op: the same values, as an op of its own that the compiler never removes (a copy on
    the device; its gradient passes through). Useful for debugging and profiling."""
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"nop must take a torch.tensor argument. {type(tensor)} is not supported.")
    if has_torch_function_unary(tensor):
        return handle_torch_function(nop, (tensor,), tensor)
    return tensor


def _on_device(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor has on the IPU, which has no 64-bit types."""
    return {torch.int64: torch.int32, torch.float64: torch.float32}.get(dtype, dtype)


def _start_value(start: torch.Tensor) -> int:
    if start.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise Error(f"Expected integer typed start tensor, got {start.dtype}")
    return int(start.reshape(-1)[0])


def dynamic_slice(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int, step: int) -> torch.Tensor:
    """`tensor` sliced along `dim` from `start` (a tensor: on the device its value is read when the
    program runs) to `start + size` with `step`: `size` and `step` are constant, so the result's
    shape is known at compile time. On the device `size` must divide the dimension, an out-of-range
    start reads from 0 and a slice past the end wraps round (PopLibs' dynamic slices)."""
    if not isinstance(tensor, torch.Tensor):
        raise Error(f"dynamic_slice must take a torch.tensor input. {type(tensor)} is not supported.")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise Error("Dimension must be an integer.")
    if not isinstance(start, torch.Tensor):
        raise Error(f"Slice start argument to dynamic_slice must be a torch.tensor. {type(start)} is not supported.")
    if isinstance(size, bool) or not isinstance(size, int):
        raise Error("Size must be an integer.")
    if isinstance(step, bool) or not isinstance(step, int):
        raise Error("Step must be an integer.")
    if has_torch_function((tensor, start)):
        return handle_torch_function(dynamic_slice, (tensor, start), tensor, dim, start, size, step)
    first = _start_value(start)
    return torch.ops.aten.slice(tensor, dim, first, first + size, step)


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int,  # noqa: A002 (PopTorch's argument name)
                   start: torch.Tensor, size: int) -> torch.Tensor:
    """A copy of `input` with `src` written along `dim` from `start` (a tensor: on the device its
    value is read when the program runs) for `size` rows."""
    if not isinstance(input, torch.Tensor):
        raise Error(f"dynamic_update must take a torch.tensor input. {type(input)} is not supported.")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise Error("Dimension must be an integer.")
    if not isinstance(start, torch.Tensor):
        raise Error(f"Slice start argument to dynamic_update must be a torch.tensor. {type(start)} is not supported.")
    if not isinstance(src, torch.Tensor):
        raise Error(f"Src argument to dynamic_update must be a torch.tensor. {type(src)} is not supported.")
    if isinstance(size, bool) or not isinstance(size, int):
        raise Error("Size must be an integer.")
    if input.dim() != src.dim():
        raise Error(f"input and src tensors must have same dimensionality. ({input.dim()}) vs ({src.dim()})")
    traced = has_torch_function((input, src, start))
    if input.dtype != src.dtype:   # in a model, as the IPU holds them (PopTorch's message)
        shown = (_on_device(input.dtype), _on_device(src.dtype)) if traced else (input.dtype, src.dtype)
        raise Error(f"input and src tensor must have same dtype. ({shown[0]} vs {shown[1]})")
    if traced:
        return handle_torch_function(dynamic_update, (input, src, start), input, src, dim, start, size)
    first = _start_value(start)
    return torch.slice_scatter(input, src, dim, first, first + size, 1)


def recomputationCheckpoint(*tensors):
    """Mark values of a pipeline stage's forward that its backward keeps (stashes) instead of
    recomputing them, when recomputation is on (PopART's ``autoRecomputation``, which PopTorch
    turns on for pipelined training over several IPUs): the recomputation before the stage's
    backward restarts from them. Returns the same values: one tensor for one, a tuple for
    several, a list or tuple of the same type for one list or tuple. Outside a model, or with
    recomputation off, it changes nothing."""
    if len(tensors) == 1 and isinstance(tensors[0], (tuple, list)):
        return type(tensors[0])(_recomputation_checkpoint(t) for t in tensors[0])
    out = tuple(_recomputation_checkpoint(t) for t in tensors)
    return out[0] if len(out) == 1 else out


def _recomputation_checkpoint(tensor):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"recomputationCheckpoint: all inputs must be tensors, got {type(tensor).__name__}")
    if has_torch_function_unary(tensor):  # traced: one torch function of its own per tensor
        return handle_torch_function(_recomputation_checkpoint, (tensor,), tensor)
    return tensor


SERIALIZED_DIMS = {MatMulSerializationMode.InputChannels: ("input channels", -2, "lhs"),
                   MatMulSerializationMode.ReducingDim: ("reducing", -1, "lhs"),
                   MatMulSerializationMode.OutputChannels: ("output channels", -1, "rhs")}


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor, mode: MatMulSerializationMode, factor: int = 0,
                     keep_precision: bool = False) -> torch.Tensor:
    """``lhs @ rhs`` computed on the device as `factor` smaller products one after the other,
    which needs less temporary memory (and takes more cycles). For lhs [..., m, n] and rhs
    [n, p], `mode` splits m (``InputChannels``), n (``ReducingDim``: the pieces' products are
    summed) or p (``OutputChannels``); ``Disabled`` is a plain product. In training the two
    gradient products are split along the same dimension. `factor` must divide that dimension.
    `keep_precision` (float16 only): the sums a split makes (the forward's over ReducingDim, a
    gradient's over InputChannels or OutputChannels) are kept in float32 and rounded once."""
    if not isinstance(mode, MatMulSerializationMode):
        raise Error(f"serializedMatMul: mode must be a poptorch.MatMulSerializationMode, got {mode!r}")
    if isinstance(factor, bool) or not isinstance(factor, numbers.Integral):
        raise Error(f"serializedMatMul: factor must be an int, got {factor!r}")
    if not isinstance(keep_precision, bool):
        raise Error(f"serializedMatMul: keep_precision must be a bool, got {keep_precision!r}")
    if not isinstance(lhs, torch.Tensor) or not isinstance(rhs, torch.Tensor):
        raise Error("serializedMatMul multiplies two torch.Tensor values")
    if mode is MatMulSerializationMode.Disabled:
        return torch.matmul(lhs, rhs)
    if lhs.dim() < 2 or rhs.dim() != 2:
        raise Error(f"serializedMatMul splits lhs [..., m, n] @ rhs [n, p] (rhs a matrix, such as a weight); got "
                    f"shapes {list(lhs.shape)} and {list(rhs.shape)}")
    what, dim, operand = SERIALIZED_DIMS[mode]
    size = (lhs if operand == "lhs" else rhs).shape[dim]
    if factor < 1:
        raise Error(f"Invalid serialisation factor {factor}. Serialisation factor must be a non-zero positive "
                    "integer.")
    if size % factor:
        raise Error(f"Invalid serialisation factor {factor} for {what} dimension {size}. The {what} dimension "
                    f"should be a multiple of the serialisation factor.")
    if has_torch_function((lhs, rhs)):  # traced: one torch function of its own, arguments normalised
        return handle_torch_function(serializedMatMul, (lhs, rhs), lhs, rhs, mode.value, int(factor), keep_precision)
    return torch.matmul(lhs, rhs)
