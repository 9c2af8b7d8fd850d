"""IPU targets: every hardware number the emulator uses, with where it comes from.

A `Target` describes one IPU; a `Device` (see graph.py) holds several IPUs of one target.
Published numbers carry their source; numbers Graphcore does not publish are plain fields with
the default we chose and why, so users can set them (`dataclasses.replace(GC200, sync_cycles=...)`).
"""
from __future__ import annotations

import math

import numpy as np
from dataclasses import dataclass, replace

KiB = 1024


#: Most tiles a target may have: tile mappings are int16 (see ipusim.device.tensor.TILE_DTYPE).
MAX_TILES = 2 ** 15 - 1


@dataclass(frozen=True)
class Target:
    name: str
    # Tiles per IPU. Source: PopTorch popart_compiler/source/Utils.cpp (1472 Mk2, 1216 Mk1).
    num_tiles: int
    # Hardware worker threads per tile. Source: Jia et al. 2019, "Dissecting the Graphcore IPU".
    workers_per_tile: int
    # In-processor SRAM per tile. Source: Graphcore product specs (900 MB / 1472 tiles = 624 KiB);
    # Mk1 256 KiB from early PopLibs Net.hpp.
    bytes_per_tile: int
    # Tile clock. Source: IPUToolkit.jl docs, tessellate-ipu (1.33 GHz Mk2, 1.85 GHz Bow, 1.6 GHz Mk1).
    clock_hz: float
    # Peak FLOPs per cycle per tile with the AMP unit. Source: tessellate-ipu peak-flops notebook
    # (64 half MACs/cycle on Mk2); FP32: 62.5 TFLOPS peak on GC200 -> 32 per tile per cycle.
    fp16_flops_per_cycle: int
    fp32_flops_per_cycle: int
    # Exchange bytes per cycle per tile. Source: PopLibs ipuExchangeBandwidth (4 B/cycle, ~8 TB/s/chip).
    exchange_bytes_per_cycle: int = 4
    # Local memory latency in cycles. Source: Jia et al. 2019.
    memory_latency_cycles: int = 6
    # IPU-Links. Source: Graphcore specs (GC200: 10 links, 320 GB/s in total; Mk1: 64 GB/s per link);
    # PopLibs poplibs_test/Util.cpp applies an efficiency of 0.85 to link bandwidth.
    num_ipu_links: int = 10
    ipu_link_bytes_per_s: float = 32e9
    ipu_link_efficiency: float = 0.85
    # Links a copy between two neighbouring IPUs uses. Not published per pair: default 1. Checked, not
    # fitted: gc-iputraffictest's two-IPU example on an IPU-M2000 (both directions at once) is within
    # 2.8% of one full-duplex link per direction at the efficiency above (docs/calibration.md).
    links_per_ipu_pair: int = 1
    # Host link: PCIe Gen4 x16, 64 GB/s. Source: Graphcore specs.
    host_link_bytes_per_s: float = 64e9
    # Fixed latency of a host stream copy, in cycles. Not published: default 2000 (~1.5 us at 1.33 GHz).
    host_copy_latency_cycles: int = 2000
    # On-chip (internal) sync, in cycles. Not published: default 150, the order of a tree barrier
    # over all tiles at a few cycles per level plus the sync instruction itself.
    sync_cycles: int = 150
    # Streaming Memory (remote buffer) bandwidth. Not published per IPU: default 20 GB/s.
    streaming_memory_bytes_per_s: float = 20e9
    # Per-vertex fixed overhead (launch, field loads, loop setup), in cycles. Not published:
    # default 40, consistent with the small constant terms of PopLibs' cycle estimators; with it the
    # AMP matmul vertex is within 2.1% of tessellate-ipu's per-tile measurements (not fitted to them).
    vertex_overhead_cycles: int = 40
    # Bytes a tile copies locally per cycle (on-tile copies, no exchange). Not published: 8 (64-bit loads/stores).
    local_copy_bytes_per_cycle: int = 8
    # Tiles set aside for host I/O (Poplar's IO tiles, PopTorch's Options.TensorLocations.numIOTiles):
    # tiles num_tiles .. num_tiles + io_tiles - 1 of the IPU. They hold the buffers of overlapped host
    # transfers and run no compute; ops plan on the num_tiles compute tiles. Default 0.
    io_tiles: int = 0

    def __post_init__(self):
        if not 0 < self.num_tiles + self.io_tiles <= MAX_TILES:
            raise ValueError(f"target {self.name!r}: num_tiles={self.num_tiles}; a target has 1 to "
                             f"{MAX_TILES:,} tiles per IPU (tile mappings store tile numbers as int16)")
        if self.io_tiles < 0:
            raise ValueError(f"target {self.name!r}: io_tiles={self.io_tiles} must be >= 0")

    # ---- derived quantities -------------------------------------------------------------
    @property
    def total_tiles(self) -> int:
        """All tiles of the IPU: the compute tiles and the IO tiles."""
        return self.num_tiles + self.io_tiles

    @property
    def bytes_per_ipu(self) -> int:
        return self.total_tiles * self.bytes_per_tile

    def with_io_tiles(self, io_tiles: int) -> "Target":
        """This IPU with `io_tiles` of its tiles set aside for host I/O: ops plan on the rest."""
        tiles = self.total_tiles
        if not 0 <= io_tiles < tiles:
            raise ValueError(f"target {self.name!r} has {tiles} tiles: {io_tiles} IO tiles would leave no compute "
                             "tiles")
        return replace(self, num_tiles=tiles - io_tiles, io_tiles=io_tiles)

    def flops_per_cycle(self, dtype) -> int:
        """Peak FLOPs per cycle per tile for a floating dtype name ('float16' or 'float32')."""
        return self.fp16_flops_per_cycle if str(dtype) == "float16" else self.fp32_flops_per_cycle

    def global_sync_cycles(self, num_ipus: int) -> int:
        """Sync across IPUs: ceil(15 ns * clock * hops * 2), hops = 1 + numIPUs / 4 (PopLibs Util.cpp)."""
        hops = 1 + num_ipus // 4
        return math.ceil(15e-9 * self.clock_hz * hops * 2)

    def inter_ipu_cycles(self, num_bytes: int) -> int:
        """Cycles to move bytes between two IPUs over the links joining them."""
        if num_bytes <= 0:
            return 0
        rate = self.ipu_link_bytes_per_s * self.ipu_link_efficiency * self.links_per_ipu_pair
        return math.ceil(num_bytes / rate * self.clock_hz)

    def host_cycles(self, num_bytes: int) -> int:
        """Cycles for a host stream copy of num_bytes over PCIe, plus its fixed latency."""
        if num_bytes <= 0:
            return 0
        return self.host_copy_latency_cycles + math.ceil(num_bytes / self.host_link_bytes_per_s * self.clock_hz)

    def streaming_memory_cycles(self, num_bytes: int) -> int:
        """Cycles to move bytes between Streaming Memory and the IPU."""
        if num_bytes <= 0:
            return 0
        return math.ceil(num_bytes / self.streaming_memory_bytes_per_s * self.clock_hz)

    def thread_cycles(self, instructions):
        """Tile cycles a worker needs for `instructions`: the workers are barrel-scheduled, each
        issuing one instruction every `workers_per_tile` cycles (Jia et al. 2019). A number, or
        an array (one per vertex) giving an int64 array."""
        if np.ndim(instructions):
            return np.ceil(instructions).astype(np.int64) * self.workers_per_tile
        return math.ceil(instructions) * self.workers_per_tile

    def flop_cycles(self, flops: float, dtype) -> int:
        """Tile cycles one worker needs for `flops` at its share of the tile's peak rate."""
        return math.ceil(flops * self.workers_per_tile / self.flops_per_cycle(dtype))

    def seconds(self, cycles: float) -> float:
        return cycles / self.clock_hz

    @staticmethod
    def test(num_tiles: int = 4, bytes_per_tile: int = 64 * KiB, name: str | None = None, **overrides) -> "Target":
        """A small Mk2-like target for fast tests (few tiles, small memory)."""
        return replace(GC200, name=name or f"test-{num_tiles}x{bytes_per_tile // KiB}KiB",
                       num_tiles=num_tiles, bytes_per_tile=bytes_per_tile, **overrides)


GC200 = Target(name="GC200", num_tiles=1472, workers_per_tile=6, bytes_per_tile=624 * KiB,
               clock_hz=1.33e9, fp16_flops_per_cycle=128, fp32_flops_per_cycle=32,
               num_ipu_links=10, ipu_link_bytes_per_s=32e9)
# Bow IPU: GC200 die with a 1.85 GHz clock (wafer-on-wafer power delivery). Source: Graphcore specs.
BOW = replace(GC200, name="Bow", clock_hz=1.85e9)
GC2 = Target(name="GC2", num_tiles=1216, workers_per_tile=6, bytes_per_tile=256 * KiB,
             clock_hz=1.6e9, fp16_flops_per_cycle=64, fp32_flops_per_cycle=16,
             num_ipu_links=10, ipu_link_bytes_per_s=64e9)

PRESETS = {"GC200": GC200, "Mk2": GC200, "ipu2": GC200, "Bow": BOW, "GC2": GC2, "Mk1": GC2, "ipu1": GC2}


def get_target(name: str) -> Target:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}: choose one of {sorted(PRESETS)} "
                         "or build one with Target.test(...)") from None
