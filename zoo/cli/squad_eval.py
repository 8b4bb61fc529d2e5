"""``finetune/squad_eval.py``: official SQuAD v1.1 / v2.0 evaluation, the scores of ``evaluate-v1.1.py`` /
``evaluate-v2.0.py`` (see zoo.finetune.squad_eval).

    python finetune/squad_eval.py <dataset.json> <predictions.json> [--na-prob-file F] [--na-prob-thresh T]
        [--out-file F] [--out-image-dir D] [--verbose] [--version {auto,1.1,2.0}]

v1.1 prints ``{"exact_match", "f1"}`` on one line; v2.0 prints ``exact, f1, total, HasAns_*, NoAns_*`` (and
``best_*`` with ``--na-prob-file``) indented, as the official scripts do. ``--out-file`` writes the JSON
there instead of printing it; ``--verbose`` is accepted and changes nothing, as in the official script. A
user error prints ``error: <one sentence>`` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from zoo.atomic import write_text_atomic
from zoo.cli.command import USER_ERROR_EXIT_CODE, run_command
from zoo.errors import UserError
from zoo.finetune.squad_eval import squad_scores
from zoo.options import CommandParser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description="Official SQuAD v1.1/v2.0 scores (exact match and F1, in percent).")
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
                        help="which official script to equal (default: auto, see zoo.finetune.squad_eval)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """0 with the scores printed (or written to --out-file); 2 and one sentence on stderr for a user error or
    an --out-file that cannot be written."""
    args = build_parser().parse_args(argv)

    def work() -> int:
        try:
            scores, version = squad_scores(args.data_file, args.pred_file, version=args.version,
                                           na_prob_file=args.na_prob_file, na_prob_thresh=args.na_prob_thresh,
                                           out_file=args.out_file, out_image_dir=args.out_image_dir)
            if args.out_file:
                write_text_atomic(args.out_file, json.dumps(scores))
        except (UserError, FileNotFoundError):     # reported by run_command; not a failed write
            raise
        except OSError as error:
            print(f"error: cannot write {error.filename or args.out_file} ({error.strerror}); choose a path you "
                  "can write to.", file=sys.stderr)
            return USER_ERROR_EXIT_CODE
        if not args.out_file:
            print(json.dumps(scores) if version == "1.1" else json.dumps(scores, indent=2))
        return 0

    return run_command(work, teardown=False, return_code=True)
