"""Optimiser weight updates: SGD, Adam, AdamW, RMSprop and LAMB, in place, where the weight lives.

Semantics follow torch.optim (SGD, Adam, AdamW, RMSprop) and PopTorch's LAMB, with PopTorch's
`loss_scaling`: the incoming gradient is divided by it first. With d = grad / loss_scaling:
- SGD: d += wd*w; with momentum, buf = d on the first step, else momentum*buf + (1-dampening)*d,
  and d = d + momentum*buf (nesterov) or buf; w -= lr*d.
- Adam: d += wd*w; AdamW instead w *= 1 - lr*wd (decoupled). m = b1*m + (1-b1)*d,
  v = b2*v + (1-b2)*d^2, w -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps) (without
  `bias_correction`, PopTorch's option: w -= lr * m / (sqrt(v) + eps)).
- RMSprop: d += wd*w; sq = alpha*sq + (1-alpha)*d^2; centered: ga = alpha*ga + (1-alpha)*d and
  avg = sqrt(sq - ga^2) + eps, else avg = sqrt(sq) + eps; with momentum buf = momentum*buf + d/avg
  and w -= lr*buf, else w -= lr*d/avg.
- LAMB: m, v as Adam (bias-corrected when `bias_correction`), u = m^/(sqrt(v^) + eps) + wd*w,
  r1 = min(||w||, max_weight_norm), r2 = ||u||, w -= lr * (r1/r2 if r1 > 0 and r2 > 0 else 1) * u.

Device state. Every optimiser keeps, per IPU graph, one always-live float32 "hyper" tensor of shape
(tiles, len(HYPER)) whose row t lives on tile t (category "optimiser_state"): every update vertex
reads its hyperparameters from its own tile, and the host changes them with `Optimiser.set(engine,
lr=...)` (an `engine.writeTensor`, no graph rebuild). Per weight, a `WeightState` holds the state
tensors (torch's names: momentum_buffer, exp_avg, exp_avg_sq, square_avg, grad_avg), mapped
exactly like the weight, in `state_dtype` (float32 by default, also for float16 weights; a dict
gives each slot its own, as PopTorch's first- and second-order momentum types do), and a
float32 step counter per update vertex that the vertex increments itself, so bias correction and
SGD's first-step buffer work across any number of steps inside one engine run.

Mapping: the weight is not moved. Its elements on each tile are split over the tile's workers (one
vertex each); the gradient is brought to the weight's tiles by exchange when it lives elsewhere.
LAMB runs four steps: a compute set writes u (a float32 temporary mapped like w) and the
moments; `reduce.reduce(..., "sum_squares")` gives ||w||^2 and ||u||^2 (PopLibs-style two-stage
reductions across tiles, float32); each squared norm is exchanged to the weight's tiles, where a
second compute set applies the trust ratio.

Numerics: one codelet serves every optimiser; it computes in float64 from the stored values and
rounds each stored value once; state values are re-read after being stored, as in torch. The fast
mode calls the same codelet on whole arrays with the same vertex partition (and the reductions'
own fast forms), so both modes agree bit for bit. The step counter is float32: exact for 2^24 steps.

Cycles (one vertex of n weight elements, thread instructions, `target.thread_cycles`):
  ceil(n / width) * per_vector + n * per_element + per_vertex
width = 2 when any of weight, gradient or state is float32 (64-bit loads), else 4. Table (UPDATE_COSTS):
  SGD            per_vector 3 (+3 momentum, +1 nesterov)        per_element 0   per_vertex 8
  Adam / AdamW   per_vector 10 (+1 decoupled decay)             per_element 20  per_vertex 40
  RMSprop        per_vector 6 (+3 centered, +3 momentum)        per_element 20  per_vertex 8
  LAMB direction per_vector 11                                  per_element 20  per_vertex 40
  LAMB apply     per_vector 3                                   per_element 0   per_vertex 40
per_element is the square root and the division, which do not vectorise (as sqrt and div in
elementwise.py, 10 each); per_vertex covers loading hyperparameters and the step counter and
the powers for bias correction (LAMB apply: two square roots, a division and a minimum). The
norms cost what reduce.py's estimators say.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..device.graph import Graph
from ..device.kernels import JIT, kernel_threads, kernel_view, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.mapping import TileMap
from ..device.tensor import Tensor
from ..device.vertex import Field, VertexType
from .common import Work, lookup, placed, region_work
from .reduce import reduce

KERNEL = dict(JIT, error_model="numpy")  # IEEE results (inf, nan) instead of Python exceptions

# Codelet kinds and flags.
SGD_KIND, ADAM_KIND, RMSPROP_KIND, LAMB_DIRECTION, LAMB_APPLY = range(5)
MOMENTUM, NESTEROV, DECOUPLED, CENTERED, BIAS_CORRECTION, TF_VARIANT = 1, 2, 4, 8, 16, 32

# kind -> (instructions per vector, per element, per vertex); see the module docstring.
UPDATE_COSTS = {SGD_KIND: (3, 0, 8), ADAM_KIND: (10, 20, 40), RMSPROP_KIND: (6, 20, 8),
                LAMB_DIRECTION: (11, 20, 40), LAMB_APPLY: (3, 0, 40)}
FLAG_COSTS = {MOMENTUM: 3, NESTEROV: 1, DECOUPLED: 1, CENTERED: 3, TF_VARIANT: 1}
FLOAT_DTYPES = ("float32", "float16")
EMPTY = np.zeros(0, dtype=np.int64)


# ---- codelets ---------------------------------------------------------------------------------
@njit(**KERNEL)
def sgd_element(w, wi, g, gi, buf, bi, step, flags, lr, ls, wd, momentum, dampening):
    x = ld(w, wi)
    d = ld(g, gi) / ls + wd * x
    if flags & MOMENTUM:
        b = d if step <= 1.0 else momentum * ld(buf, bi) + (1.0 - dampening) * d
        st(buf, bi, b)
        b = ld(buf, bi)
        d = d + momentum * b if flags & NESTEROV else b
    st(w, wi, x - lr * d)


@njit(**KERNEL)
def moments(m, mi, v, vi, d, beta1, beta2):
    """Update the first and second moments with d; returns their stored values."""
    st(m, mi, beta1 * ld(m, mi) + (1.0 - beta1) * d)
    st(v, vi, beta2 * ld(v, vi) + (1.0 - beta2) * d * d)
    return ld(m, mi), ld(v, vi)


@njit(**KERNEL)
def adam_element(w, wi, g, gi, m, mi, v, vi, flags, lr, ls, wd, beta1, beta2, eps, bc1, bc2):
    x = ld(w, wi)
    d = ld(g, gi) / ls
    if flags & DECOUPLED:
        x = x * (1.0 - lr * wd)
    else:
        d = d + wd * x
    mm, vv = moments(m, mi, v, vi, d, beta1, beta2)
    st(w, wi, x - (lr / bc1) * mm / (math.sqrt(vv) / math.sqrt(bc2) + eps))


@njit(**KERNEL)
def rmsprop_element(w, wi, g, gi, sq, si, ga, gai, buf, bi, flags, lr, ls, wd, alpha, momentum, eps):
    x = ld(w, wi)
    d = ld(g, gi) / ls + wd * x
    st(sq, si, alpha * ld(sq, si) + (1.0 - alpha) * d * d)
    s = ld(sq, si)
    if flags & CENTERED:
        st(ga, gai, alpha * ld(ga, gai) + (1.0 - alpha) * d)
        a = ld(ga, gai)
        s = s - a * a
    # TensorFlow's variant adds eps inside the square root and folds lr into the momentum buffer
    avg = math.sqrt(s + eps) if flags & TF_VARIANT else math.sqrt(s) + eps
    if flags & MOMENTUM and flags & TF_VARIANT:
        st(buf, bi, momentum * ld(buf, bi) + lr * d / avg)
        st(w, wi, x - ld(buf, bi))
    elif flags & MOMENTUM:
        st(buf, bi, momentum * ld(buf, bi) + d / avg)
        st(w, wi, x - lr * ld(buf, bi))
    else:
        st(w, wi, x - lr * d / avg)


@njit(**KERNEL)
def lamb_direction_element(w, wi, g, gi, m, mi, v, vi, u, ui, ls, wd, beta1, beta2, eps, bc1, bc2):
    """Store LAMB's update direction u (w is only read)."""
    mm, vv = moments(m, mi, v, vi, ld(g, gi) / ls, beta1, beta2)
    st(u, ui, (mm / bc1) / (math.sqrt(vv) / math.sqrt(bc2) + eps) + wd * ld(w, wi))


