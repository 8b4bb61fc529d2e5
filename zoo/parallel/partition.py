"""Partition specs: how each parameter of a tensor-parallel model is split, declared by the layer that owns it.

A :class:`PartitionSpec` says which dimension of a parameter is split across the TP ranks, with which stride
(the fused [Q | K | V] projection splits each block on its own, so every rank holds q, k and v of its own
heads), whether that dimension is the padded vocabulary (``vocab_rows`` real rows, the rest zero padding that
depends on tp), and whether a checkpoint format stores the tensor transposed (transformers' GPT-2 keeps its
Conv1D weights as (in, out) where zoo keeps ``nn.Linear``'s (out, in)); that last fact belongs to the format,
so layers leave it False and the format's reader and writer set it (:func:`zoo.checkpoint.hf.hf_io.stored_spec`).
It is Megatron's ``sharded_state_dict`` idea reduced to the one question every checkpoint reader and writer
asks: how does this rank's tensor relate to the merged one?

Each layer answers for its own parameters (``own_partition_specs()``, a dict from its parameter names to specs);
:func:`partition_specs` collects them over a model under the model's parameter names, and any parameter no
layer declares is replicated. A module may also declare specs of its submodules' parameters; the outermost
declaration of a parameter wins. Saving and loading Hugging Face directories, exporting DeepSpeed checkpoints
and resharding them to another tp all go through these specs plus, for transformers' layouts, a small
per-model table of key *names* (and of the keys stored transposed); no other table of split rules exists.

A further parallel dimension reuses them unchanged: a pipeline stage holds a subset of the layers, so
:func:`partition_specs` of a stage's module gives exactly the specs of the parameters it owns, under their
global names; a writer takes each stage's tensors in turn (merging over tp by the spec) and a reader
takes, per stage, the keys its names map to. Only the assignment of names to stages is new.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from zoo.parallel.utils import merge_shards, shard_tensor


@dataclass(frozen=True)
class PartitionSpec:
    """How one parameter's local tensor relates to its merged (master) tensor.

    ``dim``: the dimension split across TP ranks in zoo's layout, or None for a replicated parameter.
    ``stride`` s > 1: the dimension is s equal blocks, each split across ranks on its own.
    ``vocab_rows``: dim 0 is the vocabulary, padded to a multiple of 128 x tp in zoo (zero rows) and
    holding this many real rows in merged checkpoints. ``transposed``: merged checkpoints store the tensor
    transposed (a 2-D weight).
    """

    dim: int | None = None
    stride: int = 1
    vocab_rows: int | None = None
    transposed: bool = False

    @property
    def is_sharded(self) -> bool:
        return self.dim is not None

    @property
    def block_dim(self) -> int:
        """The dimension a fused parameter stacks its blocks along: the split one (0 when replicated)."""
        return 0 if self.dim is None else self.dim

    def file_dim(self, ndim: int) -> int:
        """The split dimension as merged checkpoints store the tensor (transposed or not)."""
        return ndim - 1 - self.dim if self.transposed else self.dim

    def block(self) -> PartitionSpec:
        """The spec of one block of a fused parameter: the same split, each block split on its own."""
        return replace(self, stride=1, vocab_rows=None)

    def master_shape(self, local_shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
        """The merged shape in zoo's layout, unpadded (``vocab_rows`` rows where the vocabulary is)."""
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= tp_size
        if self.vocab_rows is not None:
            shape[0] = self.vocab_rows
        return tuple(shape)

    def file_shape(self, local_shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
        """The merged shape as checkpoints store it: unpadded and, where ``transposed``, transposed."""
        shape = self.master_shape(local_shape, tp_size)
        return shape[::-1] if self.transposed else shape

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The padded master tensor from every TP rank's shard, in rank order (rank 0's for a replicated one)."""
        if self.dim is None:
            return shards[0]
        return merge_shards(list(shards), self.dim, self.stride)

    def shard(self, master: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """Rank ``tp_rank``'s shard of a padded master tensor (the master itself for a replicated one)."""
        if self.dim is None:
            return master
        return shard_tensor(master, self.dim, tp_rank, tp_size, self.stride)

    def repad(self, master: torch.Tensor, padded_rows: int) -> torch.Tensor:
        """A master tensor with the vocabulary padding of one tp cut and ``padded_rows`` rows (zeros added)."""
        if self.vocab_rows is None:
            return master
        master = master.narrow(0, 0, self.vocab_rows)
        if padded_rows > self.vocab_rows:
            master = torch.cat([master, master.new_zeros((padded_rows - self.vocab_rows, *master.shape[1:]))])
        return master

    def to_file_layout(self, master: torch.Tensor) -> torch.Tensor:
        """A padded master tensor as merged checkpoints store it: padding cut, transposed where declared."""
        if self.vocab_rows is not None and master.shape[0] > self.vocab_rows:
            master = master[:self.vocab_rows].clone()   # own storage: a view would keep (and count) the padding
        if self.transposed:
            master = master.t()
        return master.contiguous()


REPLICATED = PartitionSpec()


def partition_specs(model: nn.Module) -> dict[str, PartitionSpec]:
    """Every parameter of ``model`` (``named_parameters`` order and names) with the spec its owning module
    declares through ``own_partition_specs()`` (the outermost module's, where an enclosing module declares it
    too); :data:`REPLICATED` for the parameters nobody declares."""
    declared: dict[str, PartitionSpec] = {}
    for prefix, module in model.named_modules():
        own = getattr(module, "own_partition_specs", None)
        if callable(own):
            for leaf, spec in own().items():
                declared.setdefault(f"{prefix}.{leaf}" if prefix else leaf, spec)
    return {name: declared.get(name, REPLICATED) for name, _ in model.named_parameters()}
