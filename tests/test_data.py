"""DataLoader batching and sharding; AsynchronousDataAccessor behaviour."""
import collections
import gc
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from poptorch_lite.api.arguments import ICustomArgParser, registerCustomArgParser
from poptorch_lite.api.data import (AsynchronousDataAccessor, DataLoader,
                                process_shard)
from poptorch_lite.api.enums import DataLoaderMode, SharingStrategy
from poptorch_lite.api.options import Options

FORK = {"sharing_strategy": SharingStrategy.Fork}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Pair = collections.namedtuple("Pair", "data label")


class Numbered(torch.utils.data.Dataset):
    """Sample i is (tensor([i, i]), tensor(i))."""

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if not 0 <= index < self.length:
            raise IndexError(index)
        return torch.tensor([index, index]), torch.tensor(index)


class NumberedStream(torch.utils.data.IterableDataset):

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __iter__(self):
        return iter(torch.arange(self.length))


class Slow(torch.utils.data.Dataset):
    """Takes ``delay`` seconds per sample and returns when it was loaded."""

    def __init__(self, length, delay):
        self.length, self.delay = length, delay

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        start = time.monotonic()
        time.sleep(self.delay)
        return torch.tensor([index, start, time.monotonic()],
                            dtype=torch.float64)


class BrokenAt(Numbered):

    def __init__(self, length, broken, error=ValueError):
        super().__init__(length)
        self.broken, self.error = broken, error

    def __getitem__(self, index):
        if index == self.broken:
            raise self.error(f"sample {index} is corrupt")
        return super().__getitem__(index)


class NeedsTwoArguments(Exception):

    def __init__(self, first, second):
        super().__init__(f"{first} and {second}")


class RaisesUnpicklable(Numbered):

    def __getitem__(self, index):
        if index == 1:
            raise NeedsTwoArguments("left", "right")
        return super().__getitem__(index)


class ExitsAt(Numbered):

    def __init__(self, length, at):
        super().__init__(length)
        self.at = at

    def __getitem__(self, index):
        if index == self.at:
            os._exit(3)
        return super().__getitem__(index)


class SlowToExit(Numbered):
    """Its worker process, once stopped, takes 2 s more to exit after closing its pipes (a
    finalizer its first sample registers there). With `tensors` False, samples are plain ints."""

    def __init__(self, length, tensors):
        super().__init__(length)
        self.tensors = tensors

    def __getitem__(self, index):
        if index == 0:
            multiprocessing.util.Finalize(None, time.sleep, args=(2, ), exitpriority=0)
        return super().__getitem__(index) if self.tensors else index


def refuse():
    raise ValueError("this sample cannot be rebuilt in the host")


class Refused:
    """Pickled in the worker process; unpickling it in the host raises."""

    def __reduce__(self):
        return refuse, ()


class RefusedAt(Numbered):

    def __init__(self, length, at):
        super().__init__(length)
        self.at = at

    def __getitem__(self, index):
        return Refused() if index == self.at else super().__getitem__(index)


class Counting(Numbered):
    """Counts loaded samples in shared memory (visible after a fork)."""

    def __init__(self, length):
        super().__init__(length)
        self.loaded = multiprocessing.Value("i", 0)

    def __getitem__(self, index):
        if 0 <= index < self.length:
            with self.loaded.get_lock():
                self.loaded.value += 1
        return super().__getitem__(index)


class Unpicklable(Numbered):

    def __init__(self, length):
        super().__init__(length)
        self.transform = lambda x: x


def labels(loader):
    """The sample ids of every item of one epoch."""
    return [batch[1].tolist() for batch in loader]


def flat(items):
    return [i for item in items for i in item]


