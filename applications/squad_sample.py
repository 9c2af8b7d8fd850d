"""A tiny SQuAD for Graphcore's BERT application (`run_squad.py`), which loads the data set and its
metric by name from the Hugging Face Hub: `datasets.load_dataset("squad")` and
`datasets.load_metric("squad")`. This writes what a first, online run would leave behind, so that
the application runs offline (`HF_HOME=<dir> HF_HUB_OFFLINE=1`) on generated data instead:

- SQuAD v1.1 JSON files (train-v1.1.json, dev-v1.1.json: articles, paragraphs, questions, answer
  spans with their character offsets) of short generated paragraphs ("tom has a red ball . ann has
  a small cat .") with questions about them ("what does ann have ?" -> "a small cat", "who has a
  red ball ?" -> "tom"), using only words of the tokenizer stand-in's vocabulary (bert_vocabulary.py);
- the `datasets` cache of the data set "squad" (config plain_text) prepared from those files, in
  the Hub data set's columns (id, title, context, question, answers {text, answer_start});
- the `datasets` module cache of the metric "squad": SQuAD v1.1's exact match and F1 (answers
  compared after lower-casing and removing punctuation, articles and extra white space; F1 over
  their words; the best over the reference answers; both in percent).

Needs `datasets` (a 2.x release: the application imports `load_metric`, which 3.0 removed).

    python applications/squad_sample.py DIRECTORY [--train N] [--validation N]
    # then HF_HOME=DIRECTORY HF_HUB_OFFLINE=1 (with bert_vocabulary.py's cache in the same DIRECTORY)
"""
from __future__ import annotations

import argparse
import json
import os
import random

NAMES = ["tom", "ann", "sam", "eve", "bob", "max"]
COLOURS = ["red", "blue", "green", "big", "small"]
THINGS = ["ball", "box", "cat", "hat", "dog"]
CONFIG = "plain_text"
VERSION = "1.0.0"
HASH = "0" * 16   # the cache's build hash (any name: one build is cached)


def paragraph(rng: random.Random, article: int, index: int, sentences: int = 4) -> dict:
    """One SQuAD paragraph: `sentences` facts "NAME has a COLOUR THING ." (names and things
    distinct, so each question has one answer) and one question on each."""
    names = rng.sample(NAMES, sentences)
    things = [f"a {c} {t}" for c, t in rng.sample([(c, t) for c in COLOURS for t in THINGS], sentences)]
    context, starts = "", []
    for name, thing in zip(names, things):
        starts.append((len(context), len(context) + len(name) + len(" has ")))
        context += f"{name} has {thing} . "
    context = context.rstrip()
    qas = []
    for k, (name, thing) in enumerate(zip(names, things)):
        if rng.random() < 0.5:
            question, text, start = f"what does {name} have ?", thing, starts[k][1]
        else:
            question, text, start = f"who has {thing} ?", name, starts[k][0]
        assert context[start:start + len(text)] == text
        qas.append({"id": f"{article:03d}{index:03d}{k:02d}", "question": question,
                    "answers": [{"text": text, "answer_start": start}]})
    return {"context": context, "qas": qas}


def squad_json(questions: int, seed: int) -> dict:
    """A SQuAD v1.1 document with about `questions` questions (4 per paragraph, 2 paragraphs per article)."""
    rng = random.Random(seed)
    data, made = [], 0
    while made < questions:
        article = len(data)
        paragraphs = []
        for index in range(2):
            if made >= questions:
                break
            p = paragraph(rng, article, index)
            p["qas"] = p["qas"][:questions - made]
            made += len(p["qas"])
            paragraphs.append(p)
        data.append({"title": f"sample_{article}", "paragraphs": paragraphs})
    return {"version": "1.1", "data": data}


def rows(document: dict):
    """The Hub data set's rows of a SQuAD v1.1 document."""
    for article in document["data"]:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                yield {"id": qa["id"], "title": article["title"], "context": p["context"], "question": qa["question"],
                       "answers": {"text": [a["text"] for a in qa["answers"]],
                                   "answer_start": [a["answer_start"] for a in qa["answers"]]}}


