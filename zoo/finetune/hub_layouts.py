"""Hugging Face hub datasets, by name or already on disk, read into the finetune example dataclasses.

``--data-dir hub:NAME[/CONFIG]`` (see :mod:`zoo.finetune.hub_names`) loads the dataset with
``datasets.load_dataset(NAME, CONFIG)``: from the local cache, from the hub when online, or from a
local dataset repository in the hub's layout (split files and the dataset card's ``configs:``).
Two layouts of one dataset configuration are also recognised in a plain directory:

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
column raises ``UserError``.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

import datasets

from zoo.errors import MissingInput, UserError
from zoo.finetune.examples import (
    PairExample,
    RaceExample,
    SquadExample,
    make_race_example,
    make_squad_example,
    over_long,
)
from zoo.finetune.hub_names import HUB_PREFIX, TASK_EXAMPLES, is_hub_name, split_hub_name
from zoo.finetune.skips import SkippedExamples

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


def load_hub_splits(source: str | os.PathLike, task: str) -> dict[str, datasets.Dataset]:
    """The hub splits (by their hub names) of ``hub:NAME[/CONFIG]``, of a save_to_disk directory or
    of parquet files; ``task`` tells which configurations a ``hub:`` name may end with."""
    if is_hub_name(source):
        return load_hub_dataset(str(source), task)
    directory = Path(source)
    if (directory / "dataset_dict.json").is_file():
        return dict(datasets.load_from_disk(str(directory)))
    files = _parquet_files(directory)
    if not files:
        raise UserError(
            f"'{directory}' holds neither dataset_dict.json nor hub parquet files; "
            "pass a save_to_disk directory or a hub dataset download."
        )
    return {split: datasets.Dataset.from_parquet(paths, keep_in_memory=True) for split, paths in files.items()}


def _fetch_command(name: str, config: str | None) -> str:
    arguments = repr(name) + (f", {config!r}" if config else "")
    return f'python -c "import datasets; datasets.load_dataset({arguments})"'


def load_hub_dataset(data_dir: str, task: str) -> dict[str, datasets.Dataset]:
    """``datasets.load_dataset(NAME, CONFIG)`` of ``hub:NAME[/CONFIG]`` as {hub split: Dataset}.

    Offline (``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE``) it reads the local cache; a dataset that
    is not there, a name the hub does not know and a configuration the dataset lacks are each one
    sentence naming the dataset and the fix.
    """
    name, config = split_hub_name(data_dir, task)
    shown = f"{name}/{config}" if config else name
    refuse_task_files(data_dir, name)
    try:
        loaded = datasets.load_dataset(name, config)
    except datasets.exceptions.DatasetGenerationError as err:
        detail = (str(err.__cause__ or err).strip().splitlines() or [type(err).__name__])[0].rstrip(".:")
        raise UserError(
            f"hub dataset {shown} cannot be built by datasets.load_dataset ({detail}: its files do not form one "
            f"table per split); pass a dataset in the hub's layout, e.g. --data-dir {TASK_EXAMPLES[task]}, or the "
            "task's original files as --data-dir DIR without hub:."
        ) from None
    except ConnectionError:
        if datasets.config.HF_HUB_OFFLINE:
            raise MissingInput(
                f"hub dataset {shown} is not in the local Hugging Face cache and offline mode is on "
                "(HF_DATASETS_OFFLINE or HF_HUB_OFFLINE); fetch it once where the hub can be reached, with "
                f"HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 {_fetch_command(name, config)}, then rerun."
            ) from None
        raise MissingInput(
            f"the Hugging Face hub cannot be reached to fetch dataset {shown}; run where it can be reached "
            f"({_fetch_command(name, config)} fills the cache), then rerun with HF_DATASETS_OFFLINE=1."
        ) from None
    except FileNotFoundError:
        raise MissingInput(
            f"hub dataset {name!r} does not exist or cannot be accessed; pass hub:NAME[/CONFIG] of a dataset "
            f"on the hub or a local dataset repository, e.g. --data-dir {TASK_EXAMPLES[task]}."
        ) from None
    except ValueError as err:
        if "config" not in str(err).lower():
            raise
        problem = f"has no configuration {config!r}" if config else "needs a configuration"
        raise UserError(
            f"hub dataset {name} {problem} ({str(err).splitlines()[0]}); pass hub:{name}/CONFIG with one of its "
            f"configurations, e.g. --data-dir {TASK_EXAMPLES[task]}."
        ) from None
    if not isinstance(loaded, datasets.DatasetDict):
        raise UserError(f"hub dataset {shown} did not load as a dictionary of splits; pass a dataset with "
                         "train/validation splits.")
    return dict(loaded)


# File names of the tasks' original distributions (GLUE TSV, SQuAD JSON): a directory holding them is read by
# the task's own reader (--data-dir DIR), never by datasets.load_dataset.
_ORIGINAL_FILES = ("train.tsv", "dev.tsv", "dev_matched.tsv", "dev_mismatched.tsv", "test.tsv", "train-v1.1.json",
                   "dev-v1.1.json", "train-v2.0.json", "dev-v2.0.json")


def refuse_task_files(data_dir: str, name: str) -> None:
    """Refuse ``hub:DIR`` where DIR is a local directory of a task's original files (GLUE's TSV, SQuAD's
    JSON): ``datasets.load_dataset`` would read them as one table with another schema per file and fail
    after writing to its cache; the task's reader reads them as ``--data-dir DIR``."""
    for candidate in dict.fromkeys((data_dir[len(HUB_PREFIX):].strip().rstrip("/"), name)):
        directory = Path(candidate)
        found = [file for file in _ORIGINAL_FILES if (directory / file).is_file()] if directory.is_dir() else []
        if found:
            raise UserError(
                f"--data-dir {data_dir} is a local directory of the task's original files ({', '.join(found)}), "
                f"which hub: does not read (it loads Hugging Face datasets); pass --data-dir {directory} without "
                "hub: to read them."
            )


