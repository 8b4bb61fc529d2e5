"""Official SQuAD v1.1 / v2.0 evaluation: the scores of ``evaluate-v1.1.py`` / ``evaluate-v2.0.py``.

    python finetune/squad_eval.py <dataset.json> <predictions.json> [--na-prob-file F] [--na-prob-thresh T]
        [--out-file F] [--out-image-dir D] [--verbose] [--version {auto,1.1,2.0}]

``predictions.json`` maps question id -> answer text ("" for no answer); ``--na-prob-file`` maps
question id -> no-answer probability. v1.1 prints ``{"exact_match", "f1"}`` on one line; v2.0
prints ``exact, f1, total, HasAns_*, NoAns_*`` (and ``best_*`` with ``--na-prob-file``) indented,
as the official scripts do. ``--out-file`` writes the JSON there instead of printing it;
``--out-image-dir`` (with ``--na-prob-file``) writes the official precision-recall curves and
no-answer histograms there and adds ``pr_*_ap``; ``--verbose`` is accepted and changes nothing, as
in the official script.

The version: ``--version`` (default ``auto``: 2.0 with ``--na-prob-file``, else the dataset file's
``"version"`` field, else 2.0 when a question is ``is_impossible`` or has no answers, else 1.1; see
:mod:`zoo.finetune.squad_metrics`). A user error prints ``error: <one sentence>`` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from zoo.errors import report_error


def _read_json(path: str, what: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{what} file '{path}' does not exist; pass the path of an existing JSON file."
        ) from None
    except IsADirectoryError:
        raise ValueError(f"{what} file '{path}' is a directory; pass the path of a JSON file.") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(
            f"{what} file '{path}' is not JSON; write it as a JSON object of question id -> value."
        ) from None


def _check_out_file(path: str) -> None:
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"--out-file {out} is a directory; pass a file path.")
    if not out.parent.is_dir():
        raise ValueError(f"--out-file {out}: {out.parent} is not an existing directory; pass a file in one.")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Official SQuAD v1.1/v2.0 scores (exact match and F1, in percent).")
    parser.add_argument("data_file", metavar="data.json", help="SQuAD dataset JSON (the file the predictions are for)")
    parser.add_argument("pred_file", metavar="pred.json", help="predictions JSON: question id -> answer text")
    parser.add_argument("--out-file", "-o", metavar="eval.json", help="write the scores JSON here instead of stdout")
    parser.add_argument("--na-prob-file", "-n", metavar="na_prob.json",
                        help="JSON: question id -> no-answer probability (v2.0)")
    parser.add_argument("--na-prob-thresh", "-t", type=float, default=1.0,
                        help='predict "" when the no-answer probability exceeds this (default: 1.0)')
    parser.add_argument("--out-image-dir", "-p", metavar="out_images",
                        help="write precision-recall curves and no-answer histograms here (with --na-prob-file)")
    parser.add_argument("--verbose", "-v", action="store_true", help="accepted as in the official script; no effect")
    parser.add_argument("--version", default="auto", choices=["auto", "1.1", "2.0"],
                        help="which official script to equal (default: auto, see the module docstring)")
    return parser


def _evaluate(args) -> tuple[dict, str]:
    from zoo.finetune import squad_metrics as metrics

    gold = metrics.read_squad_gold(args.data_file)
    predictions = _read_json(args.pred_file, "predictions")
    na_probs = _read_json(args.na_prob_file, "no-answer probability") if args.na_prob_file else None
    version = metrics.resolve_version(gold, args.version, na_probs is not None)
    if args.out_file:
        _check_out_file(args.out_file)
    note = metrics.version_mismatch_note(gold, version)
    if note:
        print(note, file=sys.stderr)
    if version == "1.1":
        return metrics.squad_v1_scores(gold.questions, predictions), version
    images = bool(args.out_image_dir) and na_probs is not None
    if args.out_image_dir and not images:
        print("note: --out-image-dir draws no-answer curves, which need --na-prob-file; no images written.",
              file=sys.stderr)
    scores, curves = metrics.squad_v2_scores_and_curves(gold.questions, predictions, na_probs,
                                                        args.na_prob_thresh, pr_curves=images)
    if images:
        from zoo.atomic import check_writable_directory

        directory = check_writable_directory(args.out_image_dir, "--out-image-dir")
        metrics.write_precision_recall_images(
            curves, metrics.no_answer_probabilities_by_kind(gold.questions, na_probs), directory)
    return scores, version


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        scores, version = _evaluate(args)
        if args.out_file:
            from zoo.atomic import write_text_atomic

            write_text_atomic(args.out_file, json.dumps(scores))
    except (ValueError, FileNotFoundError) as error:
        report_error(error)
        return 2
    except OSError as error:
        print(f"error: cannot write {error.filename or args.out_file} ({error.strerror}); choose a path you can "
              "write to.", file=sys.stderr)
        return 2
    if not args.out_file:
        print(json.dumps(scores) if version == "1.1" else json.dumps(scores, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
