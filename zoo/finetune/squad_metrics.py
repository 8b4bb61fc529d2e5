"""The official SQuAD v1.1 / v2.0 scores, equal to ``evaluate-v1.1.py`` / ``evaluate-v2.0.py``.

The scorer reads only what the official scripts read: each question's id and its gold answer
texts (``answer_start``, contexts and ``is_impossible`` play no part), every question of the file
in file order. Nothing is skipped: the training reader (:mod:`zoo.finetune.squad`) may drop
malformed examples, the scorer may not.

Shared definitions:

- ``normalize_answer``: lower-case, drop punctuation, drop the whole words a/an/the, collapse
  whitespace. Exact match compares normalised strings; F1 is over the normalised whitespace tokens
  (shared tokens counted with multiplicity). A question's score is the maximum over its gold texts.

**v1.1** (:func:`squad_v1_scores`, keys ``exact_match``, ``f1``): every gold text counts, even one
that normalises to nothing; F1 is 0 whenever no token is shared (so gold "a" vs prediction "the"
has exact match 1 and F1 0). Every occurrence of a question in the file counts (a duplicated id
counts twice); a question without a prediction scores 0 (one :class:`MalformedExampleWarning`
counts them). A predicted question with no gold answer at all cannot be scored (the official
script fails on it): ``UserError``, score it as v2.0.

**v2.0** (:func:`squad_v2_scores`): gold texts that normalise to nothing are dropped and a
question left without any has the single gold answer "" (it is ``NoAns`` exactly when its
``answers`` list is empty); F1 with an empty side is 1 when both sides are empty, else 0. Scores
are kept per question id, so a duplicated id counts once, with its last occurrence's answers.
``na_probs`` (question id -> no-answer probability; 0 for every prediction without them): a
question whose probability exceeds ``na_prob_thresh`` counts as answered "". Keys, in the official
order: ``exact, f1, total``, ``HasAns_exact, HasAns_f1, HasAns_total`` and ``NoAns_*`` when such
questions exist, and with ``na_probs`` given ``best_exact, best_exact_thresh, best_f1,
best_f1_thresh`` (the best scores over all thresholds, from the raw scores). With
``pr_curves=True`` (the official ``--out-image-dir``) also ``pr_exact_ap, pr_f1_ap, pr_oracle_ap``,
the average precisions of :func:`precision_recall_curves`. Inputs the official script fails on
(a question without a prediction, a scored question without a no-answer probability) raise
``UserError`` naming the first question.

**Which version** (:func:`resolve_version`, ``version="auto"``): 2.0 when no-answer probabilities
are given (only v2.0 takes them); otherwise the dataset file's ``"version"`` field when it names
1.1 or 2.0 (``"1.1"``, ``"v2.0"``: the file says which official script is its own); otherwise 2.0
when some question is marked ``is_impossible`` or has an empty ``answers`` list, else 1.1.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.atomic import atomic_file
from zoo.errors import MissingInput, UserError
from zoo.finetune.skips import SkippedExamples

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
VERSIONS = ("1.1", "2.0")


@dataclass(frozen=True)
class GoldQuestion:
    """One question of a SQuAD file as the official scripts see it: its id and gold answer texts."""

    qid: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class SquadGold:
    """Every question of a SQuAD file in file order (duplicates kept) and what names its version."""

    questions: tuple[GoldQuestion, ...]
    version_field: str | None = None  # the file's "version", as written
    marked_v2: bool = False  # some question has is_impossible: true or an empty answers list


# --------------------------------------------------------------------------- answer scores
def normalize_answer(s: str) -> str:
    """Lower-case, without punctuation and articles, whitespace collapsed to single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match_score(pred: str, gold: str) -> int:
    return int(normalize_answer(pred) == normalize_answer(gold))


def _token_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    shared = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if shared == 0:
        return 0
    precision, recall = 1.0 * shared / len(pred_tokens), 1.0 * shared / len(gold_tokens)
    return (2 * precision * recall) / (precision + recall)


