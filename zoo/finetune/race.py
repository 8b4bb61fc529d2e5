"""RACE: reading the directory tree, one four-sequence input per question, and accuracy by level.

Layout read by :func:`read_race`: ``data_dir/{train,dev,test}/{middle,high}/*.txt``, each file one
JSON object ``{"id", "article", "questions": [...], "options": [[4 strings], ...], "answers":
["A".."D", ...]}``; the level comes from the directory. When no such tree is there: the Hugging
Face race/all (or race/middle, race/high) layout on disk; for ``data_dir`` ``hub:race/all``, the hub
dataset itself through ``datasets.load_dataset``; see :mod:`zoo.finetune.hub_layouts`.

Input (as Megatron-LM builds it): for each of the four options, ``[CLS] q_with_option [SEP] article
[SEP]``, where ``q_with_option`` is the question with every ``_`` replaced by the option, or the
question, a space and the option when it has no ``_``. Over-long pairs lose the end of the article
first (and the end of the question only if it alone does not fit).

Bad input (policy of :mod:`zoo.finetune.skips`): a missing directory, a file that is not a JSON
object with ``article``, ``questions``, ``options`` and ``answers`` (lists of one length), or a
directory without any split raises ``MissingInput``/``UserError`` naming it; a question
without exactly four options, with an answer letter outside A-D or with a text (article, question,
option) longer than :data:`~zoo.finetune.examples.MAX_TEXT_CHARS` is skipped and counted, with one
:class:`~zoo.finetune.skips.MalformedExampleWarning` per split directory; a split directory whose every
question is skipped is a ``UserError`` saying why (not a split found empty).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from zoo.errors import MissingInput, UserError
from zoo.finetune.examples import ANSWER_LETTERS, RaceExample, make_race_example
from zoo.finetune.glue import as_class_ids
from zoo.finetune.hub_names import is_hub_name
from zoo.finetune.skips import SkippedExamples

RACE_SPLITS = ("train", "dev", "test")
RACE_LEVELS = ("middle", "high")


def read_race_file(path: str | os.PathLike, split: str, level: str, skipped: SkippedExamples) -> list[RaceExample]:
    """The questions of one RACE ``.txt`` file (one JSON object); malformed ones go to ``skipped``."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"'{path}' is not a JSON object; each RACE .txt file must hold one JSON object.") from None
    expected_types = {"article": str, "questions": list, "options": list, "answers": list}
    if not isinstance(record, dict) or not all(isinstance(record.get(k), t) for k, t in expected_types.items()):
        raise UserError(
            f"'{path}' lacks one of {', '.join(expected_types)}; each RACE file needs an article and lists of "
            "questions, options and answers."
        )
    if not len(record["questions"]) == len(record["options"]) == len(record["answers"]):
        raise UserError(
            f"'{path}' has questions, options and answers lists of different lengths; "
            "give one entry per question in each."
        )
    file_id = str(record.get("id", path.name))
    examples = []
    questions = zip(record["questions"], record["options"], record["answers"])
    for number, (question, options, answer) in enumerate(questions):
        guid = f"{split}-{level}-{file_id}-{number}"
        example = make_race_example(guid, level, record["article"], question, options, answer, skipped)
        if example is not None:
            examples.append(example)
    return examples


def read_race(data_dir: str | os.PathLike) -> dict[str, list[RaceExample]]:
    """RACE splits present in ``data_dir`` (or ``hub:race/all``): some of "train", "dev", "test"; one
    example per question."""
    if is_hub_name(data_dir):
        from zoo.finetune import hub_layouts  # imports `datasets`, which is slow: only when needed

        return hub_layouts.read_race_hub(data_dir)
    directory = Path(data_dir)
    if not directory.is_dir():
        raise MissingInput(
            f"RACE data directory '{directory}' does not exist; pass --data-dir with the RACE train/dev/test tree "
            "or the hub dataset's name, hub:race/all."
        )
    splits = {}
    for split in RACE_SPLITS:
        level_dirs = [(level, directory / split / level) for level in RACE_LEVELS]
        level_dirs = [(level, path) for level, path in level_dirs if path.is_dir()]
        if not level_dirs:
            continue
        skipped = SkippedExamples(str(directory / split))
        examples = []
        for level, level_dir in level_dirs:
            for path in sorted(level_dir.glob("*.txt")):
                examples.extend(read_race_file(path, split, level, skipped))
        if not examples and skipped.count:
            raise UserError(every_question_skipped(directory / split, skipped))
        skipped.warn()
        splits[split] = examples
    if splits:
        return splits
    from zoo.finetune import hub_layouts  # imports `datasets`, which is slow: only when needed

    if hub_layouts.is_hub_layout(directory):
        return hub_layouts.read_race_hub(directory)
    raise UserError(
        f"no RACE split found in '{directory}'; it needs train|dev|test/middle|high/*.txt or a "
        "Hugging Face race layout (a save_to_disk directory or parquet files)."
    )


