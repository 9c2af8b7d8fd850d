"""Which 28x28 ten-class dataset the tutorial trains on, and how it is loaded.

- ``mnist``: torchvision's MNIST under ``DATA_DIR/MNIST/raw`` (downloaded when a mirror answers).
- ``fashion-mnist``: Fashion-MNIST from ``DATA_DIR/FashionMNIST/raw``, else from Debian's
  ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``), else downloaded by
  torchvision when a mirror answers.
- ``synthetic``: procedural digits drawn from a 5x7 font with random affine distortions, strokes
  and noise; needs nothing but torch.
- ``auto``: the first of these three that can be had, saying why the others could not.

The choice is always printed in a banner: a run on Fashion-MNIST or on procedural digits must
never pass for an MNIST result.
"""
from __future__ import annotations

import ast
import gzip
import importlib.util
import math
import os
import socket
import struct
import sys
import urllib.parse
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

CHOICES = ("auto", "mnist", "fashion-mnist", "synthetic")
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
MNIST_STATISTICS = (0.1307, 0.3081)  # mean and std of MNIST's training images (the tutorial's Normalize)
MIRROR_TIMEOUT_S = 3.0


class DatasetUnavailable(RuntimeError):
    """The requested dataset is neither on this machine nor downloadable."""


@dataclass
class Datasets:
    """The chosen data: training and test sets, a display name and where they came from."""
    name: str            # "MNIST", "Fashion-MNIST" or "procedural digits"
    source: str          # directory, package or generator the data came from
    train: torch.utils.data.Dataset
    test: torch.utils.data.Dataset
    passed_over: list[str] = field(default_factory=list)  # why earlier choices of "auto" were not used

    @property
    def is_mnist(self) -> bool:
        return self.name == "MNIST"

    def banner(self) -> str:
        """The loud statement of which data this run trains on."""
        rule = "=" * 78
        lines = [rule, f"DATASET: {self.name} ({len(self.train)} training / {len(self.test)} test images)",
                 f"  from {self.source}"]
        lines += [f"  not used: {reason}" for reason in self.passed_over]
        if not self.is_mnist:
            lines.append(f"  THIS IS NOT MNIST: the tutorial's MNIST accuracy (97.5-99.9%) does not apply to "
                         f"{self.name}.")
        return "\n".join(lines + [rule])


class ImageDataset(torch.utils.data.Dataset):
    """28x28 uint8 images with integer labels, served as normalised float tensors [1, 28, 28]
    (what ToTensor + Normalize give for MNIST). Plain arrays: it pickles to a loader process."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, mean: float, std: float):
        if images.ndim != 3 or images.dtype != np.uint8:
            raise ValueError(f"images must be a uint8 array [N, H, W], got {images.dtype} {images.shape}")
        if len(labels) != len(images):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels.astype(np.int64)
        self.mean = float(mean)
        self.std = float(std)

    def __len__(self) -> int:
        return len(self.images)

    def _normalised(self, images: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(images).to(torch.float32).div_(255.0).sub_(self.mean).div_(self.std)

    def __getitem__(self, index: int):
        return self._normalised(self.images[index]).unsqueeze_(0), int(self.labels[index])

    def __getitems__(self, indices: list[int]) -> list:
        """The samples at `indices`, normalised in one pass (torch's DataLoader fetches a whole
        batch through this when a dataset has it): the same values as __getitem__'s."""
        images = self._normalised(self.images[indices]).unsqueeze_(1)
        return list(zip(images.unbind(0), self.labels[indices].tolist()))

    def subset(self, size: int | None) -> "ImageDataset":
        """The first `size` samples (all of them when size is None)."""
        if size is None:
            return self
        return ImageDataset(self.images[:size], self.labels[:size], self.mean, self.std)


# ---- IDX files ------------------------------------------------------------------------------

