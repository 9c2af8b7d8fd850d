"""Threads of NumPy's BLAS during emulation.

Fast-mode kernels call BLAS (matmul, convolutions) on whole tensors. While the engine runs
programs, BLAS runs with `IPUSIM_BLAS_THREADS` threads (default: the cores this process may use,
as PyTorch's own thread pool does), and the previous setting is restored afterwards, so the
emulator's GEMMs use the machine as plain PyTorch does: measured on two cores, one BLAS thread
left a 4096-wide MLP at 1.6x PyTorch's time per call, two at 1.2x. PyTorch's OpenMP threads are
idle while the engine runs (the runtime calls no torch op inside a run), so the two pools do
not compete.

A product too small to pay for handing half of it to another thread runs on one (`matmul`):
OpenBLAS splits any GEMM of more than 64^3 multiply-adds, and when the other core is busy its
helper thread waits for a time slice. Measured on two cores with the other one loaded, the
tutorial's [40, 320] x [320, 256] product took 2.6 ms on two BLAS threads and 0.14 ms on one.
"""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager

import numpy as np

from .host_threads import usable_cores

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads64_",
            "openblas_get_num_threads")


def _find_openblas():
    """(get, set) functions of the OpenBLAS NumPy loaded, or None when there is none."""
    import numpy  # noqa: F401  (makes sure NumPy's BLAS is loaded)
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        setter = next((getattr(lib, s) for s in _SETTERS if hasattr(lib, s)), None)
        getter = next((getattr(lib, s) for s in _GETTERS if hasattr(lib, s)), None)
        if setter is not None and getter is not None:
            setter.argtypes = [ctypes.c_int]
            getter.restype = ctypes.c_int
            return getter, setter
    return None


_OPENBLAS = _find_openblas()
THREADS = int(os.environ.get("IPUSIM_BLAS_THREADS", usable_cores()))


@contextmanager
def blas_threads(n: int = THREADS):
    """Run the body with `n` BLAS threads (no effect without a recognised OpenBLAS)."""
    if _OPENBLAS is None or n <= 0:
        yield
        return
    get, set_ = _OPENBLAS
    before = get()
    if before == n:
        yield
        return
    set_(n)
    try:
        yield
    finally:
        set_(before)


SMALL_GEMM_FLOPS = int(os.environ.get("IPUSIM_BLAS_SMALL_GEMM_FLOPS", 1 << 25))
"""Products of fewer floating-point operations per matrix (2 M N K) than this run on one BLAS thread."""


def matmul(x: np.ndarray, y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """np.matmul(x, y, out=out), on one BLAS thread when each matrix product is smaller than
    SMALL_GEMM_FLOPS (a stacked product is one GEMM per matrix), else on the threads set."""
    if _OPENBLAS is None or 2 * x.shape[-2] * x.shape[-1] * y.shape[-1] >= SMALL_GEMM_FLOPS:
        return np.matmul(x, y, out=out)
    get, set_ = _OPENBLAS
    before = get()
    if before == 1:
        return np.matmul(x, y, out=out)
    set_(1)
    try:
        return np.matmul(x, y, out=out)
    finally:
        set_(before)
