"""PopTorch's API surface against this project: which of PopTorch 3.x's public names, Options
methods and compiled-model methods poptorch_lite provides, and what the emulator does with each.

    python -m poptorch_lite.surface > docs/poptorch-api.md

The lists of PopTorch's names are PopTorch's (its ``poptorch`` module: ``__init__.py``,
``enums.py``, ``ops.py``, ``options.py``; ``Options`` and its option groups; ``PoplarExecutor``);
whether each is provided, and its description (the first line of its docstring), come from the
code. A test keeps docs/poptorch-api.md equal to this output.
"""
from __future__ import annotations

import importlib
import inspect
import types

# PopTorch 3.x's public `poptorch` names (typing helpers and its logger left out).
POPTORCH_NAMES = (
    "AsynchronousDataAccessor", "Attribute", "AutoStage", "BeginBlock", "Block", "BlockFunction", "CPU",
    "CommGroupType", "ConfigFileError", "ConnectionType", "DataLoader", "DataLoaderMode", "Error",
    "HalfFloatCastingBehavior", "ICustomArgParser", "LegacyBeginBlockFn", "Liveness", "MatMulSerializationMode",
    "MeanReductionStrategy", "MultiConv", "MultiConvPlanType", "NameScope", "Options", "OutputMode", "OverlapMode",
    "ParallelPhasedExecution", "Phase", "PipelinedExecution", "PoplarExecutor", "RecoverableError",
    "ReductionType", "SerialPhasedExecution", "ShardedExecution", "SharingStrategy", "Stage", "SyncPattern",
    "TensorLocationSettings", "UnrecoverableError", "VariableRetrievalMode", "accessAttributes", "cond",
    "createPoptorchError", "ctc_beam_search_decoder", "custom_op", "dynamic_slice", "dynamic_update", "for_loop",
    "fps", "getIpuTensorId", "identity_loss", "importPoptorchMetadataFromFile", "inferenceModel",
    "ipuHardwareIsAvailable", "ipuHardwareVersion", "ipu_print_tensor", "isRunningOnIpu", "load", "module_repr",
    "nearest", "nop", "optim", "poptorchAtExit", "poptorch_core", "profiling", "recomputationCheckpoint",
    "registerCustomArgParser", "registerGeometricCustomArgParsers", "registerPostCompileHook",
    "registerPreCompileHook", "removeBlocks", "serializedMatMul", "setLogLevel", "set_available_memory",
    "set_overlap_for_input", "set_overlap_for_output", "trainingModel")

# PopTorch's Options (and OptionsDict) members, and those of its option groups.
OPTIONS_MEMBERS = {
    "Options": (
        "TensorLocations", "Distributed", "Jit", "Precision", "Training", "_Popart", "from_json",
        "sourceLocationExcludes", "appendToLocationExcludes", "showCompilationProgressBar", "loadFromFile",
        "relaxOptimizerAttributesChecks", "autoRoundNumIPUs", "deviceIterations", "setExecutionStrategy",
        "setAvailableMemoryProportion", "replicationFactor", "inputReplicaGrouping", "broadcastBuffers", "logDir",
        "maxRepeatLogs", "modelName", "enableExecutableCaching", "useIpuModel", "connectionType", "syncPattern",
        "useIpuId", "useOfflineIpuTarget", "anchorTensor", "outputMode", "defaultOutputMode", "randomSeed",
        "enableStableNorm", "enableSyntheticData", "logCycleCount", "enableProfiling", "disableModuleNamescope",
        "updatableNamedBuffers", "toDict", "clone", "exists", "checkIsFrozen"),
    "Options.Training": ("gradientAccumulation", "accumulationAndReplicationReductionType",
                         "setMeanAccumulationAndReplicationReductionStrategy", "setAutomaticLossScaling",
                         "setConvolutionDithering"),
    "Options.Precision": ("halfFloatCasting", "runningStatisticsAlwaysFloat", "enableFloatingPointExceptions",
                          "enableStochasticRounding", "setPartialsType"),
    "Options.Distributed": ("disable", "setEnvVarNames", "configureProcessId", "processId", "numProcesses"),
    "Options.TensorLocations": ("numIOTiles", "setActivationLocation", "setWeightLocation", "setOptimizerLocation",
                                "setAccumulatorLocation"),
    "Options.Jit": ("traceModel",),
    "Options._Popart": ("set", "setEngineOptions", "setPatterns", "checkIsFrozen", "options"),
    "TensorLocationSettings": ("minElementsForOffChip", "minElementsForReplicatedTensorSharding", "useOnChipStorage",
                               "useReplicatedTensorSharding", "useIOTilesToLoad", "useIOTilesToStore"),
}


