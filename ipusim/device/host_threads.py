"""Host threads that run independent parts of an emulation at the same time: the emulated IPUs
of one pipeline step (poptorch_lite's runtime) or the parts of a Parallel program (the engine).

Fast-mode kernels release Python's interpreter lock while they compute (NumPy, BLAS, Numba
kernels compiled `nogil`), so parts on different IPUs, which touch different memories, overlap.
The thread that calls `map` takes parts too: n threads are the caller and n - 1 helpers, which
sleep between maps, so a step costs one wake-up per helper, not a task queue. Parts are taken in
the order given, each by whichever thread is free first; a part computes the same values
whichever thread runs it.
"""
from __future__ import annotations

import itertools
import os
import threading
import weakref


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _Team:
    """What the helper threads share (kept apart from HostThreads so that a helper does not keep
    its HostThreads alive: dropping the last reference stops the helpers). Each helper waits on a
    lock of its own that the caller releases to wake it, and releases another when done: plain
    locks hand over in C, where an Event's condition variable costs tens of microseconds a step."""

    def __init__(self, helpers: int, name: str):
        self.wake = [_held() for _ in range(helpers)]
        self.done = [_held() for _ in range(helpers)]
        self.job: tuple | None = None
        self.stopping = False
        self.threads = [threading.Thread(target=self.serve, args=(i,), name=f"{name}-{i + 1}", daemon=True)
                        for i in range(helpers)]
        for t in self.threads:
            t.start()

    def serve(self, i: int) -> None:
        while True:
            self.wake[i].acquire()
            if self.stopping:
                return
            self.work()
            self.done[i].release()

    def work(self) -> None:
        fn, items, results, taken, errors = self.job
        while not errors:
            k = next(taken)  # one thread gets each index (next() on a count holds the interpreter lock)
            if k >= len(items):
                return
            try:
                results[k] = fn(items[k])
            except BaseException as e:  # noqa: BLE001  (re-raised by the caller of map)
                errors.append(e)

    def stop(self) -> None:
        self.stopping = True
        for w in self.wake:
            w.release()


def _held() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


class HostThreads:
    """`threads` host threads (the caller and threads - 1 helpers) mapping a function over parts."""

    def __init__(self, threads: int, name: str = "ipusim-host"):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"HostThreads: threads must be an int >= 1, got {threads!r}")
        self.threads = threads
        self._name = name
        self._team: _Team | None = None  # helpers start on the first map that has work for them
        self._busy = threading.Lock()
        self._finalizer = None

    def map(self, fn, items) -> list:
        """[fn(item) for item in items], the items shared among the threads; the first exception
        raised by any of them is raised here once all have stopped. A map made from inside a
        map (a part that itself runs parts) runs in its own thread."""
        items = list(items)
        if self.threads == 1 or len(items) < 2 or not self._busy.acquire(blocking=False):
            return [fn(item) for item in items]
        try:
            team = self._started()
            results: list = [None] * len(items)
            errors: list[BaseException] = []
            team.job = (fn, items, results, itertools.count(), errors)
            helpers = min(len(team.threads), len(items) - 1)
            for i in range(helpers):
                team.wake[i].release()
            try:
                team.work()
            finally:
                try:
                    for i in range(helpers):
                        team.done[i].acquire()
                except BaseException:  # interrupted while a helper may still be on this map
                    self.shutdown()  # so its locks are not reused: the next map starts new helpers
                    raise
            team.job = None
            if errors:
                raise errors[0]
            return results
        finally:
            self._busy.release()

    def _started(self) -> _Team:
        if self._team is None:
            self._team = _Team(self.threads - 1, self._name)
            self._finalizer = weakref.finalize(self, self._team.stop)
        return self._team

    def shutdown(self) -> None:
        """Stop the helpers (a later map starts new ones)."""
        if self._finalizer is not None:
            self._finalizer()
            self._team, self._finalizer = None, None
