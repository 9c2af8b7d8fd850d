"""Whole runs of the MNIST pipelining tutorial against plain PyTorch CPU scripts doing the same work.

Every run is a whole process, timed from start to exit; each row alternates ours and PyTorch's:
- tutorial: `tutorials/pytorch/pipelining/mnist_pipeline.py --epochs 1 --num-workers W` (four emulated
  IPUs, pipelined; then the test pass on an inference model), against the same network, data,
  optimiser (AdamW, lr 0.001) and test pass in plain PyTorch on the CPU with PyTorch's threads;
- graphcore: Graphcore's own `tutorials/tutorials/pytorch/pipelining/mnist_pipeline.py` of
  graphcore/examples, unmodified, through `python -m poptorch_lite run ... --epochs 1` (16 loader
  workers: the script's own), against a plain PyTorch script with the script's data (torchvision's
  MNIST class, ToTensor and Normalize).
Both PyTorch twins load as the emulated runs do: one item holds one call's 4,000 training samples,
cut into 40-sample micro-batches, 10 accumulated per optimiser step; the test set comes in items of
800 samples. Graphcore's script reads `~/.torch/datasets/MNIST/raw`; both sides of that row run with
HOME set to a directory holding Fashion-MNIST there (from `--data-dir`, else Debian's
dataset-fashion-mnist), so nothing is written to the user's home. The script is found through
`--graphcore-examples DIR` or `GRAPHCORE_EXAMPLES` (a checkout of graphcore/examples), by default a
checkout beside this repository; without one the row is skipped and says so.

`--phases` also records the phase trace of every run (`IPUSIM_PHASES`, see
poptorch_lite/api/phases.py; the PyTorch twins write the same lines) and prints, per row, the
median wall time from the process's launch and CPU time of each phase of the host process, then
the CPU time of every process of the run (host, accessor zygote, accessors with their DataLoader
workers). CPU times are the ones to compare on a busy machine; wall times only on a quiet one.
`--one-thread` runs every side's compute on one thread (PyTorch's and BLAS's threads, the emulator's
host threads): threads that spin while they wait for each other inflate CPU times several-fold on a
busy machine, so this is the way to compare the work done there (not the wall times).

    python benchmarks/end_to_end.py [--rows tutorial graphcore] [--repeats 5] [--phases] [--one-thread]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import os
import re
import shutil
import site
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TUTORIAL = os.path.join(REPO, "tutorials", "pytorch", "pipelining")
GRAPHCORE_SCRIPT = os.path.join("tutorials", "tutorials", "pytorch", "pipelining", "mnist_pipeline.py")
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
IDX = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

# What both PyTorch twins share: the phase marks (the lines poptorch_lite.api.phases writes), the
# tutorial's network (the same layers as Graphcore's script) and the loops of one run: each item of
# the training loader is one call's samples, cut into micro-batches, `acc` accumulated per step.
TWIN_COMMON = """
import atexit, os, sys, time
_PHASES = os.environ.get("IPUSIM_PHASES")

def mark(event):
    if _PHASES:
        t = os.times()
        with open(_PHASES, "a") as f:
            f.write(f"{time.time():.6f} {os.getpid()} host {event} cpu={t.user + t.system:.3f} "
                    f"children={t.children_user + t.children_system:.3f}\\n")

if _PHASES:
    atexit.register(mark, "exit-handlers:end")

sys.path.insert(0, TUTORIAL)
import torch
from mnist_pipeline import SEED, Network, accuracy, parse_args


def train_and_test(model, train, test, micro, acc, epochs, learning_rate):
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    loss_fn = torch.nn.CrossEntropyLoss()
    mark("model:end")
    for _ in range(epochs):
        mark("call:begin model=training")
        for images, labels in train:
            for start in range(0, len(images), micro * acc):
                optimizer.zero_grad()
                for i in range(start, start + micro * acc, micro):
                    (loss_fn(model(images[i:i + micro]), labels[i:i + micro]) / acc).backward()
                optimizer.step()
            mark("call:end model=training")
            mark("call:begin model=training")
    model.eval()
    total = 0.0
    with torch.no_grad():
        mark("call:begin model=inference")
        for images, labels in test:
            total += accuracy(model(images), labels)
            mark("call:end model=inference")
            mark("call:begin model=inference")
    mark("test:end")
    print(f"Accuracy on test set: {total / len(test):0.2f}%")
"""

TUTORIAL_TWIN = f"TUTORIAL = {TUTORIAL!r}" + TWIN_COMMON + """
from mnist_data import load_datasets
mark("imports:end")

