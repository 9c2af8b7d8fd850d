"""`python -m ipusim.report`: summaries, side-by-side comparison, advice, charts, errors."""
import json
import subprocess
import sys

import numpy as np
import pytest

import ipusim as ip
from ipusim.report import advisor as adv
from ipusim.report import charts
from ipusim.report import profile as prof
from ipusim.report import cli as report
from ipusim.report import pricing
from ipusim.schedules import pipelined_schedule, price, sharded_schedule, zb_h1_schedule

TARGET = ip.Target.test(num_tiles=16)


def write_pipeline(directory, name, schedule, stage_costs, blocks=None):
    """A profile of `schedule` where the forward and backward of stage s cost stage_costs[s]
    and a weight update 500 cycles, with memory from a small real engine."""
    n = len(stage_costs)
    dev = ip.Device(TARGET, n)
    for i in range(n):
        t = dev.graph(i).addVariable("float32", (256 * (i + 1),), f"w{i}", category="weights")
        dev.graph(i).map_linearly(t)
    memory = ip.Engine(dev, [ip.Sequence()]).memory
    programs, index = [], {}
    for kind, s in [(k, s) for k in "FBU" for s in range(n)]:
        cost = 500 if kind == "U" else stage_costs[s]
        index[(kind, s)] = len(programs)
        programs.append(prof.ProgramInfo(len(programs), f"{kind}{s}", ip.Cost(cost, {s: ip.Cycles(compute=cost)}),
                                         {s: [prof.Segment(f"{kind}{s}", "compute", cost)]}, {}, len(programs), 0))

    def events(op):
        p = programs[index[(op.kind, op.ipu if op.kind == "U" else op.stage)]]
        return [prof.ProgramEvent(op, "compute", p.index, dict(p.cost.per_ipu))]

    static = prof.StaticProfile(name, "poptorch_lite", TARGET, n, memory, programs, schedule=schedule,
                                stages=[prof.StageInfo(s, s, [f"B{s}"]) for s in range(n)], blocks=blocks,
                                settings={"samples_per_call": 8})
    rec = prof.Recording(n)
    rec.add(prof.simulate(schedule, events))
    directory.mkdir(parents=True, exist_ok=True)
    prof.write_profile(str(directory), static, rec, charts=False)
    return directory


def run(argv, capsys):
    code = report.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def two_runs(tmp_path):
    costs = [1000, 3000, 1000, 1000]
    piped = write_pipeline(tmp_path / "piped" / "training", "training",
                           pipelined_schedule(4, training=True, gradient_accumulation=8), costs)
    sharded = write_pipeline(tmp_path / "sharded" / "training", "training",
                             sharded_schedule(4, training=True, gradient_accumulation=8), costs)
    return piped, sharded


def test_summary_of_one_profile(two_runs, capsys):
    code, out, _ = run([two_runs[0]], capsys)
    assert code == 0
    assert "Profile 'training': 4 x test-16x64KiB" in out and "pipelined-grouped schedule" in out
    assert "Longest stage: stage 1 on IPU 1 (blocks B1)" in out and "50.0% of the work" in out
    assert out.count("busiest tile") == 4


def test_directory_of_profiles_and_pairing(two_runs, capsys):
    piped, sharded = two_runs
    write_pipeline(piped.parent / "inference", "inference", pipelined_schedule(4, training=False, device_iterations=4),
                   [1000] * 4)
    code, out, _ = run([piped.parent], capsys)
    assert code == 0 and "Profile 'inference'" in out and "Profile 'training'" in out
    code, out, _ = run([piped.parent, "--compare", sharded.parent], capsys)     # pairs by name
    assert code == 0 and out.startswith("== training ==") and "inference" not in out


def test_comparison_shows_ratios(two_runs, capsys):
    piped, sharded = two_runs
    code, out, _ = run([piped, "--compare", sharded], capsys)
    assert code == 0
    a, b = prof.load(str(piped)), prof.load(str(sharded))
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    ratio = b["execution"]["cycles"] / a["execution"]["cycles"]
    assert ratio > 1.5                      # sharded runs one IPU at a time
    assert rows["cycles per call"].split()[-1] == f"{ratio:.3f}"
    assert rows["time per sample (us)"].split()[-1] == f"{ratio:.3f}"
    assert rows["steps per call"].split()[-3:] == [str(len(a["execution"]["steps"])), str(len(b["execution"]["steps"])),
                                                   f"{len(b['execution']['steps']) / len(a['execution']['steps']):.3f}"]
    assert "IPU 3 utilisation" in rows and "memory, all IPUs (MiB)" in rows


