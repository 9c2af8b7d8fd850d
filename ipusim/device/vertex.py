"""Vertices and compute sets, held as tables.

A `VertexType` bundles a codelet (a Numba kernel), its cycle estimator and its field roles. A
compute set holds, per vertex type, one `VertexTable`: a tile column, a parameter matrix (one
row per vertex) and, per field, a `Field`: the pieces of variables each vertex connects, as runs
of consecutive elements (first element, length) in compressed-row form. Ops build these columns
with NumPy from their plan; `Graph.addVertex` adds a table of one row. Every element a vertex
reads or writes must live on that vertex's tile: checked when a table is added, one vectorised
test per field.

Estimators work on whole tables: `cycles(sizes, params, dtype, target)` gets, per field, the
number of elements each vertex connects (an int64 array), the parameter matrix and the dtype of
the type's first field, and returns the cycles of each vertex (an int64 array): on one worker for
a worker vertex; for a supervisor vertex (`VertexType.supervisor`, as PopLibs' AMP convolution
partials), the tile cycles of the whole vertex, which hands its work to all the tile's workers
itself. A tile runs its supervisor vertices one after another and its worker vertices on its
workers (`tile_makespans`); its compute set takes the sum of the two.

Codelet calling convention: the kernel is called once per compute set and vertex type, with,
for every field in `VertexType.fields` order, the triple (arena, addresses, starts) followed by
a float64 `params` array of shape (num_vertices, num_params) and the type's `template` values. Vertex v's field f occupies
`addresses[starts[v]:starts[v+1]]`, positions in that field's arena (the memory of the IPU in the
dtype of the field). Kernels iterate `for v in prange(params.shape[0])`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from numba import njit

from .mapping import TILE_DTYPE, expand_runs, readonly, run_holding
from .tensor import Tensor, Variable


class LocalityError(ValueError):
    """A vertex was connected to data that does not live on its tile."""


@dataclass(frozen=True, eq=False)
class VertexType:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kernel: Callable
    # cycles(sizes: {field: int64 array}, params: (n, num_params) float64, dtype, target) -> int64 array (n,),
    # the cycles of each vertex on one worker, or of the whole tile for a supervisor vertex
    cycles: Callable
    num_params: int = 0
    # A supervisor vertex occupies every worker of its tile: its estimate is tile cycles.
    supervisor: bool = False
    # Compile-time arguments of a templated codelet (a Poplar vertex class template), passed to
    # the kernel after the parameters: each instantiation is a vertex type of its own, with its
    # own code on a tile, and costs no vertex state.
    template: tuple = ()

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.inputs + self.outputs))

    def __repr__(self):
        return f"VertexType({self.name})"


def _one_value(column: np.ndarray) -> np.ndarray:
    """`column` as its one value broadcast when all its values are equal (no memory), else itself."""
    if column.ndim != 1 or column.size < 2 or column.strides[0] == 0 or column[0] != column[-1] \
            or not (column == column[0]).all():
        return column
    return np.broadcast_to(column[:1].copy(), column.shape)


@dataclass(eq=False)
class Field:
    """What one field of every vertex of a table connects: vertex v views variable
    `variables[var[v]]`, elements `starts[k] .. starts[k] + lengths[k] - 1` for the pieces
    k in `offsets[v] .. offsets[v+1] - 1`, in that order."""
    variables: tuple[Variable, ...]
    var: np.ndarray      # (n,) int32
    offsets: np.ndarray  # (n + 1,) int64
    starts: np.ndarray   # (pieces,) int64
    lengths: np.ndarray  # (pieces,) int64

    def __post_init__(self):
        # a column holding one value throughout (every vertex on one variable, runs of one
        # length: most of a model's fields) is kept as that value broadcast, read-only; such
        # columns were a third of a 12-layer encoder's vertex tables
        self.var, self.lengths = _one_value(self.var), _one_value(self.lengths)

    @property
    def num_vertices(self) -> int:
        return self.var.size

    @property
    def dtype(self) -> np.dtype:
        return self.variables[0].dtype

    def sizes(self) -> np.ndarray:
        """Elements each vertex connects."""
        ends = np.concatenate(([0], np.cumsum(self.lengths)))
        return ends[self.offsets[1:]] - ends[self.offsets[:-1]]

    def elements(self) -> np.ndarray:
        """Every connected element in vertex order, as flat indices into its variable."""
        return expand_runs(self.starts, self.lengths)

    def element_vars(self) -> np.ndarray:
        """For every connected element, the index of its variable in `variables`."""
        return np.repeat(self.var, self.sizes())

    def by_variable(self, which: np.ndarray):
        """(k, variable, positions i with which[i] == k) for every variable k of the field, from
        one stable sort of `which` (a variable index per element or per run)."""
        if len(self.variables) == 1:
            yield 0, self.variables[0], slice(None)
            return
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(len(self.variables) + 1))
        for k, v in enumerate(self.variables):
            yield k, v, order[bounds[k]:bounds[k + 1]]

    # ---- building ---------------------------------------------------------------------------
    @staticmethod
    def of(t: Tensor) -> "Field":
        """One vertex connecting the view `t`."""
        if t.span is not None:
            return Field.strided(t, [0], min(1, t.numel), [t.numel])
        return Field.at(t, np.arange(t.numel), [0, t.numel])

    @staticmethod
    def at(t: Tensor, positions: np.ndarray, offsets: np.ndarray) -> "Field":
        """Vertex v connects the flat elements `positions[offsets[v]:offsets[v+1]]` of the view."""
        elements = t.elements_at(np.asarray(positions, np.int64).reshape(-1))
        return Field.from_elements([t.var], np.zeros(len(offsets) - 1, np.int32), elements, offsets)

    @staticmethod
    def strided(t: Tensor, starts, counts, lengths, strides=0) -> "Field":
        """Vertex v connects `counts[v]` runs of `lengths[v]` flat positions of the view, the
        j-th from position `starts[v] + j * strides[v]` (a row block of a matrix, a box of a grid)."""
        starts, counts, lengths, strides = np.broadcast_arrays(*(np.asarray(a, np.int64).reshape(-1)
                                                                 for a in (starts, counts, lengths, strides)))
        offsets = np.concatenate(([0], np.cumsum(counts)))
        j = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], counts)
        first = np.repeat(starts, counts) + j * np.repeat(strides, counts)
        length = np.repeat(lengths, counts)
        span = t.span
        if span is not None:
            return Field.from_runs([t.var], np.zeros(counts.size, np.int32), first + span, length, offsets)
        return Field.from_positions(t, first, length, offsets)

    @staticmethod
    def from_positions(t: Tensor, starts, lengths, offsets) -> "Field":
        """Vertex v connects the runs of the view's flat positions `starts[k]`, `lengths[k]` for k
        in `offsets[v] .. offsets[v+1] - 1`, in that order (work per run of the view's elements)."""
        offsets = np.asarray(offsets, np.int64)
        k, first, length = t.runs_at(starts, lengths)
        owner = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))[k]  # vertex of each element run
        counts = np.bincount(owner, minlength=offsets.size - 1)
        return Field.from_runs([t.var], 0, first, length, np.concatenate(([0], np.cumsum(counts)))).merged()

    @staticmethod
    def from_elements(variables, var: np.ndarray, elements: np.ndarray, offsets: np.ndarray) -> "Field":
        """Vertex v connects `elements[offsets[v]:offsets[v+1]]` of its variable, compressed
        into runs of consecutive elements."""
        elements = np.asarray(elements, np.int64)
        offsets = np.asarray(offsets, np.int64)
        n = elements.size
        cut = np.ones(n, bool)
        cut[1:] = np.diff(elements) != 1
        bounds = offsets[:-1][offsets[:-1] < n]
        cut[bounds] = True
        first = np.flatnonzero(cut)
        lengths = np.diff(np.append(first, n))
        return Field.from_runs(variables, var, elements[first], lengths, np.searchsorted(first, offsets))

    @staticmethod
    def from_runs(variables, var, starts, lengths, offsets=None) -> "Field":
        """Vertex v connects the runs `offsets[v] .. offsets[v+1] - 1` (one run per vertex by default)."""
        starts = np.asarray(starts, np.int64).reshape(-1)
        lengths = np.broadcast_to(np.asarray(lengths, np.int64), starts.shape).copy()
        n = starts.size if offsets is None else len(offsets) - 1
        offsets = np.arange(n + 1, dtype=np.int64) if offsets is None else np.asarray(offsets, np.int64)
        var = np.broadcast_to(np.asarray(var, np.int32), (n,)).copy()
        return Field(tuple(variables), var, offsets, starts, lengths)

    def merged(self) -> "Field":
        """The same field with each vertex's touching runs (one ending where the next starts) as one."""
        n = self.starts.size
        if n < 2:
            return self
        cut = np.ones(n, bool)
        cut[1:] = self.starts[1:] != self.starts[:-1] + self.lengths[:-1]
        cut[self.offsets[:-1][self.offsets[:-1] < n]] = True  # every vertex starts a run of its own
        if cut.all():
            return self
        first = np.flatnonzero(cut)
        return Field(self.variables, self.var, np.searchsorted(first, self.offsets), self.starts[first],
                     np.add.reduceat(self.lengths, first))

    @staticmethod
    def concat(parts: list["Field"]) -> "Field":
        if len(parts) == 1:
            return parts[0]
        variables, index, var = [], {}, []
        for f in parts:
            remap = np.empty(len(f.variables), np.int32)
            for k, v in enumerate(f.variables):
                j = index.get(id(v))
                if j is None:
                    j = index[id(v)] = len(variables)
                    variables.append(v)
                remap[k] = j
            var.append(remap[f.var])
        shift = np.cumsum([0] + [f.starts.size for f in parts[:-1]])
        offsets = np.concatenate([[0]] + [f.offsets[1:] + s for f, s in zip(parts, shift)])
        return Field(tuple(variables), np.concatenate(var), offsets,
                     np.concatenate([f.starts for f in parts]), np.concatenate([f.lengths for f in parts]))


