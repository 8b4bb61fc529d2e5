"""The paper's primitives: rank grid, f/g mappings, parallel layers, fused cross-entropy, TP RNG."""

from zoo.parallel.cross_entropy import vocab_parallel_cross_entropy
from zoo.parallel.gather import gather_to_first
from zoo.parallel.layers import (
                                 ColumnParallelLinear,
                                 RowParallelLinear,
                                 VocabParallelEmbedding,
                                 is_tensor_parallel,
                                 mark_tensor_parallel,
                                 scaled_init_std,
)
from zoo.parallel.mappings import copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region, scatter_to_tp_region
from zoo.parallel.random import model_parallel_seed, tp_rng_fork
from zoo.parallel.state import ParallelState
from zoo.parallel.utils import divide, merge_shards, pad_vocab_size, shard_tensor

__all__ = [
    "ParallelState", "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region",
    "gather_from_tp_region", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "model_parallel_seed", "tp_rng_fork", "divide", "pad_vocab_size",
    "shard_tensor", "merge_shards", "is_tensor_parallel", "mark_tensor_parallel", "scaled_init_std",
    "gather_to_first",
]
