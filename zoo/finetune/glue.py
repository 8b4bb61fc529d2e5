"""GLUE MNLI and QQP: reading the TSV files, ``[CLS] a [SEP] b [SEP]`` encoding, and metrics.

Layouts read by :func:`read_mnli` and :func:`read_qqp` (``data_dir`` is one task's directory):

- GLUE TSV, columns found by header name. MNLI: ``train.tsv``, ``dev_matched.tsv``,
  ``dev_mismatched.tsv`` with ``sentence1``, ``sentence2``, ``gold_label``
  (contradiction/entailment/neutral) and ``index`` for the id. QQP: ``train.tsv``, ``dev.tsv``
  (and ``test.tsv`` when it carries labels) with ``question1``, ``question2``, ``is_duplicate``
  (0/1) and ``id``. Fields are tab-separated and never quoted (GLUE's own reading: MNLI
  sentences contain bare double quotes), so each line is split at its tabs; that keeps the row-by-row
  checking below exact.
- When no TSV is there: the Hugging Face hub layout of glue/mnli or glue/qqp already on disk;
  or, for ``data_dir`` ``hub:glue/mnli`` / ``hub:glue/qqp``, the hub dataset itself, through
  ``datasets.load_dataset`` (see :mod:`zoo.finetune.hub_layouts`).

Labels: ``MNLI_LABELS`` gives the ids 0, 1, 2 (GLUE's processor order); QQP's label is
``is_duplicate`` itself.

Bad input (the policy of :mod:`zoo.finetune.skips`): a missing directory, a missing required
column or a directory without any split raises ``MissingInput``/``UserError`` naming it; a
row whose field count differs from the header's, whose label is outside the label set or with a text
longer than :data:`~zoo.finetune.examples.MAX_TEXT_CHARS` is skipped and counted, and one :class:`~zoo.finetune.skips.MalformedExampleWarning` per file
reports them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zoo.errors import MissingInput, UserError
from zoo.finetune.examples import PairExample, over_long
from zoo.finetune.hub_names import TASK_EXAMPLES, is_hub_name
from zoo.finetune.skips import SkippedExamples

MNLI_LABELS = ("contradiction", "entailment", "neutral")  # label ids 0, 1, 2
QQP_LABELS = ("0", "1")  # is_duplicate: not duplicate, duplicate

MNLI_SPLIT_FILES = {"train": "train.tsv", "dev_matched": "dev_matched.tsv", "dev_mismatched": "dev_mismatched.tsv"}
QQP_SPLIT_FILES = {"train": "train.tsv", "dev": "dev.tsv", "test": "test.tsv"}


@dataclass(frozen=True)
class TsvColumns:
    """Header names of a task's two texts, its label and its example id (row number if absent)."""

    text_a: str
    text_b: str
    label: str
    guid: str


MNLI_COLUMNS = TsvColumns(text_a="sentence1", text_b="sentence2", label="gold_label", guid="index")
QQP_COLUMNS = TsvColumns(text_a="question1", text_b="question2", label="is_duplicate", guid="id")