@dataclass(eq=False)
class VertexTable:
    """The vertices of one type in one compute set: tile, parameters and fields, one row each.

    `state_params` is how many of a row's parameters the vertex holds in its state on the tile
    (all of them unless the builder says fewer): a general-form codelet serving several ranks (the
    convolution and pooling vertices take three spatial dimensions) is, in Poplar, a vertex
    instantiated for the op's own rank, whose state holds no fields for the unit dimensions the
    general form adds."""
    type: VertexType
    tiles: np.ndarray   # (n,) int32
    params: np.ndarray  # (n, num_params) float64
    fields: dict[str, Field]
    state_params: int | None = None

    def __post_init__(self):
        if self.state_params is None:
            self.state_params = self.type.num_params
        elif not 0 <= self.state_params <= self.type.num_params:
            raise ValueError(f"vertex {self.type.name}: state_params={self.state_params} is outside 0.."
                             f"{self.type.num_params} (the parameters it takes)")

    @property
    def num_vertices(self) -> int:
        return self.tiles.size

    @property
    def dtype(self) -> np.dtype:
        return self.fields[self.type.fields[0]].dtype

    def sizes(self) -> dict[str, np.ndarray]:
        return {f: c.sizes() for f, c in self.fields.items()}

    def variables(self) -> list[Variable]:
        return [v for c in self.fields.values() for v in c.variables]

    def cycles(self, target) -> np.ndarray:
        """Cycles of each vertex (on one worker, or on its whole tile for a supervisor vertex), with
        the target's fixed vertex overhead."""
        n = self.num_vertices
        c = np.asarray(self.type.cycles(self.sizes(), self.params, self.dtype, target))
        if c.shape != (n,):
            raise TypeError(f"the cycle estimator of {self.type.name} returned shape {c.shape} for {n} vertices; "
                            "an estimator returns one number per vertex")
        return c.astype(np.int64) + target.vertex_overhead_cycles

    @staticmethod
    def concat(parts: list["VertexTable"]) -> "VertexTable":
        if len(parts) == 1:
            return parts[0]
        return VertexTable(parts[0].type, np.concatenate([p.tiles for p in parts]),
                           np.concatenate([p.params for p in parts]),
                           {f: Field.concat([p.fields[f] for p in parts]) for f in parts[0].type.fields})


