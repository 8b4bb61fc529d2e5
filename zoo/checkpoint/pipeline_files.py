"""The weights of a pipeline-stage checkpoint, read as the one-stage model's.

DeepSpeed's pipeline engine saves each entry of the layer sequence in its own file per TP rank,
``layer_XX-model_YY-model_states.pt`` (XX the entry's index in the family's sequence:
:mod:`zoo.models.gpt2.pipeline`, :mod:`zoo.models.llama.pipeline`; YY the TP rank), written by the stage that
holds the entry; entries 0 ... layers + 2 hold every weight once (GPT-2's LM head, the tied word embedding
again, is not saved twice). The ``mp_rank_XX_model_states.pt`` files (one per stage and TP rank) hold the
optimizer, the LR schedule and zoo's client state, with no module weights. :func:`pipeline_module_states`
puts a TP rank's layer files together into the state dict the one-stage model of that TP rank would have,
memory-mapped, so the exporter and the resharders read a pipeline checkpoint like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from zoo.checkpoint.files import first_line
from zoo.checkpoint.safe_load import UnsafeCheckpointError, safe_torch_load
from zoo.errors import MissingInput, UserError

__all__ = ["LAYER_FILE", "layer_path", "pipeline_module_states"]

LAYER_FILE = "layer_{index:02d}-model_{tp_rank:02d}-model_states.pt"


def layer_path(tag_dir: Path, index: int, tp_rank: int) -> Path:
    return Path(tag_dir) / LAYER_FILE.format(index=index, tp_rank=tp_rank)


def pipeline_module_states(tag_dir: Path, tp_rank: int, n_layer: int, entries: Iterable[int] | None = None, *,
                           entry_name: Callable[[int, str, int], str]) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s module state dict under the one-stage model's names, from the tag's layer files
    (entries 0 ... n_layer + 2, which hold every weight once; or only ``entries``), memory-mapped and loaded
    weights-only. ``entry_name``: the family's name of a layer file's key (``PipelineStages.entry_name`` of
    the family that wrote the checkpoint)."""
    states: dict[str, torch.Tensor] = {}
    for index in range(n_layer + 3) if entries is None else entries:
        path = layer_path(tag_dir, index, tp_rank)
        if not path.is_file():
            raise MissingInput(f"{path} is missing from a pipeline checkpoint of {n_layer} layers; copy every "
                                    "layer_XX-model_YY-model_states.pt of the tag.")
        try:
            layer = safe_torch_load(path)
        except UnsafeCheckpointError as err:
            raise UserError(str(err)) from None
        except (RuntimeError, EOFError, OSError, ValueError) as err:
            raise UserError(f"{path} cannot be read as a torch checkpoint ({first_line(err)}); it is truncated, "
                             "re-save the checkpoint.") from None
        if not isinstance(layer, dict):
            raise UserError(f"{path} holds no state dict; it is not a DeepSpeed layer file, re-save the checkpoint.")
        states.update({entry_name(index, key, n_layer): tensor for key, tensor in layer.items()})
    return states
