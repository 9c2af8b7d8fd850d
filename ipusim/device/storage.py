"""Tile memory of each IPU, laid out for one of the two execution modes.

The memory of an IPU is one arena per dtype. Every element of every variable has one address.
- strict layout: tile-major. Tile t owns one contiguous segment of each arena; inside it, the
  elements of each variable mapped to t. A vertex is given addresses inside its own tile's
  segment only, so it can only compute from its tile's data.
- fast layout: variable-major. Each variable is one contiguous block, so whole-tensor kernels
  (NumPy/BLAS) read and write it in place without gathering. With `share` (an Engine's
  `share_storage`), temporaries share one region of the arena by liveness, as Poplar's tensors
  share memory (`temporaries`, `pack`); every other variable has a block of its own.
Both layouts hold the same values; only the addresses differ.

Sharing in the fast layout. A variable is a temporary when it is not always live, holds no
constant, the host does not read or write it between programs (`host_access`), no stream or
branch condition touches it, and every program that touches it sets all of it before reading
it (its first touch in the program is an op's output, a copy's destination or a load from
Streaming Memory covering the whole variable, not inside a branch): its value
never crosses a program's bounds, so it matters only from the first step of a run that touches
it to the last. The steps a program runs in the fast mode (an op's kernel being one) are
numbered in order, both branches of an If in turn; a variable touched inside a Repeat of more
than one iteration, or inside a Parallel (whose parts run at once, on host threads), lives over
the whole Repeat or Parallel. With the programs' steps laid end to end, temporaries whose step
ranges never meet share addresses (`pack`). All the programs with temporaries on an IPU use the
same region, so they must not run at once: `DeviceMemory.exclusive` holds the lock of each such
IPU, which a run of the program takes. The host can neither read nor write a temporary (it has
no value outside a run): `DeviceMemory.check_host_access` says so.
"""
from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, field

import numpy as np

from .graph import Device, Graph
from .program import (Copy, CrossReplicaCopy, Execute, If, InterIpuCopy, OpProgram, Parallel, Program, RemoteCopy,
                      Repeat, Sequence, StreamCopy, walk)
from .tensor import Tensor, Variable
from .vertex import Field

LAYOUTS = ("strict", "fast")


def zeroed(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros in a fresh anonymous mapping for storage that lives as long as the device, its pages
    populated at once (Linux): one call that maps them is cheaper than the page fault per 4 KB
    page that the device's first run would otherwise take, and, unlike NumPy's large arrays,
    the mapping asks for no transparent huge pages, whose first touch stalls where the kernel
    must compact memory to find them (measured: a 12-layer encoder's first run spent 12-14 s in
    page faults on its 4 GB of storage either way; populated, 8 s at allocation)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype)
    size = count * dtype.itemsize
    try:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    except (AttributeError, TypeError):  # no mapping flags on this platform (Windows): its default mapping
        buf = mmap.mmap(-1, size)
    return np.frombuffer(buf, dtype, count).reshape(shape)


def _whole(t: Tensor) -> bool:
    """Whether a write to the view sets every element of its variable."""
    return t.numel == t.var.numel and t.distinct


def _accesses(node: Program) -> list[tuple[Variable, bool]]:
    """(variable, whether the access sets all of it without reading it) for every access of a
    leaf node the fast mode runs, in order. An op's kernel reads its inputs, then touches what
    its body touches in the body's order (the ops it is made of set or read their variables;
    to be safe, any other node of the body reads), then sets its outputs. A compute set outside
    an op, a stream or a branch condition is never taken to set a whole variable."""
    if isinstance(node, OpProgram):
        read = {t.var.id for t in node.reads}
        out = [(t.var, False) for t in node.reads]
        for inner, conditional in _leaves(node.body):
            sets = isinstance(inner, OpProgram) and not conditional
            out += [(v, whole and sets) for v, whole in _accesses(inner)]
        return out + [(t.var, t.var.id not in read and _whole(t)) for t in node.writes]
    if isinstance(node, Execute):
        return [(v, False) for table in node.compute_set.tables for v in table.variables()]
    if isinstance(node, (Copy, InterIpuCopy)):
        return [(node.src.var, False), (node.dst.var, node.src.var is not node.dst.var and _whole(node.dst))]
    if isinstance(node, CrossReplicaCopy):
        return [(node.src.var, False), (node.dst.var, False)]
    if isinstance(node, RemoteCopy):
        return [(node.tensor.var, node.loads and _whole(node.tensor))]
    if isinstance(node, StreamCopy):
        return [(node.tensor.var, False)]
    if isinstance(node, _Read):
        return [(node.var, False)]
    return []


