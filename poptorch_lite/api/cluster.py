"""`poptorch.fps` and `poptorch.nearest`: torch_cluster's farthest point sampling and nearest-cluster
assignment, as PopTorch provides them (one op each in a model: `ipusim.ops.cluster`; on the CPU the
same searches run on the host)."""
from __future__ import annotations

import itertools

import torch
from torch.overrides import handle_torch_function, has_torch_function

from .errors import Error


def fps(src: torch.Tensor, ptr: list, ratio: float = 0.5, random_start: bool = False) -> torch.Tensor:
    """Farthest point sampling: from each segment [ptr[i], ptr[i+1]) of the rows of `src`, pick
    ceil(n * ratio) points, each the farthest from those already picked, starting from the
    segment's first point (or a random one). Returns their indices into `src`."""
    if not isinstance(src, torch.Tensor):
        raise Error(f"`fps` must take a torch.tensor input. {type(src)} is not supported.")
    if not isinstance(ptr, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in ptr):
        raise Error("`ptr` must be a list of integers.")
    if not len(ptr) >= 2:
        raise Error("`ptr` must containt at least 2 elements.")
    if not isinstance(ratio, float):
        raise Error(f"`ratio` must be of float type. {type(ratio)} is not supported.")
    if not isinstance(random_start, bool):
        raise Error(f"`random_start` must be of bool type. {type(random_start)} is not supported.")
    if src.dim() != 2 or ptr[0] != 0 or ptr[-1] != src.shape[0] or any(b < a for a, b in zip(ptr, ptr[1:])):
        raise Error(f"`fps`: `ptr` must rise from 0 to the number of rows of `src` ({src.shape[0]}), and `src` must "
                    f"be 2-D; got ptr={ptr} and src of shape {list(src.shape)}")
    if not 0.0 < ratio <= 1.0:
        raise Error(f"`fps`: `ratio` must be in (0, 1], got {ratio}")
    if has_torch_function((src,)):   # captured: one op (compiler/library.py)
        return handle_torch_function(fps, (src,), src, ptr, ratio, random_start)
    from ipusim.ops.cluster import fps_host   # pylint: disable=import-outside-toplevel
    starts = torch.rand(len(ptr) - 1).numpy() if random_start else None
    return torch.from_numpy(fps_host(src.detach().float().numpy(), ptr, ratio, starts))


def _unique_consecutive(batch: list) -> list:
    return [k for k, _ in itertools.groupby(batch)]


def nearest(x: torch.Tensor, y: torch.Tensor, batch_x=None, batch_y=None) -> torch.Tensor:
    """For each row (point) of `x`, the index of the nearest row of `y` in the same batch instance
    (`batch_x` and `batch_y`: sorted instance numbers per row, lists or tensors; none: one
    instance)."""
    for what, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise Error(f"`nearest` must take a torch.tensor `{what}` input. {type(t)} is not supported.")
    x = x.reshape(-1, 1) if x.dim() == 1 else x
    y = y.reshape(-1, 1) if y.dim() == 1 else y
    if x.dim() > 2 or y.dim() > 2:
        raise ValueError(f"Inputs `x` and `y` should be max 2D tensors, while `x` has {x.dim()} dims and `y` has "
                         f"{y.dim()} dims.")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"Inputs shapes inconsistent x.shape[1]={x.shape[1]} vs. y.shape[1]={y.shape[1]}")
    batch_x = [] if batch_x is None else batch_x
    batch_y = [] if batch_y is None else batch_y
    lists = isinstance(batch_x, list) and isinstance(batch_y, list)
    if not all(isinstance(b, (list, torch.Tensor)) for b in (batch_x, batch_y)):
        raise Error(f"`batch_x` and `batch_y` must be torch.Tensors or lists while `batch_x` is of type "
                    f"{type(batch_x)} and `batch_y` is of type {type(batch_y)}.")
    if lists:
        if batch_x != sorted(batch_x):
            raise ValueError("'batch_x' is not sorted")
        if batch_y != sorted(batch_y):
            raise ValueError("'batch_y' is not sorted")
        if not batch_x and batch_y:
            batch_x = [0] * x.shape[0]
        if not batch_y and batch_x:
            batch_y = [0] * y.shape[0]
        if not batch_x and not batch_y:
            batch_x, batch_y = [0] * x.shape[0], [0] * y.shape[0]
        if len(batch_x) != x.shape[0]:
            raise ValueError("x.size(0) == batch_x.size(0)")
        if len(batch_y) != y.shape[0]:
            raise ValueError("y.size(0) == batch_y.size(0)")
        if _unique_consecutive(batch_x) != _unique_consecutive(batch_y):
            raise ValueError("Some batch indices occur in 'batch_x' that do not occur in 'batch_y'")
    if isinstance(batch_x, list):
        batch_x = torch.tensor(batch_x or [0] * x.shape[0], dtype=batch_y.dtype if
                               isinstance(batch_y, torch.Tensor) else torch.long)
    if isinstance(batch_y, list):
        batch_y = torch.tensor(batch_y or [0] * y.shape[0], dtype=batch_x.dtype)
    if batch_x.shape != (x.shape[0],):
        raise ValueError("x.size(0) == batch_x.size(0)")
    if batch_y.shape != (y.shape[0],):
        raise ValueError("y.size(0) == batch_y.size(0)")
    if has_torch_function((x, y, batch_x, batch_y)):   # captured: one op (compiler/library.py)
        return handle_torch_function(nearest, (x, y, batch_x, batch_y), x, y, batch_x, batch_y)
    from ipusim.ops.cluster import nearest_host   # pylint: disable=import-outside-toplevel
    return torch.from_numpy(nearest_host(x.detach().float().numpy(), y.detach().float().numpy(),
                                         batch_x.numpy(), batch_y.numpy()))