if __name__ == "__main__":
    opts = parse_args(sys.argv[1:])
    data = load_datasets(opts.dataset, opts.data_dir)
    micro, acc = opts.batch_size, opts.gradient_accumulation
    train = torch.utils.data.DataLoader(data.train, batch_size=micro * acc * opts.device_iterations, shuffle=True,
                                        drop_last=True, num_workers=opts.num_workers,
                                        generator=torch.Generator().manual_seed(SEED))
    test = torch.utils.data.DataLoader(data.test, batch_size=opts.test_batch_size * acc * opts.device_iterations,
                                       shuffle=True, drop_last=True, num_workers=opts.num_workers,
                                       generator=torch.Generator().manual_seed(SEED + 1))
    torch.manual_seed(SEED)
    train_and_test(Network(), train, test, micro, acc, opts.epochs, opts.learning_rate)
"""

GRAPHCORE_TWIN = f"TUTORIAL = {TUTORIAL!r}" + TWIN_COMMON + """
import torchvision
mark("imports:end")
torch.manual_seed(0)


def data(train, batch_size):
    transform = torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                                torchvision.transforms.Normalize((0.1307,), (0.3081,))])
    return torch.utils.data.DataLoader(
        torchvision.datasets.MNIST("~/.torch/datasets", train=train, download=True, transform=transform),
        batch_size=batch_size, shuffle=True, drop_last=True, num_workers=16)


if __name__ == "__main__":
    micro, acc, iterations, test_micro, epochs = 40, 10, 10, 8, int(sys.argv[sys.argv.index("--epochs") + 1])
    training_data, test_data = data(True, micro * acc * iterations), data(False, test_micro * acc * iterations)
    train_and_test(Network(), training_data, test_data, micro, acc, epochs, 0.001)
"""


class Run:
    """One whole process: its wall time from launch, CPU time of the tree, accuracy and phase trace."""

    def __init__(self, wall: float, cpu: float, host_cpu: float, accuracy: str, launched: float, trace: list[tuple]):
        self.wall, self.cpu, self.host_cpu, self.accuracy = wall, cpu, host_cpu, accuracy
        self.launched, self.trace = launched, trace


def run(command: list[str], env: dict, phases: bool) -> Run:
    trace_file = None
    if phases:
        fd, trace_file = tempfile.mkstemp(prefix="ipusim_phases_", suffix=".txt")
        os.close(fd)
        env = {**env, "IPUSIM_PHASES": trace_file}
    try:
        launched = time.time()
        start = time.perf_counter()
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            process = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env)
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: its /proc entry
            seconds = time.perf_counter() - start
            host_cpu = own_cpu(process.pid)
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        if process.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{stderr[-3000:]}")
        if "leaked" in stderr:
            raise RuntimeError(f"{' '.join(command)} leaked resources:\n{stderr[-2000:]}")
        found = [line for line in stdout.splitlines() if "Accuracy on test set" in line]
        trace = []
        if trace_file is not None:
            with open(trace_file, encoding="utf-8") as f:
                trace = [parse_line(line) for line in f if line.strip()]
            trace.append((launched + seconds, process.pid, "host", "exit", host_cpu, 0.0, {}))
        return Run(seconds, usage.ru_utime + usage.ru_stime, host_cpu, found[-1].split(":")[-1].strip() if found else "?",
                   launched, trace)
    finally:
        if trace_file is not None:
            os.unlink(trace_file)


def own_cpu(pid: int) -> float:
    """The CPU seconds (user + system) of process `pid` alone, exited and not yet reaped."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parse_line(line: str) -> tuple:
    """(time, pid, role, event, cpu, children cpu, {key: value}) of a phase trace line."""
    when, pid, role, event, *fields = line.split()
    values = dict(f.split("=", 1) for f in fields)
    return (float(when), int(pid), role, event, float(values.pop("cpu")), float(values.pop("children")), values)


# ---- the phase table ------------------------------------------------------------------------------

COMPILE_STEPS = {"compile:begin": "compile: capture", "compile:captured": "compile: IR, schedule",
                 "compile:ir": "compile: lowering", "compile:lowered": "compile: engine load",
                 "compile:loaded": "first run", "compile:end": "first run"}


