"""Published IPU measurements the cycle model is held against, each with where it was published.

Every figure here was read from its source as printed (notebook output, tool output in a manual,
text of a summary); none is read off a figure's axes unless `read_off_figure` says so. `kind`
tells how much weight a figure can carry:
  measured        a measurement printed by whoever ran it
  example output  a tool's output printed in Graphcore's manual as an example of what it reports
  vendor nominal  a product specification, not a measurement
  secondary       a measurement quoted by a summary of the paper, not read from the paper itself
`workload` holds the parameters of the measured program that the calibration benchmark rebuilds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("measured", "example output", "vendor nominal", "secondary")

TESSELLATE_PEAK_FLOPS = (
    "tessellate-ipu, notebooks/IPU Peak Flops.ipynb (graphcore-research/tessellate-ipu, commit "
    "3ab241f33359de7e2788c9837b37b78cf6d19dcd), output of the cell `sizes, tflops`: fp16[N,16] @ fp16[16,16] -> "
    "fp16 on every tile with the ConvPartial1x1 vertex, tile cycle counter around the vertex minus its overhead, "
    "Bow IPU (1,472 tiles, 1.85 GHz)")
GC_IPUTRAFFICTEST = (
    "Graphcore Command Line Tools 1.2.3, section 12 gc-iputraffictest, JSON example output "
    "(docs.graphcore.ai/projects/command-line-tools/en/1.2.3/gc-iputraffictest_main.html): IPU-M2000, devices 2 "
    "and 3, 4,096,000 KB in 0.079266418 s; the tool moves 64 KB per tile per iteration, 1,000 iterations by "
    "default, and reports in Gbit/s (4,096,000 KiB x 8 / 0.079266418 s = 423.3e9) the sum of both directions "
    "running at once. The page does not give the tile count: 32 tiles per direction is what makes 4,096,000 KiB "
    "out of 1,000 transfers of 64 KiB")
GC_HOSTTRAFFICTEST = (
    "Graphcore Command Line Tools (latest), section 9 gc-hosttraffictest, JSON example output "
    "(docs.graphcore.ai/projects/command-line-tools/en/latest/gc-hosttraffictest_main.html): IPU-M2000, 1 IPU, "
    "32 tiles, transfers of 4 64-byte blocks, 100,000 iterations; 'host -> buffer -> tile' moved 13,107,200,000 "
    "tile bytes in 3.970404303 s, reported as 26.41 Gbit/s. The page does not say how those bytes split into "
    "transfers; read as transfers of 4 x 64 bytes to each of the 32 tiles they make 1,600,000 transfers")
GC200_EXCHANGE_SPEC = (
    "Graphcore Colossus Mk2 GC200 product specification 'IPU-Exchange: 8 TB/s using any communication pattern', "
    "as recorded in the IPU notes at thecharlieblake.co.uk/ipus; the same 8 TB/s in hardwareluxx.de, "
    "'Colossus-Mk2-GC200-IPU: Auslieferung beginnt' (Dec. 2020)")
JIA_CONGESTION = (
    "Jia, Tillman, Maggioni, Scarpazza, 'Dissecting the Graphcore IPU Architecture via Microbenchmarking', Citadel "
    "technical report, arXiv:1912.03413 (2019), section 4 point-to-point benchmarks, Table 4.2; quoted by "
    "aPaperADay, '4 Point to point BMs' (2019-12-21): 'Congestion increases on-chip latency only marginally "
    "(+24%)' (GC2 IPU, C2 card)")

@dataclass(frozen=True)
class Measurement:
    key: str
    what: str
    value: float
    unit: str
    system: str
    source: str
    kind: str
    workload: dict = field(default_factory=dict)
    read_off_figure: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"measurement {self.key!r}: kind {self.kind!r} is not one of {KINDS}")
        if not self.source.strip():
            raise ValueError(f"measurement {self.key!r} has no source")


def _amp(n: int, tflops: float) -> Measurement:
    return Measurement(f"amp_matmul_N{n}", f"per-tile AMP matmul fp16 [{n},16]@[16,16], all tiles", tflops,
                       "TFLOP/s", "Bow", TESSELLATE_PEAK_FLOPS, "measured",
                       {"n": n, "k": 16, "m": 16, "tiles": 1472, "dtype": "float16"})


#: N -> TFLOP/s printed by the tessellate-ipu notebook (a subset of its 128 sizes 16..2048 in steps of 16).
TESSELLATE_TFLOPS = {
    16: 55.49366766, 32: 96.70991447, 48: 127.72015878, 64: 152.79763288, 96: 186.94235531,
    128: 211.11875736, 192: 243.36495709, 256: 264.00537751, 384: 286.61825782, 512: 299.77583828,
    768: 314.5728, 1024: 322.72628427, 1536: 330.69975639, 2048: 334.94046716,
}

MEASUREMENTS: tuple[Measurement, ...] = (
    *(_amp(n, v) for n, v in TESSELLATE_TFLOPS.items()),
    # A nominal figure has no message size: 64 KiB per tile keeps the sync a small part of the superstep.
    Measurement("exchange_all_tiles", "on-chip exchange, every tile sends to another tile, aggregate", 8.0, "TB/s",
                "GC200", GC200_EXCHANGE_SPEC, "vendor nominal", {"bytes_per_tile": 64 * 1024}),
    # The summary gives neither the message size nor the load pattern: 4 bytes, every tile sending to
    # its neighbour, are assumptions until Table 4.2 is read in the paper itself.
    Measurement("exchange_latency_full_over_no_load", "on-chip point-to-point latency, full load / no load", 1.24,
                "ratio", "GC2", JIA_CONGESTION, "secondary", {"bytes_per_message": 4}),
    Measurement("ipu_link_bidirectional", "IPU to IPU over IPU-Links, both directions at once", 423.31207649625344,
                "Gbit/s", "GC200 (IPU-M2000)", GC_IPUTRAFFICTEST, "example output",
                {"tiles_per_direction": 32, "bytes_per_tile": 64 * 1024, "iterations": 1000}),
    Measurement("host_to_tiles", "host to 32 tiles of one IPU, tile side", 26.409804140291353, "Gbit/s",
                "GC200 (IPU-M2000)", GC_HOSTTRAFFICTEST, "example output",
                {"tiles": 32, "bytes_per_transfer_per_tile": 4 * 64, "tile_bytes": 13_107_200_000}),
)


def by_key() -> dict[str, Measurement]:
    out: dict[str, Measurement] = {}
    for m in MEASUREMENTS:
        if m.key in out:
            raise ValueError(f"two published measurements share the key {m.key!r}")
        out[m.key] = m
    return out