def read_idx(path: str) -> np.ndarray:
    """An IDX file (the MNIST format), plain or gzip-compressed, as a NumPy array."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (its magic number is not 0x0000TTNN)")
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if data[2] not in dtypes:
        raise ValueError(f"{path}: unknown IDX element type 0x{data[2]:02x}")
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    dtype = np.dtype(dtypes[data[2]])
    body = np.frombuffer(data, dtype=dtype, offset=4 + 4 * ndim)
    if body.size != math.prod(shape):
        raise ValueError(f"{path}: header says {shape} ({math.prod(shape)} elements), the file holds {body.size}")
    return body.reshape(shape).astype(dtype.newbyteorder("="))  # a writable copy in native byte order


def find_idx(directory: str, stem: str) -> str | None:
    """`directory/stem` or `directory/stem.gz`, whichever exists."""
    for name in (stem, stem + ".gz"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def has_idx_set(directory: str) -> bool:
    return all(find_idx(directory, stem) for pair in IDX_FILES.values() for stem in pair)


def load_idx_set(directory: str, statistics: tuple[float, float] | None = None) -> tuple[ImageDataset, ImageDataset]:
    """Training and test sets from the four IDX files in `directory`, normalised with
    `statistics` (mean, std), by default those of the training images."""
    arrays = {}
    for split, (images, labels) in IDX_FILES.items():
        x, y = read_idx(find_idx(directory, images)), read_idx(find_idx(directory, labels))
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{directory}: {split} images {x.shape} and labels {y.shape} do not match")
        arrays[split] = (x.astype(np.uint8, copy=False), y)
    mean, std = statistics or image_statistics(arrays["train"][0])
    return tuple(ImageDataset(x, y, mean, std) for x, y in arrays.values())


def image_statistics(images: np.ndarray) -> tuple[float, float]:
    """Mean and standard deviation of uint8 images scaled to [0, 1], from the histogram of
    pixel values (no float copy of the images: 60,000 of them would take 376 MB)."""
    counts = sum(np.bincount(chunk.ravel(), minlength=256) for chunk in np.array_split(images, 64)).astype(np.float64)
    values = np.arange(256) / 255.0
    mean = float(counts @ values / counts.sum())
    return mean, float(np.sqrt(counts @ (values - mean) ** 2 / counts.sum()))


# ---- downloads ------------------------------------------------------------------------------

def reachable_mirror(mirrors, timeout: float = MIRROR_TIMEOUT_S) -> tuple[str | None, str]:
    """The first mirror that accepts a TCP connection within `timeout` seconds, and otherwise
    why none did (so an offline machine learns it in seconds, not after a long download hang)."""
    errors = []
    for mirror in mirrors:
        url = urllib.parse.urlsplit(mirror)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname, port), timeout=timeout).close()
            return mirror, ""
        except OSError as error:
            errors.append(f"{url.hostname}: {error.strerror or error}")
    return None, "; ".join(errors)


def torchvision_mirrors(dataset: str) -> list[str]:
    """Where torchvision downloads `dataset` ("MNIST", "FashionMNIST") from: the class's
    `mirrors`, read from torchvision's source, since importing torchvision to learn them costs
    about 160 MB of memory, which an offline run that never downloads would keep for nothing."""
    try:
        spec = importlib.util.find_spec("torchvision")
        path = os.path.join(os.path.dirname(spec.origin), "datasets", "mnist.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == dataset:
                for item in node.body:
                    if (isinstance(item, ast.Assign) and len(item.targets) == 1
                            and getattr(item.targets[0], "id", None) == "mirrors"):
                        return list(ast.literal_eval(item.value))
    except (OSError, SyntaxError, ValueError, AttributeError, TypeError):
        pass
    import torchvision  # the source moved or changed shape: ask the class itself
    return list(getattr(torchvision.datasets, dataset).mirrors)


def torchvision_transform(statistics: tuple[float, float]):
    import torchvision
    mean, std = statistics
    return torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                           torchvision.transforms.Normalize((mean,), (std,))])


def load_mnist(data_dir: str) -> Datasets:
    """torchvision's MNIST from `data_dir`, downloading it when absent and a mirror answers."""
    raw = os.path.join(data_dir, "MNIST", "raw")
    present = has_idx_set(raw)
    if not present:
        mirror, why = reachable_mirror(torchvision_mirrors("MNIST"))
        if mirror is None:
            raise DatasetUnavailable(
                f"MNIST is not in {raw} and cannot be downloaded ({why}). Copy the four MNIST IDX files "
                f"(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
                f"t10k-labels-idx1-ubyte, gzipped or not) there, or choose --dataset fashion-mnist or synthetic.")
        print(f"Downloading MNIST to {raw} ...", flush=True)
    import torchvision
    transform = torchvision_transform(MNIST_STATISTICS)
    try:
        train = torchvision.datasets.MNIST(data_dir, train=True, download=True, transform=transform)
        test = torchvision.datasets.MNIST(data_dir, train=False, download=True, transform=transform)
    except RuntimeError as error:
        raise DatasetUnavailable(f"MNIST could not be loaded from {raw}: {error}") from error
    return Datasets("MNIST", f"{raw} (torchvision{', downloaded' if not present else ''})", train, test)


def load_fashion_mnist(data_dir: str) -> Datasets:
    """Fashion-MNIST: torchvision's folder in `data_dir`, else Debian's package, else a download."""
    raw = os.path.join(data_dir, "FashionMNIST", "raw")
    for directory, label in ((raw, raw), (DEBIAN_FASHION_MNIST, f"{DEBIAN_FASHION_MNIST} (Debian package "
                                                                  f"dataset-fashion-mnist)")):
        if has_idx_set(directory):
            train, test = load_idx_set(directory)
            return Datasets("Fashion-MNIST", label, train, test)
    mirror, why = reachable_mirror(torchvision_mirrors("FashionMNIST"))
    if mirror is None:
        raise DatasetUnavailable(
            f"Fashion-MNIST is neither in {raw} nor in {DEBIAN_FASHION_MNIST} and cannot be downloaded ({why}). "
            f"On Debian or Ubuntu: apt-get install dataset-fashion-mnist")
    print(f"Downloading Fashion-MNIST to {raw} ...", flush=True)
    import torchvision
    torchvision.datasets.FashionMNIST(data_dir, train=True, download=True)
    torchvision.datasets.FashionMNIST(data_dir, train=False, download=True)
    train, test = load_idx_set(raw)
    return Datasets("Fashion-MNIST", f"{raw} (torchvision, downloaded)", train, test)


