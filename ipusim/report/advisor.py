"""Balance advice: the contiguous split of a model's blocks into pipeline stages that minimises
the run time of a call while every IPU fits in memory, and its predicted speedup.

The model is built from a *block table*: for every block (in pipeline order) the cycles of its
forward and backward body for one micro-batch and of its weight update, the bytes it needs on
every tile without its channel buffers, and the values that flow between blocks. A candidate
split puts stage k (blocks [b_k, b_k+1)) on IPU k. Its cost model:

- an op of stage k costs the bodies of its blocks, plus every value crossing into or out of it
  (between IPUs: IPU-Link time and a global sync, paid by both ends; on one IPU, the stash
  from forward to backward: an exchange and a sync) and, when a channel holds several
  micro-batches, the copy out of its slot;
- the schedule of the strategy (ipusim.schedules) runs the ops; a step lasts as long as its
  slowest op, and a call as long as its steps;
- memory: the blocks' bytes per tile plus every channel's buffers (value bytes times the
  micro-batches the schedule keeps in flight on it), mapped linearly as the lowering does;
- recomputation (a pipeline that recomputes, as PopTorch's does by default over several IPUs):
  every stage but the last recomputes its forward before its backward, in the same step, so its
  backward op also costs its forward body, and it stashes the values entering the stage (from
  the forwards of earlier stages) instead of what its backward reads from its own forward.

A model whose last stage returns to the first IPU (BERT's and GPT's heads, tied to the embedding
on IPU 0) has a *tail*: its block table's last entry is that stage, which every split keeps as one
more stage on IPU 0 while the other blocks are split contiguously over the IPUs. An IPU holding
two stages runs their ops of a step one after the other and holds the memory of both.

Splits are enumerated when there are few enough (EXHAUSTIVE_LIMIT), otherwise a dynamic program
on the stage bottleneck gives a start that a local search improves. The current split is always
a candidate, so the advice is never worse than it under the model.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .. import schedules
from ..device.target import Target

EXHAUSTIVE_LIMIT = 2000
ADVISED_KINDS = {"GPipe": schedules.gpipe_schedule, "1F1B": schedules.one_f_one_b_schedule}


@dataclass(frozen=True)
class Flow:
    """A value made by one block's pass and used by another's (`src`, `dst`: (pass, block) with
    pass "fwd" or "bwd")."""
    value: int
    nbytes: int
    src: tuple[str, int]
    dst: tuple[str, int]


@dataclass
class BlockTable:
    """What the advisor knows about each block, in pipeline order."""
    names: list[str]
    forward: list[float]            # cycles of the forward body per micro-batch
    backward: list[float]           # cycles of the backward body per micro-batch (0 in inference)
    update: list[float]             # cycles of the weight update per group
    tile_bytes: np.ndarray          # [block, tile] bytes without channel buffers
    flows: list[Flow]
    current_split: list[int] | None  # blocks per stage of the profiled placement (stage k on IPU k), tail aside
    source: str = ""                # how the table was measured
    tail: bool = False              # the last entry is a stage of its own on IPU 0, after the others

    def __post_init__(self):
        n = len(self.names)
        self.tile_bytes = np.asarray(self.tile_bytes, dtype=np.int64)
        for name, seq in (("forward", self.forward), ("backward", self.backward), ("update", self.update)):
            if len(seq) != n:
                raise ValueError(f"block table: {len(seq)} {name} costs for {n} blocks")
        if self.tile_bytes.ndim != 2 or self.tile_bytes.shape[0] != n:
            raise ValueError(f"block table: tile_bytes must be [blocks, tiles], got shape {self.tile_bytes.shape}")
        if self.current_split is not None and (sum(self.current_split) != self.num_free or
                                               min(self.current_split) < 1):
            raise ValueError(f"block table: current split {self.current_split} does not cover {self.num_free} blocks")

    @property
    def num_blocks(self) -> int:
        return len(self.names)

    @property
    def num_free(self) -> int:
        """The blocks a split distributes (all but the tail)."""
        return len(self.names) - int(self.tail)

    def to_dict(self) -> dict:
        return {"names": list(self.names), "forward_cycles": [float(x) for x in self.forward],
                "backward_cycles": [float(x) for x in self.backward], "update_cycles": [float(x) for x in self.update],
                "tile_bytes": self.tile_bytes.tolist(),
                "flows": [{"value": f.value, "bytes": f.nbytes, "src_pass": f.src[0], "src_block": f.src[1],
                           "dst_pass": f.dst[0], "dst_block": f.dst[1]} for f in self.flows],
                "current_split": None if self.current_split is None else list(self.current_split),
                "source": self.source, "tail": self.tail}

    @classmethod
    def from_dict(cls, d: dict) -> "BlockTable":
        return cls(list(d["names"]), list(d["forward_cycles"]), list(d["backward_cycles"]), list(d["update_cycles"]),
                   np.asarray(d["tile_bytes"], dtype=np.int64),
                   [Flow(f["value"], f["bytes"], (f["src_pass"], f["src_block"]), (f["dst_pass"], f["dst_block"]))
                    for f in d["flows"]],
                   None if d["current_split"] is None else list(d["current_split"]), d.get("source", ""),
                   bool(d.get("tail", False)))


@dataclass(frozen=True)
class Pipeline:
    """How the stages run: the strategy's schedule parameters."""
    training: bool
    gradient_accumulation: int = 1
    device_iterations: int = 1
    strategy: str = "pipelined"     # "pipelined", "sharded", "GPipe" or "1F1B"
    kind: str = "grouped"           # pipelined schedules: "grouped", "interleaved", "sequential"
    recompute: bool = False         # every stage but the last recomputes its forward before its backward

    def schedule(self, num_stages: int, stage_ipus: tuple[int, ...] | None = None) -> schedules.Schedule:
        g = self.gradient_accumulation if self.training else 1
        if self.strategy in ADVISED_KINDS:
            if stage_ipus is not None and len(set(stage_ipus)) != len(stage_ipus):
                raise ValueError(f"balance advice for {self.strategy} places one stage per IPU; this model's last "
                                 "stage returns to IPU 0")
            return ADVISED_KINDS[self.strategy](num_stages, gradient_accumulation=g,
                                                device_iterations=self.device_iterations)
        if self.strategy in schedules.TRAINING_KINDS:
            raise ValueError(f"balance advice splits blocks into one stage per IPU with whole backwards; it does not "
                             f"cover {self.strategy} (compare schedules with python -m ipusim.report DIR --schedules)")
        if self.strategy == "sharded":
            return schedules.sharded_schedule(num_stages, training=self.training, gradient_accumulation=g,
                                              device_iterations=self.device_iterations, stage_ipus=stage_ipus)
        if self.strategy == "pipelined":
            return schedules.pipelined_schedule(num_stages, training=self.training, gradient_accumulation=g,
                                                device_iterations=self.device_iterations, kind=self.kind,
                                                stage_ipus=stage_ipus)
        raise ValueError(f"balance advice covers pipelined and sharded execution, not {self.strategy!r}")

    @classmethod
    def of_schedule(cls, schedule_dict: dict) -> "Pipeline":
        """From a profile's execution.schedule section."""
        strategy = schedule_dict["strategy"]
        base, _, kind = strategy.partition("-")
        training = schedule_dict["training"]
        per_group, groups = schedule_dict["micro_batches_per_group"], schedule_dict["num_groups"]
        if strategy in schedules.TRAINING_KINDS:
            base, kind = strategy, ""
        return cls(training, per_group if training else 1, groups if training else per_group,
                   base, kind or "grouped", bool(schedule_dict.get("recomputed_stages")))


