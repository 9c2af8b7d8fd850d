"""Which IPU hardware the process can use. Every model runs on emulated IPUs (ipusim), so by
default PopTorch's hardware queries answer as on a machine without IPUs. Applications that
refuse to run without IPUs of a given version (optimum-graphcore asks for a Mk2) can be told the
emulated IPUs are attached: `POPTORCH_LITE_IPU_HARDWARE=ipu2` (or `poptorch-lite run
--ipu-hardware ipu2`) makes the queries answer as a machine with IPUs of that architecture
(`ipu1`: Mk1, `ipu2`: Mk2 GC200, `ipu21`: Bow). `isRunningOnIpu` tells a model's forward whether
it runs for the (emulated) IPU."""
from __future__ import annotations

import os

from .blocks import active_trace

HARDWARE_VARIABLE = "POPTORCH_LITE_IPU_HARDWARE"
ARCHITECTURES = {"ipu1": 1, "ipu2": 2, "ipu21": 21}


def isRunningOnIpu() -> bool:
    """True while forward is captured for the IPU (what the device will run), False when the
    model runs on the CPU: `if poptorch.isRunningOnIpu():` chooses a branch for the IPU."""
    return active_trace() is not None


def attached_version() -> int:
    """The IPU version the emulated IPUs answer as (POPTORCH_LITE_IPU_HARDWARE), 0 when unset."""
    value = os.environ.get(HARDWARE_VARIABLE, "").strip()
    if not value:
        return 0
    if value not in ARCHITECTURES:
        raise ValueError(f"{HARDWARE_VARIABLE}={value!r} names no IPU architecture: use one of "
                         f"{', '.join(ARCHITECTURES)} (or unset it for no IPU hardware)")
    return ARCHITECTURES[value]


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """False: no physical IPU is attached (True when POPTORCH_LITE_IPU_HARDWARE presents the
    emulated IPUs as attached hardware, whatever `num_ipus`)."""
    if isinstance(num_ipus, bool) or not isinstance(num_ipus, int) or num_ipus < 1:
        raise ValueError(f"ipuHardwareIsAvailable: num_ipus must be a positive int, got {num_ipus!r}")
    return attached_version() != 0


def ipuHardwareVersion() -> int:
    """PopTorch's version of the attached IPUs; with none this fails as PopTorch does on a
    machine without IPUs. POPTORCH_LITE_IPU_HARDWARE presents the emulated IPUs as attached ones
    of its architecture; `Options.Emulator.setTarget` chooses the emulated IPU that models run on."""
    version = attached_version()
    if version == 0:
        raise AssertionError("No IPU hardware available on this system: poptorch_lite runs models on "
                             f"emulated IPUs (set {HARDWARE_VARIABLE}=ipu2 to present them as attached Mk2 IPUs)")
    return version
