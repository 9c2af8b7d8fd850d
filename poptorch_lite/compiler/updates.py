"""The weight-update programs of a training model: PopTorch optimisers lowered to the device.

At compile time every parameter group becomes an `ipusim.ops.optim` configuration and each weight
gets an in-place update in the weight-update program of its IPU. Learning rates and other
hyperparameters live in device tensors: `setOptimizer` rewrites them without recompiling.

Gradient reduction: accumulators hold the sum of the micro-batch gradients; with
`ReductionType.Mean` the update divides by the number of micro-batches (and replicas) through the
optimiser's loss-scaling divisor, so no extra pass over the gradients is needed.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

import ipusim as ip
from ipusim.ops import collectives
from ipusim.ops import elementwise as ew
from ipusim.ops import optim as dev
from ipusim.ops import reduce as red

from ..api.enums import MeanReductionStrategy, ReductionType
from ..api.optim import LAMB, accumulator_dtype, loss_scaling, state_dtypes, state_slot, state_tensor_name


def device_config(optimizer: torch.optim.Optimizer, group: dict, divisor: float) -> dev.Optimiser:
    """The ipusim optimiser configuration of one parameter group; `divisor` folds the gradient
    reduction (e.g. 1/G for Mean) into the loss-scaling divisor."""
    config = _device_optimiser(optimizer, group, loss_scaling(optimizer) * divisor)
    slots = [s for s in config.layout().slots if s is not None]
    return dataclasses.replace(config, state_dtype=state_dtypes(group, slots))


def _device_optimiser(optimizer: torch.optim.Optimizer, group: dict, ls: float) -> dev.Optimiser:
    if isinstance(optimizer, torch.optim.AdamW):
        return dev.AdamW(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                         weight_decay=group["weight_decay"], loss_scaling=ls,
                         bias_correction=bool(group.get("bias_correction", True)))
    if isinstance(optimizer, torch.optim.Adam):
        if group.get("amsgrad"):
            raise ValueError("Adam(amsgrad=True) is not supported on the IPU")
        return dev.Adam(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                        weight_decay=group["weight_decay"], loss_scaling=ls)
    # a momentum marked variable (PopTorch's VariableAttributes) keeps its state at zero too
    attrs = getattr(optimizer, "variable_attrs", None)
    momentum_state = attrs is not None and not attrs.isConstant("momentum") if "momentum" in group else False
    if isinstance(optimizer, torch.optim.SGD):
        return dev.SGD(lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                       weight_decay=group["weight_decay"], nesterov=group["nesterov"], loss_scaling=ls,
                       momentum_state=momentum_state)
    if isinstance(optimizer, torch.optim.RMSprop):
        return dev.RMSprop(lr=group["lr"], alpha=group["alpha"], eps=group["eps"],
                           weight_decay=group["weight_decay"], momentum=group["momentum"],
                           centered=group["centered"], loss_scaling=ls, momentum_state=momentum_state,
                           tf_variant=bool(group.get("use_tf_variant", False)))
    if isinstance(optimizer, LAMB):
        return dev.LAMB(lr=group["lr"], betas=tuple(group["betas"]), eps=group["eps"],
                        weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
                        max_weight_norm=group["max_weight_norm"], loss_scaling=ls)
    raise TypeError(f"optimizer {type(optimizer).__name__} is not supported: use SGD, Adam, AdamW, RMSprop "
                    "(torch.optim or poptorch.optim) or poptorch.optim.LAMB")


def running_mean(options) -> bool:
    """Whether accumulators keep the running mean of their gradients (MeanReductionStrategy.Running
    with a Mean reduction) instead of their sum."""
    return options.Training.accumulation_and_replication_reduction_type == ReductionType.Mean and \
        options.Training.mean_accumulation_and_replication_reduction_strategy == MeanReductionStrategy.Running


def reduction_divisor(options, replicas: int = 1) -> float:
    """What the accumulated gradients are divided by before the update: with Mean, every replica
    of every process, and the micro-batches each replica accumulates unless its accumulators
    already hold their running mean."""
    if options.Training.accumulation_and_replication_reduction_type != ReductionType.Mean:
        return 1.0
    accumulated = 1 if running_mean(options) else options.gradient_accumulation
    return float(accumulated * replicas * options.num_processes)


class UpdatePlan:
    """The weight-update programs of a training model and the device optimisers behind them."""

    def __init__(self):
        self.programs: dict[int, list[int]] = {}         # replica-0 IPU -> engine program indices, in order
        self.configs: list[tuple[int, dev.Optimiser]] = []  # (param group index, configuration)
        # weight name -> [(config, updated weight)] for replica 0, or every replica's shard in element order
        self.states: dict[str, list[tuple[dev.Optimiser, ip.Tensor]]] = {}
        # the optimiser state of an unsharded weight in replicas 1.. (equal to replica 0's in `states`)
        self.copies: dict[str, list[tuple[dev.Optimiser, ip.Tensor]]] = {}
        self.state_buffers: dict[int, ip.RemoteBuffer] = {}  # state tensor variable id -> its Streaming Memory
        self.sharded: set[str] = set()      # weights whose optimiser state is sharded over the replicas
        self.loss_scaling = None            # the device's loss scale (compiler/loss_scaling.py), or None
        self.grouped: dict[str, list[int]] = {}   # per-replica variable -> the replica of each host slice
        self.max_grad_norm: float | None = None   # gradient clipping's bound, compiled in (None: no clipping)

    @property
    def automatic_loss_scaling(self) -> bool:
        return self.loss_scaling is not None and self.loss_scaling.automatic


def _param_groups(optimizer, named_params: dict) -> dict[str, int]:
    name_of = {id(p): n for n, p in named_params.items()}
    group_of = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError("the optimizer holds a parameter that is not part of the model")
            group_of[name_of[id(p)]] = gi
    return group_of


def accumulator_dtypes(optimizer: torch.optim.Optimizer, named_params: dict) -> dict[str, str]:
    """The dtype each parameter's gradients accumulate in: the optimiser's `accum_type`."""
    return {name: accumulator_dtype(optimizer) for name in _param_groups(optimizer, named_params)}


def build_updates(lowerings: list, optimizer: torch.optim.Optimizer, options, named_params: dict,
                  variable_groups: dict | None = None) -> UpdatePlan:
    """Per IPU of replica 0, the programs run at each weight update: the reduction of the gradient
    accumulators across replicas (ring over IPU-Links), each replica's in-place optimiser update
    with its accumulator cleared, and the gather of sharded weights. Off-chip optimiser state,
    accumulators and weights are streamed from Streaming Memory around their use.

    Replicated tensor sharding (`useReplicatedTensorSharding` on the optimiser's location, for
    weights of at least `minElementsForReplicatedTensorSharding` elements and one per replica):
    the accumulators are reduce-scattered instead of all-reduced, replica r updates only its
    shard (`collectives.shard_bounds`) and holds the optimiser state of that shard alone (1/R of
    the state bytes), and the updated shards are all-gathered into every replica's weight. The two
    halves of the ring cost what one all-reduce costs; the values equal the unsharded update's.

    A per-replica variable (`variable_groups`, `model.weight.replicaGrouping`) has its gradients
    summed within each replica group only (a ring all-reduce over the group's replicas); it is
    not sharded.

    A lowering standing for all its replicas (`Device(replicas=R)`, estimate mode) prices replica
    0's part of each ring (`collectives.*_priced`) instead of running it."""
    plan = UpdatePlan()
    first = lowerings[0]
    priced = first.device.replicas > 1   # one replica standing for all (estimate mode): collectives priced
    replicas = len(lowerings) * first.device.replicas
    variable_groups = variable_groups or {}
    plan.grouped = {n: g.readers(replicas) for n, g in variable_groups.items()}
    group_of = _param_groups(optimizer, named_params)
    divisor = reduction_divisor(options, replicas)
    configs = {gi: device_config(optimizer, g, divisor) for gi, g in enumerate(optimizer.param_groups)}
    plan.configs = list(configs.items())
    location = options.tensor_locations.get("optimizer")
    offload_state = location is not None and location.on_chip is False
    min_offload = (location.min_elements_for_off_chip or 0) if location is not None else 0
    shard = replicas > 1 and location is not None and bool(location.use_replicated_tensor_sharding)
    min_shard = (location.min_elements_for_replicated_tensor_sharding or 0) if location is not None else 0
    device = first.device
    names = [n for n in first.accumulators if n in group_of]
    by_ipu: dict[int, list[str]] = {}
    for name in names:
        by_ipu.setdefault(first.weights[name].ipu, []).append(name)
    max_norm = plan.max_grad_norm = max_grad_norm(optimizer)
    if max_norm is not None and len(by_ipu) > 1:
        raise ValueError(f"max_grad_norm: gradient clipping takes the norm of the gradients of every weight, which "
                         f"this model keeps on {len(by_ipu)} IPUs; the emulator clips the gradients of a model on "
                         "one IPU (per replica) only: drop max_grad_norm or place the model on one IPU")
    for ipu0, weight_names in sorted(by_ipu.items()):
        sharded = {n for n in weight_names if shard and first.weights[n].numel >= max(min_shard, replicas)
                   and n not in variable_groups}
        if max_norm is not None and (sharded or any(n in low.accumulator_buffers for low in lowerings
                                                    for n in weight_names)):
            raise ValueError("max_grad_norm: gradient clipping needs every gradient accumulator whole and on chip; "
                             "turn off replicated tensor sharding and off-chip accumulators, or drop max_grad_norm")
        plan.sharded |= sharded
        indices = []
        if replicas > 1:
            groups = {n: g.reduction_groups(replicas) for n, g in variable_groups.items()}
            indices.append(first.add_program(
                _reduce_priced(first, weight_names, sharded, ipu0, groups, replicas) if priced
                else _reduce(device, lowerings, weight_names, sharded, ipu0, groups)))
        for r, low in enumerate(lowerings):
            seq = ip.Sequence(name=f"weight update replica {r} ipu{ipu0 + r * (len(device.graphs) // len(lowerings))}")
            for name in weight_names:
                cfg = configs[group_of[name]]
                w, acc = low.weights[name], low.accumulators[name]
                g = low.graph(w.ipu)
                lo, hi = collectives.shard_bounds(w.numel, replicas)[r] if name in sharded else (0, w.numel)
                w_upd = w.flatten()[lo:hi] if name in sharded else w
                acc_upd = acc.flatten()[lo:hi] if name in sharded else acc
                state = cfg.state(g, w_upd)
                offloaded = [t for t in (*state.tensors.values(), state.step)
                             if t is not None and offload_state and t.numel >= min_offload]
                if any(t.var.constant is not None for t in offloaded):
                    raise ValueError(f"{type(cfg).__name__}: optimiser state that does not start at zero (RMSprop's "
                                     "use_tf_variant) cannot live in Streaming Memory yet: keep the optimiser state "
                                     "on chip (TensorLocationSettings.useOnChipStorage(True))")
                loads, stores = _streamed(low, g, w, acc, offloaded, plan)
                for p in loads:
                    seq.add(p)
                dev.weight_update(g, w_upd, acc_upd, cfg, seq, f"{low.prefix}update/{name}")
                ew.unary(g, "fill", acc, seq, f"{acc.name}/clear", out=acc, scale=0.0)
                for p in stores:
                    seq.add(p)
                if r == 0 or name in sharded or name in variable_groups:
                    plan.states.setdefault(name, []).append((cfg, w_upd))
                else:   # another replica's copy of replica 0's state
                    plan.copies.setdefault(name, []).append((cfg, w_upd))
            if max_norm is not None:
                indices.append(first.add_program(_clip(low, weight_names, [configs[group_of[n]] for n in weight_names],
                                                       max_norm, f"gradient clipping replica {r}")))
            ipus = {low.weights[name].ipu for name in weight_names}
            for count in low.counters:  # Running: the next group's mean starts again
                if count.ipu in ipus:
                    ew.unary(low.graph(count.ipu), "fill", count, seq, f"{count.name}/clear", out=count, scale=0.0)
            indices.append(first.add_program(seq))
        if sharded:
            names_sharded = [n for n in weight_names if n in sharded]
            indices.append(first.add_program(_gather_priced(first, names_sharded, ipu0, replicas) if priced
                                             else _gather(device, lowerings, names_sharded, ipu0)))
        plan.programs[ipu0] = indices
    for name in plan.sharded if not priced else ():   # shards in element order (replica r holds chunk r + 1)
        order = np.argsort([b for b, _ in collectives.shard_bounds(first.weights[name].numel, replicas)], kind="stable")
        plan.states[name] = [plan.states[name][i] for i in order]
    return plan


def max_grad_norm(optimizer) -> float | None:
    """PopTorch's `max_grad_norm`, one value for the whole optimiser (None or inf: no clipping)."""
    value = optimizer.defaults.get("max_grad_norm")
    if value is None or value == math.inf:
        return None
    if not value > 0:
        raise ValueError(f"max_grad_norm must be > 0 (or None: no clipping), got {value}")
    return float(value)


def _clip(low, names: list[str], configs: list, max_norm: float, name: str) -> ip.Sequence:
    """Gradient clipping by the global norm, as PopART's: the accumulators of one replica's
    weights (on one IPU) scaled by max_norm / max(norm, max_norm), the norm taken over every
    gradient (the accumulators over the optimiser's loss-scaling column, which holds the loss
    scaling times the reduction's divisor). Runs after the gradient reduction, before the updates."""
    seq = ip.Sequence(name=name)
    accs = [low.accumulators[n] for n in names]
    g = low.graph(accs[0].ipu)
    total = None
    for acc in accs:
        squares = red.reduce(g, acc, None, "sum_squares", seq, f"{acc.name}/sum_squares", out_dtype=np.float32,
                             category="temporaries").reshape((1,))
        total = squares if total is None else ew.add(g, total, squares, seq, f"{name}/sum")
    h = configs[0].hyper_on(g)
    scale = red.reduce(g, h.tensor[:, h.names.index("loss_scaling")], None, "max", seq, f"{name}/loss_scaling",
                       category="temporaries").reshape((1,))
    threshold = ew.scale(g, scale, max_norm, seq, f"{name}/threshold")
    norm = ew.unary(g, "sqrt", total, seq, f"{name}/norm")
    factor = ew.div(g, threshold, ew.binary(g, "max", norm, threshold, seq, f"{name}/bound"), seq, f"{name}/factor")
    for acc in accs:
        f = factor if acc.dtype == factor.dtype else ew.cast(g, factor, acc.dtype, seq, f"{name}/factor_{acc.dtype}")
        ew.binary(g, "mul", acc, f.broadcast((acc.numel,)).reshape(acc.shape), seq, f"{acc.name}/clip", out=acc)
    return seq


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


def _around(seq: ip.Sequence, tensors: list, buffers: list, body) -> None:
    """Run `body(seq)` with the tensors whose Streaming Memory buffer is given loaded first and
    stored after."""
    for t, buf in zip(tensors, buffers):
        if buf is not None:
            seq.add(ip.RemoteCopy(buf, t))
    body(seq)
    for t, buf in zip(tensors, buffers):
        if buf is not None:
            seq.add(ip.RemoteCopy(t, buf))


def _reduce(device, lowerings, names: list[str], sharded: set, ipu0: int, groups: dict) -> ip.Sequence:
    """Sum each weight's accumulators over the replicas in place: a ring all-reduce, or for a
    sharded weight a ring reduce-scatter (each replica then holds the sum of its shard), or for a
    per-replica variable an all-reduce within each of its replica groups (`groups`)."""
    seq = ip.Sequence(name=f"gradient reduction ipu{ipu0}")
    for name in names:
        accs = [low.accumulators[name] for low in lowerings]
        buffers = [low.accumulator_buffers.get(name) for low in lowerings]
        if name in groups:
            for members in groups[name]:
                if len(members) > 1:
                    sub = [accs[r] for r in members]
                    _around(seq, sub, [buffers[r] for r in members],
                            lambda s: collectives.all_reduce(device, sub, s, "sum", f"all_reduce/{name}", in_place=True))
        elif name in sharded:
            _around(seq, accs, buffers,
                    lambda s: collectives.reduce_scatter(device, accs, s, "sum", f"reduce_scatter/{name}"))
        else:
            _around(seq, accs, buffers,
                    lambda s: collectives.all_reduce(device, accs, s, "sum", f"all_reduce/{name}", in_place=True))
    return seq


def gw_link(device, replicas: int) -> bool:
    """Whether a ring over the replicas leaves the IPU-Link domain (its slowest hops on GW-Links)."""
    return device.num_ipus * replicas > device.target.ipus_per_link_domain


def _reduce_priced(low, names: list[str], sharded: set, ipu0: int, groups: dict, replicas: int) -> ip.Sequence:
    """`_reduce` for a lowering standing for all replicas (estimate mode): replica 0's part of each
    ring (`collectives.all_reduce_priced`, `reduce_scatter_priced`; a per-replica variable's ring
    over the replicas of replica 0's group)."""
    seq = ip.Sequence(name=f"gradient reduction ipu{ipu0}")
    for name in names:
        acc, buf = low.accumulators[name], low.accumulator_buffers.get(name)
        g = low.graph(acc.ipu)
        if name in groups:
            size = len(next(m for m in groups[name] if 0 in m))
            if size > 1:
                _around(seq, [acc], [buf], lambda s: collectives.all_reduce_priced(
                    g, acc, size, s, "sum", f"all_reduce/{name}", gw_link=gw_link(low.device, size)))
        elif name in sharded:
            _around(seq, [acc], [buf], lambda s: collectives.reduce_scatter_priced(
                g, acc, replicas, s, "sum", f"reduce_scatter/{name}", gw_link=gw_link(low.device, replicas)))
        else:
            _around(seq, [acc], [buf], lambda s: collectives.all_reduce_priced(
                g, acc, replicas, s, "sum", f"all_reduce/{name}", gw_link=gw_link(low.device, replicas)))
    return seq


def _gather_priced(low, names: list[str], ipu0: int, replicas: int) -> ip.Sequence:
    """`_gather` for a lowering standing for all replicas: replica 0's part of each ring."""
    seq = ip.Sequence(name=f"all-gather shards ipu{ipu0}")
    for name in names:
        w = low.weights[name]
        _around(seq, [w], [low.weight_buffers.get(name)], lambda s: collectives.all_gather_shards_priced(
            w, replicas, s, f"all_gather_shards/{name}", gw_link=gw_link(low.device, replicas)))
    return seq


def _gather(device, lowerings, names: list[str], ipu0: int) -> ip.Sequence:
    """Every replica's updated shard of each sharded weight into every replica's weight (ring)."""
    seq = ip.Sequence(name=f"all-gather shards ipu{ipu0}")
    for name in names:
        weights = [low.weights[name] for low in lowerings]
        buffers = [low.weight_buffers.get(name) for low in lowerings]
        _around(seq, weights, buffers,
                lambda s: collectives.all_gather_shards(device, weights, s, f"all_gather_shards/{name}"))
    return seq


def write_hyperparameters(engine: ip.Engine, plan: UpdatePlan, optimizer: torch.optim.Optimizer, options,
                          replicas: int = 1) -> None:
    """Apply a new optimizer's hyperparameters to the device (no recompilation)."""
    divisor = reduction_divisor(options, replicas)
    if max_grad_norm(optimizer) != plan.max_grad_norm:
        raise ValueError(f"the model was compiled with max_grad_norm={plan.max_grad_norm}; the new optimizer has "
                         f"{max_grad_norm(optimizer)}: gradient clipping is part of the compiled program, create a "
                         "new training model to change it")
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


def _device_state(engine: ip.Engine, plan: UpdatePlan, named_params: dict):
    """Each trained weight's optimiser state on the device: (name, {slot: host array shaped like
    the weight}, step or None); sharded state is gathered from the replicas' shards."""
    def value(t):
        buf = plan.state_buffers.get(t.var.id)
        return engine.readRemoteBuffer(buf) if buf is not None else engine.readTensor(t)

    for name, parts in plan.states.items():
        p = named_params[name]
        if name in plan.grouped:   # a per-replica variable: each host slice from its replica
            parts = [parts[r] for r in plan.grouped[name]]
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
            yield name, {k: np.concatenate(v).reshape(p.shape) for k, v in pieces.items()}, step


def read_state(engine: ip.Engine, plan: UpdatePlan, optimizer: torch.optim.Optimizer, named_params: dict,
               updates_applied: int) -> None:
    """Copy the device optimiser state into `optimizer.state` (torch's layout); sharded state is
    gathered from the replicas' shards. torch's `step` is the device's count where it keeps one,
    else `updates_applied` (the weight updates the model ran: torch keeps a step for each of its
    optimisers with state but SGD)."""
    for name, arrays, step in _device_state(engine, plan, named_params):
        p = named_params[name]
        out = {k: torch.from_numpy(v).to(p.dtype) for k, v in arrays.items()}
        if step is not None or (out and not isinstance(optimizer, torch.optim.SGD)):
            out["step"] = torch.tensor(float(updates_applied if step is None else step))
        optimizer.state[p] = out


def read_ipu_state(engine: ip.Engine, plan: UpdatePlan, optimizer: torch.optim.Optimizer,
                   named_params: dict) -> dict:
    """The device optimiser state as PopTorch's `ipu_state` holds it: PopART's tensor names
    (`Accl1___<weight>`, `Step___<weight>`, ...), each tensor in the dtype the device keeps it."""
    out = {}
    for name, arrays, step in _device_state(engine, plan, named_params):
        for slot, v in arrays.items():
            out[state_tensor_name(optimizer, slot, name)] = torch.from_numpy(v)
        if step is not None:
            out[state_tensor_name(optimizer, "step", name)] = torch.tensor(float(step))
    return out


def write_ipu_state(engine: ip.Engine, plan: UpdatePlan, optimizer: torch.optim.Optimizer, state: dict,
                    named_params: dict) -> list[str]:
    """Write the state tensors of an `ipu_state` dict to the device (shards to their replicas);
    what the dict leaves out keeps its device value. The names it holds that are no state of
    this model are returned."""
    wanted: dict[str, dict] = {}
    unknown = []
    for key, value in state.items():
        found = state_slot(optimizer, key)
        if found is None or found[1] not in plan.states:
            unknown.append(key)
            continue
        wanted.setdefault(found[1], {})[found[0]] = value
    for name, slots in wanted.items():
        if name in plan.grouped:
            raise ValueError(f"the optimiser state of {name!r}, a per-replica variable, cannot be written from "
                             "a state dict: each replica group keeps its own")
        shape = tuple(named_params[name].shape)
        host = {}
        for slot, value in slots.items():
            value = torch.as_tensor(value).detach().cpu()
            if slot == "step":
                host[slot] = float(value.reshape(-1)[0])
            elif tuple(value.shape) != shape:
                raise ValueError(f"optimiser state {state_tensor_name(optimizer, slot, name)} has shape "
                                 f"{tuple(value.shape)}; the weight's is {shape}")
            else:
                host[slot] = value.to(torch.float32).numpy().reshape(-1)
        offset = 0
        for cfg, w in plan.states[name]:   # replica 0's, or each replica's shard
            _write_state(engine, plan, cfg.state_of(w), host, offset)
            offset += w.numel
        for cfg, w in plan.copies.get(name, []):   # the other replicas hold the same state
            _write_state(engine, plan, cfg.state_of(w), host, 0)
    return unknown


def _write_state(engine: ip.Engine, plan: UpdatePlan, ws, host: dict, offset: int) -> None:
    """Write host state (slot -> flat array, or the step count) into one weight state's tensors,
    from element `offset` of the weight (a shard's first)."""
    for slot, t in (*ws.tensors.items(), ("step", ws.step)):
        if t is None or slot not in host:
            continue
        if slot == "step":
            values = np.full(t.shape, host[slot], dtype=np.float32)
        else:
            values = host[slot][offset:offset + t.numel].reshape(t.shape)
        buf = plan.state_buffers.get(t.var.id)
        if buf is not None:
            engine.writeRemoteBuffer(buf, values)
        else:
            engine.writeTensor(t, values)
