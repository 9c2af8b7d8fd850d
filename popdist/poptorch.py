"""`popdist.poptorch.Options`: PopTorch options configured from the PopRun environment.

Under `poprun` each instance runs `getNumLocalReplicas()` replicas of the model, is process
`getInstanceIndex()` of `getNumInstances()`, and uses the device `getDeviceId()` that holds its
IPUs. These Options set all three when created, and refuse the setters that would contradict
poprun (`replicationFactor`, `useIpuId`, and `Distributed.configureProcessId`, `disable`,
`setEnvVarNames`) with a RuntimeError: change the job through poprun's options instead.

Outside poprun they describe a single process with one replica, so a script written for poprun
also runs on its own.
"""

from __future__ import annotations

from poptorch_lite.api.options import Options as _PoptorchOptions
from poptorch_lite.api.options import _DistributedOptions

import popdist

_CLASS = "popdist.poptorch.Options"


def _refuse(method: str, what: str) -> RuntimeError:
    return RuntimeError(
        f"Cannot call `{method}` with {_CLASS}: poprun decides {what} (see --num-replicas, "
        f"--num-instances and --ipus-per-replica). Change poprun's options, or use "
        f"poptorch.Options to configure it yourself.")


class _PopdistDistributedOptions(_DistributedOptions):
    """`Options.Distributed` whose process id and count come from PopDist only."""

    _popdist_locked = False

    def _lock(self) -> None:
        object.__setattr__(self, "_popdist_locked", True)

    def disable(self) -> "_PopdistDistributedOptions":
        if self._popdist_locked:
            raise _refuse("Distributed.disable", "the process id and count")
        return super().disable()

    def setEnvVarNames(self, var_num_processes: str,
                       var_process_id: str) -> "_PopdistDistributedOptions":
        if self._popdist_locked:
            raise _refuse("Distributed.setEnvVarNames", "the process id and count")
        return super().setEnvVarNames(var_num_processes, var_process_id)

    def configureProcessId(self, *args, **kwargs) -> "_PopdistDistributedOptions":
        """Refused, whatever it is given, once PopDist has set the process id and count (a call
        with one argument is told that, not that it lacks num_processes)."""
        if self._popdist_locked:
            raise _refuse("Distributed.configureProcessId", "the process id and count")
        return super().configureProcessId(*args, **kwargs)


class Options(_PoptorchOptions):
    """PopTorch options for an instance launched by poprun.

    >>> opts = popdist.poptorch.Options(ipus_per_replica=2)
    >>> opts.replication_factor == popdist.getNumLocalReplicas()
    True

    :param ipus_per_replica: IPUs one replica of the model uses; must agree with poprun's
        --ipus-per-replica. Default: `popdist.getNumIpusPerReplica()`.
    """

    _popdist_locked = False

    def __init__(self, ipus_per_replica: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if ipus_per_replica is None:
            ipus_per_replica = popdist.getNumIpusPerReplica()
        elif isinstance(ipus_per_replica, bool) or not isinstance(ipus_per_replica, int) \
                or ipus_per_replica < 1:
            raise ValueError(f"{_CLASS}: ipus_per_replica must be a positive integer, got "
                             f"{ipus_per_replica!r}")
        elif not popdist.checkNumIpusPerReplica(ipus_per_replica):
            raise ValueError(
                f"{_CLASS}(ipus_per_replica={ipus_per_replica}) disagrees with poprun, which "
                f"gave each replica {popdist.getNumIpusPerReplica()} IPUs "
                f"({popdist.core.NUM_IPUS_PER_REPLICA}); pass the same number to poprun's "
                "--ipus-per-replica and to the Options")
        object.__setattr__(self, "_ipus_per_replica", ipus_per_replica)
        distributed = _PopdistDistributedOptions()
        distributed.configureProcessId(popdist.getInstanceIndex(), popdist.getNumInstances())
        distributed._lock()
        object.__setattr__(self, "_distributed", distributed)
        super().replicationFactor(popdist.getNumLocalReplicas())
        super().useIpuId(popdist.getDeviceId(ipus_per_replica))
        object.__setattr__(self, "_popdist_locked", True)

    @property
    def ipus_per_replica(self) -> int:
        """IPUs one replica uses (checked against poprun's --ipus-per-replica)."""
        return self._ipus_per_replica

    def replicationFactor(self, replication_factor: int) -> "Options":
        if self._popdist_locked:
            raise _refuse("replicationFactor", "the number of local replicas")
        return super().replicationFactor(replication_factor)

    def useIpuId(self, ipu_id: int) -> "Options":
        if self._popdist_locked:
            raise _refuse("useIpuId", "the device of each instance")
        return super().useIpuId(ipu_id)
