"""Lower the IR to ipusim: one program per stage and pass, channels between them, host streams.

The IR is split into *stage programs*, one per (pass, stage): ("fwd", s), ("bwd", s), for
the zero-bubble schedules ("wgrad", s), the weight-gradient half of the backward
(`backward_split`), and with recomputation ("recompute", s), the forward nodes the backward
runs again (`recompute`). Each runs on its stage's IPU for one micro-batch. A value made by one stage
program and used by another travels through a *channel*: after the producer runs for
micro-batch k, a send program copies the
values into slot k % S of the consumer's receive buffers (an `InterIpuCopy` between IPUs, an
on-chip `Copy` on the same IPU: that is the activation stash of PopART, and the stash of what a
weight-gradient program needs from its input-gradient program); before the consumer
runs for micro-batch k, a receive program copies slot k % S into its inputs. S, the number of
slots, is the most micro-batches the schedule ever keeps in flight on that channel, so the
stashed activations cost exactly what the schedule needs. A value the weight-gradient program
needs that its input-gradient program also uses comes to it from there (one transfer between
IPUs, kept on chip until W runs), other values from their producer.

A recomputed stage's recompute program runs right before its backward, in the same step: it
receives the stash of its forward (the stage's inputs, checkpoints and random seed, which its
forward receives or makes and sends on), and the backward reads its tensors directly (no
channel), as well as the values the recompute program received; what the weight-gradient
program needs of them reaches it from the backward.

Model inputs enter by host streams in the stage programs that use them; model outputs leave by
host streams in separate programs, run only for the micro-batches whose outputs are returned.
Weights live on the IPU of the stage that uses them, with their gradient accumulators; the
weight-update program of a stage applies the optimiser to them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import ipusim as ip
from ipusim.ops import conv, ctc, gather, loss, norm, pool
from ipusim.ops import cluster, ctc_decoder
from ipusim.ops import custom as custom_ops
from ipusim.ops import index as index_ops
from ipusim.ops import linalg as linalg_ops
from ipusim.ops import scan as scan_ops
from ipusim.ops import sort as sort_ops
from ipusim.ops import elementwise as ew
from ipusim.ops import matmul as mm
from ipusim.ops import random as rnd
from ipusim.ops import reduce as reduce_ops
from ipusim.ops import softmax as sm

from ipusim.device import replay

from ..api.errors import Error
from .backward_split import WEIGHT_GRADIENT
from .host_io import io_buffer, overlapped
from .multiconv import lower_member
from .ir import VIEW_OPS, IRGraph, Node, Value
from . import recompute
from .recompute import RECOMPUTE


class CompileError(Error, RuntimeError):
    pass


@dataclass
class Channel:
    src: tuple                      # producing stage program key
    dst: tuple                      # consuming stage program key
    values: list[Value]
    slots: int = 1
    send: list[int] = field(default_factory=list)   # engine program index per slot
    recv: list[int] = field(default_factory=list)   # engine program index per slot (empty when slots == 1)


@dataclass
class StageProgram:
    key: tuple                      # ("fwd" | "bwd" | "wgrad", stage)
    ipu: int
    nodes: list[Node]
    body: int = -1                  # engine program index
    outputs: int = -1               # engine program index of the output streams (or -1)
    inputs: list[tuple[str, int]] = field(default_factory=list)   # (stream name, model input index)
    output_streams: list[tuple[str, int]] = field(default_factory=list)  # (stream name, output index)
    weight_views: dict[int, list[Node]] = field(default_factory=dict)    # value id -> views of a weight taken here
    op_spans: list[tuple] = field(default_factory=list)
    """(node, first, end, first variable, end variable) per node: the programs `first:end` of the
    body sequence and the variables `first variable:end variable` of the IPU's graph its lowering
    made (what a profile's operations table reports)."""
    prefetch: list[tuple[object, int]] = field(default_factory=list)  # (OverlapMode, program): inputs to IO tiles
    drain: list[tuple[object, int]] = field(default_factory=list)     # (OverlapMode, program): outputs from IO tiles

    @property
    def name(self) -> str:
        return f"{self.key[0]}{self.key[1]}"


@dataclass
class HostCallSite:
    """A CPU op: the function the host calls (api.cpu_ops.CpuCall), the streams bringing its
    inputs to the host and those taking its results back."""
    call: object
    to_host: list[str]
    from_host: list[str]


def stage_key(n: Node) -> tuple:
    return (n.pass_, n.stage)


PASS_OF_KIND = {"F": "fwd", "B": "bwd", "W": WEIGHT_GRADIENT, "R": RECOMPUTE}
"""The stage program a schedule's op runs: forward, backward (its input-gradient half when the
backward is split), weight gradient or recompute."""

STASHES = {("fwd", "bwd"), ("fwd", WEIGHT_GRADIENT), ("bwd", WEIGHT_GRADIENT), ("fwd", RECOMPUTE),
           (RECOMPUTE, WEIGHT_GRADIENT)}
"""(producer pass, consumer pass) of the channels that keep values between the passes of one
micro-batch, on the consumer's IPU: the stash."""


def program_key(op) -> tuple:
    """(pass, stage) of the stage program a schedule op of kind F, B, W or R runs."""
    return (PASS_OF_KIND[op.kind], op.stage)


@dataclass(frozen=True)
class Locations:
    """Which tensor classes live in Streaming Memory (PopTorch's TensorLocations and the phased
    strategies' Liveness), as decided at compile time."""
    weights: bool = False
    accumulators: bool = False
    optimiser: bool = False
    activations: bool = False       # the activation stash between a stage's forward and backward
    min_elements: dict = field(default_factory=dict)   # tensor class -> smaller tensors stay on chip

    def off_chip(self, cls: str, numel: int) -> bool:
        return getattr(self, cls) and numel >= self.min_elements.get(cls, 0)


class Lowering:
    """Builds the tensors and programs of one replica of an IR graph on its IPUs of a shared
    device; programs are appended to a list shared by all replicas (one Engine runs them all)."""

    def __init__(self, ir: IRGraph, device: ip.Device, programs: list, stage_ipus: dict[int, int], schedule, *,
                 replica: int = 0, prefix: str = "", locations: Locations = Locations(), running_mean: bool = False,
                 accumulator_dtypes: dict[str, str] | None = None, loss_scaling=None, templates: dict | None = None,
                 matmul_partials: str | None = None):
        self.ir = ir
        self.matmul_partials = matmul_partials   # PopLibs' partialsType of the matmuls ("half"), None: float
        self.running_mean = running_mean    # MeanReductionStrategy.Running: accumulators hold a running mean
        self.accumulator_dtypes = accumulator_dtypes or {}   # param name -> dtype (the optimiser's accum_type)
        self.loss_scaling = loss_scaling    # the loss scale of training (compiler/loss_scaling.py), or None
        self.device = device
        self.target = device.target
        self.programs = programs
        self.stage_ipus = stage_ipus
        self.schedule = schedule
        self.replica = replica
        self.prefix = prefix
        self.locations = locations
        self.tensors: dict[tuple[int, tuple], ip.Tensor] = {}   # (value id, program key) -> tensor
        self.weights: dict[str, ip.Tensor] = {}                  # param/buffer name -> tensor
        self.weight_buffers: dict[str, ip.RemoteBuffer] = {}     # weights kept in Streaming Memory
        self.accumulators: dict[str, ip.Tensor] = {}
        self.accumulator_buffers: dict[str, ip.RemoteBuffer] = {}
        self.weight_stage: dict[str, int] = {}
        self.weight_ipu: dict[str, int] = {}
        self.stage_programs: dict[tuple, StageProgram] = {}
        self.channels: list[Channel] = []
        self._consts: dict[tuple, ip.Tensor] = {}
        self.seeds: dict[int, ip.Tensor] = {}
        self.seed_modifiers: dict[Node, int] = {}   # random forward node -> its seed modifier
        self.recomputed_copies: dict[tuple, list] = {}  # backward key -> copies of what its recompute made
        # recompute key -> (forward tensor, recomputed tensor) of each value the backward reads from
        # it, for the stages the host may copy (None: it recomputes); see runtime/recompute_replay.py
        self.recomputed_from: dict[tuple, list[tuple[ip.Tensor, ip.Tensor]]] = {}
        self.counters: list[ip.Tensor] = []    # Running: micro-batches accumulated, per stage program
        self.printed: list[tuple[str, str, object]] = []         # ipu_print_tensor: (stream, title, format)
        self.host_calls: list[HostCallSite] = []                  # poptorch.CPU ops
        # op templates (ipusim.device.replay): the ops a node of the same structure built, shared by
        # the lowerings of one compile; a node with no template of its own maps to None
        self.templates: dict = {} if templates is None else templates

    def seed(self, ipu: int) -> ip.Tensor:
        """The IPU's random seed (advanced after every stage program that draws from it)."""
        if ipu not in self.seeds:
            self.seeds[ipu] = rnd.seed_tensor(self.graph(ipu), f"{self.prefix}ipu{ipu}/seed")
        return self.seeds[ipu]

    # ---- helpers ------------------------------------------------------------------------------
    def add_program(self, p: ip.Program) -> int:
        self.programs.append(p)
        return len(self.programs) - 1

    def _running_share(self, g: ip.Graph, sp, body: ip.Sequence) -> ip.Tensor:
        """1/k for the k-th micro-batch this stage program accumulates since the last weight update
        (its counter, cleared by the update, is advanced here)."""
        count = g.addVariable("float32", (1,), f"{self.prefix}{sp.name}/accumulated", category="accumulators",
                              always_live=True)
        g.setTileMapping(count, 0)
        self.counters.append(count)
        ew.unary(g, "scale", count, body, f"{count.name}/advance", out=count, bias=1.0)
        return ew.unary(g, "reciprocal", count, body, f"{count.name}/share")

    def graph(self, ipu: int) -> ip.Graph:
        return self.device.graph(ipu)

    def const(self, v: Value, key: tuple, ipu: int) -> ip.Tensor:
        k = (v.id, key)
        if k not in self._consts:
            g = self.graph(ipu)
            t = g.addConstant(v.dtype, v.shape, v.data, f"{self.prefix}{key[0]}{key[1]}/const")
            g.map_linearly(t, grain=4, min_elements_per_tile=256)
            self._consts[k] = t
        return self._consts[k]

    def remote(self, graph: ip.Graph, t: ip.Tensor, repeats: int = 1) -> ip.RemoteBuffer:
        """A Streaming Memory home for `t`, which then occupies tiles only between load and last use."""
        t.var.always_live = False
        return graph.addRemoteBuffer(f"{t.name}@remote", t.dtype, t.shape, repeats)

    # ---- placement of weights -----------------------------------------------------------------
    def place_weights(self) -> None:
        users: dict[str, set[int]] = {}
        by_id = {v.id: name for name, v in {**self.ir.params, **self.ir.buffers}.items()}
        for n in self.ir.nodes:
            for v in n.inputs:
                if v.id in by_id:
                    users.setdefault(by_id[v.id], set()).add(n.stage)
        for name, g in self.ir.grads.items():   # a weight only its (constant) gradient stands for lives where that is made
            if name not in users and isinstance(g, Value) and g.producer is not None:
                users[name] = {g.producer.stage}
        for name, v in {**self.ir.params, **self.ir.buffers}.items():
            stages = users.get(name)
            if not stages:
                continue
            ipus = {self.stage_ipus[s] for s in stages}
            if len(ipus) > 1:
                raise CompileError(f"weight {name!r} is used on IPUs {sorted(ipus)} (stages {sorted(stages)}); "
                                   "a weight must live on one IPU: put the ops that use it in blocks on the same IPU")
            ipu = ipus.pop()
            g = self.graph(ipu)
            category = "weights" if v.kind == "param" else "other"
            t = g.addVariable(v.dtype, v.shape, f"{self.prefix}{name}", category=category)
            g.map_linearly(t, grain=4, min_elements_per_tile=64)
            self.weights[name] = t
            self.weight_ipu[name] = ipu
            self.weight_stage[name] = min(stages)
            if v.kind == "param" and self.locations.off_chip("weights", t.numel):
                self.weight_buffers[name] = self.remote(g, t)

    # ---- stage programs and channels ----------------------------------------------------------
    def build(self) -> None:
        self.place_weights()
        weight_ids = {v.id: name for name, v in {**self.ir.params, **self.ir.buffers}.items()}
        input_index = {v.id: i for i, v in enumerate(self.ir.inputs)}
        for n in self.ir.nodes:
            key = stage_key(n)
            if key not in self.stage_programs:
                self.stage_programs[key] = StageProgram(key, self.stage_ipus[n.stage], [])
            self.stage_programs[key].nodes.append(n)
        producer_key = {v.id: stage_key(n) for n in self.ir.nodes for v in n.outputs}
        producer = {v.id: n for n in self.ir.nodes for v in n.outputs}
        used_by = {(v.id, key) for key, sp in self.stage_programs.items() for n in sp.nodes for v in n.inputs}
        route = Routes(self.stage_programs, producer_key, used_by, input_index)
        # channels: values crossing from one stage program to another, except views of a weight on
        # the consumer's IPU (a transposed weight the backward reads): the weight does not change
        # between a micro-batch's forward and backward, so the consumer takes the same view of it
        crossing: dict[tuple, list[Value]] = {}
        for key, sp in self.stage_programs.items():
            seen = set()
            for n in sp.nodes:
                for v in n.inputs:
                    src = producer_key.get(v.id)
                    if src is not None and src != key and v.id not in seen:
                        chain = weight_view(v, producer, weight_ids)
                        if chain is not None and self.weight_ipu[weight_ids[chain[0].inputs[0].id]] == sp.ipu:
                            sp.weight_views[v.id] = chain
                            continue
                    if key[0] == WEIGHT_GRADIENT and src is not None and (v.id, ("bwd", key[1])) in used_by:
                        src = ("bwd", key[1])   # a value its B uses too reaches W from B
                    src = route(v, key, src)
                    if src == (RECOMPUTE, key[1]) and key[0] == "bwd":
                        continue    # B reads its recompute program's tensors
                    if src is not None and src != key and v.id not in seen:
                        seen.add(v.id)
                        crossing.setdefault((src, key), []).append(v)
        slots = channel_slots(self.schedule, list(crossing))
        for (src, dst), values in crossing.items():
            self.channels.append(Channel(src, dst, values, slots[(src, dst)]))
        for ch in self.channels:
            self._make_receive_buffers(ch)
        rank = {"fwd": 0, RECOMPUTE: 1, "bwd": 2, WEIGHT_GRADIENT: 3}
        for key in sorted(self.stage_programs, key=lambda k: (k[0] != "fwd", k[1] if k[0] == "fwd" else -k[1],
                                                              rank[k[0]])):
            self._lower_stage(self.stage_programs[key], weight_ids, input_index)
            if key[0] == RECOMPUTE:
                self._share_recomputed(key, used_by)
        self._choose_copied_recomputations()
        for ch in self.channels:
            self._make_send(ch)

    def _choose_copied_recomputations(self) -> None:
        """The recomputed stages whose values the host may copy from their forward after the first
        call (runtime/recompute_replay.py): those whose copies, held for every micro-batch between
        F and R, fit the budget (`recompute.copy_budget_bytes`), fewest bytes first. Their tensors
        are read and written by the host between programs, so they keep storage of their own."""
        left = recompute.copy_budget_bytes()
        for key in sorted((k for k, pairs in self.recomputed_from.items() if pairs),
                          key=lambda k: self._copies_bytes(k)):
            need = self._copies_bytes(key)
            # a split backward (zero-bubble schedules) gives its weight-gradient program values of the
            # recompute program that the input-gradient program does not read: those stages recompute
            if need > left or (WEIGHT_GRADIENT, key[1]) in self.stage_programs or \
                    any(n.op in recompute.UNCOPYABLE for n in self.stage_programs[key].nodes):
                self.recomputed_from[key] = None
                continue
            left -= need
            for f, r in self.recomputed_from[key]:
                f.var.host_access = r.var.host_access = True

    def _copies_bytes(self, key: tuple) -> int:
        per_micro_batch = sum(f.numel * f.var.dtype.itemsize for f, _ in self.recomputed_from[key])
        return recompute.in_flight(self.schedule, key[1]) * per_micro_batch

    def _share_recomputed(self, key: tuple, used_by: set) -> None:
        """After lowering ("recompute", s): what it received is the backward's too, which runs
        right after it on the same IPU; what it recomputed and the backward reads, the backward
        copies first into tensors laid out as a stash's receive buffers (linearly), as it would
        have received them without recomputation: every op of the backward then has the same
        plan, and so the same order of sums, as without."""
        backward, forward = ("bwd", key[1]), ("fwd", key[1])
        made = {v.id for n in self.stage_programs[key].nodes for v in n.outputs}
        original = {c.id: o.id for n in self.stage_programs[key].nodes if "recomputes" in n.attrs
                    for c, o in zip(n.outputs, n.attrs["recomputes"].outputs)}
        g = self.graph(self.stage_programs[key].ipu)
        for (vid, k), t in list(self.tensors.items()):
            if k != key or (vid, backward) in self.tensors:
                continue
            if vid in made and (vid, backward) in used_by:
                pairs = self.recomputed_from.setdefault(key, [])
                if pairs is not None and (original.get(vid), forward) in self.tensors:
                    pairs.append((self.tensors[(original[vid], forward)], t))
                else:   # a value with no forward tensor to take it from: the recomputation must run
                    self.recomputed_from[key] = None
                local = g.addVariable(t.dtype, t.shape, f"{self.prefix}{backward[0]}{backward[1]}/recomputed/{t.name}",
                                      category="activations", always_live=False)
                g.map_linearly(local, grain=4, min_elements_per_tile=64)
                self.recomputed_copies.setdefault(backward, []).append(ip.Copy(t, local))
                t = local
            self.tensors[(vid, backward)] = t

    def _stash_off_chip(self, ch: Channel) -> bool:
        same_ipu = self.stage_programs[ch.src].ipu == self.stage_programs[ch.dst].ipu
        return same_ipu and (ch.src[0], ch.dst[0]) in STASHES and \
            self.locations.off_chip("activations", sum(v.numel for v in ch.values))

    def _make_receive_buffers(self, ch: Channel) -> None:
        """Slot buffers on the consumer's IPU (tile memory, or Streaming Memory for an off-chip
        stash) and, when there are several slots or they are off chip, receive programs."""
        dst_ipu = self.stage_programs[ch.dst].ipu
        g = self.graph(dst_ipu)
        category = "stashed_activations" if (ch.src[0], ch.dst[0]) in STASHES else "activations"
        ch.off_chip = self._stash_off_chip(ch)
        ch.buffers = []
        name = f"{self.prefix}{ch.dst[0]}{ch.dst[1]}"
        for v in ch.values:
            local = g.addVariable(v.dtype, v.shape, f"{name}/in/{v.name}", category="activations",
                                  always_live=False)
            g.map_linearly(local, grain=4, min_elements_per_tile=64)
            if ch.off_chip:
                ch.buffers.append(self.remote(g, local, ch.slots))
                self.tensors[(v.id, ch.dst)] = local
                continue
            slots = [local] if ch.slots == 1 else [g.clone(local, f"{name}/recv/{v.name}/{j}", category=category,
                                                           always_live=True) for j in range(ch.slots)]
            local.var.always_live = ch.slots == 1
            if ch.slots == 1:
                local.var.category = category
            ch.buffers.append(slots)
            self.tensors[(v.id, ch.dst)] = local
        if ch.slots > 1 or ch.off_chip:
            for j in range(ch.slots):
                seq = ip.Sequence(name=f"{self.prefix}recv {ch.src}->{ch.dst} slot {j}")
                for v, buf in zip(ch.values, ch.buffers):
                    local = self.tensors[(v.id, ch.dst)]
                    seq.add(ip.RemoteCopy(buf, local, j) if ch.off_chip else ip.Copy(buf[j], local))
                ch.recv.append(self.add_program(seq))

    def _make_send(self, ch: Channel) -> None:
        src_ipu = self.stage_programs[ch.src].ipu
        dst_ipu = self.stage_programs[ch.dst].ipu
        for j in range(ch.slots):
            seq = ip.Sequence(name=f"{self.prefix}send {ch.src}->{ch.dst} slot {j}")
            for v, buf in zip(ch.values, ch.buffers):
                src = self.tensors[(v.id, ch.src)]
                if ch.off_chip:
                    seq.add(ip.RemoteCopy(src, buf, j))
                else:
                    seq.add(ip.InterIpuCopy(src, buf[j]) if src_ipu != dst_ipu else ip.Copy(src, buf[j]))
            ch.send.append(self.add_program(seq))

    def _lower_stage(self, sp: StageProgram, weight_ids: dict, input_index: dict) -> None:
        g = self.graph(sp.ipu)
        body = ip.Sequence(name=f"{self.prefix}{sp.name}")
        key = sp.key
        ctx = Context(self, g, body)
        for copy in self.recomputed_copies.get(key, []):
            body.add(copy)
        # off-chip weights used here come in from Streaming Memory first
        used = {weight_ids[v.id] for n in sp.nodes for v in n.inputs if v.id in weight_ids}
        used |= {weight_ids[chain[0].inputs[0].id] for chain in sp.weight_views.values()}
        for name in sorted(used & set(self.weight_buffers)):
            body.add(ip.RemoteCopy(self.weight_buffers[name], self.weights[name]))
        # host inputs used by this stage program (overlapped ones through IO tiles: host_io.py; a
        # recomputation receives them from its forward's stash)
        prefetch: dict = {}
        for v in {v.id: v for n in sp.nodes for v in n.inputs if v.id in input_index}.values():
            if (v.id, key) in self.tensors:
                continue
            name = f"{self.prefix}{sp.name}/input/{v.name}"
            t = g.addVariable(v.dtype, v.shape, name, category="host_io", always_live=False)
            g.map_linearly(t, grain=4, min_elements_per_tile=64)
            stream = g.addHostToDeviceFIFO(name, v.dtype, v.shape)
            mode = self.ir.host_io.get(("input", input_index[v.id]))
            if overlapped(mode):
                buf = io_buffer(g, v.dtype, v.shape, f"{name}/io_tiles")
                prefetch.setdefault(mode, ip.Sequence(name=f"{self.prefix}{sp.name}/prefetch")).add(
                    ip.StreamCopy(stream, buf))
                body.add(ip.Copy(buf, t))
            else:
                body.add(ip.StreamCopy(stream, t))
            self.tensors[(v.id, key)] = t
            sp.inputs.append((name, input_index[v.id]))
        sp.prefetch = [(mode, self.add_program(seq)) for mode, seq in prefetch.items()]
        for n in sp.nodes:
            ins = []
            for v in n.inputs:
                if v.id in weight_ids:
                    ins.append(self.weights[weight_ids[v.id]])
                elif v.kind == "const":
                    ins.append(self.const(v, key, sp.ipu))
                elif (v.id, key) in self.tensors:
                    ins.append(self.tensors[(v.id, key)])
                elif v.id in sp.weight_views:
                    t = self.weights[weight_ids[sp.weight_views[v.id][0].inputs[0].id]]
                    for view in sp.weight_views[v.id]:
                        t = _view(ctx, view, [t])[0]
                    self.tensors[(v.id, key)] = t
                    ins.append(t)
                else:
                    raise CompileError(f"value {v} used by {n.op} at {n.source} is not available on stage "
                                       f"program {key}")
            lower = LOWER.get(n.op)
            if lower is None:
                raise CompileError(f"op {n.op} (at {n.source}) has no lowering to ipusim")
            ctx.name = f"{self.prefix}{sp.name}/{n.scope + '/' if n.scope else ''}{n.op}"
            first, first_var = len(body.programs), len(g.variables)
            ctx.node, ctx.inputs = n, ins
            outs = self._lower_node(ctx, lower, n, ins)
            sp.op_spans.append((n, first, len(body.programs), first_var, len(g.variables)))
            if self.loss_scaling is not None:
                self.loss_scaling.track(self, ctx, n, outs)
            for v, t in zip(n.outputs, outs):
                if t is not None:
                    self.tensors[(v.id, key)] = t
        # gradient accumulation (accumulators in Streaming Memory are loaded and stored around it)
        share = self._running_share(g, sp, body) if self.running_mean and any(
            (v.id, key) in self.tensors for v in self.ir.grads.values()) else None
        for name, v in self.ir.grads.items():
            if (v.id, key) in self.tensors and (v.producer is None or stage_key(v.producer) == key):
                w = self.weights[name]
                acc = g.clone(w, f"{w.name}/accumulator", dtype=self.accumulator_dtypes.get(name, w.dtype),
                              category="accumulators", always_live=True)
                self.accumulators[name] = acc
                grad = self.tensors[(v.id, key)]
                if grad.ipu != w.ipu:
                    raise CompileError(f"the gradient of {name!r} is computed on IPU {grad.ipu}, its weight lives on "
                                       f"IPU {w.ipu}")
                if grad.dtype != acc.dtype:
                    grad = ew.cast(g, grad, acc.dtype, body, f"{acc.name}/gradient")
                buf = None
                if self.locations.off_chip("accumulators", acc.numel):
                    buf = self.accumulator_buffers[name] = self.remote(g, acc)
                    body.add(ip.RemoteCopy(buf, acc))
                if share is None:
                    ew.binary(g, "add", acc, grad, body, f"{acc.name}/accumulate", out=acc)
                else:  # the running mean of k gradients: acc + (grad - acc) / k
                    step = ew.binary(g, "sub", grad, acc, body, f"{acc.name}/deviation")
                    step = ew.binary(g, "mul", step, ew.cast(g, share, acc.dtype, body, f"{acc.name}/share"), body,
                                     f"{acc.name}/step")
                    ew.binary(g, "add", acc, step, body, f"{acc.name}/accumulate", out=acc)
                if buf is not None:
                    body.add(ip.RemoteCopy(acc, buf))
        if ctx.random_ops:
            rnd.advance_seed(g, self.seed(sp.ipu), body, name=f"{self.prefix}{sp.name}/advance_seed")
        sp.body = self.add_program(body)
        # model outputs produced here
        outs = ip.Sequence(name=f"{self.prefix}{sp.name}/outputs")
        drain: dict = {}
        for i, v in enumerate(self.ir.returned()):
            if (v.id, key) in self.tensors and v.producer is not None and stage_key(v.producer) == key:
                name = f"{self.prefix}{sp.name}/output/{i}"
                stream = g.addDeviceToHostFIFO(name, v.dtype, v.shape)
                mode = self.ir.host_io.get(("output", i))
                if overlapped(mode):
                    buf = io_buffer(g, v.dtype, v.shape, f"{name}/io_tiles")
                    outs.add(ip.Copy(self.tensors[(v.id, key)], buf))
                    drain.setdefault(mode, ip.Sequence(name=f"{self.prefix}{sp.name}/drain")).add(
                        ip.StreamCopy(buf, stream))
                else:
                    outs.add(ip.StreamCopy(self.tensors[(v.id, key)], stream))
                sp.output_streams.append((name, i))
        if outs.programs:
            sp.outputs = self.add_program(outs)
        sp.drain = [(mode, self.add_program(seq)) for mode, seq in drain.items()]


    def _lower_node(self, ctx: "Context", lower, n: Node, ins: list) -> list:
        """The node's lowering, or the template of an earlier node of the same op, attributes and
        input structure made again for these tensors (a model's repeated layers plan once)."""
        if n.op in VIEW_OPS or n.op in UNREPLAYED or "multiconv" in n.attrs:
            return lower(ctx, n, ins)
        original = n.attrs.get("recomputes")
        if original in self.seed_modifiers:   # a recomputed random op: its forward's seed modifier
            return lower(ctx, n, ins)
        # a recomputed op plans as the op it repeats: the node it names is not part of its structure
        attrs = {k: v for k, v in n.attrs.items() if k != "recomputes"} if original is not None else n.attrs
        key = (n.op, attributes_key(attrs), tuple((v.dtype, tuple(v.shape)) for v in n.outputs),
               replay.signature(ins))
        template = self.templates.get(key)
        if template is not None:
            try:
                programs, outs = template.replay(ctx.graph, ins, ctx.name, template.name)
            except replay.NotReplayable:
                return lower(ctx, n, ins)
            for p in programs:
                ctx.prog.add(p)
            return outs
        if key in self.templates:  # seen, not replayable
            return lower(ctx, n, ins)
        prog, local = ctx.prog, ip.Sequence()
        random_ops = ctx.random_ops
        ctx.prog = local
        try:
            with replay.record(ctx.graph) as made:
                outs = lower(ctx, n, ins)
        finally:
            ctx.prog = prog
        for p in local.programs:
            prog.add(p)
        template = None
        if ctx.random_ops == random_ops:  # a random op takes a seed modifier of its own
            try:
                template = replay.Template(ctx.graph, ins, made, list(local.programs), list(outs))
                template.name = ctx.name
            except replay.NotReplayable:
                template = None
        self.templates[key] = template
        return outs


UNREPLAYED = {"print_tensor", "cpu_op", "loss_scale", "loop", "if"}
"""Ops whose lowering does more than build on its graph (host streams and calls, the lowering's
loss-scale tensors, device loops and branches lowering bodies of their own), and the members of a
MultiConv (one plan for the group): never replayed."""


def attributes_key(attrs) -> object:
    """A node's attributes as a hashable key (arrays by content)."""
    if isinstance(attrs, dict):
        return tuple(sorted((k, attributes_key(v)) for k, v in attrs.items()))
    if isinstance(attrs, (list, tuple)):
        return (type(attrs).__name__,) + tuple(attributes_key(v) for v in attrs)
    if isinstance(attrs, np.ndarray):
        return ("ndarray", replay.digest(attrs))
    if hasattr(attrs, "detach") and hasattr(attrs, "numpy"):   # a torch tensor
        return ("tensor", replay.digest(attrs.detach().cpu().numpy()))
    if isinstance(attrs, slice):
        return ("slice", attrs.start, attrs.stop, attrs.step)
    try:
        hash(attrs)
    except TypeError:
        return ("repr", repr(attrs))
    return (type(attrs).__name__, attrs)


# =========================================================================================
# Op lowerings: (context, node, input tensors) -> output tensors (None for outputs not needed)
# =========================================================================================
class Context:
    """What an op lowering needs: the IPU's graph, the program being built, a name, the seed, and
    the node being lowered with its input tensors."""

    def __init__(self, lowering: Lowering, graph: ip.Graph, prog: ip.Sequence):
        self.lowering = lowering
        self.graph = graph
        self.prog = prog
        self.name = ""
        self.random_ops = 0
        self.node: Node | None = None
        self.inputs: list = []

    def seed(self) -> tuple[ip.Tensor, int]:
        """The seed tensor and a modifier distinct for every random op of this program. A
        recomputed random op gets what its forward drew with: the seed as the forward's program
        saw it (its last input, from the stash) and the same modifier, so it draws the same bits."""
        original = self.node.attrs.get("recomputes") if self.node is not None else None
        if original is not None:
            return self.inputs[-1], self.lowering.seed_modifiers[original]
        self.random_ops += 1
        if self.node is not None:
            self.lowering.seed_modifiers[self.node] = self.random_ops
        return self.lowering.seed(self.graph.ipu), self.random_ops


LOWER = {}


def lowers(*ops):
    def deco(fn):
        for op in ops:
            LOWER[op] = fn
        return fn
    return deco


@lowers(*VIEW_OPS)
def _view(ctx, n: Node, ins):
    x, a = ins[0], n.attrs
    if n.op == "reshape":
        return [x.reshape(a["shape"])]
    if n.op == "transpose":
        return [x.transpose(a["perm"])]
    if n.op == "expand":
        return [x.broadcast(a["shape"])]
    return [x[a["key"]]]


def _new_activation(ctx, n, dtype) -> ip.Tensor:
    g = ctx.graph
    out = g.addVariable(dtype, n.outputs[0].shape, ctx.name, category="activations", always_live=False)
    g.map_linearly(out, grain=4, min_elements_per_tile=64)
    return out


@lowers("cat")
def _cat(ctx, n, ins):
    out = _new_activation(ctx, n, ins[0].dtype)
    for t, key in zip(ins, n.attrs["keys"]):
        ctx.prog.add(ip.Copy(t, out[key]))
    return [out]


@lowers("scatter_slice")
def _scatter_slice(ctx, n, ins):
    base, src = ins
    out = _new_activation(ctx, n, base.dtype)
    ctx.prog.add(ip.Copy(base, out))
    ctx.prog.add(ip.Copy(src, out[n.attrs["key"]]))
    return [out]


@lowers("copy")
def _copy(ctx, n, ins):
    """A fresh activation holding the input's values (a parameter returned as an output)."""
    out = _new_activation(ctx, n, ins[0].dtype)
    ctx.prog.add(ip.Copy(ins[0], out))
    return [out]


@lowers("checkpoint")
def _checkpoint(ctx, n, ins):
    """recomputationCheckpoint: the value itself (recomputation stashes it instead of recomputing it)."""
    return [ins[0]]


@lowers("seed_snapshot")
def _seed_snapshot(ctx, n, ins):
    """The IPU's seed as this forward program draws from it, for its recomputation (stashed)."""
    seed = ctx.lowering.seed(ctx.graph.ipu)
    out = ctx.graph.clone(seed, ctx.name, category="activations", always_live=False)
    ctx.prog.add(ip.Copy(seed, out))
    return [out]


@lowers("assign")
def _assign(ctx, n, ins):
    """A buffer's new value (functionalised in-place update) copied into the buffer."""
    ctx.prog.add(ip.Copy(ins[1], ins[0]))
    return []


@lowers("unary")
def _unary(ctx, n, ins):
    a = n.attrs
    return [ew.unary(ctx.graph, a["fn"], ins[0], ctx.prog, ctx.name, scale=a.get("scale", 1.0),
                     bias=a.get("bias", 0.0), out_dtype=n.outputs[0].dtype)]


@lowers("binary")
def _binary(ctx, n, ins):
    return [ew.binary(ctx.graph, n.attrs["fn"], ins[0], ins[1], ctx.prog, ctx.name)]


@lowers("cast")
def _cast(ctx, n, ins):
    return [ew.cast(ctx.graph, ins[0], n.outputs[0].dtype, ctx.prog, ctx.name)]


@lowers("reduce")
def _reduce(ctx, n, ins):
    a = n.attrs
    return [reduce_ops.reduce(ctx.graph, ins[0], a["axes"], a["fn"], ctx.prog, ctx.name, keepdims=a["keepdims"])]


def _memory(a):
    """The planner's memory budget set by poptorch.set_available_memory (else the op's default)."""
    return {"available_memory_proportion": a["available_memory_proportion"]} if "available_memory_proportion" in a \
        else {}


@lowers("matmul")
def _matmul(ctx, n, ins):
    a = n.attrs
    partials = ctx.lowering.matmul_partials   # Precision.setPartialsType: honoured for float16 operands
    if a.get("serialization", "none") != "none":
        return [mm.serialized_matmul(ctx.graph, ins[0], ins[1], ctx.prog, a["serialization"], a["factor"], ctx.name,
                                     keep_precision=a["keep_precision"], partials=partials, **_memory(a))]
    return [mm.matmul(ctx.graph, ins[0], ins[1], ctx.prog, ctx.name, partials=partials, **_memory(a))]


def _conv_args(a):
    return dict(stride=a["stride"], padding=a["padding"], dilation=a["dilation"], groups=a["groups"])


@lowers("conv")
def _conv(ctx, n, ins):
    if "multiconv" in n.attrs:   # a convolution of a poptorch.MultiConv (compiler/multiconv.py)
        return lower_member(ctx, n, ins, _conv_args)
    return [conv.conv(ctx.graph, ins[0], ins[1], ctx.prog, name=ctx.name, **_conv_args(n.attrs),
                      **_memory(n.attrs))]


@lowers("print_tensor")
def _print_tensor(ctx, n, ins):
    """Copy the tensor to the host, which prints it (Poplar's PrintTensor); the result is the tensor."""
    v = n.inputs[0]
    name = f"{ctx.name}/{n.outputs[0].name}"
    ctx.prog.add(ip.StreamCopy(ins[0], ctx.graph.addDeviceToHostFIFO(name, v.dtype, v.shape)))
    ctx.lowering.printed.append((name, n.attrs["title"], n.attrs["format"]))
    return [ins[0]]


@lowers("custom_op")
def _custom_op(ctx, n, ins):
    """poptorch.custom_op: the registered kernel as the vertices of a compute set (ipusim.ops.custom)."""
    d, call = n.attrs["definition"], n.attrs["call"]
    return custom_ops.custom(ctx.graph, ins, [(v.shape, v.dtype) for v in n.outputs], d.forward, ctx.prog,
                             partition=d.partition, cycles=d.cycles, attributes=call.attribute_dict,
                             name=f"{ctx.name}/{call.domain}.{call.name}")


@lowers("custom_op_backward")
def _custom_op_backward(ctx, n, ins):
    """The registered gradient kernel, given (grads, inputs, outputs); its results for the
    floating-point inputs (None from the kernel: zeros)."""
    d, call = n.attrs["definition"], n.attrs["call"]
    kernel = custom_ops.GradientKernel(d.backward, n.attrs["counts"], n.attrs["wanted"], call.describe())
    return custom_ops.custom(ctx.graph, ins, [(v.shape, v.dtype) for v in n.outputs], kernel, ctx.prog,
                             partition=d.partition, cycles=d.backward_cycles, attributes=call.attribute_dict,
                             name=f"{ctx.name}/{call.domain}.{call.name}")


@lowers("ctc_beam_search_decoder")
def _ctc_decoder(ctx, n, ins):
    a = n.attrs
    return list(ctc_decoder.ctc_beam_search_decoder(ctx.graph, *ins, ctx.prog, blank=a["blank"],
                                                    beam_width=a["beam_width"], top_paths=a["top_paths"],
                                                    name=ctx.name))


@lowers("fps")
def _fps(ctx, n, ins):
    a = n.attrs
    draws = None
    if a["random_start"]:
        seed, modifier = ctx.seed()
        draws = rnd.uniform(ctx.graph, (len(a["ptr"]) - 1,), seed, ctx.prog, 0.0, 1.0, "float32",
                            name=f"{ctx.name}/start", seed_modifier=modifier)
    return [cluster.fps(ctx.graph, ins[0], a["ptr"], a["ratio"], ctx.prog, random_u=draws, name=ctx.name)]


@lowers("nearest")
def _nearest(ctx, n, ins):
    return [cluster.nearest(ctx.graph, *ins, ctx.prog, name=ctx.name)]


@lowers("loss_scale")
def _loss_scale(ctx, n, ins):
    """The gradient seed times the replica's loss-scale tensor (the optimiser's loss_scaling, or
    automatic loss scaling's)."""
    scale = ctx.lowering.loss_scaling.scale(ctx.lowering, ctx.graph)
    x = ins[0]
    factor = scale if x.dtype == scale.dtype else ew.cast(ctx.graph, scale, x.dtype, ctx.prog, f"{ctx.name}/scale")
    return [ew.binary(ctx.graph, "mul", x, factor.broadcast((x.numel,)).reshape(x.shape), ctx.prog, ctx.name)]


@lowers("cpu_op")
def _cpu_op(ctx, n, ins):
    """poptorch.CPU: each input leaves by a device-to-host stream, the host calls the function and
    each result comes back by a host-to-device stream (the runtime connects them: HostCallSite)."""
    name = f"{ctx.name}/{n.outputs[0].name}"
    to_host, from_host, outs = [], [], []
    for i, (t, v) in enumerate(zip(ins, n.inputs)):
        stream = ctx.graph.addDeviceToHostFIFO(f"{name}/to_host/{i}", t.dtype, t.shape)
        ctx.prog.add(ip.StreamCopy(t, stream))
        to_host.append(stream.name)
    for j, v in enumerate(n.outputs):
        out = ctx.graph.addVariable(v.dtype, v.shape, f"{name}/result/{j}", category="activations",
                                    always_live=False)
        ctx.graph.map_linearly(out, grain=4, min_elements_per_tile=64)
        stream = ctx.graph.addHostToDeviceFIFO(f"{name}/from_host/{j}", v.dtype, v.shape)
        ctx.prog.add(ip.StreamCopy(stream, out))
        from_host.append(stream.name)
        outs.append(out)
    ctx.lowering.host_calls.append(HostCallSite(n.attrs["call"], to_host, from_host))
    return outs


@lowers("conv_backward_input")
def _conv_bwd_input(ctx, n, ins):
    return [conv.conv_backward_input(ctx.graph, ins[0], ins[1], n.outputs[0].shape, ctx.prog, name=ctx.name,
                                     **_conv_args(n.attrs))]


@lowers("conv_backward_weights")
def _conv_bwd_weights(ctx, n, ins):
    return [conv.conv_backward_weights(ctx.graph, ins[0], ins[1], n.outputs[0].shape, ctx.prog, name=ctx.name,
                                         **_conv_args(n.attrs))]


def _pool_args(a):
    return dict(stride=a["stride"], padding=a["padding"], ceil_mode=a.get("ceil_mode", False))


def _avg_args(a):
    return dict(_pool_args(a), count_include_pad=a["count_include_pad"], divisor_override=a.get("divisor_override"))


@lowers("max_pool")
def _max_pool(ctx, n, ins):
    a = n.attrs
    return [pool.max_pool(ctx.graph, ins[0], a["kernel"], ctx.prog, dilation=a.get("dilation", 1), name=ctx.name,
                          **_pool_args(a))]


@lowers("max_pool_backward")
def _max_pool_bwd(ctx, n, ins):
    a = n.attrs
    return [pool.max_pool_backward(ctx.graph, ins[0], ins[1], ins[2], a["kernel"], ctx.prog,
                                   dilation=a.get("dilation", 1), name=ctx.name, **_pool_args(a))]


@lowers("avg_pool")
def _avg_pool(ctx, n, ins):
    return [pool.avg_pool(ctx.graph, ins[0], n.attrs["kernel"], ctx.prog, name=ctx.name, **_avg_args(n.attrs))]


@lowers("avg_pool_backward")
def _avg_pool_bwd(ctx, n, ins):
    return [pool.avg_pool_backward(ctx.graph, ins[0], n.outputs[0].shape, n.attrs["kernel"], ctx.prog,
                                   name=ctx.name, **_avg_args(n.attrs))]


@lowers("adaptive_avg_pool")
def _adaptive(ctx, n, ins):
    return [pool.adaptive_avg_pool(ctx.graph, ins[0], n.attrs["output_size"], ctx.prog, name=ctx.name)]


@lowers("adaptive_avg_pool_backward")
def _adaptive_bwd(ctx, n, ins):
    return [pool.adaptive_avg_pool_backward(ctx.graph, ins[0], n.outputs[0].shape, ctx.prog, name=ctx.name)]


@lowers("adaptive_max_pool")
def _adaptive_max(ctx, n, ins):
    return [pool.adaptive_max_pool(ctx.graph, ins[0], n.attrs["output_size"], ctx.prog, name=ctx.name)]


@lowers("adaptive_max_pool_backward")
def _adaptive_max_bwd(ctx, n, ins):
    return [pool.adaptive_max_pool_backward(ctx.graph, ins[0], ins[1], ins[2], ctx.prog, name=ctx.name)]


@lowers("softmax", "log_softmax")
def _softmax(ctx, n, ins):
    fn = sm.softmax if n.op == "softmax" else sm.log_softmax
    return [fn(ctx.graph, ins[0], n.attrs["axis"], ctx.prog, name=ctx.name)]


@lowers("softmax_backward", "log_softmax_backward")
def _softmax_bwd(ctx, n, ins):
    fn = sm.softmax_backward if n.op == "softmax_backward" else sm.log_softmax_backward
    return [fn(ctx.graph, ins[0], ins[1], n.attrs["axis"], ctx.prog, name=ctx.name)]


@lowers("dropout")
def _dropout(ctx, n, ins):
    seed, modifier = ctx.seed()
    y, mask = rnd.dropout(ctx.graph, ins[0], n.attrs["p"], seed, ctx.prog, name=ctx.name, seed_modifier=modifier)
    return [y, mask]


@lowers("random")
def _random(ctx, n, ins):
    a = n.attrs
    seed, modifier = ctx.seed()
    out = n.outputs[0]
    g, kw = ctx.graph, {"name": ctx.name, "seed_modifier": modifier}
    kind = a["kind"]
    if kind in ("uniform", "normal", "cauchy", "log_normal"):
        draw = {"uniform": rnd.uniform, "normal": rnd.normal, "cauchy": rnd.cauchy, "log_normal": rnd.log_normal}[kind]
        return [draw(g, out.shape, seed, ctx.prog, a["a"], a["b"], out.dtype, **kw)]
    if kind == "exponential":
        return [rnd.exponential(g, out.shape, seed, ctx.prog, a["a"], out.dtype, **kw)]
    if kind == "integers":
        return [rnd.integers(g, out.shape, int(a["a"]), int(a["b"]), seed, ctx.prog, out.dtype, **kw)]
    draw = {"bernoulli": rnd.bernoulli, "geometric": rnd.geometric}[kind]
    return [draw(g, out.shape, a["a"], seed, ctx.prog, out.dtype, **kw)]


@lowers("dropout_backward")
def _dropout_bwd(ctx, n, ins):
    return [rnd.dropout_backward(ctx.graph, ins[0], ins[1], n.attrs["p"], ctx.prog, name=ctx.name)]


@lowers("nll_loss")
def _nll(ctx, n, ins):
    a = n.attrs
    return [loss.nll_loss(ctx.graph, ins[0], ins[1], ctx.prog, a["reduction"], a["ignore_index"], name=ctx.name)]


@lowers("nll_loss_backward")
def _nll_bwd(ctx, n, ins):
    a = n.attrs
    return [loss.nll_loss_backward(ctx.graph, ins[2], ins[0], ins[1], ctx.prog, a["reduction"], a["ignore_index"],
                                   name=ctx.name)]


@lowers("ctc_loss")
def _ctc(ctx, n, ins):
    a = n.attrs
    return [ctc.ctc_loss(ctx.graph, *ins, ctx.prog, blank=a["blank"], reduction=a["reduction"],
                         zero_infinity=a["zero_infinity"], name=ctx.name)]


@lowers("ctc_loss_backward")
def _ctc_bwd(ctx, n, ins):
    a = n.attrs
    return [ctc.ctc_loss_backward(ctx.graph, *ins, ctx.prog, blank=a["blank"], reduction=a["reduction"],
                                  zero_infinity=a["zero_infinity"], name=ctx.name)]


@lowers("layer_norm")
def _layer_norm(ctx, n, ins):
    a = n.attrs
    w = ins[1] if a["affine"] else None
    b = ins[-1] if a["has_bias"] else None
    return list(norm.layer_norm(ctx.graph, ins[0], a["normalized_ndim"], w, b, a["eps"], ctx.prog, name=ctx.name))


@lowers("layer_norm_backward")
def _layer_norm_bwd(ctx, n, ins):
    a = n.attrs
    g, x, mean, inv_std, *params = ins
    w = params[0] if a["affine"] else None
    b = params[-1] if a["has_bias"] else None
    dx, dw, db = norm.layer_norm_backward(ctx.graph, g, x, mean, inv_std, w, b, a["normalized_ndim"], ctx.prog,
                                          name=ctx.name)
    return [dx] + [t for t in (dw, db) if t is not None]


@lowers("batch_norm")
def _batch_norm(ctx, n, ins):
    a = n.attrs
    x, w, b, running_mean, running_var = ins
    if not a["training"]:
        return [norm.batch_norm2d_inference(ctx.graph, x, running_mean, running_var, w, b, a["eps"], ctx.prog,
                                            name=ctx.name)]
    y, mean, var, inv_std = norm.batch_norm2d_train(ctx.graph, x, w, b, a["eps"], ctx.prog, name=ctx.name)
    if "recomputes" in a:   # the forward updated the running statistics already
        return [y, mean, var, inv_std]
    count = x.numel // x.shape[1]
    norm.update_running_stats(ctx.graph, running_mean, running_var, mean, var, a["momentum"], count, ctx.prog,
                              name=f"{ctx.name}/running_stats")
    return [y, mean, var, inv_std]


@lowers("batch_norm_backward")
def _batch_norm_bwd(ctx, n, ins):
    g, x, mean, inv_std, w = ins
    return list(norm.batch_norm2d_backward(ctx.graph, g, x, mean, inv_std, w, ctx.prog, name=ctx.name))


@lowers("embedding")
def _embedding(ctx, n, ins):
    return [gather.embedding(ctx.graph, ins[0], ins[1], ctx.prog, name=ctx.name, padding_idx=n.attrs["padding_idx"])]


@lowers("embedding_backward")
def _embedding_bwd(ctx, n, ins):
    return [gather.embedding_backward(ctx.graph, ins[0], ins[1], n.outputs[0].shape[0], ctx.prog, name=ctx.name,
                                      padding_idx=n.attrs["padding_idx"])]


@lowers("gather")
def _gather(ctx, n, ins):
    return [index_ops.gather(ctx.graph, ins[0], ins[1], n.attrs["axis"], ctx.prog, name=ctx.name)]


@lowers("scatter")
def _scatter(ctx, n, ins):
    return [index_ops.scatter(ctx.graph, ins[0], ins[1], ins[2], n.attrs["axis"], ctx.prog, name=ctx.name,
                              accumulate=n.attrs["accumulate"], reduce=n.attrs.get("reduce"))]


@lowers("scan")
def _scan(ctx, n, ins):
    a = n.attrs
    if a["fn"] in scan_ops.EXTREMES:
        return list(scan_ops.scan_with_positions(ctx.graph, ins[0], a["axis"], a["fn"], ctx.prog, name=ctx.name))
    return [scan_ops.scan(ctx.graph, ins[0], a["axis"], a["fn"], ctx.prog, name=ctx.name)]


@lowers("linalg")
def _linalg(ctx, n, ins):
    """A factorisation, solve or decomposition of each matrix of a batch (ipusim.ops.linalg)."""
    a, g, prog, name = n.attrs, ctx.graph, ctx.prog, ctx.name
    fn = a["fn"]
    if fn == "lu_factor":
        return list(linalg_ops.lu_factor(g, ins[0], prog, name, pivot=a["pivot"]))
    if fn == "pivot_permutation":
        return [linalg_ops.pivot_permutation(g, ins[0], a["m"], prog, name)]
    if fn == "cholesky":
        return list(linalg_ops.cholesky(g, ins[0], prog, name))
    if fn == "triangular_solve":
        return [linalg_ops.triangular_solve(g, ins[0], ins[1], prog, a["upper"], a["unit"], name)]
    if fn == "geqrf":
        return list(linalg_ops.geqrf(g, ins[0], prog, name))
    if fn == "householder":
        return [linalg_ops.householder(g, ins[0], ins[1], prog, name)]
    if fn == "eigh":
        return list(linalg_ops.eigh(g, ins[0], prog, a["lower"], name))
    if fn == "svd":
        return list(linalg_ops.svd(g, ins[0], prog, a["full_matrices"], name))
    if fn == "matrix_exp":
        return [linalg_ops.matrix_exp(g, ins[0], prog, name)]
    if fn == "ldl_factor":
        return list(linalg_ops.ldl_factor(g, ins[0], prog, name))
    if fn == "ldl_solve":
        return [linalg_ops.ldl_solve(g, ins[0], ins[1], ins[2], prog, name)]
    raise ValueError(f"linalg op {fn!r} is not one of ipusim.ops.linalg's")


@lowers("topk")
def _topk(ctx, n, ins):
    a = n.attrs
    return list(sort_ops.topk(ctx.graph, ins[0], a["k"], a["axis"], ctx.prog, name=ctx.name, largest=a["largest"]))


def weight_view(v: Value, producer: dict, weight_ids: dict) -> list[Node] | None:
    """The view ops (reshape, transpose, expand, slice) deriving `v` from a weight, the weight's
    first; None when `v` is not a view of a weight."""
    chain = []
    while v.id not in weight_ids:
        n = producer.get(v.id)
        if n is None or n.op not in VIEW_OPS:
            return None
        chain.append(n)
        v = n.inputs[0]
    return chain[::-1] or None


class Routes:
    """Where a stage program of a recomputed stage takes an input from, when not from its
    producer: its recompute program takes from the stage's forward whatever it did not make
    (the forward received or made it, and stashes it); its backward takes from the recompute
    program what that holds (made or received), and its weight gradient takes that from the
    backward (from the recompute program when the stage's backward is all weight gradient); a
    value of another stage's forward that this stage's forward received comes from there (one
    transfer between IPUs)."""

    def __init__(self, programs: dict, producer_key: dict, used_by: set, input_index: dict):
        self.recomputed = {k[1] for k in programs if k[0] == RECOMPUTE}
        self.backwards = {k[1] for k in programs if k[0] == "bwd"}
        self.producer_key, self.used_by, self.input_index = producer_key, used_by, input_index

    def __call__(self, v: Value, key: tuple, src: tuple | None) -> tuple | None:
        pass_, s = key
        if s not in self.recomputed or pass_ == "fwd":
            return src
        forward, recompute = ("fwd", s), (RECOMPUTE, s)
        if pass_ == RECOMPUTE:
            if src == key or (src is None and v.id not in self.input_index):
                return src
            return forward
        if self.producer_key.get(v.id) == recompute or (v.id, recompute) in self.used_by:
            return recompute if pass_ == "bwd" or s not in self.backwards else ("bwd", s)
        if src is not None and src[0] == "fwd" and src[1] != s and (v.id, forward) in self.used_by:
            return forward
        return src


def channel_slots(schedule, channels: list[tuple[tuple, tuple]]) -> dict[tuple, int]:
    """Slots each channel needs: the most micro-batches in flight between producer and consumer."""
    when: dict[tuple, dict[int, int]] = {}
    for t, step in enumerate(schedule.steps):
        for op in step.ops:
            if op.kind in PASS_OF_KIND:
                when.setdefault(program_key(op), {})[op.global_micro_batch] = t
    out = {}
    for src, dst in channels:
        a, b = when.get(src, {}), when.get(dst, {})
        events = []
        for k, start in a.items():
            if k in b:
                events += [(start, 1), (b[k] + 1, -1)]
        live = peak = 0
        for _, d in sorted(events, key=lambda e: (e[0], e[1])):
            live += d
            peak = max(peak, live)
        out[(src, dst)] = max(1, peak)
    return out


from . import control_flow  # noqa: E402  (device loops and branches, dynamic slices: their lowerings)

LOWER.update(control_flow.IR)
