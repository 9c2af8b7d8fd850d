"""Profiles: the profile.json schema, the Chrome trace, per-step accounting, utilisation against
the closed form, plain Engine profiling, the poptorch_lite hook and "what if" estimates."""
import collections
import dataclasses
import gc
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.device.model_error import KNOWN_ERRORS, known_errors
from ipusim.report import advisor
from ipusim.report import profile as prof
from ipusim.ops.matmul import matmul
from ipusim.schedules import pipelined_schedule
from tutorial_model import TUTORIAL_STRATEGY, Network, TrainingModelWithLoss

SMALL = ip.Target.test(num_tiles=64, bytes_per_tile=256 * 1024)


# --------------------------------------------------------------------------- helpers

def check_trace(trace: dict) -> dict:
    """Well-formed Chrome trace: complete events with the required fields, sorted and
    non-overlapping per lane; returns the events by (pid, tid)."""
    assert isinstance(trace["traceEvents"], list)
    lanes = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M", "C"), e
        if e["ph"] == "X":
            assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and isinstance(e["name"], str) and e["name"]
            assert e["dur"] > 0 and e["ts"] >= 0
            lanes[(e["pid"], e["tid"])].append(e)
    for events in lanes.values():
        for a, b in zip(events, events[1:]):
            assert a["ts"] <= b["ts"] and a["ts"] + a["dur"] <= b["ts"] + 1e-6, (a, b)
    return lanes


def lane_cycles(trace: dict) -> dict:
    """(ipu, kind) -> cycles drawn on that lane (exact: from the events' args)."""
    out = collections.Counter()
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["pid"] > 0 and e["cat"] in prof.SEGMENT_KINDS:
            out[(e["pid"] - 1, e["cat"])] += e["args"]["cycles"]
    return out


def pipeline_profile(n: int, g: int, stage_costs=None, update_cost: int = 1000):
    """The grouped training pipeline on N IPUs with static program costs: one program per
    (kind, stage), forward and backward of stage s costing stage_costs[s] (default 1000 each),
    and one weight update per IPU."""
    stage_costs = stage_costs or [1000] * n
    schedule = pipelined_schedule(n, training=True, gradient_accumulation=g)
    programs, index = [], {}
    for kind, s in [(k, s) for k in "FBU" for s in range(n)]:
        cost = update_cost if kind == "U" else stage_costs[s]
        index[(kind, s)] = len(programs)
        programs.append(prof.ProgramInfo(len(programs), f"{kind}{s}", ip.Cost(cost, {s: ip.Cycles(compute=cost)}),
                                         {s: [prof.Segment(f"{kind}{s}", "compute", cost)]}, {}, 0, 0))

    def events(op):
        p = programs[index[(op.kind, op.ipu if op.kind == "U" else op.stage)]]
        return [prof.ProgramEvent(op, "update" if op.kind == "U" else "compute", p.index, dict(p.cost.per_ipu))]

    static = prof.StaticProfile("pipeline", "ipusim", ip.GC200, n, [], programs, schedule=schedule,
                                stages=[prof.StageInfo(s, s, [f"B{s}"]) for s in range(n)])
    rec = prof.Recording(n)
    rec.add(prof.simulate(schedule, events))
    return static, rec


# --------------------------------------------------------------------------- utilisation

@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(0, 6))
def test_equal_stage_costs_give_the_closed_form_utilisation(n, extra):
    """docs/schedules.md: every IPU idles 2(N-1) of the 2(G+N-1)+1 steps of a group."""
    g = 2 * n - 1 + extra
    static, rec = pipeline_profile(n, g)
    doc = prof.build_profile(static, rec)
    closed_form = 1 - 2 * (n - 1) / (2 * (g + n - 1) + 1)
    for u in doc["execution"]["ipus"]:
        assert u["utilisation"] == pytest.approx(closed_form, abs=1e-12)
        assert u["bubble_fraction"] == pytest.approx(1 - closed_form, abs=1e-12)
        assert u["imbalance_fraction"] == 0
        assert u["schedule_bubble_fraction"] == pytest.approx(1 - closed_form, abs=1e-12)


