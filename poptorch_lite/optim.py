"""PopTorch's optimisers (`poptorch.optim`) and their weight-update programs on the device.

The classes are torch optimisers (they also step on the CPU) that accept PopTorch's extra
arguments. At compile time every parameter group becomes an `ipusim.ops.optim` configuration and
each weight gets an in-place update in the weight-update program of its IPU. Learning rates and
other hyperparameters live in device tensors: `setOptimizer` rewrites them without recompiling.

Gradient reduction: accumulators hold the sum of the micro-batch gradients; with
`ReductionType.Mean` the update divides by the number of micro-batches (and replicas) through the
optimiser's loss-scaling divisor, so no extra pass over the gradients is needed.
"""
from __future__ import annotations

import math

import numpy as np
import torch

import ipusim as ip
from ipusim.ops import collectives
from ipusim.ops import elementwise as ew
from ipusim.ops import optim as dev

from .enums import ReductionType

POPTORCH_EXTRAS = ("loss_scaling", "accum_type", "first_order_momentum_accum_type",
                   "second_order_momentum_accum_type", "velocity_scaling", "use_combined_accum",
                   "max_grad_norm", "max_weight_norm", "bias_correction")


def _state_dtype(accum_type) -> str:
    if accum_type in (None, torch.float32):
        return "float32"
    if accum_type == torch.float16:
        return "float16"
    raise ValueError(f"accum_type must be torch.float32 or torch.float16, got {accum_type}")


class _PoptorchOptimizer:
    """Mixin: records PopTorch's extra arguments on every parameter group."""

    def _poptorch_defaults(self, loss_scaling, accum_type, **extra):
        if loss_scaling is not None and not loss_scaling > 0:
            raise ValueError(f"loss_scaling must be > 0, got {loss_scaling}")
        self.defaults.setdefault("loss_scaling", 1.0 if loss_scaling is None else float(loss_scaling))
        self.defaults.setdefault("accum_type", accum_type)
        for k, v in extra.items():
            self.defaults.setdefault(k, v)
        for group in self.param_groups:
            for k in ("loss_scaling", "accum_type", *extra):
                group.setdefault(k, self.defaults[k])


class SGD(_PoptorchOptimizer, torch.optim.SGD):
    def __init__(self, params, lr=0.01, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 maximize=False, foreach=None, differentiable=False, loss_scaling=None, velocity_scaling=None,
                 use_combined_accum=None, accum_type=None, velocity_accum_type=None, max_grad_norm=None):
        if maximize:
            raise ValueError("SGD(maximize=True) is not supported on the IPU")
        torch.optim.SGD.__init__(self, params, lr=lr, momentum=momentum, dampening=dampening,
                                 weight_decay=weight_decay, nesterov=nesterov)
        self._poptorch_defaults(loss_scaling, accum_type, velocity_scaling=velocity_scaling,
                                velocity_accum_type=velocity_accum_type, max_grad_norm=max_grad_norm)


class Adam(_PoptorchOptimizer, torch.optim.Adam):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 loss_scaling=None, accum_type=None, first_order_momentum_accum_type=None,
                 second_order_momentum_accum_type=None, max_grad_norm=None):
        if amsgrad or maximize:
            raise ValueError("Adam(amsgrad=True or maximize=True) is not supported on the IPU")
        torch.optim.Adam.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._poptorch_defaults(loss_scaling, accum_type,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type,
                                max_grad_norm=max_grad_norm)


