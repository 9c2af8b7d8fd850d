"""PopTorch's own test suite, run against this project: the per-file table of what passes.

PopTorch's tests (graphcore/poptorch `tests/*_test.py`) are kept outside this repository. Each
file runs in its own pytest process with `import poptorch` resolving here
(`-p poptorch_lite.pytest_plugin`) and PopTorch's own `--no-hw-tests`:

    python benchmarks/poptorch_tests.py --tests ../poptorch/tests              # every file
    python benchmarks/poptorch_tests.py --tests ../poptorch/tests --group ops  # the op files
    python benchmarks/poptorch_tests.py --tests ../poptorch/tests loop_test.py if_test.py

PopTorch's tests were written for torch 2.0, whose `torch.load` loads whole pickled modules by
default; torch 2.6 made `weights_only=True` the default. The files run with
`TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`, torch's own switch back to the old default, so that their
`torch.save(model)` / `torch.load(file)` round trips test this project and not torch's new default.

Tests that cannot apply to any emulator are left out (deselected), each with its reason, in
`LEFT_OUT` below; docs/conformance.md gives the same list. The share printed at the end is
passed / (collected - left out - skipped by PopTorch's own conditions), beside the left-out share
of what was collected.
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The op files (PopTorch's tests of single ops); the rest of `*_test.py` is the API.
OPS = ("activations_test.py", "blas_test.py", "convs_test.py", "lstm_test.py", "gru_test.py", "rnn_test.py",
       "losses_test.py", "norms_test.py", "pooling_and_padding_test.py", "reduce_ops_test.py",
       "math_ops_test.py", "index_ops_test.py", "slice_test.py", "tensor_ops_test.py",
       "random_sampling_test.py", "torch_nn_test.py", "misc_nn_layers_test.py", "other_ops_test.py")

# test id (or file) -> why no emulator can run it. A test id deselects all its parametrisations, a file all its tests.
LEFT_OUT: dict[str, str] = {
    # PopART's and Poplar's own files and log text
    "options_test.py::test_export_proto_file": "PopART's ONNX model file (POPTORCH_EXPORT_PROTO_FILE): the emulator "
                                               "compiles PyTorch's ATen graph and has no ONNX model",
    "options_test.py::test_name_scope_hook_disabled": "reads PopART's IR (_debugGetPopartIR) and PopTorch's "
                                                      "'lowered to PopART' log lines",
    "options_test.py::test_popart_partials": "exact log text of the Poplar matmul options PopART sets "
                                             "(\"partialsType\":\"MatMulPartialsType::FLOAT\")",
    "options_test.py::test_running_statistics": "exact log text of PopTorch's dispatcher IR dump (tensor types with "
                                                "device=ipu:0)",
    "options_test.py::test_profile_report": "expects Poplar's binary report profile.pop; the emulator writes its own "
                                            "profile (profile.json, trace.json)",
    "options_test.py::test_profile_report_with_model_name": "expects Poplar's binary report profile.pop; the emulator "
                                                            "writes its own profile (profile.json, trace.json)",
    "options_test.py::test_set_options_from_file": "expects the SyntaxError text of Python 3.8's parser ('unexpected "
                                                   "EOF while parsing'); Python 3.10+ words it differently",
    "poplar_executor_test.py::test_distributed_compile": "exact log text and timing of PopART's executable cache lock "
                                                         "('cache file locked', 'released the cache lock')",
    "poplar_executor_test.py::test_get_cycles_no_hw": "expects cycle counts to be unavailable without IPU hardware; an "
                                                      "emulator counts cycles (cycleCount works)",
    "precompilation_test.py::test_pva_annotations": "needs Graphcore's PopVision analysis library (pva) reading a "
                                                    "Poplar profile",
    "misc_test.py::test_outline_attribute": "exact text of PopART's IR log (ops of type ai.graphcore with outline "
                                            "attributes)",
    "index_ops_test.py::test_vectorized_scatter": "exact log text of PopLibs' scatter planner ('Using vectorized "
                                                  "ScatterReduce with none reduction'); its outputs and training are "
                                                  "checked before the log",
    "other_ops_test.py::test_scatter_reduce_fusable": "reads PopART's IR (_debugGetPopartIR) for its grouped "
                                                      "ScatterReduce ops and their group_size; its outputs and training"
                                                      " are checked before",
    "other_ops_test.py::test_scatter_reduce_should_not_apply_grouped_fuse": "reads PopART's IR (_debugGetPopartIR) for "
                                                                            "its ScatterReduce ops and their "
                                                                            "group_size; its outputs and training are "
                                                                            "checked before",
    "other_ops_test.py::test_2d_scatter_reduce_with_index_expansion": "exact log text of PopTorch's index-expansion "
                                                                      "pass ('Removing index expansion node:'); its "
                                                                      "outputs are checked before",
    "other_ops_test.py::test_2d_scatter_add_with_index_expansion": "exact log text of PopTorch's index-expansion pass "
                                                                   "('Removing index expansion node:'); its outputs are"
                                                                   " checked before",
    "other_ops_test.py::test_gather_with_index_expansion": "exact log text of PopTorch's gather pass ('Optimising "
                                                           "gather:') and its dispatcher's aten::expand nodes; its "
                                                           "outputs are checked before",
    "other_ops_test.py::test_available_memory_scatter_add": "exact text of PopTorch's graph dump before lowering to "
                                                            "PopART (popart::scatterreduce, "
                                                            "poptorch::set_available_memory)",
    "tensor_ops_test.py::TestOpHarness::test_error_mismatch": "a self-test of PopTorch's test harness expecting pytest "
                                                              "7's wording of a pytest.raises mismatch ('Regex pattern "
                                                              "... does not match'); pytest 8 and later word it "
                                                              "'Regex pattern did not match'",
    "tensor_ops_test.py::TestOpHarness::test_reject_fuzzy_match_without_fuzzy_option":
        "a self-test of PopTorch's test harness expecting pytest 7's wording of a pytest.raises mismatch ('Regex "
        "pattern ... does not match'); pytest 8 and later word it 'Regex pattern did not match'",
    "misc_test.py::test_set_popart_log_level": "PopART's own log output (popart:devicex, popart:ir, ...) through "
                                               "PopTorch's private _logging module",
    # PopTorch's lowering log, PopART's IR names, Poplar's compile time, downloads
    "pipelining_test.py::test_api_inline":
        "exact log text of PopTorch's lowering to PopART (' Mul:0 ... mode(Pipelined), ipu(0), stage(0)', "
        "'enablePipelining set to value 1'); it checks nothing else",
    "pipelining_test.py::test_api_wrap":
        "exact log text of PopTorch's lowering to PopART (' l1/Mul:0 ... mode(Pipelined), ipu(0), stage(0)');"
        " it checks nothing else",
    "pipelining_test.py::test_api_wrap_2stages":
        "exact log text of PopTorch's lowering to PopART (' l0/Mul:0 ... mode(Pipelined), ipu(0), stage(0)');"
        " it checks nothing else",
    "pipelining_test.py::test_inline_AutoIncrement":
        "exact log text of PopTorch's lowering to PopART (' Mul:0/1 ... mode(Pipelined), ipu(1), stage(2)'); "
        "it checks nothing else",
    "pipelining_test.py::test_api_AutoIncrement":
        "exact log text of PopTorch's lowering to PopART (' l2/Mul:0 ... mode(Pipelined), ipu(1), stage(1)');"
        " it checks nothing else",
    "pipelining_test.py::test_block_function":
        "exact log text of PopTorch's lowering to PopART (' Mul:0/1 ... mode(Pipelined), ipu(1), stage(1)'); "
        "it checks nothing else",
    "pipelining_test.py::test_removeBlocks":
        "exact log text of PopTorch's lowering to PopART (' b1/l1/Relu:0 ... mode(Pipelined), ipu(0), "
        "stage(0)'); between its log checks, BeginBlock twice raising 'module has already been assigned to a "
        "block' is checked (tests/test_blocks.py)",
    "phased_execution_test.py::test_2x2_parallel_phased_execution_inline":
        "exact log text of PopTorch's lowering to PopART (' ... mode(Phased), ipu(0), phase(0)', "
        "'executionPhaseSettings.phases set to value 6'); it checks nothing else",
    "phased_execution_test.py::test_2x2_parallel_phased_execution_opts":
        "exact log text of PopTorch's lowering to PopART (' ... mode(Phased), ipu(0), phase(0)', "
        "'executionPhaseSettings.phases set to value 6'); it checks nothing else",
    "phased_execution_test.py::test_2x2_parallel_phased_execution_small_opts":
        "exact log text of PopTorch's lowering to PopART (' ... mode(Phased), ipu(0), phase(0)', "
        "'executionPhaseSettings.phases set to value 6'); it checks nothing else",
    "phased_execution_test.py::test_serial_tensor_liveness":
        "exact log text of PopTorch's lowering to PopART ('Transpose:0 [float32(8, 7), mode(Phased), ipu(0), "
        "phase(0)]'): PopART's phase numbering per liveness; it checks nothing else",
    "debug_tensors_test.py::test_tensor_names":
        "PopART's IR tensor names (input..., loss..., scaledLearningRate..., weightDecayScaleFactor...); the "
        "emulator names the tensors anchorTensor can return (Gradient___, UpdatedVar___); the AssertionError "
        "before compiling is checked first",
    "debug_tensors_test.py::test_tensor_modes":
        "exact log text of PopART's anchor return types ('Gradient___fc2.bias EVERYN/4'); it checks nothing "
        "else",
    "ops_test.py::test_name_scope":
        "reads PopART's IR (_debugGetPopartIR) for PopART's op name 'NameScope/Add:InPlace'",
    "ops_test.py::test_available_memory_last_op":
        "exact text of PopTorch's graph dump before lowering to PopART (popart::matmul, "
        "poptorch::set_available_memory)",
    "ops_test.py::test_available_memory_linear":
        "exact text of PopTorch's graph dump before lowering to PopART (the popart::matmul variable "
        "set_available_memory takes)",
    "poplar_executor_test.py::test_get_compilation_time":
        "asserts Poplar takes over 1 s to compile x + y; compilationTime here is the emulator's own measured "
        "compile (about 0.01 s); its two errors are checked first",
    "bert_small_and_medium_test.py":
        "downloads BERT checkpoints from the Hugging Face hub (mrm8488/bert-small-finetuned-squadv2, ...); no"
        " network here",
    "dataloader_test.py::test_custom_batch_sampler": "the test's batch samplers call torch.utils.data.Sampler."
                                                     "__init__(None), which the torch this project runs "
                                                     "(2.14) no longer accepts (TypeError before the "
                                                     "DataLoader is made)",
    "dataloader_test.py::test_early_preload": "reads the fill count of PopTorch's private shared-memory ring buffer "
                                             "(_accessor._worker._data_buffers.indices_mem); early_preload itself is "
                                             "tested in this project's tests/test_data.py",
}


@dataclass
class FileResult:
    name: str
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    left_out: int = 0
    seconds: float = 0.0
    note: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def collected(self) -> int:
        return self.passed + self.failed + self.errors + self.skipped + self.left_out

    @property
    def counted(self) -> int:
        return self.passed + self.failed + self.errors


def run_file(tests: str, name: str, timeout: float, extra: list[str]) -> FileResult:
    result = FileResult(name)
    with tempfile.TemporaryDirectory(prefix="poptorch_tests_") as tmp:
        report = os.path.join(tmp, "report.xml")
        counted = os.path.join(tmp, "left_out")
        command = [sys.executable, "-m", "pytest", "-p", "poptorch_lite.pytest_plugin", "-p", "poptorch_tests",
                   "-p", "no:cacheprovider", name, "--no-hw-tests", "-q", "-rN", f"--junitxml={report}",
                   "-o", "junit_family=xunit1", *extra]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, HERE, os.environ.get("PYTHONPATH")))),
               LEFT_OUT_COUNT: counted, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=tests, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            result.seconds = time.perf_counter() - start
            result.note = f"timed out after {timeout:.0f} s"
            return result
        result.seconds = time.perf_counter() - start
        if not os.path.exists(report):
            result.note = f"pytest exit {done.returncode}: " + (done.stdout + done.stderr).strip().splitlines()[-1:][0]
            return result
        suite = ET.parse(report).getroot()
        for case in suite.iter("testcase"):
            nodeid = f"{name}::{case.get('name')}"
            if case.find("skipped") is not None:
                result.skipped += 1
            elif case.find("failure") is not None:
                result.failed += 1
                result.failures.append(nodeid + ": " + _first_line(case.find("failure").get("message")))
            elif case.find("error") is not None:
                result.errors += 1
                result.failures.append(nodeid + ": " + _first_line(case.find("error").get("message")))
            else:
                result.passed += 1
        if os.path.exists(counted):
            with open(counted, encoding="utf-8") as f:
                result.left_out = int(f.read())
    return result


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0][:200] if (text or "").strip() else ""


# This module is also the pytest plugin of each file's run (`-p poptorch_tests`): it deselects the
# tests in LEFT_OUT and writes how many it deselected to the file named by this variable.
LEFT_OUT_COUNT = "POPTORCH_TESTS_LEFT_OUT_COUNT"


def _in_file(nodeid: str) -> str:
    """A node id from the test file's name on (pytest prefixes the path from its rootdir, which for
    PopTorch's checkout is the directory above tests/)."""
    path, sep, rest = nodeid.partition("::")
    return os.path.basename(path) + sep + rest


