"""PoplarExecutor: the object `trainingModel` / `inferenceModel` return.

Compile (once per input shape, `poptorch_lite.compiler.executable.compile_model`, or load from the
executable cache) and copy the weights to the device. A call then splits its batch into micro-batches, runs the schedule step by step
(the stage programs of one step on their IPUs, then the channel copies), and returns the
outputs shaped by the OutputMode. Every step lasts as long as its slowest IPU: the executor
records the simulated cycles of each step for the profiler.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import gc
import logging
import math
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

import ipusim as ip
from ipusim.ops import random as rnd
from ipusim.report.profile import finish_collected

from ..api import arguments, batching, phases, poptorch_core, replica_groups
from .. import _impl
from ..api.blocks import module_repr
from ..api.enums import ConnectionType
from ..api import errors
from ..api.errors import Error, UnsupportedAttributeError
from ..api.optim import Optimizer, OptimizerUpdates, hyperparameter_tensors, loss_scaling, mean_reduction_strategy
from ..api.options import Options
from ..api.printing import PrintFormat, format_tensor
from ..api.profiling import Channel
from ..compiler.executable import Executable, compile_model, estimating, target_of
from ..compiler.loss_scaling import group_ends
from ..compiler.ir import flatten_values, map_values
from ..compiler.ir_json import popart_ir
from ..compiler.lowering import program_key
from ..compiler.updates import read_ipu_state, read_state, write_hyperparameters, write_ipu_state
from . import anchors, cache, host_calls, overlap, saved, timeline
from .recompute_replay import RecomputeReplay
from .step_threads import StepThreads

logger = logging.getLogger("poptorch_lite")

NO_EXECUTABLE_ERR = "Model has not been compiled or has been destroyed."
TRACE = Channel("poptorch")   # the host tracepoints of compiled models (poptorch.profiling)
_LIVE: "weakref.WeakSet[PoplarExecutor]" = weakref.WeakSet()   # models poptorchAtExit releases

class OfflineDeviceError(Error, RuntimeError, AssertionError):
    """A model for an offline target (``useOfflineIpuTarget``) was called: it can only compile.
    (PopTorch reports it as an AssertionError, so it is one too.)"""


# The public methods and properties of PopTorch's compiled model (PopTorch's PoplarExecutor).
POPTORCH_METHODS = frozenset({
    "attachToDevice", "compile", "compileAndExport", "compilationTime", "copyNamedBuffersToDevice",
    "copyWeightsToDevice", "copyWeightsToHost", "copyWeightsToHostIfNeeded", "cycleCount", "destroy",
    "detachFromDevice", "getAnchoredTensor", "getComputeLatency", "getHostIpuLatency", "getIpuHostLatency",
    "getLatency", "getPerfCounters", "getTensorNames", "isAttachedToDevice", "isCompiled", "loadExecutable",
    "load_state_dict", "model", "options", "rng_state", "save", "setOptimizer"})


@dataclass
class Event:
    """One program run on the device during a step: which op it serves, what part, its cycles."""
    op: object                      # the schedule's op (ipusim.schedules.Op)
    part: str                       # "prefetch" | "receive" | "compute" | "outputs" | "drain" | "send" | "update"
    program: int                    # engine program index
    per_ipu: dict[int, ip.Cycles]   # busy cycles by kind on each IPU it touched


@dataclass
class StepRecord:
    """One executed step: the programs each IPU ran, their cycles, and the step's length (its
    busiest IPU: the others idle until the step ends)."""
    index: int
    ops: list
    events: list[Event]
    busy: dict[int, ip.Cycles]
    cycles: int
    overlapped: list = field(default_factory=list)  # host transfers on IO tiles during the step (overlap.py)


@dataclass
class RunRecord:
    """The simulated execution of one call on IPUs clocked at `clock_hz`."""
    clock_hz: float
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def cycles(self) -> int:
        return sum(s.cycles for s in self.steps)

    @property
    def seconds(self) -> float:
        """The call's emulated time on the IPUs."""
        return self.cycles / self.clock_hz


def _execute(engine: ip.Engine, op, runs: list[tuple[str, int]], report: bool) -> list[Event]:
    """Run the engine programs `runs` ((part, program index), in order) for `op`; their events
    when `report`."""
    if report:
        return [Event(op, part, index, engine.execute(index).per_ipu) for part, index in runs]
    for _, index in runs:
        engine.execute(index, report=False)
    return []


