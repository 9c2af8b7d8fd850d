"""Replica groups: which replicas share an input (`Options.inputReplicaGrouping`) or a per-replica
variable (`model.weight.replicaGrouping`), as PopTorch's `CommGroupType` arranges them.

With N replicas and groups of k: `Consecutive` groups {0 .. k-1}, {k .. 2k-1}, ...; `Orthogonal`
groups {j, j + m, j + 2m, ...} for m = N / k; `NoGrouping` gives every replica its own group; `All`
one group of every replica.
"""
from __future__ import annotations

from dataclasses import dataclass

from .enums import CommGroupType, VariableRetrievalMode
from .errors import Error


def group_count(replicas: int, size: int, kind: CommGroupType) -> int:
    if kind == CommGroupType.All:
        return 1
    if kind == CommGroupType.NoGrouping:
        return replicas
    return replicas // size


def group_of(replica: int, replicas: int, size: int, kind: CommGroupType) -> int:
    """The group replica `replica` belongs to."""
    if kind == CommGroupType.All:
        return 0
    if kind == CommGroupType.NoGrouping:
        return replica
    if kind == CommGroupType.Consecutive:
        return replica // size
    return replica % (replicas // size)


def groups(replicas: int, size: int, kind: CommGroupType) -> list[list[int]]:
    """The replicas of every group, groups in order, each group's replicas in order."""
    out: list[list[int]] = [[] for _ in range(group_count(replicas, size, kind))]
    for r in range(replicas):
        out[group_of(r, replicas, size, kind)].append(r)
    return out


@dataclass(frozen=True)
class VariableGrouping:
    """A per-replica variable: each group of replicas holds its own value, which the host keeps as
    slice [g] of the parameter (`OnePerGroup`) or slice [r] per replica (`AllReplicas`)."""
    kind: CommGroupType
    size: int
    retrieval: VariableRetrievalMode

    def check(self, name: str, shape: tuple, replicas: int) -> None:
        if replicas % max(self.size, 1) and self.kind in (CommGroupType.Consecutive, CommGroupType.Orthogonal):
            raise Error(f"{name}.replicaGrouping: the group size {self.size} must divide the replication factor "
                        f"({replicas})")
        want = replicas if self.retrieval == VariableRetrievalMode.AllReplicas else \
            group_count(replicas, self.size, self.kind)
        if not shape or shape[0] != want:
            what = "replica" if self.retrieval == VariableRetrievalMode.AllReplicas else "group"
            raise Error(f"{name}.replicaGrouping({self.kind!r}, {self.size}, {self.retrieval!r}): the parameter holds "
                        f"one value per {what}, so its first dimension must be {want}; it has shape {list(shape)}")

    def host_index(self, replica: int, replicas: int) -> int:
        """The slice of the host parameter replica `replica` starts from."""
        if self.retrieval == VariableRetrievalMode.AllReplicas:
            return replica
        return group_of(replica, replicas, self.size, self.kind)

    def readers(self, replicas: int) -> list[int]:
        """For each slice of the host parameter, the replica whose value it receives."""
        if self.retrieval == VariableRetrievalMode.AllReplicas:
            return list(range(replicas))
        return [g[0] for g in groups(replicas, self.size, self.kind)]

    def reduction_groups(self, replicas: int) -> list[list[int]]:
        """The replicas whose gradients are summed together."""
        return groups(replicas, self.size, self.kind)
