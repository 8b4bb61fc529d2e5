"""The planner's and the throughput log's formulas read each family's shape from the registry: GPT-2's and
BERT's numbers stay those of Megatron's and Korthikanti's formulas (pinned), Llama's (SwiGLU, grouped-query
attention, RMSNorm, untied head, rotary positions) are checked against transformers' parameter count,
torch's FLOP counter and the bytes a Llama layer saves for backward."""

from __future__ import annotations

from pathlib import Path

import pytest

from zoo.planning.planner import plan

REPO = Path(__file__).resolve().parent.parent

# ds_config, GPUs per node, nodes, GPU -> (params_total, params_per_rank, total, activations, activations_layers,
# activations_output, activations_attention_scores, flops_per_iteration, stages (layers, params, activations,
# total)), as the planner gave them with GPT-2's formulas for every family.
GPT2_AND_BERT_PLANS = {
    ("tp1.json", 1, 1, "V100"): (1212103680, 1212103680, 22386294784, 2992635904, 2105540608, 887095296,
                                 671088640, 5520716602540032.0, ()),
    ("tp8.json", 8, 1, "V100"): (8317040640, 1043549184, 21046280192, 4349493248, 4118806528, 230686720,
                                 167772160, 3.659394599564083e+16, ()),
    ("tp8_zero1.json", 8, 2, "A100"): (8317040640, 1043549184, 15828534272, 4349493248, 4118806528, 230686720,
                                       167772160, 3.659394599564083e+16, ()),
    ("gpt2_20b_tp8_pp4.json", 8, 4, "H100"): (
        20262014976, 675223296, 15863761920, 2359296000, 2359296000, 0, 0, 2.6868545745636557e+17,
        ((11, 675223296, 2359296000, 15863761920), (11, 623318784, 1764753408, 14231129088),
         (11, 623318784, 1176502272, 13642877952), (11, 662652672, 620756992, 13873810432))),
    ("bert_336m_tp1.json", 1, 1, "V100"): (336297858, 336297858, 5784991776, 404226048, 255852544, 148373504,
                                           83886080, 1470734241103872.0, ()),
    ("bert_3.9b_tp4_zero1.json", 8, 1, "A100"): (3869588482, 978782722, 11495370262, 728760320, 639631360,
                                                 89128960, 52428800, 1.6608123137556482e+16, ()),
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


# ---------------------------------------------------------------------------------------------- the formulas
def _shape(preset: str, **overrides):
    from zoo.models.families import model_config, shape_of

    return shape_of(model_config(preset, **overrides))


@pytest.mark.parametrize("preset", ["gpt2-tiny", "bert-tiny"])
def test_the_shape_formulas_are_the_papers_for_gpt2_and_bert(preset):
    """The part-by-part formulas on GPT-2's and BERT's shape give the closed forms of Korthikanti et al. and
    Megatron exactly (the FLOPs to 1e-15 relative: the closed form rounds s / (6 h))."""
    from zoo.planning.activations import (
        activation_bytes,
        activation_bytes_of,
        attention_scores_bytes,
        attention_scores_bytes_of,
        output_activation_bytes,
        output_activation_bytes_of,
    )
    from zoo.planning.flops import megatron_flops_per_iteration, model_flops_per_iteration

    shape = _shape(preset)
    h, a, layers = shape.hidden, shape.heads, shape.layers
    for s, b, t, sp, recompute, v, m in [(128, 4, 1, False, "none", 2, 1), (2048, 8, 8, True, "selective", 2, 1),
                                         (1024, 2, 4, False, "full", 4, 4), (96, 3, 2, True, "full", 2, 2)]:
        widths = {"value_bytes": v, "mask_bytes": m}
        assert (activation_bytes_of(shape, s, b, t, sp, recompute, **widths)
                == activation_bytes(s, b, h, a, layers, t, sp, recompute, **widths))
        assert attention_scores_bytes_of(shape, s, b, t, **widths) == attention_scores_bytes(s, b, a, t, **widths)
        for mlm in (False, True):
            assert (output_activation_bytes_of(shape, s, b, 51200, t, sp, **widths, mlm_transform=mlm)
                    == output_activation_bytes(s, b, h, 51200, t, sp, **widths, mlm_transform=mlm))
        for full in (False, True):
            assert model_flops_per_iteration(b, s, shape, 50257, full) == pytest.approx(
                megatron_flops_per_iteration(b, s, layers, h, 50257, full), rel=1e-15, abs=0)


# ---------------------------------------------------------------------------------------------- Llama
@pytest.mark.parametrize("preset, tp", [("llama-tiny", 2), ("llama2-7b", 8), ("llama3-8b", 8)])
def test_llama_parameters_are_transformers_count(preset, tp):
    """The planner's parameter count of a Llama preset (built on the meta device) is transformers'
    LlamaForCausalLM.num_parameters() of the same config.json, plus the padded vocabulary rows of the
    untied embedding and LM head (2 (V_padded - V) h): at tp = 1 and at the demo's and the GPU configs' tp."""
    import torch
    import transformers

    from zoo.models.families import model_config
    from zoo.planning.model_states import count_parameters

    config = model_config(preset)
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict())).num_parameters()
    for degree in (1, tp):
        padding_rows = config.padded_vocab_size(degree) - config.vocab_size
        assert count_parameters(config, degree).total == reference + 2 * padding_rows * config.hidden_size, degree


