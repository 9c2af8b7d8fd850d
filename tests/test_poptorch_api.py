"""PopTorch API names beyond the core: the Options methods that shape compiling (from_json,
inputReplicaGrouping, updatableNamedBuffers, sourceLocationExcludes, maxRepeatLogs), NameScope and
LegacyBeginBlockFn, each checked by what it changes."""
import logging
import sys

import pytest
import torch

import poptorch_lite as poptorch
from poptorch_lite.api import options as options_module
from poptorch_lite.api.enums import CommGroupType


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, 3))

    def forward(self, x):
        return x @ self.w


def test_from_json_applies_setters_and_names_itself_in_errors():
    opts = poptorch.Options().from_json(
        '{"deviceIterations": 4, "Training.gradientAccumulation": 2, "outputMode": "OutputMode.All",'
        ' "_Popart.set": ["autoRecomputation", 3]}')
    assert (opts.device_iterations, opts.gradient_accumulation) == (4, 2)
    assert opts.output_mode == poptorch.OutputMode.All and opts._Popart.options["autoRecomputation"] == 3
    with pytest.raises(AttributeError, match=r"Options.from_json, 'deviceIteration': unknown option"):
        poptorch.Options().from_json('{"deviceIteration": 4}')
    with pytest.raises(ValueError, match="Options.from_json is not valid JSON"):
        poptorch.Options().from_json("{")


def test_input_replica_grouping_validates_as_poptorch():
    opts = poptorch.Options().replicationFactor(4)
    assert opts.inputReplicaGrouping(4, CommGroupType.NoGrouping) is opts      # groups of one
    assert (opts.input_group_size, opts.input_cgt) == (1, CommGroupType.Consecutive)
    opts.inputReplicaGrouping(1, CommGroupType.Orthogonal)
    assert opts.toDict()["input_cgt"] == "CommGroupType.Orthogonal"
    with pytest.raises(ValueError, match="input_group_type cannot be All"):
        opts.inputReplicaGrouping(2, CommGroupType.All)
    with pytest.raises(ValueError, match=r"input_group_size cannot be larger than replication_factor \(8 > 4\)"):
        opts.inputReplicaGrouping(8, CommGroupType.Consecutive)
    with pytest.raises(ValueError, match=r"input_group_size must be a factor of replication_factor \(3 does"):
        opts.inputReplicaGrouping(3, CommGroupType.Consecutive)
    opts.inputReplicaGrouping(2, CommGroupType.Consecutive)
    assert (opts.input_group_size, opts.input_groups) == (2, 2)


def test_updatable_named_buffers_are_recorded_for_the_device_copy():
    opts = poptorch.Options().updatableNamedBuffers(["bn.running_mean"])
    assert opts._Popart.options["updatableNamedBuffers"] == ["bn.running_mean"]
    with pytest.raises(TypeError, match="list of buffer names"):
        poptorch.Options().updatableNamedBuffers("bn.running_mean")


def test_exists_and_check_is_frozen():
    opts = poptorch.Options()
    assert opts.exists("device_iterations") and not opts.exists("random_seed")
    assert opts.randomSeed(1).exists("random_seed")
    opts.checkIsFrozen()
    opts._freeze()
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.checkIsFrozen()


def _helper_module(tmp_path, name="mylib_helpers"):
    (tmp_path / f"{name}.py").write_text("def double(x):\n    return x * 2\n")
    sys.path.insert(0, str(tmp_path))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_source_location_excludes_choose_the_reported_line(tmp_path):
    helpers = _helper_module(tmp_path)

    class Model(torch.nn.Module):
        def forward(self, x):
            with poptorch.Block("A"):
                x = x + 1
            return helpers.double(x)          # outside any block: the error names a source line

    def error_for(opts):
        with pytest.raises(poptorch.Error) as info:
            poptorch.inferenceModel(Model(), opts).compile(torch.ones(2))
        return str(info.value)

    assert "mylib_helpers.py:2" in error_for(poptorch.Options())
    text = error_for(poptorch.Options().appendToLocationExcludes("mylib_helpers"))
    assert "mylib_helpers.py" not in text and "test_poptorch_api.py" in text
    opts = poptorch.Options().sourceLocationExcludes(["mylib_helpers"])
    assert opts.source_location_excludes == ["mylib_helpers"]
    with pytest.raises(TypeError, match="path fragments"):
        poptorch.Options().sourceLocationExcludes("mylib")