def f1_score(pred: str, gold: str) -> float:
    """v2.0's F1: if either side normalises to no tokens, 1 when both do, else 0."""
    pred_tokens, gold_tokens = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return int(pred_tokens == gold_tokens)
    return _token_f1(pred_tokens, gold_tokens)


def f1_score_v1(pred: str, gold: str) -> float:
    """v1.1's F1: 0 whenever no token is shared, empty sides included."""
    return _token_f1(normalize_answer(pred).split(), normalize_answer(gold).split())


def v2_gold_texts(answers: Iterable[str]) -> list[str]:
    """v2.0's gold answers: the texts that normalise to something, or [""] when none does."""
    return [text for text in answers if normalize_answer(text)] or [""]


# --------------------------------------------------------------------------- reading
def _bad_file(path: Path, what: str) -> UserError:
    return UserError(
        f"'{path}' is not an official SQuAD file ({what}); pass the dev JSON the predictions were made for."
    )


def _gold_question(qa: Any, path: Path) -> GoldQuestion:
    if not isinstance(qa, dict) or not isinstance(qa.get("id"), str):
        raise _bad_file(path, "a question without a string 'id'")
    answers = qa.get("answers")
    if not isinstance(answers, list) or not all(isinstance(a, dict) and isinstance(a.get("text"), str)
                                                for a in answers):
        raise _bad_file(path, f"question '{qa['id']}' has no 'answers' list of objects with a string 'text'")
    return GoldQuestion(qa["id"], tuple(a["text"] for a in answers))


def read_squad_gold(path: str | os.PathLike) -> SquadGold:
    """The questions of an official SQuAD JSON file as the official scripts read them."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"'{path}' is a directory; pass the SQuAD dev JSON file the predictions were made for.")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MissingInput(f"SQuAD file '{path}' does not exist; pass the path of the official JSON file.") \
            from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"'{path}' is not JSON; pass the official SQuAD dev JSON file.") from None
    if not isinstance(record, dict) or not isinstance(record.get("data"), list):
        raise _bad_file(path, "no 'data' list")
    questions, marked_v2 = [], False
    for article in record["data"]:
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            raise _bad_file(path, "an article without a 'paragraphs' list")
        for paragraph in article["paragraphs"]:
            if not isinstance(paragraph, dict) or not isinstance(paragraph.get("qas"), list):
                raise _bad_file(path, "a paragraph without a 'qas' list")
            for qa in paragraph["qas"]:
                question = _gold_question(qa, path)
                marked_v2 = marked_v2 or qa.get("is_impossible") is True or not question.answers
                questions.append(question)
    version = record.get("version")
    return SquadGold(tuple(questions), version if isinstance(version, str) else None, marked_v2)


def gold_from_examples(examples: Sequence[Any]) -> SquadGold:
    """The gold of :class:`~zoo.finetune.squad.SquadExample` objects (finetuning's own evaluation)."""
    questions = tuple(GoldQuestion(e.qid, tuple(text for text, _ in e.answers)) for e in examples)
    return SquadGold(questions, None, any(e.is_impossible or not e.answers for e in examples))


def _version_named_by(field: str | None) -> str | None:
    name = (field or "").strip().lower().removeprefix("v")
    return name if name in VERSIONS else None


def resolve_version(gold: SquadGold, version: str = "auto", has_na_probs: bool = False) -> str:
    """ "1.1" or "2.0": ``version`` itself, or for "auto" the rule of the module docstring."""
    if version not in (*VERSIONS, "auto"):
        raise UserError(f"unknown SQuAD version '{version}'; use 1.1, 2.0 or auto.")
    if version == "1.1" and has_na_probs:
        raise UserError("no-answer probabilities are a SQuAD v2.0 input; drop them or score with version 2.0.")
    if version != "auto":
        return version
    if has_na_probs:
        return "2.0"
    return _version_named_by(gold.version_field) or ("2.0" if gold.marked_v2 else "1.1")


# --------------------------------------------------------------------------- checks
def _check_object(mapping: Any, what: str) -> None:
    if not isinstance(mapping, Mapping):
        raise UserError(f"the {what} must be a JSON object mapping question id to a value; write them in the "
                         "official format.")


def _prediction(predictions: Mapping[str, Any], qid: str) -> str:
    text = predictions[qid]
    if not isinstance(text, str):
        raise UserError(f"the prediction of question '{qid}' is {text!r}, not a string; predict its answer text "
                         "(\"\" for no answer).")
    return text


def _check_probabilities(na_probs: Mapping[str, Any]) -> None:
    for qid, prob in na_probs.items():
        if not isinstance(prob, (int, float)):
            raise UserError(f"the no-answer probability of question '{qid}' is {prob!r}, not a number; write "
                             "one number per question.")


# --------------------------------------------------------------------------- v1.1
def squad_v1_scores(questions: Sequence[GoldQuestion], predictions: Mapping[str, Any]) -> dict[str, float]:
    """``evaluate-v1.1.py``'s ``{"exact_match", "f1"}`` in percent."""
    _check_object(predictions, "predictions")
    if not questions:
        raise UserError("the SQuAD dataset has no questions; pass the dev file the predictions were made for.")
    missing = SkippedExamples("SQuAD v1.1 scoring", headline="{count} question(s) had no prediction")
    exact = f1 = total = 0
    for question in questions:
        total += 1
        if question.qid not in predictions:
            missing.skip(question.qid, "scored 0, as the official v1.1 script does")
            continue
        if not question.answers:
            raise UserError(f"question '{question.qid}' has no gold answer, which SQuAD v1.1 scoring cannot "
                             "score; score the file as SQuAD v2.0 (--version 2.0).")
        pred = _prediction(predictions, question.qid)
        exact += max(exact_match_score(pred, gold) for gold in question.answers)
        f1 += max(f1_score_v1(pred, gold) for gold in question.answers)
    missing.warn()
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * f1 / total}


