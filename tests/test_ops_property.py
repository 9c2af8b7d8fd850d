"""Property test over a broad table of ops of the core ATen opset: for shapes and arguments drawn by
hypothesis, every op computed through the whole compiler (capture, decomposition, lowering, the
emulator) gives PyTorch eager's forward value and PyTorch's gradient.

One example draws arguments for every op of a group and trains one model holding them all for one
step (a compile per example, not per op): op i's inputs are parameters, the loss is the sum of
sum(op_i(x) * r_i) for random r_i, and SGD with lr=1 leaves x - grad on the device. Tolerances
allow for float32 reassociation (sums, matmuls and convolutions in another order than PyTorch's).
Failing examples are not shrunk (each try compiles a model): the report lists every draw, labelled.
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import poptorch_lite as poptorch

small = st.integers(1, 4)
shapes = st.lists(small, min_size=1, max_size=3).map(tuple)
CASES: dict = {}


def case(group):
    def deco(fn):
        CASES[fn.__name__] = (group, fn)
        return fn
    return deco


def axis_of(draw, shape):
    return draw(st.integers(-len(shape), len(shape) - 1))


def positive(x):
    return x.abs() + 0.5


# ---- elementwise ---------------------------------------------------------------------------------
UNARY = {"abs": torch.abs, "neg": torch.neg, "exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
         "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "mish": F.mish,
         "elu": F.elu, "selu": F.selu, "softplus": F.softplus, "leaky_relu": F.leaky_relu,
         "log": lambda x: torch.log(positive(x)), "sqrt": lambda x: torch.sqrt(positive(x)),
         "rsqrt": lambda x: torch.rsqrt(positive(x)), "reciprocal": lambda x: torch.reciprocal(positive(x)),
         "log1p": lambda x: torch.log1p(x.abs()), "expm1": torch.expm1, "erf": torch.erf,
         "erfinv": lambda x: torch.erfinv(torch.tanh(x) * 0.9), "atan": torch.atan, "sin": torch.sin,
         "cos": torch.cos, "asinh": torch.asinh, "sinh": torch.sinh, "log2": lambda x: torch.log2(positive(x)),
         "lgamma": lambda x: torch.lgamma(positive(x)), "floor": lambda x: torch.floor(x) * x,
         "round": lambda x: torch.round(x * 3) * x, "sign": lambda x: torch.sign(x) * x, "frac": torch.frac,
         "logsigmoid": F.logsigmoid, "hardswish": F.hardswish, "square": torch.square}


@case("elementwise")
def unary(draw):
    name = draw(st.sampled_from(sorted(UNARY)), label="unary op")
    return UNARY[name], [draw(shapes)]


BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": lambda a, b: a / positive(b),
          "maximum": torch.maximum, "minimum": torch.minimum, "atan2": torch.atan2,
          "pow": lambda a, b: torch.pow(positive(a), b), "hypot": torch.hypot,
          "remainder": lambda a, b: torch.remainder(a, positive(b)), "where": lambda a, b: torch.where(a > b, a, b * 2),
          "lerp": lambda a, b: torch.lerp(a, b, 0.3), "logaddexp": torch.logaddexp}


@case("elementwise")
def binary(draw):
    name = draw(st.sampled_from(sorted(BINARY)), label="binary op")
    shape = draw(shapes)
    other = tuple(1 if draw(st.booleans()) else s for s in shape)[draw(st.integers(0, len(shape) - 1)):]
    return BINARY[name], [shape, other]


@case("elementwise")
def clamp(draw):
    low = draw(st.floats(-1, 0))
    high = draw(st.floats(0.1, 1))
    return lambda x: torch.clamp(x, low, high), [draw(shapes)]


@case("elementwise")
def pow_scalar(draw):
    e = draw(st.sampled_from([2, 3, 0.5, -1, -0.5, 1.5]))
    return lambda x: positive(x) ** e, [draw(shapes)]


# ---- reductions and normalisation ---------------------------------------------------------------------
REDUCE = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin, "logsumexp": torch.logsumexp,
          "var": torch.var, "std": torch.std, "prod": torch.prod, "norm": lambda x, d, keepdim: torch.linalg.vector_norm(x, 2, d, keepdim)}


@case("reduce")
def reduction(draw):
    name = draw(st.sampled_from(sorted(REDUCE)), label="reduction")
    shape = draw(shapes)
    dim = axis_of(draw, shape)
    keepdim = draw(st.booleans())
    if name in ("var", "std") and shape[dim] == 1:
        shape = shape[:dim % len(shape)] + (2,) + shape[dim % len(shape) + 1:]
    return lambda x: REDUCE[name](x, dim, keepdim=keepdim), [shape]


@case("reduce")
def softmax(draw):
    shape = draw(shapes)
    dim = axis_of(draw, shape)
    fn = draw(st.sampled_from([torch.softmax, torch.log_softmax]))
    return lambda x: fn(x, dim), [shape]


@case("reduce")
def layer_norm(draw):
    shape = draw(st.lists(st.integers(2, 4), min_size=2, max_size=3).map(tuple))
    k = draw(st.integers(1, len(shape) - 1))
    return lambda x, w, b: F.layer_norm(x, shape[-k:], w, b), [shape, shape[-k:], shape[-k:]]


@case("reduce")
def group_norm(draw):
    groups = draw(st.integers(1, 3))
    c = groups * draw(st.integers(1, 2))
    shape = (draw(st.integers(1, 3)), c) + draw(st.lists(st.integers(2, 3), min_size=1, max_size=2).map(tuple))
    return lambda x, w, b: F.group_norm(x, groups, w, b), [shape, (c,), (c,)]


@case("reduce")
def batch_norm(draw):
    shape = (draw(st.integers(2, 4)), draw(small)) + draw(st.lists(st.integers(1, 3), max_size=2).map(tuple))
    return lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), [shape, shape[1:2], shape[1:2]]


@case("reduce")
def cumulative(draw):
    shape = draw(shapes)
    dim = axis_of(draw, shape)
    fn = draw(st.sampled_from([torch.cumsum, lambda x, d: torch.cumprod(positive(x), d), torch.logcumsumexp,
                               lambda x, d: torch.cummax(x, d).values, lambda x, d: torch.cummin(x, d).values]))
    return lambda x: fn(x, dim), [shape]


@case("reduce")
def sort_topk(draw):
    shape = draw(shapes)
    dim = axis_of(draw, shape)
    k = draw(st.integers(1, shape[dim]))
    kind = draw(st.sampled_from(["sort", "topk", "max", "argsort", "median", "kthvalue"]), label="kind")
    largest = draw(st.booleans())
    if kind == "sort":
        return lambda x: torch.sort(x, dim, descending=largest)[0], [shape]
    if kind == "topk":
        return lambda x: torch.topk(x, k, dim, largest=largest)[0], [shape]
    if kind == "max":
        return lambda x: (torch.max if largest else torch.min)(x, dim)[0], [shape]
    if kind == "median":
        return lambda x: torch.median(x, dim, keepdim=largest)[0], [shape]
    if kind == "kthvalue":
        return lambda x: torch.kthvalue(x, k, dim)[0], [shape]
    return lambda x: x * torch.argsort(x, dim, descending=largest), [shape]


# ---- matmul, convolution, pooling ---------------------------------------------------------------------
@case("matmul")
def matmul(draw):
    b, m, k, n = (draw(small) for _ in range(4))
    kind = draw(st.sampled_from(["mm", "bmm", "addmm", "baddbmm", "matmul_3d_2d", "linear", "einsum"]), label="kind")
    if kind == "mm":
        return torch.mm, [(m, k), (k, n)]
    if kind == "bmm":
        return torch.bmm, [(b, m, k), (b, k, n)]
    if kind == "addmm":
        return lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0), [(n,), (m, k), (k, n)]
    if kind == "baddbmm":
        return torch.baddbmm, [(b, m, n), (b, m, k), (b, k, n)]
    if kind == "matmul_3d_2d":
        return torch.matmul, [(b, m, k), (k, n)]
    if kind == "linear":
        return F.linear, [(b, m, k), (n, k), (n,)]
    return lambda x, y: torch.einsum("bij,bjk->bik", x, y), [(b, m, k), (b, k, n)]


@case("matmul")
def conv(draw):
    nd = draw(st.sampled_from([1, 2]))
    groups = draw(st.integers(1, 2))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    kernel = draw(st.integers(1, 3))
    stride, padding, dilation = draw(st.integers(1, 2)), draw(st.integers(0, 1)), draw(st.integers(1, 2))
    size = draw(st.integers(dilation * (kernel - 1) + 1, 7))
    spatial = (size,) * nd
    batch = draw(st.integers(1, 2))
    if draw(st.booleans(), label="transposed"):
        fn = F.conv_transpose1d if nd == 1 else F.conv_transpose2d
        extra = draw(st.integers(0, stride - 1))
        if 2 * padding > (size - 1) * stride + dilation * (kernel - 1):   # no output left
            padding = 0
        return (lambda x, w, b: fn(x, w, b, stride, padding, extra, groups, dilation),
                [(batch, cin) + spatial, (cin, cout // groups) + (kernel,) * nd, (cout,)])
    conv_fn = F.conv1d if nd == 1 else F.conv2d
    return (lambda x, w, b: conv_fn(x, w, b, stride, padding, dilation, groups),
            [(batch, cin) + spatial, (cout, cin // groups) + (kernel,) * nd, (cout,)])


def sum_of(pooled):
    values, indices = pooled
    return values + indices.float()


@case("matmul")
def pool(draw):
    kernel = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 3))
    padding = draw(st.integers(0, kernel // 2))
    kind = draw(st.sampled_from(["max", "avg", "adaptive", "adaptive_max", "bilinear"]), label="kind")
    dilation = draw(st.integers(1, 2)) if kind == "max" else 1
    ceil = draw(st.booleans(), label="ceil_mode")
    reach = dilation * (kernel - 1) + 1
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(reach, 6)), draw(st.integers(reach, 6)))
    if kind == "max":
        if draw(st.booleans(), label="return_indices"):
            return lambda x: sum_of(F.max_pool2d(x, kernel, stride, padding, dilation, ceil, return_indices=True)), \
                [shape]
        return lambda x: F.max_pool2d(x, kernel, stride, padding, dilation, ceil), [shape]
    if kind == "avg":
        include_pad = draw(st.booleans(), label="count_include_pad")
        return lambda x: F.avg_pool2d(x, kernel, stride, padding, ceil, include_pad), [shape]
    if kind == "bilinear":
        size, align = (draw(st.integers(1, 8)), draw(st.integers(1, 8))), draw(st.booleans(), label="align_corners")
        return lambda x: F.interpolate(x, size, mode="bilinear", align_corners=align), [shape]
    out = (draw(st.integers(1, shape[2])), draw(st.integers(1, shape[3])))
    fn = F.adaptive_avg_pool2d if kind == "adaptive" else F.adaptive_max_pool2d
    return lambda x: fn(x, out), [shape]


# ---- views, copies and indexing ---------------------------------------------------------------------
@case("index")
def view(draw):
    shape = draw(st.lists(small, min_size=2, max_size=3).map(tuple))
    kind = draw(st.sampled_from(["permute", "transpose", "flatten", "slice", "flip", "roll", "repeat", "expand",
                                 "pad", "tril", "unsqueeze_cat", "stack", "split", "diagonal"]), label="kind")
    perm = draw(st.permutations(range(len(shape))))
    dim = axis_of(draw, shape)
    step, start = draw(st.integers(1, 2)), draw(st.integers(0, shape[dim] - 1))
    offset = draw(st.integers(1 - shape[0], shape[-1] - 1))
    pads = draw(st.lists(st.integers(0, 2), min_size=2, max_size=2))
    fns = {"permute": lambda x: x.permute(*perm), "transpose": lambda x: x.transpose(0, dim),
           "flatten": lambda x: torch.flatten(x, 0, 1), "slice": lambda x: x.narrow(dim, start, shape[dim] - start)[::step],
           "flip": lambda x: torch.flip(x, [dim]), "roll": lambda x: torch.roll(x, start + 1, dim),
           "repeat": lambda x: x.repeat(*([2] + [1] * (len(shape) - 1))),
           "expand": lambda x: x.unsqueeze(0).expand(2, *shape) * 1.5, "pad": lambda x: F.pad(x, pads, value=0.25),
           "tril": lambda x: torch.tril(x, start - 1), "unsqueeze_cat": lambda x: torch.cat([x, x * 2], dim),
           "stack": lambda x: torch.stack([x, -x], dim), "split": lambda x: torch.split(x, step, dim)[-1] * 3,
           "diagonal": lambda x: torch.diagonal(x, offset, 0, -1)}
    return fns[kind], [shape]


def index_array(draw, n, shape, negative=True):
    values = draw(st.lists(st.integers(-n if negative else 0, n - 1), min_size=int(np.prod(shape)),
                           max_size=int(np.prod(shape))))
    return torch.tensor(values, dtype=torch.int64).reshape(shape)


@case("index")
def gather_scatter(draw):
    shape = draw(st.lists(small, min_size=1, max_size=3).map(tuple))
    dim = axis_of(draw, shape) % len(shape)
    m = draw(small)
    ishape = tuple(m if d == dim else draw(st.integers(1, s)) for d, s in enumerate(shape))
    idx = index_array(draw, shape[dim], ishape, negative=False)
    kind = draw(st.sampled_from(["gather", "scatter_add", "scatter_reduce", "take_along_dim", "index_add"]),
                label="kind")
    if kind == "gather":
        return lambda x: torch.gather(x, dim, idx), [shape]
    if kind == "take_along_dim":   # the index broadcasts against x on the other axes
        full = index_array(draw, shape[dim], tuple(m if d == dim else s for d, s in enumerate(shape)))
        return lambda x: torch.take_along_dim(x, full, dim), [shape]
    if kind == "scatter_add":
        return lambda x, s: torch.scatter_add(x, dim, idx, s), [shape, ishape]
    if kind == "scatter_reduce":
        reduce = draw(st.sampled_from(["amax", "amin", "sum"]), label="reduce")
        include_self = draw(st.booleans(), label="include_self")
        return lambda x, s: torch.scatter_reduce(x, dim, idx, s, reduce, include_self=include_self), [shape, ishape]
    rows = index_array(draw, shape[dim], (m,), negative=False)
    src = tuple(m if d == dim else s for d, s in enumerate(shape))
    return lambda x, s: torch.index_add(x, dim, rows, s), [shape, src]


@case("index")
def advanced_index(draw):
    shape = draw(st.lists(small, min_size=2, max_size=3).map(tuple))
    count = draw(st.integers(1, len(shape)))
    dims = sorted(draw(st.permutations(range(len(shape))))[:count])
    bshape = draw(st.lists(small, min_size=1, max_size=2).map(tuple))
    key = [slice(None)] * len(shape)
    for d in dims:
        key[d] = index_array(draw, shape[d], bshape)
    key = tuple(key)
    if draw(st.booleans(), label="index_put"):
        values = tuple(torch.zeros(shape)[key].shape)
        accumulate = draw(st.booleans(), label="accumulate")
        if not accumulate:   # distinct positions: torch leaves the order of two writes to one open
            key = tuple(k.flatten().unique()[:1] if torch.is_tensor(k) else k for k in key)
            values = tuple(torch.zeros(shape)[key].shape)
        indices = [k if torch.is_tensor(k) else None for k in key]
        return lambda x, v: torch.ops.aten.index_put(x, indices, v, accumulate), [shape, values]
    return lambda x: x[key], [shape]


@case("index")
def index_select(draw):
    shape = draw(shapes)
    dim = axis_of(draw, shape)
    idx = index_array(draw, shape[dim], (draw(small),), negative=False)
    return lambda x: torch.index_select(x, dim, idx), [shape]


# ---- losses -------------------------------------------------------------------------------------------
@case("loss")
def loss(draw):
    n, c = draw(small), draw(st.integers(2, 5))
    labels = index_array(draw, c, (n,), negative=False)
    target = torch.rand(n, c)
    reduction = draw(st.sampled_from(["mean", "sum"]))
    weight = torch.rand(c) + 0.5
    kind = draw(st.sampled_from(["cross_entropy", "nll", "weighted", "smoothing", "mse", "l1", "smooth_l1",
                                 "bce_logits", "kl_div"]), label="kind")
    fns = {"cross_entropy": lambda x: F.cross_entropy(x, labels, reduction=reduction),
           "nll": lambda x: F.nll_loss(torch.log_softmax(x, 1), labels, reduction=reduction),
           "weighted": lambda x: F.cross_entropy(x, labels, weight=weight, reduction=reduction),
           "smoothing": lambda x: F.cross_entropy(x, labels, label_smoothing=0.1, reduction=reduction),
           "mse": lambda x: F.mse_loss(x, target, reduction=reduction),
           "l1": lambda x: F.l1_loss(x, target, reduction=reduction),
           "smooth_l1": lambda x: F.smooth_l1_loss(x, target, reduction=reduction),
           "bce_logits": lambda x: F.binary_cross_entropy_with_logits(x, target, reduction=reduction),
           "kl_div": lambda x: F.kl_div(torch.log_softmax(x, 1), target, reduction="batchmean")}
    return fns[kind], [(n, c)]


# ---- the test ------------------------------------------------------------------------------------------
class Ops(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.fns = [fn for fn, _ in ops]
        self.params = nn.ModuleList(nn.ParameterList([nn.Parameter(torch.randn(*s)) for s in shapes])
                                    for _, shapes in ops)

    def forward(self, *rs):
        # "* 1.0": an op that returns its input unchanged (a permute of a [1, 1]) would make a
        # parameter itself an output, which the device does not stream out
        outs = [fn(*params) * 1.0 for fn, params in zip(self.fns, self.params)]
        return outs, poptorch.identity_loss(sum((y * r).sum() for y, r in zip(outs, rs)), reduction="sum")


def check(ops: dict) -> None:
    torch.manual_seed(0)
    model = Ops(list(ops.values()))
    ref = copy.deepcopy(model)
    rs = [torch.randn(y.shape) for y in ref(*[torch.zeros(()) for _ in ops])[0]]
    out_ref, loss_ref = ref(*rs)
    loss_ref.backward()
    training = poptorch.trainingModel(model, poptorch.Options(), torch.optim.SGD(model.parameters(), lr=1.0))
    outs, _ = training(*[r[None] for r in rs])
    for name, y, y_ref, params, params_ref in zip(ops, outs, out_ref, model.params, ref.params):
        np.testing.assert_allclose(y.reshape(y_ref.shape).detach().numpy(), y_ref.detach().numpy(), rtol=1e-4,
                                   atol=1e-5, err_msg=f"{name}: forward")
        for k, (p, p_ref) in enumerate(zip(params, params_ref)):
            np.testing.assert_allclose((p_ref - p).detach().numpy(), p_ref.grad.numpy(), rtol=1e-3, atol=1e-4,
                                       err_msg=f"{name}: gradient of input {k}")


GROUPS = sorted({group for group, _ in CASES.values()})


@pytest.mark.parametrize("group", GROUPS)
@given(data=st.data())
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
def test_ops_match_pytorch_forward_and_gradient(group, data):
    ops = {}
    for name, (g, build) in CASES.items():
        if g == group:
            for k in range(2):
                ops[f"{name}#{k}"] = build(data.draw)
    check(ops)
