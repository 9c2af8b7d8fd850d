"""Training schedules defined by each IPU's order of ops: GPipe, 1F1B (PipeDream-flush),
interleaved 1F1B, and the zero-bubble ZB-H1 and ZB-H2 (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism"), whose backward is split into B (input gradient) and W (weight gradient).

Each kind is a pure function of the stage count and the batching: it gives, for every IPU, the
list of ops it runs in order; `steps_from_orders` turns the orders into lock-step steps (at
every step each IPU runs its next op if everything that op needs ran in an earlier step), and a
weight update closes every group as in PopTorch's schedules. At unit costs the steps are the
event-driven timing itself; with real costs `ipusim.schedules.pricing` times the same orders
both ways. See docs/schedules.md for the orders, the closed forms and the figures.
"""
from __future__ import annotations

from .core import Schedule, assemble, batching, dependencies, positive

Action = tuple[str, int, int]   # (kind, stage, micro-batch within the group)


def steps_from_orders(orders: dict[int, list[Action]], num_stages: int) -> list[list[tuple]]:
    """Lock-step steps from the order in which each IPU runs its ops: at every step each IPU
    runs its next op if everything it needs ran in an earlier step. Orders that would deadlock
    (every IPU waiting) are an error naming what each IPU waits for."""
    pos = {ipu: 0 for ipu in orders}
    done: set[Action] = set()
    steps: list[list[tuple]] = []
    left = sum(map(len, orders.values()))
    while left:
        step = [orders[ipu][pos[ipu]] for ipu in sorted(orders) if pos[ipu] < len(orders[ipu])
                and all(need in done for need in dependencies(*orders[ipu][pos[ipu]], num_stages))]
        if not step:
            stuck = {ipu: "{}{} of stage {}".format(k, m + 1, s) for ipu in sorted(orders)
                     if pos[ipu] < len(orders[ipu]) for k, s, m in [orders[ipu][pos[ipu]]]}
            raise ValueError(f"the per-IPU orders deadlock after {len(steps)} steps: every IPU waits "
                             f"for an op no other IPU will run ({stuck})")
        for action in step:
            done.add(action)
            pos[next(ipu for ipu in orders if pos[ipu] < len(orders[ipu])
                     and orders[ipu][pos[ipu]] == action)] += 1
        left -= len(step)
        steps.append([(k, s, m, None) for k, s, m in step])
    return steps


def _schedule(strategy: str, num_ipus: int, virtual_stages: int, gradient_accumulation: int,
              device_iterations: int, order_of) -> Schedule:
    """Stage s on IPU s mod num_ipus; `order_of(ipu, micro_batches)` gives one group's order."""
    groups, per_group = batching(True, gradient_accumulation, device_iterations)
    num_stages = num_ipus * virtual_stages
    orders = {d: order_of(d, per_group) for d in range(num_ipus)}
    group = steps_from_orders(orders, num_stages)
    stage_ipus = tuple(s % num_ipus for s in range(num_stages))
    return assemble(strategy, stage_ipus, True, groups, per_group, group)


class _Counter:
    """Builds one stage's order op by op, each op only while there is one left to run."""

    def __init__(self, stage: int, micro_batches: int):
        self.stage, self.m = stage, micro_batches
        self.next = {"F": 0, "B": 0, "W": 0}
        self.order: list[Action] = []

    def run(self, kind: str) -> None:
        before = {"F": self.m, "B": self.next["F"], "W": self.next["B"]}[kind]
        if self.next[kind] < before:
            self.order.append((kind, self.stage, self.next[kind]))
            self.next[kind] += 1

    def left(self, kind: str) -> bool:
        return self.next[kind] < self.m


# --------------------------------------------------------------------------- the kinds

def gpipe_schedule(num_stages: int, *, gradient_accumulation: int,
                   device_iterations: int = 1) -> Schedule:
    """GPipe: every IPU runs the forwards of all the group's micro-batches, then their
    backwards, in micro-batch order. Stage s runs on IPU s. Stashes every micro-batch."""
    positive("num_stages", num_stages)

    def order(stage: int, m: int) -> list[Action]:
        return [("F", stage, k) for k in range(m)] + [("B", stage, k) for k in range(m)]

    return _schedule("GPipe", num_stages, 1, gradient_accumulation, device_iterations, order)


