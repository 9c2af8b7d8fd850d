"""Numba building blocks shared by codelets: loads and stores that hide the storage dtype.

Tile memory keeps float16 tensors as 16-bit values (NumPy has float16, Numba's CPU target does
not), so codelets see float16 arenas as uint16 bit patterns. `ld` widens any stored value to
float64 for arithmetic and `st` narrows it back with IEEE round-to-nearest-even, exactly as
NumPy rounds float16. Codelets written with `ld`/`st` compile once per storage dtype.
"""
from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit, types
from numba.extending import overload

JIT = dict(cache=True, nogil=True)


def kernel_threads(pieces: int) -> int:
    """How many threads a fast-mode kernel splits `pieces` independent pieces of work over:
    Numba's thread count (an engine sets its `kernel_threads`, IPUSIM_KERNEL_THREADS, while its
    programs run), at most one per piece. Each piece is computed the same way whoever runs it,
    so results do not depend on it. One piece needs no thread count."""
    return 1 if pieces <= 1 else min(get_num_threads(), pieces)


@njit(**JIT)
def half_to_float(h):
    h = np.int64(h)
    sign = -1.0 if (h >> 15) & 1 else 1.0
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    if exp == 0:
        return sign * man * 2.0 ** -24
    if exp == 31:
        return sign * np.inf if man == 0 else np.nan
    return sign * (1.0 + man / 1024.0) * 2.0 ** (exp - 15)


@njit(**JIT)
def float_to_half(x):
    x = np.float64(np.float32(x))  # values pass through float32 first, as on the device
    if x != x:
        return np.uint16(0x7E00)
    sign = 0x8000 if (x < 0.0 or (x == 0.0 and math.copysign(1.0, x) < 0.0)) else 0
    a = abs(x)
    if a == np.inf:
        return np.uint16(sign | 0x7C00)
    if a < 2.0 ** -14:
        q = np.int64(np.rint(a * 2.0 ** 24))
        return np.uint16(sign | q)
    m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    exp = e - 1
    man = np.int64(np.rint((m * 2.0 - 1.0) * 1024.0))
    if man == 1024:
        man = 0
        exp += 1
    if exp > 15:
        return np.uint16(sign | 0x7C00)
    return np.uint16(sign | ((exp + 15) << 10) | man)


def ld(arena, i):
    """Load element i of an arena as a float64 (or int64 for integer arenas)."""


def st(arena, i, value):
    """Store value at element i of an arena, rounding to the arena's dtype."""


@overload(ld, jit_options=JIT)
def _ld(arena, i):
    if arena.dtype == types.uint16:
        return lambda arena, i: half_to_float(arena[i])
    if isinstance(arena.dtype, types.Float):
        return lambda arena, i: np.float64(arena[i])
    if arena.dtype == types.boolean:
        return lambda arena, i: np.int64(1) if arena[i] else np.int64(0)
    return lambda arena, i: np.int64(arena[i])


@overload(st, jit_options=JIT)
def _st(arena, i, value):
    if arena.dtype == types.uint16:
        def store_half(arena, i, value):
            arena[i] = float_to_half(value)
        return store_half
    if arena.dtype == types.boolean:
        def store_bool(arena, i, value):
            arena[i] = value != 0
        return store_bool

    def store(arena, i, value):
        arena[i] = value
    return store


def kernel_view(array: np.ndarray) -> np.ndarray:
    """The array a codelet sees: float16 storage as its uint16 bit pattern."""
    return array.view(np.uint16) if array.dtype == np.float16 else array