def test_max_repeat_logs_limits_a_repeating_warning(caplog):
    class Many(torch.nn.Module):
        def forward(self, x):
            for _ in range(6):
                x = poptorch.set_available_memory(x + 1, 0.5)   # no matmul: warns each time
            return x

    def warnings_for(opts):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
            poptorch.inferenceModel(Many(), opts).compile(torch.ones(2))
        return [r.getMessage() for r in caplog.records if "set_available_memory" in r.getMessage()
                or "repeated messages" in r.getMessage()]

    try:
        limited = warnings_for(poptorch.Options().maxRepeatLogs(2))
        assert len(limited) == 3 and limited[-1] == "...repeated messages suppressed..."
        assert len(warnings_for(poptorch.Options().maxRepeatLogs(None))) == 6
        assert len(warnings_for(poptorch.Options())) == 5      # the default: 4, then the notice
    finally:
        options_module.repeat_limit.limit = options_module.DEFAULT_REPEAT_LOGS
    with pytest.raises(ValueError, match="maxRepeatLogs must be >= 0"):
        poptorch.Options().maxRepeatLogs(-1)


def test_name_scopes_land_in_op_names_and_the_placement_table(tmp_path):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3, 3))

        def forward(self, x):
            with poptorch.NameScope("encoder"):
                with poptorch.NameScope("attention"):
                    x = x @ self.w
                x = x.relu()
            return x + 1

    table = poptorch.op_placement(Model(), None, torch.ones(2, 3))
    scopes = {r.op: r.scope for r in table}
    assert scopes["aten.mm"] == "encoder/attention" and scopes["aten.relu"] == "encoder"
    assert scopes["aten.add"] == "" and "scope" in str(table)
    model = poptorch.inferenceModel(Model(), poptorch.Options().enableProfiling(str(tmp_path)).modelName("s"))
    model(torch.ones(2, 3))
    names = {v.name for g in model._executable.engine.device.graphs for v in g.variables}
    model.destroy()
    import json
    operations = json.load(open(tmp_path / "s" / "profile.json"))["operations"]
    assert any(op["name"].startswith("encoder/attention/") for op in operations)
    assert any("/encoder/attention/" in n for n in names)
    assert any("/encoder/" in n and "attention" not in n for n in names)
    with pytest.raises(poptorch.BlockError, match="without '/'"):
        poptorch.NameScope("a/b")


def test_legacy_begin_block_fn_starts_its_block_when_called():
    def layer(x):
        return x * 2

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = poptorch.BeginBlock(layer, "B1", ipu_id=1)

        def forward(self, x):
            return self.first(x + 1) - 1

    model = Model()
    assert isinstance(model.first, poptorch.LegacyBeginBlockFn)
    rows = poptorch.op_placement(model, None, torch.ones(2)).by_origin()
    assert [r[1:4] for r in rows] == [(None, 0, 0), ("B1", 1, 1), ("B1", 1, 1)]


# ---- the compiled model's PopTorch methods -------------------------------------------------------

class Matmul(torch.nn.Module):
    def forward(self, x, y):
        return torch.matmul(x, y)


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x, target):
        out = self.linear(x) + self.offset
        return out, torch.nn.functional.mse_loss(out, target)


def test_cycle_count_is_the_last_runs_cycles_and_needs_log_cycle_count():
    model = poptorch.inferenceModel(Matmul(), poptorch.Options().logCycleCount(True))
    with pytest.raises(poptorch.Error, match="run the model at least once"):
        model.cycleCount()
    model(torch.randn(8, 8), torch.randn(8, 8))
    assert model.cycleCount() == model.last_run.cycles > 0
    plain = poptorch.inferenceModel(Matmul())
    plain(torch.randn(8, 8), torch.randn(8, 8))
    with pytest.raises(poptorch.Error, match="Please set option logCycleCount to True"):
        plain.cycleCount()


