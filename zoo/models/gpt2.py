"""Tensor-parallel GPT-2 with transformers' names, forward signature and checkpoint layout."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from zoo.models.config import GPT2Config, recompute_mode
from zoo.models.hf_io import HFParam
from zoo.assets import GPT2_TOKENIZER_DIR
from zoo.models.pretrained import HFPretrainedMixin
from zoo.models.transformer import (TransformerLayer, attention_bias, region_dropout, run_layers,
                                    sequence_parallel_for)
from zoo.parallel import VocabParallelEmbedding, scaled_init_std, vocab_parallel_cross_entropy
from zoo.parallel.layers import SequenceParallelLayerNorm
from zoo.parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from zoo.parallel.state import ParallelState, as_state



class GPT2Model(nn.Module):
    """Embeddings, N pre-norm layers and the final LayerNorm (transformers' ``GPT2Model``).

    ``config.sequence_parallel`` (tp > 1): a full-sequence forward scatters the embeddings
    (word + position, after the vocab-parallel all-reduce) along the sequence, runs embedding dropout
    (TP-rank stream), the layers and ``ln_f`` on this rank's s/p tokens (see :meth:`encode`), and
    :meth:`forward` all-gathers the result, so it returns (b, s, h) like transformers. Key/value-cached
    decoding runs without sequence parallelism (it is a training-memory device; decoding holds few tokens).
    """

    def __init__(self, config: GPT2Config, parallel: ParallelState | None = None):
        super().__init__()
        self.config = config
        self.parallel = parallel = as_state(parallel)
        std = config.initializer_range
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, parallel=parallel,
                                          pad_multiple=config.make_vocab_size_divisible_by, init_std=std)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        nn.init.normal_(self.wpe.weight, 0.0, std)
        self.drop = nn.Dropout(config.embd_pdrop)
        sp = config.sequence_parallel
        self.h = nn.ModuleList(
            TransformerLayer(config.n_embd, config.n_head, config.ffn_hidden_size,
                             layer_norm_eps=config.layer_norm_epsilon, attn_dropout=config.attn_pdrop,
                             hidden_dropout=config.resid_pdrop, gelu_approximate=config.gelu_approximate,
                             parallel=parallel, init_std=std,
                             output_init_std=scaled_init_std(std, config.n_layer), pre_norm=True,
                             sequence_parallel=sp)
            for _ in range(config.n_layer))
        self.ln_f = SequenceParallelLayerNorm(config.n_embd, eps=config.layer_norm_epsilon, parallel=parallel,
                                              sequence_parallel=sp)

    def uses_sequence_parallel(self, seq_len: int) -> bool:
        """Whether a full-sequence (uncached) forward of ``seq_len`` tokens is sequence-parallel; raises
        the one-sentence ValueError when it should be but ``seq_len`` does not divide by tp."""
        return sequence_parallel_for(self.config, self.parallel, seq_len)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """The full-sequence (training / scoring) path: (final hidden states, sequence_parallel). The
        states are (b, s/p, h), this rank's tokens, when sequence_parallel is True, else (b, s, h)."""
        b, s = input_ids.shape
        self._check_length(s, 0, position_ids)
        sp = self.uses_sequence_parallel(s)
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)   # (1, s)
        x = self.wte(input_ids) + self.wpe(position_ids)                           # (b, s, h)
        if sp:
            x = scatter_to_sequence_parallel_region(x, self.parallel)              # (b, s/p, h)
        x = region_dropout(self.drop, x, self.parallel, sp)
        bias = attention_bias(attention_mask, s, causal=True, dtype=x.dtype)      # (b, 1, s, s) or None
        x = run_layers(self.h, x, bias, causal=True, checkpoint=self._recompute(), sequence_parallel=sp)
        return self.ln_f(x, sequence_parallel=sp), sp                               # (b, s or s/p, h)

    def _recompute(self) -> str | None:
        return recompute_mode(self.config) if self.training else None

    def _check_length(self, s: int, past_length: int, position_ids) -> None:
        if s > self.config.n_positions or (position_ids is None and past_length + s > self.config.n_positions):
            raise ValueError(f"sequence length {past_length + s} exceeds n_positions={self.config.n_positions}; "
                             f"truncate inputs to {self.config.n_positions} tokens.")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False):
        """Final hidden states (b, s, h); with ``use_cache`` the pair (hidden, presents).

        ``past_key_values``: one (k, v) per layer, each (b, heads_local, P, d), from an earlier call
        with ``use_cache``; ``input_ids`` then holds only the s new tokens, ``attention_mask`` (if
        given) covers past and new tokens, (b, P + s), and positions default to P ... P + s - 1.
        """
        if past_key_values is None and not use_cache:                              # training / scoring path
            x, sp = self.encode(input_ids, attention_mask, position_ids)           # (b, s or s/p, h)
            if sp:   # a replicated consumer: backward keeps this rank's tokens of the (equal) gradients
                x = gather_from_sequence_parallel_region(x, self.parallel, tensor_parallel_output_grad=False)
            return x                                                                # (b, s, h)
        b, s = input_ids.shape
        past_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        self._check_length(s, past_length, position_ids)
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + s, device=input_ids.device).unsqueeze(0)  # (1, s)
        x = self.wte(input_ids) + self.wpe(position_ids)                           # (b, s, h)
        x = self.drop(x)
        if past_length > 0 and attention_mask is None and s > 1:
            # SDPA's is_causal would align the triangle top-left; the offset triangle needs a bias.
            attention_mask = torch.ones(b, past_length + s, dtype=torch.bool, device=input_ids.device)
        bias = attention_bias(attention_mask, s, causal=True, dtype=x.dtype,
                              past_length=past_length)                             # (b, 1, s, P + s) or None
        out = run_layers(self.h, x, bias, causal=True, checkpoint=False,
                         past_key_values=past_key_values if past_length > 0 else None, use_cache=use_cache)
        x, presents = out if use_cache else (out, None)                             # (b, s, h)
        x = self.ln_f(x, sequence_parallel=False)                                   # (b, s, h)
        return (x, presents) if use_cache else x


