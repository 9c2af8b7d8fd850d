"""Full-size application configurations, built to be priced in estimate mode.

Each config is the layer structure and the PopTorch options of a published Graphcore application
configuration, written here with plain torch.nn (the applications themselves import
`transformers`, which this project does not depend on): the models are built on the `meta` device
(shapes and dtypes, no storage) and compiled with `Options.Emulator.setMode("estimate")` on the
Bow target. `estimate(name)` compiles one and prices one call; `benchmarks/estimate_scale.py`
times them, `benchmarks/published_throughput.py` holds them against Graphcore's figures and
docs/estimating.md walks through the workflow.

What each config takes from its source (and what it leaves out) is in its docstring.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import poptorch_lite as poptorch

APPS = "Graphcore examples (github.com/graphcore/examples)"


# =========================================================================================
# BERT (nlp/bert/pytorch: modeling.py, configs_pretraining.yml, ipu_options.py)
# =========================================================================================
@dataclass
class BertConfig:
    hidden: int
    layers: int
    heads: int
    layers_per_ipu: list[int]
    matmul_proportion: list[float]
    micro_batch: int
    replicas: int
    gradient_accumulation: int
    vocab: int = 30522
    sequence: int = 128
    mask_tokens: int = 20
    max_positions: int = 512
    hidden_dropout: float = 0.1
    layer_norm_eps: float = 1e-3
    recompute_checkpoint_every_layer: bool = True

    @property
    def ffn(self) -> int:
        return 4 * self.hidden


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word = nn.Embedding(c.vocab, c.hidden)
        self.position = nn.Embedding(c.max_positions, c.hidden)
        self.token_type = nn.Embedding(2, c.hidden)
        self.norm = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.drop = nn.Dropout(c.hidden_dropout)

    def forward(self, input_ids, token_type_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        return self.drop(self.norm(x))


class BertLayer(nn.Module):
    """Post-LayerNorm BERT layer with the application's fused QKV projection (one [3H, H] product)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden)
        self.attention_out = nn.Linear(c.hidden, c.hidden)
        self.norm1 = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.up = nn.Linear(c.hidden, c.ffn)
        self.down = nn.Linear(c.ffn, c.hidden)
        self.norm2 = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.drop = nn.Dropout(c.hidden_dropout)

    def forward(self, x, mask):
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(x).split(h, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d)) + mask
        context = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, s, h)
        x = self.norm1(x + self.drop(self.attention_out(context)))
        return self.norm2(x + self.drop(self.down(F.gelu(self.up(x)))))


