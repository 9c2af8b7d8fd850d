"""Graphs: the tensors, tile mappings, compute sets and streams of one IPU; a Device holds several.

The Poplar-style names (`addVariable`, `setTileMapping`, ...) are the API; snake_case helpers
(`map_linearly`, ...) are the mapping utilities PopLibs users know from `poputil`.
"""
from __future__ import annotations

import math

import numpy as np

from .program import DataStream, RemoteBuffer
from .target import GC200, Target
from .tensor import Tensor, Variable, as_dtype
from .vertex import ComputeSet, Field, VertexTable, VertexType


class Graph:
    """Everything that lives on one IPU."""

    def __init__(self, target: Target = GC200, ipu: int = 0, device: "Device | None" = None):
        self.target = target
        self.ipu = ipu
        self.device = device
        self.variables: list[Variable] = []
        self.compute_sets: list[ComputeSet] = []
        self.streams: dict[str, DataStream] = {}
        self.remote_buffers: dict[str, RemoteBuffer] = {}
        self._names: dict[str, int] = {}
        self._recording: list | None = None   # replay.record: what the graph makes, in order

    def _unique(self, name: str) -> str:
        n = self._names.get(name, 0)
        self._names[name] = n + 1
        return name if n == 0 else f"{name}#{n}"

    # ---- tensors --------------------------------------------------------------------------
    def addVariable(self, dtype, shape, name: str = "var", *, category: str = "other",
                    always_live: bool = True) -> Tensor:
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"variable {name!r}: negative dimension in shape {shape}")
        var = Variable(self._unique(name), as_dtype(dtype), shape, self.ipu, always_live, category)
        self.variables.append(var)
        if self._recording is not None:
            self._recording.append(var)
        return Tensor(var)

    def clone(self, t: Tensor, name: str | None = None, *, dtype=None, category: str | None = None,
              always_live: bool | None = None) -> Tensor:
        """A new variable shaped like the view, each element on the same tile as the view's."""
        c = self.addVariable(dtype or t.dtype, t.shape, name or f"{t.name}/clone",
                             category=category or t.var.category,
                             always_live=t.var.always_live if always_live is None else always_live)
        c.var.mapping = t.tile_map()
        return c

    def addConstant(self, dtype, shape, value, name: str = "const") -> Tensor:
        t = self.addVariable(dtype, shape, name, category="constants")
        arr = np.broadcast_to(np.asarray(value, dtype=as_dtype(dtype)), t.shape)
        t.var.constant = np.array(arr, order="C", copy=True)
        return t

    # ---- tile mapping ---------------------------------------------------------------------
    def _check_tile(self, tile: int) -> int:
        if not 0 <= int(tile) < self.target.total_tiles:
            raise ValueError(f"tile {tile} does not exist: {self.target.name} has tiles 0..{self.target.total_tiles - 1}")
        return int(tile)

    @property
    def io_tiles(self) -> range:
        """The IPU's IO tiles (after its compute tiles; empty without IO tiles)."""
        return range(self.target.num_tiles, self.target.total_tiles)

    def _own(self, t: Tensor) -> None:
        if t.var not in self.variables:
            raise ValueError(f"tensor {t.name!r} belongs to IPU {t.ipu}'s graph, not IPU {self.ipu}'s")

    def setTileMapping(self, t: Tensor, tile: int) -> None:
        """Map every element of the view to one tile."""
        self._own(t)
        tile = self._check_tile(tile)
        self.map_positions(t, [0], [t.numel], [tile])

    def setTileMappingIntervals(self, t: Tensor, intervals) -> None:
        """Map flat element intervals of the view: `[(tile, begin, end), ...]`, end exclusive."""
        intervals = np.asarray(list(intervals), np.int64).reshape(-1, 3)
        tiles, begin, end = intervals.T
        n = t.numel
        bad = np.flatnonzero((begin < 0) | (begin > end) | (end > n))
        if bad.size:
            raise ValueError(f"interval [{begin[bad[0]]}, {end[bad[0]]}) is outside tensor {t.name!r} of {n} elements")
        self.map_positions(t, begin, end - begin, tiles)

    def map_positions(self, t: Tensor, starts, lengths, tiles) -> None:
        """Map runs of the view's flat positions: positions `starts[k] .. starts[k] + lengths[k] - 1`
        to `tiles[k]`, in work proportional to the runs (and the view's own runs)."""
        self._own(t)
        tiles = np.asarray(tiles)
        wrong = np.flatnonzero((tiles < 0) | (tiles >= self.target.total_tiles))
        if wrong.size:
            self._check_tile(int(tiles.reshape(-1)[wrong[0]]))
        t.map_positions(starts, lengths, tiles)

    def getTileMapping(self, t: Tensor) -> list[list[tuple[int, int]]]:
        """Per tile, the list of [begin, end) intervals of the view's flat elements on it."""
        m = t.tile_map()
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.target.total_tiles)]
        for b, n, tile in zip(m.starts.tolist(), m.lengths.tolist(), m.tiles.tolist()):
            if tile >= 0:
                out[tile].append((b, b + n))
        return out

    def map_linearly(self, t: Tensor, grain: int = 1, min_elements_per_tile: int = 1,
                     tiles: range | None = None) -> None:
        """Spread the view's elements evenly over tiles in contiguous chunks of `grain` elements."""
        tiles = tiles if tiles is not None else range(self.target.num_tiles)
        n = t.numel
        if n == 0:
            return
        grains = -(-n // grain)
        per_tile = max(-(-grains // len(tiles)), -(-min_elements_per_tile // grain))
        chunk = per_tile * grain
        starts = np.arange(0, n, chunk, dtype=np.int64)
        self.map_positions(t, starts, np.minimum(chunk, n - starts), np.asarray(tiles)[:starts.size])

    def map_by_dimension(self, t: Tensor, dim: int, tiles: range | None = None) -> None:
        """Give every slice along `dim` to one tile, spreading the slices evenly over tiles."""
        tiles = np.asarray(tiles if tiles is not None else range(self.target.num_tiles))
        size = t.shape[dim]
        if not t.numel:
            return
        per = -(-size // len(tiles))
        inner = t.numel // math.prod(t.shape[:dim + 1])
        slices = np.arange(t.numel // inner, dtype=np.int64)  # runs of `inner` positions, each in one slice
        self.map_positions(t, slices * inner, inner, tiles[(slices % size) // per])

    # ---- compute sets, vertices, streams ---------------------------------------------------
    def addComputeSet(self, name: str = "cs") -> ComputeSet:
        cs = ComputeSet(self._unique(name), self.ipu)
        self.compute_sets.append(cs)
        if self._recording is not None:
            self._recording.append(cs)
        return cs

    def addVertex(self, cs: ComputeSet, vertex_type: VertexType, tile: int, fields: dict,
                  params: tuple = ()) -> VertexTable:
        """One vertex on `tile`, its fields connected to the views in `fields`."""
        params = np.asarray(params, dtype=np.float64).reshape(1, -1)
        return self.addVertices(cs, vertex_type, [tile], {f: Field.of(t) for f, t in fields.items()}, params)

    def addVertices(self, cs: ComputeSet, vertex_type: VertexType, tiles, fields: dict[str, Field],
                    params=None, state_params: int | None = None) -> VertexTable:
        """Vertices of one type: vertex v on `tiles[v]`, row v of `params` (num_vertices x
        num_params) and row v of every field (see `Field`); `state_params`: how many of a row's
        parameters its vertex state holds (all of them by default; see `VertexTable`)."""
        if cs.ipu != self.ipu:
            raise ValueError(f"compute set {cs.name!r} belongs to IPU {cs.ipu}, not IPU {self.ipu}")
        tiles = np.asarray(tiles, dtype=np.int32).reshape(-1)
        bad = (tiles < 0) | (tiles >= self.target.num_tiles)
        if bad.any():
            tile = int(tiles[bad][0])
            if self.target.num_tiles <= tile < self.target.total_tiles:
                raise ValueError(f"vertex {vertex_type.name} on tile {tile}, an IO tile of {self.target.name}: IO tiles "
                                 f"(from {self.target.num_tiles}) hold host transfers and run no vertices")
            self._check_tile(tile)
        n = tiles.size
        if params is None:
            if vertex_type.num_params:
                raise ValueError(f"vertex {vertex_type.name} takes {vertex_type.num_params} parameters: pass params=")
            params = np.zeros((n, 0))
        params = np.asarray(params, dtype=np.float64)
        if params.ndim == 1 and params.size == vertex_type.num_params:
            params = np.broadcast_to(params, (n, params.size))
        return cs.add(VertexTable(vertex_type, tiles, np.ascontiguousarray(params), dict(fields), state_params))

    def _stream(self, name, dtype, shape, direction) -> DataStream:
        if name in self.streams:
            raise ValueError(f"a stream named {name!r} already exists on IPU {self.ipu}")
        s = DataStream(name, as_dtype(dtype), tuple(shape), self.ipu, direction)
        self.streams[name] = s
        if self._recording is not None:
            self._recording.append(None)   # a host stream: what made it cannot be replayed
        return s

    def addRemoteBuffer(self, name: str, dtype, shape, repeats: int = 1) -> RemoteBuffer:
        """Off-chip storage in Streaming Memory with `repeats` slots of `shape`."""
        if name in self.remote_buffers:
            raise ValueError(f"a remote buffer named {name!r} already exists on IPU {self.ipu}")
        if repeats < 1:
            raise ValueError(f"remote buffer {name!r} needs at least one slot, got repeats={repeats}")
        b = RemoteBuffer(name, as_dtype(dtype), tuple(shape), self.ipu, int(repeats))
        self.remote_buffers[name] = b
        if self._recording is not None:
            self._recording.append(None)   # a remote buffer: what made it cannot be replayed
        return b

    def addHostToDeviceFIFO(self, name: str, dtype, shape) -> DataStream:
        return self._stream(name, dtype, shape, "host_to_device")

    def addDeviceToHostFIFO(self, name: str, dtype, shape) -> DataStream:
        return self._stream(name, dtype, shape, "device_to_host")


class Device:
    """Several IPUs of one target, each with its own graph and tile memory.

    `replicas` > 1: the IPUs are one replica standing for that many identical ones, as an estimate
    prices them (the Engine in estimate mode): global syncs span every replica's IPUs and
    `CrossReplicaCopy` reaches the neighbouring replica; nothing can run with values."""

    def __init__(self, target: Target = GC200, num_ipus: int = 1, replicas: int = 1):
        if num_ipus < 1:
            raise ValueError(f"a device needs at least one IPU, got {num_ipus}")
        if replicas < 1:
            raise ValueError(f"a device stands for at least one replica, got {replicas}")
        self.target = target
        self.replicas = int(replicas)
        self.graphs = [Graph(target, i, self) for i in range(num_ipus)]

    @property
    def sync_ipus(self) -> int:
        """The IPUs a global sync spans: every replica's."""
        return self.num_ipus * getattr(self, "replicas", 1)

    @classmethod
    def of(cls, graph_or_device) -> "Device":
        if isinstance(graph_or_device, Device):
            return graph_or_device
        g = graph_or_device
        if g.device is None:
            g.device = dev = cls.__new__(cls)
            dev.target, dev.graphs, dev.replicas = g.target, [g], 1
        return g.device

    @property
    def num_ipus(self) -> int:
        return len(self.graphs)

    def graph(self, ipu: int) -> Graph:
        return self.graphs[ipu]

    def __getitem__(self, ipu: int) -> Graph:
        return self.graphs[ipu]
