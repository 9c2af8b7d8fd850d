"""The accessor zygote: one fresh interpreter per host process, from which the worker processes of
the spawning sharing strategies (``SharingStrategy.FileSystem`` and ``SharedMemory``) are forked.

PopTorch starts the worker process of each AsynchronousDataAccessor with those strategies as a
spawned interpreter: it imports the user's script again (torch with it) and unpickles the dataset.
That costs 1.3-1.6 s of CPU time per accessor on the machine the figures in docs/data-loading.md
come from, and a script usually builds two accessors at once (its training and its test loader),
just when the host is busiest (importing the export stack, compiling). The zygote is spawned
exactly like such a worker, once, and then only forks: each accessor process is a fork of it, so it
starts in milliseconds in the state a spawned worker would have (the script imported as
``__mp_main__``, no host threads, BLAS pools or Numba state, the collector paused, Ctrl-C
ignored). It receives what spawn would send it, pickled the same way (the host's preparation data,
then the process object with its target and arguments), the descriptors they refer to (pipes,
the dataset's file, shared tensors) passed beside them over a Unix socket.

The zygote runs while an accessor it forked may: the host closes it when its last live accessor
stops (and at exit); it also ends when the host dies, once the processes it forked (which watch
the host themselves) have ended. For each fork the host gets a `ForkedProcess`, which the zygote
tells the pid and, once it has reaped the process, the exit code.
"""
from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import select
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from multiprocessing import popen_spawn_posix, reduction, resource_tracker, spawn
from multiprocessing import util as mp_util

# Where a process can fork and pass descriptors over a Unix socket. A frozen executable has no
# ``-c`` program for the spawn prelude; elsewhere (Windows) each accessor process is spawned.
AVAILABLE = (os.name == "posix" and hasattr(os, "fork") and hasattr(socket, "send_fds")
             and not getattr(sys, "frozen", False))

# Run by the spawned zygote before anything else, the user's script included (see _QuietSpawn).
_SPAWN_PRELUDE = ("import gc, signal; gc.disable(); "
                  "signal.signal(signal.SIGINT, signal.SIG_IGN); "
                  "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); ")


class _QuietSpawnPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn (a fresh interpreter that imports the user's script again and
    unpickles the process), with ``_SPAWN_PRELUDE`` run first: ``_launch`` is the standard
    library's, the command line apart."""

    def _launch(self, process_obj):
        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep_data = spawn.get_preparation_data(process_obj._name)  # pylint: disable=protected-access
        fp = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, fp)
            reduction.dump(process_obj, fp)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            program = cmd.index("-c") + 1
            cmd[program] = _SPAWN_PRELUDE + cmd[program]
            self._fds.extend([child_r, child_w])
            # Started with SIGINT blocked (the prelude ignores it, then unblocks it), as the
            # resource tracker is: a Ctrl-C before the prelude ran is not a KeyboardInterrupt in
            # the new interpreter. Here it waits until the mask is restored.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
            try:
                self.pid = mp_util.spawnv_passfds(spawn.get_executable(), cmd, self._fds)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            self.finalizer = mp_util.Finalize(
                self, mp_util.close_fds,
                [fd for fd in (parent_r, parent_w) if fd is not None])
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class _QuietSpawn(multiprocessing.context.SpawnProcess):
    """The zygote's own start: spawned as PopTorch spawns an accessor process, a fresh interpreter
    that imports the user's script again, but with Python's cyclic garbage collector off (a fifth
    of the time torch and torchvision take to import goes to collections, which free little: about
    9,000 objects of 340,000) and Ctrl-C ignored from its first line (the host owns shutdown).
    The processes it forks inherit both; an accessor process turns the collector on once its
    dataset is loaded, after freezing what was made so far (``gc.freeze``: never scanned again, so
    the DataLoader workers it forks do not copy those pages by collecting)."""

    @staticmethod
    def _Popen(process_obj):
        return _QuietSpawnPopen(process_obj)


# ---- the request: a pickle and the descriptors it refers to ----------------------------------

_HEADER = struct.Struct("!QI")  # pickle size, descriptor count
_STATUS = struct.Struct("!q")  # a pid, then an exit code
_FDS_PER_MESSAGE = 250  # (Linux passes at most 253 descriptors in one message)

# In a forked process: the descriptors that came with its process object.
_INHERITED: list[int] = []


class _InheritedFd:
    """A descriptor of the pickle, by its place among those sent beside it."""

    def __init__(self, index: int):
        self.index = index

    def detach(self) -> int:
        return _INHERITED[self.index]


