"""Layer norm and batch norm, forward and backward, with torch's semantics.

Statistics are computed in two passes (mean, then the mean of squared deviations; biased
variance, as torch normalises), accumulated and kept in float32 (also for float16 inputs), from
reductions and segment maps (reduce.py): each tile normalises the elements it holds with its
own copy of their rows' (layer norm) or channels' (batch norm) statistics.

    layer norm over the last k dims:  y = (x - mean) * inv_std * weight + bias,
        inv_std = 1 / sqrt(var + eps)
    backward (D elements per row, g = dy * weight, xhat = (x - mean) * inv_std):
        dx = inv_std * (g - mean(g) - xhat * mean(g * xhat))
        dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy
    batch norm over (N, H, W) per channel (M elements per channel):
        y = (x - mean) * (weight * inv_std) + bias
        dx = weight * inv_std * (dy - sum(dy) / M - xhat * sum(dy * xhat) / M)
        dweight = sum(dy * xhat),  dbias = sum(dy)
    running statistics (torch): running = (1 - momentum) * running + momentum * batch statistic,
        with the unbiased variance var * M / (M - 1) for running_var.

Cycles are those of the parts; the running-statistics vertex costs
    6 + ceil(n / width) * 3 thread instructions (width: elements per 64-bit vector).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, kernel_view, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.tensor import Tensor
from ..device.vertex import VertexType
from . import elementwise as ew
from .common import placed, region_work
from .reduce import composite, reduce, segment_map, vector_width

F32 = np.float32


def _f32(graph: Graph, t: Tensor | None, body: Sequence, name: str) -> Tensor | None:
    return t if t is None or t.dtype == F32 else ew.cast(graph, t, F32, body, name)


def _inv_std(graph: Graph, var: Tensor, eps: float, body: Sequence, name: str) -> Tensor:
    shifted = ew.unary(graph, "scale", var, body, f"{name}/var_eps", scale=1.0, bias=float(eps))
    return ew.unary(graph, "rsqrt", shifted, body, f"{name}/inv_std")


def _check_param(t: Tensor | None, shape: tuple, what: str, name: str) -> None:
    if t is not None and t.shape != shape:
        raise ValueError(f"{name}: {what} {t.name!r} has shape {t.shape}, expected {shape}")


def _moments(graph: Graph, x: Tensor, axes: tuple, count: int, body: Sequence, name: str,
             var_category: str = "activations") -> tuple[Tensor, Tensor]:
    """(mean, biased variance) over axes, two-pass, float32."""
    mean = reduce(graph, x, axes, "mean", body, f"{name}/mean", out_dtype=F32)
    centred = segment_map(graph, "sub", x, axes, body, f"{name}/centred", r=mean, out_dtype=F32,
                          category="temporaries")
    var = reduce(graph, centred, axes, "sum_squares", body, f"{name}/var", out_dtype=F32, scale=1.0 / count,
                 category=var_category)
    return mean, var


# ---- layer norm --------------------------------------------------------------------------------
def _layer_axes(x: Tensor, normalized_ndim: int, name: str) -> tuple:
    if x.dtype.kind != "f":
        raise TypeError(f"{name}: {x.name!r} is {x.dtype.name}; normalisation needs a float tensor")
    if not 1 <= normalized_ndim <= x.rank:
        raise ValueError(f"{name}: normalized_ndim must be in [1, {x.rank}] for {x.name!r} {x.shape}, "
                         f"got {normalized_ndim}")
    if x.numel == 0:
        raise ValueError(f"{name}: {x.name!r} {x.shape} is empty")
    return tuple(range(x.rank - normalized_ndim, x.rank))


def layer_norm(graph: Graph, x: Tensor, normalized_ndim: int, weight: Tensor | None, bias: Tensor | None,
               eps: float, prog: Sequence, name: str = "layer_norm") -> tuple[Tensor, Tensor, Tensor]:
    """torch.nn.functional.layer_norm over the last `normalized_ndim` dims: returns (y, mean,
    inv_std), the statistics float32 with the shape of the leading dims."""
    axes = _layer_axes(x, normalized_ndim, name)
    norm_shape = x.shape[x.rank - normalized_ndim:]
    _check_param(weight, norm_shape, "weight", name)
    _check_param(bias, norm_shape, "bias", name)
    body = Sequence(name=name)
    mean, var = _moments(graph, x, axes, int(np.prod(norm_shape)), body, name, "temporaries")
    inv_std = _inv_std(graph, var, eps, body, name)
    if bias is not None and weight is None:
        weight = graph.addConstant(bias.dtype, (1,), 1.0, f"{name}/ones")
        graph.setTileMapping(weight, 0)
        weight = weight.reshape(()).broadcast(norm_shape)
    if weight is None:
        y = segment_map(graph, "normalise", x, axes, body, name, r=mean, q=inv_std, out_dtype=x.dtype)
    elif bias is None:
        y = segment_map(graph, "norm_scale", x, axes, body, name, r=mean, q=inv_std, b=weight, out_dtype=x.dtype)
    else:
        y = segment_map(graph, "norm_affine", x, axes, body, name, r=mean, q=inv_std, b=weight, c=bias,
                        out_dtype=x.dtype)
    reads = tuple(t for t in (x, weight, bias) if t is not None)
    prog.add(composite(name, body, reads, (y, mean, inv_std)))
    return y, mean, inv_std


def layer_norm_backward(graph: Graph, dy: Tensor, x: Tensor, mean: Tensor, inv_std: Tensor,
                        weight: Tensor | None, bias: Tensor | None, normalized_ndim: int, prog: Sequence,
                        name: str = "layer_norm_backward") -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients (dx, dweight, dbias) of layer_norm; dweight / dbias are None without weight / bias."""
    axes = _layer_axes(x, normalized_ndim, name)
    norm_shape = x.shape[x.rank - normalized_ndim:]
    _check_param(weight, norm_shape, "weight", name)
    _check_param(bias, norm_shape, "bias", name)
    if dy.shape != x.shape:
        raise ValueError(f"{name}: gradient {dy.name!r} {dy.shape} and input {x.name!r} {x.shape} differ in shape")
    lead = tuple(range(x.rank - normalized_ndim))
    body = Sequence(name=name)
    xhat = segment_map(graph, "normalise", x, axes, body, f"{name}/xhat", r=mean, q=inv_std, out_dtype=F32,
                       category="temporaries")
    g = dy if weight is None else segment_map(graph, "mul", dy, axes, body, f"{name}/g", b=weight, out_dtype=F32,
                                              category="temporaries")
    gx = segment_map(graph, "mul", g, axes, body, f"{name}/g_xhat", b=xhat, out_dtype=F32, category="temporaries")
    mg = reduce(graph, g, axes, "mean", body, f"{name}/mean_g", out_dtype=F32, category="temporaries")
    mgx = reduce(graph, gx, axes, "mean", body, f"{name}/mean_g_xhat", out_dtype=F32, category="temporaries")
    dx = segment_map(graph, "norm_grad", g, axes, body, name, b=xhat, r=mg, q=mgx, s=inv_std, out_dtype=x.dtype)
    dweight = dbias = None
    if weight is not None:
        dy_xhat = segment_map(graph, "mul", dy, axes, body, f"{name}/dy_xhat", b=xhat, out_dtype=F32,
                              category="temporaries")
        dweight = reduce(graph, dy_xhat, lead, "sum", body, f"{name}/dweight", out_dtype=weight.dtype,
                         category="gradients")
    if bias is not None:
        dbias = reduce(graph, dy, lead, "sum", body, f"{name}/dbias", out_dtype=bias.dtype, category="gradients")
    reads = tuple(t for t in (dy, x, mean, inv_std, weight) if t is not None)
    prog.add(composite(name, body, reads, tuple(t for t in (dx, dweight, dbias) if t is not None)))
    return dx, dweight, dbias


