"""Optimiser weight updates: NumPy references of the torch / PopTorch rules, torch.optim itself,
both execution modes, float16 weights, hyperparameters changed without rebuilding, cycles, memory."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import ipusim as ip
from ipusim.ops import optim

MODES = ["strict", "fast"]
TARGET = ip.Target.test(16, 64 * 1024)


# ---- NumPy references (float64 arithmetic, values rounded as stored, hyperparameters as float32) ----
def stored(x, dtype):
    x = np.asarray(x, dtype=np.float64)
    if np.dtype(dtype) == np.float16:  # the device rounds through float32 first
        return x.astype(np.float32).astype(np.float16).astype(np.float64)
    return x.astype(np.float32).astype(np.float64)


def f32(v):
    return float(np.float32(v))


def reference_step(opt, w, g, state, wdt, sdt):
    """One update of the NumPy reference; `state` holds arrays and the step count."""
    t = state["step"] = state.get("step", 0) + 1
    name = type(opt).__name__
    lr, wd, ls = f32(opt.lr), f32(opt.weight_decay), f32(opt.loss_scaling)
    d = g / ls
    if name == "SGD":
        mom, damp = f32(opt.momentum), f32(opt.dampening)
        d = d + wd * w
        if opt.momentum:
            buf = d if t == 1 else mom * state["momentum_buffer"] + (1 - damp) * d
            buf = state["momentum_buffer"] = stored(buf, sdt)
            d = d + mom * buf if opt.nesterov else buf
        return stored(w - lr * d, wdt)
    if name in ("Adam", "AdamW", "LAMB"):
        b1, b2, eps = f32(opt.betas[0]), f32(opt.betas[1]), f32(opt.eps)
        if name == "AdamW":
            w = w * (1 - lr * wd)
        elif name == "Adam":
            d = d + wd * w
        m = state["exp_avg"] = stored(b1 * state.get("exp_avg", 0) + (1 - b1) * d, sdt)
        v = state["exp_avg_sq"] = stored(b2 * state.get("exp_avg_sq", 0) + (1 - b2) * d * d, sdt)
        correct = opt.bias_correction
        bc1, bc2 = (1 - b1 ** t, 1 - b2 ** t) if correct else (1.0, 1.0)
        if name != "LAMB":
            return stored(w - lr / bc1 * m / (np.sqrt(v) / math.sqrt(bc2) + eps), wdt)
        u = stored((m / bc1) / (np.sqrt(v) / math.sqrt(bc2) + eps) + wd * w, np.float32)
        clip = np.inf if opt.max_weight_norm is None else f32(opt.max_weight_norm)
        r1 = min(math.sqrt(np.sum(w * w)), clip)
        r2 = math.sqrt(np.sum(u * u))
        trust = r1 / r2 if r1 > 0 and r2 > 0 else 1.0
        return stored(w - lr * trust * u, wdt)
    alpha, mom, eps = f32(opt.alpha), f32(opt.momentum), f32(opt.eps)
    d = d + wd * w
    sq = state["square_avg"] = stored(alpha * state.get("square_avg", 0) + (1 - alpha) * d * d, sdt)
    if opt.centered:
        ga = state["grad_avg"] = stored(alpha * state.get("grad_avg", 0) + (1 - alpha) * d, sdt)
        avg = np.sqrt(sq - ga * ga) + eps
    else:
        avg = np.sqrt(sq) + eps
    if opt.momentum > 0:
        buf = state["momentum_buffer"] = stored(mom * state.get("momentum_buffer", 0) + d / avg, sdt)
        return stored(w - lr * buf, wdt)
    return stored(w - lr * d / avg, wdt)


CASES = {
    "sgd": lambda: optim.SGD(lr=0.1),
    "sgd_momentum": lambda: optim.SGD(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.01, loss_scaling=8.0),
    "sgd_nesterov": lambda: optim.SGD(lr=0.05, momentum=0.8, nesterov=True),
    "adam": lambda: optim.Adam(lr=0.01, weight_decay=0.1),
    "adamw": lambda: optim.AdamW(lr=0.01, betas=(0.8, 0.99), loss_scaling=128.0),
    "adamw_no_bias": lambda: optim.AdamW(lr=0.01, betas=(0.8, 0.99), bias_correction=False),
    "rmsprop": lambda: optim.RMSprop(lr=0.01),
    "rmsprop_centered_momentum": lambda: optim.RMSprop(lr=0.01, alpha=0.9, weight_decay=0.05, momentum=0.5,
                                                       centered=True),
    "lamb": lambda: optim.LAMB(lr=0.02),
    "lamb_clipped_no_bias": lambda: optim.LAMB(lr=0.02, bias_correction=False, max_weight_norm=1.5,
                                               weight_decay=0.0),
}


def build(opt, shape=(13, 9), wdt="float32", gdt=None, grad_tile=None, target=TARGET):
    g = ip.Graph(target)
    w = g.addVariable(wdt, shape, "w", category="weights")
    g.map_linearly(w, grain=4)
    grad = g.addVariable(gdt or wdt, shape, "grad", category="gradients")
    if grad_tile is None:
        g.map_linearly(grad, grain=4)
    else:
        g.setTileMapping(grad, grad_tile)
    prog = ip.Sequence()
    state = optim.weight_update(g, w, grad, opt, prog)
    return g, w, grad, prog, state


def run_steps(mode, opt, w0, grads, setup=None, **kw):
    """The weight and state after the updates by `grads`; `setup(engine, graph)` runs first."""
    g, w, grad, prog, state = build(opt, w0.shape, **kw)
    e = ip.Engine(g, prog, mode=mode).load()
    if setup is not None:
        setup(e, g)
    e.writeTensor(w, w0)
    for gv in grads:
        e.writeTensor(grad, gv)
        e.run()
    return e.readTensor(w), state.read(e)


def reference_run(opt, w0, grads, wdt="float32", sdt="float32"):
    w, state = stored(w0, wdt), {}
    for gv in grads:
        w = reference_step(opt, w, np.asarray(gv, dtype=np.float64), state, wdt, sdt)
    return w, state


def data(shape=(13, 9), steps=4, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape).astype(dtype),
            [rng.standard_normal(shape).astype(dtype) for _ in range(steps)])


# ---- numerics -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_both_modes_match_the_numpy_reference_bit_for_bit_across_modes(case):
    w0, grads = data()
    results = {m: run_steps(m, CASES[case](), w0, grads) for m in MODES}
    (ws, ss), (wf, sf) = results["strict"], results["fast"]
    np.testing.assert_array_equal(ws, wf)
    assert ss.keys() == sf.keys()
    for k in ss:
        np.testing.assert_array_equal(ss[k], sf[k])
    ref_w, ref_state = reference_run(CASES[case](), w0, grads)
    np.testing.assert_allclose(ws, ref_w, rtol=1e-6, atol=1e-7)
    for k, v in ss.items():
        if k == "step":
            assert v == len(grads)
        else:
            np.testing.assert_allclose(v, ref_state[k], rtol=1e-6, atol=1e-7)
    assert not np.array_equal(ws, w0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case,state_dtype", [("sgd_momentum", "float32"), ("adam", "float32"),
                                              ("lamb", "float32"), ("adamw", "float16")])
def test_float16_weights(mode, case, state_dtype):
    opt = CASES[case]()
    opt.state_dtype = state_dtype
    w0, grads = data(dtype=np.float16)
    w, state = run_steps(mode, opt, w0, grads, wdt="float16")
    assert w.dtype == np.float16
    assert all(state[k].dtype == np.dtype(state_dtype) for k in state if k != "step")
    ref = CASES[case]()
    ref_w, _ = reference_run(ref, w0.astype(np.float64), [gv.astype(np.float64) for gv in grads], "float16",
                             state_dtype)
    np.testing.assert_array_equal(w.astype(np.float64), ref_w)


def test_float16_gradients_for_float32_weights():
    w0, grads = data()
    grads16 = [gv.astype(np.float16) for gv in grads]
    w, _ = run_steps("strict", optim.Adam(lr=0.01), w0, grads16, gdt="float16")
    ref_w, _ = reference_run(optim.Adam(lr=0.01), w0, [gv.astype(np.float64) for gv in grads16])
    np.testing.assert_allclose(w, ref_w, rtol=1e-6, atol=1e-7)


TORCH_CASES = {
    "sgd_momentum": lambda t, p: t.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.01),
    "sgd_nesterov": lambda t, p: t.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True),
    "adam": lambda t, p: t.optim.Adam(p, lr=0.01, weight_decay=0.1),
    "adamw": lambda t, p: t.optim.AdamW(p, lr=0.01, betas=(0.8, 0.99)),
    "rmsprop": lambda t, p: t.optim.RMSprop(p, lr=0.01),
    "rmsprop_centered_momentum": lambda t, p: t.optim.RMSprop(p, lr=0.01, alpha=0.9, weight_decay=0.05,
                                                              momentum=0.5, centered=True),
}


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_matches_torch_optim_over_several_steps(case):
    torch = pytest.importorskip("torch")
    w0, grads = data(steps=6, seed=3)
    opt = CASES[case]()
    w, state = run_steps("fast", opt, w0, grads)
    p = torch.nn.Parameter(torch.tensor(w0))
    topt = TORCH_CASES[case](torch, [p])
    for gv in grads:
        p.grad = torch.tensor(gv) / opt.loss_scaling  # the device receives loss-scaled gradients
        topt.step()
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=2e-5, atol=1e-6)
    for k, v in topt.state[p].items():
        if k == "step":
            if "step" in state:
                assert state["step"] == int(v)
        else:
            np.testing.assert_allclose(state[k], v.numpy(), rtol=2e-5, atol=1e-6)


def poptorch_lamb_in_torch(torch, p, grads, lr, betas, eps, weight_decay, bias_correction, max_weight_norm):
    """PopTorch's LAMB rule written with torch ops (r1 clipped by max_weight_norm as PopART does)."""
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step, gv in enumerate(grads, 1):
        g = torch.tensor(gv)
        m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
        v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
        bc1, bc2 = (1 - betas[0] ** step, 1 - betas[1] ** step) if bias_correction else (1, 1)
        upd = (m / bc1) / (v.sqrt() / math.sqrt(bc2) + eps) + weight_decay * p
        r1 = p.pow(2).sum().sqrt()
        if max_weight_norm is not None:
            r1 = r1.clamp(max=max_weight_norm)
        r2 = upd.pow(2).sum().sqrt()
        trust = 1.0 if r1 == 0 or r2 == 0 else float(r1 / r2)
        p = p - lr * trust * upd
    return p


