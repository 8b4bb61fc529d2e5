"""Llama as a DeepSpeed ``PipelineModule`` of zoo's tensor-parallel layers (3D parallelism).

The layer sequence DeepSpeed's pipeline engine runs stage by stage (Narayanan et al. 2021):

    index 0          embed_tokens (vocab-parallel), scattered along the sequence under SP
    index 1 ... L    the L decoder layers (each computes the rotary angles of positions 0 ... s-1)
    index L+1        the final RMSNorm
    index L+2        lm_head (vocab-parallel, untied): local logits (b, s, V_padded / t)
    loss             the fused vocab-parallel cross-entropy of the shifted labels

Nothing is tied, so no weight travels between stages; one tensor travels per micro-batch: the hidden states
(b, s, h), or this rank's (b, s/t, h) under sequence parallelism.

**Init equal to the one-stage model.** :class:`~zoo.models.llama.model.LlamaForCausalLM` draws, from the seed,
embed_tokens, layer 0, 1, ..., L-1, then lm_head (the norm draws nothing): the order of the sequence above.
Before its first entry a stage replays the draws of every earlier entry (built one at a time and dropped,
:class:`zoo.models.pipeline_init.InitReplay`), so a P-stage model starts from the one-stage model's weights at every tp.

**Names.** :func:`one_stage_names` maps each parameter of a stage to its ``LlamaForCausalLM`` parameter name,
so a stage reads as a subset of the one model: :func:`one_stage_name` and its inverse :func:`entry_of` relate
the keys of a layer's checkpoint file to those names (what a resume at another layout reads), and
:func:`load_llama_stage_weights` fills a stage from transformers' layout (``--pretrained``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.checkpoint.hf.hf_io import CheckpointFiles, HFParam, read_local_shard
from zoo.errors import UserError
from zoo.models.config import recompute_mode
from zoo.models.llama.config import LlamaConfig
from zoo.models.llama.hf_names import llama_hf_names
from zoo.models.llama.layers import LlamaDecoderLayer, LlamaRMSNorm
from zoo.models.llama.model import LlamaForCausalLM, VocabParallelLMHead
from zoo.models.llama.rope import rotary_cos_sin
from zoo.models.pipeline_init import InitReplay, announce
from zoo.models.transformer import lm_loss, recomputed
from zoo.parallel import VocabParallelEmbedding
from zoo.parallel.layers import uses_sequence_parallel
from zoo.parallel.mappings import scatter_to_sequence_parallel_region
from zoo.parallel.partition import partition_specs
from zoo.parallel.state import ParallelState

__all__ = ["llama_pipeline_module", "LlamaPipelineLoss", "one_stage_names", "one_stage_name", "entry_of",
           "entry_count", "load_llama_stage_weights", "PARTITION_METHODS"]

# zoo's --pipeline-partition-method -> DeepSpeed's partition_method: "uniform" balances the decoder layers
# (embedding and head ride on the first and last stage), "parameters" balances parameter counts.
PARTITION_METHODS = {"uniform": "type:LlamaDecoderPipe", "parameters": "parameters"}


def entry_count(config: LlamaConfig) -> int:
    """Entries of the pipeline's layer sequence: the embedding, the layers, the final norm, the head."""
    return config.num_hidden_layers + 3


class LlamaEmbeddingPipe(nn.Module):
    """(b, s) token ids -> (b, s, h) embeddings (g all-reduces the vocab shards), (b, s/t, h) under SP."""

    def __init__(self, config: LlamaConfig, parallel: ParallelState, index: int,
                 replay: InitReplay | None = None):
        super().__init__()
        announce(replay, index)
        self.parallel = parallel
        self.sequence_parallel = uses_sequence_parallel(parallel, bool(config.sequence_parallel))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel=parallel,
                                                   pad_multiple=config.make_vocab_size_divisible_by,
                                                   init_std=config.initializer_range)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                          # (b, s, h)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.parallel)             # (b, s/t, h)
        return x


