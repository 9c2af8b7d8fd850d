"""Executable cache (Options.enableExecutableCaching): keys, entries on disk, loading in another
process, damaged entries, directories, concurrent writers and the compile lock."""
import hashlib
import io
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import ipusim as ip
import poptorch_lite as poptorch
from ipusim.device.program import walk
from poptorch_lite.runtime import cache
from poptorch_lite.compiler.executable import target_of
from poptorch_lite.compiler.lowering import Lowering

HERE = os.path.dirname(os.path.abspath(__file__))


class TinyNet(nn.Module):
    def __init__(self, hidden=16, p=0.0):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, 4)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y=None):
        with poptorch.Block("A", ipu_id=0):
            h = self.drop(torch.relu(self.fc1(x)))
        with poptorch.Block("B", ipu_id=1):
            out = self.fc2(h)
            if y is None:
                return out
            return out, self.loss(out, y)


MICRO, ITERATIONS, ACCUMULATION = 2, 2, 4
BATCH = MICRO * ITERATIONS * ACCUMULATION


def tiny_options(cache_dir=None, mode="fast"):
    opts = poptorch.Options().deviceIterations(ITERATIONS)
    opts.Training.gradientAccumulation(ACCUMULATION)
    opts.Emulator.setMode(mode)
    if cache_dir is not None:
        opts.enableExecutableCaching(str(cache_dir))
    return opts


def tiny_training(cache_dir=None, seed=0, lr=0.1, mode="fast"):
    torch.manual_seed(seed)
    model = TinyNet()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, poptorch.trainingModel(model, tiny_options(cache_dir, mode), optimizer)


def tiny_batch(seed=1, batch=BATCH):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 8, generator=gen), torch.randint(0, 4, (batch,), generator=gen)


def first_call(executor, *args):
    """What the executor's first call does with caching on: compile or load, then run."""
    loaded = executor._compile_or_load(args, {})
    return loaded, executor(*args)


def entries(cache_dir):
    return sorted(f for f in os.listdir(cache_dir) if f.endswith(cache.SUFFIX))


