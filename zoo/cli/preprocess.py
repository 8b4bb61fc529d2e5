"""``launch/preprocess.py``: tokenize raw text into Megatron-layout indexed datasets, ``<output-prefix>.bin/.idx``.

    python launch/preprocess.py --input data/*.jsonl --output-prefix data/my-corpus --workers 8

Formats: .txt (one document per line), .jsonl/.json (optionally .gz; text under --json-key), .parquet
(column --json-key), directories of them, hub: datasets. The flags and the work are
zoo.data.preprocess's (:func:`~zoo.data.preprocess.add_preprocess_arguments`,
:func:`~zoo.data.preprocess.run_preprocess`).
"""

from __future__ import annotations

import argparse

from zoo.cli.command import command_parser, run_command
from zoo.data.preprocess import add_preprocess_arguments, run_preprocess
from zoo.options import CommandParser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return command_parser(add_preprocess_arguments(parser), launched=False)


def main(argv: list[str] | None = None) -> int:
    """0 once every output is written; 2 (and one sentence on stderr) for a user error."""
    args = build_parser().parse_args(argv)

    def work() -> int:
        run_preprocess(args)
        return 0

    return run_command(work, teardown=False, return_code=True, log_level=args.log_level)
