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

from poptorch_lite.api import zygote
from poptorch_lite.api.data import AsynchronousDataAccessor
from poptorch_lite.api.enums import SharingStrategy

pytestmark = pytest.mark.skipif(not zygote.AVAILABLE, reason="the zygote needs fork and descriptor passing")


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


def wait_gone(pid: int, seconds: float = 10) -> bool:
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
    exits.join(30)
    assert exits.exitcode == 3 and not exits.is_alive()
    sleeps = zygote.fork(context.Process(target=sleep_long))
    assert sleeps.is_alive() and sleeps.pid > 0
    sleeps.kill()
    sleeps.join(30)
    assert sleeps.exitcode == -signal.SIGKILL
    for process in (exits, sleeps):
        process.close()
    zygote.close()
    assert not multiprocessing.active_children()


def test_a_zygote_that_died_is_replaced_by_a_new_one():
    first = AsynchronousDataAccessor(Indices())
    assert int(next(iter(first))) == 0
    dead = parent_of(first._process.pid)
    os.kill(dead, signal.SIGKILL)
    assert wait_gone(dead)
    # its accessor process, re-parented, finds its host gone from its view and stops: an error, not
    # a short epoch
    with pytest.raises(RuntimeError, match="AsynchronousDataAccessor worker process"):
        list(first)
    second = AsynchronousDataAccessor(Indices())
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
