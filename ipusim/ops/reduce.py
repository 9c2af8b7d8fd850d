"""Reductions (PopLibs `popops::reduce`) and segment maps, the building blocks of softmax, losses and norms.

Segments. For a tensor and the axes of a reduction, a *segment* is the set of elements that one
tile holds of one output element (elements in increasing flat position). A reduction reduces
every segment to one partial on the segment's tile; a *segment map* does the converse: it
brings each output's statistics (one value per output, e.g. a row maximum) to every segment of
that output and combines them elementwise with the tensor, without replicating the statistics
per element.

Reduction, in two stages as in PopLibs:
1. partial stage: each segment is reduced on its own tile (no input element is exchanged) to a
   partial, kept in float32 for float inputs (float16 accumulates in float32) and int32 for int32
   and bool inputs;
2. final stage: the partials of each output are exchanged to the output's tile and reduced again
   there, applying the final scale (1/N for a mean, or the caller's `scale`).
When every output has exactly one segment and lives on that segment's tile, the partial stage
writes the output directly and there is no exchange at all (e.g. rows that each live on one tile).
Inside a vertex the accumulator is float64; partials and outputs are rounded once when stored.
The fast mode runs the same two stages over the same segments in the same order with the same
accumulator (one Numba call per stage), so both modes give bit-identical results.

Planner (a small cost model, like PopLibs' reduction planner). Candidates:
- segments as they are, or long segments split into chunks of at most a worker's share of their
  tile's elements (more parallelism in the partial stage, more partials in the final stage);
- outputs mapped on the tile holding their largest segment ("owner", fewest exchanges), spread
  linearly over the tiles as `common.new_output` maps outputs ("linear", at least 64 per tile), or
  spread as thinly as one vector grain per tile ("spread", the most tiles share the final stage).
Each candidate is costed with the vertex estimators below (slowest tile, vertices spread over the
workers), the exchange of the partials (busiest tile, `exchange_bytes_per_cycle`) and one sync per
superstep; the cheapest wins (ties: the earlier candidate: unsplit first, then owner, linear, spread).
A candidate whose working set on some tile (input, partials, gathered partials and output) exceeds
the tile's memory is chosen only when no candidate fits.

Cycle estimators (thread instructions; cycles = `target.thread_cycles(instructions)`), shaped like
PopLibs' `getCyclesEstimateForReduce` for scalar outputs. `width` = 64-bit vector width of the input
(2 float32, 4 float16, 1 int32 and bool); accumulating ops (sum, mean, sum_squares, sum_abs) use
double-width accumulators (`w = 2 * width`, 2 instructions per vector: a 128-bit load and an
accumulate), max and min do one compare per vector (`w = width`, 1 instruction):
    reduce vertex, k outputs of n elements each:
        26 + k * (8 + (n // w) * per_vector + n % w + scaled + converted)
    (26: entry/exit and vertex state; 8: per-output set-up and store; `scaled` = 1 when a scale
    other than 1 is applied, `converted` = 1 when the output dtype differs from the input's).
    segment map vertex, k segments of n elements, op with (setup, per_vector, vectorised):
        17 + k * setup + k * ceil(n / w) * per_vector, with w = width if vectorised else 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..graph import Graph
from ..kernels import JIT, kernel_view, ld, st
from ..program import Copy, Execute, OpProgram, Sequence
from ..target import Target
from ..tensor import Tensor, as_dtype
from ..vertex import VertexType, worker_makespan
from .common import GRAIN, flat, placed

# ---- reduction operations ------------------------------------------------------------------
OPS = {"sum": 0, "mean": 0, "max": 1, "min": 2, "sum_squares": 3, "sum_abs": 4}
SUM, MAX, MIN, SUM_SQUARES, SUM_ABS = range(5)
ACCUMULATING = (SUM, SUM_SQUARES, SUM_ABS)
# The op that combines partials in the final stage.
FINAL_OP = {SUM: SUM, MAX: MAX, MIN: MIN, SUM_SQUARES: SUM, SUM_ABS: SUM}
ERR = dict(error_model="numpy")  # IEEE results (inf, nan) for division by zero, as on the device


@njit(**ERR, **JIT)
def accumulate(src, index, begin, n, op):
    """Reduce src[index[begin:begin + n]] with `op` in a float64 accumulator."""
    acc = -np.inf if op == MAX else (np.inf if op == MIN else 0.0)
    for i in range(n):
        v = np.float64(ld(src, index[begin + i]))
        if op == SUM:
            acc += v
        elif op == MAX:
            if v > acc or v != v:
                acc = v
        elif op == MIN:
            if v < acc or v != v:
                acc = v
        elif op == SUM_SQUARES:
            acc += v * v
        else:
            acc += abs(v)
    return acc


@njit(**ERR, **JIT)
def finish(acc, scale):
    return acc if scale == 1.0 else acc * scale


@njit(parallel=True, **ERR, **JIT)
def reduce_codelet(x, x_addr, x_start, out, o_addr, o_start, params):
    """params: op, n (elements per output), scale, converted."""
    for v in prange(params.shape[0]):
        op = int(params[v, 0])
        n = int(params[v, 1])
        bx, bo = x_start[v], o_start[v]
        for k in range(o_start[v + 1] - bo):
            st(out, o_addr[bo + k], finish(accumulate(x, x_addr, bx + k * n, n, op), params[v, 2]))


@njit(parallel=True, **ERR, **JIT)
def reduce_segments(x, perm, starts, out, op, scale):
    """Whole-tensor form of one stage: out[s] = reduce(x[perm[starts[s]:starts[s + 1]]])."""
    for s in prange(starts.size - 1):
        st(out, s, finish(accumulate(x, perm, starts[s], starts[s + 1] - starts[s], op), scale))


def vector_width(dtype) -> int:
    """Elements per 64-bit vector."""
    dtype = np.dtype(dtype)
    return 4 if dtype == np.float16 else 2 if dtype == np.float32 else 1


def reduce_instructions(k: int, n: int, width: int, op: int, scaled: bool, converted: bool) -> int:
    """Thread instructions of a reduce vertex with k outputs of n elements each (module docstring)."""
    w, per_vector = (2 * width, 2) if op in ACCUMULATING else (width, 1)
    return 26 + k * (8 + (n // w) * per_vector + n % w + int(scaled) + int(converted))


def _reduce_cycles(sizes, params, dtype, target):
    op, n, scale, converted = params
    return target.thread_cycles(reduce_instructions(sizes["out"], int(n), vector_width(dtype), int(op),
                                                    scale != 1.0, bool(converted)))


REDUCE_VERTEX = VertexType("popops::Reduce", ("x",), ("out",), reduce_codelet, _reduce_cycles, num_params=4)


# ---- segments --------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """Segments of a tensor: segment s holds flat positions `perm[starts[s]:starts[s + 1]]`
    (increasing), all on tile `seg_tile[s]` and all of output `seg_out[s]`. Segments are ordered
    by tile, then output, then position."""
    perm: np.ndarray
    starts: np.ndarray
    seg_out: np.ndarray
    seg_tile: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.starts)

    @property
    def num_segments(self) -> int:
        return int(self.seg_out.size)

    def element_tiles(self) -> np.ndarray:
        """The tile of every element in `perm` order."""
        return np.repeat(self.seg_tile, self.counts)


def plan_segments(tiles: np.ndarray, out_index: np.ndarray, *, workers: int | None = None,
                  stride: int | None = None) -> SegmentPlan:
    """Group flat positions into segments by (tile, output).

    `workers`: also split a segment into chunks of at most a worker's share of its tile's elements
    (rounded up to the vector grain). `stride`: also split where two consecutive elements of a
    segment are not `stride` positions apart, so that every segment is a contiguous run along the
    reduced axis (needed by ops that use an element's index along that axis).
    """
    tiles = np.asarray(tiles, dtype=np.int64).reshape(-1)
    out_index = np.asarray(out_index, dtype=np.int64).reshape(-1)
    n = tiles.size
    pos = np.arange(n, dtype=np.int64)
    order = np.lexsort((pos, out_index, tiles))
    t, o = tiles[order], out_index[order]
    new = np.ones(n, dtype=bool)
    new[1:] = (t[1:] != t[:-1]) | (o[1:] != o[:-1])
    if stride is not None:
        new[1:] |= np.diff(order) != stride
    if workers is not None and n:
        per_tile = np.bincount(t)
        share = -(-per_tile // workers)
        share = np.maximum(GRAIN, -(-share // GRAIN) * GRAIN)
        first = np.flatnonzero(new)
        rank = pos - first[np.cumsum(new) - 1]
        new |= rank % share[t] == 0
    begins = np.flatnonzero(new)
    return SegmentPlan(order, np.append(begins, n).astype(np.int64), o[begins], t[begins])


def vertex_groups(seg_tile: np.ndarray, counts: np.ndarray, workers: int) -> list[tuple[int, int, int]]:
    """Split segments (ordered by tile) into vertices `(tile, begin, end)`: each vertex takes
    consecutive segments of one tile with equal element counts, about a worker's share of the
    tile's elements."""
    if seg_tile.size == 0:
        return []
    change = np.ones(seg_tile.size, dtype=bool)
    change[1:] = (seg_tile[1:] != seg_tile[:-1]) | (counts[1:] != counts[:-1])
    run_begins = np.flatnonzero(change)
    run_ends = np.append(run_begins[1:], seg_tile.size)
    tile_total = np.bincount(seg_tile, weights=counts)
    groups = []
    for b, e in zip(run_begins.tolist(), run_ends.tolist()):
        tile = int(seg_tile[b])
        share = max(1.0, tile_total[tile] / workers)
        per = max(1, int(math.ceil(share / max(int(counts[b]), 1))))
        groups.extend((tile, a, min(a + per, e)) for a in range(b, e, per))
    return groups


def output_index(shape: tuple, axes: tuple) -> tuple[np.ndarray, tuple, tuple]:
    """(output flat index of every element, output shape, output shape with kept 1s)."""
    keep_shape = tuple(1 if d in axes else s for d, s in enumerate(shape))
    out_shape = tuple(s for d, s in enumerate(shape) if d not in axes)
    num_out = int(np.prod(out_shape, dtype=np.int64))
    index = np.broadcast_to(np.arange(num_out, dtype=np.int64).reshape(keep_shape), shape).reshape(-1)
    return index, out_shape, keep_shape


def normalize_axes(axes, rank: int, what: str) -> tuple:
    """Sorted non-negative axes; None means all axes, an int one axis."""
    if axes is None:
        return tuple(range(rank))
    axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes)
    out = []
    for a in axes:
        if not isinstance(a, (int, np.integer)) or not -rank <= a < max(rank, 1):
            raise ValueError(f"{what}: axis {a!r} is out of range for a tensor of rank {rank}")
        out.append(int(a) % max(rank, 1))
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: axes {axes} repeat an axis")
    return tuple(sorted(out))


