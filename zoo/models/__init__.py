"""Tensor-parallel models with transformers' class names, forward signatures and checkpoint layouts."""

from zoo.models.bert import BertForPreTraining, BertModel
from zoo.models.bert.config import BertConfig
from zoo.models.bert.presets import BERT_PRESETS, bert_config
from zoo.models.families import model_config
from zoo.models.gpt2 import GPT2LMHeadModel, GPT2Model
from zoo.models.gpt2.config import GPT2Config
from zoo.models.gpt2.presets import GPT2_PRESETS, gpt2_config
from zoo.models.llama import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM, LlamaModel, llama_config

__all__ = [
    "BertConfig", "BertForPreTraining", "BertModel", "GPT2Config", "GPT2LMHeadModel", "GPT2Model",
    "BERT_PRESETS", "GPT2_PRESETS", "bert_config", "gpt2_config", "model_config",
    "LLAMA_PRESETS", "LlamaConfig", "LlamaForCausalLM", "LlamaModel", "llama_config",
]
