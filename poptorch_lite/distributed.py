"""Data parallelism across processes: the gradient all-reduce of a training model that several
processes run together (PopRun instances, or any launcher plus
`Options.Distributed.configureProcessId`).

Each process runs its own replicas on its own emulated IPUs and reads its own share of the data.
Just before the weight update of an IPU (each "W" step of the schedule), the gradient
accumulators of the weights homed on that IPU are summed over all processes, so every process
applies the same update and the weights stay identical. Replicas inside one process are reduced
on the device first; the accumulators read here are replica 0's.

Host side: the accumulators are read from the engine, concatenated into one flat buffer per IPU
(and dtype), all-reduced with `torch.distributed` (gloo) and written back. Each IPU has its own
process group, so IPUs that run on different host threads (`Emulator.setHostThreads`) reduce
concurrently without their collectives interleaving. When the model compiles, the processes
check that they compiled the same model (weights, IPUs, batching) and process 0 broadcasts its
initial weights, so every process starts identical.

Reduction: PopTorch sums the gradients of all replicas of all processes; with
`ReductionType.Mean` the update divides by gradient accumulation x local replicas x processes
(PopART's global replication factor). The weight update divides by the divisor it was compiled
with (`optim.reduction_divisor`); the all-reduced sum is multiplied by compiled / global divisor,
which is 1 when the compiled divisor already counts every replica of every process.

Cost: on a Pod the reduction runs device to device over the GW-Links; here it runs on the host
and takes host time, which is not device time. Each reduction is recorded (`Reduction`): the
bytes reduced, the measured host seconds, the bytes a ring all-reduce sends per process, and
`host_link_cycles`, the modelled device cost of moving the accumulators to the host and back
over the host link (`Target.host_cycles`). None of it is added to the cycles of the steps in
`PoplarExecutor.last_run`, which count device programs only.
"""
from __future__ import annotations

import datetime
import math
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .enums import ReductionType

#: Seconds a process waits for the others at the rendezvous and in every collective.
TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class Reduction:
    """One all-reduce of an IPU's gradient accumulators across processes."""
    ipu: int
    elements: int
    nbytes: int
    host_link_cycles: int   # modelled: the accumulators out to the host and back (Target.host_cycles)
    network_bytes: int      # bytes each process sends (and receives) in a ring all-reduce
    seconds: float          # measured host time: read, all-reduce, scale, write back


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
class Bucket:
    """The accumulators of one IPU and dtype, reduced as one flat buffer (in name order)."""
    ipu: int
    dtype: np.dtype
    names: tuple[str, ...]
    tensors: tuple = field(repr=False)


class GradientAllReduce:
    """Sums the gradient accumulators of a training model over the processes of a run.

    Created by the executor after compiling when `options.num_processes > 1`; `reduce(executable,
    ipu)` is called just before the weight-update programs of `ipu` in every "W" step.
    """

    def __init__(self, executor):
        import torch.distributed as dist

        options = executor.options
        self.num_processes = options.num_processes
        self.process_id = options.process_id
        join_process_group(self.num_processes, self.process_id)
        exe = executor._executable
        self.buckets = gradient_buckets(exe.lowering, exe.updates)
        self.scale = accumulator_scale(exe.updates, executor._optimizer, options)
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
        """Replace the accumulators of the weights on `ipu` by their (scaled) sum over all
        processes."""
        import torch.distributed as dist

        buckets = self.buckets.get(ipu)
        if not buckets:
            return
        start = time.perf_counter()
        engine = executable.engine
        elements = nbytes = 0
        for bucket in buckets:
            flat = torch.from_numpy(np.concatenate(
                [engine.readTensor(t).reshape(-1) for t in bucket.tensors]))
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._groups[ipu])
            if self.scale != 1.0:
                flat.mul_(self.scale)
            values, offset = flat.numpy(), 0
            for t in bucket.tensors:
                size = int(np.prod(t.shape))
                engine.writeTensor(t, values[offset:offset + size].reshape(t.shape))
                offset += size
            elements += flat.numel()
            nbytes += flat.numel() * flat.element_size()
        record = Reduction(
            ipu=ipu, elements=elements, nbytes=nbytes,
            host_link_cycles=2 * self._target.host_cycles(nbytes),
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
    import torch.distributed as dist

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
    address, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=process_id,
                            world_size=num_processes, timeout=_timeout())


def gradient_buckets(lowering, updates) -> dict[int, list[Bucket]]:
    """The accumulators of the weights the optimiser updates, by IPU, one bucket per dtype."""
    by_ipu: dict[tuple[int, np.dtype], list[str]] = {}
    for name in sorted(updates.states):
        ipu = lowering.weights[name].ipu
        dtype = np.dtype(lowering.accumulators[name].dtype)
        by_ipu.setdefault((ipu, dtype), []).append(name)
    buckets: dict[int, list[Bucket]] = {}
    for (ipu, dtype), names in sorted(by_ipu.items(), key=lambda item: (item[0][0], item[0][1].str)):
        tensors = tuple(lowering.accumulators[n] for n in names)
        buckets.setdefault(ipu, []).append(Bucket(ipu, dtype, tuple(names), tensors))
    return buckets


def global_divisor(options) -> int:
    """What PopTorch divides the summed gradients by: with ReductionType.Mean, gradient
    accumulation x local replicas x processes (every replica of the run); otherwise 1."""
    if options.Training.accumulation_and_replication_reduction_type != ReductionType.Mean:
        return 1
    return options.gradient_accumulation * options.replication_factor * options.num_processes


def compiled_divisor(updates, optimizer) -> float:
    """The divisor the weight-update programs were compiled with: each device optimiser's loss
    scaling over its parameter group's own."""
    divisors = {cfg.loss_scaling / float(optimizer.param_groups[gi].get("loss_scaling", 1.0))
                for gi, cfg in updates.configs}
    if not divisors:
        return 1.0
    low, high = min(divisors), max(divisors)
    if not math.isclose(low, high, rel_tol=1e-6):
        raise RuntimeError(f"the weight updates of the parameter groups divide the gradients by "
                           f"different numbers ({sorted(divisors)}): they cannot share one "
                           "cross-process reduction")
    return float(round(low)) if math.isclose(low, round(low), rel_tol=1e-6) else low


def accumulator_scale(updates, optimizer, options) -> float:
    """The factor the all-reduced sum is multiplied by so that the compiled update divides it by
    the global divisor: compiled / global (1 when the update already divides by every replica)."""
    return compiled_divisor(updates, optimizer) / global_divisor(options)


def model_signature(weights: dict, buckets: dict[int, list[Bucket]], options) -> tuple:
    """What every process must agree on to train one model together, as (section, entries)."""
    return (
        ("weights", tuple((n, tuple(t.shape), str(t.dtype)) for n, t in sorted(weights.items()))),
        ("gradients reduced", tuple((ipu, b.dtype.str, b.names)
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
    import torch.distributed as dist

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
    import torch.distributed as dist

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
