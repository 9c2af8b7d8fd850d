"""A large profile made by scaling a real one, for testing and timing the profile page at the size
of a BERT-Large estimate (many IPUs of 1,472 tiles, thousands of ops and steps).

Nothing in it is new data: every figure is one of the real profile's, repeated. IPU i of the
scaled profile is the real IPU i % n (n its IPUs); tile t is the real tile t % tiles; each
superstep, step and op is a real one repeated in turn (the stages, micro-batches and names of the
copies numbered on). Totals are recomputed from the repeated arrays, so the document is a valid
profile that `ipusim.report.profile.validate` accepts.
"""
from __future__ import annotations

import copy

import numpy as np

from ipusim.device.memory import KINDS


def _tiled(values, size: int) -> np.ndarray:
    return np.resize(np.asarray(values, dtype=np.int64), size)


def scaled_profile(doc: dict, *, num_ipus: int = 16, num_tiles: int = 1472, num_steps: int = 20_000,
                   superstep_repeats: int = 20, num_operations: int = 4_000) -> dict:
    """`doc` (a version 3 profile) scaled to `num_ipus` IPUs of `num_tiles` tiles, `num_steps`
    executed steps, its supersteps repeated `superstep_repeats` times and `num_operations` ops."""
    out = copy.deepcopy({k: v for k, v in doc.items() if k not in ("memory", "execution", "programs", "operations")})
    n, src_ipus = doc["num_ipus"], doc["memory"]["ipus"]
    out["name"] = f"{doc['name']} scaled to {num_ipus} IPUs"
    out["notes"] = list(doc["notes"]) + [f"synthetic: {doc['name']!r} scaled to {num_ipus} IPUs of {num_tiles} tiles, "
                                         f"{num_steps} steps and {num_operations} ops by repeating its figures"]
    out["target"] = {**doc["target"], "num_tiles": num_tiles}
    out["num_ipus"] = num_ipus
    # programs and supersteps, repeated
    programs, supersteps, names = [], [], []
    first = 0
    for r in range(superstep_repeats):
        for p, s in zip(doc["programs"], doc["memory"]["supersteps"]):
            index = len(programs)
            programs.append({**p, "index": index, "name": f"{p['name']}#{r}",
                             "per_ipu": [{**c, "ipu": c["ipu"] + n * k} for k in range(-(-num_ipus // n))
                                         for c in p["per_ipu"] if c["ipu"] + n * k < num_ipus]})
            supersteps.append({"program": index, "first": first, "count": s["count"]})
            first += s["count"]
        names += doc["memory"]["superstep_names"]
    out["programs"] = programs
    # memory
    capacity = doc["target"]["bytes_per_tile"]
    ipus = []
    for i in range(num_ipus):
        m = src_ipus[i % n]
        kinds = {k: _tiled(m["per_tile_by_kind"][k], num_tiles) for k in KINDS}
        peak = sum(kinds.values())
        parts = {k: _tiled(m["per_tile"][k], num_tiles) for k in ("always_live", "not_always_live_peak", "vertex_state",
                                                                  "code")}
        src_worst = {w["tile"]: w for w in m["worst_tiles"]}
        worst = []
        for t in np.argsort(-peak, kind="stable")[:10]:
            w = src_worst.get(int(t) % len(m["per_tile"]["peak"]))
            worst.append({"tile": int(t), "bytes": int(peak[t]), "fits": bool(peak[t] <= capacity),
                          "superstep": w["superstep"] if w else -1, "superstep_name": w["superstep_name"] if w else "",
                          "program": w["program"] if w else "", "tensors": w["tensors"] if w else []})
        scale = num_tiles / len(m["per_tile"]["peak"])
        ipus.append({**m, "ipu": i, "capacity_bytes": capacity * num_tiles, "total_bytes": int(peak.sum()),
                     "max_tile_bytes": int(peak.max()), "max_tile": int(np.argmax(peak)),
                     "fits": bool(peak.max() <= capacity),
                     "always_live_bytes": int(parts["always_live"].sum()),
                     "not_always_live_peak_bytes": int(parts["not_always_live_peak"].sum()),
                     "vertex_state_bytes": int(parts["vertex_state"].sum()), "code_bytes": int(parts["code"].sum()),
                     "by_category": {k: int(v * scale) for k, v in m["by_category"].items()},
                     "by_kind": {k: int(v.sum()) for k, v in kinds.items()},
                     "per_tile": {**{k: v.tolist() for k, v in parts.items()}, "peak": peak.tolist()},
                     "per_tile_by_kind": {k: v.tolist() for k, v in kinds.items()},
                     "per_tile_peak_superstep": _tiled(m["per_tile_peak_superstep"], num_tiles).tolist(),
                     "worst_tiles": worst,
                     "liveness": (np.tile(np.asarray(m["liveness"], np.float64) * scale, superstep_repeats)
                                  .astype(np.int64).tolist()),
                     "liveness_peak": m["liveness_peak"] and {**m["liveness_peak"],
                                                              "bytes": int(m["liveness_peak"]["bytes"] * scale)}})
    out["memory"] = {"ipus": ipus, "supersteps": supersteps, "superstep_names": names}
    # execution: the real steps in turn, each on every group of n IPUs
    ex = doc["execution"]
    src_steps = [s for s in ex["steps"] if s["call"] == 1]
    stages_per_copy = len(ex["stages"]) or 1
    micro = 1 + max((o["micro_batch"] or 0 for s in src_steps for o in s["ops"]), default=0)
    steps, start = [], 0
    for j in range(num_steps):
        s = src_steps[j % len(src_steps)]
        lap = j // len(src_steps)
        busy, ops, live = [], [], []
        for k in range(-(-num_ipus // n)):
            busy += [{**b, "ipu": b["ipu"] + n * k} for b in s["busy"] if b["ipu"] + n * k < num_ipus]
            live += [{**b, "ipu": b["ipu"] + n * k} for b in s["live_bytes"] if b["ipu"] + n * k < num_ipus]
            ops += [{**o, "ipu": o["ipu"] + n * k,
                     "stage": None if o["stage"] is None else o["stage"] + stages_per_copy * k,
                     "micro_batch": None if o["micro_batch"] is None else o["micro_batch"] + micro * lap}
                    for o in s["ops"] if o["ipu"] + n * k < num_ipus]
        steps.append({**s, "index": j, "start_cycle": start, "ops": ops, "busy": busy, "live_bytes": live,
                      "label": " ".join(o["label"] for o in ops) or s["label"]})
        start += s["cycles"]
    total = start
    out["execution"] = {
        **copy.deepcopy(ex), "calls": 1, "traced_calls": 1, "cycles_per_call": [total], "total_cycles": total,
        "total_seconds": total / doc["target"]["clock_hz"], "cycles": total, "steps": steps,
        "ipus": [{**ex["ipus"][i % n], "ipu": i} for i in range(num_ipus)],
        "stages": [{**st, "stage": st["stage"] + stages_per_copy * k, "ipu": st["ipu"] + n * k}
                   for k in range(-(-num_ipus // n)) for st in ex["stages"] if st["ipu"] + n * k < num_ipus],
    }
    if ex["schedule"]:
        out["execution"]["schedule"] = {**ex["schedule"], "num_ipus": num_ipus, "num_steps": num_steps}
    # operations: the real ones in turn, numbered on
    ops = doc["operations"]
    out["operations"] = [{**ops[q % len(ops)], "name": f"{ops[q % len(ops)]['name']}#{q // len(ops)}",
                          "ipu": (ops[q % len(ops)]["ipu"] + n * (q // len(ops))) % num_ipus}
                         for q in range(num_operations)]
    return out
