"""Running instances as child processes that live and die together.

Each instance starts in its own session (so its own process group) and is killed by the kernel
if the launcher dies (`PR_SET_PDEATHSIG`). One event loop reads every child's output, watches
for exits and for the signals the launcher receives:

- the first instance to exit with a non-zero code or by a signal is the root cause: every other
  instance gets SIGTERM, then SIGKILL once the grace period is over;
- SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded to every instance, with the
  same SIGKILL escalation; a second such signal escalates at once;
- when the instances are gone, whatever is left in their process groups is killed, so no
  process outlives the launcher.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from popdist.output import OutputRouter

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
_DRAIN_SECONDS = 0.5  # how long pipes may stay open after every instance exited


@dataclass(frozen=True)
class InstanceCommand:
    """One process to supervise."""

    index: int
    argv: list[str]
    env: dict[str, str]
    cpus: frozenset[int] | None = None  # CPU affinity, e.g. one NUMA node's CPUs
    capture_output: bool = True  # False: the child writes straight to our stdout/stderr
    stdin: bool = False  # whether the child reads our stdin (else /dev/null)
    name: str = ""  # how messages call it (default: "instance N")

    @property
    def label(self) -> str:
        return self.name or f"instance {self.index}"


@dataclass(frozen=True)
class InstanceExit:
    """How an instance ended. `returncode` follows subprocess: negative means a signal."""

    index: int
    pid: int
    returncode: int
    signalled_by_launcher: int | None = None  # the signal we sent it, if any

    @property
    def failed(self) -> bool:
        return self.returncode != 0

    @property
    def shell_status(self) -> int:
        """The status a shell would report: the exit code, or 128 + signal number."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    def describe(self) -> str:
        if self.returncode < 0:
            return f"was killed by signal {signal_name(-self.returncode)}"
        return f"exited with code {self.returncode}"


@dataclass
class SupervisionResult:
    exits: list[InstanceExit]
    first_failure: InstanceExit | None
    interrupt: int | None  # the signal that interrupted the launcher, if any
    leftovers_killed: list[int] = field(default_factory=list)  # instances with leftovers

    @property
    def exit_status(self) -> int:
        if self.interrupt is not None:
            return 128 + self.interrupt
        if self.first_failure is not None:
            return self.first_failure.shell_status
        return 0


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _Child:
    def __init__(self, command: InstanceCommand, process: subprocess.Popen):
        self.command = command
        self.process = process
        self.signalled: int | None = None
        self.exit: InstanceExit | None = None
        self.leftovers_killed = False

    @property
    def index(self) -> int:
        return self.command.index

    def signal_group(self, signum: int) -> bool:
        """Send `signum` to the child's process group; False when the group is gone."""
        try:
            os.killpg(self.process.pid, signum)
            return True
        except (ProcessLookupError, PermissionError):
            return False