def test_perf_counters_have_poptorchs_shape_and_the_run_records_times():
    model = poptorch.inferenceModel(Matmul(), poptorch.Options().deviceIterations(4))
    assert model.getPerfCounters() == {k: [[]] for k in ("input", "input_complete", "output", "output_complete")}
    model(torch.randn(4, 16, 16), torch.randn(4, 16, 16))
    perf = model.getPerfCounters()
    assert [len(perf[k]) for k in ("input", "input_complete", "output", "output_complete")] == [2, 2, 1, 1]
    assert all(len(per) == 4 for values in perf.values() for per in values)
    for i in range(4):                                   # each iteration: request, transfer, compute, send
        assert perf["input"][0][i] < perf["input_complete"][0][i] <= perf["output"][0][i] \
            < perf["output_complete"][0][i]
    assert perf["output_complete"][0][-1] <= model.last_run.seconds
    for latency in (model.getHostIpuLatency(), model.getComputeLatency(), model.getIpuHostLatency(),
                    model.getLatency()):
        low, high, mean = latency
        assert 0 < low <= mean <= high
    assert model.getLatency()[0] > model.getComputeLatency()[0]


def test_perf_counters_follow_the_output_mode_in_training():
    opts = poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.Final)
    opts.Training.gradientAccumulation(2)
    model = poptorch.trainingModel(Regression(), opts)
    model(torch.randn(8, 4), torch.randn(8, 4))
    perf = model.getPerfCounters()
    assert len(perf["input"]) == 2 and all(len(v) == 4 for v in perf["input"])
    assert len(perf["output"]) == 2 and all(len(v) == 1 for v in perf["output"])
    low, high, mean = model.getLatency()
    assert 0 < low <= mean <= high


def test_tensor_names_are_what_anchor_tensor_can_return():
    model = poptorch.trainingModel(Regression())
    with pytest.raises(AssertionError, match="must be compiled"):  # PopTorch's assert
        model.getTensorNames()
    model.compile(torch.randn(2, 4), torch.randn(2, 4))
    names = model.getTensorNames()
    assert set(names) == {f"{k}linear.{p}" for k in ("Gradient___", "UpdatedVar___") for p in ("weight", "bias")}
    inference = poptorch.inferenceModel(Matmul())
    inference.compile(torch.randn(2, 2), torch.randn(2, 2))
    assert inference.getTensorNames() == []


def test_compilation_time_is_measured_and_needs_the_progress_bar_option():
    model = poptorch.inferenceModel(Matmul())
    with pytest.raises(poptorch.Error, match="compile the model before"):
        model.compilationTime()
    start = __import__("time").perf_counter()
    model.compile(torch.randn(2, 2), torch.randn(2, 2))
    elapsed = __import__("time").perf_counter() - start
    assert 0 < model.compilationTime().total_seconds() <= elapsed
    quiet = poptorch.inferenceModel(Matmul(), poptorch.Options().showCompilationProgressBar(False))
    quiet.compile(torch.randn(2, 2), torch.randn(2, 2))
    with pytest.raises(poptorch.Error, match="showCompilationProgressBar"):
        quiet.compilationTime()


class Noisy(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, training=True) + torch.rand_like(x)


def test_rng_state_reads_and_restores_the_device_generator():
    model = poptorch.inferenceModel(Noisy(), poptorch.Options().randomSeed(7))
    x = torch.ones(64)
    with pytest.raises(poptorch.Error, match="not been compiled"):
        model.rng_state
    model.compile(x)
    state = model.rng_state
    assert state[0] == 7 and len(state) >= 2
    first = model(x)
    assert model.rng_state != state                       # the seeds advanced
    second = model(x)
    assert not torch.equal(first, second)
    model.rng_state = state
    assert torch.equal(model(x), first)
    with pytest.raises(poptorch.Error, match="integers in"):
        model.rng_state = [1]