def test_tutorial_figure_with_equal_costs():
    static, rec = pipeline_profile(4, 8)
    doc = prof.build_profile(static, rec)
    ex = doc["execution"]
    assert len(ex["steps"]) == 23 and ex["cycles"] == 23 * 1000
    assert [s["label"] for s in ex["steps"][:5]] == ["F1 s0", "F2 s0 F1 s1", "F3 s0 F2 s1 F1 s2",
                                                      "F4 s0 F3 s1 F2 s2 F1 s3", "B1 s3"]
    assert [u["utilisation"] for u in ex["ipus"]] == [17 / 23] * 4
    longest = ex["longest_stage"]
    assert longest["share_of_work"] == pytest.approx(0.25) and longest["cycles_per_micro_batch"] == 2000


def test_imbalance_is_waiting_not_bubble():
    """Doubling one stage's cost makes the other IPUs wait in the steps they share with it."""
    static, rec = pipeline_profile(3, 5, stage_costs=[1000, 2000, 1000])
    ex = prof.build_profile(static, rec)["execution"]
    assert ex["longest_stage"]["stage"] == 1 and ex["longest_stage"]["share_of_work"] == pytest.approx(0.5)
    ipus = ex["ipus"]
    assert ipus[1]["imbalance_fraction"] == 0 and ipus[0]["imbalance_fraction"] > 0
    for u in ipus:
        assert u["utilisation"] + u["bubble_fraction"] + u["imbalance_fraction"] == pytest.approx(1)
    assert ex["longest_stage"]["critical_fraction"] > 0.5


# --------------------------------------------------------------------------- plain Engine profiles

def two_ipu_engine(profile_dir=None):
    t = ip.Target.test(num_tiles=16)
    dev = ip.Device(t, 2)
    g0, g1 = dev.graph(0), dev.graph(1)
    a = g0.addVariable("float32", (32, 32), "a")
    b = g0.addVariable("float32", (32, 32), "b")
    e = g1.addVariable("float32", (32, 32), "e")
    for g, x in ((g0, a), (g0, b), (g1, e)):
        g.map_linearly(x)
    prog = ip.Sequence(ip.StreamCopy(g0.addHostToDeviceFIFO("in", "float32", (32, 32)), a), name="matmul step")
    c = matmul(g0, a, b, prog, "c")
    d = g1.addVariable("float32", (32, 32), "d")
    g1.map_linearly(d)
    prog.add(ip.InterIpuCopy(c, d))
    both = ip.Sequence(ip.Parallel(ip.Copy(a, b), ip.Copy(d, e)), ip.Repeat(3, ip.Sync(0)), name="copies")
    engine = ip.Engine(dev, [prog, both], profile_dir=profile_dir).load()
    engine.writeTensor(b, np.eye(32, dtype=np.float32))
    engine.connectStream("in", np.ones((32, 32), np.float32))
    return engine


def test_engine_profile_files_schema_and_trace(tmp_path, capsys):
    engine = two_ipu_engine(str(tmp_path))
    totals = [engine.run(0), engine.run(1), engine.run(0)]
    engine.close()
    out = capsys.readouterr().out
    assert "3 program runs" in out and "Memory per IPU" in out
    doc = prof.load(str(tmp_path))
    ex = doc["execution"]
    assert doc["source"] == "ipusim" and ex["calls"] == 3 and ex["cycles_per_call"] == totals
    assert [s["cycles"] for s in ex["steps"]] == totals and ex["cycles"] == sum(totals) == ex["total_cycles"]
    assert [s["label"] for s in ex["steps"]] == ["matmul step", "copies", "matmul step"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    check_trace(trace)
    busy = collections.Counter()
    for s in ex["steps"]:
        for b in s["busy"]:
            for k in prof.SEGMENT_KINDS:
                busy[(b["ipu"], k)] += b[k]
    assert lane_cycles(trace) == +busy
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"schedule", "IPU 0", "IPU 1"}
    # the cycle model's known error comes from its one table, in the file and in the summary
    assert doc["model_error"] == known_errors() and [e["part"] for e in doc["model_error"]] == \
        [e.part for e in KNOWN_ERRORS]
    for e in KNOWN_ERRORS:
        assert e.statement() in out
    assert "matmul partials (AMP, float16): within 2.1% of published" in out
    engine.close()      # finishing twice writes nothing more and prints nothing
    assert capsys.readouterr().out == ""


