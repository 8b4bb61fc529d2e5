"""Regional compilation: each transformer block compiled on its own with ``torch.compile``, as torchtitan does.

Every block of a model (GPT-2's and BERT's :class:`~zoo.models.transformer.TransformerLayer`, Llama's
:class:`~zoo.models.llama.layers.LlamaDecoderLayer`, and the pipeline stages' blocks, which are subclasses of
them) runs the same code on tensors of the same shapes, so Dynamo traces the block once and every layer reuses
that graph (its parameters are graph inputs, not constants): compile time does not grow with depth. Inside a
block the compiler fuses what eager runs as separate passes over the activations: LayerNorm or RMSNorm with the
residual add, GeLU or SwiGLU's SiLU(gate) * up, RoPE's rotation of q and k, the bias adds. A Llama block's
forward is five generated kernels besides its GEMMs and attention (inductor on CPU, torch 2.13;
``benchmarks/bench_compile.py --kernels``): the first RMSNorm; RoPE of q and k with their transposes and the
key/value heads' repeat for grouped-query attention; the residual add with the second RMSNorm; SiLU(gate) * up;
the last residual add. Eager runs each of those operations as a pass of its own.

What is compiled is the block's ``layer_forward``, replaced on the instance (:func:`compile_transformer_blocks`),
so the module tree, the parameters and the state_dict keys are unchanged (no ``_orig_mod.`` prefix): resuming,
changing the layout and exporting read a compiled model's checkpoints as an eager one's.

The tensor-parallel mappings trace into the graph: Dynamo traces their autograd Functions forward and backward,
and inside a traced region their collectives are torch's functional collectives (:mod:`zoo.parallel.mappings`,
:mod:`zoo.parallel.host_all_reduce`), which inductor lowers on NCCL and gloo alike. At any tp, with or without
sequence parallelism, with dropout off or drawn from the default stream, a block is then one forward and one
backward graph, in training and under no_grad (evaluation; the first pass of full recomputation). It breaks,
and runs the piece eagerly, only where something cannot be traced:

- selective recomputation: the attention core goes through DeepSpeed's activation checkpointing, which is
  excluded from compilation (:func:`zoo.models.transformer.recomputed`); the block compiles around it;
- dropout drawn from the TP-rank stream (attention-probability dropout once the model-parallel RNG is seeded;
  residual and embedding dropout under sequence parallelism): DeepSpeed's RNG tracker swaps the generator's
  state, which a graph cannot hold (:func:`zoo.parallel.random.in_tp_stream`).

Full recomputation checkpoints the compiled block itself, so the recomputed forward runs the same compiled code
as the first one, and a dropout inside the graph draws the same mask both times (DeepSpeed restores the
generators first). Key/value-cached decoding (generation, whose shapes change every token) runs the eager block.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from zoo.models.llama.layers import LlamaDecoderLayer
from zoo.models.transformer import TransformerLayer

__all__ = ["BLOCK_TYPES", "compile_transformer_blocks", "is_compiled"]

BLOCK_TYPES: tuple[type[nn.Module], ...] = (TransformerLayer, LlamaDecoderLayer)


def is_compiled(block: nn.Module) -> bool:
    """Whether :func:`compile_transformer_blocks` compiled this block."""
    return getattr(block.__dict__.get("layer_forward"), "zoo_compiled", False)


def compile_transformer_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every transformer block of ``model`` in place with ``torch.compile(backend=backend)``; returns the
    number of blocks this call compiled (a block compiled before is left as it is, so a second call returns 0).

    Call it after the model is built (and its weights loaded) and before ``deepspeed.initialize``: nothing is
    compiled until the first forward, which traces the block once for all layers. ``backend`` is any
    ``torch.compile`` backend: "inductor" generates fused kernels (Triton on GPUs, C++ on CPUs), "aot_eager" only
    traces (for checking the traced graphs against eager at little compile time)."""
    count = 0
    for module in model.modules():
        if isinstance(module, BLOCK_TYPES) and not is_compiled(module):
            module.layer_forward = _compiled_layer_forward(module.layer_forward, backend)
            count += 1
    return count


def _compiled_layer_forward(eager, backend: str):
    """``eager`` (a block's bound ``layer_forward``) compiled, except for key/value-cached decoding."""
    compiled = torch.compile(eager, backend=backend)

    @functools.wraps(eager)
    def layer_forward(*args, cache=None, **kwargs):
        if cache is not None:
            return eager(*args, cache=cache, **kwargs)
        return compiled(*args, **kwargs)

    layer_forward.zoo_compiled = True
    return layer_forward
