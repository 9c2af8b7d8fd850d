"""2-D convolution forward, and its gradients with respect to the input and the weights, in
PyTorch's conventions: NCHW activations, weights [O, C / groups, kh, kw], stride, zero padding,
dilation and groups.

One general form serves all three passes, as in PopLibs: a convolution of an input
[G, B, Ci, H, W] with a kernel [G, Co, Ci, KH, KW] into an output [G, B, Co, OH, OW], where along
each spatial dimension (`ConvDim`) output o and kernel tap t read the input at the coordinate
u = o * stride + t' * dilation - padding of the zero-dilated, padded input (t' = K - 1 - t when
the kernel is flipped); u must be a multiple of the input dilation, the input element being
u / in_dilation. Then
  forward            x [N, C, H, W] * w             -> y:  G = groups, B = N, Ci = C/G, Co = O/G
  backward to input  dy (input dilation = stride, padding = dilation (k - 1) - padding, stride 1,
                     flipped kernel w transposed to [G, C/G, O/G, kh, kw])  -> dx
  backward to weights x as [G, C/G, N, H, W] * dy as a kernel [G, O/G, N, Ho, Wo] with stride =
                     dilation and dilation = stride  -> dw as [G, C/G, O/G, kh, kw]
All are views of the user's tensors (transposes and reshapes only rearrange indices).

Plan (`plan_conv`, a pure function of the geometry and dtypes): the grid (G, B, Co, OH, OW) of
outputs and the reduction dimensions (Ci, KH) are split into blocks, one per tile, spread over
the IPU; a tile receives by exchange the input window its outputs read (the rows and columns
of its output block's receptive field, halo included, clipped to the real input) and its kernel
block. Without a reduction split the tile computes its piece of the output, which lives there;
with one (Ci or KH split) it writes float32 partials that are exchanged to the output's tiles
and reduced (see matmul.py for the reduction, the candidate splits and the choice rule). The cost
model is the matmul one with window = rows x cols of the receptive field and, for compute, the
valid fraction of (output, tap) pairs along each dimension.

Cycle estimator of a vertex computing `lines` output rows (of `out_cols` each, a line being one
(group, batch, out channel, output row)), over `in_ch` input channels and a kh x kw kernel block,
with V multiply-accumulates landing on real (not padding) input:
    flop_cycles(2 V) + thread_cycles(20 + kh * kw * ceil(in_ch / A) * (6 + lines))
the AMP structure of PopLibs' nx1 convolution partials (poplin PerformanceEstimation.hpp): for
every kernel tap and group of A input channels (16 float16, 8 float32) a pass that loads its
weights (6 instructions) and then walks a worklist of one entry per output line; 20 for the
worker's setup. Padding positions are skipped, as PopLibs' worklists skip them.

Numerics: strict vertices accumulate in float64 and round once to the output dtype (or to the
float32 partials, which the reduction sums in float64 and rounds once). The fast mode uses im2col
(strided views) and one batched BLAS matmul per op, plus a col2im scatter of kh x kw strided adds
for the gradient to the input; float16 operands are computed in float32 and rounded once.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit, prange

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

DIMS = ("groups", "batch", "out_channels", "out_rows", "out_cols", "in_channels", "kernel_rows")


# ---- geometry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvDim:
    """One spatial dimension of the general convolution (see the module doc)."""
    in_size: int
    kernel: int
    out_size: int
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
    """A convolution in the general form: channel counts are per group."""
    groups: int
    batch: int
    in_channels: int
    out_channels: int
    h: ConvDim
    w: ConvDim

    @property
    def dims(self) -> tuple[int, ...]:
        """Sizes along DIMS: (G, B, Co, OH, OW, Ci, KH)."""
        return (self.groups, self.batch, self.out_channels, self.h.out_size, self.w.out_size,
                self.in_channels, self.h.kernel)


def _pair(v, what: str) -> tuple[int, int]:
    t = tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v), int(v))
    if len(t) != 2:
        raise ValueError(f"{what} must be an int or a pair of ints, got {v!r}")
    return t


def conv_params(stride, padding, dilation, what: str):
    """Normalise torch-style int-or-pair arguments, checking their ranges."""
    s, p, d = _pair(stride, f"{what}: stride"), _pair(padding, f"{what}: padding"), _pair(dilation, f"{what}: dilation")
    if min(s) < 1:
        raise ValueError(f"{what}: stride must be positive, got {s}")
    if min(d) < 1:
        raise ValueError(f"{what}: dilation must be positive, got {d}")
    if min(p) < 0:
        raise ValueError(f"{what}: padding must be non-negative, got {p}")
    return s, p, d


def conv_output_size(in_size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (in_size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _check_shapes(x_shape, w_shape, groups: int, what: str):
    if len(x_shape) != 4:
        raise ValueError(f"{what}: expected a 4-D input [N, C, H, W], got shape {list(x_shape)}")
    if len(w_shape) != 4:
        raise ValueError(f"{what}: expected 4-D weights [O, C/groups, kh, kw], got shape {list(w_shape)}")
    if groups < 1:
        raise ValueError(f"{what}: groups must be positive, got {groups}")
    n, c, h, w = x_shape
    o, cg, kh, kw = w_shape
    if o % groups:
        raise ValueError(f"{what}: given groups={groups}, expected weight to be divisible by {groups} at "
                         f"dimension 0, but got weight of size {list(w_shape)}")
    if c != cg * groups:
        raise ValueError(f"{what}: given groups={groups}, weight of size {list(w_shape)}, expected input "
                         f"{list(x_shape)} to have {cg * groups} channels, but got {c} channels")
    if min(n, c, h, w, o, kh, kw) < 1:
        raise ValueError(f"{what}: empty input {list(x_shape)} or weight {list(w_shape)}")


def conv2d_output_shape(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1,
                        what: str = "conv2d") -> tuple[int, int, int, int]:
    """Shape of conv2d's output, with torch's checks and errors."""
    s, p, d = conv_params(stride, padding, dilation, what)
    _check_shapes(x_shape, w_shape, groups, what)
    n, _, h, w = x_shape
    o, _, kh, kw = w_shape
    oh, ow = conv_output_size(h, kh, s[0], p[0], d[0]), conv_output_size(w, kw, s[1], p[1], d[1])
    if oh < 1 or ow < 1:
        raise ValueError(f"{what}: calculated output size ({oh}x{ow}) is too small: the input {h}x{w} padded by "
                         f"{p} is smaller than the dilated kernel {d[0] * (kh - 1) + 1}x{d[1] * (kw - 1) + 1}")
    return (n, o, oh, ow)


def forward_geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1) -> ConvGeometry:
    s, p, d = conv_params(stride, padding, dilation, "conv2d")
    n, o, oh, ow = conv2d_output_shape(x_shape, w_shape, s, p, d, groups)
    _, c, h, w = x_shape
    _, cg, kh, kw = w_shape
    return ConvGeometry(groups, n, cg, o // groups,
                        ConvDim(h, kh, oh, s[0], p[0], d[0]), ConvDim(w, kw, ow, s[1], p[1], d[1]))


def backward_input_geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1) -> ConvGeometry:
    s, p, d = conv_params(stride, padding, dilation, "conv2d_backward_input")
    n, o, oh, ow = conv2d_output_shape(x_shape, w_shape, s, p, d, groups, "conv2d_backward_input")
    _, c, h, w = x_shape
    _, cg, kh, kw = w_shape
    return ConvGeometry(groups, n, o // groups, cg,
                        ConvDim(oh, kh, h, 1, d[0] * (kh - 1) - p[0], d[0], s[0], True),
                        ConvDim(ow, kw, w, 1, d[1] * (kw - 1) - p[1], d[1], s[1], True))


def backward_weights_geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1) -> ConvGeometry:
    s, p, d = conv_params(stride, padding, dilation, "conv2d_backward_weights")
    n, o, oh, ow = conv2d_output_shape(x_shape, w_shape, s, p, d, groups, "conv2d_backward_weights")
    _, c, h, w = x_shape
    _, cg, kh, kw = w_shape
    return ConvGeometry(groups, cg, n, o // groups,
                        ConvDim(h, oh, kh, d[0], p[0], s[0]), ConvDim(w, ow, kw, d[1], p[1], s[1]))


# ---- cycle estimator -------------------------------------------------------------------------
def conv_partial_cycles(macs, lines, in_ch, k_rows, k_cols, dtype, target: Target):
    """Cycles of one worker's convolution partials (see the module doc); ints or arrays."""
    passes = k_rows * k_cols * ceil_div(in_ch, amp_channels(dtype))
    return _flop_cycles(2 * macs, dtype, target) + target.workers_per_tile * (20 + passes * (6 + lines))