# ---- batch norm --------------------------------------------------------------------------------
def _channel_axes(x: Tensor, name: str) -> tuple[tuple, int]:
    if x.dtype.kind != "f":
        raise TypeError(f"{name}: {x.name!r} is {x.dtype.name}; normalisation needs a float tensor")
    if x.rank < 2:
        raise ValueError(f"{name}: {x.name!r} {x.shape} needs a batch and a channel dimension (N, C, ...)")
    axes = (0,) + tuple(range(2, x.rank))
    return axes, int(np.prod([x.shape[a] for a in axes]))


def _check_rank4(x: Tensor, name: str) -> None:
    if x.rank != 4:
        raise ValueError(f"{name}: 2-D batch norm takes NCHW input, got {x.name!r} of shape {x.shape}")


def batch_norm_train(graph: Graph, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                     prog: Sequence, name: str = "batch_norm") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Batch norm with batch statistics over all dims but the channel dim 1: returns (y, mean,
    var, inv_std), statistics float32 of shape [C] (var biased; see update_running_stats)."""
    axes, count = _channel_axes(x, name)
    channels = (x.shape[1],)
    _check_param(weight, channels, "weight", name)
    _check_param(bias, channels, "bias", name)
    if count <= 1:
        raise ValueError(f"{name}: expected more than 1 value per channel when training, got input size {x.shape}")
    body = Sequence(name=name)
    mean, var = _moments(graph, x, axes, count, body, name)
    inv_std = _inv_std(graph, var, eps, body, name)
    y = _normalise_channels(graph, x, axes, mean, inv_std, weight, bias, body, name)
    reads = tuple(t for t in (x, weight, bias) if t is not None)
    prog.add(composite(name, body, reads, (y, mean, var, inv_std)))
    return y, mean, var, inv_std


def _normalise_channels(graph, x, axes, mean, inv_std, weight, bias, body, name) -> Tensor:
    """y = (x - mean) * (weight * inv_std) + bias, per channel."""
    q = inv_std if weight is None else ew.mul(graph, _f32(graph, weight, body, f"{name}/weight"), inv_std, body,
                                              f"{name}/scale")
    if bias is None:
        return segment_map(graph, "normalise", x, axes, body, name, r=mean, q=q, out_dtype=x.dtype)
    return segment_map(graph, "norm_shift", x, axes, body, name, r=mean, q=q, s=bias, out_dtype=x.dtype)


def batch_norm_backward(graph: Graph, dy: Tensor, x: Tensor, mean: Tensor, inv_std: Tensor,
                        weight: Tensor | None, prog: Sequence,
                        name: str = "batch_norm_backward") -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dx, dweight, dbias) of batch_norm_train (dweight, dbias float32 [C], or the
    weight's dtype)."""
    axes, count = _channel_axes(x, name)
    _check_param(weight, (x.shape[1],), "weight", name)
    if dy.shape != x.shape:
        raise ValueError(f"{name}: gradient {dy.name!r} {dy.shape} and input {x.name!r} {x.shape} differ in shape")
    body = Sequence(name=name)
    xhat = segment_map(graph, "normalise", x, axes, body, f"{name}/xhat", r=mean, q=inv_std, out_dtype=F32,
                       category="temporaries")
    dbias = reduce(graph, dy, axes, "sum", body, f"{name}/dbias", out_dtype=F32, category="gradients")
    dy_xhat = segment_map(graph, "mul", dy, axes, body, f"{name}/dy_xhat", b=xhat, out_dtype=F32,
                          category="temporaries")
    dweight = reduce(graph, dy_xhat, axes, "sum", body, f"{name}/dweight", out_dtype=F32, category="gradients")
    k = inv_std if weight is None else ew.mul(graph, _f32(graph, weight, body, f"{name}/weight"), inv_std, body,
                                              f"{name}/scale")
    mean_dy = ew.scale(graph, dbias, 1.0 / count, body, f"{name}/mean_dy")
    mean_dy_xhat = ew.scale(graph, dweight, 1.0 / count, body, f"{name}/mean_dy_xhat")
    dx = segment_map(graph, "norm_grad", dy, axes, body, name, b=xhat, r=mean_dy, q=mean_dy_xhat, s=k,
                     out_dtype=x.dtype)
    if weight is not None and weight.dtype != F32:
        dweight = ew.cast(graph, dweight, weight.dtype, body, f"{name}/dweight_cast")
        dbias = ew.cast(graph, dbias, weight.dtype, body, f"{name}/dbias_cast")
    reads = tuple(t for t in (dy, x, mean, inv_std, weight) if t is not None)
    prog.add(composite(name, body, reads, (dx, dweight, dbias)))
    return dx, dweight, dbias


