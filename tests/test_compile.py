"""``--compile``: regionally compiled transformer blocks (zoo.models.compiled) against eager, and the setting.

One spawn per tp in {1, 2, 4} builds each family's pretraining model (GPT-2, BERT, Llama: 2 layers, hidden 64,
a vocabulary of 1000 that tp pads, fp32, dropout off, LayerNorm/RMSNorm weights randomised, a padded sample so
the attention bias is exercised) twice from one seed, with and without sequence parallelism (tp > 1), runs one
forward + backward eager, compiles the blocks (:func:`compile_transformer_blocks`) and runs it compiled. The
loss and every gradient must agree: max|compiled - eager| <= 1e-5 x max|eager|, tensor by tensor. The compiled
step must have traced its block into graphs and broken none of them (Dynamo's counters, reset per model, so a
silent fall-back to eager fails), except at the one break selective recomputation has by design. The first,
forward-only pass of full recomputation runs the blocks under no_grad, as evaluation does: its graph is checked
too.

Backends. inductor generates and compiles C++ kernels (about 25 s of CPU per model with an empty inductor cache,
a few seconds with a warm one); aot_eager traces the forward and backward graphs through AOTAutograd
(functionalisation, the partition into forward and backward) as inductor does, and runs them with eager kernels;
"eager" traces with Dynamo only (the collectives and the autograd Functions' traced backward included) and runs
the traced graph. inductor runs once per family: GPT-2 and BERT at tp = 1, Llama at tp = 2 with sequence
parallelism (its all-gathers, reduce-scatters and the RMSNorm weights' all-reduce lowered by inductor, on gloo);
aot_eager runs GPT-2 at tp = 2 without sequence parallelism (the all-reduces of f and g) and with full
recomputation; "eager" runs the rest (at tp = 4, four ranks share two cores).

Also at tp = 2: full recomputation (GPT-2, sequence parallel) and selective recomputation (Llama), and the
pipeline stages' blocks (GPT2BlockPipe, LlamaDecoderPipe). At tp = 1: compiling leaves the state_dict keys and
parameter names as they were (no ``_orig_mod.``), and a state_dict saved from a compiled model loads strictly
into an eager one and back. Without a process group: the zoo-block key and the ``--compile/--no-compile`` flag,
a non-boolean value refused in one sentence, and the effective-settings line.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from tests.spawn import spawn

REL_TOL = 1e-5
VOCAB, BATCH, SEQ = 1000, 2, 16
REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "ds_configs" / "cpu_demo.json"

# (family, sequence_parallel, recompute) per tp
CASES = {
    1: [(family, False, None) for family in ("gpt2", "bert", "llama")],
    2: [(family, sp, None) for family in ("gpt2", "bert", "llama") for sp in (False, True)]
       + [("gpt2", True, "full"), ("llama", False, "selective")],
    4: [(family, sp, None) for family in ("gpt2", "bert", "llama") for sp in (False, True)],
}
INDUCTOR = {(1, "gpt2", False, None), (1, "bert", False, None), (2, "llama", True, None)}
AOT_EAGER = {(2, "gpt2", False, None), (2, "gpt2", True, "full")}


def backend_of(tp: int, family: str, sp: bool, recompute: str | None) -> str:
    case = (tp, family, sp, recompute)
    return "inductor" if case in INDUCTOR else "aot_eager" if case in AOT_EAGER else "eager"


def family_config(family: str, sp: bool, recompute: str | None):
    from zoo.models import model_config

    run = {"sequence_parallel": sp, "activation_checkpointing": recompute == "full",
           "recompute_granularity": "selective" if recompute == "selective" else None}
    if family == "gpt2":
        return model_config("gpt2-tiny", n_embd=64, vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            **run)
    if family == "bert":
        return model_config("bert-tiny", hidden_size=64, vocab_size=VOCAB, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, **run)
    return model_config("llama-tiny", hidden_size=64, intermediate_size=96, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=VOCAB, **run)


def build(family: str, sp: bool, recompute: str | None, parallel):
    """The family's pretraining model, initialised from seed 0 (the same master weights at every tp)."""
    from zoo.models.families import build_model

    torch.manual_seed(0)
    model = build_model(family_config(family, sp, recompute), parallel)
    with torch.no_grad():   # norms start at 1 and 0: randomise them so their gradients are tested
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) * 0.1)
    return model.train()


