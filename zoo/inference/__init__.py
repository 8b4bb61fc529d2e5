"""Text generation at any tensor-parallel degree: KV-cached decoding, greedy / temperature / top-k /
top-p sampling with one RNG stream per sequence shared by the TP group, EOD stopping, left-padded
batches; the end-of-run samples of a pretraining run (:func:`sample_lines`)."""

from zoo.inference.generate import (
                                    Completion,
                                    GenerationConfig,
                                    TextCompletion,
                                    encode_prompts,
                                    generate,
                                    generate_batch,
                                    generate_text,
                                    left_pad,
                                    sync_across_tp,
)
from zoo.inference.run_samples import sample_lines
from zoo.inference.sampling import apply_temperature, filter_logits, sample, top_k_filter, top_p_filter

__all__ = [
    "Completion", "GenerationConfig", "TextCompletion", "encode_prompts", "generate", "generate_batch",
    "generate_text", "left_pad", "sample_lines", "sync_across_tp", "apply_temperature", "filter_logits", "sample",
    "top_k_filter", "top_p_filter",
]
