"""Official SQuAD v1.1/v2.0 evaluation: prints the JSON of scores.

    python finetune/squad_eval.py <dataset.json> <predictions.json> [--na-prob-file F]

``predictions.json`` maps question id -> answer text ("" for no answer); ``--na-prob-file`` maps
question id -> no-answer probability and adds the best-threshold scores. A user error prints one
sentence on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _read_json(path: str, what: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{what} file '{path}' does not exist; pass the path of an existing JSON file."
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(
            f"{what} file '{path}' is not JSON; write it as a JSON object of question id -> value."
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Official SQuAD v1.1/v2.0 scores (exact match and F1, in percent).")
    parser.add_argument("data_file", help="SQuAD dataset JSON (the dev file the predictions were made for)")
    parser.add_argument("pred_file", help="predictions JSON: question id -> answer text")
    parser.add_argument("--na-prob-file", "-n", help="JSON: question id -> no-answer probability")
    parser.add_argument("--na-prob-thresh", "-t", type=float, default=1.0,
                        help="predict no answer when the probability is above this (default: 1.0)")
    parser.add_argument("--out-file", "-o", help="also write the scores JSON here")
    args = parser.parse_args(argv)

    from zoo.finetune.squad_metrics import squad_scores

    try:
        predictions = _read_json(args.pred_file, "predictions")
        na_probs = _read_json(args.na_prob_file, "no-answer probability") if args.na_prob_file else None
        scores = squad_scores(args.data_file, predictions, na_probs, na_prob_thresh=args.na_prob_thresh)
    except (ValueError, FileNotFoundError) as error:
        print(f"squad_eval.py: {error}", file=sys.stderr)
        return 2
    text = json.dumps(scores, indent=2)
    if args.out_file:
        out = Path(args.out_file)
        partial = out.with_name(out.name + ".tmp")
        partial.write_text(text + "\n", encoding="utf-8")
        partial.replace(out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
