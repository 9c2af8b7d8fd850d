"""The Engine: compiles programs for a device, then loads, runs and reads them.

Compiling means: check memory (out-of-memory is an error, the reports stay available), estimate
every program node's cycles once, and precompute the addresses every vertex and copy touches.
Loading flattens each program into the list of host calls its leaves make (kernels, copies,
streams); a run makes those calls and charges the program's precomputed cycles once. Programs
that branch on device data (If), Parallel parts on host threads and profiled runs walk the
program node by node instead, each leaf adding its own cycles.

Modes (same program, same cycles and memory, different host work):
- "strict": tile-major memory; every copy moves bytes; every compute set runs its codelets
  vertex by vertex, each from its own tile's memory.
- "fast": variable-major memory; an op's program runs as the op's whole-tensor kernel and its
  internal exchanges are accounted, not copied; other programs run as in strict mode. With
  `share_storage`, temporaries (not always live, and set whole by every program that uses them
  before it reads them: no value crosses a program's bounds) share storage by liveness, as
  Poplar's tensors do (ipusim.device.storage); the host cannot read or write them, and programs
  whose temporaries share an IPU's storage take turns.
- "estimate": no tile memory and no host calls: a run charges each program's static cycles
  (the same figures as the other modes) and computes no values, so shapes alone answer how much
  memory and how many cycles a program takes. Reading or writing a tensor is an error; an If
  charges its costlier branch (it cannot look at device data).

Profiling (`profile_dir=DIR`): every run is recorded with the program nodes it executed, and
DIR receives profile.json, trace.json and charts when the engine is closed or collected, or at
exit (see ipusim.report.profile). Off by default, and then nothing is recorded.
"""
from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import numba
import numpy as np

from .blas import THREADS as BLAS_THREADS, blas_threads
from .host_threads import HostThreads
from .cost import Cost, Cycles, estimate, overlapped
from .graph import Device, Graph
from .kernels import kernel_view
from .memory import check_fits, memory_reports
from .program import (Copy, DataStream, Execute, If, InterIpuCopy, OpProgram, Parallel, Program, RemoteBuffer,
                      RemoteCopy, Repeat, Sequence, StreamCopy, Sync, walk)
from .tensor import Tensor, run_start

MODES = ("strict", "fast", "estimate")


class EstimateModeError(RuntimeError):
    """A tensor value was asked of an engine in estimate mode, which holds none."""


@dataclass
class RunReport:
    """Cycles of one run: wall-clock total and busy cycles per IPU by kind. With profiling on,
    `nodes` lists the nodes charged, in order (a tuple of such lists for a Parallel)."""
    total: int = 0
    per_ipu: dict[int, Cycles] = field(default_factory=dict)
    nodes: list | None = None

    def charge(self, cost: Cost, node: Program | None = None) -> None:
        self.total += cost.total
        for ipu, c in cost.per_ipu.items():
            self.per_ipu[ipu] = self.per_ipu.get(ipu, Cycles()) + c
        if self.nodes is not None:
            self.nodes.append(node)