# ---- procedural digits ----------------------------------------------------------------------

# A 5x7 font of the digits 0-9, side by side ("#" = ink).
FONT = """
.###. ..#.. .###. ##### ...#. ##### ..##. ##### .###. .###.
#...# .##.. #...# ...#. ..##. #.... .#... ....# #...# #...#
#..## ..#.. ....# ..#.. .#.#. ####. #.... ...#. #...# #...#
#.#.# ..#.. ...#. ...#. #..#. ....# ####. ..#.. .###. .####
##..# ..#.. ..#.. ....# ##### ....# #...# .#... #...# ....#
#...# ..#.. .#... #...# ...#. #...# #...# .#... #...# ...#.
.###. .###. ##### .###. ...#. .###. .###. .#... .###. .##..
"""


def glyph_bitmaps() -> torch.Tensor:
    """The ten glyphs of FONT as a float tensor [10, 1, 7, 5] of 0s and 1s."""
    rows = [line.split() for line in FONT.strip().splitlines()]
    return torch.tensor([[[[1.0 if ch == "#" else 0.0 for ch in row[d]] for row in rows]] for d in range(10)])


def procedural_digits(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` 28x28 uint8 images of the digits 0-9 (balanced labels) with random rotation,
    scale, shear, translation, stroke width, blur and noise: deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % 10
    labels = labels[torch.randperm(count, generator=g)]
    glyphs = F.pad(glyph_bitmaps(), (2, 2, 1, 1))  # a margin so bilinear sampling fades to 0
    images = []
    for start in range(0, count, 4096):
        y = labels[start:start + 4096]
        n = len(y)
        u = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=g)  # noqa: E731
        angle, shear = u(-0.3, 0.3), u(-0.3, 0.3)
        sx, sy = u(1.15, 1.6), u(1.05, 1.35)  # >1 zooms out: the digit fills 60-90% of the image
        tx, ty = u(-0.15, 0.15), u(-0.12, 0.12)
        cos, sin = torch.cos(angle), torch.sin(angle)
        theta = torch.stack([torch.stack([sx * cos, sx * (shear * cos - sin), tx], 1),
                             torch.stack([sy * sin, sy * (shear * sin + cos), ty], 1)], 1)
        grid = F.affine_grid(theta, [n, 1, 28, 28], align_corners=False)
        x = F.grid_sample(glyphs[y], grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        bold = u(0, 1) < 0.5
        x[bold] = F.max_pool2d(x[bold], 3, stride=1, padding=1)  # thicker strokes for half of them
        x = F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)  # soft edges
        x = x * u(0.7, 1.0).view(n, 1, 1, 1) + 0.08 * torch.randn(x.shape, generator=g)
        images.append(x.clamp_(0, 1).mul_(255).round_().to(torch.uint8)[:, 0])
    return torch.cat(images).numpy(), labels.numpy()


def load_synthetic(train_size: int = 60000, test_size: int = 10000, seed: int = 0) -> Datasets:
    """Procedural digits, as many as MNIST has (training and test sets drawn with different seeds)."""
    train_x, train_y = procedural_digits(train_size, seed)
    test_x, test_y = procedural_digits(test_size, seed + 1)
    mean, std = image_statistics(train_x)
    return Datasets("procedural digits", f"generated in memory (seed {seed})",
                    ImageDataset(train_x, train_y, mean, std), ImageDataset(test_x, test_y, mean, std))


def load_datasets(kind: str = "auto", data_dir: str = "~/.torch/datasets", *,
                  synthetic_sizes=(60000, 10000)) -> Datasets:
    """The datasets of `kind` (one of CHOICES); `auto` takes MNIST, else Fashion-MNIST, else
    procedural digits, recording why it passed over each."""
    if kind not in CHOICES:
        raise ValueError(f"unknown dataset {kind!r}: choose one of {', '.join(CHOICES)}")
    data_dir = os.path.expanduser(data_dir)
    loaders = {"mnist": lambda: load_mnist(data_dir), "fashion-mnist": lambda: load_fashion_mnist(data_dir),
               "synthetic": lambda: load_synthetic(*synthetic_sizes)}
    if kind != "auto":
        return loaders[kind]()
    passed_over = []
    for name in ("mnist", "fashion-mnist"):
        try:
            chosen = loaders[name]()
            chosen.passed_over = passed_over
            return chosen
        except DatasetUnavailable as error:
            passed_over.append(str(error))
    chosen = loaders["synthetic"]()
    chosen.passed_over = passed_over
    return chosen


def announce(datasets: Datasets, stream=None) -> None:
    print(datasets.banner(), file=stream or sys.stdout, flush=True)