@dataclass(eq=False)
class ComputeSet:
    name: str
    ipu: int
    _parts: dict = field(default_factory=dict, repr=False)  # vertex type -> [VertexTable, ...]

    def add(self, table: VertexTable) -> VertexTable:
        """Add vertices, after checking their fields, parameters and locality."""
        vt = table.type
        missing = set(vt.fields) - set(table.fields)
        extra = set(table.fields) - set(vt.fields)
        if missing or extra:
            raise ValueError(f"vertex {vt.name} in compute set {self.name!r}: fields {sorted(missing)} "
                             f"not connected, unknown fields {sorted(extra)}; expected {list(vt.fields)}")
        n = table.num_vertices
        if table.params.ndim != 2 or table.params.shape[0] != n:
            raise ValueError(f"vertex {vt.name} in compute set {self.name!r}: a parameter matrix of shape "
                             f"{table.params.shape} for {n} vertices; give one row of {vt.num_params} per vertex")
        if table.params.shape[1] != vt.num_params:
            raise ValueError(f"vertex {vt.name} takes {vt.num_params} parameters, got {table.params.shape[1]}")
        for name in vt.fields:
            check_field(table, name, self)
        parts = self._parts.setdefault(vt, [])
        if parts:
            for name in vt.fields:
                if table.fields[name].dtype != parts[0].fields[name].dtype:
                    raise TypeError(f"vertex {vt.name} in compute set {self.name!r}: field {name!r} connects "
                                    f"{table.fields[name].dtype.name} here and {parts[0].fields[name].dtype.name} "
                                    "in earlier vertices; vertices of one type in one compute set share field "
                                    "dtypes: use a separate compute set")
        parts.append(table)
        return table

    @property
    def tables(self) -> list[VertexTable]:
        """One table per vertex type, in the order the types were first added."""
        for key, parts in self._parts.items():
            if len(parts) > 1:
                self._parts[key] = [VertexTable.concat(parts)]
        return [parts[0] for parts in self._parts.values()]

    @property
    def num_vertices(self) -> int:
        return sum(t.num_vertices for parts in self._parts.values() for t in parts)

    def tile_cycles(self, target) -> np.ndarray:
        """Cycles per tile (0 where no vertex runs): a tile's worker vertices spread over its
        workers (longest first) and finish when its busiest worker does; its supervisor vertices
        run one after another, each on the whole tile."""
        out = np.zeros(target.num_tiles, np.int64)
        for supervisor in (False, True):
            tables = [t for t in self.tables if t.type.supervisor == supervisor]
            if not tables:
                continue
            tiles = np.concatenate([t.tiles for t in tables])
            cycles = np.concatenate([t.cycles(target) for t in tables])
            if supervisor:
                out += np.bincount(tiles, weights=cycles, minlength=target.num_tiles).astype(np.int64)
            else:
                out += tile_makespans(tiles, cycles, target.workers_per_tile, target.num_tiles)
        return out

    def __repr__(self):
        return f"ComputeSet({self.name!r}, ipu={self.ipu}, vertices={self.num_vertices})"


