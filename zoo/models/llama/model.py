"""Tensor-parallel Llama with transformers' class names, forward signatures and checkpoint layout.

    LlamaModel:        embed_tokens (vocab-parallel) -> N decoder layers -> norm (RMSNorm)
    LlamaForCausalLM:  LlamaModel -> lm_head (vocab-parallel, untied) -> fused vocab-parallel cross-entropy

The LM head is a second vocab-parallel matrix, not the embedding: logits_i = f(H) W_i^T, rank i holding
rows [start_i, end_i) of the padded vocabulary, and the loss never gathers the logits. Padded vocabulary
rows start at zero and are excluded from the softmax, so logits and loss equal transformers' exactly.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from zoo.errors import UserError
from zoo.models.config import recompute_mode
from zoo.models.llama.config import LlamaConfig
from zoo.models.llama.hf_names import LlamaCheckpointMixin
from zoo.models.llama.layers import LlamaDecoderLayer, LlamaRMSNorm
from zoo.models.llama.rope import rotary_cos_sin
from zoo.models.outputs import with_cache
from zoo.models.transformer import KVCache, attention_bias, causal_lm_head_outputs, recomputed
from zoo.parallel import VocabParallelEmbedding
from zoo.parallel.context import context_positions
from zoo.parallel.layers import uses_sequence_parallel
from zoo.parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from zoo.parallel.state import ParallelState, as_state


class VocabParallelLMHead(VocabParallelEmbedding):
    """An untied output embedding W (V_padded, h) split along the vocabulary: forward(H) = f(H) W_i^T,
    (b, s, h) -> (b, s, V_padded / p), this rank's logits. Same weight layout, padding and partition spec as
    :class:`~zoo.parallel.VocabParallelEmbedding` (real rows N(0, std), padded rows zero)."""

    def forward(self, hidden: torch.Tensor, gather_output: bool = False,
                sequence_parallel: bool = False) -> torch.Tensor:
        return self.lm_logits(hidden, gather_output=gather_output, sequence_parallel=sequence_parallel)


class LlamaModel(LlamaCheckpointMixin, nn.Module):
    """Embeddings, N decoder layers and the final RMSNorm (transformers' ``LlamaModel``).

    ``forward`` returns ``.last_hidden_state`` (b, s, h) and, with ``use_cache``, the key/value cache: one
    (k, v) per layer, each (b, kv_heads_local, P + s, d), this rank's key/value heads after RoPE, under the
    installed transformers' field name (``.cache`` or ``.past_key_values``; :func:`zoo.models.outputs.cache_of`
    reads either).

    ``config.sequence_parallel`` (tp > 1): a full-sequence forward scatters the embeddings along the sequence
    and runs the layers and ``norm`` on this rank's s/p tokens (:meth:`hidden_states`); :meth:`forward`
    all-gathers the result. Cached decoding runs without it.
    """

    architecture = "LlamaModel"

    def __init__(self, config: LlamaConfig, parallel: ParallelState | None = None):
        super().__init__()
        self.parallel = parallel = as_state(parallel)
        config.validate(parallel.tp_size)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel=parallel,
                                                   pad_multiple=config.make_vocab_size_divisible_by,
                                                   init_std=config.initializer_range)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, parallel) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps, parallel=parallel,
                                 sequence_parallel=config.sequence_parallel)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None,
                      cache: KVCache | None = None) -> tuple[torch.Tensor, bool]:
        """(final hidden states, sequence_parallel): (b, s/p, h), this rank's tokens, when sequence parallelism
        is in use, else (b, s, h). With a ``cache`` ``input_ids`` holds the s new tokens after its P past ones,
        ``attention_mask`` (if given) covers past and new, (b, P + s), and positions default to P ... P + s - 1."""
        b, s = input_ids.shape                                                     # s = S/c: this context rank's
        past_length = cache.past_length if cache is not None else 0
        total = past_length + s * self.parallel.cp_size
        if position_ids is None and total > self.config.max_position_embeddings:
            raise UserError(f"sequence length {total} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}; truncate inputs to that many tokens.")
        sp = cache is None and uses_sequence_parallel(self.parallel, self.config.sequence_parallel, s)
        if position_ids is None and self.parallel.cp_size > 1:
            position_ids = context_positions(s, self.parallel, input_ids.device)   # (1, s): global positions
        elif position_ids is None:
            position_ids = torch.arange(past_length, past_length + s, device=input_ids.device).unsqueeze(0)  # (1, s)
        x = self.embed_tokens(input_ids)                                           # (b, s, h)
        cos, sin = rotary_cos_sin(self.config, position_ids, x.dtype)              # (b or 1, s, d) each
        if sp:
            x = scatter_to_sequence_parallel_region(x, self.parallel)              # (b, s/p, h)
        if past_length > 0 and attention_mask is None and s > 1:
            # SDPA's is_causal aligns the triangle top-left; after a past the offset triangle needs a bias.
            attention_mask = torch.ones(b, past_length + s, dtype=torch.bool, device=input_ids.device)
        bias = attention_bias(attention_mask, s, causal=True, dtype=x.dtype,
                              past_length=past_length)                             # (b, 1, s, P + s) or None
        recompute = recompute_mode(self.config) if self.training and cache is None else None
        full = recompute == "full" and torch.is_grad_enabled()
        for index, layer in enumerate(self.layers):
            options = {"cache": None if cache is None else cache.layers[index], "sequence_parallel": sp,
                       "recompute_attention": recompute == "selective"}
            x = recomputed(layer, x, cos, sin, bias, **options) if full else layer(x, cos, sin, bias, **options)
        return self.norm(x, sp), sp                                                # (b, s or s/p, h)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s/p, h) -> (b, s, h) for a replicated consumer (backward keeps this rank's tokens)."""
        return gather_from_sequence_parallel_region(x, self.parallel, tensor_parallel_output_grad=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None,
                use_cache: bool = False) -> BaseModelOutputWithPast:
        cache = KVCache(past_key_values, len(self.layers)) if past_key_values is not None or use_cache else None
        x, sp = self.hidden_states(input_ids, attention_mask, position_ids, cache)   # (b, s or s/p, h)
        if sp:
            x = self.gather_sequence(x)                                             # (b, s, h)
        return with_cache(BaseModelOutputWithPast, cache.presents() if use_cache else None, last_hidden_state=x)


