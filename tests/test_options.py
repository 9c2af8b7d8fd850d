"""Options: chaining, validation, freezing, clone, environment defaults."""
import copy
import json
import logging
import pickle

import pytest
import torch

from poptorch_lite.api import strategies
from poptorch_lite.api.enums import (AutoStage, CommGroupType, ConnectionType,
                                 HalfFloatCastingBehavior,
                                 MeanReductionStrategy, OutputMode,
                                 ReductionType, SyncPattern)
from poptorch_lite.api.options import (ConfigFileError, FrozenOptionsError,
                                   Options, TensorLocationSettings,
                                   setLogLevel)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("POPTORCH_DEFAULT_OPTIONS", "POPTORCH_CACHE_DIR",
                 "POPLAR_ENGINE_OPTIONS", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


# Every setter, as (path to the object it belongs to, name, arguments).
SETTERS = [
    ("", "deviceIterations", (4, )),
    ("", "replicationFactor", (2, )),
    ("", "outputMode", (OutputMode.EveryN, 2)),
    ("", "randomSeed", (3, )),
    ("", "useIpuModel", (True, )),
    ("", "useOfflineIpuTarget", (1, )),
    ("", "connectionType", (ConnectionType.OnDemand, )),
    ("", "syncPattern", (SyncPattern.SinglePipeline, )),
    ("", "useIpuId", (3, )),
    ("", "autoRoundNumIPUs", (True, )),
    ("", "logDir", ("/tmp/logs", )),
    ("", "modelName", ("net", )),
    ("", "enableExecutableCaching", ("/tmp/cache", )),
    ("", "enableProfiling", ("/tmp/profile", )),
    ("", "enableSyntheticData", (True, )),
    ("", "enableStableNorm", (True, )),
    ("", "logCycleCount", (True, )),
    ("", "setAvailableMemoryProportion", ({"IPU0": 0.5}, )),
    ("", "broadcastBuffers", (False, )),
    ("", "showCompilationProgressBar", (False, )),
    ("", "relaxOptimizerAttributesChecks", (True, )),
    ("", "disableModuleNamescope", ()),
    ("", "setExecutionStrategy", (strategies.ShardedExecution(), )),
    ("", "from_json", ('{"deviceIterations": 2}', )),
    ("", "inputReplicaGrouping", (1, CommGroupType.Orthogonal)),
    ("", "updatableNamedBuffers", (["running_mean"], )),
    ("", "sourceLocationExcludes", (["my_library/"], )),
    ("", "appendToLocationExcludes", ("my_library/", "other/")),
    ("", "maxRepeatLogs", (None, )),
    ("Training", "gradientAccumulation", (8, )),
    ("Training", "accumulationAndReplicationReductionType",
     (ReductionType.Sum, )),
    ("Training", "setMeanAccumulationAndReplicationReductionStrategy",
     (MeanReductionStrategy.Running, )),
    ("Training", "setAutomaticLossScaling", (True, )),
    ("Training", "setConvolutionDithering", (True, )),
    ("Distributed", "configureProcessId", (1, 4)),
    ("TensorLocations", "setActivationLocation",
     (TensorLocationSettings().useOnChipStorage(False), )),
    ("TensorLocations", "setWeightLocation",
     (TensorLocationSettings().useReplicatedTensorSharding(True), )),
    ("TensorLocations", "setOptimizerLocation",
     (TensorLocationSettings().minElementsForOffChip(10), )),
    ("TensorLocations", "setAccumulatorLocation",
     (TensorLocationSettings().useIOTilesToLoad(True), )),
    ("TensorLocations", "numIOTiles", (64, )),
    ("Precision", "setPartialsType", (torch.half, )),
    ("Precision", "halfFloatCasting",
     (HalfFloatCastingBehavior.HalfUpcastToFloat, )),
    ("Precision", "runningStatisticsAlwaysFloat", (False, )),
    ("Precision", "enableFloatingPointExceptions", (True, )),
    ("Precision", "enableStochasticRounding", (True, )),
    ("Jit", "traceModel", (False, )),
    ("_Popart", "set", ("autoRecomputation", 3)),
    ("_Popart", "setPatterns", ({"PadSum": True}, 1)),
    ("_Popart", "setEngineOptions", ({"opt": "1"}, )),
]
SETTER_IDS = [f"{group or 'Options'}.{name}" for group, name, _ in SETTERS]


def owner(options, group):
    return getattr(options, group) if group else options


@pytest.mark.parametrize("group, name, arguments", SETTERS, ids=SETTER_IDS)
def test_setters_chain_and_change_the_options(group, name, arguments):
    options = Options()
    target = owner(options, group)
    before = options.toDict()
    assert getattr(target, name)(*arguments) is target
    assert options.toDict() != before


@pytest.mark.parametrize("group, name, arguments", SETTERS, ids=SETTER_IDS)
def test_frozen_options_refuse_every_setter(group, name, arguments):
    options = Options()
    options._freeze()
    before = options.toDict()
    with pytest.raises(FrozenOptionsError, match=r"clone\(\)"):
        getattr(owner(options, group), name)(*arguments)
    assert options.toDict() == before


def test_defaults():
    options = Options()
    assert options.device_iterations == 1
    assert options.replication_factor == 1
    assert options.gradient_accumulation == 1
    assert options.Training.gradient_accumulation == 1
    assert options.Training.accumulation_and_replication_reduction_type \
        == ReductionType.Mean
    assert options.output_mode == OutputMode.Default
    assert options.defaultOutputMode()
    assert options.output_return_period == 1
    assert options.random_seed is None
    assert (options.process_id, options.num_processes) == (0, 1)
    assert options.cache_path is None
    assert options.profile_dir is None
    assert not options.synthetic_data
    assert options.tensor_locations == {
        "activation": None,
        "weight": None,
        "optimizer": None,
        "accumulator": None
    }
    strategy = options.execution_strategy
    assert isinstance(strategy, strategies.PipelinedExecution)
    assert not isinstance(strategy, strategies.ShardedExecution)
    assert strategy.auto_stage == AutoStage.SameAsIpu


def test_setters_store_their_values():
    options = Options().deviceIterations(4).replicationFactor(2)
    options.Training.gradientAccumulation(8)
    options.outputMode(OutputMode.EveryN, 2)
    options.Distributed.configureProcessId(1, 3)
    options.enableExecutableCaching("/tmp/cache")
    options.enableSyntheticData(True)
    options.useOfflineIpuTarget(1)
    assert (options.device_iterations, options.replication_factor,
            options.gradient_accumulation) == (4, 2, 8)
    assert (options.output_mode, options.output_return_period) == \
        (OutputMode.EveryN, 2)
    assert not options.defaultOutputMode()
    assert (options.process_id, options.num_processes) == (1, 3)
    assert (options.Distributed.processId,
            options.Distributed.numProcesses) == (1, 3)
    assert options.cache_path == "/tmp/cache"
    assert options.enableExecutableCaching(None).cache_path is None
    assert options.synthetic_data
    assert (options.connection_type, options.ipu_version) == \
        (ConnectionType.Never, 1)
    options.setAvailableMemoryProportion({"IPU0": 0.25, "IPU3": 1})
    assert options.available_memory_proportion == {0: 0.25, 3: 1.0}


def test_output_mode_period_rules(caplog):
    options = Options()
    with pytest.raises(ValueError, match="EveryN.*needs the return period"):
        options.outputMode(OutputMode.EveryN)
    with caplog.at_level(logging.INFO, logger="poptorch_lite"):
        options.outputMode(OutputMode.All, 2)  # ignored, as in PopTorch
    assert (options.output_mode, options.output_return_period) == (OutputMode.All, 1)
    assert "output_return_period 2 ignored" in caplog.text
    with pytest.raises(ValueError, match="output_return_period must be >= 1"):
        options.outputMode(OutputMode.EveryN, 0)
    with pytest.raises(TypeError, match="OutputMode.All"):
        options.outputMode("All")
    assert options.outputMode(OutputMode.Sum).output_return_period == 1


@pytest.mark.parametrize("call, error, message", [
    (lambda o: o.deviceIterations(0), ValueError,
     r"Options.deviceIterations must be >= 1, got 0"),
    (lambda o: o.deviceIterations("4"), TypeError,
     r"Options.deviceIterations expects an int"),
    (lambda o: o.deviceIterations(True), TypeError,
     r"Options.deviceIterations expects an int"),
    (lambda o: o.replicationFactor(-2), ValueError,
     r"Options.replicationFactor must be >= 1"),
    (lambda o: o.Training.gradientAccumulation(0), ValueError,
     r"Training.gradientAccumulation must be >= 1"),
    (lambda o: o.Training.accumulationAndReplicationReductionType(
        ReductionType.NoReduction), TypeError,
     r"ReductionType.Sum, ReductionType.Mean"),
    (lambda o: o.Training.setMeanAccumulationAndReplicationReductionStrategy(
        1), TypeError, r"MeanReductionStrategy.Running"),
    (lambda o: o.randomSeed(1.5), TypeError, r"Options.randomSeed"),
    (lambda o: o.randomSeed(2**64), ValueError, r"Options.randomSeed"),
    (lambda o: o.useIpuModel(1), TypeError, r"Options.useIpuModel"),
    (lambda o: o.useOfflineIpuTarget(3), ValueError, r"1 \(Mk1\) or 2"),
    (lambda o: o.connectionType("Never"), TypeError,
     r"ConnectionType.Always"),
    (lambda o: o.logDir(""), TypeError, r"Options.logDir"),
    (lambda o: o.enableExecutableCaching(3), TypeError,
     r"enableExecutableCaching"),
    (lambda o: o.setAvailableMemoryProportion({"GPU0": 0.5}), ValueError,
     r'"IPU<n>"'),
    (lambda o: o.setAvailableMemoryProportion({"IPU0": 1.5}), ValueError,
     r"IPU0 must be a number in \(0, 1\]"),
    (lambda o: o.setExecutionStrategy("pipelined"), TypeError,
     r"PipelinedExecution, ShardedExecution"),
    (lambda o: o.Distributed.configureProcessId(2, 2), ValueError,
     r"process_id \(2\) must be smaller than num_processes \(2\)"),
    (lambda o: o.Distributed.configureProcessId(0, 0), ValueError,
     r"num_processes must be >= 1"),
    (lambda o: o.TensorLocations.setWeightLocation({"onChip": False}),
     TypeError, r"setWeightLocation expects a TensorLocationSettings"),
    (lambda o: o.TensorLocations.numIOTiles(33), ValueError,
     r"even number from 32 to 192"),
    (lambda o: o.TensorLocations.numIOTiles(16), ValueError,
     r"numIOTiles must be >= 32"),
    (lambda o: o.Precision.setPartialsType(torch.int32), TypeError,
     r"torch.float or torch.half"),
    (lambda o: o._Popart.set(3, 1), TypeError, r"_Popart.set"),
])
def test_invalid_values_name_the_option(call, error, message):
    options = Options()
    before = options.toDict()
    with pytest.raises(error, match=message):
        call(options)
    assert options.toDict() == before


def test_random_seed_also_seeds_torch():
    Options().randomSeed(1234)
    first = torch.rand(4)
    torch.manual_seed(1234)
    assert torch.equal(first, torch.rand(4))


def test_frozen_random_seed_leaves_torch_alone():
    options = Options()
    options._freeze()
    state = torch.get_rng_state()
    with pytest.raises(FrozenOptionsError):
        options.randomSeed(99)
    assert torch.equal(state, torch.get_rng_state())


def test_attributes_cannot_be_assigned():
    options = Options()
    with pytest.raises(AttributeError, match="setter methods"):
        options.device_iterations = 4
    with pytest.raises(AttributeError, match="setter methods"):
        options.Training.gradient_accumulation = 4
    with pytest.raises(TypeError):
        options._Popart.options["key"] = 1
    assert options.device_iterations == 1


def test_freezing_reaches_stored_tensor_locations():
    options = Options()
    options.TensorLocations.setWeightLocation(
        TensorLocationSettings().useOnChipStorage(True))
    options._freeze()
    with pytest.raises(FrozenOptionsError):
        options.tensor_locations["weight"].useOnChipStorage(False)
    assert options.tensor_locations["weight"].on_chip is True


def test_tensor_location_settings_are_copied():
    settings = TensorLocationSettings().useOnChipStorage(False)
    settings.minElementsForReplicatedTensorSharding(8)
    options = Options()
    options.TensorLocations.setOptimizerLocation(settings)
    settings.useOnChipStorage(True)
    stored = options.tensor_locations["optimizer"]
    assert stored.on_chip is False
    assert stored.min_elements_for_replicated_tensor_sharding == 8
    assert stored.use_replicated_tensor_sharding is None


def test_clone_is_an_unfrozen_deep_copy():
    options = Options().deviceIterations(5)
    options.Distributed.configureProcessId(5, 15)
    options._Popart.set("dummyKey", [1, 2])
    options.Training.gradientAccumulation(4)
    options.TensorLocations.setWeightLocation(
        TensorLocationSettings().useOnChipStorage(True))
    options.setExecutionStrategy(strategies.ShardedExecution())
    options._freeze()
    copied = options.clone()
    assert copied.toDict() == options.toDict()
    assert copied.execution_strategy is not options.execution_strategy
    copied.deviceIterations(4).Distributed.configureProcessId(2, 15)
    copied._Popart.set("dummyKey", [3])
    copied.Training.gradientAccumulation(2)
    copied.TensorLocations.setWeightLocation(
        TensorLocationSettings().useOnChipStorage(False))
    copied.Precision.setPartialsType(torch.float16)
    assert options.device_iterations == 5
    assert options.process_id == 5
    assert options._Popart.options["dummyKey"] == [1, 2]
    assert options.gradient_accumulation == 4
    assert options.tensor_locations["weight"].on_chip is True
    with pytest.raises(FrozenOptionsError):
        options.deviceIterations(1)


def test_a_deep_copy_of_frozen_options_is_unfrozen():
    options = Options().deviceIterations(2)
    options._freeze()  # pylint: disable=protected-access
    copied = copy.deepcopy(options)
    copied.deviceIterations(5).Training.gradientAccumulation(4)
    assert (options.device_iterations, copied.device_iterations) == (2, 5)
    with pytest.raises(FrozenOptionsError):
        options.Training.gradientAccumulation(4)


def test_deepcopy_and_pickle_keep_every_value():
    options = Options().replicationFactor(2).randomSeed(7)
    options.outputMode(OutputMode.Sum)
    options.Precision.setPartialsType(torch.half)
    for copied in (copy.deepcopy(options),
                   pickle.loads(pickle.dumps(options))):
        assert copied.toDict() == options.toDict()
        assert copied.Precision.partials_type == torch.float16


def test_repr_and_to_dict_are_readable():
    options = Options().replicationFactor(4)
    text = repr(options)
    assert text.startswith("Options(")
    assert "replication_factor=4" in text
    assert "Training=_TrainingOptions(gradient_accumulation=1" in text
    assert "output_mode=OutputMode.Default" in text
    as_dict = options.toDict()
    json.dumps(as_dict)
    assert as_dict["replication_factor"] == 4
    assert as_dict["Training"]["gradient_accumulation"] == 1
    assert as_dict["execution_strategy"].startswith("PipelinedExecution")


def test_distributed_defaults_come_from_mpi_environment(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    options = Options()
    assert (options.process_id, options.num_processes) == (2, 4)
    assert options.Distributed.disable().numProcesses == 1
    monkeypatch.setenv("MY_SIZE", "3")
    monkeypatch.setenv("MY_RANK", "1")
    options.Distributed.setEnvVarNames("MY_SIZE", "MY_RANK")
    assert (options.process_id, options.num_processes) == (1, 3)


@pytest.mark.parametrize("rank, size, message", [
    ("x", "2", r"OMPI_COMM_WORLD_RANK='x' is not an integer"),
    ("3", "2", r"process_id \(3\) must be smaller than num_processes \(2\)"),
])
def test_bad_mpi_environment_is_reported(monkeypatch, rank, size, message):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", rank)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", size)
    with pytest.raises(ValueError, match=message):
        Options()


def test_default_options_environment_equals_setter_calls(monkeypatch):
    baseline = repr(Options())
    expected = Options().deviceIterations(2).replicationFactor(1)
    expected.logDir("/tmp/x.y").enableSyntheticData(True)
    expected.Precision.enableFloatingPointExceptions(True)
    expected.connectionType(ConnectionType.OnDemand)
    expected.outputMode(OutputMode.EveryN, 2)
    expected._Popart.set("saveInitializersToFile", "my_file.onnx")
    monkeypatch.setenv(
        "POPTORCH_DEFAULT_OPTIONS",
        json.dumps({
            "deviceIterations": 2,
            "replicationFactor": 1,
            "logDir": "/tmp/x.y",
            "enableSyntheticData": True,
            "Precision.enableFloatingPointExceptions": True,
            "connectionType": "ConnectionType.OnDemand",
            "outputMode": ["poptorch.OutputMode.EveryN", 2],
            "_Popart.set": ["saveInitializersToFile", "my_file.onnx"],
        }))
    from_environment = Options()
    assert repr(from_environment) == repr(expected)
    assert repr(from_environment) != baseline


@pytest.mark.parametrize("value, error, message", [
    ("{not json", ValueError, "POPTORCH_DEFAULT_OPTIONS is not valid JSON"),
    ("[1, 2]", ValueError, "must be a JSON object"),
    ('{"noSuchOption": 1}', AttributeError,
     "POPTORCH_DEFAULT_OPTIONS, 'noSuchOption': unknown option"),
    ('{"_freeze": []}', AttributeError, "not an option setter"),
    ('{"deviceIterations": 0}', ValueError,
     "POPTORCH_DEFAULT_OPTIONS, 'deviceIterations'.*must be >= 1"),
    ('{"outputMode": "OutputMode.Everything"}', ValueError,
     "OutputMode has no member 'Everything'"),
])
def test_bad_default_options_environment_is_reported(monkeypatch, value,
                                                      error, message):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", value)
    with pytest.raises(error, match=message):
        Options()


def test_cache_dir_environment_enables_caching(monkeypatch, tmp_path):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    assert Options().cache_path == str(tmp_path)


def test_profiling_directory(monkeypatch, tmp_path):
    options = Options()
    assert options.enableProfiling().profile_dir == "."
    options.enableProfiling(tmp_path / "reports")
    assert options.profile_dir == str(tmp_path / "reports")
    monkeypatch.setenv(
        "POPLAR_ENGINE_OPTIONS",
        '{"autoReport.all":"true", "autoReport.directory":"./from_env"}')
    assert options.profile_dir == "./from_env"
    assert Options().profile_dir == "./from_env"
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS",
                       '{"autoReport.outputExecutionProfile":"true"}')
    assert Options().profile_dir == "."
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", '{"debug.x":"true"}')
    assert Options().profile_dir is None
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", "autoReport.all=true")
    with pytest.raises(ValueError, match="POPLAR_ENGINE_OPTIONS is not valid"):
        Options().profile_dir  # pylint: disable=expression-not-assigned