@njit(**KERNEL)
def vertex_scalars(kind, flags, step, p3, p4, p6, s0, i0, s1, i1):
    """(bias corrections, LAMB trust ratio) of one vertex at this step."""
    bc1, bc2, trust = 1.0, 1.0, 1.0
    if (kind == ADAM_KIND or kind == LAMB_DIRECTION) and flags & BIAS_CORRECTION:
        bc1 = 1.0 - p3 ** step
        bc2 = 1.0 - p4 ** step
    elif kind == LAMB_APPLY:
        r1 = min(math.sqrt(ld(s0, i0)), p6)
        r2 = math.sqrt(ld(s1, i1))
        trust = r1 / r2 if (r1 > 0.0 and r2 > 0.0) else 1.0
    return bc1, bc2, trust


def at(addresses, i):
    """Element i of a field: `addresses[i]` for a codelet's address list, `addresses + i` for a
    whole flat array (`addresses` its first position)."""


@overload(at, jit_options=KERNEL)
def _at(addresses, i):
    if isinstance(addresses, types.Integer):
        return lambda addresses, i: addresses + i
    return lambda addresses, i: addresses[i]


@njit(**KERNEL)
def sgd_range(n, w, wa, g, ga, buf, ba, momentum, step, flags, lr, ls, wd, p3, p4):
    for i in range(n):
        sgd_element(w, at(wa, i), g, at(ga, i), buf, at(ba, i) if momentum else 0, step, flags, lr, ls, wd, p3, p4)


@njit(**KERNEL)
def adam_range(n, w, wa, g, ga, m, ma, v, va, flags, lr, ls, wd, p3, p4, p5, bc1, bc2):
    for i in range(n):
        adam_element(w, at(wa, i), g, at(ga, i), m, at(ma, i), v, at(va, i), flags, lr, ls, wd, p3, p4, p5, bc1, bc2)


@njit(**KERNEL)
def rmsprop_range(n, w, wa, g, ga, sq, sa, avg, aa, centered, buf, ba, momentum, flags, lr, ls, wd, p3, p4, p5):
    for i in range(n):
        rmsprop_element(w, at(wa, i), g, at(ga, i), sq, at(sa, i), avg, at(aa, i) if centered else 0, buf,
                        at(ba, i) if momentum else 0, flags, lr, ls, wd, p3, p4, p5)


@njit(**KERNEL)
def lamb_direction_range(n, w, wa, g, ga, m, ma, v, va, u, ua, ls, wd, p3, p4, p5, bc1, bc2):
    for i in range(n):
        lamb_direction_element(w, at(wa, i), g, at(ga, i), m, at(ma, i), v, at(va, i), u, at(ua, i), ls, wd, p3, p4,
                               p5, bc1, bc2)


