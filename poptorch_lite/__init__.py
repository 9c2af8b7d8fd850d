"""poptorch_lite: PopTorch's API on emulated IPUs (the PopTorch + PopART role).

Three layers, each importing only the ones before it: `api` (what PopTorch users call: Options,
blocks and strategies, DataLoader, optimisers), `compiler` (a torch.nn.Module to an Executable of
ipusim programs) and `runtime` (PoplarExecutor runs it; executable cache, profiling, distributed).
"""
import importlib

from .api import phases  # first: with IPUSIM_PHASES set it marks this process's start
from .api import enums, options
from .api.arguments import ICustomArgParser, registerCustomArgParser, registerGeometricCustomArgParsers
from .api.blocks import (BeginBlock, Block, BlockError, BlockFunction, LegacyBeginBlockFn, NameScope, getIpuTensorId,
                         module_repr, removeBlocks)
from .api.cluster import fps, nearest
from .api.cpu_ops import CPU
from .api.ctc_decoder import ctc_beam_search_decoder
from .api.custom_ops import custom_op, register_custom_op, unregister_custom_op
from .api.data import AsynchronousDataAccessor, DataLoader
from .api.attributes import accessAttributes
from .api.errors import Error, RecoverableError, UnrecoverableError, createPoptorchError
from .api.hardware import ipuHardwareIsAvailable, ipuHardwareVersion, isRunningOnIpu
from .api.enums import (AutoStage, CommGroupType, ConnectionType, DataLoaderMode, HalfFloatCastingBehavior, Liveness,
                        MatMulSerializationMode, MeanReductionStrategy, MultiConvPlanType, OutputMode, OverlapMode,
                        ReductionType, SharingStrategy, SyncPattern, VariableRetrievalMode)
from .api.multiconv import MultiConv
from .api.op_attributes import Attribute
from .api.ops import (cond, dynamic_slice, dynamic_update, for_loop, identity_loss, ipu_print_tensor, nop,
                      recomputationCheckpoint, serializedMatMul, set_available_memory)
from .api.options import ConfigFileError, Options, TensorLocationSettings, setLogLevel
from .api.overlap import set_overlap_for_input, set_overlap_for_output

# Names whose modules bring in the device emulator (ipusim, Numba) or the compiler: imported on first
# use, so that a process that only loads data (an AsynchronousDataAccessor's, spawned, which imports
# the user's script again) imports torch and what its dataset needs, not the emulator.
_ON_FIRST_USE = {
    "optim": ("poptorch_lite.api.optim", None),
    "poptorch_core": ("poptorch_lite.api.poptorch_core", None),
    "_impl": ("poptorch_lite._impl", None),
    "profiling": ("poptorch_lite.api.profiling", None),
    "importPoptorchMetadataFromFile": ("poptorch_lite.runtime.saved", "importPoptorchMetadataFromFile"),
    **{name: ("poptorch_lite.api.strategies", name)
       for name in ("ParallelPhasedExecution", "Phase", "PipelinedExecution", "SerialPhasedExecution",
                    "ShardedExecution", "Stage", "StrategyError")},
    "op_placement": ("poptorch_lite.compiler.placement", "op_placement"),
    "UnsupportedOpError": ("poptorch_lite.compiler.aten", "UnsupportedOpError"),
    "CompileError": ("poptorch_lite.compiler.lowering", "CompileError"),
    **{name: ("poptorch_lite.runtime.executor", name) for name in ("PoplarExecutor", "inferenceModel", "load",
                                                                   "poptorchAtExit",
                                                                   "registerPostCompileHook", "registerPreCompileHook",
                                                                   "trainingModel")},
}


def __getattr__(name: str):
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _ON_FIRST_USE[name]
    with phases.phase(f"import-{module}"):
        value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_ON_FIRST_USE))


__version__ = "0.1.0"

phases.mark("import-poptorch_lite:end")

__all__ = ["AsynchronousDataAccessor", "Attribute", "AutoStage", "BeginBlock", "Block", "BlockError", "BlockFunction",
           "CPU",
           "CommGroupType", "CompileError", "ConfigFileError", "ConnectionType", "DataLoader", "DataLoaderMode",
           "Error", "HalfFloatCastingBehavior", "ICustomArgParser", "LegacyBeginBlockFn", "Liveness",
           "MatMulSerializationMode", "MeanReductionStrategy", "MultiConv", "MultiConvPlanType", "NameScope",
           "Options", "OutputMode", "OverlapMode", "ParallelPhasedExecution", "Phase", "PipelinedExecution",
           "PoplarExecutor", "RecoverableError", "ReductionType", "SerialPhasedExecution", "ShardedExecution",
           "SharingStrategy", "Stage", "StrategyError", "SyncPattern", "TensorLocationSettings",
           "UnrecoverableError", "UnsupportedOpError", "VariableRetrievalMode", "accessAttributes", "cond",
           "createPoptorchError", "ctc_beam_search_decoder", "custom_op", "dynamic_slice", "dynamic_update",
           "for_loop", "fps", "getIpuTensorId", "identity_loss", "importPoptorchMetadataFromFile", "inferenceModel",
           "ipuHardwareIsAvailable", "ipuHardwareVersion", "ipu_print_tensor", "isRunningOnIpu", "load",
           "module_repr", "nearest", "nop", "op_placement", "optim", "poptorchAtExit", "poptorch_core", "profiling",
           "recomputationCheckpoint", "registerCustomArgParser", "registerGeometricCustomArgParsers",
           "registerPostCompileHook", "registerPreCompileHook", "register_custom_op", "removeBlocks",
           "serializedMatMul", "setLogLevel", "set_available_memory", "set_overlap_for_input",
           "set_overlap_for_output", "trainingModel", "unregister_custom_op"]
registerGeometricCustomArgParsers()