def batch_norm_inference(graph: Graph, x: Tensor, running_mean: Tensor, running_var: Tensor,
                         weight: Tensor | None, bias: Tensor | None, eps: float, prog: Sequence,
                         name: str = "batch_norm_inference") -> Tensor:
    """Batch norm with running statistics: y = (x - running_mean) / sqrt(running_var + eps) * weight + bias."""
    axes, _ = _channel_axes(x, name)
    channels = (x.shape[1],)
    for t, what in ((running_mean, "running_mean"), (running_var, "running_var"), (weight, "weight"), (bias, "bias")):
        _check_param(t, channels, what, name)
    body = Sequence(name=name)
    inv_std = _inv_std(graph, _f32(graph, running_var, body, f"{name}/running_var"), eps, body, name)
    y = _normalise_channels(graph, x, axes, running_mean, inv_std, weight, bias, body, name)
    reads = tuple(t for t in (x, running_mean, running_var, weight, bias) if t is not None)
    prog.add(composite(name, body, reads, (y,)))
    return y


def batch_norm2d_train(graph, x, weight, bias, eps, prog, name="batch_norm2d"):
    """batch_norm_train for NCHW input (torch.nn.BatchNorm2d in training)."""
    _check_rank4(x, name)
    return batch_norm_train(graph, x, weight, bias, eps, prog, name)


