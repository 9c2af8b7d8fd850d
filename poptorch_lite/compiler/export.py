"""Capture through PyTorch 2: one joint forward-backward graph of core ATen ops, blocks on its nodes.

:func:`capture_joint` traces a function that calls the model (parameters and buffers passed in
as tensors, ``torch.func.functional_call``), picks the final loss and asks
``torch.autograd.grad`` for the gradients of the trainable parameters. The trace is
``make_fx``'s, in two passes:

1. ``make_fx(joint)`` on fake tensors records the forward and PyTorch's own backward formulas
   as ATen ops, in-place ops included (BatchNorm's running statistics, ``relu(inplace=True)``);
2. ``make_fx(functionalize(Interpreter(pass 1)))`` replays that graph functionalised (every
   mutation becomes a new value; the new buffer values are outputs) and decomposes it with
   :data:`DECOMPOSITIONS`. The fx Interpreter sets each replayed node's meta as the current
   meta, so the annotations of pass 1 reach the nodes of pass 2. Both passes decompose with
   the table the lowering gives (``aten.decompositions()``).

Why not ``aot_export_module``: on torch 2.14 it re-traces its joint graph by calling the
GraphModule (not an Interpreter), which drops ``node.meta["custom"]``, and it refuses
parameters that get no gradient. ``torch.export`` + ``run_decompositions`` gives a forward
graph only; its joint (``_export_forward_backward``) is experimental and keeps no annotation
on backward nodes either.

Blocks and sources are ``node.meta["custom"]["poptorch"]``, an :class:`Annotation`, set two ways:

- forward: :class:`BlockAnnotator`, a ``TorchFunctionMode`` active while the model runs, wraps
  every torch function the user's code calls (``F.linear``, ``x + 1``, ``torch.cat``, ...) in
  ``torch.fx.traceback.annotate`` with the block active at that moment (see
  ``poptorch_lite.api.blocks``: ``with Block``, ``Block.start``, ``BeginBlock`` hooks and
  ``BlockFunction`` all change it), the user's source line and the module path;
- backward: the same mode tags every autograd node the call created, with a pre-hook and a
  post-hook that set and clear that annotation while the autograd engine runs the node's
  backward formula. So every backward ATen op carries the annotation of the forward call
  whose gradient it computes (PopTorch: an op's gradient runs on its forward op's IPU). This
  is what ``seq_nr`` matching in AOTAutograd's ``copy_fwd_metadata_to_bw_nodes`` achieves; the
  hooks make it direct. Ops the engine adds between nodes (sums of the gradients of a value
  used twice) and the seed carry no block: :mod:`.aten` places them by their inputs.

Every node made inside ``torch.autograd.grad`` also carries ``pass="bwd"``.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch._decomp.decompositions import _weight_norm_interface as weight_norm_interface
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from ..api import arguments
from ..api.blocks import BlockError, BlockRef, BlockTrace, block_annotation, tracing_blocks
from ..api import cluster, ctc_decoder
from ..api.cpu_ops import cpu_op
from ..api.custom_ops import custom_op
from ..api.errors import Error
from ..api.ops import (_recomputation_checkpoint, cond, dynamic_slice, dynamic_update, for_loop, identity_loss,
                       ipu_print_tensor, nop, serializedMatMul, set_available_memory)
from ..api.options import DEFAULT_SOURCE_LOCATION_EXCLUDES
from ..api.overlap import overlap_input, overlap_output
from . import control_flow, library, recurrent, sampling
from .ir import flatten_values, map_values

aten = torch.ops.aten
KEY = "poptorch"

def _dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """Dropout as one op with its mask: ATen's CPU dropout is a CompositeImplicit bernoulli and
    multiply, decomposed before any table sees it."""
    return aten.native_dropout.default(x, p, True)[0] if training and p > 0 else x


def _cdist(x1: torch.Tensor, x2: torch.Tensor, p: float = 2.0, compute_mode=None) -> torch.Tensor:
    """Distances between the rows of x1 [..., P, M] and x2 [..., R, M] as the p-norm of their
    broadcast differences [..., P, R, M]: ATen's ``_cdist_forward`` and its backward have no
    decomposition; this one's gradient is the norm's (zero at zero distance, as cdist's)."""
    if p < 0:
        raise ValueError(f"cdist only supports non-negative p values, got p={p}")
    return torch.linalg.vector_norm(x1.unsqueeze(-2) - x2.unsqueeze(-3), ord=p, dim=-1)


def _pdist(x: torch.Tensor, p: float = 2.0) -> torch.Tensor:
    """The distances between the rows i < j of x [N, M], in torch.pdist's order, as the p-norm of
    their differences (gathers at the pairs' rows): ATen's ``_pdist_forward`` and its backward
    have no decomposition; this one's gradient is the norm's."""
    if x.dim() != 2:
        raise RuntimeError(f"pdist only supports 2D tensors, got: {x.dim()}D")
    if p < 0:
        raise RuntimeError("pdist only supports non-negative p values")
    i, j = torch.triu_indices(x.size(0), x.size(0), 1, device=x.device)
    return torch.linalg.vector_norm(x[i] - x[j], ord=p, dim=-1)


def _one_hot(x: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """F.one_hot with its number of classes given: without it PyTorch sizes the output from x's
    largest value, a shape the compiled program cannot know (PopTorch's error)."""
    if num_classes < 0:
        raise Error("OneHot num classes must be specified and must be constant. F.one_hot(x) without "
                    "num_classes sizes its output from x's largest value, which a compiled model cannot know: "
                    "pass num_classes=<the number of classes>")
    return F.one_hot(x, num_classes)


def _weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Weight normalisation as PyTorch's decomposition of ``_weight_norm_interface`` composes it, so
    that its gradient is that composition's (ATen's fused backward has no decomposition)."""
    return weight_norm_interface(v, g, dim)[0]


def _bilinear(x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x1^T W_o x2 (+ b_o) for each output o, as matrix products: ATen's ``_trilinear`` has no
    decomposition."""
    y = torch.einsum("...i,oij,...j->...o", x1, weight, x2)
    return y if bias is None else y + bias


def _embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                   mode="mean", sparse=False, per_sample_weights=None, include_last_offset=False, padding_idx=None):
    """F.embedding_bag as an embedding and a scatter of its rows into their bags (sum, mean or max;
    an empty bag is zeros, rows at padding_idx are left out): ATen's ``_embedding_bag`` has no
    decomposition. A bag's position comes from the offsets on the device, so the offsets may be
    data; their number fixes the number of bags."""
    if max_norm is not None:
        raise ValueError("embedding_bag with max_norm (renormalising the weight in place) is not supported on the IPU")
    if mode not in ("sum", "mean", "max"):
        raise ValueError(f"mode has to be one of sum, mean or max, got {mode!r}")
    if per_sample_weights is not None and mode != "sum":
        raise NotImplementedError(f"embedding_bag: per_sample_weights was not None. per_sample_weights is only "
                                  f"supported for mode='sum' (got mode='{mode}'). Please open a feature request "
                                  f"on GitHub.")
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("if input is 2D, then offsets has to be None, as input is treated is a mini-batch of "
                             "fixed length sequences.")
        offsets = torch.arange(0, input.numel(), input.size(1), device=input.device)
        include_last_offset = False
        input = input.reshape(-1)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
    elif offsets is None:
        raise ValueError("offsets has to be a 1D Tensor but got None")
    bags = offsets.numel() - (1 if include_last_offset else 0)
    positions = torch.arange(input.numel(), device=input.device)
    bag = (offsets[:bags].unsqueeze(0) <= positions.unsqueeze(1)).sum(1) - 1
    rows = F.embedding(input, weight)
    keep = (torch.ones_like(input, dtype=weight.dtype) if padding_idx is None
            else (input != padding_idx).to(weight.dtype))
    count = weight.new_zeros(bags).index_add(0, bag, keep).unsqueeze(1)
    if mode == "max":
        rows = torch.where(keep.unsqueeze(1) > 0, rows, float("-inf"))
        best = weight.new_full((bags, weight.size(1)), float("-inf"))
        best = best.scatter_reduce(0, bag.unsqueeze(1).expand_as(rows), rows, "amax")
        return torch.where(count > 0, best, 0.0)
    weights = keep if per_sample_weights is None else keep * per_sample_weights
    total = weight.new_zeros(bags, weight.size(1)).index_add(0, bag, rows * weights.unsqueeze(1))
    return total if mode == "sum" else total / count.clamp(min=1)


