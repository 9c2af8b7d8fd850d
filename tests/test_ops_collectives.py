"""Cross-replica collectives: ring all-reduce, all-gather and broadcast over separate IPU memories."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import ipusim as ip
from ipusim.ops import collectives as cl
from ipusim.device.program import InterIpuCopy, walk

MODES = ["strict", "fast"]
TARGET = ip.Target.test(16, 64 * 1024)


def replicas(num, shape=(6, 10), dtype="float32", mappings=None):
    dev = ip.Device(TARGET, num)
    xs = []
    for r in range(num):
        g = dev.graph(r)
        x = g.addVariable(dtype, shape, f"x{r}", category="gradients")
        if mappings is None:
            g.map_linearly(x, grain=4)
        else:
            x.var.mapping = ip.TileMap.from_tiles(mappings[r])
        xs.append(x)
    return dev, xs


def values(num, shape=(6, 10), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(num)]


def run(dev, xs, prog, vals, mode):
    e = ip.Engine(dev, prog, mode=mode).load()
    for x, v in zip(xs, vals):
        e.writeTensor(x, v)
    e.run()
    return e


def ring_order_sum(vals, scale=1.0):
    """The documented arithmetic: chunk c summed from replica c around the ring, in the dtype."""
    num = len(vals)
    flat = [v.reshape(-1) for v in vals]
    n = flat[0].size
    out = np.empty_like(flat[0])
    for c, (b, e) in enumerate(cl.chunk_bounds(n, num)):
        acc = flat[c][b:e].copy()
        for k in range(1, num):
            s = scale if k == num - 1 else 1.0
            acc = ((acc.astype(np.float64) + flat[(c + k) % num][b:e]) * s).astype(np.float32).astype(acc.dtype)
        out[b:e] = acc
    return out.reshape(vals[0].shape)


# ---- all-reduce numerics --------------------------------------------------------------------------
@pytest.mark.parametrize("num", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_equals_the_numpy_sum_and_is_bit_identical_everywhere(num, op):
    vals = values(num, seed=num)
    results = {}
    for mode in MODES:
        dev, xs = replicas(num)
        prog = ip.Sequence()
        outs = cl.all_reduce(dev, xs, prog, op=op)
        e = run(dev, xs, prog, vals, mode)
        results[mode] = [e.readTensor(o) for o in outs]
        for x, v in zip(xs, vals):  # not in place: the inputs are unchanged
            np.testing.assert_array_equal(e.readTensor(x), v)
    for mode in MODES:
        for r in results[mode]:
            np.testing.assert_array_equal(r, results["strict"][0])
    expected = np.sum(np.asarray(vals, np.float64), axis=0) * (1.0 / num if op == "mean" else 1.0)
    np.testing.assert_allclose(results["strict"][0], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(results["strict"][0],
                                  ring_order_sum(vals, 1.0 / num if op == "mean" else 1.0))


@pytest.mark.parametrize("mode", MODES)
def test_all_reduce_float16_in_place(mode):
    vals = values(4, dtype=np.float16, seed=2)
    dev, xs = replicas(4, dtype="float16")
    prog = ip.Sequence()
    outs = cl.all_reduce(dev, xs, prog, op="mean", in_place=True)
    assert outs == xs
    e = run(dev, xs, prog, vals, mode)
    got = [e.readTensor(x) for x in xs]
    for g in got:
        assert g.dtype == np.float16
        np.testing.assert_array_equal(g, got[0])
    np.testing.assert_array_equal(got[0], ring_order_sum(vals, 0.25))
    np.testing.assert_allclose(got[0], np.mean(np.asarray(vals, np.float64), axis=0), rtol=5e-3, atol=2e-3)


@pytest.mark.parametrize("mode", MODES)
def test_replicas_may_map_their_tensors_differently(mode):
    rng = np.random.default_rng(3)
    maps = [rng.integers(0, 16, size=60) for _ in range(3)]
    dev, xs = replicas(3, mappings=maps)
    prog = ip.Sequence()
    outs = cl.all_reduce(dev, xs, prog)
    vals = values(3, seed=4)
    e = run(dev, xs, prog, vals, mode)
    for r, o in enumerate(outs):
        np.testing.assert_array_equal(o.tiles().reshape(-1), maps[r])
        np.testing.assert_array_equal(e.readTensor(o), ring_order_sum(vals))


def test_every_replica_result_depends_on_every_replica_input():
    dev, xs = replicas(3)
    prog = ip.Sequence()
    outs = cl.all_reduce(dev, xs, prog)
    vals = values(3, seed=5)
    base = [run(dev, xs, prog, vals, "strict").readTensor(o) for o in outs]
    for k in range(3):
        changed = [v.copy() for v in vals]
        changed[k] += 1.0
        e = run(dev, xs, prog, changed, "strict")
        for o, b in zip(outs, base):
            np.testing.assert_allclose(e.readTensor(o), b + 1.0, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(num=hs.integers(1, 5), n=hs.integers(0, 40), seed=hs.integers(0, 2 ** 16), mean=hs.booleans())
def test_all_reduce_any_size(num, n, seed, mean):
    vals = values(num, shape=(n,), seed=seed)
    res = {}
    for mode in MODES:
        dev, xs = replicas(num, shape=(n,))
        prog = ip.Sequence()
        outs = cl.all_reduce(dev, xs, prog, op="mean" if mean else "sum")
        e = run(dev, xs, prog, vals, mode)
        res[mode] = [e.readTensor(o) for o in outs]
    for r in res["strict"] + res["fast"]:
        np.testing.assert_array_equal(r, res["strict"][0])
    expected = np.sum(np.asarray(vals, np.float64).reshape(num, n), axis=0) / (num if mean else 1)
    np.testing.assert_allclose(res["fast"][0], expected, rtol=1e-6, atol=1e-6)


# ---- links and cycles -----------------------------------------------------------------------------
@pytest.mark.parametrize("num", [2, 3, 4, 6])
def test_each_link_carries_the_ring_closed_form(num):
    n = 12 * 10 * num  # divisible by the number of replicas
    dev, xs = replicas(num, shape=(n,))
    prog = ip.Sequence()
    cl.all_reduce(dev, xs, prog, in_place=True)
    per_link: dict[tuple[int, int], int] = {}
    for node in walk(prog):
        if isinstance(node, InterIpuCopy):
            key = (node.src.ipu, node.dst.ipu)
            per_link[key] = per_link.get(key, 0) + node.src.nbytes
    ring = {(r, (r + 1) % num) for r in range(num)}
    assert set(per_link) == ring
    nbytes = n * 4
    for b in per_link.values():
        assert b == 2 * (num - 1) * nbytes // num  # 2(R-1)/R of the data crosses each link
    e = ip.Engine(dev, prog).load()
    cost = e.cost(prog.programs[0])
    assert cost.inter_ipu_bytes == 2 * (num - 1) * nbytes


@pytest.mark.parametrize("num", [2, 3, 4, 5])
def test_all_reduce_cycles_are_the_link_model_of_the_ring(num):
    n = 16 * 24 * num
    dev, xs = replicas(num, shape=(n,))
    prog = ip.Sequence()
    cl.all_reduce(dev, xs, prog, in_place=True)
    e = ip.Engine(dev, prog).load()
    op = prog.programs[0]
    steps = op.body.programs
    links = sum(e.cost(p).total for p in steps if any(isinstance(n, InterIpuCopy) for n in walk(p)))
    compute = sum(e.cost(p).total for p in steps if any(isinstance(n, ip.Execute) for n in walk(p)))
    assert e.cost(op).total == links + compute
    chunk_bytes = n * 4 // num
    gsync = TARGET.global_sync_cycles(num)
    # full-duplex links: every IPU sends a chunk and receives one at once, one round per ring step
    assert links == 2 * (num - 1) * (TARGET.inter_ipu_cycles(chunk_bytes) + gsync)
    # per round, the link time is the closed form of a ring all-reduce: 2(R-1)/R of the bytes over one link
    rate = TARGET.ipu_link_bytes_per_s * TARGET.ipu_link_efficiency * TARGET.links_per_ipu_pair
    closed_form = 2 * (num - 1) / num * n * 4 / rate * TARGET.clock_hz
    assert 2 * (num - 1) * TARGET.inter_ipu_cycles(chunk_bytes) == pytest.approx(closed_form, abs=2 * (num - 1))
    # every IPU's links are busy for its 2(R-1) steps, sending and receiving at once
    for ipu in range(num):
        assert e.cost(op).per_ipu[ipu].inter_ipu == 2 * (num - 1) * TARGET.inter_ipu_cycles(chunk_bytes)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("dtype,width", [("float32", 2), ("float16", 4)])
def test_add_vertex_cycles_follow_the_formula(scaled, dtype, width):
    dev, xs = replicas(2, shape=(200,), dtype=dtype)
    cl.all_reduce(dev, xs, ip.Sequence(), op="mean" if scaled else "sum", in_place=True)
    tables = [t for g in dev.graphs for cs in g.compute_sets for t in cs.tables]
    assert tables and all(t.type is cl.REDUCE_ADD_VERTEX for t in tables)
    for t in tables:
        n = t.sizes()["acc"]
        expected = [6 * (math.ceil(k / width) * (2 if scaled else 1) + 6) + TARGET.vertex_overhead_cycles for k in n]
        assert t.cycles(TARGET).tolist() == expected


def test_received_chunks_are_temporaries_on_the_chunk_tiles():
    dev, xs = replicas(3, shape=(90,))
    prog = ip.Sequence()
    cl.all_reduce(dev, xs, prog, in_place=True)
    e = ip.Engine(dev, prog)
    for node in walk(prog):
        if isinstance(node, InterIpuCopy) and node.dst.var.category == "temporaries":
            assert not node.dst.var.always_live
            src_positions = node.src.index.reshape(-1)
            np.testing.assert_array_equal(node.dst.tiles().reshape(-1), xs[node.dst.ipu].var.mapping.at(src_positions))
    for report in e.memory:  # one received chunk (30 floats) is live at a time on each IPU
        assert report.liveness.max() == 30 * 4


# ---- all-gather, broadcast ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num", [1, 3, 4])
def test_all_gather(mode, num):
    dev, xs = replicas(num, shape=(5, 3), dtype="float16")
    prog = ip.Sequence()
    outs = cl.all_gather(dev, xs, prog)
    vals = values(num, shape=(5, 3), dtype=np.float16, seed=6)
    e = run(dev, xs, prog, vals, mode)
    for r, o in enumerate(outs):
        assert o.shape == (num, 5, 3) and o.ipu == r
        np.testing.assert_array_equal(e.readTensor(o), np.stack(vals))
        np.testing.assert_array_equal(o.tiles()[r], xs[r].tiles())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num,root", [(2, 1), (3, 0), (4, 2), (5, 4)])
def test_broadcast_from_any_root(mode, num, root):
    dev, xs = replicas(num, shape=(7, 5))
    prog = ip.Sequence()
    cl.broadcast(dev, xs, prog, root=root)
    vals = values(num, shape=(7, 5), seed=7)
    e = run(dev, xs, prog, vals, mode)
    for x in xs:
        np.testing.assert_array_equal(e.readTensor(x), vals[root])
    for node in walk(prog):
        if isinstance(node, InterIpuCopy):
            assert node.dst.ipu != root
    # the root scatters the chunks it does not own in the all-gather, the ring gathers the rest:
    # R-1 tensors' worth of bytes in all, as many as any broadcast must deliver
    moved = sum(n.src.nbytes for n in walk(prog) if isinstance(n, InterIpuCopy))
    assert moved == (num - 1) * 35 * 4


def test_bad_replica_lists_are_reported_clearly():
    dev, xs = replicas(2)
    other = dev.graph(1).addVariable("float32", (3,), "small")
    ints = [dev.graph(r).addVariable("int32", (6, 10), f"i{r}") for r in range(2)]
    prog = ip.Sequence()
    with pytest.raises(ValueError, match="different IPUs"):
        cl.all_reduce(dev, [xs[0], xs[0]], prog)
    with pytest.raises(ValueError, match="replica tensors must match"):
        cl.all_reduce(dev, [xs[0], other], prog)
    with pytest.raises(ValueError, match="unknown reduction 'max'"):
        cl.all_reduce(dev, xs, prog, op="max")
    with pytest.raises(TypeError, match="float32 or float16.*int32"):
        cl.all_reduce(dev, ints, prog)
    with pytest.raises(ValueError, match="one tensor per replica"):
        cl.all_gather(dev, [], prog)
    with pytest.raises(ValueError, match="root 2 is not a replica"):
        cl.broadcast(dev, xs, prog, root=2)
    stranger = ip.Device(TARGET, 2)
    with pytest.raises(ValueError, match="does not belong to this device"):
        cl.all_reduce(stranger, xs, prog)
