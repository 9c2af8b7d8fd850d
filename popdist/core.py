"""The PopDist API: the distributed configuration of this process, read from the environment.

`poprun` describes each instance to the program through environment variables (the same names
PopRun uses). Outside `poprun` none of them is set and every query returns the single-process
default: 1 replica, 1 IPU per replica, replica offset 0, instance 0 of 1.

The environment is read on every call, so a value can never be stale, and a bad value is
reported with the variable's name wherever it is first used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

NUM_TOTAL_REPLICAS = "POPDIST_NUM_TOTAL_REPLICAS"
NUM_IPUS_PER_REPLICA = "POPDIST_NUM_IPUS_PER_REPLICA"
NUM_LOCAL_REPLICAS = "POPDIST_NUM_LOCAL_REPLICAS"
UNIFORM_REPLICAS_PER_INSTANCE = "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE"
REPLICA_INDEX_OFFSET = "POPDIST_REPLICA_INDEX_OFFSET"
LOCAL_INSTANCE_INDEX = "POPDIST_LOCAL_INSTANCE_INDEX"

#: Every variable `poprun` sets for PopDist, in the order it sets them.
POPDIST_VARIABLES = (
    NUM_TOTAL_REPLICAS,
    NUM_IPUS_PER_REPLICA,
    NUM_LOCAL_REPLICAS,
    UNIFORM_REPLICAS_PER_INSTANCE,
    REPLICA_INDEX_OFFSET,
    LOCAL_INSTANCE_INDEX,
)


class PopdistEnvironmentError(ValueError):
    """A PopDist environment variable holds a value that cannot describe a valid run."""


@dataclass(frozen=True)
class PopdistConfig:
    """The distributed configuration of one instance, as PopRun describes it."""

    num_total_replicas: int = 1
    num_ipus_per_replica: int = 1
    num_local_replicas: int = 1
    uniform_replicas_per_instance: bool = True
    replica_index_offset: int = 0
    local_instance_index: int = 0
    is_set: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "PopdistConfig":
        """Read and check the PopDist variables of `environ` (default: `os.environ`)."""
        env = os.environ if environ is None else environ
        config = cls(
            num_total_replicas=_read_int(env, NUM_TOTAL_REPLICAS, 1, minimum=1),
            num_ipus_per_replica=_read_int(env, NUM_IPUS_PER_REPLICA, 1, minimum=1),
            num_local_replicas=_read_int(env, NUM_LOCAL_REPLICAS, 1, minimum=1),
            uniform_replicas_per_instance=_read_bool(env, UNIFORM_REPLICAS_PER_INSTANCE, True),
            replica_index_offset=_read_int(env, REPLICA_INDEX_OFFSET, 0, minimum=0),
            local_instance_index=_read_int(env, LOCAL_INSTANCE_INDEX, 0, minimum=0),
            is_set=any(name in env for name in POPDIST_VARIABLES),
        )
        config._check()
        return config

    def _check(self) -> None:
        total, local, offset = (
            self.num_total_replicas, self.num_local_replicas, self.replica_index_offset)
        if local > total:
            raise PopdistEnvironmentError(
                f"{NUM_LOCAL_REPLICAS}={local} exceeds {NUM_TOTAL_REPLICAS}={total}: an "
                "instance cannot run more replicas than the whole job; launch through poprun "
                "or fix these variables")
        if offset + local > total:
            raise PopdistEnvironmentError(
                f"{REPLICA_INDEX_OFFSET}={offset} with {NUM_LOCAL_REPLICAS}={local} reaches "
                f"replica {offset + local - 1}, beyond {NUM_TOTAL_REPLICAS}={total}")
        if self.uniform_replicas_per_instance:
            if total % local:
                raise PopdistEnvironmentError(
                    f"{NUM_TOTAL_REPLICAS}={total} is not a multiple of "
                    f"{NUM_LOCAL_REPLICAS}={local}, yet {UNIFORM_REPLICAS_PER_INSTANCE} says "
                    "every instance runs the same number of replicas")
            if offset % local:
                raise PopdistEnvironmentError(
                    f"{REPLICA_INDEX_OFFSET}={offset} is not a multiple of "
                    f"{NUM_LOCAL_REPLICAS}={local}: with a uniform number of replicas per "
                    "instance, instance k starts at replica k * local replicas")

    @property
    def num_instances(self) -> int:
        self._require_uniform("getNumInstances")
        return self.num_total_replicas // self.num_local_replicas

    @property
    def instance_index(self) -> int:
        self._require_uniform("getInstanceIndex")
        return self.replica_index_offset // self.num_local_replicas

    def _require_uniform(self, what: str) -> None:
        if not self.uniform_replicas_per_instance:
            raise RuntimeError(
                f"popdist.{what}() needs the same number of replicas in every instance, but "
                f"{UNIFORM_REPLICAS_PER_INSTANCE}=0; use getReplicaIndexOffset() and "
                "getNumLocalReplicas() instead")


def _read_int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise PopdistEnvironmentError(
            f"{name}={raw!r} is not {kind}; poprun sets this variable, so unset it or launch "
            "the program through poprun")
    return value


def _read_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise PopdistEnvironmentError(f"{name}={raw!r} is not a boolean (expected 1 or 0)")


def _config() -> PopdistConfig:
    return PopdistConfig.from_environ()


def isPopdistEnvSet() -> bool:
    """True when the program runs under `poprun` (any PopDist variable is set)."""
    return _config().is_set


def getNumTotalReplicas() -> int:
    """The number of replicas over all instances (1 outside poprun)."""
    return _config().num_total_replicas


def getNumIpusPerReplica() -> int:
    """The number of IPUs each replica uses (1 outside poprun)."""
    return _config().num_ipus_per_replica


def getNumLocalReplicas() -> int:
    """The number of replicas this instance runs (1 outside poprun)."""
    return _config().num_local_replicas


def getReplicaIndexOffset() -> int:
    """The global index of this instance's first replica (0 outside poprun)."""
    return _config().replica_index_offset