# --------------------------------------------------------------------------- v2.0
@dataclass(frozen=True)
class _V2Raw:
    has_answer: dict[str, bool]  # per unique id, in first-occurrence order, last occurrence's value
    exact: dict[str, float]
    f1: dict[str, float]


def _v2_raw_scores(questions: Sequence[GoldQuestion], predictions: Mapping[str, Any]) -> _V2Raw:
    has_answer, exact, f1, missing = {}, {}, {}, []
    for question in questions:
        has_answer[question.qid] = bool(question.answers)
        if question.qid not in predictions:
            missing.append(question.qid)
            continue
        pred, golds = _prediction(predictions, question.qid), v2_gold_texts(question.answers)
        exact[question.qid] = max(exact_match_score(pred, gold) for gold in golds)
        f1[question.qid] = max(f1_score(pred, gold) for gold in golds)
    if missing:
        raise UserError(f"{len(set(missing))} question(s) have no prediction, the first is '{missing[0]}'; "
                         "SQuAD v2.0 scores every question of the file: predict \"\" for no answer.")
    return _V2Raw(has_answer, exact, f1)


def _thresholded(raw: Mapping[str, float], na_probs: Mapping[str, float], has_answer: Mapping[str, bool],
                 na_prob_thresh: float) -> dict[str, float]:
    return {q: (float(not has_answer[q]) if na_probs[q] > na_prob_thresh else s) for q, s in raw.items()}


def _eval_dict(exact: Mapping[str, float], f1: Mapping[str, float], qids: Sequence[str]) -> dict[str, float]:
    total = len(qids)
    return {"exact": 100.0 * sum(exact[q] for q in qids) / total,
            "f1": 100.0 * sum(f1[q] for q in qids) / total, "total": total}


def _best_threshold(predictions: Mapping[str, Any], raw: Mapping[str, float], na_probs: Mapping[str, float],
                    has_answer: Mapping[str, bool]) -> tuple[float, float]:
    """Best percent score over thresholds: start with every question answered "" and, by rising
    no-answer probability, let each keep its prediction instead (on a no-answer question that costs
    1 whenever the prediction is not the empty string, even a text that normalises to nothing)."""
    score = best = sum(1 for q in has_answer if not has_answer[q])
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        if qid not in raw:
            continue
        score += raw[qid] if has_answer[qid] else (-1 if predictions[qid] else 0)
        if score > best:
            best, best_thresh = score, na_probs[qid]
    return 100.0 * best / len(raw), best_thresh


