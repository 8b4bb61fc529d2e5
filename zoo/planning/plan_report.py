"""The readable table of ``launch/plan.py`` (:func:`format_plan`), sizes in GB = 10^9 bytes (:func:`gb`) and
MB = 10^6 bytes (:func:`mb`)."""

from __future__ import annotations

from zoo.planning.planner import Plan


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def format_plan(p: Plan) -> str:
    """The readable table of ``launch/plan.py``."""
    lines = [
        f"plan: {p.model} from {p.config}: {p.world_size} x {p.device} on {p.num_nodes} node"
        f"{'s' if p.num_nodes > 1 else ''}, tp={p.tp} " + (f"pp={p.pp} " if p.pp > 1 else "")
        + (f"cp={p.cp} " if p.cp > 1 else "") + f"dp={p.dp}, {p.dtype}, ZeRO stage {p.zero_stage}"
        + (f" over dp x cp = {p.dp * p.cp} ranks" if p.cp > 1 and p.zero_stage else "") + f", recompute {p.recompute}"
        f"{', sequence parallel' if p.sequence_parallel else ''}",
        f"  batch: micro {p.micro_batch} x seq {p.seq_length}, global {p.global_batch} "
        f"({p.gradient_accumulation_steps} accumulation steps)",
        f"  model: {p.layers} layers, hidden {p.hidden}, {p.heads} heads"
        + (f" ({p.kv_heads} key/value heads)" if p.kv_heads != p.heads else "")
        + f", MLP {p.ffn_hidden} x {p.ffn_matrices} GEMMs, vocab {p.vocab} padded to {p.padded_vocab}",
        f"  parameters: {p.params_total:,} total ({p.params_total / 1e9:.2f}B), {p.params_per_rank:,} per rank",
        "  bytes per rank:",
        f"    weights      {gb(p.weights):>12}",
        f"    gradients    {gb(p.gradients):>12}",
        f"    optimizer    {gb(p.optimizer):>12}",
        f"    model states {gb(p.model_states):>12}   DeepSpeed's estimate: "
        + (gb(p.deepspeed_model_states) if p.deepspeed_model_states is not None else "none at ZeRO stage 0"),
        f"    activations  {gb(p.activations):>12}   per micro-batch: layers {gb(p.activations_layers)}, "
        f"embeddings/head/logits {gb(p.activations_output)}",
        f"{'':32}(attention scores {gb(p.activations_attention_scores)} of it, which a fused attention "
        "kernel does not keep)",
        f"    total        {gb(p.total):>12}",
    ]
    if p.pp > 1:
        lines[4] = "  bytes per rank (the heaviest pipeline stage):"
        lines[9] = (f"    activations  {gb(p.activations):>12}   the micro-batches in flight under 1F1B (up to "
                    f"{p.pp} on the first stage)")
        del lines[10]
        lines.append(f"  pipeline: {p.pp} stages, {p.gradient_accumulation_steps} micro-batches per step: "
                     f"bubble {100 * p.bubble_fraction:.1f} % of the step")
        for stage in p.stages:
            lines.append(f"    stage {stage['stage']}: {stage['layers']:>3} layers, {stage['params_per_rank']:,} "
                         f"parameters, model states {gb(stage['weights'] + stage['gradients'] + stage['optimizer'])}, "
                         f"activations {gb(stage['activations'])}, total {gb(stage['total'])}")
    if p.cp > 1:
        lines.append(f"  context all-to-all: {mb(p.all_to_all_forward)} forward, {mb(p.all_to_all_backward)} backward"
                     f" sent per rank per layer per micro-batch ({p.seq_length // p.cp} tokens per rank; 4 all-to-alls"
                     " each way" + (", and the recomputed forward's 4" if p.recompute == "full" else "") + ")")
    if p.memory is not None:
        verdict = "fits" if p.fits else "does NOT fit"
        lines.append(f"  memory: {verdict} in {gb(p.memory)}, margin {gb(p.margin)} "
                     f"({100 * p.margin / p.memory:.0f} %)")
    compute = f"  compute: {p.flops_per_iteration / 1e15:.2f} PFLOP per iteration"
    if p.seconds_per_iteration is not None:
        compute += (f", {p.seconds_per_iteration:.2f} s per iteration at {100 * p.mfu:g} % MFU of "
                    f"{p.peak_tflops:g} TFLOP/s x {p.world_size}" + (" with the bubble" if p.pp > 1 else ""))
    else:
        compute += f" (no peak for {p.device}: no time estimate)"
    lines.append(compute)
    return "\n".join(lines)


__all__ = ["format_plan", "gb", "mb"]
