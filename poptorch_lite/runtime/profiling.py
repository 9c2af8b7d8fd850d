"""Profiling of poptorch_lite models: the executor's hook, balance advice and "what if" estimates.

With profiling on (`Options.enableProfiling(DIR)` or POPLAR_ENGINE_OPTIONS with autoReport.all
and autoReport.directory) the executor creates a `Profiler` after compiling and hands it the
record of every call. Files go to DIR/<model name> (Options.modelName, else "training" or
"inference"), as PopTorch names its report directories:

- after compiling: profile.json with the memory per IPU and tile, the programs' static costs, the
  schedule and the block table, no calls (PopTorch writes its memory report at compile time too:
  a model compiled and never run, as with `--compile-only` and an offline target, has one);
- after the first call: profile.json and trace.json (so a profile exists as soon as one call ran);
- when the model is destroyed, or freed (when the garbage collector frees it: at the next safe
  point, `ipusim.report.profile.finish_collected`), or the process exits (once): profile.json
  again with the totals of every call, trace.json, the PNG charts, the page (profile.html), and
  the summary printed.

The profile itself is ipusim's (ipusim.report.profile); this module adds what only the compiler knows:
stages and their blocks, the ops with the ATen op and source line each came from, the block table
behind the balance advice, and re-lowering the model for estimates on another target or another
split without running it.
"""
from __future__ import annotations

import copy
import functools
import os

import numpy as np

import ipusim as ip
from ipusim.device.program import Execute, walk
from ipusim.report import advisor
from ipusim.report import profile as ipprofile

from ..api import batching, poptorch_core
from ..api import profiling as host_profiling
from ..compiler.backward_split import WEIGHT_GRADIENT
from ..compiler.executable import build_executable, training_schedule
from ..compiler.lowering import program_key


class Profiler:
    """The executor's profiling hook for one compiled model."""

    def __init__(self, executor, profile_dir: str, trace_calls: int = 1):
        exe = executor._executable
        name = executor.options.model_name or ("training" if executor._training else "inference")
        self.directory = os.path.join(profile_dir, name)
        self.session = ipprofile.ProfileSession(self.directory, model_profile(executor, name),
                                                trace_calls=trace_calls, advice=advice_text)
        # Tied to the executable: destroy() or collecting the model drops it; exit runs it too.
        self._finish = ipprofile.finish_on_collect(exe, functools.partial(_finish, self.session, self.directory))
        self.session.write_compiled()

    def called(self, record) -> None:
        """Account one call (executor.RunRecord); the first call also writes the files (and the
        host tracepoints so far, poptorch.profiling)."""
        first = self.session.recording.calls == 0
        self.session.add(record.steps)
        if first:
            self.session.write_early()
            host_profiling.write_host_trace(self.directory)

    def finish(self) -> str | None:
        """Write everything and print the summary now (at most once); returns the summary."""
        return self._finish()


def _finish(session, directory: str) -> str | None:
    """The session's files and summary, and the host tracepoints (host_trace.json)."""
    text = session.finish()
    if text is not None:
        host_profiling.write_host_trace(directory)
    return text


# =========================================================================================
# The static side of a model's profile
# =========================================================================================
def block_order(placement) -> list[tuple[str, int]]:
    """(block name, stage) of every traced block in pipeline order: by stage, then as traced."""
    placed = sorted(enumerate(placement.blocks), key=lambda ib: (ib[1].stage, ib[0]))
    out, seen = [], set()
    for _, p in placed:
        name = str(p.block.user_id)
        if name not in seen:
            seen.add(name)
            out.append((name, p.stage))
    return out


def stage_infos(placement) -> list[ipprofile.StageInfo]:
    blocks = block_order(placement)
    return [ipprofile.StageInfo(s, ipu, [b for b, st in blocks if st == s]) for s, ipu in enumerate(placement.stage_ipus)]


def settings_of(executor) -> dict:
    opts, exe = executor.options, executor._executable
    micro = int(exe.ir.inputs[0].shape[0]) if exe.ir.inputs and exe.ir.inputs[0].shape else 1
    g = opts.gradient_accumulation if executor._training else 1
    return {"training": executor._training, "micro_batch_size": micro, "gradient_accumulation": g,
            "device_iterations": opts.device_iterations, "replication_factor": opts.replication_factor,
            "samples_per_call": micro * g * opts.device_iterations * opts.replication_factor,
            "mode": opts.Emulator.mode, "strategy": type(opts.execution_strategy).__name__}


