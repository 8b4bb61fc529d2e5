"""Official SQuAD v1.1 / v2.0 scores of a predictions file: what ``evaluate-v1.1.py`` / ``evaluate-v2.0.py``
compute, with zoo's one-sentence errors for unreadable files (the command is :mod:`zoo.cli.squad_eval`).

``predictions`` maps question id -> answer text ("" for no answer); ``na_prob_file`` maps question id ->
no-answer probability. The version (``"auto"``: 2.0 with a no-answer file, else the dataset file's
``"version"`` field, else 2.0 when a question is ``is_impossible`` or has no answers, else 1.1) is
resolved by :mod:`zoo.finetune.squad_metrics`. With ``out_image_dir`` and a no-answer file the official
precision-recall curves and no-answer histograms are written there, and ``pr_*_ap`` added to the scores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from zoo.atomic import check_writable_directory
from zoo.errors import MissingInput, UserError
from zoo.finetune import squad_metrics as metrics


def read_json(path: str, what: str) -> Any:
    """The JSON in ``path``; a missing, directory or non-JSON file is one sentence naming ``what`` and ``path``."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MissingInput(
            f"{what} file '{path}' does not exist; pass the path of an existing JSON file."
        ) from None
    except IsADirectoryError:
        raise UserError(f"{what} file '{path}' is a directory; pass the path of a JSON file.") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(
            f"{what} file '{path}' is not JSON; write it as a JSON object of question id -> value."
        ) from None


def check_out_file(path: str) -> None:
    """``path`` can receive the scores: not a directory, in an existing directory."""
    out = Path(path)
    if out.is_dir():
        raise UserError(f"--out-file {out} is a directory; pass a file path.")
    if not out.parent.is_dir():
        raise UserError(f"--out-file {out}: {out.parent} is not an existing directory; pass a file in one.")


def squad_scores(data_file: str, pred_file: str, *, version: str = "auto", na_prob_file: str | None = None,
                 na_prob_thresh: float = 1.0, out_file: str | None = None,
                 out_image_dir: str | None = None) -> tuple[dict, str]:
    """(scores, the version scored). Notes (a version mismatch, images that need a no-answer file) go to
    stderr; ``out_file`` is only checked here, before any image is written."""
    gold = metrics.read_squad_gold(data_file)
    predictions = read_json(pred_file, "predictions")
    na_probs = read_json(na_prob_file, "no-answer probability") if na_prob_file else None
    version = metrics.resolve_version(gold, version, na_probs is not None)
    if out_file:
        check_out_file(out_file)
    note = metrics.version_mismatch_note(gold, version)
    if note:
        print(note, file=sys.stderr)
    if version == "1.1":
        return metrics.squad_v1_scores(gold.questions, predictions), version
    images = bool(out_image_dir) and na_probs is not None
    if out_image_dir and not images:
        print("note: --out-image-dir draws no-answer curves, which need --na-prob-file; no images written.",
              file=sys.stderr)
    scores, curves = metrics.squad_v2_scores_and_curves(gold.questions, predictions, na_probs,
                                                        na_prob_thresh, pr_curves=images)
    if images:
        directory = check_writable_directory(out_image_dir, "--out-image-dir")
        metrics.write_precision_recall_images(
            curves, metrics.no_answer_probabilities_by_kind(gold.questions, na_probs), directory)
    return scores, version