def _leaves(program: Program, conditional: bool = False):
    """(leaf node, whether it may not run) for the leaves of a program in order, an op being
    one leaf; an If's condition is read, its branches may not run, nor a Repeat of no iteration."""
    if not isinstance(program, (Sequence, Repeat, If, Parallel)):
        yield program, conditional
        return
    if isinstance(program, If):
        yield _Read(program.predicate.var), conditional
    conditional = conditional or isinstance(program, If) or (isinstance(program, Repeat) and program.count < 1)
    for c in program.children():
        yield from _leaves(c, conditional)


@dataclass(eq=False)
class _Read(Program):
    """A read of a variable outside any program node (an If's condition)."""
    var: Variable


@dataclass
class Steps:
    """How one program's run touches variables, in the fast mode."""
    count: int = 0                                              # steps of a run (leaf nodes, in order)
    ranges: dict[int, list[int]] = field(default_factory=dict)  # variable id -> [first, last] step
    pinned: set[int] = field(default_factory=set)               # touched by a stream or a branch condition
    fresh: set[int] = field(default_factory=set)                # first touched by a step that sets all of it
                                                                # on every run (its value on entry is dead)


def program_steps(program: Program) -> Steps:
    """The steps of a run of `program` (both branches of an If in turn) and the variables they
    touch; a variable touched inside a Repeat of more than one iteration or inside a Parallel
    lives over the whole Repeat or Parallel."""
    out = Steps()

    def touch(ids, first: int, last: int) -> None:
        for i in ids:
            r = out.ranges.get(i)
            if r is None:
                out.ranges[i] = [first, last]
            else:
                r[0], r[1] = min(r[0], first), max(r[1], last)

    def visit(p: Program, conditional: bool) -> set[int]:
        if not isinstance(p, (Sequence, Repeat, If, Parallel)):
            ids = set()
            for v, sets in _accesses(p):
                if v.id not in out.ranges and sets and not conditional:
                    out.fresh.add(v.id)
                ids.add(v.id)
            if isinstance(p, (StreamCopy, CrossReplicaCopy)):
                out.pinned.update(ids)
            touch(ids, out.count, out.count)
            out.count += 1
            return ids
        first, ids = out.count, set()
        if isinstance(p, If):
            ids.add(p.predicate.var.id)
            out.pinned.add(p.predicate.var.id)
            touch(ids, first, first)
        for c in p.children():
            ids |= visit(c, conditional or isinstance(p, If) or (isinstance(p, Repeat) and p.count < 1))
        if isinstance(p, Parallel) or (isinstance(p, Repeat) and p.count > 1):
            touch(ids, first, max(first, out.count - 1))
        return ids

    visit(program, False)
    return out


def temporaries(programs: list[Program], variables: list[Variable]) -> tuple[dict[int, dict[int, list[int]]], list[int]]:
    """Variable id -> {program index: [first, last] step} of the variables among `variables`
    whose values never cross a program's bounds (module docstring), and the steps of each
    program."""
    candidates = {v.id for v in variables if not (v.always_live or v.host_access) and v.constant is None}
    found: dict[int, dict[int, list[int]]] = {}
    excluded: set[int] = set()
    counts = []
    for index, program in enumerate(programs):
        steps = program_steps(program)
        counts.append(steps.count)
        excluded |= steps.pinned
        for vid, r in steps.ranges.items():
            if vid not in candidates:
                continue
            if vid not in steps.fresh:
                excluded.add(vid)
            found.setdefault(vid, {})[index] = r
    return {vid: r for vid, r in found.items() if vid not in excluded}, counts