@njit(**KERNEL)
def lamb_apply_range(n, w, wa, g, ga, lr, trust):
    for i in range(n):
        wi = at(wa, i)
        st(w, wi, ld(w, wi) - lr * trust * ld(g, at(ga, i)))


@njit(inline="always", **KERNEL)
def update_range(kind, flags, n, w, wa, g, ga, s0, s0a, each0, s1, s1a, each1, s2, s2a, each2, step, lr, ls, wd, p3, p4,
                 p5, bc1, bc2, trust):
    """Update n elements by the optimiser `kind`: element i of each field at `at(xa, i)` (state
    fields connect the elements, or nothing: `each`). Each kind's loop is a function of its own:
    compiled beside the others in one function, the loops do not vectorise."""
    if kind == SGD_KIND:
        sgd_range(n, w, wa, g, ga, s0, s0a, flags & MOMENTUM and each0, step, flags, lr, ls, wd, p3, p4)
    elif kind == ADAM_KIND:
        adam_range(n, w, wa, g, ga, s0, s0a, s1, s1a, flags, lr, ls, wd, p3, p4, p5, bc1, bc2)
    elif kind == RMSPROP_KIND:
        rmsprop_range(n, w, wa, g, ga, s0, s0a, s1, s1a, flags & CENTERED and each1, s2, s2a,
                      flags & MOMENTUM and each2, flags, lr, ls, wd, p3, p4, p5)
    elif kind == LAMB_DIRECTION:
        lamb_direction_range(n, w, wa, g, ga, s0, s0a, s1, s1a, s2, s2a, ls, wd, p3, p4, p5, bc1, bc2)
    else:
        lamb_apply_range(n, w, wa, g, ga, lr, trust)


@njit(**KERNEL)
def hyper_row(h, ha, hb, nh):
    """lr, loss scaling, weight decay and up to four more hyperparameters from a hyper row."""
    return (ld(h, ha[hb]), ld(h, ha[hb + 1]), ld(h, ha[hb + 2]), ld(h, ha[hb + 3]), ld(h, ha[hb + 4]),
            ld(h, ha[hb + 5]) if nh > 5 else 0.0, ld(h, ha[hb + 6]) if nh > 6 else 0.0)


@njit(**KERNEL)
def next_step(t, ta, ts, v):
    """The vertex's step counter advanced (0 when it has none)."""
    if ts[v + 1] == ts[v]:
        return 0.0
    step = ld(t, ta[ts[v]]) + 1.0
    st(t, ta[ts[v]], step)
    return step


@njit(parallel=True, **KERNEL)
def update_codelet(w, wa, ws, g, ga, gs, s0, s0a, s0s, s1, s1a, s1s, s2, s2a, s2s, h, ha, hs, t, ta, ts, params):
    """Fields: w (weight), g (gradient; LAMB apply: u), s0..s2 (state; LAMB direction: s2 is u;
    LAMB apply: s0 and s1 hold the squared norms of w and u), h (the tile's hyper row), t (the
    vertex's step counter, or nothing). params: (kind, flags, vector width)."""
    for v in prange(params.shape[0]):
        kind, flags = int(params[v, 0]), int(params[v, 1])
        lr, ls, wd, p3, p4, p5, p6 = hyper_row(h, ha, hs[v], hs[v + 1] - hs[v])
        step = next_step(t, ta, ts, v)
        w0, g0, a0, a1, a2 = ws[v], gs[v], s0s[v], s1s[v], s2s[v]
        n = ws[v + 1] - w0
        bc1, bc2, trust = vertex_scalars(kind, flags, step, p3, p4, p6, s0, s0a[a0] if s0s[v + 1] > a0 else 0,
                                         s1, s1a[a1] if s1s[v + 1] > a1 else 0)
        # state fields connect the vertex's elements, or nothing (LAMB apply: one norm each)
        each0, each1, each2 = s0s[v + 1] - a0 == n, s1s[v + 1] - a1 == n, s2s[v + 1] - a2 == n
        update_range(kind, flags, n, w, wa[w0:], g, ga[g0:], s0, s0a[a0:], each0, s1, s1a[a1:], each1, s2, s2a[a2:],
                     each2, step, lr, ls, wd, p3, p4, p5, bc1, bc2, trust)


@njit(**KERNEL)
def update_span(kind, flags, w, g, s0, s1, s2, first, end, step, lr, ls, wd, p3, p4, p5, bc1, bc2, trust):
    """`update_range` over positions [first, end) of the whole flat fields: each field that has an
    element per weight element is cut to the span, so the loop indexes from 0 and vectorises;
    the others (LAMB apply's norms) are read at 0."""
    each0, each1, each2 = s0.size == w.size, s1.size == w.size, s2.size == w.size
    update_range(kind, flags, end - first, w[first:end], 0, g[first:end], 0, s0[first:end] if each0 else s0, 0, each0,
                 s1[first:end] if each1 else s1, 0, each1, s2[first:end] if each2 else s2, 0, each2, step, lr, ls,
                 wd, p3, p4, p5, bc1, bc2, trust)


