"""Tiny GPT-2 configurations for parity with transformers, and transformers' loss by formula: a vocab of
``VOCAB`` ids (not a multiple of 128, so vocab padding is exercised at every tp), dropout off."""

from __future__ import annotations

import torch

VOCAB = 1000            # not a multiple of 128: exercises vocab padding at every tp


def tiny_hf_config(n_layer: int = 2):
    """transformers' GPT2Config: 64 hidden, 4 heads, 32 positions, ``n_layer`` layers, dropout off."""
    import transformers

    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=n_layer, n_head=4,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)


def tiny_zoo_config(n_layer: int = 2):
    """zoo's GPT2Config of the same shape as ``tiny_hf_config``."""
    from zoo.models import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=n_layer, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """GPT2LMHeadModel's loss (labels shifted inside, -100 ignored), in the logits' dtype."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