def forbid_compiling(monkeypatch):
    """Make every compiler stage after the capture fail: a load must not reach them."""
    def fail(*args, **kwargs):
        raise AssertionError("the model was compiled although its executable is in the cache")
    monkeypatch.setattr(Lowering, "build", fail)
    monkeypatch.setattr(ip.Engine, "__init__", fail)
    monkeypatch.setattr("poptorch_lite.compiler.executable.to_ir", fail)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A tiny training model compiled (and saved) once for the tests that only read it."""
    cache_dir = tmp_path_factory.mktemp("cache")
    model, training = tiny_training(cache_dir, seed=5)
    first_call(training, *tiny_batch())
    (name,) = entries(cache_dir)
    return SimpleNamespace(model=model, training=training, executable=training._executable,
                           key=name[:-len(cache.SUFFIX)], entry=(cache_dir / name).read_bytes())


# ---- key ------------------------------------------------------------------------------------------
def tiny_key(model=None, opts=None, args=None, training=True, optimizer=None, target=None):
    model = model if model is not None else TinyNet()
    opts = opts if opts is not None else tiny_options()
    x, y = tiny_batch(batch=MICRO)
    args = args if args is not None else ((x, y) if training else (x,))
    if training and optimizer is None:
        optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return cache.cache_key(model, args, opts, target or target_of(opts), training, optimizer)


def test_key_ignores_weight_values_hyperparameters_and_host_options():
    base = tiny_key()
    torch.manual_seed(123)
    other = TinyNet()
    assert tiny_key(model=other) == base
    assert tiny_key(optimizer=poptorch.optim.SGD(other.parameters(), lr=0.5, momentum=0.3), model=other) == base
    host = tiny_options("/somewhere/else").randomSeed(5).logDir("/tmp/logs")
    host.Emulator.setHostThreads(2)
    assert tiny_key(opts=host) == base


def _changed(name):
    """One change of what shapes the compiled program, as tiny_key arguments."""
    x, y = tiny_batch(batch=MICRO)
    if name == "micro-batch shape":
        return {"args": tiny_batch(batch=MICRO + 1)}
    if name == "input dtype":
        return {"args": (x, y.to(torch.int32))}
    if name == "device iterations":
        return {"opts": tiny_options().deviceIterations(3)}
    if name == "gradient accumulation":
        opts = tiny_options()
        opts.Training.gradientAccumulation(6)
        return {"opts": opts}
    if name == "output mode":
        return {"opts": tiny_options().outputMode(poptorch.OutputMode.All)}
    if name == "replication":
        return {"opts": tiny_options().replicationFactor(2)}
    if name == "strategy":
        return {"opts": tiny_options().setExecutionStrategy(
            poptorch.ShardedExecution(poptorch.Stage("A").ipu(0), poptorch.Stage("B").ipu(1)))}
    if name == "tensor location":
        opts = tiny_options()
        opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
        return {"opts": opts}
    if name == "emulator mode":
        return {"opts": tiny_options(mode="strict")}
    if name == "emulator target":
        opts = tiny_options()
        opts.Emulator.setTarget("GC2")
        return {"opts": opts}
    if name == "target fields":
        return {"target": ip.Target.test(num_tiles=16)}
    if name == "inference":
        return {"training": False}
    if name == "optimizer type":
        model = TinyNet()
        return {"model": model, "optimizer": poptorch.optim.Adam(model.parameters())}
    if name == "momentum on/off":
        model = TinyNet()
        return {"model": model, "optimizer": poptorch.optim.SGD(model.parameters(), lr=0.1)}
    if name == "loss scaling":
        model = TinyNet()
        return {"model": model, "optimizer": poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                                   loss_scaling=4.0)}
    if name == "frozen parameter":
        model = TinyNet()
        model.fc1.weight.requires_grad_(False)
        return {"model": model}
    if name == "module setting":
        return {"model": TinyNet(p=0.25)}
    if name == "weight shapes":
        return {"model": TinyNet(hidden=12)}
    raise ValueError(name)


CHANGES = ["micro-batch shape", "input dtype", "device iterations", "gradient accumulation", "output mode",
           "replication", "strategy", "tensor location", "emulator mode", "emulator target", "target fields",
           "inference", "optimizer type", "momentum on/off", "loss scaling", "frozen parameter", "module setting",
           "weight shapes"]


@pytest.mark.parametrize("change", CHANGES)
def test_key_changes_with_what_shapes_the_program(change):
    assert tiny_key(**_changed(change)) != tiny_key()


def test_key_changes_with_software_versions(monkeypatch):
    base = tiny_key()
    monkeypatch.setattr(poptorch, "__version__", "999.0")
    assert tiny_key() != base
    monkeypatch.undo()
    monkeypatch.setattr("numba.__version__", "0.0.1")
    assert tiny_key() != base


def test_key_follows_blocks():
    class Moved(TinyNet):
        def forward(self, x, y=None):
            with poptorch.Block("A", ipu_id=0):
                h = self.drop(torch.relu(self.fc1(x)))
                out = self.fc2(h)
            with poptorch.Block("B", ipu_id=1):
                return out, self.loss(out, y)
    assert tiny_key(model=Moved()) != tiny_key()


def test_key_contents_are_plain_data_and_name_the_software():
    model = TinyNet()
    x, y = tiny_batch(batch=MICRO)
    opts = tiny_options()
    contents = cache.key_contents(model, (x, y), opts, target_of(opts), True,
                                  poptorch.optim.SGD(model.parameters(), lr=0.1))
    json.dumps(contents)
    assert contents["weights"]["fc1.weight"] == [[16, 8], "torch.float32", True]
    assert set(contents["software"]) == {"poptorch_lite", "sources", "python", "numpy", "numba", "torch"}
    assert "cachePath" not in contents["options"]["_Popart"]
    assert contents["optimizer"]["groups"][0]["layout"].startswith("Layout(")


# ---- entries --------------------------------------------------------------------------------------
def test_no_cache_path_compiles_without_the_cache(monkeypatch):
    monkeypatch.setattr(cache, "load", lambda *a: pytest.fail("looked in a cache that is off"))
    monkeypatch.setattr(cache, "store", lambda *a: pytest.fail("stored in a cache that is off"))
    _, training = tiny_training()
    loaded, _ = first_call(training, *tiny_batch())
    assert not loaded and training.isCompiled()


def test_loaded_executable_matches_a_fresh_compile(tmp_path, monkeypatch):
    """Weights and learning rate differ from the process that saved the entry: both come from the
    loading process (weights copied, hyperparameters written), as after a compile."""
    _, first = tiny_training(tmp_path, seed=0, lr=0.1)
    assert first_call(first, *tiny_batch())[0] is False
    assert len(entries(tmp_path)) == 1

    fresh_model, fresh = tiny_training(None, seed=7, lr=0.03)
    _, fresh_out = first_call(fresh, *tiny_batch())
    with monkeypatch.context() as m:
        forbid_compiling(m)
        model, cached = tiny_training(tmp_path, seed=7, lr=0.03)
        loaded, out = first_call(cached, *tiny_batch())
    assert loaded
    for a, b in zip(out, fresh_out):
        assert torch.equal(a, b)
    for (name, p), q in zip(model.named_parameters(), fresh_model.parameters()):
        assert torch.equal(p, q), name
    assert [s.cycles for s in cached.last_run.steps] == [s.cycles for s in fresh.last_run.steps]
    # later calls and setOptimizer work on the loaded executable as on a compiled one
    cached.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    fresh.setOptimizer(poptorch.optim.SGD(fresh_model.parameters(), lr=0.01, momentum=0.9))
    for a, b in zip(cached(*tiny_batch(2)), fresh(*tiny_batch(2))):
        assert torch.equal(a, b)


def test_model_calls_use_the_cache(tmp_path, monkeypatch):
    """The executor's own first call and compile() use the cache."""
    _, first = tiny_training(tmp_path)
    first(*tiny_batch())
    assert len(entries(tmp_path)) == 1
    forbid_compiling(monkeypatch)
    for compile_first in (False, True):
        _, second = tiny_training(tmp_path)
        if compile_first:
            second.compile(*tiny_batch())
        _, loss = second(*tiny_batch())
        assert torch.isfinite(loss).all()


