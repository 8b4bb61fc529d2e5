"""Hugging Face hub layouts already on disk, read into the finetune example dataclasses.

Two layouts of one dataset configuration are recognised in a directory:

- a ``datasets`` ``save_to_disk`` directory of a ``DatasetDict`` (it holds ``dataset_dict.json``);
- parquet files, as the hub stores them: ``<split>-00000-of-00001.parquet`` (also under
  ``data/``), ``<split>/0000.parquet`` or ``<split>.parquet``.

Configurations and columns: glue/mnli (premise, hypothesis, label; splits train,
validation_matched, validation_mismatched -> "train", "dev_matched", "dev_mismatched"), glue/qqp
(question1, question2, label; train, validation, test -> "train", "dev", "test"), squad and
squad_v2 (id, context, question, answers{text, answer_start}; train, validation -> "train", "dev";
a question without answers is impossible), race/all, race/middle, race/high (example_id, article,
question, options, answer; train, validation, test -> "train", "dev", "test"; the level is the
``example_id`` prefix, "middle..." or "high...").

Labels are mapped by name: the hub's glue/mnli order is entailment, neutral, contradiction, which
becomes :data:`~zoo.finetune.glue.MNLI_LABELS` ids. The names come from the ``ClassLabel`` feature
when present, else the hub's order is assumed. A split whose labels are all -1 (the hub's
unlabelled test sets) is left out; other labels outside the set are skipped and counted like every
malformed example (policy of :mod:`zoo.finetune.skips`: one warning per split), and a missing
column raises ``ValueError``.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

import datasets

from zoo.finetune.glue import PairExample
from zoo.finetune.race import RaceExample, make_race_example
from zoo.finetune.skips import SkippedExamples
from zoo.finetune.squad import SquadExample, make_squad_example

_SHARD_NAME = re.compile(r"^(?P<split>\w+?)-\d{5}-of-\d{5}\.parquet$")
_NUMBERED_NAME = re.compile(r"^\d+\.parquet$")

# (hub split -> our split, text columns, hub label names in id order, our label id of each name)
_GLUE = {
    "mnli": (
        {"train": "train", "validation_matched": "dev_matched", "validation_mismatched": "dev_mismatched"},
        ("premise", "hypothesis"),
        ("entailment", "neutral", "contradiction"),
        {"contradiction": 0, "entailment": 1, "neutral": 2},
    ),
    "qqp": (
        {"train": "train", "validation": "dev", "test": "test"},
        ("question1", "question2"),
        ("not_duplicate", "duplicate"),
        {"not_duplicate": 0, "duplicate": 1},
    ),
}
_EVAL_SPLITS = {"train": "train", "validation": "dev", "test": "test"}


def _parquet_split(path: Path, directory: Path) -> str | None:
    """The split a parquet file holds, from its hub file name, or None if it is not a split file."""
    in_subdirectory = path.parent != directory
    shard = _SHARD_NAME.match(path.name)
    if shard and (not in_subdirectory or path.parent.name == "data"):
        return shard.group("split")
    if _NUMBERED_NAME.match(path.name) and in_subdirectory:
        return path.parent.name
    if not in_subdirectory and not shard:
        return path.stem
    return None


def _parquet_files(directory: Path) -> dict[str, list[str]]:
    files = defaultdict(list)
    for path in sorted([*directory.glob("*.parquet"), *directory.glob("*/*.parquet")]):
        split = _parquet_split(path, directory)
        if split is not None:
            files[split].append(str(path))
    return dict(files)


def is_hub_layout(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a save_to_disk ``DatasetDict`` or hub parquet split files."""
    directory = Path(directory)
    return (directory / "dataset_dict.json").is_file() or bool(_parquet_files(directory))


def load_hub_splits(directory: str | os.PathLike) -> dict[str, datasets.Dataset]:
    """The hub splits (by their hub names) of a save_to_disk directory or of parquet files."""
    directory = Path(directory)
    if (directory / "dataset_dict.json").is_file():
        return dict(datasets.load_from_disk(str(directory)))
    files = _parquet_files(directory)
    if not files:
        raise ValueError(
            f"'{directory}' holds neither dataset_dict.json nor hub parquet files; "
            "pass a save_to_disk directory or a hub dataset download."
        )
    return {split: datasets.Dataset.from_parquet(paths, keep_in_memory=True) for split, paths in files.items()}


def _require_columns(dataset: datasets.Dataset, columns, directory: Path, split: str) -> None:
    for column in columns:
        if column not in dataset.column_names:
            raise ValueError(
                f"split '{split}' of '{directory}' has no '{column}' column "
                f"(it has {', '.join(dataset.column_names)}); "
                "pass the matching Hugging Face dataset configuration."
            )


