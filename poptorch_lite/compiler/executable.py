"""From a torch.nn.Module to an Executable: the compiler's pipeline end to end.

capture (PyTorch 2: one joint forward-backward ATen graph, blocks on its nodes) -> placement
(blocks to stages and IPUs) -> IR (the ATen lowering table) -> schedule -> lowering to ipusim, one
`Lowering` per replica on one device, weight updates -> an Engine. The runtime
(`poptorch_lite.runtime`) loads and runs the result.
"""
from __future__ import annotations

import collections

import torch

import ipusim as ip
from ipusim import schedules
from ipusim.device.memory import check_fits

from ..api import phases
from ..api.enums import ConnectionType, Liveness
from ..api.errors import Error
from ..api.multiconv import entered_groups, reset_groups
from ..api.optim import loss_scaling
from . import recompute
from .aten import decompositions, to_ir
from .backward_split import partition_backward
from .export import buffers_changed_in_place, capture_joint
from .host_io import check_host_io, device_target
from .loss_scaling import LossScaling, automatic_loss_scaling
from .lowering import Locations, Lowering
from .multiconv import group_multiconvs
from .updates import UpdatePlan, accumulator_dtypes, build_updates, running_mean


class Executable:
    """Everything compiled for one input signature: one `Lowering` per replica on one device."""

    def __init__(self, lowerings: list[Lowering], engine: ip.Engine, schedule, ir, placement, updates: UpdatePlan):
        self.lowerings = lowerings
        self.engine = engine
        self.schedule = schedule
        self.ir = ir
        self.placement = placement
        self.updates = updates
        self.out_of_memory: ip.OutOfMemoryError | None = None  # estimate mode: the report of what does not fit
        self.in_channels = collections.defaultdict(list)    # (replica, key) -> channels into it
        self.out_channels = collections.defaultdict(list)   # (replica, key) -> channels out of it
        for r, low in enumerate(lowerings):
            for ch in low.channels:
                self.out_channels[(r, ch.src)].append(ch)
                self.in_channels[(r, ch.dst)].append(ch)

    @property
    def lowering(self) -> Lowering:
        """Replica 0's lowering (what every replica has, on other IPUs)."""
        return self.lowerings[0]

    @property
    def replicas(self) -> int:
        return len(self.lowerings)

    @property
    def stage_programs(self) -> dict:
        return self.lowerings[0].stage_programs


def compile_model(model: torch.nn.Module, args, kwargs, options, training: bool, optimizer,
                  named_weights: dict, progress=lambda percent: None, variable_groups: dict | None = None
                  ) -> Executable:
    """Compile `model` for one micro-batch of inputs (`args`, `kwargs`): capture (with the backward
    when training), place blocks on stages and IPUs, lower to IR, build the schedule, lower to
    ipusim and load the Engine. `progress(percent)` is told how far it got. `variable_groups`:
    parameter name -> `api.replica_groups.VariableGrouping` of the per-replica variables."""
    variable_groups = variable_groups or {}
    ir, placement = capture_to_ir(model, args, kwargs, options, training, optimizer, progress,
                                  grouped=set(variable_groups))
    progress(15)
    schedule = build_schedule(placement, options, training)
    phases.mark("compile:ir")
    pricing = options.Emulator.mode == "estimate"   # asked for: a model that does not fit is a finding, not an error
    try:
        executable = build_executable(ir, placement, schedule, placement.stage_ipus, options, target_of(options),
                                      optimizer, named_weights, check_memory=not pricing,
                                      variable_groups=variable_groups)
    except ip.OutOfMemoryError as error:
        raise model_out_of_memory(error, placement, placement.num_ipus) from None
    if pricing:
        try:
            check_fits(executable.engine.memory)
        except ip.OutOfMemoryError as error:
            executable.out_of_memory = model_out_of_memory(error, placement, placement.num_ipus)
    progress(35)
    phases.mark("compile:lowered")
    executable.engine.load()
    progress(25)
    phases.mark("compile:loaded")
    return executable


