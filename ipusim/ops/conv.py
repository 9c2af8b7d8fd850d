"""Convolution forward, and its gradients with respect to the input and the weights, over one,
two or three spatial dimensions, in PyTorch's conventions: activations [N, C, *spatial], weights
[O, C / groups, *kernel], stride, zero padding, dilation and groups.

One general form serves all three passes and every number of spatial dimensions, as in PopLibs:
a convolution of an input [G, B, Ci, D, H, W] with a kernel [G, Co, Ci, KD, KH, KW] into an
output [G, B, Co, OD, OH, OW] (fewer spatial dimensions are the last of these three, the others
of size 1), where along each spatial dimension (`ConvDim`) output o and kernel tap t read the
input at the coordinate u = o * stride + t' * dilation - padding of the zero-dilated, padded
input (t' = K - 1 - t when the kernel is flipped); u must be a multiple of the input dilation,
the input element being u / in_dilation. Then
  forward            x [N, C, ...] * w              -> y:  G = groups, B = N, Ci = C/G, Co = O/G
  backward to input  dy (input dilation = stride, padding = dilation (k - 1) - padding, stride 1,
                     flipped kernel w transposed to [G, C/G, O/G, ...])  -> dx
  backward to weights x as [G, C/G, N, ...] * dy as a kernel [G, O/G, N, ...] with stride =
                     dilation and dilation = stride  -> dw as [G, C/G, O/G, ...]
All are views of the user's tensors (transposes and reshapes only rearrange indices).

Plan (`plan_conv`, a pure function of the geometry and dtypes): the grid (G, B, Co, OD, OH, OW)
of outputs and the reduction dimensions (Ci, KD, KH) are split into blocks, one per tile, spread
over the IPU; a tile receives by exchange the input window its outputs read (the planes, rows and
columns of its output block's receptive field, halo included, clipped to the real input) and its
kernel block. Without a reduction split the tile computes its piece of the output, which lives
there; with one (Ci, KD or KH split) it writes float32 partials that are exchanged to the
output's tiles and reduced (see matmul.py for the reduction, the candidate splits and the choice
rule). The cost model is the matmul one with window = planes x rows x cols of the receptive
field and, for compute, the valid fraction of (output, tap) pairs along each dimension.

Cycle estimator of a vertex computing `lines` output rows (of `out_cols` each, a line being one
(group, batch, out channel, output plane, output row)), over `in_ch` input channels and a
kd x kh x kw kernel block, with V multiply-accumulates landing on real (not padding) input:
    flop_cycles(2 V) + thread_cycles(20 + kd * kh * kw * ceil(in_ch / A) * (6 + lines))
the AMP structure of PopLibs' nx1 convolution partials (poplin PerformanceEstimation.hpp): for
every kernel tap and group of A input channels (16 float16, 8 float32) a pass that loads its
weights (6 instructions) and then walks a worklist of one entry per output line; 20 for the
worker's setup. Padding positions are skipped, as PopLibs' worklists skip them.

Numerics: strict vertices accumulate in float64 and round once to the output dtype (or to the
float32 partials, which the reduction sums in float64 and rounds once). The fast mode uses im2col
(strided views) and one batched BLAS matmul per op, plus a col2im scatter of the taps' strided
adds for the gradient to the input; float16 operands are computed in float32 and rounded once.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit, prange

from ..device import blas
from ..device.graph import Graph
from ..device.kernels import JIT, ld, st
from ..device.mapping import readonly
from ..device.program import Execute, OpProgram, Sequence
from ..device.target import Target
from ..device.tensor import Tensor
from ..device.vertex import Field, VertexType
from .common import (GRAIN, box_runs, by_distinct_rows, gather_boxes, kernel_array, map_boxes, new_output, split_ranges,
                     store)
from .matmul import (AVAILABLE_MEMORY_PROPORTION, PARTIALS, _flop_cycles, amp_channels, block_grid, block_partials,
                     block_tiles, ceil_div, check_proportion, choose_split, float_dtype, linear_tile_elements,
                     output_dtype, partials_variable, ranges, reduce_cycles, reduce_partials, split_grid)

DIMS = ("groups", "batch", "out_channels", "out_planes", "out_rows", "out_cols", "in_channels", "kernel_planes",
        "kernel_rows")
SPATIAL = 3   # spatial dimensions of the general form; 1-D and 2-D convolutions lead with unit ones


# ---- geometry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvDim:
    """One spatial dimension of the general convolution (see the module doc); the default is a
    unit dimension (one input, one tap, one output)."""
    in_size: int = 1
    kernel: int = 1
    out_size: int = 1
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    in_dilation: int = 1
    flip: bool = False

    def inputs(self, o, t) -> np.ndarray:
        """Input index read by output o at kernel tap t (broadcast arrays); -1 for padding."""
        tap = self.kernel - 1 - t if self.flip else t
        u = np.asarray(o) * self.stride + tap * self.dilation - self.padding
        q = u // self.in_dilation
        return np.where((u >= 0) & (u % self.in_dilation == 0) & (q < self.in_size), q, -1)

    def span(self, o0: int, o1: int, t0: int, t1: int) -> tuple[int, int]:
        """[lo, hi) of the input read by outputs [o0, o1) at taps [t0, t1); (0, 0) if only padding."""
        idx = self.inputs(np.arange(o0, o1)[:, None], np.arange(t0, t1)[None, :])
        real = idx[idx >= 0]
        return (int(real.min()), int(real.max()) + 1) if real.size else (0, 0)

    @property
    def valid_fraction(self) -> float:
        """Share of (output, tap) pairs that read real input."""
        idx = self.inputs(np.arange(self.out_size)[:, None], np.arange(self.kernel)[None, :])
        return float((idx >= 0).mean())


@dataclass(frozen=True)
class ConvGeometry:
    """A convolution in the general form: channel counts are per group; d, h, w the spatial
    dimensions (planes, rows, columns)."""
    groups: int
    batch: int
    in_channels: int
    out_channels: int
    d: ConvDim
    h: ConvDim
    w: ConvDim

    @property
    def dims(self) -> tuple[int, ...]:
        """Sizes along DIMS: (G, B, Co, OD, OH, OW, Ci, KD, KH)."""
        return (self.groups, self.batch, self.out_channels, self.d.out_size, self.h.out_size, self.w.out_size,
                self.in_channels, self.d.kernel, self.h.kernel)


def _spatial(v, nd: int, what: str) -> tuple[int, ...]:
    t = tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),) * nd
    if len(t) == 1 and nd > 1:
        t = t * nd
    if len(t) != nd:
        raise ValueError(f"{what} must be an int or {nd} ints, got {v!r}")
    return t


def conv_params(stride, padding, dilation, what: str, nd: int = 2):
    """Normalise torch-style int-or-tuple arguments of `nd` spatial dimensions, checking their ranges."""
    s, p, d = (_spatial(v, nd, f"{what}: {name}") for v, name in ((stride, "stride"), (padding, "padding"),
                                                                   (dilation, "dilation")))
    if min(s) < 1:
        raise ValueError(f"{what}: stride must be positive, got {s}")
    if min(d) < 1:
        raise ValueError(f"{what}: dilation must be positive, got {d}")
    if min(p) < 0:
        raise ValueError(f"{what}: padding must be non-negative, got {p}")
    return s, p, d


def conv_output_size(in_size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (in_size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def spatial_rank(x_shape, w_shape, what: str) -> int:
    """The number of spatial dimensions (1 to 3) of a convolution of these operands."""
    nd = len(x_shape) - 2
    if not 1 <= nd <= SPATIAL:
        raise ValueError(f"{what}: expected an input [N, C, *spatial] with 1 to 3 spatial dimensions, got shape "
                         f"{list(x_shape)}")
    if len(w_shape) != nd + 2:
        raise ValueError(f"{what}: expected {nd + 2}-D weights [O, C/groups, *kernel] for a {nd + 2}-D input, got "
                         f"shape {list(w_shape)}")
    return nd


def _check_shapes(x_shape, w_shape, groups: int, what: str):
    spatial_rank(x_shape, w_shape, what)
    if groups < 1:
        raise ValueError(f"{what}: groups must be positive, got {groups}")
    n, c = x_shape[:2]
    o, cg = w_shape[:2]
    if o % groups:
        raise ValueError(f"{what}: given groups={groups}, expected weight to be divisible by {groups} at "
                         f"dimension 0, but got weight of size {list(w_shape)}")
    if c != cg * groups:
        raise ValueError(f"{what}: given groups={groups}, weight of size {list(w_shape)}, expected input "
                         f"{list(x_shape)} to have {cg * groups} channels, but got {c} channels")
    if min(*x_shape, *w_shape) < 1:
        raise ValueError(f"{what}: empty input {list(x_shape)} or weight {list(w_shape)}")


def conv_output_shape(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1,
                      what: str = "conv") -> tuple[int, ...]:
    """Shape of the convolution's output [N, O, *out spatial], with torch's checks and errors."""
    x_shape, w_shape = tuple(int(v) for v in x_shape), tuple(int(v) for v in w_shape)
    _check_shapes(x_shape, w_shape, groups, what)
    nd = len(x_shape) - 2
    s, p, d = conv_params(stride, padding, dilation, what, nd)
    out = tuple(conv_output_size(i, k, *a) for i, k, a in zip(x_shape[2:], w_shape[2:], zip(s, p, d)))
    if min(out) < 1:
        dilated = "x".join(str(dd * (k - 1) + 1) for dd, k in zip(d, w_shape[2:]))
        raise ValueError(f"{what}: calculated output size ({'x'.join(map(str, out))}) is too small: the input "
                         f"{'x'.join(map(str, x_shape[2:]))} padded by {p} is smaller than the dilated kernel {dilated}")
    return (x_shape[0], w_shape[0]) + out


def _lead(values, unit) -> tuple:
    """Per-dimension values of fewer than three spatial dimensions, led by `unit` ones."""
    return (unit,) * (SPATIAL - len(values)) + tuple(values)


def _dims3(*per_dim):
    """Three ConvDims from per-dimension argument tuples (unit dimensions first)."""
    dims = [ConvDim(*args) for args in zip(*per_dim)]
    return (ConvDim(),) * (SPATIAL - len(dims)) + tuple(dims)


def forward_geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1) -> ConvGeometry:
    n, o, *out = conv_output_shape(x_shape, w_shape, stride, padding, dilation, groups)
    s, p, d = conv_params(stride, padding, dilation, "conv", len(out))
    cg = int(w_shape[1])
    return ConvGeometry(groups, n, cg, o // groups, *_dims3(x_shape[2:], w_shape[2:], out, s, p, d))


def backward_input_geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1) -> ConvGeometry:
    n, o, *out = conv_output_shape(x_shape, w_shape, stride, padding, dilation, groups, "conv_backward_input")
    s, p, d = conv_params(stride, padding, dilation, "conv_backward_input", len(out))
    k = tuple(int(v) for v in w_shape[2:])
    return ConvGeometry(groups, n, o // groups, int(w_shape[1]),
                        *_dims3(out, k, x_shape[2:], (1,) * len(k), [dd * (kk - 1) - pp for dd, kk, pp in zip(d, k, p)],
                                d, s, (True,) * len(k)))


def backward_weights_geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1) -> ConvGeometry:
    n, o, *out = conv_output_shape(x_shape, w_shape, stride, padding, dilation, groups, "conv_backward_weights")
    s, p, d = conv_params(stride, padding, dilation, "conv_backward_weights", len(out))
    return ConvGeometry(groups, int(w_shape[1]), n, o // groups, *_dims3(x_shape[2:], out, w_shape[2:], d, p, s))


# ---- cycle estimator -------------------------------------------------------------------------
def conv_partial_cycles(macs, lines, in_ch, k_taps, dtype, target: Target):
    """Cycles of one worker's convolution partials (see the module doc); `k_taps` is the vertex's
    kernel taps kd * kh * kw. Ints or arrays."""
    passes = k_taps * ceil_div(in_ch, amp_channels(dtype))
    return _flop_cycles(2 * macs, dtype, target) + target.workers_per_tile * (20 + passes * (6 + lines))


# Vertex parameters, in order: per spatial dimension (planes d, rows h, columns w) the block's
# window, kernel taps and outputs, then the vertex's lines, then per dimension the stride,
# dilation, input dilation and the offset of the block's first output in the window, then the
# kernel block's first plane and row and the kernel's planes and rows (for flipping), and flip.
PARAMS = ("groups", "batch", "in_ch", "out_ch", "win_planes", "win_rows", "win_cols", "k_planes", "k_rows", "k_cols",
          "out_planes", "out_rows", "out_cols", "line0", "lines", "stride_d", "dilation_d", "in_dilation_d", "base_d",
          "stride_h", "dilation_h", "in_dilation_h", "base_h", "stride_w", "dilation_w", "in_dilation_w", "base_w",
          "k_plane0", "kernel_d", "k_row0", "kernel_h", "flip")
P = {name: i for i, name in enumerate(PARAMS)}
DEPTH_PARAMS = ("win_planes", "k_planes", "out_planes", "stride_d", "dilation_d", "in_dilation_d", "base_d",
                "k_plane0", "kernel_d")


def _state_params(geometry: ConvGeometry) -> int:
    """The parameters a vertex holds as state: a convolution with a unit depth (every 1-D and 2-D
    one) is a two-dimensional vertex in Poplar, without the depth's."""
    return len(PARAMS) - (len(DEPTH_PARAMS) if geometry.d == ConvDim() else 0)


