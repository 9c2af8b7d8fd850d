"""Torch functions captured as one op of our own (``torch.library`` custom ops).

Some functions have no ATen form the capture can trace: ``F.ctc_loss`` dispatches to
``aten._ctc_loss``, whose second output (the alpha table) has a shape that depends on the
target lengths' values, so fake tensors cannot trace it. PopTorch lowers CTC loss as one op
(sum or mean reduction, padded 2-D targets); so do we: ``poptorch_lite::ctc_loss`` and its
gradient ``poptorch_lite::ctc_loss_backward`` run PyTorch's CTC loss when called eagerly and are
lowered to ipusim's CTC ops (:mod:`.aten`).

PopTorch's device ops are identities on the CPU that the capture must keep:
``poptorch_lite::print_tensor`` (``ipu_print_tensor``; its gradient is printed by another
print_tensor in the backward), ``poptorch_lite::available_memory`` (``set_available_memory``,
read by the lowering of the matmul or convolution that made its input) and
``poptorch_lite::recomputation_checkpoint`` (``recomputationCheckpoint``: a value the
recomputation of a stage starts from, `compiler/recompute.py`). ``serializedMatMul`` is one op,
``poptorch_lite::serialized_matmul``, whose gradients are serialised products too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum")


@torch.library.custom_op("poptorch_lite::ctc_loss", mutates_args=())
def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
             target_lengths: torch.Tensor, blank: int, reduction: str, zero_infinity: bool) -> torch.Tensor:
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)


@ctc_loss.register_fake
def _ctc_loss_fake(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    return log_probs.new_empty(())


@torch.library.custom_op("poptorch_lite::ctc_loss_backward", mutates_args=())
def ctc_loss_backward(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
                      target_lengths: torch.Tensor, grad: torch.Tensor, blank: int, reduction: str,
                      zero_infinity: bool) -> torch.Tensor:
    with torch.enable_grad():
        x = log_probs.detach().requires_grad_()
        loss = F.ctc_loss(x, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
        return torch.autograd.grad(loss, x, grad)[0]


@ctc_loss_backward.register_fake
def _ctc_loss_backward_fake(log_probs, targets, input_lengths, target_lengths, grad, blank, reduction,
                            zero_infinity):
    return torch.empty_like(log_probs)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.attrs = inputs[4:]


def _backward(ctx, grad):
    return (ctc_loss_backward(*ctx.saved_tensors, grad, *ctx.attrs),) + (None,) * 6


ctc_loss.register_autograd(_backward, setup_context=_setup)


def functional_ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
                        zero_infinity=False):
    """``F.ctc_loss`` as captured: PopTorch's restrictions, then the op of our own."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"CTC loss supports reduction 'sum' or 'mean' on the IPU, as in PopTorch; got {reduction!r}")
    if targets.dim() != 2:
        raise ValueError("CTC loss needs 2-D padded targets [N, S], as in PopTorch")
    lengths = [torch.as_tensor(v, dtype=torch.int64) for v in (input_lengths, target_lengths)]
    return ctc_loss(log_probs, targets, *lengths, int(blank), reduction, bool(zero_infinity))


@torch.library.custom_op("poptorch_lite::print_tensor", mutates_args=())
def print_tensor(x: torch.Tensor, title: str, print_gradient: bool, summarise_threshold: int, edge_items: int,
                 max_line_width: int, digits: int, float_format: str, separator: str, open_bracket: str,
                 close_bracket: str) -> torch.Tensor:
    return x.clone()


@print_tensor.register_fake
def _print_tensor_fake(x, *fmt):
    return torch.empty_like(x)


def _print_setup(ctx, inputs, output):
    ctx.fmt = inputs[1:]


def _print_backward(ctx, grad):
    title, print_gradient, *fmt = ctx.fmt
    shown = print_tensor(grad, f"{title}_gradient", False, *fmt) if print_gradient else grad
    return (shown,) + (None,) * len(ctx.fmt)


print_tensor.register_autograd(_print_backward, setup_context=_print_setup)


@torch.library.custom_op("poptorch_lite::available_memory", mutates_args=())
def available_memory(x: torch.Tensor, proportion: float) -> torch.Tensor:
    return x.clone()


@available_memory.register_fake
def _available_memory_fake(x, proportion):
    return torch.empty_like(x)


available_memory.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("poptorch_lite::recomputation_checkpoint", mutates_args=())
def recomputation_checkpoint(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@recomputation_checkpoint.register_fake
def _recomputation_checkpoint_fake(x):
    return torch.empty_like(x)


recomputation_checkpoint.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)


