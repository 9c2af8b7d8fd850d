"""A pytest plugin that runs PopTorch test files on emulated IPUs.

    python -m pytest -p poptorch_lite.pytest_plugin path/to/poptorch/tests --no-hw-tests

Loaded before any conftest.py, it makes `import poptorch` (and `poptorch.<sub>`) resolve to this
project for the test run, as `poptorch-lite run` does for a script, in Python processes the
tests start too (an application's test running its training script with `python3`). Nothing else
changes: the test files, their conftest.py and helpers run as written.
"""
from . import runner

runner.propagate()
runner.install()
