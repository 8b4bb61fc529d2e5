"""Text sampled from a model at the end of a pretraining run, so a run shows what it learned.

The pretraining loop (``zoo.training``) sits beside this package, not above it, so it receives
:func:`sample_lines` from its entry script (``launch/pretrain.py``) and calls it on every rank with
the run's ``sample_prompts``; the writer prints the lines.

The settings are fixed, so the printed text depends only on the weights, the prompts and the seed:
:data:`SAMPLE_NEW_TOKENS` new tokens at temperature 0.9 with nucleus (top-p) 0.95, each prompt's
stream seeded by (seed, its index) as in :mod:`zoo.inference.generate`, so two runs with the same
seed print the same text. Greedy decoding, or a top-k of a few dozen, of a small, briefly trained
model repeats its most frequent word ("the the the"); the nucleus keeps the corpus's rarer words.
"""

from __future__ import annotations

from collections.abc import Sequence

from zoo.data.tokenizers import load_gpt2_tokenizer
from zoo.inference.generate import GenerationConfig, generate_text

SAMPLE_NEW_TOKENS = 40
SAMPLE_TEMPERATURE = 0.9
SAMPLE_TOP_P = 0.95


def sample_settings(seed: int) -> GenerationConfig:
    """The decoding of the end-of-run samples: temperature 0.9, top-p 0.95, 40 new tokens, ``seed``."""
    return GenerationConfig(max_new_tokens=SAMPLE_NEW_TOKENS, temperature=SAMPLE_TEMPERATURE, top_p=SAMPLE_TOP_P,
                            seed=seed)


def sample_lines(model, prompts: Sequence[str], seed: int, parallel, tokenizer: str | None = None) -> list[str]:
    """A header naming the settings, then one line per prompt: the prompt followed by its sampled
    continuation, encoded and decoded with the run's ``tokenizer`` directory (by default GPT-2 BPE, the
    tokenizer of the bundled corpus and of launch/preprocess.py).

    Collective over the whole world (every rank calls it with the same prompts and seed; every rank
    returns the same lines). The model is in eval mode for the call and restored afterwards."""
    settings = sample_settings(seed)
    completions = generate_text(model, load_gpt2_tokenizer(tokenizer), list(prompts), settings, parallel)
    header = (f"samples (temperature {settings.temperature:g}, top-p {settings.top_p:g}, "
              f"{settings.max_new_tokens} new tokens, seed {seed}):")
    # newlines shown as spaces: each prompt's sample is one printed line
    return [header] + [f"  {done.prompt}{done.completion}".replace("\n", " ") for done in completions]
