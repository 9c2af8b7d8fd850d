"""CTC beam search decoder: exact against brute-force labelling probabilities when the beam holds
every prefix, equal to an independent prefix beam search otherwise; one op of a model."""
import itertools
import math

import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.ops.ctc_decoder import ctc_beam_search_decoder, decode


def collapse(path, blank):
    out = []
    for k, _ in itertools.groupby(path):
        if k != blank:
            out.append(k)
    return tuple(out)


def exact(lp, length, blank):
    """log P(labelling) for every labelling, summing over all alignments of `length` frames."""
    probs = {}
    for path in itertools.product(range(lp.shape[1]), repeat=length):
        p = math.exp(sum(lp[t, c] for t, c in enumerate(path)))
        key = collapse(path, blank)
        probs[key] = probs.get(key, 0.0) + p
    return {k: math.log(v) for k, v in probs.items()}


def log_add(a, b):
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return math.log(math.exp(a - m) + math.exp(b - m)) + m


def reference(lp, length, blank, width, top):
    """Prefix beam search written from the algorithm's definition (dicts of prefixes)."""
    beams = {(): (0.0, -math.inf)}
    for t in range(length):
        cand = {}
        for prefix, (pb, pnb) in beams.items():
            total = log_add(pb, pnb)
            for c in range(lp.shape[1]):
                x = float(lp[t, c])
                if c == blank:
                    b, n = cand.get(prefix, (-math.inf, -math.inf))
                    cand[prefix] = (log_add(b, total + x), n)
                    continue
                if prefix and prefix[-1] == c:
                    b, n = cand.get(prefix, (-math.inf, -math.inf))
                    cand[prefix] = (b, log_add(n, pnb + x))
                    ext = prefix + (c,)
                    b, n = cand.get(ext, (-math.inf, -math.inf))
                    cand[ext] = (b, log_add(n, pb + x))
                else:
                    ext = prefix + (c,)
                    b, n = cand.get(ext, (-math.inf, -math.inf))
                    cand[ext] = (b, log_add(n, total + x))
        ranked = sorted(cand.items(), key=lambda kv: -log_add(*kv[1]))[:width]
        beams = dict(ranked)
    ranked = sorted(beams.items(), key=lambda kv: -log_add(*kv[1]))[:top]
    return [(prefix, log_add(*p)) for prefix, p in ranked]


def log_softmax(rng, shape):
    x = rng.standard_normal(shape) * 2
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


@pytest.mark.parametrize("seed", range(4))
def test_a_wide_beam_is_exact(seed):
    rng = np.random.default_rng(seed)
    T, C, blank = 5, 3, seed % 3
    lp = log_softmax(rng, (T, 1, C))
    truth = sorted(exact(lp[:, 0].astype(np.float64), T, blank).items(), key=lambda kv: -kv[1])
    probs, lens, paths = decode(lp, np.array([T]), blank, beam_width=200, top_paths=4)
    for p in range(4):
        labels, logp = truth[p]
        assert tuple(paths[0, p, :lens[0, p]]) == labels
        assert probs[0, p] == pytest.approx(logp, abs=1e-5)
        assert all(paths[0, p, lens[0, p]:] == blank)


@pytest.mark.parametrize("seed", range(3))
def test_narrow_beams_match_the_algorithm(seed):
    rng = np.random.default_rng(10 + seed)
    T, N, C = 12, 4, 6
    lp = log_softmax(rng, (T, N, C))
    lengths = np.array([12, 7, 0, 10])
    probs, lens, paths = decode(lp, lengths, blank=1, beam_width=3, top_paths=2)
    for n in range(N):
        ref = reference(lp[:, n].astype(np.float64), lengths[n], 1, 3, 2)
        for p, (labels, logp) in enumerate(ref):
            assert tuple(paths[n, p, :lens[n, p]]) == labels
            assert probs[n, p] == pytest.approx(logp, abs=1e-4)
    assert lens[2].tolist() == [0, 0] and probs[2, 0] == 0.0 and probs[2, 1] == -np.inf   # no frames: the empty path


@pytest.mark.parametrize("mode", ["fast", "strict"])
def test_device_op_equals_the_host_search(mode):
    rng = np.random.default_rng(3)
    T, N, C = 9, 5, 7
    g = ip.Graph(ip.Target.test(4))
    lp = g.addVariable("float32", (T, N, C), "lp")
    ln = g.addVariable("int32", (N,), "ln")
    for t in (lp, ln):
        g.map_linearly(t)
    prog = ip.Sequence()
    outs = ctc_beam_search_decoder(g, lp, ln, prog, blank=0, beam_width=4, top_paths=3)
    engine = ip.Engine(g, prog, mode=mode).load()
    values, lengths = log_softmax(rng, (T, N, C)), np.array([9, 3, 8, 9, 1], np.int32)
    engine.writeTensor(lp, values)
    engine.writeTensor(ln, lengths)
    engine.run()
    for got, want in zip((engine.readTensor(t) for t in outs), decode(values, lengths, 0, 4, 3)):
        np.testing.assert_array_equal(got, want)
    assert len(set(np.unique(outs[0].tiles()))) == 4      # samples spread over the tiles


def test_wider_beams_cost_more_cycles():
    cycles = []
    for width in (2, 16):
        g = ip.Graph(ip.Target.test(4))
        lp, ln = g.addVariable("float32", (20, 4, 8), "lp"), g.addVariable("int32", (4,), "ln")
        for t in (lp, ln):
            g.map_linearly(t)
        prog = ip.Sequence()
        ctc_beam_search_decoder(g, lp, ln, prog, beam_width=width)
        cycles.append(ip.Engine(g, prog).costs[0].total)
    assert cycles[1] > 6 * cycles[0]


def test_in_a_model_as_poptorch_shapes_it():
    class Decoder(torch.nn.Module):
        def forward(self, log_probs, lengths):
            return poptorch.ctc_beam_search_decoder(log_probs, lengths, beam_width=5, top_paths=2)

    torch.manual_seed(42)
    log_probs = torch.randn(9, 3, 10).log_softmax(-1)
    lengths = torch.randint(5, 9, (3,), dtype=torch.int)
    probs, lens, paths = poptorch.inferenceModel(Decoder())(log_probs, lengths)
    assert probs.shape == (3, 2) and lens.shape == (3, 2) and paths.shape == (3, 2, 9)
    want = decode(log_probs.numpy(), lengths.numpy(), 0, 5, 2)
    for got, w in zip((probs, lens, paths), want):
        np.testing.assert_array_equal(got.numpy(), w)
    eager = poptorch.ctc_beam_search_decoder(log_probs, lengths, beam_width=5, top_paths=2)
    torch.testing.assert_close(eager[0], probs)


def test_arguments_are_checked():
    with pytest.raises(poptorch.Error, match="probs must be a torch.tensor"):
        poptorch.ctc_beam_search_decoder([1.0], torch.ones(1))
    with pytest.raises(poptorch.Error, match="top_paths <= beam_width"):
        poptorch.ctc_beam_search_decoder(torch.zeros(2, 1, 3), torch.ones(1, dtype=torch.int), beam_width=2,
                                         top_paths=3)
