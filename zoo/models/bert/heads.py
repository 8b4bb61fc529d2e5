"""Finetuning heads on the tensor-parallel BERT: sequence classification (MNLI, QQP), multiple
choice (RACE) and extractive question answering (SQuAD).

The encoder is tensor-parallel; each head is a small replicated linear layer. A head that the
starting checkpoint lacks (a pretraining or bare-encoder directory) is drawn from a generator seeded
with ``head_seed``, so every TP rank starts from the same head without any communication.
Checkpoints use transformers' classes: ``BertFor*`` (post-norm) or ``MegatronBertFor*`` (pre-norm),
keys ``bert.*`` + ``classifier.*`` / ``qa_outputs.*``.

Sequence parallelism (``sequence_parallel=True``, e.g. as a ``from_pretrained`` keyword) acts inside
the encoder: :meth:`BertModel.forward` all-gathers its output along the sequence (backward: each rank
keeps its own tokens' gradient, the heads being replicated), so the heads run as without it. The
sequence length must then divide by tp.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import (
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
)

from zoo.checkpoint.hf.hf_io import read_config_json
from zoo.errors import UserError
from zoo.models.bert.config import BertConfig
from zoo.models.bert.model import BertModel, _BertCheckpoints, at_least_fp32, init_head_params
from zoo.parallel.state import ParallelState, as_state

_PRETRAINING_HEAD_PREFIXES = ("cls.",)
_POOLER_KEYS = ("pooler.dense.weight", "pooler.dense.bias")


def num_labels_of(config: BertConfig) -> int:
    """The label count stored HF-style in config.json's ``id2label`` (2 when absent, as transformers)."""
    return len(config.extra.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"})


def with_labels(config: BertConfig, num_labels: int | None = None,
                labels: list[str] | tuple[str, ...] | None = None) -> BertConfig:
    """``config`` with HF's ``id2label``/``label2id`` set from label names or a label count."""
    if labels is None and num_labels is None:
        return config
    if labels is None:
        current = config.extra.get("id2label") or {}
        labels = [current.get(str(i), current.get(i, f"LABEL_{i}")) for i in range(num_labels)]
    if num_labels is not None and len(labels) != num_labels:
        raise UserError(f"num_labels={num_labels} does not match the {len(labels)} label names {list(labels)}; "
                         "pass one of them or make them agree.")
    extra = {**config.extra, "id2label": {str(i): name for i, name in enumerate(labels)},
             "label2id": {name: i for i, name in enumerate(labels)}}
    return config.replace(extra=extra)


class _BertTaskModel(_BertCheckpoints, nn.Module):
    """Shared body of the finetuning models: ``self.bert`` plus a replicated head named ``head_name``."""

    base_prefix = "bert."
    ignorable_prefixes = _PRETRAINING_HEAD_PREFIXES
    new_param_prefixes = ("classifier.",)
    add_pooling_layer = True
    head_name = "classifier"

    def __init__(self, config: BertConfig, parallel: ParallelState | None = None):
        super().__init__()
        self.config = config
        self.parallel = parallel = as_state(parallel)
        self.bert = BertModel(config, parallel, add_pooling_layer=self.add_pooling_layer)
        classifier_dropout = config.extra.get("classifier_dropout")
        self.dropout = nn.Dropout(config.hidden_dropout_prob if classifier_dropout is None else classifier_dropout)
        setattr(self, self.head_name, nn.Linear(config.hidden_size, self.head_outputs(config)))
        if not getattr(self, self.head_name).weight.is_meta:
            self.init_new_params([f"{self.head_name}.weight", f"{self.head_name}.bias"], seed=0)

    @classmethod
    def head_outputs(cls, config: BertConfig) -> int:
        raise NotImplementedError

    def init_new_params(self, names: list[str], seed: int) -> None:
        """Draw the named head parameters as BERT does (see :func:`init_head_params`), the same on every rank."""
        init_head_params(self, names, seed, self.config.initializer_range)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, parallel: ParallelState | None = None,
                        dtype: torch.dtype | None = None,
                        num_labels: int | None = None, labels: list[str] | None = None, head_seed: int = 0,
                        **config_overrides):
        """Any pre- or post-norm BERT directory: a bare encoder, pretraining heads (dropped) or this
        task's own head. A head absent from the directory is initialised from ``head_seed``. Returned in eval
        mode, as transformers returns it."""
        values = read_config_json(directory)
        cls.check_overrides(directory, values, config_overrides)
        config = cls.configure_head(cls.config_from_hf(values).replace(**config_overrides), num_labels, labels)
        return cls.load_into(directory, config, parallel, dtype, new_params_seed=head_seed)

    @classmethod
    def configure_head(cls, config: BertConfig, num_labels: int | None, labels) -> BertConfig:
        return config

    def hf_names(self) -> dict[str, str | tuple[str, ...]]:
        heads = {f"{self.head_name}.{leaf}": f"{self.head_name}.{leaf}" for leaf in ("weight", "bias")}
        return {**{f"bert.{k}": v for k, v in self.bert.hf_names(prefix="bert.").items()}, **heads}


