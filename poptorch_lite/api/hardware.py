"""Which IPU hardware the process can use: none. Every model runs on emulated IPUs (ipusim), so
PopTorch's hardware queries answer as on a machine without IPUs. `isRunningOnIpu` tells a model's
forward whether it runs for the (emulated) IPU."""
from __future__ import annotations

from .blocks import active_trace


def isRunningOnIpu() -> bool:
    """True while forward is captured for the IPU (what the device will run), False when the
    model runs on the CPU: `if poptorch.isRunningOnIpu():` chooses a branch for the IPU."""
    return active_trace() is not None


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """False: no physical IPU is attached; models run on emulated IPUs whatever `num_ipus`."""
    if isinstance(num_ipus, bool) or not isinstance(num_ipus, int) or num_ipus < 1:
        raise ValueError(f"ipuHardwareIsAvailable: num_ipus must be a positive int, got {num_ipus!r}")
    return False


def ipuHardwareVersion() -> int:
    """PopTorch's version of the attached IPUs; there are none, so this fails as PopTorch does
    on a machine without IPUs. `Options.Emulator.setTarget` chooses the emulated IPU's version."""
    raise AssertionError("No IPU hardware available on this system: poptorch_lite runs models on "
                         "emulated IPUs (choose their version with Options.Emulator.setTarget)")