def operations(exe) -> list[dict]:
    """Every op of the compiled model (replica 0) as the profile's `operations` table: the ATen op,
    source line and module it came from, its block, stage, IPU and pass, the static cycles of the
    programs its lowering made on its IPU (per run), the bytes its exchanges move, the tile
    memory of the tensors it made (outputs and temporaries, summed over tiles, live or not) and
    the tiles its vertices run on."""
    engine = exe.engine
    reports = {r.ipu: r for r in engine.memory}
    rows = []
    for sp in exe.lowering.stage_programs.values():
        body = engine.programs[sp.body]
        graph = engine.device.graphs[sp.ipu]
        tensors = reports[sp.ipu].tensors
        for node, first, end, first_var, end_var in sp.op_spans:
            busy, moved, tiles = ip.Cycles(), 0, []
            for p in body.programs[first:end]:
                cost = engine.cost(p)
                busy = busy + cost.per_ipu.get(sp.ipu, ip.Cycles())
                moved += cost.exchange_bytes
                tiles += [t.tiles for q in walk(p) if isinstance(q, Execute) for t in q.compute_set.tables]
            made = sum(int(tensors[v.name].sum()) for v in graph.variables[first_var:end_var] if v.name in tensors)
            name = node.outputs[0].name if node.outputs else node.op
            rows.append({"name": f"{node.scope}/{name}" if node.scope else name, "op": node.op, "aten": node.aten,
                         "source": node.source, "module": node.module,
                         "block": None if node.block is None else str(node.block), "stage": node.stage,
                         "ipu": sp.ipu, "pass": node.pass_, "cycles": busy.total, "compute": busy.compute,
                         "exchange": busy.exchange, "sync": busy.sync, "inter_ipu": busy.inter_ipu,
                         "host": busy.host, "exchange_bytes": moved, "bytes": made,
                         "tiles": int(np.unique(np.concatenate(tiles)).size) if tiles else 0})
    return rows


def model_profile(executor, name: str) -> ipprofile.StaticProfile:
    """StaticProfile of a compiled model: engine memory and programs, schedule, stages, blocks."""
    exe = executor._executable
    notes = []
    if exe.replicas > 1:
        notes.append(f"{exe.replicas} replicas: IPUs {exe.placement.num_ipus}*r.. belong to replica r")
    unmodelled = poptorch_core.popart_without_effect(executor.options)
    if unmodelled:
        notes.append("PopART options accepted with no effect on the emulator: " + ", ".join(unmodelled))
    try:
        blocks = block_table(executor).to_dict()
    except Exception as error:  # advice is optional: say why it is missing, never fail the run
        blocks = None
        notes.append(f"no balance advice: {error}")
    return ipprofile.static_profile(name, exe.engine, source="poptorch_lite", schedule=exe.schedule,
                                    stages=stage_infos(exe.placement), blocks=blocks,
                                    settings=settings_of(executor), notes=notes, operations=operations(exe))


# =========================================================================================
# Re-lowering (same model, another split or target, compiled but not run)
# =========================================================================================
def _relowered(executor, stage_of_block: dict[str, int], target: ip.Target, replicas: int = 1, *,
               recompute: bool = True, stage_ipus: list[int] | None = None):
    """The model lowered with its blocks on the given stages (stage s on IPU `stage_ipus[s]`,
    default s) for `target`, compiled without checking memory and without loading: static costs
    and memory only. Mirrors the executor's compile step; without `recompute`, with
    autoRecomputation off."""
    exe, opts = executor._executable, executor.options
    if not recompute:
        opts = opts.clone()
        opts._Popart.set("autoRecomputation", 0)
    num_stages = 1 + max(stage_of_block.values())
    stage_ipus = list(range(num_stages)) if stage_ipus is None else list(stage_ipus)
    ir = copy.deepcopy(exe.ir)
    for n in ir.nodes:
        n.stage = stage_of_block[str(n.block)]
        n.ipu = stage_ipus[n.stage]
    training = executor._training
    g = max(opts.gradient_accumulation, 2 * num_stages - 1) if training else 1
    d = opts.device_iterations if training else max(opts.device_iterations, num_stages)
    kind = exe.schedule.strategy.partition("-")[2] or "grouped"
    if training and exe.schedule.strategy in ip.schedules.TRAINING_KINDS:   # the kind that ran, one stage per IPU
        schedule = training_schedule(exe.schedule.strategy, range(num_stages), g, d)
    elif exe.schedule.strategy.startswith("sharded"):
        schedule = ip.schedules.sharded_schedule(num_stages, training=training, gradient_accumulation=g,
                                                 device_iterations=d, stage_ipus=stage_ipus)
    else:
        schedule = ip.schedules.pipelined_schedule(num_stages, training=training, gradient_accumulation=g,
                                                   device_iterations=d, kind=kind, stage_ipus=stage_ipus)
    return build_executable(ir, exe.placement, schedule, stage_ipus, opts.clone().replicationFactor(replicas)
                            if replicas != opts.replication_factor else opts, target,
                            executor._optimizer if training else None, executor._named_weights(), check_memory=False)


