"""How far the cycle model is from published IPU measurements: one table, read by the profile
(profile.json's `model_error`), the text report, and the calibration test that keeps it true.

Each entry names a part of the cost model, the largest relative error of that part against the
published measurements `benchmarks/calibration.py` rebuilds (None where nothing published holds
it), what the error was measured over, and what the part leaves out. `tests/test_calibration.py`
runs the benchmark and fails when an entry's error no longer matches it, so a change to an
estimator must update this table, and the statements users read, in the same commit.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KnownError:
    part: str             # the part of the model: a key of the calibration table's families
    what: str             # which estimator, in words
    error: float | None   # largest |emulated / published - 1| over `over`; None: not held against a measurement
    over: str             # the measurements behind `error`
    leaves_out: str = ""  # what the part does not model

    def statement(self) -> str:
        """One line for a report: "matmul partials: within 2.0% of ... over ...; leaves out ..."."""
        head = (f"{self.what}: within {100 * self.error:.1f}% of {self.over}" if self.error is not None
                else f"{self.what}: not held against a published measurement ({self.over})")
        return head + (f"; leaves out {self.leaves_out}" if self.leaves_out else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "statement": self.statement()}


KNOWN_ERRORS: tuple[KnownError, ...] = (
    KnownError("amp_matmul", "matmul partials (AMP, float16)", 0.021,
               "published per-tile throughput for [N,16] @ [16,16] with N = 16..2048 rows per tile "
               "(tessellate-ipu, Bow)",
               "float32 matmuls, which take the same PopLibs structure at the float32 peak without a "
               "published per-tile measurement"),
    KnownError("exchange_all_tiles", "on-chip exchange", 0.030,
               "the GC200's nominal 8 TB/s aggregate (64 KiB from every tile)",
               "contention on the exchange fabric (Jia et al. 2019 report +24% latency under full load)"),
    KnownError("ipu_link_bidirectional", "IPU-Links", 0.028,
               "gc-iputraffictest's example between two IPUs of an IPU-M2000, both directions at once"),
    KnownError("host_to_tiles", "host streams", None,
               "gc-hosttraffictest's IPU-M2000 example is 49% slower than the PCIe model, over a host path "
               "the model does not describe",
               "the IPU-M2000's network-attached host link; latency per copy is a default, not a measurement"),
    KnownError("other_vertices", "convolution, pooling, elementwise, reduce and the other vertices", None,
               "no published per-vertex measurement at hand; their estimators follow the structure of "
               "PopLibs': per-worker loops, vector widths, fixed costs"),
)


def known_errors() -> list[dict]:
    """The table as plain data (profile.json's `model_error`)."""
    return [e.to_dict() for e in KNOWN_ERRORS]


def by_part() -> dict[str, KnownError]:
    return {e.part: e for e in KNOWN_ERRORS}
