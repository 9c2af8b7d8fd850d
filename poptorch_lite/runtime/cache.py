"""Executable cache: PopTorch's ``Options.enableExecutableCaching(path)``.

A compiled model is saved as ``<path>/<key>.ipusim`` and a later process that compiles the same
model for the same inputs, options and target loads it instead of compiling. poprun's
``--executable-cache-path`` sets ``POPTORCH_CACHE_DIR``, which enables caching in every
``Options``; the instances of a run share the directory and only one compiles (below).

Key (:func:`cache_key`): the SHA-256 of :func:`key_contents`, everything that shapes the
compiled program: the captured graph (the code of the joint ATen graph, with every op's
arguments; block, pass and result shape of every node; constant tensors), parameter and buffer names, shapes, dtypes and
``requires_grad`` (not their values: weights are copied to the device after loading, as after a
compile), input shapes and dtypes, the options except host-side ones (:data:`HOST_OPTIONS`), the
target's fields, the optimiser's type, parameter groups and structure (state layout, state
dtype, loss scaling; learning rates and other hyperparameters live in device tensors and are
written after loading), and the software: this package's version and a digest of its sources,
Python, NumPy, Numba and PyTorch versions.

Entry: a magic line, a JSON header line (format version, key, payload size and SHA-256) and the
payload, the pickled ``Executable`` without host-side state (the engine's memory and address
plans, connected streams, thread pools; ``engine.load()`` re-creates them). Entries are written
to a temporary file in the same directory, synced to disk and renamed, so readers never see a
partial entry, after an interrupt or a system crash alike; an interrupted writer (Ctrl-C) removes
its temporary file, and one killed outright leaves a hidden ``.<key>.*.tmp`` that is never read
(the checksum catches damage done to an entry afterwards). A missing, truncated,
corrupt, stale or unreadable entry makes :func:`load` return None (the reason is logged at
info level) and the model is compiled again and the entry rewritten. Entries are pickles: point
the cache only at directories you trust, as you would for any executable.

Serialisation uses the cloudpickle vendored in Numba (a dependency already): op programs hold
closures (each ``OpProgram.fast``), which the standard pickle cannot save. Codelets, vertex
types and other module-level objects are saved by reference (their import path), so a loaded
program runs the same Numba dispatchers and hits Numba's own on-disk cache. Compute sets are
tables of arrays and pickle as they are; integer arrays (tile mappings, element indices, bytes
per tile, vertex columns) are saved as runs of equal or consecutive values when that is much
smaller.

Concurrency: a process that misses takes an exclusive lock on ``<key>.lock`` (``flock``) while
it compiles; processes compiling the same model wait for it and then load its entry. The lock
dies with its process; after ``lock_timeout`` seconds a waiting process compiles anyway. Writers
never corrupt each other's entries either way (each writes its own temporary file).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import importlib
import io
import json
import logging
import os
import pickle
import platform
import sys
import threading
import time
import uuid
from pathlib import Path

import numba
import numpy as np
import torch
from numba.cloudpickle import cloudpickle
from numba.core.dispatcher import Dispatcher

import ipusim as ip
from ipusim.ops import optim as device_optim

from ..compiler.aten import decompositions
from ..compiler.export import JointGraph, annotation_of, capture_joint, pass_of
from ..compiler.executable import Executable
from ..api.optim import accumulator_dtype, loss_scaling
from ..compiler.updates import device_config, max_grad_norm

try:
    import fcntl
except ImportError:  # no advisory locks (Windows): concurrent processes may each compile
    fcntl = None

logger = logging.getLogger("poptorch_lite")

FORMAT_VERSION = 1
MAGIC = b"poptorch_lite executable\n"
SUFFIX = ".ipusim"
MAX_HEADER_BYTES = 1 << 16
LOCK_TIMEOUT = 3600.0

# Options that only change what the host does, never the compiled program.
# (The random seed is written to the device with the weights, after compiling or loading.)
HOST_OPTIONS = ("log_dir", "show_compilation_progress_bar", "relax_optimizer_attributes_checks",
                "connection_type", "ipu_id", "model_name", "random_seed")


# ---- key ------------------------------------------------------------------------------------------
def cache_key(model: torch.nn.Module, example_args, options, target: ip.Target, training: bool,
              optimizer=None, example_kwargs: dict | None = None) -> str:
    """The cache key of `model` compiled for these micro-batch inputs (hex SHA-256). Like the
    compiler, it captures the model (on fake tensors: the model's weights and buffers are left as
    they are)."""
    contents = key_contents(model, example_args, options, target, training, optimizer, example_kwargs)
    text = json.dumps(contents, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def key_contents(model: torch.nn.Module, example_args, options, target: ip.Target, training: bool,
                 optimizer=None, example_kwargs: dict | None = None) -> dict:
    """Everything the key hashes, as plain data (compare two of them to see why a key changed)."""
    if training and optimizer is None:
        raise ValueError("key_contents: a training model's key depends on its optimizer; pass optimizer=")
    example_kwargs = example_kwargs or {}
    weights = {**dict(torch.nn.Module.named_parameters(model)), **dict(torch.nn.Module.named_buffers(model))}
    return {
        "format": FORMAT_VERSION,
        "software": software_versions(),
        "training": bool(training),
        "graph": graph_description(traced(model, training, example_args, example_kwargs, options)),
        "weights": {name: [list(w.shape), str(w.dtype), bool(w.requires_grad)] for name, w in weights.items()},
        "inputs": {"args": [_describe_input(a) for a in example_args],
                   "kwargs": {k: _describe_input(v) for k, v in example_kwargs.items()}},
        "options": compiled_options(options),
        "target": dataclasses.asdict(target),
        "optimizer": optimizer_description(optimizer, model) if training else None,
    }


def traced(model: torch.nn.Module, training: bool, args, kwargs, options) -> JointGraph:
    """The model captured as the compiler captures it, in train or eval mode as the executor
    runs it (the joint forward-backward ATen graph when training)."""
    was_training = torch.nn.Module.__getattribute__(model, "training")
    model.train(training)
    try:
        trainable = {n for n, p in torch.nn.Module.named_parameters(model) if p.requires_grad}
        return capture_joint(model, args, kwargs, training=training, decompositions=decompositions(),
                             trainable=trainable,
                             source_excludes=options.source_location_excludes)
    finally:
        model.train(was_training)


def graph_description(joint: JointGraph) -> dict:
    """The captured graph as plain data: its code (every ATen op with its arguments) and per node
    its block, pass and result shapes, and for constant tensors a digest."""
    gm = joint.graph_module
    nodes = []
    for node in gm.graph.nodes:
        annotation = annotation_of(node)
        entry = {"name": node.name, "block": str(annotation.block) if annotation is not None else None,
                 "pass": pass_of(node), "result": _describe_meta(node.meta.get("val"))}
        if node.op == "get_attr":
            entry["constant"] = _digest_value(_attribute(gm, node.target))
        nodes.append(entry)
    return {"code": gm.code, "nodes": nodes, "outputs": repr(joint.output_tree)}


def compiled_options(options) -> dict:
    """The options as plain data without the host-side ones (they do not change the program):
    :data:`HOST_OPTIONS`, the process id, Emulator host threads, the cache path itself and
    profiling (``autoReport.*``) engine options."""
    values = options.toDict()
    for name in HOST_OPTIONS:
        values.pop(name, None)
    values["Distributed"].pop("distributed_process_id", None)
    values["Emulator"].pop("host_threads", None)
    popart = values["_Popart"]
    popart.pop("cachePath", None)
    popart.pop("enableEngineCaching", None)
    if "engineOptions" in popart:
        popart["engineOptions"] = {k: v for k, v in popart["engineOptions"].items() if not k.startswith("autoReport.")}
    return values


def optimizer_description(optimizer, model: torch.nn.Module) -> dict:
    """What of the optimiser shapes the program: its type, which parameters each group updates,
    the device optimiser's state layout and structural settings, the loss scaling (the seed of
    the backward pass), the accumulators' dtype (`accum_type`) and gradient clipping's bound. Learning rates and other hyperparameters are not part of it."""
    names = {id(p): n for n, p in torch.nn.Module.named_parameters(model)}
    groups = []
    for group in optimizer.param_groups:
        config = device_config(optimizer, group, 1.0)
        groups.append({
            "params": [names.get(id(p), "<not in the model>") for p in group["params"]],
            "device": type(config).__name__,
            "layout": repr(config.layout()),
            "structural": {k: repr(getattr(config, k)) for k in config.STRUCTURAL},
        })
    return {"type": _qualified_name(type(optimizer)), "groups": groups, "loss_scaling": loss_scaling(optimizer),
            "accum_type": accumulator_dtype(optimizer), "max_grad_norm": max_grad_norm(optimizer)}


def software_versions() -> dict:
    from .. import __version__  # pylint: disable=import-outside-toplevel
    return {"poptorch_lite": __version__, "sources": source_digest(),
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "numpy": np.__version__, "numba": numba.__version__, "torch": torch.__version__}


@functools.cache
def source_digest() -> str:
    """SHA-256 of the compiler's and the emulator's sources: an edited source tree never loads
    entries of another."""
    digest = hashlib.sha256()
    for package in (ip, sys.modules[__package__.partition(".")[0]]):
        root = Path(package.__file__).parent
        for file in sorted(root.rglob("*.py")):
            digest.update(str(file.relative_to(root.parent)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def _describe_input(value):
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype)}
    return repr(value)


def _describe_meta(meta):
    if isinstance(meta, torch.Tensor):
        return [list(meta.shape), str(meta.dtype)]
    if isinstance(meta, (list, tuple)):
        return [_describe_meta(m) for m in meta]
    if isinstance(meta, dict):
        return {str(k): _describe_meta(m) for k, m in meta.items()}
    return None if meta is None else repr(meta)


def _digest_value(value) -> str:
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().contiguous()
        return f"{list(array.shape)} {array.dtype} " + hashlib.sha256(array.view(torch.uint8).numpy()).hexdigest()
    return repr(value)


def _attribute(root, dotted: str):
    for part in dotted.split("."):
        root = getattr(root, part)
    return root


def _qualified_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ---- entries on disk ------------------------------------------------------------------------------
class CacheEntryError(ValueError):
    """A cache entry that cannot be used (truncated, corrupt, stale or of another format)."""


def entry_path(path, key: str) -> str:
    return os.path.join(os.fspath(path), key + SUFFIX)


def store(path, key: str, executable: Executable) -> str | None:
    """Save `executable` as the entry of `key` in directory `path` (created if missing); returns
    the entry's file, or None, with a warning, when it cannot be written: the model is compiled
    either way."""
    file = entry_path(path, key)
    try:
        payload = serialize(executable)
    except Exception as error:  # noqa: BLE001 - an unpicklable program must not fail the run
        logger.warning("The compiled model cannot be cached (%s: %s); it runs normally but the next process "
                       "will compile it again.", type(error).__name__, error)
        return None
    header = {"format": FORMAT_VERSION, "key": key, "payload_bytes": len(payload),
              "payload_sha256": hashlib.sha256(payload).hexdigest(), "software": software_versions()}
    tmp = os.path.join(os.fspath(path), f".{key}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}.tmp")
    try:
        os.makedirs(path, exist_ok=True)
        # a file of its own for every writer, with the permissions the umask gives
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            f.write(MAGIC)
            f.write(json.dumps(header).encode() + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())  # on disk before it gets the entry's name
        os.replace(tmp, file)
        _sync_directory(path)
    except BaseException as error:  # an interrupt (Ctrl-C) too: no temporary file is left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not isinstance(error, OSError):
            raise
        logger.warning("Cannot write the executable cache entry %s (%s); the model was compiled but not cached. "
                       "Make the directory writable or choose another with Options.enableExecutableCaching(path) "
                       "(or POPTORCH_CACHE_DIR).", file, error)
        return None
    logger.info("Saved the compiled model to the executable cache: %s (%.1f MB)", file, len(payload) / 1e6)
    return file


def _sync_directory(path) -> None:
    """Make a rename in directory `path` durable (where the file system can sync a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load(path, key: str) -> Executable | None:
    """The executable of `key` from directory `path`, loaded and ready to run, or None when there is
    no usable entry (the reason is logged: debug when there is none, info when it is unusable)."""
    file = entry_path(path, key)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        logger.debug("No executable cache entry %s", file)
        return None
    except OSError as error:
        logger.info("Cannot read the executable cache entry %s (%s): compiling the model", file, error)
        return None
    try:
        executable = deserialize(read_entry(data, key))
        executable.engine.load()
    except Exception as error:  # noqa: BLE001 - whatever is wrong with the entry, compiling fixes it
        logger.info("The executable cache entry %s is unusable (%s: %s): compiling the model again",
                    file, type(error).__name__, error)
        return None
    return executable


def read_entry(data: bytes, key: str) -> memoryview:
    """The payload of an entry after checking its magic, format, key, size and checksum."""
    if not data.startswith(MAGIC):
        raise CacheEntryError("not an executable cache entry (bad magic)")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER_BYTES)
    if end < 0:
        raise CacheEntryError("truncated or corrupt header")
    try:
        header = json.loads(data[len(MAGIC):end])
    except ValueError as error:
        raise CacheEntryError(f"corrupt header ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        raise CacheEntryError(f"entry format {header.get('format') if isinstance(header, dict) else None!r}, "
                              f"this version reads format {FORMAT_VERSION}")
    if header.get("key") != key:
        raise CacheEntryError(f"the entry was saved for key {header.get('key')!r}, not {key!r}")
    payload = memoryview(data)[end + 1:]
    if len(payload) != header.get("payload_bytes"):
        raise CacheEntryError(f"truncated: {len(payload)} of {header.get('payload_bytes')} payload bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise CacheEntryError("payload checksum mismatch (corrupt)")
    return payload


# ---- serialisation --------------------------------------------------------------------------------
def serialize(executable: Executable) -> bytes:
    """The executable as bytes, without host-side state."""
    buffer = io.BytesIO()
    with _gc_paused():
        _ExecutablePickler(buffer).dump(executable)
    return buffer.getvalue()


def deserialize(payload) -> Executable:
    """The executable of `serialize` (its engine not loaded yet)."""
    with _gc_paused():
        executable = pickle.loads(payload)
    if not isinstance(executable, Executable):
        raise CacheEntryError(f"the payload holds a {type(executable).__name__}, not an Executable")
    return executable


@contextlib.contextmanager
def _gc_paused():
    """No cyclic garbage collection while (un)pickling: a program is ~10^5 new objects, which
    would trigger many full collections over a heap that only grows."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _ExecutablePickler(cloudpickle.Pickler):
    """cloudpickle with the reducers of the emulator's objects (see the module docstring)."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        # The same reducers as cloudpickle's ChainMap, looked up at C speed.
        self.dispatch_table = dict(cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj):
        if type(obj) is np.ndarray:
            return _reduce_array(obj) or NotImplemented
        reduce = _REDUCERS.get(type(obj))
        if reduce is not None:
            return reduce(obj)
        if isinstance(obj, Dispatcher):
            return _reduce_dispatcher(obj)
        if isinstance(obj, device_optim.Optimiser):
            return _reduce_optimiser(obj)
        if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            raise TypeError(f"the executable refers to a {type(obj).__name__}: an entry holds no model, "
                            "optimiser or weights")
        return super().reducer_override(obj)


def _new(cls):
    return cls.__new__(cls)


def _import_attribute(module: str, qualname: str):
    return _attribute(importlib.import_module(module), qualname)


def _by_reference(obj, module_names) -> tuple | None:
    """(module, attribute) of a module-level object, or None when it is not one."""
    for name in dict.fromkeys(module_names):
        module = sys.modules.get(name)
        for attribute, value in vars(module).items() if module is not None else ():
            if value is obj:
                return name, attribute
    return None


def _reduce_dispatcher(dispatcher: Dispatcher):
    """A Numba dispatcher by import path when it is a module attribute, else Numba's own pickling."""
    func = dispatcher.py_func
    found = _by_reference(dispatcher, [func.__module__])
    return (_import_attribute, found) if found else dispatcher.__reduce__()


def _reduce_vertex_type(vertex_type: ip.VertexType):
    kernel, cycles = vertex_type.kernel, vertex_type.cycles
    modules = [getattr(kernel, "py_func", kernel).__module__, getattr(cycles, "__module__", None)]
    found = _by_reference(vertex_type, [m for m in modules if m])
    if found:
        return _import_attribute, found
    return ip.VertexType, tuple(getattr(vertex_type, f.name) for f in dataclasses.fields(vertex_type))


def _reduce_engine(engine: ip.Engine):
    state = {k: v for k, v in vars(engine).items() if k not in ip.Engine.HOST_STATE}
    state["_costs"] = list(engine._costs.values())  # keyed by id(node): re-keyed when loaded
    state["host_pool_threads"] = engine._pool.threads if engine._pool is not None else 1
    return _new, (type(engine),), state, None, None, _set_engine_state


def _set_engine_state(engine: ip.Engine, state: dict) -> None:
    state = dict(state)
    threads = state.pop("host_pool_threads")
    costs = state.pop("_costs")
    vars(engine).update(state)
    engine._costs = {id(node): (node, cost) for node, cost in costs}
    engine.host_state(threads)
    # The saving machine may have had more cores than this one.
    engine.kernel_threads = min(engine.kernel_threads, numba.config.NUMBA_NUM_THREADS)


def _reduce_optimiser(optimiser: device_optim.Optimiser):
    state = dict(vars(optimiser))
    state["_hypers"] = list(optimiser._hypers.values())  # keyed by id(graph): re-keyed when loaded
    return _new, (type(optimiser),), state, None, None, _set_optimiser_state


def _set_optimiser_state(optimiser: device_optim.Optimiser, state: dict) -> None:
    state = dict(state)
    hypers = state.pop("_hypers")
    vars(optimiser).update(state)
    optimiser._hypers = {id(h.graph): h for h in hypers}


def _reduce_array(a: np.ndarray):
    """Integer arrays (tile mappings, element indices, bytes per tile) as runs (`runs`) when that
    is at least four times smaller, else None (plain pickling)."""
    if a.dtype.kind not in "iu" or a.dtype == np.uint64 or a.size < 64 or not a.flags.c_contiguous:
        return None
    flat = a.reshape(-1)
    for step in (1, 0):
        values, lengths = runs(flat, step)
        if values.size * 8 <= flat.size:
            return _array, (a.dtype.str, a.shape, step, _compact(values), _compact(lengths))
    return None


def _array(dtype: str, shape: tuple, step: int, values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return expand(values, lengths, step).astype(dtype, copy=False).reshape(shape)


def _compact(a: np.ndarray) -> np.ndarray:
    """An int64 array as int32 when its values allow."""
    if a.dtype == np.int64 and (a.size == 0 or (a.min() >= -2 ** 31 and a.max() < 2 ** 31)):
        return a.astype(np.int32)
    return a


def runs(a: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """A 1-d integer array as runs in which each element is the previous plus `step`: the first
    value and the length of each run."""
    if a.size == 0:
        return a.copy(), np.zeros(0, np.int64)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(a) != step) + 1))
    return a[starts], np.diff(np.append(starts, a.size))


