"""The accessor zygote: the accessor processes of the spawning sharing strategies are forked from
one spawned interpreter per host process (poptorch_lite/api/zygote.py)."""
import multiprocessing
import os
import signal
import socket
import threading
import time

import pytest
import torch

from poptorch_lite.api import data, zygote
from poptorch_lite.api.data import AsynchronousDataAccessor
from poptorch_lite.api.enums import SharingStrategy

pytestmark = pytest.mark.skipif(not zygote.AVAILABLE, reason="the zygote needs fork and descriptor passing")
# Seconds allowed for a wait that includes the zygote's start: an interpreter importing torch,
# seconds of CPU, minutes on a loaded machine.
STARTS = 900


class Indices(torch.utils.data.Dataset):
    """Six samples; iterated as a sequence (the accessor iterates its source), it ends with
    IndexError."""

    def __len__(self):
        return 6

    def __getitem__(self, index):
        if index >= 6:
            raise IndexError(index)
        return torch.tensor([index])


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return int(stat.read().rpartition(")")[2].split()[1])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def exit_with(code: int) -> None:
    os._exit(code)  # pylint: disable=protected-access


def sleep_long() -> None:
    time.sleep(60)


def test_a_request_carries_its_pickle_and_descriptors_and_eof_ends_the_requests():
    host, server = socket.socketpair()
    server.settimeout(60)  # a sender that fails is a test failure, not a hang
    pipes = [os.pipe() for _ in range(300)]  # more descriptors than one message can pass
    payload = os.urandom(3 << 20)  # more than a socket buffer: sent while the other end reads
    sender = threading.Thread(target=zygote._send, args=(host, payload, [w for _, w in pipes]))
    sender.start()
    received, fds = zygote._receive(server)
    sender.join()
    assert received == payload and len(fds) == len(pipes)
    for i, fd in enumerate(fds):
        os.write(fd, b"through passed descriptor %d" % i)
    assert [os.read(r, 100) for r, _ in pipes] == [b"through passed descriptor %d" % i for i in range(300)]
    host.close()
    assert zygote._receive(server) is None
    for fd in (*[fd for pipe in pipes for fd in pipe], *fds):
        os.close(fd)
    server.close()


@pytest.mark.parametrize("strategy", [SharingStrategy.FileSystem, SharingStrategy.SharedMemory])
def test_the_accessors_of_a_host_are_forks_of_one_zygote_that_ends_with_the_last(strategy):
    first = AsynchronousDataAccessor(Indices(), sharing_strategy=strategy)
    second = AsynchronousDataAccessor(Indices(), sharing_strategy=strategy)
    assert [int(x) for x in first] == list(range(6))
    assert [int(x) for x in second] == list(range(6))
    shared = parent_of(first._process.pid)
    assert shared == parent_of(second._process.pid) != os.getpid()
    assert parent_of(shared) == os.getpid()  # the zygote is the host's child
    first.terminate()
    assert alive(shared)  # the second accessor may still need it
    second.terminate()
    assert wait_gone(shared)
    assert not multiprocessing.active_children()


