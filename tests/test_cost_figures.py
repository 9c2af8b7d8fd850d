"""Cycle and memory figures of every op family and of the tutorial network, against recorded values.

The figures are the static accounting of a compiled program: per compute set its compute cycles
and its cycles per tile (a tile's vertices spread over its workers), and per IPU the bytes per
tile (peak, vertex state, code). They must not move when the way a graph is built or accounted
changes. `tests/data/cost_figures.json` holds the recorded values; to record them again after a
deliberate change of the cost model, run this file with IPUSIM_RECORD_FIGURES=1.
"""
import hashlib
import json
import os

import numpy as np
import pytest
import torch

import ipusim as ip
from ipusim.device.program import Execute, walk
from ipusim.ops import collectives, conv, ctc, elementwise, gather, loss, matmul, norm, optim, pool, reduce, random
from ipusim.ops import softmax

DATA = os.path.join(os.path.dirname(__file__), "data", "cost_figures.json")
RECORD = os.environ.get("IPUSIM_RECORD_FIGURES") == "1"
T16 = ip.Target.test(16, 256 * 1024)


def digest(values) -> str:
    return hashlib.sha256(json.dumps([int(v) for v in values]).encode()).hexdigest()[:16]


def figures(device, programs) -> dict:
    """Per compute set (program order): name, IPU, compute cycles, number of tiles used, sum and
    digest of the cycles per tile; per IPU: bytes per tile; and each program's total cycles."""
    engine = ip.Engine(device, programs, check_memory=False)
    target = engine.target
    sets, seen = [], set()
    for p in engine.programs:
        for node in walk(p):
            if isinstance(node, Execute) and id(node) not in seen:
                seen.add(id(node))
                cs = node.compute_set
                per_tile = cs.tile_cycles(target)
                sets.append([cs.name, cs.ipu, engine.cost(node).per_ipu[cs.ipu].compute, int((per_tile > 0).sum()),
                             int(per_tile.sum()), digest(per_tile)])
    memory = [{"peak": r.peak.tolist(), "vertex_state": r.vertex_state.tolist(), "code": r.code.tolist()}
              for r in engine.memory]
    return {"compute_sets": sets, "memory": memory, "totals": [c.total for c in engine.costs]}


# ---- one small instance of each op family -------------------------------------------------------
def graph_with(*specs, target=T16):
    """A graph and its variables: (dtype, shape, mapping) with mapping 'linear' or a tile."""
    g = ip.Graph(target)
    out = []
    for i, (dtype, shape, mapping) in enumerate(specs):
        t = g.addVariable(dtype, shape, f"v{i}")
        g.map_linearly(t) if mapping == "linear" else g.setTileMapping(t, mapping)
        out.append(t)
    return g, ip.Sequence(), out


def case_matmul():
    g, prog, (a, b, c, d) = graph_with(("float32", (24, 40), "linear"), ("float32", (40, 36), "linear"),
                                       ("float16", (3, 20, 12), "linear"), ("float16", (3, 12, 28), 5))
    matmul.matmul(g, a, b, prog)
    matmul.matmul(g, c, d, prog, out_dtype="float32")
    matmul.matmul(g, a.T, a, prog)
    tight = ip.Target.test(16, 24 * 1024)
    g2, prog2, (e, f) = graph_with(("float32", (8, 2000), "linear"), ("float32", (2000, 8), "linear"), target=tight)
    matmul.matmul(g2, e, f, prog2)
    return [(g, prog), (g2, prog2)]


def case_elementwise():
    g, prog, (x, y, h) = graph_with(("float32", (7, 33), "linear"), ("float32", (33,), 3), ("float16", (7, 33), 2))
    r = elementwise.unary(g, "relu", x, prog)
    elementwise.binary(g, "add", r, y.reshape(1, 33).broadcast((7, 33)), prog)
    elementwise.mul(g, x, elementwise.cast(g, h, "float32", prog), prog)
    elementwise.scale(g, h, 0.5, prog, bias=1.0)
    return [(g, prog)]