def test_inference_model_round_trip(tmp_path, monkeypatch):
    x, _ = tiny_batch(batch=MICRO * ITERATIONS)
    torch.manual_seed(3)
    model = TinyNet()
    opts = poptorch.Options().deviceIterations(ITERATIONS).enableExecutableCaching(str(tmp_path))
    assert first_call(poptorch.inferenceModel(model, opts), x)[0] is False
    with monkeypatch.context() as m:
        forbid_compiling(m)
        loaded, out = first_call(poptorch.inferenceModel(model, opts.clone()), x)
    assert loaded
    assert torch.allclose(out, model.eval()(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_strict_mode_runs_the_loaded_vertices(tmp_path, monkeypatch):
    """Strict mode runs every vertex from its tile's memory: the decoded compute sets must be exact."""
    _, first = tiny_training(tmp_path, mode="strict")
    first_call(first, *tiny_batch())
    fresh_model, fresh = tiny_training(None, seed=4, mode="strict")
    _, fresh_out = first_call(fresh, *tiny_batch())
    with monkeypatch.context() as m:
        forbid_compiling(m)
        model, cached = tiny_training(tmp_path, seed=4, mode="strict")
        loaded, out = first_call(cached, *tiny_batch())
    assert loaded
    for a, b in zip(out, fresh_out):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)


def test_serialisation_keeps_the_compiled_program(compiled):
    exe = compiled.executable
    copy = cache.deserialize(cache.serialize(exe))
    graphs, copied = exe.lowering.device.graphs, copy.lowering.device.graphs
    for g, h in zip(graphs, copied):
        assert [v.name for v in g.variables] == [v.name for v in h.variables]
        for v, w in zip(g.variables, h.variables):
            assert (v.id, v.dtype, v.shape, v.category) == (w.id, w.dtype, w.shape, w.category)
            assert v.mapping == w.mapping
        assert len(g.compute_sets) == len(h.compute_sets)
        for cs, ds in zip(g.compute_sets, h.compute_sets):
            assert (cs.name, cs.ipu, cs.num_vertices) == (ds.name, ds.ipu, ds.num_vertices)
            for u, v in zip(cs.tables, ds.tables):
                assert u.type is v.type and np.array_equal(u.tiles, v.tiles) and np.array_equal(u.params, v.params)
                assert list(u.fields) == list(v.fields)
                for f in u.fields:
                    a, b = u.fields[f], v.fields[f]
                    assert [x.id for x in a.variables] == [x.id for x in b.variables]
                    for column in ("var", "offsets", "starts", "lengths"):
                        assert np.array_equal(getattr(a, column), getattr(b, column))
    assert copy.engine.costs == exe.engine.costs
    for p in copy.engine.programs:
        for node in walk(p):
            copy.engine.cost(node)  # every node keeps its static cost
    assert [r.max_tile for r in copy.engine.memory] == [r.max_tile for r in exe.engine.memory]
    assert copy.engine.mem is None and not copy.engine._streams


def test_entry_holds_no_weights(compiled):
    """Weights are copied to the device after loading, as after compiling: the entry has none."""
    arenas = [a.tobytes() for m in compiled.executable.engine.mem.ipus for a in m.arenas.values()]
    payload = cache.read_entry(compiled.entry, compiled.key).tobytes()
    for name, p in compiled.model.named_parameters():
        weight = p.detach().numpy().tobytes()
        assert any(weight in a for a in arenas), name  # the device holds it ...
        assert weight not in payload, name             # ... the entry does not


def test_torch_random_generator_ends_as_after_compiling(tmp_path):
    """The key's capture traces the model like the compiler's (on fake tensors): with the cache on,
    torch's generator ends where a compile without the cache leaves it, whether the entry is
    loaded or saved."""
    states = []
    for cache_dir in (None, tmp_path, tmp_path):  # no cache, miss, hit
        torch.manual_seed(0)
        model = TinyNet(p=0.5)
        training = poptorch.trainingModel(model, tiny_options(cache_dir),
                                          poptorch.optim.SGD(model.parameters(), lr=0.1))
        torch.manual_seed(5)
        before = torch.get_rng_state()
        training._compile_or_load(tiny_batch(), {})
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], before)  # capturing on fake tensors draws nothing
    assert torch.equal(states[0], states[1]) and torch.equal(states[0], states[2])