# The mode splitting each gradient product of a serialised A @ B, for the forward's mode: dA = dC @ B.T
# and dB = A.T @ dC, split along the same dimension of the problem (PopART's serializeMatMuls).
GRADIENT_MODES = {"input_channels": ("input_channels", "reducing_dim"),
                  "reducing_dim": ("output_channels", "input_channels"),
                  "output_channels": ("reducing_dim", "output_channels")}


@torch.library.custom_op("poptorch_lite::serialized_matmul", mutates_args=())
def serialized_matmul(lhs: torch.Tensor, rhs: torch.Tensor, mode: str, factor: int,
                      keep_precision: bool) -> torch.Tensor:
    return torch.mm(lhs, rhs)


@serialized_matmul.register_fake
def _serialized_matmul_fake(lhs, rhs, mode, factor, keep_precision):
    return lhs.new_empty((lhs.shape[0], rhs.shape[1]))


def _serialized_setup(ctx, inputs, output):
    lhs, rhs, *ctx.attrs = inputs
    ctx.save_for_backward(lhs, rhs)


def _serialized_backward(ctx, grad):
    lhs, rhs = ctx.saved_tensors
    mode, factor, keep = ctx.attrs
    lhs_mode, rhs_mode = GRADIENT_MODES[mode]
    return (serialized_matmul(grad, rhs.t(), lhs_mode, factor, keep),
            serialized_matmul(lhs.t(), grad, rhs_mode, factor, keep), None, None, None)


serialized_matmul.register_autograd(_serialized_backward, setup_context=_serialized_setup)


def functional_serialized_matmul(lhs, rhs, mode: str, factor: int, keep_precision: bool):
    """``serializedMatMul`` as captured: lhs [..., m, n] folded to a matrix, the serialised
    product, the result unfolded (its mode and factor checked by the API)."""
    folded = lhs.reshape(-1, lhs.shape[-1])
    out = serialized_matmul(folded, rhs, mode, factor, keep_precision)
    return out.reshape(*lhs.shape[:-1], rhs.shape[-1])
# ---- PopTorch's CTC beam search decoder and torch_cluster's fps and nearest ------------------------
@torch.library.custom_op("poptorch_lite::ctc_beam_search_decoder", mutates_args=())
def ctc_beam_search_decoder(probs: torch.Tensor, lengths: torch.Tensor, blank: int, beam_width: int,
                            top_paths: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ipusim.ops.ctc_decoder import decode
    p, n, d = decode(probs.detach().float().numpy(), lengths.numpy(), blank, beam_width, top_paths)
    return torch.from_numpy(p), torch.from_numpy(n), torch.from_numpy(d)


@ctc_beam_search_decoder.register_fake
def _ctc_beam_search_decoder_fake(probs, lengths, blank, beam_width, top_paths):
    T, N, _ = probs.shape
    return (probs.new_empty((N, top_paths), dtype=torch.float32), probs.new_empty((N, top_paths), dtype=torch.int32),
            probs.new_empty((N, top_paths, T), dtype=torch.int32))


@torch.library.custom_op("poptorch_lite::fps", mutates_args=())
def fps(src: torch.Tensor, ptr: list[int], ratio: float, random_start: bool) -> torch.Tensor:
    from ipusim.ops.cluster import fps_host
    starts = torch.rand(len(ptr) - 1).numpy() if random_start else None
    return torch.from_numpy(fps_host(src.detach().float().numpy(), ptr, ratio, starts))


@fps.register_fake
def _fps_fake(src, ptr, ratio, random_start):
    from ipusim.ops.cluster import segment_sizes
    return src.new_empty((sum(segment_sizes(ptr, ratio)),), dtype=torch.int64)


@torch.library.custom_op("poptorch_lite::nearest", mutates_args=())
def nearest(x: torch.Tensor, y: torch.Tensor, batch_x: torch.Tensor, batch_y: torch.Tensor) -> torch.Tensor:
    from ipusim.ops.cluster import nearest_host
    return torch.from_numpy(nearest_host(x.detach().float().numpy(), y.detach().float().numpy(), batch_x.numpy(),
                                         batch_y.numpy()))


@nearest.register_fake
def _nearest_fake(x, y, batch_x, batch_y):
    return x.new_empty((x.shape[0],), dtype=torch.int64)


# ---- automatic loss scaling: the gradient seed scaled by a device tensor -----------------------------
@torch.library.custom_op("poptorch_lite::loss_scale", mutates_args=())
def loss_scale(x: torch.Tensor, initial: float) -> torch.Tensor:
    """x times the loss scale: `initial` on the CPU, the device's loss-scale tensor on the IPU
    (automatic loss scaling changes it as training runs)."""
    return x * initial


@loss_scale.register_fake
def _loss_scale_fake(x, initial):
    return torch.empty_like(x)


def _loss_scale_backward(ctx, grad):
    return loss_scale(grad, ctx.initial), None


def _loss_scale_setup(ctx, inputs, output):
    ctx.initial = inputs[1]


loss_scale.register_autograd(_loss_scale_backward, setup_context=_loss_scale_setup)


# ---- overlapped host I/O marks (api/overlap.py): identities the compiler reads -----------------------
@torch.library.custom_op("poptorch_lite::overlap_input", mutates_args=())
def overlap_input(x: torch.Tensor, mode: str) -> torch.Tensor:
    return x.clone()


@overlap_input.register_fake
def _overlap_input_fake(x, mode):
    return torch.empty_like(x)


@torch.library.custom_op("poptorch_lite::overlap_output", mutates_args=())
def overlap_output(x: torch.Tensor, mode: str) -> torch.Tensor:
    return x.clone()


@overlap_output.register_fake
def _overlap_output_fake(x, mode):
    return torch.empty_like(x)


for _mark in (overlap_input, overlap_output):
    _mark.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


# ---- custom ops (api/custom_ops.py): one op per call, its gradient another -------------------------
def _spec(key: str):
    from ..api.custom_ops import call_spec
    return call_spec(key)


@torch.library.custom_op("poptorch_lite::custom_op", mutates_args=())
def custom_op(inputs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype) for shape, dtype in _spec(key).outputs]