def _read_tsv(path: Path) -> tuple[list[str], list[list[str]]]:
    """The header and the non-blank rows of a GLUE TSV file: each line split at its tabs, which is what
    :mod:`csv` with ``QUOTE_NONE`` does, without its 131,072-character field limit (over-long texts are
    skipped per row by :func:`read_pair_tsv`, see :data:`~zoo.finetune.examples.MAX_TEXT_CHARS`)."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            rows = [line.rstrip("\r\n").split("\t") for line in f if line.rstrip("\r\n")]
    except UnicodeDecodeError:
        raise UserError(f"'{path}' is not UTF-8 text; pass the GLUE TSV file as distributed.") from None
    if not rows:
        raise UserError(f"'{path}' is empty; it needs a header row and one row per example.")
    return rows[0], rows[1:]


def read_pair_tsv(
    path: str | os.PathLike,
    split: str,
    columns: TsvColumns,
    labels: Sequence[str],
) -> list[PairExample]:
    """Examples of one GLUE TSV file; malformed rows are skipped, counted and warned about once."""
    path = Path(path)
    header, rows = _read_tsv(path)
    position = {name.strip(): i for i, name in enumerate(header)}
    for required in (columns.text_a, columns.text_b, columns.label):
        if required not in position:
            raise UserError(
                f"'{path}' has no '{required}' column in its header; pass the GLUE TSV with its "
                f"original header row ({', '.join(header)} was found)."
            )
    label_ids = {name: i for i, name in enumerate(labels)}
    skipped = SkippedExamples(str(path))
    examples = []
    id_column = position.get(columns.guid)
    for row_number, row in enumerate(rows, start=1):
        row_id = row[id_column] if id_column is not None and id_column < len(row) else f"row {row_number}"
        if len(row) != len(header):
            skipped.skip(row_id, f"row(s) with a field count other than the header's {len(header)}")
            continue
        too_long = over_long(row)
        if too_long:
            skipped.skip(row_id, too_long)
            continue
        label = row[position[columns.label]].strip()
        if label not in label_ids:
            skipped.skip(row_id, f"label(s) outside {'/'.join(labels)}")
            continue
        examples.append(PairExample(
            guid=f"{split}-{row_id}",
            text_a=row[position[columns.text_a]],
            text_b=row[position[columns.text_b]],
            label=label_ids[label],
        ))
    skipped.warn()
    return examples


def _has_column(path: Path, column: str) -> bool:
    header, _ = _read_tsv(path)
    return column in {name.strip() for name in header}


def _read_task_dir(
    data_dir: str | os.PathLike,
    task: str,
    split_files: Mapping[str, str],
    columns: TsvColumns,
    labels: Sequence[str],
    unlabelled_ok: Sequence[str] = (),
) -> dict[str, list[PairExample]]:
    if is_hub_name(data_dir):
        from zoo.finetune import hub_layouts  # imports `datasets`, which is slow: only when needed

        return hub_layouts.read_glue_hub(data_dir, task)
    directory = Path(data_dir)
    if not directory.is_dir():
        raise MissingInput(
            f"{task} data directory '{directory}' does not exist; pass --data-dir with the GLUE {task} files "
            f"or the hub dataset's name, {TASK_EXAMPLES[task]}."
        )
    splits = {}
    for split, name in split_files.items():
        path = directory / name
        if not path.is_file():
            continue
        if split in unlabelled_ok and not _has_column(path, columns.label):
            continue  # an unlabelled test file is not an evaluation split
        splits[split] = read_pair_tsv(path, split, columns, labels)
    if splits:
        return splits
    from zoo.finetune import hub_layouts  # imports `datasets`, which is slow: only when needed

    if hub_layouts.is_hub_layout(directory):
        return hub_layouts.read_glue_hub(directory, task)
    expected = ", ".join(f for s, f in split_files.items() if s not in unlabelled_ok)
    raise UserError(
        f"no {task} split found in '{directory}'; put the GLUE files there ({expected}) or a "
        f"Hugging Face glue/{task} layout (a save_to_disk directory or parquet files)."
    )


def read_mnli(data_dir: str | os.PathLike) -> dict[str, list[PairExample]]:
    """MNLI splits present in ``data_dir`` (or ``hub:glue/mnli``): some of "train", "dev_matched",
    "dev_mismatched"."""
    return _read_task_dir(data_dir, "mnli", MNLI_SPLIT_FILES, MNLI_COLUMNS, MNLI_LABELS)


def read_qqp(data_dir: str | os.PathLike) -> dict[str, list[PairExample]]:
    """QQP splits present in ``data_dir`` (or ``hub:glue/qqp``): some of "train", "dev" and, when
    labelled, "test"."""
    return _read_task_dir(data_dir, "qqp", QQP_SPLIT_FILES, QQP_COLUMNS, QQP_LABELS, unlabelled_ok=("test",))


def encode_pairs(examples: Sequence[PairExample], tokenizer, max_seq_length: int) -> dict[str, torch.Tensor]:
    """``[CLS] a [SEP] b [SEP]`` padded to ``max_seq_length``, the longer text truncated first.

    Returns ``input_ids``, ``token_type_ids`` (0 for ``[CLS] a [SEP]``, 1 for ``b [SEP]``) and
    ``attention_mask`` of shape (N, L), and ``labels`` of shape (N,), all int64.
    """
    if max_seq_length < 5:
        raise UserError(
            f"max_seq_length={max_seq_length} leaves no room for two texts; use at least 5 (128 is usual)."
        )
    if not examples:
        empty = torch.zeros((0, max_seq_length), dtype=torch.long)
        return {"input_ids": empty, "token_type_ids": empty.clone(), "attention_mask": empty.clone(),
                "labels": torch.zeros((0,), dtype=torch.long)}
    encoded = tokenizer(
        [e.text_a for e in examples],
        [e.text_b for e in examples],
        truncation="longest_first",
        max_length=max_seq_length,
        padding="max_length",
        return_token_type_ids=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    tensors = {key: encoded[key].long() for key in ("input_ids", "token_type_ids", "attention_mask")}
    tensors["labels"] = torch.tensor([e.label for e in examples], dtype=torch.long)
    return tensors


def as_class_ids(predictions) -> np.ndarray:
    """Class ids from ids (N,) or from scores (N, C), which are arg-maxed."""
    if isinstance(predictions, torch.Tensor):
        predictions = predictions.detach().cpu().numpy()
    predictions = np.asarray(predictions)
    return predictions.argmax(axis=-1) if predictions.ndim == 2 else predictions.astype(np.int64)


CLASSIFICATION_TASKS = ("mnli", "qqp", "same-article")


def classification_metrics(task: str, predictions, labels) -> dict[str, float]:
    """``accuracy`` (and for qqp the ``f1`` of the duplicate class), as fractions in [0, 1].

    ``predictions`` are class ids (N,) or logits (N, C).
    """
    if task not in CLASSIFICATION_TASKS:
        raise UserError(f"unknown classification task '{task}'; use one of {', '.join(CLASSIFICATION_TASKS)}.")
    predicted = as_class_ids(predictions)
    gold = as_class_ids(labels)
    if predicted.shape != gold.shape or gold.ndim != 1:
        raise UserError(f"{len(predicted)} predictions for {len(gold)} labels; pass one prediction per example.")
    metrics = {"accuracy": float((predicted == gold).mean()) if len(gold) else float("nan")}
    if task == "qqp":
        true_pos = int(((predicted == 1) & (gold == 1)).sum())
        false_pos = int(((predicted == 1) & (gold != 1)).sum())
        false_neg = int(((predicted != 1) & (gold == 1)).sum())
        denominator = 2 * true_pos + false_pos + false_neg
        metrics["f1"] = 2 * true_pos / denominator if denominator else 0.0
    return metrics