@njit(parallel=True, **KERNEL)
def update_whole(w, g, s0, s1, s2, h, ha, hs, t, ta, ts, run_start, run_length, runs, params, spans, rows, threads):
    """The fast mode's form of `update_codelet`: every field of elements is its whole flat array
    and vertex v updates the positions of runs `runs[v] .. runs[v+1] - 1` (`run_start`,
    `run_length`) in each; LAMB apply reads the norms s0[0] and s1[0]. Same arithmetic, element
    by element, as the codelet. `rows`: where each distinct hyperparameter row the vertices read
    starts in h when no vertex has a step counter (the vertices of one op share kind and flags),
    else nothing. When those rows are equal value for value, every vertex has the same scalars
    and the element spans `spans` [k, 2] (all vertices' runs, joined where they continue one
    another) are updated in parallel, a pass each;
    otherwise vertices run in `threads` runs of consecutive vertices, within which adjacent runs
    of vertices with the same scalars (hyperparameters, step, corrections) form one span."""
    vertices = params.shape[0]
    if vertices == 0:
        return
    if _alike(h, rows, hs[1] - hs[0]):
        kind, flags = int(params[0, 0]), int(params[0, 1])
        lr, ls, wd, p3, p4, p5, p6 = hyper_row(h, ha, hs[0], hs[1] - hs[0])
        bc1, bc2, trust = vertex_scalars(kind, flags, 0.0, p3, p4, p6, s0, 0, s1, 0)
        if spans.shape[0] == 1:  # no parallel region (waking a thread costs more than a span's update)
            update_span(kind, flags, w, g, s0, s1, s2, spans[0, 0], spans[0, 1], 0.0, lr, ls, wd, p3, p4, p5, bc1, bc2,
                        trust)
            return
        for k in prange(spans.shape[0]):
            update_span(kind, flags, w, g, s0, s1, s2, spans[k, 0], spans[k, 1], 0.0, lr, ls, wd, p3, p4, p5, bc1, bc2,
                        trust)
        return
    for part in prange(threads):
        held = np.full(12, np.nan)  # kind, flags, step, lr, ls, wd, p3, p4, p5, bc1, bc2, trust of the span
        now = np.empty(12)
        first = end = 0
        for v in range(part * vertices // threads, (part + 1) * vertices // threads):
            kind, flags = int(params[v, 0]), int(params[v, 1])
            lr, ls, wd, p3, p4, p5, p6 = hyper_row(h, ha, hs[v], hs[v + 1] - hs[v])
            step = next_step(t, ta, ts, v)
            bc1, bc2, trust = vertex_scalars(kind, flags, step, p3, p4, p6, s0, 0, s1, 0)
            now[0], now[1], now[2], now[3], now[4], now[5] = kind, flags, step, lr, ls, wd
            now[6], now[7], now[8], now[9], now[10], now[11] = p3, p4, p5, bc1, bc2, trust
            same = True
            for i in range(12):
                same = same and now[i] == held[i]
            for r in range(runs[v], runs[v + 1]):
                if same and run_start[r] == end:
                    end += run_length[r]
                    continue
                _flush(w, g, s0, s1, s2, first, end, held)
                held[:] = now
                same, first, end = True, run_start[r], run_start[r] + run_length[r]
        _flush(w, g, s0, s1, s2, first, end, held)


@njit(**KERNEL)
def _alike(h, rows, width):
    """Whether the hyperparameter rows starting at `rows` (each `width` values of h) are all
    equal value for value (False when there are none)."""
    if rows.size == 0:
        return False
    for r in range(1, rows.size):
        for j in range(width):
            if not ld(h, rows[r] + j) == ld(h, rows[0] + j):
                return False
    return True


@njit(**KERNEL)
def _flush(w, g, s0, s1, s2, first, end, held):
    """`update_span` of the span [first, end) with the scalars `held` (nothing when empty)."""
    if end > first:
        update_span(int(held[0]), int(held[1]), w, g, s0, s1, s2, first, end, held[2], held[3], held[4], held[5],
                    held[6], held[7], held[8], held[9], held[10], held[11])


SPAN = 1 << 20  # elements per span of a uniform update: a large weight's update runs in parallel, a small one's not


def joined_spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[k, 2] (first, end) element spans covering the runs `starts`, `lengths` (disjoint), runs that
    continue one another joined, each span cut into pieces of at most SPAN elements."""
    if starts.size == 0:
        return np.zeros((0, 2), np.int64)
    order = np.argsort(starts, kind="stable")
    first, end = starts[order], starts[order] + lengths[order]
    breaks = np.flatnonzero(first[1:] != end[:-1]) + 1
    lo, hi = first[np.r_[0, breaks]], end[np.r_[breaks - 1, len(end) - 1]]
    pieces = -(-(hi - lo) // SPAN)
    cut = np.repeat(lo, pieces) + SPAN * (np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces))
    return np.stack([cut, np.minimum(cut + SPAN, np.repeat(hi, pieces))], axis=1).astype(np.int64)


def update_cycles(sizes, params, dtype, target) -> np.ndarray:
    kind, flags, width = (params[:, i].astype(np.int64) for i in range(3))
    per_vector, per_element, per_vertex = (lookup({k: c[i] for k, c in UPDATE_COSTS.items()}, kind) for i in range(3))
    flagged = np.isin(kind, (SGD_KIND, ADAM_KIND, RMSPROP_KIND))
    per_vector = per_vector + flagged * sum(c * ((flags & f) != 0) for f, c in FLAG_COSTS.items())
    n = sizes["w"]
    return target.thread_cycles(np.ceil(n / width) * per_vector + n * per_element + per_vertex)


UPDATE_VERTEX = VertexType("popart::OptimiserUpdate", ("w", "g", "s0", "s1", "s2", "h", "step"),
                           ("w", "s0", "s1", "s2", "step"), update_codelet, update_cycles, num_params=3)


# ---- device state -----------------------------------------------------------------------------
@dataclass(eq=False)
class Hyper:
    """An optimiser's hyperparameters on one IPU: row t of `tensor` lives on tile t."""
    graph: Graph
    tensor: Tensor
    names: tuple[str, ...]

    def read(self, engine) -> dict[str, float]:
        row = engine.readTensor(self.tensor)[0]
        return {n: float(v) for n, v in zip(self.names, row)}


@dataclass(eq=False)
class WeightState:
    """The optimiser state of one weight: state tensors shaped and mapped like the weight, and a
    step counter per update vertex. `vertices` gives each update vertex's tile and flat weight
    positions."""
    weight: Tensor
    tensors: dict[str, Tensor]
    slots: tuple[str | None, str | None, str | None]
    step: Tensor | None
    vertices: Work

    def read(self, engine) -> dict[str, np.ndarray | int]:
        """The state as host arrays (torch's names); `step` is the number of updates applied."""
        out: dict = {k: engine.readTensor(t) for k, t in self.tensors.items()}
        if self.step is not None:
            out["step"] = int(engine.readTensor(self.step).reshape(-1)[0])
        return out


@dataclass(frozen=True)
class Layout:
    """What an optimiser's configuration fixes in the graph: state slots, step counter, flags."""
    slots: tuple[str | None, str | None, str | None]
    uses_step: bool
    flags: int


def _key(t: Tensor):
    if t.span is not None:
        return (t.var.id, t.span, t.numel)
    return (t.var.id, t.index.tobytes())


@dataclass(eq=False)
class Optimiser:
    """Base of the optimiser configurations. Fields are the hyperparameters; the device tensors
    (one `Hyper` per IPU graph, one `WeightState` per weight) are created on first use."""
    KIND: ClassVar[int]
    HYPER: ClassVar[tuple[str, ...]]          # hyper tensor columns, in codelet order
    STRUCTURAL: ClassVar[tuple[str, ...]] = ("state_dtype",)

    def __post_init__(self):
        self.check()
        self._hypers: dict[int, Hyper] = {}
        self._states: dict[tuple, WeightState] = {}

    # -- configuration, overridden per optimiser --
    def check(self) -> None:
        if not self.lr >= 0.0:
            raise ValueError(f"{type(self).__name__}: invalid learning rate {self.lr}; it must be >= 0")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"{type(self).__name__}: invalid weight_decay {self.weight_decay}; it must be >= 0")
        if not self.loss_scaling > 0.0:
            raise ValueError(f"{type(self).__name__}: invalid loss_scaling {self.loss_scaling}; it must be > 0")
        dtypes = self.state_dtype.values() if isinstance(self.state_dtype, dict) else (self.state_dtype,)
        if any(np.dtype(d).name not in FLOAT_DTYPES for d in dtypes):
            raise TypeError(f"{type(self).__name__}: state_dtype must be float32 or float16 (or a dict of them by "
                            f"state slot), got {self.state_dtype!r}")
        if isinstance(self.state_dtype, dict):
            known = {s for s in self.layout().slots if s is not None}
            unknown = sorted(set(self.state_dtype) - known)
            if unknown:
                raise ValueError(f"{type(self).__name__}: state_dtype names slots {unknown} this configuration does "
                                 f"not keep; its state slots are {sorted(known)}")

    def slot_dtype(self, slot: str) -> str:
        """The dtype of state `slot`: `state_dtype` itself, or its entry for the slot (float32 when a
        dict leaves the slot out)."""
        if isinstance(self.state_dtype, dict):
            return self.state_dtype.get(slot, "float32")
        return self.state_dtype

    def hyper_values(self) -> dict[str, float]:
        raise NotImplementedError

    def layout(self) -> Layout:
        raise NotImplementedError

    def initial_state(self, slot: str) -> float:
        """The value state `slot` starts at (zero unless an optimiser says otherwise)."""
        return 0.0

    # -- device tensors --
    def hyper(self, graph: Graph) -> Hyper:
        """This optimiser's hyper tensor on `graph` (created on first use, initialised to the
        current hyperparameters when an engine loads)."""
        h = self._hypers.get(id(graph))
        if h is None:
            n, cols = graph.target.num_tiles, len(self.HYPER)
            t = graph.addVariable("float32", (n, cols), f"{type(self).__name__.lower()}/hyper",
                                  category="optimiser_state")
            graph.setTileMappingIntervals(t, [(i, i * cols, (i + 1) * cols) for i in range(n)])
            t.var.constant = np.empty((n, cols), dtype=np.float32)
            h = self._hypers[id(graph)] = Hyper(graph, t, self.HYPER)
            self._initialise(h)
        return h

    def hyper_on(self, graph: Graph) -> Hyper | None:
        """This optimiser's hyper tensor on `graph`, None if no update there uses it."""
        return self._hypers.get(id(graph))

    def _initialise(self, h: Hyper) -> None:
        values = self.hyper_values()
        h.tensor.var.constant[:] = np.asarray([values[n] for n in h.names], dtype=np.float32)

    def state(self, graph: Graph, weight: Tensor) -> WeightState:
        """The state of `weight` (created on first use at `initial_state`, mapped like the weight)."""
        found = self._states.get(_key(weight))
        if found is not None:
            return found
        layout = self.layout()
        tiles = weight.tile_map()
        if not tiles.mapped:
            raise ValueError(f"weight {weight.name!r} has elements without a tile mapping: map it before "
                             "building its update")
        vertices = region_work(tiles, graph.target.workers_per_tile, grain=4)
        tensors = {}
        for slot in layout.slots:
            if slot is not None:
                t = graph.addVariable(self.slot_dtype(slot), weight.shape, f"{weight.name}/{slot}",
                                      category="optimiser_state")
                t.var.mapping = tiles
                if self.initial_state(slot):
                    t.var.constant = np.full(weight.shape, self.initial_state(slot), dtype=self.slot_dtype(slot))
                tensors[slot] = t
        step = None
        if layout.uses_step:
            step = graph.addVariable("float32", (vertices.num_vertices,), f"{weight.name}/step",
                                     category="optimiser_state")
            step.var.mapping = TileMap.from_tiles(vertices.tiles)
        s = self._states[_key(weight)] = WeightState(weight, tensors, layout.slots, step, vertices)
        return s

    def state_of(self, weight: Tensor) -> WeightState:
        try:
            return self._states[_key(weight)]
        except KeyError:
            raise KeyError(f"{type(self).__name__} has no state for weight {weight.name!r}: build its update "
                           "with weight_update first") from None

    def set(self, engine, **changes) -> None:
        """Change hyperparameters (e.g. `lr=1e-4`): updates this configuration and writes the hyper
        tensors of every graph `engine` runs; later engines start from the new values too."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no hyperparameter(s) {unknown}; known: {sorted(names)}")
        fixed = sorted(set(changes) & set(self.STRUCTURAL))
        if fixed:
            raise ValueError(f"{type(self).__name__}: {fixed} shape the graph and cannot change between steps; "
                             "build the weight updates again with a new optimiser")
        new = replace(self, **changes)
        if self._states and new.layout() != self.layout():
            raise ValueError(f"{type(self).__name__}: changing {sorted(changes)} to {changes} adds or removes "
                             "optimiser state (e.g. momentum between zero and non-zero); build the weight "
                             "updates again with a new optimiser")
        for k, v in changes.items():
            setattr(self, k, getattr(new, k))
        graphs = {id(g) for g in engine.device.graphs}
        if self._hypers and not graphs & set(self._hypers):
            raise ValueError(f"{type(self).__name__}: the engine runs none of the graphs this optimiser updates")
        for key, h in self._hypers.items():
            self._initialise(h)
            if key in graphs:
                engine.writeTensor(h.tensor, h.tensor.var.constant)


def _betas(opt) -> None:
    b1, b2 = opt.betas
    if not 0.0 <= b1 < 1.0 or not 0.0 <= b2 < 1.0:
        raise ValueError(f"{type(opt).__name__}: invalid betas {opt.betas}; each must be in [0, 1)")
    if not opt.eps >= 0.0:
        raise ValueError(f"{type(opt).__name__}: invalid eps {opt.eps}; it must be >= 0")


@dataclass(eq=False)
class SGD(Optimiser):
    """torch.optim.SGD (PopTorch's SGD adds loss_scaling)."""
    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    loss_scaling: float = 1.0
    state_dtype: str | dict = "float32"
    momentum_state: bool = False    # keep the velocity at momentum 0 too (a momentum `set` may change)
    KIND: ClassVar[int] = SGD_KIND
    HYPER: ClassVar[tuple[str, ...]] = ("lr", "loss_scaling", "weight_decay", "momentum", "dampening")
    STRUCTURAL: ClassVar[tuple[str, ...]] = ("state_dtype", "nesterov", "momentum_state")

    def check(self):
        super().check()
        if not self.momentum >= 0.0:
            raise ValueError(f"SGD: invalid momentum {self.momentum}; it must be >= 0")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("SGD: Nesterov momentum requires a momentum and zero dampening")

    def hyper_values(self):
        return {"lr": self.lr, "loss_scaling": self.loss_scaling, "weight_decay": self.weight_decay,
                "momentum": self.momentum, "dampening": self.dampening}

    def layout(self):
        m = self.momentum != 0 or self.momentum_state
        return Layout(("momentum_buffer" if m else None, None, None), m,
                      (MOMENTUM if m else 0) | (NESTEROV if self.nesterov else 0))


@dataclass(eq=False)
class Adam(Optimiser):
    """torch.optim.Adam (L2 weight decay added to the gradient), without amsgrad; PopTorch's
    `bias_correction=False` drops the moments' bias corrections."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    loss_scaling: float = 1.0
    state_dtype: str | dict = "float32"
    bias_correction: bool = True
    KIND: ClassVar[int] = ADAM_KIND
    HYPER: ClassVar[tuple[str, ...]] = ("lr", "loss_scaling", "weight_decay", "beta1", "beta2", "eps")
    STRUCTURAL: ClassVar[tuple[str, ...]] = ("state_dtype", "bias_correction")
    DECOUPLED: ClassVar[bool] = False

    def check(self):
        super().check()
        _betas(self)

    def hyper_values(self):
        return {"lr": self.lr, "loss_scaling": self.loss_scaling, "weight_decay": self.weight_decay,
                "beta1": self.betas[0], "beta2": self.betas[1], "eps": self.eps}

    def layout(self):
        return Layout(("exp_avg", "exp_avg_sq", None), self.bias_correction,
                      (DECOUPLED if self.DECOUPLED else 0) | (BIAS_CORRECTION if self.bias_correction else 0))


@dataclass(eq=False)
class AdamW(Adam):
    """torch.optim.AdamW: weight decay decoupled from the gradient (w *= 1 - lr*weight_decay)."""
    weight_decay: float = 1e-2
    DECOUPLED: ClassVar[bool] = True


@dataclass(eq=False)
class RMSprop(Optimiser):
    """torch.optim.RMSprop; `tf_variant`: TensorFlow's RMSprop (PopTorch's `use_tf_variant`): the
    average of squared gradients starts at one, eps is added inside the square root and the
    momentum buffer accumulates lr times the step."""
    lr: float = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    loss_scaling: float = 1.0
    state_dtype: str | dict = "float32"
    momentum_state: bool = False    # keep the momentum buffer at momentum 0 too (a momentum `set` may change)
    tf_variant: bool = False
    KIND: ClassVar[int] = RMSPROP_KIND
    HYPER: ClassVar[tuple[str, ...]] = ("lr", "loss_scaling", "weight_decay", "alpha", "momentum", "eps")
    STRUCTURAL: ClassVar[tuple[str, ...]] = ("state_dtype", "centered", "momentum_state", "tf_variant")

    def check(self):
        super().check()
        if not self.alpha >= 0.0:   # torch.optim.RMSprop's bound
            raise ValueError(f"RMSprop: invalid alpha {self.alpha}; it must be >= 0")
        if not self.momentum >= 0.0 or not self.eps >= 0.0:
            raise ValueError(f"RMSprop: invalid momentum {self.momentum} or eps {self.eps}; both must be >= 0")

    def hyper_values(self):
        return {"lr": self.lr, "loss_scaling": self.loss_scaling, "weight_decay": self.weight_decay,
                "alpha": self.alpha, "momentum": self.momentum, "eps": self.eps}

    def layout(self):
        m = self.momentum > 0 or self.momentum_state
        return Layout(("square_avg", "grad_avg" if self.centered else None, "momentum_buffer" if m else None),
                      False, (MOMENTUM if m else 0) | (CENTERED if self.centered else 0) |
                      (TF_VARIANT if self.tf_variant else 0))

    def initial_state(self, slot: str) -> float:
        return 1.0 if self.tf_variant and slot == "square_avg" else 0.0


@dataclass(eq=False)
class LAMB(Optimiser):
    """PopTorch's LAMB: Adam moments, per-tensor trust ratio min(||w||, max_weight_norm) / ||u||
    (None: no clipping of ||w||), optional bias correction."""
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    bias_correction: bool = True
    loss_scaling: float = 1.0
    max_weight_norm: float | None = None
    state_dtype: str | dict = "float32"
    KIND: ClassVar[int] = LAMB_DIRECTION
    HYPER: ClassVar[tuple[str, ...]] = ("lr", "loss_scaling", "weight_decay", "beta1", "beta2", "eps",
                                        "max_weight_norm")
    STRUCTURAL: ClassVar[tuple[str, ...]] = ("state_dtype", "bias_correction")

    def check(self):
        super().check()
        _betas(self)
        if self.max_weight_norm is not None and not self.max_weight_norm >= 0.0:
            raise ValueError(f"LAMB: invalid max_weight_norm {self.max_weight_norm}; use None or a value >= 0")

    def hyper_values(self):
        return {"lr": self.lr, "loss_scaling": self.loss_scaling, "weight_decay": self.weight_decay,
                "beta1": self.betas[0], "beta2": self.betas[1], "eps": self.eps,
                "max_weight_norm": np.inf if self.max_weight_norm is None else self.max_weight_norm}

    def layout(self):
        return Layout(("exp_avg", "exp_avg_sq", None), self.bias_correction,
                      BIAS_CORRECTION if self.bias_correction else 0)


# ---- the op -----------------------------------------------------------------------------------
ELEMENTS, SCALAR, HYPER_ROW, STEP = "elements", "scalar", "hyper", "step"
FIELDS = ("w", "g", "s0", "s1", "s2", "h", "step")


@dataclass(frozen=True, eq=False)
class _Field:
    """A tensor connected to one update-vertex field: `elements` (shaped like the weight, each
    vertex takes its positions), `scalar` (one value every vertex reads), `hyper` or `step`."""
    tensor: Tensor
    kind: str
    written: bool = False


def _starts(sizes) -> np.ndarray:
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    return starts


def _fast_addresses(kind: str | None, vertices: Work, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(addresses, starts) of a hyper-row or step field for every vertex, as positions in the
    field's whole flat array (fields of elements are runs of the weight's positions instead)."""
    nv = vertices.num_vertices
    if kind == HYPER_ROW:
        rows = vertices.tiles.astype(np.int64)
        return (rows[:, None] * cols + np.arange(cols)).reshape(-1), _starts(np.full(nv, cols))
    if kind == STEP:
        return np.arange(nv, dtype=np.int64), _starts(np.ones(nv, dtype=np.int64))
    return EMPTY, np.zeros(nv + 1, dtype=np.int64)