def capture_to_ir(model, args, kwargs, options, training: bool, optimizer, progress, grouped=frozenset()):
    """Capture the model in train or eval mode as it will run (`export.capture_joint`: forward and
    backward as ATen ops, the gradients PyTorch's own, seeded with the optimiser's loss scaling),
    place its blocks and lower it to IR (`aten.to_ir`). A per-replica parameter (in `grouped`) is
    captured as one replica sees it: its first slice."""
    was_training = torch.nn.Module.__getattribute__(model, "training")
    model.train(training)
    reset_groups()
    try:
        trainable = {n for n, p in torch.nn.Module.named_parameters(model) if p.requires_grad}
        joint = capture_joint(model, args, kwargs, training=training, decompositions=decompositions(),
                              trainable=trainable, loss_scaling=loss_scaling(optimizer) if training else 1.0,
                              device_loss_scale=training,
                              per_replica=grouped,
                              source_excludes=options.source_location_excludes)
    finally:
        model.train(was_training)
    check_buffer_broadcast(joint, options)
    phases.mark("compile:captured")
    progress(15)
    ir, placement = to_ir(joint, options.execution_strategy)
    group_multiconvs(ir, entered_groups())
    progress(10)
    return ir, placement


def check_buffer_broadcast(joint, options) -> None:
    """Replicas start each call with the host's buffers (``Options.broadcastBuffers``, on by
    default), so a model that changes a buffer itself cannot be replicated that way (PopTorch's
    error); with broadcastBuffers(False) each replica keeps its own."""
    if options.replication_factor <= 1 or not options.broadcast_buffers:
        return
    changed = buffers_changed_in_place(joint)
    if changed:
        name, where = next(iter(changed.items()))
        origin = f" (changed {where.origin()})" if where is not None else ""
        raise Error("PopTorch does not support broadcasting buffers. If your model is able to tolerate buffers "
                    "becoming out of sync between replicas, you can disable buffer broadcasting using "
                    f"poptorch.Options.broadcastBuffers(False). Buffer {name!r}{origin} is changed by the model "
                    f"with replicationFactor({options.replication_factor}).")


def matmul_partials(options) -> str | None:
    """PopLibs' partialsType for the matmuls (`Precision.setPartialsType`, PopART's
    partialsTypeMatMuls): "half" or "float" (None: unset, float)."""
    value = options._Popart.get("partialsTypeMatMuls")
    if value is not None and value not in ("float", "half"):
        raise Error(f"_Popart option partialsTypeMatMuls must be 'float' or 'half', got {value!r}; "
                    "Precision.setPartialsType(torch.half) sets it")
    return value