def _valid(count: int, taps: np.ndarray, stride: int, dilation: int, in_dilation: int, base: int,
           window: int) -> np.ndarray:
    """[count, taps] mask of local outputs and (already flipped) taps reading the window."""
    u = np.arange(count)[:, None] * stride + taps[None, :] * dilation + base
    return (u >= 0) & (u % in_dilation == 0) & (u < in_dilation * window)


def _real_taps(p: list, dim: str, window: str, taps: str, outs: str, first: str | None, kernel: str | None):
    """Per local output along dimension `dim`, the taps of the block that read its window."""
    tap = np.arange(p[P[first]], p[P[first]] + p[P[taps]]) if first else np.arange(p[P[taps]])
    total = p[P[kernel]] if kernel else p[P[taps]]
    tap = total - 1 - tap if p[P["flip"]] else tap
    return _valid(p[P[outs]], tap, p[P[f"stride_{dim}"]], p[P[f"dilation_{dim}"]], p[P[f"in_dilation_{dim}"]],
                  p[P[f"base_{dim}"]], p[P[window]]).sum(axis=1)


@lru_cache(maxsize=65536)
def _conv_vertex_macs(params: tuple) -> int:
    p = [int(v) for v in params]
    per_plane = _real_taps(p, "d", "win_planes", "k_planes", "out_planes", "k_plane0", "kernel_d")
    per_row = _real_taps(p, "h", "win_rows", "k_rows", "out_rows", "k_row0", "kernel_h")
    per_col = _real_taps(p, "w", "win_cols", "k_cols", "out_cols", None, None).sum()
    lines = np.arange(p[P["line0"]], p[P["line0"]] + p[P["lines"]])
    rows, planes = lines % p[P["out_rows"]], (lines // p[P["out_rows"]]) % p[P["out_planes"]]
    return int((per_plane[planes] * per_row[rows]).sum()) * int(per_col) * p[P["in_ch"]]


def _conv_vertex_cycles(sizes, params, dtype, target):
    macs = by_distinct_rows(params, _conv_vertex_macs)
    column = lambda name: params[:, P[name]].astype(np.int64)  # noqa: E731
    return conv_partial_cycles(macs, column("lines"), column("in_ch"),
                               column("k_planes") * column("k_rows") * column("k_cols"), dtype, target)


# ---- codelet ---------------------------------------------------------------------------------
@njit(parallel=True, **JIT)
def conv_codelet(x, x_addr, x_start, w, w_addr, w_start, out, o_addr, o_start, params):
    """Output lines [line0, line0 + lines) of a block: out[g, b, co, od, oh, ow] = sum over ci and
    taps of x[g, b, ci, window plane, window row, window col] * w[g, co, ci, kd, kr, kc]; x is the
    block's input window [G, B, Ci, win_planes, win_rows, win_cols], w its kernel block
    [G, Co, Ci, k_planes, k_rows, k_cols]."""
    for v in prange(params.shape[0]):
        p = params[v]
        bb, cib, cob = int(p[1]), int(p[2]), int(p[3])
        wd, wr, wc, kdb, khb, kwc = int(p[4]), int(p[5]), int(p[6]), int(p[7]), int(p[8]), int(p[9])
        odb, ohb, owb, line0, lines = int(p[10]), int(p[11]), int(p[12]), int(p[13]), int(p[14])
        sd, dd, idd, base_d = int(p[15]), int(p[16]), int(p[17]), int(p[18])
        sh, dh, idh, base_h = int(p[19]), int(p[20]), int(p[21]), int(p[22])
        sw, dw, idw, base_w = int(p[23]), int(p[24]), int(p[25]), int(p[26])
        d0, kd_total, k0, kh_total, flip = int(p[27]), int(p[28]), int(p[29]), int(p[30]), p[31] != 0
        bx, bw, bo = x_start[v], w_start[v], o_start[v]
        for rr in range(lines):
            line = line0 + rr
            oh = line % ohb
            rest = line // ohb
            od = rest % odb
            rest = rest // odb
            co = rest % cob
            rest = rest // cob
            b = rest % bb
            g = rest // bb
            x_plane = (g * bb + b) * cib
            w_plane = (g * cob + co) * cib
            for ow in range(owb):
                acc = 0.0
                for kd in range(kdb):
                    td = kd_total - 1 - (d0 + kd) if flip else d0 + kd
                    ud = od * sd + td * dd + base_d
                    if ud < 0 or ud % idd != 0 or ud // idd >= wd:
                        continue
                    idp = ud // idd
                    for kr in range(khb):
                        th = kh_total - 1 - (k0 + kr) if flip else k0 + kr
                        uh = oh * sh + th * dh + base_h
                        if uh < 0 or uh % idh != 0 or uh // idh >= wr:
                            continue
                        ih = uh // idh
                        for kc in range(kwc):
                            tw = kwc - 1 - kc if flip else kc
                            uw = ow * sw + tw * dw + base_w
                            if uw < 0 or uw % idw != 0 or uw // idw >= wc:
                                continue
                            iw = uw // idw
                            for ci in range(cib):
                                acc += (ld(x, x_addr[bx + (((x_plane + ci) * wd + idp) * wr + ih) * wc + iw])
                                        * ld(w, w_addr[bw + (((w_plane + ci) * kdb + kd) * khb + kr) * kwc + kc]))
                st(out, o_addr[bo + rr * owb + ow], acc)


CONV_VERTEX = VertexType("poplin::ConvPartial", ("x", "w"), ("out",), conv_codelet, _conv_vertex_cycles,
                         num_params=len(PARAMS))


# ---- plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvPlan:
    """How a convolution is spread over tiles: parts along DIMS, one block per tile."""
    geometry: ConvGeometry
    splits: tuple[int, ...]
    dtype: str
    out_dtype: str
    cycles: int             # the planner's estimate
    bytes_per_tile: int     # working set of the busiest tile
    fits: bool              # working set within the available memory proportion

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(ceil_div(s, p) for s, p in zip(self.geometry.dims, self.splits))

    @property
    def reduction_split(self) -> int:
        """Blocks each output element's sum is split over (input channels x kernel planes x kernel rows)."""
        return self.splits[6] * self.splits[7] * self.splits[8]

    @property
    def tiles_used(self) -> int:
        return int(np.prod(self.splits))

    def as_dict(self) -> dict:
        return dict(zip(DIMS, self.splits))


def _window(dim: ConvDim, outs, taps):
    """Input positions along `dim` a block of `outs` outputs and `taps` taps reads (clipped)."""
    return np.minimum(dim.in_size, ceil_div((outs - 1) * dim.stride + (taps - 1) * dim.dilation + 1, dim.in_dilation))


def _conv_model(target: Target, geom: ConvGeometry, splits: np.ndarray, dtype, out_dtype):
    """(cycles, working-set bytes) of every candidate split, vectorised (see the module doc)."""
    G, B, Co, OD, OH, OW, Ci, KD, KH = geom.dims
    KW = geom.w.kernel
    gb, bb, cob, odb, ohb, owb, cib, kdb, khb = (ceil_div(s, splits[:, i]) for i, s in enumerate(geom.dims))
    d, h, w = geom.d, geom.h, geom.w
    isz, osz, psz = np.dtype(dtype).itemsize, np.dtype(out_dtype).itemsize, PARTIALS.itemsize
    workers, tiles, xb, sync = (target.workers_per_tile, target.num_tiles, target.exchange_bytes_per_cycle,
                                target.sync_cycles)
    window = _window(d, odb, kdb) * _window(h, ohb, khb) * _window(w, owb, KW)
    lines = gb * bb * cob * odb * ohb
    vertex_lines = ceil_div(lines, workers)
    macs = np.ceil(vertex_lines * owb * cib * kdb * khb * KW * d.valid_fraction * h.valid_fraction
                   * w.valid_fraction).astype(np.int64)
    compute = conv_partial_cycles(macs, vertex_lines, cib, kdb * khb * KW, dtype, target) + target.vertex_overhead_cycles
    received = (gb * bb * cib * window + gb * cob * cib * kdb * khb * KW) * isz
    sent = ceil_div(received * splits.prod(axis=1), tiles)
    cycles = compute + ceil_div(np.maximum(received, sent), xb) + 2 * sync
    r = splits[:, 6] * splits[:, 7] * splits[:, 8]
    split = r > 1
    block_out = gb * bb * cob * odb * ohb * owb * np.where(split, psz, osz)
    memory = received + block_out
    out_tile = linear_tile_elements(G * B * Co * OD * OH * OW, tiles)
    gathered = r * out_tile * psz
    reduction = (ceil_div(np.maximum(gathered, gb * bb * cob * odb * ohb * owb * psz), xb) + 2 * sync
                 + reduce_cycles(ceil_div(out_tile, workers), r, target) + target.vertex_overhead_cycles)
    cycles = cycles + np.where(split, reduction, 0)
    memory = np.maximum(memory, np.where(split, block_out + gathered + out_tile * osz, 0))
    return cycles, memory


def plan_conv(target: Target, geometry: ConvGeometry, dtype="float32", out_dtype=None,
              available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION) -> ConvPlan:
    """The tile plan the conv ops use for this geometry (see the module doc)."""
    check_proportion(available_memory_proportion, "conv")
    dtype = np.dtype(dtype)
    out_dtype = np.dtype(out_dtype) if out_dtype is not None else dtype
    splits = split_grid(geometry.dims, target.num_tiles)
    cycles, memory = _conv_model(target, geometry, splits, dtype, out_dtype)
    budget = available_memory_proportion * target.bytes_per_tile
    reduction = splits[:, 6] * splits[:, 7] * splits[:, 8]
    best = choose_split(cycles, memory, budget, np.stack([splits.prod(axis=1), reduction], axis=1))
    return ConvPlan(geometry, tuple(int(s) for s in splits[best]), dtype.name, out_dtype.name,
                    int(cycles[best]), int(memory[best]), bool(memory[best] <= budget))


# ---- building --------------------------------------------------------------------------------
def _output(graph: Graph, plan: ConvPlan, dtype, shape, name: str, category: str,
            tile_range: range | None = None) -> Tensor:
    """The op's output variable: mapped block by block later, or linearly (over `tile_range`, all
    tiles by default) when partials are reduced."""
    if plan.reduction_split > 1:
        if tile_range is None:
            return new_output(graph, dtype, shape, name, category=category)
        out = graph.addVariable(dtype, shape, name, category=category, always_live=False)
        graph.map_linearly(out, grain=GRAIN, min_elements_per_tile=64, tiles=tile_range)
        return out
    return graph.addVariable(dtype, shape, name, category=category, always_live=False)


def _spans(dim: ConvDim, outs, taps) -> np.ndarray:
    """[len(outs), len(taps), 2]: the input span each (output block, tap block) pair reads."""
    return np.asarray([[dim.span(o0, o1, t0, t1) for t0, t1 in taps] for o0, o1 in outs],
                      np.int64).reshape(len(outs), len(taps), 2)


def _build(graph: Graph, body: Sequence, name: str, plan: ConvPlan, xv: Tensor, wv: Tensor, out: Tensor,
           outv: Tensor, compute: Sequence | None = None, tile_range: range | None = None) -> None:
    """Exchanges and compute sets of one convolution in the general form: xv [G, B, Ci, D, H, W]
    and wv [G, Co, Ci, KD, KH, KW] are views of the operands, outv [G, B, Co, OD, OH, OW] a view of
    `out`. The operands' exchanges go to `body`, the rest (compute and any reduction, which touch
    only the plan's tiles) to `compute` (default `body`); the plan's blocks go to the tiles of
    `tile_range` (default all: a plan for a range is made on a target of that many tiles)."""
    compute = body if compute is None else compute
    tile_range = range(graph.target.num_tiles) if tile_range is None else tile_range
    geom = plan.geometry
    d, h, w = geom.d, geom.h, geom.w
    kw = w.kernel
    first, extent = block_grid(geom.dims, plan.splits)  # per block: (g, b, co, od, oh, ow, ci, kd, kh)
    g0, b0, c0, od0, oh0, ow0, i0, kd0, k0 = first.T
    gb, bb, cob, odb, ohb, owb, cib, kdb, khb = extent.T
    tiles = tile_range.start + block_tiles(len(first), len(tile_range))
    # input planes, rows and columns each block reads: one span per (outputs, taps) split, not per block
    step = [ceil_div(size, parts) for size, parts in zip(geom.dims, plan.splits)]
    split = [ranges(geom.dims[i], plan.splits[i]) for i in range(len(DIMS))]
    dlo, dhi = _spans(d, split[3], split[7])[od0 // step[3], kd0 // step[7]].T
    hlo, hhi = _spans(h, split[4], split[8])[oh0 // step[4], k0 // step[8]].T
    wlo, whi = _spans(w, split[5], [(0, kw)])[ow0 // step[5], 0].T
    sizes = gb * bb * cob * odb * ohb * owb
    reduction = plan.reduction_split
    if reduction == 1:
        map_boxes(outv, first[:, :6], extent[:, :6], tiles)
    xs, xs_at = gather_boxes(graph, body, xv, np.stack([g0, b0, i0, dlo, hlo, wlo], 1),
                             np.stack([gb, bb, cib, dhi - dlo, hhi - hlo, whi - wlo], 1), tiles, f"{name}/in")
    ws, ws_at = gather_boxes(graph, body, wv, np.stack([g0, c0, i0, kd0, k0, np.zeros_like(k0)], 1),
                             np.stack([gb, cob, cib, kdb, khb, np.full_like(k0, kw)], 1), tiles, f"{name}/weights")
    if reduction > 1:
        dst, dst_at = partials_variable(graph, sizes, tiles, f"{name}/partials")
    else:  # each block writes its box of the output in place
        _, element, length = outv.runs_at(*box_runs(first[:, :6], extent[:, :6], outv.shape)[:2])
        dst, dst_at = Tensor.of_runs(out.var, element, length, distinct=True), np.concatenate(([0], np.cumsum(sizes)))
    # vertices: each block's output lines split over the workers
    blk, l0, l1 = split_ranges(gb * bb * cob * odb * ohb, graph.target.workers_per_tile)
    n = l1 - l0
    ow_b = owb[blk]
    base = [(o0 * dim.stride - dim.padding - dim.in_dilation * lo)[blk]
            for o0, dim, lo in ((od0, d, dlo), (oh0, h, hlo), (ow0, w, wlo))]
    params = np.stack(np.broadcast_arrays(
        gb[blk], bb[blk], cib[blk], cob[blk], (dhi - dlo)[blk], (hhi - hlo)[blk], (whi - wlo)[blk], kdb[blk], khb[blk],
        kw, odb[blk], ohb[blk], ow_b, l0, n,
        d.stride, d.dilation, d.in_dilation, base[0], h.stride, h.dilation, h.in_dilation, base[1],
        w.stride, w.dilation, w.in_dilation, base[2], kd0[blk], d.kernel, k0[blk], h.kernel, int(w.flip)),
        axis=1).astype(np.float64)
    cs = graph.addComputeSet(f"{name}/conv")
    fields = {"x": Field.strided(xs, xs_at[blk], 1, np.diff(xs_at)[blk]),
              "w": Field.strided(ws, ws_at[blk], 1, np.diff(ws_at)[blk]),
              "out": Field.strided(dst, dst_at[blk] + l0 * ow_b, 1, n * ow_b)}
    graph.addVertices(cs, CONV_VERTEX, tiles[blk], fields, params, state_params=_state_params(geom))
    compute.add(Execute(cs))
    if reduction > 1:
        reduce_partials(graph, compute, dst, reduction, *block_partials(outv, first[:, :6], extent[:, :6], reduction, dst_at),
                        out, name)


# ---- NumPy whole-tensor implementations (fast mode) -------------------------------------------
# The kernels take three spatial dimensions (planes, rows, columns); fewer lead with unit ones.
@njit(**JIT)
def _col2im_kernel(patches, groups, cg, kd, kh, kw, n, od, oh, ow, sd, sh, sw, ddl, dh, dw, dp, hp, wp, dxp):
    """dxp[N, G, C/G, Dp, Hp, Wp] += each patch gradient patches[G, C/G, kd, kh, kw, N, OD, OH, OW]
    at the input position it was read from (both flat; taps in order, so sums round the same way
    every time)."""
    src = np.uint64(0)
    for g in range(groups):  # patches in memory order; each input position still sums its taps in order
        for ci in range(cg):
            for a in range(kd):
                for i in range(kh):
                    for j in range(kw):
                        for b in range(n):
                            plane = ((b * groups + g) * cg + ci) * dp
                            for z in range(od):
                                depth = (plane + z * sd + a * ddl) * hp
                                for y in range(oh):
                                    d = ((depth + y * sh + i * dh) * wp + j * dw)
                                    for x in range(ow):
                                        dxp[np.uint64(d + x * sw)] += patches[src + np.uint64(x)]
                                    src += np.uint64(ow)


@njit(**JIT)
def _im2col_kernel(x, n, c, dd, h, wd, kd, kh, kw, od, oh, ow, sd, sh, sw, pd, ph, pw, ddl, dh, dw, out):
    """out[(ch, a, i, j), (b, z, y, x)] = x[b, ch, z * sd + a * ddl - pd, y * sh + i * dh - ph,
    x * sw + j * dw - pw], 0 where that is padding; x and out flat (unsigned offsets, so no index
    wraps around and rows vectorise)."""
    per_sample = od * oh * ow
    for ch in range(c):
        for a in range(kd):
            for i in range(kh):
                for j in range(kw):
                    row = (((ch * kd + a) * kh + i) * kw + j) * n * per_sample
                    left = pw - j * dw  # the input column of output column x is x * sw - left
                    x_lo = min(ow, max(0, (left + sw - 1) // sw))
                    x_hi = max(x_lo, min(ow, (wd - 1 + left) // sw + 1 if wd - 1 + left >= 0 else 0))
                    for b in range(n):
                        for z in range(od):
                            q = z * sd + a * ddl - pd
                            for y in range(oh):
                                d = np.uint64(row + b * per_sample + (z * oh + y) * ow)
                                r = y * sh + i * dh - ph
                                if q < 0 or q >= dd or r < 0 or r >= h:
                                    for xx in range(ow):
                                        out[d + np.uint64(xx)] = 0.0
                                    continue
                                src = (((b * c + ch) * dd + q) * h + r) * wd - left
                                for xx in range(x_lo):
                                    out[d + np.uint64(xx)] = 0.0
                                for xx in range(x_lo, x_hi):
                                    out[d + np.uint64(xx)] = x[np.uint64(src + xx * sw)]
                                for xx in range(x_hi, ow):
                                    out[d + np.uint64(xx)] = 0.0


@njit(**JIT)
def _im2col_short_kernel(x, n, c, dd, h, wd, kd, kh, kw, per_sample, ddl, dh, dw, at, out):
    """`_im2col_kernel` without padding, for short output rows: the output positions of a sample
    are read through `at` (each one's input offset from the window's origin), so each
    (channel, tap, sample) is one loop over all of them instead of OD x OH loops of OW."""
    for ch in range(c):
        for a in range(kd):
            for i in range(kh):
                for j in range(kw):
                    row = (((ch * kd + a) * kh + i) * kw + j) * n * per_sample
                    for b in range(n):
                        src = (((b * c + ch) * dd + a * ddl) * h + i * dh) * wd + j * dw
                        d = row + b * per_sample
                        for q in range(per_sample):
                            out[np.uint64(d + q)] = x[np.uint64(src + at[q])]


SHORT_ROW = 16  # output rows shorter than this are copied through `_im2col_short_kernel` (measured on
# AVX-512: rows of 8 1.4x faster through the table, rows of 24 1.6x slower, so copied row by row)


@lru_cache(maxsize=256)
def _window_offsets(out: tuple, s: tuple, size: tuple) -> np.ndarray:
    """Input offset of each output position (row-major over the three spatial dimensions) from
    its window's origin, in an input of spatial `size`."""
    od, oh, ow = out
    q = np.arange(od * oh * ow, dtype=np.int64)
    z, y, xx = q // (oh * ow), (q // ow) % oh, q % ow
    return readonly((z * s[0] * size[1] + y * s[1]) * size[2] + xx * s[2])


def _as3(a: np.ndarray) -> np.ndarray:
    """a [N, C, *spatial] as [N, C, D, H, W] (unit dimensions first)."""
    return a.reshape(a.shape[:2] + (1,) * (SPATIAL + 2 - a.ndim) + a.shape[2:])


def _im2col(x: np.ndarray, k: tuple, out: tuple, s, p, d, groups: int) -> np.ndarray:
    """[G, C/G*kd*kh*kw, N*OD*OH*OW] patches of x [N, C, D, H, W] (zero padding; every other
    argument per spatial dimension): one matrix per group, so each product is a single large
    GEMM; output positions innermost, as the copy reads rows."""
    n, c = x.shape[:2]
    size = x.shape[2:]
    taps, positions = int(np.prod(k)), int(np.prod(out))
    cols = np.empty(c * taps * n * positions, x.dtype)
    flat = np.ascontiguousarray(x).reshape(-1)
    if out[2] < SHORT_ROW and not any(p):
        _im2col_short_kernel(flat, n, c, *size, *k, positions, *d, _window_offsets(out, s, size), cols)
    else:
        _im2col_kernel(flat, n, c, *size, *k, *out, *s, *p, *d, cols)
    return cols.reshape(groups, c // groups * taps, n * positions)


def _by_group(a: np.ndarray, groups: int) -> np.ndarray:
    """a [N, G*k, *spatial] as [G, k, N*positions] (a copy)."""
    n, c = a.shape[:2]
    return np.ascontiguousarray(a.reshape(n, groups, c // groups, -1).transpose(1, 2, 0, 3)).reshape(
        groups, c // groups, -1)


def _as_float32(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.float32 else a.astype(np.float32)


def _args3(x_shape, w_shape, stride, padding, dilation, what: str):
    """(stride, padding, dilation) of three spatial dimensions (unit ones first)."""
    s, p, d = conv_params(stride, padding, dilation, what, len(x_shape) - 2)
    return _lead(s, 1), _lead(p, 0), _lead(d, 1)


PER_SAMPLE = 64  # output positions per sample from which the forward product runs sample by sample
LONG_PRODUCT = 1024  # a weight gradient's product is cut at sample boundaries into pieces about this long ...
THIN_PRODUCT = 1024  # ... when its result has at most this many elements


def conv_numpy(x, w, stride=1, padding=0, dilation=1, groups=1, out=None) -> np.ndarray:
    """y = conv(x, w) on whole arrays (float32 result, in `out` [N, O, *out spatial] when given).
    With enough output positions per sample, one product per sample writes y in its own order;
    otherwise one product for the batch gives a transposed view, which the write puts in order."""
    x, w = _as_float32(np.asarray(x)), _as_float32(np.asarray(w))
    shape = conv_output_shape(x.shape, w.shape, stride, padding, dilation, groups)
    s, p, d = _args3(x.shape, w.shape, stride, padding, dilation, "conv")
    n, o = shape[:2]
    cg = w.shape[1]
    k, spatial = _lead(w.shape[2:], 1), _lead(shape[2:], 1)
    positions = int(np.prod(spatial))
    cols = _im2col(_as3(x), k, spatial, s, p, d, groups)  # [G, C/G*taps, N*positions]
    wg = w.reshape(groups, o // groups, cg * int(np.prod(k)))
    if positions >= PER_SAMPLE:
        per_sample = cols.reshape(groups, -1, n, positions).transpose(2, 0, 1, 3)  # [N, G, C/G*taps, positions]
        if out is not None and out.flags.c_contiguous:  # (a reshape of a strided `out` would be a copy)
            blas.matmul(wg, per_sample, out=out.reshape(n, groups, o // groups, positions))
            return out
        y = blas.matmul(wg, per_sample).reshape(shape)
    else:  # [G, O/G, N*positions] in order
        y = np.moveaxis(blas.matmul(wg, cols).reshape((o, n) + shape[2:]), 0, 1)
    if out is None:
        return y
    out[...] = y
    return out


def conv_backward_input_numpy(dy, w, input_shape, stride=1, padding=0, dilation=1, groups=1,
                              out=None) -> np.ndarray:
    """dx of conv for output gradient dy (float32 result): the patch gradients w^T dy, each
    added back to the input position it was read from (col2im); summed in `out` [N, C, *spatial]
    when there is no padding and it is contiguous float32."""
    dy, w = _as_float32(np.asarray(dy)), _as_float32(np.asarray(w))
    input_shape = tuple(int(v) for v in input_shape)
    s, p, d = _args3(input_shape, w.shape, stride, padding, dilation, "conv_backward_input")
    n, c = input_shape[:2]
    o, cg = w.shape[:2]
    og = o // groups
    k, size, outs = _lead(w.shape[2:], 1), _lead(input_shape[2:], 1), _lead(dy.shape[2:], 1)
    wt = w.reshape(groups, og, cg * int(np.prod(k))).transpose(0, 2, 1)
    patches = blas.matmul(wt, _by_group(dy, groups))
    padded = tuple(v + 2 * pad for v, pad in zip(size, p))
    dxp = kernel_array(out if not any(p) else None, (n, groups, cg) + padded, np.float32)
    dxp.fill(0)
    _col2im_kernel(patches.reshape(-1), groups, cg, *k, n, *outs, *s, *d, *padded, dxp.reshape(-1))
    return dxp[(slice(None),) * 3 + tuple(slice(pad, pad + v) for pad, v in zip(p, size))].reshape(input_shape)


def conv_backward_weights_numpy(dy, x, weight_shape, stride=1, padding=0, dilation=1, groups=1) -> np.ndarray:
    """dw of conv for output gradient dy and input x (float32 result)."""
    dy, x = _as_float32(np.asarray(dy)), _as_float32(np.asarray(x))
    weight_shape = tuple(int(v) for v in weight_shape)
    s, p, d = _args3(x.shape, weight_shape, stride, padding, dilation, "conv_backward_weights")
    o, cg = weight_shape[:2]
    k, outs = _lead(weight_shape[2:], 1), _lead(dy.shape[2:], 1)
    positions = int(np.prod(outs))
    cols = _im2col(_as3(x), k, outs, s, p, d, groups)
    grads = _by_group(dy, groups)
    # patches times gradients, [G, C/G*taps, O/G]: BLAS runs this orientation of the long, thin
    # product faster than its transpose, and a very long, thin one faster in pieces of whole
    # samples, summed after
    n = dy.shape[0]
    pieces = _sample_pieces(n, positions) if cg * int(np.prod(k)) * (o // groups) <= THIN_PRODUCT else 1
    if pieces == 1:
        dw = blas.matmul(cols, grads.transpose(0, 2, 1))
    else:
        cut = lambda a: a.reshape(groups, a.shape[1], pieces, -1).transpose(2, 0, 1, 3)  # noqa: E731
        dw = blas.matmul(cut(cols), cut(grads).transpose(0, 1, 3, 2)).sum(axis=0)
    return dw.transpose(0, 2, 1).reshape(weight_shape)


@lru_cache(maxsize=256)
def _sample_pieces(n: int, positions: int) -> int:
    """Into how many equal pieces of whole samples a product over n samples of `positions` each
    is cut so each piece is about LONG_PRODUCT long (1: not cut)."""
    want = max(1, n * positions // LONG_PRODUCT)
    return max(k for k in range(1, min(want, n) + 1) if n % k == 0)


# ---- the ops ---------------------------------------------------------------------------------
def _same_dtype(a: Tensor, b: Tensor, what: str) -> np.dtype:
    dt = float_dtype(a, what)
    if b.dtype != dt:
        raise TypeError(f"{what}: operands {a.name!r} ({dt.name}) and {b.name!r} ({b.dtype.name}) have "
                        "different dtypes; cast one first")
    return dt


def _shape_like(shape, rank: int, what: str, name: str) -> tuple[int, ...]:
    shape = tuple(int(v) for v in shape)
    if len(shape) != rank:
        raise ValueError(f"{what}: {name} must have {rank} dimensions, got {list(shape)}")
    return shape


def general_view(t: Tensor, groups: int, axis: int, perm: tuple) -> Tensor:
    """The view of an operand [A, B, *spatial] in the general form: its axis `axis` (0 or 1)
    split into (groups, size / groups), the spatial dimensions led to three by unit ones, the
    five leading axes transposed by `perm`."""
    a, b, *spatial = t.shape
    split = (a, groups, b // groups) if axis == 1 else (groups, a // groups, b)
    return t.reshape(*split, *_lead(spatial, 1)).transpose(*perm, 3, 4, 5)


def conv(graph: Graph, x: Tensor, w: Tensor, prog: Sequence, stride=1, padding=0, dilation=1, groups: int = 1,
         name: str = "conv", *, out_dtype=None,
         available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION) -> Tensor:
    """y[N, O, *out] = conv(x[N, C, *spatial], w[O, C/groups, *kernel]) like torch's conv1d,
    conv2d and conv3d (no bias): 1 to 3 spatial dimensions, stride, padding and dilation an int
    or one per dimension."""
    dtype = _same_dtype(x, w, name)
    odt = output_dtype(out_dtype, dtype, name)
    shape = conv_output_shape(x.shape, w.shape, stride, padding, dilation, groups, name)
    geom = forward_geometry(x.shape, w.shape, stride, padding, dilation, groups)
    plan = plan_conv(graph.target, geom, dtype, odt, available_memory_proportion)
    out = _output(graph, plan, odt, shape, name, "activations")
    body = Sequence(name=name)
    _build(graph, body, name, plan, general_view(x, groups, 1, (1, 0, 2)), general_view(w, groups, 0, (0, 1, 2)), out,
           general_view(out, groups, 1, (1, 0, 2)))

    def fast(io):
        target = io.output(out) if odt == np.float32 else None
        y = conv_numpy(io.read(x), io.read(w), stride, padding, dilation, groups, out=target)
        if target is None:
            io.write(out, y)

    prog.add(OpProgram(name, body, fast, (x, w), (out,)))
    return out


def conv_backward_input(graph: Graph, dy: Tensor, w: Tensor, input_shape, prog: Sequence, stride=1, padding=0,
                        dilation=1, groups: int = 1, name: str = "conv_backward_input", *, out_dtype=None,
                        available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION) -> Tensor:
    """dx[N, C, *spatial]: the gradient of conv's input (of shape `input_shape`) for output gradient dy."""
    dtype = _same_dtype(dy, w, name)
    odt = output_dtype(out_dtype, dtype, name)
    input_shape = _shape_like(input_shape, len(w.shape), name, "input_shape")
    expected = conv_output_shape(input_shape, w.shape, stride, padding, dilation, groups, name)
    if tuple(dy.shape) != expected:
        raise ValueError(f"{name}: output gradient {dy.name!r} has shape {list(dy.shape)}, but a convolution of an "
                         f"input {list(input_shape)} with weights {list(w.shape)} gives {list(expected)}")
    geom = backward_input_geometry(input_shape, w.shape, stride, padding, dilation, groups)
    plan = plan_conv(graph.target, geom, dtype, odt, available_memory_proportion)
    out = _output(graph, plan, odt, input_shape, name, "gradients")
    body = Sequence(name=name)
    _build(graph, body, name, plan, general_view(dy, groups, 1, (1, 0, 2)), general_view(w, groups, 0, (0, 2, 1)), out,
           general_view(out, groups, 1, (1, 0, 2)))

    def fast(io):
        target = io.output(out)
        store(io, out, conv_backward_input_numpy(io.read(dy), io.read(w), input_shape, stride, padding, dilation, groups,
                                                 out=target), target)

    prog.add(OpProgram(name, body, fast, (dy, w), (out,)))
    return out


def conv_backward_weights(graph: Graph, dy: Tensor, x: Tensor, weight_shape, prog: Sequence, stride=1, padding=0,
                          dilation=1, groups: int = 1, name: str = "conv_backward_weights", *, out_dtype=None,
                          available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION) -> Tensor:
    """dw[O, C/groups, *kernel]: the gradient of conv's weights (of shape `weight_shape`) for output
    gradient dy and input x."""
    dtype = _same_dtype(dy, x, name)
    odt = output_dtype(out_dtype, dtype, name)
    weight_shape = _shape_like(weight_shape, len(x.shape), name, "weight_shape")
    expected = conv_output_shape(x.shape, weight_shape, stride, padding, dilation, groups, name)
    if tuple(dy.shape) != expected:
        raise ValueError(f"{name}: output gradient {dy.name!r} has shape {list(dy.shape)}, but a convolution of the "
                         f"input {list(x.shape)} with weights {list(weight_shape)} gives {list(expected)}")
    geom = backward_weights_geometry(x.shape, weight_shape, stride, padding, dilation, groups)
    plan = plan_conv(graph.target, geom, dtype, odt, available_memory_proportion)
    out = _output(graph, plan, odt, weight_shape, name, "gradients")
    body = Sequence(name=name)
    _build(graph, body, name, plan, general_view(x, groups, 1, (1, 2, 0)), general_view(dy, groups, 1, (1, 2, 0)), out,
           general_view(out, groups, 0, (0, 2, 1)))

    def fast(io):
        io.write(out, conv_backward_weights_numpy(io.read(dy), io.read(x), weight_shape, stride, padding, dilation,
                                                  groups))

    prog.add(OpProgram(name, body, fast, (dy, x), (out,)))
    return out