@custom_op.register_fake
def _custom_op_fake(inputs, key):
    return [torch.empty(shape, dtype=dtype) for shape, dtype in _spec(key).outputs]


def _differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point


@torch.library.custom_op("poptorch_lite::custom_op_backward", mutates_args=())
def custom_op_backward(grads: list[torch.Tensor], inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                       key: str) -> list[torch.Tensor]:
    return [torch.zeros_like(t) for t in inputs if _differentiable(t)]


@custom_op_backward.register_fake
def _custom_op_backward_fake(grads, inputs, outputs, key):
    return [torch.empty_like(t) for t in inputs if _differentiable(t)]


def _custom_setup(ctx, inputs, output):
    ctx.inputs, ctx.key = list(inputs[0]), inputs[1]
    ctx.outputs = list(output)


def _custom_backward(ctx, grads):
    from ..api.custom_ops import registered_custom_op
    from ..api.errors import Error
    call = _spec(ctx.key)
    try:
        definition = registered_custom_op(call)
    except LookupError as error:
        raise Error(str(error)) from None
    if definition.backward is None:
        raise Error(f"custom op {call.describe()} is on the path of the loss's gradient but has no gradient "
                    f"kernel: register it with poptorch_lite.register_custom_op({call.name!r}, {call.domain!r}, "
                    f"{call.domain_version}, forward=..., backward=gradient_kernel)")
    grads = [g if g is not None else torch.zeros_like(o) for g, o in zip(grads, ctx.outputs)]
    made = iter(custom_op_backward(grads, ctx.inputs, ctx.outputs, ctx.key))
    return [next(made) if _differentiable(t) else None for t in ctx.inputs], None


custom_op.register_autograd(_custom_backward, setup_context=_custom_setup)


# ---- CPU ops (api/cpu_ops.py): the host runs a Python function between two host streams ------------
@torch.library.custom_op("poptorch_lite::cpu_op", mutates_args=())
def cpu_op(inputs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    from ..api.cpu_ops import cpu_call
    return [torch.zeros(shape, dtype=dtype) for shape, dtype in cpu_call(key).outputs]


@cpu_op.register_fake
def _cpu_op_fake(inputs, key):
    from ..api.cpu_ops import cpu_call
    return [torch.empty(shape, dtype=dtype) for shape, dtype in cpu_call(key).outputs]


def _cpu_op_backward(ctx, grads):
    from ..api.cpu_ops import cpu_call
    from ..api.errors import Error
    raise Error(f"CPU op {cpu_call(ctx.key).op.ID!r} is on the path of the loss's gradient: CPU ops are only "
                "supported in inference models (as in PopTorch); detach its inputs or results, or move it out of "
                "the training model")


def _cpu_op_setup(ctx, inputs, output):
    ctx.key = inputs[1]


cpu_op.register_autograd(_cpu_op_backward, setup_context=_cpu_op_setup)