class BertForSequenceClassification(_BertTaskModel):
    """Sentence(-pair) classification (MNLI: 3 labels, QQP: 2): pooled [CLS] -> dropout -> linear.

    ``labels`` (b,) give the cross-entropy loss (mean squared error when ``num_labels == 1``)."""

    hf_architecture = "ForSequenceClassification"

    @classmethod
    def head_outputs(cls, config: BertConfig) -> int:
        return num_labels_of(config)

    @classmethod
    def configure_head(cls, config: BertConfig, num_labels: int | None, labels) -> BertConfig:
        return with_labels(config, num_labels, labels)

    @property
    def num_labels(self) -> int:
        return num_labels_of(self.config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> SequenceClassifierOutput:
        pooled = self.bert(input_ids, attention_mask, token_type_ids, position_ids).pooler_output  # (b, h)
        logits = self.classifier(self.dropout(pooled))                                          # (b, labels)
        loss = None
        if labels is not None:
            # fp32 losses: an fp16 loss cannot carry the fp16 loss scale back (65,536 overflows fp16)
            scores = at_least_fp32(logits)
            loss = (F.mse_loss(scores.squeeze(-1), labels.to(scores.dtype)) if self.num_labels == 1
                    else F.cross_entropy(scores, labels.view(-1)))
        return SequenceClassifierOutput(loss=loss, logits=logits)


class BertForMultipleChoice(_BertTaskModel):
    """Multiple choice (RACE: 4 options). Each (b, n, s) option sequence is encoded on its own;
    pooled output -> dropout -> linear to one score; softmax over the n options."""

    hf_architecture = "ForMultipleChoice"

    @classmethod
    def head_outputs(cls, config: BertConfig) -> int:
        return 1

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> MultipleChoiceModelOutput:
        b, n, s = input_ids.shape

        def flat(t):
            return None if t is None else t.reshape(b * n, -1)                                # (b*n, s)

        pooled = self.bert(flat(input_ids), flat(attention_mask), flat(token_type_ids),
                           flat(position_ids)).pooler_output                                  # (b*n, h)
        logits = self.classifier(self.dropout(pooled)).view(b, n)                             # (b, n)
        loss = F.cross_entropy(at_least_fp32(logits), labels.view(-1)) if labels is not None else None
        return MultipleChoiceModelOutput(loss=loss, logits=logits)


class BertForQuestionAnswering(_BertTaskModel):
    """Extractive QA (SQuAD): per-token start and end logits from a linear layer on the encoder output.

    No pooler, like transformers' class. ``start_positions``/``end_positions`` (b,) give the mean of
    the two cross-entropies; positions outside the sequence are ignored, as in transformers."""

    hf_architecture = "ForQuestionAnswering"
    add_pooling_layer = False
    head_name = "qa_outputs"
    new_param_prefixes = ("qa_outputs.",)
    ignorable_keys = _BertCheckpoints.ignorable_keys + _POOLER_KEYS

    @classmethod
    def head_outputs(cls, config: BertConfig) -> int:
        return 2

    @classmethod
    def configure_head(cls, config: BertConfig, num_labels: int | None, labels) -> BertConfig:
        # transformers sizes qa_outputs by num_labels, which must therefore say 2 (start, end).
        return with_labels(config, num_labels=2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, start_positions: torch.Tensor | None = None,
                end_positions: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> QuestionAnsweringModelOutput:
        hidden = self.bert(input_ids, attention_mask, token_type_ids, position_ids).last_hidden_state  # (b, s, h)
        start_logits, end_logits = self.qa_outputs(hidden).unbind(dim=-1)                         # (b, s) each
        loss = None
        if start_positions is not None and end_positions is not None:
            s = input_ids.shape[1]
            start = start_positions.view(-1).clamp(0, s)
            end = end_positions.view(-1).clamp(0, s)
            loss = (F.cross_entropy(at_least_fp32(start_logits), start, ignore_index=s)
                    + F.cross_entropy(at_least_fp32(end_logits), end, ignore_index=s)) / 2
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits.contiguous(),
                                            end_logits=end_logits.contiguous())