def alive(pid):
    """Whether process ``pid`` runs (a zombie awaiting its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def options(device_iterations=1, replicas=1, accumulation=1, seed=None,
            process=None):
    opts = Options().deviceIterations(device_iterations)
    opts.replicationFactor(replicas)
    opts.Training.gradientAccumulation(accumulation)
    if seed is not None:
        opts.randomSeed(seed)
    if process is not None:
        opts.Distributed.configureProcessId(*process)
    return opts


# --- batching -----------------------------------------------------------


def test_items_have_the_combined_batch_size():
    loader = DataLoader(options(device_iterations=3, replicas=2,
                                accumulation=2),
                        Numbered(100),
                        batch_size=2)
    assert loader.combinedBatchSize == 24
    assert len(loader) == 100 // 24
    items = list(loader)
    assert len(items) == 4
    for number, (data, label) in enumerate(items):
        assert data.shape == (24, 2) and label.shape == (24, )
        assert label.tolist() == list(range(24 * number, 24 * (number + 1)))


def test_drop_last_false_keeps_a_smaller_last_item(caplog):
    with caplog.at_level(logging.WARNING, logger="poptorch_lite"):
        loader = DataLoader(options(device_iterations=2), Numbered(11),
                            batch_size=2, drop_last=False)
    assert "the last batch holds 3 samples" in caplog.text
    assert len(loader) == 3
    assert [len(item) for item in labels(loader)] == [4, 4, 3]


def test_unbatched_items_pass_through():
    loader = DataLoader(options(device_iterations=4), Numbered(5),
                        batch_size=None)
    assert loader.combinedBatchSize is None
    assert [label.item() for _, label in loader] == list(range(5))


UNEVEN = [[0], [1, 2], [3, 4, 5], [6], [7, 8]]   # a batch sampler's batches


class Padded:
    """A batch of rows padded to 3, with the number of real rows."""

    def __init__(self, data, rows):
        self.data, self.rows = data, rows


class PaddedParser(ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.data
        yield struct.rows

    def reconstruct(self, original_structure, tensor_iterator):
        return type(original_structure)(*tensor_iterator)


registerCustomArgParser(Padded, PaddedParser())


def pad_to_three(samples):
    """collate_fn: the samples' data padded with -1 rows to 3 rows."""
    data = torch.full((3, 2), -1)
    data[:len(samples)] = torch.stack([d for d, _ in samples])
    return Padded(data, torch.tensor([len(samples)]))


@pytest.mark.parametrize("mode", list(DataLoaderMode))  # AsyncRebatched keeps whole items as Async does
@pytest.mark.parametrize("drop_last", [True, False])
def test_a_batch_sampler_item_joins_the_batches_of_one_call(mode, drop_last):
    loader = DataLoader(options(device_iterations=2), Numbered(9), batch_sampler=UNEVEN, collate_fn=pad_to_three,
                        drop_last=drop_last, mode=mode, async_options=FORK)
    groups = [UNEVEN[0:2], UNEVEN[2:4]] + ([] if drop_last else [UNEVEN[4:]])
    assert len(loader) == len(groups)
    items = list(loader)
    assert len(items) == len(groups)
    for item, group in zip(items, groups):
        assert type(item) is Padded  # joined through its ICustomArgParser
        expected = torch.cat([pad_to_three([(torch.tensor([i, i]), None) for i in batch]).data for batch in group])
        assert torch.equal(item.data, expected)
        assert item.rows.tolist() == [len(batch) for batch in group]


