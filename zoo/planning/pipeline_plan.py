"""The planner's pipeline arithmetic: which layers each stage holds, what each stage keeps, and the bubble.

* **Stages.** The family's layer sequence (GPT-2's :mod:`zoo.models.gpt2.pipeline`: word embedding,
  position embedding, the L layers, final norm, tied LM head; Llama's: embedding, the L layers, norm, untied
  head), each entry's parameters counted by the family, is split as DeepSpeed splits it: ``uniform``
  balances the transformer layers (DeepSpeed's ``type:`` method, a linear partition of 0/1 weights),
  ``parameters`` balances each entry's parameter count (a tied word embedding counts on the first and on the last stage); both with
  DeepSpeed's own partition function, so the plan names the stages the run will build.
* **Activations under 1F1B** (Narayanan et al. 2021, section 2.2): stage k (0-based) starts P - k micro-
  batches before its first backward, so it holds the activations of min(P - k, m) micro-batches of its own
  layers; the first stage holds the most, P micro-batches of L/P layers, the same L layers' worth as one
  stage without pipelining. The embedding's dropout mask (where the family has one) lives on the first
  stage, the final norm's kept tensors, the head's input and the logits on the last (one micro-batch: its
  backward follows its forward at once).
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


def stage_bounds(entries: list[int], pp: int, method: str, layers: range | None = None) -> list[int]:
    """The P + 1 entry offsets of the stages, as DeepSpeed's PipelineModule computes them. ``layers``: the
    indices of the layer entries (by default GPT-2's: all but two entries at each end)."""
    from deepspeed.runtime.utils import partition_balanced  # local: DeepSpeed costs seconds to import

    layers = range(2, len(entries) - 2) if layers is None else layers
    if method == "uniform":
        weights = [1 if index in layers else 0 for index in range(len(entries))]
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


def plan_stages(model_config, method: str, tp: int, pp: int, m: int, recompute: str, layer_bytes,
                embedding_bytes: float, head_bytes: float, model_state_bytes) -> list[StagePlan]:
    """Each pipeline stage's layers, parameters and bytes per rank. ``layer_bytes(mode)``: one layer's activation
    bytes per micro-batch under recomputation ``mode``; ``embedding_bytes`` and ``head_bytes``: what the
    embeddings and the final norm, LM head and logits keep of one micro-batch; ``model_state_bytes(params)``:
    (weights, gradients, optimizer) bytes of ``params`` parameters (the planner's formulas, from the family's
    shape)."""
    from zoo.models.families import family_of  # local: torch and transformers import cost

    stages = family_of(model_config).pipeline
    entries, layer_range = stages.entry_parameters(model_config, tp), stages.layer_entries(model_config)
    bounds = stage_bounds(entries, pp, method, layer_range)
    plans = []
    for stage in range(pp):
        first, last = bounds[stage], bounds[stage + 1]
        layers = sum(1 for index in range(first, last) if index in layer_range)
        params = sum(entries[first:last])
        weights, gradients, optimizer = model_state_bytes(params)
        in_flight = micro_batches_in_flight(stage, pp, m)
        held = in_flight * layers * layer_bytes(recompute)
        if recompute == "full" and layers:   # the layer being recomputed holds its whole working set again
            held += layer_bytes("none")
        if first == 0:                       # the embeddings' share, per micro-batch in flight
            held += in_flight * embedding_bytes
        if last == len(entries):             # final norm and head inputs, and the logits (one micro-batch)
            held += head_bytes
        activations = round(held)
        plans.append(StagePlan(stage=stage, layers=layers, params_per_rank=params, weights=weights, gradients=gradients,
                               optimizer=optimizer, activations=activations,
                               total=weights + gradients + optimizer + activations))
    return plans
