"""A pytest plugin that runs PopTorch test files on emulated IPUs.

    python -m pytest -p poptorch_lite.pytest_plugin path/to/poptorch/tests --no-hw-tests

Loaded before any conftest.py, it makes `import poptorch` (and `poptorch.<sub>`) resolve to this
project for the test run, as `poptorch-lite run` does for a script, in the processes the tests
spawn too (data loader workers import the test file again). Nothing else changes: the test
files, their conftest.py and helpers run as written.
"""
import sys

from . import runner

runner.install()
sys.path.insert(1, runner.spawn_shim())