@dataclass
class Prediction:
    """The modelled call of one split."""
    split: tuple[int, ...]
    stages: list[list[str]]
    cycles: int                       # per call
    forward: list[int]                # op cycles per stage
    backward: list[int]
    update: list[int]
    max_tile_bytes: list[int]         # busiest tile per IPU
    fits: bool
    stage_ipus: tuple[int, ...] = ()  # the IPU of each stage (default stage k on IPU k)

    def ipu_blocks(self) -> list[list[str]]:
        """The blocks of each IPU, its stages in pipeline order."""
        ipus = self.stage_ipus or tuple(range(len(self.stages)))
        out: list[list[str]] = [[] for _ in range(max(ipus) + 1)]
        for names, ipu in zip(self.stages, ipus):
            out[ipu] += names
        return out

    @property
    def bottleneck_stage(self) -> int:
        return int(np.argmax([f + b for f, b in zip(self.forward, self.backward)]))


@dataclass
class Advice:
    """The best split on `num_ipus` IPUs against the current one."""
    num_ipus: int
    best: Prediction | None
    current: Prediction | None
    measured_cycles: int | None
    candidates: int
    exhaustive: bool
    clock_hz: float
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        """Predicted current time / predicted best time (same model for both)."""
        if self.best is None or self.current is None or not self.best.cycles:
            return None
        return self.current.cycles / self.best.cycles

    def text(self) -> str:
        lines = [f"Balance advice for {self.num_ipus} IPU{'s' if self.num_ipus != 1 else ''} "
                 f"({'all' if self.exhaustive else 'a search over'} {self.candidates:,} contiguous splits):"]
        if self.best is None:
            lines.append("  no split fits in memory" + (f": {self.notes[0]}" if self.notes else ""))
            return "\n".join(lines)

        def describe(p: Prediction) -> str:
            return " | ".join(f"IPU{k}: {', '.join(s)}" for k, s in enumerate(p.ipu_blocks()))

        b, c = self.best, self.current
        if c is not None:
            lines.append(f"  current  {describe(c)}")
            lines.append(f"           predicted {c.cycles:,} cycles per call"
                         + (f" (measured {self.measured_cycles:,}; the advice's block-by-block estimate is "
                            f"{100 * (c.cycles - self.measured_cycles) / self.measured_cycles:+.1f}% off the run)"
                            if self.measured_cycles else ""))
        if c is not None and tuple(b.split) == tuple(c.split) and len(c.split) == self.num_ipus:
            lines.append("  the current split is already the best contiguous split under the model")
        else:
            lines.append(f"  proposed {describe(b)}")
            lines.append(f"           predicted {b.cycles:,} cycles per call"
                         + (f", speedup x{self.speedup:.2f} over the current split" if self.speedup else ""))
            lines.append("           stage op cycles (F/B): " + ", ".join(
                f"{f:,}/{bb:,}" if bb else f"{f:,}" for f, bb in zip(b.forward, b.backward)))
            lines.append("           busiest tile per IPU: " + ", ".join(f"{m:,} B" for m in b.max_tile_bytes))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# =========================================================================================