def _table(exe, names: list[str], current_split, source: str, tail: bool = False) -> advisor.BlockTable:
    """Block table of an executable whose stage b holds exactly block b, on IPU b; with `tail`,
    its last stage (the last entry of `names`) is back on IPU 0, whose memory and weight update
    are counted with block 0 (they always share that IPU)."""
    low, engine = exe.lowering, exe.engine
    n = len(names)

    def body(*keys) -> int:
        programs = [low.stage_programs[k] for k in keys if k in low.stage_programs]
        return sum(engine.costs[sp.body].per_ipu.get(sp.ipu, ip.Cycles()).total for sp in programs)

    buffer_names = set()
    for ch in low.channels:
        for v, buf in zip(ch.values, ch.buffers):
            tensors = list(buf) if isinstance(buf, list) else []
            local = low.tensors.get((v.id, ch.dst))
            if local is not None:
                tensors.append(local)
            buffer_names |= {t.name for t in tensors if isinstance(t, ip.Tensor)}
    reports = {r.ipu: r for r in engine.memory}
    tile_bytes = []
    for b in range(n):
        if tail and b == n - 1:
            tile_bytes.append(np.zeros_like(tile_bytes[0]))
            continue
        r = reports[b]
        own = r.peak.copy()
        for name in buffer_names & set(r.tensors):
            own -= r.tensors[name]
        tile_bytes.append(own.clip(min=0))
    # the advisor knows whole backwards: a split backward's weight-gradient half counts as backward
    whole = {"fwd": "fwd", "bwd": "bwd", WEIGHT_GRADIENT: "bwd"}
    # values numbered in the order the capture made them (IR ids count across compiles)
    number = {i: k for k, i in enumerate(sorted({v.id for ch in low.channels for v in ch.values}))}
    flows = [advisor.Flow(number[v.id], v.nbytes, (whole[ch.src[0]], ch.src[1]), (whole[ch.dst[0]], ch.dst[1]))
             for ch in low.channels for v in ch.values if (whole[ch.src[0]], ch.src[1]) != (whole[ch.dst[0]], ch.dst[1])]
    update = [0 if tail and b == n - 1 else sum(engine.costs[i].total for i in exe.updates.programs.get(b, []))
              for b in range(n)]
    return advisor.BlockTable(names, [body(("fwd", b)) for b in range(n)],
                              [body(("bwd", b), (WEIGHT_GRADIENT, b)) for b in range(n)],
                              update, tile_bytes, flows, current_split, source, tail)


