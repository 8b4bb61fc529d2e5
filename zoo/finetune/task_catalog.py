"""The finetuning tasks as data: which reader, encoder, model head and metrics each one uses.

A :class:`Task` turns a data directory into a :class:`TaskData`: the encoded training tensors and
the evaluation sets. An :class:`EvalSet` holds the model inputs and a ``score`` function that maps
the model's outputs to (metrics, predictions file contents). The runner (:mod:`zoo.finetune.finetune_job`)
knows nothing task-specific beyond this.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zoo.errors import UserError
from zoo.finetune import demo_task, glue, race, squad
from zoo.finetune.squad_metrics import squad_scores
from zoo.models.bert import heads as bert_heads


@dataclass
class EvalSet:
    """One evaluation split: model inputs (N, ...) and how to score the model's outputs on them."""

    name: str
    inputs: dict[str, torch.Tensor]
    score: Callable[[dict[str, np.ndarray]], tuple[dict[str, float], dict[str, str]]]

    def __len__(self) -> int:
        return next(iter(self.inputs.values())).shape[0]


@dataclass
class TaskData:
    train: dict[str, torch.Tensor] | None
    eval_sets: list[EvalSet] = field(default_factory=list)


@dataclass(frozen=True)
class Task:
    """``main_metric`` (e.g. "dev_matched/accuracy") picks the best epoch; ``outputs`` are the names of
    the model output tensors the scores read."""

    name: str
    model_class_name: str
    labels: tuple[str, ...] | None
    main_metric: str
    outputs: tuple[str, ...]
    load: Callable[..., TaskData]

    @property
    def model_class(self):
        return getattr(bert_heads, self.model_class_name)


LABEL_KEYS = ("labels", "start_positions", "end_positions")


def _without_labels(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k not in LABEL_KEYS}


def _json_file(entries: list[dict[str, Any]]) -> dict[str, str]:
    return {"jsonl": "".join(json.dumps(e) + "\n" for e in entries)}


# --------------------------------------------------------------------------- GLUE
def majority_label(examples) -> int:
    """The most frequent label of ``examples`` (the lowest id on a tie)."""
    counts = np.bincount([e.label for e in examples])
    return int(counts.argmax())


def _pair_eval_set(task: str, split: str, examples, tokenizer, max_seq_length: int, labels,
                   baseline_label: int | None = None) -> EvalSet:
    """A sentence-pair eval set; with ``baseline_label`` its scores add ``majority_baseline``: the accuracy
    of always answering that label (the training split's majority class)."""
    encoded = glue.encode_pairs(examples, tokenizer, max_seq_length)
    gold = encoded["labels"].numpy()

    def score(outputs):
        predicted = outputs["logits"].argmax(-1)
        metrics = glue.classification_metrics(task, predicted, gold)
        if baseline_label is not None:
            metrics["majority_baseline"] = float((gold == baseline_label).mean())
        rows = [{"guid": e.guid, "prediction": labels[p], "label": labels[e.label]}
                for e, p in zip(examples, predicted)]
        return metrics, _json_file(rows)

    return EvalSet(split, _without_labels(encoded), score)


def _load_pairs(task: str, reader, labels, train_split: str, eval_splits: tuple[str, ...],
                with_baseline: bool = False):
    """The loader of a sentence-pair task; ``with_baseline`` scores each eval set's majority-class baseline
    too (the training split's majority label, or the eval set's own when there is no training split)."""
    def load(data_dir, tokenizer, max_seq_length, **_) -> TaskData:
        splits = reader(data_dir)
        train = splits.get(train_split)

        def baseline(examples):
            return majority_label(train or examples) if with_baseline else None

        return TaskData(
            train=glue.encode_pairs(train, tokenizer, max_seq_length) if train else None,
            eval_sets=[_pair_eval_set(task, name, splits[name], tokenizer, max_seq_length, labels,
                                      baseline(splits[name]))
                       for name in eval_splits if splits.get(name)])
    return load