def read_glue_hub(directory: str | os.PathLike, task: str) -> dict[str, list[PairExample]]:
    """glue/mnli or glue/qqp on disk as :class:`PairExample` splits (see the module docstring)."""
    directory = Path(directory)
    split_names, (column_a, column_b), hub_names, our_ids = _GLUE[task]
    splits = {}
    for hub_split, dataset in load_hub_splits(directory).items():
        if hub_split not in split_names:
            continue
        _require_columns(dataset, (column_a, column_b, "label"), directory, hub_split)
        label_feature = dataset.features["label"]
        names = tuple(label_feature.names) if isinstance(label_feature, datasets.ClassLabel) else hub_names
        if any(name not in our_ids for name in names):
            raise ValueError(
                f"the label names {', '.join(names)} of '{directory}' are not those of glue/{task}; "
                f"pass the glue/{task} dataset."
            )
        rows = dataset.to_dict()
        if all(label == -1 for label in rows["label"]):
            continue  # the hub's unlabelled test split
        split = split_names[hub_split]
        skipped = SkippedExamples(f"{directory} [{hub_split}]")
        ids = rows.get("idx", range(len(rows["label"])))
        examples = []
        for row_id, text_a, text_b, label in zip(ids, rows[column_a], rows[column_b], rows["label"]):
            if not isinstance(label, int) or not 0 <= label < len(names):
                skipped.skip(str(row_id), f"label(s) outside 0..{len(names) - 1}")
                continue
            label_id = our_ids[names[label]]
            examples.append(PairExample(guid=f"{split}-{row_id}", text_a=text_a, text_b=text_b, label=label_id))
        skipped.warn()
        splits[split] = examples
    if not splits:
        raise ValueError(f"'{directory}' has no labelled {', '.join(split_names)} split; pass a glue/{task} dataset.")
    return splits


def read_squad_hub(directory: str | os.PathLike) -> dict[str, list[SquadExample]]:
    """squad or squad_v2 on disk as "train"/"dev" :class:`SquadExample` lists."""
    directory = Path(directory)
    splits = {}
    for hub_split, dataset in load_hub_splits(directory).items():
        if hub_split not in ("train", "validation"):
            continue
        _require_columns(dataset, ("id", "context", "question", "answers"), directory, hub_split)
        skipped, seen_ids, examples = SkippedExamples(f"{directory} [{hub_split}]"), set(), []
        rows = dataset.to_dict()
        for qid, context, question, answers in zip(rows["id"], rows["context"], rows["question"], rows["answers"]):
            pairs = list(zip(answers["text"], answers["answer_start"]))
            example = make_squad_example(qid, question, context, pairs, not pairs, skipped, seen_ids)
            if example is not None:
                examples.append(example)
        skipped.warn()
        splits[_EVAL_SPLITS[hub_split]] = examples
    if not splits:
        raise ValueError(f"'{directory}' has no train or validation split; pass a squad or squad_v2 dataset.")
    return splits


def read_race_hub(directory: str | os.PathLike) -> dict[str, list[RaceExample]]:
    """race/all (or middle, high) on disk as "train"/"dev"/"test" :class:`RaceExample` lists."""
    directory = Path(directory)
    splits = {}
    for hub_split, dataset in load_hub_splits(directory).items():
        if hub_split not in _EVAL_SPLITS:
            continue
        _require_columns(dataset, ("example_id", "article", "question", "options", "answer"), directory, hub_split)
        split = _EVAL_SPLITS[hub_split]
        skipped, examples, questions_seen = SkippedExamples(f"{directory} [{hub_split}]"), [], defaultdict(int)
        rows = dataset.to_dict()
        for example_id, article, question, options, answer in zip(
            rows["example_id"], rows["article"], rows["question"], rows["options"], rows["answer"]
        ):
            number = questions_seen[example_id]
            questions_seen[example_id] += 1
            level = next((name for name in ("middle", "high") if str(example_id).startswith(name)), None)
            guid = f"{split}-{level}-{example_id}-{number}"
            if level is None:
                skipped.skip(guid, "example_id(s) not starting with 'middle' or 'high'")
                continue
            example = make_race_example(guid, level, article, question, options, answer, skipped)
            if example is not None:
                examples.append(example)
        skipped.warn()
        splits[split] = examples
    if not splits:
        raise ValueError(f"'{directory}' has no train, validation or test split; pass a race dataset.")
    return splits
