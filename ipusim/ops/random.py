"""Random numbers (PopLibs `poprand`): uniform, normal, Bernoulli, dropout, and the distributions
PyTorch's in-place samplers draw (exponential, Cauchy, geometric, log-normal, uniform integers),
from a counter-based RNG.

Generator. Every element's random bits are Philox4x32-10 (Salmon et al., "Parallel random numbers:
as easy as 1, 2, 3", SC 2011) of
    counter = (element index low 32 bits, element index high 32 bits, seed_modifier, distribution)
    key     = (seed low 32 bits, seed high 32 bits)
where the element index is the element's flat position in the op's output. So the bits depend only
on the seed, the seed modifier, the distribution and the element: the same in the strict and fast
modes, whatever the tile mapping and the order in which tiles and worker threads run. Each tile
generates the elements it holds; a vertex derives its first counter from its first element
(a stronger guarantee than the hardware RNG, whose streams follow the tile mapping).

From the first two 32-bit words w0, w1 of an element's Philox output:
    uniform    low + (high - low) * u,  u = (w0 >> 8) * 2**-24 in [0, 1)
    normal     mean + std * sqrt(-2 ln u1) * cos(2 pi u2),  u1 = ((w0 >> 8) + 1) * 2**-24 in (0, 1],
               u2 = (w1 >> 8) * 2**-24 (Box-Muller)
    bernoulli  1 if w0 < floor(prob * 2**32) else 0
    dropout    keep = w0 >= floor(p * 2**32);  y = x * keep * 1 / (1 - p) (torch's scaling;
               p = 1 drops everything), mask = keep (bool)
and, with v = (k + 1/2) * 2**-52 in the open interval (0, 1), k = (w0 >> 6) * 2**26 + (w1 >> 6)
(52 random bits), by inversion of the distribution function:
    exponential   -ln(v) / rate                                 (> 0, finite)
    cauchy        median + sigma * tan(pi * (v - 1/2))           (finite)
    geometric     ceil(ln(v) / ln(1 - p)), 0 < p < 1             (an integer >= 1: trials to the first success)
    log-normal    exp(the normal value of mean, std)
    integers      low + floor(w0 * n / 2**32), n < 2**32         (low, ..., low + n - 1; bias below n / 2**32)
each computed in float64 and rounded once to the output dtype.
Distributions: 0 uniform, 1 normal, 2 bernoulli, 3 dropout, 4 exponential, 5 cauchy, 6 geometric,
7 log-normal, 8 integers.

Seeds. A seed is an int (baked into the program as a constant) or a device tensor of two 32-bit
words [low, high] (uint32 or int32; `seed_tensor` makes one, `seed_words` splits an int for
`Engine.writeTensor`). A program advances a device seed between steps with `advance_seed`, so a
training loop draws new masks every step without recompiling; ops drawing in the same step take
distinct `seed_modifier`s (e.g. one per dropout layer). The seed is copied to every tile that
generates (an exchange of 8 bytes per tile).

Cycle estimators (thread instructions), shaped like PopLibs' poprand estimators: 7 (overhead) +
9 (seed set-up and warm-up) + 3 (loop set-up) + ceil(n / width) * per_vector, per_vector = 3
uniform, 2 normal, 1 bernoulli, 3 dropout, and for the samplers one more than their maths costs a
vector (elementwise.py's UNARY: ln 15, tan 25, exp 15) plus the uniform's 3: 19 exponential,
29 cauchy, 21 geometric (ln and ceil), 20 log-normal (exp after the normal's 2), 3 integers; width = elements per 64-bit vector of the output (2
float32, 4 float16, 1 otherwise). Dropout backward: 6 + ceil(n / width) * 2. Seed advance: 10.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, kernel_view, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.mapping import TileMap
from ..device.tensor import Tensor, as_dtype
from ..device.vertex import Field, VertexType
from .common import GRAIN, lookup, new_output, placed, region_work, tile_groups
from .reduce import vector_width

UNIFORM, NORMAL, BERNOULLI, DROPOUT, EXPONENTIAL, CAUCHY, GEOMETRIC, LOG_NORMAL, INTEGERS = range(9)
PER_VECTOR = {UNIFORM: 3, NORMAL: 2, BERNOULLI: 1, DROPOUT: 3, EXPONENTIAL: 19, CAUCHY: 29, GEOMETRIC: 21,
              LOG_NORMAL: 20, INTEGERS: 3}
MASK32 = 0xFFFFFFFF
TWO_32 = 2.0 ** 32


@njit(**JIT)
def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint64 values holding 32-bit words."""
    mask = np.uint64(MASK32)
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    s = np.uint64(32)
    for _ in range(10):
        p0 = m0 * c0
        p1 = m1 * c2
        c0, c1, c2, c3 = ((p1 >> s) ^ c1 ^ k0) & mask, p1 & mask, ((p0 >> s) ^ c3 ^ k1) & mask, p0 & mask
        k0 = (k0 + w0) & mask
        k1 = (k1 + w1) & mask
    return c0, c1, c2, c3