class ManyTensors(torch.utils.data.Dataset):
    """400 tensors of its own: with SharingStrategy.SharedMemory each is a descriptor sent to the
    accessor process."""

    def __init__(self):
        self.samples = [torch.full((3, ), float(i)) for i in range(400)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def test_a_dataset_of_hundreds_of_shared_tensors_reaches_its_accessor():
    with AsynchronousDataAccessor(ManyTensors(), sharing_strategy=SharingStrategy.SharedMemory) as accessor:
        assert [float(x[0]) for x in accessor] == [float(i) for i in range(400)]


def test_the_zygote_tells_each_forked_process_exit_code_and_signal():
    context = multiprocessing.get_context("spawn")
    exits = zygote.fork(context.Process(target=exit_with, args=(3, )))
    exits.join(STARTS)
    assert exits.exitcode == 3 and not exits.is_alive()
    sleeps = zygote.fork(context.Process(target=sleep_long))
    assert sleeps.is_alive() and sleeps.pid > 0
    sleeps.kill()
    sleeps.join(60)
    assert sleeps.exitcode == -signal.SIGKILL
    for process in (exits, sleeps):
        process.close()
    zygote.close()
    assert not multiprocessing.active_children()


def forked_process_told(*statuses: int) -> zygote.ForkedProcess:
    """A ForkedProcess whose zygote told it `statuses` (a pid, then an exit code) and ended."""
    status_r, status_w = os.pipe()
    for value in statuses:
        os.write(status_w, zygote._STATUS.pack(value))
    os.close(status_w)
    return zygote.ForkedProcess(status_r)


def test_a_forked_process_whose_zygote_ended_first_has_no_exit_code_to_report():
    told = forked_process_told(1234, -signal.SIGKILL)
    told.join()
    assert (told.pid, told.exitcode, told.status_lost) == (1234, -signal.SIGKILL, False)
    assert "(pid 1234) was killed by signal SIGKILL" in data._how_the_worker_ended(told)
    orphaned = forked_process_told(1234)  # forked, then the zygote died
    orphaned.join()
    assert not orphaned.is_alive() and orphaned.status_lost and orphaned.pid == 1234
    assert "(pid 1234) lost the zygote it was forked from, which ended first" in \
        data._how_the_worker_ended(orphaned)
    never = forked_process_told()  # the zygote died (or could not fork) before forking it
    assert never.pid is None and never.status_lost
    assert "was never started: its zygote ended (or could not fork it) first" in \
        data._how_the_worker_ended(never)
    for process in (told, orphaned, never):
        process.close()


def rest_of_epoch(accessor, received: list) -> None:
    """Append to `received` the items of the epoch under way up to its end (``next``: another
    ``iter`` would start a new epoch)."""
    while True:
        try:
            received.append(int(next(accessor)))
        except StopIteration:
            return


def test_a_zygote_that_died_leaves_a_whole_epoch_or_an_error_and_is_replaced():
    """The zygote killed after the first item: whether the accessor process had already sent the
    rest of the epoch when it saw its zygote gone is a matter of timing, so the host may receive
    the whole epoch or an error, but never a short or a repeated one."""
    first = AsynchronousDataAccessor(Indices())
    received = [int(next(iter(first)))]
    dead = parent_of(first._process.pid)
    os.kill(dead, signal.SIGKILL)
    assert wait_gone(dead)
    try:
        rest_of_epoch(first, received)
    except RuntimeError as error:
        assert "AsynchronousDataAccessor worker process" in str(error), error
        assert received == list(range(len(received))), received  # in order, none twice
    else:
        assert received == list(range(6))
    second = AsynchronousDataAccessor(Indices())
    assert [int(x) for x in second] == list(range(6))
    assert parent_of(second._process.pid) != dead
    first.terminate()
    second.terminate()
    assert not multiprocessing.active_children()


class Gated(torch.utils.data.Dataset):
    """Six samples; every sample but the first waits until the file `gate` exists (at most 60 s,
    then raises)."""

    def __init__(self, gate):
        self.gate = str(gate)

    def __len__(self):
        return 6

    def __getitem__(self, index):
        if index >= 6:
            raise IndexError(index)
        deadline = time.monotonic() + 60
        while index and not os.path.exists(self.gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.gate} was not created within 60 s")
            time.sleep(0.01)
        return torch.tensor([index])


def test_an_accessor_whose_zygote_died_mid_epoch_raises_instead_of_ending_it(tmp_path):
    """The accessor process cannot load past the first item before its zygote is killed: it sees
    its zygote gone and stops, and the host gets an error for the rest of the epoch, never a
    short epoch; a new accessor then works."""
    gate = tmp_path / "gate"
    first = AsynchronousDataAccessor(Gated(gate))
    epoch = iter(first)
    assert int(next(epoch)) == 0
    worker = first._process.pid
    dead = parent_of(worker)
    os.kill(dead, signal.SIGKILL)
    assert wait_gone(dead)
    assert wait_gone(worker)  # re-parented, it found its host gone from its view and stopped
    gate.touch()  # the samples could be loaded now, by a process that no longer runs
    with pytest.raises(RuntimeError, match=rf"worker process \(pid {worker}\) lost the zygote"):
        next(epoch)
    with pytest.raises(RuntimeError, match="AsynchronousDataAccessor worker process"):
        iter(first)  # and stays broken
    second = AsynchronousDataAccessor(Gated(gate))
    assert [int(x) for x in second] == list(range(6))
    assert parent_of(second._process.pid) != dead
    first.terminate()
    second.terminate()
    assert not multiprocessing.active_children()


class WorkingDirectory(torch.utils.data.Dataset):
    """One sample: the working directory of the process that loads it."""

    def __len__(self):
        return 1

    def __getitem__(self, index):
        if index >= 1:
            raise IndexError(index)
        return os.getcwd()


def test_a_forked_accessor_takes_on_the_host_state_a_spawned_one_would(tmp_path, monkeypatch):
    """Each fork takes the host's current spawn preparation (working directory, sys.path, ...),
    not the zygote's from when it started."""
    first = AsynchronousDataAccessor(Indices())
    assert int(next(iter(first))) == 0  # the zygote runs
    monkeypatch.chdir(tmp_path)
    second = AsynchronousDataAccessor(WorkingDirectory())
    assert list(second) == [str(tmp_path)]
    first.terminate()
    second.terminate()
