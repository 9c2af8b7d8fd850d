"""Host threads running the emulated IPUs of a step: the thread team (ipusim.device.host_threads),
how many threads a model's calls use (Emulator.setHostThreads, "auto" measuring one thread
against all cores), BLAS's threads shared among them, and results that do not depend on it."""
import gc
import signal
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.device import blas
from ipusim.device.host_threads import HostThreads
from ipusim.ops import elementwise as ew
from ipusim.schedules.core import Op, Step
from poptorch_lite.runtime import step_threads
from poptorch_lite.runtime.step_threads import StepThreads
from tutorial_model import Network, TrainingModelWithLoss


def helpers_named(name):
    return [t for t in threading.enumerate() if t.name.startswith(name + "-")]


# ---- the team --------------------------------------------------------------------------------
def test_map_gives_every_result_in_order_and_shares_the_parts():
    team = HostThreads(2, "team-order")
    ran_on = []

    both_busy = threading.Barrier(2, timeout=60)

    def part(x):
        ran_on.append(threading.get_ident())
        if x < 2:  # the first two parts wait for each other: two threads hold them
            both_busy.wait()
        return x * x

    assert team.map(part, range(20)) == [x * x for x in range(20)]
    assert len(set(ran_on)) == 2
    assert team.map(part, []) == []
    assert team.map(part, [3]) == [9]
    team.shutdown()


def test_the_first_exception_is_raised_once_every_thread_has_stopped():
    team = HostThreads(2, "team-error")
    finished = []

    def part(x):
        time.sleep(0.001)
        if x == 3:
            raise KeyError("part 3")
        finished.append(x)
        return x

    with pytest.raises(KeyError, match="part 3"):
        team.map(part, range(8))
    assert 3 not in finished
    assert team.map(lambda x: x + 1, range(4)) == [1, 2, 3, 4]  # the team still works
    team.shutdown()


def test_a_map_made_inside_a_map_runs_in_its_own_thread():
    team = HostThreads(2, "team-nested")

    def outer(x):
        me = threading.get_ident()
        inner = team.map(lambda y: (y, threading.get_ident()), range(3))
        assert {ident for _, ident in inner} == {me}
        return x

    assert team.map(outer, range(4)) == list(range(4))
    team.shutdown()