class BertPretraining(nn.Module):
    """BertForPreTraining as the application pipelines it: embeddings, `layers` encoder layers,
    pooler, and the pretraining heads (masked-LM on the masked positions only, gathered by a
    one-hot product, its decoder tied to the word embeddings; next-sentence prediction)."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.c = c
        self.embeddings = BertEmbeddings(c)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.layers))
        self.pooler = nn.Linear(c.hidden, c.hidden)
        self.transform = nn.Linear(c.hidden, c.hidden)
        self.transform_norm = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.decoder_bias = nn.Parameter(torch.zeros(c.vocab))
        self.nsp = nn.Linear(c.hidden, 2)

    def forward(self, input_ids, attention_mask, token_type_ids, masked_lm_positions, masked_lm_labels,
                next_sentence_label):
        x = self.embeddings(input_ids, token_type_ids)
        mask = ((1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -1000.0).to(x.dtype)
        for layer in self.layers:
            x = layer(x, mask)
            if self.c.recompute_checkpoint_every_layer:   # the application's checkpoint on each layer's output
                x = poptorch.recomputationCheckpoint(x)
        with poptorch.Block("Pooler", ipu_id=0):
            pooled = torch.tanh(self.pooler(x[:, 0]))
        with poptorch.Block("Classifier", ipu_id=0):
            one_hot = F.one_hot(masked_lm_positions, x.shape[1]).to(x.dtype)
            masked = torch.matmul(one_hot, x)
            t = self.transform_norm(F.gelu(self.transform(masked)))
            scores = F.linear(t, self.embeddings.word.weight, self.decoder_bias)
            nsp = self.nsp(pooled)
            mlm_loss = F.cross_entropy(scores.reshape(-1, self.c.vocab).float(), masked_lm_labels.reshape(-1),
                                       ignore_index=0)
            nsp_loss = F.cross_entropy(nsp.float(), next_sentence_label)
            loss = poptorch.identity_loss(mlm_loss + nsp_loss, reduction="none")
        return loss, mlm_loss, nsp_loss

    def parallelize(self) -> "BertPretraining":
        """The application's placement: embeddings on IPU 0, `layers_per_ipu[i]` layers on IPU i,
        pooler and heads back on IPU 0 (where the tied word embeddings live)."""
        poptorch.BeginBlock(self.embeddings, "Embedding", ipu_id=0)
        ipu_of = [i for i, n in enumerate(self.c.layers_per_ipu) for _ in range(n)]
        for index, layer in enumerate(self.layers):
            poptorch.BeginBlock(layer, f"Encoder{index}", ipu_id=ipu_of[index])
        return self


def bert_inputs(c: BertConfig, batch: int) -> tuple:
    meta = dict(device="meta")
    return (torch.empty(batch, c.sequence, dtype=torch.int64, **meta),
            torch.empty(batch, c.sequence, dtype=torch.int64, **meta),
            torch.empty(batch, c.sequence, dtype=torch.int64, **meta),
            torch.empty(batch, c.mask_tokens, dtype=torch.int64, **meta),
            torch.empty(batch, c.mask_tokens, dtype=torch.int64, **meta),
            torch.empty(batch, dtype=torch.int64, **meta))


def bert_options(c: BertConfig, *, rts: bool = True, offchip_state: bool = True) -> poptorch.Options:
    """ipu_options.get_options for the config: replication, accumulation with a Mean reduction,
    OutputMode.Sum, optimiser state off chip with replicated tensor sharding, PipelinedExecution
    with AutoIncrement stages, per-IPU matmul memory proportions, half partials."""
    opts = poptorch.Options()
    opts.replicationFactor(c.replicas).deviceIterations(1)
    opts.Training.gradientAccumulation(c.gradient_accumulation)
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
    opts.outputMode(poptorch.OutputMode.Sum)
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(not offchip_state).useReplicatedTensorSharding(rts))
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    opts.setAvailableMemoryProportion({f"IPU{i}": p for i, p in enumerate(c.matmul_proportion)})
    opts.Precision.enableStochasticRounding(True)
    opts.Precision.setPartialsType(torch.float16)
    return opts


def bert_lamb(model: nn.Module, bias_correction: bool = True):
    """optimization.get_optimizer for LAMB: float16 accumulators, float32 second moments,
    no weight decay on biases and LayerNorm weights."""
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or "norm" in n)]
    rest = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n]
    return poptorch.optim.LAMB([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                               lr=0.006, loss_scaling=4096.0, bias_correction=bias_correction,
                               accum_type=torch.float16, first_order_momentum_accum_type=torch.float32,
                               second_order_momentum_accum_type=torch.float32)


# =========================================================================================
# The configs
# =========================================================================================
@dataclass
class Config:
    name: str
    source: str                       # where its structure and options come from
    build: Callable[[], tuple]        # -> (model on meta, options, optimizer, inputs of one call)
    samples_per_call: int
    leaves_out: list[str] = field(default_factory=list)


def _bert(c: BertConfig, bias_correction: bool = True) -> Callable[[], tuple]:
    def build():
        with torch.device("meta"):
            model = BertPretraining(c).half().parallelize()
        opts = bert_options(c)
        opts.Emulator.setMode("estimate").setTarget("Bow")
        batch = c.micro_batch * c.gradient_accumulation * c.replicas
        return model, opts, bert_lamb(model, bias_correction), bert_inputs(c, batch)
    return build


BERT_LARGE = dict(hidden=1024, layers=24, heads=16, layers_per_ipu=[3, 7, 7, 7], micro_batch=8)
BERT_BASE = dict(hidden=768, layers=12, heads=12, layers_per_ipu=[0, 4, 4, 4], micro_batch=32,
                 matmul_proportion=[0.25] * 4)
BERT_LEAVES_OUT = [
    "the serialised decoder matmul (embedding_serialization_factor 2): one product",
    "sequence packing: rows of 128 tokens are priced; packed throughput counts 1.17 sequences a row "
    "(the application's packing factor for SL128)",
]

CONFIGS = {
    "bert_large_128_pod16": Config(
        "bert_large_128_pod16", f"{APPS}: nlp/bert/pytorch configs_pretraining.yml pretrain_large_128",
        _bert(BertConfig(**BERT_LARGE, matmul_proportion=[0.15, 0.25, 0.25, 0.25], replicas=4,
                         gradient_accumulation=2048)),
        8 * 2048 * 4, BERT_LEAVES_OUT),
    "bert_large_128_pod64": Config(
        "bert_large_128_pod64", f"{APPS}: nlp/bert/pytorch configs_pretraining.yml pretrain_large_128_POD64",
        _bert(BertConfig(**BERT_LARGE, matmul_proportion=[0.14, 0.19, 0.19, 0.19], replicas=16,
                         gradient_accumulation=512)),
        8 * 512 * 16, BERT_LEAVES_OUT),
    "bert_large_512_pod16": Config(
        "bert_large_512_pod16", f"{APPS}: nlp/bert/pytorch configs_pretraining.yml pretrain_large_512 (micro-batch 2, "
        "SL512, 76 masked tokens, matmul proportions [0.10, 0.15, 0.15, 0.15]); gradient accumulation 1024, the "
        "application's 2048 divided by its packing factor for SL512 (2.0) as it does when packing, which is the "
        "published batch of 8,192",
        _bert(BertConfig(**dict(BERT_LARGE, micro_batch=2), sequence=512, mask_tokens=76,
                         matmul_proportion=[0.10, 0.15, 0.15, 0.15], replicas=4, gradient_accumulation=1024)),
        2 * 1024 * 4, BERT_LEAVES_OUT[:1] + [
            "sequence packing: rows of 512 tokens are priced; packed throughput counts 2.0 sequences a row "
            "(the application's packing factor for SL512)"]),
    "bert_base_128_pod16": Config(
        "bert_base_128_pod16", f"{APPS}: nlp/bert/pytorch configs_pretraining.yml pretrain_base_128",
        _bert(BertConfig(**BERT_BASE, replicas=4, gradient_accumulation=512), bias_correction=False),
        32 * 512 * 4, BERT_LEAVES_OUT),
    "optimum_bert_large_pod64": Config(
        "optimum_bert_large_pod64",
        "optimum-graphcore's Graphcore/bert-large-ipu IPUConfig (optimum_version 1.0.0: layers_per_ipu [3, 7, 7, 7], "
        "matmul_proportion [0.1, 0.15, 0.15, 0.15], replication 16, gradient accumulation 512, RTS, optimiser state "
        "off chip, recomputation every layer, half partials), as a public project copies it; the Hub page itself is "
        "not reachable here. Micro-batch 8 as the BERT application (the IPUConfig does not set it)",
        _bert(BertConfig(**BERT_LARGE, matmul_proportion=[0.1, 0.15, 0.15, 0.15], replicas=16,
                         gradient_accumulation=512)),
        8 * 512 * 16, BERT_LEAVES_OUT),
}


@dataclass
class Priced:
    """One config compiled and one call priced in estimate mode."""
    config: Config
    model: object                     # the PoplarExecutor
    compile_seconds: float            # wall time of compile and the priced call
    cpu_seconds: float                # CPU time of the same


def estimate(name: str) -> Priced:
    """Compile config `name` in estimate mode and price one call."""
    config = CONFIGS[name]
    model, opts, optimizer, inputs = config.build()
    start, cpu = time.perf_counter(), time.process_time()
    training = poptorch.trainingModel(model, opts, optimizer)
    training(*inputs)
    return Priced(config, training, time.perf_counter() - start, time.process_time() - cpu)
