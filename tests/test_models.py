"""Models beyond the tutorial on four emulated IPUs, one BeginBlock per layer group: torchvision's
resnet18 and mobilenet_v3_small, and a BERT-style encoder (embeddings, attention through
scaled_dot_product_attention and with an explicit softmax, LayerNorm, GELU, dropout). The forward
matches PyTorch eager; training ends as close to float64 training as PyTorch's own float32
training does, within 2x. The training comparison of the two CNNs takes minutes per run on two
cores, too long for the suite: benchmarks/models_vs_float64.py runs every model, strategy and
optimiser and prints the table."""
import pytest
import torch

import poptorch_lite as poptorch

import model_zoo


@pytest.mark.parametrize("name", [
    "bert_style",
    pytest.param("resnet18", marks=pytest.mark.slow),
    pytest.param("mobilenet_v3_small", marks=pytest.mark.slow),
])
def test_forward_matches_pytorch(name):
    emulated, eager = model_zoo.inference_against_eager(name)
    torch.testing.assert_close(emulated, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, strategy, optimiser", [
    ("bert_style", "pipelined", "SGD"),
    ("bert_style", "pipelined", "AdamW"),
    ("bert_style", "sharded", "SGD"),
    ("bert_style", "sharded", "AdamW"),
])
def test_training_is_as_close_to_float64_as_pytorch_float32(name, strategy, optimiser):
    c = model_zoo.train_against_float64(name, strategy, optimiser)
    assert c.moved > 10 * c.float32, f"training hardly moved the parameters: {c}"
    assert c.emulated <= 2 * c.float32, f"{name} {strategy} {optimiser}: {c} (ratio {c.ratio:.2f})"


def test_bert_style_with_dropout_trains_pipelined():
    """Dropout in the embeddings, attention and residual branches: masks drawn on the IPUs, so
    the loss differs from the same model without dropout, and training still lowers it."""
    losses = {}
    for dropout in (0.0, 0.3):
        zoo = model_zoo.bert_style(dropout=dropout)
        torch.manual_seed(1)
        ids, labels = zoo.inputs(1, 8, 2)
        model = model_zoo.with_blocks(zoo)
        training = poptorch.trainingModel(model, model_zoo.options(zoo, "pipelined", 8).randomSeed(3),
                                          poptorch.optim.AdamW(model.parameters(), lr=1e-2))
        losses[dropout] = [training(ids[0].flatten(0, 1), labels[0].flatten(0, 1))[1].mean().item()
                           for _ in range(6)]
    assert losses[0.3][0] != pytest.approx(losses[0.0][0], rel=1e-3)
    assert losses[0.3][-1] < losses[0.3][0] and losses[0.0][-1] < losses[0.0][0]
