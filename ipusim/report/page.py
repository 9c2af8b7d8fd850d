"""The page of a profile: one self-contained HTML file that shows a profile.json offline.

`write_page(path, [(label, doc), ...])` writes one file (one profile, or two side by side with
their differences) that a browser opens from disk: no server, nothing fetched, scripts and
styles inline (a Content-Security-Policy in the page forbids any request). Views: summary,
memory (a map of every tile of every IPU, coloured by bytes, with the bytes of each kind on
hover; the busiest and out-of-memory tiles; bytes by kind per IPU), liveness over the program's
supersteps with the peak named, the execution timeline per IPU (zoom and pan), the operations
table, and the comparison of two profiles.

It reads only the profile.json document (schema versions 2 and 3; a version 2 profile has no
kinds of memory at the tiles' peaks, no superstep names and no operations, and the page says so).
Large profiles stay small and quick: the per-tile, per-superstep, per-step and per-op data go
as typed columns (the smallest integer type that holds each), gzip-compressed and base64-encoded
in the page; the browser inflates them with its own DecompressionStream and draws on canvases,
with no DOM element per tile, step or op.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import struct

import numpy as np

from ..device.memory import KINDS
from . import advisor
from . import profile as prof

ASSETS = os.path.join(os.path.dirname(__file__), "page_assets")
PAGE_NAME = "profile.html"
VIEWS = ("summary", "memory", "liveness", "execution", "operations", "compare")
OP_KINDS = ("", "F", "B", "W", "U", "R")        # op kind codes in the columns (0: no op)
BUSY_KINDS = ("compute", "exchange", "sync", "inter_ipu", "host")
# the parts of a tile's peak a version 2 profile has (no kinds)
PARTS_V2 = ("always_live", "not_always_live_peak", "vertex_state", "code")
_TYPES = ((np.uint8, "u1"), (np.int8, "i1"), (np.uint16, "u2"), (np.int16, "i2"), (np.uint32, "u4"),
          (np.int32, "i4"))


class Columns:
    """Named 1-D numeric columns packed one after the other (each 8-byte aligned) in the
    smallest type that holds their values exactly: integers in 8, 16 or 32 bits, else float64."""

    def __init__(self):
        self.index: dict[str, list] = {}
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, name: str, values) -> None:
        a = np.asarray(values)
        if a.dtype == bool:
            a = a.astype(np.uint8)
        code, out = "f8", a.astype("<f8")
        if a.size == 0:
            code, out = "u1", a.astype(np.uint8)
        elif a.dtype.kind in "iu" or (a.dtype.kind == "f" and np.all(np.isfinite(a)) and np.all(a == np.round(a))):
            lo, hi = a.min(), a.max()
            for dtype, c in _TYPES:
                info = np.iinfo(dtype)
                if info.min <= lo and hi <= info.max:
                    code, out = c, a.astype(np.dtype(dtype).newbyteorder("<"))
                    break
        data = out.tobytes()
        self.index[name] = [code, self.size, int(a.size)]
        pad = -len(data) % 8
        self.parts.append(data + b"\0" * pad)
        self.size += len(data) + pad

    def blob(self) -> bytes:
        return b"".join(self.parts)


class Strings:
    """A table of distinct strings; columns hold their indices."""

    def __init__(self):
        self.table: list[str] = []
        self._index: dict[str, int] = {}

    def __call__(self, s) -> int:
        s = "" if s is None else str(s)
        if s not in self._index:
            self._index[s] = len(self.table)
            self.table.append(s)
        return self._index[s]


# =========================================================================================
# One profile's payload
# =========================================================================================
def _memory(doc: dict, cols: Columns) -> dict:
    ipus = doc["memory"]["ipus"]
    v3 = bool(ipus) and "per_tile_by_kind" in ipus[0]
    kinds = list(KINDS) if v3 else list(PARTS_V2)
    tiles = len(ipus[0]["per_tile"]["peak"]) if ipus else 0
    cols.add("tile.peak", np.concatenate([m["per_tile"]["peak"] for m in ipus]) if ipus else [])
    for k in kinds:
        cols.add(f"tile.{k}", np.concatenate([(m["per_tile_by_kind"] if v3 else m["per_tile"])[k] for m in ipus])
                 if ipus else [])
    if v3:
        cols.add("tile.peak_superstep", np.concatenate([m["per_tile_peak_superstep"] for m in ipus]) if ipus else [])
    lengths = [len(m["liveness"]) for m in ipus]
    cols.add("liveness", np.concatenate([m["liveness"] for m in ipus]) if sum(lengths) else [])
    skip = {"per_tile", "per_tile_by_kind", "per_tile_by_category", "per_tile_peak_superstep", "liveness"}
    return {"kinds": kinds, "kind_source": "peak" if v3 else "parts", "tiles": tiles,
            "ipus": [{k: v for k, v in m.items() if k not in skip} for m in ipus],
            "liveness_lengths": lengths, "supersteps": doc["memory"]["supersteps"],
            "superstep_names": doc["memory"].get("superstep_names")}


def _steps(doc: dict, cols: Columns, strings: Strings) -> dict:
    ex = doc["execution"]
    steps = ex["steps"]
    n, s_count = doc["num_ipus"], len(steps)
    start = np.zeros(s_count, np.float64)
    cycles = np.zeros(s_count, np.float64)
    call = np.zeros(s_count, np.int64)
    index = np.zeros(s_count, np.int64)
    group = np.full(s_count, -1, np.int64)
    critical = np.full(s_count, -1, np.int64)
    label = np.zeros(s_count, np.int64)
    kind = np.zeros(s_count * n, np.int64)
    stage = np.full(s_count * n, -1, np.int64)
    micro = np.full(s_count * n, -1, np.int64)
    # An IPU's busy cycles and live bytes in a step follow from the programs it ran, which repeat
    # from micro-batch to micro-batch: each distinct row of them once, and per step and IPU its row.
    rows: dict[tuple, int] = {}
    row = np.zeros(s_count * n, np.int64)
    idle = (0,) * len(BUSY_KINDS)
    codes = {k: i for i, k in enumerate(OP_KINDS)}
    for j, s in enumerate(steps):
        start[j], cycles[j], call[j], index[j] = s["start_cycle"], s["cycles"], s["call"], s["index"]
        if s["group"] is not None:
            group[j] = s["group"]
        if s["critical_ipu"] is not None:
            critical[j] = s["critical_ipu"]
        if not s["ops"]:
            label[j] = strings(s["label"])
        base = j * n
        busy = {b["ipu"]: tuple(b.get(name, 0) for name in BUSY_KINDS) for b in s["busy"]}
        live = {b["ipu"]: b["bytes"] for b in s["live_bytes"]}
        for i in range(n):
            row[base + i] = rows.setdefault(busy.get(i, idle) + (live.get(i, 0),), len(rows))
        for op in s["ops"]:    # one op per IPU and step: its last (the B a recompute R precedes)
            k = base + op["ipu"]
            kind[k] = codes.get(op["kind"], 0)
            stage[k] = -1 if op["stage"] is None else op["stage"]
            micro[k] = -1 if op["micro_batch"] is None else op["micro_batch"]
    for name, values in (("step.start", start), ("step.cycles", cycles), ("step.call", call), ("step.index", index),
                         ("step.group", group), ("step.critical", critical), ("step.label", label),
                         ("op.kind", kind), ("op.stage", stage), ("op.micro_batch", micro), ("step_ipu.row", row)):
        cols.add(name, values)
    table = np.array(list(rows), dtype=np.float64).reshape(len(rows), len(BUSY_KINDS) + 1)
    for c, name in enumerate(BUSY_KINDS):
        cols.add(f"row.busy.{name}", table[:, c])
    cols.add("row.live", table[:, len(BUSY_KINDS)])
    return {"count": s_count, "op_kinds": list(OP_KINDS), "busy_kinds": list(BUSY_KINDS), "rows": len(rows)}


def _operations(doc: dict, cols: Columns, strings: Strings) -> dict:
    ops = doc.get("operations")
    if ops is None:
        return {"count": 0, "available": False}
    text = ("name", "op", "aten", "source", "module", "block", "pass")
    numbers = ("stage", "ipu", "cycles", "compute", "exchange", "sync", "inter_ipu", "host", "exchange_bytes",
               "bytes", "tiles")
    for key in text:
        cols.add(f"ops.{key}", [strings(o[key]) for o in ops])
    for key in numbers:
        cols.add(f"ops.{key}", np.array([o[key] for o in ops], dtype=np.float64))
    return {"count": len(ops), "available": True, "text": list(text), "numbers": list(numbers)}


def payload(doc: dict, advice: str | None, label: str) -> bytes:
    """One profile as the page reads it: gzip of [4-byte length][JSON][padding][columns]."""
    cols, strings = Columns(), Strings()
    ex = doc["execution"]
    meta = {
        "label": label, "name": doc["name"], "source": doc["source"], "created": doc["created"],
        "version": doc["version"], "estimated": doc["estimated"], "notes": doc["notes"], "target": doc["target"],
        "num_ipus": doc["num_ipus"], "settings": doc["settings"], "model_error": doc.get("model_error") or [],
        "advice": advice, "blocks": (doc.get("blocks") or {}).get("names"),
        "execution": {k: v for k, v in ex.items() if k != "steps"},
        # the programs' names (liveness names them); their costs only where the page lists
        # programs in place of the operations
        "programs": [{"name": p["name"], **({} if doc.get("operations") else {
                      "cycles": p["cycles"], "per_ipu": [[c["ipu"], c["total"]] for c in p["per_ipu"]],
                      "exchange_bytes": p["exchange_bytes"], "inter_ipu_bytes": p["inter_ipu_bytes"],
                      "host_bytes": p["host_bytes"]})} for p in doc["programs"]],
        "memory": _memory(doc, cols),
        "steps": _steps(doc, cols, strings),
        "operations": _operations(doc, cols, strings),
    }
    meta["strings"] = strings.table
    meta["columns"] = cols.index
    head = json.dumps(meta, separators=(",", ":")).encode()
    head += b" " * (-(len(head) + 4) % 8)
    return gzip.compress(struct.pack("<I", len(head)) + head + cols.blob(), compresslevel=6, mtime=0)


# =========================================================================================
# The page
# =========================================================================================
def advice_text(doc: dict, num_ipus: int | None = None) -> str | None:
    """The balance advice for a profile, or None when it has no block table."""
    if not doc.get("blocks"):
        return None
    try:
        return advisor.advise_profile(doc, num_ipus).text()
    except ValueError as error:
        return f"Balance advice: {error}"


def _asset(name: str) -> str:
    with open(os.path.join(ASSETS, name), encoding="utf-8") as f:
        return f.read()


def _json_in_html(obj) -> str:
    """JSON safe inside a <script> element."""
    return json.dumps(obj, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")


def page_html(profiles: list[tuple[str, dict]], advice: list[str | None] | None = None) -> str:
    """The HTML of a page showing one profile, or two side by side (A, B) with their
    differences. `profiles` are (label, document) pairs; `advice` the balance advice text of
    each (default: computed from each document's block table)."""
    if not 1 <= len(profiles) <= 2:
        raise ValueError(f"a page shows one profile or two side by side, not {len(profiles)}")
    for label, doc in profiles:     # documents come validated (profile.load, build_profile)
        if doc.get("schema") != prof.SCHEMA_NAME or doc.get("version") not in prof.READABLE_VERSIONS:
            raise prof.ProfileError(f"{label}: not an ipusim profile of version "
                                    f"{' or '.join(map(str, prof.READABLE_VERSIONS))}")
    if advice is None:
        advice = [advice_text(doc) for _, doc in profiles]
    blobs = [base64.b64encode(payload(doc, a, label)).decode("ascii") for (label, doc), a in zip(profiles, advice)]
    page = {"views": list(VIEWS), "profiles": len(profiles)}
    if len(profiles) == 2:
        (la, a), (lb, b) = profiles
        page["comparison"] = {"labels": [la, lb], "rows": prof.comparison_rows(a, b)}
    script = _asset("page.js")
    style = _asset("page.css")
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    title = " vs ".join(f"{doc['name']}" for _, doc in profiles)
    csp = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; img-src data:; "
           "connect-src 'none'; base-uri 'none'; form-action 'none'")
    data = "\n".join(f'<script type="application/octet-stream" class="ipusim-profile">{b}</script>' for b in blobs)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>ipusim profile: {_escape(title)}</title>\n<style>{style}</style>\n</head>\n<body>\n"
            f'<noscript>This page draws the profile with JavaScript: allow scripts for local files.</noscript>\n'
            f'<script type="application/json" id="ipusim-page">{_json_in_html(page)}</script>\n{data}\n'
            f"<script>{script}</script>\n</body>\n</html>\n")


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def write_page(path: str, profiles: list[tuple[str, dict]], advice: list[str | None] | None = None) -> str:
    """Write the page (see page_html) to `path` atomically; returns the path."""
    text = page_html(profiles, advice)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path