# Vertex parameters, in order.
PARAMS = ("groups", "batch", "in_ch", "out_ch", "win_rows", "win_cols", "k_rows", "k_cols", "out_rows",
          "out_cols", "line0", "lines", "stride_h", "dilation_h", "in_dilation_h", "base_h", "stride_w",
          "dilation_w", "in_dilation_w", "base_w", "k_row0", "kernel_h", "flip")
P = {name: i for i, name in enumerate(PARAMS)}


def _valid(count: int, taps: np.ndarray, stride: int, dilation: int, in_dilation: int, base: int,
           window: int) -> np.ndarray:
    """[count, taps] mask of local outputs and (already flipped) taps reading the window."""
    u = np.arange(count)[:, None] * stride + taps[None, :] * dilation + base
    return (u >= 0) & (u % in_dilation == 0) & (u < in_dilation * window)


@lru_cache(maxsize=65536)
def _conv_vertex_macs(params: tuple) -> int:
    p = [int(v) for v in params]
    k_row = np.arange(p[P["k_row0"]], p[P["k_row0"]] + p[P["k_rows"]])
    taps_h = p[P["kernel_h"]] - 1 - k_row if p[P["flip"]] else k_row
    k_col = np.arange(p[P["k_cols"]])
    taps_w = p[P["k_cols"]] - 1 - k_col if p[P["flip"]] else k_col
    per_row = _valid(p[P["out_rows"]], taps_h, p[P["stride_h"]], p[P["dilation_h"]], p[P["in_dilation_h"]],
                     p[P["base_h"]], p[P["win_rows"]]).sum(axis=1)
    per_col = _valid(p[P["out_cols"]], taps_w, p[P["stride_w"]], p[P["dilation_w"]], p[P["in_dilation_w"]],
                     p[P["base_w"]], p[P["win_cols"]]).sum()
    rows = np.arange(p[P["line0"]], p[P["line0"]] + p[P["lines"]]) % p[P["out_rows"]]
    return int(per_row[rows].sum()) * int(per_col) * p[P["in_ch"]]