def test_a_batch_sampler_with_the_default_collate_joins_tuples():
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(10)), batch_size=2,
                                            drop_last=False)
    loader = DataLoader(options(device_iterations=2, accumulation=2), Numbered(10), batch_sampler=sampler,
                        drop_last=False)
    assert labels(loader) == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("kwargs, message", [
    ({"shuffle": True}, "mutually exclusive with shuffle and sampler"),
    ({"mode": DataLoaderMode.AsyncRebatched, "rebatched_worker_size": 2}, "cannot be used with a batch_sampler"),
])
def test_a_batch_sampler_refuses_what_would_change_its_batches(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataLoader(options(device_iterations=2), Numbered(9), batch_sampler=UNEVEN, **kwargs)


def test_loader_freezes_its_options():
    opts = options()
    loader = DataLoader(opts, Numbered(4))
    assert loader.options is opts
    with pytest.raises(AttributeError, match="frozen"):
        opts.deviceIterations(2)
    opts.clone().deviceIterations(2)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
    ({"num_workers": -1}, ValueError, "num_workers must be >= 0"),
    ({"mode": 1}, TypeError, "DataLoaderMode.Sync"),
    ({"mode": DataLoaderMode.AsyncRebatched, "rebatched_worker_size": 9},
     ValueError, r"rebatched_worker_size \(9\) must be <= the combined"),
    ({"mode": DataLoaderMode.Async, "async_options": {"rebatched_size": 4}},
     ValueError, "use mode=DataLoaderMode.AsyncRebatched"),
    ({"mode": DataLoaderMode.Async, "async_options": {"buffer_size": 0}},
     ValueError, "buffer_size must be >= 1"),
])
def test_bad_arguments_are_reported(kwargs, error, message):
    with pytest.raises(error, match=message):
        DataLoader(options(device_iterations=4), Numbered(16), **kwargs)


def test_options_must_be_options():
    with pytest.raises(TypeError, match="poptorch_lite.Options"):
        DataLoader(Numbered(4), Numbered(4))


# --- distributed sharding -------------------------------------------------


def shard_loaders(num_processes, length=100, batch_size=2, seed=None,
                  **kwargs):
    return [
        DataLoader(options(device_iterations=2, seed=seed,
                           process=(pid, num_processes)),
                   Numbered(length),
                   batch_size=batch_size,
                   shuffle=seed is not None,
                   **kwargs) for pid in range(num_processes)
    ]


