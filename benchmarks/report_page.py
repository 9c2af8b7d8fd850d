"""The profile page at scale: its file size and how long a browser takes to draw it.

Takes a real profile (a directory holding profile.json, e.g. the pipelining tutorial's, written
with --profile) and scales it (tests/large_profile.py: every figure repeated, nothing new) to a
BERT-Large-sized estimate: N IPUs of 1,472 tiles, S steps, K ops. Writes its page and opens it
in headless Chromium (ipusim.report.browser) at each view, several times, reporting:

- the file size, and the bound whatever the data: the uncompressed payload in base64;
- the times of writing the page (Python) and of loading profile.json with its validation (wall
  and CPU: on a busy machine the CPU time says more);
- per view, from opening the page to its first full draw (decoded, laid out, every canvas of
  the view drawn: `ipusimPage.timings.firstDraw`, milliseconds since navigation), median of the
  repeats (the timeline opens on the first gradient-accumulation group); and the time to redraw
  the timeline showing the whole run, and a tenth of it.

    python benchmarks/report_page.py PROFILE_DIR [--ipus 16] [--steps 20000] [--ops 4000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

from ipusim.report import browser, page
from ipusim.report import profile as prof

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from large_profile import scaled_profile  # noqa: E402

VIEWS = ("summary", "memory", "liveness", "execution", "operations")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="a profile directory (holding profile.json) to scale")
    parser.add_argument("--ipus", type=int, default=16)
    parser.add_argument("--tiles", type=int, default=1472)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--ops", type=int, default=4_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    doc = prof.load(args.profile)
    big = scaled_profile(doc, num_ipus=args.ipus, num_tiles=args.tiles, num_steps=args.steps,
                         num_operations=args.ops)
    with tempfile.TemporaryDirectory() as tmp:
        json_path = os.path.join(tmp, "profile.json")
        with open(json_path, "w") as f:
            json.dump(big, f, separators=(",", ":"))
        t, c = time.perf_counter(), time.process_time()
        prof.load(json_path)
        load_s, load_cpu = time.perf_counter() - t, time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        path = page.write_page(os.path.join(tmp, "big.html"), [("scaled", big)])
        write_s, write_cpu = time.perf_counter() - t, time.process_time() - c
        raw = len(gzip.decompress(page.payload(big, None, "scaled")))
        print(f"scaled profile: {args.ipus} IPUs x {args.tiles} tiles, {args.steps:,} steps, {args.ops:,} ops "
              f"(from {doc['name']!r}: {doc['num_ipus']} IPUs x {doc['target']['num_tiles']} tiles, "
              f"{len(doc['execution']['steps'])} steps, {len(doc['operations'])} ops)")
        print(f"profile.json {os.path.getsize(json_path) / 1e6:.1f} MB, read and validated in {load_s:.2f} s "
              f"({load_cpu:.2f} s of CPU)")
        print(f"page {os.path.getsize(path) / 1e6:.2f} MB, written in {write_s:.2f} s ({write_cpu:.2f} s of CPU); "
              "uncompressed payload "
              f"{raw / 1e6:.2f} MB ({raw * 4 / 3 / 1e6:.2f} MB in base64, the bound whatever the data)")
        with browser.Browser() as b:
            tab = b.new_page(1400, 900)
            for view in VIEWS:
                times = []
                for _ in range(args.repeats):
                    tab.open("about:blank")
                    tab.open(f"{path}#{view}")
                    tab.evaluate("ipusimPage.ready")
                    times.append(tab.evaluate("ipusimPage.timings.firstDraw"))
                print(f"  {view:<11} first full draw {statistics.median(times):7.0f} ms (median of {len(times)}; "
                      f"{min(times):.0f}-{max(times):.0f})")
            tab.evaluate("ipusimPage.show('execution')")
            for what, span in (("the whole run", "1"), ("a tenth of the run", "10")):
                frames = []
                for _ in range(args.repeats):
                    tab.evaluate(f"ipusimPage.profiles[0].setView(0, ipusimPage.profiles[0].end / {span})")
                    frames.append(tab.evaluate("ipusimPage.drawTimes['execution-frame']"))
                    tab.evaluate("ipusimPage.profiles[0].setView(0, 1000)")
                print(f"  timeline redraw of {what}: {statistics.median(frames):.0f} ms (median of {len(frames)})")
            errors = tab.errors()
            if errors:
                raise SystemExit(f"the page reported errors: {errors}")


if __name__ == "__main__":
    main()