class Engine:
    # Attributes that belong to the host process (memory, connections, threads, records), not to
    # the compiled program: a saved executable leaves them out and load() rebuilds them.
    HOST_STATE = ("mem", "_plans", "_steps", "_streams", "_stream_pos", "_pool", "last_run", "total_cycles",
                  "_profiler", "_running", "_running_threads")

    def __init__(self, graph: Graph | Device, programs: Program | list[Program], *, mode: str = "fast",
                 check_memory: bool = True, threads: int = 1, kernel_threads: int | None = None,
                 profile_dir: str | None = None, share_storage: bool = False):
        if mode not in MODES:
            raise ValueError(f"unknown engine mode {mode!r}; use 'fast', 'strict' or 'estimate'")
        self.device = Device.of(graph)
        self.target = self.device.target
        self.programs = [programs] if isinstance(programs, Program) else list(programs)
        self.mode = mode
        self.share_storage = share_storage
        self.memory = memory_reports(self.device.graphs, self.programs)
        if check_memory:
            check_fits(self.memory)
        self._costs: dict = {}
        self.costs = [estimate(p, self.target, self.device.num_ipus, self._costs, self.device.sync_ipus)
                      for p in self.programs]
        if self.device.replicas > 1 and mode != "estimate":
            raise ValueError(f"this device stands for {self.device.replicas} replicas it does not hold: it can only be "
                             "priced (mode='estimate'); build every replica's IPUs to run it")
        self.host_state(threads)
        # Threads inside one kernel call. Kernels are small (one compute set, one op); on a
        # loaded or small machine the synchronisation of a parallel region costs more than the
        # work, so the default is 1 (IPUSIM_KERNEL_THREADS or kernel_threads= to change it).
        self.kernel_threads = min(int(kernel_threads or os.environ.get("IPUSIM_KERNEL_THREADS", 1)),
                                  numba.config.NUMBA_NUM_THREADS)
        if profile_dir is not None:
            from ..report.profile import EngineProfiler
            self._profiler = EngineProfiler(self, profile_dir)

    def host_state(self, threads: int = 1) -> None:
        """Fresh HOST_STATE: no memory (load() makes it), no connected streams, no record, and a
        pool of `threads` host threads for Parallel programs."""
        self.mem = None
        self.loaded = False
        self._plans: dict[int, object] = {}
        self._steps: list[list | None] = []
        self._streams: dict[tuple[int, str], object] = {}
        self._stream_pos: dict[tuple[int, str], int] = {}
        self._pool = HostThreads(threads, "ipusim-parallel") if threads > 1 else None
        self.last_run: RunReport | None = None
        self.total_cycles = 0
        self._profiler = None
        self._running = threading.local()  # per host thread: inside `running()`
        self._running_threads = 0  # host threads sharing the machine in the outermost `running()`, 0 outside

    # ---- loading --------------------------------------------------------------------------
    def load(self) -> "Engine":
        self.loaded = True
        if self.mode == "estimate":  # no storage, nothing to plan: every program charges its static cost
            self._plans, self._steps = {}, [[] for _ in self.programs]
            return self
        from .storage import DeviceMemory
        self.mem = DeviceMemory(self.device, self.mode, self._op_internal(), self.programs,
                                share=getattr(self, "share_storage", False))
        self._plans = {}
        for p in self.programs:
            for node in self._executed_nodes(p):
                self._plan(node)
        self._steps = [self._flatten(p) for p in self.programs]
        return self

    def _op_internal(self) -> dict[int, str]:
        """Fast mode: the variables only ever used inside ops' bodies (their exchange buffers,
        partials), which no executed node touches, so they need no host storage: variable id ->
        the op. Their device memory is still accounted (memory reports come from the graph)."""
        if self.mode != "fast":
            return {}
        touched, internal = set(), {}
        for p in self.programs:
            for node in self._executed_nodes(p):
                if isinstance(node, OpProgram):
                    for inner in walk(node):
                        if isinstance(inner, OpProgram):  # an op's kernel may run its parts' kernels
                            touched.update(t.var.id for t in (*inner.reads, *inner.writes))
                        internal.update((v.id, node.name) for v in _variables(inner))
                else:
                    touched.update(v.id for v in _variables(node))
        return {v: op for v, op in internal.items() if v not in touched}

    def _executed_nodes(self, p: Program):
        """Nodes this mode executes: the fast mode runs an OpProgram's kernel, not its body."""
        yield p
        if not (self.mode == "fast" and isinstance(p, OpProgram)):
            for c in p.children():
                yield from self._executed_nodes(c)

    def _plan(self, node: Program) -> None:
        mem = self.mem
        if isinstance(node, Execute):
            ipu_mem = mem[node.compute_set.ipu]
            plan = []
            for table in node.compute_set.tables:
                args = []
                for f in table.type.fields:
                    column = table.fields[f]
                    starts = np.concatenate(([0], np.cumsum(column.sizes()))).astype(np.int64)
                    args += [kernel_view(ipu_mem.arena(column.dtype)), ipu_mem.field_addresses(column), starts]
                plan.append((table.type.kernel, args + [table.params, *table.type.template]))
            self._plans[id(node)] = plan
        elif isinstance(node, (Copy, InterIpuCopy)):
            self._plans[id(node)] = _copy_plan(mem[node.src.ipu], node.src, mem[node.dst.ipu], node.dst)

    def _flatten(self, p: Program) -> list | None:
        """Program p as a flat list of host calls, one per leaf it runs, in order; None when p
        branches on device data (If) or runs Parallel parts on host threads, which the node
        walk handles. A flat program's cycles are static: a run charges cost(p) once."""
        if isinstance(p, Sequence):
            steps = []
            for c in p.programs:
                part = self._flatten(c)
                if part is None:
                    return None
                steps += part
            return steps
        if isinstance(p, Repeat):
            body = self._flatten(p.body)
            if body is None:
                return None
            return [_repeat(body, p.count)] if p.count and body else []
        if isinstance(p, Parallel):
            return None if self._pool is not None else self._flatten(Sequence(*p.programs))
        if isinstance(p, OpProgram):
            return [functools.partial(p.fast, self.mem)] if self.mode == "fast" else self._flatten(p.body)
        if isinstance(p, Execute):
            return [functools.partial(kernel, *args) for kernel, args in self._plans[id(p)]]
        if isinstance(p, (Copy, InterIpuCopy)):
            return [_copy(*part) for part in self._plans[id(p)]]
        if isinstance(p, StreamCopy):
            return [functools.partial(self._stream_copy, p)]
        if isinstance(p, RemoteCopy):
            return [functools.partial(self._remote_copy, p)]
        if isinstance(p, Sync):
            return []
        return None

    def _require_loaded(self):
        if not self.loaded:
            raise RuntimeError("the engine is not loaded: call engine.load() before running or "
                               "reading and writing tensors")

    def _require_values(self, what: str):
        self._require_loaded()
        if self.mode == "estimate":
            raise EstimateModeError(f"{what}: an engine in estimate mode computes no values and holds no tensor "
                                    "storage; use mode='fast' or 'strict' to run with values")

    # ---- host access ----------------------------------------------------------------------
    def readTensor(self, t: Tensor) -> np.ndarray:
        self._require_values("readTensor")
        self.mem.check_host_access(t, "readTensor")
        return np.array(self.mem.read(t), copy=True)

    def writeTensor(self, t: Tensor, values) -> None:
        self._require_values("writeTensor")
        self.mem.check_host_access(t, "writeTensor")
        self.mem.write(t, np.asarray(values).astype(t.dtype, copy=False))

    def readRemoteBuffer(self, buffer: RemoteBuffer, slot: int = 0) -> np.ndarray:
        self._require_values("readRemoteBuffer")
        return self.mem[buffer.ipu].remote[buffer.name][slot].reshape(buffer.shape).copy()

    def writeRemoteBuffer(self, buffer: RemoteBuffer, values, slot: int = 0) -> None:
        self._require_values("writeRemoteBuffer")
        self.mem[buffer.ipu].remote[buffer.name][slot] = np.asarray(values, dtype=buffer.dtype).reshape(-1)

    def connectStream(self, name: str, data, ipu: int | None = None) -> None:
        """Connect a host stream to an array (consumed or filled one element per copy,
        cyclically) or to a callback (`fn()` returns data for host-to-device, `fn(array)`
        receives data for device-to-host)."""
        stream = self._find_stream(name, ipu)
        if not callable(data):
            data = np.asarray(data)
            if data.dtype != stream.dtype:
                raise TypeError(f"stream {name!r} carries {stream.dtype.name}, the connected array is {data.dtype.name}")
            shape = tuple(stream.shape)
            if data.shape == shape:
                data = data.reshape((1,) + shape)
            elif data.shape[1:] != shape:
                raise ValueError(f"stream {name!r} moves elements of shape {shape}; connect an array of shape "
                                 f"{shape} or (N, *{shape}), got {data.shape}")
        self._streams[(stream.ipu, name)] = data
        self._stream_pos[(stream.ipu, name)] = 0

    def _find_stream(self, name: str, ipu: int | None) -> DataStream:
        found = [g.streams[name] for g in self.device.graphs if name in g.streams and ipu in (None, g.ipu)]
        if not found:
            raise KeyError(f"no stream named {name!r}" + (f" on IPU {ipu}" if ipu is not None else ""))
        if len(found) > 1:
            raise ValueError(f"stream {name!r} exists on IPUs {[s.ipu for s in found]}: pass ipu=")
        return found[0]

    # ---- running --------------------------------------------------------------------------
    def run(self, index: int = 0) -> int:
        """Run program `index`; returns its cycles (also in `last_run`, by IPU and kind)."""
        report = self.execute(index)
        self.last_run = report
        self.total_cycles += report.total
        return report.total

    @contextmanager
    def running(self, host_threads: int | None = None):
        """Programs executed inside the block (from this host thread) share one setting of the
        kernels' and BLAS's threads instead of making it for each program: a runtime running many
        programs per model call enters it once per call. With `host_threads` running programs at
        once (default: the engine's own, for Parallel programs), BLAS's threads are shared among
        them (two threads each calling a two-threaded BLAS on two cores measured 1.5x slower than
        the same products one thread at a time)."""
        if getattr(self._running, "inside", False):
            yield
            return
        numba.set_num_threads(self.kernel_threads)  # (a per-thread setting)
        outermost = not self._running_threads  # a helper thread enters inside the caller's block
        threads = (host_threads or self._running_threads
                   or (self._pool.threads if self._pool is not None else 1))
        with blas_threads(max(1, BLAS_THREADS // threads)):
            self._running.inside = True
            if outermost:
                self._running_threads = threads
            try:
                yield
            finally:
                self._running.inside = False
                if outermost:
                    self._running_threads = 0

    def execute(self, index: int = 0, report: bool = True) -> RunReport | None:
        """Run program `index` and return its report (None when not `report` and the program's
        cycles are static) without touching `last_run` / `total_cycles` (programs on different
        IPUs may be executed from several host threads at once)."""
        self._require_loaded()
        if not 0 <= index < len(self.programs):
            raise IndexError(f"program {index} does not exist: the engine has {len(self.programs)} program(s)")
        if not getattr(self._running, "inside", False):
            with self.running():
                return self.execute(index, report)
        exclusive = self.mem.exclusive[index] if self.mem is not None else ()
        if exclusive:
            for lock in exclusive:
                lock.acquire()
            try:
                return self._execute(index, report)
            finally:
                for lock in reversed(exclusive):
                    lock.release()
        return self._execute(index, report)

    def _execute(self, index: int, report: bool) -> RunReport | None:
        steps = self._steps[index] if self._profiler is None else None
        if steps is not None:
            for step in steps:
                step()
            if not report:
                return None
            cost = self.costs[index]
            return RunReport(cost.total, dict(cost.per_ipu))
        report = RunReport(nodes=None if self._profiler is None else [])
        self._run(self.programs[index], report)
        if self._profiler is not None:
            self._profiler.ran(index, report)
        return report

    @property
    def fixed_reports(self) -> bool:
        """Whether every program reports the same cycles on every run: none branches on device
        data (If) and no profiler collects the nodes it ran."""
        self._require_loaded()
        return self._profiler is None and all(steps is not None for steps in self._steps)

    def cost(self, node: Program) -> Cost:
        return self._costs[id(node)][1]

    def _run(self, p: Program, report: RunReport) -> None:
        if self.mode == "estimate":
            self._charge(p, report)
        elif isinstance(p, Sequence):
            for c in p.programs:
                self._run(c, report)
        elif isinstance(p, OpProgram):
            if self.mode == "fast":
                p.fast(self.mem)
                report.charge(self.cost(p), p)
            else:
                self._run(p.body, report)
        elif isinstance(p, Execute):
            for kernel, args in self._plans[id(p)]:
                kernel(*args)
            report.charge(self.cost(p), p)
        elif isinstance(p, (Copy, InterIpuCopy)):
            for part in self._plans[id(p)]:
                _copy(*part)()
            report.charge(self.cost(p), p)
        elif isinstance(p, StreamCopy):
            self._stream_copy(p)
            report.charge(self.cost(p), p)
        elif isinstance(p, RemoteCopy):
            self._remote_copy(p)
            report.charge(self.cost(p), p)
        elif isinstance(p, Repeat):
            for _ in range(p.count):
                self._run(p.body, report)
        elif isinstance(p, If):
            self._run(p.then if self.mem.read(p.predicate).reshape(-1)[0] else p.else_, report)
        elif isinstance(p, Parallel):
            self._run_parallel(p, report)
        elif isinstance(p, Sync):
            report.charge(self.cost(p), p)
        else:
            raise TypeError(f"cannot run {type(p).__name__}")

    def _charge(self, p: Program, report: RunReport) -> None:
        """Estimate mode's walk (a profiled run): every leaf charged as a run charges it, nothing run;
        an If is one leaf at its static (costlier branch) cost."""
        if isinstance(p, Sequence):
            for c in p.programs:
                self._charge(c, report)
        elif isinstance(p, Repeat):
            for _ in range(p.count):
                self._charge(p.body, report)
        elif isinstance(p, Parallel):
            self._run_parallel(p, report)
        else:
            report.charge(self.cost(p), p)

    def _run_parallel(self, p: Parallel, report: RunReport) -> None:
        parts = [RunReport(nodes=None if report.nodes is None else []) for _ in p.programs]
        if self._pool is not None and len(p.programs) > 1:
            self._pool.map(lambda cr: self._run(*cr), zip(p.programs, parts))
        else:
            for c, r in zip(p.programs, parts):
                self._run(c, r)
        for ipu, c in overlapped([r.per_ipu for r in parts]).items():
            report.per_ipu[ipu] = report.per_ipu.get(ipu, Cycles()) + c
        report.total += max((r.total for r in parts), default=0)
        if report.nodes is not None:
            report.nodes.append(tuple(r.nodes for r in parts))

    def _remote_copy(self, p: RemoteCopy) -> None:
        remote = self.mem[p.buffer.ipu].remote[p.buffer.name]
        if p.loads:
            self.mem.write(p.tensor, remote[p.slot].reshape(p.tensor.shape))
        else:
            remote[p.slot] = self.mem.read(p.tensor).reshape(-1)

    def _stream_copy(self, p: StreamCopy) -> None:
        s = p.stream
        key = (s.ipu, s.name)
        if key not in self._streams:
            raise RuntimeError(f"stream {s.name!r} on IPU {s.ipu} is not connected: call "
                               f"engine.connectStream({s.name!r}, array_or_callback) before running")
        data = self._streams[key]
        if s.direction == "host_to_device":
            if callable(data):
                value = np.asarray(data(), dtype=s.dtype)
            else:
                i = self._stream_pos[key]
                value = data[i % len(data)]
                self._stream_pos[key] = i + 1
            self.mem.write(p.tensor, np.asarray(value).reshape(p.tensor.shape))
        else:
            value = np.array(self.mem.read(p.tensor), copy=True).reshape(s.shape)
            if callable(data):
                data(value)
            else:
                i = self._stream_pos[key]
                data[i % len(data)] = value
                self._stream_pos[key] = i + 1

    def close(self) -> None:
        if self._profiler is not None:
            self._profiler.close()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _repeat(steps: list, count: int):
    def run():
        for _ in range(count):
            for step in steps:
                step()
    return run


def _copy_plan(src_mem, src: Tensor, dst_mem, dst: Tensor) -> list[tuple]:
    """The (source array, its index, destination array, its index) assignments of a copy: blocks
    of the two views of storage when both are strided (fast layout), else arenas and addresses."""
    src_view = src_mem.view(src)
    dst_view = dst_mem.output(dst)
    if src_view is not None and dst_view is not None and src_view.shape == dst_view.shape:
        return [(s, ..., d, ...) for s, d in _blocks(src_view, dst_view)]
    return [(src_mem.arena(src.dtype), _as_index(src_mem.addresses(src)),
             dst_mem.arena(dst.dtype), _as_index(dst_mem.addresses(dst)))]


def _blocks(src: np.ndarray, dst: np.ndarray, block: int = 256) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pairs of sub-views whose copies, in turn, copy `src` to `dst`: block x block tiles of the
    axes along which each is contiguous when these differ (a transposing copy, which NumPy makes
    along the destination's rows across the whole array, missing the cache on every read), else
    the whole views."""
    def fastest(a: np.ndarray) -> int | None:
        axes = [d for d in range(a.ndim) if a.shape[d] > 1 and a.strides[d] != 0]
        return min(axes, key=lambda d: abs(a.strides[d])) if axes else None

    i, j = fastest(src), fastest(dst)
    if i is None or j is None or i == j or src.shape[i] * src.shape[j] <= block * block:
        return [(src, dst)]
    pairs = []
    for a in range(0, src.shape[i], block):
        for b in range(0, src.shape[j], block):
            index = [slice(None)] * src.ndim
            index[i], index[j] = slice(a, a + block), slice(b, b + block)
            pairs.append((src[tuple(index)], dst[tuple(index)]))
    return pairs


def _as_index(addr: np.ndarray):
    """Addresses as a slice when they are one run of consecutive addresses (faster to copy, and
    nothing to keep), else the array."""
    start = run_start(addr)
    return addr if start is None else slice(start, start + addr.size)


def _copy(src: np.ndarray, src_index, dst: np.ndarray, dst_index):
    def run():
        dst[dst_index] = src[src_index]
    return run


def _variables(node: Program):
    """The variables a leaf program node reads or writes."""
    if isinstance(node, Execute):
        for table in node.compute_set.tables:
            yield from table.variables()
    elif isinstance(node, (Copy, InterIpuCopy)):
        yield node.src.var
        yield node.dst.var
    elif isinstance(node, (StreamCopy, RemoteCopy)):
        yield node.tensor.var
    elif isinstance(node, If):
        yield node.predicate.var
