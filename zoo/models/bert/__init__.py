"""BERT (pre-norm, the paper's Figure 7b, or post-norm): its configuration with transformers' field names
(:mod:`.config`), presets (:mod:`.presets`), the tensor-parallel encoder and pretraining model with transformers'
names and checkpoint layout (:mod:`.model`) and the finetuning heads (:mod:`.heads`)."""

from zoo.models.bert.model import BertForPreTraining, BertModel

__all__ = ["BertForPreTraining", "BertModel"]
