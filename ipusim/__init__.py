"""ipusim: a tile-level IPU emulator (the Poplar + PopLibs + IPU Model role), torch-free."""
from .device import kernel_cache

kernel_cache.use_versioned_cache()   # first: before any module defines a cached kernel

from .device.cost import Cost, Cycles  # noqa: E402 (after the kernel cache is chosen)
from .device.engine import Engine, EstimateModeError, RunReport
from .device.graph import Device, Graph
from .device.mapping import TileMap
from .device.memory import MemoryReport, OutOfMemoryError
from .device.program import (Copy, CrossReplicaCopy, DataStream, Execute, If, InterIpuCopy, OpProgram, Parallel, Program, RemoteBuffer,
                      RemoteCopy, Repeat, Sequence, StreamCopy, Sync)
from .device.storage import MappingError
from .device.target import BOW, GC2, GC200, Target, get_target
from .device.tensor import Tensor, Variable
from .device.vertex import ComputeSet, Field, LocalityError, VertexTable, VertexType

__all__ = ["BOW", "GC2", "GC200", "ComputeSet", "Copy", "Cost", "CrossReplicaCopy", "Cycles", "DataStream", "Device", "Engine",
           "EstimateModeError", "Execute", "Field", "Graph", "If", "InterIpuCopy", "LocalityError", "MappingError", "MemoryReport", "OpProgram",
           "OutOfMemoryError", "Parallel", "Program", "RemoteBuffer", "RemoteCopy", "Repeat", "RunReport", "Sequence", "StreamCopy", "Sync",
           "Target", "Tensor", "TileMap", "Variable", "VertexTable", "VertexType", "get_target"]