def test_advice_in_the_report(tmp_path, capsys):
    n = 6
    table = adv.BlockTable([f"B{i}" for i in range(n)], [4000, 4000, 4000, 1000, 1000, 1000], [8000, 8000, 8000, 2000,
                                                                                                2000, 2000],
                           [100] * n, np.zeros((n, TARGET.num_tiles), np.int64),
                           [adv.Flow(b, 1024, ("fwd", b), ("fwd", b + 1)) for b in range(n - 1)], [4, 1, 1], "test")
    d = write_pipeline(tmp_path / "p", "training", pipelined_schedule(3, training=True, gradient_accumulation=8),
                       [12000, 1000, 1000], blocks=table.to_dict())
    code, out, _ = run([d], capsys)
    assert code == 0 and "Balance advice for 3 IPUs" in out and "speedup x" in out
    code, out, _ = run([d, "--ipus", "2"], capsys)
    assert "Balance advice for 2 IPUs" in out
    code, out, _ = run([d, "--no-advice"], capsys)
    assert "Balance advice" not in out
    code, out, err = run([d, "--ipus", "9"], capsys)
    assert code == 0 and "cannot fill 9 pipeline stages" in out


def test_errors(tmp_path, capsys):
    code, _, err = run([tmp_path / "missing"], capsys)
    assert code == 1 and "does not exist" in err
    code, _, err = run([tmp_path], capsys)
    assert code == 1 and "enableProfiling" in err
    a = write_pipeline(tmp_path / "x" / "training", "training", pipelined_schedule(2, training=True,
                                                                                  gradient_accumulation=3), [1, 1])
    b = write_pipeline(tmp_path / "y" / "other", "other", pipelined_schedule(2, training=True,
                                                                            gradient_accumulation=3), [1, 1])
    write_pipeline(tmp_path / "y" / "third", "third", pipelined_schedule(2, training=True, gradient_accumulation=3),
                   [1, 1])
    code, _, err = run([a.parent, "--compare", b.parent], capsys)
    assert code == 1 and "nothing to compare" in err
    (a / "profile.json").write_text(json.dumps({"schema": "ipusim.profile", "version": 99}))
    code, _, err = run([a], capsys)
    assert code == 1 and "the file has version 99" in err


def test_schema_option(capsys):
    code, out, _ = run(["--schema"], capsys)
    assert code == 0 and json.loads(out) == json.loads(json.dumps(prof.PROFILE_SCHEMA))


def test_module_entry_point(two_runs):
    done = subprocess.run([sys.executable, "-m", "ipusim.report", str(two_runs[0])], capture_output=True, text=True)
    assert done.returncode == 0 and "Longest stage" in done.stdout


# --------------------------------------------------------------------------- charts

def test_charts_are_decodable_pngs(two_runs, capsys):
    image = pytest.importorskip("matplotlib.image")
    code, out, _ = run([two_runs[0], "--charts"], capsys)
    assert code == 0
    for name, (width, height) in (("pipeline.png", (900, 200)), ("utilisation.png", (800, 200)),
                                  ("memory.png", (900, 400))):
        path = two_runs[0] / name
        assert str(path) in out and path.stat().st_size > 10_000
        pixels = image.imread(str(path))
        assert pixels.shape[1] >= width and pixels.shape[0] >= height and pixels.shape[2] in (3, 4)
        assert pixels[..., :3].std() > 0.05          # not a blank canvas