class LlamaDecoderPipe(LlamaDecoderLayer):
    """One decoder layer of the causal full-sequence forward, recomputed as the config says; it computes the
    rotary angles of positions 0 ... s-1 itself (s the full sequence: t times its tokens under SP)."""

    def __init__(self, config: LlamaConfig, parallel: ParallelState, index: int,
                 replay: InitReplay | None = None):
        announce(replay, index)
        super().__init__(config, parallel)
        self.config, self.tp_size = config, parallel.tp_size
        self.sequence_parallel = uses_sequence_parallel(parallel, bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:                        # (b, s or s/t, h) -> same
        s = x.shape[1] * (self.tp_size if self.sequence_parallel else 1)
        positions = torch.arange(s, device=x.device).unsqueeze(0)                 # (1, s)
        cos, sin = rotary_cos_sin(self.config, positions, x.dtype)                # (1, s, d) each
        recompute = recompute_mode(self.config) if self.training else None
        options = {"sequence_parallel": self.sequence_parallel, "recompute_attention": recompute == "selective"}
        if recompute == "full" and torch.is_grad_enabled():
            return recomputed(self.layer_forward, x, cos, sin, None, **options)
        return self.layer_forward(x, cos, sin, None, **options)


class LlamaNormPipe(nn.Module):
    """The final RMSNorm (``norm``), on this rank's tokens under SP."""

    def __init__(self, config: LlamaConfig, parallel: ParallelState, index: int,
                 replay: InitReplay | None = None):
        super().__init__()
        announce(replay, index)
        self.sequence_parallel = uses_sequence_parallel(parallel, bool(config.sequence_parallel))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps, parallel=parallel,
                                 sequence_parallel=config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.sequence_parallel)


class LlamaHeadPipe(nn.Module):
    """The untied LM head: (b, s or s/t, h) -> (b, s, V_padded / t), this rank's logits."""

    def __init__(self, config: LlamaConfig, parallel: ParallelState, index: int,
                 replay: InitReplay | None = None):
        super().__init__()
        announce(replay, index)
        self.sequence_parallel = uses_sequence_parallel(parallel, bool(config.sequence_parallel))
        self.lm_head = VocabParallelLMHead(config.vocab_size, config.hidden_size, parallel=parallel,
                                           pad_multiple=config.make_vocab_size_divisible_by,
                                           init_std=config.initializer_range)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, sequence_parallel=self.sequence_parallel)


def entry_class(index: int, config: LlamaConfig) -> type[nn.Module]:
    last = entry_count(config) - 1
    if index == 0:
        return LlamaEmbeddingPipe
    if index == last:
        return LlamaHeadPipe
    if index == last - 1:
        return LlamaNormPipe
    return LlamaDecoderPipe


class LlamaPipelineLoss:
    """loss(local logits, labels): the shifted-label mean token cross-entropy, -100 ignored, through the fused
    vocab-parallel cross-entropy (the logits are never gathered)."""

    __name__ = "LlamaPipelineLoss"

    def __init__(self, parallel: ParallelState, vocab_size: int):
        self.parallel, self.vocab_size = parallel, vocab_size

    def __call__(self, local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)                        # (b, s): t predicts t+1
        return lm_loss(local_logits, targets, self.parallel, self.vocab_size)


def llama_pipeline_module(config: LlamaConfig, parallel: ParallelState, seed: int,
                          partition_method: str = "parameters", replay_init: bool = True):
    """This rank's stage of Llama as a ``deepspeed.pipe.PipelineModule`` over ``parallel``'s topology, its
    entries drawn as the one-stage model of ``seed`` draws them. Collective. After the build the default
    generators are reseeded with this stage's training stream (:func:`zoo.parallel.model_parallel_seed`);
    ``replay_init=False`` skips the replay of earlier stages' draws, for weights loaded next."""
    from deepspeed.pipe import LayerSpec, PipelineModule  # local: DeepSpeed costs seconds to import

    from zoo.parallel import model_parallel_seed

    if partition_method not in PARTITION_METHODS:
        raise UserError(f"pipeline partition method {partition_method!r} is not one of {sorted(PARTITION_METHODS)}; "
                        "pass --pipeline-partition-method uniform (decoder layers) or parameters.")
    config.validate(parallel.tp_size)
    replay = InitReplay(config, parallel, seed, entry_class) if replay_init else None
    specs = [LayerSpec(entry_class(index, config), config, parallel, index, replay)
             for index in range(entry_count(config))]
    module = PipelineModule(specs, topology=parallel.topology, loss_fn=LlamaPipelineLoss(parallel, config.vocab_size),
                            partition_method=PARTITION_METHODS[partition_method])
    module.zoo_config = config
    model_parallel_seed(seed, parallel)
    return module


