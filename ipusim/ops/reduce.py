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

Numerics. A vertex accumulates each segment in float64 in LANES = 16 interleaved lanes (element i
of the segment into lane i % 16, like a vertex's vector accumulators), joins the lanes by halving
(lane l takes lane l + w for w = 8, 4, 2, 1) and rounds partials and outputs once when storing
them. The fast mode runs the same stages over the same segments in the same order, so both modes
give bit-identical results. Its plan is made once, with the graph (`FastReduction`): runs of
segments that are equally spaced elements are read with strides instead of gathered (contiguous
float32 segments with 8-wide float64 vector instructions, one vector lane per accumulator lane;
strided segments of neighbouring outputs side by side, vectorised across the outputs), and when
every partial holds exactly one element the partial stage is skipped (the final stage reads the
elements themselves, rounding squares to float32 as the partials would).

Segment maps compute each element in float64 from its operands and round once; `exp` is `exp64`
(branch-free, within 2 ulp in float64, so that loops over it vectorise), in both modes. The fast
mode runs one kernel per op over the tensor seen as runs of its innermost reduced or kept
dimensions (`RowLayout`): statistics are read as one value per output, b and c in place where
their runs are contiguous, and a float32 output is written straight into its storage.

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
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..device.graph import Graph
from ..device.kernels import JIT, kernel_threads, ld, st
from ..device.program import Copy, Execute, OpProgram, Sequence
from ..device.target import Target
from ..device.mapping import TileMap, expand_runs, tile_counts
from ..device.tensor import Tensor, as_dtype
from ..device.vertex import Field, VertexType, tile_makespans
from .common import GRAIN, flat, lookup, placed
from .segments import (Geometry, SegmentPlan, geometry, plan_segments, remembered, side_by_side, structure,
                       vertex_element_runs)

# ---- reduction operations ------------------------------------------------------------------
OPS = {"sum": 0, "mean": 0, "max": 1, "min": 2, "sum_squares": 3, "sum_abs": 4}
SUM, MAX, MIN, SUM_SQUARES, SUM_ABS = range(5)
ACCUMULATING = (SUM, SUM_SQUARES, SUM_ABS)
# The op that combines partials in the final stage.
FINAL_OP = {SUM: SUM, MAX: MAX, MIN: MIN, SUM_SQUARES: SUM, SUM_ABS: SUM}
ERR = dict(error_model="numpy")  # IEEE results (inf, nan) for division by zero, as on the device


# Accumulation order (see the module docstring). Lanes start at the op's identity. Strict
# codelets run this order one element at a time; the fast kernels vectorise it without changing
# any lane's sequence of operations, so both modes give the same bits. The fast kernels do sum,
# max, min and sum_squares; `run_stage` turns sum_abs and rounded squares into sums of exactly
# transformed elements.
LANES = 16
VECTOR = 8  # float64 elements per vector register in `reduce_contiguous`


def identity_value(op: int) -> float:
    return -math.inf if op == MAX else (math.inf if op == MIN else 0.0)


@njit(**ERR, **JIT)
def identity(op):
    return -np.inf if op == MAX else (np.inf if op == MIN else 0.0)


@njit(**ERR, **JIT)
def combine(op, acc, v):
    """acc combined with element v (a NaN element wins max and min). Branch-free: every form is
    computed and the op's is selected, which keeps the compiled loops small."""
    term = v * v if op == SUM_SQUARES else (abs(v) if op == SUM_ABS else v)
    wins = (v > acc) if op == MAX else (v < acc)
    extreme = v if wins | (v != v) else acc
    return extreme if (op == MAX) | (op == MIN) else acc + term


@njit(**ERR, **JIT)
def join_lanes(lanes, op):
    """The result of LANES lanes joined by halving."""
    lane_op = op if (op == MAX or op == MIN) else SUM
    w = LANES // 2
    while w >= 1:
        for lane in range(w):
            lanes[lane] = combine(lane_op, lanes[lane], lanes[lane + w])
        w //= 2
    return lanes[0]


@njit(**ERR, **JIT)
def finish(acc, scale):
    return acc if scale == 1.0 else acc * scale


@njit(parallel=True, **ERR, **JIT)
def reduce_codelet(x, x_addr, x_start, out, o_addr, o_start, params, side_by_side):
    """params: op, n (elements per output), scale, converted. The vertex's k segments lie in x one
    after another, or side by side (template): element i of segment j at i * k + j."""
    for v in prange(params.shape[0]):
        op = int(params[v, 0])
        n = int(params[v, 1])
        lanes = np.empty(LANES)
        bx, bo = x_start[v], o_start[v]
        k = o_start[v + 1] - bo
        for j in range(k):
            for lane in range(LANES):
                lanes[lane] = identity(op)
            for i in range(n):
                e = bx + (i * k + j if side_by_side else j * n + i)
                lanes[i % LANES] = combine(op, lanes[i % LANES], np.float64(ld(x, x_addr[e])))
            st(out, o_addr[bo + j], finish(join_lanes(lanes, op), params[v, 2]))


def _vector_combine(builder, op, acc, v):
    """IR of `combine` on vectors (or scalars) of float64, for sum, max, min and sum_squares."""
    if op in (MAX, MIN):
        kept = builder.select(builder.fcmp_ordered(">" if op == MAX else "<", v, acc), v, acc)
        return builder.select(builder.fcmp_unordered("uno", v, v), v, kept)
    return builder.fadd(acc, builder.fmul(v, v) if op == SUM_SQUARES else v)


def _vector_lane_step(builder, op, regs, v, used=None):
    """One row of elements into the lanes. For max and min a lane is two registers, the max (min)
    of its non-NaN elements and its last NaN (0 until one comes): `combine` gives exactly that
    lane a NaN element wins and stays until a later NaN replaces it, and the two short chains
    run in parallel."""
    acc = builder.load(regs[0])
    if op in (MAX, MIN):
        new = builder.select(builder.fcmp_ordered(">" if op == MAX else "<", v, acc), v, acc)
        last_nan = builder.load(regs[1])
        nan = builder.select(builder.fcmp_unordered("uno", v, v), v, last_nan)
        builder.store(new if used is None else builder.select(used, new, acc), regs[0])
        builder.store(nan if used is None else builder.select(used, nan, last_nan), regs[1])
        return
    new = _vector_combine(builder, op, acc, v)
    builder.store(new if used is None else builder.select(used, new, acc), regs[0])


def _vector_lane_value(builder, op, regs):
    """The lanes' values (see `_vector_lane_step`)."""
    acc = builder.load(regs[0])
    if op in (MAX, MIN):
        nan = builder.load(regs[1])
        return builder.select(builder.fcmp_unordered("uno", nan, nan), nan, acc)
    return acc


@intrinsic
def reduce_contiguous(typingctx, src, start, n, op):
    """The lane-order reduction of the contiguous float32 run src[start:start + n] for a constant
    op, with the LANES lanes in two 8-wide float64 vector registers (lanes 0-7 and 8-15): each
    vector lane does the operations of its scalar lane in the same order, so the result has the
    bits of the scalar form. The last n % LANES elements go to lanes 0, 1, ... under a mask."""
    if not (isinstance(src, types.Array) and src.dtype == types.float32 and src.layout == "C"
            and isinstance(op, types.IntegerLiteral)):
        return None  # vector loads need C-contiguous memory: a strided array must not reach them
    code = op.literal_value
    lane_op = code if code in (MAX, MIN) else SUM

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        data = array.data
        f32s, f64s = ir.VectorType(ir.FloatType(), VECTOR), ir.VectorType(ir.DoubleType(), VECTOR)
        i32, i64 = ir.IntType(32), args[2].type
        regs = [(cgutils.alloca_once_value(builder, ir.Constant(f64s, [identity_value(code)] * VECTOR)),
                 cgutils.alloca_once_value(builder, ir.Constant(f64s, [0.0] * VECTOR)))
                for _ in range(LANES // VECTOR)]
        base = builder.gep(data, [args[1]])
        rows = builder.sdiv(args[2], ir.Constant(i64, LANES))
        with cgutils.for_range(builder, rows) as loop:
            row = builder.mul(loop.index, ir.Constant(i64, LANES))
            for half, reg in enumerate(regs):
                at = builder.gep(base, [builder.add(row, ir.Constant(i64, half * VECTOR))])
                v = builder.fpext(builder.load(builder.bitcast(at, f32s.as_pointer()), align=4, typ=f32s), f64s)
                _vector_lane_step(builder, code, reg, v)
        done = builder.mul(rows, ir.Constant(i64, LANES))
        left = builder.sub(args[2], done)
        with builder.if_then(builder.icmp_signed(">", left, ir.Constant(i64, 0))):
            splat = builder.insert_element(ir.Constant(ir.VectorType(i64, VECTOR), None), left, ir.Constant(i32, 0))
            splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(i32, VECTOR), [0] * VECTOR))
            inside = builder.icmp_signed("<=", builder.add(builder.add(args[1], done), ir.Constant(i64, LANES)),
                                         array.nitems)
            tails = []
            with builder.if_else(inside) as (whole_rows, near_the_end):
                with whole_rows:  # a full row of loads stays inside the array; lanes >= left are masked
                    tails.append((builder.block, [builder.load(builder.bitcast(
                        builder.gep(base, [builder.add(done, ir.Constant(i64, half * VECTOR))]), f32s.as_pointer()),
                        align=4, typ=f32s) for half in range(len(regs))]))
                with near_the_end:  # element min(lane, left - 1) of the tail: always inside the run
                    last = builder.sub(left, ir.Constant(i64, 1))
                    loaded = []
                    for half in range(len(regs)):
                        tail = ir.Constant(f32s, None)
                        for j in range(VECTOR):
                            lane = ir.Constant(i64, half * VECTOR + j)
                            at = builder.add(done, builder.select(builder.icmp_signed("<", lane, last), lane, last))
                            tail = builder.insert_element(tail, builder.load(builder.gep(base, [at]),
                                                                             typ=ir.FloatType()), ir.Constant(i32, j))
                        loaded.append(tail)
                    tails.append((builder.block, loaded))
            merged = [builder.phi(f32s) for _ in regs]
            for half, tail in enumerate(merged):
                for block, loaded in tails:
                    tail.add_incoming(loaded[half], block)
            for half, (reg, tail) in enumerate(zip(regs, merged)):
                lanes = ir.Constant(ir.VectorType(i64, VECTOR), [half * VECTOR + j for j in range(VECTOR)])
                _vector_lane_step(builder, code, reg, builder.fpext(tail, f64s), builder.icmp_signed("<", lanes, splat))
        acc = _vector_combine(builder, lane_op, _vector_lane_value(builder, code, regs[0]),
                              _vector_lane_value(builder, code, regs[1]))
        width = VECTOR
        while width > 1:  # halving: lane l takes lane l + width / 2
            width //= 2
            low = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(i32, width), list(range(width))))
            high = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(i32, width),
                                                                list(range(width, 2 * width))))
            acc = _vector_combine(builder, lane_op, low, high)
        return builder.extract_element(acc, ir.Constant(i32, 0))

    return types.float64(src, start, n, op), codegen


