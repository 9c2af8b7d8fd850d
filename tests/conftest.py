import os
import signal
import sys

# Test modules import shared model definitions from each other (e.g. the tutorial network).
sys.path.insert(0, os.path.dirname(__file__))

# A test run started as a background job (`pytest &` in a script) begins with SIGINT ignored, and
# every process it starts would inherit that. The tests that press Ctrl-C on a script need it as
# in a terminal's foreground job.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
