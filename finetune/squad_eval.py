"""Official SQuAD v1.1 / v2.0 evaluation: the scores of ``evaluate-v1.1.py`` / ``evaluate-v2.0.py``
(see zoo.cli.squad_eval).

    python finetune/squad_eval.py <dataset.json> <predictions.json> [--na-prob-file F] [--out-file F]
"""

import sys

from zoo.cli.squad_eval import main

if __name__ == "__main__":
    sys.exit(main())
