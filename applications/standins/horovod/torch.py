"""`horovod.torch` as Graphcore's BERT application uses it: init, rank/size, broadcast,
broadcast_parameters and allreduce. With more than one PopRun instance they are
`torch.distributed` collectives over gloo (initialised here from PopRun's environment when no
process group exists); with one they return their input, as Horovod does with one rank."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

_initialised = False


def _world() -> tuple[int, int]:
    """(rank, size) from PopRun's / mpirun's environment."""
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    return rank, size


def init() -> None:
    """Join the instances' process group (gloo) when there is more than one instance."""
    global _initialised
    rank, size = _world()
    if size > 1 and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", os.environ.get("POPDIST_MASTER_PORT", "29517"))
        dist.init_process_group("gloo", rank=rank, world_size=size)
    _initialised = True


def _check() -> None:
    if not _initialised:
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def rank() -> int:
    _check()
    return dist.get_rank() if dist.is_initialized() else 0


def size() -> int:
    _check()
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    return rank()


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """A copy of `tensor` as it is on `root_rank`."""
    _check()
    out = tensor.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(out, src=root_rank)
    return out


def broadcast_parameters(params, root_rank: int) -> None:
    """Every process takes `root_rank`'s values of `params` (a state_dict or (name, tensor) pairs), in place."""
    _check()
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    if dist.is_initialized() and dist.get_world_size() > 1:
        for _, p in items:
            if torch.is_tensor(p):
                data = p.data if isinstance(p, torch.nn.Parameter) else p
                dist.broadcast(data, src=root_rank)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op=None) -> torch.Tensor:
    """The sum over processes of `tensor` (its mean with `average`, Horovod's default)."""
    _check()
    out = tensor.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
        if average is None or average:
            out /= dist.get_world_size()
    return out