# --------------------------------------------------------------------------- RACE
def _race_eval_set(split: str, examples, tokenizer, max_seq_length: int) -> EvalSet:
    encoded = race.encode_race(examples, tokenizer, max_seq_length)

    def score(outputs):
        predicted = outputs["logits"].argmax(-1)
        metrics = race.race_accuracy(predicted, examples)
        rows = [{"guid": e.guid, "level": e.level, "prediction": "ABCD"[p], "answer": "ABCD"[e.label]}
                for e, p in zip(examples, predicted)]
        return metrics, _json_file(rows)

    return EvalSet(split, _without_labels(encoded), score)


def _load_race(data_dir, tokenizer, max_seq_length, **_) -> TaskData:
    splits = race.read_race(data_dir)
    train = splits.get("train")
    return TaskData(train=race.encode_race(train, tokenizer, max_seq_length) if train else None,
                    eval_sets=[_race_eval_set(name, splits[name], tokenizer, max_seq_length)
                               for name in ("dev", "test") if splits.get(name)])


# --------------------------------------------------------------------------- SQuAD
def _squad_eval_set(split: str, examples, tokenizer, max_seq_length: int, doc_stride: int,
                    max_query_length: int, version_2: bool) -> EvalSet:
    features = squad.featurize_squad(examples, tokenizer, max_seq_length, doc_stride, max_query_length)

    def score(outputs):
        predictions, na_probs = squad.decode_predictions(
            examples, features, outputs["start_logits"], outputs["end_logits"],
            version_2_with_negative=version_2)
        metrics = squad_scores(examples, predictions, na_probs if version_2 else None)
        files = {"json": json.dumps(predictions, indent=2) + "\n"}
        if version_2:
            files["na_prob.json"] = json.dumps(na_probs, indent=2) + "\n"
        return metrics, files

    return EvalSet(split, _without_labels(features.tensors), score)


def _load_squad(data_dir, tokenizer, max_seq_length, doc_stride=128, max_query_length=64, version=None,
                **_) -> TaskData:
    splits = squad.read_squad_dir(data_dir, version)
    version_2 = any(e.is_impossible for examples in splits.values() for e in examples) or version == "2.0"
    train = splits.get("train")
    train_tensors = None
    if train:
        train_tensors = squad.featurize_squad(train, tokenizer, max_seq_length, doc_stride,
                                              max_query_length).tensors
    return TaskData(train=train_tensors,
                    eval_sets=[_squad_eval_set(name, splits[name], tokenizer, max_seq_length, doc_stride,
                                               max_query_length, version_2)
                               for name in ("dev",) if splits.get(name)])


TASKS = {
    "mnli": Task("mnli", "BertForSequenceClassification", glue.MNLI_LABELS, "dev_matched/accuracy", ("logits",),
                 _load_pairs("mnli", glue.read_mnli, glue.MNLI_LABELS, "train", ("dev_matched", "dev_mismatched"))),
    "qqp": Task("qqp", "BertForSequenceClassification", glue.QQP_LABELS, "dev/accuracy", ("logits",),
                _load_pairs("qqp", glue.read_qqp, glue.QQP_LABELS, "train", ("dev", "test"))),
    "same-article": Task("same-article", "BertForSequenceClassification", demo_task.SAME_ARTICLE_LABELS,
                         "dev/accuracy", ("logits",),
                         _load_pairs("same-article", demo_task.read_same_article, demo_task.SAME_ARTICLE_LABELS,
                                     "train", ("dev",), with_baseline=True)),
    "race": Task("race", "BertForMultipleChoice", None, "dev/all", ("logits",), _load_race),
    "squad": Task("squad", "BertForQuestionAnswering", None, "dev/f1", ("start_logits", "end_logits"), _load_squad),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; choose one of {sorted(TASKS)}.")
    return TASKS[name]
