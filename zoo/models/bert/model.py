"""Tensor-parallel BERT, pre-norm (Megatron, the paper's Figure 7b) or post-norm (original BERT),
with transformers' class names, forward signatures and checkpoint layouts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput

from zoo.assets import BERT_TOKENIZER_DIR
from zoo.errors import UserError
from zoo.models.bert.config import BertConfig, check_bert_config_values
from zoo.models.config import recompute_mode
from zoo.models.pretrained import HFPretrainedMixin
from zoo.models.transformer import (
    LayerOptions,
    TransformerLayer,
    attention_bias,
    lm_loss,
    region_dropout,
    run_layers,
    user_logits,
)
from zoo.parallel import VocabParallelEmbedding, mark_tensor_parallel, scaled_init_std
from zoo.parallel.layers import SequenceParallelLayerNorm, mark_sequence_parallel, uses_sequence_parallel
from zoo.parallel.mappings import (
    all_reduce_grads_of_replicated,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from zoo.parallel.partition import PartitionSpec
from zoo.parallel.state import ParallelState, as_state


def _normal_linear(in_features: int, out_features: int, std: float) -> nn.Linear:
    """A replicated linear layer drawn N(0, std) from the global RNG (identical on every TP rank)."""
    layer = nn.Linear(in_features, out_features)
    nn.init.normal_(layer.weight, 0.0, std)
    nn.init.zeros_(layer.bias)
    return layer


@torch.no_grad()
def init_head_params(model: nn.Module, names: list[str], seed: int, std: float,
                     layer_norms: tuple[str, ...] = ()) -> None:
    """Draw the named parameters of a head as BERT's init does (weights N(0, std), LayerNorm weights
    1, biases 0) from a generator seeded with ``seed``: the same values on every rank, whatever the
    global RNG state. ``layer_norms`` are the name prefixes of LayerNorm modules."""
    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for name in sorted(names):
        param = params[name]
        if name.endswith("bias"):
            param.zero_()
        elif layer_norms and name.startswith(layer_norms):
            param.fill_(1.0)
        else:
            values = torch.empty(param.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)
            param.copy_(values.to(device=param.device, dtype=param.dtype))


def at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Logits for a loss: fp16/bf16 upcast to fp32, fp32/fp64 as they are. An fp16 loss cannot carry the
    fp16 loss scale back (65,536 overflows fp16); a float64 model keeps float64 (the parity tests)."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


class BertEmbeddings(nn.Module):
    """word (vocab-parallel) + position + token type; LayerNorm only in the post-norm layout.

    With sequence parallelism the sum is scattered along the sequence (after the vocab-parallel
    all-reduce, so the position and token-type tables still see every token), and the post-norm
    LayerNorm and the dropout (TP-rank stream) run on this rank's s/p tokens."""

    def __init__(self, config: BertConfig, parallel: ParallelState | None):
        super().__init__()
        std = config.initializer_range
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel=parallel,
                                                      pad_multiple=config.make_vocab_size_divisible_by, init_std=std)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        nn.init.normal_(self.position_embeddings.weight, 0.0, std)
        nn.init.normal_(self.token_type_embeddings.weight, 0.0, std)
        self.parallel = parallel = as_state(parallel)
        self.LayerNorm = None if config.pre_norm else SequenceParallelLayerNorm(
            config.hidden_size, eps=config.layer_norm_eps, parallel=parallel,
            sequence_parallel=config.sequence_parallel)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids, position_ids, sequence_parallel: bool = False):
        x = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
             + self.token_type_embeddings(token_type_ids))                        # (b, s, h)
        if sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.parallel)             # (b, s/p, h)
        if self.LayerNorm is not None:
            x = self.LayerNorm(x, sequence_parallel=sequence_parallel)
        return region_dropout(self.dropout, x, self.parallel, sequence_parallel)


HEAD_NAMES = {   # BertForPreTraining's heads -> transformers' keys
    "transform.weight": "cls.predictions.transform.dense.weight",
    "transform.bias": "cls.predictions.transform.dense.bias",
    "transform_ln.weight": "cls.predictions.transform.LayerNorm.weight",
    "transform_ln.bias": "cls.predictions.transform.LayerNorm.bias",
    "lm_bias": "cls.predictions.bias",
    "seq_relationship.weight": "cls.seq_relationship.weight",
    "seq_relationship.bias": "cls.seq_relationship.bias",
}
_BERT_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids", "cls.predictions.decoder.weight",
                 "cls.predictions.decoder.bias")


