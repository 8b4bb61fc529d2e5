"""The Llama family (Touvron et al. 2023): RMSNorm, rotary embeddings, SwiGLU, grouped-query attention and
untied embeddings, tensor-parallel from zoo's Megatron layers, in transformers' names and checkpoint layout.

    config.py    LlamaConfig (transformers' field names), validation, config.json both ways
    presets.py   llama-tiny (CPU), llama2-7b, llama3-8b, llama3.1-8b
    rope.py      rotary embeddings (default and Llama-3 scaled frequencies)
    layers.py    RMSNorm, grouped-query attention, SwiGLU MLP, the decoder layer
    model.py     LlamaModel, LlamaForCausalLM
    hf_names.py  transformers' key names, from_pretrained / save_pretrained
"""

from zoo.models.llama.config import LlamaConfig
from zoo.models.llama.model import LlamaForCausalLM, LlamaModel
from zoo.models.llama.presets import LLAMA_PRESETS, llama_config

__all__ = ["LLAMA_PRESETS", "LlamaConfig", "LlamaForCausalLM", "LlamaModel", "llama_config"]
