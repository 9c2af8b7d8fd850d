"""ipusim: a tile-level IPU emulator (the Poplar + PopLibs + IPU Model role), torch-free."""
from .cost import Cost, Cycles
from .engine import Engine, RunReport
from .graph import Device, Graph
from .memory import MemoryReport, OutOfMemoryError
from .program import (Copy, DataStream, Execute, If, InterIpuCopy, OpProgram, Parallel, Program, RemoteBuffer,
                      RemoteCopy, Repeat, Sequence, StreamCopy, Sync)
from .storage import MappingError
from .target import BOW, GC2, GC200, Target, get_target
from .tensor import Tensor, Variable
from .vertex import ComputeSet, LocalityError, Vertex, VertexType

__all__ = ["BOW", "GC2", "GC200", "ComputeSet", "Copy", "Cost", "Cycles", "DataStream", "Device", "Engine",
           "Execute", "Graph", "If", "InterIpuCopy", "LocalityError", "MappingError", "MemoryReport", "OpProgram",
           "OutOfMemoryError", "Parallel", "Program", "RemoteBuffer", "RemoteCopy", "Repeat", "RunReport", "Sequence", "StreamCopy", "Sync",
           "Target", "Tensor", "Variable", "Vertex", "VertexType", "get_target"]
