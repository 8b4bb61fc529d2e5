"""Tensor-parallel GPT-2 with transformers' names, forward signature and checkpoint layout."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from zoo.assets import GPT2_TOKENIZER_DIR
from zoo.errors import UserError
from zoo.models.config import recompute_mode
from zoo.models.gpt2.config import GPT2Config, check_gpt2_config_values
from zoo.models.outputs import with_cache
from zoo.models.pretrained import HFPretrainedMixin
from zoo.models.transformer import (
    KVCache,
    LayerOptions,
    TransformerLayer,
    attention_bias,
    causal_lm_head_outputs,
    region_dropout,
    run_layers,
)
from zoo.parallel import VocabParallelEmbedding, scaled_init_std
from zoo.parallel.context import context_positions
from zoo.parallel.layers import SequenceParallelLayerNorm, uses_sequence_parallel
from zoo.parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from zoo.parallel.state import ParallelState, as_state


def gpt2_layer_options(config: GPT2Config) -> LayerOptions:
    """The settings of every GPT-2 layer: pre-norm, GeLU as configured, output GEMMs initialised with the
    depth-scaled std."""
    std = config.initializer_range
    return LayerOptions(config.n_embd, config.n_head, config.ffn_hidden_size,
                        layer_norm_eps=config.layer_norm_epsilon, attn_dropout=config.attn_pdrop,
                        hidden_dropout=config.resid_pdrop, gelu_approximate=config.gelu_approximate,
                        init_std=std, output_init_std=scaled_init_std(std, config.n_layer), pre_norm=True,
                        sequence_parallel=config.sequence_parallel)


class GPT2Model(nn.Module):
    """Embeddings, N pre-norm layers and the final LayerNorm (transformers' ``GPT2Model``).

    ``config.sequence_parallel`` (tp > 1): a full-sequence forward scatters the embeddings
    (word + position, after the vocab-parallel all-reduce) along the sequence, runs embedding dropout
    (TP-rank stream), the layers and ``ln_f`` on this rank's s/p tokens (see :meth:`hidden_states`), and
    :meth:`forward` all-gathers the result, so it returns (b, s, h) like transformers. Key/value-cached
    decoding runs without sequence parallelism (it is a training-memory device; decoding holds few tokens).
    transformers' checkpoints store the GEMM weights as Conv1D's (in, out); the name map of
    :class:`GPT2LMHeadModel` (``hf_transposed_keys``) says so, the layers hold ``nn.Linear``'s (out, in).
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
        options = gpt2_layer_options(config)
        self.h = nn.ModuleList(TransformerLayer(options, parallel=parallel) for _ in range(config.n_layer))
        self.ln_f = SequenceParallelLayerNorm(config.n_embd, eps=config.layer_norm_epsilon, parallel=parallel,
                                              sequence_parallel=sp)

    def uses_sequence_parallel(self, seq_len: int) -> bool:
        """Whether a full-sequence (uncached) forward of ``seq_len`` tokens is sequence-parallel; raises
        the one-sentence UserError when it should be but ``seq_len`` does not divide by tp."""
        return uses_sequence_parallel(self.parallel, self.config.sequence_parallel, seq_len)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None,
                      cache: KVCache | None = None) -> tuple[torch.Tensor, bool]:
        """The one forward path: (final hidden states, sequence_parallel). The states are (b, s/p, h), this
        rank's tokens, when sequence_parallel is True (a full-sequence forward with the config asking, tp > 1),
        else (b, s, h). With a ``cache`` (decoding) ``input_ids`` holds only the s new tokens after its P past
        ones, ``attention_mask`` (if given) covers past and new tokens, (b, P + s), positions default to
        P ... P + s - 1, and the cache receives every layer's updated keys and values."""
        b, s = input_ids.shape                                                     # s = S/c: this context rank's
        past_length = cache.past_length if cache is not None else 0
        total = past_length + s * self.parallel.cp_size
        if s > self.config.n_positions or (position_ids is None and total > self.config.n_positions):
            raise UserError(f"sequence length {total} exceeds n_positions={self.config.n_positions}; "
                             f"truncate inputs to {self.config.n_positions} tokens.")
        sp = cache is None and self.uses_sequence_parallel(s)
        if position_ids is None and self.parallel.cp_size > 1:
            position_ids = context_positions(s, self.parallel, input_ids.device)  # (1, s): global positions
        elif position_ids is None:
            position_ids = torch.arange(past_length, past_length + s, device=input_ids.device).unsqueeze(0)  # (1, s)
        x = self.wte(input_ids) + self.wpe(position_ids)                           # (b, s, h)
        if sp:
            x = scatter_to_sequence_parallel_region(x, self.parallel)              # (b, s/p, h)
        x = region_dropout(self.drop, x, self.parallel, sp)
        if past_length > 0 and attention_mask is None and s > 1:
            # SDPA's is_causal would align the triangle top-left; the offset triangle needs a bias.
            attention_mask = torch.ones(b, past_length + s, dtype=torch.bool, device=input_ids.device)
        bias = attention_bias(attention_mask, s, causal=True, dtype=x.dtype,
                              past_length=past_length)                             # (b, 1, s, P + s) or None
        recompute = recompute_mode(self.config) if self.training and cache is None else None
        x = run_layers(self.h, x, bias, causal=True, recompute=recompute, cache=cache, sequence_parallel=sp)
        return self.ln_f(x, sequence_parallel=sp), sp                               # (b, s or s/p, h)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s/p, h) -> (b, s, h) for a replicated consumer: backward keeps this rank's tokens of the (equal)
        gradients."""
        return gather_from_sequence_parallel_region(x, self.parallel, tensor_parallel_output_grad=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False):
        """Final hidden states (b, s, h); with ``use_cache`` the pair (hidden, presents).

        ``past_key_values``: one (k, v) per layer, each (b, heads_local, P, d), from an earlier call
        with ``use_cache``; ``input_ids`` then holds only the s new tokens (see :meth:`hidden_states`).
        """
        cache = KVCache(past_key_values, len(self.h)) if past_key_values is not None or use_cache else None
        x, sp = self.hidden_states(input_ids, attention_mask, position_ids, cache)  # (b, s or s/p, h)
        if sp:
            x = self.gather_sequence(x)                                             # (b, s, h)
        return (x, cache.presents()) if use_cache else x


class GPT2LMHeadModel(HFPretrainedMixin, nn.Module):
    """GPT-2 language model; the LM head is tied to the vocab-parallel input embedding.

    ``forward`` follows transformers: labels are shifted inside, -100 is ignored. ``.logits`` is
    this rank's vocab shard (b, s, V_padded / p) by default at tp > 1, and the full unpadded vocabulary
    (b, s, V) with ``gather_output=True`` and always at tp = 1. The loss never gathers logits (fused cross-entropy).

    Decoding: ``use_cache=True`` returns the key/value cache, a tuple of one (k, v) per layer, each
    (b, heads_local, P + s, d) for this rank's heads, under the installed transformers' field name (``.cache``
    or ``.past_key_values``; :func:`zoo.models.outputs.cache_of` reads either); pass it back as
    ``past_key_values`` with only the new tokens.
    ``logits_to_keep`` = n > 0 computes (and gathers) the logits of the last n positions only.

    ``config.sequence_parallel`` (tp > 1, Korthikanti et al. 2022): the full-sequence forward keeps
    this rank's s/p tokens up to the LM head, whose input is all-gathered along the sequence in place
    of f (backward: reduce-scatter), as in Megatron; logits and loss are unchanged. Key/value-cached
    decoding runs without it (whatever the length); with ``logits_to_keep`` (no cache) the hidden states
    are all-gathered before the head is applied to the kept positions.
    """

    base_prefix = "transformer."   # OpenAI-converted gpt2 checkpoints store keys without it
    ignorable_keys = (".attn.bias", ".attn.masked_bias", "lm_head.weight")  # causal-mask buffers, tied head
    # transformers' Conv1D keeps these GEMM weights as (in, out); zoo's layers hold nn.Linear's (out, in)
    hf_transposed_keys = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
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
        if logits_to_keep and labels is not None:
            raise UserError("labels need the logits of every position; pass logits_to_keep=0 with labels.")
        cache = KVCache(past_key_values, self.config.n_layer) if past_key_values is not None or use_cache else None
        hidden, sp = self.transformer.hidden_states(input_ids, attention_mask, position_ids, cache)  # (b, s or s/p, h)
        if logits_to_keep:
            if sp:
                hidden, sp = self.transformer.gather_sequence(hidden), False        # (b, s, h)
            hidden = hidden[:, -logits_to_keep:]                                    # (b, n, h)
        local_logits = self.transformer.wte.lm_logits(hidden, sequence_parallel=sp)  # (b, s, V_pad/p)
        loss, logits = causal_lm_head_outputs(local_logits, labels, self.parallel, self.config.vocab_size,
                                              gather_output)                     # (b, s, V) gathered
        presents = cache.presents() if use_cache else None
        return with_cache(CausalLMOutputWithPast, presents, loss=loss, logits=logits)

    # ------------------------------------------------------------------ transformers checkpoints
    @classmethod
    def config_from_hf(cls, values: dict) -> GPT2Config:
        if values.get("model_type") != "gpt2":
            raise UserError(f"checkpoint has model_type {values.get('model_type')!r}, not 'gpt2'; load it with "
                             "the zoo class for that model type.")
        return GPT2Config.from_dict(values)

    check_hf_config = staticmethod(check_gpt2_config_values)

    def hf_config_dict(self) -> dict:
        return self.config.to_hf_dict()

    def hf_names(self) -> dict[str, str]:
        """zoo parameter -> transformers ``GPT2LMHeadModel`` key: the names are identical (how each tensor is
        split comes from the layers' partition specs, which keys are stored transposed from ``hf_transposed_keys``). ``lm_head.weight`` is tied to
        ``transformer.wte.weight`` and not stored."""
        return {name: name for name, _ in self.named_parameters()}
