"""``poptorch.profiling``: host-side tracepoints, as PopTorch's profiling channels.

    channel = poptorch.profiling.Channel("MyApp")
    with channel.tracepoint("preprocess"):
        batch = preprocess(batch)
    channel.instrument(dataset, "__getitem__")     # every call of dataset.__getitem__ is traced

Every tracepoint is recorded (wall-clock start and duration, thread, ``<channel>.<name>``; the
last :data:`MAX_EVENTS` are kept). A profiled model (``Options.enableProfiling`` or
``POPLAR_ENGINE_OPTIONS``) writes them, with the model's own (its compile, weight copies and
calls, channel ``poptorch``), as ``host_trace.json`` beside its ``trace.json``: a Chrome trace in
host time, where the emulated device's trace is in device time.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import threading
import time

MAX_EVENTS = 100_000
_EVENTS: collections.deque = collections.deque(maxlen=MAX_EVENTS)
_START = time.perf_counter()


class Channel:
    """A named group of tracepoints (PopTorch's profiling channel)."""

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise TypeError(f"profiling.Channel expects a non-empty name, got {name!r}")
        self.name = name

    @contextlib.contextmanager
    def tracepoint(self, name: str):
        """Record the time the body takes as ``<channel>.<name>``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            _EVENTS.append((self.name, f"{self.name}.{name}", start, time.perf_counter() - start,
                            threading.get_ident()))

    def instrument(self, obj, *methods: str):
        """Trace every call of `obj`'s `methods` (by name); returns `obj`. A special method
        (``__getitem__``) is traced on a subclass made for `obj`, as Python looks those up on
        the type."""
        for method in methods:
            original = getattr(obj, method)          # an AttributeError names a missing method
            traced = self._traced(original, f"{type(obj).__name__}.{method}")
            if method.startswith("__") and method.endswith("__"):
                cls = type(obj)
                obj.__class__ = type(cls.__name__, (cls,), {method: lambda self, *a, _t=traced, **k: _t(*a, **k),
                                                            "__reduce_ex__": _plain_reduce(cls)})
            else:
                setattr(obj, method, traced)
        return obj

    def _traced(self, function, name: str):
        @functools.wraps(function)
        def traced(*args, **kwargs):
            with self.tracepoint(name):
                return function(*args, **kwargs)
        return traced


def _plain_reduce(cls):
    """Pickle an instrumented object as its own class (a worker process gets the plain object)."""
    def reduce(self, protocol):
        state = dict(self.__dict__)
        return (object.__new__, (cls,), state)
    return reduce


def events() -> list[dict]:
    """The recorded tracepoints as Chrome trace events (microseconds since the process started)."""
    return [{"name": name, "cat": channel, "ph": "X", "pid": os.getpid(), "tid": tid,
             "ts": round((start - _START) * 1e6, 3), "dur": round(duration * 1e6, 3)}
            for channel, name, start, duration, tid in list(_EVENTS)]


def write_host_trace(directory: str) -> str:
    """Write the recorded tracepoints to ``directory/host_trace.json``; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "host_trace.json")
    meta = [{"name": "process_name", "ph": "M", "pid": os.getpid(), "tid": 0,
             "args": {"name": "host (wall clock)"}}]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": meta + events(), "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
    return path