@dataclass(frozen=True)
class PrecisionRecall:
    """One precision-recall curve over no-answer thresholds, and its average precision (percent)."""

    precisions: list[float]
    recalls: list[float]
    average_precision: float


def _precision_recall(scores: Mapping[str, float], na_probs: Mapping[str, float],
                      has_answer: Mapping[str, bool]) -> PrecisionRecall:
    """Answer the questions by rising no-answer probability; a point at each distinct probability."""
    order = sorted(na_probs, key=lambda q: na_probs[q])
    num_answerable = sum(1 for v in has_answer.values() if v)
    true_pos, precisions, recalls, average = 0.0, [1.0], [0.0], 0.0
    for i, qid in enumerate(order):
        if has_answer[qid]:
            true_pos += scores[qid]
        precision, recall = true_pos / float(i + 1), true_pos / float(num_answerable)
        if i == len(order) - 1 or na_probs[qid] != na_probs[order[i + 1]]:
            average += precision * (recall - recalls[-1])
            precisions.append(precision)
            recalls.append(recall)
    return PrecisionRecall(precisions, recalls, 100.0 * average)


def precision_recall_curves(raw: _V2Raw, na_probs: Mapping[str, float]) -> dict[str, PrecisionRecall]:
    """The official script's exact, f1 and oracle curves (empty when no question has an answer)."""
    strangers = [q for q in na_probs if q not in raw.has_answer]
    if strangers:
        raise UserError(f"the no-answer probabilities name question '{strangers[0]}', which the dataset does not "
                         "have; precision-recall curves need exactly the dataset's questions.")
    if not any(raw.has_answer.values()):
        return {}
    oracle = {q: float(v) for q, v in raw.has_answer.items()}
    return {name: _precision_recall(scores, na_probs, raw.has_answer)
            for name, scores in (("exact", raw.exact), ("f1", raw.f1), ("oracle", oracle))}


def squad_v2_scores(
    questions: Sequence[GoldQuestion],
    predictions: Mapping[str, Any],
    na_probs: Mapping[str, Any] | None = None,
    na_prob_thresh: float = 1.0,
    pr_curves: bool = False,
) -> dict[str, float | int]:
    """``evaluate-v2.0.py``'s scores, keys in its order (see the module docstring)."""
    result, _ = squad_v2_scores_and_curves(questions, predictions, na_probs, na_prob_thresh, pr_curves)
    return result


def squad_v2_scores_and_curves(
    questions: Sequence[GoldQuestion],
    predictions: Mapping[str, Any],
    na_probs: Mapping[str, Any] | None = None,
    na_prob_thresh: float = 1.0,
    pr_curves: bool = False,
) -> tuple[dict[str, float | int], dict[str, PrecisionRecall]]:
    """:func:`squad_v2_scores` and, with ``pr_curves`` and ``na_probs``, the precision-recall curves."""
    _check_object(predictions, "predictions")
    if na_probs is not None:
        _check_object(na_probs, "no-answer probabilities")
        _check_probabilities(na_probs)
    if not questions:
        raise UserError("the SQuAD dataset has no questions; pass the dev file the predictions were made for.")
    raw = _v2_raw_scores(questions, predictions)
    probs = dict(na_probs) if na_probs is not None else {q: 0.0 for q in predictions}
    unscored = next((q for q in raw.exact if q not in probs), None)
    if unscored is not None:
        raise UserError(f"the no-answer probabilities have no entry for question '{unscored}'; write one for "
                         "every question of the dataset.")
    exact = _thresholded(raw.exact, probs, raw.has_answer, na_prob_thresh)
    f1 = _thresholded(raw.f1, probs, raw.has_answer, na_prob_thresh)
    result = _eval_dict(exact, f1, list(exact))
    for prefix, answerable in (("HasAns", True), ("NoAns", False)):
        subset = [q for q, has in raw.has_answer.items() if has == answerable]
        if subset:
            result.update({f"{prefix}_{key}": value for key, value in _eval_dict(exact, f1, subset).items()})
    curves: dict[str, PrecisionRecall] = {}
    if na_probs is not None:
        result["best_exact"], result["best_exact_thresh"] = _best_threshold(predictions, raw.exact, probs,
                                                                            raw.has_answer)
        result["best_f1"], result["best_f1_thresh"] = _best_threshold(predictions, raw.f1, probs, raw.has_answer)
        if pr_curves:
            curves = precision_recall_curves(raw, probs)
            result.update({f"pr_{name}_ap": curve.average_precision for name, curve in curves.items()})
    return result, curves