class AdamW(_PoptorchOptimizer, torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 loss_scaling=None, bias_correction=True, accum_type=None, first_order_momentum_accum_type=None,
                 second_order_momentum_accum_type=None, max_grad_norm=None):
        if amsgrad or maximize:
            raise ValueError("AdamW(amsgrad=True or maximize=True) is not supported on the IPU")
        if not bias_correction:
            raise ValueError("AdamW(bias_correction=False) is not supported; use LAMB(bias_correction=False)")
        torch.optim.AdamW.__init__(self, params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._poptorch_defaults(loss_scaling, accum_type, bias_correction=bias_correction,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type,
                                max_grad_norm=max_grad_norm)


class RMSprop(_PoptorchOptimizer, torch.optim.RMSprop):
    def __init__(self, params, lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
                 foreach=None, maximize=False, differentiable=False, capturable=False, loss_scaling=None,
                 accum_type=None, first_order_momentum_accum_type=None, second_order_momentum_accum_type=None):
        if maximize:
            raise ValueError("RMSprop(maximize=True) is not supported on the IPU")
        torch.optim.RMSprop.__init__(self, params, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                                     momentum=momentum, centered=centered)
        self._poptorch_defaults(loss_scaling, accum_type,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type)


class LAMB(_PoptorchOptimizer, torch.optim.Optimizer):
    """Layer-wise adaptive moments (You et al. 2019) with PopTorch's options."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, bias_correction=True,
                 loss_scaling=None, max_weight_norm=None, accum_type=None, first_order_momentum_accum_type=None,
                 second_order_momentum_accum_type=None):
        dev.LAMB(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_weight_norm=max_weight_norm)  # validates
        torch.optim.Optimizer.__init__(self, params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                                          bias_correction=bias_correction,
                                                          max_weight_norm=max_weight_norm))
        self._poptorch_defaults(loss_scaling, accum_type,
                                first_order_momentum_accum_type=first_order_momentum_accum_type,
                                second_order_momentum_accum_type=second_order_momentum_accum_type)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                d = p.grad / group["loss_scaling"]
                st["exp_avg"].mul_(b1).add_(d, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(d, d, value=1 - b2)
                m, v = st["exp_avg"], st["exp_avg_sq"]
                if group["bias_correction"]:
                    m = m / (1 - b1 ** st["step"])
                    v = v / (1 - b2 ** st["step"])
                u = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                r1 = p.norm()
                if group["max_weight_norm"] is not None:
                    r1 = r1.clamp(max=group["max_weight_norm"])
                r2 = u.norm()
                ratio = r1 / r2 if r1 > 0 and r2 > 0 else torch.tensor(1.0)
                p.sub_(group["lr"] * ratio * u)
        return loss


def device_config(optimizer: torch.optim.Optimizer, group: dict, divisor: float) -> dev.Optimiser:
    """The ipusim optimiser configuration of one parameter group; `divisor` folds the gradient
    reduction (e.g. 1/G for Mean) into the loss-scaling divisor."""
    ls = float(group.get("loss_scaling", 1.0)) * divisor
    state_dtype = _state_dtype(group.get("accum_type"))
    if group.get("max_grad_norm") not in (None, math.inf):
        raise ValueError("max_grad_norm (gradient clipping) is not supported by the emulated optimisers")
    if isinstance(optimizer, torch.optim.AdamW):
        return dev.AdamW(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                         weight_decay=group["weight_decay"], loss_scaling=ls, state_dtype=state_dtype)
    if isinstance(optimizer, torch.optim.Adam):
        if group.get("amsgrad"):
            raise ValueError("Adam(amsgrad=True) is not supported on the IPU")
        return dev.Adam(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                        weight_decay=group["weight_decay"], loss_scaling=ls, state_dtype=state_dtype)
    if isinstance(optimizer, torch.optim.SGD):
        return dev.SGD(lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                       weight_decay=group["weight_decay"], nesterov=group["nesterov"], loss_scaling=ls,
                       state_dtype=state_dtype)
    if isinstance(optimizer, torch.optim.RMSprop):
        return dev.RMSprop(lr=group["lr"], alpha=group["alpha"], eps=group["eps"],
                           weight_decay=group["weight_decay"], momentum=group["momentum"],
                           centered=group["centered"], loss_scaling=ls, state_dtype=state_dtype)
    if isinstance(optimizer, LAMB):
        return dev.LAMB(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                        weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
                        max_weight_norm=group["max_weight_norm"], loss_scaling=ls, state_dtype=state_dtype)
    raise TypeError(f"optimizer {type(optimizer).__name__} is not supported: use SGD, Adam, AdamW, RMSprop "
                    "(torch.optim or poptorch.optim) or poptorch.optim.LAMB")


def reduction_divisor(options, replicas: int = 1) -> float:
    """What the accumulated gradient sum is divided by before the update: with Mean, the number
    of micro-batches each replica accumulates times every replica of every process."""
    mean = options.Training.accumulation_and_replication_reduction_type == ReductionType.Mean
    return float(options.gradient_accumulation * replicas * options.num_processes) if mean else 1.0


class UpdatePlan:
    """The weight-update programs of a training model and the device optimisers behind them."""

    def __init__(self):
        self.programs: dict[int, list[int]] = {}         # replica-0 IPU -> engine program indices, in order
        self.configs: list[tuple[int, dev.Optimiser]] = []  # (param group index, configuration)
        # weight name -> [(config, updated weight)] for replica 0, or for every replica's shard when sharded
        self.states: dict[str, list[tuple[dev.Optimiser, ip.Tensor]]] = {}
        self.state_buffers: dict[int, ip.RemoteBuffer] = {}  # state tensor variable id -> its Streaming Memory


def _param_groups(optimizer, named_params: dict) -> dict[str, int]:
    name_of = {id(p): n for n, p in named_params.items()}
    group_of = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError("the optimizer holds a parameter that is not part of the model")
            group_of[name_of[id(p)]] = gi
    return group_of


def build_updates(lowerings: list, optimizer: torch.optim.Optimizer, options, named_params: dict) -> UpdatePlan:
    """Per IPU of replica 0, the programs run at each weight update: the all-reduce of the
    gradient accumulators across replicas (ring over IPU-Links), each replica's in-place
    optimiser update with its accumulator cleared, and with replicated tensor sharding the
    all-gather of the updated shards. Off-chip optimiser state, accumulators and weights are
    streamed from Streaming Memory around their use."""
    plan = UpdatePlan()
    replicas = len(lowerings)
    group_of = _param_groups(optimizer, named_params)
    divisor = reduction_divisor(options, replicas)
    configs = {gi: device_config(optimizer, g, divisor) for gi, g in enumerate(optimizer.param_groups)}
    plan.configs = list(configs.items())
    location = options.tensor_locations.get("optimizer")
    offload_state = location is not None and location.on_chip is False
    min_offload = (location.min_elements_for_off_chip or 0) if location is not None else 0
    shard = replicas > 1 and location is not None and bool(location.use_replicated_tensor_sharding)
    min_shard = (location.min_elements_for_replicated_tensor_sharding or 0) if location is not None else 0
    first = lowerings[0]
    device = first.device
    names = [n for n in first.accumulators if n in group_of]
    by_ipu: dict[int, list[str]] = {}
    for name in names:
        by_ipu.setdefault(first.weights[name].ipu, []).append(name)
    for ipu0, weight_names in sorted(by_ipu.items()):
        indices = []
        if replicas > 1:
            indices.append(first.add_program(_all_reduce(device, lowerings, weight_names, ipu0)))
        gathers = ip.Sequence(name=f"all-gather shards ipu{ipu0}")
        for r, low in enumerate(lowerings):
            seq = ip.Sequence(name=f"weight update replica {r} ipu{ipu0 + r * (len(device.graphs) // replicas)}")
            for name in weight_names:
                cfg = configs[group_of[name]]
                w, acc = low.weights[name], low.accumulators[name]
                g = low.graph(w.ipu)
                sharded = shard and w.numel >= max(min_shard, replicas)
                bounds = _shards(w.numel, replicas) if sharded else None
                w_upd = w.flatten()[bounds[r][0]:bounds[r][1]] if sharded else w
                acc_upd = acc.flatten()[bounds[r][0]:bounds[r][1]] if sharded else acc
                state = cfg.state(g, w_upd)
                offloaded = [t for t in (*state.tensors.values(), state.step)
                             if t is not None and offload_state and t.numel >= min_offload]
                loads, stores = _streamed(low, g, w, acc, offloaded, plan)
                for p in loads:
                    seq.add(p)
                dev.weight_update(g, w_upd, acc_upd, cfg, seq, f"{low.prefix}update/{name}")
                ew.unary(g, "fill", acc, seq, f"{acc.name}/clear", out=acc, scale=0.0)
                for p in stores:
                    seq.add(p)
                if r == 0 or sharded:
                    plan.states.setdefault(name, []).append((cfg, w_upd))
                if sharded:
                    lo, hi = bounds[r]
                    for q, other in enumerate(lowerings):
                        if q != r:
                            gathers.add(ip.InterIpuCopy(w.flatten()[lo:hi], other.weights[name].flatten()[lo:hi]))
            indices.append(first.add_program(seq))
        if gathers.programs:
            indices.append(first.add_program(gathers))
        plan.programs[ipu0] = indices
    return plan


def _shards(n: int, replicas: int) -> list[tuple[int, int]]:
    per = -(-n // replicas)
    return [(min(r * per, n), min((r + 1) * per, n)) for r in range(replicas)]


def _streamed(low, g, w, acc, state_tensors, plan: UpdatePlan) -> tuple[list, list]:
    """RemoteCopy loads before and stores after an update, for whatever lives off chip."""
    loads, stores = [], []
    for t in state_tensors:
        buf = plan.state_buffers.get(t.var.id)
        if buf is None:
            buf = plan.state_buffers[t.var.id] = low.remote(g, ip.Tensor(t.var))
        loads.append(ip.RemoteCopy(buf, ip.Tensor(t.var)))
        stores.append(ip.RemoteCopy(ip.Tensor(t.var), buf))
    name = next((n for n, x in low.weights.items() if x is w), None)
    for table, t in ((low.accumulator_buffers, acc), (low.weight_buffers, w)):
        if name in table:
            loads.append(ip.RemoteCopy(table[name], t))
            stores.append(ip.RemoteCopy(t, table[name]))
    return loads, stores


def _all_reduce(device, lowerings, names: list[str], ipu0: int) -> ip.Sequence:
    """Sum each weight's accumulators over the replicas, in place (ring all-reduce)."""
    seq = ip.Sequence(name=f"gradient all-reduce ipu{ipu0}")
    for name in names:
        accs = [low.accumulators[name] for low in lowerings]
        buffers = [low.accumulator_buffers.get(name) for low in lowerings]
        for acc, buf in zip(accs, buffers):
            if buf is not None:
                seq.add(ip.RemoteCopy(buf, acc))
        collectives.all_reduce(device, accs, seq, "sum", f"all_reduce/{name}", in_place=True)
        for acc, buf in zip(accs, buffers):
            if buf is not None:
                seq.add(ip.RemoteCopy(acc, buf))
    return seq


def write_hyperparameters(engine: ip.Engine, plan: UpdatePlan, optimizer: torch.optim.Optimizer, options,
                          replicas: int = 1) -> None:
    """Apply a new optimizer's hyperparameters to the device (no recompilation)."""
    divisor = reduction_divisor(options, replicas)
    if len(optimizer.param_groups) != len(plan.configs):
        raise ValueError(f"the new optimizer has {len(optimizer.param_groups)} parameter groups, the compiled model "
                         f"{len(plan.configs)}: create a new training model to change the groups")
    for gi, cfg in plan.configs:
        new = device_config(optimizer, optimizer.param_groups[gi], divisor)
        if type(new) is not type(cfg):
            raise ValueError(f"the model was compiled with {type(cfg).__name__}; changing to {type(new).__name__} "
                             "needs a new training model")
        changes = {k: getattr(new, k) for k in new.hyper_values() if k in vars(new) and getattr(new, k) != getattr(cfg, k)}
        changes.update({k: getattr(new, k) for k in ("betas",) if hasattr(new, k) and getattr(new, k) != getattr(cfg, k)})
        if changes:
            cfg.set(engine, **changes)


def read_state(engine: ip.Engine, plan: UpdatePlan, optimizer: torch.optim.Optimizer, named_params: dict) -> None:
    """Copy the device optimiser state into `optimizer.state` (torch's layout); sharded state is
    gathered from the replicas' shards."""
    def value(t):
        buf = plan.state_buffers.get(t.var.id)
        return engine.readRemoteBuffer(buf) if buf is not None else engine.readTensor(t)

    for name, parts in plan.states.items():
        p = named_params[name]
        pieces: dict[str, list] = {}
        step = None
        for cfg, w in parts:
            try:
                ws = cfg.state_of(w)
            except KeyError:
                break
            for k, t in ws.tensors.items():
                pieces.setdefault(k, []).append(np.asarray(value(t)).reshape(-1))
            if ws.step is not None:
                step = int(np.asarray(value(ws.step)).reshape(-1)[0])
        else:
            out = {k: torch.from_numpy(np.concatenate(v).reshape(p.shape)).to(p.dtype) for k, v in pieces.items()}
            if step is not None:
                out["step"] = torch.tensor(float(step))
            optimizer.state[p] = out
