"""Python's cyclic garbage collector paused around bursts of long-lived objects.

Each time the heap grows by a quarter the collector walks all of it: after torch is imported that
is a few hundred thousand objects, 0.1-0.2 s a walk. Two steps of a PopTorch script make that many
objects at once, all living as long as the process or the model: building the first optimiser
(torch's optimisers import torch._dynamo on their first parameter group, about 130,000 objects) and
compiling a model (about 100,000, and lazy imports of more of torch). Measured: the first AdamW
built in 1.25 s with the collector on, 0.90 s paused (five full walks then, three in all when the
same allocations follow); the tutorial's first call had 0.22 s of collections (one full) with the
collector on, 0.05 s paused. The objects made are walked later, as they age, like any others.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collection_paused():
    """The collector off in the body (unless it was off already), back on after; also a
    decorator."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
