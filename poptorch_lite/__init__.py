"""poptorch_lite: PopTorch's API on emulated IPUs (the PopTorch + PopART role).

Three layers, each importing only the ones before it: `api` (what PopTorch users call: Options,
blocks and strategies, DataLoader, optimisers), `compiler` (a torch.nn.Module to an Executable of
ipusim programs) and `runtime` (PoplarExecutor runs it; executable cache, profiling, distributed).
"""
from .api import enums, optim, options
from .api.arguments import ICustomArgParser, registerCustomArgParser
from .api.blocks import BeginBlock, Block, BlockError, BlockFunction, module_repr, removeBlocks
from .api.data import AsynchronousDataAccessor, DataLoader
from .api.errors import Error, RecoverableError, UnrecoverableError
from .api.hardware import ipuHardwareIsAvailable, ipuHardwareVersion, isRunningOnIpu
from .api.enums import (AutoStage, ConnectionType, DataLoaderMode, HalfFloatCastingBehavior, Liveness,
                        MeanReductionStrategy, OutputMode, ReductionType, SharingStrategy, SyncPattern)
from .api.ops import identity_loss, ipu_print_tensor, set_available_memory
from .api.options import Options, TensorLocationSettings, setLogLevel
from .api.strategies import (ParallelPhasedExecution, Phase, PipelinedExecution, SerialPhasedExecution,
                             ShardedExecution, Stage, StrategyError)
from .compiler.capture import op_placement
from .compiler.aten import UnsupportedOpError
from .compiler.lowering import CompileError
from .runtime.executor import PoplarExecutor, inferenceModel, trainingModel

__version__ = "0.1.0"

__all__ = ["AsynchronousDataAccessor", "AutoStage", "BeginBlock", "Block", "BlockError", "BlockFunction",
           "CompileError", "ConnectionType", "DataLoader", "DataLoaderMode", "Error", "HalfFloatCastingBehavior", "ICustomArgParser", "Liveness", "MeanReductionStrategy",
           "Options", "OutputMode", "ParallelPhasedExecution", "Phase", "PipelinedExecution", "PoplarExecutor",
           "RecoverableError", "ReductionType", "SerialPhasedExecution", "ShardedExecution", "SharingStrategy", "Stage", "StrategyError", "SyncPattern",
           "TensorLocationSettings", "UnrecoverableError", "UnsupportedOpError", "identity_loss", "inferenceModel",
           "ipu_print_tensor", "ipuHardwareIsAvailable", "ipuHardwareVersion", "isRunningOnIpu", "module_repr", "op_placement", "optim",
           "registerCustomArgParser", "removeBlocks", "setLogLevel", "set_available_memory", "trainingModel"]
