"""Scripts shaped like Graphcore's PopTorch tutorials `basics`, `mixed_precision` and
`efficient_data_loading` (their model with GroupNorm, LogSoftmax and NLLLoss; torchvision's
FashionMNIST read from disk; PopTorch's DataLoader, optimisers and options as those scripts use
them) run unmodified through `poptorch-lite run`, on a small Fashion-MNIST-format dataset the test
writes: the image of class c has a bright band at row 2c, so a few epochs learn it.
docs/graphcore-tutorials.md gives the full-size runs of Graphcore's own scripts."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from test_tutorial import write_idx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def write_banded_fashion_mnist(root, n_train=128, n_test=64, folder="FashionMNIST") -> None:
    """root/<folder>/raw/ as torchvision looks for it (so nothing is downloaded); MNIST reads
    the same files from root/MNIST/raw/."""
    raw = os.path.join(root, folder, "raw")
    os.makedirs(raw)
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 64, (n, 28, 28)).astype(np.uint8)
        images[np.arange(n), 2 * labels + 4] = 255
        write_idx(os.path.join(raw, FILES[split][0]), images)
        write_idx(os.path.join(raw, FILES[split][1]), labels)


MODEL = """
    import torch
    import torch.nn as nn
    import torchvision
    import poptorch


    class ClassificationModel(nn.Module):
        def __init__(self, log_softmax_dim):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 5, 3)
            self.pool = nn.MaxPool2d(2, 2)
            self.conv2 = nn.Conv2d(5, 12, 5)
            self.norm = nn.GroupNorm(3, 12)
            self.fc1 = nn.Linear(972, 100)
            self.relu = nn.ReLU()
            self.fc2 = nn.Linear(100, 10)
            self.log_softmax = nn.LogSoftmax(dim=log_softmax_dim)
            self.loss = nn.NLLLoss()

        def forward(self, x, labels=None):
            x = self.pool(self.relu(self.conv1(x)))
            x = self.norm(self.relu(self.conv2(x)))
            x = torch.flatten(x, start_dim=1)
            x = self.relu(self.fc1(x))
            x = self.log_softmax(self.fc2(x))
            if self.training:
                return x, self.loss(x, labels)
            return x


    def accuracy(model, dataset, opts, half=False):
        inference = poptorch.inferenceModel(model.eval(), options=opts)
        loader = poptorch.DataLoader(opts, dataset, batch_size=32, num_workers=2)
        predictions, labels = [], []
        for data, label in loader:
            predictions += inference(data).data.float().max(dim=1).indices
            labels += label
        inference.detachFromDevice()
        return (torch.tensor(predictions) == torch.tensor(labels)).float().mean().item()
"""

BASICS = MODEL + """
    torch.manual_seed(42)
    transform = torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                                torchvision.transforms.Normalize((0.5,), (0.5,))])
    train = torchvision.datasets.FashionMNIST("data", transform=transform, download=True, train=True)
    test = torchvision.datasets.FashionMNIST("data", transform=transform, download=True, train=False)
    model = ClassificationModel(log_softmax_dim=1)
    opts = poptorch.Options()
    loader = poptorch.DataLoader(opts, train, batch_size=16, shuffle=True, num_workers=4)
    training = poptorch.trainingModel(model, options=opts,
                                      optimizer=poptorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    for epoch in range(3):
        for data, labels in loader:
            output, loss = training(data, labels)
    training.detachFromDevice()
    torch.save(model.state_dict(), "classifier.pth")
    print("accuracy", accuracy(model, test, opts))
    reloaded = ClassificationModel(log_softmax_dim=1)
    reloaded.load_state_dict(torch.load("classifier.pth"))
    image, label = test[0]
    one = poptorch.inferenceModel(reloaded.eval(), options=poptorch.Options())(image.unsqueeze(0))
    print("reloaded", int(one.argmax()) == int(reloaded(image.unsqueeze(0)).argmax()))
"""

MIXED_PRECISION = MODEL + """
    torch.manual_seed(42)
    model = ClassificationModel(log_softmax_dim=0).half()
    transform = torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                                torchvision.transforms.Normalize((0.5,), (0.5,)),
                                                torchvision.transforms.ConvertImageDtype(torch.half)])
    train = torchvision.datasets.FashionMNIST("data", transform=transform, download=True, train=True)
    test = torchvision.datasets.FashionMNIST("data", transform=transform, download=True, train=False)
    optimizer = poptorch.optim.AdamW(params=model.parameters(), lr=0.002, accum_type=torch.float16,
                                     loss_scaling=1024)
    opts = poptorch.Options()
    opts.Precision.enableStochasticRounding(True)
    opts.Precision.setPartialsType(torch.half)
    loader = poptorch.DataLoader(opts, train, batch_size=12, shuffle=True, num_workers=4)
    training = poptorch.trainingModel(model.train(), options=opts, optimizer=optimizer)
    for epoch in range(3):
        for data, labels in loader:
            output, loss = training(data, labels)
    training.detachFromDevice()
    print("dtype", next(model.parameters()).dtype)
    print("accuracy", accuracy(model, test, opts))