def _label(source: str | os.PathLike) -> str | Path:
    """How messages and warnings name the source: the ``hub:`` text as typed, else the directory."""
    return source if is_hub_name(source) else Path(source)


def _require_columns(dataset: datasets.Dataset, columns, where: str | Path, split: str) -> None:
    for column in columns:
        if column not in dataset.column_names:
            raise UserError(
                f"split '{split}' of '{where}' has no '{column}' column "
                f"(it has {', '.join(dataset.column_names)}); "
                "pass the matching Hugging Face dataset configuration."
            )


def read_glue_hub(source: str | os.PathLike, task: str) -> dict[str, list[PairExample]]:
    """glue/mnli or glue/qqp (a ``hub:`` name or a directory) as :class:`PairExample` splits (see
    the module docstring)."""
    where = _label(source)
    split_names, (column_a, column_b), hub_names, our_ids = _GLUE[task]
    splits = {}
    for hub_split, dataset in load_hub_splits(source, task).items():
        if hub_split not in split_names:
            continue
        _require_columns(dataset, (column_a, column_b, "label"), where, hub_split)
        label_feature = dataset.features["label"]
        names = tuple(label_feature.names) if isinstance(label_feature, datasets.ClassLabel) else hub_names
        if any(name not in our_ids for name in names):
            raise UserError(
                f"the label names {', '.join(names)} of '{where}' are not those of glue/{task}; "
                f"pass the glue/{task} dataset."
            )
        rows = dataset.to_dict()
        if all(label == -1 for label in rows["label"]):
            continue  # the hub's unlabelled test split
        split = split_names[hub_split]
        skipped = SkippedExamples(f"{where} [{hub_split}]")
        ids = rows.get("idx", range(len(rows["label"])))
        examples = []
        for row_id, text_a, text_b, label in zip(ids, rows[column_a], rows[column_b], rows["label"]):
            if not isinstance(label, int) or not 0 <= label < len(names):
                skipped.skip(str(row_id), f"label(s) outside 0..{len(names) - 1}")
                continue
            too_long = over_long([text_a, text_b])
            if too_long:
                skipped.skip(str(row_id), too_long)
                continue
            label_id = our_ids[names[label]]
            examples.append(PairExample(guid=f"{split}-{row_id}", text_a=text_a, text_b=text_b, label=label_id))
        skipped.warn()
        splits[split] = examples
    if not splits:
        raise UserError(f"'{where}' has no labelled {', '.join(split_names)} split; pass a glue/{task} dataset.")
    return splits


def read_squad_hub(source: str | os.PathLike) -> dict[str, list[SquadExample]]:
    """squad or squad_v2 (a ``hub:`` name or a directory) as "train"/"dev" :class:`SquadExample` lists."""
    where = _label(source)
    splits = {}
    for hub_split, dataset in load_hub_splits(source, "squad").items():
        if hub_split not in ("train", "validation"):
            continue
        _require_columns(dataset, ("id", "context", "question", "answers"), where, hub_split)
        skipped, seen_ids, examples = SkippedExamples(f"{where} [{hub_split}]"), set(), []
        rows = dataset.to_dict()
        for qid, context, question, answers in zip(rows["id"], rows["context"], rows["question"], rows["answers"]):
            pairs = list(zip(answers["text"], answers["answer_start"]))
            example = make_squad_example(qid, question, context, pairs, not pairs, skipped, seen_ids)
            if example is not None:
                examples.append(example)
        skipped.warn()
        splits[_EVAL_SPLITS[hub_split]] = examples
    if not splits:
        raise UserError(f"'{where}' has no train or validation split; pass a squad or squad_v2 dataset.")
    return splits


def read_race_hub(source: str | os.PathLike) -> dict[str, list[RaceExample]]:
    """race/all (or middle, high; a ``hub:`` name or a directory) as "train"/"dev"/"test"
    :class:`RaceExample` lists."""
    where = _label(source)
    splits = {}
    for hub_split, dataset in load_hub_splits(source, "race").items():
        if hub_split not in _EVAL_SPLITS:
            continue
        _require_columns(dataset, ("example_id", "article", "question", "options", "answer"), where, hub_split)
        split = _EVAL_SPLITS[hub_split]
        skipped, examples, questions_seen = SkippedExamples(f"{where} [{hub_split}]"), [], defaultdict(int)
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
        raise UserError(f"'{where}' has no train, validation or test split; pass a race dataset.")
    return splits
