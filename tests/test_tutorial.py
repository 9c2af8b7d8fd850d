"""The MNIST pipelining tutorial: its accuracy() helper, dataset selection (IDX files, the
offline fallbacks and the banner that says which data is used), procedural digits, and the
script end to end on a tiny procedural dataset (pipelined, and sharded with the optimiser state
offloaded)."""
import gzip
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIAL = os.path.join(REPO, "tutorials", "pytorch", "pipelining")
sys.path.insert(0, TUTORIAL)
import mnist_data  # noqa: E402
from mnist_pipeline import accuracy, inference_options, parse_args, training_options  # noqa: E402


def test_accuracy_of_graphcores_example():
    pred = torch.tensor([[0.9, 0.05, 0.05], [0.1, 0.5, 0.4], [0.6, 0.01, 0.49], [0.09, 0.11, 0.8]])
    label = torch.tensor([0, 1, 2, 2])
    assert accuracy(pred, label) == 75


def test_accuracy_compares_the_last_labels_with_fewer_predictions():
    """A training call returns only its last micro-batch's predictions (OutputMode.Final)."""
    labels = torch.tensor([3, 3, 3, 3, 1, 2])
    pred = torch.nn.functional.one_hot(torch.tensor([1, 0]), 4).float()
    assert accuracy(pred, labels) == 50


def test_command_line_defaults_are_the_tutorials():
    opts = parse_args([])
    assert (opts.batch_size, opts.device_iterations, opts.gradient_accumulation, opts.test_batch_size,
            opts.epochs, opts.learning_rate, opts.strategy, opts.profile_dir) == \
        (40, 10, 10, 8, 3, 0.001, "pipelined", "./profile")
    assert not (opts.profile or opts.offload_optimiser or opts.debug)
    assert opts.dataset == "auto"
    with pytest.raises(SystemExit):
        parse_args(["--strategy", "phased"])
    with pytest.raises(SystemExit):
        parse_args(["--batch-size", "0"])


def test_model_options_follow_the_tutorial():
    pipelined = training_options(parse_args([]))
    assert (pipelined.gradient_accumulation, pipelined.device_iterations) == (10, 10)
    assert repr(pipelined.execution_strategy) == ('PipelinedExecution(Stage("B1").ipu(0), Stage("B2").ipu(1), '
                                                  'Stage("B3").ipu(2), Stage("B4").ipu(3))')
    assert pipelined.tensor_locations["optimizer"] is None and pipelined.profile_dir is None
    sharded = training_options(parse_args(["--strategy", "sharded"]))
    assert sharded.gradient_accumulation == 1 and type(sharded.execution_strategy).__name__ == "ShardedExecution"
    inference = inference_options(pipelined, parse_args([]))
    assert (inference.gradient_accumulation, inference.device_iterations) == (1, 100)
    assert type(inference.execution_strategy).__name__ == "PipelinedExecution"


def test_offload_keeps_only_the_optimiser_state_off_chip(tmp_path):
    opts = training_options(parse_args(["--offload-optimiser", "--profile", "--profile-dir", str(tmp_path)]))
    assert {k: v.on_chip for k, v in opts.tensor_locations.items()} == \
        {"activation": True, "weight": True, "accumulator": True, "optimizer": False}
    assert opts.profile_dir == str(tmp_path)


