"""How a poprun job is laid out: hosts, IPU-Link domains (ILDs), instances, replicas and IPUs.

Pure functions and plain data: the launcher derives every instance's environment and the
topology table from one `Topology`.
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import os
import socket
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from popdist import core


class TopologyError(ValueError):
    """The requested hosts, instances, replicas and ILDs do not form a valid job."""


class HostlistError(ValueError):
    """A host list such as `node[01-03,07]` is malformed."""


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm-style host list: `a,b[1-3],rack[1-2]-n[01-02]` -> individual host names.

    Commas separate hosts outside brackets and ranges inside them; `[08-10]` keeps the
    zero padding of its first bound; several bracket groups in one name expand as a product,
    rightmost fastest. Names are returned in order, repeated names included.
    """
    hosts: list[str] = []
    for item in _split_top_level(spec):
        if not item:
            raise HostlistError(f"empty host name in host list {spec!r}")
        hosts.extend(_expand_item(item, spec))
    if not hosts:
        raise HostlistError(f"host list {spec!r} names no host")
    return hosts


def _split_top_level(spec: str) -> list[str]:
    items, depth, start = [], 0, 0
    for pos, char in enumerate(spec):
        if char == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' in host list {spec!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in host list {spec!r}")
        elif char == "," and depth == 0:
            items.append(spec[start:pos].strip())
            start = pos + 1
    if depth:
        raise HostlistError(f"unbalanced '[' in host list {spec!r}")
    items.append(spec[start:].strip())
    return items


def _expand_item(item: str, spec: str) -> list[str]:
    parts: list[list[str]] = []
    rest = item
    while "[" in rest:
        prefix, _, rest = rest.partition("[")
        body, _, rest = rest.partition("]")
        parts.append([prefix])
        parts.append(_expand_ranges(body, spec))
    parts.append([rest])
    return ["".join(combo) for combo in itertools.product(*parts)]


def _expand_ranges(body: str, spec: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise HostlistError(
                f"bad range {part.strip()!r} in host list {spec!r}: expected N or N-M with "
                "decimal numbers, e.g. node[01-03,07]")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise HostlistError(f"descending range {part.strip()!r} in host list {spec!r}")
        width = len(low) if low.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(first, last + 1))
    return values


def slurm_hosts(environ: Mapping[str, str]) -> tuple[str, list[str]] | None:
    """The hosts of the enclosing Slurm allocation: (variable name, hosts), or None."""
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environ.get(name, "").strip():
            return name, expand_hostlist(environ[name].strip())
    return None


@lru_cache(maxsize=None)
def is_local_host(host: str) -> bool:
    """Whether `host` names this machine: its host name, or a name or address that resolves
    to a loopback address or to an address of this machine."""
    name = host.strip().lower()
    if name in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    if name == socket.gethostname().lower():
        return True
    try:
        infos = socket.getaddrinfo(name, None)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, address in infos:
        ip = ipaddress.ip_address(address[0].split("%")[0])
        if ip.is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((address[0], 0))  # binding succeeds only on this machine's addresses
            return True
        except OSError:
            continue
    return False


@dataclass(frozen=True)
class InstancePlacement:
    """Where one instance runs and which replicas and IPUs it owns."""

    index: int
    host: str
    local_index: int
    ild: int
    replicas: range
    ipus: range


