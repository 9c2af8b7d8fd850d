"""The data path under faults: nothing lost, nothing leaked, nothing left running.

Every scenario runs a real loader (in a subprocess where the process's own exit is what is
tested) and checks three things: the batches or the error the user sees, that no process is left
behind, and that Python's resource tracker has nothing to clean up (it prints "leaked semaphore
objects" when a process ends with multiprocessing semaphores still registered).
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import poptorch_lite as poptorch
from poptorch_lite.api.data import DataLoader
from poptorch_lite.api.enums import DataLoaderMode, SharingStrategy
from poptorch_lite.api.options import Options
from start_method_probe import StartMethodProbe

TESTS = os.path.dirname(os.path.abspath(__file__))
ASYNC_MODES = [DataLoaderMode.Async, DataLoaderMode.AsyncRebatched]


class Squares(torch.utils.data.Dataset):
    """Sample i is (tensor([i, i * i]), tensor(i))."""

    def __init__(self, length, broken=None):
        self.length, self.broken = length, broken

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if index == self.broken:
            raise ValueError(f"sample {index} cannot be decoded")
        return torch.tensor([index, index * index]), torch.tensor(index)


def batches(loader):
    return [y.tolist() for _, y in loader]


@pytest.mark.parametrize("mode", ASYNC_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("strategy", [SharingStrategy.Fork, SharingStrategy.FileSystem], ids=lambda s: s.name)
def test_async_loader_iterated_inline_gives_every_batch_in_order(mode, strategy):
    """`for x in DataLoader(...)` with the loader bound to no name: the same batches as Sync."""
    opts = Options().deviceIterations(2)
    expected = batches(DataLoader(opts, Squares(40), batch_size=3))
    got = [y.tolist() for _, y in DataLoader(Options().deviceIterations(2), Squares(40), batch_size=3,
                                               mode=mode, async_options={"sharing_strategy": strategy})]
    assert got == expected and len(got) == 40 // 6


def test_terminating_mid_epoch_is_an_error_not_a_short_epoch():
    loader = DataLoader(Options(), Squares(40), batch_size=2, mode=DataLoaderMode.Async,
                        async_options={"sharing_strategy": SharingStrategy.Fork})
    epoch = iter(loader)
    next(epoch)
    loader.terminate()
    with pytest.raises(RuntimeError, match="terminated during an epoch, after 1 item"):
        next(epoch)


def test_loader_workers_in_the_accessor_process_are_forked_unless_the_user_chose():
    """The accessor's own process is spawned; the torch workers of the loader it iterates start
    by fork, as they would in the user's process, but a multiprocessing_context is honoured."""
    forked = DataLoader(Options(), StartMethodProbe(), batch_size=1, num_workers=2, mode=DataLoaderMode.Async)
    assert [int(x) for x in forked] == [1, 1, 1, 1]
    forked.terminate()
    spawned = DataLoader(Options(), StartMethodProbe(), batch_size=1, num_workers=2, mode=DataLoaderMode.Async,
                         multiprocessing_context="spawn")
    assert [int(x) for x in spawned] == [0, 0, 0, 0]
    spawned.terminate()


@pytest.mark.parametrize("mode", [DataLoaderMode.Sync, DataLoaderMode.Async], ids=lambda m: m.name)
def test_a_failing_sample_names_itself_and_stops_the_epoch(mode):
    loader = DataLoader(Options(), Squares(40, broken=13), batch_size=2, num_workers=2, mode=mode,
                        async_options={"sharing_strategy": SharingStrategy.Fork} if mode != DataLoaderMode.Sync
                        else None)
    start = time.monotonic()
    with pytest.raises(ValueError, match="sample 13 cannot be decoded"):
        for _ in loader:
            pass
    assert time.monotonic() - start < 20
    if mode != DataLoaderMode.Sync:
        loader.terminate()


IMPORTS_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import poptorch_lite as poptorch
    from start_method_probe import ImportProbe, emulator_modules

    if __name__ == "__main__":
        print("host", emulator_modules())
        loader = poptorch.DataLoader(poptorch.Options(), ImportProbe(), batch_size=None,
                                     mode=poptorch.DataLoaderMode.Async)
        print("accessor", next(iter(loader)))
""")


def test_the_accessor_process_imports_what_the_dataset_needs_not_the_emulator(tmp_path):
    """The spawned accessor process imports the user's script again, and with it poptorch_lite:
    that brings in the DataLoader, not the emulator, Numba or the compiler (seconds of imports
    before the first batch). The host imports them only when it builds a model."""
    script = tmp_path / "imports.py"
    script.write_text(IMPORTS_SCRIPT.format(tests=TESTS))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.split("\n")[:2] == ["host []", "accessor []"], done.stdout + done.stderr


# ---- whole processes: exits, interrupts, deaths ------------------------------------------------
SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    import poptorch_lite as poptorch
    from test_data_faults import Squares

    class Slow(Squares):
        def __getitem__(self, index):
            time.sleep(0.02)
            return super().__getitem__(index)

    if __name__ == "__main__":
        how, workers = sys.argv[1], int(sys.argv[2])
        opts = poptorch.Options().deviceIterations(2)
        loader = poptorch.DataLoader(opts, Slow(400), batch_size=4, num_workers=workers,
                                     mode=poptorch.DataLoaderMode.Async)
        count = 0
        for x, y in loader:
            count += 1
            if count == 3:
                print("pids", os.getpid(), flush=True)
                if how == "break":
                    break
                if how == "raise":
                    raise ValueError("the training loop failed")
                if how in ("sigint", "hold"):
                    time.sleep(60)
        print("batches", count, flush=True)
""")