@njit(**JIT)
def element_words(k0, k1, modifier, kind, index):
    """The first two Philox words of element `index`."""
    i = np.uint64(index)
    r0, r1, _, _ = philox4x32(i & np.uint64(MASK32), i >> np.uint64(32), np.uint64(modifier), np.uint64(kind), k0, k1)
    return r0, r1


@njit(**JIT)
def open_unit(w0, w1):
    """52 bits of two words as a number in the open interval (0, 1)."""
    k = np.float64(w0 >> np.uint64(6)) * 67108864.0 + np.float64(w1 >> np.uint64(6))
    return (k + 0.5) * 2.0 ** -52


@njit(**JIT)
def random_value(kind, w0, w1, a, b):
    """From two words: uniform(low=a, high=b), normal(mean=a, std=b), bernoulli(threshold=a),
    exponential(rate=a), cauchy(median=a, sigma=b), geometric(ln(1 - p)=a), log-normal(mean=a,
    std=b) or integers(low=a, count=b)."""
    if kind == UNIFORM:
        return a + (b - a) * (np.float64(w0 >> np.uint64(8)) * 2.0 ** -24)
    if kind == NORMAL or kind == LOG_NORMAL:
        u1 = (np.float64(w0 >> np.uint64(8)) + 1.0) * 2.0 ** -24
        u2 = np.float64(w1 >> np.uint64(8)) * 2.0 ** -24
        z = a + b * math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
        return z if kind == NORMAL else math.exp(z)
    if kind == EXPONENTIAL:
        return -math.log(open_unit(w0, w1)) / a
    if kind == CAUCHY:
        return a + b * math.tan(math.pi * (open_unit(w0, w1) - 0.5))
    if kind == GEOMETRIC:
        return max(1.0, math.ceil(math.log(open_unit(w0, w1)) / a))
    if kind == INTEGERS:
        return a + np.float64((w0 * np.uint64(b)) >> np.uint64(32))
    return 1.0 if np.float64(w0) < a else 0.0


@njit(**JIT)
def seed_key(seed, addr, begin):
    return (np.uint64(np.int64(ld(seed, addr[begin])) & MASK32),
            np.uint64(np.int64(ld(seed, addr[begin + 1])) & MASK32))


@njit(parallel=True, **JIT)
def random_codelet(seed, s_addr, s_start, out, o_addr, o_start, params):
    """params: kind, first element index, a, b, seed modifier."""
    for v in prange(params.shape[0]):
        k0, k1 = seed_key(seed, s_addr, s_start[v])
        kind = int(params[v, 0])
        first = np.int64(params[v, 1])
        for i in range(o_start[v + 1] - o_start[v]):
            w0, w1 = element_words(k0, k1, np.int64(params[v, 4]), kind, first + i)
            st(out, o_addr[o_start[v] + i], random_value(kind, w0, w1, params[v, 2], params[v, 3]))


