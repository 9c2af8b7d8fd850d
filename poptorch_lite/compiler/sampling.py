"""Grid sampling (``F.grid_sample``, ``torch.grid_sampler``, ``grid_sampler_2d`` / ``_3d``) traced
as a composition of gathers and arithmetic, so that its gradients (input and grid) are that
composition's: ATen's fused backward ops have no decomposition. Bilinear, trilinear and nearest
sampling in 2-D and 3-D: the coordinates unnormalised and padded, then each corner of the cell
(4 or 8), or the nearest element, gathered with its weight, out-of-bounds corners weighing 0, as
ATen's CPU kernels compute them (PyTorch's decomposition of ``grid_sampler_2d`` builds its
bilinear mode the same way, with an int8 parity test the device cannot run); bicubic (2-D only)
is PyTorch's decomposition.
"""
from __future__ import annotations

import itertools
import warnings

import torch
from torch._decomp.decompositions import grid_sampler_2d as _grid_sampler_2d

MODES = {"bilinear": 0, "nearest": 1, "bicubic": 2}
PADDINGS = {"zeros": 0, "border": 1, "reflection": 2}


def _source_index(coords: torch.Tensor, size: int, padding_mode: int, align_corners: bool) -> torch.Tensor:
    """Grid coordinates in [-1, 1] as input positions, padded as `padding_mode` says."""
    mul = (size * 0.5 - 0.5) if align_corners else size * 0.5
    coords = coords * mul + (size * 0.5 - 0.5)
    if padding_mode == 1:
        return coords.clamp(0, size - 1)
    if padding_mode == 2:
        twice_low, twice_high = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        if twice_low == twice_high:
            return torch.zeros_like(coords)
        low, span = twice_low / 2, (twice_high - twice_low) / 2
        distance = (coords - low).abs()
        extra = torch.fmod(distance, span)
        flips = (distance / span).floor()
        coords = torch.where(torch.fmod(flips, 2) == 0, extra + low, span + low - extra)
        return coords.clamp(0, size - 1)
    return coords


def grid_sampler_nd(a: torch.Tensor, grid: torch.Tensor, interpolation_mode: int = 0, padding_mode: int = 0,
                    align_corners: bool = False) -> torch.Tensor:
    """Grid sampling of a 2-D or 3-D input as gathers: (bi, tri)linear (mode 0: each corner of the
    cell with its weight) or nearest (mode 1, half to even); corners outside the input weigh 0."""
    nd = a.dim() - 2
    if interpolation_mode not in (0, 1):
        raise RuntimeError(f"grid_sampler(): interpolation mode {interpolation_mode} is not bilinear (0) or "
                           "nearest (1); bicubic interpolation only supports 4D input")
    if padding_mode not in (0, 1, 2):
        raise RuntimeError(f"grid_sampler(): invalid padding mode {padding_mode}")
    N, C, sizes = a.shape[0], a.shape[1], a.shape[2:]
    if grid.shape[-1] != nd:
        raise RuntimeError(f"grid_sampler(): the grid's last dimension must be {nd} (x, y{', z' if nd == 3 else ''}), "
                           f"got {grid.shape[-1]}")
    # the grid's coordinate k addresses the input's spatial axis nd - 1 - k (x is the last axis)
    coords = [_source_index(grid[..., nd - 1 - d], sizes[d], padding_mode, align_corners) for d in range(nd)]
    batch = (torch.arange(N, device=a.device).view((N,) + (1,) * (nd + 1)),
             torch.arange(C, device=a.device).view((1, C) + (1,) * nd))

    def corner(position, w=None):
        inside = None
        for p, size in zip(position, sizes):
            ok = (p >= 0) & (p < size)
            inside = ok if inside is None else inside & ok
        index = [torch.where(inside, p, 0).to(torch.int64).unsqueeze(1) for p in position]
        value = a[batch + tuple(index)]
        weight = inside.to(a.dtype) if w is None else torch.where(inside, w, 0)
        return value * weight.unsqueeze(1)

    if interpolation_mode == 1:
        return corner([p.round() for p in coords])
    low = [p.floor() for p in coords]
    weights = [(l + 1 - p, p - l) for p, l in zip(coords, low)]
    out = None
    for bits in itertools.product((0, 1), repeat=nd):
        w = None
        for d, b in enumerate(bits):
            w = weights[d][b] if w is None else w * weights[d][b]
        term = corner([l + b for l, b in zip(low, bits)], w)
        out = term if out is None else out + term
    return out


def grid_sampler(a: torch.Tensor, grid: torch.Tensor, interpolation_mode: int, padding_mode: int,
                 align_corners: bool) -> torch.Tensor:
    """torch.grid_sampler: the 2-D or 3-D composition by the input's rank."""
    if a.dim() == 4 and interpolation_mode == 2:
        return _grid_sampler_2d(a, grid, interpolation_mode, padding_mode, align_corners)
    if a.dim() in (4, 5):
        return grid_sampler_nd(a, grid, interpolation_mode, padding_mode, align_corners)
    raise RuntimeError(f"grid_sampler(): expected 4D or 5D input and grid with same number of dimensions, "
                       f"but got input with sizes {list(a.shape)}")


def grid_sample(input: torch.Tensor, grid: torch.Tensor, mode: str = "bilinear", padding_mode: str = "zeros",
                align_corners=None) -> torch.Tensor:
    """F.grid_sample's argument checks, then :func:`grid_sampler`."""
    if mode not in MODES:
        raise ValueError(f"nn.functional.grid_sample(): expected mode to be 'bilinear', 'nearest' or 'bicubic', "
                         f"but got: '{mode}'")
    if padding_mode not in PADDINGS:
        raise ValueError(f"nn.functional.grid_sample(): expected padding_mode to be 'zeros', 'border', or "
                         f"'reflection', but got: '{padding_mode}'")
    if mode == "bicubic" and input.dim() != 4:
        raise ValueError("nn.functional.grid_sample(): bicubic interpolation only supports 4D input")
    if align_corners is None:
        warnings.warn("Default grid_sample and affine_grid behavior has changed to align_corners=False since 1.3.0. "
                      "Please specify align_corners=True if the old behavior is desired. See the documentation of "
                      "grid_sample for details.")
        align_corners = False
    return grid_sampler(input, grid, MODES[mode], PADDINGS[padding_mode], bool(align_corners))


FUNCTIONS = {torch.nn.functional.grid_sample: grid_sample, torch.grid_sampler: grid_sampler,
             torch.grid_sampler_2d: grid_sampler, torch.grid_sampler_3d: grid_sampler}