@pytest.mark.parametrize("num_processes", [2, 3, 4])
def test_processes_read_contiguous_equal_shares(num_processes):
    loaders = shard_loaders(num_processes, length=50)
    per_process = 4 * (50 // (4 * num_processes))
    assert {len(loader) for loader in loaders} == {per_process // 4}
    for pid, loader in enumerate(loaders):
        for _ in range(2):  # no shuffle: the same share every epoch
            assert flat(labels(loader)) == list(
                range(pid * per_process, (pid + 1) * per_process))


@pytest.mark.parametrize("seed", [None, 11])
def test_every_sample_once_per_epoch_when_divisible(seed):
    loaders = shard_loaders(3, length=48, seed=seed)
    for _ in range(3):
        epoch = [flat(labels(loader)) for loader in loaders]
        assert sorted(flat(epoch)) == list(range(48))


def test_shuffle_is_global_identical_in_all_processes_and_new_each_epoch():
    loaders = shard_loaders(3, length=60, seed=5)
    epochs = [[flat(labels(loader)) for loader in loaders] for _ in range(3)]
    for epoch in epochs:
        assert sorted(flat(epoch)) == list(range(60))  # disjoint shares
    assert len({tuple(flat(epoch)) for epoch in epochs}) == 3
    assert flat(epochs[0]) != list(range(60))
    again = shard_loaders(3, length=60, seed=5)
    assert [flat(labels(loader)) for loader in again] == epochs[0]
    other = shard_loaders(3, length=60, seed=6)
    assert [flat(labels(loader)) for loader in other] != epochs[0]


def test_leftovers_rotate_across_epochs():
    # 100 samples, combined batch 4, 3 processes: 96 used, 4 left over.
    loaders = shard_loaders(3, length=100, seed=42)
    previous_leftovers = None
    for _ in range(4):
        used = flat(flat(labels(loader)) for loader in loaders)
        assert len(used) == len(set(used)) == 96
        leftovers = set(range(100)) - set(used)
        if previous_leftovers is not None:
            assert previous_leftovers <= set(used)
            assert not previous_leftovers & leftovers
        previous_leftovers = leftovers


def test_shuffled_shares_with_persistent_torch_workers():
    loaders = shard_loaders(2, length=40, seed=3, num_workers=2)
    assert loaders[0].persistent_workers
    epochs = [[flat(labels(loader)) for loader in loaders] for _ in range(2)]
    for epoch in epochs:
        assert sorted(flat(epoch)) == list(range(40))
    assert epochs[0] != epochs[1]


def test_distributed_shuffle_needs_a_random_seed():
    with pytest.raises(ValueError, match=r"options.randomSeed\(seed\)"):
        DataLoader(options(process=(0, 2)), Numbered(10), shuffle=True)


def test_too_small_dataset_for_the_processes():
    with pytest.raises(ValueError, match="4 processes need at least 8"):
        DataLoader(options(process=(3, 4)), Numbered(7), batch_size=2)


def test_without_drop_last_every_sample_is_read_once():
    loaders = shard_loaders(3, length=23, drop_last=False)
    shares = [flat(labels(loader)) for loader in loaders]
    assert flat(shares) == list(range(23))
    assert [len(share) for share in shares] == [8, 8, 7]
    assert [len(loader) for loader in loaders] == [2, 2, 2]


@pytest.mark.parametrize("num_samples, combined, processes, drop_last", [
    (100, 4, 3, True),
    (11, 2, 3, True),
    (23, 2, 3, False),
    (5, 1, 4, False),
])
def test_process_shards_tile_the_dataset(num_samples, combined, processes,
                                         drop_last):
    shards = [
        process_shard(num_samples, combined, pid, processes, drop_last)
        for pid in range(processes)
    ]
    assert len({shard.leftovers for shard in shards}) == 1
    start = 0
    for shard in shards:
        assert shard.offset == start
        if drop_last:
            assert shard.length % combined == 0
            assert shard.length == shards[0].length
        start += shard.length
    assert start + shards[0].leftovers == num_samples


def test_iterable_datasets_are_not_partitioned_automatically():
    with pytest.raises(ValueError, match="auto_distributed_partitioning"):
        DataLoader(options(process=(0, 2)), NumberedStream(8))
    loader = DataLoader(options(process=(0, 2)), NumberedStream(8),
                        batch_size=4, auto_distributed_partitioning=False)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# --- asynchronous loading -------------------------------------------------


def test_async_yields_what_sync_yields_every_epoch():
    sync = DataLoader(options(device_iterations=3), Numbered(40), batch_size=2)
    with DataLoader(options(device_iterations=3), Numbered(40), batch_size=2,
                    mode=DataLoaderMode.Async, async_options=FORK) as loader:
        assert len(loader) == len(sync) == 6
        for _ in range(3):
            for ours, theirs in zip(loader, sync, strict=True):
                assert torch.equal(ours[0], theirs[0])
                assert torch.equal(ours[1], theirs[1])


def test_async_distributed_shuffle_with_torch_workers():
    loaders = shard_loaders(2, length=40, seed=8, num_workers=2,
                            mode=DataLoaderMode.Async, async_options=FORK)
    sync = shard_loaders(2, length=40, seed=8)
    for _ in range(2):
        assert [labels(loader) for loader in loaders] == \
            [labels(loader) for loader in sync]
    for loader in loaders:
        loader.terminate()


@pytest.mark.parametrize("drop_last, expected", [
    (True, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]),
    (False, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]),
])
def test_async_rebatched(drop_last, expected):
    with DataLoader(options(device_iterations=2), Numbered(14), batch_size=2,
                    drop_last=drop_last, mode=DataLoaderMode.AsyncRebatched,
                    rebatched_worker_size=3, async_options=FORK) as loader:
        assert len(loader) == len(expected)
        assert labels(loader) == expected
        assert labels(loader) == expected