def test_a_long_trace_details_the_first_steps_and_keeps_every_step(tmp_path, monkeypatch):
    """Past TRACE_EVENT_LIMIT events the IPUs' lanes stop (a full-size call has thousands of steps
    of thousands of events); the schedule lane keeps every step and otherData says how many are
    detailed."""
    engine = two_ipu_engine(str(tmp_path))
    runs = [engine.run(i % 2) for i in range(6)]
    engine.close()
    whole = json.loads((tmp_path / "trace.json").read_text())
    assert whole["otherData"]["steps_detailed"] == whole["otherData"]["steps"] == 6
    first = [e for e in whole["traceEvents"]
             if e["ph"] == "X" and e["pid"] > 0 and (e["args"]["call"], e["args"]["step"]) == (1, 1)]
    monkeypatch.setattr(prof, "TRACE_EVENT_LIMIT", 1)   # reached within the first step's events
    engine = two_ipu_engine(str(tmp_path / "limited"))
    assert [engine.run(i % 2) for i in range(6)] == runs
    engine.close()
    trace = json.loads((tmp_path / "limited" / "trace.json").read_text())
    assert trace["otherData"]["steps_detailed"] == 1 and trace["otherData"]["steps"] == 6
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    assert [e["args"]["cycles"] for e in steps] == runs
    detailed = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] > 0]
    assert {(e["args"]["call"], e["args"]["step"]) for e in detailed} == {(1, 1)} and len(detailed) == len(first) > 0


def test_engine_profile_is_written_when_the_engine_is_freed(tmp_path):
    engine = two_ipu_engine(str(tmp_path))
    engine.run(1)
    assert not (tmp_path / "profile.json").exists()
    engine.cycle = engine   # freed by the garbage collector, not when the last reference goes
    del engine
    written_while_collecting = []
    watch = lambda phase, info: written_while_collecting.append((tmp_path / "profile.json").exists())
    gc.callbacks.append(watch)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(watch)
    # nothing is written from inside the collector (which can start in the middle of any
    # allocation: an ast.parse, a print, an import); it waits for the next safe point
    assert written_while_collecting == [False, False]
    assert not (tmp_path / "profile.json").exists()
    prof.finish_collected()
    assert prof.load(str(tmp_path))["execution"]["calls"] == 1
    prof.finish_collected()    # once


def test_a_profiled_model_freed_during_a_parse_finishes_after_it(tmp_path, capsys):
    """Finishing a profile imports and compiles code: inside the collector, in the middle of an
    ast.parse, that corrupted CPython 3.11's parser state (SystemError: AST constructor recursion
    depth mismatch)."""
    import ast
    model = poptorch.inferenceModel(torch.nn.Linear(4, 4), poptorch.Options().enableProfiling(str(tmp_path)))
    model(torch.ones(2, 4))
    model.cycle = model
    del model
    source = "\n".join(f"def f{i}(x):\n    return [x + {i} for _ in range(3)]" for i in range(400))
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)   # collections during the parse's allocations
    try:
        ast.parse(source)
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    poptorch.inferenceModel(torch.nn.Linear(4, 4))(torch.ones(2, 4))   # a model call finishes it
    assert "Profile written to" in capsys.readouterr().out
    assert (tmp_path / "inference" / "profile.html").exists()


def test_profiling_off_records_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = two_ipu_engine()
    report = engine.execute(0)
    assert engine._profiler is None and report.nodes is None
    engine.close()
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- schema