def _conv_vertex_cycles(sizes, params, dtype, target):
    macs = by_distinct_rows(params, _conv_vertex_macs)
    column = lambda name: params[:, P[name]].astype(np.int64)  # noqa: E731
    return conv_partial_cycles(macs, column("lines"), column("in_ch"), column("k_rows"), column("k_cols"),
                               dtype, target)


# ---- codelet ---------------------------------------------------------------------------------
@njit(parallel=True, **JIT)
def conv_codelet(x, x_addr, x_start, w, w_addr, w_start, out, o_addr, o_start, params):
    """Output lines [line0, line0 + lines) of a block: out[g, b, co, oh, ow] = sum over ci and taps
    of x[g, b, ci, window row, window col] * w[g, co, ci, kr, kc]; x is the block's input window
    [G, B, Ci, win_rows, win_cols], w its kernel block [G, Co, Ci, k_rows, k_cols]."""
    for v in prange(params.shape[0]):
        p = params[v]
        bb, cib, cob = int(p[1]), int(p[2]), int(p[3])
        wr, wc, khb, kwc, ohb, owb = int(p[4]), int(p[5]), int(p[6]), int(p[7]), int(p[8]), int(p[9])
        line0, lines = int(p[10]), int(p[11])
        sh, dh, idh, base_h = int(p[12]), int(p[13]), int(p[14]), int(p[15])
        sw, dw, idw, base_w = int(p[16]), int(p[17]), int(p[18]), int(p[19])
        k0, kh_total, flip = int(p[20]), int(p[21]), p[22] != 0
        bx, bw, bo = x_start[v], w_start[v], o_start[v]
        for rr in range(lines):
            line = line0 + rr
            oh = line % ohb
            rest = line // ohb
            co = rest % cob
            rest = rest // cob
            b = rest % bb
            g = rest // bb
            x_plane = (g * bb + b) * cib
            w_plane = (g * cob + co) * cib
            for ow in range(owb):
                acc = 0.0
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
                            acc += (ld(x, x_addr[bx + ((x_plane + ci) * wr + ih) * wc + iw])
                                    * ld(w, w_addr[bw + ((w_plane + ci) * khb + kr) * kwc + kc]))
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
        """Blocks each output element's sum is split over (input channels x kernel rows)."""
        return self.splits[5] * self.splits[6]

    @property
    def tiles_used(self) -> int:
        return int(np.prod(self.splits))

    def as_dict(self) -> dict:
        return dict(zip(DIMS, self.splits))


