"""The phase trace of a run: where a whole process's time goes, read from outside.

With ``IPUSIM_PHASES=FILE`` in the environment, every process of a run (the host, the accessor
zygote, each accessor process) appends one line to FILE at each phase boundary::

    <wall time, s since the epoch> <pid> <role> <event> cpu=<s> children=<s> [key=value ...]

``cpu`` is the process's own CPU time so far (user + system, all its threads), ``children`` that of
its children it has reaped (an accessor's DataLoader workers once it has joined them, the zygote and
its forks once the host has), ``gc`` the CPU time Python's cyclic garbage collector has taken in
this process and ``full`` its full collections (both since the trace began). Events are ``<phase>:begin`` / ``<phase>:end`` pairs or single marks;
the keys count what a phase did (items loaded and sent, workers, ...). ``benchmarks/end_to_end.py
--phases`` sets the variable and prints the table (docs/performance.md). Unset, nothing is written
and each mark costs one test of a module global.

Lines are appended with one ``write`` on a descriptor opened ``O_APPEND``, so the processes' lines
never interleave.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import time

PATH = os.environ.get("IPUSIM_PHASES") or None
# A spawned interpreter (the accessor zygote, before it knows it is one) runs with this argument.
ROLE = "spawned" if "--multiprocessing-fork" in sys.argv else "host"  # the zygote and accessors set theirs


def mark(event: str, **counts) -> None:
    """Append `event` with this process's CPU times and `counts` to the trace, if one is kept."""
    if PATH is None:
        return
    t = os.times()
    extra = "".join(f" {key}={value}" for key, value in counts.items())
    line = (f"{time.time():.6f} {os.getpid()} {ROLE} {event} cpu={t.user + t.system:.3f} "
            f"children={t.children_user + t.children_system:.3f} gc={_collector[0]:.3f} "
            f"full={_collector[1]}{extra}\n")
    try:
        fd = os.open(PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a trace that cannot be written never stops the run


_collector = [0.0, 0, 0.0]  # CPU s in collections, full collections, when the current one began


def _time_collection(stage: str, info: dict) -> None:
    if stage == "start":
        _collector[2] = time.thread_time()
    else:
        _collector[0] += time.thread_time() - _collector[2]
        _collector[1] += info["generation"] == 2


@contextlib.contextmanager
def phase(name: str, **counts):
    """Mark ``name:begin`` and ``name:end`` around the body."""
    mark(f"{name}:begin", **counts)
    try:
        yield
    finally:
        mark(f"{name}:end")


def _started() -> None:
    """Mark this process's start (when the interpreter began, from /proc) and register the mark of
    its last exit handler: done on import, which `import poptorch_lite` does first."""
    if PATH is None:
        return
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        began = time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
        mark("process", began=f"{began:.3f}")
    except (OSError, ValueError, IndexError):
        pass
    gc.callbacks.append(_time_collection)
    # Exit handlers run last registered first: this one, registered on import, after the others.
    atexit.register(mark, "exit-handlers:end")


_started()