def _update_op(graph: Graph, name: str, vertices: Work, params: tuple, connected: dict[str, _Field]) -> OpProgram:
    """One compute set of update vertices (one per vertex of `vertices`), operands brought to the
    vertices' tiles first; the fast mode runs the same codelet on whole arrays."""
    body = Sequence(name=name)
    weight_tiles = connected["w"].tensor.tile_map()
    tiles = np.unique(vertices.tiles)
    cols = connected["h"].tensor.shape[1]
    views = {}
    for f, c in connected.items():
        if c.kind == ELEMENTS and not c.written:
            views[f] = placed(graph, body, c.tensor, weight_tiles, f"{name}/{f}")
        elif c.kind == SCALAR:
            views[f] = placed(graph, body, c.tensor.reshape(1).broadcast((len(tiles),)), tiles,
                              f"{name}/{f}@tiles")
        else:
            views[f] = c.tensor
    cs = graph.addComputeSet(name)
    fields_ = {}
    for f in FIELDS:
        c = connected.get(f)
        if c is None:  # connects nothing
            fields_[f] = Field.strided(connected["h"].tensor, np.zeros(vertices.num_vertices, np.int64), 0, 0)
        elif c.kind == ELEMENTS:
            fields_[f] = vertices.field(views[f])
        elif c.kind == SCALAR:  # the copy on the vertex's tile
            fields_[f] = Field.strided(views[f], np.searchsorted(tiles, vertices.tiles), 1, 1)
        elif c.kind == HYPER_ROW:  # row `tile` of the hyperparameters
            fields_[f] = Field.strided(views[f], vertices.tiles.astype(np.int64) * cols, 1, cols)
        else:  # the vertex's own step counter
            fields_[f] = Field.strided(views[f], np.arange(vertices.num_vertices), 1, 1)
    graph.addVertices(cs, UPDATE_VERTEX, vertices.tiles, fields_, np.asarray(params, np.float64))
    body.add(Execute(cs))

    addresses = {f: _fast_addresses(connected[f].kind if f in connected else None, vertices, cols) for f in ("h", "step")}
    param_rows = np.tile(np.asarray(params, dtype=np.float64), (vertices.num_vertices, 1))
    spans = joined_spans(vertices.starts, vertices.lengths)
    uniform = connected["h"].kind == HYPER_ROW and "step" not in connected
    rows = np.unique(vertices.tiles).astype(np.int64) * cols if uniform else EMPTY
    empty = np.zeros(0, dtype=np.float32)

    def fast(io):
        # the codelet updates contiguous storage in place, as it does tile memory in strict mode;
        # other views are copied in and, when written, back
        arrays, copied = {}, []
        for f, c in connected.items():
            values = io.output(c.tensor) if c.written else io.read(c.tensor)
            if values is None or not values.flags.c_contiguous:
                values = np.array(io.read(c.tensor), order="C", copy=True)
                if c.written:
                    copied.append((f, c.tensor))
            arrays[f] = values.reshape(-1)
        w, g, s0, s1, s2, h, t = (kernel_view(arrays[f]) if f in arrays else empty for f in FIELDS)
        update_whole(w, g, s0, s1, s2, h, *addresses["h"], t, *addresses["step"], vertices.starts, vertices.lengths,
                     vertices.offsets, param_rows, spans, rows, kernel_threads(len(param_rows)))
        for f, t in copied:
            io.write(t, arrays[f].reshape(t.shape))

    reads = tuple(dict.fromkeys(c.tensor for c in connected.values()))
    writes = tuple(c.tensor for c in connected.values() if c.written)
    return OpProgram(name, body, fast, reads, writes)


