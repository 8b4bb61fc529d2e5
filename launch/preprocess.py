"""Tokenize raw text into a Megatron-layout indexed dataset: <output-prefix>.bin/.idx.

    python launch/preprocess.py --input data/*.jsonl --output-prefix data/my-corpus --workers 8

Formats: .txt (one document per line), .jsonl/.json (optionally .gz; text under --json-key),
.parquet (column --json-key). Each document gets <|endoftext|> appended.
"""

from __future__ import annotations

import argparse
import sys
from zoo.errors import report_error


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE", help="raw text files")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--json-key", default="text", help="text field of .jsonl/.json/.parquet inputs")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: bundled GPT-2)")
    parser.add_argument(
        "--append-eod", action=argparse.BooleanOptionalAction, default=True, help="append <|endoftext|>"
    )
    args = parser.parse_args(argv)

    from zoo.data import preprocess

    try:
        summary = preprocess(
            args.input,
            args.output_prefix,
            tokenizer=args.tokenizer,
            workers=args.workers,
            json_key=args.json_key,
            append_eod=args.append_eod,
        )
    except (ValueError, FileNotFoundError) as err:
        report_error(err)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