class LlamaForCausalLM(LlamaCheckpointMixin, nn.Module):
    """Llama language model: :class:`LlamaModel` plus an untied vocab-parallel LM head.

    ``forward`` follows transformers: labels are shifted inside, -100 is ignored. ``.logits`` is this rank's
    vocab shard (b, s, V_padded / p) by default at tp > 1, and the full unpadded vocabulary (b, s, V) with
    ``gather_output=True`` and always at tp = 1. The loss is the fused vocab-parallel cross-entropy (the logits are never
    gathered for it). ``use_cache=True`` returns the key/value cache (see :class:`LlamaModel`), to be passed
    back as ``past_key_values`` with only the new tokens; ``logits_to_keep`` = n > 0 computes the logits of the last n positions only.
    """

    architecture = "LlamaForCausalLM"

    def __init__(self, config: LlamaConfig, parallel: ParallelState | None = None):
        super().__init__()
        self.parallel = parallel = as_state(parallel)
        self.config = config
        self.model = LlamaModel(config, parallel)
        self.lm_head = VocabParallelLMHead(config.vocab_size, config.hidden_size, parallel=parallel,
                                           pad_multiple=config.make_vocab_size_divisible_by,
                                           init_std=config.initializer_range)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                gather_output: bool = False, past_key_values=None, use_cache: bool = False,
                logits_to_keep: int = 0) -> CausalLMOutputWithPast:
        if logits_to_keep and labels is not None:
            raise UserError("labels need the logits of every position; pass logits_to_keep=0 with labels.")
        cache = KVCache(past_key_values, len(self.model.layers)) if past_key_values is not None or use_cache else None
        hidden, sp = self.model.hidden_states(input_ids, attention_mask, position_ids, cache)  # (b, s or s/p, h)
        if logits_to_keep:
            if sp:
                hidden, sp = self.model.gather_sequence(hidden), False             # (b, s, h)
            hidden = hidden[:, -logits_to_keep:]                                    # (b, n, h)
        local_logits = self.lm_head(hidden, sequence_parallel=sp)                  # (b, s, V_pad/p)
        loss, logits = causal_lm_head_outputs(local_logits, labels, self.parallel, self.config.vocab_size,
                                              gather_output)                     # (b, s, V) gathered
        return with_cache(CausalLMOutputWithPast, cache.presents() if use_cache else None, loss=loss, logits=logits)