# The model
# =========================================================================================
@lru_cache(maxsize=4096)
def linear_tile_bytes(nbytes: int, num_tiles: int, itemsize: int = 4, grain: int = 4,
                      min_elements_per_tile: int = 64) -> np.ndarray:
    """Bytes per tile of a buffer spread like Graph.map_linearly(grain=4, min_elements_per_tile=64)
    (cached: treat the result as read-only)."""
    out = np.zeros(num_tiles, dtype=np.int64)
    n = -(-nbytes // itemsize)
    if n <= 0:
        return out
    grains = -(-n // grain)
    per_tile = max(-(-grains // num_tiles), -(-min_elements_per_tile // grain)) * grain
    full, rest = divmod(n, per_tile)
    out[:full] = per_tile * itemsize
    if rest and full < num_tiles:
        out[full] = rest * itemsize
    return out


def in_flight(schedule: schedules.Schedule, src: tuple[str, int], dst: tuple[str, int]) -> int:
    """The most micro-batches a channel from stage program `src` to `dst` holds at once: from the
    step its producer runs a micro-batch to the step its consumer does."""
    when: dict[tuple, dict[int, int]] = {}
    for t, step in enumerate(schedule.steps):
        for op in step.ops:
            if op.kind in ("F", "B"):
                when.setdefault(("fwd" if op.kind == "F" else "bwd", op.stage), {})[op.global_micro_batch] = t
    a, b = when.get(src, {}), when.get(dst, {})
    events = sorted([(t, 1) for k, t in a.items() if k in b] + [(b[k] + 1, -1) for k in a if k in b])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return max(1, peak)


class _Model:
    """Evaluates splits of one block table under one pipeline on one target."""

    def __init__(self, table: BlockTable, target: Target, pipeline: Pipeline):
        self.table, self.target, self.pipeline = table, target, pipeline
        self.prefix = np.vstack([np.zeros((1, table.tile_bytes.shape[1]), np.int64), np.cumsum(table.tile_bytes, 0)])
        self._schedules: dict[int, tuple] = {}
        self._slots: dict[tuple, int] = {}

    def stage_ipus(self, n: int) -> tuple[int, ...]:
        """The IPU of each of the n stages: stage k on IPU k, a tail stage back on IPU 0."""
        return tuple(range(n - 1)) + (0,) if self.table.tail else tuple(range(n))

    def schedule(self, n: int):
        """(schedule, index array [step, IPU, op] into the op-cost vector [F.., B.., W.., 0]) of n stages."""
        if n not in self._schedules:
            ipus = self.stage_ipus(n)
            s = self.pipeline.schedule(n, ipus if self.table.tail else None)
            per_ipu: list[dict[int, list[int]]] = []
            for st in s.steps:
                mine: dict[int, list[int]] = {}
                for op in st.ops:
                    k = {"F": 0, "B": n, "U": 2 * n}[op.kind] + (op.stage if op.kind != "U" else op.ipu)
                    mine.setdefault(op.ipu if op.kind == "U" else ipus[op.stage], []).append(k)
                per_ipu.append(mine)
            width = max((len(v) for m in per_ipu for v in m.values()), default=1)
            idx = np.full((len(s.steps), max(ipus) + 1, width), 3 * n, dtype=np.int64)
            for t, mine in enumerate(per_ipu):
                for ipu, ks in mine.items():
                    idx[t, ipu, :len(ks)] = ks
            self._schedules[n] = (s, idx)
        return self._schedules[n]

    def slots(self, n: int, src, dst) -> int:
        key = (n, src, dst)
        if key not in self._slots:
            self._slots[key] = in_flight(self.schedule(n)[0], src, dst)
        return self._slots[key]

    def channels(self, stage_of: np.ndarray) -> dict[tuple, dict[int, int]]:
        """(src key, dst key) -> {value: bytes} of the values crossing stage programs. With
        recomputation, a recomputed stage's backward reads no forward value (the recomputation
        makes or receives them) and its forward stashes the values entering it."""
        out: dict[tuple, dict[int, int]] = {}
        last = int(stage_of[-1]) if len(stage_of) else 0
        for f in self.table.flows:
            src, dst = (f.src[0], int(stage_of[f.src[1]])), (f.dst[0], int(stage_of[f.dst[1]]))
            if self.pipeline.recompute and dst[0] == "bwd" and dst[1] != last and src[0] == "fwd":
                continue
            if src != dst:
                out.setdefault((src, dst), {})[f.value] = f.nbytes
            if self.pipeline.recompute and src[0] == dst[0] == "fwd" and src[1] != dst[1] != last:
                out.setdefault((dst, ("bwd", dst[1])), {})[f.value] = f.nbytes   # the stash of the stage's input
        return out

    def evaluate(self, split: tuple[int, ...]) -> Prediction:
        """The modelled call of `split` (blocks per IPU, the tail aside)."""
        t, table = self.target, self.table
        stages = tuple(split) + ((1,) if table.tail else ())
        n = len(stages)
        ipus = self.stage_ipus(n)
        bounds = np.concatenate([[0], np.cumsum(stages)])
        stage_of = np.repeat(np.arange(n), stages)
        fwd = np.array([sum(table.forward[bounds[k]:bounds[k + 1]]) for k in range(n)], dtype=float)
        bwd = np.array([sum(table.backward[bounds[k]:bounds[k + 1]]) for k in range(n)], dtype=float)
        upd = np.array([sum(table.update[bounds[k]:bounds[k + 1]]) for k in range(n)], dtype=float)
        if self.pipeline.recompute and self.pipeline.training:
            bwd[:-1] += fwd[:-1]   # R: the stage's forward body again, before its backward in the same step
        memory = [self.prefix[bounds[k + 1]] - self.prefix[bounds[k]] for k in range(n)]
        gsync = t.global_sync_cycles(len(split))
        tiles = table.tile_bytes.shape[1]
        for (src, dst), values in self.channels(stage_of).items():
            slots = self.slots(n, src, dst)
            for nbytes in values.values():
                spread = linear_tile_bytes(nbytes, tiles)
                if ipus[src[1]] != ipus[dst[1]]:
                    link = t.inter_ipu_cycles(nbytes) + gsync
                    costs = [(src, link), (dst, link)]
                else:
                    costs = [(src, t.sync_cycles + math.ceil(int(spread.max()) / t.exchange_bytes_per_cycle))]
                if slots > 1:
                    costs.append((dst, t.sync_cycles + math.ceil(int(spread.max()) / t.local_copy_bytes_per_cycle)))
                for (pass_, stage), c in costs:
                    (fwd if pass_ == "fwd" else bwd)[stage] += c
                memory[dst[1]] = memory[dst[1]] + spread * slots
        _, idx = self.schedule(n)
        vector = np.concatenate([fwd, bwd, upd, [0.0]])
        cycles = int(round(vector[idx].sum(axis=2).max(axis=1).sum()))   # an IPU runs its ops of a step in turn
        on_ipu = [sum(memory[k] for k in range(n) if ipus[k] == i) for i in range(len(split))]
        peaks = [int(m.max(initial=0)) for m in on_ipu]
        return Prediction(tuple(int(x) for x in split),
                          [table.names[bounds[k]:bounds[k + 1]] for k in range(n)], cycles,
                          [int(round(x)) for x in fwd], [int(round(x)) for x in bwd], [int(round(x)) for x in upd],
                          peaks, all(p <= t.bytes_per_tile for p in peaks), ipus)


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def _bottleneck_start(model: _Model, n: int) -> tuple[int, ...]:
    """The split minimising the largest per-micro-batch work of a stage (dynamic programming)."""
    table = model.table
    work = (np.asarray(table.forward) + np.asarray(table.backward))[:table.num_free]
    prefix = np.concatenate([[0.0], np.cumsum(work)])
    b = table.num_free

    @lru_cache(maxsize=None)
    def best(k: int, j: int) -> tuple[float, tuple[int, ...]]:
        if k == 1:
            return prefix[j], (j,)
        out = (math.inf, ())
        for i in range(k - 1, j):
            cost, split = best(k - 1, i)
            cand = (max(cost, prefix[j] - prefix[i]), split + (j - i,))
            out = min(out, cand)
        return out

    return best(n, b)[1]


def _neighbours(split: tuple[int, ...]):
    for k in range(len(split) - 1):
        for d in (-1, 1):
            a, b = split[k] + d, split[k + 1] - d
            if a >= 1 and b >= 1:
                yield split[:k] + (a, b) + split[k + 2:]


def _key(p: Prediction):
    return (not p.fits, p.cycles, max(p.max_tile_bytes, default=0), p.split)


def advise(table: BlockTable, target: Target, pipeline: Pipeline, num_ipus: int | None = None,
           measured_cycles: int | None = None) -> Advice:
    """The best contiguous split of `table`'s blocks over `num_ipus` IPUs (default: as many as
    the current split uses) against the current split."""
    current_n = len(table.current_split) if table.current_split else None
    n = num_ipus or current_n
    if n is None:
        raise ValueError("the block table has no current split: say how many IPUs to split over (num_ipus=)")
    free = table.num_free
    if not 1 <= n <= free:
        raise ValueError(f"{free} block(s) cannot fill {n} pipeline stages: split the model into at least "
                         f"{n} blocks (poptorch.BeginBlock / Block) or ask for at most {free} IPUs")
    stages = n + int(table.tail)
    if pipeline.training and pipeline.strategy == "pipelined" and pipeline.gradient_accumulation < 2 * stages - 1:
        raise ValueError(f"a training pipeline of {stages} stages over {n} IPUs needs gradient_accumulation >= "
                         f"{2 * stages - 1} (it is {pipeline.gradient_accumulation}): advise for fewer IPUs or raise "
                         "options.Training.gradientAccumulation")
    if not pipeline.training and pipeline.strategy == "pipelined" and pipeline.device_iterations < stages:
        raise ValueError(f"pipelined inference of {stages} stages over {n} IPUs needs device_iterations >= {stages} "
                         f"(it is {pipeline.device_iterations})")
    model = _Model(table, target, pipeline)
    current = model.evaluate(tuple(table.current_split)) if table.current_split else None
    count = math.comb(free - 1, n - 1)
    exhaustive = count <= EXHAUSTIVE_LIMIT
    if exhaustive:
        candidates = [model.evaluate(s) for s in _compositions(free, n)]
    else:
        starts = {_bottleneck_start(model, n)}
        if current is not None and len(current.split) == n:
            starts.add(current.split)
        candidates, seen = [], set()
        for start in starts:
            p = model.evaluate(start)
            seen.add(start)
            improved = True
            while improved:
                improved = False
                for s in _neighbours(p.split):
                    if s in seen:
                        continue
                    seen.add(s)
                    q = model.evaluate(s)
                    if _key(q) < _key(p):
                        p, improved = q, True
            candidates.append(p)
        count = len(seen)
    if current is not None and len(current.split) == n:
        candidates.append(current)
    best = min(candidates, key=_key)
    notes = []
    if not best.fits:
        notes.append(f"even the best split needs {max(best.max_tile_bytes):,} bytes on a tile; a "
                     f"{target.name} tile has {target.bytes_per_tile:,}")
        best = None
    return Advice(n, best, current, measured_cycles, count, exhaustive, target.clock_hz, notes)


def target_of(doc: dict) -> Target:
    """The Target a profile was made for."""
    return Target(**doc["target"])


def advise_profile(doc: dict, num_ipus: int | None = None) -> Advice:
    """Balance advice from a profile.json document that has a block table."""
    if not doc.get("blocks"):
        raise ValueError(f"profile {doc.get('name')!r} has no block table: balance advice needs a poptorch_lite "
                         "model profile (plain ipusim programs have no blocks)")
    if not doc["execution"]["schedule"]:
        raise ValueError(f"profile {doc.get('name')!r} has no schedule")
    table = BlockTable.from_dict(doc["blocks"])
    measured = doc["execution"]["cycles"] if not doc["estimated"] else None
    return advise(table, target_of(doc), Pipeline.of_schedule(doc["execution"]["schedule"]), num_ipus, measured)