@njit(parallel=True, **JIT)
def random_whole(k0, k1, modifier, kind, out, a, b):
    for i in prange(out.size):
        w0, w1 = element_words(k0, k1, modifier, kind, i)
        st(out, i, random_value(kind, w0, w1, a, b))


@njit(**JIT)
def dropout_value(x, w0, threshold, scale):
    keep = 1.0 if np.float64(w0) >= threshold else 0.0
    return x * keep * scale, keep


@njit(parallel=True, **JIT)
def dropout_codelet(x, x_addr, x_start, seed, s_addr, s_start, out, o_addr, o_start, mask, m_addr, m_start, params):
    """params: first element index, threshold, scale, seed modifier."""
    for v in prange(params.shape[0]):
        k0, k1 = seed_key(seed, s_addr, s_start[v])
        first = np.int64(params[v, 0])
        for i in range(o_start[v + 1] - o_start[v]):
            w0, _ = element_words(k0, k1, np.int64(params[v, 3]), DROPOUT, first + i)
            y, keep = dropout_value(ld(x, x_addr[x_start[v] + i]), w0, params[v, 1], params[v, 2])
            st(out, o_addr[o_start[v] + i], y)
            st(mask, m_addr[m_start[v] + i], keep)


@njit(parallel=True, **JIT)
def dropout_whole(x, out, mask, k0, k1, modifier, threshold, scale):
    for i in prange(out.size):
        w0, _ = element_words(k0, k1, modifier, DROPOUT, i)
        y, keep = dropout_value(ld(x, i), w0, threshold, scale)
        st(out, i, y)
        st(mask, i, keep)


@njit(**JIT)
def masked_scale(dy, keep, scale):
    return dy * keep * scale


@njit(parallel=True, **JIT)
def dropout_grad_codelet(dy, d_addr, d_start, mask, m_addr, m_start, out, o_addr, o_start, params):
    """params: scale."""
    for v in prange(params.shape[0]):
        for i in range(o_start[v + 1] - o_start[v]):
            st(out, o_addr[o_start[v] + i], masked_scale(ld(dy, d_addr[d_start[v] + i]),
                                                         ld(mask, m_addr[m_start[v] + i]), params[v, 0]))


@njit(parallel=True, **JIT)
def dropout_grad_whole(dy, mask, out, scale):
    for i in prange(out.size):
        st(out, i, masked_scale(ld(dy, i), ld(mask, i), scale))


@njit(**JIT)
def advanced(lo, hi, step):
    total = ((np.uint64(hi) << np.uint64(32)) | np.uint64(lo)) + np.uint64(step)
    return np.int64(total & np.uint64(MASK32)), np.int64(total >> np.uint64(32))


@njit(parallel=True, **JIT)
def seed_advance_codelet(seed, s_addr, s_start, params):
    """params: step. Adds step to the 64-bit seed [low, high] in place."""
    for v in prange(params.shape[0]):
        b = s_start[v]
        lo, hi = seed_key(seed, s_addr, b)
        new_lo, new_hi = advanced(lo, hi, np.int64(params[v, 0]))
        st(seed, s_addr[b], new_lo)
        st(seed, s_addr[b + 1], new_hi)


def rng_instructions(n, width: int, kind):
    """Ints, or arrays (one per vertex)."""
    return 7 + 9 + 3 + np.ceil(n / width) * lookup(PER_VECTOR, kind)


RANDOM_VERTEX = VertexType(
    "poprand::Random", ("seed",), ("out",), random_codelet,
    lambda sizes, params, dtype, target: target.thread_cycles(
        rng_instructions(sizes["out"], vector_width(dtype), params[:, 0])),
    num_params=5)
DROPOUT_VERTEX = VertexType(
    "poprand::Dropout", ("x", "seed"), ("out", "mask"), dropout_codelet,
    lambda sizes, params, dtype, target: target.thread_cycles(
        rng_instructions(sizes["out"], vector_width(dtype), np.full(len(params), DROPOUT))),
    num_params=4)
