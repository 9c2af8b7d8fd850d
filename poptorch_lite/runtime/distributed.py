"""Data parallelism across processes: the gradient all-reduce of a training model that several
processes run together (PopRun instances, or any launcher plus
`Options.Distributed.configureProcessId`).

Each process runs its own replicas on its own emulated IPUs and reads its own share of the data.
Just before the weight-update programs of an IPU (each "U" step of the schedule), the gradient
accumulators of the weights homed on that IPU are summed over all processes, so every process
applies the same update and the weights stay identical.

Replicas: the hook runs before the weight-update programs, and the first of those is the
on-device all-reduce of the local replicas. So each replica's accumulators are summed over the
processes (replica r of every process together), then the device sums the replicas: every
replica ends with the sum over all replicas of all processes. The update divides that sum as
PopTorch does (`optim.reduction_divisor`: with `ReductionType.Mean`, gradient accumulation x local
replicas x processes, PopART's global replication factor).

Host side: the accumulators of one IPU of replica 0 and of the same IPU of every other replica
(read from tile memory, or from Streaming Memory when accumulators live off chip) are
concatenated into one flat buffer per IPU (and dtype), all-reduced with `torch.distributed`
(gloo) and written back. Each IPU has its own process group, so IPUs that run on different host
threads (`Emulator.setHostThreads`) reduce concurrently without their collectives interleaving.
When the model compiles, the processes check that they compiled the same model (weights, IPUs,
batching) and process 0 broadcasts its initial weights and buffers, so every process starts
identical. Buffers the forward pass updates (batch-norm running statistics) are not reduced
afterwards: each process keeps the statistics of its own data.

Cost: on a Pod the reduction runs device to device over the GW-Links; here it runs on the host
and takes host time, which is not device time. Each reduction is recorded (`Reduction`): the
bytes reduced, the measured host seconds, the bytes a ring all-reduce sends per process, and
`host_link_cycles`, the modelled device cost of moving one replica's accumulators to the host
and back over the host link (`Target.host_cycles`; the replicas' IPUs move theirs in parallel).
None of it is added to the cycles of the steps in `PoplarExecutor.last_run`, which count device
programs only.
"""
from __future__ import annotations

import atexit
import datetime
import math
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

#: Seconds a process waits for the others at the rendezvous and in every collective.
TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class Reduction:
    """One all-reduce of an IPU's gradient accumulators (all local replicas) across processes."""
    ipu: int
    elements: int
    nbytes: int
    host_link_cycles: int   # modelled: one replica's accumulators out to the host and back
    network_bytes: int      # bytes each process sends (and receives) in a ring all-reduce
    seconds: float          # measured host time: read, all-reduce, write back


@dataclass
class ReductionTotals:
    """All reductions of one IPU since the model compiled."""
    count: int = 0
    nbytes: int = 0
    host_link_cycles: int = 0
    network_bytes: int = 0
    seconds: float = 0.0

    def add(self, r: Reduction) -> None:
        self.count += 1
        self.nbytes += r.nbytes
        self.host_link_cycles += r.host_link_cycles
        self.network_bytes += r.network_bytes
        self.seconds += r.seconds


@dataclass(frozen=True)
class Slot:
    """Where one replica keeps one weight's accumulator: a tensor in tile memory, or a remote
    buffer in Streaming Memory (accumulators off chip)."""
    replica: int
    name: str
    storage: object   # ip.Tensor or ip.RemoteBuffer
    off_chip: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.storage.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def read(self, engine) -> np.ndarray:
        if self.off_chip:
            return engine.readRemoteBuffer(self.storage)
        return engine.readTensor(self.storage)

    def write(self, engine, values: np.ndarray) -> None:
        if self.off_chip:
            engine.writeRemoteBuffer(self.storage, values)
        else:
            engine.writeTensor(self.storage, values)