def write_idx(path, array: np.ndarray) -> None:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def write_idx_set(directory, n_train=20, n_test=10, gz=True) -> None:
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("test", n_test)):
        images, labels = mnist_data.IDX_FILES[split]
        write_idx(os.path.join(directory, images + (".gz" if gz else "")),
                  rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(os.path.join(directory, labels + (".gz" if gz else "")),
                  rng.integers(0, 10, n, dtype=np.uint8))


@pytest.mark.parametrize("gz", [True, False])
def test_idx_files_load_normalised(tmp_path, gz):
    write_idx_set(tmp_path, gz=gz)
    train, test = mnist_data.load_idx_set(str(tmp_path))
    assert (len(train), len(test)) == (20, 10)
    x, y = train[3]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and isinstance(y, int)
    stacked = torch.stack([train[i][0] for i in range(len(train))])
    assert abs(stacked.mean().item()) < 1e-5 and abs(stacked.std(unbiased=False).item() - 1) < 1e-4
    raw = mnist_data.read_idx(str(tmp_path / ("train-images-idx3-ubyte" + (".gz" if gz else ""))))
    assert torch.allclose(x[0], (torch.from_numpy(raw[3]).float() / 255 - train.mean) / train.std)


def test_batched_fetch_gives_the_samples_one_by_one_fetch_gives(tmp_path):
    write_idx_set(tmp_path, gz=False)
    train, _ = mnist_data.load_idx_set(str(tmp_path))
    indices = [7, 0, 19, 7, 3]
    batch = train.__getitems__(indices)
    assert len(batch) == len(indices)
    for i, (image, label) in zip(indices, batch):
        one_image, one_label = train[i]
        assert torch.equal(image, one_image) and label == one_label and isinstance(label, int)
    loader = torch.utils.data.DataLoader(train, batch_size=5, shuffle=False)
    images, labels = next(iter(loader))
    assert torch.equal(images, torch.stack([train[i][0] for i in range(5)]))
    assert labels.tolist() == [train[i][1] for i in range(5)]


def test_idx_errors_say_what_is_wrong(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x05abcde")
    with pytest.raises(ValueError, match="not an IDX file"):
        mnist_data.read_idx(str(tmp_path / "bad"))
    write_idx(tmp_path / "short", np.arange(4, dtype=np.uint8))
    data = (tmp_path / "short").read_bytes()
    (tmp_path / "short").write_bytes(data[:-1])
    with pytest.raises(ValueError, match=r"header says \(4,\)"):
        mnist_data.read_idx(str(tmp_path / "short"))


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No download mirror answers and Debian's Fashion-MNIST is not installed."""
    monkeypatch.setattr(mnist_data, "reachable_mirror", lambda mirrors, timeout=0: (None, "offline (test)"))
    monkeypatch.setattr(mnist_data, "DEBIAN_FASHION_MNIST", str(tmp_path / "no-debian-package"))
    return tmp_path


def test_auto_without_any_dataset_trains_on_procedural_digits_and_says_so(offline):
    chosen = mnist_data.load_datasets("auto", str(offline / "data"), synthetic_sizes=(50, 20))
    assert chosen.name == "procedural digits" and not chosen.is_mnist
    assert (len(chosen.train), len(chosen.test)) == (50, 20)
    banner = chosen.banner()
    assert "DATASET: procedural digits" in banner and "THIS IS NOT MNIST" in banner
    assert "MNIST is not in" in banner and "offline (test)" in banner
    assert "apt-get install dataset-fashion-mnist" in banner


def test_auto_prefers_installed_fashion_mnist_then_mnist(offline):
    write_idx_set(offline / "no-debian-package")
    chosen = mnist_data.load_datasets("auto", str(offline / "data"))
    assert chosen.name == "Fashion-MNIST" and "dataset-fashion-mnist" in chosen.source
    assert "THIS IS NOT MNIST" in chosen.banner()
    write_idx_set(offline / "data" / "MNIST" / "raw", n_train=30, gz=False)  # as torchvision extracts them
    chosen = mnist_data.load_datasets("auto", str(offline / "data"))
    assert chosen.is_mnist and len(chosen.train) == 30 and chosen.passed_over == []
    assert "NOT MNIST" not in chosen.banner()


def test_download_mirrors_are_torchvisions():
    import torchvision
    assert mnist_data.torchvision_mirrors("MNIST") == list(torchvision.datasets.MNIST.mirrors)
    assert mnist_data.torchvision_mirrors("FashionMNIST") == list(torchvision.datasets.FashionMNIST.mirrors)


def test_offline_fashion_mnist_does_not_import_torchvision(tmp_path):
    """Choosing local IDX files (after finding MNIST unreachable) never imports torchvision,
    which would cost about 160 MB of memory for the whole run."""
    write_idx_set(tmp_path / "debian")
    script = (f"import sys; sys.path.insert(0, {TUTORIAL!r}); import mnist_data\n"
              f"mnist_data.DEBIAN_FASHION_MNIST = {str(tmp_path / 'debian')!r}\n"
              "mnist_data.reachable_mirror = lambda mirrors, timeout=0: (None, 'offline')\n"
              f"chosen = mnist_data.load_datasets('auto', {str(tmp_path / 'data')!r})\n"
              "print(chosen.name, 'torchvision' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Fashion-MNIST", "False"]


def test_explicit_mnist_offline_is_a_clear_error(offline):
    with pytest.raises(mnist_data.DatasetUnavailable, match=r"MNIST is not in .*MNIST/raw and cannot be downloaded "
                                                            r"\(offline \(test\)\)\. Copy the four MNIST IDX files"):
        mnist_data.load_datasets("mnist", str(offline / "data"))
    with pytest.raises(ValueError, match="unknown dataset 'kmnist'"):
        mnist_data.load_datasets("kmnist", str(offline))


def test_unreachable_mirror_is_reported_quickly():
    mirror, why = mnist_data.reachable_mirror(["http://127.0.0.1:9/"], timeout=1.0)
    assert mirror is None and "127.0.0.1" in why


def test_procedural_digits_are_deterministic_balanced_and_distinct():
    x1, y1 = mnist_data.procedural_digits(200, seed=5)
    x2, y2 = mnist_data.procedural_digits(200, seed=5)
    x3, _ = mnist_data.procedural_digits(200, seed=6)
    assert x1.shape == (200, 28, 28) and x1.dtype == np.uint8
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2) and not np.array_equal(x1, x3)
    assert np.bincount(y1, minlength=10).tolist() == [20] * 10
    # Class means differ far more than the images of one class vary around theirs.
    means = np.stack([x1[y1 == d].mean(0) for d in range(10)]).reshape(10, -1)
    between = np.linalg.norm(means[:, None] - means[None], axis=-1)[np.triu_indices(10, 1)].min()
    assert between > 200


def test_procedural_digits_are_learnable():
    """A linear classifier separates the classes well: the data carries the digit."""
    x, y = mnist_data.procedural_digits(3000, seed=0)
    xt, yt = mnist_data.procedural_digits(500, seed=1)
    features = torch.from_numpy(x.reshape(len(x), -1)).float() / 255
    torch.manual_seed(0)
    model = torch.nn.Linear(784, 10)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(features), torch.from_numpy(y)).backward()
        opt.step()
    predicted = model(torch.from_numpy(xt.reshape(len(xt), -1)).float() / 255).argmax(1).numpy()
    assert (predicted == yt).mean() > 0.8


