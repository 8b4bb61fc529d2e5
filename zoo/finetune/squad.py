"""SQuAD 1.1 / 2.0: reading, document-stride windows, and n-best span decoding.

Layout read by :func:`read_squad`: the official JSON (``data -> paragraphs -> qas``; v2.0 adds
``is_impossible`` and ``plausible_answers``), read with :mod:`json` since it is one nested object;
or, for a directory, the Hugging Face squad / squad_v2 layout on disk, or for ``hub:squad`` /
``hub:squad_v2`` the hub dataset itself through ``datasets.load_dataset`` (see
:mod:`zoo.finetune.hub_layouts`; a question without answers is impossible there).

Input (as BERT's run_squad builds it): ``[CLS] question [SEP] context window [SEP]``. The question
keeps its first ``max_query_length`` tokens. The context is cut into windows of at most
``max_seq_length - len(question) - 3`` tokens whose starts are ``doc_stride`` tokens apart (the
BERT/Megatron meaning of the stride: the step between windows, not their overlap). Token
character offsets come from the fast tokenizer, so spans map back to the exact context characters.

Bad input (policy of :mod:`zoo.finetune.skips`): a missing file, text that is not JSON or JSON
without a ``data`` list of articles with paragraphs raises ``MissingInput``/``UserError``
naming it; a question with a duplicate id, an answer whose ``answer_start`` does not point at its
text in the context, an empty answer text, an answerable question without answers, an impossible
one with answers, or a context or question longer than :data:`~zoo.finetune.examples.MAX_TEXT_CHARS`
is skipped and counted, with one :class:`~zoo.finetune.skips.MalformedExampleWarning` per file.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from zoo.errors import MissingInput, UserError
from zoo.finetune.examples import SquadExample, make_squad_example
from zoo.finetune.hub_names import is_hub_name
from zoo.finetune.skips import SkippedExamples

SQUAD_FILES = {"1.1": ("train-v1.1.json", "dev-v1.1.json"), "2.0": ("train-v2.0.json", "dev-v2.0.json")}

Offset = tuple[int, int] | None


@dataclass
class SquadFeatures:
    """Windows of the examples as model inputs.

    ``tensors``: ``input_ids``, ``token_type_ids``, ``attention_mask`` (F, L) and
    ``start_positions``, ``end_positions`` (F,) int64, the answer's token indices inside the
    window (0, the ``[CLS]`` token, when the example is impossible or the answer is not wholly in
    this window). ``example_index[f]`` is the example of window ``f``; ``offsets[f][t]`` is the
    context character span ``(start, end)`` of token ``t``, None for question, special and pad
    tokens. ``max_context[f][t]``: window ``f`` is the one where context token ``t`` has the most
    context on both sides (BERT's rule: the largest min(left, right) + 0.01 * window length), so a
    span starting there is decoded from this window only, as BERT's and Megatron's SQuAD code do.
    """

    tensors: dict[str, torch.Tensor]
    example_index: list[int] = field(default_factory=list)
    offsets: list[list[Offset]] = field(default_factory=list)
    max_context: list[list[bool]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.example_index)


def _not_squad(path: Path) -> UserError:
    return UserError(
        f"'{path}' is not SQuAD JSON (data -> paragraphs -> context, qas); pass the official train/dev file."
    )


def read_squad_json(path: str | os.PathLike) -> list[SquadExample]:
    """The questions of an official SQuAD v1.1 or v2.0 JSON file, malformed ones skipped."""
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"SQuAD file '{path}' does not exist; pass the path of the official JSON file.")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"'{path}' is not JSON; pass the official SQuAD train/dev JSON file.") from None
    if not isinstance(record, dict) or not isinstance(record.get("data"), list):
        raise _not_squad(path)
    skipped, seen_ids, examples = SkippedExamples(str(path)), set(), []
    for article in record["data"]:
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            raise _not_squad(path)
        for paragraph in article["paragraphs"]:
            if not isinstance(paragraph, dict) or not isinstance(paragraph.get("context"), str):
                raise _not_squad(path)
            if not isinstance(paragraph.get("qas"), list):
                raise _not_squad(path)
            for qa in paragraph["qas"]:
                qid, question = qa.get("id"), qa.get("question")
                if not isinstance(qid, str) or not isinstance(question, str):
                    skipped.skip(str(qid), "question(s) without an id or question text")
                    continue
                answers = [(a.get("text"), a.get("answer_start")) for a in qa.get("answers", []) if isinstance(a, dict)]
                example = make_squad_example(qid, question, paragraph["context"], answers,
                                             bool(qa.get("is_impossible", False)), skipped, seen_ids)
                if example is not None:
                    examples.append(example)
    skipped.warn()
    return examples


def read_squad(path: str | os.PathLike, split: str | None = None) -> list[SquadExample]:
    """Examples of a SQuAD JSON file, or of ``split`` ("train" or "dev") of a hub layout directory."""
    path = Path(path)
    if not path.is_dir():
        return read_squad_json(path)
    from zoo.finetune import hub_layouts  # imports `datasets`, which is slow: only when needed

    if split is None:
        raise UserError(
            f"'{path}' is a directory; pass a SQuAD JSON file, or split='train' or 'dev' for a "
            "Hugging Face squad layout."
        )
    splits = hub_layouts.read_squad_hub(path)
    if split not in splits:
        raise UserError(f"'{path}' has no '{split}' split (it has {', '.join(splits)}); pass one of those.")
    return splits[split]


def read_squad_dir(data_dir: str | os.PathLike, version: str | None = None) -> dict[str, list[SquadExample]]:
    """The "train" and/or "dev" examples of ``data_dir``.

    They come from the official files of ``version`` ("1.1" or "2.0"; None takes whichever is
    there) or, without them, from a Hugging Face squad/squad_v2 layout; ``hub:squad`` or
    ``hub:squad_v2`` loads the hub dataset.
    """
    if is_hub_name(data_dir):
        from zoo.finetune import hub_layouts  # imports `datasets`, which is slow: only when needed

        return hub_layouts.read_squad_hub(data_dir)
    directory = Path(data_dir)
    if not directory.is_dir():
        raise MissingInput(
            f"SQuAD data directory '{directory}' does not exist; pass --data-dir with the SQuAD JSON files "
            "or the hub dataset's name, hub:squad or hub:squad_v2."
        )
    if version is not None and version not in SQUAD_FILES:
        raise UserError(f"unknown SQuAD version '{version}'; use '1.1' or '2.0'.")
    present = {v: names for v, names in SQUAD_FILES.items() if any((directory / n).is_file() for n in names)}
    if version is None and len(present) > 1:
        raise UserError(f"'{directory}' holds both SQuAD 1.1 and 2.0 files; pass version '1.1' or '2.0'.")
    chosen = version or next(iter(present), None)
    if chosen in present:
        train_name, dev_name = SQUAD_FILES[chosen]
        return {split: read_squad_json(directory / name) for split, name in (("train", train_name), ("dev", dev_name))
                if (directory / name).is_file()}
    from zoo.finetune import hub_layouts  # imports `datasets`, which is slow: only when needed

    if hub_layouts.is_hub_layout(directory):
        return hub_layouts.read_squad_hub(directory)
    names = " or ".join(", ".join(SQUAD_FILES[v]) for v in ([chosen] if chosen else SQUAD_FILES))
    raise UserError(f"no SQuAD split found in '{directory}'; put {names} there or a Hugging Face squad layout.")


def _windows(num_tokens: int, window_length: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) of each window; starts ``doc_stride`` apart, the last one reaches the end."""
    windows, start = [], 0
    while True:
        length = min(num_tokens - start, window_length)
        windows.append((start, length))
        if start + length >= num_tokens:
            return windows
        start += min(length, doc_stride)


def _answer_token_span(example: SquadExample, offsets: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """First and last context token of the first answer, or None when impossible."""
    if example.is_impossible or not example.answers:
        return None
    text, char_start = example.answers[0]
    char_end = char_start + len(text)
    covering = [t for t, (start, end) in enumerate(offsets) if end > char_start and start < char_end]
    return (covering[0], covering[-1]) if covering else None


def featurize_squad(
    examples: Sequence[SquadExample],
    tokenizer,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
) -> SquadFeatures:
    """Document-stride windows ``[CLS] question [SEP] context window [SEP]`` of every example."""
    if max_seq_length - max_query_length - 3 < 1:
        raise UserError(
            f"max_seq_length={max_seq_length} leaves no room for context after a {max_query_length}-token question; "
            "raise max_seq_length or lower max_query_length."
        )
    if doc_stride < 1:
        raise UserError(f"doc_stride={doc_stride} must be a positive number of tokens (128 is usual).")
    if examples:
        questions = tokenizer([e.question for e in examples], add_special_tokens=False)["input_ids"]
        contexts = tokenizer([e.context for e in examples], add_special_tokens=False, return_offsets_mapping=True)
    cls_id, sep_id, pad_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
    rows: dict[str, list[list[int] | int]] = defaultdict(list)
    example_index, all_offsets, all_max_context = [], [], []
    for i, example in enumerate(examples):
        question = questions[i][:max_query_length]
        doc_ids = contexts["input_ids"][i]
        doc_offsets = [tuple(o) for o in contexts["offset_mapping"][i]]
        answer_span = _answer_token_span(example, doc_offsets)
        prefix = len(question) + 2  # [CLS] question [SEP]
        windows = _windows(len(doc_ids), max_seq_length - prefix - 1, doc_stride)
        best_window = _best_context_windows(len(doc_ids), windows)
        for w, (start, length) in enumerate(windows):
            all_max_context.append([False] * prefix + [best_window[p] == w for p in range(start, start + length)]
                                   + [False] * (max_seq_length - prefix - length))
            ids = [cls_id, *question, sep_id, *doc_ids[start : start + length], sep_id]
            padding = max_seq_length - len(ids)
            rows["input_ids"].append(ids + [pad_id] * padding)
            rows["token_type_ids"].append([0] * prefix + [1] * (length + 1) + [0] * padding)
            rows["attention_mask"].append([1] * len(ids) + [0] * padding)
            all_offsets.append([None] * prefix + doc_offsets[start : start + length] + [None] * (padding + 1))
            if answer_span is not None and start <= answer_span[0] and answer_span[1] < start + length:
                rows["start_positions"].append(prefix + answer_span[0] - start)
                rows["end_positions"].append(prefix + answer_span[1] - start)
            else:
                rows["start_positions"].append(0)
                rows["end_positions"].append(0)
            example_index.append(i)
    tensors = {}
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        tensors[key] = torch.tensor(rows[key], dtype=torch.long).reshape(-1, max_seq_length)
    for key in ("start_positions", "end_positions"):
        tensors[key] = torch.tensor(rows[key], dtype=torch.long)
    return SquadFeatures(tensors=tensors, example_index=example_index, offsets=all_offsets,
                         max_context=all_max_context)


def _best_context_windows(num_tokens: int, windows: Sequence[tuple[int, int]]) -> list[int]:
    """For each context token, the window where it has the most context (ties: the first)."""
    best, best_score = [0] * num_tokens, [-math.inf] * num_tokens
    for w, (start, length) in enumerate(windows):
        for p in range(start, start + length):
            score = min(p - start, start + length - 1 - p) + 0.01 * length
            if score > best_score[p]:
                best[p], best_score[p] = w, score
    return best


def _as_numpy(logits) -> np.ndarray:
    """Logits from a torch tensor (any device or dtype) or anything array-like."""
    if hasattr(logits, "detach"):
        logits = logits.detach().float().cpu().numpy()
    return np.asarray(logits, dtype=np.float64)


def decode_predictions(
    examples: Sequence[SquadExample],
    features: SquadFeatures,
    start_logits,
    end_logits,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    version_2_with_negative: bool = False,
    null_score_diff_threshold: float = 0.0,
) -> tuple[dict[str, str], dict[str, float]]:
    """Answer text and no-answer score of each example from window logits (F, L).

    Over every window of an example, the ``n_best_size`` highest start and end logits are paired
    (end >= start, at most ``max_answer_length`` tokens, both tokens in the context, the start token
    in its max-context window) and the pair
    with the highest start + end logit is the best span; its text is the context between the
    characters of the two tokens. The null score is the lowest ``start[0] + end[0]`` ([CLS]) over
    the windows. With ``version_2_with_negative``, the answer is "" when null - best >
    ``null_score_diff_threshold`` (or when there is no span at all).

    The no-answer score returned for every example is ``sigmoid(null - best)`` (1.0 without any
    span): monotone in the margin the decision uses, so the official best-threshold search on it
    finds the same cut as tuning ``null_score_diff_threshold`` (diff threshold = logit(prob
    threshold)).
    """
    starts, ends = _as_numpy(start_logits), _as_numpy(end_logits)
    expected = (len(features), features.tensors["input_ids"].shape[1])
    if starts.shape != expected or ends.shape != expected:
        raise UserError(
            f"start/end logits of shape {starts.shape}/{ends.shape} do not match the {expected} features; "
            "pass one row per window."
        )
    windows_of = defaultdict(list)
    for f, i in enumerate(features.example_index):
        windows_of[i].append(f)
    predictions, na_probs = {}, {}
    for i, example in enumerate(examples):
        best_score, best_chars, null_score = -math.inf, None, math.inf
        for f in windows_of[i]:
            start, end, offsets = starts[f], ends[f], features.offsets[f]
            null_score = min(null_score, float(start[0] + end[0]))
            top_starts = np.argsort(-start, kind="stable")[:n_best_size]
            top_ends = np.argsort(-end, kind="stable")[:n_best_size]
            max_context = features.max_context[f] if features.max_context else None
            for s in top_starts:
                if offsets[s] is None or (max_context is not None and not max_context[s]):
                    continue
                for e in top_ends:
                    if offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                        continue
                    score = float(start[s] + end[e])
                    if score > best_score:
                        best_score, best_chars = score, (offsets[s][0], offsets[e][1])
        if best_chars is None:
            predictions[example.qid], na_probs[example.qid] = "", 1.0
            continue
        margin = null_score - best_score
        na_probs[example.qid] = 1.0 / (1.0 + math.exp(-margin)) if margin > -700 else 0.0
        answer_is_null = version_2_with_negative and margin > null_score_diff_threshold
        predictions[example.qid] = "" if answer_is_null else example.context[best_chars[0] : best_chars[1]]
    return predictions, na_probs