def test_validation_names_what_is_wrong():
    static, rec = pipeline_profile(2, 3)
    doc = prof.build_profile(static, rec)
    prof.validate(doc)
    broken = json.loads(json.dumps(doc))
    del broken["execution"]["steps"][0]["cycles"]
    broken["memory"]["supersteps"][0]["count"] = -1
    with pytest.raises(prof.ProfileError, match=r"steps\[0\]: missing required field 'cycles'") as error:
        prof.validate(broken)
    assert "supersteps[0].count: -1 is below the minimum 0" in str(error.value)
    with pytest.raises(prof.ProfileError, match="reads versions 2 and 3; the file has version 99"):
        prof.validate({**doc, "version": 99})


def test_schema_is_a_valid_json_schema_that_accepts_profiles():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(prof.PROFILE_SCHEMA)
    static, rec = pipeline_profile(3, 5)
    jsonschema.validate(prof.build_profile(static, rec), prof.PROFILE_SCHEMA)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="autoReport.directory"):
        prof.load(str(tmp_path))
    (tmp_path / "profile.json").write_text("{not json")
    with pytest.raises(prof.ProfileError, match="is not JSON"):
        prof.load(str(tmp_path))


# --------------------------------------------------------------------------- poptorch_lite models

def tutorial_training(profile_dir, **names):
    torch.manual_seed(0)
    model = TrainingModelWithLoss(Network())
    opts = poptorch.Options().setExecutionStrategy(TUTORIAL_STRATEGY)
    opts.Emulator.setTarget(SMALL)
    opts.Training.gradientAccumulation(8)
    if profile_dir is not None:
        opts.enableProfiling(str(profile_dir))
    if names.get("model_name"):
        opts.modelName(names["model_name"])
    return poptorch.trainingModel(model, opts)


BATCH = (torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(0)),
         torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(1)))


class TiedLanguageModel(torch.nn.Module):
    """An embedding on IPU 0, a layer on IPU 1, and the output projection tied to the embedding
    back on IPU 0 (BERT's and GPT's layout); with `zigzag`, the loss in one more block on IPU 1."""

    def __init__(self, zigzag: bool = False):
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.layer = torch.nn.Linear(8, 8)
        self.zigzag = zigzag

    def forward(self, ids, labels):
        ids = ids.clamp(0, 15)   # an op before the first block: IPU 0, with the embedding
        with poptorch.Block("embedding", ipu_id=0):
            x = self.embedding(ids)
        with poptorch.Block("layer", ipu_id=1):
            x = torch.relu(self.layer(x))
        with poptorch.Block("head", ipu_id=0):
            logits = x @ self.embedding.weight.t()
        with poptorch.Block("loss", ipu_id=1 if self.zigzag else 0):
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))


def compiled_tied_model(profile_dir, zigzag: bool = False):
    torch.manual_seed(0)
    opts = poptorch.Options().setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    opts.Emulator.setTarget(SMALL)
    opts.Training.gradientAccumulation(8)
    opts.useOfflineIpuTarget().enableProfiling(str(profile_dir))
    net = TiedLanguageModel(zigzag)
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), 0.1))
    ids = torch.randint(0, 16, (8, 4), generator=torch.Generator().manual_seed(0))
    model.compile(ids, ids)
    return model, ids


def test_compiled_model_profile_has_its_memory_and_advice_before_any_call(tmp_path):
    """PopTorch writes the memory report when it compiles: a model compiled and never run (an
    offline target, as with an application's --compile-only) has profile.json with the memory of
    every IPU and no calls. Its last stage returns to IPU 0 (the head tied to the embedding): the
    balance advice keeps it there and splits the other blocks."""
    model, ids = compiled_tied_model(tmp_path)
    assert sorted(os.listdir(tmp_path / "training")) == ["profile.json"]
    doc = prof.load(str(tmp_path / "training"))
    assert doc["execution"]["calls"] == 0 and doc["num_ipus"] == 2
    assert [m["ipu"] for m in doc["memory"]["ipus"]] == [0, 1] and all(m["total_bytes"] > 0 for m in doc["memory"]["ipus"])
    text = prof.summary(doc)
    assert "compiled, not run" in text and "per call" not in text and text.count("busiest tile") == 2
    blocks = doc["blocks"]
    assert blocks["names"] == ["embedding", "layer", "head, loss"] and blocks["tail"] and blocks["current_split"] == [1, 1]
    two = advisor.advise_profile(doc)
    assert two.current.stage_ipus == (0, 1, 0) and two.current.ipu_blocks() == [["embedding", "head, loss"], ["layer"]]
    assert "current  IPU0: embedding, head, loss | IPU1: layer" in two.text()
    one = advisor.advise_profile(doc, 1)
    assert one.best.ipu_blocks() == [["embedding", "layer", "head, loss"]] and one.best.cycles > two.current.cycles
    with pytest.raises(poptorch.Error, match="offline"):
        model(ids, ids)
    model.destroy()
    assert sorted(os.listdir(tmp_path / "training")) == ["profile.json"]   # nothing ran: the compile report stays