def _llama_ds_config(tmp_path, name: str, *, dtype: str = "fp32", **zoo_block) -> Path:
    """ds_configs/llama_cpu_demo.json (at tp = 1 unless given) with the zoo-block changes and precision given."""
    import json

    values = json.loads((REPO / "ds_configs" / "llama_cpu_demo.json").read_text())
    values["zoo"].update({"tensor_parallel_size": 1, **zoo_block})
    values.pop("fp16", None)
    values.pop("bf16", None)
    if dtype != "fp32":
        values[dtype] = {"enabled": True}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(values))
    return path


@pytest.mark.parametrize("recompute", [False, True])
def test_llama_flops_per_iteration_are_what_torch_counts(tmp_path, recompute):
    """The planner's FLOPs of an iteration of llama-tiny (grouped-query attention, SwiGLU, untied head) equal
    torch's FlopCounterMode over one sample's forward and backward times the global batch, with attention on
    SDPA's math kernel so that its two batched GEMMs are counted (every query-key pair, as Megatron counts);
    with full recomputation the layers' forward runs once more (DeepSpeed's checkpoint)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from zoo.models.families import build_model
    from zoo.planning.planner import model_config_of, run_config_of

    seq = 64
    path = _llama_ds_config(tmp_path, "flops", seq_length=seq, checkpoint_activations=recompute)
    planned = plan(path, 1, gpu="cpu", with_deepspeed_estimate=False)
    torch.manual_seed(0)
    model = build_model(model_config_of(run_config_of(path)), None).train()
    ids = torch.randint(0, 50257, (1, seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    assert planned.recompute == ("full" if recompute else "none")
    assert planned.flops_per_iteration == planned.global_batch * counter.get_total_flops()


def _saved_bytes(model, ids, extra_storages=(), labels=None) -> tuple[int, int, int, object]:
    """(bytes of the floating-point tensors autograd saves in a forward with labels (``ids`` unless given), and
    of the returned logits (once, whether or not the loss saves them too), parameters and token ids and label
    masks left out; bytes of the saved per-row statistics: (b, s, 1) ones and the cross-entropy's flat (b s,)
    ones; bytes of the saved 0-dimensional tensors (the loss's sum and token count over context ranks); the
    output)."""
    import torch

    saved = {}

    def keep(tensor):
        saved[tensor.untyped_storage().data_ptr()] = (tensor.untyped_storage().nbytes(), tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        output = model(ids, labels=ids if labels is None else labels)
    logits = output.logits.untyped_storage()
    saved.setdefault(logits.data_ptr(), (logits.nbytes(), output.logits))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | set(extra_storages)
    kept = [(n, t) for ptr, (n, t) in saved.items() if ptr not in params and t.is_floating_point()]
    row_statistics = [n for n, t in kept if (t.dim() == 3 and t.shape[-1] == 1) or (t.dim() == 1 and t.numel() == ids.numel())]
    scalars = [n for n, t in kept if t.dim() == 0]
    return sum(n for n, _ in kept), sum(row_statistics), sum(scalars), output


@pytest.mark.parametrize("dtype, recompute", [("fp32", None), ("bf16", None), ("bf16", "selective")])
def test_llama_activation_bytes_are_what_the_model_saves_for_backward(tmp_path, dtype, recompute):
    """The planner's activation bytes of llama-tiny (layers plus embeddings/head/logits) are what its forward
    saves for backward on CPU, the returned logits included, up to what the formulas leave out by design: the
    norms' per-row 1/rms and the cross-entropy's per-token statistics (16-bit logits: its max and sum, fp32:
    one scale, 4 B each), the rotary cos/sin tables (2 x (1, s, d), shared by the layers) and the token ids;
    under selective recomputation DeepSpeed's checkpoint holds Q, K and V outside autograd's saved tensors,
    v (n d + 2 n_kv d) per token of each layer, added by hand."""
    import torch

    from zoo.models.families import build_model
    from zoo.planning.planner import model_config_of, run_config_of

    block = {"model_overrides": {"recompute_granularity": recompute}} if recompute else {}
    path = _llama_ds_config(tmp_path, "memory", dtype=dtype, seq_length=64, **block)
    planned = plan(path, 1, gpu="cpu", with_deepspeed_estimate=False)
    assert planned.recompute == (recompute or "none") and planned.dtype == dtype
    config = model_config_of(run_config_of(path))
    v, layers, head_dim = planned.weights // planned.params_per_rank, config.num_hidden_layers, config.attention_head_dim
    torch.manual_seed(0)
    model = build_model(config, None).to(torch.float32 if dtype == "fp32" else torch.bfloat16).train()
    ids = torch.randint(0, config.vocab_size, (planned.micro_batch, planned.seq_length))
    measured, row_statistics, _, output = _saved_bytes(model, ids)
    tokens = planned.micro_batch * planned.seq_length
    loss_statistics = (1 if dtype == "fp32" else 2) * 4 * tokens
    assert row_statistics == (2 * layers + 1) * 4 * tokens + loss_statistics
    rotary_tables = 2 * v * planned.seq_length * head_dim
    checkpoint_inputs = (layers * v * tokens * (config.num_attention_heads + 2 * config.kv_heads) * head_dim
                         if recompute else 0)
    measured += checkpoint_inputs - row_statistics - rotary_tables
    assert measured == planned.activations_layers + planned.activations_output
    assert planned.activations_attention_scores == 0   # SDPA's fused kernel keeps no scores


def _llama_saved_bytes_at_tp(rank: int, world_size: int, seq: int, micro_batch: int) -> list[tuple[int, int]]:
    """(measured bytes, row statistics) of llama-tiny's forward on this TP rank, without and with sequence
    parallelism (see :func:`_saved_bytes`; the returned logits shard added)."""
    import torch

    from zoo.models.llama import LlamaForCausalLM, llama_config
    from zoo.parallel.state import ParallelState

    parallel = ParallelState.initialize(world_size)
    results = []
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config("llama-tiny", sequence_parallel=sequence_parallel), parallel).train()
        ids = torch.randint(0, 50257, (micro_batch, seq))
        measured, row_statistics, _, _ = _saved_bytes(model, ids)
        results.append((measured, row_statistics))
    return results


def test_llama_activation_bytes_at_tp2_with_and_without_sequence_parallelism(tmp_path):
    """At tp = 2 each rank saves what the planner says, without sequence parallelism and with it, where the
    norms, the q/k/v GEMMs' shared input, the MLP's input and the head's input are this rank's s/2 tokens (an
    attention that kept its all-gathered input, s tokens, would save v h s b / 2 more per layer and fail); the
    norms' per-row 1/rms, the cross-entropy's per-token statistics and the rotary tables left out as above."""
    from tests.spawn import spawn

    seq, micro_batch, head_dim, layers = 64, 4, 32, 2
    planned = [plan(_llama_ds_config(tmp_path, f"tp2_{sp}", seq_length=seq, tensor_parallel_size=2,
                                     sequence_parallel=sp), 2, gpu="cpu", with_deepspeed_estimate=False)
               for sp in (False, True)]
    measured = spawn(_llama_saved_bytes_at_tp, 2, seq, micro_batch)
    for (saved, row_statistics), p, sp in zip(measured[0], planned, (False, True)):
        assert p.sequence_parallel is sp and p.micro_batch == micro_batch and p.tp == 2
        loss_statistics = 4 * micro_batch * seq              # fp32 logits: one scale a token, every token
        assert row_statistics == (2 * layers + 1) * 4 * micro_batch * seq // (2 if sp else 1) + loss_statistics
        rotary_tables = 2 * 4 * seq * head_dim
        assert saved - row_statistics - rotary_tables == p.activations_layers + p.activations_output, sp
    assert measured[0] == measured[1]


def _llama_saved_bytes_at_cp(rank: int, world_size: int, seq: int, micro_batch: int, cases) -> dict:
    """(measured bytes, row statistics, 0-dimensional tensors) of llama-tiny's forward on this rank at
    context-parallel size 1 and 2 (tp = 1), the same sequences, the c = 2 ranks their shards (see
    :func:`_saved_bytes`), for each (key/value heads, recompute) of ``cases``."""
    import torch

    from zoo.models.llama import LlamaForCausalLM, llama_config
    from zoo.parallel.context import context_shard
    from zoo.parallel.state import ParallelState

    grids = {cp: ParallelState.initialize(1, cp_size=cp) for cp in (1, 2)}
    ids = torch.randint(0, 50257, (micro_batch, seq), generator=torch.Generator().manual_seed(3))
    results = {}
    for kv_heads, recompute in cases:
        for cp, parallel in grids.items():
            torch.manual_seed(0)
            config = llama_config("llama-tiny", num_key_value_heads=kv_heads, recompute_granularity=recompute)
            model = LlamaForCausalLM(config, parallel).train()
            batch = context_shard({"input_ids": ids, "labels": ids.clone()}, parallel)
            measured, row_statistics, scalars, _ = _saved_bytes(model, batch["input_ids"], labels=batch["labels"])
            results[(kv_heads, recompute, cp)] = (measured, row_statistics, scalars)
    return results


# llama-tiny's 2 key/value heads, one per context rank; 1 key/value head, repeated for the 2 context ranks
CONTEXT_CASES = [(2, None), (1, None), (2, "selective"), (1, "selective")]


def test_llama_activation_bytes_at_context_parallel_2_are_half_and_what_the_planner_says(tmp_path):
    """At context-parallel size 2 (DeepSpeed-Ulysses, tp = 1, 2 ranks) each rank saves for backward at most
    55 % of what one rank saves for the whole sequence (c = 1), and exactly what the planner says: every
    per-token tensor of its s/2 tokens, the logits (b, s/2, V) included, and in attention the fused kernel's Q, K,
    V, output and log-sum-exp for n/2 heads over all s positions plus the projection's input, the returning
    all-to-all's output (5 v n d + 4 n per token, over 2), with grouped-query attention (2 key/value heads) and
    with one key/value head repeated for the two context ranks. Left out as at c = 1: the norms' 1/rms, the
    cross-entropy's per-token scale, the rotary tables (of this rank's s/2 positions); and the loss's sum and
    token count over the context ranks (0-dimensional). Under selective recomputation DeepSpeed's checkpoint
    holds Q, K and V after the exchange outside autograd's saved tensors, v (n + 2 n_kv') d s/2 per layer (n_kv'
    = 2: the key/value heads as exchanged), added by hand."""
    from tests.spawn import spawn

    seq, micro_batch, head_dim, layers, heads, v = 64, 4, 32, 2, 4, 4
    measured = spawn(_llama_saved_bytes_at_cp, 2, seq, micro_batch, CONTEXT_CASES)
    assert measured[0] == measured[1]
    for kv_heads, recompute in CONTEXT_CASES:
        whole, split = (measured[0][(kv_heads, recompute, cp)] for cp in (1, 2))
        assert split[0] <= 0.55 * whole[0], (kv_heads, recompute, split[0] / whole[0])
        for cp, (saved, row_statistics, scalars) in ((1, whole), (2, split)):
            overrides = {"num_key_value_heads": kv_heads, **({"recompute_granularity": recompute} if recompute else {})}
            p = plan(_llama_ds_config(tmp_path, f"cp{cp}_{kv_heads}_{recompute}", seq_length=seq,
                                      context_parallel_size=cp, model_overrides=overrides),
                     2, gpu="cpu", with_deepspeed_estimate=False)
            assert (p.cp, p.dp, p.tp, p.micro_batch, p.recompute) == (cp, 2 // cp, 1, micro_batch, recompute or "none")
            tokens = micro_batch * seq // cp
            assert row_statistics == (2 * layers + 1) * 4 * tokens + 4 * tokens   # fp32 logits: one scale a token
            assert scalars == (0 if cp == 1 else 12)
            rotary_tables = 2 * v * (seq // cp) * head_dim
            exchanged_kv = 2 if cp == 2 else kv_heads
            checkpoint_inputs = layers * v * micro_batch * seq * (heads + 2 * exchanged_kv) * head_dim // cp \
                if recompute else 0
            kept = saved + checkpoint_inputs - row_statistics - scalars - rotary_tables
            assert kept == p.activations_layers + p.activations_output, (kv_heads, recompute, cp)


# ---------------------------------------------------------------------------------------------- sample prompts
def _llama_block_config(model: str, **zoo_block) -> dict:
    import json

    values = json.loads((REPO / "ds_configs" / "llama_cpu_demo.json").read_text())
    values["zoo"].update(model=model, tensor_parallel_size=1, **zoo_block)
    return values


def test_gpt2_bpe_sample_prompts_are_refused_for_a_llama_vocabulary_they_do_not_fit():
    """llama2-7b's 32,000-token vocabulary cannot take GPT-2 BPE ids (up to 50,256): the sample prompts of such
    a run are refused before training, naming the run's ``tokenizer`` setting."""
    from zoo.errors import UserError
    from zoo.planning.planner import run_config_of

    with pytest.raises(UserError, match=r"bundled GPT-2 tokenizer \(50257 tokens\), more than the vocab_size 32000 "
                                        r"of model 'llama2-7b'; set the zoo block's \"tokenizer\""):
        run_config_of(_llama_block_config("llama2-7b", seq_length=128))
    assert run_config_of(_llama_block_config("llama-tiny")).sample_prompts   # GPT-2's vocabulary: accepted


