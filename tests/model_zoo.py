"""Models beyond the tutorial, pipelined over four IPUs with one BeginBlock per layer group, and
the measure of how well the emulator trains them: parameters after a few optimiser steps against
float64 training, beside PyTorch's own float32 training against the same float64 run.

Used by tests/test_models.py (the forwards, the encoder's training) and benchmarks/models_vs_float64.py
(every model, strategy and optimiser).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

import poptorch_lite as poptorch


class Classifier(nn.Module):
    """A network and its cross-entropy loss, called as PopTorch models are: (x) or (x, labels)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        out = self.net(x)
        if labels is None:
            return out
        return out, self.loss(out.reshape(-1, out.shape[-1]), labels.reshape(-1))


# ---- a BERT-style encoder ---------------------------------------------------------------------
class Attention(nn.Module):
    """Multi-head self-attention, through scaled_dot_product_attention or written out with an
    explicit softmax."""

    def __init__(self, hidden: int, heads: int, dropout: float, explicit: bool):
        super().__init__()
        self.heads, self.explicit, self.dropout = heads, explicit, dropout
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        if self.explicit:
            scores = q @ k.transpose(-1, -2) / math.sqrt(h // self.heads)
            context = F.dropout(torch.softmax(scores, dim=-1), p, self.training) @ v
        else:
            context = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return self.out(context.transpose(1, 2).reshape(b, s, h))


class EncoderLayer(nn.Module):
    """Post-LayerNorm BERT layer: attention, GELU feed-forward, dropout on both residual branches."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float, explicit: bool):
        super().__init__()
        self.attention = Attention(hidden, heads, dropout, explicit)
        self.norm1 = nn.LayerNorm(hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
        self.norm2 = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = self.norm1(x + self.drop(self.attention(x)))
        return self.norm2(x + self.drop(self.ffn(x)))


class BertStyle(nn.Module):
    """Token and position embeddings with LayerNorm and dropout, `layers` encoder layers (even ones
    through scaled_dot_product_attention, odd ones with an explicit softmax), a token classifier."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, ffn: int = 64, layers: int = 4,
                 seq: int = 8, classes: int = 5, dropout: float = 0.0):
        super().__init__()
        self.words = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads, ffn, dropout, explicit=i % 2 == 1)
                                    for i in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        x = self.drop(self.norm(self.words(ids) + self.positions(positions)))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# ---- the models and their layer groups (one block per group, one group per IPU) ------------------
@dataclass
class Zoo:
    """A model with its layer groups (the submodule paths starting each block) and its inputs."""
    model: nn.Module
    groups: list[str]
    inputs: "callable"          # (steps, micro_batches, micro_batch) -> (x, labels), shaped [steps, G, m, ...]
    sgd_lr: float = 1e-3        # learning rates at which float32 training stays close to float64
    adamw_lr: float = 1e-3


def resnet18(image: int = 64) -> Zoo:
    torch.manual_seed(0)
    model = Classifier(torchvision.models.resnet18(num_classes=10))
    return Zoo(model, ["net.conv1", "net.layer2", "net.layer3", "net.layer4"],
               lambda s, g, m: (torch.randn(s, g, m, 3, image, image), torch.randint(0, 10, (s, g, m))))


def mobilenet_v3_small(image: int = 32) -> Zoo:
    torch.manual_seed(0)
    model = Classifier(torchvision.models.mobilenet_v3_small(num_classes=10))
    return Zoo(model, ["net.features.0", "net.features.3", "net.features.7", "net.features.11"],
               lambda s, g, m: (torch.randn(s, g, m, 3, image, image), torch.randint(0, 10, (s, g, m))))


def bert_style(dropout: float = 0.0, seq: int = 8) -> Zoo:
    torch.manual_seed(0)
    model = Classifier(BertStyle(seq=seq, dropout=dropout))
    return Zoo(model, ["net.words", "net.layers.1", "net.layers.2", "net.layers.3"],
               lambda s, g, m: (torch.randint(0, 64, (s, g, m, seq)), torch.randint(0, 5, (s, g, m, seq))),
               sgd_lr=0.1)


MODELS = {"resnet18": resnet18, "mobilenet_v3_small": mobilenet_v3_small, "bert_style": bert_style}
MICRO_BATCH = {"resnet18": 4, "mobilenet_v3_small": 4, "bert_style": 2}


def with_blocks(zoo: Zoo) -> nn.Module:
    """A copy of the model with BeginBlock on the first module of every group, group i on IPU i."""
    model = copy.deepcopy(zoo.model)
    for i, path in enumerate(zoo.groups):
        poptorch.BeginBlock(model.get_submodule(path), f"group{i}", ipu_id=i)
    return model


