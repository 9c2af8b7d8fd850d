"""Fine-tune a small Hugging Face model with optimum-graphcore's IPUTrainer on emulated IPUs, or
the same model with transformers.Trainer on the CPU, on generated data; print the results as JSON.

    poptorch-lite run --ipu-hardware ipu2 applications/optimum_finetune.py --model bert --trainer ipu
    python applications/optimum_finetune.py --model bert --trainer cpu

Both start from the same weights (built from a small config with a fixed seed: nothing is
downloaded), see the same generated data in the same order (both trainers' samplers are replaced
by a sequential one; their own shuffle differently) and take optimiser steps of the same effective
batch:
IPUTrainer with micro-batch 2, gradient accumulation 8 and 2 device iterations (a call makes two
updates of 16 samples, the model pipelined over 2 IPUs with layers_per_ipu), transformers.Trainer
with batches of 16 and twice the steps. Both use AdamW without bias correction and with eps 1e-8 (IPUTrainer's
choice; transformers' own AdamW with correct_bias=False on the CPU), a constant learning rate and no
gradient clipping (IPUTrainer has none). After training, each trainer evaluates the model on the
training and on the evaluation set (IPUTrainer through inferenceModel) and predicts the evaluation
set; before training, it evaluates the initial weights on the evaluation set (the same loss on both
trainers, since the weights are the same).

Models: `bert`, BertForSequenceClassification (4 layers, hidden 128) on a two-class task (the class
is whether the second token is in the lower half of the vocabulary); `gpt2`, GPT2LMHeadModel
(4 layers, hidden 128) on sequences that count up by a per-sequence stride modulo the vocabulary
(next-token accuracy).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

VOCAB, SEQ = 128, 32
MICRO_BATCH, ACCUMULATION, DEVICE_ITERATIONS = 2, 8, 2
EFFECTIVE_BATCH = MICRO_BATCH * ACCUMULATION


class TwoClasses(torch.utils.data.Dataset):
    """Token sequences whose class is whether their second token is below the vocabulary's middle."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(4, VOCAB, (n, SEQ), generator=g)
        self.ids[:, 0] = 2  # [CLS]
        self.labels = (self.ids[:, 1] < (VOCAB + 4) // 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "token_type_ids": torch.zeros(SEQ, dtype=torch.long), "labels": self.labels[i]}


class Counting(torch.utils.data.Dataset):
    """Sequences x_t = (x_0 + s*t) mod V with a random start x_0 and stride s in 1..3: after two
    tokens the next one is determined."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.ids[i]}


def make_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "bert":
        from transformers import BertConfig, BertForSequenceClassification
        config = BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=256, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, num_labels=2)
        return BertForSequenceClassification(config)
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def datasets(kind: str, train: int, evaluation: int):
    cls = TwoClasses if kind == "bert" else Counting
    return cls(train, seed=1), cls(evaluation, seed=2)


def accuracy(kind: str):
    """compute_metrics: classification accuracy, or next-token accuracy for the causal LM."""
    def metric(prediction) -> dict:
        logits = prediction.predictions
        logits = logits[0] if isinstance(logits, tuple) else logits
        labels = prediction.label_ids
        if kind == "bert":
            return {"accuracy": float((logits.argmax(-1) == labels).mean())}
        return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}
    return metric


def in_order(trainer_class):
    """`trainer_class` feeding the training set in its order (IPUTrainer's and Trainer's random
    samplers draw different permutations from the same seed)."""
    class InOrder(trainer_class):
        def _get_train_sampler(self):
            return torch.utils.data.SequentialSampler(self.train_dataset)
    InOrder.__name__ = trainer_class.__name__
    return InOrder


def run_ipu(kind: str, steps: int, train, evaluation, out_dir: str) -> dict:
    from optimum.graphcore import IPUConfig, IPUTrainer, IPUTrainingArguments
    ipu_config = IPUConfig(layers_per_ipu=[2, 2], ipus_per_replica=2, gradient_accumulation_steps=ACCUMULATION,
                           device_iterations=DEVICE_ITERATIONS, inference_device_iterations=8,
                           inference_layers_per_ipu=[2, 2], executable_cache_dir="disabled",
                           enable_half_partials=False, optimizer_state_offchip=False, embedding_serialization_factor=1)
    args = IPUTrainingArguments(output_dir=out_dir, per_device_train_batch_size=MICRO_BATCH,
                                per_device_eval_batch_size=4, max_steps=steps, learning_rate=1e-3,
                                lr_scheduler_type="constant", fp32=True, logging_steps=max(1, steps // 5),
                                report_to=[], dataloader_drop_last=True, seed=0, save_strategy="no",
                                disable_tqdm=True)
    trainer = in_order(IPUTrainer)(model=make_model(kind), ipu_config=ipu_config, args=args, train_dataset=train,
                         eval_dataset=evaluation, compute_metrics=accuracy(kind))
    return _train_and_evaluate(trainer, evaluation, updates=steps * DEVICE_ITERATIONS)


def run_cpu(kind: str, steps: int, train, evaluation, out_dir: str) -> dict:
    from transformers import AdamW, Trainer, TrainingArguments
    model = make_model(kind)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=EFFECTIVE_BATCH,
                             per_device_eval_batch_size=32, max_steps=steps * DEVICE_ITERATIONS, learning_rate=1e-3,
                             lr_scheduler_type="constant", logging_steps=max(1, steps // 5), report_to=[],
                             dataloader_drop_last=True, seed=0, save_strategy="no", max_grad_norm=0.0,
                             disable_tqdm=True, no_cuda=True)
    optimizer = AdamW(model.parameters(), lr=1e-3, eps=args.adam_epsilon, weight_decay=0.0, correct_bias=False,
                      no_deprecation_warning=True)
    trainer = in_order(Trainer)(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                      compute_metrics=accuracy(kind), optimizers=(optimizer, None))
    return _train_and_evaluate(trainer, evaluation, updates=steps * DEVICE_ITERATIONS)


def _train_and_evaluate(trainer, evaluation, updates: int) -> dict:
    initial = trainer.evaluate(metric_key_prefix="initial")  # the same weights on both trainers
    start = time.perf_counter()
    trainer.train()
    trained = time.perf_counter() - start
    on_train = trainer.evaluate(trainer.train_dataset, metric_key_prefix="train")
    on_eval = trainer.evaluate()
    predicted = trainer.predict(evaluation)
    logits = predicted.predictions[0] if isinstance(predicted.predictions, tuple) else predicted.predictions
    return {"updates": updates, "train_seconds": round(trained, 1), "seconds": round(time.perf_counter() - start, 1),
            "initial_eval_loss": initial["initial_loss"], "train_loss": on_train["train_loss"], "eval_loss": on_eval["eval_loss"],
            "eval_accuracy": on_eval["eval_accuracy"], "predict_shape": list(np.shape(logits)),
            "log": [h for h in trainer.state.log_history if "loss" in h]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["bert", "gpt2"], default="bert")
    p.add_argument("--trainer", choices=["ipu", "cpu"], default="ipu")
    p.add_argument("--steps", type=int, default=50, help="IPUTrainer steps (the CPU trainer takes twice as many)")
    p.add_argument("--train-samples", type=int, default=1600)
    p.add_argument("--eval-samples", type=int, default=128)
    p.add_argument("--output-dir", default="optimum_finetune_out")
    p.add_argument("--json", help="also write the results to this file")
    a = p.parse_args(argv)
    train, evaluation = datasets(a.model, a.train_samples, a.eval_samples)
    run = run_ipu if a.trainer == "ipu" else run_cpu
    result = {"model": a.model, "trainer": a.trainer, **run(a.model, a.steps, train, evaluation, a.output_dir)}
    print("RESULT " + json.dumps(result))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