def _gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    """F.gaussian_nll_loss as PyTorch computes it, without its check that a tensor var has no
    negative entry: that check branches on the values of device tensors, which the capture does not
    have (torch.distributions' argument checks are off for the same reason)."""
    if isinstance(var, (int, float)):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = var * torch.ones_like(input)
    if var.size() != input.size():
        if input.size()[:-1] == var.size():   # homoscedastic: one variance per row
            var = torch.unsqueeze(var, -1)
        elif not (input.ndim == var.ndim and sum(y for x, y in zip(input.size(), var.size()) if x != y) == 1):
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    var = var.clone()
    with torch.no_grad():   # clamped for stability, the gradient passing as if it were not
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


def _flash_attention_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """ATen's CPU flash attention as the math attention (its output) and the log-sum-exp of each
    query's scores (its second output, without a gradient as the op's has none), so that autograd
    differentiates the pieces: the fused op's backward has no decomposition."""
    gqa = query.size(1) != key.size(1)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                            is_causal=is_causal, scale=scale, enable_gqa=gqa)
    if gqa:   # grouped-query attention: each key head serves a group of query heads
        key = key.repeat_interleave(query.size(1) // key.size(1), 1)
    scores = query @ key.transpose(-2, -1) * (scale if scale is not None else query.size(-1) ** -0.5)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return output, torch.logsumexp(scores, -1).detach()


def _cov(input: torch.Tensor, *, correction: int = 1, fweights=None, aweights=None) -> torch.Tensor:
    """torch.cov as ATen's composition computes it, without its data-dependent checks (a normalisation
    factor <= 0 becomes 0, as ATen makes it, by a clamp on the device; frequency weights are not
    checked to be integers): the C++ composition asks the data whether the factor is positive,
    which a traced graph cannot answer."""
    if input.dim() > 2:
        raise ValueError(f"cov(): expected input to have two or fewer dimensions but got an input with "
                         f"{input.dim()} dimensions")
    x = input if input.dim() == 2 else input.reshape(1, -1)
    observations = x.size(1)
    w = fweights
    if aweights is not None:
        w = aweights if w is None else w * aweights
    if w is None:
        avg = x.mean(1)
        norm = float(observations - correction)
        if norm <= 0:
            warnings.warn("cov(): degrees of freedom is <= 0. Correction should be strictly less than the number "
                          "of observations.")
            norm = 0.0
    else:
        w = w.to(x.dtype)
        w_sum = w.sum()
        avg = (x * w).sum(1) / w_sum
        norm = w_sum - correction if aweights is None or correction == 0 else \
            w_sum - correction * (w * aweights).sum() / w_sum
        norm = norm.clamp(min=0)
    centred = x - avg.unsqueeze(1)
    product = centred @ (centred if w is None else centred * w).t()
    return (product / norm).squeeze()


def _corrcoef(input: torch.Tensor) -> torch.Tensor:
    """torch.corrcoef as ATen composes it from cov, on :func:`_cov`."""
    c = _cov(input)
    if c.dim() == 0:
        return c / c
    stddev = c.diagonal().sqrt()
    c = c / stddev.unsqueeze(1)
    c = c / stddev.unsqueeze(0)
    return c.clamp(-1, 1)


# Torch functions traced as another (the annotator calls these instead). PopTorch's device ops
# reach the annotator with their arguments normalised to the library ops' (see api.ops).
FUNCTIONS = {F.dropout: _dropout, F.one_hot: _one_hot, torch.pdist: _pdist, F.pdist: _pdist, torch.cov: _cov, torch.Tensor.cov: _cov,
             torch.corrcoef: _corrcoef, torch.Tensor.corrcoef: _corrcoef, F.embedding_bag: _embedding_bag, torch.cdist: _cdist, torch._weight_norm: _weight_norm,
             F.gaussian_nll_loss: _gaussian_nll_loss,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _flash_attention_for_cpu,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_attention_for_cpu,
             F.bilinear: _bilinear, torch.bilinear: _bilinear, F.ctc_loss: library.functional_ctc_loss, ipu_print_tensor: library.print_tensor,
             set_available_memory: library.available_memory, custom_op: library.custom_op,
             cpu_op: library.cpu_op, overlap_input: library.overlap_input,
             overlap_output: library.overlap_output, ctc_decoder.ctc_beam_search_decoder: library.ctc_beam_search_decoder,
             cluster.fps: library.fps, cluster.nearest: library.nearest, for_loop: control_flow.traced_for_loop,
             cond: control_flow.traced_cond, nop: control_flow.traced_nop,
             dynamic_slice: control_flow.traced_dynamic_slice, dynamic_update: control_flow.traced_dynamic_update,
             _recomputation_checkpoint: library.recomputation_checkpoint,
             serializedMatMul: library.functional_serialized_matmul, **recurrent.FUNCTIONS,
             **sampling.FUNCTIONS}

# Device control flow: the bodies are the model's own code, traced under the annotator (their ops
# annotated, nested loops and branches captured too); inference only, as in PopTorch.
CONTROL_FLOW = {for_loop: "for_loop", cond: "cond"}


# Torch functions that define a loss (PopTorch finds the final loss among them).
LOSS_FUNCTIONS = frozenset({
    identity_loss, F.nll_loss, F.cross_entropy, F.mse_loss, F.l1_loss, F.ctc_loss, F.smooth_l1_loss,
    F.huber_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.kl_div,
    F.poisson_nll_loss, F.gaussian_nll_loss, F.soft_margin_loss, F.multilabel_soft_margin_loss,
    F.hinge_embedding_loss, F.margin_ranking_loss, F.triplet_margin_loss, F.cosine_embedding_loss,
    F.multi_margin_loss, F.multilabel_margin_loss,
})



@dataclass(frozen=True)
class Annotation:
    """Where a torch call was made: its block, the user's source line, the module and function."""

    block: Optional[BlockRef]
    source: str
    module: str = ""                       # "model.layer1.conv (Conv2d)", "" outside modules
    function: str = ""                     # "linear", "add", ".view", ...
    leaf_module: bool = False              # the call is a torch.nn layer's own computation
    closed: Optional[BlockRef] = None      # the block that had closed, when block is None
    scope: str = ""                        # the open NameScopes, "encoder/attention"

    def describe(self) -> str:
        """The user's call for error messages: 'module layer1.conv (Conv2d)', 'function add()', 'method .view()'."""
        if self.leaf_module:
            return f"module {self.module}"
        if self.function.startswith("."):
            return f"method {self.function}()"
        return f"function {self.function}()"

    def origin(self) -> str:
        """'from <op> at <file:line>, module <path>' for error messages."""
        module = f", module {self.module}" if self.module and not self.leaf_module else ""
        return f"from {self.describe()} at {self.source}{module}"


def annotation_of(node: torch.fx.Node) -> Optional[Annotation]:
    custom = node.meta.get("custom") or {}
    return custom.get(KEY)


def pass_of(node: torch.fx.Node) -> str:
    custom = node.meta.get("custom") or {}
    return custom.get("pass", "fwd")


def _function_name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name.startswith("__") and name.endswith("__"):
        name = name.strip("_")
        return name[1:] if name.startswith(("r", "i")) and name[1:] in _REFLECTED else name
    qualname = getattr(func, "__qualname__", "")
    if qualname.startswith(("Tensor.", "TensorBase.", "_TensorBase.")):
        return "." + name
    return name


_REFLECTED = {"add", "sub", "mul", "truediv", "floordiv", "matmul", "pow", "mod", "and", "or", "xor"}
# Tensor attributes read through __torch_function__ that compute nothing.
_NOT_OPS = {"shape", "dtype", "device", "size", "dim", "ndim", "numel", "requires_grad", "is_floating_point",
            "__len__", "__iter__", "__bool__", "__format__", "__repr__", "__hash__", "grad_fn", "is_leaf",
            "data_ptr", "layout", "names", "T", "mT", "__get__", "stride", "storage_offset",
            "is_contiguous", "__index__", "__int__", "__float__", "item", "tolist", "element_size"}


def _on_ipu(device) -> bool:
    """Whether `device` names the IPU ("ipu", "ipu:0", torch.device("ipu"))."""
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "ipu"


# Ops PyTorch only runs on operands of one floating dtype. PopTorch infers their result from the
# first operand (the activation) and casts the others to it: a float32 layer given float16
# activations runs in float16 and its float32 weights train through the cast.
IN_ACTIVATION_DTYPE = {F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
                       F.conv_transpose3d, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                       torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.mv,
                       torch.Tensor.mv, torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm,
                       torch.addmv, torch.Tensor.addmv, torch.addbmm, torch.Tensor.addbmm}


def activation_dtype_operands(args, kwargs):
    """`args` and `kwargs` with every floating tensor in the first floating tensor's dtype."""
    floats = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if len({t.dtype for t in floats}) < 2:
        return args, kwargs
    dtype = floats[0].dtype
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, (args, kwargs))


