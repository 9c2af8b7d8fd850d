"""Tile memory of each IPU, laid out for one of the two execution modes.

The memory of an IPU is one arena per dtype. Every element of every variable has one address.
- strict layout: tile-major. Tile t owns one contiguous segment of each arena; inside it, the
  elements of each variable mapped to t. A vertex is given addresses inside its own tile's
  segment only, so it can only compute from its tile's data.
- fast layout: variable-major. Each variable is one contiguous block, so whole-tensor kernels
  (NumPy/BLAS) read and write it in place without gathering.
Both layouts hold the same values; only the addresses differ.
"""
from __future__ import annotations

import mmap

import numpy as np

from .graph import Device, Graph
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


class MappingError(ValueError):
    """A tensor has elements without a tile mapping when the graph is compiled."""


class IpuMemory:
    def __init__(self, graph: Graph, layout: str, internal: dict[int, str] | None = None):
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
            stored = [v for v in vars_ if v.id not in self.internal]
            self.arenas[dt] = zeroed((sum(v.numel for v in stored),), dt)
            if layout == "fast":
                vars_ = stored
                off = 0
                for v in vars_:
                    self.offset[v.id] = off
                    off += v.numel
            else:
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
    """The memories of all IPUs of a device; reads and writes go to the tensor's IPU."""

    def __init__(self, device: Device, layout: str, internal: dict[int, str] | None = None):
        self.layout = layout
        self.ipus = [IpuMemory(g, layout, internal) for g in device.graphs]
        # id(tensor) -> (tensor, its NumPy view or None when it has none, whether the view may be
        # written): the ops of a program read and write the same tensor objects on every run
        self._seen: dict[int, tuple[Tensor, np.ndarray | None, bool]] = {}

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
