"""Hugging Face's optimum-graphcore, unmodified, on emulated IPUs: IPUTrainer fine-tunes a small
BertForSequenceClassification and a small GPT2LMHeadModel, each pipelined over 2 IPUs
(applications/optimum_finetune.py), against transformers.Trainer on the CPU with the same
weights, data and effective batch.

Needs transformers 4.29.2 and optimum-graphcore 0.7.1 (installed without its numpy<1.24 pin, see
docs/applications.md and .ci/install-applications)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="the application tests need transformers (.ci/install-applications)")
pytest.importorskip("optimum", reason="the optimum-graphcore test needs optimum-graphcore 0.7.1 "
                                      "(.ci/install-applications)")
if importlib.util.find_spec("optimum.graphcore") is None:  # imported by the run, where poptorch is this project
    pytest.skip("the optimum-graphcore test needs optimum-graphcore 0.7.1 (.ci/install-applications)",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "applications", "optimum_finetune.py")
REDUCED = ["--steps", "2", "--train-samples", "64", "--eval-samples", "32"]
PREDICTIONS = {"bert": [32, 2], "gpt2": [32, 32, 128]}   # logits: two classes; 32 tokens of a vocabulary of 128


def run(model: str, trainer: str, tmp_path) -> dict:
    """The script's results, run as a user would: `poptorch-lite run` for IPUTrainer, plain Python for the CPU."""
    out = tmp_path / f"{trainer}.json"
    args = ["--model", model, *REDUCED, "--trainer", trainer, "--output-dir", str(tmp_path / trainer), "--json", str(out)]
    if trainer == "ipu":
        command = [sys.executable, "-c", "from poptorch_lite.runner import main; main()",
                   "run", "--ipu-hardware", "ipu2", SCRIPT, *args]
    else:
        command = [sys.executable, SCRIPT, *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(PREDICTIONS))
def test_iputrainer_matches_transformers_trainer_on_the_cpu(model, tmp_path):
    ipu, cpu = run(model, "ipu", tmp_path), run(model, "cpu", tmp_path)
    # The same initial weights evaluated on the same data: IPUTrainer.evaluate (through
    # inferenceModel, 2 IPUs) gives the CPU's loss.
    assert ipu["initial_eval_loss"] == pytest.approx(cpu["initial_eval_loss"], rel=1e-5)
    # Four optimiser steps of 16 samples each (2 per IPUTrainer step: gradient accumulation 8,
    # device iterations 2, two pipeline stages), the samples in the same order: the trained models
    # agree to float32 rounding (measured: 3e-7 relative on BERT's training-set loss, 1.4e-6 on
    # GPT-2's).
    assert ipu["updates"] == cpu["updates"] == 4
    assert ipu["train_loss"] == pytest.approx(cpu["train_loss"], rel=1e-4)
    assert ipu["eval_loss"] == pytest.approx(cpu["eval_loss"], rel=1e-4)
    assert ipu["predict_shape"] == cpu["predict_shape"] == PREDICTIONS[model]
    assert [entry["step"] for entry in ipu["log"]] == [1, 2]