TINY = ["--dataset", "synthetic", "--train-samples", "64", "--test-samples", "64", "--batch-size", "2",
        "--device-iterations", "2", "--gradient-accumulation", "8", "--test-batch-size", "2", "--epochs", "2",
        "--num-workers", "0"]


def run_tutorial(tmp_path, *args):
    out = subprocess.run([sys.executable, os.path.join(TUTORIAL, "mnist_pipeline.py"), *TINY, *args],
                         cwd=tmp_path, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout + out.stderr


def check_tutorial_output(text: str) -> float:
    assert "DATASET: procedural digits (64 training / 64 test images)" in text
    assert "THIS IS NOT MNIST" in text
    assert "Graph compilation: 100%" in text
    assert "Epoch 1/2" in text and "Epoch 2/2" in text
    losses = [float(v) for v in re.findall(r"Loss:(\d+\.\d+) \| Accuracy:\d+\.\d+%", text)]
    assert losses and all(np.isfinite(losses))
    assert len(re.findall(r"Emulated IPU time \d+\.\d+ s for 64 images", text)) == 2
    (test_accuracy,) = re.findall(r"Accuracy on test set: (\d+\.\d+)%", text)
    return float(test_accuracy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, flags", [("pipelined", ()), ("sharded", ("--offload-optimiser",))],
                         ids=["pipelined", "sharded-optimiser-offloaded"])
def test_tutorial_end_to_end(tmp_path, strategy, flags):
    """Both strategies; the sharded run keeps its optimiser state off chip (Options.TensorLocations)."""
    accuracy_ = check_tutorial_output(run_tutorial(tmp_path, "--strategy", strategy, *flags))
    assert 0 <= accuracy_ <= 100