def one_f_one_b_schedule(num_stages: int, *, gradient_accumulation: int,
                         device_iterations: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): stage s runs N-s forwards (N stages), then a backward and a
    forward alternately while forwards remain, then the remaining backwards. At most N-s
    micro-batches are in flight on stage s. Stage s runs on IPU s."""
    positive("num_stages", num_stages)

    def order(stage: int, m: int) -> list[Action]:
        c = _Counter(stage, m)
        for _ in range(num_stages - stage):
            c.run("F")
        while c.left("F"):
            c.run("B")
            c.run("F")
        while c.left("B"):
            c.run("B")
        return c.order

    return _schedule("1F1B", num_stages, 1, gradient_accumulation, device_iterations, order)


def _zero_bubble_order(stage: int, m: int, warmup: int, pairs: int) -> list[Action]:
    """`warmup` forwards, `pairs` (B, F) pairs that leave their W for later, then (B, W, F)
    while forwards remain, (B, W) while backwards remain, and the deferred Ws."""
    c = _Counter(stage, m)
    for _ in range(warmup):
        c.run("F")
    for _ in range(pairs):
        c.run("B")
        c.run("F")
    while c.left("F"):
        c.run("B")
        c.run("W")
        c.run("F")
    while c.left("B"):
        c.run("B")
        c.run("W")
    while c.left("W"):
        c.run("W")
    return c.order


def zb_h1_schedule(num_stages: int, *, gradient_accumulation: int,
                   device_iterations: int = 1) -> Schedule:
    """ZB-H1, the memory-efficient zero-bubble schedule: 1F1B's order with the backward split
    into B and W, where stage s (of N) runs N-s forwards, then s (B, F) pairs whose Ws it defers
    to the end of the group, then (B, W, F) in steady state. Like 1F1B at most N micro-batches
    are in flight on any stage (on every stage here, against N-s in 1F1B). Run event-driven with
    a flush per group, an IPU idles (N-1)max(F, F+B-W) against 1F1B's (N-1)(F+B+W) (M >= N)."""
    positive("num_stages", num_stages)

    def order(stage: int, m: int) -> list[Action]:
        return _zero_bubble_order(stage, m, num_stages - stage, stage)

    return _schedule("ZB-H1", num_stages, 1, gradient_accumulation, device_iterations, order)


def zb_h2_schedule(num_stages: int, *, gradient_accumulation: int,
                   device_iterations: int = 1) -> Schedule:
    """ZB-H2, the zero-bubble schedule that spends memory: stage s (of N) runs 2(N-s)-1
    forwards, then 2s (B, F) pairs whose Ws it defers, then (B, W, F) in steady state, so every
    IPU stays busy from its first op to its last; up to 2N-1 micro-batches are in flight on
    every stage. The paper's figure drops the flush at the weight update to reach zero bubble;
    here every group still ends with its weight update, so the ramps remain."""
    positive("num_stages", num_stages)

    def order(stage: int, m: int) -> list[Action]:
        return _zero_bubble_order(stage, m, 2 * (num_stages - stage) - 1, 2 * stage)

    return _schedule("ZB-H2", num_stages, 1, gradient_accumulation, device_iterations, order)


def interleaved_1f1b_schedule(num_ipus: int, virtual_stages: int, *, gradient_accumulation: int,
                              device_iterations: int = 1) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, as in torch.distributed.pipelining): N IPUs
    hold V stages each, stage s on IPU s mod N, so the model has V*N stages. Micro-batches go
    in rounds of r = M / max(1, M // N) (M must be a multiple of the number of rounds); IPU d
    runs its forwards chunk by chunk, r micro-batches per chunk before moving to its next
    chunk, and its backwards likewise from its last chunk back. It warms up with
    min((V-1)r + 2(N-1-d), V*M) forwards, then alternates a forward and a backward, then
    finishes the backwards. At unit costs the bubble is (N-1)/(V*M+N-1) once M >= N."""
    positive("num_ipus", num_ipus)
    positive("virtual_stages", virtual_stages)
    positive("gradient_accumulation", gradient_accumulation)
    m = gradient_accumulation
    rounds = max(1, m // num_ipus)
    if m % rounds:
        raise ValueError(
            f"interleaved 1F1B over {num_ipus} IPUs runs micro-batches in {rounds} rounds of "
            f"{m // rounds}, and gradient_accumulation={m} is not a multiple of {rounds}: use a "
            f"gradient_accumulation that is a multiple of {num_ipus} (the IPUs), or at most {num_ipus}")
    per_round = m // rounds
    v, n = virtual_stages, num_ipus

    def order(d: int, micro_batches: int) -> list[Action]:
        total = v * micro_batches
        warmup = min((v - 1) * per_round + 2 * (n - 1 - d), total)

        def forward(k: int) -> tuple[str, int]:
            return "F", (k // per_round) % v * n + d

        def backward(j: int) -> tuple[str, int]:
            return "B", (v - 1 - (j // per_round) % v) * n + d

        sequence = [forward(k) for k in range(warmup)]
        for k in range(warmup, total):
            sequence += [forward(k), backward(k - warmup)]
        sequence += [backward(j) for j in range(total - warmup, total)]
        count: dict[tuple[str, int], int] = {}
        out: list[Action] = []
        for kind, stage in sequence:
            count[(kind, stage)] = count.get((kind, stage), -1) + 1
            out.append((kind, stage, count[(kind, stage)]))
        return out

    return _schedule("Interleaved1F1B", n, v, gradient_accumulation, device_iterations, order)


TRAINING_KINDS = ("GPipe", "1F1B", "Interleaved1F1B", "ZB-H1", "ZB-H2")
"""The kinds of this module, by the names `Schedule.strategy` and the emulator option use."""
