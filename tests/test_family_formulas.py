"""The planner's and the throughput log's formulas read each family's shape from the registry: GPT-2's and
BERT's numbers stay those of Megatron's and Korthikanti's formulas (pinned), Llama's (SwiGLU, grouped-query
attention, RMSNorm, untied head, rotary positions) are checked against transformers' parameter count,
torch's FLOP counter and the bytes a Llama layer saves for backward."""

from __future__ import annotations

from pathlib import Path

import pytest

from zoo.training.planner import plan

REPO = Path(__file__).resolve().parent.parent

# ds_config, GPUs per node, nodes, GPU -> (params_total, params_per_rank, total, activations, activations_layers,
# activations_output, activations_attention_scores, flops_per_iteration, stages (layers, params, activations,
# total)), as the planner gave them with GPT-2's formulas for every family.
GPT2_AND_BERT_PLANS = {
    ("tp1.json", 1, 1, "V100"): (1212103680, 1212103680, 24034656256, 4640997376, 2105540608, 2535456768,
                                 671088640, 5520716602540032.0, ()),
    ("tp8.json", 8, 1, "V100"): (8317040640, 1043549184, 21255995392, 4559208448, 4118806528, 440401920,
                                 167772160, 3.659394599564083e+16, ()),
    ("tp8_zero1.json", 8, 2, "A100"): (8317040640, 1043549184, 16038249472, 4559208448, 4118806528, 440401920,
                                       167772160, 3.659394599564083e+16, ()),
    ("gpt2_20b_tp8_pp4.json", 8, 4, "H100"): (
        20262014976, 675223296, 15863761920, 2359296000, 2359296000, 0, 0, 2.6868545745636557e+17,
        ((11, 675223296, 2359296000, 15863761920), (11, 623318784, 1764753408, 14231129088),
         (11, 623318784, 1176502272, 13642877952), (11, 662652672, 673185792, 13926239232))),
    ("bert_336m_tp1.json", 1, 1, "V100"): (336297858, 336297858, 6035601440, 654835712, 255852544, 398983168,
                                           83886080, 1470734241103872.0, ()),
    ("bert_3.9b_tp4_zero1.json", 8, 1, "A100"): (3869588482, 978782722, 11558284822, 791674880, 639631360,
                                                 152043520, 52428800, 1.6608123137556482e+16, ()),
    ("cpu_demo.json", 2, 1, "cpu"): (6884864, 3459712, 168863744, 113508352, 9437184, 104071168, 3145728,
                                     42479910912.0, ()),
    ("bert_cpu_demo.json", 2, 1, "cpu"): (4459010, 2280066, 184330272, 147849216, 18874368, 128974848, 6291456,
                                          53955526656.0, ()),
}


def _plan_numbers(name: str, gpus: int, nodes: int, gpu: str) -> tuple:
    p = plan(REPO / "ds_configs" / name, gpus, num_nodes=nodes, gpu=gpu, with_deepspeed_estimate=False)
    stages = tuple((s["layers"], s["params_per_rank"], s["activations"], s["total"]) for s in p.stages)
    return (p.params_total, p.params_per_rank, p.total, p.activations, p.activations_layers, p.activations_output,
            p.activations_attention_scores, p.flops_per_iteration, stages)


@pytest.mark.parametrize("case", sorted(GPT2_AND_BERT_PLANS))
def test_gpt2_and_bert_plans_keep_their_numbers(case):
    """Every integer field exactly; the FLOPs (a float) to 1e-15 relative, the rounding of the closed form
    24 k B s l h^2 (1 + s / (6 h)) + 6 B s h V against the same count summed GEMM by GEMM."""
    *numbers, flops, stages = _plan_numbers(*case)
    *pinned, pinned_flops, pinned_stages = GPT2_AND_BERT_PLANS[case]
    assert (numbers, stages) == (pinned, pinned_stages)
    assert flops == pytest.approx(pinned_flops, rel=1e-15, abs=0)
