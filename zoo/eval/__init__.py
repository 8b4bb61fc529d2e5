"""Zero-shot evaluation (Shoeybi et al. 2019, Appendix E): WikiText-103 perplexity and LAMBADA accuracy.

``evaluate_wikitext`` and ``evaluate_lambada`` take a (tensor-parallel) GPT-2, the raw task data
(``read_wikitext`` / ``read_lambada``: original files or ``datasets`` directories) and the GPT-2
tokenizer; they are collective over the tp x dp grid. ``zoo.eval.zero_shot`` is the CLI behind
``launch/evaluate.py``.
"""

from zoo.eval.lambada import LambadaExample, LambadaResult, build_example, evaluate_lambada, split_last_word
from zoo.eval.sources import read_lambada, read_wikitext
from zoo.eval.wikitext import (
                               WikitextResult,
                               Window,
                               count_original_tokens,
                               evaluate_wikitext,
                               plan_windows,
                               validate_window,
                               wikitext_detokenize,
)

__all__ = [
    "LambadaExample", "LambadaResult", "Window", "WikitextResult", "build_example", "count_original_tokens",
    "evaluate_lambada", "evaluate_wikitext", "plan_windows", "read_lambada", "read_wikitext", "split_last_word",
    "validate_window", "wikitext_detokenize",
]
