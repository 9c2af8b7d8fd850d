"""PopART's Python names that PopTorch programs use, and the session options PopTorch passes on.

PopTorch users reach PopART through ``Options._Popart.set(name, value)`` and
``Options._Popart.setPatterns(...)``, passing PopART's enums (``popart.RecomputationType.Pipeline``,
``popart.SyntheticDataMode.RandomNormal``, ...). Under ``poptorch-lite run`` (and the pytest plugin)
``import popart`` gives this module. Enum members and values are PopART's
(``willow/include/popart/sessionoptions.hpp`` and its Python bindings).

:data:`SESSION_OPTIONS` lists the options PopTorch forwards to PopART (PopTorch's
``SessionOptionsImpl``: any other name is an error there, and here), each with its value kind
and, where the emulator models it, what it does here. :func:`check_option` checks a name and a
value as PopTorch does when it parses the options.
"""
from __future__ import annotations

import difflib
import enum
import numbers
from dataclasses import dataclass
from typing import Any, Optional

from . import errors


class _Enum(enum.IntEnum):
    """An IntEnum shown as PopART's Python bindings show theirs (``RecomputationType.Pipeline``)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class RecomputationType(_Enum):
    """Which activations the backward recomputes instead of keeping (``autoRecomputation``)."""
    NoRecompute = 0
    Standard = 1
    NormOnly = 2
    Pipeline = 3
    RecomputeAll = 4


class MergeVarUpdateType(_Enum):
    """How variable updates are grouped (``mergeVarUpdate``)."""
    Off = 0
    All = 1
    AutoLoose = 2
    AutoTight = 3


class VirtualGraphMode(_Enum):
    """How ops are placed on IPUs (``virtualGraphMode``)."""
    Off = 0
    Manual = 1
    Auto = 2
    ExecutionPhases = 3


class SyntheticDataMode(_Enum):
    """Host I/O replaced by data made on the device (``syntheticDataMode``)."""
    Off = 0
    Zeros = 1
    RandomNormal = 2
    RandomUniform = 3


class Instrumentation(_Enum):
    """Where cycle counters are placed (``hardwareInstrumentations``)."""
    Outer = 0
    Inner = 1


class IrSerializationFormat(_Enum):
    JSON = 0


class BatchSerializationBatchSchedule(_Enum):
    Scheduler = 0
    Isomorphic = 1
    OverlapOnIo = 2
    OverlapOnCompute = 3


class BatchSerializationTransformContext(_Enum):
    Fwd = 0
    Bwd = 1
    Forward = 0
    Backward = 1


class BatchSerializationMethod(_Enum):
    UnrollDynamic = 0
    UnrollStatic = 1
    Loop = 2


class ExecutionPhaseIOSchedule(_Enum):
    Preload = 0
    OnDemand = 1


class ExecutionPhaseSchedule(_Enum):
    Interleaving = 0
    Batch = 1
    BatchClusteredIO = 2


class AccumulateOuterFragmentSchedule(_Enum):
    """How the ops outside the gradient-accumulation loop are scheduled."""
    Scheduler = 0
    Serial = 1
    OverlapCycleOptimized = 2
    OverlapMemoryOptimized = 3


class SubgraphCopyingStrategy(_Enum):
    OnEnterAndExit = 0
    JustInTime = 1


class MeanReductionStrategy(_Enum):
    Running = 0
    Post = 1


class AutodiffStitchStrategy(_Enum):
    RecomputeMinimal = 0
    RecomputeAllNonInputs = 1
    AddFwdOutputs = 2
    SafeAddFwdOutputs = 3


class GradientTensorTrackingMethod(_Enum):
    AllNonViewChangingGradientTensors = 0
    ConvAndMatmulGradients = 1
    GradientsOfUserSpecifiedTensors = 2


class ReductionType(_Enum):
    Sum = 0
    Mean = 1
    NoReduction = 2


class PatternsLevel(_Enum):
    """The set of graph patterns a ``Patterns`` starts from."""
    NoPatterns = 0
    Minimal = 1
    Default = 2
    All = 3


class TensorStorage(_Enum):
    OnChip = 0
    OffChip = 1


class TileSet(_Enum):
    Compute = 0
    IO = 1


class ReplicatedTensorSharding(_Enum):
    Off = 0
    On = 1


class SyncPattern(_Enum):
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class DeviceConnectionType(_Enum):
    Always = 0
    OnDemand = 1
    Never = 2


class CommGroupType(_Enum):
    All = 0
    Consecutive = 1
    Orthogonal = 2
    Ungrouped = 3


class DotCheck(str, enum.Enum):
    """The points of PopART's IR construction at which ``dotChecks`` writes a .dot file; PopART
    compares them in upper case, and ``All`` writes every one."""
    Fwd0 = "FWD0"
    Fwd1 = "FWD1"
    Bwd0 = "BWD0"
    PreAlias = "PREALIAS"
    MainLoops = "MAINLOOPS"
    Final = "FINAL"
    All = "ALL"

    def __str__(self) -> str:
        return self.value


# ---- graph patterns -----------------------------------------------------------------------------

# PopART's pre-alias patterns: name -> (enabled at PatternsLevel.Default, mandatory: enabled at
# Minimal). ``willow/src/patterns/*.cpp`` registers them (PatternCreator(name, enabled, mandatory)).
PATTERNS: dict[str, tuple[bool, bool]] = {
    **{name: (True, True) for name in """
        AllReduceToIdentity Atan2Arg0GradOp Atan2Arg1GradOp ConvDataGrad ConvFlipWeightsGradOp ConvTranspose
        CosGradOp CoshOp DivArg0GradOp DivArg1GradOp AbsGradOp SinGradOp ExpGradOp Expm1GradOp FmodArg0GradOp
        RandomNormalLikeOpPattern RandomUniformLikeOpPattern ZerosLikeOpPattern Log1pGradOp LogGradOp LoopScanOut
        MatMulOp MatMulLhsGradOp MatMulRhsGradOp MulArgGradOp PowArg0GradOp PowArg1GradOp ReciprocalGradOp
        ScanToLoop SqrtGradOp SubtractArg1GradOp""".split()},
    **{name: (True, False) for name in """
        ConvFlipWeightsDoubleFlip DecomposeBinaryConstScalar ExpandCast InitAccumulate LambSerialisedWeight
        NegativeOneScale NlllWithSoftmaxGradDirect OpToIdentity PackedDataBlock PadSum PostNRepl PreUniRepl
        RemoveUnnecessaryLossGradCast SoftmaxGradDirect SplitGradOpToConcat SplitOp SumToAdd
        TransposeToIdentityOrReshapePattern UpsampleToResize""".split()},
    **{name: (False, False) for name in "LSTMOp Slice2SliceSubsample SplitGather TiedGather TiedGatherAccumulate".split()},
}
# Patterns that are not pre-alias patterns (PopART handles them apart), on at Default and All.
SPECIAL_PATTERNS = ("InPlace", "UpdateInplacePrioritiesForIpu")


def check_pattern(name: str) -> None:
    """An Error naming `name`, with the closest pattern names, unless PopART has that pattern."""
    if name not in PATTERNS and name not in SPECIAL_PATTERNS:
        raise errors.make(f"Unknown pattern {name!r}.{_hint(name, [*PATTERNS, *SPECIAL_PATTERNS])} "
                          "popart.PATTERNS lists PopART's patterns.")


class Patterns:
    """A set of PopART graph patterns: ``Patterns(PatternsLevel.Default)``, ``Patterns(["PadSum",
    ...])``, then ``enablePattern(name, on)`` and ``isPatternEnabled(name)``. The emulator does
    not run PopART's patterns (its graph comes from PyTorch's decompositions); the set is checked
    and recorded, as ``Options._Popart.setPatterns`` does."""

    def __init__(self, level_or_names=PatternsLevel.Default):
        self.runtime_asserts = True
        if isinstance(level_or_names, (list, tuple)):
            for name in level_or_names:
                check_pattern(name)
            self.enabled = {name: name in level_or_names for name in [*PATTERNS, *SPECIAL_PATTERNS]}
            return
        level = PatternsLevel(level_or_names)
        self.enabled = {name: (level == PatternsLevel.All or (level == PatternsLevel.Default and on)
                               or (level == PatternsLevel.Minimal and mandatory))
                        for name, (on, mandatory) in PATTERNS.items()}
        self.enabled.update({name: level in (PatternsLevel.Default, PatternsLevel.All) for name in SPECIAL_PATTERNS})

    def enablePattern(self, name: str, enabled: bool) -> "Patterns":
        check_pattern(name)
        self.enabled[name] = bool(enabled)
        return self

    def isPatternEnabled(self, name: str) -> bool:
        check_pattern(name)
        return self.enabled[name]

    def enableRuntimeAsserts(self, enabled: bool) -> "Patterns":
        self.runtime_asserts = bool(enabled)
        return self

    def __repr__(self) -> str:
        return "Patterns(" + ", ".join(n for n, on in self.enabled.items() if on) + ")"


# ---- the session options PopTorch passes to PopART ---------------------------------------------

@dataclass(frozen=True)
class SessionOption:
    """One PopART session option as PopTorch parses it.

    `kind` is what PopTorch accepts: ``bool``, ``uint64`` (an int, or a member of `enum`),
    ``double``, ``string``, ``set`` (a list, tuple or set of items) or ``map`` (a dict of string
    to string). `effect` says what the emulator does with it; None means it is accepted (a
    PopTorch program may set it) and has no effect on the emulator.
    """
    name: str
    kind: str
    enum: Optional[type] = None
    effect: Optional[str] = None


def _options(kind: str, names: str, **extra) -> dict[str, SessionOption]:
    return {n: SessionOption(n, kind, **extra) for n in names.split()}


SESSION_OPTIONS: dict[str, SessionOption] = {
    **_options("bool", """
        enableExplicitIR enableInplaceAmbiguityChecking enableLoadAndOffloadRNGState
        batchSerializationSettings.concatOnVirtualGraphChange
        batchSerializationSettings.concatOnExecutionPhaseChange
        batchSerializationSettings.concatOnPipelineStageChange strictOpVersions opxAliasChecking
        opxModifyChecking dotOpNames exportPoplarComputationGraph exportPoplarVertexGraph
        separateCallOpPdfs enableOutlining enableOutliningCopyCostPruning rearrangeAnchorsOnHost
        rearrangeStreamsOnHost enablePrefetchDatastreams enableNonStableSoftmax enableReplicatedGraphs
        enableGradientAccumulation enablePipelining disableGradAccumulationTensorStreams
        disableOptimizerStateTensorStreams compileEngine constantWeights enableMergeExchange
        enableFloatingPointChecks enableStochasticRounding ensureFp32LossScaleTensor explicitRecomputation
        enableExplicitMainLoops useHostCopyOps aliasZeroCopy delayVarUpdates enableFullyConnectedPass
        enableSerializedMatmuls enableStableNorm decomposeGradSum enableDistributedReplicatedGraphs
        groupHostSync enableSupportedDataTypeCasting
        groupNormStridedChannelGrouping scheduleNonWeightUpdateGradientConsumersEarly
        replicatedCollectivesSettings.prepareScheduleForMergingCollectives
        replicatedCollectivesSettings.mergeAllReduceCollectives"""),
    "autoRecomputation": SessionOption(
        "autoRecomputation", "uint64", enum=RecomputationType,
        effect="which pipeline stages recompute their forward before their backward (poptorch_lite.compiler."
               "recompute); Pipeline by default for pipelined training over more than one IPU, as in PopTorch"),
    "enableEngineCaching": SessionOption(
        "enableEngineCaching", "bool",
        effect="turns the executable cache on (Options.enableExecutableCaching)"),
    "instrumentWithHardwareCycleCounter": SessionOption(
        "instrumentWithHardwareCycleCounter", "bool",
        effect="PoplarExecutor.cycleCount() reports the emulated cycles of the last run (Options.logCycleCount)"),
    **_options("uint64", """
        executionPhaseSettings.phases executionPhaseSettings.stages batchSerializationSettings.factor
        firstDotOp finalDotOp numIOTiles mergeVarUpdateMemThreshold looseThresholdAtPeak
        accumulationFactor swapLimitScheduler globalReplicationFactor globalReplicaOffset
        defaultBufferingDepth defaultPrefetchBufferingDepth compilationProgressTotal
        transitiveClosureOptimizationThreshold"""),
    **{name: SessionOption(name, "uint64", enum=cls) for name, cls in (
        ("autodiffSettings.stitchStrategy", AutodiffStitchStrategy),
        ("batchSerializationSettings.transformContext", BatchSerializationTransformContext),
        ("batchSerializationSettings.method", BatchSerializationMethod),
        ("batchSerializationSettings.batchSchedule", BatchSerializationBatchSchedule),
        ("mergeVarUpdate", MergeVarUpdateType),
        ("virtualGraphMode", VirtualGraphMode),
        ("syntheticDataMode", SyntheticDataMode),
        ("subgraphCopyingStrategy", SubgraphCopyingStrategy),
        ("accumulationAndReplicationReductionType", ReductionType),
        ("meanAccumulationAndReplicationReductionStrategy", MeanReductionStrategy),
        ("accumulateOuterFragmentSettings.schedule", AccumulateOuterFragmentSchedule),
    )},
    **_options("double", """
        outlineSequenceBreakCost outlineThreshold timeLimitScheduler"""),
    **{name: SessionOption(name, kind, enum=enum, effect="automatic loss scaling (poptorch_lite.compiler.loss_scaling; "
                           "Options.Training.setAutomaticLossScaling)")
       for name, kind, enum in (("automaticLossScalingSettings.enabled", "bool", None),
                                ("automaticLossScalingSettings.updatePeriod", "uint64", None),
                                ("automaticLossScalingSettings.gradientTensorTrackingMethod", "uint64",
                                 GradientTensorTrackingMethod),
                                ("automaticLossScalingSettings.thresholdUpperCountProportion", "double", None),
                                ("automaticLossScalingSettings.binEdgeLocation", "double", None))},
    **_options("string", """
        customCodeletCompileFlags serializedPoprithmsShiftGraphsDir kahnTieBreaker saveInitializersToFile"""),
    "partialsTypeMatMuls": SessionOption(
        "partialsTypeMatMuls", "string",
        effect="'half': float16 matmuls write float16 partials when they split the reduced dimension over "
               "tiles (ipusim.ops.matmul), halving those bytes and their exchange (Precision.setPartialsType)"),
    "logDir": SessionOption(
        "logDir", "string", effect="ignored, as in PopTorch: Options.logDir() sets the log directory"),
    "cachePath": SessionOption(
        "cachePath", "string", effect="the executable cache's directory (Options.enableExecutableCaching)"),
    **_options("set", """
        accumulateOuterFragmentSettings.excludedVirtualGraphs customCodelets"""),
    "dotChecks": SessionOption("dotChecks", "set", enum=DotCheck),
    "hardwareInstrumentations": SessionOption("hardwareInstrumentations", "set", enum=Instrumentation),
    "updatableNamedBuffers": SessionOption(
        "updatableNamedBuffers", "set",
        effect="the buffers PoplarExecutor.copyNamedBuffersToDevice() writes (Options.updatableNamedBuffers)"),
    **_options("map", "reportOptions convolutionOptions matmulOptions lstmOptions gclOptions"),
    "engineOptions": SessionOption(
        "engineOptions", "map",
        effect="autoReport.all / autoReport.output* / autoReport.directory turn profiling on "
               "(Options.enableProfiling); other engine options have no effect"),
    # PopTorch keeps these two together (setPatterns)
    "patterns": SessionOption("patterns", "map"),
    "patterns_level": SessionOption("patterns_level", "uint64", enum=PatternsLevel),
}


def _hint(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    if not close:
        lowered = {n.lower(): n for n in names}
        close = [lowered[name.lower()]] if name.lower() in lowered else []
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def value_kind(value: Any) -> Optional[str]:
    """The kind PopTorch's option parser sees `value` as, or None if it takes no such value."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, numbers.Integral):
        return "uint64"
    if isinstance(value, numbers.Real):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple, set, frozenset)):
        return "set"
    if isinstance(value, dict):
        return "map"
    return None


