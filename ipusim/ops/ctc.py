"""CTC loss (connectionist temporal classification) and its gradient, with torch's semantics.

Inputs as torch.nn.functional.ctc_loss takes them: `log_probs` [T, N, C] (log-softmax applied),
`targets` [N, S] int32 padded (PopTorch supports only padded 2-D targets), `input_lengths` and
`target_lengths` [N] int32. Sample n uses frames t < input_lengths[n] and labels
s < target_lengths[n]; lengths are clamped to [0, T] and [0, S] (the device cannot raise on
data) and labels outside [0, C) have probability zero.

Maths (log space, extended label l' = blank, l1, blank, l2, ..., blank of length 2L + 1):
alpha[t, s] = logsumexp(alpha[t-1, s], alpha[t-1, s-1], alpha[t-1, s-2] if l'(s) != l'(s-2))
+ lp[t, l'(s)]; beta is the same recursion backwards in time (including lp at t, as torch);
nll = -logsumexp(alpha[T_n-1, 2L], alpha[T_n-1, 2L-1]) (T_n = 0: 0 if L = 0, else inf).
d loss / d lp[t, c] = (exp(lp[t, c]) - exp(logsumexp_{s: l'(s)=c}(alpha + beta)[t, s] + nll - lp[t, c])) * g_n
for t < T_n and 0 after, exactly the expression torch's CTC backward returns; g_n is the
incoming gradient, divided by max(L, 1) and N for reduction "mean". With zero_infinity an
infinite nll gives loss 0 and gradient 0; without it the loss is inf and the gradient NaN
(as torch). "mean" averages nll / max(L, 1) over the batch, "sum" sums nll.

Mapping (like PopLibs' CTC loss with a batch-only partition): sample n lives on tile
n * tiles // N (one or more samples per tile); its log-probabilities [T, C], labels, lengths
and alpha (and beta) tables [T, 2S + 1] are brought to or allocated on that tile and one vertex
(one worker) runs the recursion, which is sequential in time. alpha and beta are float32
tables in tile memory; each step is computed in float64 from the stored float32 values.
Forward: the per-sample losses (float32) are exchanged to tile 0, where one vertex reduces them
in sample order in float64 and rounds once. Backward recomputes alpha, then runs beta and the
gradient in the same vertex (PopLibs' gradGivenAlpha); the gradient is written on the sample's
tile. The fast mode runs the same per-sample functions over the batch, so both modes agree bit for bit.

Cycles per vertex (worker instructions, times 6 tile cycles each), from PopLibs' popnn CTC
estimators with log-add = 16 and log-mul = 1 instructions, for T frames and S labels (static:
padded sizes, not the data-dependent lengths):
- loss: alpha(T, S) + 16 (final log-add), alpha(T, S) = 44 * T * S + 17.
- gradient: alpha(T, S) + gradGivenAlpha(T, S) + 10 * T * C (two exps, three adds and a
  multiply per class), gradGivenAlpha(T, S) = alpha(T, S) + 40 * T * S + 17.
- batch reduction over N samples: 8 + 6 * N (load loss and length, clamp, divide, accumulate).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, kernel_view, ld, st
from ..device.program import Execute, OpProgram, Sequence
from ..device.mapping import TileMap
from ..device.tensor import Tensor
from ..device.vertex import Field, VertexType
from .common import placed

REDUCTIONS = {"mean": 0, "sum": 1}
LOG_ADD = 16
LOG_MUL = 1
NEG_INF = -np.inf


# ---- the recursion, shared by both modes ----------------------------------------------
@njit(**JIT)
def log_add(a, b):
    m = max(a, b)
    if m == NEG_INF:
        return NEG_INF
    return math.log(math.exp(a - m) + math.exp(b - m)) + m


@njit(**JIT)
def extended(label, s, blank):
    return blank if s % 2 == 0 else label[(s - 1) // 2]


@njit(**JIT)
def emission(lp, t, c):
    return lp[t, c] if c >= 0 and c < lp.shape[1] else NEG_INF


@njit(**JIT)
def ctc_alpha(lp, label, tn, ln, blank, alpha):
    """Fill alpha[:tn, :2ln+1] (float32) and return the negative log-likelihood."""
    width = 2 * ln + 1
    if tn == 0:
        return 0.0 if ln == 0 else np.inf
    for s in range(width):
        alpha[0, s] = NEG_INF
    alpha[0, 0] = emission(lp, 0, blank)
    if ln > 0:
        alpha[0, 1] = emission(lp, 0, label[0])
    for t in range(1, tn):
        for s in range(width):
            c = extended(label, s, blank)
            a1 = np.float64(alpha[t - 1, s])
            a2 = np.float64(alpha[t - 1, s - 1]) if s > 0 else NEG_INF
            a3 = NEG_INF
            if s > 1 and extended(label, s - 2, blank) != c:
                a3 = np.float64(alpha[t - 1, s - 2])
            m = max(a1, max(a2, a3))
            if m == NEG_INF:
                m = 0.0
            alpha[t, s] = math.log(math.exp(a1 - m) + math.exp(a2 - m) + math.exp(a3 - m)) + m + emission(lp, t, c)
    l1 = np.float64(alpha[tn - 1, 2 * ln])
    l2 = np.float64(alpha[tn - 1, 2 * ln - 1]) if ln > 0 else NEG_INF
    return -log_add(l1, l2)


@njit(**JIT)
def ctc_grad(lp, label, tn, ln, blank, alpha, beta, nll, scale, zero_infinity, grad):
    """Fill beta and grad [T, C] (float64) given alpha and nll."""
    T, C = grad.shape
    for t in range(T):
        for c in range(C):
            grad[t, c] = 0.0
    if tn == 0 or (zero_infinity and nll == np.inf):
        return
    width = 2 * ln + 1
    for s in range(width):
        beta[tn - 1, s] = NEG_INF
    beta[tn - 1, 2 * ln] = emission(lp, tn - 1, blank)
    if ln > 0:
        beta[tn - 1, 2 * ln - 1] = emission(lp, tn - 1, label[ln - 1])
    for t in range(tn - 2, -1, -1):
        for s in range(width):
            c = extended(label, s, blank)
            b1 = np.float64(beta[t + 1, s])
            b2 = np.float64(beta[t + 1, s + 1]) if s < 2 * ln else NEG_INF
            b3 = NEG_INF
            if s < 2 * ln - 1 and extended(label, s + 2, blank) != c:
                b3 = np.float64(beta[t + 1, s + 2])
            m = max(b1, max(b2, b3))
            if m == NEG_INF:
                m = 0.0
            beta[t, s] = math.log(math.exp(b1 - m) + math.exp(b2 - m) + math.exp(b3 - m)) + m + emission(lp, t, c)
    acc = np.empty(C)
    for t in range(tn):
        for c in range(C):
            acc[c] = NEG_INF
        for s in range(width):
            c = extended(label, s, blank)
            if c >= 0 and c < C:
                acc[c] = log_add(acc[c], np.float64(alpha[t, s]) + np.float64(beta[t, s]))
        for c in range(C):
            x = lp[t, c]
            grad[t, c] = (math.exp(x) - math.exp(acc[c] + nll - x)) * scale


@njit(**JIT)
def sample_nll(nll, zero_infinity):
    """The per-sample loss as stored (float32), with zero_infinity applied."""
    if zero_infinity and nll == np.inf:
        return np.float32(0.0)
    return np.float32(nll)


@njit(**JIT)
def reduce_losses(nll, lengths, max_len, mode):
    """Batch loss from float32 per-sample losses, in sample order, in float64."""
    total = 0.0
    n = nll.size
    for i in range(n):
        x = np.float64(nll[i])
        if mode == 0:
            x = x / max(min(max(lengths[i], 0), max_len), 1)
        total += x
    return total / n if mode == 0 and n > 0 else total


@njit(**JIT)
def grad_scale(grad_loss, length, max_len, batch, mode):
    if mode == 0:
        return grad_loss / max(min(max(length, 0), max_len), 1) / batch
    return grad_loss


# ---- codelets ---------------------------------------------------------------------------
@njit(**JIT)
def _load_sample(lp_arena, lp_addr, lb, T, C, tg_arena, tg_addr, tb, S):
    lp = np.empty((T, C))
    for t in range(T):
        for c in range(C):
            lp[t, c] = ld(lp_arena, lp_addr[lb + t * C + c])
    label = np.empty(S, dtype=np.int64)
    for s in range(S):
        label[s] = ld(tg_arena, tg_addr[tb + s])
    return lp, label


@njit(**JIT)
def _store_table(arena, addr, base, table):
    k = 0
    for t in range(table.shape[0]):
        for s in range(table.shape[1]):
            st(arena, addr[base + k], table[t, s])
            k += 1


@njit(parallel=True, **JIT)
def ctc_loss_codelet(lpa, lp_addr, lp_start, tga, tg_addr, tg_start, ila, il_addr, il_start,
                     tla, tl_addr, tl_start, aa, a_addr, a_start, na, n_addr, n_start, params):
    """params: blank, C, zero_infinity."""
    for v in prange(params.shape[0]):
        blank, C, zinf = int(params[v, 0]), int(params[v, 1]), params[v, 2] != 0
        T = (lp_start[v + 1] - lp_start[v]) // C
        S = tg_start[v + 1] - tg_start[v]
        lp, label = _load_sample(lpa, lp_addr, lp_start[v], T, C, tga, tg_addr, tg_start[v], S)
        tn = min(max(ld(ila, il_addr[il_start[v]]), 0), T)
        ln = min(max(ld(tla, tl_addr[tl_start[v]]), 0), S)
        alpha = np.full((T, 2 * S + 1), NEG_INF, dtype=np.float32)
        nll = ctc_alpha(lp, label, tn, ln, blank, alpha)
        _store_table(aa, a_addr, a_start[v], alpha)
        st(na, n_addr[n_start[v]], sample_nll(nll, zinf))


@njit(parallel=True, **JIT)
def ctc_reduce_codelet(na, n_addr, n_start, tla, tl_addr, tl_start, oa, o_addr, o_start, params):
    """params: reduction code, max target length."""
    for v in prange(params.shape[0]):
        mode, S = int(params[v, 0]), int(params[v, 1])
        n = n_start[v + 1] - n_start[v]
        nll = np.empty(n, dtype=np.float32)
        lengths = np.empty(n, dtype=np.int64)
        for i in range(n):
            nll[i] = ld(na, n_addr[n_start[v] + i])
            lengths[i] = ld(tla, tl_addr[tl_start[v] + i])
        st(oa, o_addr[o_start[v]], reduce_losses(nll, lengths, S, mode))


@njit(parallel=True, **JIT)
def ctc_grad_codelet(lpa, lp_addr, lp_start, tga, tg_addr, tg_start, ila, il_addr, il_start,
                     tla, tl_addr, tl_start, ga, g_addr, g_start, aa, a_addr, a_start,
                     ba, b_addr, b_start, oa, o_addr, o_start, params):
    """params: blank, C, zero_infinity, reduction code, batch size."""
    for v in prange(params.shape[0]):
        blank, C, zinf = int(params[v, 0]), int(params[v, 1]), params[v, 2] != 0
        mode, batch = int(params[v, 3]), params[v, 4]
        T = (lp_start[v + 1] - lp_start[v]) // C
        S = tg_start[v + 1] - tg_start[v]
        lp, label = _load_sample(lpa, lp_addr, lp_start[v], T, C, tga, tg_addr, tg_start[v], S)
        tn = min(max(ld(ila, il_addr[il_start[v]]), 0), T)
        length = ld(tla, tl_addr[tl_start[v]])
        ln = min(max(length, 0), S)
        alpha = np.full((T, 2 * S + 1), NEG_INF, dtype=np.float32)
        beta = np.full((T, 2 * S + 1), NEG_INF, dtype=np.float32)
        nll = ctc_alpha(lp, label, tn, ln, blank, alpha)
        scale = grad_scale(ld(ga, g_addr[g_start[v]]), length, S, batch, mode)
        grad = np.empty((T, C))
        ctc_grad(lp, label, tn, ln, blank, alpha, beta, nll, scale, zinf, grad)
        _store_table(aa, a_addr, a_start[v], alpha)
        _store_table(ba, b_addr, b_start[v], beta)
        _store_table(oa, o_addr, o_start[v], grad)


# ---- whole-batch kernels for the fast mode -------------------------------------------------
@njit(**JIT)
def _sample_lp(log_probs, n):
    T, _, C = log_probs.shape
    lp = np.empty((T, C))
    for t in range(T):
        for c in range(C):
            lp[t, c] = ld(log_probs[t, n], c)
    return lp


@njit(parallel=True, **JIT)
def ctc_loss_whole(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity, mode, out):
    T, N, C = log_probs.shape
    S = targets.shape[1]
    nll = np.empty(N, dtype=np.float32)
    for n in prange(N):
        lp = _sample_lp(log_probs, n)
        label = targets[n].astype(np.int64)
        tn = min(max(np.int64(input_lengths[n]), 0), T)
        ln = min(max(np.int64(target_lengths[n]), 0), S)
        alpha = np.empty((T, 2 * S + 1), dtype=np.float32)
        nll[n] = sample_nll(ctc_alpha(lp, label, tn, ln, blank, alpha), zero_infinity)
    st(out, 0, reduce_losses(nll, target_lengths.astype(np.int64), S, mode))


@njit(parallel=True, **JIT)
def ctc_grad_whole(log_probs, targets, input_lengths, target_lengths, grad_loss, blank, zero_infinity, mode, out):
    T, N, C = log_probs.shape
    S = targets.shape[1]
    for n in prange(N):
        lp = _sample_lp(log_probs, n)
        label = targets[n].astype(np.int64)
        tn = min(max(np.int64(input_lengths[n]), 0), T)
        length = np.int64(target_lengths[n])
        ln = min(max(length, 0), S)
        alpha = np.empty((T, 2 * S + 1), dtype=np.float32)
        beta = np.empty((T, 2 * S + 1), dtype=np.float32)
        nll = ctc_alpha(lp, label, tn, ln, blank, alpha)
        grad = np.empty((T, C))
        ctc_grad(lp, label, tn, ln, blank, alpha, beta, nll, grad_scale(grad_loss, length, S, N, mode),
                 zero_infinity, grad)
        for t in range(T):
            for c in range(C):
                st(out[t, n], c, grad[t, c])


# ---- cycle estimators -------------------------------------------------------------------
def alpha_instructions(frames: int, labels: int) -> int:
    per_symbol = (1 + 3) * 2 + 2 * LOG_ADD + 2 * LOG_MUL + 2
    return per_symbol * labels * frames + LOG_ADD + LOG_MUL


def grad_given_alpha_instructions(frames: int, labels: int) -> int:
    per_symbol = (2 + 1) * 2 + (LOG_MUL + LOG_ADD) * 2
    return alpha_instructions(frames, labels) + per_symbol * labels * frames + LOG_ADD + LOG_MUL


def loss_instructions(frames: int, labels: int) -> int:
    return alpha_instructions(frames, labels) + LOG_ADD


def gradient_instructions(frames: int, labels: int, classes: int) -> int:
    return alpha_instructions(frames, labels) + grad_given_alpha_instructions(frames, labels) + 10 * frames * classes


def reduce_instructions(samples: int) -> int:
    return 8 + 6 * samples


def _loss_cycles(sizes, params, dtype, target):
    C = params[:, 1].astype(np.int64)
    return target.thread_cycles(loss_instructions(sizes["log_probs"] // C, sizes["target"]))


def _grad_cycles(sizes, params, dtype, target):
    C = params[:, 1].astype(np.int64)
    return target.thread_cycles(gradient_instructions(sizes["log_probs"] // C, sizes["target"], C))


def _reduce_cycles(sizes, params, dtype, target):
    return target.thread_cycles(reduce_instructions(sizes["nll"]))


CTC_LOSS = VertexType("popnn::CTCLoss", ("log_probs", "target", "input_length", "target_length"),
                      ("alpha", "nll"), ctc_loss_codelet, _loss_cycles, num_params=3)
CTC_REDUCE = VertexType("popnn::CTCLossReduce", ("nll", "target_length"), ("loss",), ctc_reduce_codelet,
                        _reduce_cycles, num_params=2)
CTC_GRAD = VertexType("popnn::CTCGradient", ("log_probs", "target", "input_length", "target_length", "grad_loss"),
                      ("alpha", "beta", "grad"), ctc_grad_codelet, _grad_cycles, num_params=5)


# ---- graph construction -----------------------------------------------------------------
def _validate(log_probs, targets, input_lengths, target_lengths, blank, reduction, name):
    if log_probs.rank != 3:
        raise ValueError(f"{name}: log_probs {log_probs.name!r} must be [T, N, C] (torch layout), "
                         f"has shape {log_probs.shape}")
    if log_probs.dtype.name not in ("float32", "float16"):
        raise TypeError(f"{name}: log_probs {log_probs.name!r} is {log_probs.dtype.name}; use float32 or float16")
    T, N, C = log_probs.shape
    if targets.rank != 2 or targets.shape[0] != N:
        raise ValueError(f"{name}: targets {targets.name!r} must be padded [N, S] = [{N}, S], has shape "
                         f"{targets.shape} (concatenated 1-D targets are not supported, as in PopTorch)")
    for what, t in (("targets", targets), ("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if t.dtype != np.int32:
            raise TypeError(f"{name}: {what} {t.name!r} is {t.dtype.name}; it must be int32 (cast it first)")
    for what, t in (("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if t.shape != (N,):
            raise ValueError(f"{name}: {what} {t.name!r} must have shape ({N},), has {t.shape}")
    if N == 0:
        raise ValueError(f"{name}: log_probs {log_probs.name!r} has an empty batch (N = 0)")
    if not 0 <= blank < C:
        raise ValueError(f"{name}: blank must be a class in [0, {C}), got {blank}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")


def _sample_tiles(graph: Graph, N: int) -> np.ndarray:
    return (np.arange(N, dtype=np.int64) * graph.target.num_tiles // N).astype(np.int32)


def _per_sample(graph, body, t: Tensor, tiles, name) -> Tensor:
    """t [N, ...] (sample-major) with sample n's elements brought to tiles[n]."""
    return placed(graph, body, t, np.repeat(tiles, t.numel // t.shape[0]), name)


def _rows(t: Tensor, rows: np.ndarray) -> Field:
    """Vertex v connects row `rows[v]` of t [N, ...] (all of that sample's elements)."""
    per = t.numel // t.shape[0]
    return Field.strided(t, np.asarray(rows) * per, 1, per)


def _workspace(graph, name, N, T, S, tiles) -> Tensor:
    table = graph.addVariable(np.float32, (N, T, 2 * S + 1), name, category="temporaries", always_live=False)
    table.var.mapping = TileMap.from_tiles(np.repeat(tiles, T * (2 * S + 1)))
    return table


def ctc_loss(graph: Graph, log_probs: Tensor, targets: Tensor, input_lengths: Tensor, target_lengths: Tensor,
             prog: Sequence, blank: int = 0, reduction: str = "mean", zero_infinity: bool = False,
             name: str = "ctc_loss") -> Tensor:
    """Scalar CTC loss (torch.nn.functional.ctc_loss semantics, reduction "mean" or "sum")."""
    _validate(log_probs, targets, input_lengths, target_lengths, blank, reduction, name)
    T, N, C = log_probs.shape
    S = targets.shape[1]
    mode = REDUCTIONS[reduction]
    tiles = _sample_tiles(graph, N)
    loss = graph.addVariable(log_probs.dtype, (), name, category="activations", always_live=False)
    graph.setTileMapping(loss, 0)
    body = Sequence(name=name)
    lp = _per_sample(graph, body, log_probs.transpose(1, 0, 2), tiles, f"{name}/log_probs")
    tg = _per_sample(graph, body, targets, tiles, f"{name}/targets")
    il = _per_sample(graph, body, input_lengths, tiles, f"{name}/input_lengths")
    tl = _per_sample(graph, body, target_lengths, tiles, f"{name}/target_lengths")
    alpha = _workspace(graph, f"{name}/alpha", N, T, S, tiles)
    nll = graph.addVariable(np.float32, (N,), f"{name}/nll", category="temporaries", always_live=False)
    nll.var.mapping = TileMap.from_tiles(tiles)
    cs = graph.addComputeSet(f"{name}/loss")
    n = np.arange(N)
    fields = {"log_probs": _rows(lp, n), "target": _rows(tg, n), "input_length": _rows(il, n),
              "target_length": _rows(tl, n), "alpha": _rows(alpha, n), "nll": _rows(nll, n)}
    graph.addVertices(cs, CTC_LOSS, tiles, fields, np.array([blank, C, int(zero_infinity)], np.float64))
    body.add(Execute(cs))
    nll0 = placed(graph, body, nll, np.zeros(N, np.int32), f"{name}/nll_gathered")
    tl0 = placed(graph, body, target_lengths, np.zeros(N, np.int32), f"{name}/lengths_gathered")
    cs2 = graph.addComputeSet(f"{name}/reduce")
    graph.addVertex(cs2, CTC_REDUCE, 0, {"nll": nll0, "target_length": tl0, "loss": loss.reshape(1)}, (mode, S))
    body.add(Execute(cs2))

    def fast(io):
        res = np.zeros(1, dtype=log_probs.dtype)
        ctc_loss_whole(kernel_view(np.ascontiguousarray(io.read(log_probs))), np.ascontiguousarray(io.read(targets)),
                       io.read(input_lengths), np.ascontiguousarray(io.read(target_lengths)), blank, zero_infinity,
                       mode, kernel_view(res))
        io.write(loss, res.reshape(()))

    prog.add(OpProgram(name, body, fast, (log_probs, targets, input_lengths, target_lengths), (loss,)))
    return loss


def ctc_loss_backward(graph: Graph, log_probs: Tensor, targets: Tensor, input_lengths: Tensor,
                      target_lengths: Tensor, grad_loss: Tensor, prog: Sequence, blank: int = 0,
                      reduction: str = "mean", zero_infinity: bool = False, name: str = "ctc_loss_grad") -> Tensor:
    """d loss / d log_probs [T, N, C], as torch's CTC backward computes it, scaled by grad_loss."""
    _validate(log_probs, targets, input_lengths, target_lengths, blank, reduction, name)
    if grad_loss.numel != 1 or grad_loss.dtype != log_probs.dtype:
        raise ValueError(f"{name}: grad_loss {grad_loss.name!r} must be one {log_probs.dtype.name} element, "
                         f"is {grad_loss.dtype.name}{grad_loss.shape}")
    T, N, C = log_probs.shape
    S = targets.shape[1]
    mode = REDUCTIONS[reduction]
    tiles = _sample_tiles(graph, N)
    grad = graph.addVariable(log_probs.dtype, (T, N, C), name, category="gradients", always_live=False)
    grad.var.mapping = TileMap.from_tiles(np.tile(np.repeat(tiles, C), T))
    body = Sequence(name=name)
    lp = _per_sample(graph, body, log_probs.transpose(1, 0, 2), tiles, f"{name}/log_probs")
    tg = _per_sample(graph, body, targets, tiles, f"{name}/targets")
    il = _per_sample(graph, body, input_lengths, tiles, f"{name}/input_lengths")
    tl = _per_sample(graph, body, target_lengths, tiles, f"{name}/target_lengths")
    hosts, slot = np.unique(tiles, return_inverse=True)
    gl = placed(graph, body, grad_loss.reshape(1).broadcast((hosts.size,)), hosts, f"{name}/grad_loss")
    alpha = _workspace(graph, f"{name}/alpha", N, T, S, tiles)
    beta = _workspace(graph, f"{name}/beta", N, T, S, tiles)
    cs = graph.addComputeSet(f"{name}/gradient")
    n = np.arange(N)
    fields = {"log_probs": _rows(lp, n), "target": _rows(tg, n), "input_length": _rows(il, n),
              "target_length": _rows(tl, n), "grad_loss": _rows(gl, slot), "alpha": _rows(alpha, n),
              "beta": _rows(beta, n), "grad": Field.strided(grad, n * C, T, C, N * C)}  # grad[:, n, :]
    graph.addVertices(cs, CTC_GRAD, tiles, fields, np.array([blank, C, int(zero_infinity), mode, N], np.float64))
    body.add(Execute(cs))

    def fast(io):
        res = np.zeros((T, N, C), dtype=log_probs.dtype)
        ctc_grad_whole(kernel_view(np.ascontiguousarray(io.read(log_probs))), np.ascontiguousarray(io.read(targets)),
                       io.read(input_lengths), io.read(target_lengths), float(io.read(grad_loss).reshape(-1)[0]),
                       blank, zero_infinity, mode, kernel_view(res))
        io.write(grad, res)

    prog.add(OpProgram(name, body, fast, (log_probs, targets, input_lengths, target_lengths, grad_loss), (grad,)))
    return grad
