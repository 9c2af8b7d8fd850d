"""CTC beam search decoder (PopLibs' popnn::ctc_infer beam search on log-probabilities, as
PopTorch's `ctc_beam_search_decoder`).

Inputs: `log_probs` [T, N, C] (log-probabilities, as torch's CTC takes them), `lengths` [N] int32
(frames of each sample; clamped to [0, T]). Outputs per sample n: the `top_paths` most likely label
sequences, their log-probabilities [N, top_paths] (float32, -inf where fewer paths exist) and
lengths [N, top_paths] (int32), and the sequences [N, top_paths, T] (int32, padded with `blank`).

Prefix beam search (Hannun et al. 2014, the algorithm TensorFlow's decoder and PopLibs' run): every
beam is a label prefix with the log-probabilities of its alignments ending in blank (pb) and in a
label (pnb). At each frame every beam and class c make candidates: c = blank keeps the prefix
(pb += total + lp[blank]); c equal to the prefix's last label keeps the prefix from pnb and extends
it from pb (a repeat needs a blank between); any other c extends the prefix from total. Equal
prefixes merge (log-add), and the `beam_width` best by total = logaddexp(pb, pnb) survive (ties:
the earlier candidate; candidates of -inf are dropped). Prefixes are deduplicated through a hash
table of their polynomial hashes, checked label by label.

Mapping (as the CTC loss): sample n lives on tile n * tiles // N; its log-probabilities [T, C] and
length are brought there, one vertex (one worker) runs the search, and its outputs are written
there. The fast mode runs the same per-sample function over the batch: both modes agree bit for bit.

Cycles per vertex (worker instructions, static: padded T, full beams): per frame
B * C * (2 * LOG_ADD + 12) for the candidates (log-adds, hashing, probing), K * (ceil(log2 K) * 4)
for the selection of K = B * C candidates, and B * T for copying prefixes; plus
top_paths * (T + 4) to write the outputs.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..device.graph import Graph
from ..device.kernels import JIT, kernel_view, ld, st
from ..device.mapping import TileMap
from ..device.program import Execute, OpProgram, Sequence
from ..device.tensor import Tensor
from ..device.vertex import Field, VertexType
from .ctc import LOG_ADD, _per_sample, _rows, _sample_tiles, log_add

NEG_INF = -np.inf
_MASK = (1 << 61) - 1
_MULT = 1_000_003


@njit(**JIT)
def _label(pref, plen, par, lab, i):
    """Label i of the candidate (parent beam `par` extended by `lab`, or not when lab < 0)."""
    return pref[par, i] if i < plen[par] else lab


@njit(**JIT)
def beam_search(lp, length, blank, beam_width, top_paths, probs, lens, paths):
    """Decode one sample: lp [T, C] float64 log-probabilities; writes probs [top], lens [top],
    paths [top, T]."""
    T, C = lp.shape
    L = min(max(length, 0), T)
    B = max(beam_width, 1)
    pref = np.zeros((B, max(T, 1)), np.int64)
    plen = np.zeros(B, np.int64)
    phash = np.zeros(B, np.int64)
    pb = np.full(B, NEG_INF)
    pnb = np.full(B, NEG_INF)
    nb = 1
    pb[0] = 0.0
    maxc = B * max(C, 1) + 1
    size = 1
    while size < 2 * maxc:
        size *= 2
    table = np.empty(size, np.int64)
    cpar = np.empty(maxc, np.int64)
    clab = np.empty(maxc, np.int64)
    chash = np.empty(maxc, np.int64)
    clen = np.empty(maxc, np.int64)
    cpb = np.empty(maxc)
    cpnb = np.empty(maxc)
    for t in range(L):
        nc = 0
        table[:] = -1
        for b in range(nb):
            total = log_add(pb[b], pnb[b])
            last = pref[b, plen[b] - 1] if plen[b] > 0 else -1
            for c in range(C):
                x = lp[t, c]
                for ext in range(2):
                    # ext 0: the prefix itself (blank, or a repeat of the last label); ext 1: extended by c
                    if ext == 0 and not (c == blank or c == last):
                        continue
                    if ext == 1 and c == blank:
                        continue
                    lab = c if ext == 1 else -1
                    h = phash[b] if lab < 0 else (phash[b] * _MULT + lab + 1) & _MASK
                    ln = plen[b] + (1 if lab >= 0 else 0)
                    slot = h & (size - 1)
                    k = -1
                    while table[slot] != -1:
                        j = table[slot]
                        if chash[j] == h and clen[j] == ln:
                            same = True
                            for i in range(ln):
                                if _label(pref, plen, cpar[j], clab[j], i) != _label(pref, plen, b, lab, i):
                                    same = False
                                    break
                            if same:
                                k = j
                                break
                        slot = (slot + 1) & (size - 1)
                    if k < 0:
                        k = nc
                        nc += 1
                        table[slot] = k
                        cpar[k], clab[k], chash[k], clen[k] = b, lab, h, ln
                        cpb[k] = NEG_INF
                        cpnb[k] = NEG_INF
                    if c == blank:
                        cpb[k] = log_add(cpb[k], total + x)
                    elif ext == 0:   # a repeat collapses into the prefix
                        cpnb[k] = log_add(cpnb[k], pnb[b] + x)
                    elif c == last:  # a repeat after a blank extends it
                        cpnb[k] = log_add(cpnb[k], pb[b] + x)
                    else:
                        cpnb[k] = log_add(cpnb[k], total + x)
        score = np.empty(nc)
        for k in range(nc):
            score[k] = -log_add(cpb[k], cpnb[k])
        order = np.argsort(score, kind="mergesort")
        new_pref = np.zeros_like(pref)
        new_plen = np.zeros(B, np.int64)
        new_hash = np.zeros(B, np.int64)
        new_pb = np.full(B, NEG_INF)
        new_pnb = np.full(B, NEG_INF)
        kept = 0
        for k in order[:B]:
            if score[k] == np.inf:
                break
            par, lab = cpar[k], clab[k]
            for i in range(plen[par]):
                new_pref[kept, i] = pref[par, i]
            if lab >= 0:
                new_pref[kept, plen[par]] = lab
            new_plen[kept], new_hash[kept] = clen[k], chash[k]
            new_pb[kept], new_pnb[kept] = cpb[k], cpnb[k]
            kept += 1
        pref, plen, phash, pb, pnb = new_pref, new_plen, new_hash, new_pb, new_pnb
        nb = kept
        if nb == 0:
            break
    for p in range(top_paths):
        for i in range(paths.shape[1]):
            paths[p, i] = blank
        if p < nb:
            probs[p] = log_add(pb[p], pnb[p])
            lens[p] = plen[p]
            for i in range(plen[p]):
                paths[p, i] = pref[p, i]
        else:
            probs[p] = NEG_INF
            lens[p] = 0


@njit(parallel=True, **JIT)
def decoder_codelet(lpa, lp_addr, lp_start, la, l_addr, l_start, pa, p_addr, p_start, na, n_addr, n_start,
                    da, d_addr, d_start, params):
    """params: blank, C, beam_width, top_paths."""
    for v in prange(params.shape[0]):
        blank, C, width, top = int(params[v, 0]), int(params[v, 1]), int(params[v, 2]), int(params[v, 3])
        T = (lp_start[v + 1] - lp_start[v]) // C
        lp = np.empty((T, C))
        for t in range(T):
            for c in range(C):
                lp[t, c] = ld(lpa, lp_addr[lp_start[v] + t * C + c])
        probs = np.empty(top)
        lens = np.empty(top, np.int64)
        paths = np.empty((top, T), np.int64)
        beam_search(lp, ld(la, l_addr[l_start[v]]), blank, width, top, probs, lens, paths)
        for p in range(top):
            st(pa, p_addr[p_start[v] + p], probs[p])
            st(na, n_addr[n_start[v] + p], lens[p])
            for i in range(T):
                st(da, d_addr[d_start[v] + p * T + i], paths[p, i])


@njit(parallel=True, **JIT)
def decoder_whole(log_probs, lengths, blank, width, top, probs, lens, paths):
    T, N, C = log_probs.shape
    for n in prange(N):
        lp = np.empty((T, C))
        for t in range(T):
            for c in range(C):
                lp[t, c] = ld(log_probs[t, n], c)
        pr = np.empty(top)
        ln = np.empty(top, np.int64)
        pt = np.empty((top, T), np.int64)
        beam_search(lp, np.int64(lengths[n]), blank, width, top, pr, ln, pt)
        for p in range(top):
            probs[n, p] = pr[p]
            lens[n, p] = ln[p]
            for i in range(T):
                paths[n, p, i] = pt[p, i]


def decoder_instructions(frames, classes, beam_width, top_paths):
    candidates = beam_width * classes
    select = candidates * max(1, math.ceil(math.log2(max(candidates, 2)))) * 4
    per_frame = candidates * (2 * LOG_ADD + 12) + select + beam_width * frames
    return frames * per_frame + top_paths * (frames + 4)


def _cycles(sizes, params, dtype, target):
    C = params[:, 1].astype(np.int64)
    frames = sizes["log_probs"] // C
    out = [decoder_instructions(int(f), int(c), int(w), int(k))
           for f, c, w, k in zip(frames, C, params[:, 2], params[:, 3])]
    return target.thread_cycles(np.asarray(out, np.float64))


DECODER = VertexType("popnn::CTCBeamSearchDecoderLogProbabilities", ("log_probs", "length"),
                     ("probs", "lengths", "paths"), decoder_codelet, _cycles, num_params=4)


def ctc_beam_search_decoder(graph: Graph, log_probs: Tensor, lengths: Tensor, prog: Sequence, blank: int = 0,
                            beam_width: int = 100, top_paths: int = 1,
                            name: str = "ctc_beam_search_decoder") -> tuple[Tensor, Tensor, Tensor]:
    """(log-probabilities [N, top_paths], lengths [N, top_paths], paths [N, top_paths, T]); see the
    module docstring."""
    if log_probs.rank != 3 or log_probs.dtype.name not in ("float32", "float16"):
        raise ValueError(f"{name}: log_probs {log_probs.name!r} must be float [T, N, C], is "
                         f"{log_probs.dtype.name}{log_probs.shape}")
    T, N, C = log_probs.shape
    if lengths.shape != (N,) or lengths.dtype != np.int32:
        raise ValueError(f"{name}: lengths {lengths.name!r} must be int32 [{N}], is {lengths.dtype.name}{lengths.shape}")
    if not 0 <= blank < C:
        raise ValueError(f"{name}: blank must be a class in [0, {C}), got {blank}")
    if beam_width < 1 or top_paths < 1 or top_paths > beam_width:
        raise ValueError(f"{name}: need 1 <= top_paths <= beam_width, got top_paths={top_paths}, "
                         f"beam_width={beam_width}")
    tiles = _sample_tiles(graph, N)
    body = Sequence(name=name)
    lp = _per_sample(graph, body, log_probs.transpose(1, 0, 2), tiles, f"{name}/log_probs")
    ln = _per_sample(graph, body, lengths, tiles, f"{name}/lengths")
    outs = []
    for what, dtype, shape in (("probs", np.float32, (N, top_paths)), ("lengths", np.int32, (N, top_paths)),
                               ("paths", np.int32, (N, top_paths, T))):
        t = graph.addVariable(dtype, shape, f"{name}/{what}", category="activations", always_live=False)
        t.var.mapping = TileMap.from_lengths(np.full(N, t.numel // N), tiles)
        outs.append(t)
    probs, lens, paths = outs
    n = np.arange(N)
    cs = graph.addComputeSet(name)
    graph.addVertices(cs, DECODER, tiles, {"log_probs": _rows(lp, n), "length": _rows(ln, n),
                                           "probs": _rows(probs, n), "lengths": _rows(lens, n),
                                           "paths": _rows(paths, n)},
                      np.array([blank, C, beam_width, top_paths], np.float64))
    body.add(Execute(cs))

    def fast(io):
        p = np.empty((N, top_paths))
        k = np.empty((N, top_paths), np.int64)
        d = np.empty((N, top_paths, T), np.int64)
        decoder_whole(kernel_view(np.ascontiguousarray(io.read(log_probs))), np.ascontiguousarray(io.read(lengths)),
                      blank, beam_width, top_paths, p, k, d)
        io.write(probs, p.astype(np.float32))
        io.write(lens, k.astype(np.int32))
        io.write(paths, d.astype(np.int32))

    prog.add(OpProgram(name, body, fast, (log_probs, lengths), (probs, lens, paths)))
    return probs, lens, paths


def decode(log_probs: np.ndarray, lengths: np.ndarray, blank: int = 0, beam_width: int = 100,
           top_paths: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decoder on host arrays (the same search the device runs)."""
    lp = np.ascontiguousarray(log_probs)
    T, N, _ = lp.shape
    p = np.empty((N, top_paths))
    k = np.empty((N, top_paths), np.int64)
    d = np.empty((N, top_paths, T), np.int64)
    decoder_whole(kernel_view(lp), np.ascontiguousarray(lengths, np.int64), blank, beam_width, top_paths, p, k, d)
    return p.astype(np.float32), k.astype(np.int32), d.astype(np.int32)
