"""poptorch_lite: PopTorch's API on emulated IPUs (the PopTorch + PopART role)."""
from . import optim
from .blocks import BeginBlock, Block, BlockError, BlockFunction, removeBlocks
from .capture import op_placement
from .data import AsynchronousDataAccessor, DataLoader
from .enums import (AutoStage, ConnectionType, DataLoaderMode, Liveness, MeanReductionStrategy, OutputMode,
                    ReductionType, SyncPattern)
from .executor import PoplarExecutor, inferenceModel, trainingModel
from .frontend import UnsupportedOpError
from .lowering import CompileError
from .ops import identity_loss
from .options import Options, TensorLocationSettings, setLogLevel
from .strategies import (ParallelPhasedExecution, Phase, PipelinedExecution, SerialPhasedExecution,
                         ShardedExecution, Stage, StrategyError)

__version__ = "0.1.0"

__all__ = ["AsynchronousDataAccessor", "AutoStage", "BeginBlock", "Block", "BlockError", "BlockFunction",
           "CompileError", "ConnectionType", "DataLoader", "DataLoaderMode", "Liveness", "MeanReductionStrategy",
           "Options", "OutputMode", "ParallelPhasedExecution", "Phase", "PipelinedExecution", "PoplarExecutor",
           "ReductionType", "SerialPhasedExecution", "ShardedExecution", "Stage", "StrategyError", "SyncPattern",
           "TensorLocationSettings", "UnsupportedOpError", "identity_loss", "inferenceModel", "op_placement", "optim",
           "removeBlocks", "setLogLevel", "trainingModel"]