def tile_makespans(tiles: np.ndarray, cycles: np.ndarray, workers: int, num_tiles: int) -> np.ndarray:
    """Per tile, the longest-processing-time assignment of its vertices' cycles onto `workers`
    threads: the busiest thread's total (0 for a tile without vertices). All tiles advance
    together: round k gives each tile's k-th longest vertex to its least loaded thread."""
    tiles = np.asarray(tiles, np.int64)
    cycles = np.asarray(cycles, np.int64)
    order = np.lexsort((-cycles, tiles))
    cycles = cycles[order]
    counts = np.bincount(tiles, minlength=num_tiles)
    first = np.cumsum(counts) - counts
    out = np.zeros(num_tiles, np.int64)
    few = (counts > 0) & (counts <= workers)
    out[few] = cycles[first[few]]  # one thread each: the longest vertex
    many = np.flatnonzero(counts > workers)
    if many.size:
        loads = np.zeros((many.size, workers), np.int64)
        for k in range(int(counts[many].max())):
            rows = np.flatnonzero(counts[many] > k)
            least = loads[rows].argmin(axis=1)
            loads[rows, least] += cycles[first[many[rows]] + k]
        out[many] = loads.max(axis=1)
    return out


def check_field(table: VertexTable, name: str, cs: ComputeSet) -> None:
    """Every element a field connects lives on its vertex's tile, of the compute set's IPU."""
    f = table.fields[name]
    what = f"{table.type.name}.{name}"
    if f.num_vertices != table.num_vertices:
        raise ValueError(f"{what}: the field connects {f.num_vertices} vertices, the table has {table.num_vertices}")
    dtypes = {v.dtype for v in f.variables}
    if len(dtypes) > 1:
        raise TypeError(f"{what} connects tensors of dtypes {sorted(d.name for d in dtypes)} in one table; "
                        "vertices of one type in one compute set share field dtypes")
    for v in f.variables:
        if v.ipu != cs.ipu:
            raise LocalityError(f"{what}: tensor {v.name!r} lives on IPU {v.ipu}, the vertex on IPU {cs.ipu}; "
                                "move it with an InterIpuCopy first")
    if _runs_are_local(f, table.tiles):
        return
    elements = f.elements()  # something is not local: find the first element to name it
    tiles = np.empty(elements.size, np.int64)
    for _, v, at in f.by_variable(f.element_vars()):
        tiles[at] = v.mapping.at(elements[at])
    sizes = f.sizes()
    expected = np.repeat(table.tiles, sizes)
    bad = np.flatnonzero(tiles != expected)
    if not bad.size:
        return
    first = int(bad[0])
    ends = np.cumsum(sizes)
    vertex = int(np.searchsorted(ends, first, side="right"))
    begin = int(ends[vertex] - sizes[vertex])
    in_vertex = int(np.count_nonzero(bad < ends[vertex]))
    var = f.variables[f.var[vertex]]
    where = "has no tile mapping" if tiles[first] < 0 else f"lives on tile {int(tiles[first])}"
    raise LocalityError(f"{what}: element {first - begin} of tensor {var.name!r} {where}, but the vertex runs on "
                        f"tile {int(table.tiles[vertex])} ({in_vertex} of {int(sizes[vertex])} elements are not "
                        "local); a vertex only reads its own tile's memory: copy the data to the tile first")