def batch(family: str) -> dict:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 4:] = 0
    if family == "bert":
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
                "labels": ids.masked_fill(torch.rand(ids.shape, generator=gen) > 0.3, -100),
                "next_sentence_label": torch.tensor([0, 1])}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss_and_grads(model, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def relative_errors(eager: tuple, compiled: tuple) -> dict[str, float]:
    """max|compiled - eager| / max|eager| of the loss and of each gradient (a missing gradient is inf)."""
    (loss_e, grads_e), (loss_c, grads_c) = eager, compiled
    errors = {"loss": ((loss_c - loss_e).abs() / loss_e.abs()).item()}
    for name, grad in grads_e.items():
        other = grads_c.get(name)
        scale = grad.abs().max().clamp(min=1e-30)
        errors[name] = float("inf") if other is None else ((other - grad).abs().max() / scale).item()
    return errors


def traced(run):
    """Run ``run()`` with fresh Dynamo state; (its result, graphs traced, what Dynamo did not trace: graph breaks,
    unsupported code, frames that fell back to eager)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    result = run()
    untraced = [reason.splitlines()[0] + ": " + reason for kind in ("graph_break", "unimplemented")
                for reason in counters[kind]]
    frames = counters["frames"]
    if frames["ok"] != frames["total"]:
        untraced.append(f"{frames['total'] - frames['ok']} of {frames['total']} frames fell back to eager")
    return result, counters["stats"]["unique_graphs"], sorted(untraced)


def compiled_against_eager(family: str, sp: bool, recompute: str | None, backend: str, parallel,
                           check_keys: bool = False) -> dict:
    from zoo.models.compiled import compile_transformer_blocks

    model, inputs = build(family, sp, recompute, parallel), batch(family)
    eager = loss_and_grads(model, inputs)
    names = (list(model.state_dict()), [name for name, _ in model.named_parameters()])
    blocks = compile_transformer_blocks(model, backend=backend)
    compiled, graphs, breaks = traced(lambda: loss_and_grads(model, inputs))
    result = {"errors": relative_errors(eager, compiled), "graphs": graphs, "breaks": breaks, "blocks": blocks}
    if check_keys:
        result["keys"] = checkpoint_keys(model, names, family, parallel)
    return result


def checkpoint_keys(model, before: tuple, family: str, parallel) -> dict:
    """The state_dict keys and parameter names of a compiled model that has run (``before``: the eager model's),
    and whether its saved state_dict loads strictly into an eager model, and that one's back, unchanged."""
    after = (list(model.state_dict()), [name for name, _ in model.named_parameters()])
    eager_model = build(family, False, None, parallel)
    with torch.no_grad():
        for param in eager_model.parameters():
            param.zero_()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    eager_model.load_state_dict(torch.load(buffer), strict=True)
    model.load_state_dict(eager_model.state_dict(), strict=True)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), eager_model.state_dict().values()))
    return {"before": before, "after": after, "round_trip_equal": same}


def pipe_block_against_eager(family: str, sp: bool, parallel) -> dict:
    """One pipeline-stage block (index 2 of GPT-2's layer sequence, 1 of Llama's) on random hidden states."""
    from zoo.models.compiled import compile_transformer_blocks
    from zoo.models.gpt2.pipeline import GPT2BlockPipe
    from zoo.models.llama.pipeline import LlamaDecoderPipe

    config = family_config(family, sp, None)
    cls, index = (GPT2BlockPipe, 2) if family == "gpt2" else (LlamaDecoderPipe, 1)
    torch.manual_seed(0)
    block = cls(config, parallel, index).train()
    local_seq = SEQ // parallel.tp_size if sp else SEQ
    x = torch.randn(BATCH, local_seq, 64, generator=torch.Generator().manual_seed(3 + parallel.tp_rank * sp))

    def run():
        inputs = x.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        out = block(inputs)
        loss = (out * out).sum()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in block.named_parameters()}
        return loss.detach(), {"input": inputs.grad, **grads}

    eager = run()
    blocks = compile_transformer_blocks(block, backend="eager")
    compiled, graphs, breaks = traced(run)
    return {"errors": relative_errors(eager, compiled), "graphs": graphs, "breaks": breaks, "blocks": blocks}