def contiguous_reduce(src, start, n, op):
    """The lane-order reduction of the contiguous run src[start:start + n] with sum, max, min or
    sum_squares (vectorised for float32)."""


@overload(contiguous_reduce, jit_options=JIT)
def _contiguous_reduce(src, start, n, op):
    if src.dtype != types.float32:
        def scalar(src, start, n, op):
            lanes = np.empty(LANES)
            for lane in range(LANES):
                lanes[lane] = identity(op)
            for i in range(n):
                lanes[i % LANES] = combine(op, lanes[i % LANES], np.float64(src[np.uint64(start + i)]))
            return join_lanes(lanes, op)
        return scalar

    def vectorised(src, start, n, op):
        if op == SUM:
            return reduce_contiguous(src, start, n, SUM)
        if op == MAX:
            return reduce_contiguous(src, start, n, MAX)
        if op == MIN:
            return reduce_contiguous(src, start, n, MIN)
        return reduce_contiguous(src, start, n, SUM_SQUARES)
    return vectorised


@njit(**ERR, **JIT)
def fold_row(acc, lane, src, start, count, gap, op):
    """acc[lane, k] = combine(op, acc[lane, k], src[start + k * gap]) for k < count, one loop per
    op (vectorised over k)."""
    row = np.uint64(lane)
    if op == SUM:
        for k in range(count):
            acc[row, k] += np.float64(src[np.uint64(start + k * gap)])
    elif op == MAX:
        for k in range(count):
            v = np.float64(src[np.uint64(start + k * gap)])
            acc[row, k] = v if (v > acc[row, k]) | (v != v) else acc[row, k]
    elif op == MIN:
        for k in range(count):
            v = np.float64(src[np.uint64(start + k * gap)])
            acc[row, k] = v if (v < acc[row, k]) | (v != v) else acc[row, k]
    else:
        for k in range(count):
            v = np.float64(src[np.uint64(start + k * gap)])
            acc[row, k] += v * v


@njit(**ERR, **JIT)
def reduce_side_by_side(acc, src, first, n, stride, count, gap, op, out, o, scale):
    """`count` segments at once, segment k being src[first + k * gap + i * stride] for i < n, in
    the lane order of each (acc[lane, k] holds lane `lane` of segment k; loops over k innermost).
    Lanes that no element reaches hold the identity, so joining them is skipped."""
    used = min(n, LANES)
    start_value = identity(op)
    for lane in range(max(used, 1)):
        for k in range(count):
            acc[lane, k] = start_value
    for i in range(n):
        fold_row(acc, i % LANES, src, first + i * stride, count, gap, op)
    lane_op = op if (op == MAX or op == MIN) else SUM
    w = LANES // 2
    while w >= 1:
        for lane in range(used - w):
            for k in range(count):
                acc[lane, k] = combine(lane_op, acc[lane, k], acc[lane + w, k])
        used = min(used, w)
        w //= 2
    for k in range(count):
        out[o + k] = finish(acc[0, k], scale)


GATHERED, ROWS, COLUMNS = range(3)


@njit(parallel=True, **ERR, **JIT)
def reduce_rows(src, gathered, blocks, op, scale, out):
    """The ROWS and GATHERED blocks of a stage (see `stage_blocks`): out[o + k] = the reduction
    of segment k of each block, in float64."""
    for b in prange(blocks.shape[0]):
        first, n, count, gap, o = blocks[b, 0], blocks[b, 1], blocks[b, 3], blocks[b, 4], blocks[b, 5]
        if blocks[b, 6] == GATHERED:
            for k in range(count):
                out[o + k] = finish(contiguous_reduce(gathered, first + k * gap, n, op), scale)
        else:
            for k in range(count):
                out[o + k] = finish(contiguous_reduce(src, first + k * gap, n, op), scale)


@njit(parallel=True, **ERR, **JIT)
def reduce_columns(src, blocks, op, scale, out, threads):
    """The COLUMNS blocks of a stage, each block's segments side by side; block b is done by the
    kernel thread b % threads, with that thread's lane scratch."""
    width = 1
    for b in range(blocks.shape[0]):
        width = max(width, blocks[b, 3])
    scratch = np.empty((threads, LANES, width))
    for t in prange(threads):
        for b in range(t, blocks.shape[0], threads):
            reduce_side_by_side(scratch[t], src, blocks[b, 0], blocks[b, 1], blocks[b, 2], blocks[b, 3],
                                blocks[b, 4], op, out, blocks[b, 5], scale)


def vector_width(dtype) -> int:
    """Elements per 64-bit vector."""
    dtype = np.dtype(dtype)
    return 4 if dtype == np.float16 else 2 if dtype == np.float32 else 1