def run_script(tmp_path, how, workers, **kw):
    """The script in a subprocess: its stdout a pipe, its stderr the file tmp_path/stderr.txt."""
    script = tmp_path / "loader_script.py"
    script.write_text(SCRIPT.format(tests=TESTS))
    with open(tmp_path / "stderr.txt", "w", encoding="utf-8") as err:
        return subprocess.Popen([sys.executable, str(script), how, str(workers)], stdout=subprocess.PIPE,
                                stderr=err, text=True, **kw)


def finish(process, tmp_path, timeout):
    """Wait for the script; its whole stdout and stderr."""
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL) if hasattr(os, "killpg") else process.kill()
    return process.stdout.read(), (tmp_path / "stderr.txt").read_text()


def descendants(pid):
    """Every live process below `pid` (children, their children, ...)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,stat="], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    table = [line.split() for line in out if line.strip()]
    children = {}
    for p, parent, stat in table:
        if not stat.startswith("Z"):
            children.setdefault(int(parent), []).append(int(p))
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for_pids_line(process, tmp_path):
    line = process.stdout.readline()
    assert line.startswith("pids"), line + (tmp_path / "stderr.txt").read_text()
    return int(line.split()[1])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["normal", "break", "raise", "sigint"])
def test_sixteen_workers_leave_nothing_to_clean_up(tmp_path, how):
    """A normal exit, `break`, an exception in the user's loop and Ctrl-C: no resource tracker
    warning, no process left, and within seconds."""
    process = run_script(tmp_path, how, 16, start_new_session=True)
    if how != "normal":
        host = wait_for_pids_line(process, tmp_path)
        if how == "sigint":
            os.killpg(host, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
    out, err = finish(process, tmp_path, 90)
    assert "resource_tracker" not in err and "leaked" not in err, err
    if how == "normal":
        assert process.returncode == 0 and "batches 50" in out, err
    elif how == "break":
        assert process.returncode == 0 and "batches 3" in out, err
    elif how == "raise":
        assert process.returncode == 1 and "the training loop failed" in err
    else:
        assert "KeyboardInterrupt" in err
    time.sleep(0.5)
    assert not descendants(process.pid)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_loader_processes_die_with_their_host(tmp_path, sig):
    """When the host dies, its accessor process and the DataLoader workers below it are gone
    within 5 s, and nothing is left for the resource tracker."""
    process = run_script(tmp_path, "hold", 4, start_new_session=True)
    host = wait_for_pids_line(process, tmp_path)
    below = descendants(host)
    assert len(below) >= 5  # the accessor process and its 4 DataLoader workers (and the tracker)
    os.kill(host, sig)
    process.wait(timeout=10)
    deadline = time.monotonic() + 5
    while any(alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in below if alive(p)]
    assert "leaked" not in finish(process, tmp_path, 10)[1]


@pytest.mark.slow
def test_a_killed_dataloader_worker_in_the_accessor_process_is_reported(tmp_path):
    loader = DataLoader(Options(), SlowSquares(400), batch_size=2, num_workers=2, mode=DataLoaderMode.Async)
    epoch = iter(loader)
    next(epoch)
    accessor_pid = loader._accessor._process.pid
    victim = descendants(accessor_pid)[0]
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"DataLoader worker \\(pid {victim}\\) is killed by signal"):
        for _ in epoch:
            pass
    assert time.monotonic() - start < 15
    loader.terminate()
    assert not alive(accessor_pid)


class SlowSquares(Squares):
    def __getitem__(self, index):
        time.sleep(0.02)
        return super().__getitem__(index)


def test_poptorch_name_is_the_same_loader():
    assert poptorch.DataLoader is DataLoader


FORKED_AFTER_PARALLEL_WORK = textwrap.dedent("""
    import torch
    import poptorch_lite as poptorch

    class Numbers(torch.utils.data.Dataset):
        def __len__(self):
            return 200000

        def __getitem__(self, index):
            return torch.tensor([index])

    if __name__ == "__main__":
        torch.randn(2000, 2000) @ torch.randn(2000, 2000)  # the host's intra-op threads have run
        loader = poptorch.DataLoader(poptorch.Options(), Numbers(), batch_size=1000, shuffle=True,
                                     mode=poptorch.DataLoaderMode.Async,
                                     async_options={"sharing_strategy": poptorch.SharingStrategy.Fork})
        print("batches", sum(1 for _ in loader))
""")


def test_a_forked_accessor_does_not_hang_in_torch_after_the_host_ran_parallel_ops(tmp_path):
    """A forked process inherits a broken intra-op thread pool: the accessor runs torch with one
    thread, as torch's own DataLoader workers do (the shuffle's randperm hung before)."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED_AFTER_PARALLEL_WORK)
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert "batches 200" in out, err