def test_async_rebatched_iterable_dataset():
    with DataLoader(options(device_iterations=4), NumberedStream(10),
                    mode=DataLoaderMode.AsyncRebatched,
                    rebatched_worker_size=1, async_options=FORK) as loader:
        assert len(loader) == 2
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def wait_until(condition, seconds: float = 60) -> bool:
    """Poll `condition` until it holds or `seconds` have passed; whether it holds."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_async_loading_overlaps_consumption():
    """While the caller computes on an item, the worker process loads the next one; a Sync
    loader loads each item only when it is asked for."""
    count = 8

    def loaded_ahead(mode):
        """For each item: how many more the dataset had loaded once the caller was done with it
        (an Async caller computes until the next item is loaded)."""
        dataset = Counting(count)
        loader = DataLoader(options(), dataset, mode=mode,
                            async_options=None
                            if mode == DataLoaderMode.Sync else FORK)
        ahead = []
        for number, _ in enumerate(loader):
            if mode != DataLoaderMode.Sync:
                wait_until(lambda: dataset.loaded.value >= min(number + 2, count))
            ahead.append(dataset.loaded.value - (number + 1))
        loader.terminate()
        return ahead

    assert loaded_ahead(DataLoaderMode.Sync) == [0] * count
    ahead = loaded_ahead(DataLoaderMode.Async)
    assert all(1 <= n <= 3 for n in ahead[:-1]), ahead  # (then the next epoch starts)


def test_buffer_size_bounds_loading_ahead():
    dataset = Counting(50)
    with AsynchronousDataAccessor(dataset, buffer_size=3,
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        iterator = iter(acc)
        next(iterator)  # held by the caller: one of the 3 slots
        assert wait_until(lambda: dataset.loaded.value >= 3)
        time.sleep(0.3)  # (time for a fourth load that must not happen)
        assert dataset.loaded.value == 3
        next(iterator)  # releases the first slot
        assert wait_until(lambda: dataset.loaded.value >= 4)
        time.sleep(0.3)
        assert dataset.loaded.value == 4


def test_early_preload_loads_before_iteration():
    dataset = Counting(10)
    with AsynchronousDataAccessor(dataset, buffer_size=2, early_preload=True,
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        assert wait_until(lambda: dataset.loaded.value >= 2)
        assert dataset.loaded.value == 2
        assert [label.item() for _, label in acc] == list(range(10))


class NoisyCounting(Counting):
    """Sample i is (a draw of the loading worker's generator, tensor(i)): which
    worker loads which batch, in which order, shows in the values."""

    def __getitem__(self, index):
        _, label = super().__getitem__(index)
        return torch.rand(()), label


def noisy_loader(dataset, **async_options):
    return DataLoader(options(), dataset, batch_size=2, num_workers=4, shuffle=True,
                      generator=torch.Generator().manual_seed(1), mode=DataLoaderMode.Async,
                      async_options={**FORK, "buffer_size": 3, **async_options})


def settled(counter, expected, timeout=5.0):
    """The counter's value once it has reached `expected` (or `timeout`
    passed) and then stayed put for a moment."""
    deadline = time.monotonic() + timeout
    while counter.value < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    return counter.value


def test_the_next_epoch_is_loaded_ahead_only_as_far_as_the_ring_buffer():
    # Four workers would be handed eight batches as an epoch starts (prefetch
    # factor 2): the epoch the worker begins by itself dispatches three, what
    # the ring buffer holds, until the program iterates it.
    dataset = NoisyCounting(40)
    with noisy_loader(dataset) as loader:
        first = [(x.tolist(), y.tolist()) for x, y in loader]
        assert settled(dataset.loaded, 40 + 3 * 2) == 40 + 3 * 2
        second = [(x.tolist(), y.tolist()) for x, y in loader]
        assert settled(dataset.loaded, 80 + 3 * 2) == 80 + 3 * 2
    # The items are those of a loader that loads nothing ahead: same batches,
    # same workers, in the same order.
    with noisy_loader(NoisyCounting(40), load_indefinitely=False) as loader:
        assert [(x.tolist(), y.tolist()) for x, y in loader] == first
        assert [(x.tolist(), y.tolist()) for x, y in loader] == second
    assert sorted(flat(y for _, y in second)) == list(range(40))


def test_early_preload_with_workers_loads_what_the_ring_buffer_holds():
    dataset = NoisyCounting(40)
    with noisy_loader(dataset, early_preload=True) as loader:
        assert settled(dataset.loaded, 3 * 2) == 3 * 2
        preloaded = [(x.tolist(), y.tolist()) for x, y in loader]
    with noisy_loader(NoisyCounting(40)) as loader:
        assert [(x.tolist(), y.tolist()) for x, y in loader] == preloaded


@pytest.mark.parametrize("load_indefinitely", [True, False])
def test_accessor_over_iterable_for_several_epochs(load_indefinitely):
    with AsynchronousDataAccessor(NumberedStream(7),
                                  load_indefinitely=load_indefinitely,
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        assert len(acc) == 7
        for _ in range(3):
            assert [t.item() for t in acc] == list(range(7))


def test_empty_dataset_ends_every_epoch():
    with AsynchronousDataAccessor(NumberedStream(0),
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        for _ in range(3):
            assert not list(acc)
        assert not acc._data.poll(0.2)  # no end-of-epoch messages piling up


def test_rebatching_keeps_the_structure_of_items():
    items = [Pair(torch.full((2, 3), i), torch.tensor([i, i]))
             for i in range(3)]
    with AsynchronousDataAccessor(items, rebatched_size=4,
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        batch, = list(acc)
    assert isinstance(batch, Pair)
    assert batch.data.shape == (4, 3)
    assert batch.label.tolist() == [0, 0, 1, 1]


def test_stopping_early_then_iterating_again_restarts():
    with DataLoader(options(), Numbered(12), batch_size=2,
                    mode=DataLoaderMode.Async, async_options=FORK) as loader:
        for number, _ in enumerate(loader):
            if number == 2:
                break
        assert labels(loader) == [[2 * i, 2 * i + 1] for i in range(6)]
        iterator = iter(loader)
        next(iterator)
        assert labels(loader)[0] == [0, 1]


def test_worker_exception_is_raised_with_its_traceback():
    loader = DataLoader(options(), BrokenAt(10, broken=3),
                        mode=DataLoaderMode.Async, async_options=FORK)
    for _ in range(2):  # after an error, a new epoch starts afresh
        seen = []
        with pytest.raises(ValueError) as info:
            for _, label in loader:
                seen.append(label.item())
        assert seen == [0, 1, 2]
        message = str(info.value)
        assert "Caught ValueError in the AsynchronousDataAccessor worker" in \
            message
        assert "Original Traceback (most recent call last)" in message
        assert "test_data.py" in message and "in __getitem__" in message
        assert 'raise self.error(f"sample {index} is corrupt")' in message
        assert message.rstrip().endswith("ValueError: sample 3 is corrupt")
    loader.terminate()


def test_worker_exceptions_that_cannot_be_rebuilt():
    with AsynchronousDataAccessor(RaisesUnpicklable(4),
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        with pytest.raises(RuntimeError,
                           match="(?s)Caught NeedsTwoArguments.*left and right"):
            list(acc)
    with AsynchronousDataAccessor(BrokenAt(4, 0, KeyError),
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        with pytest.raises(KeyError) as info:
            list(acc)
        assert "\nOriginal Traceback" in str(info.value)


def test_worker_death_is_reported_not_waited_for():
    with AsynchronousDataAccessor(ExitsAt(10, 4),
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        with pytest.raises(RuntimeError, match="exited with code 3"):
            list(acc)
        with pytest.raises(RuntimeError, match="exited with code 3"):
            iter(acc)


@pytest.mark.parametrize("tensors", [True, False])
def test_a_worker_slow_to_exit_is_reported_with_its_exit_code(tensors):
    """The host finds the worker's pipes closed (and, with tensors, the items in flight no longer
    fetchable) seconds before the worker has exited: it waits for the exit status rather than
    report none, or report the fetch."""
    with AsynchronousDataAccessor(SlowToExit(10, tensors),
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        iterator = iter(acc)
        next(iterator)
        worker = acc._process.pid
        os.kill(worker, signal.SIGTERM)  # it stops cleanly, reporting no error
        with pytest.raises(RuntimeError, match=rf"\(pid {worker}\) exited with code 0 "
                                               "without reporting an error"):
            for _ in iterator:
                pass


def test_an_item_the_host_cannot_receive_ends_the_epoch_with_an_error_not_a_gap():
    with AsynchronousDataAccessor(RefusedAt(6, 2),
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        iterator = iter(acc)
        assert [label.item() for _, label in (next(iterator), next(iterator))] == [0, 1]
        with pytest.raises(RuntimeError, match="(?s)could not receive an item.*ValueError.*"
                                               "cannot be rebuilt in the host"):
            next(iterator)
        with pytest.raises(StopIteration):  # not sample 3: the epoch lost sample 2
            next(iterator)
        with pytest.raises(RuntimeError, match="could not receive an item"):
            iter(acc)


def test_killed_worker_is_reported():
    accessor = AsynchronousDataAccessor(Slow(100, 0.05),
                                        sharing_strategy=SharingStrategy.Fork)
    iterator = iter(accessor)
    next(iterator)
    os.kill(accessor._process.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="killed by signal SIGKILL"):
        for _ in iterator:
            pass
    assert time.monotonic() - start < 60  # (the host notices; it does not wait for data)
    accessor.terminate()


def test_dropping_a_loader_stops_its_worker():
    loader = DataLoader(options(), Slow(100, 0.01), mode=DataLoaderMode.Async,
                        async_options=FORK)
    for _ in loader:
        break
    pid = loader._accessor._process.pid
    assert alive(pid)
    del loader
    gc.collect()
    assert not alive(pid)


def test_terminate_and_context_manager_stop_the_worker():
    with DataLoader(options(), Numbered(8), mode=DataLoaderMode.Async,
                    async_options=FORK) as loader:
        next(iter(loader))
        pid = loader._accessor._process.pid
    assert not alive(pid)
    loader.terminate()  # idempotent
    with pytest.raises(RuntimeError, match="terminated"):
        iter(loader)
    accessor = AsynchronousDataAccessor(Numbered(3),
                                        sharing_strategy=SharingStrategy.Fork)
    pid = accessor._process.pid
    accessor.terminate()
    assert not alive(pid)
    assert not any(p.name == "AsynchronousDataAccessor"
                   for p in multiprocessing.active_children())


def test_accessor_over_a_sync_loader():
    loader = DataLoader(options(device_iterations=2), Numbered(13),
                        batch_size=2, drop_last=False)
    with AsynchronousDataAccessor(loader,
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        assert len(acc) == 4
        assert labels(acc) == labels(loader)
    with AsynchronousDataAccessor(loader, rebatched_size=3,
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        assert len(acc) == 4 * 4 // 3
        assert labels(acc) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11],
                               [12]]  # the loader keeps its last samples
    pairs = torch.utils.data.DataLoader(NumberedStream(13), batch_size=2)
    with AsynchronousDataAccessor(pairs, rebatched_size=3,
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        assert [t.tolist() for t in acc] == [[0, 1, 2], [3, 4, 5], [6, 7, 8],
                                             [9, 10, 11]]
    with AsynchronousDataAccessor(NumberedStream(13), rebatched_size=3,
                                  sharing_strategy=SharingStrategy.Fork) as acc:
        with pytest.raises(ValueError, match="items must be batched tensors"):
            list(acc)


def test_failed_construction_leaves_options_unfrozen():
    opts = options()
    with pytest.raises(ValueError):
        DataLoader(opts, Numbered(8), mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=9)
    opts.deviceIterations(2)


def test_loader_with_an_accessor_cannot_be_wrapped_again():
    with DataLoader(options(), Numbered(8), mode=DataLoaderMode.Async,
                    async_options=FORK) as loader:
        with pytest.raises(ValueError, match="already loads through"):
            AsynchronousDataAccessor(loader)


@pytest.mark.parametrize("strategy", [SharingStrategy.FileSystem,
                                      SharingStrategy.SharedMemory])
def test_unpicklable_dataset_is_reported(strategy):
    with pytest.raises(TypeError, match="SharingStrategy.Fork"):
        AsynchronousDataAccessor(Unpicklable(4), sharing_strategy=strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [SharingStrategy.FileSystem,
                                      SharingStrategy.SharedMemory])
def test_spawned_worker(strategy):
    sync = DataLoader(options(device_iterations=2, seed=1, process=(1, 2)),
                      Numbered(30), batch_size=2, shuffle=True)
    with DataLoader(options(device_iterations=2, seed=1, process=(1, 2)),
                    Numbered(30), batch_size=2, shuffle=True,
                    mode=DataLoaderMode.Async,
                    async_options={"sharing_strategy": strategy}) as loader:
        for _ in range(2):
            assert labels(loader) == labels(sync)


HOST_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from test_data import Slow
    from poptorch_lite.api.data import DataLoader
    from poptorch_lite.api.enums import DataLoaderMode, SharingStrategy
    from poptorch_lite.api.options import Options

    if __name__ == "__main__":
        loader = DataLoader(Options(), Slow(1000, 0.01),
                            mode=DataLoaderMode.Async,
                            async_options={{"sharing_strategy":
                                            SharingStrategy.Fork}})
        next(iter(loader))
        print(loader._accessor._process.pid, flush=True)
        if sys.argv[1] == "crash":
            os._exit(0)
""")