def host_phases(r: Run) -> list[tuple[str, float, float]]:
    """The launched process's phases, in order, as (name, wall s, CPU s of that process alone). A
    phase runs from one mark to the next (poptorch_lite.api.phases): start-up and imports; set-up
    (data, loaders, model; ours also imports the emulator and compiler there); per model, its first
    call (ours: capture, IR, lowering, engine load, first run) and the other calls with the waits for
    the loader between them; the end of the script (loaders stopped) and exit handlers; the
    interpreter's teardown, from the last mark to the exit."""
    host = r.trace[-1][1]
    rows: dict[str, list[float]] = {}
    label, kind, calls = "start-up, imports", "", collections.Counter()
    previous_when, previous_cpu = r.launched, 0.0
    for when, pid, _, event, cpu, _, extra in r.trace:
        if pid != host:
            continue
        row = rows.setdefault(label, [0.0, 0.0])
        row[0] += when - previous_when
        row[1] += cpu - previous_cpu
        previous_when, previous_cpu = when, cpu
        if event in ("import-poptorch_lite:end", "imports:end", "import-poptorch_lite.runtime.executor:end"):
            label = "set-up: data, loaders, model"
        elif event == "import-poptorch_lite.runtime.executor:begin" and not calls:
            label = "set-up: import of the emulator, compiler"
        elif event == "call:begin":
            kind = extra.get("model", "")
            calls[kind] += 1
            label = f"{kind}: {'first call' if calls[kind] == 1 else 'other calls, loader waits'}"
        elif event in COMPILE_STEPS:
            label = f"{kind}: {COMPILE_STEPS[event]}"
        elif event == "call:end":
            label = f"{kind}: other calls, loader waits"
        elif event == "loader:epoch-end" or event == "test:end":
            label = "between training and test" if kind == "training" else "end of the script, exit handlers"
        elif event == "exit-handlers:end":
            label = "interpreter teardown"
    return [(name, wall, cpu) for name, (wall, cpu) in rows.items()]


def process_cpu(r: Run) -> dict[str, float]:
    """CPU seconds by process: the host alone, the processes it started (the accessor zygote and each
    accessor with its DataLoader workers, from their last marks; the PyTorch twin's workers)."""
    last = {}
    for t in r.trace:
        last[(t[1], t[2])] = t
    out = collections.OrderedDict([("host", r.host_cpu)])
    zygote = [t for (_, role), t in last.items() if role == "zygote"]
    accessors = sorted((t for (_, role), t in last.items() if role == "accessor"), key=lambda t: t[1])
    if zygote:
        out["accessor zygote"] = zygote[0][4]
    for i, t in enumerate(accessors):
        out[f"accessor {i + 1}"] = t[4]
        out[f"its DataLoader workers"] = t[5]
    if not zygote and not accessors:
        out["DataLoader workers"] = r.cpu - r.host_cpu
    out["all processes"] = r.cpu
    return out


def median_table(runs: list[Run]) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
    tables = [host_phases(r) for r in runs]
    names = list(dict.fromkeys(name for table in tables for name, _, _ in table))
    phases = []
    for name in names:
        walls = [w for table in tables for n, w, _ in table if n == name]
        cpus = [c for table in tables for n, _, c in table if n == name]
        phases.append((name, statistics.median(walls), statistics.median(cpus)))
    procs = [process_cpu(r) for r in runs]
    keys = list(dict.fromkeys(k for p in procs for k in p))
    return phases, {k: statistics.median(p[k] for p in procs if p.get(k) is not None) for k in keys
                    if any(p.get(k) is not None for p in procs)}


def print_phases(title: str, ours: list[Run], theirs: list[Run]) -> None:
    (op, oproc), (tp, tproc) = median_table(ours), median_table(theirs)
    print(f"\n{title}: phases of the host process, medians (wall s from launch is only meaningful on a quiet "
          "machine; CPU s of the host process alone)")
    print(f"  {'phase':<38} {'ours wall':>9} {'cpu':>7}   {'PyTorch wall':>12} {'cpu':>7}")
    theirs_by = {n: (w, c) for n, w, c in tp}
    for name, w, c in op:
        tw, tc = theirs_by.pop(name, (None, None))
        print(f"  {name:<38} {w:>9.2f} {c:>7.2f}   {_f(tw):>12} {_f(tc):>7}")
    for name, (tw, tc) in theirs_by.items():
        print(f"  {name:<38} {'':>9} {'':>7}   {_f(tw):>12} {_f(tc):>7}")
    print(f"  CPU s by process, ours: " + "; ".join(f"{k} {v:.2f}" for k, v in oproc.items()))
    print(f"  CPU s by process, PyTorch: " + "; ".join(f"{k} {v:.2f}" for k, v in tproc.items()))


def _f(value) -> str:
    return "" if value is None else f"{value:.2f}"


# ---- the rows -----------------------------------------------------------------------------------

def fashion_mnist_home(data_dir: str | None, directory: str) -> str:
    """A HOME whose ~/.torch/datasets/MNIST/raw holds Fashion-MNIST (Graphcore's script reads MNIST
    from there and would download it otherwise)."""
    source = data_dir or DEBIAN_FASHION_MNIST
    raw = os.path.join(directory, ".torch", "datasets", "MNIST", "raw")
    os.makedirs(raw)
    for name in IDX:
        plain, packed = os.path.join(source, name), os.path.join(source, name + ".gz")
        if os.path.exists(plain):
            shutil.copyfile(plain, os.path.join(raw, name))
        elif os.path.exists(packed):
            with gzip.open(packed, "rb") as f, open(os.path.join(raw, name), "wb") as g:
                shutil.copyfileobj(f, g)
        else:
            raise SystemExit(f"Fashion-MNIST's {name} is not in {source}: install Debian's dataset-fashion-mnist "
                             "(apt-get install dataset-fashion-mnist) or give --data-dir")
    return directory