DROPOUT_GRAD_VERTEX = VertexType(
    "poprand::DropoutGrad", ("dy", "mask"), ("out",), dropout_grad_codelet,
    lambda sizes, params, dtype, target: target.thread_cycles(6 + np.ceil(sizes["out"] / vector_width(dtype)) * 2),
    num_params=1)
SEED_ADVANCE_VERTEX = VertexType(
    "poprand::SeedAdvance", (), ("seed",), seed_advance_codelet,
    lambda sizes, params, dtype, target: target.thread_cycles(np.full(len(params), 10)), num_params=1)


# ---- seeds ---------------------------------------------------------------------------------------
def seed_words(seed: int) -> np.ndarray:
    """A 64-bit seed as the uint32 words [low, high] a seed tensor holds."""
    if not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2 ** 64:
        raise ValueError(f"a seed is an integer in [0, 2**64), got {seed!r}")
    return np.array([int(seed) & MASK32, int(seed) >> 32], dtype=np.uint32)


def seed_tensor(graph: Graph, name: str = "seed", tile: int = 0) -> Tensor:
    """A device seed: uint32 [low, high] on one tile, always live; set it with
    `engine.writeTensor(seed, seed_words(value))` and advance it with `advance_seed`."""
    t = graph.addVariable(np.uint32, (2,), name, category="other", always_live=True)
    graph.setTileMapping(t, tile)
    return t


def _seed(graph: Graph, seed, name: str) -> Tensor:
    if isinstance(seed, Tensor):
        if seed.dtype not in (np.dtype(np.uint32), np.dtype(np.int32)) or seed.numel != 2:
            raise TypeError(f"{name}: seed tensor {seed.name!r} is {seed.dtype.name}{seed.shape}; a seed is two "
                            "uint32 (or int32) words [low, high]")
        return seed.reshape((2,))
    const = graph.addConstant(np.uint32, (2,), seed_words(seed), f"{name}/seed")
    graph.setTileMapping(const, 0)
    return const


def _seed_per_tile(graph: Graph, body: Sequence, seed: Tensor, tiles: list[int], name: str) -> Tensor:
    """A copy of the seed on each of `tiles` (row j on tiles[j])."""
    spread = seed.reshape((1, 2)).broadcast((len(tiles), 2))
    return placed(graph, body, spread, np.repeat(np.asarray(tiles, dtype=np.int64), 2), f"{name}/seed")


def advance_seed(graph: Graph, seed: Tensor, prog: Sequence, step: int = 1, name: str = "advance_seed") -> None:
    """seed += step (as one 64-bit number), in place on the seed's tile."""
    if not isinstance(seed, Tensor) or seed.var.constant is not None:
        raise TypeError(f"{name}: only a seed tensor (see seed_tensor) can be advanced, not a constant seed")
    seed = _seed(graph, seed, name)
    tiles = np.unique(seed.tiles())
    if tiles.size != 1:
        raise ValueError(f"{name}: seed {seed.name!r} is split over tiles {tiles.tolist()}; map both words to one "
                         "tile (seed_tensor does)")
    body = Sequence(name=name)
    cs = graph.addComputeSet(name)
    graph.addVertex(cs, SEED_ADVANCE_VERTEX, int(tiles[0]), {"seed": seed}, (int(step),))
    body.add(Execute(cs))

    def fast(io):
        lo, hi = (int(w) & MASK32 for w in io.read(seed))
        total = ((hi << 32 | lo) + int(step)) % 2 ** 64
        io.write(seed, np.array([total & MASK32, total >> 32], dtype=np.uint64).astype(seed.dtype))

    prog.add(OpProgram(name, body, fast, (seed,), (seed,)))


def _key(io, seed: Tensor) -> tuple[int, int]:
    lo, hi = (int(w) & MASK32 for w in io.read(seed))
    return lo, hi


