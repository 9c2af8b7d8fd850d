"""What an estimate says about a compiled model: per IPU, whether it fits and what fills its
memory; per call, cycles, the pipeline bubble and samples per second.

Read from the executable and the record of a call (estimate mode, or any run: the figures are the
static ones both share), never from tensor values. `summary(executor)` returns an `Estimate`;
`Estimate.text()` is what `PoplarExecutor.estimate()` prints.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ALWAYS_LIVE_KINDS = {"weights": ("weights",), "optimiser state": ("optimiser_state",),
                     "accumulators": ("accumulators", "gradients"), "stashed activations": ("stashed_activations",),
                     "other always-live": ("activations", "constants", "temporaries", "host_io", "other")}
"""Always-live tensor categories by the kind of memory they report."""


@dataclass
class IpuEstimate:
    ipu: int
    fits: bool
    max_tile_bytes: int
    tile_bytes: int                   # the target's bytes per tile
    total_bytes: int                  # peak bytes summed over tiles
    always_live: dict[str, int]       # kind -> bytes (ALWAYS_LIVE_KINDS)
    temporaries_peak: int             # not-always-live tensors at their liveness peak (activations, buffers)
    vertex_state_and_code: int
    off_chip: dict[str, int]          # kind -> bytes in Streaming Memory
    busy_cycles: int                  # in one call
    bubble_fraction: float            # idle in steps without an op of this IPU, over the call
    wait_fraction: float              # idle in steps with one (waiting for the step's slowest IPU)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Estimate:
    target: str
    clock_hz: float
    replicas: int
    ipus_per_replica: int
    samples_per_call: int
    weight_updates_per_call: int
    call_cycles: int
    ipus: list[IpuEstimate]
    out_of_memory: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(i.fits for i in self.ipus)

    @property
    def call_seconds(self) -> float:
        return self.call_cycles / self.clock_hz

    @property
    def cycles_per_step(self) -> int:
        """Cycles per weight update (an optimiser step)."""
        return self.call_cycles // max(1, self.weight_updates_per_call)

    @property
    def samples_per_second(self) -> float:
        return self.samples_per_call / self.call_seconds if self.call_cycles else 0.0

    @property
    def bubble_fraction(self) -> float:
        return max((i.bubble_fraction for i in self.ipus), default=0.0)

    def to_dict(self) -> dict:
        return {"target": self.target, "clock_hz": self.clock_hz, "replicas": self.replicas,
                "ipus_per_replica": self.ipus_per_replica, "samples_per_call": self.samples_per_call,
                "weight_updates_per_call": self.weight_updates_per_call, "call_cycles": self.call_cycles,
                "cycles_per_step": self.cycles_per_step, "samples_per_second": self.samples_per_second,
                "fits": self.fits, "out_of_memory": self.out_of_memory, "notes": self.notes,
                "ipus": [i.to_dict() for i in self.ipus]}

    def text(self) -> str:
        mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
        lines = [f"Estimate on {self.target} ({self.clock_hz / 1e9:.2f} GHz), {self.replicas} replica(s) of "
                 f"{self.ipus_per_replica} IPU(s): {self.samples_per_call:,} samples a call, "
                 f"{self.call_cycles:,} cycles ({self.call_seconds * 1e3:,.1f} ms), "
                 f"{self.cycles_per_step:,} cycles per weight update, {self.samples_per_second:,.1f} samples/s",
                 f"  {'IPU':>3} {'fits':>4} {'busiest tile':>12}  {'MiB':>7}  {'weights':>7} {'optim':>6} "
                 f"{'accum':>6} {'stash':>6} {'other':>6} {'temp':>6} {'code':>6}  {'off chip':>8}  "
                 f"{'bubble':>6} {'wait':>5}"]
        for i in self.ipus:
            a = i.always_live
            lines.append(f"  {i.ipu:>3} {'yes' if i.fits else 'NO':>4} {i.max_tile_bytes:>12,}  {mib(i.total_bytes):>7}  "
                         f"{mib(a['weights']):>7} {mib(a['optimiser state']):>6} {mib(a['accumulators']):>6} "
                         f"{mib(a['stashed activations']):>6} {mib(a['other always-live']):>6} "
                         f"{mib(i.temporaries_peak):>6} {mib(i.vertex_state_and_code):>6}  "
                         f"{mib(sum(i.off_chip.values())):>8}  {100 * i.bubble_fraction:>5.1f}% "
                         f"{100 * i.wait_fraction:>4.1f}%")
        lines.append("  (MiB on chip at the peak; always-live weights, optimiser state, accumulators, stash, other; "
                     "temp: not-always-live peak; code: vertex state and code; off chip: Streaming Memory)")
        lines += [f"  note: {n}" for n in self.notes]
        if self.out_of_memory:
            lines.append(self.out_of_memory)
        return "\n".join(lines)


def _off_chip_kinds(exe) -> dict[str, str]:
    """Remote buffer name -> the kind of tensor it holds."""
    kinds = {}
    for low in exe.lowerings:
        for table, kind in ((low.weight_buffers, "weights"), (low.accumulator_buffers, "accumulators")):
            kinds.update((b.name, kind) for b in table.values())
        for ch in low.channels:
            if getattr(ch, "off_chip", False):
                kinds.update((b.name, "stashed activations") for b in ch.buffers)
    kinds.update((b.name, "optimiser state") for b in exe.updates.state_buffers.values())
    return kinds


def summary(executor) -> Estimate:
    """The estimate of a compiled model that has been called once (its record)."""
    exe = executor._executable
    record = executor.last_run
    if exe is None or record is None:
        raise RuntimeError("estimate(): call the model once first (in estimate mode, a call prices it)")
    engine = exe.engine
    target = engine.target
    opts = executor.options
    kinds = _off_chip_kinds(exe)
    total = record.cycles
    ipus = []
    for report, graph in zip(engine.memory, engine.device.graphs):
        always = {k: 0 for k in ALWAYS_LIVE_KINDS}
        of_category = {c: k for k, cats in ALWAYS_LIVE_KINDS.items() for c in cats}
        for v in graph.variables:
            if v.always_live:
                always[of_category[v.category]] += v.nbytes
        off = {}
        for b in graph.remote_buffers.values():
            kind = kinds.get(b.name, "other")
            off[kind] = off.get(kind, 0) + b.nbytes * b.repeats
        busy = bubble = wait = 0
        for s in record.steps:
            c = s.busy.get(report.ipu)
            if c is None:
                bubble += s.cycles
            else:
                busy += c.total
                wait += s.cycles - c.total
        ipus.append(IpuEstimate(report.ipu, report.fits, report.max_tile, target.bytes_per_tile, report.total, always,
                                int(report.not_always_live_peak.sum()),
                                int(report.vertex_state.sum() + report.code.sum()), off, busy,
                                bubble / total if total else 0.0, wait / total if total else 0.0))
    micro = int(exe.ir.inputs[0].shape[0]) if exe.ir.inputs and exe.ir.inputs[0].shape else 1
    samples = micro * opts.device_iterations * opts.replication_factor * \
        (opts.gradient_accumulation if executor._training else 1)
    notes = []
    if engine.device.replicas > 1:
        notes.append(f"one replica priced for {engine.device.replicas}: its collectives are modelled "
                     "(ring over IPU-Links" + (", GW-Links between IPU-Link domains" if engine.device.sync_ipus >
                                               target.ipus_per_link_domain else "") + ")")
    oom = exe.out_of_memory
    return Estimate(target.name, target.clock_hz, opts.replication_factor, engine.device.num_ipus // max(1, exe.replicas),
                    samples, opts.device_iterations if executor._training else 0, total, ipus,
                    str(oom) if oom is not None else None, notes)