@dataclass(frozen=True)
class Bucket:
    """The accumulators of one IPU (of every replica) and one dtype, reduced as one flat buffer:
    replica by replica, weights in name order."""
    ipu: int            # replica 0's IPU; replica r's is the same IPU of its own copy
    dtype: np.dtype
    names: tuple[str, ...]
    replicas: int
    slots: tuple[Slot, ...]


class GradientAllReduce:
    """Sums the gradient accumulators of a training model over the processes of a run.

    Created by the executor after compiling when `options.num_processes > 1`; `reduce(executable,
    ipu)` is called just before the weight-update programs of `ipu` in every "U" step.
    """

    def __init__(self, executor):
        options = executor.options
        self.num_processes = options.num_processes
        self.process_id = options.process_id
        join_process_group(self.num_processes, self.process_id)
        exe = executor._executable
        self.buckets = gradient_buckets(exe.lowerings, exe.updates)
        weights = executor._named_weights()
        check_same_model(model_signature(weights, self.buckets, options), self.process_id)
        # groups are created collectively, in the same order everywhere: IPUs in ascending order
        self._groups = {ipu: dist.new_group(backend="gloo", timeout=_timeout())
                        for ipu in sorted(self.buckets)}
        broadcast_weights(weights)
        self._target = exe.engine.target
        self._lock = threading.Lock()
        self.last: dict[int, Reduction] = {}
        self.totals: dict[int, ReductionTotals] = {}

    def reduce(self, executable, ipu: int) -> None:
        """Replace every local replica's accumulators of the weights on `ipu` by their sum over
        the same replica of all processes."""
        buckets = self.buckets.get(ipu)
        if not buckets:
            return
        start = time.perf_counter()
        engine = executable.engine
        elements = nbytes = host_cycles = 0
        for bucket in buckets:
            flat = torch.from_numpy(np.concatenate(
                [slot.read(engine).reshape(-1) for slot in bucket.slots]))
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._groups[ipu])
            values, offset = flat.numpy(), 0
            for slot in bucket.slots:
                slot.write(engine, values[offset:offset + slot.size].reshape(slot.shape))
                offset += slot.size
            size = flat.numel() * flat.element_size()
            elements += flat.numel()
            nbytes += size
            host_cycles += 2 * self._target.host_cycles(size // bucket.replicas)
        record = Reduction(
            ipu=ipu, elements=elements, nbytes=nbytes, host_link_cycles=host_cycles,
            network_bytes=ring_bytes(nbytes, self.num_processes),
            seconds=time.perf_counter() - start)
        with self._lock:
            self.last[ipu] = record
            self.totals.setdefault(ipu, ReductionTotals()).add(record)


def ring_bytes(nbytes: int, num_processes: int) -> int:
    """Bytes each process sends in a ring all-reduce of `nbytes`: 2 (P - 1) / P of them."""
    return math.ceil(2 * (num_processes - 1) * nbytes / num_processes)


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=TIMEOUT_SECONDS)


def join_process_group(num_processes: int, process_id: int) -> None:
    """Join (or check) the torch.distributed process group of the run.

    An existing group (e.g. from `popdist.init()`) must have this process's rank and size.
    Otherwise the group is created with gloo from `MASTER_ADDR` / `MASTER_PORT` (poprun sets
    them, as do torchrun and most launchers), rank = process id, size = number of processes.
    """
    if not dist.is_available():
        raise RuntimeError("training over several processes needs torch.distributed, which this "
                           "torch build does not have")
    where = f"Options.Distributed says process {process_id} of {num_processes}"
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (process_id, num_processes):
            raise RuntimeError(
                f"torch.distributed is initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but {where}: configure both the same way")
        return
    for name, expected in (("RANK", process_id), ("WORLD_SIZE", num_processes)):
        value = os.environ.get(name, "").strip()
        if value and value != str(expected):
            raise RuntimeError(f"{name}={value} in the environment, but {where}; the launcher "
                               "and Options.Distributed.configureProcessId must agree")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"{where}, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
            "set, so the processes cannot find each other to all-reduce gradients. Launch with "
            "poprun, set MASTER_ADDR and MASTER_PORT (the address and a free port of process 0) "
            "in every process, or call torch.distributed.init_process_group('gloo', ...) "
            "before the model compiles")
    open_process_group(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], process_id,
                       num_processes, TIMEOUT_SECONDS)


