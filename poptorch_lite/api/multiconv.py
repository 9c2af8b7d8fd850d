"""`poptorch.MultiConv`: the convolutions of a block of code planned together (PopLibs'
multi-convolution), with PopTorch's options and checks.

    with poptorch.MultiConv().availableMemoryProportions((0.8, 0.7)).planType(
            poptorch.MultiConvPlanType.Parallel):
        u = self.conv1(x)
        v = self.conv2(y)

The forward convolutions made inside the block form one multi-convolution (`compiler/multiconv.py`,
`ipusim/ops/multiconv.py`): with the Parallel plan they compute side by side on shares of the
IPU's tiles, with Serial one after the other on all tiles; values are those of the separate
convolutions. Per-convolution options take one value for all or one per convolution, in the
order the convolutions are made. `perConvReservedTiles` is each convolution's minimum share in the
Parallel plan. `partialsTypes` must be float (the emulated convolutions accumulate in float32);
`cycleBackOff` and `enableConvDithering` tune PopLibs' planner search, which the emulator's
planner does not have: they are checked and recorded, and compiling says they have no effect.
Outside a model the block does nothing.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch
import torch.fx.traceback as fx_traceback

from . import enums
from .errors import Error

KEY = "poptorch_multiconv"
_ids = itertools.count()
_state = threading.local()


@dataclass(eq=False)
class MultiConvGroup:
    """One `with MultiConv()` block as the capture saw it; the compiler adds its convolutions."""
    id: int
    available_memory_proportions: tuple | None
    partials_types: tuple | None
    plan_type: "enums.MultiConvPlanType | None"
    per_conv_reserved_tiles: int | None
    cycle_back_off: float | None
    enable_conv_dithering: tuple | None
    members: list = field(default_factory=list, repr=False)    # IR nodes (compiler/multiconv.py)


def entered_groups() -> list[MultiConvGroup]:
    """The MultiConv blocks entered while capturing, since `reset_groups`."""
    return list(getattr(_state, "groups", []))


def reset_groups() -> None:
    _state.groups = []


def _capturing() -> bool:
    return bool(torch.overrides._get_current_function_mode_stack())


class MultiConv:
    """Combine the convolutions made inside this block into a single multi-convolution."""

    def __init__(self):
        self._available_memory_proportions = None
        self._partials_types = None
        self._plan_type = None
        self._per_conv_reserved_tiles = None
        self._cycle_back_off = None
        self._enable_conv_ditherings = None
        self._annotation = None

    @staticmethod
    def _validatePerConvProperty(name, value, expected_scalar_type):
        if value is None:
            return value
        if isinstance(value, expected_scalar_type):
            return (value,)
        if isinstance(value, (list, tuple)) and len(value) > 0 and all(
                isinstance(x, expected_scalar_type) for x in value):
            return tuple(value)
        raise AssertionError(f"Invalid {name}!")

    def availableMemoryProportions(self, value) -> "MultiConv":
        """Temporary memory each convolution's planner may use, as a proportion of tile memory in
        (0, 1]: one float for all, or one per convolution."""
        value = self._validatePerConvProperty("available memory proportion", value, float)
        if value is not None and not all(0.0 < v <= 1.0 for v in value):
            raise ValueError(f"MultiConv.availableMemoryProportions: each proportion must be in (0, 1], got "
                             f"{list(value)}")
        self._available_memory_proportions = value
        return self

    def partialsTypes(self, value) -> "MultiConv":
        """The partials type of each convolution: torch.float or torch.half (one for all, or one
        per convolution)."""
        def encode(dtype):
            if dtype in (torch.float, torch.float32):
                return 0
            if dtype in (torch.half, torch.float16):
                return 1
            raise ValueError("Invalid partials types. Expecting torch.float or torch.half")

        self._partials_types = tuple(encode(v) for v in value) if isinstance(value, (list, tuple)) \
            else (encode(value),)
        return self

    def enableConvDithering(self, value) -> "MultiConv":
        """Per-convolution dithering (one bool for all, or one per convolution)."""
        if value is None:
            self._enable_conv_ditherings = None
        elif isinstance(value, (list, tuple)):
            if not all(isinstance(x, bool) for x in value):
                raise ValueError("value must be bool or list of bools")
            self._enable_conv_ditherings = tuple(value)
        elif isinstance(value, bool):
            self._enable_conv_ditherings = (value,)
        else:
            raise ValueError("value must be bool or list of bools")
        return self

    def planType(self, value) -> "MultiConv":
        """A MultiConvPlanType: Parallel (default) or Serial."""
        if value is not None and not isinstance(value, enums.MultiConvPlanType):
            raise AssertionError("Invalid plan type!")
        self._plan_type = value
        return self

    def perConvReservedTiles(self, value: int) -> "MultiConv":
        """Tiles each convolution gets at least in the Parallel plan."""
        assert isinstance(value, int) and not isinstance(value, bool), "perConvReservedTiles expects an int"
        if value < 1:
            raise ValueError(f"MultiConv.perConvReservedTiles must be >= 1, got {value}")
        self._per_conv_reserved_tiles = value
        return self

    def cycleBackOff(self, value: float) -> "MultiConv":
        """PopLibs' cycle back-off proportion, in [0, 1]."""
        assert isinstance(value, float), "cycleBackOff expects a float"
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"MultiConv.cycleBackOff must be in [0, 1], got {value}")
        self._cycle_back_off = value
        return self

    def __enter__(self):
        if not _capturing():
            return self
        if getattr(_state, "depth", 0):
            raise Error("Nested poptorch.MultiConv is not supported")
        group = MultiConvGroup(next(_ids), self._available_memory_proportions, self._partials_types,
                               self._plan_type, self._per_conv_reserved_tiles, self._cycle_back_off,
                               self._enable_conv_ditherings)
        _state.groups = entered_groups() + [group]
        _state.depth = 1
        self._annotation = fx_traceback.annotate({KEY: group})
        self._annotation.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._annotation is not None:
            self._annotation.__exit__(exc_type, exc, tb)
            self._annotation = None
            _state.depth = 0
        return False