def test_helpers_stop_on_shutdown_and_when_the_team_is_dropped():
    team = HostThreads(3, "team-stop")
    team.map(lambda x: x, range(4))
    helpers = helpers_named("team-stop")
    assert len(helpers) == 2
    team.shutdown()
    for t in helpers:
        t.join(timeout=60)
        assert not t.is_alive()
    assert team.map(lambda x: -x, range(3)) == [0, -1, -2]  # helpers start again
    dropped = helpers_named("team-stop")
    del team
    gc.collect()
    for t in dropped:
        t.join(timeout=60)
        assert not t.is_alive()


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_an_interrupt_while_waiting_for_a_helper_leaves_a_team_that_still_works():
    """Ctrl-C reaches the caller once its own part is done and it waits for the helper, which is
    still on its part: the team is stopped (its helper finishes that part and ends), and the next
    map starts a new helper."""
    team = HostThreads(2, "team-interrupt")
    caller, map_code = threading.main_thread().ident, HostThreads.map.__code__
    helper_busy, caller_done, interrupted = threading.Event(), threading.Event(), threading.Event()
    helper = []

    def interrupt(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    def part(x):
        if threading.get_ident() == caller:  # returns once the helper holds the other part
            assert helper_busy.wait(60)
            caller_done.set()
            return
        helper.append(threading.current_thread())
        helper_busy.set()
        assert caller_done.wait(60)
        deadline = time.monotonic() + 60
        # once its part is done, the caller is back in map only to wait for the helpers
        while sys._current_frames()[caller].f_code is not map_code:  # pylint: disable=protected-access
            assert time.monotonic() < deadline, "the caller never waited for the helper"
            time.sleep(0.001)
        signal.pthread_kill(caller, signal.SIGUSR1)
        assert interrupted.wait(60)  # still on its part when the interrupt lands

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            team.map(part, range(2))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    (interrupted_helper, ) = helper
    interrupted_helper.join(60)  # the team was stopped: its helper finishes its part and ends
    assert not interrupted_helper.is_alive()
    assert team.map(lambda x: 2 * x, range(6)) == [0, 2, 4, 6, 8, 10]
    assert [t for t in helpers_named("team-interrupt") if t is not interrupted_helper]
    team.shutdown()


@pytest.mark.parametrize("threads", [0, -1, True, 1.5, "2"])
def test_a_thread_count_must_be_a_positive_int(threads):
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        HostThreads(threads)


@pytest.mark.skipif(blas._OPENBLAS is None, reason="needs NumPy's OpenBLAS to read its thread count")
def test_threads_running_programs_at_once_share_blas_s_threads():
    g = ip.Graph(ip.Target.test(4))
    x = g.addVariable("float32", (8,), "x")
    g.map_linearly(x)
    prog = ip.Sequence()
    ew.unary(g, "tanh", x, prog)
    e = ip.Engine(g, prog).load()
    get = blas._OPENBLAS[0]
    before = get()
    seen = []
    with e.running(2):
        seen.append(get())
        team = HostThreads(2, "team-blas")
        # a helper entering the engine inside the caller's block keeps the caller's setting
        team.map(lambda _: (e.execute(0), seen.append(get())), range(4))
        team.shutdown()
    assert seen == [max(1, blas.THREADS // 2)] * 5
    assert get() == before
    e.close()


# ---- how many threads a model's calls use ------------------------------------------------------
def schedule(*widths):
    """A schedule whose steps keep `widths` IPUs busy (one forward each)."""
    return SimpleNamespace(steps=[Step(tuple(Op("F", ipu, 0, ipu, 0, 0) for ipu in range(w)), 0) for w in widths])


def calls(policy, times, n=6):
    """Run n calls whose wall time on k threads is times[k] (a number, or a list taken in turn);
    the threads of each call."""
    used = []
    for _ in range(n):
        k = policy.for_call()
        t = times[k] if not isinstance(times[k], list) else times[k].pop(0)
        used.append(k)
        policy.ran(k, t)
    return used


def test_auto_times_one_thread_then_all_cores_and_keeps_the_faster(monkeypatch):
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 2)
    policy = StepThreads("auto", schedule(1, 2, 2, 1))
    assert calls(policy, {1: 1.0, 2: 0.8}) == [1, 1, 2, 2, 2, 2]  # call 0 compiles: not timed
    assert policy.chosen == 2
    policy = StepThreads("auto", schedule(1, 2, 2, 1))
    assert calls(policy, {1: 1.0, 2: 1.3}) == [1, 1, 2, 1, 1, 1]  # clearly slower: one round
    assert policy.chosen == 1
    policy.shutdown()


def test_auto_times_more_rounds_when_the_first_is_close_and_keeps_each_shortest_time(monkeypatch):
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 2)
    # not 5% faster in any of three rounds: one thread
    policy = StepThreads("auto", schedule(1, 2, 2, 1))
    assert calls(policy, {1: 1.0, 2: 0.97}, n=9) == [1, 1, 2, 1, 2, 1, 2, 1, 1]
    assert policy.chosen == 1
    # the threaded call of round one was slowed (say, a loader starting its workers meanwhile):
    # round two shows the threads 20% faster
    policy = StepThreads("auto", schedule(1, 2, 2, 1))
    assert calls(policy, {1: [1.0, 1.0, 1.0], 2: [1.02, 0.8, 0.8, 0.8]}) == [1, 1, 2, 1, 2, 2]
    assert policy.chosen == 2
    policy.shutdown()


def test_auto_uses_one_thread_where_no_step_has_two_ops_or_there_is_one_core(monkeypatch):
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 4)
    assert StepThreads("auto", schedule(1, 1, 1)).chosen == 1
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 1)
    assert StepThreads("auto", schedule(2, 2)).chosen == 1


