"""Tensor-parallel GPT-2 with transformers' names, forward signature and checkpoint layout."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from zoo.models.config import GPT2Config
from zoo.models.hf_io import (DEFAULT_MAX_SHARD_SIZE, HFParam, hf_state_dict, load_hf_weights, read_config_json,
                              write_pretrained)
from zoo.models.transformer import TransformerLayer, attention_bias, run_layers
from zoo.parallel import VocabParallelEmbedding, scaled_init_std, vocab_parallel_cross_entropy
from zoo.parallel.layers import materialize_meta_module
from zoo.parallel.state import ParallelState, tp_size_of

GPT2_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "gpt2"
TOKENIZER_FILE_NAMES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json")


class GPT2Model(nn.Module):
    """Embeddings, N pre-norm layers and the final LayerNorm (transformers' ``GPT2Model``)."""

    def __init__(self, config: GPT2Config, parallel: ParallelState | None = None):
        super().__init__()
        self.config = config
        self.parallel = parallel
        std = config.initializer_range
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, parallel=parallel,
                                          pad_multiple=config.make_vocab_size_divisible_by, init_std=std)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        nn.init.normal_(self.wpe.weight, 0.0, std)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(
            TransformerLayer(config.n_embd, config.n_head, config.ffn_hidden_size,
                             layer_norm_eps=config.layer_norm_epsilon, attn_dropout=config.attn_pdrop,
                             hidden_dropout=config.resid_pdrop, gelu_approximate=config.gelu_approximate,
                             parallel=parallel, init_std=std,
                             output_init_std=scaled_init_std(std, config.n_layer), pre_norm=True)
            for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s = input_ids.shape
        if s > self.config.n_positions:
            raise ValueError(f"sequence length {s} exceeds n_positions={self.config.n_positions}; "
                             f"truncate inputs to {self.config.n_positions} tokens.")
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)   # (1, s)
        x = self.wte(input_ids) + self.wpe(position_ids)                           # (b, s, h)
        x = self.drop(x)
        bias = attention_bias(attention_mask, s, causal=True, dtype=x.dtype)      # (b, 1, s, s) or None
        x = run_layers(self.h, x, bias, causal=True,
                       checkpoint=self.config.activation_checkpointing and self.training)       # (b, s, h)
        return self.ln_f(x)                                                         # (b, s, h)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 language model; the LM head is tied to the vocab-parallel input embedding.

    ``forward`` follows transformers: labels are shifted inside, -100 is ignored. ``.logits`` is
    this rank's vocab shard (b, s, V_padded / p) by default and the full unpadded vocabulary
    (b, s, V) with ``gather_output=True``. The loss never gathers logits (fused cross-entropy).
    """

    def __init__(self, config: GPT2Config, parallel: ParallelState | None = None):
        super().__init__()
        config.validate(tp_size_of(parallel))
        self.config = config
        self.parallel = parallel
        self.transformer = GPT2Model(config, parallel)
        self.tokenizer_dir = GPT2_TOKENIZER_DIR

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                gather_output: bool = False) -> CausalLMOutput:
        hidden = self.transformer(input_ids, attention_mask, position_ids)          # (b, s, h)
        local_logits = self.transformer.wte.lm_logits(hidden)                      # (b, s, V_pad/p)
        loss = None
        if labels is not None:
            # Shift the labels, not the logits (no logits-sized copy): position t predicts t+1.
            targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)   # (b, s)
            token_loss = vocab_parallel_cross_entropy(                              # (b, s)
                local_logits, targets, self.parallel, vocab_size=self.config.vocab_size)
            loss = token_loss.sum() / (targets != -100).sum().clamp(min=1)
        logits = local_logits
        if gather_output:
            from zoo.parallel import gather_from_tp_region
            logits = gather_from_tp_region(local_logits, self.parallel)[..., :self.config.vocab_size]
        return CausalLMOutput(loss=loss, logits=logits)

    # ------------------------------------------------------------------ transformers checkpoints
    def hf_param_map(self) -> dict[str, HFParam]:
        """zoo parameter -> transformers ``GPT2LMHeadModel`` key.

        Names are identical; Conv1D weights are stored transposed (in, out). ``c_attn`` is the fused
        [Q | K | V] projection: its output dim (HF dim 1) is split with stride 3, so rank r holds
        columns [q_r | k_r | v_r] with q_r = Q[:, r*h/p:(r+1)*h/p] (likewise k, v): its own heads.
        ``lm_head.weight`` is tied to ``transformer.wte.weight`` and not stored.
        """
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        table = {}
        for name, _ in self.named_parameters():
            table[name] = HFParam(
                key=name, transpose=name.endswith(conv1d),
                vocab_rows=self.config.vocab_size if name == "transformer.wte.weight" else None)
        return table

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, parallel: ParallelState | None = None,
                        dtype: torch.dtype | None = None, **config_overrides) -> "GPT2LMHeadModel":
        """Build from a transformers GPT-2 directory (config.json + safetensors), reading only this
        rank's slices. ``config_overrides`` set zoo fields, e.g. ``activation_checkpointing=True``."""
        values = read_config_json(directory)
        model_type = values.get("model_type")
        if model_type != "gpt2":
            raise ValueError(f"checkpoint {directory} has model_type {model_type!r}, not 'gpt2'; load it with "
                             "the zoo class for that model type.")
        config = GPT2Config.from_dict(values).replace(**config_overrides)
        with torch.device("meta"):
            model = cls(config, parallel)
        materialize_meta_module(model, "cpu")
        files = _prefixed_keys_adapter(directory)
        load_hf_weights(model, directory, files(model.hf_param_map()), parallel,
                        ignorable=(".attn.bias", ".attn.masked_bias", "lm_head.weight"))
        if any((Path(directory) / f).is_file() for f in ("vocab.json", "tokenizer.json")):
            model.tokenizer_dir = Path(directory)
        if dtype is not None:
            model.to(dtype)
        return model

    def save_pretrained(self, directory: str | os.PathLike, dtype: torch.dtype | None = None,
                        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        """Collective: write transformers' GPT2LMHeadModel layout (merged over tp, vocab unpadded).

        Weights above ``max_shard_size`` (bytes or e.g. "2GB") are split into indexed shards.
        """
        state = hf_state_dict(self, self.hf_param_map(), self.parallel)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        is_writer = not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_rank() == 0
        if is_writer:
            config = hf_config_dict(self.config, dtype or next(self.parameters()).dtype)
            write_pretrained(directory, config, state, tokenizer_files(self.tokenizer_dir), max_shard_size)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()


def hf_config_dict(config: GPT2Config, dtype: torch.dtype) -> dict:
    """The config.json of a checkpoint whose weights are stored in ``dtype``."""
    return {**config.to_hf_dict(), "torch_dtype": str(dtype).replace("torch.", "")}


def tokenizer_files(directory: str | os.PathLike = GPT2_TOKENIZER_DIR) -> list[Path]:
    """The GPT-2 tokenizer files present in ``directory`` (by default the bundled ones)."""
    return [Path(directory) / name for name in TOKENIZER_FILE_NAMES if (Path(directory) / name).is_file()]


def _prefixed_keys_adapter(directory):
    """Original OpenAI-converted gpt2 checkpoints store keys without the ``transformer.`` prefix."""
    from zoo.models.hf_io import CheckpointFiles

    keys = set(CheckpointFiles(directory).keys())

    def adapt(table: dict[str, HFParam]) -> dict[str, HFParam]:
        if "transformer.wte.weight" in keys or "wte.weight" not in keys:
            return table
        return {name: HFParam(spec.key.removeprefix("transformer."), spec.transpose, spec.vocab_rows)
                for name, spec in table.items()}

    return adapt