_KIND_NAMES = {"bool": "bool", "uint64": "uint64", "double": "floating point", "string": "string",
               "set": "set / vector", "map": "map"}


def check_option(name: str, value: Any) -> SessionOption:
    """Check PopART option `name` set to `value` as PopTorch parses it; its :class:`SessionOption`.

    Raises :class:`poptorch.Error` for a value of a type no option takes ("Unknown value type"),
    for a name PopTorch does not pass to PopART ("Unknown <kind> option", with the closest names),
    for a value of the wrong kind and for an enum value out of range."""
    kind = value_kind(value)
    if kind is None:
        raise errors.make(f"Unknown value type {type(value).__name__} for option {name}: PopART options "
                          "take a bool, an int, a float, a str, a list/tuple/set or a dict")
    option = SESSION_OPTIONS.get(name)
    if option is None:
        raise errors.make(f"Unknown {_KIND_NAMES[kind]} option {name}: PopTorch does not pass it to "
                          f"PopART.{_hint(name, SESSION_OPTIONS)} popart.SESSION_OPTIONS lists the names.")
    accepted = {option.kind} | ({"uint64"} if option.kind == "double" else set())
    if kind not in accepted:
        raise errors.make(f"Unknown {_KIND_NAMES[kind]} option {name}: {name} takes a "
                          f"{_KIND_NAMES[option.kind]} value, got {value!r}")
    if option.kind == "uint64":
        if value < 0:
            raise errors.make(f"Option {name} takes an unsigned integer, got {value}")
        if option.enum is not None and value not in {m.value for m in option.enum}:
            members = ", ".join(f"{m.value} ({option.enum.__name__}.{m.name})" for m in _members(option.enum))
            raise errors.make(f"Value {value} for {option.enum.__name__} out of range (option {name}): use {members}")
    elif option.kind == "set" and option.enum is not None:
        for item in value:
            _check_item(name, option.enum, item)
    elif option.kind == "map":
        for key in value:
            if not isinstance(key, str):
                raise errors.make(f"Option {name} maps names (str) to values, got the key {key!r}")
            if name == "patterns":
                check_pattern(key)
    return option


def without_effect(values: dict, defaults: dict) -> list[str]:
    """The PopART options set in `values` (other than at their `defaults`) that the emulator
    accepts but does not model."""
    return sorted(name for name, value in values.items()
                  if name in SESSION_OPTIONS and SESSION_OPTIONS[name].effect is None
                  and not (name in defaults and defaults[name] == value))


def _members(enum_class) -> list:
    return [m for name, m in enum_class.__members__.items() if m.name == name]  # aliases once


def _check_item(name: str, enum_class, item) -> None:
    if issubclass(enum_class, str):
        if str(item).upper() not in {m.value for m in enum_class}:
            raise errors.make(f"Option {name}: {item!r} is not one of "
                              f"{', '.join(m.name for m in enum_class)}")
    elif isinstance(item, bool) or not isinstance(item, numbers.Integral) or \
            item not in {m.value for m in enum_class}:
        members = ", ".join(f"{m.value} ({enum_class.__name__}.{m.name})" for m in _members(enum_class))
        raise errors.make(f"Option {name}: {item!r} is not a {enum_class.__name__}: use {members}")