class BlockAnnotator(TorchFunctionMode):
    """Annotates every torch call the model makes, and the backward of it, with its block."""

    def __init__(self, trace: BlockTrace, root: torch.nn.Module, *, training: bool = False,
                 source_excludes=DEFAULT_SOURCE_LOCATION_EXCLUDES):
        super().__init__()
        self.trace = trace
        self.training = training
        self.source_excludes = tuple(source_excludes)
        self.modules = {id(m): (name, m) for name, m in root.named_modules()}
        self.losses: list[tuple[torch.Tensor, Annotation]] = []
        self.tagged: dict = {}          # autograd node -> annotation (keeps the nodes alive)
        self._saved: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _function_name(func)
        if name.lstrip(".") in _NOT_OPS or getattr(func, "__name__", "") == "__get__":
            return func(*args, **kwargs)
        annotation = self.annotate(name)
        if _on_ipu(kwargs.get("device")):   # a tensor made on the IPU while captured: the capture's device
            kwargs = {**kwargs, "device": None}
        if func in CONTROL_FLOW and self.training:
            raise Error(f"poptorch.{CONTROL_FLOW[func]}() is only supported in inference ({annotation.source})")
        with fx_traceback.annotate({KEY: annotation}):
            if func in IN_ACTIVATION_DTYPE:
                args, kwargs = activation_dtype_operands(args, kwargs)
            if func in CONTROL_FLOW:
                with self:
                    out = FUNCTIONS[func](*args, **kwargs)
            else:
                out = FUNCTIONS.get(func, func)(*args, **kwargs)
        self.tag_backward(out, annotation)
        if func in LOSS_FUNCTIONS and isinstance(out, torch.Tensor):
            self.losses.append((out, annotation))
        return out

    def annotate(self, function: str) -> Annotation:
        source, module, leaf = "<unknown>", "", False
        frame = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            if not module and frame.f_code.co_name == "forward":
                owner = self.modules.get(id(frame.f_locals.get("self")))
                if owner is not None:
                    path, m = owner
                    module = f"{path or '<root>'} ({type(m).__name__})"
                    leaf = type(m).__module__.startswith("torch.nn")
            if source == "<unknown>" and not filename.startswith("<") and \
                    not any(fragment in filename for fragment in self.source_excludes):
                source = f"{filename}:{frame.f_lineno}"
            if module and source != "<unknown>":
                break
            frame = frame.f_back
        block = self.trace.active
        return Annotation(block, source, module, function, leaf, None if block is not None else self.trace.last_closed,
                          self.trace.scope)

    # ---- backward: the autograd nodes a call created run under its annotation ----------------
    def tag_backward(self, out, annotation: Annotation) -> None:
        stack = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in self.tagged or type(node).__name__ == "AccumulateGrad":
                continue
            self.tagged[node] = annotation
            node.register_prehook(functools.partial(self._enter, annotation))
            node.register_hook(self._leave)
            stack.extend(fn for fn, _ in node.next_functions)

    def _enter(self, annotation: Annotation, grad_outputs) -> None:
        meta = fx_traceback.get_current_meta()
        custom = meta.get("custom")
        self._saved.append(custom)
        meta["custom"] = {**(custom or {}), KEY: annotation}

    def _leave(self, grad_inputs, grad_outputs) -> None:
        meta = fx_traceback.get_current_meta()
        custom = self._saved.pop()
        if custom is None:
            meta.pop("custom", None)
        else:
            meta["custom"] = custom