def _runs_are_local(f: Field, tiles: np.ndarray) -> bool:
    """True when every run of the field lies inside one run of its variable's mapping that is on
    the run's vertex's tile: one search per run, nothing per element."""
    if len(f.variables) == 1:
        m = f.variables[0].mapping
        return m.num_runs > 0 and _field_local(readonly(m.starts), readonly(m.tiles, TILE_DTYPE), m.size,
                                               readonly(f.starts), readonly(f.lengths), readonly(f.offsets),
                                               readonly(tiles)) or not f.lengths.any()
    vertex = np.repeat(np.arange(f.num_vertices), np.diff(f.offsets))
    for _, v, at in f.by_variable(f.var[vertex]):
        if not v.mapping.covers(f.starts[at], f.lengths[at], tiles[vertex[at]]).all():
            return False
    return True


@njit(cache=True, nogil=True)
def _field_local(map_starts, map_tiles, size, starts, lengths, offsets, tiles):
    r = 0
    for v in range(offsets.size - 1):
        for k in range(offsets[v], offsets[v + 1]):
            if lengths[k] == 0:
                continue
            if starts[k] < 0 or starts[k] + lengths[k] > size:
                return False
            r = run_holding(map_starts, starts[k], r)
            end = map_starts[r + 1] if r + 1 < map_starts.size else size
            if starts[k] + lengths[k] > end or map_tiles[r] != tiles[v]:
                return False
    return True