def linear_tiles(n: int, num_tiles: int, grain: int = GRAIN, min_elements_per_tile: int = 64) -> np.ndarray:
    """The tiles `Graph.map_linearly` gives n elements (as `common.new_output` maps outputs)."""
    grains = -(-n // grain)
    chunk = max(-(-grains // num_tiles), -(-min_elements_per_tile // grain)) * grain
    return np.arange(n, dtype=np.int64) // chunk


# ---- planning --------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ReducePlan:
    """A reduction's plan: partial-stage segments, the output's tiles, and the final stage (whose
    segments group the partials by output; None when the partial stage writes the outputs)."""
    partial: SegmentPlan
    out_tiles: np.ndarray
    final: SegmentPlan | None
    cycles: int
    description: str


def _stage_cycles(plan: SegmentPlan, width: int, op: int, scaled: bool, converted: bool, target: Target) -> int:
    per_tile: dict[int, list[int]] = {}
    counts = plan.counts
    for tile, a, b in vertex_groups(plan.seg_tile, counts, target.workers_per_tile):
        cyc = target.thread_cycles(reduce_instructions(b - a, int(counts[a]), width, op, scaled, converted))
        per_tile.setdefault(tile, []).append(cyc + target.vertex_overhead_cycles)
    return max((worker_makespan(c, target.workers_per_tile) for c in per_tile.values()), default=0)


def _gather_cycles(src_tiles: np.ndarray, dst_tiles: np.ndarray, itemsize: int, target: Target) -> int:
    """Cycles of the exchange superstep moving element i from src_tiles[i] to dst_tiles[i], as
    cost.py counts a Copy (with its sync); 0 when every element is already in place (no Copy)."""
    moved = src_tiles != dst_tiles
    if not moved.any():
        return 0
    n = target.num_tiles
    worst = max(np.bincount(src_tiles[moved], minlength=n).max(), np.bincount(dst_tiles[moved], minlength=n).max())
    local = np.bincount(dst_tiles[~moved], minlength=n).max(initial=0)
    return (math.ceil(int(worst) * itemsize / target.exchange_bytes_per_cycle)
            + math.ceil(int(local) * itemsize / target.local_copy_bytes_per_cycle) + target.sync_cycles)


def plan_reduction(tiles: np.ndarray, out_index: np.ndarray, num_out: int, target: Target, op: int,
                   in_dtype, partial_dtype, out_dtype, scaled: bool) -> ReducePlan:
    """Choose segments and output mapping with the cost model of the module docstring."""
    workers = target.workers_per_tile
    width_in, width_part = vector_width(in_dtype), vector_width(partial_dtype)
    final_op = FINAL_OP[op]
    plain = plan_segments(tiles, out_index)
    split = plan_segments(tiles, out_index, workers=workers)
    segment_options = [("unsplit", plain)] + ([("split", split)] if split.num_segments != plain.num_segments else [])
    # owner: the tile of each output's largest segment (the first on ties)
    by_size = np.lexsort((-plain.counts, plain.seg_out))
    first = np.ones(by_size.size, dtype=bool)
    first[1:] = plain.seg_out[by_size[1:]] != plain.seg_out[by_size[:-1]]
    owners = np.empty(num_out, dtype=np.int64)
    owners[plain.seg_out[by_size[first]]] = plain.seg_tile[by_size[first]]
    mapping_options = [("owner", owners), ("linear", linear_tiles(num_out, target.num_tiles)),
                       ("spread", linear_tiles(num_out, target.num_tiles, min_elements_per_tile=GRAIN))]
    n = target.num_tiles
    part_size, out_size = np.dtype(partial_dtype).itemsize, np.dtype(out_dtype).itemsize
    input_bytes = np.bincount(np.asarray(tiles, dtype=np.int64).reshape(-1), minlength=n) * np.dtype(in_dtype).itemsize
    best, best_key = None, None
    for seg_name, segs in segment_options:
        for map_name, out_tiles in mapping_options:
            single = (segs.num_segments == num_out and np.array_equal(segs.seg_tile, out_tiles[segs.seg_out]))
            if single:
                cycles = _stage_cycles(segs, width_in, op, scaled, np.dtype(in_dtype) != np.dtype(out_dtype),
                                       target) + target.sync_cycles
                final = None
                working = input_bytes
            else:
                final = plan_segments(out_tiles[segs.seg_out], segs.seg_out)
                converted = np.dtype(in_dtype) != np.dtype(partial_dtype)
                cycles = (_stage_cycles(segs, width_in, op, False, converted, target)
                          + _gather_cycles(segs.seg_tile[final.perm], final.element_tiles(),
                                           np.dtype(partial_dtype).itemsize, target)
                          + _stage_cycles(final, width_part, final_op, scaled,
                                          np.dtype(partial_dtype) != np.dtype(out_dtype), target)
                          + 2 * target.sync_cycles)
                working = input_bytes + (np.bincount(segs.seg_tile, minlength=n)
                                         + np.bincount(final.element_tiles(), minlength=n)) * part_size
            working = working + np.bincount(out_tiles, minlength=n) * out_size
            key = (bool((working > target.bytes_per_tile).any()), cycles)
            if best_key is None or key < best_key:
                best_key = key
                best = ReducePlan(segs, out_tiles, final, cycles, f"{seg_name} segments, {map_name} outputs, "
                                  f"{'one stage' if final is None else 'two stages'}")
    return best


# ---- reduce ----------------------------------------------------------------------------------
def _add_stage(graph: Graph, cs, src: Tensor, perm: np.ndarray, plan: SegmentPlan, dst: Tensor,
               op: int, scale: float) -> None:
    """Reduce vertices: segment s of `plan` reads src[perm[starts[s]:starts[s+1]]] and writes dst[s]
    (src and dst 1-D)."""
    counts = plan.counts
    converted = float(src.dtype != dst.dtype)
    for tile, a, b in vertex_groups(plan.seg_tile, counts, graph.target.workers_per_tile):
        fields = {"x": src[perm[plan.starts[a]:plan.starts[b]]], "out": dst[a:b]}
        graph.addVertex(cs, REDUCE_VERTEX, tile, fields, (op, int(counts[a]), scale, converted))


def reduce(graph: Graph, x: Tensor, axes, op: str, prog: Sequence, name: str | None = None,
           keepdims: bool = False, out_dtype=None, *, scale: float = 1.0,
           category: str = "activations") -> Tensor:
    """Reduce `x` over `axes` (a tuple; () copies, None reduces all) with `op` in
    {"sum", "mean", "max", "min", "sum_squares", "sum_abs"}, then multiply by `scale`.

    The output has x's dtype unless `out_dtype` is given (sums of bool give int32); NaN propagates
    through max and min as in torch. A mean or sum over an empty axis gives NaN or 0 (NaN also
    when `scale` is NaN); a max or min over an empty axis is an error, as in torch. The output is
    a not-always-live tensor of `category`.
    """
    name = name or f"reduce_{op}"
    if op not in OPS:
        raise ValueError(f"{name}: unknown reduction {op!r}; use one of {sorted(OPS)}")
    axes = normalize_axes(axes, x.rank, name)
    code = OPS[op]
    in_dt = x.dtype
    if op == "mean" and in_dt.kind != "f":
        raise TypeError(f"{name}: mean of {in_dt.name} tensor {x.name!r} is not defined; cast it to float first "
                        "(or use out_dtype with op='sum' and a scale)")
    out_dt = as_dtype(out_dtype) if out_dtype is not None else (
        np.dtype(np.int32) if in_dt == np.bool_ and code in ACCUMULATING else in_dt)
    part_dt = np.dtype(np.float32) if in_dt.kind == "f" or out_dt.kind == "f" else np.dtype(np.int32)
    out_index, out_shape, keep_shape = output_index(x.shape, axes)
    num_out = int(np.prod(out_shape, dtype=np.int64))
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    final_scale = float(scale) * ((1.0 / count if count else math.nan) if op == "mean" else 1.0)

    out = graph.addVariable(out_dt, out_shape, name, category=category, always_live=False)
    result = out.reshape(keep_shape) if keepdims else out
    body = Sequence(name=name)
    if num_out == 0:
        prog.add(OpProgram(name, body, lambda io: None, (x,), (out,)))
        return result
    if count == 0:
        if code in (MAX, MIN):
            raise ValueError(f"{name}: cannot take the {op} of {x.name!r} {x.shape} over axes {axes}: the reduced "
                             "size is 0 and the reduction has no identity")
        fill = math.nan if math.isnan(final_scale) else 0.0
        out.var.mapping[:] = linear_tiles(num_out, graph.target.num_tiles)
        const = graph.addConstant(out_dt, out_shape, fill, f"{name}/fill")
        const.var.mapping[:] = out.var.mapping
        body.add(Copy(const, out))
        prog.add(OpProgram(name, body, lambda io: io.write(out, np.full(out_shape, fill, out_dt)), (x,), (out,)))
        return result

    plan = plan_reduction(x.tiles(), out_index, num_out, graph.target, code, in_dt, part_dt, out_dt,
                          final_scale != 1.0)
    out.var.mapping[:] = plan.out_tiles
    segs, final = plan.partial, plan.final
    xf, of = x.flatten(), out.flatten()
    cs = graph.addComputeSet(f"{name}/partials" if final is not None else name)
    if final is None:
        _add_stage(graph, cs, xf, segs.perm, segs, flat(of, segs.seg_out), code, final_scale)
        body.add(Execute(cs))
    else:
        partials = graph.addVariable(part_dt, (segs.num_segments,), f"{name}/partials", category="temporaries",
                                     always_live=False)
        partials.var.mapping[:] = segs.seg_tile
        _add_stage(graph, cs, xf, segs.perm, segs, partials, code, 1.0)
        body.add(Execute(cs))
        gathered = placed(graph, body, flat(partials, final.perm), final.element_tiles(), f"{name}/gathered")
        cs2 = graph.addComputeSet(f"{name}/final")
        _add_stage(graph, cs2, gathered, np.arange(final.perm.size), final, flat(of, final.seg_out),
                   FINAL_OP[code], final_scale)
        body.add(Execute(cs2))

    def fast(io):
        xs = kernel_view(np.ascontiguousarray(io.read(x)).reshape(-1))
        res = np.empty(num_out, dtype=out_dt)
        if final is None:
            vals = np.empty(segs.num_segments, dtype=out_dt)
            reduce_segments(xs, segs.perm, segs.starts, kernel_view(vals), code, final_scale)
            res[segs.seg_out] = vals
        else:
            parts = np.empty(segs.num_segments, dtype=part_dt)
            reduce_segments(xs, segs.perm, segs.starts, kernel_view(parts), code, 1.0)
            vals = np.empty(final.num_segments, dtype=out_dt)
            reduce_segments(kernel_view(parts), final.perm, final.starts, kernel_view(vals), FINAL_OP[code],
                            final_scale)
            res[final.seg_out] = vals
        io.write(out, res.reshape(out_shape))

    prog.add(OpProgram(name, body, fast, (x,), (out,)))
    return result


def reduce_sum(graph, x, axes, prog, name="reduce_sum", keepdims=False, out_dtype=None):
    return reduce(graph, x, axes, "sum", prog, name, keepdims, out_dtype)


def reduce_mean(graph, x, axes, prog, name="reduce_mean", keepdims=False, out_dtype=None):
    return reduce(graph, x, axes, "mean", prog, name, keepdims, out_dtype)


def reduce_max(graph, x, axes, prog, name="reduce_max", keepdims=False, out_dtype=None):
    return reduce(graph, x, axes, "max", prog, name, keepdims, out_dtype)


# ---- segment maps ----------------------------------------------------------------------------
# op -> (code, setup instructions per segment, instructions per vector, vectorised).
# a, b, c: elements of full-size operands; r, q, s: the statistics of the element's output;
# col: the element's index along the (single) axis; p: the op's scalar parameter.
SEGMENT_OPS = {
    "exp_sub": (0, 4, 16, False),        # exp(a - r)                  softmax numerator
    "div": (1, 12, 1, True),             # a / r                       softmax normalisation
    "log_softmax": (2, 20, 2, True),     # a - r - log(q)
    "softmax_grad": (3, 4, 3, True),     # a * (b - r)                 a = y, b = dy, r = sum(dy * y)
    "log_softmax_grad": (4, 4, 17, False),  # b - exp(a) * r           a = y, b = dy, r = sum(dy)
    "sub": (5, 4, 1, True),              # a - r
    "normalise": (6, 4, 2, True),        # (a - r) * q
    "norm_affine": (7, 4, 4, True),      # (a - r) * q * b + c
    "norm_scale": (8, 4, 3, True),       # (a - r) * q * b
    "norm_shift": (9, 4, 3, True),       # (a - r) * q + s
    "norm_grad": (10, 4, 4, True),       # s * (a - r - b * q)
    "mul": (11, 4, 1, True),             # a * b
    "nll_pick": (12, 6, 3, True),        # -a where col == r != p, else 0         r = label
    "nll_grad": (13, 6, 3, True),        # -q where col == r != p, else 0         q = upstream gradient
    "softmax_xent_grad": (14, 6, 18, False),  # (exp(a) - [col == r]) * q, 0 where r == p
}
USES_COLUMN = 12  # ops from this code on use the element's index along the axis
STATLESS = ("mul",)


@njit(**ERR, **JIT)
def segment_value(op, a, b, c, r, q, s, col, p):
    if op == 0:
        return math.exp(a - r)
    if op == 1:
        return a / r
    if op == 2:
        return a - r - math.log(q)
    if op == 3:
        return a * (b - r)
    if op == 4:
        return b - math.exp(a) * r
    if op == 5:
        return a - r
    if op == 6:
        return (a - r) * q
    if op == 7:
        return (a - r) * q * b + c
    if op == 8:
        return (a - r) * q * b
    if op == 9:
        return (a - r) * q + s
    if op == 10:
        return s * (a - r - b * q)
    if op == 11:
        return a * b
    if op == 12:
        return -a if (col == r and r != p) else 0.0
    if op == 13:
        return -q if (col == r and r != p) else 0.0
    if r == p:
        return 0.0
    return (math.exp(a) - (1.0 if col == r else 0.0)) * q


@njit(parallel=True, **ERR, **JIT)
def segment_map_codelet(a, a_addr, a_start, b, b_addr, b_start, c, c_addr, c_start, r, r_addr, r_start,
                        q, q_addr, q_start, s, s_addr, s_start, out, o_addr, o_start, params):
    """params: op, n (elements per segment), p. For column ops, s holds the segment's first column."""
    for v in prange(params.shape[0]):
        op = int(params[v, 0])
        n = int(params[v, 1])
        p = params[v, 2]
        for k in range(r_start[v + 1] - r_start[v]):
            rv = np.float64(ld(r, r_addr[r_start[v] + k]))
            qv = np.float64(ld(q, q_addr[q_start[v] + k]))
            sv = np.float64(ld(s, s_addr[s_start[v] + k]))
            for i in range(n):
                e = k * n + i
                av = np.float64(ld(a, a_addr[a_start[v] + e]))
                bv = np.float64(ld(b, b_addr[b_start[v] + e]))
                cv = np.float64(ld(c, c_addr[c_start[v] + e]))
                st(out, o_addr[o_start[v] + e], segment_value(op, av, bv, cv, rv, qv, sv, sv + i, p))


@njit(parallel=True, **ERR, **JIT)
def segment_map_whole(op, a, b, c, r, q, s, out, p):
    """Whole-tensor form: every operand flattened and broadcast to the output; for column ops, s
    holds the element's column."""
    for i in prange(out.size):
        sv = np.float64(ld(s, i))
        st(out, i, segment_value(op, np.float64(ld(a, i)), np.float64(ld(b, i)), np.float64(ld(c, i)),
                                 np.float64(ld(r, i)), np.float64(ld(q, i)), sv, sv, p))


SEGMENT_COSTS = {code: (setup, per, vec) for code, setup, per, vec in SEGMENT_OPS.values()}


def segment_map_instructions(k: int, n: int, width: int, op: int) -> int:
    """Thread instructions of a segment map vertex with k segments of n elements (module docstring)."""
    setup, per_vector, vectorised = SEGMENT_COSTS[op]
    w = width if vectorised else 1
    return 17 + k * setup + k * math.ceil(n / w) * per_vector


def _segment_map_cycles(sizes, params, dtype, target):
    return target.thread_cycles(segment_map_instructions(sizes["r"], int(params[1]), vector_width(dtype),
                                                         int(params[0])))


SEGMENT_MAP_VERTEX = VertexType("popops::SegmentMap", ("a", "b", "c", "r", "q", "s"), ("out",),
                                segment_map_codelet, _segment_map_cycles, num_params=3)


def _per_output(t: Tensor, stats_shape: tuple, what: str) -> Tensor:
    """A statistics operand as a view of one value per output (scalars broadcast)."""
    num_out = int(np.prod(stats_shape, dtype=np.int64))
    if t.numel == num_out:
        return t.reshape(stats_shape) if t.shape != stats_shape else t
    try:
        return t.broadcast(stats_shape)
    except ValueError:
        raise ValueError(f"{what}: statistics {t.name!r} {t.shape} do not match the {num_out} outputs "
                         f"{stats_shape} of the segments") from None


def segment_map(graph: Graph, op: str, a: Tensor, axes, prog: Sequence, name: str, *, r: Tensor | None = None,
                b: Tensor | None = None, c: Tensor | None = None, q: Tensor | None = None,
                s: Tensor | None = None, param: float = 0.0, out_dtype=None,
                category: str = "activations") -> Tensor:
    """out[i] = op(a[i], b[i], c[i], r[o], q[o], s[o]) with o the output of element i for a
    reduction of `a` over `axes`; see SEGMENT_OPS for the ops.

    The output is mapped like `a`. Full-size operands `b`, `c` (broadcast to a's shape) are
    exchanged to a's tiles; statistics `r`, `q`, `s` (one value per output, or a scalar) are
    exchanged once to every segment that uses them. Column ops need exactly one axis. Ops without
    statistics ("mul") take no `r`: each segment's first element of `a` fills the unused fields.
    """
    if op not in SEGMENT_OPS:
        raise ValueError(f"{name}: unknown segment op {op!r}; use one of {sorted(SEGMENT_OPS)}")
    code = SEGMENT_OPS[op][0]
    if (r is None) != (op in STATLESS):
        raise ValueError(f"{name}: segment op {op!r} " + ("takes no statistics" if r is not None else "needs r="))
    axes = normalize_axes(axes, a.rank, name)
    shape = a.shape
    out_index, stats_shape, keep_shape = output_index(shape, axes)
    column = code >= USES_COLUMN
    if column and len(axes) != 1:
        raise ValueError(f"{name}: op {op!r} indexes along one axis, got axes {axes}")
    stride = int(np.prod(shape[axes[0] + 1:], dtype=np.int64)) if column else None
    b = a if b is None else (b if b.shape == shape else b.broadcast(shape))
    c = a if c is None else (c if c.shape == shape else c.broadcast(shape))
    r = a if r is None else _per_output(r, stats_shape, name)
    q = r if q is None else _per_output(q, stats_shape, name)
    s = r if s is None else _per_output(s, stats_shape, name)
    out_dt = as_dtype(out_dtype) if out_dtype is not None else a.dtype
    out = graph.addVariable(out_dt, shape, name, category=category, always_live=False)
    out.var.mapping[:] = a.tiles().reshape(-1)
    body = Sequence(name=name)
    if out.numel:
        tiles = out.var.mapping
        plan = plan_segments(tiles, out_index, workers=graph.target.workers_per_tile, stride=stride)
        # statistics are copied once per (tile, output); the chunks of one such group share the copy
        groups = plan_segments(tiles, out_index)
        parent = np.searchsorted(groups.starts, plan.starts[:-1], side="right") - 1
        bl = placed(graph, body, b, tiles, f"{name}/b")
        cl = placed(graph, body, c, tiles, f"{name}/c") if c is not b else bl
        per_chunk = {}  # field -> (1-D tensor, element of the tensor for each chunk)
        for key, t in (("r", r), ("q", q), ("s", s)):
            if column and key == "s":
                first_col = (plan.perm[plan.starts[:-1]] // stride) % shape[axes[0]]
                const = graph.addConstant(np.float32, (plan.num_segments,), first_col, f"{name}/columns")
                const.var.mapping[:] = plan.seg_tile
                per_chunk[key] = (const, np.arange(plan.num_segments))
            elif key != "r" and t is r:
                per_chunk[key] = per_chunk["r"]
            elif t is a:
                per_chunk[key] = (a.flatten(), plan.perm[plan.starts[:-1]])
            else:
                copies = placed(graph, body, flat(t, groups.seg_out), groups.seg_tile, f"{name}/{key}")
                per_chunk[key] = (copies, parent)
        cs = graph.addComputeSet(name)
        counts = plan.counts
        full = {"a": a.flatten(), "b": bl.flatten(), "c": cl.flatten(), "out": out.flatten()}
        for tile, lo, hi in vertex_groups(plan.seg_tile, counts, graph.target.workers_per_tile):
            pos = plan.perm[plan.starts[lo]:plan.starts[hi]]
            fields = {k: t[pos] for k, t in full.items()}
            fields.update({k: t[index[lo:hi]] for k, (t, index) in per_chunk.items()})
            graph.addVertex(cs, SEGMENT_MAP_VERTEX, tile, fields, (code, int(counts[lo]), float(param)))
        body.add(Execute(cs))

    def full(t: Tensor, io, kept: bool) -> np.ndarray:
        if t is a:
            kept = False
        arr = io.read(t)
        arr = np.broadcast_to(arr.reshape(keep_shape) if kept else arr, shape)
        return kernel_view(np.ascontiguousarray(arr).reshape(-1))

    def fast(io):
        res = np.empty(shape, dtype=out_dt)
        if column:
            along = [-1 if d == axes[0] else 1 for d in range(len(shape))]
            cols = np.arange(shape[axes[0]], dtype=np.float32).reshape(along)
            sv = np.ascontiguousarray(np.broadcast_to(cols, shape)).reshape(-1)
        else:
            sv = full(s, io, True)
        segment_map_whole(code, full(a, io, False), full(b, io, False), full(c, io, False), full(r, io, True),
                          full(q, io, True), sv, kernel_view(res.reshape(-1)), float(param))
        io.write(out, res)

    reads = tuple(dict.fromkeys(t for t in (a, b, c, r, q) + (() if column else (s,))))
    prog.add(OpProgram(name, body, fast, reads, (out,)))
    return out


# ---- composition -----------------------------------------------------------------------------
def composite(name: str, body: Sequence, reads: tuple, writes: tuple) -> OpProgram:
    """One op made of the op programs in `body`: the strict mode runs their bodies, the fast mode
    their whole-tensor implementations, in order."""
    parts = list(body.programs)
    for p in parts:
        if not isinstance(p, OpProgram):
            raise TypeError(f"{name}: a composite op holds op programs only, got {type(p).__name__}")

    def fast(io):
        for p in parts:
            p.fast(io)

    return OpProgram(name, body, fast, tuple(reads), tuple(writes))
