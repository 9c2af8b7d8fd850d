"""Programs: the control flow an Engine runs, built from supersteps.

`Execute` runs a compute set (compute phase), `Copy` moves data between tiles of one IPU
(exchange phase), `InterIpuCopy` moves it between IPUs over IPU-Links, `StreamCopy` between the
host and an IPU. `OpProgram` wraps the program an op library function builds together with the
op's whole-tensor implementation, which the fast execution mode runs instead of the body.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .tensor import Tensor
from .vertex import ComputeSet


@dataclass(eq=False)
class DataStream:
    """A FIFO between the host and one IPU (`host_to_device` or `device_to_host`)."""
    name: str
    dtype: np.dtype
    shape: tuple
    ipu: int
    direction: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(eq=False)
class RemoteBuffer:
    """Off-chip storage in the IPU's Streaming Memory: `repeats` slots of one tensor shape,
    outside tile memory; only `RemoteCopy` moves data in and out."""
    name: str
    dtype: np.dtype
    shape: tuple
    ipu: int
    repeats: int = 1

    @property
    def nbytes(self) -> int:
        """Bytes of one slot."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class Program:
    def children(self) -> list["Program"]:
        return []

    def ipus(self) -> set[int]:
        out: set[int] = set()
        for c in self.children():
            out |= c.ipus()
        return out