def pack(firsts, lasts, sizes, owners=None) -> tuple[np.ndarray, int]:
    """Offsets for blocks of `sizes` elements such that no two blocks live at one step overlap,
    and the extent they span. Block b lives over steps firsts[i] .. lasts[i] for every i with
    owners[i] == b (default: interval i is block i's only one). The largest blocks are placed
    first, each at the lowest offset clear of the blocks already placed whose steps meet its own."""
    firsts, lasts, sizes = (np.asarray(a, np.int64) for a in (firsts, lasts, sizes))
    owners = np.arange(firsts.size) if owners is None else np.asarray(owners, np.int64)
    n = sizes.size
    offsets = np.zeros(n, np.int64)
    placed = np.zeros(n, bool)
    by_block = np.argsort(owners, kind="stable")
    bounds = np.searchsorted(owners[by_block], np.arange(n + 1))
    extent = 0
    for k in np.lexsort((np.arange(n), -sizes)):
        meet = np.zeros(firsts.size, bool)
        for i in by_block[bounds[k]:bounds[k + 1]]:
            meet |= (firsts <= lasts[i]) & (lasts >= firsts[i])
        near = np.zeros(n, bool)
        near[owners[meet]] = True
        near &= placed
        off = 0
        if near.any():
            lo, hi = offsets[near], offsets[near] + sizes[near]
            order = np.argsort(lo, kind="stable")
            lo, hi = lo[order], hi[order]
            reach = np.maximum.accumulate(hi)       # end of the blocks placed below each start
            gaps = np.concatenate(([lo[0]], lo[1:] - reach[:-1]))
            fits = np.flatnonzero(gaps >= sizes[k])
            off = int(0 if fits.size and fits[0] == 0 else reach[fits[0] - 1]) if fits.size else int(reach[-1])
        offsets[k] = off
        placed[k] = True
        extent = max(extent, off + int(sizes[k]))
    return offsets, extent


class MappingError(ValueError):
    """A tensor has elements without a tile mapping when the graph is compiled."""