def case_conv():
    g, prog, (x, w, dy) = graph_with(("float32", (2, 4, 9, 9), "linear"), ("float32", (6, 2, 3, 3), "linear"),
                                     ("float32", (2, 6, 5, 5), "linear"))
    conv.conv(g, x, w, prog, stride=2, padding=1, groups=2)
    conv.conv_backward_input(g, dy, w, x.shape, prog, stride=2, padding=1, groups=2)
    conv.conv_backward_weights(g, dy, x, w.shape, prog, stride=2, padding=1, groups=2)
    g2, prog2, (x2, w2) = graph_with(("float16", (1, 3, 12, 12), "linear"), ("float16", (8, 3, 5, 5), 0))
    conv.conv(g2, x2, w2, prog2, padding=2, dilation=1)
    return [(g, prog), (g2, prog2)]


def case_pool():
    g, prog, (x,) = graph_with(("float32", (2, 3, 10, 10), "linear"))
    y = pool.max_pool(g, x, 3, prog, 2, 1)
    pool.max_pool_backward(g, x, y, y, 3, prog, 2, 1)
    a = pool.avg_pool(g, x, 2, prog)
    pool.avg_pool_backward(g, a, x.shape, 2, prog)
    ad = pool.adaptive_avg_pool(g, x, (3, 4), prog)
    pool.adaptive_avg_pool_backward(g, ad, x.shape, prog)
    return [(g, prog)]


def case_reduce():
    g, prog, (x, h, r, q) = graph_with(("float32", (6, 20, 7), "linear"), ("float16", (9, 31), 4),
                                       ("float32", (6,), 0), ("float32", (6,), "linear"))
    reduce.reduce(g, x, (1,), "sum", prog, keepdims=True, scale=0.5)
    reduce.reduce_max(g, x, -1, prog)
    reduce.reduce_mean(g, x, None, prog)
    reduce.reduce(g, h, 0, "min", prog)
    reduce.reduce(g, h, None, "sum", prog, out_dtype="float32")
    x2 = x.reshape(6, 140)
    reduce.segment_map(g, "normalise", x2, 1, prog, "n", r=r, q=q)
    reduce.segment_map(g, "nll_pick", x2, 1, prog, "pick", r=r, param=-100.0)
    return [(g, prog)]


def case_norm():
    g, prog, (x, dy, w, b, xb, rm, rv, wb, bb) = graph_with(
        ("float32", (4, 3, 5, 6), "linear"), ("float32", (4, 3, 5, 6), 2), ("float32", (5, 6), 9),
        ("float32", (5, 6), "linear"), ("float32", (2, 4, 5, 5), "linear"), ("float32", (4,), 1),
        ("float32", (4,), 1), ("float32", (4,), 3), ("float32", (4,), 3))
    y, mean, inv_std = norm.layer_norm(g, x, 2, w, b, 1e-5, prog)
    norm.layer_norm_backward(g, dy, x, mean, inv_std, w, b, 2, prog)
    yb, mb, ib = norm.batch_norm2d_train(g, xb, wb, bb, 1e-5, prog)[:3]
    norm.batch_norm2d_backward(g, yb, xb, mb, ib, wb, prog)
    norm.batch_norm2d_inference(g, xb, rm, rv, wb, bb, 1e-5, prog)
    norm.update_running_stats(g, rm, rv, mb, ib, 0.1, 50, prog)
    return [(g, prog)]


def case_loss():
    g, prog, (logits, labels, a, t, grad) = graph_with(
        ("float32", (10, 7), "linear"), ("int32", (10,), "linear"), ("float32", (5, 11), "linear"),
        ("float32", (5, 11), 6), ("float32", (), 0))
    ce = loss.cross_entropy(g, logits, labels, prog)
    loss.cross_entropy_backward(g, grad, logits, labels, prog)
    loss.nll_loss(g, logits, labels, prog, reduction="sum")
    loss.mse_loss(g, a, t, prog)
    loss.mse_loss_backward(g, grad, a, t, prog)
    loss.l1_loss(g, a, t, prog, reduction="none")
    loss.l1_loss_backward(g, grad, a, t, prog)
    return [(g, prog)]


def case_gather():
    g, prog, (idx, w, go) = graph_with(("int32", (3, 5), "linear"), ("float32", (40, 12), "linear"),
                                       ("float32", (3, 5, 12), "linear"))
    gather.embedding(g, idx, w, prog)
    gather.embedding_backward(g, idx, go, 40, prog, padding_idx=2)
    return [(g, prog)]