def getLocalInstanceIndex() -> int:
    """The index of this instance among the instances on its host (0 outside poprun)."""
    return _config().local_instance_index


def isUniformReplicasPerInstance() -> bool:
    """True when every instance runs the same number of replicas (the default)."""
    return _config().uniform_replicas_per_instance


def getNumInstances() -> int:
    """The number of instances: total replicas / local replicas (needs uniform replicas)."""
    return _config().num_instances


def getInstanceIndex() -> int:
    """This instance's index in [0, getNumInstances()): replica offset / local replicas."""
    return _config().instance_index


def checkNumIpusPerReplica(num_ipus: int) -> bool:
    """Whether `num_ipus` agrees with the IPUs per replica poprun was given.

    Outside poprun nothing constrains the model, so any positive number agrees.
    """
    if isinstance(num_ipus, bool) or not isinstance(num_ipus, int) or num_ipus < 1:
        raise ValueError(f"checkNumIpusPerReplica expects a positive integer, got {num_ipus!r}")
    if NUM_IPUS_PER_REPLICA not in os.environ:
        return True
    return _config().num_ipus_per_replica == num_ipus


def getDeviceId(ipusPerReplica: int = 0) -> int:
    """The id of the device that holds all of this instance's IPUs.

    The instance owns `ipusPerReplica * getNumLocalReplicas()` IPUs (`ipusPerReplica=0` means
    `getNumIpusPerReplica()`). Poplar numbers the devices of an n-IPU system with the n
    single-IPU devices first, then the n/2 pairs, the n/4 quads, and so on up to the device
    spanning all n IPUs, whose id is therefore 2n - 2. Multi-IPU devices come in powers of two.
    """
    if isinstance(ipusPerReplica, bool) or not isinstance(ipusPerReplica, int) \
            or ipusPerReplica < 0:
        raise ValueError(f"getDeviceId expects ipusPerReplica >= 0, got {ipusPerReplica!r}")
    config = _config()
    per_replica = ipusPerReplica or config.num_ipus_per_replica
    num_ipus = per_replica * config.num_local_replicas
    if num_ipus & (num_ipus - 1):
        raise ValueError(
            f"this instance needs {num_ipus} IPUs ({config.num_local_replicas} local replicas x "
            f"{per_replica} IPUs per replica), but multi-IPU devices hold a power of two IPUs; "
            "change --num-replicas, --num-instances or --ipus-per-replica")
    return 2 * num_ipus - 2