def test_copy_named_buffers_to_device_writes_only_those_buffers():
    net = Regression()
    opts = poptorch.Options().updatableNamedBuffers(["offset"])
    model = poptorch.inferenceModel(net, opts)
    x = torch.randn(2, 4)
    before = model(x, x)[0]
    with torch.no_grad():
        net.offset.fill_(1.0)
        net.linear.bias.fill_(100.0)      # a parameter: not copied by copyNamedBuffersToDevice
    model.copyNamedBuffersToDevice()
    after = model(x, x)[0]
    torch.testing.assert_close(after, before + 1.0)
    other = poptorch.inferenceModel(Regression())
    other(x, x)
    with pytest.raises(poptorch.Error, match="No named buffers marked as updatable"):
        other.copyNamedBuffersToDevice()
    unknown = poptorch.inferenceModel(Regression(), poptorch.Options().updatableNamedBuffers(["offset", "scale"]))
    with pytest.raises(poptorch.Error, match=r"updatableNamedBuffers names \['scale'\].*its buffers: \['offset'\]"):
        unknown(x, x)   # checked when compiled


def test_compile_and_export_then_load_runs_without_compiling(tmp_path):
    torch.manual_seed(0)
    net = Regression()
    opts = poptorch.Options().randomSeed(3)
    optimizer = poptorch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = poptorch.trainingModel(net, opts, optimizer)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    model(x, y)
    path = str(tmp_path / "sub" / "model.poptorch")
    model.save(path)
    expected = model(x, y)

    compiled = []
    handle = poptorch.registerPreCompileHook(lambda: compiled.append(1))
    try:
        loaded = poptorch.load(path, edit_opts_fn=lambda o: o.modelName("reloaded"))
        assert loaded.isCompiled() and loaded.options.model_name == "reloaded" and not compiled
        got = loaded(x, y)
    finally:
        handle.remove()
    torch.testing.assert_close(got, expected)   # same weights and momentum: the same step

    inference = poptorch.inferenceModel(Matmul())
    exported = str(tmp_path / "inference.poptorch")
    inference.compileAndExport(exported, torch.randn(3, 3), torch.randn(3, 3), export_model=False)
    with pytest.raises(poptorch.Error, match="export_model=False"):
        poptorch.load(exported)
    directory = tmp_path / "exports"
    directory.mkdir()
    inference.save(str(directory))                       # a directory: saved as model.poptorch in it
    assert [p.name for p in directory.iterdir()] == ["model.poptorch"]
    again = poptorch.inferenceModel(Matmul())
    again.loadExecutable(exported)
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    torch.testing.assert_close(again(a, b), a @ b)
    import pickle
    metadata = pickle.loads(poptorch.importPoptorchMetadataFromFile(exported))
    assert metadata.training is False and metadata.model is None and len(metadata.call[0]) == 2
    (tmp_path / "junk.poptorch").write_bytes(b"not a model")
    with pytest.raises(poptorch.Error, match="Invalid file"):
        poptorch.load(str(tmp_path / "junk.poptorch"))


def test_compile_hooks_run_in_order_and_can_be_removed():
    calls = []
    handles = [poptorch.registerPreCompileHook(lambda: calls.append("pre1")),
               poptorch.registerPreCompileHook(lambda: calls.append("pre2")),
               poptorch.registerPostCompileHook(lambda: calls.append("post"))]
    try:
        poptorch.inferenceModel(Matmul()).compile(torch.ones(2, 2), torch.ones(2, 2))
        assert calls == ["pre1", "pre2", "post"]
        handles[1].remove()
        calls.clear()
        poptorch.inferenceModel(Matmul()).compile(torch.ones(2, 2), torch.ones(2, 2))
        assert calls == ["pre1", "post"]
    finally:
        for h in handles:
            h.remove()
    with pytest.raises(RuntimeError, match="must be callable"):
        poptorch.registerPreCompileHook(3)


def test_load_state_dict_reaches_the_device():
    net = Regression()
    model = poptorch.inferenceModel(net)
    x = torch.randn(2, 4)
    model(x, x)
    state = {k: torch.zeros_like(v) for k, v in net.state_dict().items()}
    model.load_state_dict(state)
    torch.testing.assert_close(model(x, x)[0], torch.zeros(2, 4))