def block_table(executor) -> advisor.BlockTable:
    """The advisor's block table of a compiled model: the stage programs themselves when each
    stage holds one block on its own IPU, else the model lowered with one block per stage. The
    table describes the blocks without recomputation (the advisor recomputes the stages of each
    split it weighs as the pipeline does): a model that recomputes is lowered again without."""
    exe = executor._executable
    placement = exe.placement
    order = block_order(placement)
    names = [b for b, _ in order]
    identity = tuple(placement.stage_ipus) == tuple(range(placement.num_stages))
    split = [sum(1 for _, s in order if s == k) for k in range(placement.num_stages)] if identity else None
    if split is not None and 0 in split:
        split = None
    recomputes = bool(exe.schedule.recomputed_stages)
    if identity and len(names) == placement.num_stages and exe.replicas == 1 and not recomputes:
        return _table(exe, names, split, "stage programs")
    k = placement.num_stages - 1
    if k >= 2 and tuple(placement.stage_ipus) == tuple(range(k)) + (0,):
        # the last stage returns to IPU 0 (heads tied to the embedding): one entry, kept there;
        # the ops before the first block go with the block of their stage
        def unnamed(b, s):
            return b == "None" and any(other != b and t == s for other, t in order)

        named = [(b, s) for b, s in order if s < k and not unnamed(b, s)]
        free = [b for b, _ in named]
        tail = ", ".join(b for b, s in order if s == k and not unnamed(b, s))
        stage_of = {b: i for i, b in enumerate(free)}
        for b, s in order:
            if b not in stage_of:
                stage_of[b] = len(free) if s == k else next(i for i, (_, t) in enumerate(named) if t == s)
        split = [sum(1 for _, s in named if s == j) for j in range(k)]
        per_block = _relowered(executor, stage_of, exe.engine.target, recompute=False,
                               stage_ipus=list(range(len(free))) + [0])
        return _table(per_block, free + [tail], None if 0 in split else split,
                      "model lowered with one block per stage" + (" without recomputation" if recomputes else "")
                      + ", the last stage on IPU 0", tail=True)
    shared = _shared_weights(exe.ir)
    if shared:
        weight, blocks = shared
        raise ValueError(f"blocks {' and '.join(repr(b) for b in blocks)} share the weight {weight!r} (tied weights), so "
                         "they must stay on one IPU; the advisor weighs contiguous splits giving each block its own "
                         "stage on its own IPU, which cannot keep them together. Profile the splits you consider and "
                         "compare them (python -m ipusim.report DIR --compare DIR2)")
    per_block = _relowered(executor, {b: i for i, b in enumerate(names)}, exe.engine.target, recompute=False)
    return _table(per_block, names, split, "model lowered with one block per stage"
                  + (" without recomputation" if recomputes else ""))


def _shared_weights(ir) -> tuple[str, list[str]] | None:
    """(weight, its blocks) of the first weight the ops of several blocks use, or None."""
    names = {v.id: name for name, v in {**ir.params, **ir.buffers}.items()}
    users: dict[str, list[str]] = {}
    for n in ir.nodes:
        for v in n.inputs:
            if v.id in names and n.block is not None:
                blocks = users.setdefault(names[v.id], [])
                if str(n.block) not in blocks:
                    blocks.append(str(n.block))
    return next(((w, b) for w, b in users.items() if len(b) > 1), None)


def advice_text(doc: dict) -> str:
    """The advisor's text for a profile (empty when it has no block table)."""
    if not doc.get("blocks"):
        return ""
    try:
        return advisor.advise_profile(doc).text()
    except ValueError as error:
        return f"Balance advice: {error}"


def advise(executor, num_ipus: int | None = None) -> advisor.Advice:
    """Balance advice for a compiled model: the contiguous split of its blocks over `num_ipus`
    IPUs (default: the IPUs it uses) that minimises a call's time while fitting memory, and the
    predicted speedup over its current split."""
    exe = _compiled(executor)
    profiler = executor._profiler
    known = profiler.session.static.blocks if profiler is not None else None
    table = advisor.BlockTable.from_dict(known) if known else block_table(executor)
    pipeline = advisor.Pipeline.of_schedule(ipprofile.schedule_summary(exe.schedule))
    measured = executor.last_run.cycles if executor.last_run is not None else None
    return advisor.advise(table, exe.engine.target, pipeline, num_ipus, measured)


def _compiled(executor):
    if executor._executable is None:
        raise RuntimeError("the model is not compiled: call it once (or model.compile(inputs)) first")
    return executor._executable