def _runs_arrays():
    """Integer arrays made of runs of equal or consecutive values, and arbitrary ones."""
    run = st.tuples(st.integers(-2 ** 40, 2 ** 40), st.integers(1, 20), st.sampled_from([0, 1]))
    built = st.lists(run, max_size=20).map(
        lambda rs: np.concatenate([v + s * np.arange(n) for v, n, s in rs]) if rs else np.zeros(0, np.int64))
    return built | st.lists(st.integers(-2 ** 62, 2 ** 62), max_size=50).map(lambda v: np.array(v, np.int64))


@given(_runs_arrays(), st.sampled_from([0, 1]))
def test_runs_round_trip(a, step):
    values, lengths = cache.runs(a.astype(np.int64), step)
    assert (lengths > 0).all() and lengths.sum() == a.size
    assert np.array_equal(cache.expand(values, lengths, step), a)


def _pickled(obj):
    buffer = io.BytesIO()
    cache._ExecutablePickler(buffer).dump(obj)
    return buffer.getvalue()


@given(_runs_arrays(), st.sampled_from(["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"]),
       st.booleans())
def test_integer_arrays_round_trip(a, dtype, transpose):
    a = a.astype(dtype)
    if transpose and a.size % 2 == 0:
        a = a.reshape(2, -1).T  # not C-contiguous
    back = pickle.loads(_pickled(a))
    assert back.dtype == a.dtype and back.shape == a.shape and np.array_equal(back, a)


def test_integer_arrays_with_runs_are_saved_small():
    mapping = np.repeat(np.arange(1472, dtype=np.int32), 100)
    indices = np.arange(10 ** 6, dtype=np.int64).reshape(1000, 1000)[:, 100:900].copy()
    for a in (mapping, indices):
        assert len(_pickled(a)) < a.nbytes / 20


