"""GPT-2 as a DeepSpeed ``PipelineModule`` of zoo's tensor-parallel layers (3D parallelism).

The model is the sequence DeepSpeed's pipeline engine runs stage by stage (Narayanan et al. 2021 compose
it with the paper's tensor parallelism and with data parallelism):

    index 0          word embedding (vocab-parallel), tied: TiedLayerSpec "word_embeddings"
    index 1          + position embedding, embedding dropout (sequence-parallel scatter first, with SP)
    index 2 ... L+1  the L transformer layers
    index L+2        final LayerNorm
    index L+3        LM head: the tied word embedding again, local logits (b, s, V_padded / t)
    loss             the fused vocab-parallel cross-entropy of the shifted labels (:class:`GPT2PipelineLoss`)

DeepSpeed keeps the tied word embedding on the first and the last stage, all-reduces its gradient between
them and marks the last stage's copy ``ds_pipe_replicated``. Between stages one tensor travels per
micro-batch: the hidden states (b, s, h), or this rank's (b, s/t, h) under sequence parallelism.

**Init equal to the one-stage model.** A stage's layers are drawn exactly as :class:`GPT2LMHeadModel`
draws them from the run's seed: before its first layer a stage replays the draws of every earlier layer
(built one at a time and dropped, :class:`zoo.models.pipeline_init.InitReplay`), so a P-stage model starts from the same weights as
the one-stage model of the same seed, at every tp (the layers draw full masters and keep their slice).

**Names.** :func:`hf_names` maps each parameter of a stage to its ``GPT2LMHeadModel`` name, so the
partition specs (:func:`zoo.parallel.partition.partition_specs` of the stage), transformers' layout and
zoo's checkpoint tools read a stage as a subset of the one model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.checkpoint.hf.hf_io import CheckpointFiles, HFParam, read_local_shard, stored_spec
from zoo.errors import UserError
from zoo.models.config import recompute_mode
from zoo.models.gpt2.config import GPT2Config
from zoo.models.gpt2.model import GPT2LMHeadModel, gpt2_layer_options
from zoo.models.pipeline_init import InitReplay, announce
from zoo.models.transformer import TransformerLayer, lm_loss, recomputed, region_dropout
from zoo.parallel import VocabParallelEmbedding
from zoo.parallel.layers import SequenceParallelLayerNorm, uses_sequence_parallel
from zoo.parallel.mappings import scatter_to_sequence_parallel_region
from zoo.parallel.partition import partition_specs
from zoo.parallel.state import ParallelState

__all__ = ["gpt2_pipeline_module", "GPT2PipelineLoss", "hf_names", "layer_count", "load_stage_weights",
           "one_stage_name", "entry_of", "PARTITION_METHODS", "TIED_KEY"]

TIED_KEY = "word_embeddings"
# zoo's --pipeline-partition-method -> DeepSpeed's partition_method: "uniform" balances the transformer layers
# (embeddings and head ride on the first and last stage), "parameters" balances parameter counts.
PARTITION_METHODS = {"uniform": "type:GPT2BlockPipe", "parameters": "parameters"}


def layer_count(config: GPT2Config) -> int:
    """Entries of the pipeline's layer sequence: 2 embedding entries, the layers, the final norm, the head."""
    return config.n_layer + 4


class WordEmbeddingPipe(nn.Module):
    """The vocab-parallel word embedding, tied between the first stage (lookup) and the last (LM head)."""

    def __init__(self, config: GPT2Config, parallel: ParallelState, index: int, replay: InitReplay | None = None):
        super().__init__()
        announce(replay, index)
        self.sequence_parallel = uses_sequence_parallel(parallel, bool(config.sequence_parallel))
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, parallel=parallel,
                                          pad_multiple=config.make_vocab_size_divisible_by,
                                          init_std=config.initializer_range)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """First stage: (b, s) token ids -> (b, s, h) word embeddings (g all-reduces the vocab shards). Being the
        module itself (not a function of it), the first stage's copy is what DeepSpeed saves as layer 00."""
        return self.wte(input_ids)


