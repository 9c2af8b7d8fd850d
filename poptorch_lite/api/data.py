"""``DataLoader`` and ``AsynchronousDataAccessor`` with PopTorch's semantics.

``DataLoader`` yields batches of the combined batch size (``batch_size *
deviceIterations * replicationFactor * gradientAccumulation``), so each item
feeds exactly one model call. In a run over ``P`` processes each process reads
its own contiguous share of the dataset, ``combined * (N // (combined * P))``
samples from offset ``process_id * share``; with ``shuffle`` the shares are cut
from one global permutation seeded by ``Options.randomSeed``, identical in
every process and new every epoch, and the samples ``drop_last`` left over in
one epoch come first in the next.

``AsynchronousDataAccessor`` iterates a dataset or loader in a worker process
that keeps up to ``buffer_size`` batches ready while the caller computes.
"""
import atexit
import collections
import contextlib
import copy
import gc
import logging
import multiprocessing
import numbers
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any, Dict, Optional, Tuple

import torch
import torch.multiprocessing  # noqa: F401  (tensors cross processes via shared memory)
import torch.utils.data

from .arguments import parser_for
from .batching import combined_batch_size
from .enums import DataLoaderMode, SharingStrategy
from .options import Options
from . import phases, zygote

logger = logging.getLogger("poptorch_lite")

# --- distributed sharding -------------------------------------------------


@dataclass(frozen=True)
class ProcessShard:
    """The contiguous range of the global sample order one process reads."""
    offset: int
    length: int
    leftovers: int  # samples no process reads this epoch