def graphcore_script(args) -> str | None:
    root = args.graphcore_examples or os.environ.get("GRAPHCORE_EXAMPLES") or os.path.join(
        os.path.dirname(REPO), "examples")
    path = os.path.join(root, GRAPHCORE_SCRIPT)
    return path if os.path.isfile(path) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", choices=("tutorial", "graphcore"), default=["tutorial", "graphcore"])
    ap.add_argument("--workers", type=int, default=16, help="loader workers of the tutorial row (default 16)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dataset", default="fashion-mnist", help="the tutorial row's --dataset")
    ap.add_argument("--data-dir", default=None,
                    help="where Fashion-MNIST's idx files are for the graphcore row (default: Debian's package)")
    ap.add_argument("--graphcore-examples", default=None,
                    help="a checkout of graphcore/examples (default: $GRAPHCORE_EXAMPLES, else ../examples)")
    ap.add_argument("--phases", action="store_true", help="record and print the phase table of each row")
    ap.add_argument("--one-thread", action="store_true",
                    help="compute on one thread on every side (to compare CPU times on a busy machine)")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))}
    if args.one_thread:
        env.update({name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                           "IPUSIM_BLAS_THREADS", "IPUSIM_HOST_THREADS")})
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        if "tutorial" in args.rows:
            twin = os.path.join(tmp, "torch_tutorial.py")
            with open(twin, "w", encoding="utf-8") as f:
                f.write(TUTORIAL_TWIN)
            common = ["--epochs", "1", "--num-workers", str(args.workers), "--dataset", args.dataset]
            rows["tutorial"] = ([sys.executable, os.path.join(TUTORIAL, "mnist_pipeline.py"), *common],
                                [sys.executable, twin, *common], env)
        if "graphcore" in args.rows:
            script = graphcore_script(args)
            if script is None:
                print("graphcore row skipped: Graphcore's mnist_pipeline.py was not found; give a checkout of "
                      "graphcore/examples with --graphcore-examples DIR or GRAPHCORE_EXAMPLES=DIR")
            else:
                twin = os.path.join(tmp, "torch_graphcore.py")
                with open(twin, "w", encoding="utf-8") as f:
                    f.write(GRAPHCORE_TWIN)
                home = fashion_mnist_home(args.data_dir, os.path.join(tmp, "home"))
                genv = {**env, "HOME": home}
                if os.path.isdir(site.getusersitepackages()):  # packages installed for the user stay found
                    genv["PYTHONUSERBASE"] = site.getuserbase()
                rows["graphcore"] = ([sys.executable, "-m", "poptorch_lite", "run", script, "--epochs", "1"],
                                     [sys.executable, twin, "--epochs", "1"], genv)
        for name, (ours_cmd, theirs_cmd, row_env) in rows.items():
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(run(ours_cmd, row_env, args.phases))
                theirs.append(run(theirs_cmd, row_env, args.phases))
            results[name] = (ours, theirs)
    print(f"one epoch and the test pass{', compute on one thread' if args.one_thread else ''}, median of "
          f"{args.repeats}, {os.cpu_count()} cores, load average "
          f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (wall times mean something only on a "
          "quiet machine):")
    for name, (ours, theirs) in results.items():
        o, t = statistics.median(r.wall for r in ours), statistics.median(r.wall for r in theirs)
        oc, tc = statistics.median(r.cpu for r in ours), statistics.median(r.cpu for r in theirs)
        label = {"tutorial": f"the project's tutorial, {args.workers} loader workers",
                 "graphcore": "Graphcore's mnist_pipeline.py through poptorch-lite run"}[name]
        print(f"  {label}:")
        print(f"    emulated IPUs {o:.1f} s (CPU {oc:.1f} s, test accuracy {ours[-1].accuracy}); "
              f"plain PyTorch {t:.1f} s (CPU {tc:.1f} s, test accuracy {theirs[-1].accuracy}); ratio {o / t:.2f}")
        print(f"    each run, ours: {' '.join(f'{r.wall:.1f}' for r in ours)}; "
              f"PyTorch: {' '.join(f'{r.wall:.1f}' for r in theirs)}")
    if args.phases:
        for name, (ours, theirs) in results.items():
            print_phases(name, ours, theirs)


if __name__ == "__main__":
    main()
