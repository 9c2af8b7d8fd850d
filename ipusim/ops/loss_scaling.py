"""Automatic loss scaling on the device: gradient statistics and the loss-scale update, as PopART's
automatic loss scaling transform builds them (its HistogramOp with one level over absolute values,
and its LossScaleUpdateOp).

Statistics. `gradient_statistics` adds to a float32 `stats` tensor of two elements the number of
elements of a gradient whose absolute value is below the bin edge (`stats[0]`, the lower bin) and
the number of the others (`stats[1]`, the upper bin; NaN counts there, as a comparison with NaN is
false). PopART puts the edge at `binEdgeLocation * 65504` (the largest float16) for float16
gradients. One vertex per worker region of the gradient counts its elements below the edge into a
partial (float32) on its tile; the partials are exchanged to the tile of `stats`, where one vertex
adds their sum to stats[0] and the rest to stats[1]. Counts are exact while each stays below 2^24.

Update. With lower-bin count l and upper-bin count u (summed over the given statistics tensors),
PopART's rule: the loss scale is halved when u / (l + u) > t (the threshold upper-count
proportion), doubled otherwise; computed as u > f * l with f = t / (1 - t). `loss_scale_update`
applies it every `period`-th call (a counter on the device; the other calls change nothing) to the
update factor in place, clears the statistics, and returns the change (0.5, 2 or 1) for the
caller to apply to the loss-scale tensors and the optimisers' inverse loss scale.

Cycles (worker instructions): histogram ceil(n / width) * 3 + 12 per vertex (load, absolute
value, compare and count per vector; width 4 for float16, 2 for float32); the sum of partials
6 * k + 12; the update 24 + 4 * k for k statistics pairs. The cycle model of PopLibs' histogram
is not published; these are counts of the arithmetic.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, ld, st
from ..device.mapping import TileMap
from ..device.program import Execute, OpProgram, Sequence
from ..device.tensor import Tensor
from ..device.vertex import Field, VertexType
from .common import placed, region_work

FLOAT16_MAX = 65504.0


@njit(parallel=True, **JIT)
def histogram_codelet(x, x_addr, x_start, lo, lo_addr, lo_start, params):
    """lo = number of connected elements with |x| < level; params: (level,)."""
    for v in prange(params.shape[0]):
        level = params[v, 0]
        count = 0
        for i in range(x_start[v], x_start[v + 1]):
            if abs(ld(x, x_addr[i])) < level:
                count += 1
        st(lo, lo_addr[lo_start[v]], count)


@njit(parallel=True, **JIT)
def stats_add_codelet(p, p_addr, p_start, s, s_addr, s_start, params):
    """stats[0] += sum(partials); stats[1] += total - sum(partials); params: (total,)."""
    for v in prange(params.shape[0]):
        below = 0.0
        for i in range(p_start[v], p_start[v + 1]):
            below += ld(p, p_addr[i])
        b = s_start[v]
        st(s, s_addr[b], ld(s, s_addr[b]) + below)
        st(s, s_addr[b + 1], ld(s, s_addr[b + 1]) + (params[v, 0] - below))


@njit(**JIT)
def scale_change(lower, upper, f, active):
    """PopART's LossScaleUpdate: 0.5 when u > f * l, else 2; 1 outside an update window."""
    if not active:
        return 1.0
    return 0.5 if upper > f * lower else 2.0


@njit(parallel=True, **JIT)
def update_codelet(s, s_addr, s_start, c, c_addr, c_start, fa, f_addr, f_start, ch, ch_addr, ch_start, params):
    """params: (f, period). stats: pairs (lower, upper) to sum; counter, factor in place; change out."""
    for v in prange(params.shape[0]):
        lower = 0.0
        upper = 0.0
        for i in range(s_start[v], s_start[v + 1], 2):
            lower += ld(s, s_addr[i])
            upper += ld(s, s_addr[i + 1])
        count = ld(c, c_addr[c_start[v]])
        change = scale_change(lower, upper, params[v, 0], count == 0.0)
        st(fa, f_addr[f_start[v]], ld(fa, f_addr[f_start[v]]) * change)
        st(ch, ch_addr[ch_start[v]], change)
        st(c, c_addr[c_start[v]], (count + 1.0) % params[v, 1])


def _histogram_cycles(sizes, params, dtype, target):
    width = 4 if dtype == np.float16 else 2
    return target.thread_cycles(np.ceil(sizes["x"] / width) * 3 + 12)


def _stats_cycles(sizes, params, dtype, target):
    return target.thread_cycles(6 * sizes["partials"] + 12)