# ---- vertex placement ----------------------------------------------------------------------------
def contiguous_work(tiles: np.ndarray, workers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vertices over flat positions: vertex v on `tile[v]` takes positions [begin[v], end[v]), a
    contiguous run of one tile's elements at most about a worker's share of the tile (in vector
    grains). Tiles in increasing order, runs in position order."""
    order, values, _, counts = tile_groups(tiles)
    sorted_tiles = np.asarray(tiles).reshape(-1)[order]
    share = np.maximum(GRAIN, -(-(-(-counts // workers)) // GRAIN) * GRAIN)
    cut = np.ones(order.size, bool)
    cut[1:] = (np.diff(order) != 1) | (np.diff(sorted_tiles) != 0)
    run_first = np.flatnonzero(cut)
    run_length = np.diff(np.append(run_first, order.size))
    run_share = share[np.searchsorted(values, sorted_tiles[run_first])]
    pieces = -(-run_length // run_share)
    run = np.repeat(np.arange(run_first.size), pieces)
    begin = order[run_first][run] + (np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * \
        run_share[run]
    end = np.minimum(begin + run_share[run], order[run_first][run] + run_length[run])
    return sorted_tiles[run_first][run], begin, end


def _check_probability(p: float, what: str, name: str) -> float:
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name}: {what} must be in [0, 1], got {p}")
    return p


# ---- ops ---------------------------------------------------------------------------------------
def _random(graph: Graph, kind: int, shape, seed, prog: Sequence, a: float, b: float, dtype, name: str,
            seed_modifier: int) -> Tensor:
    dtype = as_dtype(dtype)
    if kind not in (BERNOULLI, GEOMETRIC, INTEGERS) and dtype.kind != "f":
        raise TypeError(f"{name}: output dtype must be float32 or float16, got {dtype.name}")
    seed = _seed(graph, seed, name)
    out = new_output(graph, dtype, shape, name)
    body = Sequence(name=name)
    work, begin, end = contiguous_work(out.tiles().reshape(-1), graph.target.workers_per_tile)
    if work.size:
        tiles = np.unique(work)
        seeds = _seed_per_tile(graph, body, seed, tiles, name)
        cs = graph.addComputeSet(name)
        fields = {"seed": Field.strided(seeds, 2 * np.searchsorted(tiles, work), 1, 2),
                  "out": Field.strided(out, begin, 1, end - begin)}
        params = np.stack(np.broadcast_arrays(kind, begin, a, b, int(seed_modifier)), 1).astype(np.float64)
        graph.addVertices(cs, RANDOM_VERTEX, work, fields, params)
        body.add(Execute(cs))

    def fast(io):
        res = np.empty(out.shape, dtype=dtype)
        k0, k1 = _key(io, seed)
        random_whole(np.uint64(k0), np.uint64(k1), int(seed_modifier), kind, kernel_view(res.reshape(-1)), a, b)
        io.write(out, res)

    prog.add(OpProgram(name, body, fast, (seed,), (out,)))
    return out


def uniform(graph: Graph, shape, seed, prog: Sequence, low: float = 0.0, high: float = 1.0, dtype=np.float32,
            name: str = "uniform", *, seed_modifier: int = 0) -> Tensor:
    """Uniform numbers in [low, high), mapped linearly over the tiles."""
    return _random(graph, UNIFORM, shape, seed, prog, float(low), float(high), dtype, name, seed_modifier)


def normal(graph: Graph, shape, seed, prog: Sequence, mean: float = 0.0, std: float = 1.0, dtype=np.float32,
           name: str = "normal", *, seed_modifier: int = 0) -> Tensor:
    """Normal numbers (Box-Muller), mapped linearly over the tiles."""
    if std < 0:
        raise ValueError(f"{name}: std must be non-negative, got {std}")
    return _random(graph, NORMAL, shape, seed, prog, float(mean), float(std), dtype, name, seed_modifier)


def bernoulli(graph: Graph, shape, prob: float, seed, prog: Sequence, dtype=np.float32, name: str = "bernoulli",
              *, seed_modifier: int = 0) -> Tensor:
    """1 with probability `prob`, else 0 (float, int32 or bool), mapped linearly over the tiles."""
    prob = _check_probability(prob, "prob", name)
    return _random(graph, BERNOULLI, shape, seed, prog, math.floor(prob * TWO_32), 0.0, dtype, name, seed_modifier)


def exponential(graph: Graph, shape, seed, prog: Sequence, rate: float = 1.0, dtype=np.float32,
                name: str = "exponential", *, seed_modifier: int = 0) -> Tensor:
    """Exponential numbers of the given rate (torch's lambd): density rate * exp(-rate * x), x > 0."""
    if not rate > 0:
        raise ValueError(f"{name}: the rate must be positive, got {rate}")
    return _random(graph, EXPONENTIAL, shape, seed, prog, float(rate), 0.0, dtype, name, seed_modifier)


def cauchy(graph: Graph, shape, seed, prog: Sequence, median: float = 0.0, sigma: float = 1.0, dtype=np.float32,
           name: str = "cauchy", *, seed_modifier: int = 0) -> Tensor:
    """Cauchy numbers: density 1 / (pi * sigma * (1 + ((x - median) / sigma)**2))."""
    if not sigma > 0:
        raise ValueError(f"{name}: sigma must be positive, got {sigma}")
    return _random(graph, CAUCHY, shape, seed, prog, float(median), float(sigma), dtype, name, seed_modifier)


def geometric(graph: Graph, shape, p: float, seed, prog: Sequence, dtype=np.float32, name: str = "geometric", *,
              seed_modifier: int = 0) -> Tensor:
    """The number of Bernoulli(p) trials up to and including the first success: k >= 1 with
    probability (1 - p)**(k - 1) * p (float or int32)."""
    if not 0.0 < float(p) < 1.0:
        raise ValueError(f"{name}: p must be in the open interval (0, 1), got {p}")
    return _random(graph, GEOMETRIC, shape, seed, prog, math.log1p(-float(p)), 0.0, dtype, name, seed_modifier)


def log_normal(graph: Graph, shape, seed, prog: Sequence, mean: float = 1.0, std: float = 2.0, dtype=np.float32,
               name: str = "log_normal", *, seed_modifier: int = 0) -> Tensor:
    """exp(N(mean, std**2)): numbers whose logarithm is normal."""
    if not std > 0:
        raise ValueError(f"{name}: std must be positive, got {std}")
    return _random(graph, LOG_NORMAL, shape, seed, prog, float(mean), float(std), dtype, name, seed_modifier)


def integers(graph: Graph, shape, low: int, high: int, seed, prog: Sequence, dtype=np.int32, name: str = "integers",
             *, seed_modifier: int = 0) -> Tensor:
    """Integers uniform in [low, high) (int32 or float), as PopLibs' uniform of an integer type."""
    low, high = int(low), int(high)
    if not 0 < high - low < 2 ** 32:
        raise ValueError(f"{name}: need low < high and high - low < 2**32, got [{low}, {high})")
    if as_dtype(dtype) == np.int32 and not (-2 ** 31 <= low and high - 1 < 2 ** 31):
        raise ValueError(f"{name}: [{low}, {high}) does not fit in int32")
    return _random(graph, INTEGERS, shape, seed, prog, float(low), float(high - low), dtype, name, seed_modifier)


def _dropout_scale(p: float) -> float:
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)


def dropout(graph: Graph, x: Tensor, p: float, seed, prog: Sequence, name: str = "dropout", *,
            seed_modifier: int = 0) -> tuple[Tensor, Tensor]:
    """torch.nn.functional.dropout in training: returns (y, mask) with mask[i] = element i kept
    (probability 1 - p) and y = x * mask / (1 - p); both mapped like x."""
    p = _check_probability(p, "dropout probability p", name)
    if x.dtype.kind != "f":
        raise TypeError(f"{name}: {x.name!r} is {x.dtype.name}; dropout needs a float tensor")
    seed = _seed(graph, seed, name)
    threshold, scale = float(math.floor(p * TWO_32)), _dropout_scale(p)
    y = graph.addVariable(x.dtype, x.shape, name, category="activations", always_live=False)
    mask = graph.addVariable(np.bool_, x.shape, f"{name}/mask", category="activations", always_live=False)
    y.var.mapping = x.tile_map()
    mask.var.mapping = y.var.mapping
    body = Sequence(name=name)
    work, begin, end = contiguous_work(y.tiles().reshape(-1), graph.target.workers_per_tile)
    if work.size:
        tiles = np.unique(work)
        seeds = _seed_per_tile(graph, body, seed, tiles, name)
        cs = graph.addComputeSet(name)
        fields = {"x": Field.strided(x, begin, 1, end - begin),
                  "seed": Field.strided(seeds, 2 * np.searchsorted(tiles, work), 1, 2),
                  "out": Field.strided(y, begin, 1, end - begin), "mask": Field.strided(mask, begin, 1, end - begin)}
        params = np.stack(np.broadcast_arrays(begin, threshold, scale, int(seed_modifier)), 1).astype(np.float64)
        graph.addVertices(cs, DROPOUT_VERTEX, work, fields, params)
        body.add(Execute(cs))

    def fast(io):
        res = np.empty(x.shape, dtype=x.dtype)
        keep = np.empty(x.shape, dtype=np.bool_)
        k0, k1 = _key(io, seed)
        dropout_whole(kernel_view(np.ascontiguousarray(io.read(x)).reshape(-1)), kernel_view(res.reshape(-1)),
                      keep.reshape(-1), np.uint64(k0), np.uint64(k1), int(seed_modifier), threshold, scale)
        io.write(y, res)
        io.write(mask, keep)

    prog.add(OpProgram(name, body, fast, (x, seed), (y, mask)))
    return y, mask


def dropout_backward(graph: Graph, dy: Tensor, mask: Tensor, p: float, prog: Sequence,
                     name: str = "dropout_backward") -> Tensor:
    """dx = dy * mask / (1 - p), mapped like dy."""
    p = _check_probability(p, "dropout probability p", name)
    if mask.dtype != np.bool_ or mask.shape != dy.shape:
        raise ValueError(f"{name}: mask {mask.name!r} must be a bool tensor of the gradient's shape {dy.shape}, "
                         f"got {mask.dtype.name}{mask.shape}")
    scale = _dropout_scale(p)
    dx = graph.addVariable(dy.dtype, dy.shape, name, category="activations", always_live=False)
    dx.var.mapping = dy.tile_map()
    body = Sequence(name=name)
    dx_tiles = dx.tile_map()
    ml = placed(graph, body, mask, dx_tiles, f"{name}/mask")
    cs = graph.addComputeSet(name)

    def split(counts):  # each tile's elements as np.array_split splits them into min(workers, count // GRAIN) parts
        parts = np.minimum(graph.target.workers_per_tile, np.maximum(1, counts // GRAIN))
        index = np.repeat(np.arange(counts.size), parts)
        k = np.arange(parts.sum()) - np.repeat(np.cumsum(parts) - parts, parts)
        small, extra = (counts // parts)[index], (counts % parts)[index]
        begin = k * small + np.minimum(k, extra)
        return index, begin, begin + small + (k < extra)

    work = region_work(dx_tiles, graph.target.workers_per_tile, split=split)
    fields = {f: work.field(t) for f, t in {"dy": dy, "mask": ml, "out": dx}.items()}
    graph.addVertices(cs, DROPOUT_GRAD_VERTEX, work.tiles, fields, np.array([scale]))
    body.add(Execute(cs))

    def fast(io):
        res = np.empty(dy.shape, dtype=dy.dtype)
        dropout_grad_whole(kernel_view(np.ascontiguousarray(io.read(dy)).reshape(-1)),
                           np.ascontiguousarray(io.read(mask)).reshape(-1), kernel_view(res.reshape(-1)), scale)
        io.write(dx, res)

    prog.add(OpProgram(name, body, fast, (dy, mask), (dx,)))
    return dx