def process_shard(num_samples: int, combined: int, process_id: int,
                  num_processes: int, drop_last: bool) -> ProcessShard:
    """Split ``num_samples`` between processes.

    With ``drop_last`` every process gets the same whole number of combined
    batches, ``combined * (num_samples // (combined * num_processes))``
    samples from offset ``process_id`` times that; the rest is left over.
    Without it the samples are spread as evenly as possible and the last
    batch of a process may be incomplete.
    """
    if drop_last:
        per_process = combined * (num_samples // (combined * num_processes))
        return ProcessShard(process_id * per_process, per_process,
                            num_samples - num_processes * per_process)
    base, extra = divmod(num_samples, num_processes)
    offset = process_id * base + min(process_id, extra)
    return ProcessShard(offset, base + (process_id < extra), 0)


class _GlobalOrder:
    """The sample order of each epoch, the same in every process.

    A permutation drawn from a generator seeded with the options' random
    seed, advanced once per epoch; the samples left over by the previous
    epoch are moved to the front so that none is skipped twice in a row.
    (The state is kept as plain data: a ``torch.Generator`` or an empty
    tensor cannot be sent to a spawned worker through shared memory.)
    """

    def __init__(self, num_samples: int, seed: int, used: int):
        self._num_samples = num_samples
        self._used = used
        self._seed = seed
        self._generator_state = None
        self._leftovers = None

    def next_epoch(self) -> torch.Tensor:
        generator = torch.Generator()
        if self._generator_state is None:
            generator.manual_seed(self._seed)
        else:
            generator.set_state(
                torch.frombuffer(bytearray(self._generator_state),
                                 dtype=torch.uint8))
        order = torch.randperm(self._num_samples, generator=generator)
        self._generator_state = generator.get_state().numpy().tobytes()
        if self._leftovers is not None:
            was_left = torch.zeros(self._num_samples, dtype=torch.bool)
            was_left[self._leftovers] = True
            first = was_left[order]
            order = torch.cat([order[first], order[~first]])
        self._leftovers = (order[self._used:].clone()
                           if self._used < self._num_samples else None)
        return order


class _ShardDataset(torch.utils.data.Dataset):
    """One process's view of a map-style dataset.

    ``order`` (global order of this epoch, in shared memory so that
    persistent torch workers see each update) maps positions to samples;
    None means the natural order.
    """

    def __init__(self, dataset, shard: ProcessShard,
                 order: Optional[torch.Tensor]):
        self.dataset = dataset
        self.shard = shard
        self.order = order

    def __len__(self):
        return self.shard.length

    def __getitem__(self, index):
        if not 0 <= index < self.shard.length:
            raise IndexError(f"sample {index} is outside this process's "
                             f"{self.shard.length} samples")
        position = self.shard.offset + index
        if self.order is not None:
            position = int(self.order[position])
        return self.dataset[position]


class _GroupedBatches:
    """A user's batch sampler read ``factor`` batches at a time: each item is
    the indices of ``factor`` consecutive batches, tagged with the batch they
    came from (``(part, index)``, read by ``_PartDataset``) so that
    ``_GroupedCollate`` collates every batch on its own."""

    def __init__(self, batch_sampler, factor: int, drop_last: bool):
        self.batch_sampler = batch_sampler
        self.factor = factor
        self.drop_last = drop_last

    def __iter__(self):
        group = []
        for batch in self.batch_sampler:
            group.append(batch)
            if len(group) == self.factor:
                yield [(part, i) for part, b in enumerate(group) for i in b]
                group = []
        if group and not self.drop_last:
            yield [(part, i) for part, b in enumerate(group) for i in b]

    def __len__(self):
        items, rest = divmod(len(self.batch_sampler), self.factor)
        return items + (1 if rest and not self.drop_last else 0)


class _PartDataset(torch.utils.data.Dataset):
    """A map-style dataset read with ``(part, index)`` keys: the sample and
    the batch it belongs to."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        part, index = key
        return part, self.dataset[index]


class _GroupedCollate:
    """Collates each batch of a group with the user's ``collate_fn`` and
    joins the results along their first dimension (``concatenate``)."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, samples):
        parts = collections.defaultdict(list)
        for part, sample in samples:
            parts[part].append(sample)
        return concatenate([self.collate_fn(parts[p]) for p in sorted(parts)])


def concatenate(batches: list):
    """Collated batches of one structure joined into one: tensors along their
    first dimension (0-d tensors stacked), tuples, namedtuples, lists and
    dicts element by element, types with a registered ``ICustomArgParser``
    through it; lists of other values are chained."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches) if first.dim() else torch.stack(batches)
    parser = parser_for(first)
    if parser is not None:
        columns = zip(*(list(parser.yieldTensors(b)) for b in batches))
        return parser.reconstruct(first, iter([concatenate(list(c)) for c in columns]))
    if isinstance(first, dict):
        return type(first)((k, concatenate([b[k] for b in batches])) for k in first)
    if isinstance(first, (tuple, list)) and any(isinstance(v, (torch.Tensor, tuple, list, dict)) for v in first):
        items = [concatenate(list(c)) for c in zip(*batches)]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    if isinstance(first, (tuple, list)):
        return type(first)(v for b in batches for v in b)
    raise TypeError(f"DataLoader: cannot join batches of type {type(first).__name__} from a batch_sampler; "
                    "return tensors (in tuples, lists or dicts) from collate_fn, or register an "
                    "ICustomArgParser for the type.")


# --- DataLoader -----------------------------------------------------------


def _count_arg(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} expects an int >= {minimum}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return int(value)


class DataLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` whose items feed one model call each.

    :param options: the ``Options`` of the model the data is for (frozen here).
    :param batch_size: the micro-batch size; items hold ``batch_size *
        deviceIterations * replicationFactor * gradientAccumulation`` samples
        (``combinedBatchSize``). None passes the dataset's items unbatched.
    :param shuffle: shuffle every epoch; in a distributed run this needs
        ``options.randomSeed`` so that all processes agree on the order.
    :param drop_last: drop the samples that do not fill a whole item. With
        False the last item is smaller (a warning says so) and a model call
        will reject it unless the batching options are all 1.
    :param auto_distributed_partitioning: give each process its own share of
        a map-style dataset (see ``process_shard``).
    :param mode: ``DataLoaderMode.Sync``, ``Async`` or ``AsyncRebatched``.
    :param async_options: keyword arguments of ``AsynchronousDataAccessor``.
    :param rebatched_worker_size: with ``AsyncRebatched``, the batch size the
        torch loader produces (at most the combined batch size; default: the
        combined batch size).
    :param kwargs: passed to ``torch.utils.data.DataLoader``.
    """

    def __init__(self,
                 options: Options,
                 dataset,
                 batch_size: Optional[int] = 1,
                 shuffle: Optional[bool] = None,
                 num_workers: int = 0,
                 drop_last: bool = True,
                 persistent_workers: Optional[bool] = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: Optional[Dict[str, Any]] = None,
                 rebatched_worker_size: Optional[int] = None,
                 **kwargs):
        if not isinstance(options, Options):
            raise TypeError("DataLoader expects poptorch_lite.Options as its "
                            f"first argument, got {options!r}.")
        if not isinstance(mode, DataLoaderMode):
            raise TypeError("DataLoader: mode must be DataLoaderMode.Sync, "
                            f"Async or AsyncRebatched, got {mode!r}.")
        if batch_size is not None:
            batch_size = _count_arg("DataLoader: batch_size", batch_size, 1)
        num_workers = _count_arg("DataLoader: num_workers", num_workers, 0)
        shuffle = bool(shuffle)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        combined = None if batch_size is None else combined_batch_size(
            batch_size, options, training=True)
        num_processes = options.Distributed.numProcesses
        self._global_order = None
        batch_sampler = kwargs.pop("batch_sampler", None)

        if batch_sampler is not None:
            # each item is the batches of one model call: deviceIterations *
            # replicationFactor * gradientAccumulation batches of the sampler
            if rebatched_worker_size is not None:
                raise ValueError("DataLoader: rebatched_worker_size cannot be "
                                 "used with a batch_sampler, whose batches "
                                 "are kept as they are.")
            dataset, kwargs = self._grouped(dataset, batch_sampler, options,
                                            shuffle, drop_last,
                                            auto_distributed_partitioning,
                                            kwargs)
            combined = None
        elif isinstance(dataset, torch.utils.data.IterableDataset):
            if auto_distributed_partitioning and num_processes > 1:
                raise ValueError(
                    "DataLoader: auto_distributed_partitioning cannot split "
                    "an IterableDataset between processes. Split it yourself "
                    "(for example by options.Distributed.processId) and pass "
                    "auto_distributed_partitioning=False.")
            if num_workers > 1 and "worker_init_fn" not in kwargs:
                logger.warning(
                    "IterableDataset used with num_workers=%d and no "
                    "worker_init_fn: every worker iterates the whole dataset, "
                    "so each sample is returned %d times (see "
                    "torch.utils.data.IterableDataset).", num_workers,
                    num_workers)
        else:
            if num_processes > 1 and auto_distributed_partitioning:
                dataset, shuffle = self._shard(dataset, options, combined,
                                               shuffle, drop_last)
            leftover = 0 if combined is None else len(dataset) % combined
            if not drop_last and leftover:
                logger.warning(
                    "The dataset's %d samples (for this process) are not a "
                    "multiple of the combined batch size %d and "
                    "drop_last=False: the last batch holds %d samples, which "
                    "a model call only accepts if it is a multiple of "
                    "deviceIterations * replicationFactor * "
                    "gradientAccumulation. Use drop_last=True to avoid it.",
                    len(dataset), combined, leftover)

        rebatched_size = None
        if batch_sampler is not None:
            loader_batch_size, loader_drop_last = 1, False  # torch's defaults
        else:
            # Without batching there is no incomplete batch to drop.
            loader_batch_size = combined
            loader_drop_last = drop_last and combined is not None
        if mode == DataLoaderMode.AsyncRebatched and batch_sampler is None:
            if combined is None:
                raise ValueError("DataLoader: DataLoaderMode.AsyncRebatched "
                                 "needs a batch_size.")
            rebatched_size, loader_drop_last = combined, False
            if rebatched_worker_size is not None:
                loader_batch_size = _count_arg(
                    "DataLoader: rebatched_worker_size", rebatched_worker_size,
                    1)
                if loader_batch_size > combined:
                    raise ValueError(
                        f"DataLoader: rebatched_worker_size "
                        f"({loader_batch_size}) must be <= the combined batch "
                        f"size ({combined}).")
        elif rebatched_worker_size is not None:
            # PopTorch ignores it in the other modes (optimum-graphcore always passes one): say so
            warnings.warn(f"DataLoader: rebatched_worker_size={rebatched_worker_size} has no effect with "
                          f"mode={mode}; it sets the workers' batch only with DataLoaderMode.AsyncRebatched")

        super().__init__(dataset,
                         batch_size=loader_batch_size,
                         shuffle=shuffle,
                         num_workers=num_workers,
                         drop_last=loader_drop_last,
                         persistent_workers=persistent_workers,
                         **kwargs)
        options._freeze()  # pylint: disable=protected-access
        self._options = options
        self._combined_batch_size = combined
        self._rebatched_drop_last = drop_last
        self._accessor = None
        if mode != DataLoaderMode.Sync:
            async_options = dict(async_options or {})
            if "rebatched_size" in async_options:
                raise ValueError(
                    "DataLoader: do not put rebatched_size in async_options; "
                    "use mode=DataLoaderMode.AsyncRebatched, which rebatches "
                    "to the combined batch size.")
            self._accessor = AsynchronousDataAccessor(
                self, rebatched_size=rebatched_size, **async_options)
            self._accessor._hold_source_weakly()  # pylint: disable=protected-access

    @staticmethod
    def _grouped(dataset, batch_sampler, options, shuffle, drop_last,
                 auto_distributed_partitioning, kwargs):
        """The dataset and torch loader arguments that read a user's
        ``batch_sampler`` a model call's worth of batches at a time: each
        batch collated on its own, then joined (``concatenate``). With
        drop_last=False the last item may hold fewer batches. The items are
        whole model calls already, so AsyncRebatched loads them ahead as
        Async does."""
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise ValueError("DataLoader: batch_sampler needs a map-style "
                             "dataset (an IterableDataset has no indices).")
        if shuffle or kwargs.get("sampler") is not None:
            raise ValueError("DataLoader: batch_sampler is mutually exclusive "
                             "with shuffle and sampler: the batch sampler "
                             "chooses the samples.")
        if options.Distributed.numProcesses > 1 and \
                auto_distributed_partitioning:
            raise ValueError("DataLoader: auto_distributed_partitioning "
                             "cannot split a batch_sampler's batches between "
                             "processes; give each process a batch sampler "
                             "of its own share and pass "
                             "auto_distributed_partitioning=False.")
        factor = combined_batch_size(1, options, training=True)
        collate_fn = kwargs.pop("collate_fn", None) or \
            torch.utils.data.default_collate
        return _PartDataset(dataset), dict(
            kwargs, batch_sampler=_GroupedBatches(batch_sampler, factor,
                                                  drop_last),
            collate_fn=_GroupedCollate(collate_fn))

    def _shard(self, dataset, options, combined, shuffle, drop_last):
        if combined is None:
            raise ValueError("DataLoader: batch_size=None cannot be used with "
                             "auto_distributed_partitioning: the shares of "
                             "the processes are whole combined batches.")
        if shuffle and options.random_seed is None:
            raise ValueError(
                "DataLoader: shuffling in a distributed run needs "
                "options.randomSeed(seed) with the same seed in every "
                "process, so that they all shuffle the same way and read "
                "disjoint samples.")
        num_samples = len(dataset)
        num_processes = options.Distributed.numProcesses
        shard = process_shard(num_samples, combined,
                              options.Distributed.processId, num_processes,
                              drop_last)
        if shard.length == 0:
            needed = combined * num_processes if drop_last else num_processes
            raise ValueError(
                f"DataLoader: the dataset has {num_samples} samples, but "
                f"{num_processes} processes need at least {needed} "
                f"(drop_last={drop_last}, combined batch size {combined}) so "
                f"that each reads something. Use a smaller batch_size or "
                f"fewer processes.")
        order = None
        if shuffle:
            self._global_order = _GlobalOrder(
                num_samples, options.random_seed,
                num_samples - shard.leftovers)
            order = torch.arange(num_samples).share_memory_()
        return _ShardDataset(dataset, shard, order), False

    @property
    def combinedBatchSize(self) -> Optional[int]:
        """Samples per item: the samples one model call consumes."""
        return self._combined_batch_size

    @property
    def options(self) -> Options:
        """The (frozen) options this loader was built for."""
        return self._options

    def __len__(self) -> int:
        accessor = self._accessor
        if accessor is not None and accessor.rebatched_size:
            samples = len(self.dataset)
            batches, rest = divmod(samples, accessor.rebatched_size)
            return batches + (1 if rest and not self._rebatched_drop_last
                              else 0)
        return super().__len__()

    def __iter__(self):
        if self._accessor is not None:
            return _AsyncEpoch(self, iter(self._accessor))
        if self._global_order is not None:
            self.dataset.order.copy_(self._global_order.next_epoch())
        return super().__iter__()

    def terminate(self) -> None:
        """Stop the asynchronous worker, if any (also done by ``del``, a
        ``with`` block and interpreter exit)."""
        if self._accessor is not None:
            self._accessor.terminate()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.terminate()

    def __del__(self):
        if getattr(self, "_accessor", None) is not None:
            self.terminate()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_accessor"] = None
        state["_iterator"] = None
        return state


class _AsyncEpoch:
    """One epoch of an asynchronous DataLoader. It holds the loader, so that a
    loader iterated without being bound to a name (``for x in
    DataLoader(...)``) lives, and keeps its worker, until the epoch ends."""

    def __init__(self, loader: DataLoader, accessor: "AsynchronousDataAccessor"):
        self._loader = loader
        self._accessor = accessor

    def __iter__(self) -> "_AsyncEpoch":
        return self

    def __next__(self):
        return next(self._accessor)

    def __len__(self) -> int:
        return len(self._loader)


# --- asynchronous loading -------------------------------------------------

_LIVE_ACCESSORS = weakref.WeakSet()
# Seconds between the worker process's checks that the host still runs.
_HOST_CHECK_INTERVAL = 0.1
# Seconds to wait for the exit status of a worker process that has closed its pipes: it is
# exiting, and its status comes as soon as its parent reaps it, which on a loaded machine can
# take more than a second.
_EXIT_STATUS_WAIT = 60.0


def _close_idle_zygote() -> None:
    """Stop the zygote once no accessor of this process may need it."""
    if not _LIVE_ACCESSORS:
        zygote.close()


@atexit.register
def _terminate_live_accessors():
    for accessor in list(_LIVE_ACCESSORS):
        accessor.terminate()
    zygote.close()


@dataclass(frozen=True)
class _WorkerSettings:
    buffer_size: int
    load_indefinitely: bool
    early_preload: bool
    rebatched_size: Optional[int]
    rebatched_drop_last: bool
    parent_pid: int
    start_method: str  # the host's default: for the DataLoader workers


def _leading_rows(batch) -> int:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise ValueError("rebatching joins items along their first "
                             "(batch) dimension, so items must be batched "
                             "tensors (for example from a DataLoader); got "
                             "a 0-d tensor")
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch:
        rows = {_leading_rows(b) for b in batch}
    elif isinstance(batch, dict) and batch:
        rows = {_leading_rows(b) for b in batch.values()}
    else:
        raise TypeError("rebatching needs tensors or lists, tuples or dicts "
                        f"of tensors, got {type(batch).__name__}")
    if len(rows) != 1:
        raise ValueError(f"rebatching needs the same batch size in every "
                         f"tensor of an item, got {sorted(rows)}")
    return rows.pop()


def _like(sequence, values):
    """A list, tuple or namedtuple of the same type as ``sequence``."""
    if hasattr(sequence, "_fields"):
        return type(sequence)(*values)
    return type(sequence)(values)


def _concat(first, second):
    if isinstance(first, torch.Tensor):
        return torch.cat([first, second])
    if isinstance(first, dict):
        return {k: _concat(first[k], second[k]) for k in first}
    return _like(first, [_concat(a, b) for a, b in zip(first, second)])


def _split(batch, rows: int):
    if isinstance(batch, torch.Tensor):
        return batch[:rows], batch[rows:]
    if isinstance(batch, dict):
        pairs = {k: _split(v, rows) for k, v in batch.items()}
        return ({k: p[0] for k, p in pairs.items()},
                {k: p[1] for k, p in pairs.items()})
    pairs = [_split(b, rows) for b in batch]
    return (_like(batch, [p[0] for p in pairs]),
            _like(batch, [p[1] for p in pairs]))


def _describe_exception(error: BaseException) -> Tuple[Optional[bytes], str,
                                                       str]:
    text = "".join(traceback.format_exception(error))
    try:
        blob = pickle.dumps(error)
        pickle.loads(blob)
    except Exception:  # pylint: disable=broad-except
        blob = None
    return blob, type(error).__qualname__, text


class _Meter:
    """The sampler a DataLoader's workers get their batches from (its
    ``_index_sampler``), metered while the program has not asked for the
    epoch: an epoch the accessor began by itself (the next one, with
    ``load_indefinitely``; the first, with ``early_preload``) dispatches only
    as many batches as the ring buffer holds, PopTorch's bound on what is
    loaded ahead. Unmetered, torch hands its workers ``prefetch_factor *
    num_workers`` batches as an epoch starts: with 16 workers, the whole of a
    15-item epoch, loaded whether or not the program ever reads it. Once the
    program iterates the epoch, ``release`` dispatches the rest as torch
    would have. Torch gives the k-th batch of an epoch to the next worker in
    turn however late it is dispatched, so the items are the same.

    Installed (``install``) on a map-style DataLoader with workers, the only
    source whose iterator loads ahead of ``next()``."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.allowance: Optional[int] = None  # batches the epoch may dispatch
        self.dispatched = 0
        self.exhausted = False
        self._indices = None

    @staticmethod
    def install(source) -> Optional["_Meter"]:
        if not (isinstance(source, torch.utils.data.DataLoader) and source.num_workers > 0
                and not isinstance(source.dataset, torch.utils.data.IterableDataset)
                and hasattr(torch.utils.data.dataloader._MultiProcessingDataLoaderIter,  # pylint: disable=protected-access
                            "_try_put_index")):
            return None
        name = "batch_sampler" if source.batch_sampler is not None else "sampler"
        meter = _Meter(getattr(source, name))
        # (a DataLoader refuses new samplers once built; this one is the accessor's own copy)
        object.__setattr__(source, name, meter)
        return meter

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> "_Meter":
        """A new epoch (torch starts one with ``iter()`` of its sampler)."""
        self.dispatched, self.exhausted = 0, False
        self._indices = iter(self.sampler)
        return self

    def __next__(self):
        if self.allowance is not None and self.dispatched >= self.allowance:
            # held back (torch asks again after each batch it receives)
            raise StopIteration
        try:
            indices = next(self._indices)
        except StopIteration:
            self.exhausted = True
            raise
        self.dispatched += 1
        return indices

    def holds_back(self, pulled: int) -> bool:
        """Whether every batch dispatched has been taken (``pulled``) while
        the epoch is metered: torch would take the next ``next()`` for the
        epoch's end."""
        return self.allowance is not None and not self.exhausted and pulled >= self.dispatched

    def release(self, iterator) -> None:
        """The program iterates the epoch: dispatch as torch would have. Torch keeps at most
        ``prefetch_factor * num_workers`` batches in flight, counting those received out of
        order and not yet returned (each one it returns dispatches another; torch asserts the
        bound), so the batches its ``_task_info`` holds count, not only the outstanding ones."""
        self.allowance = None
        limit = iterator._prefetch_factor * iterator._num_workers  # pylint: disable=protected-access
        while not self.exhausted and len(iterator._task_info) < limit:  # pylint: disable=protected-access
            before = self.dispatched
            iterator._try_put_index()  # pylint: disable=protected-access
            if self.dispatched == before:
                break


class _Worker:
    """The loop of the worker process.

    It loads items of the current epoch while it has credits (free ring
    buffer slots) and sends them tagged with the epoch id. The host sends
    ``("start", epoch)`` whenever it iterates, ``("credit", n)`` and
    ``("stop",)``. An epoch the worker begins by itself (the next one, with
    ``load_indefinitely``) loads only what the ring buffer holds until the
    host's start for it arrives (see ``_Meter``); a start for an epoch the
    worker has gone past is ignored.
    """

    def __init__(self, source, data, commands, settings):
        self.source = source
        self.data = data  # the write end of the pipe to the host
        self.commands = commands
        self.settings = settings
        self.credits = settings.buffer_size
        self.epoch = None
        self.iterator = None
        self.ready = collections.deque()
        self.carry = None
        self.exhausted = False
        self.sent = 0  # items sent in the current epoch
        self.pulled_in_epoch = 0  # items taken from the source in the current epoch
        self.meter: Optional[_Meter] = None
        self.pulled = 0  # items taken from the source, all epochs (for the phase trace)
        self.sent_total = 0
        self.epochs = 0
        self.stopping = False
        self.start_parent = os.getppid()

    def run(self) -> None:
        self.meter = _Meter.install(self.source)
        if self.settings.early_preload:
            self.begin(0, requested=False)
        while not self.stopping:
            # Sending "end" needs no credit; loading or sending an item does,
            # and loading one a metered epoch has not dispatched waits.
            held_back = (not self.ready and self.meter is not None
                         and self.meter.holds_back(self.pulled_in_epoch))
            can_step = self.epoch is not None and (
                (self.credits > 0 and not held_back) or (self.exhausted and not self.ready))
            self.read_commands(wait=not can_step)
            if can_step and not self.stopping:
                self.step()

    def read_commands(self, wait: bool) -> None:
        try:
            if not self.commands.poll(0.5 if wait else 0):
                if wait and not self.host_alive():
                    self.stopping = True
                return
            while not self.stopping and self.commands.poll():
                self.handle(self.commands.recv())
        except (EOFError, OSError):
            self.stopping = True

    def host_alive(self) -> bool:
        return _host_alive(self.settings, self.start_parent)

    def close(self) -> None:
        """Shut down the iterators of the source: a torch DataLoader joins its
        worker processes (persistent ones too) and releases their queues."""
        torch_iterator = getattr(self.source, "_iterator", None)
        phases.mark("accessor:close", epochs=self.epochs, pulled=self.pulled, sent=self.sent_total,
                    dispatched=getattr(torch_iterator, "_send_idx", "-"))
        iterators = (self.iterator, torch_iterator)
        self.iterator = None
        for iterator in iterators:
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def handle(self, command) -> None:
        if command[0] == "stop":
            self.stopping = True
        elif command[0] == "credit":
            self.credits += command[1]
        elif command[0] == "start":
            if self.epoch is None or command[1] > self.epoch:
                self.begin(command[1], requested=True)
            elif command[1] == self.epoch and self.meter is not None \
                    and self.meter.allowance is not None and self.iterator is not None:
                self.meter.release(self.iterator)
                phases.mark("accessor:released", epoch=self.epoch, pulled=self.pulled_in_epoch)

    def begin(self, epoch: int, requested: bool) -> None:
        """Start loading `epoch`; one the host has not asked for yet
        (`requested` False) is metered (see _Meter)."""
        self.iterator = None  # let the previous iterator release its workers
        self.ready.clear()
        self.carry = None
        self.exhausted = False
        self.sent = 0
        self.pulled_in_epoch = 0
        self.epoch = epoch
        self.epochs += 1
        phases.mark("accessor:epoch", epoch=epoch, requested=requested)
        if self.meter is not None:
            self.meter.allowance = None if requested else self.settings.buffer_size
        try:
            self.iterator = iter(self.source)
        except Exception as error:  # pylint: disable=broad-except
            self.fail(error)

    def fail(self, error: BaseException) -> None:
        self.data.send(("error", self.epoch, *_describe_exception(error)))
        self.epoch, self.iterator = None, None

    def step(self) -> None:
        if not self.ready and not self.exhausted:
            try:
                self.pull()
            except Exception as error:  # pylint: disable=broad-except
                self.fail(error)
                return
        if self.ready:
            self.credits -= 1
            self.sent += 1
            self.sent_total += 1
            self.data.send(("data", self.epoch, self.ready.popleft()))
        elif self.exhausted:
            finished = self.epoch
            self.data.send(("end", finished))
            phases.mark("accessor:epoch-end", epoch=finished, sent=self.sent)
            # An empty epoch is not repeated by itself: it would spin.
            if self.settings.load_indefinitely and self.sent:
                self.begin(finished + 1, requested=False)
            else:
                self.epoch, self.iterator = None, None

    def pull(self) -> None:
        size = self.settings.rebatched_size
        try:
            item = next(self.iterator)
            self.pulled += 1
            self.pulled_in_epoch += 1
        except StopIteration:
            self.exhausted = True
            if self.carry is not None and not self.settings.rebatched_drop_last:
                self.ready.append(self.carry)
            self.carry = None
            return
        if size is None:
            self.ready.append(item)
            return
        self.carry = item if self.carry is None else _concat(self.carry, item)
        while self.carry is not None and _leading_rows(self.carry) >= size:
            head, rest = _split(self.carry, size)
            self.ready.append(head)
            self.carry = rest if _leading_rows(rest) else None


def _running(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (dead, not yet reaped) does not."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _start_loader_workers_as_the_host(source, start_method: str) -> None:
    """Start the torch DataLoader workers of ``source`` as they would start in
    the user's own process: with the host's default start method (fork on
    Linux up to Python 3.13), unless the user gave the DataLoader a
    ``multiprocessing_context``, which is always honoured.

    A spawned Python process makes ``spawn`` its own default start method, so
    without this every worker of the loader this process iterates would be a
    fresh interpreter importing torch (seconds each; 16 workers are 16 more
    interpreters, and every spawned queue's semaphores are left to the
    resource tracker). This process is fresh and runs no Numba threads or
    BLAS pools, so forking it is safe."""
    if (isinstance(source, torch.utils.data.DataLoader) and source.num_workers > 0
            and source.multiprocessing_context is None):
        source.multiprocessing_context = start_method


def _default_start_method() -> str:
    """This process's default start method, without fixing it (as
    ``multiprocessing.get_start_method()`` would): the first of
    ``get_all_start_methods`` unless one was set."""
    return (multiprocessing.get_start_method(allow_none=True)
            or multiprocessing.get_all_start_methods()[0])


class _Stop(BaseException):
    """Raised in the worker process's main thread to shut it down cleanly."""


def _stop_on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: see _worker_main
    raise _Stop()


def _watch_host(settings: "_WorkerSettings", start_parent: int) -> None:
    """Thread of the worker process: when the host process dies (however it
    dies, SIGKILL included) stop this process, so that neither it nor the
    DataLoader workers it started outlive the host."""
    while _host_alive(settings, start_parent):
        time.sleep(_HOST_CHECK_INTERVAL)
    os.kill(os.getpid(), signal.SIGTERM)


def _how_the_worker_ended(process) -> str:
    """What the host knows of a worker process that ended without reporting
    an error: its exit code or signal, or, for a fork of the zygote whose
    zygote ended first, that it lost its zygote (its exit code is unknown)."""
    if getattr(process, "status_lost", False):
        if process.pid is None:
            return ("The AsynchronousDataAccessor worker process was never "
                    "started: its zygote ended (or could not fork it) first.")
        return (f"The AsynchronousDataAccessor worker process (pid "
                f"{process.pid}) lost the zygote it was forked from, which "
                f"ended first: the process stops by itself, without "
                f"reporting an error, and its exit code is unknown.")
    code = process.exitcode
    if code is None:
        how = (f"closed its pipes without reporting an error, and had not "
               f"exited {_EXIT_STATUS_WAIT:g} s later")
    elif code < 0:
        how = (f"was killed by signal {signal.Signals(-code).name} without "
               f"reporting an error")
    else:
        how = f"exited with code {code} without reporting an error"
    return (f"The AsynchronousDataAccessor worker process (pid {process.pid}) "
            f"{how}.")


def _host_alive(settings: "_WorkerSettings", start_parent: int) -> bool:
    if os.getppid() != start_parent:
        return False  # our parent died: we were re-parented
    # A forkserver worker's parent is the server, not the host.
    return start_parent == settings.parent_pid or _running(settings.parent_pid)


def _sent_copy(source):
    """What is pickled for the worker process: a DataLoader without its
    options (its copy only iterates, and an execution strategy in the options
    would import the device emulator there); any other source as it is."""
    if not isinstance(source, DataLoader):
        return source
    source = copy.copy(source)  # __getstate__: no accessor, no iterator
    source._options = None  # pylint: disable=protected-access
    return source


class _DatasetFile:
    """The file the host pickles the dataset to (SharingStrategy.FileSystem),
    held by its descriptor. The file has no name (``tempfile.TemporaryFile``:
    ``O_TMPFILE`` on Linux, else unlinked as soon as it is created), so it
    is never in the temporary directory and its space is freed when the last
    descriptor closes, however the host and the worker process end. It
    reaches the worker process as a duplicated descriptor, as the ends of a
    ``Pipe`` do."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _DatasetFile._rebuild, (reduction.DupFd(self.fd), )

    @staticmethod
    def _rebuild(duplicate) -> "_DatasetFile":
        return _DatasetFile(duplicate.detach())

    def read(self):
        """The dataset. The descriptor is closed (and the file's space freed
        once the host has closed its own)."""
        fd, self.fd = self.fd, None
        with open(fd, "rb") as file:  # shares the host's file offset
            file.seek(0)
            return pickle.load(file)

    def close(self) -> None:
        """Close the descriptor if ``read`` did not."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def _serve(worker: "_Worker", payload, collector_paused: bool) -> None:
    """The worker process's work: receive the dataset, then load items until
    stopped. ``collector_paused``: forked from the zygote (see zygote.py)."""
    # Neither this process nor the DataLoader workers it starts outlive the
    # host: a thread watches it.
    threading.Thread(target=_watch_host, args=(worker.settings, worker.start_parent),
                     daemon=True, name="host watcher").start()
    phases.ROLE = "accessor"
    phases.mark("accessor:start")
    # One intra-op thread, as in torch's own DataLoader workers: this process
    # only loads, and a forked copy of a host that has run parallel torch ops
    # would hang in its first parallel region (the thread pool does not
    # survive the fork).
    torch.set_num_threads(1)
    if isinstance(payload, _DatasetFile):
        if worker.commands.recv()[0] != "dataset":
            return  # stopped before the host had written the file
    try:
        if isinstance(payload, _DatasetFile):
            payload = payload.read()
        if isinstance(payload, DataLoader):
            payload._accessor = None  # this copy loads synchronously  # pylint: disable=protected-access
        if collector_paused:  # see zygote._QuietSpawn
            gc.freeze()
            gc.enable()
        _start_loader_workers_as_the_host(payload, worker.settings.start_method)
        phases.mark("accessor:dataset", workers=getattr(payload, "num_workers", 0))
    except Exception as error:  # pylint: disable=broad-except
        worker.data.send(("error", None, *_describe_exception(error)))
        return
    worker.source = payload
    worker.run()


def _worker_main(payload, data, commands, settings, collector_paused=False) -> None:
    """Entry point of the worker process."""
    # The host owns shutdown: Ctrl-C reaches it, and it stops this worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = _Worker(None, data, commands, settings)
    try:
        try:
            # SIGTERM (from the host's terminate() or from the host watcher)
            # raises _Stop once in the main thread, wherever it is, so that the
            # DataLoader workers are shut down and the pipes closed below. It
            # is set up inside these blocks, and the handler ignores any later
            # SIGTERM before it raises, so _Stop can only unwind to the except
            # clause: the shutdown always runs, and is never interrupted.
            signal.signal(signal.SIGTERM, _stop_on_sigterm)
            _serve(worker, payload, collector_paused)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (_Stop, EOFError, BrokenPipeError, ConnectionResetError):
        pass  # stopped, or the host closed its end: nobody wants more items
    finally:
        if isinstance(payload, _DatasetFile):
            payload.close()
        worker.close()
        data.close()
        phases.mark("accessor:exit")


class _VerbatimMessage(str):
    """A message KeyError prints as is (it normally shows its repr)."""

    def __repr__(self):
        return str(self)


_START_METHODS = {
    SharingStrategy.SharedMemory: "spawn",
    SharingStrategy.FileSystem: "spawn",
    SharingStrategy.Fork: "fork",
    SharingStrategy.ForkServer: "forkserver",
}

def _log_worker_pid(pid: int) -> None:
    logger.debug("AsynchronousDataAccessor worker process: %d", pid)


class AsynchronousDataAccessor:
    """Iterates ``dataset`` (any iterable: a dataset, a ``DataLoader``, ...)
    in a worker process that loads ahead while the caller computes.

    At most ``buffer_size`` items are loaded and not yet released (an item is
    released when the next one is requested). Items are fresh tensors: they
    stay valid after the next request.

    :param buffer_size: size of the ring buffer of loaded items.
    :param miss_sleep_time_in_ms: accepted for PopTorch compatibility; the
        worker here wakes as soon as a slot frees, without polling.
    :param load_indefinitely: start loading the next epoch as soon as one
        ends (otherwise wait until the next ``iter()``).
    :param early_preload: start loading at construction rather than at the
        first ``iter()``.
    :param sharing_strategy: how the dataset reaches the worker (see
        ``SharingStrategy``); the spawning strategies need a picklable
        dataset and, in scripts, an ``if __name__ == "__main__":`` guard.
    :param rebatched_size: if set, concatenate and split the items into
        batches of this many samples (incomplete final batch dropped unless
        the dataset is a ``DataLoader`` with ``drop_last=False``).

    An error in the worker is raised by ``next()`` with the worker's
    traceback in its message. ``terminate()``, a ``with`` block, ``del``
    and interpreter exit stop the worker; terminating it during an epoch
    makes the next ``next()`` an error, never a silently short epoch. So
    does a worker that ends without reporting an error, or an item the host
    cannot receive: that epoch then ends, and the accessor cannot be
    iterated again.

    The worker process and the host talk through pipes (no semaphores, so
    nothing for the resource tracker to clean up however either ends). The
    worker stops when the host asks, when the host dies (it checks every
    0.1 s, so it and the DataLoader workers it started are gone within a
    second), and on SIGTERM, each time shutting its DataLoader workers down
    first. The DataLoader workers it starts are started as the host would
    start them (see ``_start_loader_workers_as_the_host``): forked on Linux.
    With the spawning strategies (FileSystem, SharedMemory) this process is
    a fork of the host's zygote, one interpreter spawned as PopTorch spawns
    this process, so that the host's accessors share one interpreter start
    (see zygote.py).
    """

    def __init__(self,
                 dataset,
                 buffer_size: int = 3,
                 miss_sleep_time_in_ms: float = 0.1,
                 load_indefinitely: bool = True,
                 early_preload: bool = False,
                 sharing_strategy: SharingStrategy = SharingStrategy.FileSystem,
                 rebatched_size: Optional[int] = None):
        self._process = None
        buffer_size = _count_arg("AsynchronousDataAccessor: buffer_size",
                                 buffer_size, 1)
        if isinstance(miss_sleep_time_in_ms, bool) or not isinstance(
                miss_sleep_time_in_ms,
                numbers.Real) or miss_sleep_time_in_ms <= 0:
            raise ValueError("AsynchronousDataAccessor: miss_sleep_time_in_ms "
                             f"must be a positive number, got "
                             f"{miss_sleep_time_in_ms!r}.")
        for name, flag in (("load_indefinitely", load_indefinitely),
                           ("early_preload", early_preload)):
            if not isinstance(flag, bool):
                raise TypeError(f"AsynchronousDataAccessor: {name} expects "
                                f"True or False, got {flag!r}.")
        if not isinstance(sharing_strategy, SharingStrategy):
            raise TypeError("AsynchronousDataAccessor: sharing_strategy must "
                            "be a SharingStrategy, got "
                            f"{sharing_strategy!r}.")
        if rebatched_size is not None:
            rebatched_size = _count_arg(
                "AsynchronousDataAccessor: rebatched_size", rebatched_size, 2)
        if isinstance(dataset, DataLoader) and dataset._accessor is not None:  # pylint: disable=protected-access
            raise ValueError(
                "This DataLoader already loads through its own "
                "AsynchronousDataAccessor: iterate the DataLoader directly, "
                "or build it with mode=DataLoaderMode.Sync.")
        self.rebatched_size = rebatched_size
        self._source = dataset
        self._source_ref = None
        self._owner_pid = os.getpid()
        self._settings = _WorkerSettings(
            buffer_size, load_indefinitely, early_preload, rebatched_size,
            getattr(dataset, "_rebatched_drop_last", True), os.getpid(),
            _default_start_method())
        self._start_worker(dataset, sharing_strategy)
        # Host-side view of the worker's epochs (see _Worker).
        self._last_started = 0 if early_preload else -1
        self._prefetched = 0 if early_preload else None
        self._current = None
        self._done = True
        self._received = 0
        self._holding = False
        self._broken = None

    def _start_worker(self, dataset, sharing_strategy) -> None:
        with phases.phase("loader-start", strategy=sharing_strategy.name):
            self._start_worker_process(dataset, sharing_strategy)

    def _start_worker_process(self, dataset, sharing_strategy) -> None:
        context = multiprocessing.get_context(_START_METHODS[sharing_strategy])
        # Pipes, not queues: they need no semaphores, so nothing is left for
        # the resource tracker however either process ends.
        self._data, data_writer = context.Pipe(duplex=False)
        commands_reader, self._commands = context.Pipe(duplex=False)
        if sharing_strategy != SharingStrategy.Fork:
            dataset = _sent_copy(dataset)
        # With FileSystem the process is started first and the dataset pickled
        # to a file while it starts (a spawned interpreter spends seconds
        # importing torch before it can read anything); a command tells it the
        # file is complete. The other strategies hand the dataset over at start.
        file_system = sharing_strategy == SharingStrategy.FileSystem
        with tempfile.TemporaryFile() if file_system else contextlib.nullcontext() as dump:
            args = (_DatasetFile(dump.fileno()) if file_system else dataset,
                    data_writer, commands_reader, self._settings)
            # With spawn: forked from the zygote, the collector paused (see zygote.py).
            from_zygote = context.get_start_method() == "spawn" and zygote.AVAILABLE
            process = context.Process(target=_worker_main, args=args + (from_zygote, ),
                                      name="AsynchronousDataAccessor", daemon=False)
            try:
                if from_zygote:
                    process = zygote.fork(process)
                else:
                    process.start()
            except Exception as error:
                self._commands.close()
                self._data.close()
                raise TypeError(self._pickle_advice(sharing_strategy,
                                                    error)) from error
            finally:
                commands_reader.close()
                data_writer.close()
            self._process = process
            _LIVE_ACCESSORS.add(self)
            logger.debug("AsynchronousDataAccessor parent process: %d", os.getpid())
            if from_zygote:  # known once the zygote has forked it (it may still be importing the script)
                process.on_pid = _log_worker_pid
            else:
                _log_worker_pid(process.pid)
            if file_system:
                try:
                    pickle.dump(dataset, dump, protocol=pickle.HIGHEST_PROTOCOL)
                    dump.flush()
                except Exception as error:
                    self._abort_start()
                    raise TypeError(self._pickle_advice(sharing_strategy,
                                                        error)) from error
                self._send(("dataset", ))

    def _abort_start(self) -> None:
        """Stop a worker process that has not received its dataset: it is
        still starting, so it is stopped by signal rather than asked."""
        process, self._process = self._process, None
        _LIVE_ACCESSORS.discard(self)
        process.terminate()
        process.join()
        process.close()
        self._commands.close()
        self._data.close()
        _close_idle_zygote()

    @staticmethod
    def _pickle_advice(sharing_strategy, error) -> str:
        return (f"AsynchronousDataAccessor could not send the dataset to its "
                f"worker process with SharingStrategy.{sharing_strategy.name} "
                f"({type(error).__name__}: {error}). Make the dataset "
                f"picklable (classes defined at module level, no open files, "
                f"locks or generators) or use "
                f"sharing_strategy=SharingStrategy.Fork.")

    def _hold_source_weakly(self) -> None:
        """Keep only a weak reference to the source (a DataLoader that owns
        this accessor), so that dropping the loader stops the worker."""
        self._source_ref = weakref.ref(self._source)
        self._source = None

    def _source_object(self):
        return self._source if self._source_ref is None else self._source_ref()

    def __len__(self) -> int:
        source = self._source_object()
        length = len(source)
        owner = getattr(source, "_accessor", None)
        if self.rebatched_size and owner is not self and hasattr(
                source, "batch_size") and source.batch_size:
            length = length * source.batch_size // self.rebatched_size
        return length

    # --- iteration --------------------------------------------------------

    def __iter__(self) -> "AsynchronousDataAccessor":
        if self._process is None:
            raise RuntimeError("This AsynchronousDataAccessor was terminated: "
                               "create a new one to load data again.")
        if self._broken is not None:
            raise RuntimeError(self._broken)
        self._release()
        if self._prefetched is not None:  # begun by the worker: it loads the rest now
            self._current, self._prefetched = self._prefetched, None
        else:
            self._last_started += 1
            self._current = self._last_started
        self._send(("start", self._current))
        self._done = False
        self._received = 0
        return self

    def __next__(self):
        if self._current is None or self._done:
            raise StopIteration
        if self._process is None:
            self._done = True
            raise RuntimeError(
                f"The AsynchronousDataAccessor was terminated during an epoch, "
                f"after {self._received} item(s): the epoch cannot be "
                f"completed. Terminate it (or the DataLoader) only after the "
                f"iteration, or create a new one to load data again.")
        self._release()
        while True:
            message = self._receive()
            kind, epoch = message[0], message[1]
            if kind == "error" and epoch is None:
                self._done = True
                self._broken = ("The AsynchronousDataAccessor worker process "
                                "could not load the dataset (see the error "
                                "above); create a new accessor.")
                raise self._worker_error(message)
            if kind == "end" and self._settings.load_indefinitely:
                self._last_started = max(self._last_started, epoch + 1)
            if epoch != self._current:
                if kind == "data":
                    self._send(("credit", 1))
                continue
            if kind == "data":
                self._holding = True
                self._received += 1
                if self._received == 1:
                    phases.mark("loader:first-item", epoch=epoch)
                return message[2]
            self._done = True
            phases.mark("loader:epoch-end", epoch=epoch, received=self._received)
            if kind == "end":
                # The worker goes on with the next epoch unless this one
                # was empty (see _Worker.step).
                if self._settings.load_indefinitely and self._received:
                    self._prefetched = epoch + 1
                raise StopIteration
            raise self._worker_error(message)

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self._send(("credit", 1))

    def _send(self, command) -> None:
        try:
            self._commands.send(command)
        except (BrokenPipeError, OSError):
            raise self._death_error() from None

    def _receive(self):
        while True:
            try:
                if self._data.poll(0.1):
                    return self._data.recv()
            except EOFError:  # the worker closed its end: it is exiting
                raise self._death_error() from None
            except Exception as error:  # pylint: disable=broad-except
                raise self._receive_error(error) from error
            if not self._process.is_alive() and not self._data.poll(0):
                raise self._death_error()

    def _receive_error(self, error: Exception) -> RuntimeError:
        """The error for an item that could not be received: it is lost, so
        the epoch cannot be completed. Shared tensors are fetched from the
        worker process, which fails (an OSError) when it is exiting: then its
        end is the error, once its exit status has come."""
        self._process.join(timeout=_EXIT_STATUS_WAIT
                           if isinstance(error, OSError) else 0)
        if not self._process.is_alive():
            return self._death_error()
        self._done = True
        self._broken = (f"AsynchronousDataAccessor could not receive an item "
                        f"from its worker process: {error!r}. The epoch "
                        f"cannot be completed without it: create a new "
                        f"accessor to load data again.")
        return RuntimeError(self._broken)

    def _death_error(self) -> RuntimeError:
        """The error for a worker process found ending without reporting
        one (its pipes closed): with its exit status once its parent has
        reaped it."""
        process = self._process
        process.join(timeout=_EXIT_STATUS_WAIT)
        self._broken = (f"{_how_the_worker_ended(process)} Create a new "
                        f"accessor to load data again.")
        self._done = True
        return RuntimeError(self._broken)

    def _worker_error(self, message) -> BaseException:
        _, _, blob, type_name, text = message
        description = (f"Caught {type_name} in the AsynchronousDataAccessor "
                       f"worker process (pid {self._process.pid}).\n"
                       f"Original {text}")
        error_type = RuntimeError
        if blob is not None:
            try:
                error_type = type(pickle.loads(blob))
            except Exception:  # pylint: disable=broad-except
                pass
        if issubclass(error_type, KeyError):
            description = _VerbatimMessage(description)
        try:
            return error_type(description)
        except Exception:  # pylint: disable=broad-except
            return RuntimeError(description)

    # --- shutdown ---------------------------------------------------------

    def terminate(self) -> None:
        """Stop the worker process (idempotent)."""
        process = getattr(self, "_process", None)
        if process is None:
            return
        self._process = None
        _LIVE_ACCESSORS.discard(self)
        if os.getpid() != self._owner_pid:
            return  # a forked copy: the worker belongs to the original
        with phases.phase("loader-terminate"):
            self._stop(process)

    def _stop(self, process) -> None:
        """Ask the worker process to stop, then signal it if it does not."""
        if process.is_alive():
            try:
                self._commands.send(("stop", ))
            except (BrokenPipeError, OSError):
                pass
            process.join(timeout=2)
        if process.is_alive():
            process.terminate()
            process.join(timeout=2)
        if process.is_alive():
            process.kill()
        process.join()
        process.close()
        self._commands.close()
        self._data.close()
        _close_idle_zygote()

    def __enter__(self) -> "AsynchronousDataAccessor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.terminate()

    def __del__(self):
        self.terminate()