def _update_cycles(sizes, params, dtype, target):
    return target.thread_cycles(24 + 4 * (sizes["stats"] // 2))


HISTOGRAM = VertexType("popops::HistogramAbsLower", ("x",), ("lower",), histogram_codelet, _histogram_cycles,
                       num_params=1)
STATS_ADD = VertexType("popart::GradientStatisticsAdd", ("partials", "stats"), ("stats",), stats_add_codelet,
                       _stats_cycles, num_params=1)
UPDATE = VertexType("popart::LossScaleUpdate", ("stats", "counter", "factor"), ("counter", "factor", "change"),
                    update_codelet, _update_cycles, num_params=2)


def bin_edge(dtype, bin_edge_location: float) -> float:
    """PopART's single histogram level: a proportion of the largest float16 (float16 gradients only)."""
    if np.dtype(dtype) != np.float16:
        raise TypeError(f"automatic loss scaling tracks float16 gradients only, got {np.dtype(dtype).name}")
    if not 0.0 <= bin_edge_location <= 1.0:
        raise ValueError(f"binEdgeLocation must be in [0, 1], got {bin_edge_location}")
    return FLOAT16_MAX * bin_edge_location


def gradient_statistics(graph: Graph, t: Tensor, stats: Tensor, level: float, prog: Sequence,
                        name: str = "gradient_statistics") -> None:
    """Add the counts of |t| < level and |t| >= level to stats[0] and stats[1] (float32, 2 elements)."""
    if stats.numel != 2 or stats.dtype != np.float32:
        raise ValueError(f"{name}: stats {stats.name!r} must be 2 float32 elements, is {stats.dtype.name}{stats.shape}")
    flat = t.flatten()
    n = flat.numel
    home = int(stats.tiles().reshape(-1)[0])
    body = Sequence(name=name)
    work = region_work(flat.tile_map(), graph.target.workers_per_tile, grain=4)
    partials = graph.addVariable(np.float32, (work.num_vertices,), f"{name}/partials", category="temporaries",
                                 always_live=False)
    partials.var.mapping = TileMap.from_tiles(work.tiles)
    cs = graph.addComputeSet(f"{name}/histogram")
    graph.addVertices(cs, HISTOGRAM, work.tiles,
                      {"x": work.field(flat), "lower": Field.strided(partials, np.arange(work.num_vertices), 1, 1)},
                      np.array([level], np.float64))
    body.add(Execute(cs))
    gathered = placed(graph, body, partials, np.full(work.num_vertices, home, np.int32), f"{name}/gathered")
    cs2 = graph.addComputeSet(f"{name}/add")
    graph.addVertex(cs2, STATS_ADD, home, {"partials": gathered, "stats": stats.flatten()}, (float(n),))
    body.add(Execute(cs2))

    def fast(io):
        below = float(np.count_nonzero(np.abs(np.asarray(io.read(flat), dtype=np.float64)) < level))
        s = np.asarray(io.read(stats), dtype=np.float32).reshape(-1).copy()
        s[0] = np.float32(np.float64(s[0]) + below)
        s[1] = np.float32(np.float64(s[1]) + (n - below))
        io.write(stats, s.reshape(stats.shape))

    prog.add(OpProgram(name, body, fast, (t, stats), (stats,)))


def loss_scale_update(graph: Graph, stats: Tensor, counter: Tensor, factor: Tensor, prog: Sequence,
                      threshold: float, period: int = 1, name: str = "loss_scale_update") -> Tensor:
    """Apply PopART's rule to the summed pairs of `stats` ([k, 2] float32 on one tile): every
    `period`-th call (when `counter` is 0) halve or double `factor` in place; advance `counter`
    modulo `period`; return the change (a new float32 scalar on the same tile: 0.5, 2 or 1).
    The caller clears the statistics."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"{name}: thresholdUpperCountProportion must be in [0, 1], got {threshold}")
    if period < 1:
        raise ValueError(f"{name}: the update period must be >= 1, got {period}")
    tiles = {int(x) for t in (stats, counter, factor) for x in np.unique(t.tiles())}
    if len(tiles) != 1:
        raise ValueError(f"{name}: stats, counter and factor must live on one tile, they live on {sorted(tiles)}")
    tile = tiles.pop()
    f = threshold / (1.0 - threshold) if threshold < 1.0 else np.inf
    change = graph.addVariable(np.float32, (1,), f"{name}/change", category="temporaries", always_live=False)
    graph.setTileMapping(change, tile)
    cs = graph.addComputeSet(name)
    graph.addVertex(cs, UPDATE, tile, {"stats": stats.flatten(), "counter": counter.flatten(),
                                       "factor": factor.flatten(), "change": change}, (f, float(period)))
    body = Sequence(Execute(cs), name=name)

    def fast(io):
        s = np.asarray(io.read(stats), dtype=np.float64).reshape(-1, 2)
        lower, upper = float(np.float64(np.sum(s[:, 0]))), float(np.float64(np.sum(s[:, 1])))
        count = float(np.asarray(io.read(counter)).reshape(-1)[0])
        c = scale_change(lower, upper, f, count == 0.0)
        io.write(factor, (np.asarray(io.read(factor), np.float64) * c).astype(np.float32).reshape(factor.shape))
        io.write(change, np.array([c], np.float32))
        io.write(counter, np.array([(count + 1.0) % period], np.float32).reshape(counter.shape))

    prog.add(OpProgram(name, body, fast, (stats, counter, factor), (counter, factor, change)))
    return change

