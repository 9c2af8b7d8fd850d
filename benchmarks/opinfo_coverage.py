"""PyTorch's OpInfo database through the compiler: the share of ops whose forward (an inference
model) and backward (a training model) match eager PyTorch, and why the others fail.

    nice python benchmarks/opinfo_coverage.py                        # every op (long: run it in parts)
    nice python benchmarks/opinfo_coverage.py --start 0 --stop 200 --json part0.json
    nice python benchmarks/opinfo_coverage.py --report part0.json part1.json ...   # merge parts
    python benchmarks/opinfo_coverage.py --ops nn.functional.conv3d max_pool3d -v

What is measured
- An op is an entry of `torch.testing._internal.common_methods_invocations.op_db` whose CPU
  dtypes include float32, variants included (`nn.functional.conv2d` and `addmm[decomposed]` are
  two ops), so the count is PyTorch's own.
- Its sample is the first of `op.sample_inputs("cpu", torch.float32, requires_grad=...)` after
  `torch.manual_seed(0)` whose tensors are not empty (an empty tensor cannot be a model input: its
  batch dimension would be 0); the first sample when every one has an empty tensor. An op whose
  sample fails in eager PyTorch on the CPU (the jiterator ops, which need a GPU, and a few sparse
  and complex-half ones) has nothing to compare with: it is listed, not counted.
- Forward: every tensor of the sample (input, args, kwargs; one tensor used twice is one input)
  is an input of an inference model whose forward calls `op.op` with the sample's non-tensor
  arguments fixed; every tensor it returns is compared with eager PyTorch on the same sample:
  same shape, same kind of dtype (int64 comes back int32, as PopTorch returns it), values within
  rtol 1e-4 and atol 1e-5 times the reference's largest magnitude (at least 1), NaN where NaN.
- Backward (ops with a gradient: `supports_autograd`, and eager PyTorch differentiates a floating
  output of the sample with respect to one of its floating tensors): the tensors eager PyTorch gives
  a gradient become nn.Parameters of a wrapper module (the compiler differentiates parameters
  only, as PopART does), the rest inputs; the loss is the sum over the floating outputs of each
  output times fixed random weights (`identity_loss`, reduction "sum": random weights so that
  ops whose outputs sum to a constant, softmax, still have a gradient to check); the gradients,
  read through `Options.anchorTensor("Gradient___<parameter>")`, are compared with
  `torch.autograd.grad` of the same loss within rtol 1e-3 and atol 1e-4 of the largest magnitude.
- Random ops (eager calls with different seeds differ; the seed OpInfo's `wrapper_set_seed`
  fixes is shifted by the caller's) cannot match torch's generator: their outputs and gradients
  are compared in shape and dtype only.
Forward share = forward passes / ops; backward share = backward passes / ops with a gradient,
whatever their forward gave (the share among ops that pass forward is printed as well).

Failures are listed with their reason: the compiler's UnsupportedOpError (naming the ATen op),
another error at capture or compile time, or a mismatch with its largest error. Each op runs
under a time limit (--timeout); a full run takes long, so run it in parts with --start/--stop or
--ops, under `nice`, and merge the parts' --json files with --report.

Needs the `expecttest` package (torch.testing._internal imports it): pip install expecttest.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

FORWARD_TOL = (1e-4, 1e-5)    # rtol, atol (times the reference's largest magnitude, at least 1)
BACKWARD_TOL = (1e-3, 1e-4)


@dataclass
class Result:
    op: str
    forward: str = "fail"        # "pass" | "fail" | "n/a" (the sample fails in eager PyTorch)
    forward_reason: str = ""
    backward: str = "n/a"        # "pass" | "fail" | "n/a" (no gradient)
    backward_reason: str = ""
    random: bool = False
    seconds: float = 0.0


class OpTimeout(Exception):
    pass


def op_name(op) -> str:
    return op.name + (f"[{op.variant_test_name}]" if op.variant_test_name else "")


def float32_ops() -> list:
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ModuleNotFoundError as e:
        raise SystemExit(f"{e}: torch.testing._internal needs it; pip install {e.name}") from None
    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def first_sample(op):
    """The first sample without an empty tensor (else the first sample; see the module doc)."""
    torch.manual_seed(0)
    first = None
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=bool(op.supports_autograd)):
        first = first or sample
        leaves = tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))[0]
        if all(t.numel() > 0 for t in leaves if isinstance(t, torch.Tensor)):
            return sample
    if first is None:
        raise ValueError("the op has no sample for float32 on the CPU")
    return first


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# ---- the models ----------------------------------------------------------------------------------
class Call:
    """The sample as a call of `op.op` with its tensors replaced by the model's: `tensors` are the
    distinct tensors of the sample in order of appearance, `slots` the leaf positions of each."""

    def __init__(self, op, sample):
        self.fn = op.op
        self.leaves, self.spec = tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
        self.tensors, self.slots, seen = [], [], {}
        for i, leaf in enumerate(self.leaves):
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in seen:
                    seen[id(leaf)] = len(self.tensors)
                    self.tensors.append(leaf)
                    self.slots.append([])
                self.slots[seen[id(leaf)]].append(i)

    def __call__(self, tensors):
        leaves = list(self.leaves)
        for t, slots in zip(tensors, self.slots):
            for i in slots:
                leaves[i] = t
        x, args, kwargs = tree_unflatten(leaves, self.spec)
        return self.fn(x, *args, **kwargs)


def tensor_outputs(out) -> list[torch.Tensor]:
    leaves = tree_flatten(out)[0]
    return [t for t in leaves if isinstance(t, torch.Tensor)]


class Forward(nn.Module):
    def __init__(self, call: Call):
        super().__init__()
        self.call = call

    def forward(self, *tensors):
        return tuple(tensor_outputs(self.call(list(tensors))))


class Backward(nn.Module):
    """The differentiable tensors as parameters p0, p1, ...; the loss as the module doc says."""

    def __init__(self, call: Call, grad_of: list[int], weights: list[torch.Tensor]):
        super().__init__()
        self.call, self.grad_of = call, grad_of
        for k, i in enumerate(grad_of):
            setattr(self, f"p{k}", nn.Parameter(call.tensors[i].detach().clone()))
        for k, w in enumerate(weights):
            self.register_buffer(f"w{k}", w)
        self.n_weights = len(weights)

    def forward(self, *inputs):
        it = iter(inputs)
        params = {i: getattr(self, f"p{k}") for k, i in enumerate(self.grad_of)}
        tensors = [params[i] if i in params else next(it) for i in range(len(self.call.tensors))]
        outs = [t for t in tensor_outputs(self.call(tensors)) if t.is_floating_point()]
        loss = sum((o * getattr(self, f"w{k}")).sum() for k, o in enumerate(outs))
        import poptorch_lite
        return poptorch_lite.identity_loss(loss, reduction="sum")


# ---- comparing -------------------------------------------------------------------------------------
def compare(got: list, want: list, tol, values: bool) -> str:
    """'' when `got` matches `want`, else what differs."""
    if len(got) != len(want):
        return f"mismatch: {len(got)} outputs, eager PyTorch gives {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if tuple(g.shape) != tuple(w.shape):
            return f"mismatch: output {k} has shape {list(g.shape)}, eager PyTorch {list(w.shape)}"
        kinds = [t.dtype.is_floating_point + 2 * (t.dtype == torch.bool) for t in (g, w)]
        if kinds[0] != kinds[1]:
            return f"mismatch: output {k} is {g.dtype}, eager PyTorch's {w.dtype}"
        if not values or w.numel() == 0:
            continue
        g64, w64 = g.detach().to(torch.float64), w.detach().to(torch.float64)
        finite = torch.isfinite(w64)
        scale = max(1.0, float(w64[finite].abs().max())) if finite.any() else 1.0
        rtol, atol = tol
        close = torch.isclose(g64, w64, rtol=rtol, atol=atol * scale, equal_nan=True)
        if not bool(close.all()):
            bad = ~close
            err = (g64 - w64).abs()[bad & finite & torch.isfinite(g64)]
            worst = f"largest error {float(err.max()):.3g}" if err.numel() else "inf or NaN where eager has none"
            return (f"mismatch: output {k}: {int(bad.sum())} of {w.numel()} values differ ({worst}, "
                    f"reference scale {scale:.3g})")
    return ""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.layout != torch.strided:
        return True
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    return bool(((a == b) | ((a != a) & (b != b))).all())


@contextlib.contextmanager
def seeds_shifted(by: int):
    """Every `torch.manual_seed(s)` seeds `s + by` instead. OpInfo calls its random ops through
    `wrapper_set_seed`, which seeds torch with 42 before the op to make it repeatable: without the
    shift two calls of a random op would agree whatever seed the caller set."""
    real = torch.manual_seed
    torch.manual_seed = lambda seed: real(int(seed) + by)
    try:
        yield
    finally:
        torch.manual_seed = real


def is_random(call: Call) -> bool:
    """Whether calls with different seeds differ (four seeds: a small draw, a permutation of three
    by multinomial, can repeat under two)."""
    outs = []
    for seed in (1, 2, 3, 4):
        torch.manual_seed(seed)
        with torch.no_grad(), seeds_shifted(seed):
            outs.append([t.clone() for t in tensor_outputs(call([t.detach() for t in call.tensors]))])
    return not all(_same(a, b) for other in outs[1:] for a, b in zip(outs[0], other))


# ---- running one op ----------------------------------------------------------------------------------
def run_forward(call: Call, random: bool) -> str:
    import poptorch_lite as poptorch
    inputs = [t.detach().clone() for t in call.tensors]
    with torch.no_grad():
        want = tensor_outputs(call([t.clone() for t in inputs]))
    if not want:
        return "returns no tensor: nothing to compare as a model output"
    model = poptorch.inferenceModel(Forward(call))
    try:
        got = tensor_outputs(model(*inputs))
    finally:
        model.destroy()
    return compare(got, want, FORWARD_TOL, not random)


def differentiable(call: Call) -> list[int]:
    """The sample's tensors eager PyTorch gives a gradient of its floating outputs."""
    wrt = [i for i, t in enumerate(call.tensors) if t.requires_grad and t.is_floating_point()]
    leaves = [t.detach().clone().requires_grad_(i in wrt) for i, t in enumerate(call.tensors)]
    outs = [t for t in tensor_outputs(call(leaves)) if t.is_floating_point() and t.requires_grad]
    if not outs:
        return []
    grads = torch.autograd.grad(sum(o.sum() for o in outs), [leaves[i] for i in wrt], allow_unused=True)
    return [i for i, g in zip(wrt, grads) if g is not None]