def _simulated_call(executor, exe) -> list[ipprofile.ExecutedStep]:
    """The steps of one call of `exe` with static costs, as the executor would run them."""
    opts, training = executor.options, executor._training
    returned = set(batching.output_plan(opts, training).returned_steps)
    g = opts.gradient_accumulation if training else 1
    costs = exe.engine.costs

    def event(op, part, index):
        return ipprofile.ProgramEvent(op, part, index, dict(costs[index].per_ipu))

    def runs(op):
        if op.kind == "U":
            return [event(op, "update", i) for i in exe.updates.programs.get(op.ipu, [])]
        key = program_key(op)
        k = op.global_micro_batch
        out = []
        for r, low in enumerate(exe.lowerings):
            sp = low.stage_programs.get(key)
            if sp is None:
                continue
            out += [event(op, "receive", ch.recv[k % ch.slots]) for ch in exe.in_channels[(r, key)] if ch.recv]
            out.append(event(op, "compute", sp.body))
            if sp.outputs >= 0 and (k // g, k % g) in returned:
                out.append(event(op, "outputs", sp.outputs))
        return out

    def sends(op):
        if op.kind == "U":
            return []
        key = program_key(op)
        k = op.global_micro_batch
        return [event(op, "send", ch.send[k % ch.slots]) for r in range(exe.replicas) for ch in exe.out_channels[(r, key)]]

    return ipprofile.simulate(exe.schedule, runs, sends)


def what_if(executor, *, target: str | ip.Target | None = None, split: list[list[str]] | None = None,
            num_ipus: int | None = None, directory: str | None = None) -> dict:
    """An estimated profile of the same model without running it: on another `target` (a name
    such as "Mk1", "Mk2", "Bow", or an ipusim.Target), with its blocks split into the given
    stages (`split`: block names per stage, stage k on IPU k) or, given `num_ipus`, with the
    advisor's best split over that many IPUs. The model is lowered and compiled again (memory
    is reported, not checked) and one call's schedule is timed with the static costs. With
    `directory`, the profile is also written there (profile.json, trace.json, charts) for
    `python -m ipusim.report DIR --compare OTHER`."""
    exe = _compiled(executor)
    tgt = exe.engine.target if target is None else (target if isinstance(target, ip.Target) else ip.get_target(target))
    names = [b for b, _ in block_order(exe.placement)]
    if split is not None and num_ipus is not None:
        raise ValueError("what_if: give split= or num_ipus=, not both")
    if num_ipus is not None:
        advice = advise(executor, num_ipus)
        if advice.best is None:
            raise ValueError(f"no split of the model over {num_ipus} IPUs fits in memory: {'; '.join(advice.notes)}")
        if len(set(advice.best.stage_ipus)) != len(advice.best.stage_ipus):
            raise ValueError("what_if re-lowers with stage k on IPU k; the advised split returns its last stage to "
                             "IPU 0: pass split= to choose the stages")
        split = advice.best.stages
    if split is not None:
        given = [b for stage in split for b in stage]
        if given != names:
            raise ValueError(f"what_if split {split} must list every block once, in pipeline order {names}")
        stage_of = {b: k for k, stage in enumerate(split) for b in stage}
    else:
        stage_of = {str(p.block.user_id): p.stage for p in exe.placement.blocks}
        if tuple(exe.placement.stage_ipus) != tuple(range(exe.placement.num_stages)):
            raise ValueError("what_if re-lowers with stage k on IPU k; this model places several stages on one IPU: "
                             "pass split= to choose the stages")
    est = _relowered(executor, stage_of, tgt, replicas=exe.replicas)
    stages = sorted(set(stage_of.values()))
    name = (executor.options.model_name or ("training" if executor._training else "inference")) + \
        f" on {tgt.name}" + (f", {len(stages)} IPUs" if split is not None else "")
    unfit = [r.ipu for r in est.engine.memory if not r.fits]
    notes = [f"estimated without running: the model lowered for {tgt.name} and one call's schedule timed with "
             "static cycle estimates"]
    if unfit:
        notes.append(f"does not fit: IPU{'s' if len(unfit) > 1 else ''} {', '.join(map(str, unfit))} exceed the "
                     f"{tgt.bytes_per_tile:,} bytes of a {tgt.name} tile")
    static = ipprofile.static_profile(
        name, est.engine, source="poptorch_lite", schedule=est.schedule,
        stages=[ipprofile.StageInfo(k, k, [b for b in names if stage_of[b] == k]) for k in stages],
        settings=settings_of(executor), estimated=True, notes=notes, operations=operations(est))
    rec = ipprofile.Recording(static.num_ipus)
    rec.add(_simulated_call(executor, est))
    if directory is not None:
        doc, _, _ = ipprofile.write_profile(directory, static, rec)
        return doc
    return ipprofile.build_profile(static, rec)
