"""Memory per tile: always-live tensors, not-always-live tensors at their liveness peak, vertex
state and code; and the out-of-memory error Poplar users know.

Liveness: the program is flattened into its supersteps in order (a Repeat body once, both
branches of an If). A not-always-live tensor is live from the first superstep that touches it
to the last, except that a `RemoteCopy` loading it from Streaming Memory starts a new live range
(the tensor's previous contents are dead): a tensor kept off chip occupies tiles only between
its load and its last use. A range that reaches into a loop (`Repeat`) from outside it, or out
of it, covers the whole body: the tensor is live on every iteration (a loop-carried state, a
tensor every iteration reads), not only up to where the body last touches it. The peak of a tile
is the most bytes live on it at any superstep; per category (temporaries, activations, ...), the
most bytes of it live on the IPU at once.
Remote buffers are reported as off-chip bytes per IPU, outside tile memory.

Kinds: every byte of a tile's peak belongs to one kind (`KINDS`): its tensor's category, except
that temporaries an on-chip exchange (`Copy`) fills are `exchange_buffers` (an op's operands
gathered to the tiles that use them), plus vertex state and code. `peak_by_kind` splits each
tile's peak this way at the superstep where the tile peaks, so the kinds add up to the peak.
Estimates not published by Graphcore: vertex state = 8 bytes per field (pointer and size) +
4 bytes per parameter; code = CODELET_BYTES per distinct codelet on a tile (the instantiations of
a templated codelet, such as the matmul partials vertex for its operand layouts, count once).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .program import Copy, CrossReplicaCopy, Execute, InterIpuCopy, Program, RemoteCopy, Repeat, StreamCopy, walk
from .target import Target
from .mapping import tile_counts
from .tensor import Variable

KINDS = ("weights", "activations", "stashed_activations", "optimiser_state", "gradients", "accumulators",
         "exchange_buffers", "temporaries", "constants", "host_io", "other", "vertex_state", "code")
CODELET_BYTES = 256
FIELD_BYTES = 8
PARAM_BYTES = 4


@dataclass
class MemoryReport:
    """Bytes per tile of one IPU."""
    ipu: int
    target: Target
    always_live: np.ndarray
    not_always_live_peak: np.ndarray
    vertex_state: np.ndarray
    code: np.ndarray
    by_category: dict[str, np.ndarray]
    tensors: dict[str, np.ndarray] = field(repr=False)  # tensor name -> bytes per tile
    liveness: np.ndarray = field(repr=False, default=None)  # live not-always-live bytes per superstep
    off_chip_bytes: int = 0                                  # remote buffers in Streaming Memory
    peak_by_kind: dict[str, np.ndarray] = field(repr=False, default_factory=dict)  # KINDS -> bytes per tile
    peak_superstep: np.ndarray = field(repr=False, default=None)   # per tile: where it peaks (-1: nothing live)
    kinds: dict[str, str] = field(repr=False, default_factory=dict)          # tensor name -> kind
    live_ranges: dict[str, list] = field(repr=False, default_factory=dict)   # tensor name -> [first, last]
                                                                             # supersteps (absent: always live)
    live_peak_by_category: dict[str, int] = field(default_factory=dict)  # not-always-live bytes, most at once

    @property
    def peak(self) -> np.ndarray:
        """Peak bytes per tile."""
        return self.always_live + self.not_always_live_peak + self.vertex_state + self.code

    @property
    def total(self) -> int:
        return int(self.peak.sum())

    @property
    def max_tile(self) -> int:
        return int(self.peak.max(initial=0))

    @property
    def fits(self) -> bool:
        return self.max_tile <= self.target.bytes_per_tile

    def largest_tensors(self, tile: int, n: int = 3) -> list[tuple[str, int]]:
        rows = [(name, int(b[tile])) for name, b in self.tensors.items() if b[tile]]
        return sorted(rows, key=lambda r: -r[1])[:n]

    def is_live(self, name: str, superstep: int) -> bool:
        """Whether the tensor occupies its tiles at `superstep` (always-live tensors always do)."""
        ranges = self.live_ranges.get(name)
        return ranges is None or any(first <= superstep <= last for first, last in ranges)

    def live_tensors(self, superstep: int, tile: int | None = None) -> list[tuple[str, str, int]]:
        """(name, kind, bytes) of the tensors live at `superstep`, on `tile` or on all tiles,
        largest first; always-live tensors included."""
        rows = []
        for name, b in self.tensors.items():
            nbytes = int(b[tile]) if tile is not None else int(b.sum())
            if nbytes and self.is_live(name, superstep):
                rows.append((name, self.kinds.get(name, "other"), nbytes))
        return sorted(rows, key=lambda r: (-r[2], r[0]))

    def summary(self) -> str:
        cap = self.target.bytes_per_ipu
        return (f"IPU {self.ipu}: {self.total / 2**20:.2f} MiB of {cap / 2**20:.1f} MiB "
                f"({100 * self.total / cap:.2f}%), busiest tile {self.max_tile} B of {self.target.bytes_per_tile} B")

    def to_dict(self) -> dict:
        return {"ipu": self.ipu, "total_bytes": self.total, "max_tile_bytes": self.max_tile,
                "capacity_bytes": self.target.bytes_per_ipu,
                "always_live_bytes": int(self.always_live.sum()),
                "not_always_live_peak_bytes": int(self.not_always_live_peak.sum()),
                "vertex_state_bytes": int(self.vertex_state.sum()), "code_bytes": int(self.code.sum()),
                "off_chip_bytes": self.off_chip_bytes,
                "by_category": {k: int(v.sum()) for k, v in self.by_category.items()},
                "live_peak_by_category": dict(self.live_peak_by_category),
                "per_tile_bytes": self.peak.tolist()}


class OutOfMemoryError(MemoryError):
    """A tile needs more memory than the target has; `.reports` keeps the memory reports."""

    def __init__(self, message: str, reports: list[MemoryReport]):
        super().__init__(message)
        self.reports = reports


def tile_bytes(var: Variable, num_tiles: int) -> np.ndarray:
    """Bytes of the variable on each tile (unmapped elements on none), from the runs of its mapping."""
    return var.mapping.counts(num_tiles) * var.dtype.itemsize


SUPERSTEPS = (Execute, Copy, InterIpuCopy, CrossReplicaCopy, StreamCopy, RemoteCopy)


def supersteps(program: Program) -> list[Program]:
    return [p for p in walk(program) if isinstance(p, SUPERSTEPS)]


def loop_spans(programs: list[Program]) -> list[tuple[int, int]]:
    """[first, last] superstep of the body of every Repeat of more than one iteration, in the
    numbering of `supersteps` over `programs` in turn."""
    spans, at = [], 0

    def visit(p: Program) -> None:
        nonlocal at
        first = at
        if isinstance(p, SUPERSTEPS):
            at += 1
        for c in p.children():
            visit(c)
        if isinstance(p, Repeat) and p.count > 1 and at > first:
            spans.append((first, at - 1))

    for p in programs:
        visit(p)
    return spans


def touched(step: Program) -> list[Variable]:
    if isinstance(step, Execute):
        return [v for table in step.compute_set.tables for v in table.variables()]
    if isinstance(step, (StreamCopy, RemoteCopy)):
        return [step.tensor.var]
    return [step.src.var, step.dst.var]


def live_ranges(steps: list[Program], loops: list[tuple[int, int]] = ()) -> dict[int, list[list[int]]]:
    """Variable id -> [first, last] superstep ranges; a remote load opens a new range. A range
    that crosses the bounds of a loop body (`loops`, as `loop_spans`) is widened to all of it."""
    ranges: dict[int, list[list[int]]] = {}
    for i, s in enumerate(steps):
        reload = isinstance(s, RemoteCopy) and s.loads
        for v in touched(s):
            r = ranges.setdefault(v.id, [])
            if not r or reload:
                r.append([i, i])
            else:
                r[-1][1] = i
    for first, last in sorted(loops, key=lambda span: span[0] - span[1]):   # outer loops first
        for rs in ranges.values():
            for r in rs:
                inside = first <= r[0] <= last, first <= r[1] <= last
                if inside[0] != inside[1] and r[0] <= last and r[1] >= first:
                    r[0], r[1] = min(r[0], first), max(r[1], last)
    return ranges


def kind_of(var: Variable, exchanged: set[int]) -> str:
    """The kind (KINDS) of a variable's bytes: its category, or `exchange_buffers` for a
    temporary that an on-chip exchange fills."""
    return "exchange_buffers" if var.category == "temporaries" and var.id in exchanged else var.category


def memory_reports(graphs, programs: list[Program]) -> list[MemoryReport]:
    """One report per IPU graph for the given programs."""
    steps = [s for p in programs for s in supersteps(p)]
    ranges = live_ranges(steps, loop_spans(programs))
    exchanged = {s.dst.var.id for s in steps if isinstance(s, Copy)}
    reports = []
    for g in graphs:
        n = g.target.total_tiles
        zero = lambda: np.zeros(n, dtype=np.int64)  # noqa: E731
        always, by_cat, per_tensor = zero(), {}, {}
        kinds, tensor_ranges = {}, {}
        by_kind = {k: zero() for k in KINDS}
        starts: dict[int, list[np.ndarray]] = {}
        ends: dict[int, list[np.ndarray]] = {}
        # variables with one tile map and itemsize (a stash's slots, repeated layers) share one
        # read-only array of bytes per tile: memory follows the distinct maps, not the variables
        shared: dict[tuple[bytes, int], np.ndarray] = {}
        by_step: dict[str, np.ndarray] = {}   # category -> change of its live bytes at each superstep
        for v in g.variables:
            key = (v.mapping.digest, v.dtype.itemsize)
            b = shared.get(key)
            if b is None:
                b = shared[key] = tile_bytes(v, n)
                b.flags.writeable = False
            per_tensor[v.name] = b
            kinds[v.name] = kind_of(v, exchanged)
            by_cat[v.category] = by_cat.get(v.category, zero()) + b
            if v.always_live:
                always += b
                by_kind[kinds[v.name]] += b
            else:
                tensor_ranges[v.name] = [tuple(r) for r in ranges.get(v.id, ())]
                delta = by_step.setdefault(v.category, np.zeros(len(steps) + 1, dtype=np.int64))
                for first, last in ranges.get(v.id, ()):
                    starts.setdefault(first, []).append(b)
                    ends.setdefault(last, []).append(b)
                    delta[first] += int(b.sum())
                    delta[last + 1] -= int(b.sum())
        live, peak, curve = zero(), zero(), []
        peak_at = np.full(n, -1, dtype=np.int64)
        for i in range(len(steps)):
            for b in starts.get(i, ()):
                live += b
            if i in starts:
                higher = live > peak
                peak_at[higher] = i
                peak[higher] = live[higher]
            curve.append(int(live.sum()))
            for b in ends.get(i, ()):
                live -= b
        # the not-always-live tensors live at each tile's peak, by kind
        for v in g.variables:
            if v.always_live:
                continue
            b = per_tensor[v.name]
            for first, last in tensor_ranges[v.name]:
                at_peak = (peak_at >= first) & (peak_at <= last)
                by_kind[kinds[v.name]] += np.where(at_peak, b, 0)
        state, code = zero(), zero()
        on_tiles: dict[int, np.ndarray] = {}  # codelet -> tiles running at least one of its vertices
        for cs in g.compute_sets:
            for table in cs.tables:
                vt = table.type
                count = tile_counts(table.tiles, n)
                state += count * (FIELD_BYTES * len(vt.fields) + PARAM_BYTES * table.state_params)
                on_tiles[id(vt.kernel)] = on_tiles.get(id(vt.kernel), np.zeros(n, bool)) | (count > 0)
        for used in on_tiles.values():
            code += CODELET_BYTES * used
        by_cat["vertex_state"], by_cat["code"] = state, code
        by_kind["vertex_state"], by_kind["code"] = state, code
        off_chip = sum(b.nbytes * b.repeats for b in g.remote_buffers.values())
        live_peaks = {cat: int(np.cumsum(d).max(initial=0)) for cat, d in by_step.items()}
        reports.append(MemoryReport(g.ipu, g.target, always, peak, state, code, by_cat, per_tensor,
                                    np.asarray(curve, dtype=np.int64), off_chip, by_kind, peak_at, kinds,
                                    tensor_ranges, live_peaks))
    return reports


def check_fits(reports: list[MemoryReport], worst: int = 5) -> None:
    """Raise OutOfMemoryError naming the worst tiles and their largest tensors."""
    over = [(r, t) for r in reports for t in np.flatnonzero(r.peak > r.target.bytes_per_tile)]
    if not over:
        return
    over.sort(key=lambda rt: -int(rt[0].peak[rt[1]]))
    lines = [f"Out of memory: {len(over)} tile(s) exceed the {reports[0].target.bytes_per_tile} bytes "
             f"of a {reports[0].target.name} tile. Worst tiles:"]
    for r, t in over[:worst]:
        tensors = ", ".join(f"{name} ({b} B)" for name, b in r.largest_tensors(int(t)))
        lines.append(f"  IPU {r.ipu} tile {int(t)}: {int(r.peak[t])} B "
                     f"(always-live {int(r.always_live[t])}, not-always-live peak {int(r.not_always_live_peak[t])}, "
                     f"vertex state {int(r.vertex_state[t])}, code {int(r.code[t])}); largest: {tensors}")
    lines.append("Spread the largest tensors over more tiles, split the model over more IPUs, "
                 "or move tensors off chip.")
    raise OutOfMemoryError("\n".join(lines), reports)
