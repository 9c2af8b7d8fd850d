"""Datasets that tell about the process loading them. Kept apart from the tests, which import
poptorch_lite: a spawned worker imports only this module and torch to unpickle them."""
import gc
import signal
import sys

import torch

# How the process that imported this module first was set up at that moment: whether Python's cyclic
# garbage collector ran, and whether Ctrl-C was ignored.
AT_IMPORT = {"collector": gc.isenabled(), "ctrl_c_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}


class StartMethodProbe(torch.utils.data.Dataset):
    """Each sample is 1 when the worker that loaded it inherited poptorch_lite from its parent
    (a forked worker does), 0 when it started a fresh interpreter (spawn)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor(int("poptorch_lite.api.data" in sys.modules))


def emulator_modules() -> list:
    """The modules of the device emulator, Numba and poptorch_lite's compiler and runtime that
    this process has imported."""
    return sorted(m for m in sys.modules if m.partition(".")[0] in ("ipusim", "numba", "llvmlite")
                  or m.startswith(("poptorch_lite.compiler", "poptorch_lite.runtime")))


class ImportProbe(torch.utils.data.Dataset):
    """One sample: `emulator_modules()` of the process that loads it."""

    def __len__(self):
        return 1

    def __getitem__(self, index):
        return emulator_modules()


class CollectorProbe(torch.utils.data.Dataset):
    """One sample: `AT_IMPORT` of the process that loads it, and its collector now (on, and how many
    objects `gc.freeze` moved out of its reach)."""

    def __len__(self):
        return 1

    def __getitem__(self, index):
        return {**{f"{k}_at_import": v for k, v in AT_IMPORT.items()},
                "collector": gc.isenabled(), "frozen": gc.get_freeze_count()}
