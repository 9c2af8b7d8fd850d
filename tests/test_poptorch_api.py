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


def test_input_replica_grouping_validates_as_poptorch_and_refuses_groups_it_cannot_run():
    opts = poptorch.Options().replicationFactor(4)
    assert opts.inputReplicaGrouping(4, CommGroupType.NoGrouping) is opts      # groups of one
    assert (opts.input_group_size, opts.input_cgt) == (1, CommGroupType.Consecutive)
    opts.inputReplicaGrouping(1, CommGroupType.Orthogonal)
    assert opts.toDict()["input_cgt"] == "CommGroupType.Orthogonal"
    with pytest.raises(ValueError, match="cannot be CommGroupType.All"):
        opts.inputReplicaGrouping(2, CommGroupType.All)
    with pytest.raises(ValueError, match=r"input_group_size \(8\) cannot be larger than replication_factor \(4\)"):
        opts.inputReplicaGrouping(8, CommGroupType.Consecutive)
    with pytest.raises(ValueError, match=r"input_group_size \(3\) must be a factor of replication_factor"):
        opts.inputReplicaGrouping(3, CommGroupType.Consecutive)
    with pytest.raises(NotImplementedError, match="input replica groups are not modelled"):
        opts.inputReplicaGrouping(2, CommGroupType.Consecutive)
    assert opts.input_group_size == 1


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


def test_name_scopes_land_in_op_names_and_the_placement_table():
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
    model = poptorch.inferenceModel(Model())
    model(torch.ones(2, 3))
    names = {v.name for g in model._executable.engine.device.graphs for v in g.variables}
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