def one_stage_name(index: int, local_name: str, num_layers: int) -> str:
    """The ``LlamaForCausalLM`` parameter name of ``local_name`` of entry ``index`` of the layer sequence."""
    if index == 0 or index == num_layers + 1:
        return f"model.{local_name}"                                              # embed_tokens / norm
    if index == num_layers + 2:
        return local_name                                                         # lm_head.weight
    return f"model.layers.{index - 1}.{local_name}"


def entry_of(name: str, num_layers: int) -> int:
    """The index of the layer-sequence entry whose checkpoint file holds ``LlamaForCausalLM`` parameter ``name``
    (the inverse of :func:`one_stage_name`)."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
        return int(parts[2]) + 1
    fixed = {("model", "embed_tokens"): 0, ("model", "norm"): num_layers + 1, ("lm_head", "weight"): num_layers + 2}
    if tuple(parts[:2]) in fixed:
        return fixed[tuple(parts[:2])]
    raise UserError(f"{name} is not a parameter of zoo's Llama pipeline stages; the checkpoint was not written "
                     "by a Llama run: resume it with the --model preset of the family that wrote it.")


def one_stage_names(module) -> dict[str, str]:
    """Each parameter of a pipeline stage (``named_parameters`` names) -> its ``LlamaForCausalLM`` name."""
    layers = module.zoo_config.num_hidden_layers
    names = {}
    for name, _ in module.named_parameters():
        head, _, rest = name.partition(".")
        names[name] = one_stage_name(int(head), rest, layers)
    return names


def load_llama_stage_weights(module, directory, parallel: ParallelState) -> None:
    """Fill a stage from a transformers Llama directory (``LlamaForCausalLM`` keys; gate/up read as the fused
    ``gate_up_proj``'s two blocks, :mod:`zoo.models.llama.hf_names`): this stage's tensors, this rank's slices,
    one at a time, so a rank holds its own shard and one tensor. The module must have been built with the
    directory's config (its shapes); a missing key is one sentence naming it."""
    files = CheckpointFiles(directory)
    available = set(files.keys())
    specs, names = partition_specs(module), one_stage_names(module)
    keys_of = llama_hf_names(names.values())
    for name, param in module.named_parameters():
        keys = keys_of[names[name]]
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        missing = [key for key in keys if key not in available]
        if missing:
            raise UserError(f"checkpoint {directory} has no tensor {missing[0]!r} (needed by pipeline stage "
                             f"{parallel.pp_rank}); it was not written for a Llama model of this config.json.")
        param.copy_(read_local_shard(files, HFParam(keys, specs[name]), param, parallel).to(param.dtype))


def layer_entries(config: LlamaConfig) -> range:
    """The indices of the decoder layers in the layer sequence (what ``uniform`` partitioning balances)."""
    return range(1, config.num_hidden_layers + 1)


def entry_parameters(config: LlamaConfig, tp: int) -> list[int]:
    """Parameters per TP rank of each entry of the layer sequence (its heaviest rank: rank 0), counted on the
    meta device: embed_tokens, the layers, norm, lm_head (untied: a matrix of its own)."""
    grid = ParallelState(tp_size=tp, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp, rank=0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, grid)

    def count(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    return [count(model.model.embed_tokens), *([count(model.model.layers[0])] * config.num_hidden_layers),
            count(model.model.norm), count(model.lm_head)]