def options(zoo: Zoo, strategy: str, gradient_accumulation: int) -> poptorch.Options:
    kind = {"pipelined": poptorch.PipelinedExecution, "sharded": poptorch.ShardedExecution}[strategy]
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(gradient_accumulation)
    opts.setExecutionStrategy(kind(*[poptorch.Stage(f"group{i}").ipu(i) for i in range(len(zoo.groups))]))
    return opts


OPTIMISERS = {"SGD": (torch.optim.SGD, poptorch.optim.SGD), "AdamW": (torch.optim.AdamW, poptorch.optim.AdamW)}


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


@dataclass
class Comparison:
    emulated: float      # |emulated - float64| / |float64| over all parameters
    float32: float       # |PyTorch float32 - float64| / |float64|
    moved: float         # |float64 after - before| / |before|: how far training went
    # the same for PyTorch float32 in channels_last memory format (its convolutions sum in
    # another order; None for models without 4-D inputs): how far float32 rounding alone moves
    # PyTorch's own training
    float32_channels_last: float | None = None

    @property
    def ratio(self) -> float:
        return self.emulated / self.float32

    @property
    def float32_spread(self) -> float:
        """The larger of PyTorch float32's distances to float64 (default and channels_last)."""
        return max(self.float32, self.float32_channels_last or 0.0)


def train_against_float64(name: str, strategy: str, optimiser: str, steps: int = 5,
                          gradient_accumulation: int = 8) -> Comparison:
    """Train `name` for `steps` calls (one optimiser step each, over `gradient_accumulation`
    micro-batches) on four emulated IPUs, and the same steps in PyTorch eager in float32 and in
    float64 micro-batch by micro-batch (the mean of the micro-batches' gradients, as PopTorch's
    accumulation takes it); compare the parameters."""
    zoo = MODELS[name]()
    torch.manual_seed(1)
    x, labels = zoo.inputs(steps, gradient_accumulation, MICRO_BATCH[name])
    eager_cls, emulated_cls = OPTIMISERS[optimiser]
    lr = zoo.sgd_lr if optimiser == "SGD" else zoo.adamw_lr
    after = {}
    layouts = [(torch.float32, None), (torch.float64, None)]
    if x.dim() == 6:  # [steps, G, m, C, H, W] images: PyTorch's convolutions in the other layout too
        layouts.append((torch.float32, torch.channels_last))
    for dtype, layout in layouts:
        model = copy.deepcopy(zoo.model).to(dtype)
        if layout is not None:
            model = model.to(memory_format=layout)
        opt = eager_cls(model.parameters(), lr=lr)
        for s in range(steps):
            opt.zero_grad()
            for k in range(gradient_accumulation):
                xs = x[s, k].to(dtype) if x.is_floating_point() else x[s, k]
                if layout is not None:
                    xs = xs.contiguous(memory_format=layout)
                (model(xs, labels[s, k])[1] / gradient_accumulation).backward()
            opt.step()
        after[(dtype, layout)] = flat_parameters(model)
    model = with_blocks(zoo)
    training = poptorch.trainingModel(model, options(zoo, strategy, gradient_accumulation),
                                      emulated_cls(model.parameters(), lr=lr))
    for s in range(steps):
        training(x[s].flatten(0, 1), labels[s].flatten(0, 1))
    training.copyWeightsToHost()
    reference, before = after[(torch.float64, None)], flat_parameters(zoo.model)
    distance = lambda p: ((p - reference).norm() / reference.norm()).item()  # noqa: E731
    channels_last = after.get((torch.float32, torch.channels_last))
    return Comparison(distance(flat_parameters(model)), distance(after[(torch.float32, None)]),
                      ((reference - before).norm() / before.norm()).item(),
                      None if channels_last is None else distance(channels_last))


def inference_against_eager(name: str, strategy: str = "pipelined", micro_batches: int = 8):
    """(emulated, eager) outputs of the model in eval mode, pipelined over four IPUs."""
    zoo = MODELS[name]()
    torch.manual_seed(2)
    x, _ = zoo.inputs(1, micro_batches, MICRO_BATCH[name])
    x = x[0].flatten(0, 1)
    model = with_blocks(zoo).eval()
    opts = options(zoo, strategy, 1).deviceIterations(micro_batches)
    emulated = poptorch.inferenceModel(model, opts)(x)
    return emulated, zoo.model.eval()(x).detach()