@pytest.mark.slow
@pytest.mark.parametrize("exit_mode", ["normal", "crash"])
def test_worker_does_not_outlive_its_host(tmp_path, exit_mode):
    script = tmp_path / "host.py"
    script.write_text(
        HOST_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, str(script), exit_mode],
                            capture_output=True, text=True, timeout=900,
                            check=True, env={**os.environ, "PYTHONPATH": REPO})
    worker = int(result.stdout.split()[0])
    assert wait_until(lambda: not alive(worker))


def test_a_released_epoch_keeps_torchs_bound_on_batches_in_flight():
    """Releasing a metered epoch dispatches up to torch's prefetch_factor * num_workers batches
    in flight, counting those received out of order and not yet returned: torch dispatches one
    more as it returns each of them and asserts the bound."""
    from poptorch_lite.api.data import _Meter

    class Iterator:   # the parts of torch's multiprocessing iterator release() uses
        _prefetch_factor, _num_workers = 2, 2

        def __init__(self, meter):
            self.meter = meter
            self._task_info = {0: (0,), 1: (1, "data"), 2: (0, "data")}   # one outstanding, two stored
            self._tasks_outstanding = 1

        def _try_put_index(self):
            assert self._tasks_outstanding < self._prefetch_factor * self._num_workers
            next(self.meter)
            self._task_info[max(self._task_info) + 1] = (0,)
            self._tasks_outstanding += 1

    meter = _Meter(list(range(10)))
    iter(meter)
    meter.allowance = 3
    for _ in range(3):
        next(meter)
    iterator = Iterator(meter)
    meter.release(iterator)
    assert len(iterator._task_info) == 4 and iterator._tasks_outstanding == 2
    for idx in (1, 2):   # torch returns the stored batches, each dispatching one more
        del iterator._task_info[idx]
        iterator._try_put_index()


@pytest.mark.parametrize("strategy", [SharingStrategy.Fork, SharingStrategy.FileSystem])
def test_the_worker_process_id_is_logged_at_debug_level(caplog, strategy):
    """As PopTorch logs it, so that a tool (or a test) can signal the worker; a worker the zygote
    forks is logged once the host learns its pid (building the accessor never waits for it)."""
    with caplog.at_level(logging.DEBUG, logger="poptorch_lite"):
        with AsynchronousDataAccessor([torch.full((2,), float(i)) for i in range(4)], sharing_strategy=strategy) as acc:
            assert sum(1 for _ in acc) == 4
            pid = acc._process.pid
    assert f"AsynchronousDataAccessor worker process: {pid}" in caplog.text
    assert f"AsynchronousDataAccessor parent process: {os.getpid()}" in caplog.text
