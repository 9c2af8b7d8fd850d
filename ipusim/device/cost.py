"""Static cycle estimates of programs (Poplar programs are static, so this runs once at compile).

The model, superstep by superstep (BSP):
- `Execute(cs)`: compute = the slowest tile, a tile being as slow as its busiest worker (vertex
  estimates come from each VertexType's estimator); then one internal sync.
- `Copy`: exchange = ceil(max over tiles of bytes sent or received / exchange bytes per cycle),
  plus on-tile copies at the local copy rate; then one internal sync.
- `InterIpuCopy`: link time at the IPU-Link rate (with PopLibs' efficiency) plus a global sync;
  the links are full duplex, so copies in a `Parallel` where an IPU sends one and receives another
  overlap (the IPU is busy as long as the longer).
- `StreamCopy`: host link time (PCIe) plus latency and a global sync.
- `RemoteCopy`: Streaming Memory time at the target's streaming bandwidth plus an internal sync
  (counted with host I/O).
- `Sync`: the internal or global sync cost.
All IPUs of a device advance in lockstep through a program: a node's `total` is the time its
slowest IPU takes; per IPU we keep the busy cycles by kind, so idle = total - busy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from .program import (Copy, Execute, If, InterIpuCopy, OpProgram, Parallel, Program, RemoteCopy, Repeat,
                      Sequence, StreamCopy, Sync)
from .target import Target
from .tensor import Tensor

KINDS = ("compute", "exchange", "sync", "inter_ipu", "host")


@dataclass
class Cycles:
    compute: int = 0
    exchange: int = 0
    sync: int = 0
    inter_ipu: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        return self.compute + self.exchange + self.sync + self.inter_ipu + self.host

    def __add__(self, other: "Cycles") -> "Cycles":
        return Cycles(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __mul__(self, n: int) -> "Cycles":
        return Cycles(*(getattr(self, f.name) * n for f in fields(self)))

    def to_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


@dataclass
class Cost:
    """Cycles of one program node: wall-clock `total` and busy cycles per IPU."""
    total: int = 0
    per_ipu: dict[int, Cycles] = field(default_factory=dict)
    exchange_bytes: int = 0
    inter_ipu_bytes: int = 0
    host_bytes: int = 0

    def add(self, other: "Cost", times: int = 1) -> None:
        self.total += other.total * times
        for ipu, c in other.per_ipu.items():
            self.per_ipu[ipu] = self.per_ipu.get(ipu, Cycles()) + c * times
        self.exchange_bytes += other.exchange_bytes * times
        self.inter_ipu_bytes += other.inter_ipu_bytes * times
        self.host_bytes += other.host_bytes * times


def overlapped(parts: list[dict[int, Cycles]]) -> dict[int, Cycles]:
    """Busy cycles per IPU of the branches of a `Parallel`, which run at the same time: an IPU in
    several branches (sending one inter-IPU copy while receiving another, over full-duplex links)
    is busy as long as its longest branch."""
    out: dict[int, Cycles] = {}
    for part in parts:
        for ipu, c in part.items():
            if ipu not in out or c.total > out[ipu].total:
                out[ipu] = c
    return out


def exchange_cycles(src: Tensor, dst: Tensor, target: Target) -> tuple[int, int]:
    """(cycles, bytes received across tiles) of an on-chip copy from src to dst.

    The exchange takes as long as its busiest tile: the most bytes a tile receives, or sends.
    A tile sends each element once even when several tiles receive it (exchange broadcast), so a
    source element counts once per sender however many copies of it the destination holds.
    """
    s = src.on(src.var.mapping).reshape(-1)  # int16 tiles: no widening copy
    d = dst.on(dst.var.mapping).reshape(-1)
    size = src.dtype.itemsize
    moved = s != d
    n = target.num_tiles
    if src.distinct:  # every source element once: its tile is s
        sent = np.bincount(s[moved], minlength=n)
    else:  # a source element sent to several tiles is sent once
        mask = np.zeros(src.var.numel, dtype=bool)
        mask[src.elements()[moved]] = True
        sent = np.bincount(src.var.mapping[mask], minlength=n)
    recv = np.bincount(d[moved], minlength=n)
    local = np.bincount(d[~moved], minlength=n)
    worst = int(max(sent.max(initial=0), recv.max(initial=0))) * size
    cycles = math.ceil(worst / target.exchange_bytes_per_cycle)
    cycles += math.ceil(int(local.max(initial=0)) * size / target.local_copy_bytes_per_cycle)
    return cycles, int(moved.sum()) * size


def estimate(program: Program, target: Target, num_ipus: int, memo: dict | None = None) -> Cost:
    """Static cost of a program node (cached per node in `memo`, keyed by id)."""
    memo = {} if memo is None else memo
    key = id(program)
    if key in memo:
        return memo[key][1]
    cost = _estimate(program, target, num_ipus, memo)
    memo[key] = (program, cost)  # keep the node alive so its id stays unique
    return cost


def _leaf(ipus, total: int, kind: str, **bytes_) -> Cost:
    return Cost(total, {i: Cycles(**{kind: total}) for i in ipus}, **bytes_)


def _estimate(p: Program, target: Target, num_ipus: int, memo: dict) -> Cost:
    sync = target.sync_cycles
    gsync = target.global_sync_cycles(num_ipus)
    if isinstance(p, Execute):
        compute = int(p.compute_set.tile_cycles(target).max(initial=0))
        return Cost(compute + sync, {p.compute_set.ipu: Cycles(compute=compute, sync=sync)})
    if isinstance(p, Copy):
        cyc, nbytes = exchange_cycles(p.src, p.dst, target)
        return Cost(cyc + sync, {p.src.ipu: Cycles(exchange=cyc, sync=sync)}, exchange_bytes=nbytes)
    if isinstance(p, InterIpuCopy):
        cyc = target.inter_ipu_cycles(p.src.nbytes)
        return Cost(cyc + gsync, {i: Cycles(inter_ipu=cyc, sync=gsync) for i in (p.src.ipu, p.dst.ipu)},
                    inter_ipu_bytes=p.src.nbytes)
    if isinstance(p, StreamCopy):
        cyc = target.host_cycles(p.tensor.nbytes)
        return Cost(cyc + gsync, {p.tensor.ipu: Cycles(host=cyc, sync=gsync)}, host_bytes=p.tensor.nbytes)
    if isinstance(p, RemoteCopy):
        cyc = target.streaming_memory_cycles(p.tensor.nbytes)
        return Cost(cyc + sync, {p.tensor.ipu: Cycles(host=cyc, sync=sync)}, host_bytes=p.tensor.nbytes)
    if isinstance(p, Sync):
        cyc = gsync if p.global_ else sync
        ipus = range(num_ipus) if p.global_ else [p.ipu]
        return _leaf(ipus, cyc, "sync")
    if isinstance(p, Repeat):
        out = Cost()
        out.add(estimate(p.body, target, num_ipus, memo), p.count)
        return out
    if isinstance(p, If):
        # Static worst case; the Engine charges the branch it actually runs.
        a, b = (estimate(c, target, num_ipus, memo) for c in (p.then, p.else_))
        return a if a.total >= b.total else b
    if isinstance(p, Parallel):
        parts = [estimate(c, target, num_ipus, memo) for c in p.programs]
        out = Cost(max((c.total for c in parts), default=0), overlapped([c.per_ipu for c in parts]))
        for c in parts:
            out.exchange_bytes += c.exchange_bytes
            out.inter_ipu_bytes += c.inter_ipu_bytes
            out.host_bytes += c.host_bytes
        return out
    if isinstance(p, (Sequence, OpProgram)):
        out = Cost()
        for c in p.children():
            out.add(estimate(c, target, num_ipus, memo))
        return out
    raise TypeError(f"cannot estimate cycles of {type(p).__name__}")
