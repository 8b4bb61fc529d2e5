"""The examples of the finetuning tasks and their checked constructors, in one module that the task
readers (:mod:`zoo.finetune.glue`, :mod:`~zoo.finetune.race`, :mod:`~zoo.finetune.squad`) and the hub
layouts (:mod:`zoo.finetune.hub_layouts`) both import, so that neither imports the other's module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zoo.finetune.skips import SkippedExamples

ANSWER_LETTERS = ("A", "B", "C", "D")

# The longest text (a RACE article, a SQuAD context, a GLUE sentence, a question or an option) read into an
# example, in characters: about 1 MB of text, some 70 times the longest RACE article and 25 times the longest
# SQuAD context. A longer one is skipped and counted before it is tokenised, since tokenising it costs about
# 100 bytes of memory per character (a 50 MB article would take ~6 GB) for a model that sees its first few
# hundred tokens only.
MAX_TEXT_CHARS = 1_000_000


def over_long(texts) -> str | None:
    """The reason to skip an example holding one of ``texts`` longer than :data:`MAX_TEXT_CHARS`, else None."""
    if any(isinstance(text, str) and len(text) > MAX_TEXT_CHARS for text in texts):
        return f"example(s) with a text longer than {MAX_TEXT_CHARS:,} characters (zoo.finetune.examples.MAX_TEXT_CHARS)"
    return None


@dataclass(frozen=True)
class PairExample:
    """One sentence-pair classification example; ``label`` indexes the task's label tuple."""

    guid: str
    text_a: str
    text_b: str
    label: int


@dataclass(frozen=True)
class RaceExample:
    """One RACE question with its article and four options; ``label`` indexes ``options``."""

    guid: str
    level: str  # "middle" or "high"
    article: str
    question: str
    options: tuple[str, str, str, str]
    label: int


def make_race_example(
    guid: str, level: str, article: str, question: str, options, answer, skipped: SkippedExamples,
) -> RaceExample | None:
    """The example, or None (counted in ``skipped``) when its options or answer are malformed or one of its
    texts is longer than :data:`MAX_TEXT_CHARS`."""
    too_long = over_long([article, question, *(options if isinstance(options, (list, tuple)) else ())])
    if too_long:
        skipped.skip(guid, too_long)
        return None
    four_texts = isinstance(options, (list, tuple)) and len(options) == len(ANSWER_LETTERS)
    if not four_texts or not all(isinstance(option, str) for option in options):
        skipped.skip(guid, "question(s) without exactly 4 text options")
        return None
    if answer not in ANSWER_LETTERS:
        skipped.skip(guid, "answer letter(s) outside A-D")
        return None
    return RaceExample(guid=guid, level=level, article=article, question=question,
                       options=tuple(options), label=ANSWER_LETTERS.index(answer))


@dataclass(frozen=True)
class SquadExample:
    """One question on one context; ``answers`` are (text, character start) pairs."""

    qid: str
    question: str
    context: str
    answers: tuple[tuple[str, int], ...]
    is_impossible: bool = False


def make_squad_example(
    qid: str,
    question: str,
    context: str,
    answers: Sequence[tuple[str, int]],
    is_impossible: bool,
    skipped: SkippedExamples,
    seen_ids: set[str],
) -> SquadExample | None:
    """The example, or None (counted in ``skipped``) when it is malformed or its context or question is longer
    than :data:`MAX_TEXT_CHARS`."""
    too_long = over_long([context, question])
    if too_long:
        skipped.skip(qid, too_long)
        return None
    if qid in seen_ids:
        skipped.skip(qid, "duplicate question id(s)")
        return None
    if is_impossible and answers:
        skipped.skip(qid, "impossible question(s) with answers")
        return None
    if not is_impossible and not answers:
        skipped.skip(qid, "answerable question(s) without answers")
        return None
    for text, start in answers:
        if not isinstance(text, str) or not text.strip():
            skipped.skip(qid, "empty answer text(s)")
            return None
        if not isinstance(start, int) or start < 0 or context[start : start + len(text)] != text:
            skipped.skip(qid, "answer_start(s) not pointing at the answer text in the context")
            return None
    seen_ids.add(qid)
    return SquadExample(qid=qid, question=question, context=context,
                        answers=tuple((text, start) for text, start in answers), is_impossible=is_impossible)
