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
from .mapping import TileMap, distinct_exchange, union_length
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

    def __add__(self, other: "Cycles") -> "Cycles":  # spelled out: runs once per op and step
        return Cycles(self.compute + other.compute, self.exchange + other.exchange, self.sync + other.sync,
                      self.inter_ipu + other.inter_ipu, self.host + other.host)

    def __mul__(self, n: int) -> "Cycles":
        return Cycles(self.compute * n, self.exchange * n, self.sync * n, self.inter_ipu * n, self.host * n)

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
    Work is per run of the source's elements and per run of its mapping, once for every distinct
    run however many destinations receive it (`routes`).
    """
    n = target.total_tiles
    dst_map = dst.tile_map()
    if src.distinct and src.blocks is None and src.var.mapping.mapped and dst_map.mapped:
        # every element sent once: one walk over the runs
        starts, lengths = src.runs()
        m = src.var.mapping
        sent, recv, local = distinct_exchange(starts, lengths, m.starts, m.tiles, m.size, dst_map.starts,
                                              dst_map.tiles, dst_map.size, n)
        moved_total = int(recv.sum())
    else:
        r = routes(src, dst_map)
        moved = r.lengths - r.local
        recv = np.bincount(r.dst_tile, weights=moved, minlength=n)
        local = np.bincount(r.dst_tile, weights=r.local, minlength=n)
        sent = union_length(r.piece_first[r.piece_moved], r.piece_length[r.piece_moved], r.piece_tile[r.piece_moved],
                            n)
        moved_total = int(moved.sum())
    size = src.dtype.itemsize
    worst = int(max(sent.max(initial=0), recv.max(initial=0))) * size
    cycles = math.ceil(worst / target.exchange_bytes_per_cycle)
    cycles += math.ceil(int(local.max(initial=0)) * size / target.local_copy_bytes_per_cycle)
    return cycles, moved_total * size


@dataclass
class Routes:
    """Where the elements of a copy go. The copy is cut into *deliveries*: a run of consecutive
    source elements all received by one tile (`dst_tile`), `local` of them already there. The
    distinct runs delivered are cut into *pieces* on one source tile each (`piece_tile`), with
    `piece_moved` when some delivery takes the piece's elements off their tile."""
    lengths: np.ndarray
    dst_tile: np.ndarray
    local: np.ndarray
    piece_first: np.ndarray
    piece_length: np.ndarray
    piece_tile: np.ndarray
    piece_moved: np.ndarray


def routes(src: Tensor, dst: TileMap) -> Routes:
    """The deliveries and pieces of a copy from `src` to a tensor whose positions live on `dst`
    (see `Routes`)."""
    by_block = src.block_deliveries(dst)
    if by_block is not None:  # operand blocks, each sent whole to tiles: one delivery per block sent
        dst_tile, local, (block, piece_first, piece_length, piece_tile) = by_block
        sequence = src.blocks[3]
        pair, first = _groups(sequence, dst_tile)  # distinct (block, destination) pairs
        blocks = src.blocks[2].size
        destinations = np.bincount(sequence[first], minlength=blocks)
        only = np.full(blocks, -2, np.int64)
        only[sequence[first]] = dst_tile[first]
        piece_moved = (destinations[block] > 1) | ((destinations[block] == 1) & (only[block] != piece_tile))
        return Routes(src.blocks[4][sequence], dst_tile, local, piece_first, piece_length, piece_tile, piece_moved)
    _, element, length, dst_tile = src.deliveries(dst)
    if src.distinct:  # every delivery its own run
        which = np.arange(element.size)
        runs_first, runs_length = element, length
    else:  # one distinct run for all deliveries of the same elements (an operand block sent to many tiles)
        which, first = _groups(element, length)
        runs_first, runs_length = element[first], length[first]
    run, piece_first, piece_length, piece_tile = src.var.mapping.pieces(runs_first, runs_length)
    num_runs = runs_first.size
    # runs whose elements all live on one tile (most): that tile, else -2
    tile_of_run = np.full(num_runs, -2, np.int64)
    one = np.bincount(run, minlength=num_runs) == 1
    tile_of_run[run[one[run]]] = piece_tile[one[run]]
    local = np.where(tile_of_run[which] == dst_tile, length, 0)
    mixed = np.flatnonzero(tile_of_run[which] == -2)  # deliveries of runs spread over tiles
    if mixed.size:
        key_tiles = int(max(piece_tile.max(initial=0), dst_tile.max(initial=0))) + 2  # tile + 1 as a digit
        on_tile, sums = _sum_by(run * key_tiles + piece_tile + 1, piece_length)  # elements of a run on a tile
        key = which[mixed] * key_tiles + dst_tile[mixed] + 1
        hit = np.searchsorted(on_tile, key).clip(max=on_tile.size - 1)
        local[mixed] = np.where(on_tile[hit] == key, sums[hit], 0)
    # a piece is moved when some delivery of its run goes to another tile
    if src.distinct:
        piece_moved = piece_tile != dst_tile[run]
    else:
        pair, first = _groups(which, dst_tile)  # distinct (run, destination) pairs
        destinations = np.bincount(which[first], minlength=num_runs)
        only = np.full(num_runs, -2, np.int64)
        only[which[first]] = dst_tile[first]  # meaningful where a run has one destination
        piece_moved = (destinations[run] > 1) | (only[run] != piece_tile)
    return Routes(length, dst_tile, local, piece_first, piece_length, piece_tile, piece_moved)


def _groups(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Equal (a[i], b[i]) pairs grouped: (group of each i, the first i of each group), groups in
    order of their pairs; by one stable sort (fast on the nearly sorted arrays copies make)."""
    low, span = int(b.min(initial=0)), int(b.max(initial=0)) - int(b.min(initial=0)) + 1
    if a.size and int(a.max()) < np.iinfo(np.int64).max // span - 1 and int(a.min()) >= 0:
        key = a * span + (b - low)  # one key: a stable sort of it is the lexicographic order
        order = np.argsort(key, kind="stable")
        key = key[order]
        new = np.ones(order.size, bool)
        new[1:] = key[1:] != key[:-1]
    else:
        order = np.lexsort((b, a))
        a, b = a[order], b[order]
        new = np.ones(order.size, bool)
        new[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    group = np.empty(order.size, np.int64)
    group[order] = np.cumsum(new) - 1
    return group, order[new]


def _sum_by(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys in increasing order, the sum of `values` for each)."""
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    first = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1]))) if keys.size else np.zeros(0, np.int64)
    return keys[first], np.add.reduceat(values[order], first).astype(np.int64) if first.size else np.zeros(0, np.int64)


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