def test_sample_prompts_are_encoded_and_decoded_with_the_runs_tokenizer(tmp_path):
    """A run whose data was preprocessed with another tokenizer (here a 290-token byte-level BPE) names it in
    the zoo block: the prompts are checked and sampled with it. GPT-2 BPE would give ids past the model's
    290-row vocabulary."""
    import torch
    from tokenizers import ByteLevelBPETokenizer

    from zoo.data.tokenizers import load_gpt2_tokenizer
    from zoo.inference import sample_lines
    from zoo.models.families import build_model
    from zoo.planning.planner import model_config_of, run_config_of

    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(["the history of the river", "in the united states the river flows"] * 10,
                                vocab_size=290, min_frequency=1, special_tokens=["<|endoftext|>"])
    trained.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_gpt2_tokenizer(tmp_path)
    config = run_config_of(_llama_block_config("llama-tiny", tokenizer=str(tmp_path), sample_prompts=["the river"],
                                               model_overrides={"vocab_size": len(tokenizer)}))
    assert max(load_gpt2_tokenizer().encode("the river")) >= len(tokenizer)
    torch.manual_seed(0)
    model = build_model(model_config_of(config), None)
    header, line = sample_lines(model, config.sample_prompts, config.seed, None, config.tokenizer)
    assert header.startswith("samples") and line.startswith("  the river")
    completion = line[len("  the river"):]
    assert completion and tokenizer.decode(tokenizer.encode(completion)) == completion
