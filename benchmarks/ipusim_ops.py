"""ipusim op speed against plain NumPy, side by side in one run, and Numba compile times.

For each op and size: host wall time of one Engine.run of the op (fast mode, GC200) divided by
the wall time of the same computation written directly in NumPy (median of repeats). Then the
start-up cost of the kernels: a fresh process with an empty Numba cache (cold) and one with the
cache filled (warm).

    python benchmarks/ipusim_ops.py [--repeats 15] [--skip-compile]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import ipusim as ip
from ipusim.ops import conv, elementwise, matmul, pool, reduce, softmax


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gelu_numpy(x):
    from math import erf
    return 0.5 * x * (1.0 + np.vectorize(erf, otypes=[np.float64])(x / np.sqrt(2.0))).astype(x.dtype)


def cases():
    """(name, flops, inputs {name: array}, build(graph, tensors, prog) -> out, numpy(arrays) -> array)."""
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    out = []
    for n in (128, 256, 512):
        out.append((f"matmul {n}x{n}x{n}", 2 * n ** 3, {"a": f32(n, n), "b": f32(n, n)},
                    lambda g, t, p: matmul.matmul(g, t["a"], t["b"], p), lambda a: a["a"] @ a["b"]))
    for n, c, hw in ((8, 16, 32), (32, 32, 32)):
        o = 32
        out.append((f"conv2d {n}x{c}x{hw}x{hw} k3 o{o}", 2 * n * o * c * 9 * (hw - 2) ** 2,
                    {"x": f32(n, c, hw, hw), "w": f32(o, c, 3, 3)},
                    lambda g, t, p: conv.conv(g, t["x"], t["w"], p), lambda a: conv.conv_numpy(a["x"], a["w"])))
    for size in (1 << 18, 1 << 21):
        out.append((f"add {size}", size, {"a": f32(size), "b": f32(size)},
                    lambda g, t, p: elementwise.binary(g, "add", t["a"], t["b"], p), lambda a: a["a"] + a["b"]))
        out.append((f"relu {size}", size, {"a": f32(size)},
                    lambda g, t, p: elementwise.unary(g, "relu", t["a"], p), lambda a: np.maximum(a["a"], 0)))
    out.append(("gelu 262144", 262144 * 8, {"a": f32(262144)},
                lambda g, t, p: elementwise.unary(g, "gelu", t["a"], p), lambda a: gelu_numpy(a["a"])))
    out.append(("reduce sum 1024x1024 axis 1", 1 << 20, {"a": f32(1024, 1024)},
                lambda g, t, p: reduce.reduce(g, t["a"], (1,), "sum", p), lambda a: a["a"].sum(axis=1)))
    out.append(("softmax 1024x1024", 5 << 20, {"a": f32(1024, 1024)},
                lambda g, t, p: softmax.softmax(g, t["a"], 1, p),
                lambda a: (lambda e: e / e.sum(1, keepdims=True))(np.exp(a["a"] - a["a"].max(1, keepdims=True)))))
    out.append(("max_pool2d 32x32x32x32 k2", 32 * 32 * 32 * 32, {"x": f32(32, 32, 32, 32)},
                lambda g, t, p: pool.max_pool(g, t["x"], 2, p),
                lambda a: a["x"].reshape(32, 32, 16, 2, 16, 2).max(axis=(3, 5))))
    return out


def bench_ops(repeats: int) -> None:
    print(f"{'op':34s} {'MFLOP':>8s} {'ipusim ms':>10s} {'numpy ms':>10s} {'ratio':>7s}  check")
    ratios = []
    for name, flops, arrays, build, reference in cases():
        graph = ip.Graph(ip.GC200)
        tensors = {}
        for k, v in arrays.items():
            tensors[k] = graph.addVariable(v.dtype, v.shape, k)
            graph.map_linearly(tensors[k])
        prog = ip.Sequence()
        result = build(graph, tensors, prog)
        engine = ip.Engine(graph, prog).load()
        for k, v in arrays.items():
            engine.writeTensor(tensors[k], v)
        t_emu = median_time(engine.run, repeats)
        t_np = median_time(lambda: reference(arrays), repeats)
        got, want = engine.readTensor(result), reference(arrays)
        ok = np.allclose(got, want, rtol=1e-4, atol=1e-4)
        ratio = t_emu / t_np
        if flops >= 1e6:
            ratios.append(ratio)
        print(f"{name:34s} {flops / 1e6:8.1f} {t_emu * 1e3:10.3f} {t_np * 1e3:10.3f} {ratio:7.2f}  {'ok' if ok else 'WRONG'}")
    print(f"median ratio over ops of >= 1 MFLOP: {statistics.median(ratios):.2f} (target: within 3x)")


STARTUP = """
import time; t0 = time.perf_counter()
import numpy as np, ipusim as ip
from ipusim.ops import elementwise, matmul, conv, pool, reduce, softmax
g = ip.Graph(ip.Target.test(16)); p = ip.Sequence()
a = g.addVariable("float32", (8, 4, 8, 8), "a"); g.map_linearly(a)
w = g.addVariable("float32", (4, 4, 3, 3), "w"); g.map_linearly(w)
m = g.addVariable("float32", (16, 16), "m"); g.map_linearly(m)
y = conv.conv(g, a, w, p); y = pool.max_pool(g, y, 2, p); y = elementwise.unary(g, "relu", y, p)
s = softmax.softmax(g, reduce.reduce(g, y, (2, 3), "sum", p), 1, p); mm = matmul.matmul(g, m, m, p)
for mode in ("fast", "strict"):
    ip.Engine(g, p, mode=mode).load().run()
print(time.perf_counter() - t0)
"""


def bench_startup() -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        run = lambda: float(subprocess.run([sys.executable, "-c", STARTUP], env=env, check=True,  # noqa: E731
                                           capture_output=True, text=True).stdout.split()[-1])
        cold = run()
        warm = statistics.median(run() for _ in range(3))
    print(f"start-up with conv, pool, relu, reduce, softmax and matmul kernels in both modes: "
          f"cold (empty Numba cache) {cold:.1f} s, warm (cached) {warm:.1f} s (target: warm under 3 s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--skip-compile", action="store_true", help="skip the cold/warm start-up measurement")
    args = ap.parse_args()
    bench_ops(args.repeats)
    if not args.skip_compile:
        bench_startup()


if __name__ == "__main__":
    main()