def every_question_skipped(split_dir: Path, skipped: SkippedExamples) -> str:
    """The sentence for a split whose every question was skipped: it was found, and why it has no example
    (the multiple-choice head scores exactly four options, A-D, per question)."""
    why = "; ".join(f"{n} {reason}" for reason, n in skipped.reasons.most_common())
    return (f"all {skipped.count} questions in {split_dir} were skipped ({why}), because zoo's RACE head scores "
            f"exactly {len(ANSWER_LETTERS)} options (A-D) per question; give every question {len(ANSWER_LETTERS)} "
            "text options and an answer letter A-D.")


def question_with_option(question: str, option: str) -> str:
    """The question with each ``_`` replaced by the option, else the question, a space, the option."""
    return question.replace("_", option) if "_" in question else f"{question} {option}"


def _pair_ids(
    first: list[int], second: list[int], max_seq_length: int, cls_id: int, sep_id: int
) -> tuple[list[int], list[int]]:
    """``[CLS] first [SEP] second [SEP]`` ids and token types; ``second`` is cut first."""
    budget = max_seq_length - 3
    second = second[: max(budget - len(first), 0)]
    first = first[: budget - len(second)]
    ids = [cls_id, *first, sep_id, *second, sep_id]
    types = [0] * (len(first) + 2) + [1] * (len(second) + 1)
    return ids, types


def encode_race(examples: Sequence[RaceExample], tokenizer, max_seq_length: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``token_type_ids``, ``attention_mask`` (N, 4, L) and ``labels`` (N,), int64."""
    if max_seq_length < 5:
        raise UserError(
            f"max_seq_length={max_seq_length} leaves no room for a question and an article; "
            "use at least 5 (512 is usual)."
        )
    count, num_options = len(examples), len(ANSWER_LETTERS)
    input_ids = torch.full((count, num_options, max_seq_length), tokenizer.pad_token_id, dtype=torch.long)
    token_type_ids = torch.zeros_like(input_ids)
    attention_mask = torch.zeros_like(input_ids)
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    if count:
        articles = tokenizer([e.article for e in examples], add_special_tokens=False)["input_ids"]
        questions = tokenizer(
            [question_with_option(e.question, option) for e in examples for option in e.options],
            add_special_tokens=False,
        )["input_ids"]
        for i in range(count):
            for j in range(num_options):
                question = questions[i * num_options + j]
                ids, types = _pair_ids(question, articles[i], max_seq_length, cls_id, sep_id)
                input_ids[i, j, : len(ids)] = torch.tensor(ids)
                token_type_ids[i, j, : len(ids)] = torch.tensor(types)
                attention_mask[i, j, : len(ids)] = 1
    labels = torch.tensor([e.label for e in examples], dtype=torch.long)
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask,
            "labels": labels}


def race_accuracy(predictions, examples: Sequence[RaceExample]) -> dict[str, float]:
    """Accuracy (fraction) on "middle", "high" and "all"; NaN for a level without examples.

    ``predictions`` are option ids (N,) or option scores (N, 4), in the order of ``examples``.
    """
    predicted = as_class_ids(predictions)
    if predicted.shape != (len(examples),):
        raise UserError(f"{len(predicted)} predictions for {len(examples)} RACE examples; pass one per example.")
    correct = predicted == np.array([e.label for e in examples], dtype=np.int64)
    levels = np.array([e.level for e in examples])
    accuracy = {}
    masks = {"middle": levels == "middle", "high": levels == "high", "all": np.ones(len(examples), dtype=bool)}
    for name, mask in masks.items():
        accuracy[name] = float(correct[mask].mean()) if mask.any() else float("nan")
    return accuracy