def test_popart_options_are_recorded():
    options = Options()
    options._Popart.set("autoRecomputation", 3).set("dotChecks", ["FINAL"])
    options.Precision.setPartialsType(torch.float)
    options.Training.setConvolutionDithering(True)
    recorded = options._Popart.options
    assert recorded["autoRecomputation"] == 3
    assert recorded["dotChecks"] == ["FINAL"]
    assert recorded["convolutionOptions"] == {
        "partialsType": "float",
        "enableConvDithering": True
    }
    assert options.Precision.partials_type == torch.float32


def test_execution_strategy_is_kept():
    strategy = strategies.PipelinedExecution(AutoStage.AutoIncrement)
    options = Options().setExecutionStrategy(strategy)
    assert options.execution_strategy is strategy


def test_load_from_file(tmp_path):
    config = tmp_path / "poptorch.conf"
    config.write_text("\n".join([
        "deviceIterations(3)",
        "  replicationFactor(2)  # trailing comment",
        "",
        "# a comment line",
        "setExecutionStrategy(poptorch.ShardedExecution())",
        "outputMode(poptorch.OutputMode.EveryN, 3)",
        "Training.gradientAccumulation(4)",
        "TensorLocations.setWeightLocation("
        "poptorch.TensorLocationSettings().useOnChipStorage(False))",
        "Precision.setPartialsType(torch.half)",
        "_Popart.set('autoRecomputation', 3)",
    ]))
    options = Options().loadFromFile(config)
    assert (options.device_iterations, options.replication_factor,
            options.gradient_accumulation) == (3, 2, 4)
    assert isinstance(options.execution_strategy, strategies.ShardedExecution)
    assert (options.output_mode, options.output_return_period) == \
        (OutputMode.EveryN, 3)
    assert options.tensor_locations["weight"].on_chip is False
    assert options.Precision.partials_type == torch.float16
    assert options._Popart.options["autoRecomputation"] == 3


