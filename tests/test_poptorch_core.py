"""poptorch.poptorch_core: PopTorch's native module's Python surface (errors, option parsing, the
test error hook, the capture flag, shape propagation), and the error contexts behind `location`."""
import importlib
import logging
import sys

import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from poptorch_lite import runner
from poptorch_lite.api import errors, popart
from poptorch_lite.api import poptorch_core as core


@pytest.mark.parametrize("kind", list(core.TestErrorType))
def test_every_test_error_kind_has_its_class_type_and_location(kind):
    with pytest.raises(poptorch.Error) as info:
        core._throwTestError(kind)
    e = info.value
    assert "throwTestError::bottomLevel" in e.args[0] and "throwTestError::topLevel" in e.args[0]
    assert e.location == "  [0] throwTestError::bottomLevel\n  [1] throwTestError::topLevel\n"
    assert "throwTestError" not in e.message and e.message
    assert f"'{e.type}'" in e.args[0]
    expected = {core.TestErrorType.PoplarUnrecoverable: poptorch.UnrecoverableError,
                core.TestErrorType.PoplarRecoverableFullReset: poptorch.RecoverableError}.get(kind, poptorch.Error)
    assert type(e) is expected


def test_specific_errors_carry_popart_and_poplar_fields():
    with pytest.raises(poptorch.RecoverableError) as info:
        core._throwTestError(core.TestErrorType.PoplarRecoverableFullReset)
    assert info.value.recovery_action == "FULL_RESET"
    assert info.value.type == "poplar_recoverable_runtime_error"
    assert "Recovery action required: FULL_RESET" in str(info.value)
    with pytest.raises(poptorch.Error) as info:
        core._throwTestError(core.TestErrorType.PoplarLinkError)
    assert info.value.type == "poplar_link_error" and "-lfoo not found" in info.value.message
    with pytest.raises(poptorch.Error, match="Unknown TestErrorType"):
        core._throwTestError(42)


def test_error_context_sets_location_once_from_the_innermost():
    with pytest.raises(poptorch.Error) as info:
        with errors.context("outer"):
            with errors.context("inner"):
                raise poptorch.Error("it broke")
    assert info.value.location == "  [0] inner\n  [1] outer\n"
    assert info.value.message == "it broke"
    assert str(info.value) == "it broke\nError raised in:\n  [0] inner\n  [1] outer\n"
    assert errors.current_location() == ""       # the stack unwinds
    with pytest.raises(ValueError):              # other exceptions pass unchanged
        with errors.context("x"):
            raise ValueError("plain")


def test_error_classes_are_the_api_ones():
    assert core.Error is poptorch.Error and core.RecoverableError is poptorch.RecoverableError
    assert core.UnrecoverableError is poptorch.UnrecoverableError
    assert poptorch.poptorch_core is core


def _all_mode():
    return poptorch.Options().outputMode(poptorch.OutputMode.All)


def test_validate_options_accepts_what_options_make_and_logs_it(caplog):
    opts = _all_mode().deviceIterations(3).enableSyntheticData(True)
    opts._Popart.set("autoRecomputation", int(popart.RecomputationType.Pipeline))
    opts._Popart.set("hardwareInstrumentations", {0, 1})
    opts._Popart.set("dotChecks", ["FINAL", "ALL"])
    opts._Popart.set("engineOptions", {"debug.allowOutOfMemory": "true"})
    opts._Popart.set("outlineThreshold", 1)        # an int is a fine double
    with caplog.at_level(logging.DEBUG, logger="poptorch_lite"):
        core._validateOptions(opts.toDict())
    text = caplog.text
    assert "poptorch.Options set device_iterations to value 3" in text
    assert "poptorch.Options set syntheticDataMode to value 2" in text
    assert "poptorch.Options set autoRecomputation to value 3" in text
    assert "poptorch.Options added 1 to hardwareInstrumentations" in text
    assert "poptorch.Options added FINAL to dotChecks" in text
    assert "poptorch.Options set engineOptions[debug.allowOutOfMemory] to true" in text
    assert "poptorch.Options set output_mode to value 2" in text
    assert "poptorch.Options set execution_mode to value 0" in text


@pytest.mark.parametrize("key, value, match", [
    ("asdfasdf", True, r"Unknown bool option asdfasdf"),
    ("autoRecomputaton", 3, r"Unknown uint64 option autoRecomputaton.*Did you mean 'autoRecomputation'"),
    ("dotChecks", torch.empty(1, 1), r"Unknown value type Tensor for option dotChecks"),
    ("autoRecomputation", 9, r"Value 9 for RecomputationType out of range.*3 \(RecomputationType.Pipeline\)"),
    ("outlineThreshold", "high", r"Unknown string option outlineThreshold: .* floating point"),
    ("hardwareInstrumentations", [2], r"2 is not a Instrumentation"),
    ("dotChecks", ["Middle"], r"'Middle' is not one of Fwd0"),
    ("patterns", {"PadSum": True}, r"'patterns' should not be set without first setting 'patterns_level'"),
])
def test_validate_options_rejects_what_popart_would(key, value, match):
    opts = _all_mode()
    opts._Popart.set(key, value)
    with pytest.raises(poptorch.Error, match=match) as info:
        core._validateOptions(opts.toDict())
    assert "parseSessionOptions" in info.value.location


