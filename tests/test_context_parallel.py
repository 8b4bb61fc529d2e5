"""Context parallelism (DeepSpeed-Ulysses) against the unsplit model, dropout off.

One 4-rank spawn builds each model at context-parallel size c = 2 and at c = 1 with the same tensor-parallel
size, from the same transformers checkpoint, and gives both the same batch (the c = 2 ranks their shards,
:func:`zoo.parallel.context.context_shard`):

* Llama with grouped-query attention (4 query heads, 2 key/value heads) at tp1 x cp2 (two KV heads per TP rank,
  one per context rank), at tp2 x cp2 with and without Korthikanti sequence parallelism (one KV head per TP
  rank, repeated for the two context ranks) and at tp1 x cp4 (each of the two KV heads repeated for two context
  ranks, the query heads 0-1 reading the first); GPT-2 at tp1 x cp2.
* fp32: the loss <= 1e-5 relative, every gradient (summed over the context ranks, as DeepSpeed sums it) <= 1e-5
  of its layer's largest; fp64: every gradient and the AdamW update of one step <= 1e-9 relative.
* Positions are global and the key/value heads grouped as the unsplit model groups them: rank-local positions,
  or key/value heads repeated in the wrong order, change the loss by far more than these tolerances.
* What context parallelism cannot do is one sentence: heads the layout cannot split, a sequence the context
  size does not divide, key/value-cached decoding.
"""

from __future__ import annotations

import pytest
import torch

from tests.checks import layer_scaled_grad_errors, rel_err
from tests.helpers.llama_reference import hf_llama_config
from tests.spawn import spawn

pytestmark = pytest.mark.filterwarnings("ignore::zoo.models.pretrained.BundledTokenizerWarning")
FP32_TOL, FP64_TOL = 1e-5, 1e-9
VOCAB, BATCH, SEQ = 512, 2, 16          # 16 tokens: 8 (or 4) per context rank, 4 per TP rank under SP
LAYOUTS = [("llama", 1, 2, False), ("llama", 2, 2, False), ("llama", 2, 2, True), ("llama", 1, 4, False),
           ("gpt2", 1, 2, False)]


def save_randomised(model, path) -> str:
    """``model`` with every weight moved off its init (norms and biases too), saved with save_pretrained."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * (0.1 if param.dim() == 1 else 0.05))
    model.save_pretrained(path)
    return str(path)


def save_llama(path) -> str:
    import transformers

    torch.manual_seed(11)
    config = hf_llama_config({"rope_type": "default", "rope_theta": 10000.0}, vocab_size=VOCAB, hidden_size=64,
                             intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2, max_position_embeddings=64, attention_dropout=0.0)
    return save_randomised(transformers.LlamaForCausalLM(config), path)


def save_gpt2(path) -> str:
    import transformers

    torch.manual_seed(12)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return save_randomised(transformers.GPT2LMHeadModel(config), path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {"llama": save_llama(tmp_path_factory.mktemp("llama")), "gpt2": save_gpt2(tmp_path_factory.mktemp("gpt2"))}


def the_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def load(family: str, directory: str, ps, sequence_parallel: bool, dtype):
    from zoo.models import GPT2LMHeadModel, LlamaForCausalLM

    cls = LlamaForCausalLM if family == "llama" else GPT2LMHeadModel
    overrides = {"sequence_parallel": True} if sequence_parallel else {}
    return cls.from_pretrained(directory, parallel=ps, dtype=dtype, **overrides).train()


def loss_and_grads(model, batch, ps) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one forward and each parameter's gradient summed over the context ranks."""
    import torch.distributed as dist

    loss = model(**batch).loss
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        if ps.cp_size > 1:
            dist.all_reduce(grad, group=ps.cp_group)
        grads[name] = grad
    return loss.detach(), grads


