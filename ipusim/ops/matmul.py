"""Matrix multiplication (2-D and batched 3-D), plus the tile-grid planning, operand gathering and
partials reduction that the convolution and pooling ops reuse.

Plan (`plan_matmul`, a pure function of shapes and dtypes). The output C[B, M, N] and the
reduction dimension K form a 4-D grid; a plan splits (B, M, N, K) into (pb, pm, pn, pk) equal
blocks, one block per tile, the blocks spread evenly over the IPU's tiles. A tile receives by
exchange its A block [bb, bm, bk] and B block [bb, bk, bn] and computes their product over its K
slice. With pk = 1 that is its piece of C, which lives on that tile. With pk > 1 (the K-split)
each tile writes partials; a second exchange brings, for every output element, its pk
partials to the tile that owns the element (C is then spread linearly over all tiles) and a
reduce compute set sums them and rounds once to the output dtype.

Partials are float32 unless the caller asks for float16 ones (PopLibs' `partialsType` "half",
which PopTorch's `Precision.setPartialsType(torch.half)` sets) and the operands are float16: a
float32 product keeps float32 partials, as PopLibs does. Half partials halve the bytes the
K-split writes, exchanges and holds, and the reduction reads 4 of them per 64-bit vector instead
of 2; each is the block's sum over its K slice rounded to float16.

Candidate splits of a dimension of size d: the smallest part counts giving the block sizes of
1, 2, 3, 4, 6, 8, 12, ... parts (powers of two and 1.5 times powers of two) and of min(d, tiles)
parts, in every combination that needs at most the IPU's tiles. Cost of a candidate, on the
busiest tile:
  compute  = cycles of the block's supervisor vertex + vertex overhead
  exchange = ceil(max(bytes received, bytes sent) / exchange bytes per cycle); received = the
             operand blocks, sent = received * tiles used / tiles (operands assumed spread over
             the IPU, every element sent to each tile that needs it)
  plus one sync per exchange and per compute set; with pk > 1 the partials exchange and the
  reduction are costed the same way.
Working set of the busiest tile = operand blocks + partials block, and during the reduction the
partials block + gathered partials + output piece; it must stay within
`available_memory_proportion` of the tile memory (PopLibs' option of that name, default 0.6).
The cheapest candidate that fits wins (ties: fewer tiles, then a smaller K-split); if none fits,
the one with the smallest working set (the engine then reports the out-of-memory tiles).

A tile's block is one supervisor vertex: the AMP partials vertex of PopLibs (ConvPartial1x1Out),
whose batch entries are its convolution groups and whose output rows it shares among the tile's
workers.

Cycle estimators (thread cycles = instructions x workers per tile):
  partial products, a supervisor vertex of g groups, each an m x n block of outputs over k, in
  AMP passes of A input by A output channels (A = 16 for float16, 8 for float32): I = ceil(k / A)
  input groups, O = ceil(n / A) output groups, each worker taking r = ceil(m / workers) rows:
      tile cycles = 50 + 7 workers + g * (24 + 15 (I - 1) + I * O * pass)
      pass        = 25 + weight loads + workers * (19 + c * max(r, 3))
    which is the structure of PopLibs' estimator of that vertex (poplin PerformanceEstimation.hpp,
    getConvPartial1x1SupervisorCycleEstimate, half-precision path): 50 cycles of supervisor code
    outside the loops and 7 per worker context to set up the state the workers keep between
    passes; per group and per further input group the supervisor's loop costs; per pass the
    loop cost, the weight loads (A x A weights at 16 bytes per cycle) and the slowest worker, whose
    loop costs a fixed 19 plus c per row, with at least 3 rows' worth (the worklist holds rows - 3:
    the AMP pipeline is three rows deep). c = 2 A^2 / (FLOPs per cycle per tile): the AMP's peak,
    4 for float16 on every target with 128 FLOPs per cycle. These constants are PopLibs', not
    fitted; against tessellate-ipu's per-tile measurement on Bow (fp16 [N,16] @ [16,16], N = 16 to
    2048, benchmarks/calibration.py) they are within 2.1% (ipusim.device.model_error). The float32
    path has no published per-tile measurement here: it uses the same structure at the float32 peak.
  reduce of r partials into n outputs, a worker vertex:
      thread_cycles(17 + ceil(n / v) * (r + 3)),  v = 2 float32 or 4 float16 partials
    like PopLibs' reduce estimator (popops CycleEstimationFunctions.cpp): one load-and-add per
    partial and 64-bit vector, 3 more per vector to convert and store, 17 non-loop.

Numerics: strict vertices accumulate in float64 and round once to the partials or output dtype;
the fast mode calls BLAS on whole arrays (float16 operands in float32, rounded once), and with
float16 partials on each K slice in float64, rounding every slice's sum to float16 as the tiles do.

Serialised matmul (`serialized_matmul`, PopART's serializeMatMuls): the product runs as `factor`
smaller products one after the other, split along the rows of the result ("input_channels"),
the reduced dimension ("reducing_dim") or the columns ("output_channels"). Each piece is a plain
matmul with its own plan; its gathered operand blocks and partials are live only while it runs,
so the op's peak temporary memory is one piece's instead of the whole product's, and its cycles
are the pieces' one after the other. Row and column pieces are copied into the result; each is
planned with the whole product's K-split, so every element is the same sum in the same parts as
in the plain product (bit-identical in both modes); reducing-dimension pieces are added up
one by one in the pieces' dtype (float32 partials with `keep_precision` for float16, else the
result's dtype), which changes the summation order: within float32 rounding of the sum of
`factor` partial products, or float16 rounding per addition without `keep_precision`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..device import blas
from ..device.graph import Graph
from ..device.kernels import JIT, ld, st
from ..device.program import Copy, Execute, OpProgram, Sequence
from ..device.target import Target
from ..device.mapping import TileMap
from ..device.tensor import Tensor
from ..device.vertex import Field, VertexType
from . import elementwise as ew
from .common import GRAIN, box_runs, gather_boxes, map_boxes, new_output, placed, region_work

PARTIALS = np.dtype(np.float32)
"""The default partials type (PopLibs' matmul and convolution option `partialsType`, "float")."""
AVAILABLE_MEMORY_PROPORTION = 0.6
FLOAT_DTYPES = ("float16", "float32")


def ceil_div(a, b):
    """Ceiling division for ints and integer arrays."""
    return -(-a // b)


def amp_channels(dtype) -> int:
    """Channels the AMP unit processes per pass (input and output): 16 for float16, 8 for float32."""
    return 16 if np.dtype(dtype) == np.float16 else 8


def _flop_cycles(flops, dtype, target: Target):
    """target.flop_cycles for ints or integer arrays."""
    return ceil_div(flops * target.workers_per_tile, target.flops_per_cycle(np.dtype(dtype).name))


# ---- cycle estimators ------------------------------------------------------------------------
# The AMP partials vertex (see the module doc; PopLibs' ConvPartial1x1Out estimator, half path).
AMP_SUPERVISOR_CYCLES = 50          # supervisor code outside the loops
AMP_RETENTION_CYCLES = 7            # per worker context: state the workers keep between passes
AMP_GROUP_CYCLES = 24               # per group: the group loop and the first input group's setup
AMP_INPUT_GROUP_CYCLES = 15         # per further input-channel group
AMP_PASS_CYCLES = 25                # per pass: output-group loop and worker launch
AMP_WORKER_CYCLES = 19              # per pass, the worker's loop outside its rows (thread cycles)
AMP_PIPELINE_ROWS = 3               # the AMP pipeline's depth: a worker pays for at least this many rows
AMP_WEIGHT_LOAD_BYTES_PER_CYCLE = 16  # weights load 128 bits per cycle


def amp_row_cycles(dtype, target: Target) -> int:
    """Thread cycles a worker spends per output row and pass: one A x A pass at the AMP's peak."""
    a = amp_channels(dtype)
    return ceil_div(2 * a * a, target.flops_per_cycle(np.dtype(dtype).name))


def amp_partial_cycles(groups, m, n, k, dtype, target: Target):
    """Tile cycles of one AMP partials supervisor vertex: `groups` products of m x n outputs over
    k (see the module doc); ints or integer arrays."""
    a = amp_channels(dtype)
    workers = target.workers_per_tile
    in_groups, out_groups = ceil_div(k, a), ceil_div(n, a)
    rows = np.maximum(ceil_div(m, workers), AMP_PIPELINE_ROWS)
    worker = AMP_WORKER_CYCLES + amp_row_cycles(dtype, target) * rows
    loads = ceil_div(a * a * np.dtype(dtype).itemsize, AMP_WEIGHT_LOAD_BYTES_PER_CYCLE)
    one_pass = AMP_PASS_CYCLES + loads + workers * worker
    return (AMP_SUPERVISOR_CYCLES + workers * AMP_RETENTION_CYCLES
            + groups * (AMP_GROUP_CYCLES + AMP_INPUT_GROUP_CYCLES * (in_groups - 1)
                        + in_groups * out_groups * one_pass))


def reduce_cycles(n, r, target: Target, partials=PARTIALS):
    """Cycles of one worker summing r partials into n outputs (see module doc): a 64-bit vector
    holds 2 float32 or 4 float16 partials."""
    return target.workers_per_tile * (17 + ceil_div(n, 8 // np.dtype(partials).itemsize) * (r + 3))


# ---- codelets --------------------------------------------------------------------------------
@njit(parallel=True, **JIT)
def matmul_codelet(a, a_addr, a_start, b, b_addr, b_start, out, o_addr, o_start, params, a_cols, b_cols):
    """out[e, m, n] = a[e, m, k] @ b[e, k, n] for every group e, the output row-major; params
    (groups, m, n, k). Templates: each operand block is held row-major, or column-major (its
    transpose row-major) when `a_cols` / `b_cols`."""
    for v in prange(params.shape[0]):
        g, m, n, k = int(params[v, 0]), int(params[v, 1]), int(params[v, 2]), int(params[v, 3])
        ai, al = (1, m) if a_cols else (k, 1)  # steps of a's row and column index
        bl, bj = (1, k) if b_cols else (n, 1)
        for e in range(g):
            ba, bb, bo = a_start[v] + e * m * k, b_start[v] + e * k * n, o_start[v] + e * m * n
            for i in range(m):
                for j in range(n):
                    acc = 0.0
                    for l in range(k):
                        acc += ld(a, a_addr[ba + i * ai + l * al]) * ld(b, b_addr[bb + l * bl + j * bj])
                    st(out, o_addr[bo + i * n + j], acc)


@njit(parallel=True, **JIT)
def reduce_codelet(p, p_addr, p_start, out, o_addr, o_start, params):
    """out[i] = sum over r of partials[r, i] (partials row-major [r, n]); params (r,)."""
    for v in prange(params.shape[0]):
        r = int(params[v, 0])
        bp, bo = p_start[v], o_start[v]
        n = o_start[v + 1] - bo
        for i in range(n):
            acc = 0.0
            for j in range(r):
                acc += ld(p, p_addr[bp + j * n + i])
            st(out, o_addr[bo + i], acc)


def _matmul_vertex_cycles(sizes, params, dtype, target):
    g, m, n, k = params.T.astype(np.int64)
    return amp_partial_cycles(g, m, n, k, dtype, target)


def _reduce_vertex_cycles(sizes, params, dtype, target):
    return reduce_cycles(sizes["out"], params[:, 0].astype(np.int64), target, dtype)


def _matmul_vertex(a_cols: bool, b_cols: bool) -> VertexType:
    layouts = [f"{x}=columns" for x, cols in (("a", a_cols), ("b", b_cols)) if cols]
    return VertexType("poplin::MatMulPartial" + (f"<{','.join(layouts)}>" if layouts else ""), ("a", "b"), ("out",),
                      matmul_codelet, _matmul_vertex_cycles, num_params=4, supervisor=True,
                      template=(bool(a_cols), bool(b_cols)))


# The AMP partials vertex by operand layout: an operand gathered column-major (the transpose of a
# row-major view, as a linear layer's weight is read) is its own instantiation, as in Poplar.
MATMUL_VERTEX = _matmul_vertex(False, False)
MATMUL_VERTEX_A_COLUMNS = _matmul_vertex(True, False)
MATMUL_VERTEX_B_COLUMNS = _matmul_vertex(False, True)
MATMUL_VERTEX_COLUMNS = _matmul_vertex(True, True)
MATMUL_VERTICES = {(False, False): MATMUL_VERTEX, (True, False): MATMUL_VERTEX_A_COLUMNS,
                   (False, True): MATMUL_VERTEX_B_COLUMNS, (True, True): MATMUL_VERTEX_COLUMNS}
REDUCE_VERTEX = VertexType("popops::ReducePartials", ("partials",), ("out",), reduce_codelet,
                           _reduce_vertex_cycles, num_params=1)


# ---- tile-grid planning helpers ----------------------------------------------------------------
def split_candidates(size: int, limit: int) -> np.ndarray:
    """Part counts worth trying for a dimension of `size` on at most `limit` tiles: the smallest
    count giving each block size reached with 1, 2, 3, 4, 6, 8, 12, ... or min(size, limit) parts."""
    top = min(size, limit)
    raw = {1, top}
    p = 1
    while p <= top:
        raw.add(p)
        if 3 * p // 2 <= top:
            raw.add(3 * p // 2)
        p *= 2
    return np.unique([ceil_div(size, ceil_div(size, q)) for q in raw]).astype(np.int64)


def split_grid(sizes, num_tiles: int) -> np.ndarray:
    """All combinations of candidate splits, one row per combination, using at most num_tiles blocks."""
    combos = np.ones((1, 0), dtype=np.int64)
    used = np.ones(1, dtype=np.int64)
    for size in sizes:
        cands = split_candidates(int(size), num_tiles)
        rows, cols = np.nonzero(used[:, None] * cands[None, :] <= num_tiles)
        combos = np.concatenate([combos[rows], cands[cols, None]], axis=1)
        used = used[rows] * cands[cols]
    return combos


def choose_split(cycles: np.ndarray, memory: np.ndarray, budget: float, tiebreak: np.ndarray) -> int:
    """Index of the cheapest candidate whose working set fits `budget` (ties: smaller `tiebreak`
    values, compared column by column); the smallest working set when none fits."""
    keys = [tiebreak[:, i] for i in reversed(range(tiebreak.shape[1]))]
    fits = np.flatnonzero(memory <= budget)
    if fits.size:
        order = np.lexsort([k[fits] for k in keys] + [cycles[fits]])
        return int(fits[order[0]])
    return int(np.lexsort(keys + [cycles, memory])[0])


def ranges(size: int, parts: int) -> list[tuple[int, int]]:
    """[begin, end) of the blocks when `size` is split into `parts` blocks of ceil(size / parts)."""
    block = ceil_div(size, parts)
    return [(b, min(b + block, size)) for b in range(0, size, block)]


def block_grid(sizes, splits) -> tuple[np.ndarray, np.ndarray]:
    """The blocks of splitting each dimension d of `sizes` into `splits[d]` blocks as `ranges`
    does, every combination, the last dimension fastest: (first, extent), each [blocks, dims]."""
    axes = [np.asarray(ranges(size, parts), np.int64).reshape(-1, 2) for size, parts in zip(sizes, splits)]
    grid = np.stack(np.meshgrid(*[np.arange(len(a)) for a in axes], indexing="ij"), -1).reshape(-1, len(axes))
    bounds = np.stack([a[grid[:, d]] for d, a in enumerate(axes)], axis=1)  # block, dim, (begin, end)
    return bounds[:, :, 0], bounds[:, :, 1] - bounds[:, :, 0]


def block_tiles(count: int, num_tiles: int) -> np.ndarray:
    """Tiles for `count` blocks, spread evenly over the IPU."""
    return (np.arange(count, dtype=np.int64) * num_tiles) // max(count, 1)


def linear_tile_elements(numel: int, num_tiles: int) -> int:
    """Elements on the busiest tile of a tensor mapped by `new_output` (linear, grain 4, >= 64)."""
    per = max(ceil_div(ceil_div(numel, GRAIN), num_tiles), ceil_div(64, GRAIN)) * GRAIN
    return min(numel, per)


def partials_variable(graph: Graph, sizes: list[int], tiles, name: str, dtype=PARTIALS) -> tuple[Tensor, np.ndarray]:
    """A temporary of `dtype` (float32 partials by default) holding consecutive partial blocks,
    block i on tiles[i]; returns it and the block offsets."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    part = graph.addVariable(np.dtype(dtype), (int(offsets[-1]),), name, category="temporaries", always_live=False)
    part.var.mapping = TileMap.from_lengths(sizes, tiles)
    return part, offsets


def reduce_partials(graph: Graph, body: Sequence, partials: Tensor, parts: int, split: np.ndarray,
                    out_starts: np.ndarray, part_starts: np.ndarray, lengths: np.ndarray, out: Tensor,
                    name: str) -> None:
    """out.flat[i] = the sum of the `parts` partials of element i, rounded once to out's dtype.

    The partials come as runs: run q holds `lengths[q]` partials of split `split[q]` (0 .. parts-1)
    at `partials.flat[part_starts[q]:...]`, for out elements `out_starts[q]:...`; every split
    covers every element once. `out` is a whole, mapped variable; the partials of each output
    element are brought to its tile by one exchange ([parts, out.numel], row r the r-th partials
    in element order), then each tile's elements are reduced by about one vertex per worker.
    """
    order = np.lexsort((out_starts, split))  # split after split, each in element order
    source = Tensor.of_runs(partials.var, part_starts[order], lengths[order], (parts, out.numel), distinct=True)
    gathered = placed(graph, body, source, TileMap.concat([out.tile_map()] * parts), f"{name}/gathered_partials")
    cs = graph.addComputeSet(f"{name}/reduce")
    work = region_work(out.tile_map(), graph.target.workers_per_tile, grain=GRAIN)
    graph.addVertices(cs, REDUCE_VERTEX, work.tiles, {"partials": work.rows(gathered), "out": work.field(out)},
                      np.array([parts], np.float64))
    body.add(Execute(cs))


def block_partials(out: Tensor, first: np.ndarray, extent: np.ndarray, parts: int, part_at: np.ndarray):
    """The runs `reduce_partials` takes when block i of a tile grid (`first[i]`, `extent[i]` per
    dimension of the view `out` of the result) wrote its partials, row-major, at `part_at[i]` of
    the partials, and blocks cycle through the `parts` splits of the reduction (block i: i % parts)."""
    starts, lengths, box = box_runs(first, extent, out.shape)
    k, element, length = out.runs_at(starts, lengths)  # the result's elements, run by run
    row_first = np.cumsum(lengths) - lengths
    box_first = row_first[np.searchsorted(box, np.arange(len(first)))]  # first position of each box
    within = (np.cumsum(length) - length) - box_first[box[k]]  # each piece's offset in its box
    part = part_at[box[k]] + within
    return box[k] % parts, element, part, length


def float_dtype(t: Tensor, what: str) -> np.dtype:
    if t.dtype.name not in FLOAT_DTYPES:
        raise TypeError(f"{what}: tensor {t.name!r} is {t.dtype.name}; this op takes float16 or float32 "
                        "(cast it first)")
    return t.dtype


def output_dtype(out_dtype, default: np.dtype, what: str) -> np.dtype:
    dt = np.dtype(out_dtype) if out_dtype is not None else default
    if dt.name not in FLOAT_DTYPES:
        raise TypeError(f"{what}: out_dtype {dt.name} is not supported; use float16 or float32")
    return dt


def check_proportion(p: float, what: str) -> None:
    if not 0 < p <= 1:
        raise ValueError(f"{what}: available_memory_proportion must be in (0, 1], got {p}")


# ---- matmul plan -----------------------------------------------------------------------------
@dataclass(frozen=True)
class MatMulPlan:
    """How a matmul C[B, M, N] = A[B, M, K] @ B[B, K, N] is spread over tiles."""
    shape: tuple[int, int, int, int]     # (B, M, N, K)
    splits: tuple[int, int, int, int]    # parts of (B, M, N, K); one block per tile
    dtype: str
    out_dtype: str
    cycles: int                          # the planner's estimate
    bytes_per_tile: int                  # working set of the busiest tile
    fits: bool                           # working set within the available memory proportion
    partials: str = PARTIALS.name        # dtype of the K-split's partials

    @property
    def blocks(self) -> tuple[int, ...]:
        """Block size along (B, M, N, K)."""
        return tuple(ceil_div(s, p) for s, p in zip(self.shape, self.splits))

    @property
    def k_split(self) -> int:
        return self.splits[3]

    @property
    def tiles_used(self) -> int:
        return int(np.prod(self.splits))

    @property
    def partials_dtype(self) -> str:
        return self.partials if self.k_split > 1 else self.out_dtype


def matmul_dims(a_shape, b_shape, what: str = "matmul") -> tuple[int, int, int, int]:
    """(B, M, K, N) of a[.., M, K] @ b[.., K, N]; a clear error for anything else."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(a_shape) != len(b_shape) or len(a_shape) not in (2, 3):
        raise ValueError(f"{what}: expected a[M, K] @ b[K, N] or a[B, M, K] @ b[B, K, N], got shapes "
                         f"{list(a_shape)} and {list(b_shape)}")
    if a_shape[-1] != b_shape[-2]:
        raise ValueError(f"{what}: inner dimensions differ: a is {list(a_shape)} and b is {list(b_shape)} "
                         f"({a_shape[-1]} != {b_shape[-2]})")
    if len(a_shape) == 3 and a_shape[0] != b_shape[0]:
        raise ValueError(f"{what}: batch sizes differ: a is {list(a_shape)} and b is {list(b_shape)}")
    batch = a_shape[0] if len(a_shape) == 3 else 1
    dims = (batch, a_shape[-2], a_shape[-1], b_shape[-1])
    if min(dims) < 1:
        raise ValueError(f"{what}: empty operand in {list(a_shape)} @ {list(b_shape)}")
    return dims


def partials_type(partials, dtype, what: str = "matmul") -> np.dtype:
    """The partials dtype of a product of `dtype` operands when `partials` ("float32"/"float",
    "float16"/"half", or None for the default) is asked for: float16 only for float16 operands."""
    if partials is None:
        return PARTIALS
    names = {"float": "float32", "half": "float16"}
    name = names.get(partials, partials) if isinstance(partials, str) else np.dtype(partials).name
    if name not in FLOAT_DTYPES:
        raise ValueError(f"{what}: partials type {partials!r} is not supported; use 'float' (float32) or 'half' "
                         "(float16)")
    return np.dtype(name) if np.dtype(dtype) == np.float16 else PARTIALS


def _matmul_model(target: Target, dims, splits: np.ndarray, dtype, out_dtype, partials=PARTIALS):
    """(cycles, working-set bytes) of every candidate split (rows of `splits`), vectorised."""
    B, M, N, K = dims
    pb, pm, pn, pk = (splits[:, i] for i in range(4))
    bb, bm, bn, bk = ceil_div(B, pb), ceil_div(M, pm), ceil_div(N, pn), ceil_div(K, pk)
    isz, osz, psz = np.dtype(dtype).itemsize, np.dtype(out_dtype).itemsize, np.dtype(partials).itemsize
    workers, tiles, xb, sync = (target.workers_per_tile, target.num_tiles, target.exchange_bytes_per_cycle,
                                target.sync_cycles)
    compute = amp_partial_cycles(bb, bm, bn, bk, dtype, target) + target.vertex_overhead_cycles
    received = (bb * bm * bk + bb * bk * bn) * isz
    sent = ceil_div(received * (pb * pm * pn * pk), tiles)
    cycles = compute + ceil_div(np.maximum(received, sent), xb) + 2 * sync
    split = pk > 1
    block_out = bb * bm * bn * np.where(split, psz, osz)
    memory = received + block_out
    out_tile = linear_tile_elements(B * M * N, tiles)
    gathered = pk * out_tile * psz
    reduction = (ceil_div(np.maximum(gathered, bb * bm * bn * psz), xb) + 2 * sync
                 + reduce_cycles(ceil_div(out_tile, workers), pk, target, partials) + target.vertex_overhead_cycles)
    cycles = cycles + np.where(split, reduction, 0)
    memory = np.maximum(memory, np.where(split, block_out + gathered + out_tile * osz, 0))
    return cycles, memory


def plan_matmul(target: Target, a_shape, b_shape, dtype="float32", out_dtype=None,
                available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION,
                k_split: int | None = None, partials=None) -> MatMulPlan:
    """The tile plan `matmul` uses for these shapes and dtypes (see the module doc); with
    `k_split`, among the splits that cut K into that many parts (a K-split candidate); `partials`
    as `partials_type` takes it."""
    B, M, K, N = matmul_dims(a_shape, b_shape)
    check_proportion(available_memory_proportion, "matmul")
    dtype = np.dtype(dtype)
    out_dtype = np.dtype(out_dtype) if out_dtype is not None else dtype
    partials = partials_type(partials, dtype)
    dims = (B, M, N, K)
    splits = split_grid(dims, target.num_tiles)
    if k_split is not None:
        splits = splits[splits[:, 3] == k_split]
        if not len(splits):
            raise ValueError(f"matmul: K = {K} cannot be split into {k_split} parts on {target.num_tiles} tiles")
    cycles, memory = _matmul_model(target, dims, splits, dtype, out_dtype, partials)
    budget = available_memory_proportion * target.bytes_per_tile
    best = choose_split(cycles, memory, budget, np.stack([splits.prod(axis=1), splits[:, 3]], axis=1))
    return MatMulPlan(dims, tuple(int(s) for s in splits[best]), dtype.name, out_dtype.name,
                      int(cycles[best]), int(memory[best]), bool(memory[best] <= budget), partials.name)


# ---- the op ----------------------------------------------------------------------------------
def _operand_blocks(graph: Graph, body: Sequence, t: Tensor, shape3: tuple, first: np.ndarray, extent: np.ndarray,
                    tiles: np.ndarray, name: str) -> tuple[Tensor, np.ndarray, bool]:
    """Bring block i of the operand `t` (viewed as `shape3` = [batch, rows, cols]) to `tiles[i]`:
    (the blocks, one after the other, each on its tile; their offsets; whether they are held
    column-major). A block is gathered in the order its elements lie in memory: row-major, or
    column-major when the operand is the transpose of a row-major view (its columns are
    contiguous), so that every block is a few runs of consecutive elements and never one run
    per element."""
    steps = t.axis_steps()
    columns = (steps is not None and t.rank >= 2 and shape3[1] > 1 and shape3[2] > 1
               and abs(steps[-2]) < abs(steps[-1]))
    if not columns:
        local, at = gather_boxes(graph, body, t.reshape(shape3), first, extent, tiles, name)
        return local, at, False
    swapped = t.transpose(tuple(range(t.rank - 2)) + (t.rank - 1, t.rank - 2))
    local, at = gather_boxes(graph, body, swapped.reshape(shape3[0], shape3[2], shape3[1]), first[:, [0, 2, 1]],
                             extent[:, [0, 2, 1]], tiles, name)
    return local, at, True


def matmul(graph: Graph, a: Tensor, b: Tensor, prog: Sequence, name: str = "matmul", *, out_dtype=None,
           available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION, k_split: int | None = None,
           partials=None) -> Tensor:
    """C = a @ b for a[M, K] @ b[K, N] or batched a[B, M, K] @ b[B, K, N] (float16 or float32).

    `out_dtype` (default: the operands' dtype) sets the result's dtype, e.g. float32 results of
    float16 operands. The plan is `plan_matmul(graph.target, a.shape, b.shape, ...)`, with K cut
    into `k_split` parts when given; `partials` ("half" or "float", default float) is PopLibs'
    partialsType, honoured for float16 operands.
    """
    B, M, K, N = matmul_dims(a.shape, b.shape, name)
    dtype = float_dtype(a, name)
    if b.dtype != dtype:
        raise TypeError(f"{name}: operands {a.name!r} ({dtype.name}) and {b.name!r} ({b.dtype.name}) have "
                        "different dtypes; cast one first")
    odt = output_dtype(out_dtype, dtype, name)
    plan = plan_matmul(graph.target, a.shape, b.shape, dtype, odt, available_memory_proportion, k_split, partials)
    pb, pm, pn, pk = plan.splits
    out_shape = (B, M, N) if a.rank == 3 else (M, N)
    first, extent = block_grid((B, M, N, K), plan.splits)  # per block, (b, m, n, k)
    bb, bm, bn, bk = extent.T
    tiles = block_tiles(len(first), graph.target.num_tiles)
    if pk == 1:
        out = graph.addVariable(odt, out_shape, name, category="activations", always_live=False)
        map_boxes(out.reshape(B, M, N), first[:, :3], extent[:, :3], tiles)
    else:
        out = new_output(graph, odt, out_shape, name)

    body = Sequence(name=name)
    lhs, lhs_at, a_cols = _operand_blocks(graph, body, a, (B, M, K), first[:, [0, 1, 3]], extent[:, [0, 1, 3]], tiles,
                                          f"{name}/lhs")
    rhs, rhs_at, b_cols = _operand_blocks(graph, body, b, (B, K, N), first[:, [0, 3, 2]], extent[:, [0, 3, 2]], tiles,
                                          f"{name}/rhs")
    if pk > 1:
        part, part_at = partials_variable(graph, bb * bm * bn, tiles, f"{name}/partials", plan.partials)
    cs = graph.addComputeSet(f"{name}/product")
    # one supervisor vertex per block: its batch entries are the vertex's groups, each operand block
    # is contiguous where it was gathered, the output is bm rows of bn per entry
    fields = {"a": Field.strided(lhs, lhs_at[:-1], 1, bb * bm * bk),
              "b": Field.strided(rhs, rhs_at[:-1], 1, bb * bk * bn)}
    if pk == 1:
        rows = bb * bm
        blk = np.repeat(np.arange(len(first)), rows)
        e, i = np.divmod(np.arange(rows.sum()) - np.repeat(np.cumsum(rows) - rows, rows), bm[blk])
        starts = ((first[blk, 0] + e) * M + first[blk, 1] + i) * N + first[blk, 2]
        fields["out"] = Field.from_runs([out.var], 0, starts, bn[blk], np.concatenate(([0], np.cumsum(rows))))
    else:
        fields["out"] = Field.strided(part, part_at[:-1], 1, bb * bm * bn)
    graph.addVertices(cs, MATMUL_VERTICES[(a_cols, b_cols)], tiles, fields,
                      np.stack([bb, bm, bn, bk], axis=1).astype(np.float64))
    body.add(Execute(cs))
    if pk > 1:
        split, element, part_start, length = block_partials(out.reshape(B, M, N), first[:, :3], extent[:, :3], pk,
                                                            part_at)
        reduce_partials(graph, body, part, pk, split, element, part_start, length, out, name)

    half_slices = half_partial_slices(plan)

    def fast(io):
        x, y = io.read(a), io.read(b)
        if half_slices:
            io.write(out, sum_of_half_partials(x, y, half_slices).astype(odt))
            return
        if dtype != np.float32:
            x, y = x.astype(np.float32), y.astype(np.float32)
        res = io.output(out) if odt == np.float32 else None
        if res is None:
            io.write(out, blas.matmul(x, y))
        else:
            blas.matmul(x, y, out=res)

    prog.add(OpProgram(name, body, fast, (a, b), (out,)))
    return out


def half_partial_slices(plan: MatMulPlan) -> list[tuple[int, int]]:
    """The K slices whose sums a plan rounds to float16 partials ([] without float16 partials)."""
    return ranges(plan.shape[3], plan.k_split) if plan.partials_dtype == "float16" and plan.k_split > 1 else []


def sum_of_half_partials(x: np.ndarray, y: np.ndarray, k_slices) -> np.ndarray:
    """x @ y as tiles with float16 partials compute it: each K slice's sum rounded to float16, the
    slices added in float64 (the fast mode's twin of the partials and reduce vertices)."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    return sum(blas.matmul(x[..., k0:k1], y[..., k0:k1, :]).astype(np.float16).astype(np.float64)
               for k0, k1 in k_slices)


# ---- serialised matmul ----------------------------------------------------------------------------
SERIALIZATION_MODES = {"input_channels": "M (the rows of the result)", "reducing_dim": "K (the reduced dimension)",
                       "output_channels": "N (the columns of the result)"}


def serialized_matmul(graph: Graph, a: Tensor, b: Tensor, prog: Sequence, mode: str, factor: int,
                      name: str = "matmul", *, keep_precision: bool = False, out_dtype=None,
                      available_memory_proportion: float = AVAILABLE_MEMORY_PROPORTION, partials=None) -> Tensor:
    """C = a[M, K] @ b[K, N] as `factor` matmuls one after the other, split along `mode`
    ("input_channels": M, "reducing_dim": K, "output_channels": N), which `factor` must divide
    (see the module doc). `keep_precision` adds float16 reducing-dimension pieces in float32;
    `partials` is the pieces' partials type (as `matmul` takes it)."""
    if mode not in SERIALIZATION_MODES:
        raise ValueError(f"{name}: unknown serialisation mode {mode!r}; use one of {sorted(SERIALIZATION_MODES)}")
    if a.rank != 2 or b.rank != 2:
        raise ValueError(f"{name}: a serialised matmul multiplies matrices, got shapes {list(a.shape)} and "
                         f"{list(b.shape)}")
    _, M, K, N = matmul_dims(a.shape, b.shape, name)
    size = {"input_channels": M, "reducing_dim": K, "output_channels": N}[mode]
    if isinstance(factor, bool) or not isinstance(factor, (int, np.integer)) or factor < 1 or size % factor:
        raise ValueError(f"{name}: serialisation factor {factor!r} must be a positive divisor of "
                         f"{SERIALIZATION_MODES[mode]} = {size}")
    dtype = float_dtype(a, name)
    odt = output_dtype(out_dtype, dtype, name)
    budget = {"available_memory_proportion": available_memory_proportion, "partials": partials}
    body = Sequence(name=name)
    pieces = ranges(K, factor) if mode == "reducing_dim" else ranges(size, factor)
    if mode == "reducing_dim":
        pdt = PARTIALS if keep_precision or odt == PARTIALS else odt
        acc = None
        piece_slices = [half_partial_slices(plan_matmul(graph.target, (M, k1 - k0), (k1 - k0, N), dtype, pdt,
                                                        available_memory_proportion, partials=partials))
                        for k0, k1 in pieces]
        for i, (k0, k1) in enumerate(pieces):
            piece = matmul(graph, a[:, k0:k1], b[k0:k1, :], body, f"{name}/piece{i}", out_dtype=pdt, **budget)
            if acc is None:
                acc = piece
            else:
                ew.binary(graph, "add", acc, piece, body, f"{name}/piece{i}/accumulate", out=acc)
        out = acc if pdt == odt else ew.cast(graph, acc, odt, body, f"{name}/cast")
    else:   # each piece sums over K as the whole product would: in the same parts
        whole = plan_matmul(graph.target, a.shape, b.shape, dtype, odt, available_memory_proportion, partials=partials)
        k_split, whole_slices = whole.k_split, half_partial_slices(whole)
        out = new_output(graph, odt, (M, N), name)
        for i, (lo, hi) in enumerate(pieces):
            rows, cols = (slice(lo, hi), slice(None)) if mode == "input_channels" else (slice(None), slice(lo, hi))
            piece = matmul(graph, a[rows, :], b[:, cols], body, f"{name}/piece{i}", out_dtype=odt, k_split=k_split,
                           **budget)
            body.add(Copy(piece, out[rows, cols]))

    def product(x, y, half_slices):
        return sum_of_half_partials(x, y, half_slices) if half_slices else blas.matmul(x, y)

    def fast(io):
        x, y = io.read(a).astype(np.float32), io.read(b).astype(np.float32)
        if mode != "reducing_dim":   # every element is the same sum as in one product
            io.write(out, product(x, y, whole_slices).astype(odt))
            return
        total = None
        for (k0, k1), half_slices in zip(pieces, piece_slices):
            piece = product(x[:, k0:k1], y[k0:k1, :], half_slices).astype(pdt)
            total = piece if total is None else (total + piece).astype(pdt)
        io.write(out, total.astype(odt))

    prog.add(OpProgram(name, body, fast, (a, b), (out,)))
    return out
