"""PopDist: the distributed configuration API of programs launched by `poprun`.

`poprun` (see `popdist.poprun`) starts several instances of a program; each reads its share of
the job (replicas, IPUs, instance index) through the functions below.
"""

from popdist.core import (
    PopdistConfig,
    PopdistEnvironmentError,
    checkNumIpusPerReplica,
    current_group,
    execute_on_instances,
    getDeviceId,
    getInstanceIndex,
    getLocalInstanceIndex,
    getNumInstances,
    getNumIpusPerReplica,
    getNumLocalReplicas,
    getNumTotalReplicas,
    getReplicaIndexOffset,
    init,
    isPopdistEnvSet,
    isUniformReplicasPerInstance,
)

__all__ = [
    "PopdistConfig",
    "PopdistEnvironmentError",
    "checkNumIpusPerReplica",
    "current_group",
    "execute_on_instances",
    "getDeviceId",
    "getInstanceIndex",
    "getLocalInstanceIndex",
    "getNumInstances",
    "getNumIpusPerReplica",
    "getNumLocalReplicas",
    "getNumTotalReplicas",
    "getReplicaIndexOffset",
    "init",
    "isPopdistEnvSet",
    "isUniformReplicasPerInstance",
]