def run_backward(call: Call, grad_of: list[int], random: bool) -> str:
    import poptorch_lite as poptorch
    torch.manual_seed(3)
    leaves = [t.detach().clone().requires_grad_(i in grad_of) for i, t in enumerate(call.tensors)]
    outs = [t for t in tensor_outputs(call(leaves)) if t.is_floating_point()]
    weights = [torch.randn(o.shape) for o in outs]
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    wrt = [leaves[i] for i in grad_of]
    want = [g if g is not None else torch.zeros_like(t)
            for g, t in zip(torch.autograd.grad(loss, wrt, allow_unused=True), wrt)]
    module = Backward(call, grad_of, weights)
    opts = poptorch.Options()
    for k in range(len(grad_of)):
        opts.anchorTensor(f"g{k}", f"Gradient___p{k}")
    model = poptorch.trainingModel(module, opts, torch.optim.SGD(module.parameters(), lr=0.0))
    inputs = [t.detach().clone() for i, t in enumerate(call.tensors) if i not in grad_of]
    try:
        model(*inputs)
        got = [model.getAnchoredTensor(f"g{k}") for k in range(len(grad_of))]
    finally:
        model.destroy()
    return compare(got, want, BACKWARD_TOL, not random)


@contextlib.contextmanager
def time_limit(seconds: float):
    def expire(signum, frame):
        raise OpTimeout(f"took longer than {seconds:.0f} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def attempt(fn, *args) -> str:
    try:
        return fn(*args)
    except OpTimeout as e:
        return f"timeout: {e}"
    except Exception as e:   # noqa: BLE001 - every failure is a reason to report
        return first_line(e)


def run_op(op, timeout: float) -> Result:
    r = Result(op_name(op))
    start = time.perf_counter()
    quiet = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        warnings.simplefilter("ignore")
        try:
            with time_limit(timeout):
                sample = first_sample(op)
                call = Call(op, sample)
                r.random = is_random(call)
        except Exception as e:   # noqa: BLE001
            r.forward, r.forward_reason = "n/a", "the sample itself fails in eager PyTorch: " + first_line(e)
            r.seconds = time.perf_counter() - start
            return r
        with time_limit(timeout):
            r.forward_reason = attempt(run_forward, call, r.random)
        r.forward = "fail" if r.forward_reason else "pass"
        with time_limit(timeout):
            grad_of = differentiable(call) if op.supports_autograd else []
        if grad_of:
            with time_limit(timeout):
                r.backward_reason = attempt(run_backward, call, grad_of, r.random)
            r.backward = "fail" if r.backward_reason else "pass"
    r.seconds = time.perf_counter() - start
    return r


# ---- reporting ------------------------------------------------------------------------------------
def short_reason(reason: str) -> str:
    """The reason without the user's source line and sizes, for counting."""
    m = re.search(r"aten op (\S+?)(?:\.\w+)? .*?: (.*)", reason)
    if m:
        return f"unsupported {m.group(1)}: {m.group(2)[:80]}"
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", reason)[:120]


def report(results: list[Result], out=sys.stdout) -> None:
    skipped = [r for r in results if r.forward == "n/a"]
    counted = [r for r in results if r.forward != "n/a"]
    n = len(counted)
    fwd = sum(r.forward == "pass" for r in counted)
    with_grad = [r for r in counted if r.backward != "n/a"]
    bwd = sum(r.backward == "pass" for r in with_grad)
    fwd_ok_grad = [r for r in with_grad if r.forward == "pass"]
    print("\nFailing ops:", file=out)
    for r in counted:
        if r.forward != "pass":
            print(f"  {r.op:45s} forward:  {r.forward_reason}", file=out)
        if r.backward == "fail":
            print(f"  {r.op:45s} backward: {r.backward_reason}", file=out)
    counts: dict[str, int] = {}
    for r in counted:
        for reason in ([r.forward_reason] if r.forward != "pass" else []) + \
                ([r.backward_reason] if r.backward == "fail" else []):
            key = short_reason(reason)
            counts[key] = counts.get(key, 0) + 1
    print("\nReasons, most frequent first:", file=out)
    for key, c in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {c:4d}  {key}", file=out)
    if skipped:
        print(f"\nNot counted ({len(skipped)}: the sample fails in eager PyTorch on the CPU):", file=out)
        for r in skipped:
            print(f"  {r.op:45s} {r.forward_reason[len('the sample itself fails in eager PyTorch: '):][:120]}",
                  file=out)
    print(file=out)
    print(f"forward:  {fwd} of {n} ops pass ({100 * fwd / max(n, 1):.1f}%)", file=out)
    print(f"backward: {bwd} of {len(with_grad)} ops with a gradient pass ({100 * bwd / max(len(with_grad), 1):.1f}%); "
          f"of those passing forward {sum(r.backward == 'pass' for r in fwd_ok_grad)} of {len(fwd_ok_grad)}", file=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="*", help="op names (OpInfo names, with [variant] for a variant; a name "
                                            "without one selects all its variants)")
    p.add_argument("--start", type=int, default=0, help="first op index (in op_db's order of float32 ops)")
    p.add_argument("--stop", type=int, default=None, help="op index to stop before")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per op and pass")
    p.add_argument("--json", help="write the results to this file (merge parts with --report)")
    p.add_argument("--report", nargs="+", metavar="JSON", help="print the report of saved parts; run nothing")
    p.add_argument("-v", "--verbose", action="store_true", help="print each op's result as it finishes")
    a = p.parse_args(argv)
    if a.report:
        results = []
        for path in a.report:
            with open(path, encoding="utf-8") as f:
                results += [Result(**d) for d in json.load(f)]
        report(results)
        return 0
    ops = float32_ops()
    if a.ops:
        wanted = set(a.ops)
        ops = [op for op in ops if op_name(op) in wanted or op.name in wanted]
        missing = wanted - {op_name(op) for op in ops} - {op.name for op in ops}
        if missing:
            p.error(f"no float32 OpInfo entry named {sorted(missing)}")
    else:
        ops = ops[a.start:a.stop]
    results = []
    for k, op in enumerate(ops):
        r = run_op(op, a.timeout)
        results.append(r)
        if a.verbose:
            print(f"{a.start + k:4d} {r.op:45s} fwd {r.forward:4s} bwd {r.backward:4s} {r.seconds:6.1f} s  "
                  f"{r.forward_reason or r.backward_reason}", flush=True)
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump([asdict(x) for x in results], f, indent=0)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
