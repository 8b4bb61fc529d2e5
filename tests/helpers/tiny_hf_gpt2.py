"""A random transformers GPT-2 with the real vocabulary, small everywhere else, for the zero-shot evaluations."""

from __future__ import annotations

import torch


def tiny_hf_gpt2(seed: int = 0, n_positions: int = 64):
    """A random transformers GPT-2 with the real 50257-token vocab, small everywhere else."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=n_positions, n_embd=32, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():   # biases and LayerNorms start at 0/1: randomise them so every parameter matters
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_tiny_hf_gpt2(directory, seed: int = 0) -> str:
    """``tiny_hf_gpt2(seed)`` saved with save_pretrained into ``directory``; returns the directory."""
    tiny_hf_gpt2(seed).save_pretrained(directory)
    return str(directory)