def _worker(rank, world_size):
    import torch._inductor.config as inductor_config

    from zoo.parallel import ParallelState

    tp = world_size
    inductor_config.compile_threads = 2 if tp == 1 else 1   # a pool of compile workers only where a core is free
    parallel = ParallelState.initialize(tp)
    results = {case: compiled_against_eager(*case, backend_of(tp, *case), parallel, check_keys=tp == 1)
               for case in CASES[tp]}
    if tp == 2:
        results.update({("pipe", family, True): pipe_block_against_eager(family, True, parallel)
                        for family in ("gpt2", "llama")})
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def tp_results(request):
    tp = request.param
    return tp, spawn(_worker, tp, timeout=600)


def test_compiled_blocks_equal_eager(tp_results):
    tp, per_rank = tp_results
    for rank, results in enumerate(per_rank):
        for case, result in results.items():
            where = f"tp {tp} rank {rank} {case}"
            bad = {name: err for name, err in result["errors"].items() if not err <= REL_TOL}
            assert not bad, f"{where}: compiled differs from eager by more than {REL_TOL}: {bad}"
            assert result["blocks"] == (1 if case[0] == "pipe" else 2), f"{where}: {result['blocks']} blocks compiled"
            assert result["graphs"] >= 1, f"{where}: nothing was compiled"
            allowed = "recomputed" if case[-1] == "selective" else None
            unexpected = [r for r in result["breaks"] if allowed is None or allowed not in r]
            assert not unexpected, f"{where}: graph breaks {unexpected}"
            if allowed:
                assert result["breaks"], f"{where}: selective recomputation ran inside the compiled graph"


@pytest.mark.parametrize("tp_results", [1], indirect=True, ids=["tp1"])
def test_compiling_keeps_checkpoint_keys(tp_results):
    _, per_rank = tp_results
    for case, result in per_rank[0].items():
        keys = result["keys"]
        assert keys["after"] == keys["before"], f"{case}: compiling changed the state_dict keys or parameter names"
        assert not any("_orig_mod" in key for key in keys["after"][0])
        assert keys["round_trip_equal"], f"{case}: a compiled model's state_dict did not load back unchanged"


# ------------------------------------------------------------------------------------------------- the setting
def load(*flags: str, block: dict | None = None, tmp_path: Path | None = None):
    from zoo.cli.pretrain import build_parser
    from zoo.config.loading import load_run_config

    path = DEMO
    if block is not None:
        content = json.loads(DEMO.read_text())
        content["zoo"].update(block)
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(content))
    return load_run_config(build_parser().parse_args(["--deepspeed_config", str(path), *flags]))


def test_compile_setting(tmp_path):
    from zoo.training.effective_settings import describe_precision, effective_settings

    assert load().compile is False                                    # off by default
    assert load("--compile").compile is True
    assert load(block={"compile": True}, tmp_path=tmp_path).compile is True
    assert load("--no-compile", block={"compile": True}, tmp_path=tmp_path).compile is False   # the flag wins
    with pytest.raises(ValueError) as err:
        load(block={"compile": "yes"}, tmp_path=tmp_path)
    message = str(err.value)
    assert "'compile'" in message and '"yes"' in message and "true or false" in message
    assert ". " not in message.replace("e.g. ", "") and message.endswith(".")        # one sentence
    precision = effective_settings(load("--compile"), 2, 2)["precision"]
    assert precision["compiled_blocks"] is True
    assert "transformer blocks compiled" in describe_precision(precision)
    assert "compiled" not in describe_precision(effective_settings(load(), 2, 2)["precision"])