class _Descriptors:
    """Stands in for a spawning Popen while the request is pickled: the descriptors the pickle
    refers to (``reduction.DupFd``: pipes, sockets, files, shared tensors) are listed, to be sent
    beside the pickle, and replaced by their place in the list. As with spawn, they are not
    duplicated: the objects pickled keep them open until the request is sent."""

    DupFd = _InheritedFd

    def __init__(self):
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return len(self.fds) - 1


def _send(sock: socket.socket, payload, fds: list[int]) -> None:
    """The header, the descriptors (in messages of at most _FDS_PER_MESSAGE, one byte each), the
    pickle."""
    sock.sendall(_HEADER.pack(len(payload), len(fds)))
    for start in range(0, len(fds), _FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"F"], fds[start:start + _FDS_PER_MESSAGE])
    sock.sendall(payload)


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes; None if the host closed its end before the first."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            if not data:
                return None
            raise EOFError("the host closed the zygote's socket in the middle of a request")
        data += chunk
    return bytes(data)


def _receive(sock: socket.socket):
    """The next request (pickle, descriptors), or None once the host has closed its end."""
    header = _exactly(sock, _HEADER.size)
    if header is None:
        return None
    size, count = _HEADER.unpack(header)
    fds: list[int] = []
    while len(fds) < count:
        data, received, _, _ = socket.recv_fds(sock, 1, _FDS_PER_MESSAGE)
        if not data:
            raise EOFError("the host closed the zygote's socket in the middle of a request")
        fds += received
    payload = _exactly(sock, size) if size else b""
    if payload is None:
        raise EOFError("the host closed the zygote's socket in the middle of a request")
    return payload, fds


# ---- the zygote process ------------------------------------------------------------------------

def _write_status(fd: int, value: int) -> None:
    try:
        os.write(fd, _STATUS.pack(value))
    except OSError:
        pass  # the host is gone or has stopped listening