class GPT2LMHeadModel(HFPretrainedMixin, nn.Module):
    """GPT-2 language model; the LM head is tied to the vocab-parallel input embedding.

    ``forward`` follows transformers: labels are shifted inside, -100 is ignored. ``.logits`` is
    this rank's vocab shard (b, s, V_padded / p) by default and the full unpadded vocabulary
    (b, s, V) with ``gather_output=True``. The loss never gathers logits (fused cross-entropy).

    Decoding: ``use_cache=True`` returns ``.past_key_values``, a tuple of one (k, v) per layer, each
    (b, heads_local, P + s, d) for this rank's heads; pass it back with only the new tokens.
    ``logits_to_keep`` = n > 0 computes (and gathers) the logits of the last n positions only.

    ``config.sequence_parallel`` (tp > 1, Korthikanti et al. 2022): the full-sequence forward keeps
    this rank's s/p tokens up to the LM head, whose input is all-gathered along the sequence in place
    of f (backward: reduce-scatter), as in Megatron; logits and loss are unchanged. Key/value-cached
    decoding runs without it (whatever the length); with ``logits_to_keep`` (no cache) the hidden states
    are all-gathered before the head is applied to the kept positions.
    """

    base_prefix = "transformer."   # OpenAI-converted gpt2 checkpoints store keys without it
    ignorable_keys = (".attn.bias", ".attn.masked_bias", "lm_head.weight")  # causal-mask buffers, tied head
    default_tokenizer_dir = GPT2_TOKENIZER_DIR

    def __init__(self, config: GPT2Config, parallel: ParallelState | None = None):
        super().__init__()
        parallel = as_state(parallel)
        config.validate(parallel.tp_size)
        self.config = config
        self.parallel = parallel
        self.transformer = GPT2Model(config, parallel)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                gather_output: bool = False, past_key_values=None, use_cache: bool = False,
                logits_to_keep: int = 0) -> CausalLMOutputWithPast:
        presents = None
        sp = False
        if past_key_values is None and not use_cache and not logits_to_keep:
            hidden, sp = self.transformer.encode(input_ids, attention_mask, position_ids)  # (b, s or s/p, h)
        elif past_key_values is None and not use_cache:
            hidden = self.transformer(input_ids, attention_mask, position_ids)      # (b, s, h)
        else:
            out = self.transformer(input_ids, attention_mask, position_ids, past_key_values=past_key_values,
                                   use_cache=use_cache)
            hidden, presents = out if use_cache else (out, None)                    # (b, s, h)
        if logits_to_keep:
            if labels is not None:
                raise ValueError("labels need the logits of every position; pass logits_to_keep=0 with labels.")
            hidden = hidden[:, -logits_to_keep:]                                    # (b, n, h)
        local_logits = self.transformer.wte.lm_logits(hidden, sequence_parallel=sp)  # (b, s, V_pad/p)
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
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=presents)

    # ------------------------------------------------------------------ transformers checkpoints
    @classmethod
    def config_from_hf(cls, values: dict) -> GPT2Config:
        if values.get("model_type") != "gpt2":
            raise ValueError(f"checkpoint has model_type {values.get('model_type')!r}, not 'gpt2'; load it with "
                             "the zoo class for that model type.")
        return GPT2Config.from_dict(values)

    def hf_config_dict(self) -> dict:
        return self.config.to_hf_dict()

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