def init(timeout_seconds: float = 300.0) -> None:
    """Join the host-side process group of all instances (torch.distributed, gloo backend).

    Under poprun with several instances this connects to the rendezvous poprun set up
    (`MASTER_ADDR`/`MASTER_PORT`), with rank = instance index and world size = number of
    instances. With a single instance, or when the process group already exists, it does
    nothing.
    """
    config = _config()
    if config.num_instances == 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != config.num_instances or \
                dist.get_rank() != config.instance_index:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but PopDist describes instance "
                f"{config.instance_index} of {config.num_instances}")
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"popdist.init() needs {' and '.join(missing)} to reach the other instances; "
            "poprun sets them, so launch the program through poprun")
    from poptorch_lite.runtime.distributed import open_process_group

    open_process_group(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"],
                       config.instance_index, config.num_instances, timeout_seconds)


def execute_on_instances(instances: Iterable[int], fn: Callable[..., Any],
                         *args: Any, **kwargs: Any) -> Any:
    """Run `fn(*args, **kwargs)` only on the given instances and return its result there.

    Every instance must call this (it is collective). Instances not in `instances` skip `fn`
    and get None. When the instances' process group exists (`popdist.init()`), `fn` runs with
    `popdist.current_group()` restricted to the participating instances, and all instances wait
    for each other afterwards, so for example a checkpoint written by instance 0 is complete
    when any instance returns. Without a process group each instance decides on its own.
    """
    config = _config()
    chosen = _instance_set(instances, config.num_instances)
    group = None
    distributed = _distributed_ready()
    if distributed:
        import torch.distributed as dist

        if chosen not in _state.groups:
            # every instance makes the same calls in the same order, so all create it together
            _state.groups[chosen] = dist.new_group(sorted(chosen))
        group = _state.groups[chosen]
    result = None
    if config.instance_index in chosen:
        previous = _state.group
        _state.group = group
        try:
            result = fn(*args, **kwargs)
        finally:
            _state.group = previous
    if distributed:
        import torch.distributed as dist

        dist.barrier()
    return result


def current_group() -> Any:
    """The torch.distributed group collectives should use: inside `execute_on_instances`, the
    participating instances; elsewhere None, which torch.distributed reads as all instances."""
    return _state.group


@dataclass
class _State:
    group: Any = None  # the group of the execute_on_instances call in progress
    groups: dict = field(default_factory=dict)  # groups by participating instances, made once


_state = _State()


def _distributed_ready() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def _instance_set(instances: Iterable[int], num_instances: int) -> frozenset[int]:
    if isinstance(instances, int):
        raise TypeError(
            f"instances must be a collection of instance indices, e.g. {{{instances}}}, "
            f"not the integer {instances}")
    chosen = frozenset(instances)
    bad = sorted((i for i in chosen if isinstance(i, bool) or not isinstance(i, int)
                  or not 0 <= i < num_instances), key=repr)
    if bad:
        raise ValueError(
            f"instances {bad} do not exist: instance indices run from 0 to {num_instances - 1}")
    if not chosen:
        raise ValueError("execute_on_instances needs at least one instance")
    return chosen