def lm_head(module: WordEmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """Last stage: (b, s or s/t, h) final hidden states -> (b, s, V_padded / t) this rank's logits."""
    return module.wte.lm_logits(hidden, sequence_parallel=module.sequence_parallel)


class PositionEmbeddingPipe(nn.Module):
    """x + wpe(0 ... s-1), scattered along the sequence under SP, then embedding dropout."""

    def __init__(self, config: GPT2Config, parallel: ParallelState, index: int, replay: InitReplay | None = None):
        super().__init__()
        announce(replay, index)
        self.parallel = parallel
        self.sequence_parallel = uses_sequence_parallel(parallel, bool(config.sequence_parallel))
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        nn.init.normal_(self.wpe.weight, 0.0, config.initializer_range)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)       # (1, s)
        x = x + self.wpe(positions)                                              # (b, s, h)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.parallel)            # (b, s/t, h)
        return region_dropout(self.drop, x, self.parallel, self.sequence_parallel)


class GPT2BlockPipe(TransformerLayer):
    """One pre-norm GPT-2 layer (:class:`TransformerLayer`, causal), recomputed as the config says."""

    def __init__(self, config: GPT2Config, parallel: ParallelState, index: int, replay: InitReplay | None = None):
        announce(replay, index)
        super().__init__(gpt2_layer_options(config), parallel=parallel)
        self.config = config
        self.sequence_parallel = uses_sequence_parallel(parallel, bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:                        # (b, s or s/t, h) -> same
        recompute = recompute_mode(self.config) if self.training else None
        options = {"causal": True, "sequence_parallel": self.sequence_parallel,
                   "recompute_attention": recompute == "selective"}
        if recompute == "full" and torch.is_grad_enabled():
            return recomputed(self.layer_forward, x, None, **options)
        return self.layer_forward(x, None, **options)


class FinalNormPipe(nn.Module):
    """The final LayerNorm (``ln_f``), on this rank's tokens under SP."""

    def __init__(self, config: GPT2Config, parallel: ParallelState, index: int, replay: InitReplay | None = None):
        super().__init__()
        announce(replay, index)
        self.sequence_parallel = uses_sequence_parallel(parallel, bool(config.sequence_parallel))
        self.ln_f = SequenceParallelLayerNorm(config.n_embd, eps=config.layer_norm_epsilon, parallel=parallel,
                                              sequence_parallel=config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x, sequence_parallel=self.sequence_parallel)


def layer_class(index: int, config: GPT2Config) -> type[nn.Module]:
    last = layer_count(config) - 1
    if index in (0, last):
        return WordEmbeddingPipe
    if index == 1:
        return PositionEmbeddingPipe
    if index == last - 1:
        return FinalNormPipe
    return GPT2BlockPipe


class GPT2PipelineLoss:
    """loss(local logits, labels): GPT-2's shifted-label mean token cross-entropy, -100 ignored, through the
    fused vocab-parallel cross-entropy (the logits are never gathered)."""

    __name__ = "GPT2PipelineLoss"

    def __init__(self, parallel: ParallelState, vocab_size: int):
        self.parallel, self.vocab_size = parallel, vocab_size

    def __call__(self, local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)                     # (b, s): position t predicts t+1
        return lm_loss(local_logits, targets, self.parallel, self.vocab_size)


def gpt2_pipeline_module(config: GPT2Config, parallel: ParallelState, seed: int, partition_method: str = "parameters",
                         replay_init: bool = True):
    """This rank's stage of GPT-2 as a ``deepspeed.pipe.PipelineModule`` over ``parallel``'s topology (the grid
    DeepSpeed's engine then uses), its layers drawn as the one-stage model of ``seed`` draws them. Collective.

    After the build the default generators are reseeded with this stage's training stream
    (:func:`zoo.parallel.model_parallel_seed`). ``replay_init=False`` skips the replay of earlier stages'
    draws, for weights loaded next (``--pretrained``)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # local: DeepSpeed costs seconds to import

    from zoo.parallel import model_parallel_seed

    if partition_method not in PARTITION_METHODS:
        raise UserError(f"pipeline partition method {partition_method!r} is not one of {sorted(PARTITION_METHODS)}; "
                         "pass --pipeline-partition-method uniform (transformer layers) or parameters.")
    config.validate(parallel.tp_size)
    head = layer_count(config) - 1            # the tied head repeats wte's draws
    replay = (InitReplay(config, parallel, seed, layer_class, draw_index=lambda index: 0 if index == head else index)
              if replay_init else None)
    specs = []
    for index in range(layer_count(config)):
        cls = layer_class(index, config)
        if cls is WordEmbeddingPipe:
            specs.append(TiedLayerSpec(TIED_KEY, cls, config, parallel, index, replay,
                                       forward_fn=None if index == 0 else lm_head, tied_weight_attr="wte.weight"))
        else:
            specs.append(LayerSpec(cls, config, parallel, index, replay))
    module = PipelineModule(specs, topology=parallel.topology, loss_fn=GPT2PipelineLoss(parallel, config.vocab_size),
                            partition_method=PARTITION_METHODS[partition_method])
    module.zoo_config = config
    model_parallel_seed(seed, parallel)
    return module


def one_stage_name(index: int, local_name: str, n_layer: int) -> str:
    """The ``GPT2LMHeadModel`` name of parameter ``local_name`` of entry ``index`` of the layer sequence (the
    tied word embedding's entries are 0 and n_layer + 3)."""
    if index in (0, n_layer + 3):
        return f"transformer.{local_name}"                                        # wte.weight
    if index in (1, n_layer + 2):
        return f"transformer.{local_name}"                                        # wpe.weight, ln_f.weight
    return f"transformer.h.{index - 2}.{local_name}"


def entry_of(name: str, n_layer: int) -> int:
    """The index of the layer-sequence entry whose checkpoint file holds ``GPT2LMHeadModel`` parameter ``name``
    (the inverse of :func:`one_stage_name`; the tied word embedding is saved with entry 0)."""
    parts = name.split(".")
    if parts[:2] == ["transformer", "h"] and len(parts) > 2 and parts[2].isdigit():
        return int(parts[2]) + 2
    fixed = {"wte": 0, "wpe": 1, "ln_f": n_layer + 2}
    if len(parts) > 1 and parts[0] == "transformer" and parts[1] in fixed:
        return fixed[parts[1]]
    raise UserError(f"{name} is not a parameter of zoo's GPT-2 pipeline stages; the checkpoint was not written "
                     "by a GPT-2 run: resume it with the --model preset of the family that wrote it.")


def hf_names(module) -> dict[str, str]:
    """Each parameter of a pipeline stage (``named_parameters`` names) -> its ``GPT2LMHeadModel`` name.
    The last stage's tied copy of wte (``ds_pipe_replicated``) maps to the same name as the first stage's."""
    n_layer = module.zoo_config.n_layer
    names = {}
    for name, _ in module.named_parameters():
        head, _, rest = name.partition(".")
        if head == "tied_modules":                                                # word_embeddings.wte.weight
            names[name] = one_stage_name(0, rest.partition(".")[2], n_layer)
        else:
            names[name] = one_stage_name(int(head), rest, n_layer)
    return names


def load_stage_weights(module, directory, parallel: ParallelState) -> None:
    """Fill a stage from a transformers GPT-2 directory (``GPT2LMHeadModel`` keys, with or without the
    ``transformer.`` prefix of OpenAI-converted files): this stage's tensors, this rank's slices, one at a time.
    The module must have been built with the directory's config (its shapes)."""
    files = CheckpointFiles(directory)
    available = set(files.keys())
    specs, names = partition_specs(module), hf_names(module)
    for name, param in module.named_parameters():
        key = names[name]
        if key not in available and key.removeprefix("transformer.") in available:
            key = key.removeprefix("transformer.")
        if key not in available:
            raise UserError(f"checkpoint {directory} has no tensor {key!r} (needed by pipeline stage "
                             f"{parallel.pp_rank}); it was not written for a GPT-2 model.")
        spec = stored_spec(specs[name], key, GPT2LMHeadModel.hf_transposed_keys)
        param.copy_(read_local_shard(files, HFParam((key,), spec), param, parallel).to(param.dtype))


def layer_entries(config: GPT2Config) -> range:
    """The indices of the transformer layers in the layer sequence (what ``uniform`` partitioning balances)."""
    return range(2, config.n_layer + 2)


def entry_parameters(config: GPT2Config, tp: int) -> list[int]:
    """Parameters per TP rank of each entry of the layer sequence (its heaviest rank: rank 0), counted on the
    meta device: wte, wpe, the layers, ln_f, and the tied head, which counts wte again on the last stage."""
    grid = ParallelState(tp_size=tp, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp, rank=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config, grid).transformer

    def count(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    embedding = count(model.wte)
    return [embedding, count(model.wpe), *([count(model.h[0])] * config.n_layer), count(model.ln_f), embedding]
