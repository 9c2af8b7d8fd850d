"""Cross-replica collectives over IPU-Links: ring all-reduce, all-gather and broadcast.

Replica r's tensor lives on its own IPU; the list order is the ring order (replica r sends to
replica r+1, the last to the first). Data moves between IPUs only by `InterIpuCopy`; reductions
run as vertices on the receiving tiles.

All-reduce (sum or mean) is the bandwidth-optimal ring algorithm. The flattened tensor is cut into
R contiguous chunks (chunk c = elements [c*n//R, (c+1)*n//R)).
- Reduce-scatter, steps s = 0..R-2: replica r sends its partial of chunk (r - s) mod R to replica
  r+1, which adds it into its own copy (add vertices on the tiles holding the chunk; the received
  chunk lands in a temporary mapped to those tiles). After R-1 steps replica r holds the full sum
  of chunk (r+1) mod R; for "mean" the last addition also multiplies by 1/R (one rounding).
- All-gather, steps s = 0..R-2: replica r sends chunk (r + 1 - s) mod R to replica r+1, which
  stores it in place.
Every chunk is summed once, in ring order x_c + x_(c+1) + ... + x_(c-1), and then copied, so all
replicas hold the same bits. Each directed link r -> r+1 carries 2(R-1) chunks, i.e. 2(R-1)/R of
the tensor's bytes (the closed form of a ring all-reduce).

Link schedule: the copies of one ring step are independent, and IPU-Links are full duplex: every
IPU sends one chunk to the next while it receives one from the previous, so a ring step is one
`Parallel` round costing the link time of one chunk (`Target.inter_ipu_cycles`) plus a global
sync. `link_rounds` groups any list of independent copies into such rounds.

Reduce-scatter and the all-gather of shards are the two halves of the all-reduce on their own
(replicated tensor sharding: each replica updates only its shard of a reduced tensor, then the
shards are gathered): after `reduce_scatter` replica r holds the reduction of its shard, chunk
(r+1) mod R (`shard_bounds`), and `all_gather_shards` sends every shard around the ring in place.
Each costs (R-1) ring steps of one chunk, half of the all-reduce.

All-gather (R tensors of shape S -> on every replica an (R, *S) tensor, row j from replica j) uses
the same ring with whole tensors as chunks. Broadcast scatters the root's chunks to the replicas
that own them in the all-gather above, then runs that all-gather (the root receives nothing).

Cycles of the add vertex (n elements, thread instructions): ceil(n / width) * (1, or 2 with a
scale) + 6, width 2 for float32 and 4 for float16, as popops' vectorised binary ops.
Fast mode: one whole-array kernel adds the chunks in the same ring order with the same roundings,
so strict and fast results are bit-identical; cycles and memory are the same static figures.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..device.graph import Device, Graph
from ..device.kernels import JIT, kernel_view, ld, st
from ..device.program import Copy, Execute, InterIpuCopy, OpProgram, Parallel, Program, Sequence
from ..device.mapping import TileMap
from ..device.tensor import Tensor
from ..device.vertex import VertexType
from .common import region_work

REDUCE_OPS = ("sum", "mean")
FLOAT_DTYPES = ("float32", "float16")


@njit(parallel=True, **JIT)
def reduce_add_codelet(acc, acc_addr, acc_start, recv, recv_addr, recv_start, params):
    """acc = (acc + recv) * scale, computed in float64 and rounded once; params: (scale,)."""
    for v in prange(params.shape[0]):
        scale = params[v, 0]
        a0, r0 = acc_start[v], recv_start[v]
        for i in range(acc_start[v + 1] - a0):
            ai = acc_addr[a0 + i]
            st(acc, ai, (ld(acc, ai) + ld(recv, recv_addr[r0 + i])) * scale)


@njit(parallel=True, **JIT)
def ring_sum_whole(x, bounds, scale, out):
    """The ring all-reduce's arithmetic over whole arrays: x is (replicas, n); chunk c is summed
    from replica c onwards around the ring, the last addition scaled, every partial rounded."""
    replicas = x.shape[0]
    for c in range(replicas):
        for i in prange(bounds[c], bounds[c + 1]):
            st(out, i, ld(x[c], i))
            for k in range(1, replicas):
                s = scale if k == replicas - 1 else 1.0
                st(out, i, (ld(out, i) + ld(x[(c + k) % replicas], i)) * s)


def reduce_add_cycles(sizes, params, dtype, target) -> np.ndarray:
    width = 4 if dtype == np.float16 else 2
    per_vector = np.where(params[:, 0] == 1.0, 1, 2)
    return target.thread_cycles(np.ceil(sizes["acc"] / width) * per_vector + 6)


REDUCE_ADD_VERTEX = VertexType("gcl::ReduceAdd", ("acc", "recv"), ("acc",), reduce_add_codelet, reduce_add_cycles,
                               num_params=1)


# ---- helpers ----------------------------------------------------------------------------------
def _check(device: Device, tensors, what: str, floats: bool = False) -> list[Graph]:
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{what}: give one tensor per replica, got none")
    ipus = [t.ipu for t in tensors]
    if len(set(ipus)) != len(ipus):
        raise ValueError(f"{what}: replicas must live on different IPUs, got tensors on IPUs {ipus}")
    graphs = []
    for t in tensors:
        if not 0 <= t.ipu < device.num_ipus or t.var not in device.graph(t.ipu).variables:
            raise ValueError(f"{what}: tensor {t.name!r} does not belong to this device's IPU {t.ipu} graph")
        graphs.append(device.graph(t.ipu))
    first = tensors[0]
    for t in tensors[1:]:
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(f"{what}: replica tensors must match; {first.name!r} is {first.dtype.name}{first.shape}, "
                             f"{t.name!r} is {t.dtype.name}{t.shape}")
    if floats and first.dtype.name not in FLOAT_DTYPES:
        raise TypeError(f"{what}: reductions need float32 or float16 tensors, got {first.dtype.name}")
    return graphs


def chunk_bounds(n: int, replicas: int) -> list[tuple[int, int]]:
    """The ring's chunks: [c*n//R, (c+1)*n//R) for c in range(R)."""
    return [(c * n // replicas, (c + 1) * n // replicas) for c in range(replicas)]


def link_rounds(copies: list[InterIpuCopy]) -> Program:
    """Independent inter-IPU copies as rounds in which every IPU sends at most one copy and
    receives at most one (greedy, in the given order): the links are full duplex."""
    rounds: list[tuple[set, list]] = []
    for c in copies:
        roles = {("send", c.src.ipu), ("receive", c.dst.ipu)}
        for used, members in rounds:
            if not used & roles:
                used |= roles
                members.append(c)
                break
        else:
            rounds.append((roles, [c]))
    return Sequence(*(Parallel(*members) for _, members in rounds))


def _like(graph: Graph, t: Tensor, shape, name: str, category: str, always_live: bool) -> Tensor:
    """A new tensor of `shape` whose flat element i lives where element i % t.numel of t lives."""
    out = graph.addVariable(t.dtype, shape, name, category=category, always_live=always_live)
    tiles = t.tiles().reshape(-1)
    out.var.mapping = TileMap.from_tiles(np.tile(tiles, out.numel // max(1, tiles.size)))
    return out


def _add_vertices(graph: Graph, cs, acc: Tensor, recv: Tensor, scale: float) -> None:
    work = region_work(acc.tile_map(), graph.target.workers_per_tile, grain=4)
    graph.addVertices(cs, REDUCE_ADD_VERTEX, work.tiles, {"acc": work.field(acc), "recv": work.field(recv)},
                      np.array([scale], np.float64))


def _all_gather_steps(body: Sequence, flats: list[Tensor], chunks, skip_to: int | None = None) -> None:
    """Ring all-gather of chunks: replica r starts owning chunk (r+1) mod R."""
    replicas = len(flats)
    for s in range(replicas - 1):
        copies = []
        for r in range(replicas):
            d = (r + 1) % replicas
            b, e = chunks[(r + 1 - s) % replicas]
            if e > b and d != skip_to:
                copies.append(InterIpuCopy(flats[r][b:e], flats[d][b:e]))
        if copies:
            body.add(link_rounds(copies))


def _reduce_scatter_steps(body: Sequence, graphs: list[Graph], flats: list[Tensor], chunks, scale: float,
                          name: str) -> None:
    replicas = len(flats)
    for s in range(replicas - 1):
        copies, sets = [], []
        for r in range(replicas):
            d = (r + 1) % replicas
            b, e = chunks[(r - s) % replicas]
            if e == b:
                continue
            g = graphs[d]
            acc = flats[d][b:e]
            recv = g.addVariable(acc.dtype, (e - b,), f"{name}/step{s}/recv", category="temporaries",
                                 always_live=False)
            recv.var.mapping = acc.tile_map()
            copies.append(InterIpuCopy(flats[r][b:e], recv))
            cs = g.addComputeSet(f"{name}/step{s}")
            _add_vertices(g, cs, acc, recv, scale if s == replicas - 2 else 1.0)
            sets.append(Execute(cs))
        if copies:
            body.add(link_rounds(copies))
            body.add(Parallel(*sets))


# ---- collectives ------------------------------------------------------------------------------
def all_reduce(device: Device, tensors, prog: Sequence, op: str = "sum", name: str = "all_reduce", *,
               in_place: bool = False) -> list[Tensor]:
    """Sum (or mean) of the replicas' tensors, on every replica; `tensors[r]` is replica r's.
    Returns new tensors mapped like the inputs, or the inputs themselves with `in_place`."""
    if op not in REDUCE_OPS:
        raise ValueError(f"{name}: unknown reduction {op!r}; use one of {REDUCE_OPS}")
    tensors = list(tensors)
    graphs = _check(device, tensors, name, floats=True)
    replicas = len(tensors)
    scale = 1.0 / replicas if op == "mean" else 1.0
    body = Sequence(name=name)
    if in_place:
        outs = tensors
    else:
        outs = [_like(g, t, t.shape, f"{name}/out", "activations", False) for g, t in zip(graphs, tensors)]
        body.add(Parallel(*(Copy(t, o) for t, o in zip(tensors, outs))))
    n = tensors[0].numel
    chunks = chunk_bounds(n, replicas)
    flats = [o.flatten() for o in outs]
    if replicas > 1:
        _reduce_scatter_steps(body, graphs, flats, chunks, scale, name)
        _all_gather_steps(body, flats, chunks)
    bounds = np.asarray([b for b, _ in chunks] + [n], dtype=np.int64)

    def fast(io):
        x = np.stack([np.ascontiguousarray(io.read(t)).reshape(-1) for t in tensors])
        res = np.empty(n, dtype=tensors[0].dtype)
        ring_sum_whole(kernel_view(x), bounds, scale, kernel_view(res))
        for o in outs:
            io.write(o, res.reshape(o.shape))

    prog.add(OpProgram(name, body, fast, tuple(tensors), tuple(outs)))
    return outs


def shard_bounds(n: int, replicas: int) -> list[tuple[int, int]]:
    """The elements [begin, end) of a flattened tensor of n elements that replica r holds reduced
    after `reduce_scatter` (and sends in `all_gather_shards`): ring chunk (r+1) mod R."""
    chunks = chunk_bounds(n, replicas)
    return [chunks[(r + 1) % replicas] for r in range(replicas)]


def reduce_scatter(device: Device, tensors, prog: Sequence, op: str = "sum",
                   name: str = "reduce_scatter") -> list[tuple[int, int]]:
    """Reduce the replicas' tensors in place so that replica r's shard (`shard_bounds`, returned)
    holds the sum (or mean) over the replicas; its other elements hold partial sums of the ring
    (strict mode) and are not to be read."""
    if op not in REDUCE_OPS:
        raise ValueError(f"{name}: unknown reduction {op!r}; use one of {REDUCE_OPS}")
    tensors = list(tensors)
    graphs = _check(device, tensors, name, floats=True)
    replicas = len(tensors)
    scale = 1.0 / replicas if op == "mean" else 1.0
    n = tensors[0].numel
    chunks = chunk_bounds(n, replicas)
    shards = shard_bounds(n, replicas)
    flats = [t.flatten() for t in tensors]
    body = Sequence(name=name)
    if replicas > 1:
        _reduce_scatter_steps(body, graphs, flats, chunks, scale, name)
    bounds = np.asarray([b for b, _ in chunks] + [n], dtype=np.int64)

    def fast(io):
        x = np.stack([np.ascontiguousarray(io.read(t)).reshape(-1) for t in tensors])
        res = np.empty(n, dtype=tensors[0].dtype)
        ring_sum_whole(kernel_view(x), bounds, scale, kernel_view(res))
        for f, (b, e) in zip(flats, shards):
            if e > b:
                io.write(f[b:e], res[b:e])

    prog.add(OpProgram(name, body, fast, tuple(tensors), tuple(f[b:e] for f, (b, e) in zip(flats, shards) if e > b)))
    return shards


def all_gather_shards(device: Device, tensors, prog: Sequence, name: str = "all_gather_shards") -> None:
    """In place: every replica's shard (`shard_bounds`) of its tensor reaches every other replica,
    over the same ring as the all-reduce's second half."""
    tensors = list(tensors)
    _check(device, tensors, name)
    replicas = len(tensors)
    n = tensors[0].numel
    flats = [t.flatten() for t in tensors]
    shards = shard_bounds(n, replicas)
    body = Sequence(name=name)
    if replicas > 1:
        _all_gather_steps(body, flats, chunk_bounds(n, replicas))

    def fast(io):
        for r, (b, e) in enumerate(shards):
            if e > b:
                value = np.array(io.read(flats[r][b:e]), copy=True)
                for d in range(replicas):
                    if d != r:
                        io.write(flats[d][b:e], value)

    written = tuple(flats[d][b:e] for r, (b, e) in enumerate(shards) for d in range(replicas) if d != r and e > b)
    prog.add(OpProgram(name, body, fast, tuple(f[b:e] for f, (b, e) in zip(flats, shards) if e > b), written))


def all_gather(device: Device, tensors, prog: Sequence, name: str = "all_gather") -> list[Tensor]:
    """On every replica, an (R, *shape) tensor whose row j is replica j's tensor; row j is mapped
    like the replica's own tensor."""
    tensors = list(tensors)
    graphs = _check(device, tensors, name)
    replicas = len(tensors)
    shape = (replicas,) + tensors[0].shape
    outs = [_like(g, t, shape, f"{name}/out", "activations", False) for g, t in zip(graphs, tensors)]
    body = Sequence(name=name)
    body.add(Parallel(*(Copy(t, o[r]) for r, (t, o) in enumerate(zip(tensors, outs)))))
    rows = [o.reshape(replicas, -1) for o in outs]
    for s in range(replicas - 1):
        copies = [InterIpuCopy(rows[r][(r - s) % replicas], rows[(r + 1) % replicas][(r - s) % replicas])
                  for r in range(replicas)]
        body.add(link_rounds(copies))

    def fast(io):
        stacked = np.stack([np.asarray(io.read(t)) for t in tensors])
        for o in outs:
            io.write(o, stacked)

    prog.add(OpProgram(name, body, fast, tuple(tensors), tuple(outs)))
    return outs


def broadcast(device: Device, tensors, prog: Sequence, root: int = 0, name: str = "broadcast") -> list[Tensor]:
    """Copy replica `root`'s tensor into every other replica's tensor (in place)."""
    tensors = list(tensors)
    _check(device, tensors, name)
    replicas = len(tensors)
    if not 0 <= root < replicas:
        raise ValueError(f"{name}: root {root} is not a replica; there are {replicas} (0..{replicas - 1})")
    n = tensors[0].numel
    chunks = chunk_bounds(n, replicas)
    flats = [t.flatten() for t in tensors]
    body = Sequence(name=name)
    scatter = []
    for c, (b, e) in enumerate(chunks):
        owner = (c - 1) % replicas
        if e > b and owner != root:
            scatter.append(InterIpuCopy(flats[root][b:e], flats[owner][b:e]))
    if scatter:
        body.add(link_rounds(scatter))
    _all_gather_steps(body, flats, chunks, skip_to=root)

    def fast(io):
        value = np.array(io.read(tensors[root]), copy=True)
        for r, t in enumerate(tensors):
            if r != root:
                io.write(t, value)

    prog.add(OpProgram(name, body, fast, (tensors[root],), tuple(t for r, t in enumerate(tensors) if r != root)))
    return tensors