class IpuMemory:
    def __init__(self, graph: Graph, layout: str, internal: dict[int, str] | None = None,
                 packed: dict[int, int] | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown memory layout {layout!r}; use one of {LAYOUTS}")
        self.ipu = graph.ipu
        self.layout = layout
        self.arenas: dict[np.dtype, np.ndarray] = {}
        self.offset: dict[int, int] = {}          # fast layout: variable id -> first address
        self.addr: dict[int, np.ndarray] = {}     # strict layout: variable id -> address per element
        self.tile_segments: dict[str, np.ndarray] = {}  # strict: dtype -> start address of each tile (+ end)
        # fast layout: variables internal to an op (variable id -> op name) have no storage
        self.internal = (internal or {}) if layout == "fast" else {}
        # fast layout: programs' temporaries (variable id -> address in the region they share,
        # which follows the other variables' blocks)
        self.packed = (packed or {}) if layout == "fast" else {}
        # fast layout: (variable id, offset, shape, strides) -> (NumPy view of the arena, whether
        # it may be written: no element twice); a program reads and writes the same views on
        # every run, and making a view costs more than looking it up
        self._views: dict[tuple, tuple[np.ndarray, bool]] = {}
        # Streaming Memory: one host array per remote buffer, outside the tile arenas
        self.remote = {b.name: zeroed((b.repeats, int(np.prod(b.shape, dtype=np.int64))), b.dtype)
                       for b in graph.remote_buffers.values()}
        by_dtype: dict[np.dtype, list[Variable]] = {}
        for v in graph.variables:
            n = v.mapping.unmapped()
            if n:
                raise MappingError(f"tensor {v.name!r} on IPU {v.ipu} has {n} of {v.numel} elements without a "
                                   "tile mapping: call setTileMapping (or a mapping helper) for all of it")
            by_dtype.setdefault(v.dtype, []).append(v)
        for dt, vars_ in by_dtype.items():
            if layout == "fast":
                stored = [v for v in vars_ if v.id not in self.internal and v.id not in self.packed]
                off = 0
                for v in stored:
                    self.offset[v.id] = off
                    off += v.numel
                region = [v for v in vars_ if v.id in self.packed]
                for v in region:
                    self.offset[v.id] = off + self.packed[v.id]
                size = max((self.packed[v.id] + v.numel for v in region), default=0)
                self.arenas[dt] = zeroed((off + size,), dt)
            else:
                self.arenas[dt] = zeroed((sum(v.numel for v in vars_),), dt)
                self._strict_addresses(dt, vars_, graph.target.total_tiles)
        for v in graph.variables:
            if v.constant is not None and v.id not in self.internal:
                self.write(Tensor(v), v.constant)

    def _strict_addresses(self, dt: np.dtype, vars_: list[Variable], num_tiles: int) -> None:
        tiles = np.concatenate([v.mapping.dense(np.int64) for v in vars_])
        owner = np.concatenate([np.full(v.numel, k, dtype=np.int64) for k, v in enumerate(vars_)])
        flat = np.concatenate([np.arange(v.numel, dtype=np.int64) for v in vars_])
        order = np.lexsort((flat, owner, tiles))  # tile-major, then variable, then element
        addr = np.empty_like(order)
        addr[order] = np.arange(order.size, dtype=np.int64)
        start = 0
        for v in vars_:
            self.addr[v.id] = addr[start:start + v.numel]
            start += v.numel
        counts = np.bincount(tiles, minlength=num_tiles)
        self.tile_segments[dt.name] = np.concatenate([[0], np.cumsum(counts)])

    # ---- addresses and access --------------------------------------------------------------
    def addresses(self, t: Tensor) -> np.ndarray:
        """Arena address of every element of the view, flattened."""
        v = t.var
        if self.layout == "fast":
            base = self._offset(v)
            span = t.span
            if span is not None:
                return np.arange(base + span, base + span + t.numel, dtype=np.int64)
            return np.add(t.index.reshape(-1), base, dtype=np.int64)  # indices may be int32
        return t.on(self.addr[v.id]).reshape(-1)

    def view(self, t: Tensor) -> np.ndarray | None:
        """The view's storage as a NumPy view of its arena (fast layout, strided view), else None."""
        strided = self._strided(t)
        return None if strided is None else strided[0]

    def _strided(self, t: Tensor) -> tuple[np.ndarray, bool] | None:
        """(NumPy view of the arena, whether writes through it are well defined) of a strided
        view in the fast layout, else None."""
        if self.layout != "fast" or not t.strided:
            return None
        key = (t.var.id, t.offset, t.shape, t.strides)
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = (t.on(self.arenas[t.var.dtype], self._offset(t.var)), t.distinct)
        return found

    def field_addresses(self, f: Field) -> np.ndarray:
        """Arena address of every element a vertex field connects, in vertex order."""
        elements = f.elements()
        if len(f.variables) == 1:
            return self._element_addresses(f.variables[0], elements)
        out = np.empty(elements.size, np.int64)
        for _, v, at in f.by_variable(f.element_vars()):
            out[at] = self._element_addresses(v, elements[at])
        return out

    def _element_addresses(self, v: Variable, elements: np.ndarray) -> np.ndarray:
        if self.layout == "fast":
            return elements + self._offset(v)
        return self.addr[v.id][elements]

    def _offset(self, v: Variable) -> int:
        try:
            return self.offset[v.id]
        except KeyError:
            if v.id in self.internal:
                raise ValueError(f"tensor {v.name!r} is internal to op {self.internal[v.id]!r}: the fast mode runs "
                                 "the op as one whole-tensor kernel and keeps no values for it; use an Engine in "
                                 "mode='strict' to read it") from None
            raise

    def arena(self, dtype) -> np.ndarray:
        return self.arenas[np.dtype(dtype)]

    def read(self, t: Tensor) -> np.ndarray:
        """The view's values: a NumPy view of the storage in the fast layout when the view is
        strided (do not modify), else a copy."""
        view = self.view(t)
        if view is not None:
            return view
        if self.layout == "fast" and t._flat is not None:  # a reshape of a strided view: NumPy's copy of it
            return self.read(t._flat).reshape(t.shape)
        return self.arenas[t.var.dtype][self.addresses(t)].reshape(t.shape)

    def output(self, t: Tensor) -> np.ndarray | None:
        """A writeable NumPy view of the view's storage (fast layout, strided, no element twice),
        for a kernel to compute into (`out=`) instead of writing a result; else None."""
        strided = self._strided(t)
        return strided[0] if strided is not None and strided[1] else None

    def write(self, t: Tensor, values) -> None:
        arena = self.arenas[t.var.dtype]
        values = np.asarray(values)
        if values.shape != t.shape:
            try:
                values = np.broadcast_to(values, t.shape)
            except ValueError:
                raise ValueError(f"cannot write values of shape {values.shape} to tensor {t.name!r} "
                                 f"of shape {t.shape}") from None
        view = self.output(t)
        if view is not None:
            view[...] = values
        elif self.layout == "fast" and t._flat is not None:
            self.write(t._flat, values.reshape(t._flat.shape))
        else:
            arena[self.addresses(t)] = values.reshape(-1)


class DeviceMemory:
    """The memories of all IPUs of a device; reads and writes go to the tensor's IPU. With
    `share` (fast layout), the temporaries of `programs` share storage (module docstring)."""

    def __init__(self, device: Device, layout: str, internal: dict[int, str] | None = None,
                 programs: list[Program] = (), share: bool = False):
        self.layout = layout
        internal = internal or {}
        packed: list[dict[int, int]] = [{} for _ in device.graphs]
        # program index -> the locks of the IPUs whose shared region it uses with other programs
        self.exclusive: list[tuple[threading.Lock, ...]] = [() for _ in programs]
        self.owner: dict[int, list[int]] = {}   # a temporary's variable id -> the programs that use it
        if share and layout == "fast":
            variables = [v for g in device.graphs for v in g.variables if v.id not in internal]
            found, counts = temporaries(list(programs), variables)
            base = np.concatenate(([0], np.cumsum(counts)))   # the programs' steps on one line
            self.owner = {vid: sorted(runs) for vid, runs in found.items()}
            groups: dict[tuple, list[Variable]] = {}
            for v in variables:
                if v.id in found:
                    groups.setdefault((v.ipu, v.dtype), []).append(v)
            users: dict[int, set[int]] = {}
            for (ipu, _), vars_ in groups.items():
                runs = [(k, base[index] + r[0], base[index] + r[1])
                        for k, v in enumerate(vars_) for index, r in found[v.id].items()]
                owners, firsts, lasts = zip(*runs)
                offsets, _ = pack(firsts, lasts, [v.numel for v in vars_], owners)
                packed[ipu].update(zip((v.id for v in vars_), offsets.tolist()))
                users.setdefault(ipu, set()).update(index for v in vars_ for index in found[v.id])
            locks = {ipu: threading.Lock() for ipu, indices in users.items() if len(indices) > 1}
            for ipu, lock in sorted(locks.items()):
                for index in sorted(users[ipu]):
                    self.exclusive[index] += (lock,)
        self.ipus = [IpuMemory(g, layout, internal, packed[k]) for k, g in enumerate(device.graphs)]
        # id(tensor) -> (tensor, its NumPy view or None when it has none, whether the view may be
        # written): the ops of a program read and write the same tensor objects on every run
        self._seen: dict[int, tuple[Tensor, np.ndarray | None, bool]] = {}

    def check_host_access(self, t: Tensor, what: str) -> None:
        """A ValueError when `t` is a temporary sharing storage: the host has no value to read
        or write for it outside its program's run."""
        indices = self.owner.get(t.var.id)
        if indices is not None:
            raise ValueError(f"{what}: tensor {t.name!r} is a temporary of program(s) {indices} (not always live, each "
                             "program sets all of it before reading it): in the fast mode it shares storage with "
                             "other temporaries by liveness and holds no value between runs. Make it always live "
                             "(always_live=True), or build the Engine with share_storage=False or mode='strict', to "
                             "read or write it")

    def __getitem__(self, ipu: int) -> IpuMemory:
        return self.ipus[ipu]

    def _view_of(self, t: Tensor) -> tuple[Tensor, np.ndarray | None, bool]:
        seen = self._seen.get(id(t))
        if seen is None or seen[0] is not t:
            strided = self.ipus[t.ipu]._strided(t)
            seen = self._seen[id(t)] = (t, None, False) if strided is None else (t, *strided)
        return seen

    def read(self, t: Tensor) -> np.ndarray:
        view = self._view_of(t)[1]
        return view if view is not None else self.ipus[t.ipu].read(t)

    def output(self, t: Tensor) -> np.ndarray | None:
        _, view, writeable = self._view_of(t)
        return view if writeable else None

    def write(self, t: Tensor, values) -> None:
        _, view, writeable = self._view_of(t)
        if writeable and np.shape(values) == view.shape:
            view[...] = values
        else:
            self.ipus[t.ipu].write(t, values)