def _left_out_by(nodeid: str, key: str) -> bool:
    """Whether LEFT_OUT's `key` names `nodeid`: the test itself, one of its parametrisations, or
    its file or class (test_block_function does not name test_block_function_saving)."""
    return nodeid == key or nodeid.startswith((key + "[", key + "::"))


def pytest_collection_modifyitems(session, config, items):
    left = [item for item in items if any(_left_out_by(_in_file(item.nodeid), key) for key in LEFT_OUT)]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if item not in left]
    if os.environ.get(LEFT_OUT_COUNT):
        with open(os.environ[LEFT_OUT_COUNT], "w", encoding="utf-8") as f:
            f.write(str(len(left)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="test files to run (default: the group's files)")
    p.add_argument("--tests", default=os.environ.get("POPTORCH_TESTS", os.path.join(ROOT, "..", "poptorch", "tests")),
                   help="PopTorch's tests/ directory (or set POPTORCH_TESTS)")
    p.add_argument("--group", choices=("all", "ops", "api"), default="all")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per file")
    p.add_argument("--failures", action="store_true", help="list every failing test with its first message line")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: extra pytest arguments")
    options = p.parse_args(argv)
    tests = os.path.abspath(options.tests)
    if not os.path.isfile(os.path.join(tests, "conftest.py")):
        p.error(f"{tests} is not PopTorch's tests/ directory (no conftest.py): pass --tests DIR")
    files = options.files or sorted(os.path.basename(f) for f in glob.glob(os.path.join(tests, "*_test.py")))
    if not options.files and options.group != "all":
        files = [f for f in files if (f in OPS) == (options.group == "ops")]
    extra = [a for a in options.pytest_args if a != "--"]
    results = []
    for name in files:
        r = run_file(tests, name, options.timeout, extra)
        results.append(r)
        print(f"{name:40s} {r.passed:5d} passed {r.failed:4d} failed {r.errors:4d} errors {r.skipped:4d} skipped "
              f"{r.left_out:4d} left out  {r.seconds:7.1f} s {r.note}", flush=True)
    total = FileResult("total")
    for r in results:
        for attr in ("passed", "failed", "errors", "skipped", "left_out", "seconds"):
            setattr(total, attr, getattr(total, attr) + getattr(r, attr))
    print()
    print("| file | collected | passed | failed | errors | skipped (PopTorch's conditions) | left out | pass share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results + [total]:
        share = f"{100 * r.passed / r.counted:.1f}%" if r.counted else "-"
        print(f"| {r.name} | {r.collected} | {r.passed} | {r.failed} | {r.errors} | {r.skipped} | {r.left_out} | "
              f"{share}{' ' + r.note if r.note else ''} |")
    if total.collected:
        print(f"\npassed {total.passed} of {total.counted} counted ({100 * total.passed / max(total.counted, 1):.1f}%); "
              f"left out {total.left_out} of {total.collected} collected ({100 * total.left_out / total.collected:.1f}%); "
              f"{total.seconds:.0f} s")
    if options.failures:
        for r in results:
            for line in r.failures:
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