def test_auto_tries_no_more_threads_than_the_widest_step_has_ops(monkeypatch):
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 16)
    assert calls(StepThreads("auto", schedule(1, 3, 2, 1)), {1: 1.0, 3: 0.5}) == [1, 1, 3, 3, 3, 3]
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 2)
    assert calls(StepThreads("auto", schedule(1, 3, 2, 1)), {1: 1.0, 2: 0.5}) == [1, 1, 2, 2, 2, 2]


def test_a_fixed_count_is_used_on_every_call(monkeypatch):
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 2)
    policy = StepThreads(3, schedule(2, 2))
    assert calls(policy, {3: 1.0}) == [3] * 6
    assert policy.team(3).threads == 3
    assert policy.team(1) is None
    policy.shutdown()


def test_options_take_a_count_or_auto(monkeypatch):
    assert poptorch.Options().Emulator.host_threads == "auto"
    assert poptorch.Options().Emulator.setHostThreads(3).host_threads == 3
    assert poptorch.Options().Emulator.setHostThreads("auto").host_threads == "auto"
    for bad in (0, "two", 2.0, True):
        with pytest.raises(ValueError, match=r"Emulator.setHostThreads expects an int >= 1 or 'auto'"):
            poptorch.Options().Emulator.setHostThreads(bad)
    monkeypatch.setenv("IPUSIM_HOST_THREADS", "2")
    assert poptorch.Options().Emulator.host_threads == 2
    monkeypatch.setenv("IPUSIM_HOST_THREADS", "many")
    with pytest.raises(ValueError, match="IPUSIM_HOST_THREADS expects an int >= 1 or 'auto', got 'many'"):
        poptorch.Options()


# ---- results do not depend on the threads ------------------------------------------------------
def train(threads, calls=4):
    torch.manual_seed(0)
    net = Network()
    net.layer3_dropout.p = 0.0
    model = TrainingModelWithLoss(net)
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(8)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(*[poptorch.Stage(f"B{s + 1}").ipu(s) for s in range(4)]))
    opts.Emulator.setHostThreads(threads)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(calls):
        x, y = torch.randn(2 * 8 * 4, 1, 28, 28, generator=g), torch.randint(0, 10, (2 * 8 * 4,), generator=g)
        losses.append(training(x, y)[1].clone())
    chosen = training._threads.chosen
    training.destroy()
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}, chosen


@pytest.mark.slow
def test_training_gives_the_same_bits_on_one_two_or_auto_threads():
    """The same bits whatever the threads. With "auto" the choice is made after at most
    step_threads.ROUNDS rounds of one timed call on each of its two candidates, after the call
    that compiles: that many calls make it whatever the timings (a busy machine blurs them)."""
    calls = 1 + 2 * step_threads.ROUNDS
    losses, params, chosen = train(1, calls)
    assert chosen == 1
    for threads in (2, "auto"):
        other_losses, other_params, chosen = train(threads, calls)
        assert chosen in ((1, 2) if threads == "auto" else (2,))
        torch.testing.assert_close(other_losses, losses, rtol=0, atol=0)
        for name, value in params.items():
            np.testing.assert_array_equal(other_params[name].numpy(), value.numpy(), err_msg=name)


@pytest.mark.skipif(blas._OPENBLAS is None, reason="needs NumPy's OpenBLAS to read its thread count")
def test_a_product_too_small_to_split_runs_on_one_blas_thread(monkeypatch):
    get, set_ = blas._OPENBLAS
    before = get()
    seen = []
    real = np.matmul
    monkeypatch.setattr(blas.np, "matmul", lambda *a, **k: (seen.append(get()), real(*a, **k))[1])
    side = 16
    while 2 * side ** 3 < blas.SMALL_GEMM_FLOPS:
        side *= 2
    small, large = np.ones((3, 16, 16), np.float32), np.ones((side, side), np.float32)
    set_(2)
    try:
        np.testing.assert_array_equal(blas.matmul(small, small), real(small, small))   # stacked: per matrix
        out = np.empty((side, side), np.float32)
        assert blas.matmul(large, large, out=out) is out
        assert seen == [1, 2] and get() == 2
    finally:
        set_(before)