def test_cache_directory_is_created(tmp_path):
    path = tmp_path / "a" / "b" / "cache"
    _, training = tiny_training(path)
    first_call(training, *tiny_batch())
    assert len(entries(path)) == 1


def test_unwritable_cache_path_warns_and_runs(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    _, training = tiny_training(blocker / "cache")
    with caplog.at_level(logging.INFO, logger="poptorch_lite"):
        loaded, (_, loss) = first_call(training, *tiny_batch())
    assert not loaded and torch.isfinite(loss).all()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "Cannot write the executable cache entry" in warnings[0].getMessage()


def _damage(file, how):
    data = file.read_bytes()
    magic_end = len(cache.MAGIC)
    header_end = data.index(b"\n", magic_end)
    header = json.loads(data[magic_end:header_end])
    if how == "truncated":
        data = data[:len(data) // 2]
    elif how == "empty":
        data = b""
    elif how == "garbage":
        data = os.urandom(4096)
    elif how == "flipped byte":
        i = header_end + 1 + (len(data) - header_end) // 2
        data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
    elif how == "other format":
        header["format"] = cache.FORMAT_VERSION + 1
        data = cache.MAGIC + json.dumps(header).encode() + data[header_end:]
    elif how == "other key":
        header["key"] = "0" * 64
        data = cache.MAGIC + json.dumps(header).encode() + data[header_end:]
    elif how == "not an executable":
        payload = pickle.dumps(42)  # intact header and checksum, wrong contents
        header.update(payload_bytes=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest())
        data = cache.MAGIC + json.dumps(header).encode() + b"\n" + payload
    elif how == "directory":
        os.remove(file)
        os.mkdir(file)
        return
    file.write_bytes(data)


DAMAGE = {"truncated": "truncated", "empty": "bad magic", "garbage": "bad magic", "flipped byte": "checksum",
          "other format": "format", "other key": "saved for key", "not an executable": "not an Executable",
          "directory": "Cannot read"}


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_entry_is_rebuilt(compiled, tmp_path, caplog, how):
    key = compiled.key
    file = tmp_path / (key + cache.SUFFIX)
    file.write_bytes(compiled.entry)
    _damage(file, how)
    _, second = tiny_training(tmp_path)
    with caplog.at_level(logging.INFO, logger="poptorch_lite"):
        loaded, (_, loss) = first_call(second, *tiny_batch())
    assert not loaded and torch.isfinite(loss).all()
    (reason,) = [r for r in caplog.records if r.levelno == logging.INFO and str(file) in r.getMessage()
                 and "Saved" not in r.getMessage()]
    assert DAMAGE[how] in reason.getMessage()
    if how != "directory":  # a directory in the way cannot be replaced by a file
        assert cache.load(tmp_path, key) is not None  # rewritten


def test_concurrent_writers_leave_one_valid_entry(compiled, tmp_path):
    threads = [threading.Thread(target=cache.store, args=(tmp_path, "k" * 64, compiled.executable))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert os.listdir(tmp_path) == ["k" * 64 + cache.SUFFIX]
    assert cache.load(tmp_path, "k" * 64) is not None


def test_entries_get_the_permissions_of_the_umask(compiled, tmp_path):
    old = os.umask(0o027)
    try:
        file = cache.store(tmp_path, compiled.key, compiled.executable)
    finally:
        os.umask(old)
    assert os.stat(file).st_mode & 0o777 == 0o640


def test_waiting_process_loads_the_entry_the_compiling_one_stores(compiled, tmp_path, monkeypatch):
    """While another compiler holds the key's lock, the model's compile step waits, then loads its entry."""
    _, second = tiny_training(tmp_path)
    key = cache.cache_key(second.model, tiny_batch(batch=MICRO), second.options, target_of(second.options), True,
                          second._optimizer)
    holding, waiting = threading.Event(), threading.Event()

    class WaitingSeen(logging.Handler):
        def emit(self, record):
            if "Another process is compiling the same model" in record.getMessage():
                waiting.set()

    def other_process():
        with cache.compile_lock(tmp_path, key, 60.0):
            holding.set()
            waiting.wait(60)  # stores once the model's compile step waits for the lock
            cache.store(tmp_path, key, compiled.executable)

    thread = threading.Thread(target=other_process)
    thread.start()
    assert holding.wait(60)
    monkeypatch.setattr(type(second), "_compile", lambda *a: pytest.fail("compiled instead of waiting"))
    logger, handler = logging.getLogger("poptorch_lite"), WaitingSeen()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        loaded, _ = first_call(second, *tiny_batch())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        thread.join()
    assert waiting.is_set() and loaded


def test_lock_wait_has_a_timeout(tmp_path, caplog):
    with cache.compile_lock(tmp_path, "k", 10.0):
        start = time.perf_counter()
        with caplog.at_level(logging.INFO, logger="poptorch_lite"), cache.compile_lock(tmp_path, "k", 0.3):
            waited = time.perf_counter() - start
    assert waited >= 0.3
    assert "compiling here too" in caplog.text


# ---- other processes ------------------------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import hashlib, json, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    import ipusim as ip
    import poptorch_lite as poptorch
    from poptorch_lite.runtime import cache
    from tutorial_model import TUTORIAL_STRATEGY, Network, TrainingModelWithLoss
    from test_executable_cache import TinyNet, first_call, forbid_compiling

    cache_dir, model_name, forbid = sys.argv[1], sys.argv[2], sys.argv[3] == "forbid"
    torch.manual_seed(0)
    if model_name == "tutorial":
        model = TrainingModelWithLoss(Network())
        opts = poptorch.Options().deviceIterations(2).randomSeed(7)
        opts.Training.gradientAccumulation(8)
        opts.setExecutionStrategy(TUTORIAL_STRATEGY)
        gen = torch.Generator().manual_seed(1)
        args = (torch.randn(32, 1, 28, 28, generator=gen), torch.randint(0, 10, (32,), generator=gen))
    else:
        model = TinyNet()
        opts = poptorch.Options().deviceIterations(2)
        opts.Training.gradientAccumulation(4)
        gen = torch.Generator().manual_seed(1)
        args = (torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen))
    opts.enableExecutableCaching(cache_dir)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9))
    if forbid:
        import pytest
        forbid_compiling(pytest.MonkeyPatch())
    loaded = training._compile_or_load(args, {{}})
    out, loss = training(*args)
    digest = hashlib.sha256()
    for t in [out, loss, *model.parameters()]:
        digest.update(t.detach().numpy().tobytes())
    print(json.dumps({{"loaded": loaded, "digest": digest.hexdigest()}}))