class _BertCheckpoints(HFPretrainedMixin):
    """Checkpoint I/O of zoo's BERTs: "megatron-bert" directories are pre-norm, "bert" post-norm."""

    base_prefix = "bert."
    ignorable_keys = _BERT_BUFFERS
    default_tokenizer_dir = BERT_TOKENIZER_DIR
    hf_architecture = "Model"

    @classmethod
    def config_from_hf(cls, values: dict) -> BertConfig:
        return BertConfig.from_dict(values)

    check_hf_config = staticmethod(check_bert_config_values)

    @classmethod
    def check_overrides(cls, directory, values: dict, overrides: dict) -> None:
        """pre_norm comes from model_type; asking for the other layout would run the weights through
        a different function, so it is refused rather than silently converted."""
        if "pre_norm" not in overrides:
            return
        stored = values.get("model_type") == "megatron-bert"
        if bool(overrides["pre_norm"]) != stored:
            layout = "pre-norm (model_type 'megatron-bert')" if stored else "post-norm (model_type 'bert')"
            raise UserError(f"checkpoint {directory} holds {layout} BERT weights but pre_norm="
                             f"{overrides['pre_norm']} was requested; drop the pre_norm override, since zoo takes "
                             "the layer order from model_type and the two orders compute different functions.")

    @classmethod
    def check_checkpoint_keys(cls, directory, file_keys: set[str], config: BertConfig) -> None:
        """A config.json whose model_type contradicts the tensors (an embedding LayerNorm exists only in
        post-norm BERT, a final encoder LayerNorm only in pre-norm) is refused with the fix."""
        has_embedding_ln = any(k.endswith("embeddings.LayerNorm.weight") for k in file_keys)
        has_final_ln = any(k.endswith("encoder.ln.weight") for k in file_keys)
        if config.pre_norm and has_embedding_ln and not has_final_ln:
            raise UserError(f"checkpoint {directory} holds post-norm BERT weights (embeddings.LayerNorm, no "
                             "encoder.ln) but its config.json says model_type 'megatron-bert' (pre-norm); set "
                             "model_type to 'bert' in config.json.")
        if not config.pre_norm and has_final_ln and not has_embedding_ln:
            raise UserError(f"checkpoint {directory} holds pre-norm BERT weights (encoder.ln, no embeddings."
                             "LayerNorm) but its config.json says model_type 'bert' (post-norm); set model_type "
                             "to 'megatron-bert' in config.json.")

    def hf_config_dict(self) -> dict:
        return self.config.to_hf_dict(self.hf_architecture)


def bert_layer_options(config: BertConfig) -> LayerOptions:
    """The settings of every BERT layer: post-norm (the original BERT) or pre-norm (Megatron BERT) as
    configured, output GEMMs initialised with the depth-scaled std."""
    std = config.initializer_range
    return LayerOptions(config.hidden_size, config.num_attention_heads, config.ffn_hidden_size,
                        layer_norm_eps=config.layer_norm_eps, attn_dropout=config.attention_probs_dropout_prob,
                        hidden_dropout=config.hidden_dropout_prob, gelu_approximate=config.gelu_approximate,
                        init_std=std, output_init_std=scaled_init_std(std, config.num_hidden_layers),
                        pre_norm=config.pre_norm, sequence_parallel=config.sequence_parallel)


