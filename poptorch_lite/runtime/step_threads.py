"""How many host threads run the emulated IPUs of one schedule step (Options.Emulator.setHostThreads).

A fixed number is used as given. "auto" (the default) measures: whether running a step's IPUs
side by side pays depends on the model. The tutorial's CNN keeps two of its four IPUs equally
busy in every step, and its call takes 0.8x the time on two threads of a two-core machine; a
two-IPU MLP whose second IPU holds nearly all the work runs 1.1-1.5x slower on two threads,
because each thread's BLAS then has one core where a lone thread's BLAS has both. So after the
call that compiles (and makes the run record), calls take turns on one thread and on as many as
the cores this process may use and the widest step allow, each timed; later calls use the
faster (one thread unless the other is 5% faster: it leaves the other cores to the data loader).
One round of turns decides when it is clear; when the two are within a few percent (a data loader
starting its workers during one of the two calls is enough to blur them), up to two more rounds
are timed and the shortest time of each decides, a busy moment only ever adding time. Which
threads compute a step never changes its values, only the wall time.
"""
from __future__ import annotations

from ipusim.device.host_threads import HostThreads, usable_cores

from ..api.options import AUTO_THREADS as AUTO

MARGIN = 0.95  # several threads are chosen when they take less than this fraction of one thread's time
CLEARLY_SLOWER = 1.10  # ... and one thread without another round when they take more than this
ROUNDS = 3  # rounds of timed calls at most


class StepThreads:
    """The host threads of one compiled schedule's calls."""

    def __init__(self, setting, schedule):
        widest = max((len(step.by_ipu()) for step in schedule.steps), default=1)  # the most IPUs a step keeps busy
        threads = min(usable_cores(), widest)  # (more threads would idle, and take BLAS's share of the cores)
        if setting == AUTO:
            self._candidates = [1, threads] if threads > 1 else [1]
        else:
            self._candidates = [int(setting)]
        self._calls = 0
        self._times: dict[int, float] = {}
        self._chosen = self._candidates[0] if len(self._candidates) == 1 else None
        self._team: HostThreads | None = None

    @property
    def chosen(self) -> int | None:
        """The number of threads calls run on, None while still measuring."""
        return self._chosen

    def for_call(self) -> int:
        """How many threads this call runs on."""
        if self._chosen is not None:
            return self._chosen
        trial = self._calls - 1  # call 0 compiles and makes the record: not measured
        return self._candidates[trial % len(self._candidates)] if trial >= 0 else 1

    def team(self, threads: int) -> HostThreads | None:
        """The host threads of a call on `threads` threads (None for one)."""
        if threads <= 1:
            return None
        if self._team is None or self._team.threads != threads:
            self.shutdown()
            self._team = HostThreads(threads, "ipu")
        return self._team

    def ran(self, threads: int, seconds: float) -> None:
        """A call ran on `threads` threads in `seconds` of wall time."""
        trial = self._calls - 1
        self._calls += 1
        if self._chosen is not None or trial < 0:
            return
        self._times[threads] = min(seconds, self._times.get(threads, seconds))
        if (trial + 1) % len(self._candidates):
            return  # the round goes on
        one, best = self._times[1], min(self._candidates[1:], key=self._times.__getitem__)
        ratio = self._times[best] / one
        if ratio < MARGIN:
            self._chosen = best
        elif ratio > CLEARLY_SLOWER or (trial + 1) // len(self._candidates) >= ROUNDS:
            self._chosen = 1
            self.shutdown()

    def shutdown(self) -> None:
        if self._team is not None:
            self._team.shutdown()
            self._team = None