@pytest.mark.parametrize("case", ["lamb", "lamb_clipped_no_bias"])
def test_lamb_matches_poptorchs_rule_in_torch(case):
    torch = pytest.importorskip("torch")
    w0, grads = data(steps=5, seed=4)
    opt = CASES[case]()
    w, _ = run_steps("fast", opt, w0, grads)
    expected = poptorch_lamb_in_torch(torch, torch.tensor(w0), grads, opt.lr, opt.betas, opt.eps, opt.weight_decay,
                                      opt.bias_correction, opt.max_weight_norm)
    np.testing.assert_allclose(w, expected.numpy(), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_lamb_trust_ratio_is_one_for_zero_weights(mode):
    w0 = np.zeros((13, 9), np.float32)
    grads = [np.ones((13, 9), np.float32)]
    w, _ = run_steps(mode, optim.LAMB(lr=0.1, weight_decay=0.0), w0, grads)
    # u = m^/(sqrt(v^)+eps) = 1/(1+1e-8) everywhere; ratio 1 (||w|| = 0): w = -lr * u
    np.testing.assert_allclose(w, np.full_like(w0, -0.1), rtol=1e-6)


@settings(max_examples=15, deadline=None)
@given(rows=hs.integers(1, 9), cols=hs.integers(1, 11), seed=hs.integers(0, 2 ** 16),
       lamb=hs.booleans())
def test_any_shape_and_mapping_agrees_across_modes_and_with_the_reference(rows, cols, seed, lamb):
    rng = np.random.default_rng(seed)
    shape = (rows, cols)
    w0, grads = data(shape, steps=2, seed=seed)
    tiles = rng.integers(0, TARGET.num_tiles, size=rows * cols)
    out = {}
    for mode in MODES:
        g = ip.Graph(TARGET)
        w = g.addVariable("float32", shape, "w")
        w.var.mapping = ip.TileMap.from_tiles(tiles)
        grad = g.addVariable("float32", shape, "grad")
        grad.var.mapping = ip.TileMap.from_tiles(rng.permutation(tiles))
        prog = ip.Sequence()
        opt = optim.LAMB(lr=0.05) if lamb else optim.Adam(lr=0.05)
        optim.weight_update(g, w, grad, opt, prog)
        e = ip.Engine(g, prog, mode=mode).load()
        e.writeTensor(w, w0)
        for gv in grads:
            e.writeTensor(grad, gv)
            e.run()
        out[mode] = e.readTensor(w)
    np.testing.assert_array_equal(out["strict"], out["fast"])
    ref, _ = reference_run(optim.LAMB(lr=0.05) if lamb else optim.Adam(lr=0.05), w0, grads)
    np.testing.assert_allclose(out["fast"], ref, rtol=1e-6, atol=1e-7)


# ---- device hyperparameters and step counter -----------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_learning_rate_changes_without_rebuilding_the_graph(mode):
    opt = optim.Adam(lr=0.1)
    g, w, grad, prog, state = build(opt)
    w0, grads = data(steps=4, seed=7)
    compute_sets = len(g.compute_sets)
    e = ip.Engine(g, prog, mode=mode).load()
    e.writeTensor(w, w0)
    for k, gv in enumerate(grads):
        if k == 2:
            opt.set(e, lr=0.001, betas=(0.5, 0.9))
        e.writeTensor(grad, gv)
        e.run()
    assert len(g.compute_sets) == compute_sets
    assert opt.hyper(g).read(e)["lr"] == f32(0.001) and opt.lr == 0.001
    ref = optim.Adam(lr=0.1)
    rw, rs = stored(w0, "float32"), {}
    for k, gv in enumerate(grads):
        if k == 2:
            ref.lr, ref.betas = 0.001, (0.5, 0.9)
        rw = reference_step(ref, rw, gv.astype(np.float64), rs, "float32", "float32")
    np.testing.assert_allclose(e.readTensor(w), rw, rtol=1e-6, atol=1e-7)
    # an engine loaded later starts from the new values
    assert opt.hyper(g).read(ip.Engine(g, prog, mode=mode).load())["beta1"] == 0.5


@pytest.mark.parametrize("mode", MODES)
def test_one_hyper_tensor_per_graph_serves_every_weight(mode):
    g = ip.Graph(TARGET)
    opt = optim.SGD(lr=1.0)
    prog = ip.Sequence()
    pairs = []
    for name in ("a", "b"):
        w = g.addVariable("float32", (20,), name)
        g.map_linearly(w, grain=4)
        gr = g.addConstant("float32", (20,), 1.0, f"{name}/grad")
        g.map_linearly(gr, grain=4)
        optim.weight_update(g, w, gr, opt, prog)
        pairs.append(w)
    assert len([v for v in g.variables if v.name.startswith("sgd/hyper")]) == 1
    e = ip.Engine(g, prog, mode=mode).load()
    opt.set(e, lr=0.25)
    e.run()
    for w in pairs:
        np.testing.assert_array_equal(e.readTensor(w), np.full(20, -0.25, np.float32))


@pytest.mark.parametrize("mode", MODES)
def test_step_counter_advances_inside_one_run(mode):
    opt = optim.Adam(lr=0.01)
    g, w, grad, prog, state = build(opt)
    w0, (gv,) = data(steps=1, seed=5)
    e = ip.Engine(g, ip.Repeat(3, prog), mode=mode).load()
    e.writeTensor(w, w0)
    e.writeTensor(grad, gv)
    e.run()
    ref_w, _ = reference_run(optim.Adam(lr=0.01), w0, [gv] * 3)
    np.testing.assert_allclose(e.readTensor(w), ref_w, rtol=1e-6, atol=1e-7)
    assert state.read(e)["step"] == 3
    assert (e.readTensor(state.step) == 3).all()
    assert opt.state_of(w) is state
    with pytest.raises(KeyError, match="no state for weight 'grad'"):
        opt.state_of(grad)


def test_set_refuses_structural_and_unknown_changes():
    opt = optim.SGD(lr=0.1)
    g, w, grad, prog, _ = build(opt)
    e = ip.Engine(g, prog).load()
    with pytest.raises(ValueError, match="nesterov.*cannot change between steps"):
        opt.set(e, nesterov=True)
    with pytest.raises(ValueError, match="momentum between zero and non-zero"):
        opt.set(e, momentum=0.9)
    with pytest.raises(TypeError, match="no hyperparameter.*'betas'"):
        opt.set(e, betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="invalid learning rate -1"):
        opt.set(e, lr=-1)
    assert opt.lr == 0.1
    other = ip.Graph(TARGET)
    with pytest.raises(ValueError, match="runs none of the graphs"):
        opt.set(ip.Engine(other, ip.Sequence()).load(), lr=0.2)


def test_bad_inputs_are_reported_clearly():
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        optim.SGD(lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="invalid betas"):
        optim.Adam(betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="invalid loss_scaling"):
        optim.AdamW(loss_scaling=0)
    with pytest.raises(TypeError, match="state_dtype"):
        optim.RMSprop(state_dtype="int32")
    dev = ip.Device(TARGET, 2)
    w = dev.graph(0).addVariable("float32", (8,), "w")
    dev.graph(0).map_linearly(w)
    g1 = dev.graph(1).addVariable("float32", (8,), "g1")
    g_bad = dev.graph(0).addVariable("float32", (4, 2), "g_bad")
    wi = dev.graph(0).addVariable("int32", (8,), "wi")
    prog = ip.Sequence()
    with pytest.raises(ValueError, match="gradient 'g1' lives on IPU 1.*InterIpuCopy"):
        optim.weight_update(dev.graph(0), w, g1, optim.SGD(lr=1), prog)
    with pytest.raises(ValueError, match=r"shape \(4, 2\), weight 'w' has \(8,\)"):
        optim.weight_update(dev.graph(0), w, g_bad, optim.SGD(lr=1), prog)
    with pytest.raises(TypeError, match="'wi' is int32"):
        optim.weight_update(dev.graph(0), wi, wi, optim.SGD(lr=1), prog)
    with pytest.raises(ValueError, match="not on IPU 1"):
        optim.weight_update(dev.graph(1), w, w, optim.SGD(lr=1), prog)
    with pytest.raises(TypeError, match="needs an ipusim.ops.optim optimiser"):
        optim.weight_update(dev.graph(0), w, w, "sgd", prog)


# ---- placement, cycles, memory --------------------------------------------------------------------
def test_gradient_is_brought_to_the_weight_tiles_by_exchange():
    opt = optim.SGD(lr=0.5)
    w0, grads = data(steps=1, seed=9)
    for mode in MODES:
        w, _ = run_steps(mode, optim.SGD(lr=0.5), w0, grads, grad_tile=15)
        np.testing.assert_array_equal(w, stored(w0 - 0.5 * grads[0].astype(np.float64), "float32"))
    g, w, grad, prog, _ = build(opt, grad_tile=15)
    e = ip.Engine(g, prog).load()
    cost = e.cost(prog.programs[0])
    off_tile = int((w.tiles().reshape(-1) != 15).sum())
    assert cost.exchange_bytes == off_tile * 4 and cost.per_ipu[0].exchange > 0
    g2, w2, grad2, prog2, _ = build(optim.SGD(lr=0.5))  # gradient mapped like the weight: nothing moves
    cost2 = ip.Engine(g2, prog2).load().cost(prog2.programs[0])
    assert cost2.exchange_bytes == 0 and cost2.per_ipu[0].exchange == 0
    assert cost.total > cost2.total


def expected_vertex_cycles(kind, extra_per_vector, n, width, target):
    per_vector = {"sgd": 3, "adam": 10, "rmsprop": 6, "lamb_direction": 11, "lamb_apply": 3}[kind]
    per_element = {"sgd": 0, "adam": 20, "rmsprop": 20, "lamb_direction": 20, "lamb_apply": 0}[kind]
    per_vertex = {"sgd": 8, "adam": 40, "rmsprop": 8, "lamb_direction": 40, "lamb_apply": 40}[kind]
    instructions = math.ceil(n / width) * (per_vector + extra_per_vector) + n * per_element + per_vertex
    return 6 * instructions + target.vertex_overhead_cycles


@pytest.mark.parametrize("case,kinds,extra", [
    ("sgd", ["sgd"], 0), ("sgd_momentum", ["sgd"], 3), ("sgd_nesterov", ["sgd"], 4), ("adam", ["adam"], 0),
    ("adamw", ["adam"], 1), ("rmsprop", ["rmsprop"], 0), ("rmsprop_centered_momentum", ["rmsprop"], 6),
    ("lamb", ["lamb_direction", "lamb_apply"], 0)])
@pytest.mark.parametrize("wdt", ["float32", "float16"])
def test_vertex_cycles_follow_the_documented_formula(case, kinds, extra, wdt):
    g, w, *_ = build(CASES[case](), shape=(40, 7), wdt=wdt)
    # the widest vector all the operands allow: float32 state (and LAMB's float32 u) sets 2; SGD
    # without momentum keeps no state, so float16 weights and gradients run 4 wide
    width = 4 if (case, wdt) == ("sgd", "float16") else 2
    tables = [t for cs in g.compute_sets for t in cs.tables if t.type is optim.UPDATE_VERTEX]
    assert len(tables) == len(kinds)
    for table, kind in zip(tables, kinds):
        assert table.cycles(TARGET).tolist() == [expected_vertex_cycles(kind, extra, n, width, TARGET)
                                                 for n in table.sizes()["w"]]
        assert set(table.tiles.tolist()) == set(w.tiles().reshape(-1).tolist())


def test_all_float16_update_uses_the_wider_vector():
    opt = optim.SGD(lr=0.1, momentum=0.9, state_dtype="float16")
    g, *_ = build(opt, shape=(40, 7), wdt="float16")
    for table in g.compute_sets[-1].tables:
        assert table.cycles(TARGET).tolist() == [expected_vertex_cycles("sgd", 3, n, 4, TARGET)
                                                 for n in table.sizes()["w"]]


def test_optimiser_state_is_always_live_and_mapped_like_the_weight():
    opt = optim.AdamW()
    g, w, grad, prog, state = build(opt, shape=(40, 7))
    mem = ip.Engine(g, prog).memory[0]
    n, tiles = w.numel, TARGET.num_tiles
    per_tile_weight = np.bincount(w.tiles().reshape(-1), minlength=tiles) * 4
    expected = 2 * per_tile_weight + len(optim.AdamW.HYPER) * 4 + np.bincount(
        state.vertices.tiles, minlength=tiles) * 4
    np.testing.assert_array_equal(mem.by_category["optimiser_state"], expected)
    assert int(mem.by_category["optimiser_state"].sum()) == 2 * n * 4 + tiles * 6 * 4 + state.vertices.num_vertices * 4
    for t in state.tensors.values():
        assert t.var.always_live and t.var.category == "optimiser_state"
        np.testing.assert_array_equal(t.tiles(), w.tiles())
    assert (mem.always_live >= expected).all()


def test_state_slots_take_their_own_dtypes():
    """A dict state_dtype gives each slot its dtype (PopTorch's first- and second-order momentum
    types); slots it leaves out are float32, and naming a slot the configuration does not keep
    is an error naming the slots it keeps."""
    opt = optim.AdamW(lr=1e-3, state_dtype={"exp_avg": "float16"})
    _, _, _, _, state = build(opt)
    assert state.tensors["exp_avg"].dtype == np.float16 and state.tensors["exp_avg_sq"].dtype == np.float32
    with pytest.raises(ValueError, match=r"momentum_buffer.*\['exp_avg', 'exp_avg_sq'\]"):
        optim.Adam(state_dtype={"momentum_buffer": "float16"})


# ---- the fast mode's spans ------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(0, 3), hs.integers(1, 40)), max_size=30), hs.integers(1, 64))
def test_joined_spans_cover_the_runs_exactly_in_pieces_of_at_most_span(gaps_lengths, span):
    starts, at = [], 0
    for gap, length in gaps_lengths:
        starts.append(at + gap)
        at += gap + length
    starts, lengths = np.array(starts, np.int64), np.array([n for _, n in gaps_lengths], np.int64)
    order = np.random.default_rng(len(starts)).permutation(len(starts))  # vertices need not be in order
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(optim, "SPAN", span)
        spans = optim.joined_spans(starts[order], lengths[order])
    covered = np.concatenate([np.arange(a, b) for a, b in spans] + [np.zeros(0, np.int64)])
    runs = [np.arange(s, s + n) for s, n in zip(starts, lengths)]
    np.testing.assert_array_equal(covered, np.concatenate(runs + [np.zeros(0, np.int64)]))
    assert spans.shape == (len(spans), 2) and ((spans[:, 1] - spans[:, 0] <= span) & (spans[:, 1] > spans[:, 0])).all()


@pytest.mark.parametrize("case", ["sgd_momentum", "adamw", "lamb"])
def test_a_weight_in_several_spans_updates_as_in_one(case, monkeypatch):
    """The fast mode updates a weight whose vertices all see the same hyperparameters span by span
    (in parallel); spans of a few elements still give the strict mode's bits."""
    monkeypatch.setattr(optim, "SPAN", 5)
    w0, grads = data(steps=3, seed=11)
    out = {mode: run_steps(mode, CASES[case](), w0, grads)[0] for mode in MODES}
    np.testing.assert_array_equal(out["fast"], out["strict"])


@pytest.mark.parametrize("case", ["sgd", "sgd_momentum", "adam", "rmsprop_centered_momentum"])
def test_tiles_with_their_own_hyperparameters_agree_across_modes(case):
    """Each vertex reads its own tile's hyperparameter row: rows that differ (a learning rate per
    tile) give each tile's elements their own update, in both modes alike."""
    w0, grads = data(steps=2, seed=13)

    def learning_rate_per_tile(opt):
        def setup(engine, graph):
            hyper = opt.hyper(graph).tensor
            rows = engine.readTensor(hyper)
            rows[:, 0] *= 1.0 + np.arange(len(rows)) / 4  # lr grows with the tile
            engine.writeTensor(hyper, rows)
        return setup

    out = {}
    for mode in MODES:
        opt = CASES[case]()
        out[mode] = run_steps(mode, opt, w0, grads, setup=learning_rate_per_tile(opt))[0]
    np.testing.assert_array_equal(out["fast"], out["strict"])
    same_lr = run_steps("fast", CASES[case](), w0, grads)[0]
    assert not np.array_equal(out["fast"], same_lr)