def no_answer_probabilities_by_kind(questions: Sequence[GoldQuestion],
                                    na_probs: Mapping[str, float]) -> dict[str, list[float]]:
    """The probabilities of the answerable ("hasAns") and unanswerable ("noAns") questions, each
    unique id once (for the official histograms)."""
    has_answer = {q.qid: bool(q.answers) for q in questions}
    return {kind: [na_probs[q] for q, has in has_answer.items() if has == wanted]
            for kind, wanted in (("hasAns", True), ("noAns", False))}


# --------------------------------------------------------------------------- entry point
def squad_scores(
    dataset: Sequence[Any] | SquadGold | str | os.PathLike,
    predictions: Mapping[str, Any],
    na_probs: Mapping[str, Any] | None = None,
    na_prob_thresh: float = 1.0,
    version: str = "auto",
) -> dict[str, float | int]:
    """The official scores of ``predictions`` (question id -> answer text, "" for no answer).

    ``dataset``: a SQuAD JSON path, a :class:`SquadGold`, or :class:`~zoo.finetune.squad.SquadExample`
    objects. ``version``: "1.1", "2.0" or "auto" (:func:`resolve_version`).
    """
    if isinstance(dataset, (str, os.PathLike)):
        gold = read_squad_gold(dataset)
    elif isinstance(dataset, SquadGold):
        gold = dataset
    else:
        gold = gold_from_examples(dataset)
    if resolve_version(gold, version, na_probs is not None) == "1.1":
        return squad_v1_scores(gold.questions, predictions)
    return squad_v2_scores(gold.questions, predictions, na_probs, na_prob_thresh)


def version_mismatch_note(gold: SquadGold, version: str) -> str | None:
    """The official v1.1 script's note when the file names another version than the one scored."""
    named = _version_named_by(gold.version_field)
    if gold.version_field is not None and named != version:
        return f"note: scoring as SQuAD v{version}, but the dataset says version '{gold.version_field}'."
    return None


def write_precision_recall_images(curves: Mapping[str, PrecisionRecall], probabilities: Mapping[str, list[float]],
                                  directory: Path) -> list[Path]:
    """The official script's images in ``directory``: pr_exact.png, pr_f1.png, pr_oracle.png and
    na_prob_hist_hasAns.png / na_prob_hist_noAns.png (each written atomically)."""
    import matplotlib  # local: matplotlib only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: matplotlib only when a plot is drawn

    titles = {"exact": "Precision-Recall curve for Exact Match score", "f1": "Precision-Recall curve for F1 score",
              "oracle": "Oracle Precision-Recall curve (binary task of HasAns vs. NoAns)"}
    written = []

    def save(fig, name: str) -> None:
        path = directory / name
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format="png")
        plt.close(fig)
        written.append(path)

    for name, curve in curves.items():
        fig, ax = plt.subplots()
        ax.step(curve.recalls, curve.precisions, color="b", alpha=0.2, where="post")
        ax.fill_between(curve.recalls, curve.precisions, step="post", alpha=0.2, color="b")
        ax.set(xlabel="Recall", ylabel="Precision", xlim=(0.0, 1.05), ylim=(0.0, 1.05), title=titles[name])
        save(fig, f"pr_{name}.png")
    for kind, values in probabilities.items():
        if not values:
            continue
        fig, ax = plt.subplots()
        ax.hist(values, weights=[1.0 / len(values)] * len(values), bins=20, range=(0.0, 1.0))
        ax.set(xlabel="Model probability of no-answer", ylabel="Proportion of dataset",
               title=f"Histogram of no-answer probability: {kind}")
        save(fig, f"na_prob_hist_{kind}.png")
    return written
