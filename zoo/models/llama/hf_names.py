"""Llama's transformers checkpoint layout (``model_type`` "llama"): names and config.json.

zoo's parameter names are transformers' ``LlamaForCausalLM`` / ``LlamaModel`` keys, with one exception,
the fused gate/up GEMM:

    zoo                                   transformers
    model.embed_tokens.weight             model.embed_tokens.weight        vocab rows, padding cut
    model.layers.N.self_attn.q_proj       model.layers.N.self_attn.q_proj  (n d, h), rows = query heads
    model.layers.N.self_attn.k_proj/v_proj                                 (n_kv d, h), rows = KV heads
    model.layers.N.self_attn.o_proj       model.layers.N.self_attn.o_proj  (h, n d), split by columns
    model.layers.N.mlp.gate_up_proj       model.layers.N.mlp.gate_proj + model.layers.N.mlp.up_proj
    model.layers.N.mlp.down_proj          model.layers.N.mlp.down_proj     (h, I), split by columns
    model.layers.N.{input,post_attention}_layernorm, model.norm            replicated
    lm_head.weight                        lm_head.weight                   vocab rows, padding cut (untied)

``gate_up_proj`` is stored as its two blocks: rank i's shard [W_gate,i; W_up,i] is read from rows
[i I/p, (i+1) I/p) of each of ``gate_proj`` and ``up_proj`` and written back merged the same way (its
partition spec has stride 2). Every weight is stored as ``nn.Linear``'s (out, in); how each is split comes
from its layer's partition spec (:mod:`zoo.parallel.partition`).
"""

from __future__ import annotations

from pathlib import Path

from zoo.assets import GPT2_TOKENIZER_DIR
from zoo.errors import UserError
from zoo.models.llama.config import LlamaConfig, check_llama_config_values
from zoo.models.pretrained import HFPretrainedMixin

FUSED_GATE_UP = "mlp.gate_up_proj.weight"
GATE_UP_KEYS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")


def llama_hf_names(parameter_names) -> dict[str, str | tuple[str, ...]]:
    """zoo parameter -> transformers key (or the two keys of the fused gate/up weight)."""
    names: dict[str, str | tuple[str, ...]] = {}
    for name in parameter_names:
        if name.endswith(FUSED_GATE_UP):
            stem = name[: -len(FUSED_GATE_UP)]
            names[name] = tuple(stem + key for key in GATE_UP_KEYS)
        else:
            names[name] = name
    return names


class LlamaCheckpointMixin(HFPretrainedMixin):
    """``from_pretrained`` / ``save_pretrained`` of transformers' Llama directories (each rank reads only its
    slices; saving writes merged, unpadded safetensors). A bare :class:`LlamaModel` reads a causal-LM
    checkpoint by its ``model.`` keys and ignores ``lm_head``. Without tokenizer files in the directory the
    bundled GPT-2 BPE (the vocabulary of zoo's demo presets) stands in, with a warning."""

    base_prefix = "model."
    default_tokenizer_dir: Path = GPT2_TOKENIZER_DIR
    architecture = "LlamaForCausalLM"

    @classmethod
    def config_from_hf(cls, values: dict) -> LlamaConfig:
        if values.get("model_type") != "llama":
            raise UserError(f"checkpoint has model_type {values.get('model_type')!r}, not 'llama'; load it with "
                             "the zoo class for that model type.")
        check_llama_config_values(values, "config.json")
        return LlamaConfig.from_hf_dict(values)

    def hf_config_dict(self) -> dict:
        return self.config.to_hf_dict(self.architecture)

    def hf_names(self) -> dict[str, str | tuple[str, ...]]:
        return llama_hf_names(name for name, _ in self.named_parameters())
