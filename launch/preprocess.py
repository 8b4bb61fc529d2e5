"""Tokenize raw text into a Megatron-layout indexed dataset: <output-prefix>.bin/.idx (see zoo.cli.preprocess).

    python launch/preprocess.py --input data/*.jsonl --output-prefix data/my-corpus --workers 8
"""

import sys

from zoo.cli.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
