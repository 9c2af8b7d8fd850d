"""A dataset that tells how the worker loading it started. Kept apart from the tests, which
import poptorch_lite: a spawned worker imports only this module and torch to unpickle it."""
import sys

import torch


class StartMethodProbe(torch.utils.data.Dataset):
    """Each sample is 1 when the worker that loaded it inherited poptorch_lite from its parent
    (a forked worker does), 0 when it started a fresh interpreter (spawn)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor(int("poptorch_lite.api.data" in sys.modules))