class BertModel(_BertCheckpoints, nn.Module):
    """The bare encoder: ``.last_hidden_state`` (b, s, h) and ``.pooler_output`` (b, h).

    ``config.sequence_parallel`` (tp > 1): embeddings, layers and the final LayerNorm run on this
    rank's s/p tokens (:meth:`hidden_states`); :meth:`forward` all-gathers the result, so its outputs, and
    the finetuning heads on top of them, are as without it.
    """

    def __init__(self, config: BertConfig, parallel: ParallelState | None = None, add_pooling_layer: bool = True):
        super().__init__()
        parallel = as_state(parallel)
        config.validate(parallel.tp_size)
        self.config = config
        self.parallel = parallel
        std = config.initializer_range
        self.embeddings = BertEmbeddings(config, parallel)
        options = bert_layer_options(config)
        self.layer = nn.ModuleList(TransformerLayer(options, parallel=parallel)
                                   for _ in range(config.num_hidden_layers))
        self.ln = SequenceParallelLayerNorm(config.hidden_size, eps=config.layer_norm_eps, parallel=parallel,
                                            sequence_parallel=config.sequence_parallel) if config.pre_norm else None
        self.pooler = _normal_linear(config.hidden_size, config.hidden_size, std) if add_pooling_layer else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> BaseModelOutputWithPooling:
        x, sp = self.hidden_states(input_ids, attention_mask, token_type_ids, position_ids)  # (b, s or s/p, h)
        if sp:   # replicated consumers (pooler, heads): backward keeps this rank's tokens of the gradient
            x = gather_from_sequence_parallel_region(x, self.parallel, tensor_parallel_output_grad=False)
        pooled = self.pool(x[:, 0]) if self.pooler is not None else None               # (b, h)
        return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=pooled)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      token_type_ids: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """The one forward path: (final hidden states, sequence_parallel), the states (b, s/p, h), this rank's
        tokens, when sequence_parallel is True (config asks, tp > 1; s must divide by tp), else (b, s, h)."""
        b, s = input_ids.shape
        if s > self.config.max_position_embeddings:
            raise UserError(f"sequence length {s} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}; truncate inputs to that length.")
        sp = uses_sequence_parallel(self.parallel, self.config.sequence_parallel, s)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)       # (1, s)
        x = self.embeddings(input_ids, token_type_ids, position_ids, sequence_parallel=sp)  # (b, s or s/p, h)
        bias = attention_bias(attention_mask, s, causal=False, dtype=x.dtype)          # (b, 1, 1, s)
        x = run_layers(self.layer, x, bias, causal=False,
                       recompute=recompute_mode(self.config) if self.training else None, sequence_parallel=sp)
        if self.ln is not None:
            x = self.ln(x, sequence_parallel=sp)                                       # (b, s or s/p, h)
        return x, sp

    def first_token(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        """The [CLS] states (b, h) of encoder output ``x``. Under sequence parallelism they sit on TP rank 0:
        each rank's first token is all-gathered (b*p*h values, not the whole sequence); backward keeps
        this rank's own (only rank 0's is nonzero)."""
        if not sequence_parallel:
            return x[:, 0]
        firsts = gather_from_sequence_parallel_region(x[:, :1], self.parallel,
                                                      tensor_parallel_output_grad=False)  # (b, p, h)
        return firsts[:, 0]

    def pool(self, cls_states: torch.Tensor) -> torch.Tensor:
        """BERT's pooler: tanh(W h_[CLS] + b), (b, h) -> (b, h)."""
        return torch.tanh(self.pooler(cls_states))

    def hf_names(self, prefix: str = "") -> dict[str, str | tuple[str, ...]]:
        """zoo parameter -> transformers key, for MegatronBert (pre-norm) or Bert (post-norm).

        transformers keeps Q, K and V as three (h, h) matrices where zoo fuses them into ``c_attn``: its
        entry names the three keys, the blocks stacked along the split dimension (the layer's partition
        spec, stride 3, says how each block is split: rank r's shard is [Q_r; K_r; V_r])."""
        per_layer = {
            "ln_1": "attention.ln" if self.config.pre_norm else "attention.output.LayerNorm",
            "attn.c_proj": "attention.output.dense",
            "ln_2": "ln" if self.config.pre_norm else "output.LayerNorm",
            "mlp.c_fc": "intermediate.dense",
            "mlp.c_proj": "output.dense",
        }
        table: dict[str, str | tuple[str, ...]] = {}
        for name, _ in self.named_parameters():
            parts = name.split(".")
            if parts[0] == "layer":
                index, module, leaf = parts[1], ".".join(parts[2:-1]), parts[-1]
                base = f"{prefix}encoder.layer.{index}."
                if module == "attn.c_attn":
                    table[name] = tuple(f"{base}attention.self.{q}.{leaf}" for q in ("query", "key", "value"))
                else:
                    table[name] = f"{base}{per_layer[module]}.{leaf}"
            elif parts[0] == "ln":
                table[name] = f"{prefix}encoder.ln.{parts[1]}"
            elif parts[0] == "pooler":
                table[name] = f"{prefix}pooler.dense.{parts[1]}"
            else:  # embeddings.*
                table[name] = prefix + name
        return table


class BertForPreTraining(_BertCheckpoints, nn.Module):
    """Masked-LM + sentence-order heads. MLM: dense -> GeLU -> LayerNorm -> decoder tied to the
    vocab-parallel word embedding, plus a vocab-parallel bias; the loss uses the fused
    vocab-parallel cross-entropy. ``.prediction_logits`` is this rank's vocab shard (b, s, V_padded / p) at
    tp > 1 unless ``gather_output``, else the real vocabulary (b, s, V); ``next_sentence_label`` is the sentence-order label (1 = swapped).

    With sequence parallelism the MLM transform (dense, GeLU, LayerNorm) runs on this rank's s/p tokens
    (its replicated parameters get their gradients summed over the TP group) and the decoder's input is
    all-gathered along the sequence in place of f, as in Megatron; the pooler reads the [CLS] token
    through :meth:`BertModel.first_token`."""

    base_prefix = "bert."  # a bare encoder directory (BertModel, MegatronBertModel) stores its keys without it
    hf_architecture = "ForPreTraining"
    # A bare encoder (e.g. MiniLM) has no pretraining heads: they start fresh (continued pretraining).
    new_param_prefixes = ("transform.", "transform_ln.", "lm_bias", "seq_relationship.")

    def __init__(self, config: BertConfig, parallel: ParallelState | None = None):
        super().__init__()
        self.config = config
        self.parallel = parallel = as_state(parallel)
        self.bert = BertModel(config, parallel)
        std = config.initializer_range
        self.transform = _normal_linear(config.hidden_size, config.hidden_size, std)
        if config.sequence_parallel:
            mark_sequence_parallel(self.transform.weight)
            mark_sequence_parallel(self.transform.bias)
        self.transform_ln = SequenceParallelLayerNorm(config.hidden_size, eps=config.layer_norm_eps, parallel=parallel,
                                                      sequence_parallel=config.sequence_parallel)
        word = self.bert.embeddings.word_embeddings
        self.lm_bias = mark_tensor_parallel(nn.Parameter(torch.zeros(word.weight.shape[0])), 0)
        self.seq_relationship = _normal_linear(config.hidden_size, 2, std)

    def own_partition_specs(self) -> dict[str, PartitionSpec]:
        """The MLM bias is split like the vocabulary rows of the tied decoder."""
        return {"lm_bias": PartitionSpec(0, vocab_rows=self.config.vocab_size)}

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                next_sentence_label: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                gather_output: bool = False) -> BertForPreTrainingOutput:
        x, sp = self.bert.hidden_states(input_ids, attention_mask, token_type_ids, position_ids)  # (b, s or s/p, h)
        weight, bias = self.transform.weight, self.transform.bias
        if sp:
            weight, bias = all_reduce_grads_of_replicated(self.parallel, weight, bias)
        h = F.linear(x, weight, bias)                                                  # (b, s or s/p, h)
        h = self.transform_ln(F.gelu(h, approximate=self.config.gelu_approximate), sequence_parallel=sp)
        word = self.bert.embeddings.word_embeddings
        local_logits = word.lm_logits(h, sequence_parallel=sp) + self.lm_bias          # (b, s, V_pad/p)
        sop_logits = self.seq_relationship(self.bert.pool(self.bert.first_token(x, sp)))  # (b, 2)
        loss = None
        if labels is not None:
            loss = lm_loss(local_logits, labels, self.parallel, self.config.vocab_size)
            if next_sentence_label is not None:
                loss = loss + F.cross_entropy(at_least_fp32(sop_logits), next_sentence_label.view(-1))
        logits = user_logits(local_logits, self.parallel, self.config.vocab_size, gather_output)
        return BertForPreTrainingOutput(loss=loss, prediction_logits=logits, seq_relationship_logits=sop_logits)

    @classmethod
    def check_checkpoint_keys(cls, directory, file_keys: set[str], config: BertConfig) -> None:
        """Besides the layout check: the pretraining heads are all there (a pretraining checkpoint) or
        all absent (a bare encoder, whose heads start fresh); a partial set means a damaged file."""
        super().check_checkpoint_keys(directory, file_keys, config)
        head_keys = sorted(HEAD_NAMES.values())
        absent = [key for key in head_keys if key not in file_keys]
        if absent and len(absent) < len(head_keys):
            raise UserError(f"checkpoint {directory} has some BERT pretraining head tensors but not {absent[0]!r}; "
                             "re-export it, or remove all cls.* tensors to load it as a bare encoder.")

    def init_new_params(self, names: list[str], seed: int) -> None:
        """Heads absent from a bare-encoder checkpoint, drawn as at random init (see
        :func:`init_head_params`), identical on every TP rank."""
        init_head_params(self, names, seed, self.config.initializer_range, layer_norms=("transform_ln.",))

    def hf_names(self) -> dict[str, str | tuple[str, ...]]:
        return {**{f"bert.{k}": v for k, v in self.bert.hf_names(prefix="bert.").items()}, **HEAD_NAMES}