def build_executable(ir, placement, schedule, stage_ipus, options, target: ip.Target, optimizer, named_weights: dict,
                     *, check_memory: bool = True, variable_groups: dict | None = None) -> Executable:
    """Lower the IR once per replica onto one device (replica r on IPUs r*N .. r*N+N-1), add the
    weight-update programs when training (`optimizer` given) and build the Engine (not loaded).
    A schedule with separate weight-gradient ops gets its stages' backwards split in two
    (`backward_split`); with recomputation (`recompute`: PopART's autoRecomputation, on by
    default for pipelined training over several IPUs) the stages that recompute get an R before
    each B of the schedule."""
    partition_backward(ir, schedule.split_backward)
    mode = recompute.recomputation_mode(options, placement.schedule_kind, optimizer is not None, stage_ipus)
    schedule = schedule.with_recomputation(recompute.apply(ir, mode, placement.schedule_kind))
    check_host_io(ir, placement, options)
    replicas = options.replication_factor
    per_replica = 1 + max(stage_ipus)
    # an estimate prices one replica standing for all of them (their collectives modelled, not emulated)
    priced = replicas if estimating(options) else 1
    replicas //= priced
    device = ip.Device(device_target(target, options), per_replica * replicas, replicas=priced)
    programs: list = []
    locations = tensor_locations(options, placement)
    templates: dict = {}  # op templates shared by the replicas' lowerings (ipusim.device.replay)
    als = automatic_loss_scaling(options) if optimizer is not None else None
    scaling = LossScaling(als, loss_scaling(optimizer)) if optimizer is not None else None
    lowerings = [Lowering(ir, device, programs, {s: ipu + r * per_replica for s, ipu in enumerate(stage_ipus)},
                          schedule, replica=r, prefix=f"r{r}/" if replicas > 1 else "", locations=locations,
                          running_mean=optimizer is not None and running_mean(options),
                          accumulator_dtypes=accumulator_dtypes(optimizer, named_weights) if optimizer is not None else {},
                          loss_scaling=scaling, templates=templates, matmul_partials=matmul_partials(options))
                 for r in range(replicas)]
    for low in lowerings:
        low.build()
    updates = build_updates(lowerings, optimizer, options, named_weights, variable_groups or {}) \
        if optimizer is not None else UpdatePlan()
    if scaling is not None:
        if scaling.automatic:
            scaling.build(lowerings, updates.configs)
        updates.loss_scaling = scaling
    # the host reads only always-live tensors (weights, accumulators, seeds) and streams: each
    # program's temporaries share storage by liveness in the fast mode
    engine = ip.Engine(device, programs, mode=engine_mode(options), check_memory=check_memory, share_storage=True)
    return Executable(lowerings, engine, schedule, ir, placement, updates)


def estimating(options) -> bool:
    """Whether the model is compiled to be priced, not run: Emulator.setMode("estimate"), or an
    offline target (useOfflineIpuTarget: PopTorch compiles for IPUs that are not there). The
    programs, plans, tile mappings, memory and cycles are a run's; no storage, no values."""
    return options.Emulator.mode == "estimate" or options.connection_type == ConnectionType.Never


def engine_mode(options) -> str:
    return "estimate" if estimating(options) else options.Emulator.mode


def tensor_locations(options, placement) -> Locations:
    """Which tensor classes live off chip: TensorLocations settings, and the phased strategies'
    Liveness for the activations a later phase needs."""
    settings = options.tensor_locations
    off = {cls: s is not None and s.on_chip is False for cls, s in settings.items()}
    liveness = getattr(placement, "liveness", Liveness.AlwaysLive)
    stash_off_chip = off["activation"] or liveness != Liveness.AlwaysLive
    minimum = {mine: (settings[theirs].min_elements_for_off_chip or 0) if settings[theirs] is not None else 0
               for mine, theirs in (("weights", "weight"), ("accumulators", "accumulator"),
                                    ("activations", "activation"), ("optimiser", "optimizer"))}
    return Locations(weights=off["weight"], accumulators=off["accumulator"], optimiser=off["optimizer"],
                     activations=stash_off_chip, min_elements=minimum)


def target_of(options) -> ip.Target:
    """The emulated IPU: Options.Emulator.setTarget, else the offline target's version (GC200 default)."""
    target = options.Emulator.target
    if isinstance(target, ip.Target):
        return target
    if target:
        return ip.get_target(target)
    return ip.GC2 if options.ipu_version == 1 else ip.GC200


def build_schedule(placement, options, training: bool):
    """The schedule of this placement (ipusim.schedules): the runtime executes it step by step.
    A pipelined training model runs the kind of Options.Emulator.setPipelineSchedule, PopTorch's
    own by default."""
    kind = options.Emulator.pipeline_schedule
    if not training or kind == "PopTorch":
        return placement.schedule(training=training,
                                  gradient_accumulation=options.gradient_accumulation if training else 1,
                                  device_iterations=options.device_iterations)
    if placement.schedule_kind != "pipelined":
        raise ValueError(f"Emulator.setPipelineSchedule({kind!r}) schedules a PipelinedExecution; this model uses "
                         f"{placement.schedule_kind} execution. Use PipelinedExecution or leave the schedule as "
                         "'PopTorch'.")
    return training_schedule(kind, placement.stage_ipus, options.gradient_accumulation, options.device_iterations)