def test_validate_options_checks_the_options_own_values():
    good = _all_mode().toDict()
    with pytest.raises(poptorch.Error, match=r"Unknown uint64 option device_iteration\b.*device_iterations"):
        core._validateOptions({**good, "device_iteration": 2})
    with pytest.raises(poptorch.Error, match=r"Unknown value type str for option replication_factor"):
        core._validateOptions({**good, "replication_factor": "2"})
    with pytest.raises(poptorch.Error, match=r"'OutputMode.Many' for option output_mode out of range"):
        core._validateOptions({**good, "output_mode": "OutputMode.Many"})
    with pytest.raises(poptorch.Error, match=r"Unknown uint64 option Training.gradientAccumulation"):
        core._validateOptions({**good, "Training": {**good["Training"], "gradientAccumulation": 2}})
    with pytest.raises(poptorch.Error, match="expects the dict"):
        core._validateOptions([])


def test_is_compiling_with_dispatcher_only_while_capturing():
    seen = []

    class Model(torch.nn.Module):
        def forward(self, x):
            seen.append(core.isCompilingWithDispatcher())
            return x * 2

    assert not core.isCompilingWithDispatcher()
    model = poptorch.inferenceModel(Model())
    model(torch.ones(2, 3))
    assert seen and all(seen) and not core.isCompilingWithDispatcher()

    class Broken(torch.nn.Module):
        def forward(self, x):
            with poptorch.Block("A"):
                x = x + 1
            return x * 2        # outside any block: an error during the capture

    with pytest.raises(poptorch.Error, match="outside any Block"):
        poptorch.inferenceModel(Broken()).compile(torch.ones(2, 3))
    assert not core.isCompilingWithDispatcher()


def test_propagate_input_shapes_gives_every_value_its_shape():
    def f(x, y):
        return torch.matmul(x, y).relu() + 1

    graph = torch.jit.trace(f, (torch.randn(5, 6), torch.randn(6, 7))).graph
    for graph_input, example in zip(graph.inputs(), (torch.randn(2, 3), torch.randn(3, 4))):
        graph_input.inferTypeFrom(example)
    core.propagateInputShapes(graph)
    assert [o.type().sizes() for o in graph.outputs()] == [[2, 4]]
    with pytest.raises(poptorch.Error, match="expects a torch._C.Graph"):
        core.propagateInputShapes(f)


def test_runner_resolves_poptorch_core():
    saved_path = list(sys.meta_path)
    saved = {n: m for n, m in sys.modules.items() if n == "poptorch" or n.startswith("poptorch.")}
    try:
        runner.install()
        module = importlib.import_module("poptorch.poptorch_core")
        assert module.Error is poptorch.Error and module._validateOptions is core._validateOptions
        assert importlib.import_module("poptorch").poptorch_core.TestErrorType is core.TestErrorType
    finally:
        sys.meta_path[:] = saved_path
        for name in [n for n in sys.modules if n == "poptorch" or n.startswith("poptorch.")]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.mark.parametrize("threads", [1, 3, "auto"])
def test_validate_options_takes_each_kind_of_emulator_value(threads, monkeypatch):
    """Emulator options may take more than one type (a thread count or 'auto'), whatever the
    environment's default; each is checked by its setter."""
    monkeypatch.setenv("IPUSIM_HOST_THREADS", "2")
    monkeypatch.setattr(core, "_REFERENCE", None)
    opts = poptorch.Options()
    opts.Emulator.setHostThreads(threads)
    core._validateOptions(opts.toDict())
    for target in ("Bow", ip.Target.test(num_tiles=4)):
        core._validateOptions({**opts.toDict(), "Emulator": poptorch.Options().Emulator.setTarget(target).toDict()})
    good = opts.toDict()
    with pytest.raises(poptorch.Error, match=r"Value 0 for option Emulator.host_threads out of range: "
                                             r"Emulator.setHostThreads expects an int >= 1 or 'auto'"):
        core._validateOptions({**good, "Emulator": {**good["Emulator"], "host_threads": 0}})
    with pytest.raises(poptorch.Error, match=r"Unknown option Emulator.hostThreads"):
        core._validateOptions({**good, "Emulator": {**good["Emulator"], "hostThreads": 2}})
    with pytest.raises(poptorch.Error, match=r"Value 'GC300' for option Emulator.target out of range"):
        core._validateOptions({**good, "Emulator": {**good["Emulator"], "target": "GC300"}})