"""

DATA_LOADING = MODEL + """
    if __name__ == "__main__":  # the asynchronous loader's spawned process imports this script again
        opts = poptorch.Options()
        opts.deviceIterations(4)
        opts.replicationFactor(2)
        model = ClassificationModel(log_softmax_dim=0).train()
        training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9))
        features = torch.randn([128, 1, 28, 28])
        labels = torch.empty([128], dtype=torch.long).random_(10)
        dataset = torch.utils.data.TensorDataset(features, labels)
        loader = poptorch.DataLoader(opts, dataset=dataset, batch_size=8, shuffle=True, drop_last=True, num_workers=4,
                                     mode=poptorch.DataLoaderMode.Async, async_options={"early_preload": True})
        steps = len(loader)
        for data, labels in loader:
            pass
        training.compile(data, labels)
        calls = 0
        for data, labels in loader:
            _, loss = training(data, labels)
            calls += 1
        print("steps", steps, "calls", calls, "items per call", data.shape[0])
"""


OBSERVING_TENSORS = """
    import torch
    import torchvision
    import torch.nn as nn
    import poptorch
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    class BasicLinearModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(784, 320)
            self.fc2 = nn.Linear(320, 100)
            self.fc3 = nn.Linear(100, 10)
            self.log_softmax = nn.LogSoftmax(dim=0)
            self.loss = nn.NLLLoss()
            self.relu = nn.ReLU()

        def forward(self, x, labels=None):
            x = torch.flatten(x, start_dim=1)
            x = self.relu(self.fc1(x))
            x = self.relu(self.fc2(x))
            x = self.log_softmax(self.fc3(x))
            if self.training:
                return x, self.loss(x, labels)
            return x


    batch_size_train = 32
    tensors = ["Gradient___fc1.weight", "Gradient___fc3.weight", "Gradient___fc2.bias", "Gradient___fc1.bias",
               "Gradient___fc3.bias", "Gradient___fc2.weight"]
    opts = poptorch.Options()
    for t in tensors:
        opts.anchorTensor(t, t)
    transform = torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                                torchvision.transforms.Normalize((0.5,), (0.5,))])
    train_data = torchvision.datasets.MNIST("data", transform=transform, download=True, train=True)
    train_loader = poptorch.DataLoader(opts, train_data, batch_size=batch_size_train, shuffle=True)
    model = BasicLinearModel()
    model.train()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.01)
    poptorch_model = poptorch.trainingModel(model, options=opts, optimizer=optimizer)
    poptorch_model.compile(torch.zeros(batch_size_train, 1, 28, 28), torch.zeros(batch_size_train).long())
    print("tensor names:", sorted(poptorch_model.getTensorNames()))
    total_loss = 0.0
    predictions = []
    for data, labels in train_loader:
        output, loss = poptorch_model(data, labels)
        total_loss += loss
        predictions += output
    print(f"Loss: {total_loss.item():.4f}")
    gradient = []
    for t in tensors:
        gradient += poptorch_model.getAnchoredTensor(t).flatten()
    gradient = torch.stack(gradient).abs()
    print("gradients", gradient.numel(), "nonzero", int((gradient != 0).sum()))
    idx = gradient != 0
    gradient[idx] = torch.log2(gradient[idx])
    gradient[~idx] = torch.min(gradient) - 2
    fig, axs = plt.subplots(tight_layout=True)
    axs.hist(gradient.numpy(), bins=50)
    plt.savefig("GradientHistogram.png")
    # the last update's fc3.bias gradient, against plain PyTorch from the weights before it
    print("anchored", poptorch_model.getAnchoredTensor("Gradient___fc3.bias").shape)
"""


def run_tutorial(tmp_path, source: str) -> subprocess.CompletedProcess:
    write_banded_fashion_mnist(tmp_path / "data")
    write_banded_fashion_mnist(tmp_path / "data", folder="MNIST")
    (tmp_path / "tutorial.py").write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", "poptorch_lite", "run", "tutorial.py"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def printed(done, key: str) -> str:
    return next(line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith(key + " "))


def test_basics_trains_saves_and_reloads(tmp_path):
    done = run_tutorial(tmp_path, BASICS)
    assert float(printed(done, "accuracy")) >= 0.9
    assert printed(done, "reloaded") == "True"


def test_mixed_precision_trains_in_half_with_loss_scaling_and_stochastic_rounding(tmp_path):
    done = run_tutorial(tmp_path, MIXED_PRECISION)
    assert printed(done, "dtype") == "torch.float16"
    assert float(printed(done, "accuracy")) >= 0.9


def test_data_loading_with_replicas_and_early_preload(tmp_path):
    done = run_tutorial(tmp_path, DATA_LOADING)
    # 128 samples, 8 per micro-batch, 4 device iterations, 2 replicas: 2 calls of 64 items
    assert printed(done, "steps") == "2 calls 2 items per call 64"


def test_observing_tensors_anchors_gradients_and_draws_their_histogram(tmp_path):
    done = run_tutorial(tmp_path, OBSERVING_TENSORS)
    names = printed(done, "tensor").split(":", 1)[1].strip()
    assert names == str(sorted(f"{k}{layer}.{p}" for k in ("Gradient___", "UpdatedVar___")
                               for layer in ("fc1", "fc2", "fc3") for p in ("weight", "bias")))
    count, _, nonzero = printed(done, "gradients").split()
    assert int(count) == 784 * 320 + 320 + 320 * 100 + 100 + 100 * 10 + 10 and int(nonzero) > 0
    assert printed(done, "anchored") == "torch.Size([10])"
    assert (tmp_path / "GradientHistogram.png").stat().st_size > 0
    assert float(printed(done, "Loss:")) > 0
