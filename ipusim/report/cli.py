"""`python -m ipusim.report DIR [--compare DIR2] [--schedules] [--html [OUT.html]]`: read profiles and print
their summaries, balance advice, side-by-side comparisons, and every pipeline schedule kind priced on the
profiled model; write the page of a profile (or of two compared) that a browser opens offline.

DIR is a profile directory (it holds profile.json) or a directory of them (a run's
autoReport.directory, with one sub-directory per model: "training", "inference", ...).
With --compare, profiles of the same name are paired (or the single profile of each side).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import advisor
from . import page
from . import pricing
from . import profile as prof


def find_profiles(path: str) -> dict[str, str]:
    """name -> directory of every profile in `path` (itself, or its sub-directories)."""
    if os.path.isfile(os.path.join(path, "profile.json")):
        return {os.path.basename(os.path.normpath(path)) or path: path}
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist")
    found = {d: os.path.join(path, d) for d in sorted(os.listdir(path))
             if os.path.isfile(os.path.join(path, d, "profile.json"))}
    if not found:
        raise FileNotFoundError(f"no profile.json in {path} or its sub-directories: run with profiling on "
                                "(Options.enableProfiling(DIR) or POPLAR_ENGINE_OPTIONS='{\"autoReport.all\":\"true\","
                                "\"autoReport.directory\":\"DIR\"}') or Engine(..., profile_dir=DIR)")
    return found


def pairs(a: dict[str, str], b: dict[str, str]) -> list[tuple[str, str, str]]:
    """(label, dir a, dir b) of the profiles to compare."""
    if len(a) == 1 and len(b) == 1:
        (na, da), (nb, db) = next(iter(a.items())), next(iter(b.items()))
        return [(na if na == nb else f"{na} vs {nb}", da, db)]
    common = [n for n in a if n in b]
    if not common:
        raise ValueError(f"nothing to compare: the first side has profiles {sorted(a)}, the second {sorted(b)}; "
                         "point both at single profile directories")
    return [(n, a[n], b[n]) for n in common]


def report(path: str, num_ipus: int | None = None, advice: bool = True) -> str:
    out = []
    for name, directory in find_profiles(path).items():
        doc = prof.load(directory)
        out.append(prof.summary(doc))
        if advice and doc.get("blocks"):
            try:
                out.append(advisor.advise_profile(doc, num_ipus).text())
            except ValueError as error:
                out.append(f"Balance advice: {error}")
        out.append("")
    return "\n".join(out).rstrip()


def compare(path_a: str, path_b: str) -> str:
    out = []
    for label, da, db in pairs(find_profiles(path_a), find_profiles(path_b)):
        out += [f"== {label} ==", prof.comparison(prof.load(da), prof.load(db), (da, db)), ""]
    return "\n".join(out).rstrip()


def write_pages(path: str, compare_path: str | None = None, out: str | None = None,
                num_ipus: int | None = None) -> list[str]:
    """The page of every profile in `path` (profile.html beside its profile.json), or of every
    pair compared with `compare_path` (compare.html beside the first profile.json); `out` names
    the file when there is one page to write."""
    if compare_path is not None:
        jobs = [(da, [da, db]) for _, da, db in pairs(find_profiles(path), find_profiles(compare_path))]
        default = "compare.html"
    else:
        jobs = [(d, [d]) for d in find_profiles(path).values()]
        default = page.PAGE_NAME
    if out and len(jobs) > 1:
        raise ValueError(f"{len(jobs)} pages to write ({', '.join(d for d, _ in jobs)}) but one file name, {out}: give "
                         "--html without a file name to write each beside its profile.json, or point at one profile")
    written = []
    for home, dirs in jobs:
        docs = [prof.load(d) for d in dirs]
        written.append(page.write_page(out or os.path.join(home, default), list(zip(dirs, docs)),
                                       advice=[page.advice_text(doc, num_ipus) for doc in docs]))
    return written


def screenshots(path: str, shots: list[str]) -> list[str]:
    """PNG screenshots of views of a page (`VIEW=PNG` each), taken in headless Chromium."""
    from .browser import Browser
    jobs = []
    for spec in shots:
        view, sep, png = spec.partition("=")
        if not sep or not png or view not in page.VIEWS:
            raise ValueError(f"--screenshot {spec!r}: give VIEW=FILE.png with VIEW one of {', '.join(page.VIEWS)}")
        jobs.append((view, png))
    with Browser() as browser:
        tab = browser.new_page(1400, 900)
        tab.open(path)
        if tab.evaluate("ipusimPage.ready.then(() => document.documentElement.dataset.ready)") != "1":
            raise RuntimeError(f"the page {path} did not draw: {'; '.join(tab.errors()) or 'no console message'}")
        for view, png in jobs:
            if not tab.evaluate(f"!!document.getElementById('view-{view}')"):
                raise ValueError(f"the page {path} has no {view} view (compare needs --compare)")
            tab.evaluate(f"ipusimPage.show('{view}'); new Promise((r) => requestAnimationFrame(() => "
                         "requestAnimationFrame(r)))")
            tab.screenshot(png, selector=f"#view-{view}")
        if tab.errors():
            raise RuntimeError(f"the page {path} reported errors: {'; '.join(tab.errors())}")
    return [png for _, png in jobs]


def compare_schedules(path: str, weight_gradient_share: float | None, charts: bool = True) -> str:
    """Every schedule kind priced on each training profile in `path`, with one Gantt chart per
    kind next to its profile.json (when matplotlib is installed)."""
    from .charts import ChartsUnavailable
    out = []
    for _, directory in find_profiles(path).items():
        c = pricing.compare(prof.load(directory), weight_gradient_share)
        out.append(pricing.text(c))
        if charts:
            try:
                written = pricing.write_charts(c, directory)
                out.append(f"  Gantt charts (event-driven): {', '.join(os.path.basename(p) for p in written)} in "
                           f"{directory}")
            except ChartsUnavailable as note:
                out.append(f"  {note} The table above is complete without them.")
        out.append("")
    return "\n".join(out).rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ipusim.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", help="profile directory, or a directory of profile directories")
    parser.add_argument("--compare", metavar="DIR2", help="show DIR and DIR2 side by side with ratios DIR2 / DIR")
    parser.add_argument("--ipus", type=int, metavar="N", help="balance advice for N IPUs (default: as profiled)")
    parser.add_argument("--no-advice", action="store_true", help="leave out the balance advice")
    parser.add_argument("--charts", action="store_true", help="(re)draw the PNG charts next to each profile.json")
    parser.add_argument("--html", nargs="?", const="", metavar="OUT.html",
                        help="write the page of the profile (with --compare, of both side by side): one HTML file that "
                             "works offline; default profile.html (compare.html) beside profile.json")
    parser.add_argument("--screenshot", action="append", default=[], metavar="VIEW=PNG",
                        help=f"with --html: a screenshot of a view of the page ({', '.join(page.VIEWS)}) taken in "
                             "headless Chromium; may be repeated")
    parser.add_argument("--schema", action="store_true", help="print the JSON Schema of profile.json and exit")
    parser.add_argument("--schedules", action="store_true",
                        help="price every pipeline schedule kind (PopTorch's, GPipe, 1F1B, interleaved 1F1B, ZB-H1, "
                             "ZB-H2) on the profiled model: time per call, bubble, peak stash per IPU, Gantt charts")
    parser.add_argument("--weight-gradient-share", type=float, default=None,
                        metavar="X", help="with --schedules: the share of the profiled backward taken as the weight "
                                          "gradient W of the split kinds (default: W as measured when the profiled "
                                          f"run split its backwards, else {pricing.DEFAULT_WEIGHT_GRADIENT_SHARE})")
    args = parser.parse_args(argv)
    if args.schema:
        print(json.dumps(prof.PROFILE_SCHEMA, indent=2))
        return 0
    if not args.dir:
        parser.error("give a profile directory (or --schema)")
    if args.screenshot and args.html is None:
        parser.error("--screenshot needs --html")
    try:
        if args.html is not None:
            written = write_pages(args.dir, args.compare, args.html or None, args.ipus)
            print("\n".join(f"Page written to {p}" for p in written))
            if args.screenshot:
                if len(written) > 1:
                    raise ValueError(f"--screenshot takes one page; {len(written)} were written")
                print("\n".join(f"Screenshot written to {p}" for p in screenshots(written[0], args.screenshot)))
        if args.charts:
            from .charts import write_charts
            for _, directory in find_profiles(args.dir).items():
                print("\n".join(write_charts(prof.load(directory), directory)))
        if args.schedules:
            print(compare_schedules(args.dir, args.weight_gradient_share))
        elif args.compare:
            print(compare(args.dir, args.compare))
        else:
            print(report(args.dir, args.ipus, not args.no_advice))
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        print(f"ipusim.report: {error}", file=sys.stderr)
        return 1
    return 0

