"""A gpt2-tiny checkpoint at any tp in DeepSpeed's file layout, written without processes or training."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.pretraining import TINY_MODEL

FAKE_MODEL = dict(TINY_MODEL, n_positions=32)   # n_positions differs from the preset's 256: read from the shapes


def layout_state(tp: int, rank: int):
    """The parallel state of TP rank ``rank`` of ``tp`` for building a model's shard without a process group."""
    from zoo.checkpoint.layout import layout_only_state

    return layout_only_state(tp, rank)


def write_tp_checkpoint(root: Path, tp: int, dtype: torch.dtype, tag: str = "iter_0000007",
                        client: dict | None = None) -> Path:
    """``root/checkpoints/<tag>/mp_rank_XX_model_states.pt`` as DeepSpeed writes them (module state dict
    and client state at the top level), from models built per rank without processes: construction
    needs no collective, and TP-invariant init makes the shards those of one master model."""
    from zoo.models import GPT2LMHeadModel, gpt2_config

    tag_dir = root / "checkpoints" / tag
    tag_dir.mkdir(parents=True)
    for rank in range(tp):
        torch.manual_seed(99)
        model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", **FAKE_MODEL), parallel=layout_state(tp, rank)).to(dtype)
        states = {"module": model.state_dict(), "optimizer": None, "mp_world_size": tp, "ds_version": "0.19",
                  "iteration": 7, "zoo_model": "gpt2-tiny", "tensor_parallel_size": tp,
                  "model_config": model.hf_config_dict()}
        states.update(client or {})
        torch.save(states, tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
    (root / "checkpoints" / "latest").write_text(tag)
    return root