class Supervisor:
    """Starts instances, routes their output and ends them together."""

    def __init__(self, router: OutputRouter, grace_seconds: float = 5.0,
                 on_event: Callable[[str], None] | None = None):
        self.router = router
        self.grace_seconds = grace_seconds
        self.on_event = on_event or (lambda message: None)

    def run(self, commands: list[InstanceCommand]) -> SupervisionResult:
        with _SignalCatcher() as catcher:
            return self._run(commands, catcher)

    def _run(self, commands: list[InstanceCommand], catcher: "_SignalCatcher"):
        children: list[_Child] = []
        selector = selectors.DefaultSelector()
        selector.register(catcher.wakeup_read, selectors.EVENT_READ, None)
        first_failure: InstanceExit | None = None
        interrupt: int | None = None
        kill_at: float | None = None
        all_exited_at: float | None = None
        try:
            for command in commands:
                if catcher.pending:
                    break  # interrupted while starting: start no more
                self.router.add_instance(command.index)
                child = _Child(command, _spawn(command))
                children.append(child)
                for stream, pipe in (("stdout", child.process.stdout),
                                     ("stderr", child.process.stderr)):
                    if pipe is not None:
                        os.set_blocking(pipe.fileno(), False)
                        selector.register(pipe, selectors.EVENT_READ, (child.index, stream))
            while True:
                running = [c for c in children if c.exit is None]
                pipes_open = len(selector.get_map()) > 1
                if not running and not pipes_open:
                    break
                now = time.monotonic()
                if not running and all_exited_at is None:
                    all_exited_at = now
                deadlines = [d for d in (kill_at, self.router.next_deadline()) if d is not None]
                if all_exited_at is not None:
                    deadlines.append(all_exited_at + _DRAIN_SECONDS)
                timeout = max(0.0, min(deadlines) - now) if deadlines else None
                if catcher.polling:
                    timeout = 0.05 if timeout is None else min(timeout, 0.05)
                for key, _ in selector.select(timeout):
                    if key.data is None:
                        catcher.drain()
                        continue
                    index, stream = key.data
                    try:
                        data = os.read(key.fileobj.fileno(), 1 << 16)
                    except BlockingIOError:
                        continue
                    if data:
                        self.router.feed(index, stream, data)
                    else:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
                        self.router.close(index, stream)
                for signum in catcher.take():
                    if interrupt is None:
                        interrupt = signum
                        self.on_event(f"received {signal_name(signum)}: forwarding it to "
                                      f"{_everyone(children)} (SIGKILL after "
                                      f"{self.grace_seconds:g} s)")
                        self._signal_running(children, signum)
                        kill_at = time.monotonic() + self.grace_seconds
                    else:
                        self.on_event(f"received {signal_name(signum)} again: killing "
                                      f"{_everyone(children)} now")
                        kill_at = time.monotonic()
                for child in children:
                    if child.exit is None and child.process.poll() is not None:
                        child.exit = InstanceExit(child.index, child.process.pid,
                                                  child.process.returncode, child.signalled)
                        if (child.exit.failed and first_failure is None and interrupt is None
                                and child.signalled is None):
                            first_failure = child.exit
                            others = [c for c in children if c.exit is None]
                            message = f"{child.command.label} {child.exit.describe()}"
                            if others:
                                message += (f"; terminating the other instances (SIGTERM, then "
                                            f"SIGKILL after {self.grace_seconds:g} s)")
                                self._signal_running(children, signal.SIGTERM)
                                kill_at = time.monotonic() + self.grace_seconds
                            self.on_event(message)
                now = time.monotonic()
                if kill_at is not None and now >= kill_at:
                    self._signal_running(children, signal.SIGKILL)
                    kill_at = None
                if all_exited_at is not None and now >= all_exited_at + _DRAIN_SECONDS:
                    # only leftover processes can still hold the pipes: end them and stop reading
                    self._kill_leftovers(children)
                    for key in list(selector.get_map().values()):
                        if key.data is not None:
                            selector.unregister(key.fileobj)
                            key.fileobj.close()
                            self.router.close(*key.data)
                self.router.flush_stale()
        finally:
            for child in children:
                if child.exit is None:  # only reached when an exception cut the loop short
                    child.signal_group(signal.SIGKILL)
                    child.process.wait()
            self._kill_leftovers(children)
            selector.close()
        return SupervisionResult(
            exits=[c.exit for c in children if c.exit is not None],
            first_failure=first_failure, interrupt=interrupt,
            leftovers_killed=[c.index for c in children if c.leftovers_killed])

    def _signal_running(self, children: list[_Child], signum: int) -> None:
        for child in children:
            if child.exit is None and child.signal_group(signum):
                child.signalled = child.signalled or signum

    def _kill_leftovers(self, children: list[_Child]) -> None:
        for child in children:
            if child.exit is None or child.leftovers_killed:
                continue
            leftovers = live_group_members(child.process.pid)
            if leftovers and child.signal_group(signal.SIGKILL):
                child.leftovers_killed = True
                self.on_event(f"killed {len(leftovers)} process(es) left behind by "
                              f"{child.command.label}: pid {', '.join(map(str, leftovers))}")


def live_group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that have not finished (zombies have)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return sorted(members)


def _everyone(children: list[_Child]) -> str:
    return children[0].command.label if len(children) == 1 else "every instance"


def _spawn(command: InstanceCommand) -> subprocess.Popen:
    parent = os.getpid()
    libc = _libc()
    cpus = command.cpus

    def in_child() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the line above took effect
            os._exit(1)
        if cpus:
            os.sched_setaffinity(0, cpus)

    output = subprocess.PIPE if command.capture_output else None
    return subprocess.Popen(
        command.argv, env=command.env, stdout=output, stderr=output,
        stdin=None if command.stdin else subprocess.DEVNULL,
        start_new_session=True, preexec_fn=in_child, close_fds=True)


_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


class _SignalCatcher:
    """Turns SIGINT/SIGTERM/SIGHUP (and SIGCHLD, to wake up) into events of the loop.

    Signal handlers only exist in the main thread; elsewhere the loop polls instead.
    """

    def __init__(self):
        self.wakeup_read, self._wakeup_write = os.pipe()
        for fd in (self.wakeup_read, self._wakeup_write):
            os.set_blocking(fd, False)
        self.pending: list[int] = []
        self.polling = threading.current_thread() is not threading.main_thread()
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1

    def __enter__(self) -> "_SignalCatcher":
        if not self.polling:
            self._previous_wakeup = signal.set_wakeup_fd(self._wakeup_write)
            for signum in FORWARDED_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
            self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, _wake)
        return self

    def __exit__(self, *exc) -> None:
        if not self.polling:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            signal.set_wakeup_fd(self._previous_wakeup)
        os.close(self.wakeup_read)
        os.close(self._wakeup_write)

    def _record(self, signum: int, frame) -> None:
        self.pending.append(signum)

    def take(self) -> list[int]:
        taken, self.pending = self.pending, []
        return taken

    def drain(self) -> None:
        try:
            while os.read(self.wakeup_read, 512):
                pass
        except BlockingIOError:
            pass


def _wake(signum: int, frame) -> None:
    """SIGCHLD only needs to wake the loop up, which the wakeup fd already did."""
