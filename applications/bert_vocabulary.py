"""Stand-in for the tokenizer download in Graphcore's BERT application tests: they build
`BertTokenizer.from_pretrained("bert-base-uncased")`, which fetches the vocabulary from the Hugging
Face Hub. `write_hub_cache(directory)` writes a Hub cache holding a small vocabulary under that
name; with `HF_HOME=<directory>` and `HF_HUB_OFFLINE=1` transformers' own BertTokenizer loads it
from there, nothing downloaded. The tokenizer itself is transformers' (lower-casing, punctuation
splitting, WordPiece); only its vocabulary is small. It covers the tests' sentence
("Hello, my dog is cute ... yo") so that it tokenizes to the application's sequence length of 128,
as bert-base-uncased's does (the tests gather masked positions anywhere in 0..127), and the words
of the generated SQuAD sample (applications/squad_sample.py), none of which changes how that
sentence splits.

    python applications/bert_vocabulary.py DIRECTORY   # then export HF_HOME=DIRECTORY HF_HUB_OFFLINE=1
"""
from __future__ import annotations

import json
import os
import sys

MODEL = "bert-base-uncased"
REVISION = "0" * 40  # the cache's snapshot name (a commit id on the Hub)
VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", ",", "my", "dog", "is", "cute", "y", "##o",
              "##hello",
              # the words of the generated SQuAD sample (applications/squad_sample.py)
              "a", "has", "have", "does", "what", "who", ".", "?", "red", "blue", "green", "big", "small", "ball",
              "box", "cat", "hat", "tom", "ann", "sam", "eve", "bob", "max"]


def write_hub_cache(directory: str) -> str:
    """Write the Hub cache for MODEL's tokenizer under `directory` (HF_HOME); returns the snapshot's path."""
    root = os.path.join(directory, "hub", "models--" + MODEL.replace("/", "--"))
    snapshot = os.path.join(root, "snapshots", REVISION)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", "main"), "w", encoding="utf-8") as f:
        f.write(REVISION)
    with open(os.path.join(snapshot, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(VOCABULARY) + "\n")
    with open(os.path.join(snapshot, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"do_lower_case": True, "model_max_length": 512}, f)
    return snapshot


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python applications/bert_vocabulary.py DIRECTORY")
    print(write_hub_cache(sys.argv[1]))