def _builder_class(files: dict):
    import datasets

    class Squad(datasets.GeneratorBasedBuilder):
        """The "squad" data set read from the local SQuAD v1.1 `files` (by split). They are not
        config parameters, which would name the cached config after them instead of plain_text."""
        BUILDER_CONFIGS = [datasets.BuilderConfig(name=CONFIG, version=datasets.Version(VERSION))]

        def _info(self):
            return datasets.DatasetInfo(
                description="Generated SQuAD v1.1 sample (poptorch_lite applications/squad_sample.py)",
                features=datasets.Features({
                    "id": datasets.Value("string"), "title": datasets.Value("string"),
                    "context": datasets.Value("string"), "question": datasets.Value("string"),
                    "answers": datasets.features.Sequence({"text": datasets.Value("string"),
                                                           "answer_start": datasets.Value("int32")})}))

        def _split_generators(self, dl_manager):
            return [datasets.SplitGenerator(name=split, gen_kwargs={"path": files[str(split)]})
                    for split in (datasets.Split.TRAIN, datasets.Split.VALIDATION)]

        def _generate_examples(self, path):
            with open(path, encoding="utf-8") as f:
                for row in rows(json.load(f)):
                    yield row["id"], row

    return Squad


METRIC = '''"""SQuAD v1.1's metric: exact match and F1 in percent, the best over each question's answers.
Written by poptorch_lite's applications/squad_sample.py."""
import collections
import re
import string

import datasets


def normalise(text):
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    text = re.sub(r"\\b(a|an|the)\\b", " ", text)
    return " ".join(text.split())


def f1(prediction, answer):
    p, a = normalise(prediction).split(), normalise(answer).split()
    common = sum((collections.Counter(p) & collections.Counter(a)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(a)
    return 2 * precision * recall / (precision + recall)


class Squad(datasets.Metric):
    def _info(self):
        return datasets.MetricInfo(
            description="SQuAD v1.1 exact match and F1", citation="", inputs_description="predictions: "
            "[{id, prediction_text}], references: [{id, answers: {text, answer_start}}]",
            features=datasets.Features({
                "predictions": {"id": datasets.Value("string"), "prediction_text": datasets.Value("string")},
                "references": {"id": datasets.Value("string"),
                               "answers": datasets.features.Sequence({"text": datasets.Value("string"),
                                                                      "answer_start": datasets.Value("int32")})}}))

    def _compute(self, predictions, references):
        answers = {r["id"]: r["answers"]["text"] for r in references}
        missing = [p["id"] for p in predictions if p["id"] not in answers]
        if missing:
            raise ValueError(f"predictions for questions with no reference: {missing[:5]}")
        exact = total_f1 = 0.0
        for p in predictions:
            truths = answers[p["id"]]
            exact += max(float(normalise(p["prediction_text"]) == normalise(t)) for t in truths)
            total_f1 += max(f1(p["prediction_text"], t) for t in truths)
        n = max(len(predictions), 1)
        return {"exact_match": 100.0 * exact / n, "f1": 100.0 * total_f1 / n}
'''


def write_metric(hf_home: str) -> str:
    """The metric "squad" in the datasets module cache under `hf_home`; returns its file."""
    root = os.path.join(hf_home, "modules", "datasets_modules")
    directory = os.path.join(root, "metrics", "squad", "0" * 64)
    os.makedirs(directory, exist_ok=True)
    for d in (root, os.path.join(root, "metrics"), os.path.join(root, "metrics", "squad"), directory):
        open(os.path.join(d, "__init__.py"), "a", encoding="utf-8").close()
    path = os.path.join(directory, "squad.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(METRIC)
    return path


def write_sample(hf_home: str, train: int = 32, validation: int = 8, seed: int = 0) -> dict:
    """The SQuAD files (in `hf_home`/squad_sample), the data set and the metric caches; returns
    the JSON files' paths by split."""
    files = {}
    out = os.path.join(hf_home, "squad_sample")
    os.makedirs(out, exist_ok=True)
    for split, name, n, s in (("train", "train-v1.1.json", train, seed), ("validation", "dev-v1.1.json", validation,
                                                                           seed + 1)):
        files[split] = os.path.join(out, name)
        with open(files[split], "w", encoding="utf-8") as f:
            json.dump(squad_json(n, s), f)
    builder = _builder_class(files)(cache_dir=os.path.join(hf_home, "datasets"), dataset_name="squad",
                                    config_name=CONFIG, hash=HASH)
    builder.download_and_prepare()
    write_metric(hf_home)
    return files


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="the HF_HOME to write into")
    parser.add_argument("--train", type=int, default=32, help="training questions (default 32)")
    parser.add_argument("--validation", type=int, default=8, help="validation questions (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    for split, path in write_sample(a.directory, a.train, a.validation, a.seed).items():
        print(f"{split}: {path}")