def adamw_update(model, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The change one AdamW step (lr 1e-3) makes to each parameter given ``grads``."""
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    for name, param in model.named_parameters():
        param.grad = grads[name]
    torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01).step()
    return {name: param.detach() - before[name] for name, param in model.named_parameters()}


def compare(family: str, directory: str, split, whole, sequence_parallel: bool) -> dict[str, float]:
    from zoo.parallel.context import context_shard

    errors = {}
    batch = the_batch()
    for dtype in (torch.float32, torch.float64):
        model, reference = (load(family, directory, ps, sequence_parallel, dtype) for ps in (split, whole))
        loss, grads = loss_and_grads(model, context_shard(batch, split), split)
        ref_loss, ref_grads = loss_and_grads(reference, batch, whole)
        if dtype == torch.float32:
            errors["fp32:loss"] = rel_err(loss, ref_loss)
            errors.update({f"fp32:{k}": v for k, v in layer_scaled_grad_errors(grads, ref_grads).items()})
        else:
            errors["fp64:loss"] = rel_err(loss, ref_loss)
            errors.update({f"fp64:grad:{n}": rel_err(g, ref_grads[n]) for n, g in grads.items()})
            update, ref_update = adamw_update(model, grads), adamw_update(reference, ref_grads)
            errors.update({f"fp64:update:{n}": rel_err(u, ref_update[n]) for n, u in update.items()})
    return errors


def refusals(directory: str, split) -> dict[str, str]:
    from zoo.errors import UserError
    from zoo.models import LlamaForCausalLM
    from zoo.parallel.context import check_context_heads, context_shard

    said = {}
    for name, attempt in {
        "heads": lambda: check_context_heads(4, 2, 1, 8),
        "kv_heads": lambda: check_context_heads(12, 6, 1, 4),
        "sequence": lambda: context_shard({"input_ids": torch.zeros(1, 15, dtype=torch.long)}, split),
        "decoding": lambda: LlamaForCausalLM.from_pretrained(directory, parallel=split)(
            torch.zeros(1, 4, dtype=torch.long), use_cache=True),
    }.items():
        try:
            attempt()
            said[name] = "accepted"
        except UserError as err:
            said[name] = str(err)
    return said


def _worker(rank, world_size, checkpoints):
    from zoo.parallel.state import ParallelState

    results = {}
    grids = {(tp, cp): ParallelState.initialize(tp, cp_size=cp) for tp, cp in ((1, 1), (2, 1), (1, 2), (2, 2), (1, 4))}
    for family, tp, cp, sequence_parallel in LAYOUTS:
        results[(family, tp, cp, sequence_parallel)] = compare(family, checkpoints[family], grids[(tp, cp)],
                                                               grids[(tp, 1)], sequence_parallel)
    results["refusals"] = refusals(checkpoints["llama"], grids[(1, 2)])
    results["grid"] = {layout: grid_place(ps) for layout, ps in grids.items() if layout[1] > 1}
    return results


def grid_place(ps) -> tuple:
    """This rank's (tp, cp, dp) ranks and the global ranks of its context and sequence-data-parallel groups."""
    import torch.distributed as dist

    return (ps.tp_rank, ps.cp_rank, ps.dp_rank, dist.get_process_group_ranks(ps.cp_group),
            dist.get_process_group_ranks(ps.seq_dp_group), ps.get_sequence_data_parallel_rank())


@pytest.fixture(scope="module")
def runs(checkpoints):
    return spawn(_worker, 4, checkpoints)


def failures(errors: dict[str, float]) -> dict[str, float]:
    return {name: error for name, error in errors.items()
            if not error <= (FP32_TOL if name.startswith("fp32") else FP64_TOL)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout[0]}-tp{layout[1]}-cp{layout[2]}"
                                                                + ("-sp" if layout[3] else ""))
def test_context_parallel_equals_the_unsplit_model(runs, layout):
    for rank, results in enumerate(runs):
        errors = results[layout]
        assert len(errors) > 10, errors
        assert not failures(errors), (rank, failures(errors))


def test_the_grid_puts_context_ranks_between_tensor_and_data_ranks(runs):
    """tp_rank = r mod t, cp_rank = (r div t) mod c, dp_rank = r div (t c); the context group is the c ranks t apart,
    the sequence-data-parallel group (DeepSpeed's gradient sum) the d c ranks of one TP rank."""
    for (tp, cp), _ in [((1, 2), 0), ((2, 2), 0), ((1, 4), 0)]:
        dp = 4 // (tp * cp)
        for r, results in enumerate(runs):
            tp_rank, cp_rank, dp_rank = r % tp, (r // tp) % cp, r // (tp * cp)
            context = [dp_rank * tp * cp + j * tp + tp_rank for j in range(cp)]
            seq_dp = sorted(d * tp * cp + j * tp + tp_rank for d in range(dp) for j in range(cp))
            assert results["grid"][(tp, cp)] == (tp_rank, cp_rank, dp_rank, context, seq_dp, seq_dp.index(r)), (tp, cp, r)


def test_what_context_parallelism_cannot_do_is_one_sentence(runs):
    said = runs[0]["refusals"]
    assert "context-parallel size 8 does not divide" in said["heads"], said
    assert "neither divides nor is divided by the context-parallel size 4" in said["kv_heads"], said
    assert "sequence length 15 does not divide by the context-parallel size 2" in said["sequence"], said
    assert "decoding runs at context-parallel size 1" in said["decoding"], said