@pytest.mark.parametrize("line, message", [
    ("outputMode(poptorch.OutputMode.All", r"SyntaxError at line 2 of bad"),
    ("noSuchSetter(1)", r"AttributeError at line 2 of bad.*unknown option"),
    ("deviceIterations(0)", r"ValueError at line 2 of bad.*must be >= 1"),
    ("deviceIterations(__import__('os'))", r"line 2 of bad"),
])
def test_load_from_file_reports_the_bad_line(tmp_path, line, message):
    config = tmp_path / "bad.conf"
    config.write_text("deviceIterations(2)\n" + line + "\n")
    with pytest.raises(ConfigFileError, match=message) as info:
        Options().loadFromFile(config)
    assert f"> options.{line}" in str(info.value)


def test_set_log_level():
    logger = logging.getLogger("poptorch_lite")
    level, handlers = logger.level, list(logger.handlers)
    try:
        setLogLevel("DEBUG")
        assert logger.level == logging.DEBUG
        setLogLevel("off")
        assert not logger.isEnabledFor(logging.CRITICAL)
        with pytest.raises(ValueError, match="Unknown log level: LOUD. Valid values are DEBUG, ERR, INFO, OFF"):
            setLogLevel("LOUD")
        with pytest.raises(ValueError, match="Invalid log level integer 5"):
            setLogLevel(5)
        # PopTorch's numbers: 0 trace, 1 debug, 2 info, 3 warn, 4 err, 6 off
        setLogLevel(2)
        assert logger.isEnabledFor(logging.INFO) and not logger.isEnabledFor(logging.DEBUG)
        setLogLevel(3)
        assert logger.isEnabledFor(logging.WARNING) and not logger.isEnabledFor(logging.INFO)
        setLogLevel(0)
        assert logger.isEnabledFor(5)
        setLogLevel(6)
        assert not logger.isEnabledFor(logging.CRITICAL)
        with pytest.raises(ValueError, match=r"use 0 \(TRACE\)"):
            setLogLevel(20)
    finally:
        logger.setLevel(level)
        logger.handlers[:] = handlers


def test_an_option_the_emulator_lacks_is_named():
    from poptorch_lite.api.errors import UnsupportedAttributeError
    with pytest.raises(UnsupportedAttributeError, match=r"Options.maxRepeatLog is not supported by poptorch_lite"
                                                        r".*Did you mean maxRepeatLogs"):
        Options().maxRepeatLog(None)
    with pytest.raises(AttributeError, match=r"TrainingOptions.gradientAcumulation .*Did you mean "
                                             r"gradientAccumulation"):
        Options().Training.gradientAcumulation(2)
    assert not hasattr(Options(), "maxRepeatLog")


def test_the_default_strategy_is_a_pipeline_from_the_start():
    options = Options()
    assert isinstance(options._execution_strategy, strategies.PipelinedExecution)  # as PopTorch's
    assert options.execution_strategy.auto_stage == AutoStage.SameAsIpu