def _conv_model(target: Target, geom: ConvGeometry, splits: np.ndarray, dtype, out_dtype):
    """(cycles, working-set bytes) of every candidate split, vectorised (see the module doc)."""
    G, B, Co, OH, OW, Ci, KH = geom.dims
    KW = geom.w.kernel
    gb, bb, cob, ohb, owb, cib, khb = (ceil_div(s, splits[:, i]) for i, s in enumerate(geom.dims))
    h, w = geom.h, geom.w
    isz, osz, psz = np.dtype(dtype).itemsize, np.dtype(out_dtype).itemsize, PARTIALS.itemsize
    workers, tiles, xb, sync = (target.workers_per_tile, target.num_tiles, target.exchange_bytes_per_cycle,
                                target.sync_cycles)
    win_rows = np.minimum(h.in_size, ceil_div((ohb - 1) * h.stride + (khb - 1) * h.dilation + 1, h.in_dilation))
    win_cols = np.minimum(w.in_size, ceil_div((owb - 1) * w.stride + (KW - 1) * w.dilation + 1, w.in_dilation))
    lines = gb * bb * cob * ohb
    vertex_lines = ceil_div(lines, workers)
    macs = np.ceil(vertex_lines * owb * cib * khb * KW * h.valid_fraction * w.valid_fraction).astype(np.int64)
    compute = conv_partial_cycles(macs, vertex_lines, cib, khb, KW, dtype, target) + target.vertex_overhead_cycles
    received = (gb * bb * cib * win_rows * win_cols + gb * cob * cib * khb * KW) * isz
    sent = ceil_div(received * splits.prod(axis=1), tiles)
    cycles = compute + ceil_div(np.maximum(received, sent), xb) + 2 * sync
    r = splits[:, 5] * splits[:, 6]
    split = r > 1
    block_out = gb * bb * cob * ohb * owb * np.where(split, psz, osz)
    memory = received + block_out
    out_tile = linear_tile_elements(G * B * Co * OH * OW, tiles)
    gathered = r * out_tile * psz
    reduction = (ceil_div(np.maximum(gathered, gb * bb * cob * ohb * owb * psz), xb) + 2 * sync
                 + reduce_cycles(ceil_div(out_tile, workers), r, target) + target.vertex_overhead_cycles)
    cycles = cycles + np.where(split, reduction, 0)
    memory = np.maximum(memory, np.where(split, block_out + gathered + out_tile * osz, 0))
    return cycles, memory


def plan_conv(target: Target, geometry: ConvGeometry, dtype="float32", out_dtype=None,
              available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION) -> ConvPlan:
    """The tile plan the conv ops use for this geometry (see the module doc)."""
    check_proportion(available_memory_proportion, "conv2d")
    dtype = np.dtype(dtype)
    out_dtype = np.dtype(out_dtype) if out_dtype is not None else dtype
    splits = split_grid(geometry.dims, target.num_tiles)
    cycles, memory = _conv_model(target, geometry, splits, dtype, out_dtype)
    budget = available_memory_proportion * target.bytes_per_tile
    best = choose_split(cycles, memory, budget, np.stack([splits.prod(axis=1), splits[:, 5] * splits[:, 6]], axis=1))
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