def expand(values: np.ndarray, lengths: np.ndarray, step: int) -> np.ndarray:
    """The array `runs` describes."""
    if step == 0:
        return np.repeat(values, lengths)
    values = values.astype(np.int64, copy=False)
    n = int(lengths.sum())
    if values.size <= 1:
        return values[0] + step * np.arange(n) if values.size else np.zeros(0, np.int64)
    # one cumulative sum: each element is the previous plus step, except at the start of a run
    deltas = np.full(n, step, dtype=np.int64)
    deltas[0] = values[0]
    starts = np.cumsum(lengths[:-1])
    deltas[starts] = values[1:] - values[:-1] - step * (lengths[:-1] - 1)
    return np.cumsum(deltas)


_REDUCERS = {
    ip.Engine: _reduce_engine,
    ip.VertexType: _reduce_vertex_type,
}


# ---- entries and locks --------------------------------------------------------------------------
def entry_version(path, key: str) -> tuple | None:
    try:
        st = os.stat(entry_path(path, key))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


@contextlib.contextmanager
def compile_lock(path, key: str, timeout: float):
    """Hold the exclusive lock of `key` in `path`; wait at most `timeout` seconds for it."""
    fd = None
    if fcntl is not None:
        try:
            os.makedirs(path, exist_ok=True)
            fd = os.open(os.path.join(os.fspath(path), key + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            logger.debug("No compile lock in %s (%s): compiling without waiting for other processes", path, error)
    try:
        if fd is not None:
            _acquire(fd, path, timeout)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _acquire(fd: int, path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not waiting:
                logger.info("Another process is compiling the same model into the executable cache %s: waiting "
                            "for it", path)
                waiting = True
            if time.monotonic() >= deadline:
                logger.warning("Waited %.0f s for another process compiling the same model into %s; compiling "
                               "here too", timeout, path)
                return
            time.sleep(0.05)


__all__ = ["CacheEntryError", "cache_key", "compile_lock", "entry_path", "entry_version", "key_contents", "load", "store"]