def case_random():
    g, prog, (x,) = graph_with(("float32", (9, 13), "linear"))
    random.uniform(g, (50,), 3, prog, 2.0, 5.0)
    random.normal(g, (50,), 3, prog, -1.0, 3.0, dtype=np.float16)
    random.bernoulli(g, (50,), 0.3, 4, prog, dtype=np.int32)
    y, mask = random.dropout(g, x, 0.5, 99, prog)
    random.dropout_backward(g, y, mask, 0.5, prog)
    seed = random.seed_tensor(g)
    random.advance_seed(g, seed, prog)
    return [(g, prog)]


def case_ctc():
    T, N, C, S = 6, 3, 5, 3
    g, prog, (lp, tg, il, tl, gl) = graph_with(("float32", (T, N, C), "linear"), ("int32", (N, S), "linear"),
                                               ("int32", (N,), "linear"), ("int32", (N,), "linear"),
                                               ("float32", (), 15))
    ctc.ctc_loss(g, lp, tg, il, tl, prog)
    ctc.ctc_loss_backward(g, lp, tg, il, tl, gl, prog)
    return [(g, prog)]


def case_optim():
    out = []
    for opt in (optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.01), optim.Adam(lr=0.01), optim.LAMB(lr=0.02),
                optim.RMSprop(lr=0.01, momentum=0.5, centered=True)):
        g, prog, (w, grad) = graph_with(("float32", (13, 9), "linear"), ("float32", (13, 9), 7))
        w.var.category = "weights"
        optim.weight_update(g, w, grad, opt, prog)
        out.append((g, prog))
    return out


def case_collectives():
    dev = ip.Device(T16, 3)
    xs = []
    for r in range(3):
        x = dev.graph(r).addVariable("float32", (6, 10), f"x{r}", category="gradients")
        dev.graph(r).map_linearly(x, grain=4)
        xs.append(x)
    prog = ip.Sequence()
    collectives.all_reduce(dev, xs, prog)
    collectives.all_reduce(dev, xs, prog, op="mean")
    collectives.all_gather(dev, xs, prog)
    collectives.broadcast(dev, xs, prog, root=1)
    return [(dev, prog)]


def case_softmax():
    g, prog, (x, dy) = graph_with(("float32", (6, 17), "linear"), ("float32", (6, 17), 3))
    y, ly = softmax.softmax(g, x, 1, prog), softmax.log_softmax(g, x, 1, prog)
    softmax.softmax_backward(g, y, dy, 1, prog)
    softmax.log_softmax_backward(g, ly, dy, 0 + 1, prog)
    return [(g, prog)]


OPS = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def op_figures(name: str) -> list:
    return [figures(ip.Device.of(g), [prog]) for g, prog in OPS[name]()]


def tutorial_figures() -> list:
    from test_profile import BATCH, tutorial_training
    model = tutorial_training(None)
    model.compile(*BATCH)
    engine = model._executable.engine
    out = figures(engine.device, engine.programs)
    model.destroy()
    return [out]


# ---- the checks ---------------------------------------------------------------------------------
def recorded() -> dict:
    if RECORD:
        return {}
    with open(DATA) as f:
        return json.load(f)


def compare(key: str, got) -> None:
    if RECORD:
        data = json.load(open(DATA)) if os.path.exists(DATA) else {}
        data[key] = got
        os.makedirs(os.path.dirname(DATA), exist_ok=True)
        with open(DATA, "w") as f:
            json.dump(data, f, separators=(",", ":"), sort_keys=True)
            f.write("\n")
        return
    want = recorded()[key]
    got = json.loads(json.dumps(got))
    assert len(got) == len(want), f"{key}: {len(got)} programs, recorded {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert [c[:3] for c in g["compute_sets"]] == [c[:3] for c in w["compute_sets"]], f"{key}[{i}] compute cycles"
        assert g["compute_sets"] == w["compute_sets"], f"{key}[{i}] cycles per tile"
        assert g["memory"] == w["memory"], f"{key}[{i}] bytes per tile"
        assert g["totals"] == w["totals"], f"{key}[{i}] program totals"


@pytest.mark.parametrize("op", sorted(OPS))
def test_op_figures_are_unchanged(op):
    compare(op, op_figures(op))


def test_tutorial_figures_are_unchanged():
    torch.manual_seed(0)
    compare("tutorial", tutorial_figures())