def test_blocks_sharing_a_weight_across_ipus_get_no_advice_and_a_note_saying_why(tmp_path):
    model, _ = compiled_tied_model(tmp_path, zigzag=True)
    doc = prof.load(str(tmp_path / "training"))
    assert doc["blocks"] is None
    assert any("share the weight 'embedding.weight'" in n and "'embedding' and 'head'" in n for n in doc["notes"])
    model.destroy()


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """The tutorial network trained for two calls with profiling on; the profile before and
    after the model is destroyed, and the summary it printed."""
    root = tmp_path_factory.mktemp("profile")
    model = tutorial_training(root)
    model(*BATCH)
    early = sorted(os.listdir(root / "training"))
    records = [model.last_run]
    model(*BATCH)
    records.append(model.last_run)
    printed = []
    model._profiler.session.echo = printed.append
    model.destroy()
    return {"dir": root / "training", "early": early, "records": records, "printed": printed, "model": model}


@pytest.mark.slow
def test_model_profile_files(profiled):
    assert profiled["early"] == ["host_trace.json", "profile.json", "trace.json"]       # written after the first call
    files = sorted(os.listdir(profiled["dir"]))
    assert files == ["host_trace.json", "memory.png", "pipeline.png", "profile.html", "profile.json", "trace.json",
                     "utilisation.png"]
    doc = prof.load(str(profiled["dir"]))
    assert doc["source"] == "poptorch_lite" and doc["name"] == "training" and not doc["estimated"]
    assert doc["target"]["num_tiles"] == 64 and doc["num_ipus"] == 4
    assert all(st["weight_gradient"] is None for st in doc["execution"]["stages"])   # PopTorch's whole backwards
    assert doc["settings"]["samples_per_call"] == 16 and doc["settings"]["gradient_accumulation"] == 8


@pytest.mark.slow
def test_model_profile_per_step_durations_add_up(profiled):
    doc = prof.load(str(profiled["dir"]))
    ex = doc["execution"]
    records = profiled["records"]
    assert records[0] is not records[1]  # a profiled call makes its own record
    assert ex["calls"] == 2 and ex["cycles_per_call"] == [r.cycles for r in records]
    assert ex["total_cycles"] == sum(r.cycles for r in records)
    steps = ex["steps"]
    assert [s["cycles"] for s in steps] == [s.cycles for s in records[0].steps]
    assert sum(s["cycles"] for s in steps) == ex["cycles"] == ex["cycles_per_call"][0]
    assert all(b["start_cycle"] == a["start_cycle"] + a["cycles"] for a, b in zip(steps, steps[1:]))
    for s in steps:
        assert s["cycles"] == max(b["total"] for b in s["busy"])
        assert s["critical_ipu"] == max(s["busy"], key=lambda b: (b["total"], -b["ipu"]))["ipu"]