def _serve(requests: socket.socket) -> None:
    """The zygote's loop: fork a process for each request and write its pid to the request's status
    pipe, then its exit code once reaped; stop once the host has closed its end and every process
    forked has been reaped."""
    from . import phases  # (imported with the user's script, when it imports poptorch_lite)
    phases.ROLE = "zygote"
    phases.mark("zygote:ready")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # a child's exit wakes the selector
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (SIG_IGN would reap children unseen)
    statuses: dict[int, int] = {}  # pid -> the status pipe of its request
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    listening = True
    while listening or statuses:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                continue
            try:
                request = _receive(requests)
            except (EOFError, ConnectionError):
                request = None
            if request is None:
                listening = False
                selector.unregister(requests)
                requests.close()
                continue
            payload, fds = request
            try:
                pid = os.fork()
            except OSError as error:  # the host finds the status pipe closed: exit code 255
                print(f"AsynchronousDataAccessor zygote: cannot fork: {error}", file=sys.stderr)
                pid = None
            if pid == 0:
                _run_forked(payload, fds, selector, [wake_r, wake_w, *statuses.values()])
            for fd in fds[1:]:
                os.close(fd)
            if pid is None:
                os.close(fds[0])
                continue
            _write_status(fds[0], pid)
            statuses[pid] = fds[0]
        while statuses:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            fd = statuses.pop(pid, None)
            if fd is not None:
                _write_status(fd, os.waitstatus_to_exitcode(status))
                os.close(fd)
    # Done: end without the interpreter's teardown (torch's alone is 0.4 s), which the host, closing
    # the zygote with its last accessor, would wait for. The zygote holds nothing to clean up; the
    # processes it forked end the same way, as those of a fork server do.
    phases.mark("zygote:exit")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _run_forked(payload: bytes, fds: list[int], selector, zygote_fds: list[int]) -> None:
    """The forked process: drop the zygote's descriptors, unpickle the process object and run it as
    multiprocessing runs a child (``_bootstrap``: its finalizers, after-fork hooks, exit code);
    exit with its status, never back into the zygote's loop."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for key in list(selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
        selector.close()
        for fd in (*zygote_fds, fds[0]):
            os.close(fd)
        _INHERITED[:] = fds[1:]
        request = io.BytesIO(payload)
        spawn.prepare(pickle.load(request))  # the host's sys.path, working directory, argv, ...
        process_obj = pickle.load(request)
        code = process_obj._bootstrap()  # pylint: disable=protected-access
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # pylint: disable=broad-except
                pass
        os._exit(code)


# ---- the host's side ---------------------------------------------------------------------------

class ForkedProcess:
    """The host's handle on a process the zygote forked: what an accessor uses of a
    ``multiprocessing.Process`` (``pid``, ``exitcode``, ``is_alive``, ``join``, ``terminate``,
    ``kill``, ``close``). Until the zygote has forked it (the zygote may still be importing the
    script), it counts as alive and ``pid`` waits for the fork. ``status_lost``: the zygote ended
    (or could not fork) without telling the exit code; a process it had forked may then still be
    running, and stops by itself once it finds its parent gone."""

    def __init__(self, status_fd: int):
        self._status = status_fd
        self._pid: int | None = None
        self.exitcode: int | None = None
        self.status_lost = False
        self.on_pid = None   # called with the pid when the host learns it (it never waits for it)

    def _read(self, timeout: float | None) -> bool:
        """Read the next status (pid, then exit code) if it comes within `timeout` seconds."""
        if self._status is None or self.exitcode is not None:
            return False
        if not select.select([self._status], [], [], timeout)[0]:
            return False
        data = os.read(self._status, _STATUS.size)
        if len(data) < _STATUS.size:  # the zygote ended without telling: the status is lost
            self.exitcode = 255  # (as multiprocessing's forkserver reports it)
            self.status_lost = True
            return True
        value = _STATUS.unpack(data)[0]
        if self._pid is None:
            self._pid = value
            if self.on_pid is not None:
                self.on_pid(value)
        else:
            self.exitcode = value
        return True

    @property
    def pid(self) -> int | None:
        while self._pid is None and self.exitcode is None and self._status is not None:
            self._read(None)
        return self._pid

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None and self._status is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._read(left):
                return

    def is_alive(self) -> bool:
        self.join(0)
        return self.exitcode is None and self._status is not None

    def _signal(self, signum: int) -> None:
        pid = self.pid
        if pid and self.is_alive():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        if self._status is not None:
            os.close(self._status)
            self._status = None


class Zygote:
    """The spawned zygote of one host process and the socket its requests go through."""

    def __init__(self):
        host_end, zygote_end = socket.socketpair()
        self._process = _QuietSpawn(target=_serve, args=(zygote_end,),
                                    name="AsynchronousDataAccessor zygote", daemon=False)
        try:
            self._process.start()
        finally:
            zygote_end.close()
        self._socket = host_end
        self._owner = os.getpid()
        self._lock = threading.Lock()

    def usable(self) -> bool:
        """Whether requests can go to it: in the process that started it, and still running."""
        return os.getpid() == self._owner and self._socket is not None and self._process.is_alive()

    def fork(self, process_obj: multiprocessing.context.SpawnProcess) -> ForkedProcess:
        """Have the zygote fork a process that runs `process_obj` (not started), pickled here as
        spawn would pickle it (errors are raised here), its descriptors sent with it."""
        descriptors = _Descriptors()
        buffer = io.BytesIO()
        multiprocessing.context.set_spawning_popen(descriptors)
        try:
            # as spawn sends them: the host's state to take on (its working directory may have
            # changed since the zygote started), then the process
            reduction.dump(spawn.get_preparation_data(process_obj.name), buffer)
            reduction.dump(process_obj, buffer)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                if self._socket is None:  # closed by another thread since it was found running
                    raise BrokenPipeError("the zygote was closed")
                _send(self._socket, buffer.getbuffer(), [status_w, *descriptors.fds])
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        return ForkedProcess(status_r)

    def join(self, timeout: float | None) -> None:
        self._process.join(timeout)

    def close(self) -> None:
        """Ask it to stop (it ends once the processes it forked have ended) and wait a little."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            if self._socket is None:
                return
            self._socket.close()
            self._socket = None
        self._process.join(5)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)


_ZYGOTE: Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def fork(process_obj: multiprocessing.context.SpawnProcess) -> ForkedProcess:
    """Run `process_obj` (a spawn-context process, not started) as a fork of this host process's
    zygote, spawning the zygote first if there is none yet (or it has ended)."""
    global _ZYGOTE  # pylint: disable=global-statement
    for attempt in range(2):
        with _ZYGOTE_LOCK:
            if _ZYGOTE is None or not _ZYGOTE.usable():
                _ZYGOTE = Zygote()
            zygote = _ZYGOTE
        try:
            return zygote.fork(process_obj)
        except (BrokenPipeError, ConnectionResetError):
            if attempt:
                raise
            zygote.join(1)  # it ended since it was found running: start another


def close() -> None:
    """Stop this host process's zygote, if it has one."""
    global _ZYGOTE  # pylint: disable=global-statement
    with _ZYGOTE_LOCK:
        zygote, _ZYGOTE = _ZYGOTE, None
    if zygote is not None:
        zygote.close()