def open_process_group(address: str, port: str, rank: int, world_size: int,
                       timeout_seconds: float) -> None:
    """Create the gloo process group of the run, and destroy it (with every group made from
    it) when the interpreter exits.

    Without that, the group outlives the interpreter: gloo's worker threads are torn down during
    finalisation and the process can abort (SIGABRT, "terminate called without an active
    exception") after the program has finished. A program that destroys the group itself
    leaves nothing for the exit handler to do.
    """
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_seconds))
    atexit.register(close_process_group)


def close_process_group() -> None:
    """Destroy the default process group and every group made from it, if it still exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def gradient_buckets(lowerings: list, updates) -> dict[int, list[Bucket]]:
    """The accumulators of the weights the optimiser updates, by IPU of replica 0, one bucket per
    dtype holding that IPU's accumulators of every replica."""
    first = lowerings[0]
    by_key: dict[tuple[int, str], list[str]] = {}
    for name in sorted(updates.states):
        key = (first.weights[name].ipu, np.dtype(first.accumulators[name].dtype).str)
        by_key.setdefault(key, []).append(name)
    buckets: dict[int, list[Bucket]] = {}
    for (ipu, dtype), names in sorted(by_key.items()):
        slots = tuple(
            Slot(r, n, low.accumulator_buffers.get(n, low.accumulators[n]),
                 n in low.accumulator_buffers)
            for r, low in enumerate(lowerings) for n in names)
        buckets.setdefault(ipu, []).append(
            Bucket(ipu, np.dtype(dtype), tuple(names), len(lowerings), slots))
    return buckets


def model_signature(weights: dict, buckets: dict[int, list[Bucket]], options) -> tuple:
    """What every process must agree on to train one model together, as (section, entries)."""
    return (
        ("weights", tuple((n, tuple(t.shape), str(t.dtype)) for n, t in sorted(weights.items()))),
        ("gradients reduced", tuple((ipu, b.dtype.str, b.names, b.replicas)
                                    for ipu, bs in sorted(buckets.items()) for b in bs)),
        ("gradient accumulation", (options.gradient_accumulation,)),
        ("local replicas", (options.replication_factor,)),
        ("reduction", (str(options.Training.accumulation_and_replication_reduction_type),)),
    )


def first_difference(theirs: tuple, ours: tuple) -> str:
    """The first entry where two signatures differ, said as 'section: theirs against ours'."""
    for (section, entries), (_, reference) in zip(theirs, ours):
        if entries == reference:
            continue
        missing = "nothing"
        for a, b in zip((*entries, missing), (*reference, missing)):
            if a != b:
                return f"{section}: {a} against {b}"
    return "the signatures differ in length"


def check_same_model(signature: tuple, process_id: int) -> None:
    """Compare the signature with every process's; all processes raise the same error."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, signature)
    different = [p for p, s in enumerate(gathered) if s != gathered[0]]
    if not different:
        return
    first = different[0]
    raise RuntimeError(
        f"processes {different} compiled a different training model than process 0 (this is "
        f"process {process_id}): every process must build the same model, optimiser parameter "
        f"groups, gradient accumulation, replication and reduction. First difference, process "
        f"{first} against process 0: {first_difference(gathered[first], gathered[0])}")


def broadcast_weights(weights: dict[str, torch.Tensor]) -> None:
    """Give every process process 0's weights and buffers (one flat broadcast per dtype)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name in sorted(weights):
        by_dtype.setdefault(weights[name].dtype, []).append(name)
    for dtype, names in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        flat = torch.cat([weights[n].detach().reshape(-1) for n in names])
        dist.broadcast(flat, src=0)
        offset = 0
        with torch.no_grad():
            for n in names:
                t = weights[n]
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
