"""Point-cloud sampling and clustering (torch_cluster's `fps` and `nearest`, which PopTorch provides
as `poptorch.fps` and `poptorch.nearest`).

Farthest point sampling (`fps`): `src` [N, D] is cut into segments [ptr[b], ptr[b+1]); from segment
b, k_b = ceil(n_b * ratio) points are picked (float32 arithmetic, as PopTorch and torch_cluster):
the first (or, with `random_start`, the point at floor(u_b * n_b) for a uniform u_b in [0, 1)), then
repeatedly the point farthest from those picked: the argmax (first on ties) of the running minimum
of squared Euclidean distances to the picked points, computed in float32 as torch does
((a - b)^2 summed over the features in order). The result holds the picked global indices,
segment after segment (int32 [sum k_b]). Mapping: segment b lives on tile b * tiles // B, where
one vertex runs its sequential search; its output indices are written there.

Nearest (`nearest`): for every row i of `x` [Nx, D], the index of the row of `y` [Ny, D] with the
same batch value (`batch_x[i] == batch_y[j]`) at the smallest squared Euclidean distance (first on
ties), -1 when the batch has no row of `y` (torch_cluster refuses such batches; the device cannot
raise on data). Mapping: the rows of x are spread over tiles, and split over each tile's workers;
y and batch_y are broadcast to those tiles by exchange; each vertex scans all of y for its rows.

Cycles per vertex (worker instructions): fps k * n * (3 * D + 4) + 8 * k; nearest
rows * Ny * (3 * D + 4) + 8 * rows.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, ld, st
from ..device.mapping import TileMap
from ..device.program import Execute, OpProgram, Sequence
from ..device.tensor import Tensor
from ..device.vertex import Field, VertexType
from .common import placed, region_work


# ---- the searches, shared by both modes ----------------------------------------------------------
@njit(**JIT)
def _sqdist(a, b):
    """Squared Euclidean distance of two float32 rows, accumulated in float32 in feature order."""
    s = np.float32(0.0)
    for d in range(a.size):
        diff = np.float32(a[d] - b[d])
        s = np.float32(s + np.float32(diff * diff))
    return s


@njit(**JIT)
def fps_segment(pts, k, start, out):
    """Pick k rows of pts [n, D] (float32) from `start`; out[:k] = local indices."""
    n = pts.shape[0]
    if k <= 0 or n == 0:
        return
    out[0] = start
    dist = np.empty(n, np.float32)
    for i in range(n):
        dist[i] = _sqdist(pts[i], pts[start])
    for j in range(1, k):
        best = 0
        for i in range(1, n):
            if dist[i] > dist[best]:
                best = i
        out[j] = best
        for i in range(n):
            d = _sqdist(pts[i], pts[best])
            if d < dist[i]:
                dist[i] = d


@njit(**JIT)
def nearest_row(row, b, y, batch_y):
    best = -1
    best_d = np.float32(np.inf)
    for j in range(y.shape[0]):
        if batch_y[j] != b:
            continue
        d = _sqdist(row, y[j])
        if best < 0 or d < best_d:
            best, best_d = j, d
    return best


def segment_sizes(ptr, ratio: float) -> list[int]:
    """k_b = ceil(n_b * ratio) in float32, as PopTorch computes it."""
    return [int(math.ceil(np.float32(ptr[i + 1] - ptr[i]) * np.float32(ratio))) for i in range(len(ptr) - 1)]


def _start(u: float, n: int) -> int:
    return min(int(math.floor(np.float32(u) * np.float32(n))), n - 1) if n else 0


# ---- codelets -------------------------------------------------------------------------------------
@njit(parallel=True, **JIT)
def fps_codelet(sa, s_addr, s_start, ua, u_addr, u_start, oa, o_addr, o_start, params):
    """params: D, k, first global index, random start (0/1)."""
    for v in prange(params.shape[0]):
        D, k, first, rnd = int(params[v, 0]), int(params[v, 1]), int(params[v, 2]), params[v, 3] != 0
        n = (s_start[v + 1] - s_start[v]) // D
        pts = np.empty((n, D), np.float32)
        for i in range(n):
            for d in range(D):
                pts[i, d] = ld(sa, s_addr[s_start[v] + i * D + d])
        start = 0
        if rnd and n > 0:
            u = np.float32(ld(ua, u_addr[u_start[v]]))
            start = min(int(math.floor(u * np.float32(n))), n - 1)
        out = np.zeros(k, np.int64)
        fps_segment(pts, k, start, out)
        for j in range(k):
            st(oa, o_addr[o_start[v] + j], out[j] + first)


@njit(parallel=True, **JIT)
def nearest_codelet(xa, x_addr, x_start, bxa, bx_addr, bx_start, ya, y_addr, y_start, bya, by_addr, by_start,
                    oa, o_addr, o_start, params):
    """params: D."""
    for v in prange(params.shape[0]):
        D = int(params[v, 0])
        rows = bx_start[v + 1] - bx_start[v]
        ny = by_start[v + 1] - by_start[v]
        y = np.empty((ny, D), np.float32)
        by = np.empty(ny, np.int64)
        for j in range(ny):
            by[j] = ld(bya, by_addr[by_start[v] + j])
            for d in range(D):
                y[j, d] = ld(ya, y_addr[y_start[v] + j * D + d])
        row = np.empty(D, np.float32)
        for i in range(rows):
            for d in range(D):
                row[d] = ld(xa, x_addr[x_start[v] + i * D + d])
            st(oa, o_addr[o_start[v] + i], nearest_row(row, ld(bxa, bx_addr[bx_start[v] + i]), y, by))


@njit(parallel=True, **JIT)
def nearest_whole(x, batch_x, y, batch_y, out):
    for i in prange(x.shape[0]):
        out[i] = nearest_row(x[i], batch_x[i], y, batch_y)


def _fps_cycles(sizes, params, dtype, target):
    D, k = params[:, 0], params[:, 1]
    n = sizes["src"] // D
    return target.thread_cycles(k * n * (3 * D + 4) + 8 * k)


def _nearest_cycles(sizes, params, dtype, target):
    D = params[:, 0]
    rows, ny = sizes["batch_x"], sizes["batch_y"]
    return target.thread_cycles(rows * ny * (3 * D + 4) + 8 * rows)


FPS = VertexType("poptorch::FarthestPointSampling", ("src", "u"), ("out",), fps_codelet, _fps_cycles, num_params=4)
NEAREST = VertexType("poptorch::Nearest", ("x", "batch_x", "y", "batch_y"), ("out",), nearest_codelet,
                     _nearest_cycles, num_params=1)


# ---- graph construction ---------------------------------------------------------------------------
def fps(graph: Graph, src: Tensor, ptr, ratio: float, prog: Sequence, random_u: Tensor | None = None,
        name: str = "fps") -> Tensor:
    """Farthest point sampling (see the module docstring); `random_u` [B] float32 uniforms in
    [0, 1) choose the start points (else each segment starts at its first point)."""
    ptr = [int(p) for p in ptr]
    if src.rank != 2:
        raise ValueError(f"{name}: src {src.name!r} must be [N, D], has shape {src.shape}")
    N, D = src.shape
    if len(ptr) < 2 or ptr[0] != 0 or ptr[-1] != N or any(b < a for a, b in zip(ptr, ptr[1:])):
        raise ValueError(f"{name}: ptr must rise from 0 to the number of points ({N}), got {ptr}")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name}: ratio must be in (0, 1], got {ratio}")
    B = len(ptr) - 1
    ks = segment_sizes(ptr, ratio)
    if random_u is not None and (random_u.shape != (B,) or random_u.dtype != np.float32):
        raise ValueError(f"{name}: random_u must be float32 [{B}], is {random_u.dtype.name}{random_u.shape}")
    tiles = (np.arange(B, dtype=np.int64) * graph.target.num_tiles // B).astype(np.int32)
    sizes = np.diff(ptr).astype(np.int64)
    body = Sequence(name=name)
    local = placed(graph, body, src.flatten(), TileMap.from_lengths(sizes * D, tiles), f"{name}/src")
    rnd = random_u is not None
    if random_u is None:
        random_u = graph.addConstant(np.float32, (B,), 0.0, f"{name}/first")
        random_u.var.mapping = TileMap.from_tiles(tiles)
    u = placed(graph, body, random_u, tiles, f"{name}/u")
    out = graph.addVariable(np.int32, (sum(ks),), name, category="activations", always_live=False)
    out.var.mapping = TileMap.from_lengths(ks, tiles)
    starts = np.asarray(ptr[:-1], np.int64)
    offsets = np.concatenate(([0], np.cumsum(ks)))[:-1]
    cs = graph.addComputeSet(name)
    params = np.stack([np.full(B, D), ks, starts, np.full(B, int(rnd))], 1)
    graph.addVertices(cs, FPS, tiles, {"src": Field.strided(local, starts * D, 1, sizes * D),
                                       "u": Field.strided(u, np.arange(B), 1, 1),
                                       "out": Field.strided(out, offsets, 1, ks)}, params.astype(np.float64))
    body.add(Execute(cs))

    def fast(io):
        values = np.asarray(io.read(src), np.float32)
        draws = np.asarray(io.read(random_u), np.float32)
        result = np.empty(sum(ks), np.int64)
        for b in range(B):
            n = int(sizes[b])
            picked = np.zeros(ks[b], np.int64)
            fps_segment(values[ptr[b]:ptr[b + 1]], ks[b], _start(draws[b], n) if rnd else 0, picked)
            result[offsets[b]:offsets[b] + ks[b]] = picked + ptr[b]
        io.write(out, result.astype(np.int32))

    prog.add(OpProgram(name, body, fast, (src, random_u), (out,)))
    return out


def nearest(graph: Graph, x: Tensor, y: Tensor, batch_x: Tensor, batch_y: Tensor, prog: Sequence,
            name: str = "nearest") -> Tensor:
    """For every row of x, the index of the nearest row of y in the same batch (int32 [Nx])."""
    if x.rank != 2 or y.rank != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"{name}: x {x.shape} and y {y.shape} must be [N, D] with the same D")
    if batch_x.shape != (x.shape[0],) or batch_y.shape != (y.shape[0],):
        raise ValueError(f"{name}: batch_x {batch_x.shape} and batch_y {batch_y.shape} must give one batch per row "
                         f"of x {x.shape} and y {y.shape}")
    for what, t in (("batch_x", batch_x), ("batch_y", batch_y)):
        if t.dtype != np.int32:
            raise TypeError(f"{name}: {what} must be int32, is {t.dtype.name}")
    Nx, D = x.shape
    Ny = y.shape[0]
    out = graph.addVariable(np.int32, (Nx,), name, category="activations", always_live=False)
    graph.map_linearly(out, grain=1, min_elements_per_tile=8)
    work = region_work(out.tile_map(), graph.target.workers_per_tile)
    body = Sequence(name=name)
    rows = out.tile_map()
    xl = placed(graph, body, x.flatten(), TileMap.from_lengths(rows.lengths * D, rows.tiles), f"{name}/x")
    bxl = placed(graph, body, batch_x, rows, f"{name}/batch_x")
    hosts = np.unique(work.tiles)
    yb = placed(graph, body, y.reshape((1, Ny * D)).broadcast((hosts.size, Ny * D)),
                TileMap.from_lengths(np.full(hosts.size, Ny * D), hosts), f"{name}/y")
    byb = placed(graph, body, batch_y.reshape((1, Ny)).broadcast((hosts.size, Ny)),
                 TileMap.from_lengths(np.full(hosts.size, Ny), hosts), f"{name}/batch_y")
    slot = np.searchsorted(hosts, work.tiles)
    cs = graph.addComputeSet(name)
    if work.starts.size != work.num_vertices:
        raise AssertionError(f"{name}: a vertex's rows must be one run")
    first = work.starts   # each vertex: one run of rows
    count = work.lengths
    graph.addVertices(cs, NEAREST, work.tiles,
                      {"x": Field.strided(xl, first * D, 1, count * D), "batch_x": Field.strided(bxl, first, 1, count),
                       "y": Field.strided(yb, slot * Ny * D, 1, Ny * D), "batch_y": Field.strided(byb, slot * Ny, 1, Ny),
                       "out": Field.strided(out, first, 1, count)}, np.full((work.num_vertices, 1), float(D)))
    body.add(Execute(cs))

    def fast(io):
        res = np.empty(Nx, np.int64)
        nearest_whole(np.asarray(io.read(x), np.float32), np.asarray(io.read(batch_x), np.int64),
                      np.asarray(io.read(y), np.float32), np.asarray(io.read(batch_y), np.int64), res)
        io.write(out, res.astype(np.int32))

    prog.add(OpProgram(name, body, fast, (x, y, batch_x, batch_y), (out,)))
    return out


def fps_host(src: np.ndarray, ptr, ratio: float, starts=None) -> np.ndarray:
    """fps on host arrays (the device's search); `starts`: uniforms choosing the start points."""
    src = np.ascontiguousarray(src, np.float32)
    ks = segment_sizes(ptr, ratio)
    out = []
    for b, k in enumerate(ks):
        n = ptr[b + 1] - ptr[b]
        picked = np.zeros(k, np.int64)
        fps_segment(src[ptr[b]:ptr[b + 1]], k, _start(starts[b], n) if starts is not None else 0, picked)
        out.append(picked + ptr[b])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def nearest_host(x, y, batch_x, batch_y) -> np.ndarray:
    res = np.empty(len(x), np.int64)
    nearest_whole(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(batch_x, np.int64),
                  np.ascontiguousarray(y, np.float32), np.ascontiguousarray(batch_y, np.int64), res)
    return res