""")


def _start(tmp_path, cache_dir, model_name, forbid=False):
    script = tmp_path / "run_cached.py"
    script.write_text(SCRIPT.format(tests=HERE))
    return subprocess.Popen([sys.executable, str(script), str(cache_dir), model_name, "forbid" if forbid else "-"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(process):
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_process_loads_the_tutorial_model(tmp_path):
    cache_dir = tmp_path / "cache"
    cold = _result(_start(tmp_path, cache_dir, "tutorial"))
    warm = _result(_start(tmp_path, cache_dir, "tutorial", forbid=True))
    assert not cold["loaded"] and warm["loaded"]
    assert warm["digest"] == cold["digest"]  # same outputs, loss and trained parameters, bit for bit
    # The warm process cannot compile (forbid): it loaded. How much time that saves is measured by
    # benchmarks/executable_cache.py, not here.


@pytest.mark.slow
def test_processes_starting_together_compile_once(tmp_path):
    cache_dir = tmp_path / "cache"
    results = [_result(p) for p in [_start(tmp_path, cache_dir, "tiny") for _ in range(2)]]
    assert sorted(r["loaded"] for r in results) == [False, True]
    assert results[0]["digest"] == results[1]["digest"]


# ---- Ctrl-C ---------------------------------------------------------------------------------------
INTERRUPTED_SCRIPT = textwrap.dedent("""
    import logging, os, sys, time
    sys.path.insert(0, {tests!r})
    import poptorch_lite as poptorch
    from poptorch_lite.compiler import executable
    from test_executable_cache import tiny_batch, tiny_training

    logging.basicConfig(format="%(levelname)s %(message)s")
    logging.getLogger("poptorch_lite").setLevel(logging.INFO)
    cache_dir, where = sys.argv[1], sys.argv[2]

    def interrupt_here(what):
        print(what, flush=True)
        time.sleep(120)  # the test sends Ctrl-C now

    if where == "compile":  # in the compiler, between the capture and the lowering to IR
        to_ir = executable.to_ir
        def pausing_to_ir(*args, **kwargs):
            interrupt_here("compiling")
            return to_ir(*args, **kwargs)
        executable.to_ir = pausing_to_ir
    elif where == "write":  # half of the entry's payload written
        fdopen = os.fdopen
        class PausingFile:
            def __init__(self, file):
                self.file = file
            def __enter__(self):
                return self
            def __exit__(self, *exc_info):
                return self.file.__exit__(*exc_info)
            def __getattr__(self, name):
                return getattr(self.file, name)
            def write(self, data):
                if len(data) > 4096:
                    self.file.write(data[:len(data) // 2])
                    self.file.flush()
                    interrupt_here("writing")
                return self.file.write(data)
        os.fdopen = lambda fd, mode="r", *args, **kwargs: PausingFile(fdopen(fd, mode, *args, **kwargs))
    _, training = tiny_training(cache_dir)
    batch = tiny_batch()
    training(*batch)
    print("called", flush=True)
    if where == "training":
        while True:
            training(*batch)
            print("trained", flush=True)
""")


def _interrupted(tmp_path, cache_dir, where):
    """Run the script until it prints what it is doing (`where`), press Ctrl-C (SIGINT to its process
    group), and return the seconds it took to exit, its stderr and its stdout lines."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED_SCRIPT.format(tests=HERE))
    process = subprocess.Popen([sys.executable, str(script), str(cache_dir), where], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        waited = {"compile": "compiling", "write": "writing", "training": "called", "none": None}[where]
        lines = []
        while waited not in lines:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
        if waited is None:
            _, err = process.communicate(timeout=900)
            return 0.0, err, lines
        assert lines[-1:] == [waited], (lines, process.communicate(timeout=60)[1])
        while where == "training" and lines.count("trained") < 3:  # a few training calls in
            line = process.stdout.readline()
            assert line, (lines, process.communicate(timeout=60)[1])
            lines.append(line.strip())
        os.killpg(process.pid, signal.SIGINT)
        interrupted = time.monotonic()
        out, err = process.communicate(timeout=120)
        return time.monotonic() - interrupted, err, lines + out.split()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.slow
def test_ctrl_c_in_compile_cache_write_or_training_exits_promptly_and_leaves_a_valid_cache(tmp_path):
    """Ctrl-C while the model compiles, while its cache entry is half written, or during training
    calls: the process exits (within 60 s, however loaded the machine), and the next run finds
    either no entry (and compiles and stores one) or a whole one, which it loads; it never reads
    a torn entry, and no temporary file is left."""
    cache_dir = tmp_path / "cache"
    for where in ("compile", "write"):
        seconds, err, _ = _interrupted(tmp_path, cache_dir, where)
        assert "KeyboardInterrupt" in err and seconds < 60, (where, seconds, err)
        assert not [f for f in os.listdir(cache_dir) if not f.endswith(".lock")], (where, os.listdir(cache_dir))
    _, err, lines = _interrupted(tmp_path, cache_dir, "none")
    assert "called" in lines and "Saved the compiled model" in err and "unusable" not in err, err
    (entry,) = entries(cache_dir)
    saved = (cache_dir / entry).read_bytes()
    seconds, err, lines = _interrupted(tmp_path, cache_dir, "training")
    assert "Loaded the compiled model" in err and "KeyboardInterrupt" in err and seconds < 60, (seconds, err)
    assert entries(cache_dir) == [entry] and (cache_dir / entry).read_bytes() == saved
    _, err, lines = _interrupted(tmp_path, cache_dir, "none")
    assert "called" in lines and "Loaded the compiled model" in err and "unusable" not in err, err
    assert not [f for f in os.listdir(cache_dir) if f.endswith(".tmp")]