def _first_line(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    line = " ".join(doc.strip().split("\n\n")[0].split())
    return line.replace("|", "\\|")


def _lookup(root, path: str):
    """The attribute at dotted `path` of `root`, or None when it is not provided."""
    obj = root
    for part in path.split("."):
        try:
            obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
        except (AttributeError, NotImplementedError):
            return None
        if isinstance(obj, property):
            obj = obj.fget
    return obj


def _row(name: str, obj) -> str:
    if obj is None:
        return f"| `{name}` | no | not provided: using it raises `NotImplementedError` naming it |"
    if isinstance(obj, types.ModuleType):
        return f"| `{name}` | yes | module: {_first_line(obj)} |"
    return f"| `{name}` | yes | {_first_line(obj) or '(see its class)'} |"


def markdown() -> str:
    poptorch = importlib.import_module("poptorch_lite")
    from .api import options as options_module, popart  # pylint: disable=import-outside-toplevel
    from .runtime import executor  # pylint: disable=import-outside-toplevel

    def provided(name):
        return getattr(poptorch, name) if name in dir(poptorch) else None

    names = [_row(n, provided(n)) for n in POPTORCH_NAMES]
    lines = ["# PopTorch's API on emulated IPUs", "",
             "Generated by `python -m poptorch_lite.surface > docs/poptorch-api.md` from the code; do not edit",
             "by hand. \"Provided\" means `poptorch_lite` has the name (and `poptorch-lite run` serves it as",
             "`poptorch.<name>`); the description is the first line of its docstring. A name that is not",
             "provided fails where it is used, with an error naming it.", "",
             f"## `poptorch` ({sum(r.split('|')[2].strip() == 'yes' for r in names)} of {len(names)} provided)",
             "", "| name | provided | what the emulator does |", "|---|---|---|", *names]
    for group, members in OPTIONS_MEMBERS.items():
        root = options_module.Options() if group.startswith("Options") else options_module.TensorLocationSettings()
        owner = root if group in ("Options", "TensorLocationSettings") else _lookup(root, group.partition(".")[2])
        rows = [_row(f"{group}.{m}", _lookup(type(owner), m)) for m in members]
        lines += ["", f"## `{group}`", "", "| method | provided | what the emulator does |", "|---|---|---|", *rows]
    rows = [_row(f"PoplarExecutor.{m}", _lookup(executor.PoplarExecutor, m)) for m in sorted(executor.POPTORCH_METHODS)]
    lines += ["", "## The compiled model (`PoplarExecutor`)", "", "| method | provided | what the emulator does |",
              "|---|---|---|", *rows]
    modelled = [o for o in popart.SESSION_OPTIONS.values() if o.effect is not None]
    lines += ["", "## PopART session options (`Options._Popart.set`)", "",
              f"`_Popart.set` takes the {len(popart.SESSION_OPTIONS)} options PopTorch passes to PopART "
              "(`popart.SESSION_OPTIONS`); any other name is an error when a model is made. These have an effect:",
              "", "| option | what the emulator does |", "|---|---|",
              *[f"| `{o.name}` | {o.effect} |" for o in sorted(modelled, key=lambda o: o.name)], "",
              "The others are accepted and have no effect on the emulator: a model made with any of them set "
              "lists them once in the log (a warning) and in its profile's notes.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
