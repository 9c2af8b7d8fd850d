"""Helpers every op uses: output allocation, operand placement by exchange, work splitting."""
from __future__ import annotations

import numpy as np

from ..device.graph import Graph
from ..device.program import Copy, Sequence
from ..device.tensor import Tensor

# Elements a tile processes in one vector step; outputs are mapped in multiples of it so that
# vertices see whole vectors (64-bit loads: 2 x float32, 4 x float16).
GRAIN = 4


def new_output(graph: Graph, dtype, shape, name: str, *, category: str = "activations",
               always_live: bool = False, grain: int = GRAIN, min_elements_per_tile: int = 64,
               like: Tensor | None = None) -> Tensor:
    """A new tensor mapped like `like` (when it has the same shape and is fully mapped, as
    PopLibs clones an operand for elementwise outputs), else spread linearly over all tiles."""
    if like is not None and tuple(like.shape) == tuple(shape) and (like.tiles() >= 0).all():
        return graph.clone(like, name, dtype=dtype, category=category, always_live=always_live)
    t = graph.addVariable(dtype, shape, name, category=category, always_live=always_live)
    graph.map_linearly(t, grain=grain, min_elements_per_tile=min_elements_per_tile)
    return t


def placed(graph: Graph, prog: Sequence, src: Tensor, tiles: np.ndarray, name: str) -> Tensor:
    """A tensor shaped like `src` whose flat element i lives on `tiles[i]`.

    Returns `src` itself when its elements already live there; otherwise a new temporary (not
    always live) mapped to `tiles`, filled by an exchange `Copy` appended to `prog`.
    """
    tiles = np.asarray(tiles).reshape(-1)
    if np.array_equal(src.tiles().reshape(-1), tiles):
        return src
    tmp = graph.addVariable(src.dtype, src.shape, name, category="temporaries", always_live=False)
    tmp.var.mapping[:] = tiles
    prog.add(Copy(src, tmp))
    return tmp


def tile_regions(tiles: np.ndarray) -> dict[int, np.ndarray]:
    """Flat positions of the elements on each tile (positions in increasing order)."""
    tiles = np.asarray(tiles).reshape(-1)
    order = np.argsort(tiles, kind="stable")
    cuts = np.flatnonzero(np.diff(tiles[order])) + 1
    return {int(tiles[g[0]]): g for g in np.split(order, cuts) if g.size}


def split_work(n: int, parts: int, grain: int = 1) -> list[tuple[int, int]]:
    """Split range(n) into at most `parts` contiguous [begin, end) pieces in multiples of grain."""
    if n <= 0:
        return []
    grains = -(-n // grain)
    per = -(-grains // max(1, min(parts, grains))) * grain
    return [(b, min(b + per, n)) for b in range(0, n, per)]


def flat(t: Tensor, positions: np.ndarray) -> Tensor:
    """The elements of `t` at flat `positions`, as a 1-D view."""
    return t.flatten()[positions]