def training_schedule(kind: str, stage_ipus, gradient_accumulation: int, device_iterations: int):
    """The training schedule of a kind of ipusim.schedules.TRAINING_KINDS for stages placed on
    `stage_ipus`, or a ValueError saying which placement the kind needs."""
    chosen = f"Emulator.setPipelineSchedule({kind!r})"
    g, d = gradient_accumulation, device_iterations
    stage_ipus = tuple(stage_ipus)
    n_ipus = 1 + max(stage_ipus)
    if kind == "Interleaved1F1B":
        if len(stage_ipus) % n_ipus or stage_ipus != tuple(s % n_ipus for s in range(len(stage_ipus))):
            raise ValueError(f"{chosen} needs stage s on IPU s mod {n_ipus} ({len(stage_ipus)} stages on {n_ipus} "
                             f"IPUs, each IPU the same number of stages); this model places its stages on IPUs "
                             f"{list(stage_ipus)}. Place them with Stage(...).ipu(s % {n_ipus}).")
        return schedules.interleaved_1f1b_schedule(n_ipus, len(stage_ipus) // n_ipus, gradient_accumulation=g,
                                                      device_iterations=d)
    if stage_ipus != tuple(range(len(stage_ipus))):
        raise ValueError(f"{chosen} runs stage s on IPU s; this model places its stages on IPUs {list(stage_ipus)}. "
                         "Place one stage per IPU in order, or use 'Interleaved1F1B' for stage s on IPU s mod N.")
    return ONE_STAGE_PER_IPU[kind](len(stage_ipus), gradient_accumulation=g, device_iterations=d)


ONE_STAGE_PER_IPU = {"GPipe": schedules.gpipe_schedule, "1F1B": schedules.one_f_one_b_schedule,
                     "ZB-H1": schedules.zb_h1_schedule, "ZB-H2": schedules.zb_h2_schedule}


def model_out_of_memory(error: ip.OutOfMemoryError, placement, ipus_per_replica: int) -> ip.OutOfMemoryError:
    """Poplar's out-of-memory report, said in the model's terms: which IPU, stages and blocks."""
    lines = []
    for r in sorted(error.reports, key=lambda r: -r.max_tile):
        if r.fits:
            continue
        ipu = r.ipu % ipus_per_replica
        replica = f" of replica {r.ipu // ipus_per_replica}" if len(error.reports) > ipus_per_replica else ""
        stages = sorted({p.stage for p in placement.blocks if p.ipu == ipu})
        blocks = [str(p.block.user_id) for p in placement.blocks if p.ipu == ipu]
        lines.append(f"IPU {r.ipu}{replica} (stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}; "
                     f"blocks {', '.join(blocks)}) needs {r.max_tile} bytes on its busiest tile, "
                     f"{r.target.bytes_per_tile} fit; {r.summary()}")
    busiest = max(error.reports, key=lambda r: r.max_tile)
    free = [r.ipu for r in error.reports if r.max_tile < busiest.max_tile // 2]
    hint = ("Split the blocks of that IPU over more IPUs (more pipeline stages with Stage(...).ipu(n)"
            + (f", e.g. onto IPU {free[0]} which has room" if free else "") +
            "), reduce the micro-batch size, or move optimiser state off chip "
            "(Options.TensorLocations.setOptimizerLocation(TensorLocationSettings().useOnChipStorage(False))).")
    message = "Out of memory compiling the model:\n  " + "\n  ".join(lines) + f"\n{hint}\n\n{error}"
    return ip.OutOfMemoryError(message, error.reports)