def _width(*dtypes) -> int:
    return 2 if any(np.dtype(d) == np.float32 for d in dtypes) else 4


def weight_update(graph: Graph, weight: Tensor, grad: Tensor, optimiser: Optimiser, prog: Sequence,
                  name: str | None = None) -> WeightState:
    """Append to `prog` the in-place update of `weight` with `grad` by `optimiser`; returns the
    weight's optimiser state (created on first use)."""
    if not isinstance(optimiser, Optimiser):
        raise TypeError(f"weight_update needs an ipusim.ops.optim optimiser (SGD, Adam, AdamW, RMSprop, LAMB), "
                        f"got {type(optimiser).__name__}")
    if weight.var not in graph.variables:
        raise ValueError(f"weight {weight.name!r} lives on IPU {weight.ipu}, not on IPU {graph.ipu} of this graph")
    if grad.shape != weight.shape:
        raise ValueError(f"gradient {grad.name!r} has shape {grad.shape}, weight {weight.name!r} has {weight.shape}")
    if grad.ipu != weight.ipu:
        raise ValueError(f"gradient {grad.name!r} lives on IPU {grad.ipu}, weight {weight.name!r} on IPU "
                         f"{weight.ipu}: copy the gradient to the weight's IPU first (InterIpuCopy)")
    for t in (weight, grad):
        if t.dtype.name not in FLOAT_DTYPES:
            raise TypeError(f"{t.name!r} is {t.dtype.name}: weight updates need float32 or float16 tensors")
    name = name or f"{type(optimiser).__name__.lower()}/{weight.name}"
    hyper = optimiser.hyper(graph)
    state = optimiser.state(graph, weight)
    layout = optimiser.layout()
    if layout.slots != state.slots:
        raise ValueError(f"{name}: the state of {weight.name!r} was built for another configuration of "
                         f"{type(optimiser).__name__}")
    if weight.numel == 0:
        prog.add(OpProgram(name, Sequence(name=name), lambda io: None, (weight, grad), ()))
        return state
    width = _width(weight.dtype, grad.dtype, *(optimiser.slot_dtype(s) for s in layout.slots if s is not None))
    common = {"g": _Field(grad, ELEMENTS), "h": _Field(hyper.tensor, HYPER_ROW)}
    if state.step is not None:
        common["step"] = _Field(state.step, STEP, written=True)
    slots = {f"s{j}": _Field(state.tensors[s], ELEMENTS, written=True)
             for j, s in enumerate(state.slots) if s is not None}
    if not isinstance(optimiser, LAMB):
        prog.add(_update_op(graph, name, state.vertices, (optimiser.KIND, layout.flags, width),
                            {"w": _Field(weight, ELEMENTS, written=True), **common, **slots}))
        return state
    # LAMB: direction u, the two squared norms (cross-tile reductions), then the scaled update.
    u = graph.addVariable("float32", weight.shape, f"{name}/u", category="temporaries", always_live=False)
    u.var.mapping = weight.tile_map()
    parts = Sequence(name=name)
    parts.add(_update_op(graph, f"{name}/direction", state.vertices, (LAMB_DIRECTION, layout.flags, width),
                         {"w": _Field(weight, ELEMENTS), **common, **slots, "s2": _Field(u, ELEMENTS, written=True)}))
    w_sq = reduce(graph, weight, None, "sum_squares", parts, f"{name}/weight_norm", out_dtype="float32")
    u_sq = reduce(graph, u, None, "sum_squares", parts, f"{name}/update_norm", out_dtype="float32")
    parts.add(_update_op(graph, f"{name}/apply", state.vertices, (LAMB_APPLY, 0, _width(weight.dtype, "float32")),
                         {"w": _Field(weight, ELEMENTS, written=True), "g": _Field(u, ELEMENTS),
                          "s0": _Field(w_sq, SCALAR), "s1": _Field(u_sq, SCALAR), "h": common["h"]}))
    steps = list(parts.programs)

    def fast(io):
        for p in steps:
            p.fast(io)

    reads = (weight, grad, hyper.tensor, *state.tensors.values(), *((state.step,) if state.step is not None else ()))
    writes = (weight, *state.tensors.values(), *((state.step,) if state.step is not None else ()))
    prog.add(OpProgram(name, parts, fast, reads, writes))
    return state