def test_charts_without_matplotlib(two_runs, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(charts.ChartsUnavailable, match="pip install"):
        charts.write_charts(prof.load(str(two_runs[0])), str(tmp_path))
    static, rec = prof.StaticProfile("x", "ipusim", TARGET, 1, [], []), prof.Recording(1)
    rec.add([])
    doc, files, messages = prof.write_profile(str(tmp_path / "x"), static, rec)
    assert [f.rsplit("/", 1)[1] for f in files] == ["profile.json", "trace.json", "profile.html"]   # the page needs no matplotlib
    assert messages and "matplotlib is not installed" in messages[0]


def test_gantt_chart_draws_the_first_group_of_the_first_call():
    steps = [{"call": c, "group": g, "index": i} for c in (1, 2) for g in (0, 1, 2) for i in range(5)]
    chosen, what = charts.chart_steps(steps)
    assert chosen == steps[:5] and what == "5 steps of group 1 of 3"
    many = [{"call": 1, "group": None, "index": i} for i in range(charts.MAX_CHART_STEPS + 7)]
    chosen, what = charts.chart_steps(many)
    assert len(chosen) == charts.MAX_CHART_STEPS and what.endswith(f"(first {charts.MAX_CHART_STEPS} of "
                                                                   f"{charts.MAX_CHART_STEPS + 7})")


# --------------------------------------------------------------------------- --schedules

def test_schedules_table_prices_every_kind_on_the_profiled_stages(two_runs, capsys):
    code, out, _ = run([two_runs[0], "--schedules", "--weight-gradient-share", "0.25"], capsys)
    assert code == 0
    assert "W = 0.25 x the profiled backward" in out and "lock-step" in out and "event-driven" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "us/call" not in line}
    for kind in ("PopTorch", "GPipe", "1F1B", "Interleaved1F1B", "ZB-H1", "ZB-H2"):
        assert kind in rows, kind
    doc = prof.load(str(two_runs[0]))
    costs = pricing.stage_costs(doc, 0.25)
    assert [s.forward for s in costs.stages] == [1000, 3000, 1000, 1000]
    assert [(s.backward, s.weight_gradient) for s in costs.stages][1] == (2250, 750)
    assert costs.update == (500, 500, 500, 500)
    expected = price(zb_h1_schedule(4, gradient_accumulation=8), costs)
    us = 1e6 / doc["target"]["clock_hz"]
    assert f"{expected.event_driven.cycles * us:,.1f}" in rows["ZB-H1"]
    assert f"{expected.lock_step.cycles * us:,.1f}" in rows["ZB-H1"]
    assert f"{expected.event_driven.bubble_fraction():.1%}" in rows["ZB-H1"]


def test_schedules_stash_comes_from_the_block_tables_flows(tmp_path):
    blocks = {"names": ["B0", "B1"], "forward_cycles": [1, 1], "backward_cycles": [1, 1], "update_cycles": [0, 0],
              "tile_bytes": [[0] * 16, [0] * 16], "current_split": [1, 1], "source": "test",
              "flows": [{"value": 1, "bytes": 100, "src_pass": "fwd", "src_block": 0, "dst_pass": "bwd", "dst_block": 0},
                        {"value": 2, "bytes": 30, "src_pass": "fwd", "src_block": 0, "dst_pass": "bwd", "dst_block": 1},
                        {"value": 3, "bytes": 7, "src_pass": "fwd", "src_block": 0, "dst_pass": "fwd", "dst_block": 1}]}
    d = write_pipeline(tmp_path / "p", "training", pipelined_schedule(2, training=True, gradient_accumulation=3),
                       [1000, 1000], blocks=blocks)
    c = pricing.compare(prof.load(str(d)))
    assert [s.activation_bytes for s in pricing.stage_costs(prof.load(str(d))).stages] == [100, 30]
    one_f_one_b = next(r for r in c.rows if r.kind == "1F1B")
    assert one_f_one_b.price.peak_stash_bytes == (200, 30) and all(one_f_one_b.fits)


def test_schedules_charts_and_their_absence(two_runs, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    code, out, _ = run([two_runs[0], "--schedules"], capsys)
    assert code == 0 and "schedule-zb-h2.png" in out
    with open(two_runs[0] / "schedule-zb-h2.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, out, _ = run([two_runs[0], "--schedules"], capsys)
    assert code == 0 and "Charts skipped: matplotlib is not installed" in out and "ZB-H2" in out


def test_schedules_need_a_training_profile(tmp_path, capsys):
    d = write_pipeline(tmp_path / "inference", "inference", pipelined_schedule(2, training=False, device_iterations=2),
                       [1000, 1000])
    code, _, err = run([d, "--schedules"], capsys)
    assert code == 1 and "has no training schedule: compare schedules on a training profile" in err
