"""Graphcore's BERT application (graphcore/examples, nlp/bert/pytorch), unmodified, on emulated IPUs,
and the stand-ins it runs with (applications/standins: horovod, examples_utils; the tokenizer's
vocabulary: applications/bert_vocabulary.py).

The application is not part of this repository: its test runs when GRAPHCORE_EXAMPLES names a
checkout of graphcore/examples."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDINS = os.path.join(ROOT, "applications", "standins")
EXAMPLES = os.environ.get("GRAPHCORE_EXAMPLES")
BERT = os.path.join(EXAMPLES or "GRAPHCORE_EXAMPLES", "nlp", "bert", "pytorch")


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
    sys.path.insert(0, os.path.join(ROOT, "applications"))
    try:
        bert_vocabulary = importlib.import_module("bert_vocabulary")
    finally:
        sys.path.remove(os.path.join(ROOT, "applications"))
    bert_vocabulary.write_hub_cache(str(tmp_path))
    tokenizer = transformers.BertTokenizer.from_pretrained("bert-base-uncased", cache_dir=str(tmp_path / "hub"),
                                                           local_files_only=True)
    sentence = ("Hello, my dog is cute " * 4 + "Hello, my dog is cute yo") * 3 + \
        "Hello, my dog is cute " * 4 + "Hello, my dog is cute"
    ids = tokenizer(sentence, return_tensors="pt")["input_ids"]
    assert ids.shape == (1, 128)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.convert_ids_to_tokens(ids[0, :8].tolist()) == ["[CLS]", "hello", ",", "my", "dog", "is", "cute",
                                                                     "hello"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(os.path.join(BERT, "tests", "cpu_ipu_test.py")),
                    reason=f"Graphcore's BERT application is not at {BERT}: set GRAPHCORE_EXAMPLES to a checkout "
                           f"of graphcore/examples")
def test_bert_application_cpu_ipu_match(tmp_path):
    """The application's own test, as written: the IPU's losses (two pipeline stages, gradient
    accumulation 10, AdamW) equal the CPU's within its atol=1e-6 for 10 steps, with the
    examples_utils stand-in (no residual-add pattern built) and the tokenizer's small vocabulary.
    Both parametrisations: embedding serialisation 1 without recomputation, and serialisation 5
    (the serialised MLM decoder matmul) with recomputation checkpoints."""
    pytest.importorskip("transformers", reason="the BERT application needs transformers")
    pytest.importorskip("tfrecord", reason="the BERT application needs tfrecord")
    app = tmp_path / "bert"
    shutil.copytree(BERT, app, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    sys.path.insert(0, os.path.join(ROOT, "applications"))
    try:
        importlib.import_module("bert_vocabulary").write_hub_cache(str(tmp_path / "hf"))
    finally:
        sys.path.remove(os.path.join(ROOT, "applications"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "POPTORCH_LITE_IPU_HARDWARE": "ipu2",
           "PYTHONPATH": os.pathsep.join([ROOT, STANDINS, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "poptorch_lite.pytest_plugin", "-p", "no:cacheprovider",
                           "tests/cpu_ipu_test.py::test_ipu_cpu_match", "-q"],
                          cwd=app, env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