@contextlib.contextmanager
def collection_paused():
    """Python's cyclic garbage collector off in the body (unless it was off already), back on after.
    Compiling makes about a hundred thousand objects that live as long as the model, and lazily
    imports more of torch; each time the heap grows by a quarter the collector walks all of it
    (after importing torch, a few hundred thousand objects: 0.2 s a walk). Measured on the
    tutorial's first call: 0.22 s of collections (one full) with the collector on, 0.05 s with
    it paused; the objects made are walked later, as they age, like any others."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class PoplarExecutor:
    """A model compiled for emulated IPUs (what trainingModel / inferenceModel return): calling it
    runs the schedule on the device and returns the outputs shaped by the output mode."""

    # registerPreCompileHook / registerPostCompileHook: called, in order, around every compile
    _precompile_hooks: dict[int, Callable] = collections.OrderedDict()
    _postcompile_hooks: dict[int, Callable] = collections.OrderedDict()

    def __init__(self, model: torch.nn.Module, options: Options | None, training: bool, optimizer=None):
        options = options if options is not None else Options()
        options._freeze()  # the user's options can no longer change...
        # ...and the model keeps its own copy, with the output mode Default resolved for it (the same
        # options may serve a training and an inference model), as in PopTorch
        self._options = options.clone()
        if self._options.defaultOutputMode():
            self._options.outputMode(batching.resolve_output_mode(options, training))
        self._options._freeze()
        poptorch_core.parse_options(self._options)
        self._user_model = model
        self._training = training
        self._executable: Executable | None = None
        self._call: arguments.CallArguments | None = None  # the call the executable was compiled for
        self._is_attached = False
        self._dirty_host_weights = False
        self._host_weights_version = 0
        self.last_run: RunRecord | None = None
        self._record: RunRecord | None = None  # a call's record, the same every call (see _run_schedule)
        self._collective = None     # cross-process gradient reduction (poptorch_lite.runtime.distributed)
        self._profiler = None       # poptorch_lite.runtime.profiling, only when profiling is on
        self._threads: StepThreads | None = None  # host threads running the IPUs of a step, per executable
        self._anchors: list[anchors.Anchor] = []    # Options.anchorTensor, resolved when compiled
        self._anchored: dict[str, torch.Tensor] = {}  # the last call's anchored tensors
        self._loss_scaling_steps: set[int] = set()  # steps after which automatic loss scaling updates
        self._variable_groups: dict[str, replica_groups.VariableGrouping] = {}   # per-replica variables
        self._compilation_time: datetime.timedelta | None = None
        self._rng_state: list[int] | None = None     # set before compiling: written when the model compiles
        self._ipu_params: dict[str, torch.Tensor] = {}  # host copies of the variable hyperparameter tensors
        self._trained: dict[int, tuple[str, torch.dtype]] = {}   # see _install
        self._updates_applied = 0   # weight updates the executable ran (torch's `step` where the device keeps none)
        if training:
            if optimizer is None:
                optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            self._optimizer = optimizer
            self._optimizer_updates = OptimizerUpdates(self._options.relax_optimizer_attributes_checks)
            self._optimizer_description = self._optimizer_updates.convert(optimizer)
            self._resolve_mean_strategy()
            self._hook_optimizer_state()
            self._install_weight_sync()
        else:
            if optimizer is not None:
                raise ValueError("an inference model takes no optimizer")
            batching.check_inference_options(options)
            self._optimizer = None
            self._resolve_mean_strategy()

        _LIVE.add(self)

    def _resolve_mean_strategy(self) -> None:
        """The model's options name the mean-reduction strategy it runs with (PopTorch chooses it
        from the optimiser's accumulation type when the user did not)."""
        strategy = mean_reduction_strategy(self._options, self._optimizer, self._training)
        self._options._set_frozen(False)
        self._options.Training.setMeanAccumulationAndReplicationReductionStrategy(strategy)
        self._options._freeze()

    # ---- PopTorch's implicit weight sync -------------------------------------------------------
    def _install_weight_sync(self) -> None:
        """Reading the user's parameters, buffers or state after training copies the weights
        back from the device, once (PopTorch's implicit copyWeightsToHost)."""
        parent = weakref.ref(self)
        user_cls = type(self._user_model)

        def sync() -> bool:
            p = parent()
            if p is not None and p._dirty_host_weights:
                p._dirty_host_weights = False
                p.copyWeightsToHost()
                return True
            return False

        class SyncedModel(user_cls):
            _poptorch_user_class = user_cls  # what `destroy` restores

            def copyWeightsToHostIfNeeded(self):
                return sync()

            def destroy(self):
                """Release the training model wrapping this one (weights copied back first) and
                unwrap it, so that it can be wrapped again."""
                p = parent()
                if p is not None:
                    p.destroy()

            def __reduce_ex__(self, protocol):
                """Saved (torch.save, pickle) as the user's class, with the trained weights."""
                sync()
                return (_impl._restoreWrapperIfNecessary, (user_cls, self.__getstate__()))

            def __getattribute__(self, name):
                if name == "_poptorch_weights_version":
                    p = parent()
                    return p._host_weights_version if p is not None else 0
                if name in ("_parameters", "_buffers", "forward", "state_dict"):
                    sync()
                return object.__getattribute__(self, name)

        class SyncedParameter(torch.nn.Parameter):
            def __getattribute__(self, name):
                sync()
                return object.__getattribute__(self, name)

            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                sync()
                return super().__torch_function__(func, types, args, kwargs or {})

        class SyncedBuffer(torch.Tensor):
            def __getattribute__(self, name):
                sync()
                return object.__getattribute__(self, name)

            def __reduce_ex__(self, protocol):
                return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)  # saved as a plain tensor

            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                sync()
                return super().__torch_function__(func, types, args, kwargs or {})

        for name, cls in (("Model", SyncedModel), ("Parameter", SyncedParameter), ("Buffer", SyncedBuffer)):
            cls.__name__ = cls.__qualname__ = f"Poptorch{user_cls.__name__ if name == 'Model' else name}"
        SyncedModel._poptorch_wrappers = (SyncedParameter, SyncedBuffer)  # what rewrap_model puts back
        SyncedParameter._poptorch_user_class = torch.nn.Parameter
        SyncedBuffer._poptorch_user_class = torch.Tensor
        for p in torch.nn.Module.parameters(self._user_model):
            if type(p) is torch.nn.Parameter:
                p.__class__ = SyncedParameter
        for b in torch.nn.Module.buffers(self._user_model):
            if type(b) is torch.Tensor:
                b.__class__ = SyncedBuffer
        self._user_model.__class__ = SyncedModel
        self._wrapper_class = SyncedModel

    def _uninstall_weight_sync(self) -> None:
        """The user's model, parameters and buffers back to their own classes (`destroy`)."""
        if type(self._user_model) is self._wrapper_class:
            _restore_user_classes(self._user_model)

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped torch model."""
        return self._user_model

    @property
    def options(self) -> Options:
        """The model's options: a frozen copy of those it was given, the output mode resolved."""
        return self._options

    def _forward(self):
        """The model's forward, for its signature: reading it must not copy trained weights back."""
        return object.__getattribute__(self._user_model, "forward")

    def _named_weights(self) -> dict[str, torch.Tensor]:
        m = self._user_model
        return {**dict(torch.nn.Module.named_parameters(m)), **dict(torch.nn.Module.named_buffers(m))}

    # ---- compile ------------------------------------------------------------------------------
    def isCompiled(self) -> bool:
        """Whether the model has an executable (compiled or loaded, and not destroyed)."""
        return self._executable is not None

    def compile(self, *args, **kwargs) -> None:
        """Compile for these inputs without running (the only way with an offline target)."""
        if self._executable is None:
            self._compile_or_load(args, kwargs)

    def _micro_batch_args(self, call: arguments.CallArguments):
        """The call's arguments with every tensor cut to its first micro-batch. As in PopTorch,
        each input is split along its own leading dimension (inputs may differ in micro-batch size)."""
        plans = [batching.split_call_batch(t, self._options, self._training, input_name=name)
                 for name, t in call.tensors]
        return call.with_tensors([t.narrow(0, 0, plan.micro_batch_size) if t.dim() else t
                                  for (_, t), plan in zip(call.tensors, plans)])

    def _compile(self, call: arguments.CallArguments) -> None:
        with phases.phase("compile", model=self._kind()), \
                tqdm(total=100, desc="Graph compilation", bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total}",
                     disable=not self._options.show_compilation_progress_bar) as bar:
            margs, mkwargs = self._micro_batch_args(call)
            executable = compile_model(self._user_model, margs, mkwargs, self._options, self._training,
                                       self._optimizer if self._training else None, self._named_weights(),
                                       progress=bar.update, variable_groups=self._variable_groups)
        self._install(executable)

    def _compile_or_load(self, args, kwargs, *, lock_timeout: float = cache.LOCK_TIMEOUT) -> bool:
        """Compile (or load from the executable cache) between the registered pre- and post-compile
        hooks, timing it (`compilationTime`)."""
        for hook in list(PoplarExecutor._precompile_hooks.values()):
            hook()
        start = time.perf_counter()
        with TRACE.tracepoint("compile"):
            loaded = self._compile_or_load_paused(args, kwargs, lock_timeout=lock_timeout)
        self._compilation_time = datetime.timedelta(seconds=time.perf_counter() - start)
        for hook in list(PoplarExecutor._postcompile_hooks.values()):
            hook()
        return loaded

    @collection_paused()
    def _compile_or_load_paused(self, args, kwargs, *, lock_timeout: float = cache.LOCK_TIMEOUT) -> bool:
        """Compile for this call's inputs, or load the executable from the cache when
        ``options.cache_path`` is set and holds an entry for it; returns True when loaded.
        Python's cyclic garbage collector waits until the executable is made (`collection_paused`).

        On a miss a single-process run holds the key's lock while it compiles and stores the
        entry, so that other processes compiling the same model wait and load it instead. The
        processes of a distributed run (``numProcesses > 1``) compile without the lock: compiling
        ends with collectives between them (weight broadcast), which a process waiting for the
        lock would never join."""
        options = self._options
        if self._training and type(self._user_model) is not self._wrapper_class:  # destroyed, now used again
            check_unwrapped(self._user_model)
            self._install_weight_sync()
        path = options.cache_path
        call = arguments.bind(self._forward(), args, kwargs)
        for _, t in (*call.tensors, *self._named_weights().items()):
            check_not_zero_sized(t)
        self._check_updatable_buffers()
        self._call = call
        if path is not None and self._variable_groups:
            cache.logger.warning("Executable caching is off for a model with per-replica variables "
                                 "(replicaGrouping): the cache key does not hold their grouping")
            path = None
        if path is None:
            self._compile(call)
            return False
        start = time.perf_counter()
        margs, mkwargs = self._micro_batch_args(call)
        key = cache.cache_key(self._user_model, margs, options, target_of(options), self._training,
                              self._optimizer, mkwargs)
        seen = cache.entry_version(path, key)
        executable = cache.load(path, key)
        if executable is None:
            lock = cache.compile_lock(path, key, lock_timeout) if options.num_processes == 1 else contextlib.nullcontext()
            with lock:
                if cache.entry_version(path, key) != seen:  # another process stored it meanwhile
                    executable = cache.load(path, key)
                if executable is None:
                    # the key's capture already drew what the compiler's capture draws from torch's
                    # random generator: the generator ends as after compiling without the cache
                    with torch.random.fork_rng(devices=[]):
                        self._compile(call)
                    cache.store(path, key, self._executable)
                    return False
        self._install(executable)
        if self._training:  # the entry has the hyperparameters of the process that saved it
            self.setOptimizer(self._optimizer)
        cache.logger.info("Loaded the compiled model from the executable cache %s in %.2f s",
                          cache.entry_path(path, key), time.perf_counter() - start)
        return True

    def _install(self, executable: Executable) -> None:
        """Make a compiled (or cached) executable this model's: hooks, streams, weights."""
        opts = self._options
        self._executable = executable
        self._record = None
        self._shutdown_threads()
        self._pricing = executable.engine.mode == "estimate"   # no values: nothing to feed, read or write
        self._threads = StepThreads(1 if self._pricing else self._options.Emulator.host_threads, executable.schedule)
        self._op_plans: dict[int, tuple] = {}  # id(op) -> its feeds and programs (see _op_runs)
        self._replay = RecomputeReplay(executable)
        # which micro-batch steps the call returns: fixed by the (frozen) options, so known once
        self._output_plan = batching.output_plan(opts, self._training)
        self._returned = set(self._output_plan.returned_steps)
        if self._training and opts.num_processes > 1 and not self._pricing:
            from .distributed import GradientAllReduce
            self._collective = GradientAllReduce(self)
        if opts.profile_dir is not None:
            from .profiling import Profiler
            self._profiler = Profiler(self, opts.profile_dir)
        self._connect_streams()
        trained = set(executable.lowering.accumulators) if self._training else set()
        dtypes = {name: w.dtype for name, w in self._named_weights().items()}
        self._anchors = anchors.resolve(opts.anchored_tensors, opts, self._training, trained, dtypes,
                                        scaled=executable.updates.automatic_loss_scaling)
        self._is_attached = True
        self.copyWeightsToDevice()
        scaling = executable.updates.loss_scaling
        self._loss_scaling_steps = group_ends(executable.schedule) if executable.updates.automatic_loss_scaling \
            else set()
        if scaling is not None and not self._pricing:   # estimate mode: no device values to set
            scaling.initialise(executable.engine)
        if self._training:
            self._updates_applied = 0
            # the trained parameters by id (read once: reading them later may copy the weights back)
            self._trained = {id(p): (n, p.dtype) for n, p in self._named_weights().items()
                             if n in executable.updates.states}
            self._optimizer_updates.send(self._optimizer_description)
            self._ipu_params = self._hyperparameter_tensors(self._optimizer)
            self._on_device_attach()

    # ---- host <-> device ----------------------------------------------------------------------
    def _connect_streams(self) -> None:
        exe = self._executable
        opts = self._options
        self._input_group = [replica_groups.group_of(r, exe.replicas, opts.input_group_size, opts.input_cgt)
                             for r in range(exe.replicas)]
        self._feed: dict[tuple, int] = {}
        self._inputs: list[np.ndarray] = []
        self._outputs: dict[int, dict[tuple, np.ndarray]] = collections.defaultdict(dict)
        for r, low in enumerate(exe.lowerings):
            for key, sp in low.stage_programs.items():
                for name, index in sp.inputs:
                    exe.engine.connectStream(name, self._input_callback((r, key), index))
                for name, index in sp.output_streams:
                    exe.engine.connectStream(name, self._output_callback((r, key), index))
            for name, title, fmt in low.printed:
                exe.engine.connectStream(name, printer(title, fmt))
            host_calls.connect(exe.engine, low.host_calls)

    def _input_callback(self, key, index):
        """Replica r of micro-batch k reads sample block k * R + r (PopART's input layout); with
        input replica groups, block k * G + g, g being replica r's group of the G."""
        groups, block = self._options.input_groups, self._input_group[key[0]]

        def feed():
            return self._inputs[index][self._feed[key] * groups + block]
        return feed

    def _output_callback(self, key, index):
        def take(value):
            self._outputs[index][(self._feed[key], key[0])] = value
        return take

    def copyWeightsToDevice(self) -> None:
        """Write the model's parameters and buffers to every replica (Streaming Memory for weights
        kept off chip) and seed each IPU's random generator."""
        if self._executable is None:
            raise RuntimeError(NO_EXECUTABLE_ERR)
        self._dirty_host_weights = False
        exe = self._executable
        if self._pricing:  # estimate mode: the weights' shapes were all the compiler needed
            return
        weights = self._named_weights()
        for r, low in enumerate(exe.lowerings):
            for name, t in low.weights.items():
                value = weights[name].detach().cpu().numpy().astype(t.dtype)
                if name in self._variable_groups:   # a per-replica variable: this replica's slice
                    value = value[self._variable_groups[name].host_index(r, exe.replicas)]
                if name in low.weight_buffers:
                    exe.engine.writeRemoteBuffer(low.weight_buffers[name], value)
                else:
                    exe.engine.writeTensor(t, value)
            base = self._options.random_seed if self._options.random_seed is not None else torch.initial_seed()
            for ipu, seed in low.seeds.items():
                exe.engine.writeTensor(seed, rnd.seed_words((int(base) * 1_000_003 + ipu) % 2 ** 64))
        if self._rng_state is not None:
            self._write_rng_state(self._rng_state)

    def copyWeightsToHost(self) -> None:
        """Copy the weights from the device into the model's parameters and buffers."""
        if self._executable is None:
            raise RuntimeError(NO_EXECUTABLE_ERR)
        logger.debug("copyWeightsToHost()")
        exe = self._executable
        if self._pricing:  # estimate mode: the device holds no weights, the host's are unchanged
            return
        low = exe.lowering
        weights = self._named_weights()

        def read(lowering, name):
            return exe.engine.readRemoteBuffer(lowering.weight_buffers[name]) if name in lowering.weight_buffers \
                else exe.engine.readTensor(lowering.weights[name])

        with torch.no_grad():
            for name, t in low.weights.items():
                if name in self._variable_groups:   # a per-replica variable: each slice from its replica
                    readers = self._variable_groups[name].readers(exe.replicas)
                    value = np.stack([read(exe.lowerings[r], name) for r in readers])
                else:
                    value = read(low, name)
                weights[name].copy_(torch.from_numpy(value).to(weights[name].dtype))
        self._host_weights_version += 1

    def detachFromDevice(self) -> None:
        """Detach from the device (trained weights copied to the host first)."""
        if self._executable is None:
            raise RuntimeError(NO_EXECUTABLE_ERR)
        if not self._is_attached:
            raise RuntimeError("Device is not attached")
        if self._training:
            self.copyWeightsToHostIfNeeded()
            self._read_optim_state_dict_if_needed()
        self._is_attached = False

    def attachToDevice(self) -> None:
        """Attach to the (emulated) device again after detachFromDevice; copies the weights to it."""
        if self._executable is None:
            raise RuntimeError(NO_EXECUTABLE_ERR)
        if self._is_attached:
            raise RuntimeError("Device is already attached")
        self._is_attached = True
        self.copyWeightsToDevice()
        if self._training:
            self._on_device_attach()

    def isAttachedToDevice(self) -> bool:
        """Whether the model is attached to its (emulated) device."""
        return self._is_attached

    def copyWeightsToHostIfNeeded(self) -> bool:
        """Copy the weights to the host if a training call changed them since; True if it did."""
        if self._dirty_host_weights:
            self._dirty_host_weights = False
            self.copyWeightsToHost()
            return True
        return False

    def destroy(self) -> None:
        """Release the executable (trained weights copied to the host first) and, for a training
        model, unwrap the user's model so that it can be wrapped again; compiled again on use."""
        if self._executable is None:
            return
        if self._training:
            self.copyWeightsToHostIfNeeded()
            if not self._pricing:
                self._optimizer.state_dict()   # the optimiser state read back first, as in PopTorch
        self._executable.engine.close()
        self._shutdown_threads()
        self._executable = None
        self._is_attached = False
        if self._training:
            self._uninstall_weight_sync()

    def _kind(self) -> str:
        return "training" if self._training else "inference"

    # ---- running ------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        phases.mark("call:begin", model=self._kind())
        try:
            return self._call_device(args, kwargs)
        finally:
            phases.mark("call:end", model=self._kind())

    def _call_device(self, args, kwargs):
        """A call: compile on the first, then run the schedule and shape the outputs."""
        finish_collected()  # the profiles of models the garbage collector freed
        if self._options.connection_type == ConnectionType.Never and self._options.Emulator.mode != "estimate":
            raise OfflineDeviceError("Trying to run a model on an offline device (useOfflineIpuTarget): use "
                                     "model.compile(inputs) instead of model(inputs), or price calls without "
                                     "values with options.Emulator.setMode('estimate')")
        if self._executable is None:
            self._compile_or_load(args, kwargs)
            tensors = self._call.tensors
        else:
            tensors = self._call.match(args, kwargs, self._forward())
        if not self._is_attached:
            self.attachToDevice()
        if not self._training:
            self._sync_from_training_model()
        exe = self._executable
        if self._pricing:
            record = self._run_schedule(exe)
            self.last_run = record
            if self._profiler is not None:
                self._profiler.called(record)
            return self._shape_outputs(exe, tensors)
        if self._training:
            self._write_optim_state_dict_if_needed()
        self._inputs = self._split_inputs(tensors)
        self._outputs.clear()
        for anchor in self._anchors:
            anchor.values = []
        with TRACE.tracepoint("execute"):
            record = self._run_schedule(exe)
        self._anchored = {a.short_name: a.result() for a in self._anchors if a.values}
        self.last_run = record
        if self._profiler is not None:
            self._profiler.called(record)
        if self._training:
            micro_batches = len(self._inputs[0]) // exe.replicas if self._inputs else 0
            self._count_batch_norm_batches(micro_batches)
            self._updates_applied += micro_batches // max(1, self._options.gradient_accumulation)
            self._dirty_host_weights = True
            if isinstance(self._optimizer, Optimizer):   # the device state moved on
                self._optimizer.host_state_is_dirty = True
        return _refuse_backward(self._shape_outputs(exe, tensors))

    def _count_batch_norm_batches(self, micro_batches: int) -> None:
        """num_batches_tracked is a host-side counter (used only with momentum=None, which the
        device refuses): advance it as torch would, once per micro-batch."""
        for m in torch.nn.Module.modules(self._user_model):
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                tracked = torch.nn.Module.__getattr__(m, "num_batches_tracked")
                # a host-side update: it must not copy the trained weights back (the buffer syncs
                # on use), which would cost a device-to-host copy of every weight per call
                with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                    torch.Tensor.add_(tracked, micro_batches)

    def _sync_from_training_model(self) -> None:
        sync = getattr(self._user_model, "copyWeightsToHostIfNeeded", None)
        if callable(sync):
            sync()
            version = getattr(self._user_model, "_poptorch_weights_version", 0)
            if version != self._host_weights_version:
                self.copyWeightsToDevice()
                self._host_weights_version = version

    def _split_inputs(self, tensors: list[tuple[str, torch.Tensor]]) -> list[np.ndarray]:
        """Each input as [micro-batches of the call, *micro-batch shape] in schedule order."""
        exe = self._executable
        micro_batches = math.prod(batching.input_factors(self._options, self._training))
        out = []
        for (_, t), v in zip(tensors, exe.ir.inputs):  # shapes checked when the call was matched
            arr = t.detach().cpu().numpy().astype(v.dtype, copy=False)
            out.append(np.ascontiguousarray(arr.reshape((micro_batches,) + tuple(v.shape))))
        return out

    def _run_op(self, exe: Executable, op, report: bool = True) -> list[Event]:
        """Run one scheduled op on every replica (receive, compute, outputs; or, for a weight
        update, the gradient all-reduce, the updates and the shard all-gather); its events when
        `report`."""
        runs: list[tuple[str, int]] = []
        if op.kind == "U" and self._anchors:
            anchors.record(self._anchors, exe, op.ipu, "gradient")
        if op.kind == "U":
            if self._collective is not None:
                self._collective.reduce(exe, op.ipu)
            runs = [("update", i) for i in exe.updates.programs.get(op.ipu, [])]
        else:
            feeds, runs, _ = self._op_runs(exe, op)
            for feed in feeds:
                self._feed[feed] = op.global_micro_batch
        replay = self._replay
        if not report and replay.replaces(op):   # a recorded call: the recomputation's values from its forward
            events = _execute(exe.engine, op, replay.runs_without_compute(op, runs), report)
            replay.write(op)
            return events
        events = _execute(exe.engine, op, runs, report)
        if op.kind == "F":
            replay.after_forward(op)
        elif op.kind == "R":
            replay.ran(op)
        elif op.kind == "U" and self._anchors:
            anchors.record(self._anchors, exe, op.ipu, "updated")
        return events

    def _op_runs(self, exe: Executable, op) -> tuple[list[tuple], list[tuple[str, int]], list[tuple[str, int]]]:
        """The inputs a compute op feeds ((replica, program key), given its micro-batch), the
        programs it runs (receive, compute, outputs) and those that send its results on: fixed
        by the schedule and the options, so made on the op's first run."""
        plan = self._op_plans.get(id(op))  # (the schedule keeps its ops alive)
        if plan is None:
            key, k = program_key(op), op.global_micro_batch
            feeds, runs = [], []
            for r, low in enumerate(exe.lowerings):
                sp = low.stage_programs.get(key)
                if sp is None:
                    continue
                feeds.append((r, key))
                runs += [("prefetch", index) for _, index in sp.prefetch]
                runs += [("receive", ch.recv[k % ch.slots]) for ch in exe.in_channels[(r, key)] if ch.recv]
                runs.append(("compute", sp.body))
                if sp.outputs >= 0 and self._wants_output(k):
                    runs.append(("outputs", sp.outputs))
                    runs += [("drain", index) for _, index in sp.drain]
            sends = [("send", ch.send[k % ch.slots]) for r in range(exe.replicas) for ch in exe.out_channels[(r, key)]]
            plan = self._op_plans[id(op)] = (feeds, runs, sends)
        return plan

    def _debugGetPopartIR(self) -> str:
        """The compiled graph as JSON, in the layout of PopTorch's (PopART's IR): {"maingraph": [ops]}."""
        if self._executable is None:
            raise RuntimeError(NO_EXECUTABLE_ERR)
        exe = self._executable
        if not self._training:
            return popart_ir(exe.ir)
        return popart_ir(exe.ir, exe.updates, exe.lowering.weights)

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The tensor anchored as `short_name` (Options.anchorTensor) by the last call."""
        if short_name not in self._anchored:
            known = ", ".join(repr(a.short_name) for a in self._anchors) or "none"
            when = "" if self._anchored else "; run the model first"
            raise Error(f"getAnchoredTensor: no tensor anchored as {short_name!r} (anchored: {known}{when})")
        return self._anchored[short_name]

    def _send(self, exe: Executable, op, report: bool = True) -> list[Event]:
        if op.kind == "U":
            return []
        return _execute(exe.engine, op, self._op_runs(exe, op)[2], report)

    def _run_schedule(self, exe: Executable) -> RunRecord:
        """Each step: every IPU runs its op (on host threads, see step_threads; an IPU that
        recomputes runs its R and then its B), then the channel copies; the step lasts as long
        as its busiest IPU. The programs, their order and their
        cycles are fixed when the model is compiled, so the record of a call is the same on every
        call: the first call makes it, the others reuse it (unless a program branches on device
        data or a profiler wants each call's reports)."""
        reuse = self._record is not None
        record = None if reuse else RunRecord(exe.engine.target.clock_hz)
        threads = self._threads.for_call()
        team = self._threads.team(threads)
        start = time.perf_counter()
        with exe.engine.running(threads):  # one setting of the kernel and BLAS threads for the whole call
            for t, step in enumerate(exe.schedule.steps):
                per_ipu = step.by_ipu()
                if team is not None and len(per_ipu) > 1:
                    parts = team.map(lambda ops: [e for op in ops for e in self._run_op(exe, op, not reuse)], per_ipu)
                else:
                    parts = [self._run_op(exe, op, not reuse) for op in step.ops]
                sends = [self._send(exe, op, not reuse) for op in step.ops]
                if t in self._loss_scaling_steps:  # automatic loss scaling, after the group's weight update
                    op = next(op for op in step.ops if op.kind == "U")
                    sends.append(_execute(exe.engine, op, [("update", exe.updates.loss_scaling.program)], not reuse))
                if reuse:
                    continue
                events = [e for part in parts + sends for e in part]
                busy: dict[int, ip.Cycles] = {}
                for e in events:
                    for ipu, c in e.per_ipu.items():
                        busy[ipu] = busy.get(ipu, ip.Cycles()) + c
                record.steps.append(StepRecord(t, list(step.ops), events, busy,
                                               max((c.total for c in busy.values()), default=0)))
        self._threads.ran(threads, time.perf_counter() - start)
        if reuse:
            return self._record
        self._replay.checked()
        overlap.hide_host_io(record, overlap.overlap_modes(exe), self._training)
        if self._profiler is None and exe.engine.fixed_reports:
            self._record = record
        return record

    def _shutdown_threads(self) -> None:
        if self._threads is not None:
            self._threads.shutdown()

    def _step_of(self, k: int) -> tuple[int, int]:
        """(device iteration, accumulation step) of the call's k-th micro-batch."""
        g = self._options.gradient_accumulation if self._training else 1
        return k // g, k % g

    def _wants_output(self, k: int) -> bool:
        return self._step_of(k) in self._returned

    def _shape_outputs(self, exe: Executable, tensors: list[tuple[str, torch.Tensor]]):
        """The model's outputs as the call returns them; the inputs the model changed in place
        get their new values (PopTorch copies them into the caller's tensors)."""
        plan = self._output_plan
        if self._pricing:  # estimate mode: the outputs' shapes and dtypes, as meta tensors
            return map_values(exe.ir.outputs, lambda v: torch.empty(plan.output_shape(tuple(v.shape)),
                                                                     dtype=torch_dtype(v.host_dtype or v.dtype),
                                                                     device="meta"),
                              rebuild=True)
        results = {}
        inputs = {v.id: i for i, v in enumerate(exe.ir.inputs)}
        for i, v in enumerate(exe.ir.returned()):
            if v.id in inputs:
                # An output that is a model input (or an op that reduces to one, such as dropout
                # in inference) is the input's micro-batch as the device received it.
                data, groups = self._inputs[inputs[v.id]], self._options.input_groups
                got = {(k, r): data[k * groups + self._input_group[r]]
                       for k in range(len(data) // groups) for r in range(exe.replicas)}
            elif v.kind == "const":  # a tensor made in forward and returned as it is
                micro_batches = math.prod(batching.batch_factors(self._options, self._training)) // exe.replicas
                got = {(k, r): v.data for k in range(micro_batches) for r in range(exe.replicas)}
            else:
                got = self._outputs.get(i, {})
            per_step = {(*self._step_of(k), r): torch.from_numpy(np.array(a)).to(torch_dtype(v.host_dtype or v.dtype))
                        for (k, r), a in got.items()}
            missing = [st for st in plan.returned_steps if (*st, 0) not in per_step]
            if missing:
                raise RuntimeError(f"output {i} of micro-batch steps {missing} was not produced by the device")
            results[v.id] = plan.gather(per_step)
        for index, v in exe.ir.input_updates:
            name, tensor = tensors[index]
            new = results[v.id]
            if new.shape != tensor.shape:
                raise Error(f"the model changes its input {name} in place, and its new value comes back from the "
                            f"device with shape {list(new.shape)} (output mode {self._options.output_mode.name}), "
                            f"not the input's {list(tensor.shape)}: use outputMode(poptorch.OutputMode.All), or "
                            "change a copy of the input")
            with torch.no_grad():
                tensor.copy_(new)
        return map_values(exe.ir.outputs, lambda v: results[v.id], rebuild=True)

    def estimate(self):
        """What the last call cost and what the model needs, per IPU (fits, memory by kind, bubble)
        and per call (cycles, samples per second): a `runtime.estimate.Estimate`; print its
        `text()`. In estimate mode (Options.Emulator.setMode("estimate")) a call prices the model
        without values."""
        from .estimate import summary
        return summary(self)

    # ---- optimiser ----------------------------------------------------------------------------
    def setOptimizer(self, optimizer) -> None:
        """Use `optimizer`'s hyperparameters (learning rates, ...) from the next call on. A new
        poptorch.optim optimiser holding device state (`load_state_dict`) has it written to the
        device; the one it replaces keeps the state it had read back."""
        if not self._training:
            raise RuntimeError("setOptimizer is only valid on a training model")
        if self._executable is not None:   # the strategy is compiled in: refused if the optimiser needs another
            mean_reduction_strategy(self._options, optimizer, True, compiled=True)
        if self._executable is not None and optimizer is not self._optimizer:
            old = self._optimizer
            if isinstance(old, Optimizer):
                self._read_optim_state_dict_if_needed()
                old.state_dict = old.get_state_dict   # no longer reads this model's device
            if isinstance(optimizer, Optimizer):
                optimizer.ipu_state_is_dirty = True
        description = self._optimizer_updates.convert(optimizer)
        changed = description != self._optimizer_description or optimizer is not self._optimizer
        self._optimizer_description = description
        if self._executable is not None:
            self._optimizer_updates.send(self._optimizer_description)
        if self._executable is not None and not self._pricing:
            exe = self._executable
            write_hyperparameters(exe.engine, exe.updates, optimizer, self._options, exe.replicas)
            if exe.updates.loss_scaling is not None:
                exe.updates.loss_scaling.new_optimizer(exe.engine, exe.updates.configs, loss_scaling(optimizer))
        self._optimizer = optimizer
        if self._executable is None:   # not compiled: the optimiser may still choose the strategy
            self._resolve_mean_strategy()
        self._hook_optimizer_state()
        if self._executable is not None and changed:
            self._ipu_params = self._hyperparameter_tensors(optimizer)
        if self._executable is not None and self._is_attached:
            self._write_optim_state_dict_if_needed()

    def _hook_optimizer_state(self) -> None:
        """`optimizer.state_dict()` reads the optimiser state from the device first (a
        poptorch.optim optimiser: when the device ran since the last read)."""
        optimizer = self._optimizer
        parent = weakref.ref(self)
        original = type(optimizer).state_dict

        def state_dict(opt_self):
            p = parent()
            if isinstance(opt_self, Optimizer):
                if p is not None:
                    p._read_optim_state_dict_if_needed()
                return opt_self.get_state_dict()
            if p is not None and p._executable is not None:
                read_state(p._executable.engine, p._executable.updates, opt_self, p._named_weights(),
                           p._updates_applied)
            out = original(opt_self)
            if p is not None and p._executable is not None and p._executable.updates.automatic_loss_scaling:
                out["ipu_state"] = p._executable.updates.loss_scaling.ipu_state(p._executable.engine)
            return out

        optimizer.state_dict = state_dict.__get__(optimizer)

    def _hyperparameter_tensors(self, optimizer) -> dict:
        if not isinstance(optimizer, Optimizer):
            return {}
        return hyperparameter_tensors(optimizer, self._trained, self._executable.replicas)

    def _device_holds_state(self) -> bool:
        """Whether the device has optimiser state to read or write (not an offline target, not
        estimate mode)."""
        return self._executable is not None and not self._pricing and \
            self._options.connection_type != ConnectionType.Never

    def _on_device_attach(self) -> None:
        """Attached (or compiled): a poptorch.optim optimiser holding state writes it to the
        device; otherwise the device's state is the one to read."""
        optimizer = self._optimizer
        if not isinstance(optimizer, Optimizer) or not self._device_holds_state():
            return
        if optimizer.has_state():
            optimizer.ipu_state_is_dirty = True
            self._write_optim_state_dict_if_needed()
        else:
            optimizer.host_state_is_dirty = True
            optimizer.ipu_state_is_dirty = False

    def _read_optim_state_dict_if_needed(self) -> None:
        """The device's optimiser state into the poptorch.optim optimiser's state dict, when the
        device ran since the host last read it."""
        optimizer = self._optimizer
        if not isinstance(optimizer, Optimizer):
            return
        if not optimizer.host_state_is_dirty:
            logger.debug("Using cached optimiser state dict")
            return
        if self._executable is None:
            raise RuntimeError(NO_EXECUTABLE_ERR)
        logger.info("Writing optimiser state tensors from IPU to host.")
        exe = self._executable
        weights = self._named_weights()
        read_state(exe.engine, exe.updates, optimizer, weights, self._updates_applied)    # torch's layout too
        ipu_state = read_ipu_state(exe.engine, exe.updates, optimizer, weights)
        if exe.updates.automatic_loss_scaling:
            ipu_state.update(exe.updates.loss_scaling.ipu_state(exe.engine))
        optimizer.set_state_dict({"ipu_state": ipu_state, "ipu_param": {k: v.clone() for k, v in
                                                                         self._ipu_params.items()},
                                  **torch.optim.Optimizer.state_dict(optimizer)})
        optimizer.ipu_state_is_dirty = False

    def _write_optim_state_dict_if_needed(self) -> None:
        """The optimiser state the host holds (loaded into a poptorch.optim optimiser) to the
        device, the weights copied to the host first (the device state is written whole)."""
        optimizer = self._optimizer
        if not isinstance(optimizer, Optimizer) or not optimizer.ipu_state_is_dirty:
            return
        if self._executable is None:
            raise RuntimeError(NO_EXECUTABLE_ERR)
        if optimizer.has_state() and self._device_holds_state():
            self.copyWeightsToHostIfNeeded()
            logger.info("Writing optimiser state tensors from host to IPU memory.")
            state = optimizer.get_state_dict()
            exe = self._executable
            ipu_state = dict(state["ipu_state"])
            factor = ipu_state.pop("lossScaleUpdateFactor", None)
            if factor is not None and exe.updates.automatic_loss_scaling:
                exe.updates.loss_scaling.set_update_factor(exe.engine, float(factor), exe.updates.configs,
                                                           loss_scaling(optimizer))
            unknown = write_ipu_state(exe.engine, exe.updates, optimizer, ipu_state, self._named_weights())
            if unknown:
                logger.warning("writeOptimizerState: ignoring state %s, which this model does not have", unknown)
            missing = [k for k in self._ipu_params if k not in state["ipu_param"]]
            if missing:
                logger.warning("writeOptimizerState: ignoring missing parameter(s) %s", missing)
            for k, v in state["ipu_param"].items():
                if k in self._ipu_params:
                    self._ipu_params[k] = torch.as_tensor(v).detach().clone().to(self._ipu_params[k].dtype)
                else:
                    logger.warning("writeOptimizerState: ignoring parameter %s, which this model does not have", k)
        optimizer.ipu_state_is_dirty = False

    # ---- what the run record and the device tell ---------------------------------------------
    def cycleCount(self) -> int:
        """The emulated cycles of the last call (its busiest IPU, step by step; replica 0's view:
        replicas run in lockstep). Needs ``Options.logCycleCount(True)``, as in PopTorch."""
        if not self._options._Popart.get("instrumentWithHardwareCycleCounter"):
            raise errors.make("Cycle count logging is disabled. Please set option logCycleCount to True to enable.")
        if self._executable is None or self.last_run is None:
            raise errors.make("Please run the model at least once before obtaining cycle count.")
        return int(self.last_run.cycles)

    def getPerfCounters(self) -> dict:
        """When each input was requested (``input``) and on the device (``input_complete``) and each
        output sent (``output``) and on the host (``output_complete``) in the last call: per input
        or output index, one time in seconds per micro-batch and replica (runtime/timeline.py)."""
        if self._executable is None or self.last_run is None:
            return timeline.empty()
        outputs = len(self._executable.ir.returned())
        return timeline.perf_counters(self.last_run, self._executable, outputs)

    def getHostIpuLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) seconds from the first input requested to the last on the device."""
        return timeline.latency(self.getPerfCounters(), "input", min, "input_complete", max)

    def getComputeLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) seconds from the last input on the device to the last output sent."""
        return timeline.latency(self.getPerfCounters(), "input_complete", max, "output", max)

    def getIpuHostLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) seconds from the first output sent to the last on the host."""
        return timeline.latency(self.getPerfCounters(), "output", min, "output_complete", max)

    def getLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) round trip: first input requested to last output on the host."""
        return timeline.latency(self.getPerfCounters(), "input", min, "output_complete", max)

    def getTensorNames(self) -> list[str]:
        """The device tensors ``Options.anchorTensor`` can return for this compiled model: each
        trained parameter's ``Gradient___<name>`` and ``UpdatedVar___<name>``."""
        if self._executable is None:
            raise AssertionError("Model must be compiled before calling getTensorNames")  # PopTorch asserts
        trained = set(self._executable.lowering.accumulators) if self._training else set()
        return anchors.names(trained)

    def compilationTime(self) -> datetime.timedelta:
        """How long compiling (or loading from the executable cache) took."""
        if self._executable is None or self._compilation_time is None:
            raise errors.make("Please compile the model before obtaining compilation time.")
        if not self._options.show_compilation_progress_bar:
            raise errors.make("Please set showCompilationProgressBar option to obtain compilation time.")
        return self._compilation_time

    @property
    def rng_state(self) -> list[int]:
        """The device's random generator state: the base seed, then each replica's per-IPU seeds
        (64-bit) as the model's random ops will next use them."""
        if self._executable is None:
            raise errors.make(NO_EXECUTABLE_ERR)
        exe = self._executable
        base = self._options.random_seed if self._options.random_seed is not None else torch.initial_seed()
        words = []
        for low in exe.lowerings:
            for ipu in sorted(low.seeds):
                low_word, high_word = (int(w) for w in exe.engine.readTensor(low.seeds[ipu]))
                words.append(low_word | high_word << 32)
        return [int(base)] + words

    @rng_state.setter
    def rng_state(self, state: list[int]) -> None:
        if self._executable is None:
            raise errors.make(NO_EXECUTABLE_ERR)
        self._write_rng_state(list(state))
        self._rng_state = list(state)

    def _write_rng_state(self, state: list[int]) -> None:
        exe = self._executable
        seeds = [(low, ipu) for low in exe.lowerings for ipu in sorted(low.seeds)]
        if len(state) != 1 + len(seeds) or not all(isinstance(v, int) and 0 <= v < 2 ** 64 for v in state):
            raise errors.make(f"rng_state: this model's state is {1 + len(seeds)} integers in [0, 2**64) (the "
                              f"base seed and {len(seeds)} device seeds, as rng_state returns), got {state!r}")
        for (low, ipu), value in zip(seeds, state[1:]):
            exe.engine.writeTensor(low.seeds[ipu], rnd.seed_words(value))

    def _check_updatable_buffers(self) -> dict[str, torch.Tensor]:
        """The model's buffers; every name in ``Options.updatableNamedBuffers`` must be one of them
        (checked when the model is compiled, as PopTorch does, and when they are copied)."""
        buffers = dict(torch.nn.Module.named_buffers(self._user_model))
        missing = [n for n in self._options._Popart.get("updatableNamedBuffers") or () if n not in buffers]
        if missing:
            raise errors.make(f"updatableNamedBuffers names {missing}, which the model does not have as buffers "
                              f"(its buffers: {sorted(buffers)})")
        return buffers

    def copyNamedBuffersToDevice(self) -> None:
        """Write the buffers named by ``Options.updatableNamedBuffers`` (only those) to every
        replica, for example after changing them on the host."""
        if self._executable is None:
            raise errors.make(NO_EXECUTABLE_ERR)
        names = self._options._Popart.get("updatableNamedBuffers")
        if not names:
            raise errors.make("No named buffers marked as updatable via updatableNamedBuffers option")
        buffers = self._check_updatable_buffers()
        exe = self._executable
        for low in exe.lowerings:
            for name in names:
                t = low.weights.get(name)
                if t is None:
                    continue   # a buffer the compiled program does not use
                value = buffers[name].detach().cpu().numpy().astype(t.dtype)
                if name in low.weight_buffers:
                    exe.engine.writeRemoteBuffer(low.weight_buffers[name], value)
                else:
                    exe.engine.writeTensor(t, value)

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """``load_state_dict`` of the wrapped model, then the weights copied to the device."""
        out = self._user_model.load_state_dict(state_dict, strict)
        if self._executable is not None and self._is_attached:
            self.copyWeightsToDevice()
        return out

    # ---- a compiled model in a file ------------------------------------------------------------
    def compileAndExport(self, filename: str, *args, export_model: bool = True, **kwargs) -> None:
        """Compile for these inputs (unless compiled) and save the model to `filename`
        (``poptorch.load`` reads it back; runtime/saved.py)."""
        self.compile(*args, **kwargs)
        self.save(filename, export_model)

    def save(self, filename: str, export_model: bool = True, save_rng_state: bool = True) -> None:
        """Save the compiled model: its executable, options and the call it was compiled for; with
        `export_model` also the torch model and its optimiser (``poptorch.load`` restores them);
        with `save_rng_state` the device's random generator state."""
        if self._executable is None:
            raise errors.make(NO_EXECUTABLE_ERR)
        if os.path.isdir(filename):
            directory, filename = filename, os.path.join(filename, "model.poptorch")
            cache.logger.warning("save(): %s is a directory, saving the model to %s", directory, filename)
        if self._training:
            self.copyWeightsToHostIfNeeded()
        data = saved.SavedModel(self._training, self._options, self._call.with_tensors([t for _, t in self._call.tensors]))
        if export_model:
            data.model = self._user_model
            if self._training:
                data.optimizer = self._optimizer
                data.optimizer_state = self._optimizer.state_dict()
        if save_rng_state:
            data.rng_state = self.rng_state
        saved.write(filename, data, self._executable)

    def loadExecutable(self, filename: str) -> None:
        """Use the executable saved in `filename` (by compileAndExport or save) instead of compiling;
        the file's model must be this one's (same inputs, options and software)."""
        data, executable = saved.read(filename)
        if data.training != self._training:
            raise errors.make(f"{filename} holds a {'training' if data.training else 'inference'} model; this is a "
                              f"{'training' if self._training else 'inference'} model")
        self._call = arguments.bind(self._forward(), *data.call)
        self._install(executable)
        if self._training:
            self.setOptimizer(self._optimizer)
        if data.rng_state is not None:
            self.rng_state = data.rng_state

    def __getattr__(self, name: str):
        """Attributes the executor does not have are the wrapped model's (`poptorch_model.linear`),
        as in PopTorch; reading a trained weight copies the weights back from the device first. A
        method of PopTorch's compiled model that this one lacks is an UnsupportedAttributeError
        naming it (not an AttributeError about the user's model)."""
        if name.startswith("__") or name == "_user_model":
            raise AttributeError(name)
        if name in POPTORCH_METHODS:
            raise UnsupportedAttributeError(
                f"PoplarExecutor.{name} (PopTorch's compiled model) is not supported by poptorch_lite (PopTorch's "
                f"API on emulated IPUs). help(poptorch_lite.PoplarExecutor) lists what the compiled model provides.",
                name=name, obj=self)
        value = getattr(self._user_model, name)
        if isinstance(value, torch.nn.Parameter):   # PopTorch's per-replica variables: W.replicaGrouping(...)
            full = next(n for n, p in torch.nn.Module.named_parameters(self._user_model) if p is value)
            object.__setattr__(value, "replicaGrouping",
                               lambda kind, shards, mode: self._group_variable(full, kind, shards, mode))
        return value

    def _group_variable(self, name: str, kind, shards: int, mode) -> None:
        """Make parameter `name` a per-replica variable: replicas of one group (`kind`, groups of
        `shards`) share a value and sum their gradients; the host keeps one value per group
        (`OnePerGroup`) or per replica (`AllReplicas`) along the parameter's first dimension."""
        from ..api.enums import CommGroupType, VariableRetrievalMode
        if self._executable is not None:
            raise Error(f"{name}.replicaGrouping: the model is already compiled; group variables before the first "
                        "call (or compile())")
        if not isinstance(kind, CommGroupType) or not isinstance(mode, VariableRetrievalMode):
            raise Error(f"{name}.replicaGrouping expects (CommGroupType, int, VariableRetrievalMode), got "
                        f"({kind!r}, {shards!r}, {mode!r})")
        if kind == CommGroupType.All:
            self._variable_groups.pop(name, None)
            return
        grouping = replica_groups.VariableGrouping(kind, int(shards), mode)
        grouping.check(name, tuple(dict(torch.nn.Module.named_parameters(self._user_model))[name].shape),
                       self._options.replication_factor)
        self._variable_groups[name] = grouping

    def __repr__(self):
        return module_repr(self._user_model)


def unwrap_model(model: torch.nn.Module) -> None:
    """PopTorch's `_impl.unwrapModelIfNecessary`: a model wrapped for weight sync (and its
    parameters and buffers) gets back its own classes, with the trained weights copied to the
    host first; nothing happens to a model that is not wrapped. `rewrap_model` undoes it."""
    if not is_wrapped(model):
        return
    model.copyWeightsToHostIfNeeded()
    model.__dict__["_poptorch_unwrapped"] = type(model)
    _restore_user_classes(model)


def _restore_user_classes(model: torch.nn.Module) -> None:
    """A wrapped model, its parameters and buffers back to their own classes."""
    for t in (*torch.nn.Module.parameters(model), *torch.nn.Module.buffers(model)):
        if is_wrapped(t):
            t.__class__ = type(t)._poptorch_user_class
    model.__class__ = type(model)._poptorch_user_class


def rewrap_model(model: torch.nn.Module) -> None:
    """PopTorch's `_impl.rewrapModelIfNecessary`: the wrapping `unwrap_model` took off, put back."""
    synced = model.__dict__.pop("_poptorch_unwrapped", None)
    if synced is None:
        return
    parameter_cls, buffer_cls = synced._poptorch_wrappers
    for p in torch.nn.Module.parameters(model):
        if type(p) is torch.nn.Parameter:
            p.__class__ = parameter_cls
    for b in torch.nn.Module.buffers(model):
        if type(b) is torch.Tensor:
            b.__class__ = buffer_cls
    model.__class__ = synced


def _backward_error():
    raise errors.make("backward() cannot be called explicitly on outputs of a PopTorch model. If you're using a "
                      "trainingModel, the backwards pass is performed automatically when invoking the model. If "
                      "you're using an inferenceModel, you should use a trainingModel instead.")


def _refuse_backward(outputs):
    """The outputs, each tensor's backward() an error: the device ran the backward pass already."""
    for t in flatten_values(outputs, torch.Tensor):
        t.backward = _backward_error
    return outputs


def printer(title: str, fmt: PrintFormat):
    """The host end of an ipu_print_tensor stream: writes `title: tensor` to stderr."""
    def write(value):
        print(f"{title}: {format_tensor(value, fmt)}", file=sys.stderr, flush=True)
    return write


def torch_dtype(dtype) -> torch.dtype:
    return {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
            np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool, np.dtype(np.int8): torch.int8,
            np.dtype(np.uint8): torch.uint8, np.dtype(np.int16): torch.int16}[np.dtype(dtype)]


def check_not_zero_sized(t: torch.Tensor) -> None:
    """An input, parameter or buffer with a dimension of size 0 has no place on the device (PopTorch's
    error)."""
    if 0 in t.shape:
        raise errors.make(f"Zero-sized tensors are unsupported (Got shape [{', '.join(map(str, t.shape))}]).")


def is_wrapped(obj) -> bool:
    """Whether `obj` (a module, parameter or buffer) is wrapped by a training model."""
    return getattr(type(obj), "_poptorch_user_class", None) is not None


def check_unwrapped(model: torch.nn.Module) -> None:
    """A model can be wrapped for training by one training model at a time (PopTorch's rule)."""
    if is_wrapped(model):
        raise RuntimeError("Model has already been wrapped in 'poptorch.trainingModel'. Call model.destroy() on the "
                           "model to unwrap before wrapping again.")


def trainingModel(model: torch.nn.Module, options: Options | None = None, optimizer=None) -> PoplarExecutor:
    """Wrap `model` for training on emulated IPUs: each call runs forward, backward and the
    optimiser's update on the device (default optimizer: SGD, lr 0.01). `model` may be a
    PoplarExecutor: its torch model is wrapped. A model is wrapped by one training model at a
    time: ``model.destroy()`` unwraps it."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    check_unwrapped(model)
    return PoplarExecutor(model, options, True, optimizer)


def inferenceModel(model: torch.nn.Module, options: Options | None = None) -> PoplarExecutor:
    """Wrap `model` for inference on emulated IPUs: each call runs its forward on the device.
    `model` may be a PoplarExecutor: its torch model is used."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    return PoplarExecutor(model, options, False)




def load(filename: str, edit_opts_fn: Callable[[Options], None] | None = None) -> PoplarExecutor:
    """The compiled model saved in `filename` by ``compileAndExport`` or ``save`` (with
    ``export_model``): the torch model, its optimiser and options, the executable (not compiled
    again) and the device's random state. `edit_opts_fn` may change the options first."""
    data, executable = saved.read(filename)
    if data.model is None:
        raise errors.make(f"{filename} was saved with export_model=False: make the model with "
                          f"poptorch.inferenceModel / trainingModel, then call model.loadExecutable({filename!r})")
    options = data.options.clone()
    if edit_opts_fn is not None:
        edit_opts_fn(options)
    if data.training:
        optimizer = data.optimizer
        if optimizer is not None and data.optimizer_state is not None:
            optimizer.load_state_dict(data.optimizer_state)
        model = trainingModel(data.model, options, optimizer)
    else:
        model = inferenceModel(data.model, options)
    model._call = arguments.bind(model._forward(), *data.call)
    model._install(executable)
    if data.training:
        model.setOptimizer(model._optimizer)
    if data.rng_state is not None:
        model.rng_state = data.rng_state
    return model


def _register_hook(hooks: dict, hook: Callable, when: str) -> torch.utils.hooks.RemovableHandle:
    if not callable(hook):
        raise RuntimeError(f"{when}-compile hook must be callable, got {hook!r}")
    handle = torch.utils.hooks.RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def registerPreCompileHook(hook: Callable[[], None]) -> torch.utils.hooks.RemovableHandle:
    """Call `hook()` before every model compiles (or loads from the executable cache), after the
    hooks registered before it; ``handle.remove()`` unregisters it."""
    return _register_hook(PoplarExecutor._precompile_hooks, hook, "Pre")


def registerPostCompileHook(hook: Callable[[], None]) -> torch.utils.hooks.RemovableHandle:
    """Call `hook()` after every model compiles (or loads from the executable cache)."""
    return _register_hook(PoplarExecutor._postcompile_hooks, hook, "Post")


@atexit.register
def poptorchAtExit() -> None:  # pylint: disable=invalid-name
    """Release what compiled models still hold (PopTorch: the devices): each is destroyed (trained
    weights copied back to the host, engines closed, profiles finished). Runs at exit."""
    for model in list(_LIVE):
        model.destroy()
    finish_collected()