@pytest.mark.slow
def test_model_profile_stages_memory_and_traffic(profiled):
    doc = prof.load(str(profiled["dir"]))
    ex = doc["execution"]
    assert [(s["stage"], s["ipu"], s["blocks"]) for s in ex["stages"]] == [(i, i, [f"B{i + 1}"]) for i in range(4)]
    # measured on the traced (first) call: 8 micro-batches
    assert all(s["forward"]["runs"] == 8 and s["backward"]["runs"] == 8 for s in ex["stages"])
    work = [s["forward"]["cycles_per_micro_batch"] + s["backward"]["cycles_per_micro_batch"]
            + (s["recompute"] or {}).get("cycles_per_micro_batch", 0.0) for s in ex["stages"]]
    assert [s["recompute"] is not None for s in ex["stages"]] == [True, True, True, False]   # PopTorch's default
    assert ex["longest_stage"]["stage"] == int(np.argmax(work))
    assert ex["longest_stage"]["share_of_work"] == pytest.approx(max(work) / sum(work))
    assert len(ex["updates"]) == 4
    assert ex["inter_ipu"]["bytes_per_call"] == sum(link["bytes"] for link in ex["inter_ipu"]["links"]) > 0
    assert {(link["src"], link["dst"]) for link in ex["inter_ipu"]["links"]} >= {(0, 1), (1, 2), (2, 3), (3, 2)}
    for m in doc["memory"]["ipus"]:
        peak = np.asarray(m["per_tile"]["peak"])
        parts = sum(np.asarray(m["per_tile"][k]) for k in ("always_live", "not_always_live_peak", "vertex_state", "code"))
        assert np.array_equal(peak, parts) and m["total_bytes"] == peak.sum() and m["max_tile_bytes"] == peak.max()
        assert {"weights", "accumulators", "optimiser_state", "code", "vertex_state"} <= set(m["by_category"])
        assert len(m["liveness"]) == sum(s["count"] for s in doc["memory"]["supersteps"])
    assert any("stashed_activations" in m["by_category"] for m in doc["memory"]["ipus"])


@pytest.mark.slow
def test_model_trace_matches_the_record(profiled):
    trace = json.loads((profiled["dir"] / "trace.json").read_text())
    lanes = check_trace(trace)
    record = profiled["records"][0]
    busy = collections.Counter()
    for s in record.steps:
        for ipu, c in s.busy.items():
            for k in prof.SEGMENT_KINDS:
                busy[(ipu, k)] += getattr(c, k)
    assert lane_cycles(trace) == +busy
    steps = lanes[(0, 1)]
    assert [e["args"]["cycles"] for e in steps] == [s.cycles for s in record.steps]
    clock = SMALL.clock_hz
    # ts and dur are microseconds rounded to 6 decimals each
    assert steps[-1]["ts"] + steps[-1]["dur"] == pytest.approx(record.cycles / clock * 1e6, abs=1e-6)
    ops = [e["name"] for e in lanes[(4, 1)]]           # IPU 3's op lane: F1 s3, B1 s3, F2 s3, ...
    assert ops[:4] == ["F1 s3", "B1 s3", "F2 s3", "B2 s3"] and ops[-1] == "U ipu3"


@pytest.mark.slow
def test_model_summary_is_printed_once(profiled):
    (text,) = profiled["printed"]
    assert "Longest stage: stage" in text and "Memory per IPU" in text
    for i in range(4):
        assert f"IPU {i}" in text
    assert "Balance advice" in text and "already the best" in text
    assert "Cycle model against published IPU measurements" in text
    assert all(e.statement() in text for e in KNOWN_ERRORS)
    assert profiled["model"]._profiler.finish() is None        # never twice


@pytest.mark.slow
def test_poplar_engine_options_turn_profiling_on(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", json.dumps({"autoReport.all": "true",
                                                            "autoReport.directory": str(tmp_path)}))
    model = tutorial_training(None, model_name="tutorial")
    model(*BATCH)
    assert model._profiler is not None and model._profiler.directory == str(tmp_path / "tutorial")
    model._profiler.session.echo = lambda text: None
    model.destroy()
    assert prof.load(str(tmp_path / "tutorial"))["name"] == "tutorial"