@dataclass(frozen=True)
class Topology:
    """A validated job layout. Build it with `Topology.build`."""

    hosts: tuple[str, ...]
    num_replicas: int
    ipus_per_replica: int
    num_instances: int
    num_ilds: int

    @classmethod
    def build(cls, hosts: list[str] | tuple[str, ...], num_replicas: int = 1,
              ipus_per_replica: int = 1, num_instances: int = 1,
              num_ilds: int = 1) -> "Topology":
        """Check that the replicas divide among instances, instances among hosts and ILDs."""
        for name, value in (("--num-replicas", num_replicas),
                            ("--ipus-per-replica", ipus_per_replica),
                            ("--num-instances", num_instances), ("--num-ilds", num_ilds)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
        if not hosts:
            raise TopologyError("no host to run on")
        repeated = sorted({host for host in hosts if list(hosts).count(host) > 1})
        if repeated:
            raise TopologyError(
                f"host {', '.join(repeated)} is listed more than once: list each host once; "
                "--num-instances decides how many instances each host runs")
        if num_replicas % num_instances:
            raise TopologyError(
                f"--num-replicas {num_replicas} is not divisible by --num-instances "
                f"{num_instances}: every instance runs the same number of replicas, so "
                f"--num-replicas must be a multiple of --num-instances")
        if num_instances % len(hosts):
            raise TopologyError(
                f"--num-instances {num_instances} is not divisible by the {len(hosts)} hosts "
                f"({', '.join(hosts)}): instances are divided evenly among the hosts, so "
                f"--num-instances must be a multiple of the number of hosts")
        if num_instances % num_ilds:
            raise TopologyError(
                f"--num-instances {num_instances} is not divisible by --num-ilds {num_ilds}: "
                "each IPU-Link domain needs the same whole number of instances (at least one)")
        return cls(tuple(hosts), num_replicas, ipus_per_replica, num_instances, num_ilds)

    @property
    def replicas_per_instance(self) -> int:
        return self.num_replicas // self.num_instances

    @property
    def instances_per_host(self) -> int:
        return self.num_instances // len(self.hosts)

    @property
    def num_ipus(self) -> int:
        return self.num_replicas * self.ipus_per_replica

    def placement(self, index: int) -> InstancePlacement:
        if not 0 <= index < self.num_instances:
            raise IndexError(f"instance {index} does not exist (0..{self.num_instances - 1})")
        per_instance = self.replicas_per_instance
        first = index * per_instance
        return InstancePlacement(
            index=index,
            host=self.hosts[index // self.instances_per_host],
            local_index=index % self.instances_per_host,
            ild=index // (self.num_instances // self.num_ilds),
            replicas=range(first, first + per_instance),
            ipus=range(first * self.ipus_per_replica,
                       (first + per_instance) * self.ipus_per_replica),
        )

    def popdist_environment(self, index: int) -> dict[str, str]:
        """The PopDist variables of instance `index`."""
        place = self.placement(index)
        return {
            core.NUM_TOTAL_REPLICAS: str(self.num_replicas),
            core.NUM_IPUS_PER_REPLICA: str(self.ipus_per_replica),
            core.NUM_LOCAL_REPLICAS: str(self.replicas_per_instance),
            core.UNIFORM_REPLICAS_PER_INSTANCE: "1",
            core.REPLICA_INDEX_OFFSET: str(place.replicas.start),
            core.LOCAL_INSTANCE_INDEX: str(place.local_index),
        }

    def process_group_environment(self, index: int, master_addr: str,
                                  master_port: int) -> dict[str, str]:
        """The torch.distributed variables (env:// rendezvous) of instance `index`."""
        return {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "RANK": str(index),
            "WORLD_SIZE": str(self.num_instances),
            "LOCAL_RANK": str(self.placement(index).local_index),
            "LOCAL_WORLD_SIZE": str(self.instances_per_host),
        }

    def mpi_environment(self, index: int) -> dict[str, str]:
        """The OpenMPI rank variables mpirun would give instance `index`."""
        return {
            "OMPI_COMM_WORLD_RANK": str(index),
            "OMPI_COMM_WORLD_SIZE": str(self.num_instances),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(self.placement(index).local_index),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(self.instances_per_host),
        }

    def table(self) -> str:
        """The topology table: one row per level, each cell spanning the replicas it holds."""
        places = [self.placement(i) for i in range(self.num_instances)]
        ipu_cells = []
        for replica in range(self.num_replicas):
            low = replica * self.ipus_per_replica
            high = low + self.ipus_per_replica - 1
            ipu_cells.append(str(low) if low == high else f"{low}-{high}")
        rows = [
            ("hosts", list(self.hosts)),
            ("ILDs", [str(i) for i in range(self.num_ilds)]),
            ("instances", [str(p.index) for p in places]),
            ("replicas", [str(r) for r in range(self.num_replicas)]),
            ("IPUs", ipu_cells),
        ]
        leaves = self.num_replicas
        leaf = 1
        for _, cells in rows:
            span = leaves // len(cells)
            need = max(len(text) for text in cells) + 2
            leaf = max(leaf, math.ceil((need - (span - 1)) / span))
        label_width = max(len(label) for label, _ in rows) + 2
        body_width = leaves * leaf + leaves - 1
        inner = label_width + 1 + body_width
        lines = [" " + "=" * inner + " ",
                 "|" + "poprun topology".center(inner) + "|",
                 "|" + "=" * inner + "|"]
        for number, (label, cells) in enumerate(rows):
            span = leaves // len(cells)
            width = span * leaf + span - 1
            lines.append("|" + f" {label}".ljust(label_width) + "|"
                         + "|".join(text.center(width) for text in cells) + "|")
            if number < len(rows) - 1:
                lines.append("|" + "-" * label_width + "|" + "-" * body_width + "|")
        lines.append(" " + "-" * inner + " ")
        return "\n".join(lines)


def default_hosts(environ: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """Hosts to use when -H is not given: the Slurm allocation, else this machine.

    Returns the hosts and a phrase saying where they came from.
    """
    env = os.environ if environ is None else environ
    slurm = slurm_hosts(env)
    if slurm is not None:
        name, hosts = slurm
        return hosts, f"the Slurm allocation ({name}={env[name]})"
    return ["localhost"], "the default (this machine)"