def _build(graph: Graph, body: Sequence, name: str, plan: ConvPlan, xv: Tensor, wv: Tensor, out: Tensor,
           outv: Tensor, compute: Sequence | None = None, tile_range: range | None = None) -> None:
    """Exchanges and compute sets of one convolution in the general form: xv [G, B, Ci, H, W] and
    wv [G, Co, Ci, KH, KW] are views of the operands, outv [G, B, Co, OH, OW] a view of `out`.
    The operands' exchanges go to `body`, the rest (compute and any reduction, which touch only
    the plan's tiles) to `compute` (default `body`); the plan's blocks go to the tiles of
    `tile_range` (default all: a plan for a range is made on a target of that many tiles)."""
    compute = body if compute is None else compute
    tile_range = range(graph.target.num_tiles) if tile_range is None else tile_range
    geom = plan.geometry
    h, w = geom.h, geom.w
    kw = w.kernel
    first, extent = block_grid(geom.dims, plan.splits)  # per block: (g, b, co, oh, ow, ci, kh)
    g0, b0, c0, oh0, ow0, i0, k0 = first.T
    gb, bb, cob, ohb, owb, cib, khb = extent.T
    tiles = tile_range.start + block_tiles(len(first), len(tile_range))
    # input rows and columns each block reads: one span per (output rows, taps) split, not per block
    step = [ceil_div(size, parts) for size, parts in zip(geom.dims, plan.splits)]
    rows, taps, cols = (ranges(geom.dims[d], plan.splits[d]) for d in (3, 6, 4))
    h_spans = np.asarray([[h.span(o0, o1, t0, t1) for t0, t1 in taps] for o0, o1 in rows],
                         np.int64).reshape(len(rows), len(taps), 2)
    w_spans = np.asarray([w.span(o0, o1, 0, kw) for o0, o1 in cols], np.int64).reshape(len(cols), 2)
    hlo, hhi = h_spans[oh0 // step[3], k0 // step[6]].T
    wlo, whi = w_spans[ow0 // step[4]].T
    sizes = gb * bb * cob * ohb * owb
    reduction = plan.reduction_split
    if reduction == 1:
        map_boxes(outv, first[:, :5], extent[:, :5], tiles)
    xs, xs_at = gather_boxes(graph, body, xv, np.stack([g0, b0, i0, hlo, wlo], 1),
                       np.stack([gb, bb, cib, hhi - hlo, whi - wlo], 1), tiles, f"{name}/in")
    ws, ws_at = gather_boxes(graph, body, wv, np.stack([g0, c0, i0, k0, np.zeros_like(k0)], 1),
                       np.stack([gb, cob, cib, khb, np.full_like(k0, kw)], 1), tiles, f"{name}/weights")
    if reduction > 1:
        dst, dst_at = partials_variable(graph, sizes, tiles, f"{name}/partials")
    else:  # each block writes its box of the output in place
        _, element, length = outv.runs_at(*box_runs(first[:, :5], extent[:, :5], outv.shape)[:2])
        dst, dst_at = Tensor.of_runs(out.var, element, length, distinct=True), np.concatenate(([0], np.cumsum(sizes)))
    # vertices: each block's output lines split over the workers
    blk, l0, l1 = split_ranges(gb * bb * cob * ohb, graph.target.workers_per_tile)
    n = l1 - l0
    ow_b = owb[blk]
    params = np.stack(np.broadcast_arrays(
        gb[blk], bb[blk], cib[blk], cob[blk], (hhi - hlo)[blk], (whi - wlo)[blk], khb[blk], kw, ohb[blk], ow_b, l0, n,
        h.stride, h.dilation, h.in_dilation, (oh0 * h.stride - h.padding - h.in_dilation * hlo)[blk],
        w.stride, w.dilation, w.in_dilation, (ow0 * w.stride - w.padding - w.in_dilation * wlo)[blk],
        k0[blk], h.kernel, int(h.flip)), axis=1).astype(np.float64)
    cs = graph.addComputeSet(f"{name}/conv")
    fields = {"x": Field.strided(xs, xs_at[blk], 1, np.diff(xs_at)[blk]),
              "w": Field.strided(ws, ws_at[blk], 1, np.diff(ws_at)[blk]),
              "out": Field.strided(dst, dst_at[blk] + l0 * ow_b, 1, n * ow_b)}
    graph.addVertices(cs, CONV_VERTEX, tiles[blk], fields, params)
    compute.add(Execute(cs))
    if reduction > 1:
        reduce_partials(graph, compute, dst, reduction, *block_partials(outv, first[:, :5], extent[:, :5], reduction, dst_at),
                        out, name)


# ---- NumPy whole-tensor implementations (fast mode) -------------------------------------------
@njit(**JIT)
def _col2im_kernel(patches, groups, cg, kh, kw, n, oh, ow, sh, sw, dh, dw, hp, wp, dxp):
    """dxp[N, G, C/G, Hp, Wp] += each patch gradient patches[G, C/G, kh, kw, N, OH, OW] at the
    input position it was read from (both flat; taps in order, so sums round the same way every
    time)."""
    src = np.uint64(0)
    for g in range(groups):  # patches in memory order; each input position still sums its taps in order
        for ci in range(cg):
            for i in range(kh):
                for j in range(kw):
                    for b in range(n):
                        plane = ((b * groups + g) * cg + ci) * hp
                        for y in range(oh):
                            d = ((plane + y * sh + i * dh) * wp + j * dw)
                            for x in range(ow):
                                dxp[np.uint64(d + x * sw)] += patches[src + np.uint64(x)]
                            src += np.uint64(ow)


@njit(**JIT)
def _im2col_kernel(x, n, c, h, wd, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw, out):
    """out[(ch, i, j), (b, y, x)] = x[b, ch, y * sh + i * dh - ph, x * sw + j * dw - pw], 0 where that
    is padding; x and out flat (unsigned offsets, so no index wraps around and rows vectorise)."""
    per_sample = oh * ow
    for ch in range(c):
        for i in range(kh):
            for j in range(kw):
                row = ((ch * kh + i) * kw + j) * n * per_sample
                left = pw - j * dw  # the input column of output column x is x * sw - left
                x_lo = min(ow, max(0, (left + sw - 1) // sw))
                x_hi = max(x_lo, min(ow, (wd - 1 + left) // sw + 1 if wd - 1 + left >= 0 else 0))
                for b in range(n):
                    for y in range(oh):
                        d = np.uint64(row + b * per_sample + y * ow)
                        r = y * sh + i * dh - ph
                        if r < 0 or r >= h:
                            for xx in range(ow):
                                out[d + np.uint64(xx)] = 0.0
                            continue
                        src = ((b * c + ch) * h + r) * wd - left
                        for xx in range(x_lo):
                            out[d + np.uint64(xx)] = 0.0
                        for xx in range(x_lo, x_hi):
                            out[d + np.uint64(xx)] = x[np.uint64(src + xx * sw)]
                        for xx in range(x_hi, ow):
                            out[d + np.uint64(xx)] = 0.0


@njit(**JIT)
def _im2col_short_kernel(x, n, c, h, wd, kh, kw, per_sample, dh, dw, at, out):
    """`_im2col_kernel` without padding, for short output rows: the output positions of a sample
    are read through `at` (each one's input offset from the window's origin), so each
    (channel, tap, sample) is one loop over all of them instead of OH loops of OW."""
    for ch in range(c):
        for i in range(kh):
            for j in range(kw):
                row = ((ch * kh + i) * kw + j) * n * per_sample
                for b in range(n):
                    src = ((b * c + ch) * h + i * dh) * wd + j * dw
                    d = row + b * per_sample
                    for q in range(per_sample):
                        out[np.uint64(d + q)] = x[np.uint64(src + at[q])]


SHORT_ROW = 16  # output rows shorter than this are copied through `_im2col_short_kernel` (measured on
# AVX-512: rows of 8 1.4x faster through the table, rows of 24 1.6x slower, so copied row by row)


@lru_cache(maxsize=256)
def _window_offsets(oh: int, ow: int, sh: int, sw: int, wd: int) -> np.ndarray:
    """Input offset of each output position (row-major) from its window's origin."""
    q = np.arange(oh * ow, dtype=np.int64)
    return readonly((q // ow) * sh * wd + (q % ow) * sw)


def _im2col(x: np.ndarray, kh: int, kw: int, oh: int, ow: int, s, p, d, groups: int) -> np.ndarray:
    """[G, C/G*kh*kw, N*OH*OW] patches of x [N, C, H, W] (zero padding): one matrix per group, so
    each product is a single large GEMM; output positions innermost, as the copy reads rows."""
    n, c, h, w = x.shape
    out = np.empty(c * kh * kw * n * oh * ow, x.dtype)
    flat = np.ascontiguousarray(x).reshape(-1)
    if ow < SHORT_ROW and p[0] == p[1] == 0:
        _im2col_short_kernel(flat, n, c, h, w, kh, kw, oh * ow, d[0], d[1], _window_offsets(oh, ow, s[0], s[1], w), out)
    else:
        _im2col_kernel(flat, n, c, h, w, kh, kw, oh, ow, s[0], s[1], p[0], p[1], d[0], d[1], out)
    return out.reshape(groups, c // groups * kh * kw, n * oh * ow)


def _by_group(a: np.ndarray, groups: int) -> np.ndarray:
    """a [N, G*k, H, W] as [G, k, N*H*W] (a copy)."""
    n, c, h, w = a.shape
    return np.ascontiguousarray(a.reshape(n, groups, c // groups, h * w).transpose(1, 2, 0, 3)).reshape(
        groups, c // groups, n * h * w)


def _as_float32(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.float32 else a.astype(np.float32)


PER_SAMPLE = 64  # output positions per sample from which the forward product runs sample by sample
LONG_PRODUCT = 1024  # a weight gradient's product is cut at sample boundaries into pieces about this long ...
THIN_PRODUCT = 1024  # ... when its result has at most this many elements


def conv2d_numpy(x, w, stride=1, padding=0, dilation=1, groups=1, out=None) -> np.ndarray:
    """y = conv2d(x, w) on whole arrays (float32 result, in `out` [N, O, OH, OW] when given). With
    enough output positions per sample, one product per sample writes y in its own order;
    otherwise one product for the batch gives a transposed view, which the write puts in order."""
    s, p, d = conv_params(stride, padding, dilation, "conv2d")
    x, w = _as_float32(np.asarray(x)), _as_float32(np.asarray(w))
    n, o, oh, ow = conv2d_output_shape(x.shape, w.shape, s, p, d, groups)
    _, cg, kh, kw = w.shape
    cols = _im2col(x, kh, kw, oh, ow, s, p, d, groups)  # [G, C/G*kh*kw, N*OH*OW]
    wg = w.reshape(groups, o // groups, cg * kh * kw)
    if oh * ow >= PER_SAMPLE:
        per_sample = cols.reshape(groups, -1, n, oh * ow).transpose(2, 0, 1, 3)  # [N, G, C/G*kh*kw, OH*OW]
        if out is not None and out.flags.c_contiguous:  # (a reshape of a strided `out` would be a copy)
            np.matmul(wg, per_sample, out=out.reshape(n, groups, o // groups, oh * ow))
            return out
        y = np.matmul(wg, per_sample).reshape(n, o, oh, ow)
    else:
        y = np.matmul(wg, cols).reshape(o, n, oh, ow).transpose(1, 0, 2, 3)  # [G, O/G, N*OH*OW] in order
    if out is None:
        return y
    out[...] = y
    return out


def conv2d_backward_input_numpy(dy, w, input_shape, stride=1, padding=0, dilation=1, groups=1,
                                out=None) -> np.ndarray:
    """dx of conv2d for output gradient dy (float32 result): the patch gradients w^T dy, each
    added back to the input position it was read from (col2im); summed in `out` [N, C, H, W] when
    there is no padding and it is contiguous float32."""
    s, p, d = conv_params(stride, padding, dilation, "conv2d_backward_input")
    dy, w = _as_float32(np.asarray(dy)), _as_float32(np.asarray(w))
    n, c, h, wd = input_shape
    _, o, oh, ow = dy.shape
    _, cg, kh, kw = w.shape
    og = o // groups
    wt = w.reshape(groups, og, cg * kh * kw).transpose(0, 2, 1)
    patches = np.matmul(wt, _by_group(dy, groups)).reshape(groups, cg, kh, kw, n, oh, ow)
    hp, wp = h + 2 * p[0], wd + 2 * p[1]
    dxp = kernel_array(out if p == (0, 0) else None, (n, groups, cg, hp, wp), np.float32)
    dxp.fill(0)
    _col2im_kernel(patches.reshape(-1), groups, cg, kh, kw, n, oh, ow, s[0], s[1], d[0], d[1], hp, wp, dxp.reshape(-1))
    return dxp[:, :, :, p[0]:p[0] + h, p[1]:p[1] + wd].reshape(n, c, h, wd)


def conv2d_backward_weights_numpy(dy, x, weight_shape, stride=1, padding=0, dilation=1, groups=1) -> np.ndarray:
    """dw of conv2d for output gradient dy and input x (float32 result)."""
    s, p, d = conv_params(stride, padding, dilation, "conv2d_backward_weights")
    dy, x = _as_float32(np.asarray(dy)), _as_float32(np.asarray(x))
    o, cg, kh, kw = weight_shape
    _, _, oh, ow = dy.shape
    cols = _im2col(x, kh, kw, oh, ow, s, p, d, groups)
    grads = _by_group(dy, groups)
    # patches times gradients, [G, C/G*kh*kw, O/G]: BLAS runs this orientation of the long, thin
    # product faster than its transpose, and a very long, thin one faster in pieces of whole
    # samples, summed after
    n = dy.shape[0]
    pieces = _sample_pieces(n, oh * ow) if cg * kh * kw * (o // groups) <= THIN_PRODUCT else 1
    if pieces == 1:
        dw = np.matmul(cols, grads.transpose(0, 2, 1))
    else:
        cut = lambda a: a.reshape(groups, a.shape[1], pieces, -1).transpose(2, 0, 1, 3)  # noqa: E731
        dw = np.matmul(cut(cols), cut(grads).transpose(0, 1, 3, 2)).sum(axis=0)
    return dw.transpose(0, 2, 1).reshape(o, cg, kh, kw)


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


def _shape4(shape, what: str, name: str) -> tuple[int, ...]:
    shape = tuple(int(v) for v in shape)
    if len(shape) != 4:
        raise ValueError(f"{what}: {name} must have 4 dimensions, got {list(shape)}")
    return shape


def conv2d(graph: Graph, x: Tensor, w: Tensor, prog: Sequence, stride=1, padding=0, dilation=1, groups: int = 1,
           name: str = "conv2d", *, out_dtype=None,
           available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION) -> Tensor:
    """y[N, O, OH, OW] = conv2d(x[N, C, H, W], w[O, C/groups, kh, kw]) like torch (no bias)."""
    dtype = _same_dtype(x, w, name)
    odt = output_dtype(out_dtype, dtype, name)
    s, p, d = conv_params(stride, padding, dilation, name)
    shape = conv2d_output_shape(x.shape, w.shape, s, p, d, groups, name)
    geom = forward_geometry(x.shape, w.shape, s, p, d, groups)
    plan = plan_conv(graph.target, geom, dtype, odt, available_memory_proportion)
    n, c, hh, ww = x.shape
    o, cg, kh, kw = w.shape
    g = groups
    out = _output(graph, plan, odt, shape, name, "activations")
    body = Sequence(name=name)
    _build(graph, body, name, plan, x.reshape(n, g, cg, hh, ww).transpose(1, 0, 2, 3, 4),
           w.reshape(g, o // g, cg, kh, kw), out, out.reshape(n, g, o // g, *shape[2:]).transpose(1, 0, 2, 3, 4))

    def fast(io):
        target = io.output(out) if odt == np.float32 else None
        y = conv2d_numpy(io.read(x), io.read(w), s, p, d, groups, out=target)
        if target is None:
            io.write(out, y)

    prog.add(OpProgram(name, body, fast, (x, w), (out,)))
    return out


def conv2d_backward_input(graph: Graph, dy: Tensor, w: Tensor, input_shape, prog: Sequence, stride=1, padding=0,
                          dilation=1, groups: int = 1, name: str = "conv2d_backward_input", *, out_dtype=None,
                          available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION) -> Tensor:
    """dx[N, C, H, W]: the gradient of conv2d's input (of shape `input_shape`) for output gradient dy."""
    dtype = _same_dtype(dy, w, name)
    odt = output_dtype(out_dtype, dtype, name)
    s, p, d = conv_params(stride, padding, dilation, name)
    input_shape = _shape4(input_shape, name, "input_shape")
    expected = conv2d_output_shape(input_shape, w.shape, s, p, d, groups, name)
    if tuple(dy.shape) != expected:
        raise ValueError(f"{name}: output gradient {dy.name!r} has shape {list(dy.shape)}, but a conv2d of an input "
                         f"{list(input_shape)} with weights {list(w.shape)} gives {list(expected)}")
    geom = backward_input_geometry(input_shape, w.shape, s, p, d, groups)
    plan = plan_conv(graph.target, geom, dtype, odt, available_memory_proportion)
    n, c, hh, ww = input_shape
    o, cg, kh, kw = w.shape
    g, og = groups, o // groups
    out = _output(graph, plan, odt, input_shape, name, "gradients")
    body = Sequence(name=name)
    _build(graph, body, name, plan, dy.reshape(n, g, og, *expected[2:]).transpose(1, 0, 2, 3, 4),
           w.reshape(g, og, cg, kh, kw).transpose(0, 2, 1, 3, 4), out,
           out.reshape(n, g, cg, hh, ww).transpose(1, 0, 2, 3, 4))

    def fast(io):
        target = io.output(out)
        store(io, out, conv2d_backward_input_numpy(io.read(dy), io.read(w), input_shape, s, p, d, groups, out=target),
              target)

    prog.add(OpProgram(name, body, fast, (dy, w), (out,)))
    return out


def conv2d_backward_weights(graph: Graph, dy: Tensor, x: Tensor, weight_shape, prog: Sequence, stride=1,
                            padding=0, dilation=1, groups: int = 1, name: str = "conv2d_backward_weights", *,
                            out_dtype=None,
                            available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION) -> Tensor:
    """dw[O, C/groups, kh, kw]: the gradient of conv2d's weights (of shape `weight_shape`) for output
    gradient dy and input x."""
    dtype = _same_dtype(dy, x, name)
    odt = output_dtype(out_dtype, dtype, name)
    s, p, d = conv_params(stride, padding, dilation, name)
    weight_shape = _shape4(weight_shape, name, "weight_shape")
    expected = conv2d_output_shape(x.shape, weight_shape, s, p, d, groups, name)
    if tuple(dy.shape) != expected:
        raise ValueError(f"{name}: output gradient {dy.name!r} has shape {list(dy.shape)}, but a conv2d of the input "
                         f"{list(x.shape)} with weights {list(weight_shape)} gives {list(expected)}")
    geom = backward_weights_geometry(x.shape, weight_shape, s, p, d, groups)
    plan = plan_conv(graph.target, geom, dtype, odt, available_memory_proportion)
    n, c, hh, ww = x.shape
    o, cg, kh, kw = weight_shape
    g, og = groups, o // groups
    out = _output(graph, plan, odt, weight_shape, name, "gradients")
    body = Sequence(name=name)
    _build(graph, body, name, plan, x.reshape(n, g, cg, hh, ww).transpose(1, 2, 0, 3, 4),
           dy.reshape(n, g, og, *expected[2:]).transpose(1, 2, 0, 3, 4), out,
           out.reshape(g, og, cg, kh, kw).transpose(0, 2, 1, 3, 4))

    def fast(io):
        io.write(out, conv2d_backward_weights_numpy(io.read(dy), io.read(x), weight_shape, s, p, d, groups))

    prog.add(OpProgram(name, body, fast, (dy, x), (out,)))
    return out