@pytest.mark.slow
def test_no_profiler_without_profiling(tmp_path, monkeypatch):
    monkeypatch.delenv("POPLAR_ENGINE_OPTIONS", raising=False)
    monkeypatch.chdir(tmp_path)
    model = tutorial_training(None)
    model(*BATCH)
    assert model._profiler is None
    model.destroy()
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_what_if_estimates(profiled, tmp_path):
    """Re-lowering on the same target reproduces the measured call exactly; on Bow (a faster
    GC200) compute cycles stay and the call takes less time; Mk1 is estimated without running."""
    from poptorch_lite.runtime.profiling import what_if
    model = tutorial_training(None)
    model(*BATCH)
    measured = model.last_run
    same = what_if(model)
    assert same["estimated"] and same["execution"]["cycles"] == measured.cycles
    assert [s["cycles"] for s in same["execution"]["steps"]] == [s.cycles for s in measured.steps]
    bow = what_if(model, target=dataclasses.replace(SMALL, name="small Bow", clock_hz=ip.BOW.clock_hz),
                  directory=str(tmp_path / "bow"))
    prof.validate(bow)
    assert [u["busy"]["compute"] for u in bow["execution"]["ipus"]] == \
        [u["busy"]["compute"] for u in same["execution"]["ipus"]]
    assert bow["execution"]["cycles"] / bow["target"]["clock_hz"] < measured.cycles / SMALL.clock_hz
    assert (tmp_path / "bow" / "pipeline.png").exists()
    mk1 = what_if(model, target="Mk1")
    assert mk1["target"]["name"] == "GC2" and mk1["target"]["num_tiles"] == 1216
    assert "estimated without running" in mk1["notes"][0]
    assert "estimate, not run" in prof.summary(mk1)
    model.destroy()


@pytest.mark.slow
def test_profile_of_a_zero_bubble_run(tmp_path):
    """A model trained under ZB-H1 is profiled and estimated under ZB-H1: the profile records its
    schedule, each stage's backward is its B and W together and its weight gradient W alone, the
    what-if estimate on the same target re-lowers with the split backward and reproduces the
    measured call, and the schedule comparison prices the split kinds with the measured W."""
    from ipusim.report import pricing
    from poptorch_lite.runtime.profiling import what_if
    torch.manual_seed(0)
    model = TrainingModelWithLoss(Network())
    opts = poptorch.Options().setExecutionStrategy(TUTORIAL_STRATEGY)
    opts.Emulator.setTarget(SMALL).setPipelineSchedule("ZB-H1")
    opts.Training.gradientAccumulation(8)
    opts.enableProfiling(str(tmp_path))
    training = poptorch.trainingModel(model, opts)
    training(*BATCH)
    measured = training.last_run
    same = what_if(training)
    assert same["execution"]["schedule"]["strategy"] == "ZB-H1"
    assert same["execution"]["cycles"] == measured.cycles
    exe = training._executable
    training.destroy()
    doc = prof.load(str(tmp_path / "training"))
    assert doc["execution"]["schedule"]["strategy"] == "ZB-H1"
    low, costs = exe.lowering, exe.engine.costs
    priced = pricing.stage_costs(doc)
    for st, stage_costs in zip(doc["execution"]["stages"], priced.stages):
        body = {key[0]: costs[sp.body].per_ipu[sp.ipu].total for key, sp in low.stage_programs.items()
                if key[1] == st["stage"]}
        recomputed = {"recompute"} if st["stage"] < 3 else set()   # PopTorch's default recomputation
        assert set(body) == ({"fwd", "wgrad"} if st["stage"] == 0 else {"fwd", "bwd", "wgrad"}) | recomputed
        assert st["backward"]["body_cycles"] == body.get("bwd", 0) + body["wgrad"]
        assert st["weight_gradient"]["body_cycles"] == body["wgrad"]
        assert stage_costs.weight_gradient == st["weight_gradient"]["cycles_per_micro_batch"]
        assert stage_costs.backward + stage_costs.weight_gradient == st["backward"]["cycles_per_micro_batch"]
    comparison = pricing.compare(doc)
    assert "B and W as measured" in pricing.text(comparison)
    first = comparison.rows[0]
    assert first.kind == "ZB-H1 (profiled)" and first.schedule.split_backward
    assert first.price.event_driven.cycles > 0
    assert "W = 0.5 x the profiled backward (an assumption: given instead of the measured W)" in \
        pricing.text(pricing.compare(doc, 0.5))
