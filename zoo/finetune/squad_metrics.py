"""The official SQuAD v1.1 / v2.0 scores: exact match and F1 after answer normalisation.

Follows the official v2.0 evaluation script (which on v1.1 data gives v1.1's numbers):

- ``normalize_answer``: lower-case, drop punctuation, drop the articles a/an/the, collapse
  whitespace. A gold answer that normalises to nothing is ignored; a question with no gold answer
  left (v2 impossible) has the single gold answer "". Scores are the maximum over gold answers.
- F1 is over normalised whitespace tokens; if either side is empty it is 1 when both are.
- ``na_probs`` (question id -> no-answer probability; 0 for all without them): a question whose
  probability exceeds ``na_prob_thresh`` counts as answered "" . The result holds ``exact``, ``f1``,
  ``total`` and, for the non-empty subsets, ``HasAns_*`` and ``NoAns_*`` (exact, f1, total), all
  scores in percent. With ``na_probs`` given it also holds ``best_exact``, ``best_exact_thresh``,
  ``best_f1``, ``best_f1_thresh``: the best scores over all no-answer thresholds, found on the raw
  (un-thresholded) scores.

Bad input: a question without a prediction scores 0 (as the v1.1 script does) and a question
without a no-answer probability gets 0; each kind is counted and reported in one
:class:`~zoo.finetune.skips.MalformedExampleWarning`. Predictions or probabilities that are not a
JSON object of question id -> text / number raise ``ValueError``.
"""

from __future__ import annotations

import os
import re
import string
from collections import Counter
from typing import Mapping, Sequence

from zoo.finetune.skips import SkippedExamples
from zoo.finetune.squad import SquadExample, read_squad

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(s: str) -> str:
    """Lower-case, without punctuation and articles, whitespace collapsed to single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match_score(pred: str, gold: str) -> int:
    return int(normalize_answer(pred) == normalize_answer(gold))


def f1_score(pred: str, gold: str) -> float:
    pred_tokens, gold_tokens = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    shared = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(pred_tokens), shared / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def gold_answers(example: SquadExample) -> list[str]:
    """The gold texts that normalise to something, or [""] when none does."""
    return [text for text, _ in example.answers if normalize_answer(text)] or [""]


def _percent(scores: Mapping[str, float], qids: Sequence[str]) -> float:
    return 100.0 * sum(scores[q] for q in qids) / len(qids)


def _best_threshold(
    raw: Mapping[str, float],
    na_probs: Mapping[str, float],
    has_answer: Mapping[str, bool],
    answered: Mapping[str, bool],
) -> tuple[float, float]:
    """Best percent score and its threshold: start with every question answered "" and, in order
    of rising no-answer probability, let each question keep its prediction instead (for a
    no-answer question that costs 1 exactly when its prediction is not the empty string, as in the
    official script, even if the text normalises to nothing)."""
    score = best = sum(1 for q in raw if not has_answer[q])
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        score += raw[qid] if has_answer[qid] else -float(answered[qid])
        if score > best:
            best, best_thresh = score, na_probs[qid]
    return 100.0 * best / len(raw), float(best_thresh)


def _check_mapping(mapping, what: str, value_types: tuple[type, ...], value_name: str) -> None:
    if not isinstance(mapping, Mapping) or not all(
        isinstance(key, str) and isinstance(value, value_types) for key, value in mapping.items()
    ):
        raise ValueError(
            f"the {what} must be a JSON object mapping question id to {value_name}; write them in the official format."
        )


def squad_scores(
    dataset: Sequence[SquadExample] | str | os.PathLike,
    predictions: Mapping[str, str],
    na_probs: Mapping[str, float] | None = None,
    na_prob_thresh: float = 1.0,
) -> dict[str, float | int]:
    """Official SQuAD scores of ``predictions`` (question id -> answer text, "" for no answer)."""
    examples = read_squad(dataset) if isinstance(dataset, (str, os.PathLike)) else list(dataset)
    if not examples:
        raise ValueError("the SQuAD dataset has no questions; pass the dev file the predictions were made for.")
    _check_mapping(predictions, "predictions", (str,), "answer text")
    if na_probs is not None:
        _check_mapping(na_probs, "no-answer probabilities", (int, float), "a number")
    missing = SkippedExamples("SQuAD scoring", headline="{count} question(s) lacked an input")
    has_answer = {e.qid: not e.is_impossible and bool(e.answers) for e in examples}
    exact_raw, f1_raw = {}, {}
    # In the probabilities' own order, as the official script sorts them (it matters for ties).
    probs = {q: float(p) for q, p in (na_probs or {}).items() if q in has_answer}
    for example in examples:
        if example.qid in predictions:
            golds, pred = gold_answers(example), predictions[example.qid]
            exact_raw[example.qid] = float(max(exact_match_score(pred, g) for g in golds))
            f1_raw[example.qid] = max(f1_score(pred, g) for g in golds)
        else:
            missing.skip(example.qid, "without a prediction, scored 0")
            exact_raw[example.qid] = f1_raw[example.qid] = 0.0
        if example.qid not in probs:
            if na_probs is not None:
                missing.skip(example.qid, "without a no-answer probability, taken as 0")
            probs[example.qid] = 0.0
    missing.warn()

    def thresholded(raw: Mapping[str, float]) -> dict[str, float]:
        return {q: (float(not has_answer[q]) if probs[q] > na_prob_thresh else s) for q, s in raw.items()}

    exact, f1 = thresholded(exact_raw), thresholded(f1_raw)
    qids = [e.qid for e in examples]
    result: dict[str, float | int] = {"exact": _percent(exact, qids), "f1": _percent(f1, qids), "total": len(qids)}
    for prefix, answerable in (("HasAns", True), ("NoAns", False)):
        subset = [q for q in qids if has_answer[q] == answerable]
        if subset:
            result[f"{prefix}_exact"] = _percent(exact, subset)
            result[f"{prefix}_f1"] = _percent(f1, subset)
            result[f"{prefix}_total"] = len(subset)
    if na_probs is not None:
        answered = {q: predictions.get(q, None) != "" for q in qids}  # a missing prediction is wrong
        result["best_exact"], result["best_exact_thresh"] = _best_threshold(exact_raw, probs, has_answer, answered)
        result["best_f1"], result["best_f1_thresh"] = _best_threshold(f1_raw, probs, has_answer, answered)
    return result