def reduce_instructions(k, n, width: int, op, scaled, converted):
    """Thread instructions of a reduce vertex with k outputs of n elements each (module docstring);
    ints, or arrays (one per vertex)."""
    accumulating = np.isin(op, ACCUMULATING)
    w, per_vector = np.where(accumulating, 2 * width, width), np.where(accumulating, 2, 1)
    return 26 + k * (8 + (n // w) * per_vector + n % w + np.asarray(scaled, np.int64) + np.asarray(converted, np.int64))


def _reduce_cycles(sizes, params, dtype, target):
    op, n, scale, converted = params.T
    return target.thread_cycles(reduce_instructions(sizes["out"], n.astype(np.int64), vector_width(dtype),
                                                    op.astype(np.int64), scale != 1.0, converted != 0))


REDUCE_VERTEX = VertexType("popops::Reduce", ("x",), ("out",), reduce_codelet, _reduce_cycles, num_params=4,
                           template=(False,))
# The same vertex reading its segments side by side (the columns of a block: see segments.py).
REDUCE_VERTEX_SIDE_BY_SIDE = VertexType("popops::Reduce<side_by_side>", ("x",), ("out",), reduce_codelet,
                                        _reduce_cycles, num_params=4, template=(True,))


# ---- stages in the fast mode ------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class StageBlocks:
    """One reduction stage as the fast kernels read it. Row `blocks[b]` holds (first, elements
    per segment, stride, segments, gap between firsts, first slot, kind): segment j of the block
    reduces the `n` elements first + j * gap + i * stride into slot first slot + j. ROWS blocks
    (stride 1) read the stage's source, their segments reduced one after the other; COLUMNS
    blocks read it with strides, their segments side by side; GATHERED blocks read
    `src[gather]` (gathered once per run) like ROWS blocks."""
    blocks: np.ndarray
    gather: np.ndarray
    num_segments: int
    rows: np.ndarray  # the ROWS and GATHERED blocks
    columns: np.ndarray  # the COLUMNS blocks

    @classmethod
    def of(cls, table: np.ndarray, gather: np.ndarray, num_segments: int) -> "StageBlocks":
        table = coalesced(np.ascontiguousarray(table, dtype=np.int64).reshape(-1, 7))
        columns = table[:, 6] == COLUMNS
        return cls(table, np.asarray(gather, np.int64), num_segments, np.ascontiguousarray(table[~columns]),
                   np.ascontiguousarray(table[columns]))


BLOCK_ELEMENTS = 1 << 15  # the most elements coalesced into one block (blocks are what kernel threads share)


def coalesced(table: np.ndarray) -> np.ndarray:
    """The block table with each run of neighbouring ROWS or COLUMNS blocks that continue one
    another (same segment length, stride and gap; the next block's segments and slots follow
    on) joined into blocks of up to BLOCK_ELEMENTS elements. Every segment keeps its elements in
    their order, so the results are the same bits with fewer, wider kernel loops."""
    if table.shape[0] < 2:
        return table
    first, n, stride, count, gap, slot, kind = table.T
    prev = np.s_[:-1]
    join = np.zeros(table.shape[0], bool)
    join[1:] = ((kind[1:] == kind[prev]) & (kind[1:] != GATHERED) & (n[1:] == n[prev]) & (stride[1:] == stride[prev])
                & (gap[1:] == gap[prev]) & (first[1:] == first[prev] + count[prev] * gap[prev])
                & (slot[1:] == slot[prev] + count[prev]))
    if not join.any():
        return table
    run = np.cumsum(~join) - 1
    size = n * count
    before = np.cumsum(size) - size
    piece = (before - before[~join][run]) // BLOCK_ELEMENTS
    head = np.flatnonzero(~join | (piece != np.concatenate(([-1], piece[:-1]))))
    out = table[head].copy()
    out[:, 3] = np.add.reduceat(count, head)
    return out


def stage_blocks(plan: SegmentPlan) -> StageBlocks:
    """The fast mode's blocks of a plan's segments over the values of its [A, R, C] view (built
    once, with the graph): a block of segments of one part each is ROWS when C = 1 (each segment
    a run along the reduced axes, the next one R further on) and COLUMNS otherwise (strided
    segments of neighbouring outputs, cut where the outputs leave an [R, C] plane); a segment of
    several parts, or one of several segments of an output, is GATHERED."""
    g = plan.geometry
    simple = (plan.m == 1) & (np.diff(plan.part_first)[plan.tmpl] == 1)
    rows = []
    b = np.flatnonzero(simple)
    r0, n = plan.part_r0[plan.part_first[plan.tmpl[b]]], plan.part_n[plan.part_first[plan.tmpl[b]]]
    if g.C == 1:
        rows.append(np.stack([g.positions(plan.out[b], r0), n, np.ones_like(b), plan.k[b], np.full_like(b, g.R),
                              plan.block_start[b], np.full_like(b, ROWS)], 1))
    elif b.size:  # per plane: the outputs of a block in one [R, C] plane
        lo, hi = plan.out[b], plan.out[b] + plan.k[b]
        planes = (hi - 1) // g.C - lo // g.C + 1
        piece = np.repeat(np.arange(b.size), planes)
        j = np.arange(planes.sum()) - np.repeat(np.cumsum(planes) - planes, planes)
        first = np.maximum(lo[piece], (lo[piece] // g.C + j) * g.C)
        last = np.minimum(hi[piece], (lo[piece] // g.C + j + 1) * g.C)
        rows.append(np.stack([g.positions(first, r0[piece]), n[piece], np.full_like(piece, g.C), last - first,
                              np.ones_like(piece), plan.block_start[b[piece]] + first - lo[piece],
                              np.full_like(piece, COLUMNS)], 1))
    segments = expand_runs(plan.block_start[:-1][~simple], plan.block_segments[~simple])
    gather = np.zeros(0, np.int64)
    if segments.size:
        seg, first, count, step = plan.segment_runs(segments)
        gather = expand_runs(first, count) if g.C == 1 else _strided_elements(first, count, step)
        counts = plan.counts[segments]
        rows.append(np.stack([np.cumsum(counts) - counts, counts, np.ones_like(counts), np.ones_like(counts),
                              np.zeros_like(counts), segments, np.full_like(counts, GATHERED)], 1))
    return StageBlocks.of(np.concatenate(rows) if rows else np.zeros((0, 7), np.int64), gather, plan.num_segments)


def read_through(stage: StageBlocks, gather: np.ndarray) -> StageBlocks | None:
    """The stage as it reads `src[gather]`, re-expressed to read `src` itself, or None when a
    block's elements are not evenly spaced in src (a ROWS block must stay contiguous). Segments,
    slots and the order of the elements of each segment are kept, so the results are the same
    bits without gathering every element on every run."""
    table = stage.blocks.copy()
    b = np.flatnonzero((table[:, 6] != GATHERED) & (table[:, 1] * table[:, 3] > 0))
    first, n, stride, count, gap = (table[b, j] for j in range(5))
    g0 = gather[first]
    step = np.where(n > 1, gather[first + np.where(n > 1, stride, 0)] - g0, 1)
    skip = np.where(count > 1, gather[first + np.where(count > 1, gap, 0)] - g0, 0)
    if ((table[b, 6] == ROWS) & (step != 1)).any():
        return None
    size = n * count
    blk = np.repeat(np.arange(b.size), size)
    within = np.arange(size.sum()) - np.repeat(np.cumsum(size) - size, size)
    k, i = np.divmod(within, n[blk])
    if not np.array_equal(gather[first[blk] + i * stride[blk] + k * gap[blk]],
                          g0[blk] + i * step[blk] + k * skip[blk]):
        return None
    table[b, 0], table[b, 2], table[b, 4] = g0, step, skip
    return StageBlocks.of(table, gather[stage.gather], stage.num_segments)


def _strided_elements(first, count, step) -> np.ndarray:
    """first[k] + i * step[k] for i < count[k], run after run."""
    run = np.repeat(np.arange(first.size), count)
    return np.repeat(first, count) + (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)) * step[run]


def final_stage_blocks(final: FinalStage) -> StageBlocks:
    """The fast mode's blocks of the final stage over the gathered values (`src[final.order]`):
    per interval, its outputs' partials side by side (COLUMNS, a stride of the interval's size),
    or one after another when an interval has one output (ROWS)."""
    slot = np.searchsorted(final.seg_interval, np.arange(final.interval_first.size))  # first segment of each
    kind = np.where(final.interval_size > 1, COLUMNS, ROWS)
    table = np.stack([final.interval_at, final.interval_parts, final.interval_size, final.interval_size,
                      np.ones_like(slot), slot, kind], 1)
    return StageBlocks.of(table, np.zeros(0, np.int64), final.seg_out.size)


def run_stage(src: np.ndarray, stage: StageBlocks, op: int, scale: float, rounded: bool = False) -> np.ndarray:
    """The float64 result of every segment of a stage. `rounded`: squares are rounded to float32
    first (as one-element float32 partials hold them). Row and column blocks are separate kernels,
    compiled only when a stage has such blocks. `src` may be a strided view (a fast-mode read); the
    kernels load runs of it as contiguous memory, so it is made contiguous first."""
    src = np.ascontiguousarray(src)
    if src.dtype != np.float32:  # one more kernel specialisation only: integers and bools exactly as float64
        src = src.astype(np.float64, copy=False)
    if op == SUM_ABS:
        src, op = np.abs(src), SUM  # |x| is exact
    elif op == SUM_SQUARES and rounded:
        src, op = np.square(src).astype(np.float32), SUM  # x * x rounded once, as the partial's store
    out = np.empty(stage.num_segments, dtype=np.float64)
    if stage.rows.shape[0]:
        reduce_rows(src, src[stage.gather] if stage.gather.size else src, stage.rows, op, scale, out)
    blocks = stage.columns.shape[0]
    if blocks:
        reduce_columns(src, stage.columns, op, scale, out, kernel_threads(blocks))
    return out


def vertex_groups(seg_tile: np.ndarray, counts: np.ndarray, workers: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split segments (ordered by tile) into vertices: vertex v runs on `tiles[v]` and takes the
    segments `begin[v] .. end[v] - 1`, consecutive segments of one tile with equal element
    counts, about a worker's share of the tile's elements. The vertices cover the segments in
    order."""
    if seg_tile.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    change = np.ones(seg_tile.size, dtype=bool)
    change[1:] = (seg_tile[1:] != seg_tile[:-1]) | (counts[1:] != counts[:-1])
    begins = np.flatnonzero(change)
    return vertex_groups_of_runs(seg_tile[begins], counts[begins], begins, np.append(begins[1:], seg_tile.size),
                                 workers)


def vertex_groups_of_runs(tile: np.ndarray, count: np.ndarray, begin: np.ndarray, end: np.ndarray, workers: int
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`vertex_groups` from the runs of segments of one tile with equal counts: run r holds
    segments `begin[r] .. end[r] - 1` of `count[r]` elements on `tile[r]` (runs in order, no two
    neighbours on one tile with one count)."""
    if not tile.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    tile = tile.astype(np.int64)
    tile_total = np.bincount(tile, weights=count * (end - begin))
    share = np.maximum(1.0, tile_total[tile] / workers)
    per = np.maximum(1, np.ceil(share / np.maximum(count, 1)).astype(np.int64))
    pieces = -(-(end - begin) // per)
    run = np.repeat(np.arange(tile.size), pieces)
    first = begin[run] + (np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * per[run]
    return tile[run], first, np.minimum(first + per[run], end[run])


def plan_vertex_groups(plan: SegmentPlan, workers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`vertex_groups` of a plan's segments, from its blocks (see `SegmentPlan.count_runs`)."""
    return vertex_groups_of_runs(*plan.count_runs(), workers)


def output_of(shape: tuple, axes: tuple, positions: np.ndarray) -> np.ndarray:
    """The output (C order over the kept axes) of the elements at flat `positions` of `shape`."""
    index = np.unravel_index(np.asarray(positions, np.int64), shape) if shape else ()
    kept = [d for d in range(len(shape)) if d not in axes]
    if not kept:
        return np.zeros(np.shape(positions), np.int64)
    return np.ravel_multi_index([index[d] for d in kept], [shape[d] for d in kept]).astype(np.int64)


def output_shapes(shape: tuple, axes: tuple) -> tuple[tuple, tuple]:
    """(output shape, output shape with kept 1s) of a reduction of `shape` over `axes`."""
    return (tuple(s for d, s in enumerate(shape) if d not in axes),
            tuple(1 if d in axes else s for d, s in enumerate(shape)))


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
class FinalStage:
    """The final stage: every output's partials, gathered to the output's tile. Its segments are
    the outputs by tile, then output (output `seg_out[s]` on tile `seg_tile[s]`, `counts[s]`
    partials). The gathered partials are laid out by *intervals*: runs of outputs of one tile
    held by the same partial-stage blocks (`interval_first` output, `interval_size` outputs,
    `interval_at` where its partials start, `interval_parts` partials per output); in an
    interval, each block's partials for the interval's outputs in turn (the pairs `pair_block`,
    `pair_interval`, in that order), so output o's partials lie `interval_size` apart and the
    exchange moves runs of partials, not single ones."""
    partial: SegmentPlan
    seg_out: np.ndarray
    seg_tile: np.ndarray
    counts: np.ndarray
    interval_first: np.ndarray
    interval_size: np.ndarray
    interval_at: np.ndarray
    interval_parts: np.ndarray
    seg_interval: np.ndarray
    pair_block: np.ndarray
    pair_interval: np.ndarray

    @cached_property
    def order(self) -> np.ndarray:
        """The partial (plan segment) at each gathered position."""
        p = self.partial
        m = p.m[self.pair_block]
        c = np.repeat(np.arange(self.pair_block.size), m)
        chunk = np.arange(m.sum()) - np.repeat(np.cumsum(m) - m, m)
        b, iv = self.pair_block[c], self.pair_interval[c]
        size = self.interval_size[iv]
        base = p.block_start[b] + (self.interval_first[iv] - p.out[b]) * p.m[b] + chunk
        return np.repeat(base, size) + (np.arange(size.sum()) - np.repeat(np.cumsum(size) - size, size)) * \
            np.repeat(p.m[b], size)

    def element_tiles(self) -> np.ndarray:
        """The tile of every gathered partial."""
        return np.repeat(self.seg_tile, self.counts)

    def positions(self, segments: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the partials of the given final segments lie in the gathered buffer: (first,
        count, step) of each segment."""
        i = self.seg_interval[segments]
        return (self.interval_at[i] + self.seg_out[segments] - self.interval_first[i], self.counts[segments],
                self.interval_size[i])

    def gather_cycles(self, itemsize: int, target: Target) -> int:
        """Cycles of the exchange that gathers the partials (as cost.py counts that Copy, with its
        sync; 0 when every partial is already on its output's tile): per (interval, block) pair."""
        n = target.num_tiles
        src = self.partial.tile[self.pair_block]
        dst = self.seg_tile[np.searchsorted(self.seg_interval, self.pair_interval)]
        weight = self.interval_size[self.pair_interval] * self.partial.m[self.pair_block]
        moved = src != dst
        if not moved.any():
            return 0
        worst = max(np.bincount(src[moved], weights=weight[moved], minlength=n).max(),
                    np.bincount(dst[moved], weights=weight[moved], minlength=n).max())
        local = np.bincount(dst[~moved], weights=weight[~moved], minlength=n).max(initial=0)
        return (math.ceil(int(worst) * itemsize / target.exchange_bytes_per_cycle)
                + math.ceil(int(local) * itemsize / target.local_copy_bytes_per_cycle) + target.sync_cycles)


def final_stage(partial: SegmentPlan, out_tiles: np.ndarray) -> FinalStage:
    """The partials of each output, gathered to its tile by intervals (see `FinalStage`)."""
    num_out = out_tiles.size
    cuts = np.zeros(num_out + 1, bool)
    cuts[1:num_out] = out_tiles[1:] != out_tiles[:-1]
    first, size, interval, block = partial.output_pairs(cuts)
    tile = out_tiles[first]
    order = np.lexsort((first, tile))  # intervals by tile, then output
    rank = np.empty(order.size, np.int64)
    rank[order] = np.arange(order.size)
    first, size, tile = first[order], size[order], tile[order]
    pair = np.lexsort((block, rank[interval]))
    block, interval = block[pair], rank[interval][pair]
    parts = np.bincount(interval, weights=partial.m[block], minlength=first.size).astype(np.int64)
    at = np.cumsum(parts * size) - parts * size
    seg_interval = np.repeat(np.arange(first.size), size)
    return FinalStage(partial, expand_runs(first, size), tile[seg_interval], parts[seg_interval], first, size, at,
                      parts, seg_interval, block, interval)


@dataclass(frozen=True, eq=False)
class ReducePlan:
    """A reduction's plan: partial-stage segments, the output's tiles, and the final stage (None
    when the partial stage writes the outputs)."""
    partial: SegmentPlan
    out_tiles: np.ndarray
    final: FinalStage | None
    cycles: int
    description: str


def _stage_cycles(groups: tuple, counts_of_first: np.ndarray, width: int, op: int, scaled: bool, converted: bool,
                  target: Target) -> int:
    """Cycles of a reduce compute set whose vertices are `groups` (tiles, begin, end) with
    `counts_of_first` elements per segment (one per vertex)."""
    tiles, first, end = groups
    if not tiles.size:
        return 0
    cycles = target.thread_cycles(reduce_instructions(end - first, counts_of_first.astype(np.int64), width, op,
                                                      scaled, converted)) + target.vertex_overhead_cycles
    return int(tile_makespans(tiles, cycles, target.workers_per_tile, target.num_tiles).max())


def plan_reduction(g: Geometry, target: Target, op: int, in_dtype, partial_dtype, out_dtype, scaled: bool,
                   tiles: TileMap | None = None) -> ReducePlan:
    """Choose segments and output mapping with the cost model of the module docstring, for the
    reduction of the [A, R, C] view `g` (its positions on `tiles`, the view's own tile map
    unless given)."""
    tiles = g.view.tile_map() if tiles is None else tiles
    workers, n = target.workers_per_tile, target.num_tiles
    num_out = g.num_out
    width_in, width_part = vector_width(in_dtype), vector_width(partial_dtype)
    final_op = FINAL_OP[op]
    plain = plan_segments(g, tiles, num_tiles=n)
    split = plan_segments(g, tiles, workers=workers, num_tiles=n)
    segment_options = [("unsplit", plain)] + ([("split", split)] if split.num_segments != plain.num_segments else [])
    mapping_options = [("owner", plain.owners()), ("linear", linear_tiles(num_out, n)),
                       ("spread", linear_tiles(num_out, n, min_elements_per_tile=GRAIN))]
    part_size, out_size = np.dtype(partial_dtype).itemsize, np.dtype(out_dtype).itemsize
    input_bytes = tiles.counts(n) * np.dtype(in_dtype).itemsize
    converted_out = np.dtype(in_dtype) != np.dtype(out_dtype)
    converted_part = np.dtype(in_dtype) != np.dtype(partial_dtype)
    best, best_key = None, None
    for seg_name, segs in segment_options:
        groups = plan_vertex_groups(segs, workers)  # the partial stage's vertices, whatever the outputs
        counts_of_first = segs.counts_at(groups[1])
        on_tiles = np.bincount(segs.tile, weights=segs.block_segments, minlength=n).astype(np.int64)
        for map_name, out_tiles in mapping_options:
            single = (segs.num_segments == num_out and np.array_equal(segs.seg_tile, out_tiles[segs.seg_out]))
            if single:
                cycles = _stage_cycles(groups, counts_of_first, width_in, op, scaled, converted_out,
                                       target) + target.sync_cycles
                final = None
                working = input_bytes
            else:
                final = final_stage(segs, out_tiles)
                final_groups = vertex_groups(final.seg_tile, final.counts, workers)
                cycles = (_stage_cycles(groups, counts_of_first, width_in, op, False, converted_part, target)
                          + final.gather_cycles(np.dtype(partial_dtype).itemsize, target)
                          + _stage_cycles(final_groups, final.counts[final_groups[1]], width_part, final_op, scaled,
                                          np.dtype(partial_dtype) != np.dtype(out_dtype), target)
                          + 2 * target.sync_cycles)
                working = input_bytes + (on_tiles + np.bincount(final.seg_tile, weights=final.counts,
                                                                  minlength=n)) * part_size
            working = working + tile_counts(out_tiles, n) * out_size
            key = (bool((working > target.bytes_per_tile).any()), cycles)
            if best_key is None or key < best_key:
                best_key = key
                best = ReducePlan(segs, out_tiles, final, cycles, f"{seg_name} segments, {map_name} outputs, "
                                  f"{'one stage' if final is None else 'two stages'}")
    return best


# ---- fast mode ---------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class FastReduction:
    """A reduction as the fast mode runs it: one or two stages of the plan's segments, in the
    same order with the same accumulation. When every partial holds one element exactly, the
    partial stage is skipped and the final stage reads the input elements directly (same bits;
    a square is rounded to float32 as its partial would be)."""
    stages: tuple
    ops: tuple
    scales: tuple
    rounded: bool
    partial_dtype: np.dtype
    slots: np.ndarray | None  # output of each final segment; None when they are in output order
    order: tuple | None  # the view's axis order when it is a transpose of x (see segments.geometry)
    gather: np.ndarray | None  # what the final stage reads: the partials (or elements) in gathered order

    def run(self, x: np.ndarray) -> np.ndarray:
        """The outputs (float64, flat) from the input values."""
        src = (x if self.order is None else x.transpose(self.order)).reshape(-1)
        if src.dtype == np.float16:
            src = src.astype(np.float32)
        if len(self.stages) == 1 and self.gather is not None:  # partials of one element: the elements
            vals = run_stage(src[self.gather], self.stages[0], self.ops[0], self.scales[0], self.rounded)
        else:
            vals = run_stage(src, self.stages[0], self.ops[0], self.scales[0], self.rounded)
        if len(self.stages) == 2:
            vals = run_stage(stored(vals, self.partial_dtype)[self.gather], self.stages[1], self.ops[1], self.scales[1])
        if self.slots is None:
            return vals
        res = np.empty(self.slots.size, dtype=np.float64)
        res[self.slots] = vals
        return res


def stored(values: np.ndarray, dtype) -> np.ndarray:
    """Float64 results rounded as `st` stores them (float16 through float32)."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return values.astype(np.float32).astype(np.float16)
    return values.astype(dtype)


def _slots(seg_out: np.ndarray) -> np.ndarray | None:
    return None if np.array_equal(seg_out, np.arange(seg_out.size)) else seg_out


def fast_reduction(plan: ReducePlan, op: int, in_dtype, partial_dtype, scale: float,
                   shape: tuple[int, ...]) -> FastReduction:
    """The fast mode's form of a plan reducing a tensor of `shape` (built once, with the graph).
    The stage that reads the input reads it in place where it can: through the transpose the
    plan's view makes, and through the gather of single elements, whenever each block's elements
    are evenly spaced in the input itself."""
    segs, final = plan.partial, plan.final
    order = segs.geometry.order
    # position in x of each position of the plan's view
    in_x = None if order is None else np.arange(math.prod(shape)).reshape(shape).transpose(order).reshape(-1)

    def first_stage(stage: StageBlocks) -> tuple[StageBlocks, tuple | None]:
        direct = None if in_x is None else read_through(stage, in_x)
        return (stage, order) if direct is None else (direct, None)

    if final is None:
        stage, reads = first_stage(stage_blocks(segs))
        return FastReduction((stage,), (op,), (scale,), False, np.dtype(partial_dtype), _slots(segs.seg_out), reads,
                             None)
    in_dtype, partial_dtype = np.dtype(in_dtype), np.dtype(partial_dtype)
    exact = (partial_dtype == np.float32 and in_dtype in (np.float16, np.float32, np.bool_)) or (
        partial_dtype == np.int32 and in_dtype in (np.int32, np.bool_) and op != SUM_SQUARES)
    if exact and (segs.template_counts == 1).all():  # the final stage reads the elements the partials would hold
        stage, elements = final_stage_blocks(final), segs.first_positions()[final.order]
        direct = read_through(stage, elements if in_x is None else in_x[elements])
        if direct is not None:
            return FastReduction((direct,), (op,), (scale,), op == SUM_SQUARES, partial_dtype, _slots(final.seg_out),
                                 None, None)
        return FastReduction((stage,), (op,), (scale,), op == SUM_SQUARES, partial_dtype, _slots(final.seg_out),
                             order, elements)
    stage, reads = first_stage(stage_blocks(segs))
    return FastReduction((stage, final_stage_blocks(final)), (op, FINAL_OP[op]), (1.0, scale), False,
                         partial_dtype, _slots(final.seg_out), reads, final.order)


_REDUCTIONS: dict = {}


@dataclass(eq=False)
class _FastOnFirstUse:
    """A reduction's `fast_reduction`, made when first asked for and kept (a priced model never
    asks); unlike a closure it pickles with the executable."""
    plan: ReducePlan
    op: int
    in_dtype: object
    partial_dtype: object
    scale: float
    shape: tuple
    made: "FastReduction | None" = None

    def __call__(self) -> "FastReduction":
        if self.made is None:
            self.made = fast_reduction(self.plan, self.op, self.in_dtype, self.partial_dtype, self.scale, self.shape)
        return self.made


def planned_reduction(g: Geometry, target: Target, op: int, in_dtype, partial_dtype, out_dtype, scale: float,
                      shape: tuple[int, ...]) -> tuple[ReducePlan, Callable[[], FastReduction]]:
    """`plan_reduction` of the reduction of a tensor of `shape` through its view `g`, and a function
    giving its `fast_reduction`, made on first use (a priced model never runs it). Both depend
    only on the structure (shapes, tile map, target, op, dtypes, scale), so the repeated layers of
    a model share them, as they share segment plans."""
    tiles = g.view.tile_map()
    key = (g.A, g.R, g.C, g.order, tuple(shape), target, op, np.dtype(in_dtype), np.dtype(partial_dtype),
           np.dtype(out_dtype), scale, structure(tiles))

    def make():
        plan = plan_reduction(g, target, op, in_dtype, partial_dtype, out_dtype, scale != 1.0, tiles)
        return plan, _FastOnFirstUse(plan, op, in_dtype, partial_dtype, scale, tuple(shape))
    plan, fast = remembered(_REDUCTIONS, key, make)
    return replace(plan, partial=plan.partial.of_geometry(g)), fast


# ---- reduce ----------------------------------------------------------------------------------
def add_segment_vertices(graph: Graph, cs, types: tuple[VertexType, VertexType], plan: SegmentPlan,
                         begin: np.ndarray, end: np.ndarray, elements: dict[str, Tensor], per_segment: dict,
                         params: np.ndarray) -> None:
    """Vertices over segments: vertex v on the tile of segments `begin[v] .. end[v] - 1` of
    `plan`. `elements`: fields connecting the segments' elements of tensors laid out like the
    plan's view ([A, R, C] flat); `per_segment`: fields connecting one element per segment, as
    (1-D tensor, its element for each segment of the plan). Vertices whose segments are the
    neighbouring outputs of one block with strided elements take them side by side (`types[1]`),
    the rest one segment after another (`types[0]`)."""
    side = side_by_side(plan, begin, end)
    for vertex_type, mask in zip(types, (~side, side)):
        v = np.flatnonzero(mask)
        if not v.size:
            continue
        starts, lengths, offsets = vertex_element_runs(plan, begin[v], end[v], vertex_type is types[1])
        fields = {f: Field.from_positions(t, starts, lengths, offsets) for f, t in elements.items()}
        seg_offsets = np.concatenate(([0], np.cumsum(end[v] - begin[v])))
        for f, (t, index) in per_segment.items():
            fields[f] = Field.from_positions(t, index[expand_runs(begin[v], end[v] - begin[v])], 1, seg_offsets)
        graph.addVertices(cs, vertex_type, plan.seg_tile[begin[v]], fields, params[v])


def _add_stage(graph: Graph, cs, plan: SegmentPlan, src: Tensor, dst: Tensor, index: np.ndarray, op: int,
               scale: float) -> None:
    """Reduce vertices: segment s of `plan` reads its elements of `src` (laid out like the plan's
    view) and writes dst[index[s]] (dst 1-D)."""
    tiles, begin, end = plan_vertex_groups(plan, graph.target.workers_per_tile)
    if not tiles.size:
        return
    params = np.stack(np.broadcast_arrays(op, plan.counts_at(begin), scale, float(src.dtype != dst.dtype)), 1)
    add_segment_vertices(graph, cs, (REDUCE_VERTEX, REDUCE_VERTEX_SIDE_BY_SIDE), plan, begin, end, {"x": src},
                         {"out": (dst, index)}, params.astype(np.float64))


def _add_final_stage(graph: Graph, cs, final: FinalStage, gathered: Tensor, out: Tensor, op: int, scale: float) -> None:
    """Reduce vertices of the final stage: output segment s reads its partials from `gathered`
    and writes out.flat[seg_out[s]]. A vertex whose outputs lie in one interval reads their
    partials side by side (one run per partial of an output), others output by output."""
    tiles, begin, end = vertex_groups(final.seg_tile, final.counts, graph.target.workers_per_tile)
    if not tiles.size:
        return
    params = np.stack(np.broadcast_arrays(op, final.counts[begin], scale, float(gathered.dtype != out.dtype)), 1)
    side = final.seg_interval[begin] == final.seg_interval[end - 1]
    for vertex_type, mask in ((REDUCE_VERTEX, ~side), (REDUCE_VERTEX_SIDE_BY_SIDE, side)):
        v = np.flatnonzero(mask)
        if not v.size:
            continue
        k = end[v] - begin[v]
        first, count, step = final.positions(begin[v])
        if vertex_type is REDUCE_VERTEX_SIDE_BY_SIDE:  # row q: the q-th partial of each output
            owner = np.repeat(np.arange(v.size), count)
            q = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
            starts, lengths = np.repeat(first, count) + q * np.repeat(step, count), k[owner]
        else:  # output after output, each partial a run of one
            segments = expand_runs(begin[v], k)
            f, c, st_ = final.positions(segments)
            owner = np.repeat(np.repeat(np.arange(v.size), k), c)
            j = np.arange(c.sum()) - np.repeat(np.cumsum(c) - c, c)
            starts, lengths = np.repeat(f, c) + j * np.repeat(st_, c), np.ones(c.sum(), np.int64)
        offsets = np.concatenate(([0], np.cumsum(np.bincount(owner, minlength=v.size))))
        fields = {"x": Field.from_positions(gathered, starts, lengths, offsets),
                  "out": Field.from_positions(out.flatten(), final.seg_out[expand_runs(begin[v], k)], 1,
                                              np.concatenate(([0], np.cumsum(k))))}
        graph.addVertices(cs, vertex_type, tiles[v], fields, params[v].astype(np.float64))


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
    out_shape, keep_shape = output_shapes(x.shape, axes)
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
        out.var.mapping = TileMap.from_tiles(linear_tiles(num_out, graph.target.num_tiles))
        const = graph.addConstant(out_dt, out_shape, fill, f"{name}/fill")
        const.var.mapping = out.var.mapping
        body.add(Copy(const, out))
        prog.add(OpProgram(name, body, lambda io: io.write(out, np.full(out_shape, fill, out_dt)), (x,), (out,)))
        return result

    g = geometry(x, axes)
    plan, fast_plan = planned_reduction(g, graph.target, code, in_dt, part_dt, out_dt, final_scale, x.shape)
    out.var.mapping = TileMap.from_tiles(plan.out_tiles)
    segs, final = plan.partial, plan.final
    of = out.flatten()
    cs = graph.addComputeSet(f"{name}/partials" if final is not None else name)
    if final is None:
        _add_stage(graph, cs, segs, g.view, of, segs.seg_out, code, final_scale)
        body.add(Execute(cs))
    else:
        partials = graph.addVariable(part_dt, (segs.num_segments,), f"{name}/partials", category="temporaries",
                                     always_live=False)
        partials.var.mapping = TileMap.from_tiles(segs.seg_tile)
        _add_stage(graph, cs, segs, g.view, partials, np.arange(segs.num_segments), code, 1.0)
        body.add(Execute(cs))
        gathered = placed(graph, body, flat(partials, final.order, distinct=True),
                          TileMap.from_lengths(final.counts, final.seg_tile),
                          f"{name}/gathered")
        cs2 = graph.addComputeSet(f"{name}/final")
        _add_final_stage(graph, cs2, final, gathered, out, FINAL_OP[code], final_scale)
        body.add(Execute(cs2))

    def fast(io):
        io.write(out, stored(fast_plan().run(io.read(x)), out_dt).reshape(out_shape))

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
# The operands each op reads besides a (nll_grad does not read a).
READS = {0: "r", 1: "r", 2: "rq", 3: "br", 4: "br", 5: "r", 6: "rq", 7: "bcrq", 8: "brq", 9: "rqs",
         10: "brqs", 11: "b", 12: "r", 13: "rq", 14: "rq"}

INV_LN2 = 1.4426950408889634
LN2_HI = 6.93147180369123816490e-01  # ln 2 to 32 bits: k * LN2_HI is exact
LN2_LO = 1.90821492927058770002e-10  # ln 2 - LN2_HI


@intrinsic
def bits_to_float(typingctx, bits):
    """The float64 whose IEEE bits are the int64 `bits`."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@njit(fastmath={"contract"}, **ERR, **JIT)
def exp64(x):
    """e**x in float64 within 2 ulp, without branches so that loops over it vectorise: x = k ln 2 + r
    with |r| <= ln 2 / 2 (Cody-Waite), e**r by its degree-13 Taylor polynomial (Estrin's scheme,
    multiply-adds fused where the CPU has them: the same in both modes, which compile this one
    function), times 2**k in two steps (so results near overflow and subnormal ones are right).
    NaN gives NaN (the select at the end discards whatever a NaN made of k)."""
    y = min(max(x, -746.0), 710.0)
    k = np.floor(y * INV_LN2 + 0.5)
    r = (y - k * LN2_HI) - k * LN2_LO
    r2 = r * r
    r4 = r2 * r2
    p = (((1.0 + r) + r2 * (1.0 / 2 + r * (1.0 / 6)))
         + r4 * ((1.0 / 24 + r * (1.0 / 120)) + r2 * (1.0 / 720 + r * (1.0 / 5040))))
    p += (r4 * r4) * (((1.0 / 40320 + r * (1.0 / 362880)) + r2 * (1.0 / 3628800 + r * (1.0 / 39916800)))
                      + r4 * (1.0 / 479001600 + r * (1.0 / 6227020800)))
    ki = np.int64(k)
    half = ki >> 1
    res = p * bits_to_float((half + 1023) << 52) * bits_to_float((ki - half + 1023) << 52)
    return res if x == x else x


@njit(**ERR, **JIT)
def segment_value(op, a, b, c, r, q, s, col, p):
    if op == 0:
        return exp64(a - r)
    if op == 1:
        return a / r
    if op == 2:
        return a - r - math.log(q)
    if op == 3:
        return a * (b - r)
    if op == 4:
        return b - exp64(a) * r
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
    return (exp64(a) - (1.0 if col == r else 0.0)) * q


@njit(parallel=True, **ERR, **JIT)
def segment_map_codelet(a, a_addr, a_start, b, b_addr, b_start, c, c_addr, c_start, r, r_addr, r_start,
                        q, q_addr, q_start, s, s_addr, s_start, out, o_addr, o_start, params, side_by_side):
    """params: op, n (elements per segment), p. For column ops, s holds the segment's first column.
    The vertex's segments lie one after another, or side by side (template, as `reduce_codelet`)."""
    for v in prange(params.shape[0]):
        op = int(params[v, 0])
        n = int(params[v, 1])
        p = params[v, 2]
        segments = r_start[v + 1] - r_start[v]
        for k in range(segments):
            rv = np.float64(ld(r, r_addr[r_start[v] + k]))
            qv = np.float64(ld(q, q_addr[q_start[v] + k]))
            sv = np.float64(ld(s, s_addr[s_start[v] + k]))
            for i in range(n):
                e = i * segments + k if side_by_side else k * n + i
                av = np.float64(ld(a, a_addr[a_start[v] + e]))
                bv = np.float64(ld(b, b_addr[b_start[v] + e]))
                cv = np.float64(ld(c, c_addr[c_start[v] + e]))
                st(out, o_addr[o_start[v] + e], segment_value(op, av, bv, cv, rv, qv, sv, sv + i, p))


def _row_kernel(op: int):
    """The fast kernel of one segment op (compiled on first use, for that op only, so that
    `segment_value` folds to the op's formula and the inner loop vectorises): out[k * length + j]
    for run k and j < length (see RowLayout), b and c read from their own run starts."""
    @njit(parallel=True, **ERR, **JIT)
    def rows_kernel(a, b, b_rows, c, c_rows, r, q, s, stat_row, stat_step, col_row, col_step, p, length, out):
        for k in prange(stat_row.size):
            base, t, bk, ck, col = k * length, stat_row[k], b_rows[k], c_rows[k], col_row[k]
            if stat_step == 0:
                rv, qv, sv = r[t], q[t], s[t]
                for j in range(length):
                    i = np.uint64(base + j)
                    out[i] = segment_value(op, np.float64(a[i]), np.float64(b[np.uint64(bk + j)]),
                                           np.float64(c[np.uint64(ck + j)]), rv, qv, sv, col + j * col_step, p)
            else:
                for j in range(length):
                    i, u = np.uint64(base + j), np.uint64(t + j)
                    out[i] = segment_value(op, np.float64(a[i]), np.float64(b[np.uint64(bk + j)]),
                                           np.float64(c[np.uint64(ck + j)]), r[u], q[u], s[u], col + j * col_step, p)
    return rows_kernel


ROW_KERNELS = {code: _row_kernel(code) for code, *_ in SEGMENT_OPS.values()}


SEGMENT_COSTS = {code: (setup, per, vec) for code, setup, per, vec in SEGMENT_OPS.values()}


def segment_map_instructions(k, n, width: int, op):
    """Thread instructions of a segment map vertex with k segments of n elements (module docstring);
    ints, or arrays (one per vertex)."""
    setup, per_vector, vectorised = (lookup({code: c[i] for code, c in SEGMENT_COSTS.items()}, op) for i in range(3))
    w = np.where(vectorised, width, 1)
    return 17 + k * setup + k * np.ceil(n / w) * per_vector


def _segment_map_cycles(sizes, params, dtype, target):
    return target.thread_cycles(segment_map_instructions(sizes["r"], params[:, 1].astype(np.int64),
                                                         vector_width(dtype), params[:, 0].astype(np.int64)))


SEGMENT_MAP_VERTEX = VertexType("popops::SegmentMap", ("a", "b", "c", "r", "q", "s"), ("out",),
                                segment_map_codelet, _segment_map_cycles, num_params=3, template=(False,))
SEGMENT_MAP_VERTEX_SIDE_BY_SIDE = VertexType("popops::SegmentMap<side_by_side>", ("a", "b", "c", "r", "q", "s"),
                                             ("out",), segment_map_codelet, _segment_map_cycles, num_params=3,
                                             template=(True,))


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


# ---- segment maps in the fast mode ---------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RowLayout:
    """A tensor as `rows` runs of `length` consecutive elements (the innermost dims of one kind,
    reduced or kept) for the fast segment-map kernels. Run k's first element belongs to output
    `stat_row[k]`; along a run the output stays the same (`stat_step` 0: the run lies in reduced
    dims) or advances by one (1: in kept dims). The element's index along the single axis of a
    column op starts at `col_row[k]` and advances by `col_step`."""
    rows: int
    length: int
    stat_row: np.ndarray
    stat_step: int
    col_row: np.ndarray
    col_step: int


def row_layout(shape: tuple, axes: tuple, column: bool) -> RowLayout:
    """The runs of a segment map over `axes` (built once, with the graph)."""
    numel = int(np.prod(shape, dtype=np.int64))
    length, reduced = 1, None
    for d in reversed(range(len(shape))):
        if shape[d] == 1:
            continue
        if reduced is None:
            reduced = d in axes
        elif (d in axes) != reduced:
            break
        length *= shape[d]
    rows = numel // length
    starts = np.arange(rows, dtype=np.int64) * length
    col_row, col_step = np.zeros(rows), 0
    if column:
        size = shape[axes[0]]
        stride = int(np.prod(shape[axes[0] + 1:], dtype=np.int64))
        col_row = ((starts // stride) % size).astype(np.float64)
        col_step = int(stride == 1 and size > 1)
    return RowLayout(rows, length, output_of(shape, axes, starts), int(reduced is False), col_row, col_step)


def operand_rows(t: Tensor, shape: tuple, layout: RowLayout) -> np.ndarray | None:
    """Where each run starts in the flat values of `t` when `t` broadcast to `shape` reads every
    run contiguously from them; None when it does not (the operand is then broadcast in full)."""
    if tuple(t.shape) == tuple(shape):
        return np.arange(layout.rows, dtype=np.int64) * layout.length
    index = np.broadcast_to(np.arange(t.numel, dtype=np.int64).reshape(t.shape), shape)
    index = index.reshape(layout.rows, layout.length)
    if layout.length > 1 and not (np.diff(index, axis=1) == 1).all():
        return None
    return np.ascontiguousarray(index[:, 0])


def kernel_values(values: np.ndarray) -> np.ndarray:
    """Flat values as a fast kernel reads them: float32 as they are, float16 widened to float32,
    integers and bools as float64 (all exact)."""
    flat = values.reshape(-1)
    if flat.dtype == np.float32:
        return flat
    return flat.astype(np.float32 if flat.dtype == np.float16 else np.float64)


def output_storage(io, t: Tensor) -> np.ndarray | None:
    """The fast layout's storage of a whole float32 variable, to write in place; None when `io`
    gives a copy."""
    if t.dtype != np.float32:
        return None
    view = io.output(t)
    return view.reshape(-1) if view is not None and view.flags.c_contiguous else None


def _fast_segment_map(code: int, a: Tensor, given: dict, stats: dict, out: Tensor, axes: tuple, param: float):
    """The fast mode of a segment map: the op's row kernel over the runs of `a` (RowLayout),
    reading only the operands the op uses: b and c from their own values (broadcast in full
    only when their runs are not contiguous), statistics as one float64 value per output."""
    shape, kernel = a.shape, ROW_KERNELS[code]
    if out.numel == 0:
        return lambda io: None
    layout = row_layout(shape, axes, code >= USES_COLUMN)
    a_rows = np.arange(layout.rows, dtype=np.int64) * layout.length
    operands = {}
    for key in "bc":
        t = given[key]
        if key in READS[code] and t is not None:
            operands[key] = (t, operand_rows(t, shape, layout))
    stat_keys = [key for key in "rqs" if key in READS[code]]
    stat_row, stat_step = (layout.stat_row, layout.stat_step) if stat_keys else (np.zeros(layout.rows, np.int64), 0)
    temp_dtype = np.float32 if out.dtype.kind == "f" else np.float64  # stored as `st` rounds: float16 via float32

    def fast(io):
        av = kernel_values(io.read(a))
        args = []
        for key in "bc":
            if key not in operands:
                args += [av, a_rows]
                continue
            t, rows = operands[key]
            if rows is None:
                args += [kernel_values(np.ascontiguousarray(np.broadcast_to(io.read(t), shape))), a_rows]
            else:
                args += [kernel_values(io.read(t)), rows]
        values = {}
        for key in stat_keys:
            if id(stats[key]) not in values:
                values[id(stats[key])] = io.read(stats[key]).reshape(-1).astype(np.float64)
        unused = next(iter(values.values()), np.zeros(1))  # a valid array for the fields the op ignores
        r, q, s = (values[id(stats[key])] if key in stat_keys else unused for key in "rqs")
        target = output_storage(io, out)
        res = target if target is not None else np.empty(out.numel, dtype=temp_dtype)
        kernel(av, *args, r, q, s, stat_row, stat_step, layout.col_row, layout.col_step, param, layout.length, res)
        if target is None:
            io.write(out, res.reshape(shape))

    return fast


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
    stats_shape, _ = output_shapes(shape, axes)
    column = code >= USES_COLUMN
    if column and len(axes) != 1:
        raise ValueError(f"{name}: op {op!r} indexes along one axis, got axes {axes}")
    given = {"b": b, "c": c}
    b = a if b is None else (b if b.shape == shape else b.broadcast(shape))
    c = a if c is None else (c if c.shape == shape else c.broadcast(shape))
    r = a if r is None else _per_output(r, stats_shape, name)
    q = r if q is None else _per_output(q, stats_shape, name)
    s = r if s is None else _per_output(s, stats_shape, name)
    out_dt = as_dtype(out_dtype) if out_dtype is not None else a.dtype
    out = graph.addVariable(out_dt, shape, name, category=category, always_live=False)
    out.var.mapping = a.tile_map()
    body = Sequence(name=name)
    if out.numel:
        tiles = out.tile_map()
        view = lambda t: geometry(t, axes).view  # noqa: E731  (laid out like the plan's view)
        g = geometry(out, axes)
        n_tiles = graph.target.num_tiles
        plan = plan_segments(g, workers=graph.target.workers_per_tile, split_parts=column, num_tiles=n_tiles)
        # statistics are copied once per (tile, output); the pieces of one such group share the copy
        groups = plan_segments(g, num_tiles=n_tiles)
        key = groups.seg_tile * g.num_out + groups.seg_out
        parent = np.searchsorted(key, plan.seg_tile * g.num_out + plan.seg_out)
        bl = placed(graph, body, b, tiles, f"{name}/b")
        cl = placed(graph, body, c, tiles, f"{name}/c") if c is not b else bl
        per_segment = {}  # field -> (1-D tensor, element of the tensor for each segment)
        for key_, t in (("r", r), ("q", q), ("s", s)):
            if column and key_ == "s":  # the first index along the axis of every segment
                first_col = plan.part_r0[plan.part_first[plan.seg_template]]
                const = graph.addConstant(np.float32, (plan.num_segments,), first_col, f"{name}/columns")
                const.var.mapping = TileMap.from_tiles(plan.seg_tile)
                per_segment[key_] = (const, np.arange(plan.num_segments))
            elif key_ != "r" and t is r:
                per_segment[key_] = per_segment["r"]
            elif t is a:  # ops without statistics: each segment's first element fills the field
                per_segment[key_] = (view(a), plan.first_positions())
            else:
                copies = placed(graph, body, flat(t, groups.seg_out), TileMap.from_tiles(groups.seg_tile),
                                f"{name}/{key_}")
                per_segment[key_] = (copies, parent)
        cs = graph.addComputeSet(name)
        _, lo, hi = plan_vertex_groups(plan, graph.target.workers_per_tile)
        params = np.stack(np.broadcast_arrays(code, plan.counts_at(lo), float(param)), 1).astype(np.float64)
        elements = {"a": view(a), "b": view(bl), "c": view(cl), "out": view(out)}
        add_segment_vertices(graph, cs, (SEGMENT_MAP_VERTEX, SEGMENT_MAP_VERTEX_SIDE_BY_SIDE), plan, lo, hi,
                             elements, per_segment, params)
        body.add(Execute(cs))

    fast = _fast_segment_map(code, a, given, {"r": r, "q": q, "s": s}, out, axes, float(param))
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
