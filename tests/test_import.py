"""What importing poptorch_lite does to the process, in a fresh interpreter each."""
import json
import subprocess
import sys

PROBE = """
import gc, json, weakref
before = gc.get_freeze_count()
import poptorch_lite
frozen = gc.get_freeze_count()

class Cycle:
    pass

made_after = Cycle()
made_after.me = made_after
alive = weakref.ref(made_after)
del made_after
gc.collect()
print(json.dumps({"before": before, "frozen": frozen, "enabled": gc.isenabled(),
                  "cycle_collected": alive() is None, "unfrozen_after_import": len(gc.get_objects())}))
"""


def probe() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_import_freezes_what_it_made_and_later_cycles_are_still_collected():
    facts = probe()
    # torch's and poptorch_lite's modules, classes and functions: out of the collector's generations
    assert facts["before"] == 0 and facts["frozen"] > 50000, facts
    # and what the program makes afterwards is collected as before
    assert facts["enabled"] and facts["cycle_collected"], facts
    assert facts["unfrozen_after_import"] < facts["frozen"] / 10, facts
