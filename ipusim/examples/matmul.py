"""Build a matmul on an emulated GC200, run it, check it against NumPy, show cycles and memory.

    python -m ipusim.examples.matmul [--m 512 --k 512 --n 512 --dtype float32 --mode fast --target GC200]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import ipusim as ip
from ipusim.ops.matmul import matmul, plan_matmul


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    ap.add_argument("--mode", choices=["fast", "strict"], default="fast")
    ap.add_argument("--target", default="GC200", help="GC200, Bow or GC2")
    args = ap.parse_args(argv)
    target = ip.get_target(args.target)

    graph = ip.Graph(target)
    a = graph.addVariable(args.dtype, (args.m, args.k), "a")
    b = graph.addVariable(args.dtype, (args.k, args.n), "b")
    graph.map_linearly(a)
    graph.map_linearly(b)
    inputs = graph.addHostToDeviceFIFO("inputs", args.dtype, (args.m, args.k))
    outputs = graph.addDeviceToHostFIFO("outputs", args.dtype, (args.m, args.n))
    prog = ip.Sequence(ip.StreamCopy(inputs, a))
    c = matmul(graph, a, b, prog, "c")
    prog.add(ip.StreamCopy(c, outputs))

    t0 = time.perf_counter()
    engine = ip.Engine(graph, prog, mode=args.mode).load()
    compile_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    A = rng.standard_normal((args.m, args.k)).astype(args.dtype)
    B = rng.standard_normal((args.k, args.n)).astype(args.dtype)
    engine.writeTensor(b, B)
    result = []
    engine.connectStream("inputs", A)
    engine.connectStream("outputs", result.append)
    t0 = time.perf_counter()
    cycles = engine.run()
    run_s = time.perf_counter() - t0

    expected = (A.astype(np.float32) @ B.astype(np.float32)).astype(args.dtype)
    err = float(np.abs(result[0].astype(np.float32) - expected).max() / np.abs(expected).max())
    plan = plan_matmul(target, a.shape, b.shape, args.dtype)
    (mem,) = engine.memory
    per = engine.last_run.per_ipu[0]
    flops = 2 * args.m * args.n * args.k
    print(f"matmul [{args.m}x{args.k}] @ [{args.k}x{args.n}] {args.dtype} on {target.name} ({args.mode} mode)")
    print(f"  result check: max relative error {err:.2e} against NumPy -> {'OK' if err < 1e-2 else 'WRONG'}")
    print(f"  plan: splits {plan.splits}, {plan.tiles_used} tiles, K split {plan.k_split}")
    print(f"  cycles: {cycles} total = compute {per.compute} + exchange {per.exchange} + sync {per.sync} "
          f"+ host I/O {per.host}")
    print(f"  simulated time {target.seconds(cycles) * 1e6:.1f} us -> {flops / target.seconds(cycles) / 1e12:.2f} TFLOP/s "
          f"(peak {target.flops_per_cycle(args.dtype) * target.num_tiles * target.clock_hz / 1e12:.1f})")
    print(f"  memory: {mem.summary()}")
    print(f"  host: compile {compile_s:.2f} s, run {run_s * 1e3:.1f} ms")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
