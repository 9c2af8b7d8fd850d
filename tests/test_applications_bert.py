"""Graphcore's BERT application (graphcore/examples, nlp/bert/pytorch), unmodified, on emulated IPUs,
and the stand-ins it runs with (applications/standins: horovod, examples_utils; the tokenizer's
vocabulary: applications/bert_vocabulary.py; the SQuAD data set and metric: applications/squad_sample.py).

The application is not part of this repository: its test runs when GRAPHCORE_EXAMPLES names a
checkout of graphcore/examples."""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDINS = os.path.join(ROOT, "applications", "standins")
EXAMPLES = os.environ.get("GRAPHCORE_EXAMPLES")
BERT = os.path.join(EXAMPLES or "GRAPHCORE_EXAMPLES", "nlp", "bert", "pytorch")
needs_application = pytest.mark.skipif(
    not os.path.isfile(os.path.join(BERT, "tests", "cpu_ipu_test.py")),
    reason=f"Graphcore's BERT application is not at {BERT}: set GRAPHCORE_EXAMPLES to a checkout of graphcore/examples")


def application_module(name: str):
    """A module of applications/ (the stand-ins' writers)."""
    sys.path.insert(0, os.path.join(ROOT, "applications"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(os.path.join(ROOT, "applications"))


def application_copy(tmp_path) -> tuple[str, dict]:
    """A copy of the application and the environment it runs in: the stand-ins on PYTHONPATH, the
    tokenizer's Hub cache in HF_HOME, offline."""
    app = tmp_path / "bert"
    shutil.copytree(BERT, app, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    hf = str(tmp_path / "hf")
    application_module("bert_vocabulary").write_hub_cache(hf)
    env = {**os.environ, "HF_HOME": hf, "HF_HUB_OFFLINE": "1", "POPTORCH_LITE_IPU_HARDWARE": "ipu2",
           "PYTHONPATH": os.pathsep.join([ROOT, STANDINS, os.environ.get("PYTHONPATH", "")])}
    return str(app), env


def run_script(app: str, env: dict, script: str, *args: str, timeout: int = 3600) -> str:
    """`poptorch-lite run SCRIPT ARGS` in the application's copy; its output (stdout and stderr)."""
    done = subprocess.run([sys.executable, "-m", "poptorch_lite", "run", "--ipu-hardware", "ipu2", script, *args],
                          cwd=app, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-6000:]
    return done.stdout


@pytest.fixture
def standins(monkeypatch):
    """`horovod` and `examples_utils` resolve to the stand-ins, as they do for the application's runs."""
    monkeypatch.syspath_prepend(STANDINS)
    for name in ("horovod", "horovod.torch", "examples_utils"):
        sys.modules.pop(name, None)
    yield
    for name in ("horovod", "horovod.torch", "examples_utils"):
        sys.modules.pop(name, None)


def test_horovod_standin_is_the_identity_in_one_process(standins, monkeypatch):
    for variable in ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "RANK"):
        monkeypatch.delenv(variable, raising=False)
    hvd = importlib.import_module("horovod.torch")
    with pytest.raises(ValueError, match="hvd.init"):
        hvd.size()
    hvd.init()
    assert (hvd.rank(), hvd.size(), hvd.local_rank()) == (0, 1, 0)
    x = torch.arange(6.0).reshape(2, 3)
    for out in (hvd.allreduce(x), hvd.allreduce(x, average=False), hvd.broadcast(x, root_rank=0)):
        assert torch.equal(out, x) and out is not x
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_examples_utils_standin_accepts_only_the_pattern_that_changes_no_value(standins, tmp_path):
    examples_utils = importlib.import_module("examples_utils")
    pattern = tmp_path / "residual_add_inplace_pattern.cpp"
    pattern.write_text("// a PopART pattern\n")
    assert examples_utils.load_lib(str(pattern)) is None
    assert examples_utils.loaded[-1] == str(pattern)
    with pytest.raises(FileNotFoundError, match="no such C\\+\\+ source"):
        examples_utils.load_lib(str(tmp_path / "missing.cpp"))
    op = tmp_path / "my_custom_op.cpp"
    op.write_text("// an op\n")
    with pytest.raises(NotImplementedError, match="register_custom_op"):
        examples_utils.load_lib(str(op))


def test_tokenizer_standin_gives_the_application_sequence_length(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the tokenizer stand-in needs transformers")
    application_module("bert_vocabulary").write_hub_cache(str(tmp_path))
    tokenizer = transformers.BertTokenizer.from_pretrained("bert-base-uncased", cache_dir=str(tmp_path / "hub"),
                                                           local_files_only=True)
    sentence = ("Hello, my dog is cute " * 4 + "Hello, my dog is cute yo") * 3 + \
        "Hello, my dog is cute " * 4 + "Hello, my dog is cute"
    ids = tokenizer(sentence, return_tensors="pt")["input_ids"]
    assert ids.shape == (1, 128)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.convert_ids_to_tokens(ids[0, :8].tolist()) == ["[CLS]", "hello", ",", "my", "dog", "is", "cute",
                                                                     "hello"]


def test_squad_sample_is_squad_v1_with_answers_at_their_offsets():
    squad_sample = application_module("squad_sample")
    vocabulary = set(application_module("bert_vocabulary").VOCABULARY)
    doc = squad_sample.squad_json(20, seed=3)
    assert doc["version"] == "1.1" and sum(len(p["qas"]) for a in doc["data"] for p in a["paragraphs"]) == 20
    rows = list(squad_sample.rows(doc))
    assert len({r["id"] for r in rows}) == 20
    for r in rows:
        (text,), (start,) = r["answers"]["text"], r["answers"]["answer_start"]
        assert r["context"][start:start + len(text)] == text
        assert r["context"].count(text + " ") + r["context"].count(text + " .") >= 1
        assert set(r["context"].split()) | set(r["question"].split()) <= vocabulary
        # one answer: the fact the question asks about is the only one of its kind in the paragraph
        key = r["question"].split()[2] if r["question"].startswith("what") else r["question"][len("who has "):-2]
        assert r["context"].count(key + " has " if r["question"].startswith("what") else "has " + key) == 1
    assert squad_sample.squad_json(20, seed=3) == doc and squad_sample.squad_json(20, seed=4) != doc


CHECK_SQUAD_CACHE = """
import json, sys
from datasets import load_dataset, load_metric
from transformers import BertTokenizerFast
data = load_dataset("squad")
metric = load_metric("squad")
val = data["validation"]
refs = [{"id": r["id"], "answers": r["answers"]} for r in val]
right = metric.compute(predictions=[{"id": r["id"], "prediction_text": r["answers"]["text"][0]} for r in val],
                       references=refs)
wrong = metric.compute(predictions=[{"id": r["id"], "prediction_text": "the " + r["answers"]["text"][0] + " box"}
                                    for r in val], references=refs)
tokenizer = BertTokenizerFast.from_pretrained("bert-base-uncased")
unknown = sum(tokenizer(r["question"], r["context"])["input_ids"].count(tokenizer.unk_token_id) for r in data["train"])
print(json.dumps({"splits": {k: len(v) for k, v in data.items()}, "columns": data["train"].column_names,
                  "right": right, "wrong": wrong, "unknown": unknown}))
"""


def test_squad_standin_loads_by_name_offline_with_its_metric(tmp_path):
    """`load_dataset("squad")` and `load_metric("squad")` (what run_squad.py calls) find the
    sample offline; the metric gives 100 for the answers themselves and scores a padded answer
    as SQuAD's F1 does (the article 'the' is dropped: 'red ball box' against 'red ball')."""
    pytest.importorskip("transformers", reason="the SQuAD stand-in's check needs transformers")
    datasets = pytest.importorskip("datasets", reason="the SQuAD stand-in needs datasets (2.x)")
    if not hasattr(datasets, "load_metric"):
        pytest.skip("datasets 3 removed load_metric, which the BERT application imports: install datasets 2.x")
    hf = str(tmp_path / "hf")
    application_module("bert_vocabulary").write_hub_cache(hf)
    files = application_module("squad_sample").write_sample(hf, train=12, validation=5)
    assert json.load(open(files["validation"]))["version"] == "1.1"
    env = {**os.environ, "HF_HOME": hf, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK_SQUAD_CACHE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["splits"] == {"train": 12, "validation": 5}
    assert out["columns"] == ["id", "title", "context", "question", "answers"]
    assert out["right"] == {"exact_match": 100.0, "f1": 100.0}
    assert out["wrong"]["exact_match"] == 0.0 and 0.0 < out["wrong"]["f1"] < 100.0
    assert out["unknown"] == 0


@pytest.mark.slow
@needs_application
def test_bert_application_cpu_ipu_match(tmp_path):
    """The application's own test, as written: the IPU's losses (two pipeline stages, gradient
    accumulation 10, AdamW) equal the CPU's within its atol=1e-6 for 10 steps, with the
    examples_utils stand-in (no residual-add pattern built) and the tokenizer's small vocabulary.
    Both parametrisations: embedding serialisation 1 without recomputation, and serialisation 5
    (the serialised MLM decoder matmul) with recomputation checkpoints."""
    pytest.importorskip("transformers", reason="the BERT application needs transformers")
    pytest.importorskip("tfrecord", reason="the BERT application needs tfrecord")
    app, env = application_copy(tmp_path)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "poptorch_lite.pytest_plugin", "-p", "no:cacheprovider",
                           "tests/cpu_ipu_test.py::test_ipu_cpu_match", "-q"],
                          cwd=app, env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout


PRETRAINING = ["run_pretraining.py", "--config", "unit_test", "--dataset", "generated", "--dataloader-workers", "1",
               "--lr-schedule", "constant"]


@pytest.mark.slow
@needs_application
def test_bert_application_pretraining_compiles_only_and_writes_the_memory_report(tmp_path):
    """run_pretraining.py --compile-only (an offline IPU target: compile(), no call) with
    --profile-dir: the profile holds the memory of the 4 IPUs and no calls; the report reads it
    and advises on the split of the encoder layers (--layers-per-ipu)."""
    pytest.importorskip("transformers", reason="the BERT application needs transformers")
    pytest.importorskip("tfrecord", reason="the BERT application needs tfrecord")
    app, env = application_copy(tmp_path)
    out = run_script(app, env, *PRETRAINING, "--compile-only", "--profile-dir", str(tmp_path / "profile"))
    assert "Model successfully compiled" in out and "Training Started" not in out
    assert sorted(os.listdir(tmp_path / "profile" / "training")) == ["profile.json"]
    doc = json.load(open(tmp_path / "profile" / "training" / "profile.json"))
    assert doc["execution"]["calls"] == 0 and doc["num_ipus"] == 4
    assert all(m["fits"] and m["total_bytes"] > 0 for m in doc["memory"]["ipus"])
    report = subprocess.run([sys.executable, "-m", "ipusim.report", str(tmp_path / "profile")], env=env,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert "compiled, not run" in report.stdout and report.stdout.count("busiest tile") == 4
    # the heads (tied to the embedding) stay on IPU 0; the advisor weighs the split of the rest
    assert "current  IPU0: Embedding, Pooler, Classifier | IPU1: Encoder0 | IPU2: Encoder1 | IPU3: Encoder2" in \
        report.stdout
    two = subprocess.run([sys.executable, "-m", "ipusim.report", str(tmp_path / "profile"), "--ipus", "2"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert re.search(r"proposed IPU0: Embedding, (Encoder\d, )*Pooler, Classifier \| IPU1: Encoder", two.stdout), \
        two.stdout + two.stderr


@pytest.mark.slow
@needs_application
def test_bert_application_pretraining_runs_to_its_throughput_line(tmp_path):
    """run_pretraining.py --config unit_test --dataset generated (4 IPUs, gradient accumulation
    16, 10 device iterations), reduced to 2 of its 10 steps: it trains, reports a throughput and
    its training metrics and writes its checkpoints."""
    pytest.importorskip("transformers", reason="the BERT application needs transformers")
    pytest.importorskip("tfrecord", reason="the BERT application needs tfrecord")
    app, env = application_copy(tmp_path)
    out = run_script(app, env, *PRETRAINING, "--training-steps", "2", "--disable-progress-bar", "True")
    throughputs = [float(x) for x in re.findall(r"throughput: ([\d.]+) samples/sec", out)]
    losses = [float(x) for x in re.findall(r"total loss: ([\d.]+)", out)]
    assert len(throughputs) == 2 and all(t > 0 for t in throughputs)
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert "training_steps: 2" in out and re.search(r"Training time: [\d.]+ secs", out)


@pytest.mark.slow
@needs_application
def test_bert_application_squad_trains_and_validates_on_the_sample(tmp_path):
    """run_squad.py --config demo_tiny_128 --sequence-length 384 (squad_data.py tokenizes to 384)
    on the generated SQuAD sample, reduced to 16 training questions and 1 epoch: one training step
    of 16 micro-batches on 4 IPUs, then the model re-pipelined over 2 IPUs with 2 replicas for
    inference on 4 validation questions (one call, padded to its 160 samples), their answers
    scored by the metric stand-in."""
    pytest.importorskip("transformers", reason="the BERT application needs transformers")
    datasets = pytest.importorskip("datasets", reason="run_squad.py needs datasets (2.x)")
    if not hasattr(datasets, "load_metric"):
        pytest.skip("datasets 3 removed load_metric, which run_squad.py imports: install datasets 2.x")
    app, env = application_copy(tmp_path)
    application_module("squad_sample").write_sample(env["HF_HOME"], train=16, validation=4)
    out = run_script(app, env, "run_squad.py", "--config", "demo_tiny_128", "--sequence-length", "384",
                     "--num-epochs", "1")
    training = re.findall(r"Epoch: 0, Step:(\d+), LR=\S+, loss: ([\d.]+), throughput: ([\d.]+) samples/sec", out)
    assert [int(s) for s, _, _ in training] == [0] and all(float(t) > 0 for _, _, t in training)
    validation = re.findall(r"Step:(\d+), throughput: ([\d.e+-]+) samples/sec", out)
    assert [int(s) for s, _ in validation] == [0] and float(validation[0][1]) > 0
    scores = re.search(r"\{'exact_match': ([\d.]+), 'f1': ([\d.]+)\}", out)
    assert scores and 0 <= float(scores.group(1)) <= float(scores.group(2)) <= 100


@pytest.mark.slow
@needs_application
def test_bert_application_tiny_demo_with_replicas_serialised_embeddings_and_loss_scaling(tmp_path):
    """bert_tiny_test.py's heaviest configuration (test_compile_and_train_with_als[3]:
    demo_tiny_128 on the sample data in data/, 2 replicas of 4 IPUs, embedding serialisation 3,
    automatic loss scaling from a scale of 1), reduced from 360 steps to 3: it compiles for 8 IPUs,
    trains and prints the loss and MLM accuracy lines the application's test parses."""
    pytest.importorskip("transformers", reason="the BERT application needs transformers")
    pytest.importorskip("tfrecord", reason="the BERT application needs tfrecord")
    app, env = application_copy(tmp_path)
    out = run_script(app, env, "run_pretraining.py", "--config", "demo_tiny_128", "--training-steps", "3",
                     "--replication-factor", "2", "--embedding-serialization-factor", "3", "--loss-scaling", "1",
                     "--auto-loss-scaling", "True", "--disable-progress-bar", "True", "--wandb", "false")
    losses = [float(x) for x in re.findall(r"total loss: ([\d.]+)", out)]
    accuracies = [float(x) for x in re.findall(r"mlm_acc: ([\d.]+)", out)]
    assert len(losses) == len(accuracies) == 3
    assert all(0 < x < 20 for x in losses) and all(0 <= a <= 1 for a in accuracies)
    assert "automaticLossScalingSettings" not in out     # modelled, not listed as without effect