class Sequence(Program):
    def __init__(self, *programs: Program, name: str = ""):
        self.programs: list[Program] = []
        self.name = name
        for p in programs:
            self.add(p)

    def add(self, program: Program) -> "Sequence":
        if not isinstance(program, Program):
            raise TypeError(f"Sequence.add expects a Program, got {type(program).__name__}")
        self.programs.append(program)
        return self

    def children(self):
        return self.programs

    def __repr__(self):
        return f"Sequence({self.name or len(self.programs)})"


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two views of one variable share an element (runs compare their bounds)."""
    x, y = a.elements(), b.elements()
    if isinstance(x, slice) and isinstance(y, slice):
        return max(x.start, y.start) < min(x.stop, y.stop)
    flat = lambda e: np.arange(e.start, e.stop) if isinstance(e, slice) else np.asarray(e).reshape(-1)  # noqa: E731
    return bool(np.intersect1d(flat(x), flat(y)).size)


class Parallel(Program):
    """Programs that run at the same time (one superstep per IPU set): on disjoint sets of IPUs,
    except that inter-IPU copies may share an IPU when it sends one of them and receives another,
    and that programs may share an IPU when they touch disjoint sets of its tiles (as PopLibs runs
    a multi-convolution's convolutions side by side on parts of the IPU: `tiles_touched`).
    IPU-Links are full duplex: a copy from IPU 0 to IPU 1 and one from 1 to 0 (or the copies of a
    ring step, each IPU sending to the next) use opposite directions of their links at once."""

    def __init__(self, *programs: Program, name: str = ""):
        self.programs = list(programs)
        self.name = name
        claimed: dict[tuple[str, int], Program] = {}  # (role, IPU): "send" / "receive" by a copy, "all" by the rest
        sharing: dict[int, list[Program]] = {}        # IPU -> the programs sharing it on disjoint tiles
        for p in self.programs:
            roles = ([("send", p.src.ipu), ("receive", p.dst.ipu)] if isinstance(p, InterIpuCopy)
                     else [("all", i) for i in sorted(p.ipus())])
            for role, ipu in roles:
                clash = [claimed[(r, ipu)] for r in (("send", "receive", "all") if role == "all" else (role, "all"))
                         if (r, ipu) in claimed]
                if clash and role == "all" and ("send", ipu) not in claimed and ("receive", ipu) not in claimed \
                        and _disjoint_tiles([p, *sharing.setdefault(ipu, [claimed[("all", ipu)]])], ipu):
                    sharing[ipu].append(p)
                    clash = []
                if clash:
                    copies = role != "all" and isinstance(clash[0], InterIpuCopy)
                    what = (f"two inter-IPU copies {'from' if role == 'send' else 'to'} IPU {ipu}" if copies
                            else f"programs share IPUs [{ipu}]")
                    raise ValueError(f"Parallel {name!r}: {what}; programs running in parallel must use disjoint "
                                     "IPUs, except inter-IPU copies in which each IPU sends at most one copy and "
                                     "receives at most one")
            for key in roles:
                claimed[key] = p
        copies = [p for p in self.programs if isinstance(p, InterIpuCopy)]
        for c in copies:
            for w in copies:
                if w is not c and w.dst.var is c.src.var and _overlap(w.dst, c.src):
                    raise ValueError(f"Parallel {name!r}: a copy reads elements of {c.src.name!r} that another copy "
                                     "of the same Parallel writes; order them with a Sequence")

    def children(self):
        return self.programs


@dataclass(eq=False)
class Execute(Program):
    compute_set: ComputeSet

    def ipus(self):
        return {self.compute_set.ipu}


@dataclass(eq=False)
class Copy(Program):
    """On-chip copy (exchange) between two tensors of the same IPU."""
    src: Tensor
    dst: Tensor

    def __post_init__(self):
        check_copy(self.src, self.dst, "Copy")
        if self.src.ipu != self.dst.ipu:
            raise ValueError(f"Copy from {self.src.name!r} (IPU {self.src.ipu}) to {self.dst.name!r} "
                             f"(IPU {self.dst.ipu}) crosses IPUs: use InterIpuCopy")

    def ipus(self):
        return {self.src.ipu}


@dataclass(eq=False)
class InterIpuCopy(Program):
    src: Tensor
    dst: Tensor

    def __post_init__(self):
        check_copy(self.src, self.dst, "InterIpuCopy")
        if self.src.ipu == self.dst.ipu:
            raise ValueError(f"InterIpuCopy from {self.src.name!r} to {self.dst.name!r} stays on IPU "
                             f"{self.src.ipu}: use Copy")

    def ipus(self):
        return {self.src.ipu, self.dst.ipu}


@dataclass(eq=False)
class StreamCopy(Program):
    """Host stream to tensor (`StreamCopy(stream, tensor)`) or tensor to host stream."""
    src: DataStream | Tensor
    dst: DataStream | Tensor

    def __post_init__(self):
        if isinstance(self.src, DataStream) == isinstance(self.dst, DataStream):
            raise TypeError("StreamCopy needs exactly one DataStream and one Tensor")
        stream, tensor = (self.src, self.dst) if isinstance(self.src, DataStream) else (self.dst, self.src)
        want = "host_to_device" if stream is self.src else "device_to_host"
        if stream.direction != want:
            raise ValueError(f"stream {stream.name!r} is {stream.direction}, cannot be used as "
                             f"{'source' if stream is self.src else 'destination'} of a StreamCopy")
        if tuple(stream.shape) != tuple(tensor.shape) and int(np.prod(stream.shape)) != tensor.numel:
            raise ValueError(f"stream {stream.name!r} has shape {stream.shape}, tensor {tensor.name!r} "
                             f"has {tensor.shape}")
        if stream.dtype != tensor.dtype:
            raise TypeError(f"stream {stream.name!r} is {stream.dtype.name}, tensor {tensor.name!r} "
                            f"is {tensor.dtype.name}")

    @property
    def stream(self) -> DataStream:
        return self.src if isinstance(self.src, DataStream) else self.dst

    @property
    def tensor(self) -> Tensor:
        return self.dst if isinstance(self.src, DataStream) else self.src

    def ipus(self):
        return {self.tensor.ipu}


@dataclass(eq=False)
class RemoteCopy(Program):
    """Tensor to remote buffer slot (`RemoteCopy(tensor, buffer, slot)`) or back
    (`RemoteCopy(buffer, tensor, slot)`), over the Streaming Memory bandwidth."""
    src: RemoteBuffer | Tensor
    dst: RemoteBuffer | Tensor
    slot: int = 0

    def __post_init__(self):
        if isinstance(self.src, RemoteBuffer) == isinstance(self.dst, RemoteBuffer):
            raise TypeError("RemoteCopy needs exactly one RemoteBuffer and one Tensor")
        buf, t = self.buffer, self.tensor
        if buf.ipu != t.ipu:
            raise ValueError(f"remote buffer {buf.name!r} belongs to IPU {buf.ipu}, tensor {t.name!r} to IPU {t.ipu}")
        if int(np.prod(buf.shape, dtype=np.int64)) != t.numel or buf.dtype != t.dtype:
            raise ValueError(f"remote buffer {buf.name!r} holds {buf.dtype.name}{buf.shape}, tensor {t.name!r} is "
                             f"{t.dtype.name}{t.shape}")
        if not 0 <= self.slot < buf.repeats:
            raise ValueError(f"slot {self.slot} of remote buffer {buf.name!r} does not exist ({buf.repeats} slots)")

    @property
    def buffer(self) -> RemoteBuffer:
        return self.src if isinstance(self.src, RemoteBuffer) else self.dst

    @property
    def tensor(self) -> Tensor:
        return self.dst if isinstance(self.src, RemoteBuffer) else self.src

    @property
    def loads(self) -> bool:
        """True when the copy brings data onto the chip."""
        return isinstance(self.src, RemoteBuffer)

    def ipus(self):
        return {self.tensor.ipu}


@dataclass(eq=False)
class Repeat(Program):
    count: int
    body: Program

    def __post_init__(self):
        if not isinstance(self.count, (int, np.integer)) or self.count < 0:
            raise ValueError(f"Repeat count must be a non-negative integer, got {self.count!r}")

    def children(self):
        return [self.body]


@dataclass(eq=False)
class If(Program):
    """Run `then` when the scalar predicate tensor is non-zero, else `else_`."""
    predicate: Tensor
    then: Program
    else_: Program = field(default_factory=Sequence)

    def __post_init__(self):
        if self.predicate.numel != 1:
            raise ValueError(f"If predicate {self.predicate.name!r} must have one element, "
                             f"has shape {self.predicate.shape}")

    def children(self):
        return [self.then, self.else_]

    def ipus(self):
        return super().ipus() | {self.predicate.ipu}


@dataclass(eq=False)
class Sync(Program):
    """A barrier: all tiles of one IPU (`global_=False`) or all IPUs of the device."""
    ipu: int = 0
    global_: bool = False

    def ipus(self):
        return {self.ipu}


@dataclass(eq=False)
class OpProgram(Program):
    """An op's program plus its whole-tensor implementation for the fast mode.

    `fast(io)` reads the op's inputs with `io.read(tensor)` and writes outputs with
    `io.write(tensor, array)`, or computes them in place into `io.output(tensor)` when that
    gives the storage (not None). The body's internal exchanges only feed the op's own vertices,
    so the fast mode accounts for them without moving the bytes.
    """
    name: str
    body: Program
    fast: Callable
    reads: tuple = ()
    writes: tuple = ()

    def children(self):
        return [self.body]


def tiles_touched(program: Program, ipu: int) -> np.ndarray | None:
    """The tiles of `ipu` whose memory or workers the program uses (sorted), None when it may use
    any (a sync, a stream or a branch)."""
    parts = []
    for node in walk(program):
        if isinstance(node, Execute):
            if node.compute_set.ipu == ipu:
                parts += [t.tiles for t in node.compute_set.tables]
        elif isinstance(node, (Copy, InterIpuCopy)):
            parts += [t.tile_map().tiles for t in (node.src, node.dst) if t.ipu == ipu]
        elif isinstance(node, (Sync, StreamCopy, RemoteCopy, If)):
            if ipu in node.ipus():
                return None
    if not parts:
        return np.zeros(0, np.int64)
    return np.unique(np.concatenate([np.asarray(p, np.int64).reshape(-1) for p in parts]))


def _disjoint_tiles(programs: list[Program], ipu: int) -> bool:
    seen = []
    for p in programs:
        tiles = tiles_touched(p, ipu)
        if tiles is None or (tiles < 0).any():
            return False
        seen.append(tiles)
    merged = np.concatenate(seen) if seen else np.zeros(0, np.int64)
    return np.unique(merged).size == merged.size


def check_copy(src: Tensor, dst: Tensor, what: str) -> None:
    if src.numel != dst.numel:
        raise ValueError(f"{what} from {src.name!r} {src.shape} to {dst.name!r} {dst.shape}: "
                         "element counts differ")
    if src.dtype != dst.dtype:
        raise TypeError(f"{what} from {src.name!r} ({src.dtype.name}) to {dst.name!r} ({dst.dtype.name}): "
                        "dtypes differ; cast first")


def walk(program: Program):
    """Every program node, depth first, parents before children."""
    yield program
    for c in program.children():
        yield from walk(c)
