"""Tensor-parallel models with transformers' class names, forward signatures and checkpoint layouts."""

from zoo.models.bert import BertForPreTraining, BertModel
from zoo.models.config import BertConfig, GPT2Config
from zoo.models.families import model_config
from zoo.models.gpt2 import GPT2LMHeadModel, GPT2Model
from zoo.models.llama import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM, LlamaModel, llama_config
from zoo.models.presets import BERT_PRESETS, GPT2_PRESETS, bert_config, gpt2_config

__all__ = [
    "BertConfig", "BertForPreTraining", "BertModel", "GPT2Config", "GPT2LMHeadModel", "GPT2Model",
    "BERT_PRESETS", "GPT2_PRESETS", "bert_config", "gpt2_config", "model_config",
    "LLAMA_PRESETS", "LlamaConfig", "LlamaForCausalLM", "LlamaModel", "llama_config",
]