class LossError(Error, RuntimeError):
    """A training model's graph has no final loss, or more than one (PopTorch's errors)."""


def final_loss(losses: list[tuple[torch.Tensor, Annotation]], outputs: list) -> tuple[torch.Tensor, Annotation]:
    """PopTorch's rule: exactly one loss among the outputs' ancestors that feeds no other loss.
    Ancestry is read from the autograd graph of the traced call."""
    def reach(roots) -> set:
        seen, stack = set(), [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack.extend(fn for fn, _ in node.next_functions)
        return seen

    from_outputs = reach(outputs)
    candidates = [(t, a) for t, a in losses if t.grad_fn is not None and t.grad_fn in from_outputs]
    if not candidates:
        # a loss of constants among the outputs (a model whose layers are all in eval mode or frozen):
        # PopTorch trains it with zero gradients
        constant = [(t, a) for t, a in losses if t.grad_fn is None and any(t is o for o in outputs)]
        if len(constant) == 1:
            candidates = constant
        elif any(t.grad_fn is None for t, _ in losses):
            raise LossError("the loss does not depend on any trainable parameter")
    finals = [(t, a) for t, a in candidates
              if not any(o is not t and t.grad_fn in reach([o]) for o, _ in candidates)]
    if not finals:
        raise LossError("Couldn't find a loss in graph: a training model must return a loss computed "
                           "by a torch loss (e.g. torch.nn.NLLLoss) or wrapped in poptorch.identity_loss(x, "
                           "reduction=...)")
    if len(finals) > 1:
        where = ", ".join(f"{a.function} at {a.source}" for _, a in finals)
        raise LossError(f"Multiple independent losses found in graph. Graph must have one final loss. Wrap final "
                        f"graph loss in poptorch.identity_loss. The losses: {where}; combine them, e.g. "
                        "poptorch.identity_loss(total, reduction='none')")
    loss, annotation = finals[0]
    if loss.numel() != 1:
        raise LossError(f"the final loss {annotation.function} at {annotation.source} has shape "
                        f"{list(loss.shape)}; training needs a scalar loss: use reduction='mean' or 'sum'")
    return loss, annotation


@dataclass(frozen=True)
class Output:
    """A tensor output of the model in its output tree: argument `index` of the graph's output."""
    index: int


@dataclass
class JointGraph:
    """A captured model: one fx graph of ATen ops and what its inputs and outputs are.

    Placeholders are, in order, the parameters, the buffers and the tensor inputs; outputs are
    the model's tensor outputs, the new value of each input the model changes in place (the
    inputs numbered in ``input_updates``), then the loss (training), the gradients of ``grads``'
    parameters and the new value of every buffer."""

    graph_module: torch.fx.GraphModule
    params: list[str]
    buffers: list[str]
    inputs: list[str]                       # names of the model's tensor inputs, in call order
    output_tree: Any                        # the model's outputs: tensors as Output(i), the rest as they are
    num_outputs: int
    loss: Optional[Annotation] = None       # where the final loss was computed (training)
    grads: list[str] = field(default_factory=list)
    input_updates: list[int] = field(default_factory=list)  # inputs changed in place, in output order

    def output_values(self) -> list[torch.fx.Node]:
        return list(self.graph_module.graph.output_node().args[0])


def _bind(model: torch.nn.Module, args, kwargs) -> tuple[list[tuple[str, torch.Tensor]], Any]:
    """The model's tensor inputs, in the order the executor feeds them (``arguments.bind``: nested
    containers and custom argument types included), and a function rebuilding the call from
    replacements for them."""
    call = arguments.bind(model.forward, args, kwargs)
    return call.tensors, call.with_tensors


def _check_buffers_kept(model: torch.nn.Module, buffers: dict) -> None:
    """At the end of forward every buffer is still the model's, the same tensor (changed in
    place at most): PopTorch's errors for a buffer removed or reassigned in forward."""
    now = dict(torch.nn.Module.named_buffers(model))
    for name, tensor in buffers.items():
        if name not in now:
            raise Error(f"Buffer {name} is removed from the model when calling the forward method.")
        if now[name] is not tensor:
            raise Error(f"Buffer {name} is reassigned within the model when calling the forward method. This is "
                        f"not supported. Consider using self.{name}.copy_(src) to copy data from a source tensor, "
                        "where src is the name of the source tensor.")


@contextlib.contextmanager
def _unvalidated_distributions():
    """torch.distributions without their argument checks (``torch.lt(low, high).all()``), as
    PopTorch traces them: a check branches on the values of device tensors, which the capture
    does not have."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)


def capture_joint(model: torch.nn.Module, args, kwargs, *, training: bool, decompositions: dict,
                  trainable=None, loss_scaling: float = 1.0,
                  device_loss_scale: bool = False, per_replica=frozenset(),
                  source_excludes=DEFAULT_SOURCE_LOCATION_EXCLUDES) -> JointGraph:
    """Trace ``model(*args, **kwargs)`` (and, when training, the gradients of the final loss times
    ``loss_scaling`` with respect to the parameters named in ``trainable``, default all that
    require grad) into a :class:`JointGraph` of ATen ops, decomposed with `decompositions`
    (``aten.decompositions()``: down to the ops the compiler lowers). Ops mixing float16 and
    float32 follow PyTorch's promotion (to float32), as PopTorch 3 does; matmuls and convolutions,
    which PyTorch refuses to mix, run in their activation's dtype (:data:`IN_ACTIVATION_DTYPE`). With
    `device_loss_scale` (automatic loss scaling) the seed is scaled by the library op
    ``loss_scale``, which the device reads from a tensor it updates. A parameter named in
    `per_replica` (a per-replica variable, one value per replica group along its first dimension)
    is traced as one replica sees it: its first slice. A frame whose file name holds one of
    `source_excludes` is not taken as an op's source line."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"capture expects a torch.nn.Module, got {type(model).__name__}")
    params = dict(torch.nn.Module.named_parameters(model))
    buffers = dict(torch.nn.Module.named_buffers(model))
    if trainable is None:
        trainable = {n for n, p in params.items() if p.requires_grad}
    inputs, rebuild = _bind(model, args, kwargs)
    pnames, bnames = list(params), list(buffers)
    found: dict = {}

    def joint(*flat):
        p = dict(zip(pnames, flat[:len(pnames)]))
        b = dict(zip(bnames, flat[len(pnames):len(pnames) + len(bnames)]))
        call_args, call_kwargs = rebuild(flat[len(pnames) + len(bnames):])
        with tracing_blocks() as trace:
            annotator = BlockAnnotator(trace, model, training=training, source_excludes=source_excludes)
            root_hook = block_annotation(model)
            if root_hook is not None:
                root_hook.start()
            # attention as ATen's math composition (matmuls, softmax, dropout): the fused CPU
            # kernel's backward has no decomposition
            watch = model.register_forward_hook(lambda *_: _check_buffers_kept(model, b))
            try:
                with annotator, sdpa_kernel([SDPBackend.MATH]), _unvalidated_distributions():
                    out = torch.func.functional_call(model, {**p, **b}, tuple(call_args), call_kwargs)
            except TypeError as e:
                # torch's argument parser names the classes it got: the user passed Tensors
                if "FakeTensor" not in str(e):
                    raise
                raise TypeError(re.sub(r"\bFakeTensor\b", "Tensor", str(e))).with_traceback(e.__traceback__) from None
            finally:
                watch.remove()
        # outputs in any nesting of tuples, namedtuples, lists and dicts (subclasses too)
        tensors = flatten_values(out, torch.Tensor)
        found["tree"] = out
        extra = []
        if training:
            loss, where = final_loss(annotator.losses, tensors)
            found["loss"] = where
            wrt = [n for n in pnames if n in trainable]
            with fx_traceback.annotate({KEY: where}):
                if device_loss_scale:
                    seed = library.loss_scale(loss, float(loss_scaling))
                else:
                    seed = loss * loss_scaling if loss_scaling != 1.0 else loss
            with fx_traceback.annotate({"pass": "bwd"}):
                grads = torch.autograd.grad(seed, [p[n] for n in wrt], allow_unused=True) if seed.requires_grad \
                    else [None] * len(wrt)
            found["grads"] = [n for n, g in zip(wrt, grads) if g is not None]
            extra = [loss.detach()] + [g for g in grads if g is not None]
        return [t.detach() for t in tensors] + extra + [b[n] for n in bnames]

    flat = [(t[0] if n in per_replica else t).detach().requires_grad_(training and n in trainable)
            for n, t in params.items()]
    # an input with autograd history (made by an in-place op on a tensor that requires grad) is
    # data to the model: the compiler differentiates parameters only
    flat += [t.detach() for t in buffers.values()] + [t.detach() for _, t in inputs]
    table = decompositions
    with fx_traceback.preserve_node_meta():
        # tensors the model makes or holds outside its parameters and buffers (torch.tensor(...)
        # in forward, tensor default arguments) are real: they become constants of the graph
        with torch.enable_grad():
            recorded = make_fx(joint, decomposition_table=table, tracing_mode="fake",
                               _allow_non_fake_inputs=True)(*flat)

        def replay(*a):
            return torch.fx.Interpreter(recorded).run(*a)

        # the replay holds the backward already: no autograd graph of it
        functional = torch.func.functionalize(replay, remove="mutations_and_views")
        with torch.no_grad():
            gm = make_fx(functional, decomposition_table=table, tracing_mode="fake",
                         _allow_non_fake_inputs=True)(*[t.detach() for t in flat])
    index = itertools.count()
    output_tree = map_values(found["tree"], lambda t: Output(next(index)), torch.Tensor)
    num_outputs = next(index)
    input_updates = _outputs_for_input_updates(gm, len(pnames) + len(bnames), num_outputs)
    joint_graph = JointGraph(gm, pnames, bnames, [n for n, _ in inputs], output_tree, num_outputs,
                             found.get("loss"), found.get("grads", []), input_updates)
    check_blocks(joint_graph)
    return joint_graph


def buffers_changed_in_place(joint: JointGraph) -> dict[str, Annotation]:
    """The buffers the model's own code changes (``self.buf += x``), each with the call that does:
    not BatchNorm's running statistics (its op updates them) nor its num_batches_tracked (a host
    counter)."""
    if not joint.buffers:
        return {}
    placeholders = [n for n in joint.graph_module.graph.nodes if n.op == "placeholder"]
    first = len(joint.params)
    changed = {}
    for name, before, after in zip(joint.buffers, placeholders[first:first + len(joint.buffers)],
                                   joint.output_values()[-len(joint.buffers):]):
        a = annotation_of(after)
        if after is before or name.rsplit(".", 1)[-1] == "num_batches_tracked" or \
                (a is not None and a.function == "batch_norm"):
            continue
        changed[name] = a
    return changed


def _outputs_for_input_updates(gm: torch.fx.GraphModule, first_input: int, num_outputs: int) -> list[int]:
    """A model input changed in place (``x += 1``, ``x.copy_(y)``, ``x[0] = 0``): functionalisation
    writes its final value back with ``copy_`` onto the placeholder. Make that value an output
    instead, after the model's own (PopTorch returns it from the device and copies it into the
    caller's tensor); the inputs' numbers, in output order."""
    graph = gm.graph
    inputs = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder") if i >= first_input}
    updates: dict[int, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.copy_.default and node.args[0] in inputs:
            updates[inputs[node.args[0]] - first_input] = node.args[1]
            graph.erase_node(node)
    if updates:
        out = graph.output_node()
        values = list(out.args[0])
        out.args = (values[:num_outputs] + list(updates.values()) + values[num_outputs:],)
        gm.recompile()
    return list(updates)


def check_blocks(joint: JointGraph) -> None:
    """An op issued after a block closed and before the next started is PopTorch's "No active
    Block" error: name the op, its source line and the block that had closed."""
    for node in joint.graph_module.graph.nodes:
        a = annotation_of(node)
        if node.op != "call_function" or a is None or a.block is not None or pass_of(node) != "fwd":
            continue
        if a.closed is None:
            closed_text, fix = "a block had closed", "wrap it in a `with Block(...)`"
        else:
            closed_text = f"block {a.closed} had closed"
            fix = f"wrap it in `with Block({a.closed.user_id!r}):` (the block that closed before it)"
        raise BlockError(
            f"No active Block: {a.describe()} at {a.source} is outside any Block. Ops before the first block run in "
            "stage 0 on IPU 0, but once a block has started every op must belong to one, and "
            f"{closed_text} when this op ran. To place it, {fix} or start a block with Block.start(...)."
        )
