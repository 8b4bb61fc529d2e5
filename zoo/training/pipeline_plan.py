"""The planner's pipeline arithmetic: which layers each stage holds, what each stage keeps, and the bubble.

* **Stages.** The layer sequence of :mod:`zoo.models.gpt2_pipeline` (word embedding, position embedding,
  the L layers, final norm, LM head) is split as DeepSpeed splits it: ``uniform`` balances the transformer
  layers (DeepSpeed's ``type:`` method, a linear partition of 0/1 weights), ``parameters`` balances each
  entry's parameter count (the tied word embedding counts on the first and on the last stage); both with
  DeepSpeed's own partition function, so the plan names the stages the run will build.
* **Activations under 1F1B** (Narayanan et al. 2021, section 2.2): stage k (0-based) starts P - k micro-
  batches before its first backward, so it holds the activations of min(P - k, m) micro-batches of its own
  layers; the first stage holds the most, P micro-batches of L/P layers, the same L layers' worth as one
  stage without pipelining. The embedding's dropout mask lives on the first stage, the final norm's and the
  head's inputs and the logits on the last (one micro-batch: its backward follows its forward at once).
* **Bubble.** With m micro-batches per step each stage idles (P - 1) / (m + P - 1) of the step, so a step
  takes (m + P - 1) / m times its compute. Point-to-point transfers are not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zoo.errors import UserError

__all__ = ["StagePlan", "stage_bounds", "entry_parameters", "bubble_fraction", "micro_batches_in_flight",
           "plan_stages"]


@dataclass(frozen=True)
class StagePlan:
    """One stage's share: its transformer layers, parameters and bytes per rank (its heaviest TP rank)."""

    stage: int
    layers: int
    params_per_rank: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    total: int

    def as_dict(self) -> dict:
        return asdict(self)


def entry_parameters(embedding: int, position: int, layer: int, final_norm: int, n_layer: int) -> list[int]:
    """Per-rank parameters of each entry of the layer sequence (the head is the tied word embedding)."""
    return [embedding, position, *([layer] * n_layer), final_norm, embedding]


def stage_bounds(entries: list[int], pp: int, method: str) -> list[int]:
    """The P + 1 entry offsets of the stages, as DeepSpeed's PipelineModule computes them."""
    from deepspeed.runtime.utils import partition_balanced  # local: DeepSpeed costs seconds to import

    if method == "uniform":
        weights = [0, 0, *([1] * (len(entries) - 4)), 0, 0]
    elif method == "parameters":
        weights = list(entries)
    else:
        raise UserError(f"pipeline partition method {method!r} is not 'parameters' or 'uniform'; pass one of them.")
    return partition_balanced(weights=weights, num_parts=pp)


def micro_batches_in_flight(stage: int, pp: int, m: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B."""
    return min(pp - stage, m)


def bubble_fraction(pp: int, m: int) -> float:
    """(P - 1) / (m + P - 1): the share of a step each stage idles."""
    return (pp - 1) / (m + pp - 1)


def plan_stages(model_config, method: str, tp: int, pp: int, m: int, s: int, b: int, widths: dict[str, int],
                sequence_parallel: bool, recompute: str, layer_bytes, model_state_bytes) -> list[StagePlan]:
    """Each pipeline stage's layers, parameters and bytes per rank. ``layer_bytes(mode)``: one layer's activation
    bytes per micro-batch under recomputation ``mode``; ``model_state_bytes(params)``: (weights, gradients,
    optimizer) bytes of ``params`` parameters (the planner's formulas)."""
    import torch  # local: torch import cost; the planner's arithmetic and plan --help run without torch

    from zoo.models import GPT2LMHeadModel  # local: torch and transformers import cost
    from zoo.parallel.state import ParallelState  # local: torch import cost

    grid = ParallelState(tp_size=tp, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp, rank=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(model_config, grid).transformer

    def count(module):
        return sum(p.numel() for p in module.parameters())

    entries = entry_parameters(count(model.wte), count(model.wpe), count(model.h[0]), count(model.ln_f),
                               model_config.n_layer)
    bounds = stage_bounds(entries, pp, method)
    h, v, mask = model_config.n_embd, widths["value_bytes"], widths["mask_bytes"]
    split = tp if sequence_parallel else 1
    plans = []
    for stage in range(pp):
        first, last = bounds[stage], bounds[stage + 1]
        layers = sum(1 for index in range(first, last) if 2 <= index < len(entries) - 2)
        params = sum(entries[first:last])
        weights, gradients, optimizer = model_state_bytes(params)
        in_flight = micro_batches_in_flight(stage, pp, m)
        held = in_flight * layers * layer_bytes(recompute)
        if recompute == "full" and layers:   # the layer being recomputed holds its whole working set again
            held += layer_bytes("none")
        if first == 0:                       # the embedding's dropout mask, per micro-batch in flight
            held += in_flight * mask * s * b * h / split
        if last == len(entries):             # final norm and head inputs, and the logits (one micro-batch)
            held += 2 * v * s * b * h / split + (v + 4) * s * b * model_config.padded_vocab_size(tp) / tp
        activations = round(held)
        plans.append(StagePlan(stage=stage, layers=layers, params_per_rank=params, weights=weights, gradients=gradients,
                               optimizer=optimizer, activations=activations,
                               total=weights + gradients + optimizer + activations))
    return plans