def test_every_poptorch_method_exists_and_a_missing_one_is_named(monkeypatch):
    from poptorch_lite.runtime import executor
    model = poptorch.inferenceModel(Matmul())
    for name in executor.POPTORCH_METHODS:
        assert hasattr(type(model), name), name
    monkeypatch.setattr(executor, "POPTORCH_METHODS", executor.POPTORCH_METHODS | {"replicaGroupingOf"})
    with pytest.raises(NotImplementedError, match=r"PoplarExecutor.replicaGroupingOf .* is not supported"):
        model.replicaGroupingOf
    with pytest.raises(AttributeError, match="'Matmul' object has no attribute 'nothing'"):
        model.nothing


# ---- popart ------------------------------------------------------------------------------------

def test_import_popart_under_the_runner_gives_popart_names():
    import importlib
    from poptorch_lite import runner
    from poptorch_lite.api import popart
    saved_path = list(sys.meta_path)
    saved = {n: m for n, m in sys.modules.items() if n in ("poptorch", "popart") or n.startswith("poptorch.")}
    try:
        runner.install()
        module = importlib.import_module("popart")
        assert module.RecomputationType.Pipeline == 3 and module.SyntheticDataMode.RandomNormal == 2
        assert module.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized == 3
        assert module.Patterns is popart.Patterns
        with pytest.raises(NotImplementedError, match=r"popart\.InferenceSession is not supported"):
            module.InferenceSession
    finally:
        sys.meta_path[:] = saved_path
        for name in [n for n in sys.modules if n in ("poptorch", "popart") or n.startswith("poptorch.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_patterns_levels_and_names_are_popart_s():
    from poptorch_lite.api import popart
    default = popart.Patterns(popart.PatternsLevel.Default)
    assert default.isPatternEnabled("PadSum") and not default.isPatternEnabled("TiedGather")
    assert default.isPatternEnabled("InPlace")
    minimal = popart.Patterns(popart.PatternsLevel.Minimal)
    assert minimal.isPatternEnabled("MatMulOp") and not minimal.isPatternEnabled("PadSum")
    assert not any(popart.Patterns(popart.PatternsLevel.NoPatterns).enabled.values())
    assert all(popart.Patterns(popart.PatternsLevel.All).enabled.values())
    assert popart.Patterns(["PadSum"]).enablePattern("SplitGather", True).isPatternEnabled("SplitGather")
    with pytest.raises(poptorch.Error, match="Unknown pattern 'PadSumm'.*'PadSum'"):
        popart.Patterns(["PadSumm"])
    opts = poptorch.Options()
    opts._Popart.setPatterns({"PadSum": True}, 0)
    with pytest.raises(poptorch.Error, match="Unknown pattern 'Padsum'"):
        opts._Popart.setPatterns({"Padsum": True})
    with pytest.raises(ValueError, match="PatternsLevel"):
        opts._Popart.setPatterns({"PadSum": True}, 7)


def test_popart_options_are_checked_when_a_model_is_made_and_unmodelled_ones_listed(caplog, tmp_path):
    from poptorch_lite.api import popart, poptorch_core
    opts = poptorch.Options()
    opts._Popart.set("autoRecomputaton", 3)
    with pytest.raises(poptorch.Error, match="Did you mean 'autoRecomputation'"):
        poptorch.inferenceModel(Matmul(), opts)
    opts = poptorch.Options().enableProfiling(str(tmp_path)).modelName("m")
    opts._Popart.set("enableOutlining", False).set("mergeVarUpdate", int(popart.MergeVarUpdateType.All))
    poptorch_core._LISTED.clear()
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        model = poptorch.inferenceModel(Matmul(), opts)
        poptorch.inferenceModel(Matmul(), opts)        # listed once
    listed = [r.getMessage() for r in caplog.records if "no effect on the emulator" in r.getMessage()]
    assert listed == ["PopART options accepted with no effect on the emulator: enableOutlining, mergeVarUpdate"]
    assert opts._Popart.get("engineOptions")["autoReport.all"] == "true"   # modelled: not listed
    model(torch.ones(2, 2), torch.ones(2, 2))
    model.destroy()
    import json
    profile = json.load(open(tmp_path / "m" / "profile.json"))
    assert any("enableOutlining, mergeVarUpdate" in n for n in profile["notes"])
    with pytest.raises(KeyError, match="not a PopART session option"):
        opts._Popart.get("enableOutlinin")


# ---- top-level names -----------------------------------------------------------------------------

def test_profiling_channel_tracepoints_land_in_the_profile(tmp_path):
    import json
    channel = poptorch.profiling.Channel("MyApp")
    with channel.tracepoint("prepare"):
        sum(range(1000))

    class Data:
        def __getitem__(self, i):
            return torch.ones(2) * i

        def size(self):
            return 10

    data = channel.instrument(Data(), "__getitem__", "size")
    assert data[3][0] == 3 and data.size() == 10
    with pytest.raises(AttributeError):
        channel.instrument(Data(), "missing")
    model = poptorch.inferenceModel(Matmul(), poptorch.Options().enableProfiling(str(tmp_path)).modelName("p"))
    model(torch.ones(2, 2), torch.ones(2, 2))
    model.destroy()
    events = json.load(open(tmp_path / "p" / "host_trace.json"))["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"MyApp.prepare", "MyApp.Data.__getitem__", "MyApp.Data.size", "poptorch.compile",
            "poptorch.execute"} <= names
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_access_attributes_reads_registered_and_json_attributes():
    from poptorch_lite.api.attributes import attributes_id, release
    attrs = {"alpha": 0.5}
    key = attributes_id(attrs)
    assert poptorch.accessAttributes(key) is attrs
    assert poptorch.accessAttributes(attributes_id(None)) == {}
    assert poptorch.accessAttributes('{"a": 1}') == {"a": 1}
    release(key)
    with pytest.raises(ValueError, match="no attributes registered"):
        poptorch.accessAttributes(key)
    with pytest.raises(ValueError, match="Invalid attribute_id_str"):
        poptorch.accessAttributes("other")
    with pytest.raises(ValueError, match="Wrong type"):
        poptorch.accessAttributes(3)


def test_get_ipu_tensor_id_names_tensors_inside_a_capture():
    seen = {}

    class Model(torch.nn.Module):
        def forward(self, x):
            y = x + 1
            seen["ids"] = (poptorch.getIpuTensorId(x), poptorch.getIpuTensorId(y), poptorch.getIpuTensorId(x))
            return y

    poptorch.inferenceModel(Model()).compile(torch.ones(2))
    a, b, again = seen["ids"]
    assert a == again and a != b
    with pytest.raises(poptorch.Error, match="only call getIpuTensorId on an IPU tensor"):
        poptorch.getIpuTensorId(torch.ones(2))


def test_create_poptorch_error_has_poptorchs_fields():
    error = poptorch.createPoptorchError("went wrong")
    assert isinstance(error, poptorch.Error) and error.type == "poptorch_py_error"
    assert error.message == "went wrong" and error.location == "" and "'poptorch_py_error': went wrong" in str(error)


def test_poptorch_at_exit_releases_compiled_models():
    model = poptorch.inferenceModel(Matmul())
    model(torch.ones(2, 2), torch.ones(2, 2))
    assert model.isCompiled()
    poptorch.poptorchAtExit()
    assert not model.isCompiled() and not model.isAttachedToDevice()


def test_register_geometric_custom_arg_parsers_uses_poptorch_geometric_when_present(monkeypatch, tmp_path):
    poptorch.registerGeometricCustomArgParsers()      # not installed: nothing to do
    package = tmp_path / "poptorch_geometric"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "types.py").write_text("CALLS = []\ndef registerCustomArgParsers():\n    CALLS.append(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        poptorch.registerGeometricCustomArgParsers()
        assert sys.modules["poptorch_geometric.types"].CALLS == [1]
    finally:
        for name in ("poptorch_geometric.types", "poptorch_geometric"):
            sys.modules.pop(name, None)


def test_docs_poptorch_api_md_is_generated_from_the_code():
    import pathlib
    from poptorch_lite import surface
    docs = pathlib.Path(__file__).parent.parent / "docs" / "poptorch-api.md"
    assert docs.read_text() == surface.markdown(), "run: python -m poptorch_lite.surface > docs/poptorch-api.md"
    text = surface.markdown()
    assert "| `load` | yes |" in text and "| `Options.maxRepeatLogs` | yes |" in text
    assert "(see its class)" not in text          # every provided name says what it does


def test_poptorch_attribute_forms_of_options():
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(2, 4)
    assert (opts.Distributed.distributed_process_id, opts.Distributed.num_distributed_processes) == (2, 4)
    opts.TensorLocations.setWeightLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    assert opts.TensorLocations.location_weight["onChip"] is False
    assert opts.TensorLocations.location_activation is None
    with pytest.raises(KeyError, match="'minElementsForOffChip' is not set"):
        opts.TensorLocations.location_weight["minElementsForOffChip"]


def test_running_an_offline_model_is_poptorchs_assertion():
    model = poptorch.inferenceModel(Matmul(), poptorch.Options().useOfflineIpuTarget())
    with pytest.raises(AssertionError, match="offline device"):
        model(torch.ones(2, 2), torch.ones(2, 2))


def test_log_lines_follow_stdout_redirection():
    import contextlib
    import io
    poptorch.setLogLevel("INFO")
    try:
        for _ in range(2):                 # a handler made under one redirection writes to the next
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                logging.getLogger("poptorch_lite").info("hello")
            assert "hello" in out.getvalue()
    finally:
        poptorch.setLogLevel("WARN")


def test_log_lines_name_the_level_in_lower_case_as_poptorch(caplog):
    import contextlib
    import io
    poptorch.setLogLevel("DEBUG")
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), caplog.at_level(logging.DEBUG, logger="poptorch_lite"):
            logging.getLogger("poptorch_lite").debug("hello")
        assert "[poptorch_lite] [debug] hello" in out.getvalue()
        assert caplog.records[-1].levelname == "DEBUG"   # other handlers see the record unchanged
    finally:
        poptorch.setLogLevel("WARN")


def test_backward_on_outputs_is_an_error():
    model = poptorch.trainingModel(Regression())
    out, loss = model(torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(poptorch.Error, match=r"backward\(\) cannot be called explicitly on outputs"):
        loss.backward()


def test_docs_conformance_lists_every_left_out_test_with_its_reason():
    import importlib.util
    import pathlib
    root = pathlib.Path(__file__).parent.parent
    spec = importlib.util.spec_from_file_location("poptorch_tests", root / "benchmarks" / "poptorch_tests.py")
    harness = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("poptorch_tests", harness)
    spec.loader.exec_module(harness)
    text = (root / "docs" / "conformance.md").read_text()

    def plain(words: str) -> str:
        return "".join(c for c in words if c.isalnum() or c == " ").strip()

    rows = {line.split("|")[1].strip().split("`")[1]: plain(line.split("|")[2]) for line in text.splitlines()
            if line.startswith("| `")}
    assert set(rows) == set(harness.LEFT_OUT)
    for node, reason in harness.LEFT_OUT.items():
        assert rows[node] == plain(reason), node
    # a key names its test, the test's parametrisations, or a whole file; not tests it is a prefix of
    assert harness._left_out_by("pipelining_test.py::test_block_function", "pipelining_test.py::test_block_function")
    assert harness._left_out_by("a_test.py::test_x[mode:All]", "a_test.py::test_x")
    assert harness._left_out_by("bert_small_and_medium_test.py::test_bert_small", "bert_small_and_medium_test.py")
    assert not harness._left_out_by("pipelining_test.py::test_block_function_saving",
                                    "pipelining_test.py::test_block_function")


def test_impl_is_dispatch_tracing_while_captured_and_ipu_tensors_are_the_captures():
    seen = []

    class Model(torch.nn.Module):
        def forward(self, x):
            tracing = poptorch._impl.isDispatchTracing()
            seen.append(tracing)
            device = "ipu" if tracing else None
            return torch.ones((2, 3), device=device) + x, torch.zeros(3, device=torch.device("ipu:0")) + 1

    assert poptorch._impl.isDispatchTracing() is False
    out, ones = poptorch.inferenceModel(Model())(torch.tensor([1.0]))
    assert seen and all(seen)
    torch.testing.assert_close(out, torch.full((2, 3), 2.0))
    torch.testing.assert_close(ones, torch.ones(3))
