"""Embedding lookup (PopLibs' multiSlice) and its gradient (multiUpdateAdd).

`embedding(indices, weight)` gathers rows of a table [V, D] into [*indices.shape, D];
`embedding_backward(indices, grad_out, V)` scatter-adds gradient rows into a zeroed [V, D] table.

Plan (`plan_embedding`, like PopLibs' embedding plan): the table is cut into `row_split` groups of
rows (the sliced dimension) and `col_split` groups of columns (the unsliced dimension, used for
wide tables), the indices into `lookup_split` contiguous groups. Tile (v, d, l) =
(l * col_split + d) * row_split + v holds table block (v, d) and works on lookup group l.
Among power-of-two splits (and the largest possible one) the planner takes the plan with the
fewest estimated cycles of one forward plus one backward pass (exchange received by the busiest
tile + compute sets from the estimators below + one sync per superstep) whose working set per
tile stays within MEMORY_PROPORTION of the tile's memory; ties go to fewer tiles.
`embedding_table` creates a table already laid out for the plan, so lookups need no exchange
of the table.

Forward (multiSlice):
1. exchange: the indices of group l go to every tile of group l (broadcast); for lookup groups
   l > 0 the table block is broadcast too (the table lives in group 0).
2. each tile splits its indices over its workers; a vertex copies the rows of its indices that
   fall in the tile's rows. With one row group it writes the output directly and fills
   out-of-range indices with zeros; with several it writes a partial [row_split, n, D] and skips
   the indices other row groups own.
3. (row_split > 1) exchange: each tile of a (d, l) group gathers the row_split partials of its
   share of the output rows; a second multiSlice picks, per output row, the partial of the row
   group that owns the index, or zeros.
Out-of-range indices (negative or >= V) give zero rows, as PopLibs' multiSlice does; the forward
output does not depend on padding_idx (as in ATen).

Backward (multiUpdateAdd):
1. exchange: indices and gradient rows [n_l, D_d] of group l go to every tile of group l.
2. each tile splits its table rows over its workers (each worker scans all the tile's indices
   and updates only its own rows, so no two workers write the same row); a vertex sums, per row,
   the gradient rows whose index hits it in increasing lookup order in float64 and stores the sum
   once. Rows equal to padding_idx and out-of-range indices get nothing, as in torch.
   With one lookup group the result is the gradient; otherwise each group writes a float32
   partial [lookup_split, V, D].
3. (lookup_split > 1) exchange: the partials of block (v, d) go to tile (v, d, 0), which sums
   them in group order in float64 and rounds once.
The fast mode computes the same sums in the same order (sort by index, then sum each row's
gradients in lookup order, cut at the same lookup groups), so both modes agree bit for bit.

Cycles per vertex (worker instructions, times 6 tile cycles each; PopLibs' popops estimators):
- multiSlice, k indices, `cols` columns, vertex rows R of V:
  13 + k_in * (19 + 2 * ceil(cols / 2)) + (k - k_in) * 8, with k_in = min(k, ceil(k * R / V))
  (indices assumed uniform over the table, PopLibs' default `indicesDistribution`); the second
  stage uses R = V (every index in range).
- multiUpdateAdd, k indices, worker rows R of V, float data f (1 element per 32-bit atom, else 2):
  (k == 0: 3) else 3 + (24 if f else 25) + k_in * ((11 if f else 12) + 3 * (ceil(cols / atom) - 1))
  + (k - k_in) * 5, plus ceil(R * cols / (2 if f else 4)) to zero the rows (64-bit stores).
- partial reduction, m outputs, p partials: 8 + ceil(m / 2) * (p + 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, kernel_view, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.target import Target
from ..device.tensor import Tensor
from ..device.vertex import Field, VertexType
from .common import box_positions, gather_boxes, map_boxes, split_ranges

# Share of a tile's memory the planner lets the op's working set use (PopLibs' default
# availableMemoryProportion for planned ops).
MEMORY_PROPORTION = 0.6
TABLE_DTYPES = ("float32", "float16")


# ---- plan -------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddingPlan:
    """How an embedding table and its lookups are spread over tiles."""
    num_embeddings: int
    dim: int
    num_lookups: int
    row_split: int
    col_split: int
    lookup_split: int
    rows_per_group: int
    cols_per_group: int
    lookups_per_group: int

    @classmethod
    def of(cls, num_embeddings: int, dim: int, num_lookups: int, row_split: int = 1, col_split: int = 1,
           lookup_split: int = 1, col_grain: int = 1) -> "EmbeddingPlan":
        """The plan with (at most) the given splits; groups are equal but the last, columns come in
        multiples of `col_grain`, and no group is empty."""
        V, D, n = num_embeddings, dim, num_lookups
        if V < 1 or D < 1:
            raise ValueError(f"an embedding table needs at least one row and one column, got [{V}, {D}]")
        if n < 0:
            raise ValueError(f"num_lookups must be >= 0, got {n}")
        if min(row_split, col_split, lookup_split, col_grain) < 1:
            raise ValueError(f"splits and grain must be >= 1, got rows {row_split}, columns {col_split}, "
                             f"lookups {lookup_split}, grain {col_grain}")
        Vb = ceil_div(V, min(row_split, V))
        Db = min(D, ceil_div(ceil_div(D, min(col_split, D)), col_grain) * col_grain)
        nb = ceil_div(n, min(lookup_split, n)) if n else 0
        return cls(V, D, n, ceil_div(V, Vb), ceil_div(D, Db), ceil_div(n, nb) if n else 1, Vb, Db, nb)

    @property
    def num_tiles(self) -> int:
        return self.row_split * self.col_split * self.lookup_split

    def tile(self, v: int, d: int, l: int) -> int:
        return (l * self.col_split + d) * self.row_split + v

    def rows(self, v: int) -> tuple[int, int]:
        return v * self.rows_per_group, min((v + 1) * self.rows_per_group, self.num_embeddings)

    def cols(self, d: int) -> tuple[int, int]:
        return d * self.cols_per_group, min((d + 1) * self.cols_per_group, self.dim)

    def lookups(self, l: int) -> tuple[int, int]:
        return (min(l * self.lookups_per_group, self.num_lookups),
                min((l + 1) * self.lookups_per_group, self.num_lookups))

    def estimate(self, target: Target, dtype) -> tuple[int, int]:
        """(cycles of one forward plus one backward pass, working bytes of the busiest tile)."""
        dtype = np.dtype(dtype)
        b, w = dtype.itemsize, target.workers_per_tile
        V, nb, Vb, Db = self.num_embeddings, self.lookups_per_group, self.rows_per_group, self.cols_per_group
        pV, pL = self.row_split, self.lookup_split
        floats = dtype == np.float32

        def exchange(nbytes):
            return math.ceil(nbytes / target.exchange_bytes_per_cycle) + target.sync_cycles

        def compute(instructions):
            return target.thread_cycles(instructions) + target.vertex_overhead_cycles + target.sync_cycles

        fwd = exchange(nb * 4 + (Vb * Db * b if pL > 1 else 0))
        fwd += compute(multislice_instructions(ceil_div(nb, w), Db, Vb, V))
        fwd_bytes = Vb * Db * b + nb * 4 + nb * Db * b
        if pV > 1:
            m = ceil_div(nb, pV)
            fwd += exchange(pV * m * Db * b) + compute(multislice_instructions(ceil_div(m, w), Db, V, V))
            fwd_bytes += (pV + 1) * m * Db * b
        bwd = exchange(nb * 4 + nb * Db * b)
        bwd += compute(multiupdateadd_instructions(nb, Db, ceil_div(Vb, w), V, floats))
        bwd_bytes = nb * 4 + nb * Db * b + Vb * Db * b
        if pL > 1:
            bwd += exchange((pL - 1) * Vb * Db * 4) + compute(reduce_instructions(ceil_div(Vb * Db, w), pL))
            bwd_bytes += (pL + 1) * Vb * Db * 4
        return fwd + bwd, max(fwd_bytes, bwd_bytes)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _splits(n: int, limit: int) -> list[int]:
    top = max(1, min(n, limit))
    out, p = {1, top}, 2
    while p < top:
        out.add(p)
        p *= 2
    return sorted(out)


def plan_embedding(target: Target, num_embeddings: int, dim: int, num_lookups: int, dtype) -> EmbeddingPlan:
    """The cheapest split of table rows, table columns and lookups that fits in tile memory."""
    dtype = np.dtype(dtype)
    grain = max(1, 8 // dtype.itemsize)  # columns in one 64-bit vector
    budget = MEMORY_PROPORTION * target.bytes_per_tile
    T, V, D, n = target.num_tiles, num_embeddings, dim, num_lookups
    best, best_key = None, None
    for pd in _splits(ceil_div(D, grain), T):
        pD = EmbeddingPlan.of(V, D, n, 1, pd, 1, grain).col_split
        for pv in _splits(V, T // pD):
            pV = EmbeddingPlan.of(V, D, n, pv, pd, 1, grain).row_split
            for pl in _splits(n, T // (pD * pV)):
                plan = EmbeddingPlan.of(V, D, n, pv, pd, pl, grain)
                cycles, nbytes = plan.estimate(target, dtype)
                fits = nbytes <= budget
                key = (not fits, cycles if fits else nbytes, plan.num_tiles)
                if best_key is None or key < best_key:
                    best, best_key = plan, key
    return best


# ---- cycle estimators -------------------------------------------------------------------
def multislice_instructions(num_offsets, cols, rows, num_embeddings):
    """Ints, or arrays (one per vertex)."""
    in_range = np.minimum(num_offsets, ceil_div(num_offsets * rows, num_embeddings))
    return 13 + in_range * (19 + 2 * ceil_div(cols, 2)) + (num_offsets - in_range) * 8


def multiupdateadd_instructions(num_offsets, cols, rows, num_embeddings, float_data: bool):
    """Ints, or arrays (one per vertex)."""
    fill = ceil_div(rows * cols, 2 if float_data else 4)
    atom = 1 if float_data else 2
    in_range = np.minimum(num_offsets, ceil_div(num_offsets * rows, num_embeddings))
    per_in_range = (11 if float_data else 12) + 3 * (ceil_div(cols, atom) - 1)
    updates = (24 if float_data else 25) + in_range * per_in_range + (num_offsets - in_range) * 5
    return 3 + np.where(num_offsets == 0, 0, updates) + fill


def reduce_instructions(num_outputs, num_partials):
    """Ints, or arrays (one per vertex)."""
    return 8 + ceil_div(num_outputs, 2) * (num_partials + 1)


def _multislice_cycles(sizes, params, dtype, target):
    rows, cols, V = (params[:, i].astype(np.int64) for i in (1, 2, 3))
    return target.thread_cycles(multislice_instructions(sizes["indices"], cols, rows, V))


def _select_cycles(sizes, params, dtype, target):
    return target.thread_cycles(multislice_instructions(sizes["indices"], params[:, 2].astype(np.int64), 1, 1))


def _update_cycles(sizes, params, dtype, target):
    rows, cols, V = (params[:, i].astype(np.int64) for i in (1, 2, 3))
    return target.thread_cycles(multiupdateadd_instructions(sizes["indices"], cols, rows, V,
                                                            np.dtype(dtype) == np.float32))


def _reduce_cycles(sizes, params, dtype, target):
    return target.thread_cycles(reduce_instructions(sizes["out"], params[:, 0].astype(np.int64)))


# ---- codelets ---------------------------------------------------------------------------
@njit(parallel=True, **JIT)
def multislice_codelet(table, t_addr, t_start, idx, i_addr, i_start, out, o_addr, o_start, params):
    """params: row_begin, rows, cols, V, fill (write zeros for indices outside the rows)."""
    for v in prange(params.shape[0]):
        base, rows, cols = int(params[v, 0]), int(params[v, 1]), int(params[v, 2])
        fill = params[v, 4] != 0
        tb, ib, ob = t_start[v], i_start[v], o_start[v]
        for k in range(i_start[v + 1] - ib):
            r = ld(idx, i_addr[ib + k]) - base
            if r >= 0 and r < rows:
                for j in range(cols):
                    out[o_addr[ob + k * cols + j]] = table[t_addr[tb + r * cols + j]]
            elif fill:
                for j in range(cols):
                    st(out, o_addr[ob + k * cols + j], 0.0)


@njit(parallel=True, **JIT)
def select_codelet(parts, p_addr, p_start, idx, i_addr, i_start, out, o_addr, o_start, params):
    """Second multiSlice stage. params: rows_per_group, V, cols, number of partials."""
    for v in prange(params.shape[0]):
        per, V, cols = int(params[v, 0]), int(params[v, 1]), int(params[v, 2])
        ib, pb, ob = i_start[v], p_start[v], o_start[v]
        m = i_start[v + 1] - ib
        for k in range(m):
            x = ld(idx, i_addr[ib + k])
            if x >= 0 and x < V:
                src = pb + ((x // per) * m + k) * cols
                for j in range(cols):
                    out[o_addr[ob + k * cols + j]] = parts[p_addr[src + j]]
            else:
                for j in range(cols):
                    st(out, o_addr[ob + k * cols + j], 0.0)


@njit(parallel=True, **JIT)
def update_add_codelet(grads, g_addr, g_start, idx, i_addr, i_start, out, o_addr, o_start, params):
    """params: row_begin, rows, cols, V, padding_idx (-1 for none)."""
    for v in prange(params.shape[0]):
        base, rows, cols = int(params[v, 0]), int(params[v, 1]), int(params[v, 2])
        pad = int(params[v, 4])
        gb, ib, ob = g_start[v], i_start[v], o_start[v]
        acc = np.zeros(rows * cols)
        for k in range(i_start[v + 1] - ib):
            x = ld(idx, i_addr[ib + k])
            r = x - base
            if x != pad and r >= 0 and r < rows:
                for j in range(cols):
                    acc[r * cols + j] += ld(grads, g_addr[gb + k * cols + j])
        for e in range(rows * cols):
            st(out, o_addr[ob + e], acc[e])


@njit(parallel=True, **JIT)
def reduce_partials_codelet(parts, p_addr, p_start, out, o_addr, o_start, params):
    """out[i] = sum over partials p (in order) of parts[p, i]. params: number of partials."""
    for v in prange(params.shape[0]):
        num = int(params[v, 0])
        pb, ob = p_start[v], o_start[v]
        m = o_start[v + 1] - ob
        for i in range(m):
            s = 0.0
            for p in range(num):
                s += ld(parts, p_addr[pb + p * m + i])
            st(out, o_addr[ob + i], s)


@njit(parallel=True, **JIT)
def scatter_add_whole(idx, order, group_starts, grads, out, dim, chunk, partials, pad):
    """Fast-mode multiUpdateAdd: per row, gradients summed in lookup order, cut at lookup groups
    of `chunk` (float32 partials summed in group order when `partials`), exactly as the vertices."""
    for g in prange(group_starts.size - 1):
        first = order[group_starts[g]]
        row = idx[first]
        if row == pad:
            continue
        for j in range(dim):
            total = 0.0
            part = 0.0
            group = first // chunk
            for q in range(group_starts[g], group_starts[g + 1]):
                k = order[q]
                if k // chunk != group:
                    total += np.float64(np.float32(part))
                    part = 0.0
                    group = k // chunk
                part += ld(grads, k * dim + j)
            if partials:
                st(out, row * dim + j, total + np.float64(np.float32(part)))
            else:
                st(out, row * dim + j, part)


MULTI_SLICE = VertexType("popops::MultiSlice", ("table", "indices"), ("out",), multislice_codelet,
                         _multislice_cycles, num_params=5)
MULTI_SLICE_SELECT = VertexType("popops::MultiSlice(stage 2)", ("partials", "indices"), ("out",), select_codelet,
                                _select_cycles, num_params=4)
MULTI_UPDATE_ADD = VertexType("popops::MultiUpdateAdd", ("grads", "indices"), ("out",), update_add_codelet,
                              _update_cycles, num_params=5)
REDUCE_PARTIALS = VertexType("popops::ReducePartials", ("partials",), ("out",), reduce_partials_codelet,
                             _reduce_cycles, num_params=1)


# ---- graph construction -----------------------------------------------------------------
@dataclass(frozen=True)
class Units:
    """The (lookup group l, column group d, row group v) units of a plan, v fastest: the tile of
    each and the lookups, columns and table rows it covers, [begin, end)."""
    tile: np.ndarray
    l: np.ndarray
    v: np.ndarray
    la: np.ndarray
    lb: np.ndarray
    ca: np.ndarray
    cb: np.ndarray
    ra: np.ndarray
    rb: np.ndarray

    @staticmethod
    def of(plan: EmbeddingPlan, lookup_split: int) -> "Units":
        l, d, v = (a.reshape(-1) for a in np.meshgrid(np.arange(lookup_split), np.arange(plan.col_split),
                                                       np.arange(plan.row_split), indexing="ij"))
        n, D, V = plan.num_lookups, plan.dim, plan.num_embeddings
        return Units((l * plan.col_split + d) * plan.row_split + v, l, v,
                     np.minimum(l * plan.lookups_per_group, n), np.minimum((l + 1) * plan.lookups_per_group, n),
                     d * plan.cols_per_group, np.minimum((d + 1) * plan.cols_per_group, D),
                     v * plan.rows_per_group, np.minimum((v + 1) * plan.rows_per_group, V))


def _rows_of(t: Tensor, first_row: np.ndarray, rows: np.ndarray, col: np.ndarray, cols: np.ndarray,
             width: int) -> Field:
    """Vertex v connects rows [first_row, first_row + rows) x columns [col, col + cols) of the
    view t seen as [.., width] (flat positions)."""
    return Field.strided(t, first_row * width + col, rows, cols, width)


def _pieces(local: Tensor, at: np.ndarray, which: np.ndarray) -> Field:
    """Vertex v connects the whole piece `which[v]` of a `gather_boxes` result."""
    return Field.strided(local, at[which], 1, np.diff(at)[which])


def _check_table(what: str, dtype) -> None:
    if np.dtype(dtype).name not in TABLE_DTYPES:
        raise TypeError(f"{what} is {np.dtype(dtype).name}; embeddings support {list(TABLE_DTYPES)}: cast it first")


def _check_indices(indices: Tensor, name: str) -> None:
    if indices.dtype != np.int32:
        raise TypeError(f"{name}: indices {indices.name!r} are {indices.dtype.name}; they must be int32 "
                        "(cast them first)")


def _check_padding(padding_idx: int, V: int, name: str) -> None:
    if padding_idx != -1 and not 0 <= padding_idx < V:
        raise ValueError(f"{name}: padding_idx must be -1 (none) or a row in [0, {V}), got {padding_idx}; "
                         f"torch's negative padding_idx counts from the end: pass {V} + padding_idx")


def _layout_table(graph: Graph, table: Tensor, plan: EmbeddingPlan) -> None:
    """Block (v, d) of rows `plan.rows(v)` and columns `plan.cols(d)` on `plan.tile(v, d, 0)`."""
    blocks = [(*plan.rows(v), *plan.cols(d), plan.tile(v, d, 0)) for v in range(plan.row_split)
              for d in range(plan.col_split)]
    ra, rb, ca, cb, tile = np.asarray(blocks, np.int64).reshape(-1, 5).T
    map_boxes(table, np.stack([ra, ca], 1), np.stack([rb - ra, cb - ca], 1), tile)


def embedding_table(graph: Graph, num_embeddings: int, dim: int, dtype="float32", num_lookups: int = 1, *,
                    name: str = "embedding_weight", category: str = "weights",
                    plan: EmbeddingPlan | None = None) -> Tensor:
    """A [num_embeddings, dim] table laid out for `plan` (PopLibs' createSliceableTensor), so
    `embedding` and `embedding_backward` with that plan need no exchange of the table."""
    _check_table(f"table {name!r}", dtype)
    plan = plan or plan_embedding(graph.target, num_embeddings, dim, num_lookups, dtype)
    table = graph.addVariable(dtype, (num_embeddings, dim), name, category=category)
    _layout_table(graph, table, plan)
    return table


def embedding(graph: Graph, indices: Tensor, weight: Tensor, prog: Sequence, name: str = "embedding",
              padding_idx: int = -1, *, plan: EmbeddingPlan | None = None) -> Tensor:
    """out[..., :] = weight[indices[...], :]; out-of-range indices give zero rows (PopLibs)."""
    _check_indices(indices, name)
    if weight.rank != 2:
        raise ValueError(f"{name}: weight {weight.name!r} must be 2-D [num_embeddings, dim], has shape {weight.shape}")
    _check_table(f"{name}: weight {weight.name!r}", weight.dtype)
    V, D = weight.shape
    _check_padding(padding_idx, V, name)
    n = indices.numel
    plan = plan or plan_embedding(graph.target, V, D, n, weight.dtype)
    _check_plan(plan, V, D, n, graph.target, name)
    out = graph.addVariable(weight.dtype, (*indices.shape, D), name, category="activations", always_live=False)
    out2d = out.reshape(n, D)
    idx_flat = indices.flatten()
    body = Sequence(name=name)
    pV = plan.row_split
    partial = None
    if pV > 1:
        partial = graph.addVariable(weight.dtype, (pV, n, D), f"{name}/partials", category="temporaries",
                                    always_live=False)
    # stage 1: every tile looks up its lookup group in its table block
    u = Units.of(plan, plan.lookup_split)
    if n:
        idx_local, idx_at = gather_boxes(graph, body, idx_flat, u.la[:, None], (u.lb - u.la)[:, None], u.tile,
                                         f"{name}/indices")
        tables, tables_at = gather_boxes(graph, body, weight, np.stack([u.ra, u.ca], 1),
                                         np.stack([u.rb - u.ra, u.cb - u.ca], 1), u.tile, f"{name}/table")
        dest = out if partial is None else partial
        row0 = u.la if partial is None else u.v * n + u.la  # first row of each unit's output in dest [.., D]
        map_boxes(Tensor(dest.var).reshape(dest.numel // D, D), np.stack([row0, u.ca], 1),
                  np.stack([u.lb - u.la, u.cb - u.ca], 1), u.tile)
        k, a, b = split_ranges(u.lb - u.la, graph.target.workers_per_tile)
        cs = graph.addComputeSet(f"{name}/slice")
        fields = {"table": _pieces(tables, tables_at, k),
                  "indices": Field.strided(idx_local, idx_at[k] + a, 1, b - a),
                  "out": _rows_of(dest, row0[k] + a, b - a, u.ca[k], (u.cb - u.ca)[k], D)}
        params = np.stack(np.broadcast_arrays(u.ra[k], (u.rb - u.ra)[k], (u.cb - u.ca)[k], V,
                                              1 if partial is None else 0), 1).astype(np.float64)
        graph.addVertices(cs, MULTI_SLICE, u.tile[k], fields, params)
        body.add(Execute(cs))
        if partial is not None:
            _select_stage(graph, body, plan, u, idx_local, idx_at, partial, out, name)

    def fast(io):
        x = io.read(indices).reshape(-1).astype(np.int64)
        w = io.read(weight)
        res = np.zeros((n, D), dtype=weight.dtype)
        valid = (x >= 0) & (x < V)
        res[valid] = w[x[valid]]
        io.write(out, res.reshape(out.shape))

    prog.add(OpProgram(name, body, fast, (indices, weight), (out,)))
    return out


def _select_stage(graph, body, plan, u: Units, idx_local, idx_at, partial, out, name):
    """Each tile of a (d, l) group takes a share of the group's output rows (share v of
    `split_ranges(rows, row groups)` for the unit of row group v) and picks, per row, the partial of
    the row group owning the index."""
    V, pV, D = plan.num_embeddings, plan.row_split, plan.dim
    unit, a, b = split_ranges(u.lb - u.la, pV)
    pick = np.arange(unit.size) - np.searchsorted(unit, unit) == u.v[unit]  # piece v of the unit of row group v
    share, a, b = unit[pick], a[pick], b[pick]
    m, cols, row0 = b - a, (u.cb - u.ca)[share], u.la[share] + a
    map_boxes(Tensor(out.var).reshape(out.numel // D, D), np.stack([row0, u.ca[share]], 1), np.stack([m, cols], 1),
              u.tile[share])
    gathered, at = gather_boxes(graph, body, partial, np.stack([np.zeros_like(row0), row0, u.ca[share]], 1),
                                np.stack([np.full_like(m, pV), m, cols], 1), u.tile[share], f"{name}/gathered")
    s, a2, b2 = split_ranges(m, graph.target.workers_per_tile)
    fields = {"partials": Field.strided(gathered, at[s] + a2 * cols[s], pV, (b2 - a2) * cols[s], m[s] * cols[s]),
              "indices": Field.strided(idx_local, idx_at[share[s]] + a[s] + a2, 1, b2 - a2),
              "out": _rows_of(out, row0[s] + a2, b2 - a2, u.ca[share][s], cols[s], D)}
    params = np.stack(np.broadcast_arrays(plan.rows_per_group, V, cols[s], pV), 1).astype(np.float64)
    cs = graph.addComputeSet(f"{name}/select")
    graph.addVertices(cs, MULTI_SLICE_SELECT, u.tile[share][s], fields, params)
    body.add(Execute(cs))


def embedding_backward(graph: Graph, indices: Tensor, grad_out: Tensor, num_embeddings: int, prog: Sequence,
                       name: str = "embedding_grad", padding_idx: int = -1, *,
                       plan: EmbeddingPlan | None = None) -> Tensor:
    """grad[V, D] with grad[r] = sum of grad_out rows whose index is r (none for padding_idx and
    out-of-range indices), laid out like `embedding_table`'s table."""
    _check_indices(indices, name)
    _check_table(f"{name}: grad_out {grad_out.name!r}", grad_out.dtype)
    if grad_out.rank < 1 or grad_out.shape[:-1] != indices.shape:
        raise ValueError(f"{name}: grad_out {grad_out.name!r} has shape {grad_out.shape}; expected "
                         f"{(*indices.shape, 'dim')} for indices of shape {indices.shape}")
    V, D, n = int(num_embeddings), grad_out.shape[-1], indices.numel
    if V < 1 or D < 1:
        raise ValueError(f"{name}: the gradient table [{V}, {D}] needs at least one row and one column")
    _check_padding(padding_idx, V, name)
    plan = plan or plan_embedding(graph.target, V, D, n, grad_out.dtype)
    _check_plan(plan, V, D, n, graph.target, name)
    dtype = grad_out.dtype
    grad = graph.addVariable(dtype, (V, D), name, category="gradients", always_live=False)
    _layout_table(graph, grad, plan)
    g2d = grad_out.reshape(n, D)
    idx_flat = indices.flatten()
    pL = plan.lookup_split
    partial = None
    if pL > 1:
        partial = graph.addVariable(np.float32, (pL, V, D), f"{name}/partials", category="temporaries",
                                    always_live=False)
    body = Sequence(name=name)
    u = Units.of(plan, pL)
    idx_local, idx_at = gather_boxes(graph, body, idx_flat, u.la[:, None], (u.lb - u.la)[:, None], u.tile,
                                     f"{name}/indices")
    grads_local, grads_at = gather_boxes(graph, body, g2d, np.stack([u.la, u.ca], 1),
                                         np.stack([u.lb - u.la, u.cb - u.ca], 1), u.tile, f"{name}/grads")
    dest = grad if partial is None else partial
    row0 = u.ra if partial is None else u.l * V + u.ra  # first row of each unit's block in dest [.., D]
    if partial is not None:
        map_boxes(Tensor(partial.var).reshape(pL * V, D), np.stack([row0, u.ca], 1),
                  np.stack([u.rb - u.ra, u.cb - u.ca], 1), u.tile)
    k, a, b = split_ranges(u.rb - u.ra, graph.target.workers_per_tile)
    fields = {"grads": _pieces(grads_local, grads_at, k), "indices": _pieces(idx_local, idx_at, k),
              "out": _rows_of(dest, row0[k] + a, b - a, u.ca[k], (u.cb - u.ca)[k], D)}
    params = np.stack(np.broadcast_arrays(u.ra[k] + a, b - a, (u.cb - u.ca)[k], V, padding_idx), 1)
    cs = graph.addComputeSet(f"{name}/update")
    graph.addVertices(cs, MULTI_UPDATE_ADD, u.tile[k], fields, params.astype(np.float64))
    body.add(Execute(cs))
    if partial is not None:
        blocks = Units.of(plan, 1)  # the table's blocks, on the tiles of lookup group 0
        rows, cols = blocks.rb - blocks.ra, blocks.cb - blocks.ca
        gathered, at = gather_boxes(graph, body, partial, np.stack([np.zeros_like(rows), blocks.ra, blocks.ca], 1),
                                    np.stack([np.full_like(rows, pL), rows, cols], 1), blocks.tile,
                                    f"{name}/gathered")
        m = rows * cols
        s, a, b = split_ranges(m, graph.target.workers_per_tile, grain=2)
        boxes = box_positions(np.stack([blocks.ra, blocks.ca], 1), np.stack([rows, cols], 1), (V, D))
        box_at = np.concatenate(([0], np.cumsum(m)))
        fields = {"partials": Field.strided(gathered, at[s] + a, pL, b - a, m[s]),
                  "out": Field.at(grad, boxes, np.append(box_at[s] + a, box_at[-1]))}
        cs2 = graph.addComputeSet(f"{name}/reduce")
        graph.addVertices(cs2, REDUCE_PARTIALS, blocks.tile[s], fields, np.array([pL], np.float64))
        body.add(Execute(cs2))

    def fast(io):
        x = io.read(indices).reshape(-1).astype(np.int64)
        g = np.ascontiguousarray(io.read(grad_out)).reshape(-1)
        res = np.zeros((V, D), dtype=dtype)
        valid = np.flatnonzero((x >= 0) & (x < V))
        order = valid[np.argsort(x[valid], kind="stable")]
        sorted_rows = x[order]
        starts = np.flatnonzero(np.diff(sorted_rows, prepend=-2)).astype(np.int64)
        starts = np.append(starts, order.size)
        scatter_add_whole(x, order, starts, kernel_view(g), kernel_view(res.reshape(-1)), D,
                          max(plan.lookups_per_group, 1), pL > 1, padding_idx)
        io.write(grad, res)

    prog.add(OpProgram(name, body, fast, (indices, grad_out), (grad,)))
    return grad


def _check_plan(plan: EmbeddingPlan, V: int, D: int, n: int, target: Target, name: str) -> None:
    if (plan.num_embeddings, plan.dim, plan.num_lookups) != (V, D, n):
        raise ValueError(f"{name}: the plan is for a [{plan.num_embeddings}, {plan.dim}] table and "
                         f"{plan.num_lookups} lookups, the op has [{V}, {D}] and {n}; make the plan with "
                         "plan_embedding for these sizes")
    if plan.num_tiles > target.num_tiles:
        raise ValueError(f"{name}: the plan uses {plan.num_tiles} tiles, {target.name} has {target.num_tiles}")