def batch_norm2d_backward(graph, dy, x, mean, inv_std, weight, prog, name="batch_norm2d_backward"):
    """batch_norm_backward for NCHW input."""
    _check_rank4(x, name)
    return batch_norm_backward(graph, dy, x, mean, inv_std, weight, prog, name)


def batch_norm2d_inference(graph, x, running_mean, running_var, weight, bias, eps, prog,
                           name="batch_norm2d_inference"):
    """batch_norm_inference for NCHW input (torch.nn.BatchNorm2d in eval mode)."""
    _check_rank4(x, name)
    return batch_norm_inference(graph, x, running_mean, running_var, weight, bias, eps, prog, name)


# ---- running statistics ------------------------------------------------------------------------
@njit(**JIT)
def running_value(running, stat, momentum, correction):
    return (1.0 - momentum) * running + momentum * (stat * correction)


@njit(parallel=True, **JIT)
def running_stats_codelet(stat, s_addr, s_start, running, r_addr, r_start, params):
    """params: momentum, correction. running = (1 - momentum) * running + momentum * stat * correction."""
    for v in prange(params.shape[0]):
        for i in range(r_start[v + 1] - r_start[v]):
            a = r_addr[r_start[v] + i]
            st(running, a, running_value(ld(running, a), ld(stat, s_addr[s_start[v] + i]), params[v, 0], params[v, 1]))


@njit(parallel=True, **JIT)
def running_stats_whole(stat, running, out, momentum, correction):
    for i in prange(out.size):
        st(out, i, running_value(ld(running, i), ld(stat, i), momentum, correction))


RUNNING_STATS_VERTEX = VertexType(
    "popnn::RunningStatistics", ("stat",), ("running",), running_stats_codelet,
    lambda sizes, params, dtype, target: target.thread_cycles(
        6 + np.ceil(sizes["running"] / vector_width(dtype)) * 3),
    num_params=2)


def update_running_stats(graph: Graph, running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor,
                         momentum: float, count: int, prog: Sequence, name: str = "update_running_stats") -> None:
    """In place, as torch's BatchNorm in training: running_mean = (1 - momentum) * running_mean +
    momentum * mean; running_var likewise with the unbiased var * count / (count - 1), where
    `count` is the number of values per channel (N * H * W) and var the biased batch variance."""
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"{name}: momentum must be in [0, 1], got {momentum} (cumulative averaging, "
                         "momentum=None in torch, is not supported)")
    if count < 2:
        raise ValueError(f"{name}: the unbiased variance needs at least 2 values per channel, got {count}")
    for stat, running in ((mean, running_mean), (var, running_var)):
        if stat.numel != running.numel:
            raise ValueError(f"{name}: statistics {stat.name!r} {stat.shape} and {running.name!r} {running.shape} "
                             "differ in size")
    body = Sequence(name=name)
    cs = graph.addComputeSet(name)
    pairs = ((mean, running_mean, 1.0), (var, running_var, count / (count - 1)))
    for stat, running, correction in pairs:
        run = running.flatten()
        sl = placed(graph, body, stat.reshape(run.shape), run.tile_map(), f"{name}/{running.name}").flatten()
        work = region_work(run.tile_map(), graph.target.workers_per_tile, grain=4)
        graph.addVertices(cs, RUNNING_STATS_VERTEX, work.tiles, {"stat": work.field(sl), "running": work.field(run)},
                          np.array([momentum, correction], np.float64))
    body.add(Execute(cs))

    def fast(io):
        for stat, running, correction in pairs:
            res = np.empty(running.shape, dtype=running.dtype)
            cur = kernel_view(np.ascontiguousarray(io.read(running)).reshape(-1))
            new = kernel_view(np.ascontiguousarray(io.read(stat)).reshape(-1))
            running_stats_whole(new, cur, kernel_view(res.reshape(-1)), float(momentum), correction)
            io.write(running, res)

    prog.add(OpProgram(name, body, fast, (mean, var, running_mean, running_var), (running_mean, running_var)))
