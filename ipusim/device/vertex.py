"""Vertices and compute sets.

A `VertexType` bundles a codelet (a Numba kernel), its cycle estimator and its field roles. A
`Vertex` is one instance on one tile with its fields connected to tensor views; every element it
reads or writes must live on that tile, checked when the vertex is added. A `ComputeSet` is a set
of vertices that run in parallel in one compute phase of a BSP superstep.

Codelet calling convention: the kernel is called once per compute set and vertex type, with,
for every field in `VertexType.fields` order, the triple (arena, addresses, starts) followed by
a float64 `params` array of shape (num_vertices, num_params). Vertex v's field f occupies
`addresses[starts[v]:starts[v+1]]`, positions in that field's arena (the memory of the IPU in the
dtype of the field). Kernels iterate `for v in prange(params.shape[0])`.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .tensor import Tensor


class LocalityError(ValueError):
    """A vertex was connected to data that does not live on its tile."""


@dataclass(frozen=True, eq=False)
class VertexType:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kernel: Callable
    # cycles(sizes: {field: numel}, params: tuple, dtype: np.dtype, target) -> cycles on one worker
    cycles: Callable
    num_params: int = 0

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.inputs + self.outputs))

    def __repr__(self):
        return f"VertexType({self.name})"


@dataclass(eq=False, slots=True)
class Vertex:
    type: VertexType
    tile: int
    fields: dict[str, Tensor]
    params: tuple = ()

    @property
    def sizes(self) -> dict[str, int]:
        return {k: t.numel for k, t in self.fields.items()}

    @property
    def dtype(self) -> np.dtype:
        return next(iter(self.fields.values())).dtype

    def cycles(self, target) -> int:
        return int(self.type.cycles(self.sizes, self.params, self.dtype, target)) + target.vertex_overhead_cycles


@dataclass(eq=False)
class ComputeSet:
    name: str
    ipu: int
    vertices: list[Vertex] = field(default_factory=list)

    def add(self, vertex: Vertex) -> Vertex:
        vt = vertex.type
        missing = set(vt.fields) - set(vertex.fields)
        extra = set(vertex.fields) - set(vt.fields)
        if missing or extra:
            raise ValueError(f"vertex {vt.name} in compute set {self.name!r}: fields {sorted(missing)} "
                             f"not connected, unknown fields {sorted(extra)}; expected {list(vt.fields)}")
        if len(vertex.params) != vt.num_params:
            raise ValueError(f"vertex {vt.name} takes {vt.num_params} parameters, got {len(vertex.params)}")
        for name, t in vertex.fields.items():
            check_local(t, vertex.tile, self.ipu, f"{vt.name}.{name}")
        self.vertices.append(vertex)
        return vertex

    def tile_cycles(self, target) -> dict[int, int]:
        """Cycles per tile: a tile's vertices spread over its workers (longest first); the
        tile finishes when its busiest worker does."""
        per_tile: dict[int, list[int]] = {}
        for v in self.vertices:
            per_tile.setdefault(v.tile, []).append(v.cycles(target))
        return {tile: worker_makespan(c, target.workers_per_tile) for tile, c in per_tile.items()}

    def __repr__(self):
        return f"ComputeSet({self.name!r}, ipu={self.ipu}, vertices={len(self.vertices)})"


def worker_makespan(cycles: list[int], workers: int) -> int:
    """Longest-processing-time assignment of vertex cycles onto `workers` threads."""
    if len(cycles) <= workers:
        return max(cycles, default=0)
    loads = [0] * workers
    for c in sorted(cycles, reverse=True):
        heapq.heapreplace(loads, loads[0] + c)
    return max(loads)


def check_local(t: Tensor, tile: int, ipu: int, what: str) -> None:
    if t.ipu != ipu:
        raise LocalityError(f"{what}: tensor {t.name!r} lives on IPU {t.ipu}, the vertex on IPU {ipu}; "
                            "move it with an InterIpuCopy first")
    tiles = t.tiles().reshape(-1)
    bad = np.flatnonzero(tiles != tile)
    if bad.size:
        i = int(bad[0])
        where = "has no tile mapping" if tiles[i] < 0 else f"lives on tile {int(tiles[i])}"
        raise LocalityError(f"{what}: element {i} of tensor {t.name!r} {where}, but the vertex runs on "
                            f"tile {tile} ({bad.size} of {tiles.size} elements are not local); a vertex only "
                            "reads its own tile's memory: copy the data to the tile first")
