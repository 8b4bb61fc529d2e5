"""The end-of-run samples of pretraining (the demo's ``sample_prompts``): every prompt gets a
printed continuation, the same on two runs with the same seed, none without prompts; bad settings
are one sentence before anything runs."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.helpers.pretraining import run_config
from tests.spawn import spawn

PROMPTS = ["The history of", "In 1990, the"]


def _samples_worker(rank, world_size, data_path, root):
    from zoo.inference import sample_lines
    from zoo.training.pretrain import pretrain

    printed = []
    for name, prompts in (("first", PROMPTS), ("again", PROMPTS), ("none", [])):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            pretrain(run_config(data_path, f"{root}/{name}", 2, 2, 2, train_iters=2, sample_prompts=list(prompts)),
                     sample_text=sample_lines)
        printed.append(out.getvalue())
    return printed


def sample_block(printed: str) -> list[str]:
    """The header and the sample lines the writer printed after the validation perplexity."""
    lines = printed.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("samples (")), None)
    return [] if start is None else lines[start:start + 1 + len(PROMPTS)]


def test_end_of_run_samples_are_printed_per_prompt_reproducibly_and_only_when_asked(corpus_prefix, tmp_path):
    """At tp=2, 2 iterations, seq 32: rank 0 prints one sampled line per prompt (the prompt, then new
    text), identical over two runs with the same seed; rank 1 prints none; no prompts, no samples."""
    (first, again, none), (rank1_first, _, _) = spawn(_samples_worker, 2, corpus_prefix, str(tmp_path))
    block = sample_block(first)
    assert block and block[0] == "samples (temperature 0.9, top-p 0.95, 40 new tokens, seed 1234):", first
    for prompt, line in zip(PROMPTS, block[1:]):
        assert line.startswith(f"  {prompt}") and len(line.strip()) > len(prompt) + 5, block
    assert sample_block(again) == block
    # no sample header anywhere (the settings block's "global N samples (T tokens)" is not one)
    assert sample_block(none) == [] and not any(line.lstrip().startswith("samples (") for line in none.splitlines())
    assert not any(line.lstrip().startswith("samples (") for line in rank1_first.splitlines())


@pytest.mark.parametrize("changes, needle", [
    (dict(sample_prompts=["The history of", 7]), "sample_prompts holds 7 (an integer), not a string"),
    (dict(sample_prompts="The history of"), "zoo setting 'sample_prompts' in <test> is \"The history of\" (a string) "
                                            "but must be a list"),
    (dict(sample_prompts=[" ".join(["word"] * 300)]), "sample prompt 0 has 300 tokens, which leaves no room for new tokens in "
                                           "the model's n_positions=256"),
    (dict(model="bert-tiny", model_overrides={}, sample_prompts=["The history of"]),
     "sample_prompts are for GPT models, but model 'bert-tiny' is a megatron-bert model"),
])
def test_bad_sample_prompts_are_one_sentence(tmp_path, changes, needle):
    with pytest.raises(ValueError, match="^" + __import__("re").escape(needle)):
        run_config(None, str(tmp_path / "run"), 1, 1, 1, train_iters=1, **changes)


def test_prompts_without_a_sampler_are_refused_before_the_run(tmp_path):
    from zoo.training.pretrain import pretrain

    config = run_config(None, str(tmp_path / "run"), 1, 1, 1, train_iters=1, sample_prompts=["The history of"])
    with pytest.raises(ValueError, match="sample_prompts are set but no text sampler was given"):
        pretrain(config)
    assert not (tmp_path / "run").exists()
